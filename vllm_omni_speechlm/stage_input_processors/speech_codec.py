"""Stage 0 (speech LM) -> stage 1 (X-Codec decoder): the async_chunk producer.

Called by vllm-omni's chunk transfer adapter (on its save thread, FIFO per request) once per
stage-0 step that produced a payload, and once more with `is_finished=True`. Each step's payload
is `{"codes": {"audio": LongTensor[1, S]}}`: the step's unified token ids of all S streams
(`[0, S]` on partial-prefill steps).

Per request it buffers the audio rows of the current audio segment (`delay_pattern.audio_rows`, so
text rows and the final eos row drop out) and, once enough frames are complete (frame t is
complete once row t + S - 1 exists), sends stage 1 one window:

    frames [emitted - left, target + holdback)   flattened [T_win * Q] codebook indices
    meta.left_context_size = left                 (<= codec_left_context_frames, 25)
    meta.right_holdback_size = holdback           (codec_right_holdback_frames, 10; 0 at finish)
    output_sample_rate                            (only if the request asked for one: resample.py)

Stage 1 decodes the window and keeps frames [emitted, target): exactly the new ones. Holding back
10 frames makes streaming exact: X-Codec's output frame f depends on input frames f-10..f+10
(codec/xcodec.py), so with >= 10 frames of left context and 10 of lookahead the kept samples equal
whole-clip decoding up to float rounding. The cost is 10 frames (200 ms) of extra latency per
window. At finish the rest is flushed with no holdback (the clip ends there, as in whole-clip
decoding). Which window is due when is stage 0's window gate's call (stage0/window_gate.py): it
hands its (end, holdback) over with the rows, and this cuts that window. Called without one (no
gate), it applies the fixed ramp itself (`streaming.next_window`): a smaller first window
(`initial_codec_chunk_frames`: connector `extra`, or per request in the prompt's
`additional_information`) for faster first audio, then windows ramping up to the full size.

An answer may hold several audio segments (audio, `<|eot|>`, another segment). ESPnet decodes each
one on its own, so a segment is streamed as if it were the whole clip: its end (the first row that
is not audio) flushes its frames with no holdback, and the next segment's windows start over,
with no left context from the one before.

State: only `transfer_manager.code_prompt_token_ids[external_req_id]` (the buffered rows, as
[k, S] numpy blocks: in numpy the save thread's host work hands no interpreter lock to the
scheduler's thread op by op) and `transfer_manager.request_payload[external_req_id]` (counters).
The adapter pops both on a normal finish and on abort (`_clear_sender_state_locked`, via
`cleanup_sender`), so nothing here outlives a request.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from vllm_omni.engine.serialization import deserialize_additional_information

from vllm_omni_speechlm.compat import window_payload, wire_tensor
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.delay_pattern import audio_rows, audio_segments, host_segment_codes, num_complete_frames
from vllm_omni_speechlm.frames import payload_frames
from vllm_omni_speechlm.resample import RATE_KEY, requested_rate
from vllm_omni_speechlm.streaming import WINDOW_KEY, first_window, next_window, window_settings
from vllm_omni_speechlm.window_trace import stamp

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
    """The window settings of the connector's `extra` section (streaming.py); a bad value names its key."""
    raw = getattr(transfer_manager.connector, "config", None) or {}
    extra = raw.get("extra", raw) if isinstance(raw, dict) else {}
    return window_settings(extra)


def _new_state(request: Any, settings: dict[str, int]) -> dict[str, int]:
    # emitted: frames of the current audio segment already sent as new audio; base: index in the
    # segment of the first buffered row; rate: the output rate asked for (0: the codec's).
    info = deserialize_additional_information(getattr(request, "additional_information", None))
    return {"emitted": 0, "base": 0, "first_chunk": first_window(info, settings), "rate": requested_rate(info, 0)}


def _buffer_segment_rows(blocks: list[np.ndarray], state: dict[str, int], multimodal_output: Any,
                         cfg: SpeechLMConfig) -> bool:
    """Buffer the payload's audio rows as one host block; whether the payload ends the current
    audio segment (a row that is not audio after its audio rows). The window gate hands over each
    segment's end, so no audio row may follow it in the same payload."""
    step = payload_frames(multimodal_output)
    if step is None:
        return False
    step = step.numpy().reshape(-1, cfg.num_streams)
    audio = audio_rows(step, cfg)
    if audio.all():
        blocks.append(step.copy())  # not a view: it could hold a whole step's pinned frame buffer
        return False
    ends = ~audio & (np.cumsum(audio) + _rows_seen(blocks, state) > 0)  # a row not audio after audio rows
    end = int(ends.argmax()) if ends.any() else len(step)
    if audio[end:].any():
        raise RuntimeError("speech_codec: audio rows after an audio segment's end in one payload")
    blocks.append(step[:end][audio[:end]])
    return end < len(step)


def _rows_seen(blocks: list[np.ndarray], state: dict[str, int]) -> int:
    """Audio rows of the current segment so far (`base` of them already dropped)."""
    return state["base"] + sum(len(b) for b in blocks)


def speechlm2codec_async_chunk(
    transfer_manager: Any,
    multimodal_output: Any,
    request: Any,
    is_finished: bool = False,
) -> Any:
    """Return the next window for stage 1 (an OmniPayloadStruct) or None (nothing to send yet)."""
    ext_id = request.external_req_id
    cfg = _layout(_model_dir(transfer_manager))
    settings = chunk_settings(transfer_manager)
    blocks = transfer_manager.code_prompt_token_ids[ext_id]
    state = transfer_manager.request_payload.get(ext_id)
    if state is None:
        state = transfer_manager.request_payload[ext_id] = _new_state(request, settings)
    gated = isinstance(multimodal_output, dict) and WINDOW_KEY in multimodal_output
    ended = _buffer_segment_rows(blocks, state, multimodal_output, cfg)
    flush = is_finished or ended
    decided = multimodal_output[WINDOW_KEY] if gated and not flush else None
    window = _next_window(blocks, state, settings, cfg, flush, decided, multimodal_output)
    if ended:  # the next segment's frames start over: no codec context crosses the edge
        blocks.clear()
        state["emitted"] = state["base"] = 0
    return window


def _next_window(blocks: list[np.ndarray], state: dict[str, int], settings: dict[str, int], cfg: SpeechLMConfig,
                 flush: bool, decided: tuple[int, int] | None, payload: Any = None) -> Any:
    """The window due now of the current segment (all of its unsent frames when `flush`; the gate's
    (end, holdback) when `decided`), or None. `payload`: the gate's, for the window trace."""
    from vllm_omni.data_entry_keys import CodesStruct, MetaStruct

    emitted = state["emitted"]
    total = num_complete_frames(_rows_seen(blocks, state), cfg.num_streams)
    window = decided or next_window(total, emitted, state["first_chunk"], settings, flush)
    if window is None:
        return None  # on the final call the adapter sends the terminal marker itself
    target, holdback = window
    if not emitted < target <= total - holdback:
        raise RuntimeError(f"speech_codec: window [{emitted}, {target}) + {holdback} is not within {total} frames")
    left = min(settings["codec_left_context_frames"], emitted)
    rows = np.concatenate(blocks) if len(blocks) > 1 else blocks[0]
    # Frames [emitted - left, target + holdback) need rows [emitted - left, target + holdback + S - 1):
    # the buffer's tail, less the rows of a window the gate held (`codec_batch_steps`). They are all
    # audio rows of one segment, >= S of them: [left + new + holdback, Q].
    end = target + holdback + cfg.num_streams - 1 - state["base"]
    codes = host_segment_codes(rows[emitted - left - state["base"] : end], cfg)
    state["emitted"] = target
    # Keep only the rows a later window can reach (it starts at emitted - left context).
    drop = max(0, target - settings["codec_left_context_frames"] - state["base"])
    blocks[:] = [rows[drop:]]
    state["base"] += drop
    return window_payload(
        CodesStruct(audio=wire_tensor(codes.astype(np.int64).reshape(-1))),  # no torch call on this thread
        MetaStruct(left_context_size=left, right_holdback_size=holdback),
        **({RATE_KEY: state["rate"]} if state["rate"] else {}),
        **stamp(payload),
    )


# ---- batch mode (deploy async_chunk: false): the whole clip in one stage-1 prompt --------------
#
# vllm-omni's orchestrator calls this (stage 1's `sync_process_input_func`) once stage 0 has
# finished a request, with that request's output: `codes.audio` then holds every step's [1, S] row,
# concatenated to [L, S] (the key's CONCAT_DIM0 strategy). The clip goes to stage 1 as a single
# window with no left context and no holdback, listing its audio segments' lengths; stage 1 decodes
# each segment whole and keeps all of it: the reference's decoding, delivered once at the end.
# The output rate the original prompt asked for goes along, as each streamed window carries it.


def _output_rate(prompt: Any) -> dict[str, Any]:
    """The original prompt's output-rate entry ({}: none asked), for stage 1's prompt."""
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    info = deserialize_additional_information(prompt.get("additional_information")) if isinstance(prompt, dict) else {}
    return {RATE_KEY: info[RATE_KEY]} if RATE_KEY in info else {}


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
    (frame-major, the streaming window format), meta left_context_size = right_holdback_size = 0
    and segment_frames (the frames of each audio segment, which stage 1 decodes on its own), and
    the output rate the original `prompt` asked for.

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
        segments = [] if tokens is None else audio_segments(tokens.reshape(-1, cfg.num_streams), cfg)  # [T_i, Q]
        if not segments:
            continue
        meta = {"left_context_size": 0, "right_holdback_size": 0, "segment_frames": [c.shape[0] for c in segments]}
        prompts.append(
            OmniTokensPrompt(
                prompt_token_ids=torch.cat(segments).reshape(-1).tolist(),  # [T * Q], frame-major
                additional_information={"meta": meta, **_output_rate(prompt)},
            )
        )
    return prompts
