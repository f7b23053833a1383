"""Classifier-free guidance pairs: a guided request and its hidden unconditional companion.

Guidance applies to audio segments (`cfg_scale` > 1). As ESPnet's `ParallelLLM.inference_segment`
does, the unconditional branch exists only while such a segment decodes, and it starts from
all-pad tokens over the whole context before the segment's modality token (prompt, earlier
segments, `<|assistant|>`): the modality token and every row after it are fed to both branches.
The companion exists only inside the stage-0 EngineCore: `stage0.scheduler.PairedCFGScheduler`
creates it when its main request reaches a guided segment, ends it with the segment, and drops its
outputs, so clients, usage counts and later stages never see it. The model merges the pair's
logits on audio rows and feeds the main's sampled tokens (all streams) to both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.decoding import OutputMode
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

COMPANION_SUFFIX = "::cfg-uncond"


def companion_id(request_id: str) -> str:
    return request_id + COMPANION_SUFFIX


def is_companion(request_id: str) -> bool:
    return request_id.endswith(COMPANION_SUFFIX)


def main_id(request_id: str) -> str:
    """The main request of a companion id."""
    return request_id.removesuffix(COMPANION_SUFFIX)


def unconditional_prompt(context_len: int, pad: int, modality: int | None = None) -> list[int]:
    """The companion's prompt: all pad over the main's `context_len` tokens before the segment's
    modality row, then the modality token when the main has already sampled it (without it, the
    companion computes the modality row alongside the main and is then fed the main's token)."""
    return [pad] * context_len + ([] if modality is None else [modality])


def guided_mode(info: Mapping[str, Any] | None, cfg: SpeechLMConfig) -> OutputMode | None:
    """The output mode of a request whose speech options (its prompt's additional information)
    ask for CFG, else None. Invalid options count as no guidance: the model decodes such a
    request with the checkpoint defaults (models/steps.py)."""
    try:
        p = SpeechSamplingParams.from_info(info).resolve(cfg)
    except (TypeError, ValueError):
        return None
    return p.modality if p.use_cfg else None


def wants_guidance(info: Mapping[str, Any] | None, cfg: SpeechLMConfig) -> bool:
    """Whether a request's speech options ask for CFG."""
    return guided_mode(info, cfg) is not None


def merge_guided(cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """w * cond + (1 - w) * uncond on raw logits (`scale` broadcasts over the vocabulary)."""
    return scale * cond + (1.0 - scale) * uncond
