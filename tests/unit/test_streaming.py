"""Streaming-window settings and the window rule (`vllm_omni_speechlm/streaming.py`)."""

import pytest

from vllm_omni_speechlm.streaming import (
    INITIAL_CHUNK_KEY,
    MAX_INITIAL_CHUNK_FRAMES,
    WINDOW_DEFAULTS,
    first_window,
    initial_chunk_frames,
    next_window_end,
)


def _windows(total: int, first: int, settings: dict) -> list[int]:
    """New frames per window while `total` frames complete one at a time, then the final flush."""
    sizes, emitted = [], 0
    for frames in range(1, total + 1):
        end = next_window_end(frames, emitted, first, settings, is_finished=frames == total)
        if end is not None:
            sizes.append(end - emitted)
            emitted = end
    return sizes


def test_windows_ramp_up_from_a_small_first_one_and_flush_at_the_end():
    settings = WINDOW_DEFAULTS | {"initial_codec_chunk_frames": 4}
    sizes = _windows(120, 4, settings)
    assert sizes[:6] == [4, 4, 8, 16, 25, 25] and sum(sizes) == 120
    assert _windows(70, 25, WINDOW_DEFAULTS) == [25, 25, 20]  # 10 frames held back until the flush


def test_the_first_window_is_the_requests_then_the_deployments_then_a_chunk():
    settings = WINDOW_DEFAULTS | {"initial_codec_chunk_frames": 5}
    assert first_window({INITIAL_CHUNK_KEY: 3}, settings) == 3
    assert first_window({INITIAL_CHUNK_KEY: [3]}, settings) == 3  # scalars may arrive wrapped
    assert first_window({}, settings) == 5
    assert first_window({}, WINDOW_DEFAULTS) == WINDOW_DEFAULTS["codec_chunk_frames"]


@pytest.mark.parametrize("value", [0, -1, MAX_INITIAL_CHUNK_FRAMES + 1, 2.5, True, "3"])
def test_a_bad_first_window_names_the_field(value):
    with pytest.raises(ValueError, match=r"^initial_codec_chunk_frames: must be an integer in \[1, 100\]"):
        initial_chunk_frames(value, "initial_codec_chunk_frames")
    with pytest.raises(ValueError, match=rf"^additional_information\.{INITIAL_CHUNK_KEY}: "):
        first_window({INITIAL_CHUNK_KEY: value}, WINDOW_DEFAULTS)
