"""One request's speech options -> what vLLM-Omni takes: the stage-0 prompt dict and SamplingParams.

Shared by the offline generator and the API server (speech and chat routes), so both send the
engine the same request for the same options.
"""

from __future__ import annotations

from typing import Any

from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.frames import CLIENT_CODES_KEY
from vllm_omni_speechlm.resample import RATE_KEY
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
from vllm_omni_speechlm.streaming import INITIAL_CHUNK_KEY


def engine_prompt(
    prompt_ids: list[int], p: SpeechSamplingParams, initial_chunk_frames: int | None = None, audio: list | None = None,
    sample_rate: int | None = None, client_codes: bool = True,
) -> dict:
    """Stage-0 prompt: token ids plus the speech options (and, optionally, the first window, the
    codec stage's output rate and whether the client reads the frames), and the audio clips of its
    placeholders in order (vLLM's multimodal data: waveforms at the model's rate, or (waveform,
    rate) pairs that vLLM resamples)."""
    info = p.to_info()
    if not client_codes:
        info[CLIENT_CODES_KEY] = False
    if initial_chunk_frames is not None:
        info[INITIAL_CHUNK_KEY] = initial_chunk_frames
    if sample_rate is not None:
        info[RATE_KEY] = sample_rate
    prompt = {"prompt_token_ids": list(prompt_ids), "additional_information": info}
    if audio:
        prompt["multi_modal_data"] = {"audio": list(audio)}
    return prompt


def stage0_sampling_params(cfg: SpeechLMConfig, p: SpeechSamplingParams, **overrides: Any) -> Any:
    """Stage 0's vLLM SamplingParams for resolved options `p`: the engine samples stream 0 at the
    engine temperature with no top-k of its own (the model applies per-modality top-k and
    rescales text rows). `overrides`: other SamplingParams fields (e.g. output_kind)."""
    from vllm import SamplingParams

    # The model emits eos where the answer ends (an eos it outlives is emitted deferred).
    fields = dict(
        temperature=p.engine_temperature,
        top_k=0,
        seed=p.seed,
        max_tokens=p.max_tokens,
        detokenize=False,
    )
    return SamplingParams(**(fields | overrides))
