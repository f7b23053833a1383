"""OpusLM and OpusLM-Dialogue: 9 streams (SSL units + 8 DAC) on an OLMo-2 (7B) or a Llama
(SmolLM2 geometry, dialogue) backbone, both on vLLM's own layers.

Everything else is the shared stage model driven by the checkpoint's `speechlm` section: the
layout, the per-stream head bias on stream 0 too (`primary_stream_embedding`), the delay warm-up,
minimum audio length and drain (`DecodingSpec`). No CFG.
"""

from __future__ import annotations

from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.llama import LlamaModel

from vllm_omni_speechlm.models.olmo2 import Olmo2Model
from vllm_omni_speechlm.models.speechlm import SpeechLMForCausalLM

BACKBONES = {"olmo2": Olmo2Model, "llama": LlamaModel}


class OpusLMForCausalLM(SpeechLMForCausalLM):
    def make_backbone(self, vllm_config: VllmConfig, prefix: str) -> nn.Module:
        model_type = vllm_config.model_config.hf_config.model_type
        if model_type not in BACKBONES:
            raise ValueError(f"OpusLM: config.json model_type must be one of {sorted(BACKBONES)}, got {model_type!r}")
        return BACKBONES[model_type](vllm_config=vllm_config, prefix=prefix)
