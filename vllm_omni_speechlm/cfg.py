"""Classifier-free guidance pairs: a guided request and its hidden unconditional companion.

The companion exists only inside the stage-0 EngineCore: `stage0.scheduler.PairedCFGScheduler`
creates it next to its main request (same length all-pad prompt, same sampling parameters) and
drops its outputs, so clients, usage counts and later stages never see it. The model merges the
pair's logits on audio rows and feeds the main's sampled tokens (all streams) to both.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

COMPANION_SUFFIX = "::cfg-uncond"


def companion_id(request_id: str) -> str:
    return request_id + COMPANION_SUFFIX


def is_companion(request_id: str) -> bool:
    return request_id.endswith(COMPANION_SUFFIX)


def main_id(request_id: str) -> str:
    """The main request of a companion id."""
    return request_id.removesuffix(COMPANION_SUFFIX)


def unconditional_prompt(prompt_ids: list[int], pad: int) -> list[int]:
    """The unconditional branch's prompt: all pad, as long as the conditional one."""
    return [pad] * len(prompt_ids)


def wants_guidance(info: Mapping[str, Any] | None, cfg: SpeechLMConfig) -> bool:
    """Whether a request's speech options (its prompt's additional information) ask for CFG.
    Invalid options count as no guidance: the model decodes such a request with the checkpoint
    defaults (models/steps.py)."""
    try:
        return SpeechSamplingParams.from_info(info).resolve(cfg).use_cfg
    except (TypeError, ValueError):
        return False


def merge_guided(cond: torch.Tensor, uncond: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """w * cond + (1 - w) * uncond on raw logits (`scale` broadcasts over the vocabulary)."""
    return scale * cond + (1.0 - scale) * uncond
