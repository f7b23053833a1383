"""Streaming windows: which frames stage 0 sends the codec stage, and when.

A window is frames [emitted - left, target + holdback): `left` frames of context the codec has
already turned into audio, the new frames [emitted, target), and `holdback` frames of lookahead.
Stage 1 keeps exactly the new frames' audio. With left >= the codec's left reach and holdback >=
its lookahead, the kept samples equal whole-clip decoding (stage_input_processors/speech_codec.py).

Settings (the deploy YAML's connector `extra`; checked at engine start-up by deploy_checks.py):
    codec_chunk_frames            int >= 1
    codec_left_context_frames     int, >= the codec's left reach (10 for X-Codec)
    codec_right_holdback_frames   int, >= the codec's lookahead (10 for X-Codec), <= chunk
    initial_codec_chunk_frames    int, 0 (a full chunk) or 1..chunk
Any other `codec_*` key is a typo and is rejected. A request may set its own first window
(`INITIAL_CHUNK_KEY` in its prompt's additional information, at most MAX_INITIAL_CHUNK_FRAMES).
"""

from __future__ import annotations

from typing import Any

WINDOW_DEFAULTS = {
    "codec_chunk_frames": 25,
    "codec_left_context_frames": 25,
    "codec_right_holdback_frames": 10,
    "initial_codec_chunk_frames": 0,  # 0: the first window is a full chunk
}
# Per-request first window, in codec frames, in the prompt's additional_information.
INITIAL_CHUNK_KEY = "initial_codec_chunk_frames"
MAX_INITIAL_CHUNK_FRAMES = 100  # 2 s at 50 frames/s


def window_settings(extra: dict[str, Any] | None, reach: tuple[int, int] | None = None) -> dict[str, int]:
    """WINDOW_DEFAULTS overridden by a connector `extra` dict, validated. `reach` (the codec's
    (left, right) frames) adds the exactness bounds; without it only types and ranges are checked."""
    extra = extra or {}
    unknown = sorted(k for k in extra if "codec" in k and k not in WINDOW_DEFAULTS)
    if unknown:
        raise ValueError(f"connector extra: unknown key {unknown[0]!r} (known: {sorted(WINDOW_DEFAULTS)})")
    out = {}
    for key, default in WINDOW_DEFAULTS.items():
        value = extra.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"connector extra: {key} must be a non-negative int, got {value!r}")
        out[key] = value
    chunk, holdback = out["codec_chunk_frames"], out["codec_right_holdback_frames"]
    if chunk < 1:
        raise ValueError(f"connector extra: codec_chunk_frames must be >= 1, got {chunk}")
    if holdback > chunk:
        raise ValueError(f"connector extra: codec_right_holdback_frames ({holdback}) must be <= codec_chunk_frames ({chunk})")
    if out["initial_codec_chunk_frames"] > chunk:
        raise ValueError(
            f"connector extra: initial_codec_chunk_frames ({out['initial_codec_chunk_frames']}) must be <= "
            f"codec_chunk_frames ({chunk}) (0 = a full chunk)"
        )
    if reach is not None:
        _check_reach(out, reach)
    return out


def _check_reach(settings: dict[str, int], reach: tuple[int, int]) -> None:
    left, right = reach
    if settings["codec_left_context_frames"] < left:
        raise ValueError(
            f"connector extra: codec_left_context_frames must be >= {left} (the codec reads {left} frames "
            f"back; fewer changes the audio at window starts), got {settings['codec_left_context_frames']}"
        )
    if settings["codec_right_holdback_frames"] < right:
        raise ValueError(
            f"connector extra: codec_right_holdback_frames must be >= {right} (the codec's lookahead; "
            f"fewer changes the audio at window ends), got {settings['codec_right_holdback_frames']}"
        )


def max_window_ids(settings: dict[str, int], num_quantizers: int) -> int:
    """Ids of the longest window the processor sends: left context + chunk + holdback frames
    (the final flush is shorter: it is sent before chunk + holdback new frames accumulate)."""
    frames = settings["codec_left_context_frames"] + settings["codec_chunk_frames"] + settings["codec_right_holdback_frames"]
    return frames * num_quantizers


def initial_chunk_frames(value: Any, field: str) -> int | None:
    """A request's own first window (None: the deployment's)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INITIAL_CHUNK_FRAMES:
        raise ValueError(f"{field}: must be an integer in [1, {MAX_INITIAL_CHUNK_FRAMES}], got {value!r}")
    return value


def first_window(info: dict[str, Any], settings: dict[str, int]) -> int:
    """A request's first window: its own (`INITIAL_CHUNK_KEY` of its additional information),
    else the deployment's, else a full chunk."""
    value = info.get(INITIAL_CHUNK_KEY)
    if isinstance(value, list) and len(value) == 1:  # scalars may arrive wrapped
        value = value[0]
    own = initial_chunk_frames(value, f"additional_information.{INITIAL_CHUNK_KEY}")
    return own or settings["initial_codec_chunk_frames"] or settings["codec_chunk_frames"]


def next_window_end(total: int, emitted: int, first_chunk: int, settings: dict[str, int], is_finished: bool) -> int | None:
    """With `total` complete frames and `emitted` already sent: the end of the window to send
    now (its new frames are [emitted, end)), or None (not enough new frames yet).

    After a small first window the windows ramp up: each brings as many new frames as all
    earlier ones together, up to codec_chunk_frames (first 4: 4, 4, 8, 16, 25, 25, ...). The
    client's buffered audio then doubles per window, so a fast first window does not leave a gap
    before the second one while generation runs faster than real time."""
    end = total - (0 if is_finished else settings["codec_right_holdback_frames"])
    chunk = first_chunk if emitted == 0 else min(settings["codec_chunk_frames"], max(first_chunk, emitted))
    if end - emitted <= 0 or (not is_finished and end - emitted < chunk):
        return None
    return end
