"""Stage 0 hands the async_chunk adapter only the steps that complete a codec window.

vllm-omni's chunk adapter copies the request and wakes its save thread on every `save_async`
call, ~0.1 ms per request per step, though a window is due only every 25 frames. The scheduler
(stage0/scheduler.py) puts a `WindowGate` in front of it: the gate keeps each request's step rows
and hands them over as one [k, S] payload on the steps where a window is due, and at finish. The
gate decides the window (`streaming.next_window`, the fixed ramp, or `streaming.PlayoutPacer`,
which reads the clock) and hands its end and holdback over with the rows (`WINDOW_KEY`); the
processor (stage_input_processors/speech_codec.py) receives the same rows in the same order and
cuts that window. A step's running rows reach the gate at once (`offer_step`, read from the step's
frame buffer, no adapter call per row); a finishing row, or one with other outputs, comes through
the adapter's `save_async` (`offer`).

Under the parallel rules (Bagpiper) an audio segment may end before the answer does; the gate hands
over the step that ends one, so the processor flushes it then, and counts the next segment's
frames from zero. Those rows are told apart by their stream-0 token, read from the request's
output ids (host ints the scheduler already holds, no tensor work per step). Under the delay rules
the audio segment is the answer's last: it ends with the answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm_omni.engine.serialization import deserialize_additional_information

from vllm_omni_speechlm import window_trace
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.decoding import OutputMode
from vllm_omni_speechlm.delay_pattern import audio_rows, num_complete_frames
from vllm_omni_speechlm.frames import FrameRows, payload_frames
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
from vllm_omni_speechlm.streaming import (
    DOUBLING,
    MIN_HOLDBACK_KEY,
    RAMP_MIN_HOLDBACK_KEY,
    RAMP_SPEED_KEY,
    TO_CODEC_KEY,
    WINDOW_KEY,
    PlayoutPacer,
    first_window,
    growing_lookahead_window,
    next_window,
    ramp_first_chunk,
    requested_first_window,
)

logger = init_logger(__name__)


@dataclass
class _GateState:
    own_first_chunk: int | None  # the request's own first window
    wants_audio: bool  # the answer's modality enforces an audio segment
    to_codec: bool  # a codec stage takes the request (streaming.TO_CODEC_KEY)
    spoke: bool = False  # an audio row was seen (parallel rules: `audio` restarts at each segment)
    emitted: int = 0  # frames of the current audio segment sent as new audio (mirrors the processor's count)
    holdback: int = 0  # the last window's lookahead
    paced: bool = False  # the segment's windows are paced (decided at its first window)
    growing: bool = False  # ramped from a short first lookahead (`streaming.growing_lookahead_window`)
    plays_until: float = 0.0  # monotonic seconds the listener runs out of audio sent (paced, growing)
    audio: int = 0  # audio rows of the current segment among those handed over or classified
    pending: list[np.ndarray] = field(default_factory=list)  # the steps' frames not handed over yet, as they came
    unclassified: int = 0  # rows at the tail of `pending` not yet tested for audio


class WindowGate:
    """Per request, the step rows not handed to the adapter yet (module docstring)."""

    def __init__(self, cfg: SpeechLMConfig, settings: dict[str, int], clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg, self.settings, self.clock = cfg, settings, clock
        self._open: dict[str, _GateState] = {}
        self._streams = 0  # open requests a codec stage takes
        self._steps = 0  # stage-0 steps ticked (`codec_batch_steps`)
        self.handed_total = 0  # payloads handed over so far (window_trace's step lines)
        self._first = first_window({}, settings)  # the deployment's first window
        paced = settings["codec_playout_margin_steps"] > 0
        # The pacer measures the step too, for a ramp that follows it (`codec_ramp_min_speed_percent`).
        measured = paced or settings[RAMP_SPEED_KEY] > 0
        self.pacer = PlayoutPacer(settings, 1e3 / cfg.codec.frame_rate) if measured else None
        self._speed = DOUBLING  # the fixed ramp's, set once per step
        # With a pacer, the first lookahead is for paced segments: a ramped one's second window
        # would wait for the full lookahead while the listener plays the first, unless the ramp
        # grows it (RAMP_MIN_HOLDBACK_KEY), which it does while the measured speed allows.
        full = settings["codec_right_holdback_frames"]
        self._exact = settings | {MIN_HOLDBACK_KEY: full} if paced else settings
        short = settings[RAMP_MIN_HOLDBACK_KEY]
        self._short = settings | {MIN_HOLDBACK_KEY: short} if short < full else None
        self._ramp = self._exact
        # Paced and growing segments time their listener; the fixed ramp reads no clock per offer.
        self._clocked = paced or self._short is not None
        # Parallel rules: a row is audio iff its stream 0 is a codec code.
        s0 = cfg.streams[0]
        self._codes = range(s0.vocab_start, s0.vocab_end) if cfg.decoding.parallel_segments else None

    def __len__(self) -> int:
        return len(self._open)

    def tick(self) -> None:
        """Once per stage-0 step, before its offers: the step count and the pacer's clock."""
        self._steps += 1
        if self.pacer is not None:
            self.pacer.tick(self.clock())
            self._speed = self.pacer.ramp_speed
            speed = self.pacer.speed
            grows = self._short is not None and speed is not None and speed * 100 >= self.settings[RAMP_SPEED_KEY]
            self._ramp = self._short if grows else self._exact

    def offer(self, request: Any, multimodal_output: Any, is_finished: bool) -> tuple[bool, Any]:
        """(hand over now, the payload to hand over) for this step of `request`."""
        state = self._state(request)
        if not state.to_codec:
            if is_finished:
                self._close(request.external_req_id)
            return False, None
        step = payload_frames(multimodal_output)  # kept as it came: shaped once, when handed over
        ended = step is not None and self._add(state, request, step.numpy())
        if is_finished:
            self._close(request.external_req_id)
            self._warn_if_silent(request, state)
        if is_finished or ended:  # a segment's end: the processor flushes it
            return True, self._flush(state)
        payload = self._window(state, request, self.clock() if self._clocked else 0.0)
        return payload is not None, payload

    def offer_step(self, frames: FrameRows, rows: list[tuple[Any, int]]) -> list[tuple[Any, dict]]:
        """`offer` for a step's (request, row) pairs that do not finish, the step's frames read
        once: [(request, payload)] to hand over."""
        host, samples = frames.host.numpy(), frames.samples
        now = self.clock() if self._clocked else 0.0
        handed = []
        for request, row in rows:
            state = self._state(request)
            if not state.to_codec:
                continue
            if samples[row] and self._add(state, request, host[row : row + 1]):
                handed.append((request, self._flush(state)))
            elif (payload := self._window(state, request, now)) is not None:
                handed.append((request, payload))
        return handed

    def _state(self, request: Any) -> _GateState:
        state = self._open.get(request.external_req_id)
        if state is None:
            state = self._open[request.external_req_id] = _GateState(*self._request_options(request))
            self._streams += state.to_codec
        return state

    def _add(self, state: _GateState, request: Any, step: np.ndarray) -> bool:
        """Keep a step's frames; whether they end the current audio segment."""
        state.pending.append(step)
        new_rows = step.size // self.cfg.num_streams
        if self._codes is None:
            state.unclassified += new_rows
            return False
        return self._count_segment_rows(state, request.output_token_ids[-new_rows:])

    def _flush(self, state: _GateState) -> dict | None:
        """The payload of a finish or a segment's end: every frame kept."""
        self.handed_total += 1
        rows = self._take(state)
        return rows if rows is None else rows | window_trace.handed()

    def _window(self, state: _GateState, request: Any, now: float) -> dict | None:
        """The payload of the window due now, or None."""
        if not self._due(state, state.audio + state.unclassified, now):  # even if every new row is audio
            return None
        if state.unclassified:
            new = self._rows(state.pending)[-state.unclassified :]
            state.audio += int(audio_rows(new, self.cfg).sum())
            state.unclassified = 0
        window = self._due(state, state.audio, now)
        if window is None or self._held(state, window):
            return None
        if state.emitted == 0:
            window_trace.log_first_window(getattr(request, "arrival_time", None), len(request.output_token_ids))
        self._sent(state, window, now)
        self.handed_total += 1
        return (self._take(state) or {}) | {WINDOW_KEY: window} | window_trace.handed()

    def _held(self, state: _GateState, window: tuple[int, int]) -> bool:
        """Whether a due full chunk (not a segment's first window) waits for a step that is a
        multiple of `codec_batch_steps`: the answers' full windows leave together."""
        if not state.emitted or window[0] - state.emitted < self.settings["codec_chunk_frames"]:
            return False
        return self._steps % max(self.settings["codec_batch_steps"], 1) != 0

    def _sent(self, state: _GateState, window: tuple[int, int], now: float) -> None:
        if not state.emitted:
            state.paced = self._paces()
            state.growing = not state.paced and self._ramp is self._short  # its first window took the short lookahead
        if state.paced or state.growing:  # the listener plays from the first window, pausing when dry
            state.plays_until = max(state.plays_until, now) + (window[0] - state.emitted) * self.pacer.frame_ms / 1e3
        state.emitted, state.holdback = window

    def _count_segment_rows(self, state: _GateState, stream0: list[int]) -> bool:
        """Count the new audio rows; whether one of the rows ends the current audio segment (the
        next one starts with no frames sent)."""
        ended = False
        for token in stream0:
            if token in self._codes:
                state.audio += 1
                state.spoke = True
            elif state.audio:
                state.audio = state.emitted = 0
                state.paced = state.growing = False
                ended = True
        return ended

    def _request_options(self, request: Any) -> tuple[int | None, bool, bool]:
        """(its own first window, whether its modality enforces audio, whether a codec stage takes it)."""
        info = deserialize_additional_information(getattr(request, "additional_information", None))
        try:
            first = requested_first_window(info)
        except ValueError:  # the processor reports the bad value; any size does here
            first = 1
        try:
            modality = SpeechSamplingParams.from_info(info).resolve(self.cfg).modality
        except (TypeError, ValueError):  # the model rejects the request itself
            modality = OutputMode.AUTO
        to_codec = (info or {}).get(TO_CODEC_KEY) is not False
        return first, modality in (OutputMode.AUDIO, OutputMode.TEXT_AUDIO), to_codec

    def _warn_if_silent(self, request: Any, state: _GateState) -> None:
        """An answer that had to speak and ends without one audio frame is an error somewhere:
        say so, with the stream-0 tokens it wrote."""
        if not state.wants_audio or state.spoke or state.audio:
            return
        new = self._rows(state.pending)[-state.unclassified :] if state.unclassified else None
        if new is not None and bool(audio_rows(new, self.cfg).any()):
            return
        ids = list(request.output_token_ids)
        logger.warning("stage 0: answer %s asked for audio and ended without any after %d rows; stream 0 began %s, "
                       "ended %s", request.external_req_id, len(ids), ids[:12], ids[-12:])

    def _due(self, state: _GateState, num_audio_rows: int, now: float) -> tuple[int, int] | None:
        """(end, holdback) of the window due with these rows, or None."""
        total = num_complete_frames(num_audio_rows, self.cfg.num_streams)
        if state.paced:
            return self.pacer.window(total, state.emitted, state.holdback, (state.plays_until - now) * 1e3)
        first = state.own_first_chunk or self._first
        # A short first lookahead leaves when the exact one would: the frames it frees are audio,
        # a lead for the hand-off's jitter (the growing ramp keeps that many steps in hand).
        if state.growing:
            lead_steps = (state.plays_until - now) * 1e3 / self.pacer.pace_ms
            return growing_lookahead_window(total, state.emitted, state.holdback, lead_steps,
                                            ramp_first_chunk(first, self.settings), self.settings,
                                            self.pacer.speed or DOUBLING)
        if state.emitted or not self._paces():
            if not state.emitted and self._ramp is self._short:
                first = ramp_first_chunk(first, self.settings)
            return next_window(total, state.emitted, first, self._ramp, False, self._speed)
        if not state.own_first_chunk:
            first = self.pacer.first_chunk(first)
        return next_window(total, 0, first, self.settings, False)

    def _paces(self) -> bool:
        bound = self.settings["codec_paced_max_streams"]
        return self.pacer is not None and self.pacer.paces and (not bound or self._streams <= bound)

    def _rows(self, pending: list[np.ndarray]) -> torch.Tensor:
        # numpy: no torch op per pending step (each would hand the interpreter lock around)
        rows = np.concatenate([step.reshape(-1, self.cfg.num_streams) for step in pending])
        return torch.from_numpy(rows.astype(np.int64, copy=False))

    def _take(self, state: _GateState) -> dict | None:
        rows, state.pending, state.unclassified = state.pending, [], 0
        return {"codes": {"audio": self._rows(rows)}} if rows else None

    def forget(self, ext_ids) -> None:
        """Drop requests that ended without a finishing call (abort, error)."""
        for ext_id in ext_ids:
            self._close(ext_id)

    def _close(self, ext_id: str) -> None:
        state = self._open.pop(ext_id, None)
        self._streams -= state is not None and state.to_codec
