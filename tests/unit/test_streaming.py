"""Streaming-window settings and the window rule (`vllm_omni_speechlm/streaming.py`)."""

import math

import pytest

from vllm_omni_speechlm.streaming import (
    INITIAL_CHUNK_KEY,
    MAX_INITIAL_CHUNK_FRAMES,
    WINDOW_DEFAULTS,
    PlayoutPacer,
    first_window,
    growing_lookahead_window,
    initial_chunk_frames,
    next_window,
    window_settings,
)

FRAME_MS = 20.0  # X-Codec at 50 frames/s


def _windows(total: int, first: int, settings: dict) -> list[int]:
    """New frames per window while `total` frames complete one at a time, then the final flush."""
    sizes, emitted = [], 0
    for frames in range(1, total + 1):
        window = next_window(frames, emitted, first, settings, is_finished=frames == total)
        if window is not None:
            sizes.append(window[0] - emitted)
            emitted = window[0]
    return sizes


def test_windows_ramp_up_from_a_small_first_one_and_flush_at_the_end():
    sizes = _windows(120, 4, window_settings({"initial_codec_chunk_frames": 4}))
    assert sizes[:6] == [4, 4, 8, 16, 25, 25] and sum(sizes) == 120
    assert _windows(70, 25, window_settings(None)) == [25, 25, 20]  # 10 frames held back until the flush


def test_the_first_window_holds_back_the_minimum_the_others_the_full_lookahead():
    settings = window_settings({"initial_codec_chunk_frames": 2, "codec_min_right_holdback_frames": 3})
    assert next_window(4, 0, 2, settings, False) is None
    assert next_window(5, 0, 2, settings, False) == (2, 3)
    assert next_window(13, 2, 2, settings, False) is None
    assert next_window(14, 2, 2, settings, False) == (4, 10)
    assert window_settings(None)["codec_min_right_holdback_frames"] == 10  # unset: every window exact


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


def _paced(pace_ms: float, jitter_ms: float, frames: int = 300, margin_steps: int = 4, min_holdback: int = 2):
    """Stage 0 making one frame per step of `pace_ms` (the delay pattern's first 7 steps make
    none) and the pacer choosing the windows; each window after the first reaches the listener
    `jitter_ms` later than the first did. Returns the windows (step, start, end, holdback) and the
    listener's stall in ms (playback from the first window's arrival, in real time)."""
    settings = window_settings({"initial_codec_chunk_frames": 2, "codec_min_right_holdback_frames": min_holdback,
                                "codec_playout_margin_steps": margin_steps})
    pacer, windows, emitted, plays_until = PlayoutPacer(settings, FRAME_MS), [], 0, 0.0
    for step in range(frames + 7):
        now = step * pace_ms
        pacer.tick(now / 1e3)
        total = step - 7
        if emitted == 0:
            first = pacer.first_chunk(settings["initial_codec_chunk_frames"])
            window = next_window(total, 0, first, settings, False)
        else:
            window = pacer.window(total, emitted, windows[-1][3], plays_until - now)
        if window is not None:
            windows.append((step, emitted, *window))
            plays_until = max(plays_until, now) + (window[0] - emitted) * FRAME_MS
            emitted = window[0]
    stall, plays_until = 0.0, windows[0][0] * pace_ms
    for i, (step, start, end, _) in enumerate(windows):
        arrives = step * pace_ms + (jitter_ms if i else 0.0)
        stall += max(0.0, arrives - plays_until)
        plays_until = max(plays_until, arrives) + (end - start) * FRAME_MS
    return windows, stall


@pytest.mark.parametrize("pace_ms", [7.0, 10.0, 15.0, 18.0])
def test_paced_windows_keep_a_listener_playing_through_a_margin_of_delay(pace_ms):
    """Faster than real time, with every later window arriving a whole margin late, the listener
    never runs dry; the windows tile the frames, the lookahead only grows, and once the lead is
    built they are full chunks with the full lookahead."""
    windows, stall = _paced(pace_ms, jitter_ms=4 * pace_ms, frames=1000)
    assert stall == 0.0
    assert [w[1] for w in windows[1:]] == [w[2] for w in windows[:-1]]  # contiguous, no frame twice
    holdbacks = [w[3] for w in windows]
    assert holdbacks == sorted(holdbacks) and holdbacks[0] == 2 and holdbacks[-1] == 10
    assert [w[2] - w[1] for w in windows[-3:]] == [25, 25, 25]
    print(f"pace {pace_ms} ms: first audio after {windows[0][0]} steps, {len(windows)} windows, "
          f"{sum(h < 10 for h in holdbacks)} with less lookahead")


def test_paced_windows_stall_when_the_delay_outgrows_the_margin():
    """The margin is what protects the listener: twice as much delay as it covers, and the
    listener runs dry (so the test above can fail)."""
    assert _paced(15.0, jitter_ms=8 * 15.0)[1] > 0


def test_slower_than_real_time_the_windows_ramp_up_as_the_fixed_ones():
    """No window keeps a listener playing then; small ones would only add decode work."""
    windows, stall = _paced(25.0, jitter_ms=0.0)
    assert stall > 0
    assert [w[2] - w[1] for w in windows[:7]] == [2, 2, 4, 8, 16, 25, 25]


def test_the_pacer_measures_the_step_and_sizes_the_first_window_by_it():
    settings = window_settings({"codec_playout_margin_steps": 4})
    pacer = PlayoutPacer(settings, FRAME_MS)
    assert pacer.first_chunk(2) == 2  # unmeasured: the fixed ramp's
    for t in (0.0, 0.010, 0.020, 5.0, 5.010):  # the 4.98 s gap is idleness, not a step
        pacer.tick(t)
    assert pacer.pace_ms == pytest.approx(10.0)
    assert pacer.first_chunk(2) == 3  # (10 + 40) / 20, rounded up
    assert pacer.first_chunk(8) == 8  # never below the deployment's


def test_a_bound_on_the_step_paces_only_while_the_step_is_short():
    settings = window_settings({"codec_playout_margin_steps": 4, "codec_paced_max_step_ms": 8})
    pacer = PlayoutPacer(settings, FRAME_MS)
    assert not pacer.paces  # unmeasured
    for t in (0.0, 0.007, 0.014):
        pacer.tick(t)
    assert pacer.paces and pacer.first_chunk(1) == 2  # (7 + 28) / 20, rounded up
    for t in (0.024, 0.034, 0.044, 0.054):
        pacer.tick(t)
    assert pacer.pace_ms > 8 and not pacer.paces
    assert pacer.first_chunk(1) == 1  # the fixed ramp's


def _ramped(pace_ms: float, jitter_ms: float, speed: float, frames: int = 300) -> tuple[list[int], float]:
    """The fixed ramp at `speed` from a first window of 2, stage 0 making one frame per step of
    `pace_ms` after the delay pattern's 7; each window after the first reaches the listener
    `jitter_ms` later than the first did. Returns the windows' sizes and the listener's stall in ms."""
    settings = window_settings({"initial_codec_chunk_frames": 2})
    windows, emitted = [], 0
    for step in range(frames + 7):
        window = next_window(step - 7, emitted, 2, settings, False, speed)
        if window is not None:
            windows.append((step * pace_ms + (jitter_ms if windows else 0.0), window[0] - emitted))
            emitted = window[0]
    stall, plays_until = 0.0, windows[0][0]
    for arrives, size in windows:
        stall += max(0.0, arrives - plays_until)
        plays_until = max(plays_until, arrives) + size * FRAME_MS
    return [size for _, size in windows], stall


@pytest.mark.parametrize("pace_ms", [10.5, 13.3, 15.5])
def test_a_ramp_at_the_measured_speed_keeps_a_listener_playing(pace_ms):
    """Slower than twice real time the doubling ramp runs a listener dry within a few windows; a
    ramp at the speed stage 0 makes frames does not. The second window is the tight one (2 x (20 -
    pace) ms to spare after a first window of 2 frames), so the hand-off's jitter here is 8 ms."""
    sizes, stall = _ramped(pace_ms, jitter_ms=8.0, speed=FRAME_MS / pace_ms)
    assert stall == 0.0 and sizes[-3:] == [25, 25, 25]
    assert _ramped(pace_ms, jitter_ms=8.0, speed=2.0)[1] > 0
    print(f"pace {pace_ms} ms: {len(sizes)} windows, {sizes[:12]}")


def test_the_pacer_gives_the_ramp_its_speed_within_the_bounds_set():
    settings = window_settings({"codec_ramp_min_speed_percent": 125})
    pacer = PlayoutPacer(settings, FRAME_MS)
    assert pacer.ramp_speed == 2.0 and not pacer.paces  # unmeasured; no margin: never paced
    for pace_ms, speed in ((5.0, 2.0), (12.5, 1.6), (17.0, 2.0)):  # fast enough; followed; too slow
        pacer.pace_ms = pace_ms
        assert pacer.ramp_speed == pytest.approx(speed)
    assert next_window(13, 2, 2, settings, False, 1.6) is None and next_window(14, 2, 2, settings, False, 1.6) == (4, 10)
    assert next_window(100, 30, 2, settings, False, 1.6) == (30 + 25, 10)  # ready: up to a chunk
    assert next_window(57, 30, 2, settings, False, 1.6) is None and next_window(58, 30, 2, settings, False, 1.6) == (48, 10)
    for bad in (100, 200, 1):
        with pytest.raises(ValueError, match="codec_ramp_min_speed_percent must be 0 or in 101..199"):
            window_settings({"codec_ramp_min_speed_percent": bad})


def _growing(step_ms, jitter_ms: float, frames: int = 300) -> tuple[list[tuple[int, int]], float, int, float]:
    """The ramp from a short first lookahead (2 frames) after a deployment's first window of 2: the
    first window leaves when the exact ramp's would, with 10 frames (the 8 of lookahead it frees),
    the later ones by the listener's lead as the gate times it, the step measured by the pacer.
    `step_ms`: a stage-0 step's length, or a function of the step's index (uneven steps). Each
    window after the first reaches the listener `jitter_ms` later than the first did. Returns the
    windows (end, holdback), the listener's stall in ms, the step the first window left at and the
    least lead (ms) a later window left with."""
    settings = window_settings({"initial_codec_chunk_frames": 2, "codec_ramp_min_speed_percent": 125,
                                "codec_ramp_min_right_holdback_frames": 2})
    first, first_settings = 2 + 8, settings | {"codec_min_right_holdback_frames": 2}
    length = step_ms if callable(step_ms) else lambda step: step_ms
    pacer, windows, arrivals, started, least, now = PlayoutPacer(settings, FRAME_MS), [], [], 0, math.inf, 0.0
    for step in range(frames + 50):
        now += length(step)
        pacer.tick(now / 1e3)
        emitted, held = windows[-1] if windows else (0, 0)
        if emitted >= frames:
            break
        total = step - 7
        lead = plays_until - now if windows else 0.0
        window = (next_window(total, 0, first, first_settings, False) if not windows else
                  growing_lookahead_window(total, emitted, held, lead / pacer.pace_ms, first, settings, pacer.speed))
        if window is not None:
            started, least = (step, least) if not windows else (started, min(least, lead))
            plays_until = max(plays_until, now) if windows else now
            plays_until += (window[0] - emitted) * FRAME_MS
            arrivals.append((now + (jitter_ms if windows else 0.0), window[0] - emitted))
            windows.append(window)
    stall, plays_until = 0.0, arrivals[0][0]
    for arrives, size in arrivals:
        stall += max(0.0, arrives - plays_until)
        plays_until = max(plays_until, arrives) + size * FRAME_MS
    return windows, stall, started, least


@pytest.mark.parametrize("pace_ms", [8.0, 10.5, 12.5, 15.5])
def test_a_ramp_from_a_short_lookahead_keeps_a_listener_playing_and_grows_it_back(pace_ms):
    """A first window with 2 frames of lookahead leaves when the exact ramp's (2 frames with 10)
    would, with 10 frames; the windows after it keep the listener playing through 8 steps of
    hand-off jitter (the exact ramp: not 3) while their lookahead grows back to the full one, never
    shrinking; after that every window is exact."""
    windows, stall, started, least = _growing(pace_ms, jitter_ms=8 * pace_ms)
    assert stall == 0.0 and started == 7 + 2 + 10 and windows[0] == (10, 2)
    assert least >= 10 * pace_ms
    assert _ramped(pace_ms, jitter_ms=3 * pace_ms, speed=FRAME_MS / pace_ms)[1] > 0
    holdbacks = [h for _, h in windows]
    assert holdbacks == sorted(holdbacks) and holdbacks[-1] == 10
    assert sum(h < 10 for h in holdbacks) <= {8.0: 2, 10.5: 3, 12.5: 4, 15.5: 10}[pace_ms]
    assert [e for e, _ in windows] == sorted(set(e for e, _ in windows)) and windows[-1][0] >= 300


def test_the_margin_is_kept_in_time_when_the_step_changes():
    """Steps of 16 ms from the first window on (a wave of prompts joining), then of 8: the windows
    leave by the listener's lead on the clock, each with its 10 steps (at the pace measured) in
    hand, and the listener plays through 60 ms of hand-off jitter. A deadline counted in frames
    at the pace measured at the time assumed the 8 ms steps all along and left a window with 12
    ms in hand."""
    def waved(step: int) -> float:
        return 16.0 if 19 <= step < 45 else 8.0

    windows, stall, started, least = _growing(waved, jitter_ms=60.0)
    assert stall == 0.0 and started == 19 and windows[0] == (10, 2) and least >= 10 * 8.0
    assert _growing(waved, jitter_ms=120.0)[1] > 0


def test_slower_than_real_time_a_short_lookahead_ramp_doubles_exactly():
    """Stage 0 slower than real time: no window keeps a listener playing, so the windows after the
    first are the doubling ramp's, with the full lookahead (fewer, larger windows)."""
    windows, *_ = _growing(25.0, jitter_ms=0.0)
    assert [h for _, h in windows[1:]] == [10] * (len(windows) - 1)
    assert [b - a for (a, _), (b, _) in zip(windows, windows[1:4])] == [10, 20, 25]


def test_a_short_ramp_lookahead_needs_the_measured_speed_and_at_most_the_holdback():
    with pytest.raises(ValueError, match="codec_ramp_min_right_holdback_frames grows within the measured speed; "
                                         "set codec_ramp_min_speed_percent too"):
        window_settings({"codec_ramp_min_right_holdback_frames": 2})
    with pytest.raises(ValueError, match=r"codec_ramp_min_right_holdback_frames \(11\) must be <= codec_right_holdback_frames \(10\)"):
        window_settings({"codec_ramp_min_right_holdback_frames": 11, "codec_ramp_min_speed_percent": 125})
    assert window_settings({})["codec_ramp_min_right_holdback_frames"] == 10  # unset: the ramp exact


def test_a_window_that_waited_takes_the_frames_ready_up_to_a_full_chunk():
    settings = window_settings({"initial_codec_chunk_frames": 2})
    assert next_window(70, 4, 2, settings, False) == (4 + 25, 10)  # 56 ready: a full chunk
    assert next_window(22, 4, 2, settings, False) == (12, 10)  # 8 ready: all of them
    assert next_window(150, 0, 100, settings, False) == (100, 10)  # a request's own larger first window
    assert next_window(70, 4, 2, settings, True) == (70, 0)  # the finish flushes everything
