"""Streaming windows: which frames stage 0 sends the codec stage, and when.

A window is frames [emitted - left, target + holdback): `left` frames of context the codec has
already turned into audio, the new frames [emitted, target), and `holdback` frames of lookahead.
Stage 1 keeps exactly the new frames' audio. With left >= the codec's left reach and holdback >=
its lookahead, the kept samples equal whole-clip decoding (stage_input_processors/speech_codec.py).

Settings (the deploy YAML's connector `extra`; checked at engine start-up by deploy_checks.py):
    codec_chunk_frames                int >= 1
    codec_left_context_frames         int, >= the codec's left reach (10 for X-Codec)
    codec_right_holdback_frames       int, >= the codec's lookahead (10 for X-Codec), <= chunk
    initial_codec_chunk_frames        int, 0 (a full chunk) or 1..chunk
    codec_min_right_holdback_frames   int, 0..holdback (unset: the holdback): the least lookahead a
                                      segment's first window (and, paced, the ones while the
                                      listener's buffer is short) is decoded with
    codec_playout_margin_steps        int >= 0: 0, the fixed ramp (`next_window`); N, paced
                                      windows (`PlayoutPacer`) that keep N stage-0 steps of audio
                                      ahead of the listener
    codec_paced_max_step_ms           int >= 0, paced windows only: a segment is paced when its
                                      first window leaves while a stage-0 step takes at most this
                                      long (a GPU with slack), else it takes the fixed ramp with
                                      the full lookahead; 0: paced while faster than real time
    codec_paced_max_streams           int >= 0, paced windows only: a segment is paced when its
                                      first window leaves while at most this many answers stream
                                      to the codec stage (its own included); 0: no bound
    codec_ramp_min_speed_percent      0 or 101..199: 0, the fixed ramp doubles the audio sent with
                                      each window, which keeps a listener playing only while stage 0
                                      makes frames at least twice as fast as real time; N, while it
                                      makes them between N% and 200% of real time (the measured
                                      step), each window brings at most (speed - 1) x the frames
                                      sent so far (at least the first window's), as much as the
                                      listener's lead allows (docs/architecture.md)
    codec_ramp_min_right_holdback_frames  int, 0..holdback (unset: the holdback), with
                                      codec_ramp_min_speed_percent: while the measured speed is at
                                      least that percentage, a ramped segment's first window leaves
                                      when the exact ramp's would, with this much lookahead, and
                                      the frames that frees (holdback - this) as audio: a lead for
                                      the hand-off's jitter; later windows' lookahead grows back to
                                      the holdback within the listener's lead
                                      (`growing_lookahead_window`); those windows' last frames are
                                      not exact
    codec_batch_steps                 int, 0..chunk: a window of a full chunk leaves on every N-th
                                      stage-0 step only (first, ramp and last windows when due), so
                                      the codec stage decodes the answers' windows in N times fewer,
                                      larger forwards when answers start at different times (0, 1:
                                      every step)
    codec_windows_on_scheduler_thread  0 or 1: 1, stage 0's scheduler thread cuts and writes each
                                      window as it hands it over; 0, vllm-omni's save thread does,
                                      which shares the interpreter lock with the scheduler's thread
                                      and fell behind from ~96 listeners on one H200
Any other `codec_*` key is a typo and is rejected. A request may set its own first window
(`INITIAL_CHUNK_KEY` in its prompt's additional information, at most MAX_INITIAL_CHUNK_FRAMES).
"""

from __future__ import annotations

import math
from typing import Any

WINDOW_DEFAULTS = {
    "codec_chunk_frames": 25,
    "codec_left_context_frames": 25,
    "codec_right_holdback_frames": 10,
    "initial_codec_chunk_frames": 0,  # 0: the first window is a full chunk
    "codec_min_right_holdback_frames": None,  # None: codec_right_holdback_frames (every window exact)
    "codec_playout_margin_steps": 0,  # 0: the fixed ramp
    "codec_paced_max_step_ms": 0,  # 0: paced while faster than real time
    "codec_paced_max_streams": 0,  # 0: paced however many answers stream
    "codec_batch_steps": 0,  # 0: a full window leaves on the step it is due
    "codec_ramp_min_speed_percent": 0,  # 0: the ramp doubles whatever the pace
    "codec_ramp_min_right_holdback_frames": None,  # None: codec_right_holdback_frames (the ramp exact)
    "codec_windows_on_scheduler_thread": 0,  # 0: vllm-omni's save thread cuts and writes the windows
}
MIN_HOLDBACK_KEY = "codec_min_right_holdback_frames"
RAMP_SPEED_KEY = "codec_ramp_min_speed_percent"
RAMP_MIN_HOLDBACK_KEY = "codec_ramp_min_right_holdback_frames"
SCHEDULER_THREAD_KEY = "codec_windows_on_scheduler_thread"
DOUBLING = 2.0  # the fixed ramp's speed: each window brings as many new frames as were sent
# The window gate's decision in the payload it hands over: (end, holdback) in segment frames.
WINDOW_KEY = "window"
# Per-request first window, in codec frames, in the prompt's additional_information.
INITIAL_CHUNK_KEY = "initial_codec_chunk_frames"
# False in the prompt's additional_information: no codec stage takes this request (a text answer
# asked for output modalities ["text"]), so stage 0 sends it no window, not even its end: nobody
# would read (and unlink) them.
TO_CODEC_KEY = "to_codec_stage"
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
        if value is None and key in (MIN_HOLDBACK_KEY, RAMP_MIN_HOLDBACK_KEY):
            value = out["codec_right_holdback_frames"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"connector extra: {key} must be a non-negative int, got {value!r}")
        out[key] = value
    chunk, holdback = out["codec_chunk_frames"], out["codec_right_holdback_frames"]
    if chunk < 1:
        raise ValueError(f"connector extra: codec_chunk_frames must be >= 1, got {chunk}")
    if holdback > chunk:
        raise ValueError(f"connector extra: codec_right_holdback_frames ({holdback}) must be <= codec_chunk_frames ({chunk})")
    for key in (MIN_HOLDBACK_KEY, RAMP_MIN_HOLDBACK_KEY):
        if out[key] > holdback:
            raise ValueError(f"connector extra: {key} ({out[key]}) must be <= codec_right_holdback_frames ({holdback})")
    if out[RAMP_MIN_HOLDBACK_KEY] < holdback and not out[RAMP_SPEED_KEY]:
        raise ValueError(f"connector extra: {RAMP_MIN_HOLDBACK_KEY} grows within the measured speed; "
                         f"set {RAMP_SPEED_KEY} too")
    if out["initial_codec_chunk_frames"] > chunk:
        raise ValueError(
            f"connector extra: initial_codec_chunk_frames ({out['initial_codec_chunk_frames']}) must be <= "
            f"codec_chunk_frames ({chunk}) (0 = a full chunk)"
        )
    if out["codec_batch_steps"] > chunk:  # a window a chunk per more steps than a chunk's frames falls behind
        raise ValueError(f"connector extra: codec_batch_steps ({out['codec_batch_steps']}) must be <= "
                         f"codec_chunk_frames ({chunk})")
    if out[SCHEDULER_THREAD_KEY] > 1:
        raise ValueError(f"connector extra: {SCHEDULER_THREAD_KEY} must be 0 or 1, got {out[SCHEDULER_THREAD_KEY]}")
    if out[RAMP_SPEED_KEY] and not 100 < out[RAMP_SPEED_KEY] < 200:
        raise ValueError(f"connector extra: {RAMP_SPEED_KEY} must be 0 or in 101..199, got {out[RAMP_SPEED_KEY]}")
    for key in ("codec_paced_max_step_ms", "codec_paced_max_streams"):
        if out[key] and not out["codec_playout_margin_steps"]:
            raise ValueError(f"connector extra: {key} applies to paced windows; set codec_playout_margin_steps too")
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


def ramp_first_chunk(first: int, settings: dict[str, int]) -> int:
    """New frames of a ramped segment's first window with the short lookahead
    (`codec_ramp_min_right_holdback_frames`): it leaves when an exact first window of `first`
    frames would, so the lookahead it does not hold back is audio."""
    return first + settings["codec_right_holdback_frames"] - settings[RAMP_MIN_HOLDBACK_KEY]


def short_first_window_frames(settings: dict[str, int]) -> int | None:
    """Frames of a ramped segment's first window with the short lookahead at the deployment's
    first window (its new frames and that lookahead); None: the ramp is exact. With no left
    context and less than the full lookahead the codec stage decodes it at its own length, so it
    warms that length."""
    short = settings[RAMP_MIN_HOLDBACK_KEY]
    if short >= settings["codec_right_holdback_frames"]:
        return None
    return ramp_first_chunk(first_window({}, settings), settings) + short


def initial_chunk_frames(value: Any, field: str) -> int | None:
    """A request's own first window (None: the deployment's)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_INITIAL_CHUNK_FRAMES:
        raise ValueError(f"{field}: must be an integer in [1, {MAX_INITIAL_CHUNK_FRAMES}], got {value!r}")
    return value


def requested_first_window(info: dict[str, Any]) -> int | None:
    """A request's own first window (`INITIAL_CHUNK_KEY` of its additional information), or None."""
    value = info.get(INITIAL_CHUNK_KEY)
    if isinstance(value, list) and len(value) == 1:  # scalars may arrive wrapped
        value = value[0]
    return initial_chunk_frames(value, f"additional_information.{INITIAL_CHUNK_KEY}")


def first_window(info: dict[str, Any], settings: dict[str, int]) -> int:
    """A request's first window under the fixed ramp: its own, else the deployment's, else a full chunk."""
    return requested_first_window(info) or settings["initial_codec_chunk_frames"] or settings["codec_chunk_frames"]


def next_window(total: int, emitted: int, first_chunk: int, settings: dict[str, int], is_finished: bool,
                speed: float = DOUBLING) -> tuple[int, int] | None:
    """The fixed ramp. With `total` complete frames and `emitted` already sent: (end, holdback) of
    the window to send now (its new frames are [emitted, end)), or None (not enough new frames yet).

    A segment's first window holds back `codec_min_right_holdback_frames`, the others the full
    lookahead. After a small first window the windows ramp up: each brings (speed - 1) x the
    frames sent so far, at least the first window's, up to codec_chunk_frames (first 4, speed 2:
    4, 4, 8, 16, 25, 25, ...). If stage 0 makes `speed` frames per frame of real time, a listener
    who starts at the first window still has audio when each window arrives, with the first
    window's frames of generation to spare for the hand-off's jitter. A window takes every frame
    ready, up to codec_chunk_frames (more than its share when it was held, `codec_batch_steps`)."""
    if is_finished:
        holdback = 0
    else:
        holdback = settings[MIN_HOLDBACK_KEY] if emitted == 0 else settings["codec_right_holdback_frames"]
    grown = max(first_chunk, int((speed - 1) * emitted))
    chunk = first_chunk if emitted == 0 else min(settings["codec_chunk_frames"], grown)
    end = total - holdback if is_finished else min(total - holdback, emitted + max(chunk, settings["codec_chunk_frames"]))
    if end - emitted <= 0 or (not is_finished and end - emitted < chunk):
        return None
    return end, holdback


def growing_lookahead_window(total: int, emitted: int, holdback: int, lead_steps: float, first_chunk: int,
                             settings: dict[str, int], speed: float) -> tuple[int, int] | None:
    """A segment's windows after a first one with less than the full lookahead
    (`codec_ramp_min_right_holdback_frames`): (end, holdback) of the window to send now, or None.

    `lead_steps`: the audio sent beyond what a listener who started at the first window has
    played, by stage 0's clock, in steps at the measured pace; stage 0 makes `speed` frames per
    frame of real time. A window leaves at the last step that keeps `first_chunk` (the first
    window's frames) steps in hand, as the fixed ramp keeps the first window's frames of generation
    for the hand-off's jitter, or earlier with a full chunk ready. The lead is timed, not counted in
    frames at the pace measured now: steps vary (one where a prompt joins takes about twice a plain
    one), and a deadline in frames moves with the last few. While the lookahead is short a window
    brings half the new frames the speed ramp would (at least the first window's, fewer if fewer
    are made), and the frames made beyond them extend its lookahead (never below the window
    before's): the lead's growth is split between new audio and lookahead, which is back to the
    holdback after a few windows (a first window of 10 frames with 2 of lookahead at 12.5 ms a
    step: the fifth is exact). Then each window brings what is ready. Slower than real time: the
    doubling ramp with the full lookahead."""
    full, chunk = settings["codec_right_holdback_frames"], settings["codec_chunk_frames"]
    if speed <= 1:  # no window keeps a listener playing: the doubling ramp, exact (fewer, larger windows)
        return next_window(total, emitted, first_chunk, settings, False)
    if total - full - emitted >= chunk:
        return emitted + chunk, full
    if lead_steps - 1 >= first_chunk:
        return None  # one more step still keeps the margin
    if holdback >= full:  # at least the first window's frames: near real time, windows would shrink
        return (total - full, full) if total - full - emitted >= first_chunk else None
    end = min(emitted + min(chunk, max(first_chunk, int((speed - 1) * emitted / 2))), total - holdback)
    return (end, min(full, total - end)) if end > emitted else None


# A gap this long between stage-0 steps is idleness, not the pace.
IDLE_STEP_S = 1.0
PACE_SMOOTHING = 0.3


class PlayoutPacer:
    """Paced windows (`codec_playout_margin_steps` > 0): each window leaves stage 0 as late as
    keeps the listener `margin` ahead, unless a full chunk is ready first.

    A listener starts playing at the first window, plays in real time and pauses when it runs dry;
    stage 0 knows what it sent and when, so it knows the listener's lead (the constant hand-off
    delay cancels out). The margin is `codec_playout_margin_steps` stage-0 steps, measured
    (`tick`): what covers stage 1's decode and the hand-off grows with the load as the step does.
    While waiting one more step keeps the margin, a window waits (fewer, larger
    windows); otherwise it goes now, with enough new frames to restore twice the margin, decoded
    with as much lookahead as the frames at hand allow (never less than the window before, never
    more than the holdback). The first window is at least the frames that cover one step plus the
    margin. Under light load this sends a few small windows and then full chunks; under heavy load
    (pace near real time) smaller windows for longer. Slower than real time every listener stalls
    whatever the windows, and small ones would only add decode work (each re-decodes its context):
    the windows then ramp up as the fixed ramp's do. Where the codec stage shares the GPU, those
    small windows slow stage 0 well before that: `codec_paced_max_step_ms` paces only the segments
    that start while the step is short (`paces`), and leaves the others to the fixed ramp. The
    step it measures also sets that ramp's speed (`ramp_speed`, `codec_ramp_min_speed_percent`)."""

    def __init__(self, settings: dict[str, int], frame_ms: float) -> None:
        self.settings, self.frame_ms = settings, frame_ms
        self.pace_ms = 0.0  # stage-0 step interval, smoothed (0: not measured yet)
        self._last_tick: float | None = None

    def tick(self, now: float) -> None:
        """Once per stage-0 step (monotonic seconds)."""
        if self._last_tick is not None and now - self._last_tick < IDLE_STEP_S:
            step_ms = (now - self._last_tick) * 1e3
            self.pace_ms = step_ms if not self.pace_ms else self.pace_ms + PACE_SMOOTHING * (step_ms - self.pace_ms)
        self._last_tick = now

    @property
    def _pace(self) -> float:
        return self.pace_ms or self.frame_ms  # unmeasured: assume real time

    @property
    def paces(self) -> bool:
        """Whether a segment starting now is paced: the step is measured, faster than real time
        and within `codec_paced_max_step_ms` (0: no bound)."""
        if not self.settings["codec_playout_margin_steps"]:
            return False
        bound = self.settings["codec_paced_max_step_ms"] or self.frame_ms
        return 0 < self.pace_ms < self.frame_ms and self.pace_ms <= bound

    @property
    def ramp_speed(self) -> float:
        """The fixed ramp's speed now (`next_window`): the measured frames per frame of real time
        while within [`codec_ramp_min_speed_percent`, 200%), else doubling (unmeasured, off, fast
        enough, or so slow that smaller windows would only add decode work)."""
        floor = self.settings[RAMP_SPEED_KEY] / 100
        speed = self.speed or DOUBLING
        return speed if floor and floor <= speed < DOUBLING else DOUBLING

    @property
    def speed(self) -> float | None:
        """Frames stage 0 makes per frame of real time, measured (None: not yet)."""
        return self.frame_ms / self.pace_ms if self.pace_ms else None

    @property
    def _margin_ms(self) -> float:
        return self.settings["codec_playout_margin_steps"] * self._pace

    def first_chunk(self, deployment: int) -> int:
        """A segment's first window when the request did not set its own: at least `deployment`
        frames and enough to cover one step plus the margin (not paced now: `deployment`)."""
        if not self.paces:
            return deployment
        covering = math.ceil((self._pace + self._margin_ms) / self.frame_ms)
        return min(self.settings["codec_chunk_frames"], max(deployment, covering))

    def window(self, total: int, emitted: int, holdback_before: int, lead_ms: float) -> tuple[int, int] | None:
        """(end, holdback) of the window due now after the first one, or None."""
        if self._pace >= self.frame_ms:
            return next_window(total, emitted, emitted, self.settings, False)
        full = self.settings["codec_right_holdback_frames"]
        if total - full - emitted >= self.settings["codec_chunk_frames"]:
            return total - full, full
        if lead_ms - self._pace >= self._margin_ms:
            return None
        need = max(1, math.ceil((2 * self._margin_ms + self._pace - lead_ms) / self.frame_ms))
        holdback = max(holdback_before, min(full, total - emitted - need))
        return (total - holdback, holdback) if total - holdback > emitted else None
