"""One request's speech options -> what vLLM-Omni takes: the stage-0 prompt dict and SamplingParams.

Shared by the offline generator and the API server (speech and chat routes), so both send the
engine the same request for the same options.
"""

from __future__ import annotations

from typing import Any

from stage_input_processors.speech_codec import INITIAL_CHUNK_KEY  # per-request first window
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.decoding import OutputMode
from vllm_omni_speechlm.sampling_params import SPEECH_PARAMS_KEY, SpeechSamplingParams


def speech_params_info(p: SpeechSamplingParams) -> dict[str, Any]:
    """The model's per-request options (resolved params), as plain scalars (msgpack). The seed
    is not among them: the model reads it from the engine's generator for the request."""
    info = {"modality": int(p.modality), "cfg_scale": p.cfg_scale}
    for name in ("text_temperature", "text_top_k", "audio_temperature", "audio_top_k", "max_tokens", "max_text_tokens"):
        info[name] = getattr(p, name)
    return info


def engine_prompt(prompt_ids: list[int], p: SpeechSamplingParams, initial_chunk_frames: int | None = None) -> dict:
    """Stage-0 prompt: token ids plus the speech options (and, optionally, the first window)."""
    info: dict[str, Any] = {SPEECH_PARAMS_KEY: speech_params_info(p)}
    if initial_chunk_frames is not None:
        info[INITIAL_CHUNK_KEY] = initial_chunk_frames
    return {"prompt_token_ids": list(prompt_ids), "additional_information": info}


def stage0_sampling_params(cfg: SpeechLMConfig, p: SpeechSamplingParams, **overrides: Any) -> Any:
    """Stage 0's vLLM SamplingParams for resolved options `p`: the engine samples stream 0 at the
    engine temperature with no top-k of its own (the model applies per-modality top-k and
    rescales text rows). `overrides`: other SamplingParams fields (e.g. output_kind)."""
    from vllm import SamplingParams

    stop = [cfg.specials.eot] if p.modality == OutputMode.TEXT else []
    fields = dict(
        temperature=p.engine_temperature,
        top_k=0,
        seed=p.seed,
        max_tokens=p.max_tokens,
        stop_token_ids=stop,
        detokenize=False,
    )
    return SamplingParams(**(fields | overrides))
