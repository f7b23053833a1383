"""Bagpiper: a Qwen3 backbone (vLLM's own layers) with 8 X-Codec streams."""

from __future__ import annotations

from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.qwen3 import Qwen3Model

from vllm_omni_speechlm.models.speechlm import SpeechLMForCausalLM


class BagpiperForCausalLM(SpeechLMForCausalLM):
    def make_backbone(self, vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return Qwen3Model(vllm_config=vllm_config, prefix=prefix)
