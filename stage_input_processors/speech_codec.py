"""Stage 0 (speech LM) -> stage 1 (X-Codec decoder): the async_chunk producer.

Called by vllm-omni's chunk transfer adapter (on its save thread, FIFO per request) once per
stage-0 step that produced a payload, and once more with `is_finished=True`. Each step's payload
is `{"codes": {"audio": LongTensor[1, S]}}`: the step's unified token ids of all S streams
(`[0, S]` on partial-prefill steps).

Per request it buffers the audio rows (stream 0 in stream 0's codec slice, the same rule as
`delay_pattern.audio_codes`, so text rows and the final eos row drop out) and, once enough frames
are complete (frame t is complete once row t + S - 1 exists), sends stage 1 one window:

    frames [emitted - left, target + holdback)   flattened [T_win * Q] codebook indices
    meta.left_context_size = left                 (<= codec_left_context_frames, 25)
    meta.right_holdback_size = holdback           (codec_right_holdback_frames, 10; 0 at finish)

Stage 1 decodes the window and keeps frames [emitted, target): exactly the new ones. Holding back
10 frames makes streaming exact: X-Codec's output frame f depends on input frames f-10..f+10
(codec/xcodec.py), so with >= 10 frames of left context and 10 of lookahead the kept samples equal
whole-clip decoding up to float rounding. The cost is 10 frames (200 ms) of extra latency per
window. At finish the rest is flushed with no holdback (the clip ends there, as in whole-clip
decoding). The first window may be smaller (`initial_codec_chunk_frames`: connector `extra`, or
per request in the prompt's `additional_information`) for faster first audio; the windows after
it ramp up to the full size (`next_window_end`).

State: only `transfer_manager.code_prompt_token_ids[external_req_id]` (buffered rows, [S] long
tensors) and `transfer_manager.request_payload[external_req_id]` (counters). The adapter pops
both on a normal finish and on abort (`_clear_sender_state_locked`, via `cleanup_sender`), so
nothing here outlives a request.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm_omni.data_entry_keys import unflatten_payload

from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.delay_pattern import audio_codes, audio_rows
from vllm_omni_speechlm.deploy_checks import WINDOW_DEFAULTS, window_settings

# Deployment defaults; the connector's `extra` section overrides them (stage_configs/bagpiper_streaming.yaml).
# Validated at engine start-up too (vllm_omni_speechlm/deploy_checks.py), where errors reach the user.
DEFAULTS = WINDOW_DEFAULTS
# Per-request override of the first window, in the prompt's additional_information.
INITIAL_CHUNK_KEY = "initial_codec_chunk_frames"


@functools.lru_cache(maxsize=8)
def _layout(model_dir: str) -> SpeechLMConfig:
    """The checkpoint's stream layout (immutable, shared by all requests)."""
    return SpeechLMConfig.from_model_dir(model_dir)


def _model_dir(transfer_manager: Any) -> str:
    """Stage 0's checkpoint directory (the adapter keeps stage 0's model config as `config`)."""
    model = getattr(getattr(transfer_manager, "config", None), "model", None)
    if not model:
        raise RuntimeError("speech_codec: the transfer manager's model config names no model directory")
    return str(model)


def chunk_settings(transfer_manager: Any) -> dict[str, int]:
    """DEFAULTS overridden by the connector's `extra` section; a bad value names its key."""
    raw = getattr(transfer_manager.connector, "config", None) or {}
    extra = raw.get("extra", raw) if isinstance(raw, dict) else {}
    return window_settings(extra)


def _request_initial_chunk(request: Any) -> int | None:
    """The request's own first-window size, if its prompt carried one."""
    from vllm_omni.engine.serialization import deserialize_additional_information

    info = deserialize_additional_information(getattr(request, "additional_information", None))
    value = info.get(INITIAL_CHUNK_KEY)
    if isinstance(value, list) and len(value) == 1:  # scalars may arrive wrapped
        value = value[0]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"additional_information: {INITIAL_CHUNK_KEY} must be a positive int, got {value!r}")
    return value


def _first_chunk(request: Any, settings: dict[str, int]) -> int:
    """The request's first window: its own, else the deployment's, else a full chunk."""
    return _request_initial_chunk(request) or settings["initial_codec_chunk_frames"] or settings["codec_chunk_frames"]


def _new_state(request: Any, settings: dict[str, int]) -> dict[str, int]:
    # emitted: frames already sent as new audio; base: absolute index of the first buffered row.
    return {"emitted": 0, "base": 0, "first_chunk": _first_chunk(request, settings)}


def _complete_frames(num_audio_rows: int, cfg: SpeechLMConfig) -> int:
    """Frame t is complete once audio row t + S - 1 exists."""
    return max(0, num_audio_rows - (cfg.num_streams - 1))


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


def _step_rows(multimodal_output: Any, cfg: SpeechLMConfig) -> torch.Tensor | None:
    """A payload's [k, S] stream rows (host tensor), or None when it carries none."""
    codes = (multimodal_output or {}).get("codes", {}) if isinstance(multimodal_output, dict) else {}
    step = codes.get("audio") if isinstance(codes, dict) else None
    if not isinstance(step, torch.Tensor) or step.numel() == 0:
        return None
    return step.reshape(-1, cfg.num_streams).to(torch.long)


def _append_audio_rows(rows: list[torch.Tensor], multimodal_output: Any, cfg: SpeechLMConfig) -> None:
    """Buffer the payload's audio rows (host tensors: no device sync)."""
    step = _step_rows(multimodal_output, cfg)
    if step is not None:
        rows.extend(step[audio_rows(step, cfg)].unbind(0))


def speechlm2codec_async_chunk(
    transfer_manager: Any,
    multimodal_output: Any,
    request: Any,
    is_finished: bool = False,
) -> Any:
    """Return the next window for stage 1 (an OmniPayloadStruct) or None (nothing to send yet)."""
    from vllm_omni.data_entry_keys import CodesStruct, MetaStruct, OmniPayloadStruct

    ext_id = request.external_req_id
    cfg = _layout(_model_dir(transfer_manager))
    settings = chunk_settings(transfer_manager)
    rows = transfer_manager.code_prompt_token_ids[ext_id]
    state = transfer_manager.request_payload.get(ext_id)
    if state is None:
        state = transfer_manager.request_payload[ext_id] = _new_state(request, settings)
    _append_audio_rows(rows, multimodal_output, cfg)

    emitted = state["emitted"]
    total = _complete_frames(state["base"] + len(rows), cfg)
    target = next_window_end(total, emitted, state["first_chunk"], settings, is_finished)
    if target is None:
        return None  # on the final call the adapter sends the terminal marker itself

    holdback = 0 if is_finished else settings["codec_right_holdback_frames"]
    left = min(settings["codec_left_context_frames"], emitted)
    # Frames [emitted - left, total) need rows [emitted - left, total + S - 1) = the buffer's tail.
    # The window's rows are all audio rows, >= S of them: [left + new + holdback, Q].
    codes = audio_codes(torch.stack(rows[emitted - left - state["base"] :]), cfg)
    state["emitted"] = target
    _drop_rows_before(rows, state, target - settings["codec_left_context_frames"])
    return OmniPayloadStruct(
        codes=CodesStruct(audio=codes.reshape(-1)),
        meta=MetaStruct(left_context_size=left, right_holdback_size=holdback),
    )


def _drop_rows_before(rows: list[torch.Tensor], state: dict[str, int], first_needed: int) -> None:
    """Free rows no later window can reach (the next one starts at emitted - left context)."""
    drop = first_needed - state["base"]
    if drop > 0:
        del rows[:drop]
        state["base"] += drop


# ---- scheduler side: hand the adapter only the steps that send something -----------------------


@dataclass
class _GateState:
    first_chunk: int
    emitted: int = 0  # frames sent as new audio (mirrors the processor's count)
    audio: int = 0  # audio rows among those handed over or classified
    pending: list[torch.Tensor] = field(default_factory=list)  # [k, S] rows not handed over yet
    unclassified: int = 0  # rows at the tail of `pending` not yet tested for audio


class WindowGate:
    """Sits in front of the chunk adapter's `save_async` (stage-0 scheduler, every step of every
    request). The adapter copies the request and wakes its save thread on every call, ~0.1 ms per
    request per step, though a window is due only every 25 frames. The gate keeps each request's
    step rows and hands them over as one [k, S] payload on the steps where the processor sends a
    window (the same rule, `next_window_end`), and at finish; the processor receives the same rows
    in the same order, so the windows are unchanged."""

    def __init__(self, cfg: SpeechLMConfig, settings: dict[str, int]) -> None:
        self.cfg, self.settings = cfg, settings
        self._open: dict[str, _GateState] = {}

    @classmethod
    def for_adapter(cls, adapter: Any) -> "WindowGate":
        return cls(_layout(_model_dir(adapter)), chunk_settings(adapter))

    def __len__(self) -> int:
        return len(self._open)

    def offer(self, request: Any, multimodal_output: Any, is_finished: bool) -> tuple[bool, Any]:
        """(hand over now, the payload to hand over) for this step of `request`."""
        ext_id = request.external_req_id
        state = self._open.get(ext_id)
        if state is None:
            state = self._open[ext_id] = _GateState(self._first_window(request))
        if isinstance(multimodal_output, Mapping):  # the scheduler's keys are flat ("codes.audio")
            multimodal_output = unflatten_payload(multimodal_output)
        rows = _step_rows(multimodal_output, self.cfg)
        if rows is not None:
            state.pending.append(rows)
            state.unclassified += rows.shape[0]
        if is_finished:
            del self._open[ext_id]
            return True, self._take(state)
        if not self._due(state, state.audio + state.unclassified):  # even if every new row is audio
            return False, None
        if state.unclassified:
            new = torch.cat(state.pending)[-state.unclassified :]
            state.audio += int(audio_rows(new, self.cfg).sum())
            state.unclassified = 0
        end = self._due(state, state.audio)
        if end is None:
            return False, None
        state.emitted = end
        return True, self._take(state)

    def _first_window(self, request: Any) -> int:
        try:
            return _first_chunk(request, self.settings)
        except ValueError:  # the processor reports the bad value; any size does here
            return 1

    def _due(self, state: _GateState, num_audio_rows: int) -> int | None:
        total = _complete_frames(num_audio_rows, self.cfg)
        return next_window_end(total, state.emitted, state.first_chunk, self.settings, False)

    @staticmethod
    def _take(state: _GateState) -> dict | None:
        rows, state.pending, state.unclassified = state.pending, [], 0
        return {"codes": {"audio": torch.cat(rows)}} if rows else None

    def forget(self, ext_ids) -> None:
        """Drop requests that ended without a finishing call (abort, error)."""
        for ext_id in ext_ids:
            self._open.pop(ext_id, None)


# ---- batch mode (deploy async_chunk: false): the whole clip in one stage-1 prompt --------------
#
# vllm-omni's orchestrator calls this (stage 1's `sync_process_input_func`) once stage 0 has
# finished a request, with that request's output: `codes.audio` then holds every step's [1, S] row,
# concatenated to [L, S] (the key's CONCAT_DIM0 strategy). The clip goes to stage 1 as a single
# window with no left context and no holdback, so stage 1 decodes it whole and keeps all of it:
# the same audio as the reference's whole-clip decoding, delivered once at the end.


def _finished_stream_tokens(source_output: Any) -> torch.Tensor | None:
    """[L, S] stream tokens of a finished stage-0 output, or None (no payload: nothing to decode)."""
    completion = source_output.outputs[0] if getattr(source_output, "outputs", None) else None
    mm = getattr(source_output, "multimodal_output", None) or getattr(completion, "multimodal_output", None) or {}
    codes = mm.get("codes")
    tokens = codes.get("audio") if isinstance(codes, dict) else mm.get("codes.audio")
    if isinstance(tokens, list):  # not consolidated (a DELTA stage-0 request): the per-step rows
        tokens = torch.cat([t.reshape(-1, t.shape[-1]) for t in tokens]) if tokens else None
    if not isinstance(tokens, torch.Tensor) or tokens.numel() == 0:
        return None
    return tokens.to(torch.long).cpu()


def speechlm2codec(
    source_outputs: list[Any],
    prompt: Any = None,
    requires_multimodal_data: bool = False,
    *,
    target_model_config: Any = None,
) -> list[Any]:
    """Finished stage-0 outputs -> one stage-1 prompt per clip: flattened [T * Q] codebook indices
    (frame-major, the streaming window format), meta left_context_size = right_holdback_size = 0.

    A request that produced no audio (a text-only answer, or fewer than S audio rows) yields no
    prompt: the orchestrator then finishes it from the final stage with empty audio, instead of
    sending stage 1 an empty window. `target_model_config` (stage 1's model config, passed by
    vllm-omni because this parameter is keyword-only) names the checkpoint directory.
    """
    from vllm_omni.inputs.data import OmniTokensPrompt

    if target_model_config is None or not getattr(target_model_config, "model", None):
        raise RuntimeError("speech_codec: speechlm2codec needs stage 1's model config (target_model_config)")
    cfg = _layout(str(target_model_config.model))
    prompts = []
    for source_output in source_outputs:
        if not getattr(source_output, "finished", True):
            continue  # batch mode decodes finished clips only
        tokens = _finished_stream_tokens(source_output)  # [L, S]
        codes = None if tokens is None else audio_codes(tokens.reshape(-1, cfg.num_streams), cfg)  # [T, Q]
        if codes is None:
            continue
        prompts.append(
            OmniTokensPrompt(
                prompt_token_ids=codes.reshape(-1).tolist(),  # [T * Q], frame-major
                additional_information={"meta": {"left_context_size": 0, "right_holdback_size": 0}},
            )
        )
    return prompts
