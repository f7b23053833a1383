"""Bagpiper: a Qwen3 backbone (vLLM's own layers) with 8 X-Codec streams, and audio input.

Audio input goes through vLLM's multimodal machinery (models/audio_processor.py builds the
requests' log-mels and expands each clip's placeholder to its rows). vLLM's runner calls
`embed_multimodal` on the clips its scheduler lets into a step, batched across requests, caches
the outputs by clip hash, and hands `embed_input_ids` each step's rows to overwrite: the adaptor's
features replace those rows' whole input embedding, as ESPnet does. The tower is vLLM's
Qwen3-Omni audio encoder (TP-aware linears, its encoder attention with windows).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
from vllm.config import VllmConfig
from vllm.model_executor.layers.linear import ReplicatedLinear
from vllm.model_executor.models.interfaces import SupportsMultiModal
from vllm.model_executor.models.qwen3 import Qwen3Model
from vllm.model_executor.models.qwen3_omni_moe_thinker import Qwen3OmniMoeAudioEncoder
from vllm.model_executor.models.utils import WeightsMapper, maybe_prefix
from vllm.multimodal import MULTIMODAL_REGISTRY

from vllm_omni_speechlm.config import BAGPIPER_AUDIO_PLACEHOLDER, AudioInputSpec
from vllm_omni_speechlm.models.audio_processor import (
    FEATURES,
    FRAMES,
    BagpiperAudioProcessor,
    BagpiperDummyInputs,
    BagpiperProcessingInfo,
)
from vllm_omni_speechlm.models.speechlm import SpeechLMForCausalLM
from vllm_omni_speechlm.tokenizer import reserved_token_text


def encoder_groups(frames: Sequence[int], chunk: int) -> list[list[int]]:
    """Clips that one encoder call may batch: every clip of at least one whole chunk together (the
    tower pads each clip's last chunk to a whole one then, as it would alone), each shorter clip
    alone (batched, its only chunk would be padded to the batch's longest chunk, and the padding's
    convolution outputs reach its last rows: it would not be its solo run)."""
    long = [i for i, n in enumerate(frames) if n >= chunk]
    return ([long] if long else []) + [[i] for i, n in enumerate(frames) if n < chunk]


@MULTIMODAL_REGISTRY.register_processor(BagpiperAudioProcessor, info=BagpiperProcessingInfo, dummy_inputs=BagpiperDummyInputs)
class BagpiperForCausalLM(SpeechLMForCausalLM, SupportsMultiModal):
    @classmethod
    def get_placeholder_str(cls, modality: str, i: int) -> str | None:
        return reserved_token_text(BAGPIPER_AUDIO_PLACEHOLDER) if modality.startswith("audio") else None

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        spec = self.speech.audio_input
        mm = vllm_config.model_config.multimodal_config
        if spec is None or (mm is not None and mm.get_limit_per_prompt("audio") == 0):
            return  # no tower: text-only mode (`--limit-mm-per-prompt '{"audio": 0}'`), weights skipped
        hidden = vllm_config.model_config.hf_config.hidden_size
        tower = Qwen3OmniMoeAudioEncoderConfig(**dataclasses.asdict(spec.tower))
        self.audio_tower = Qwen3OmniMoeAudioEncoder(tower, prefix=maybe_prefix(prefix, "audio_tower"))
        self.audio_adaptor = ReplicatedLinear(spec.tower.output_dim, hidden, bias=True, return_bias=False,
                                              prefix=maybe_prefix(prefix, "audio_adaptor"))
        self.hf_to_vllm_mapper = WeightsMapper()  # the audio input's weights load (the base skips them)

    def make_backbone(self, vllm_config: VllmConfig, prefix: str) -> nn.Module:
        return Qwen3Model(vllm_config=vllm_config, prefix=prefix)

    # ---- audio input ---------------------------------------------------------------------------
    def embed_multimodal(self, **kwargs: Any) -> list[torch.Tensor]:
        """The clips of a step's requests, [rows_i, H] each, in order."""
        features, frames = kwargs.get(FEATURES), kwargs.get(FRAMES)
        if features is None or not hasattr(self, "audio_tower"):
            return []
        if not isinstance(features, torch.Tensor):
            features = torch.cat(list(features), dim=1)
        return self.audio_embeddings(features, [int(n) for n in frames])  # frames stay on the host

    def audio_embeddings(self, features: torch.Tensor, frames: list[int]) -> list[torch.Tensor]:
        """[mel bins, sum(frames)] log-mels of clips -> adaptor(tower(clip)) per clip."""
        spec: AudioInputSpec = self.speech.audio_input
        rows = [spec.output_length(n) for n in frames]
        starts = np.cumsum([0, *frames]).tolist()
        encoded: list[torch.Tensor | None] = [None] * len(frames)
        for group in encoder_groups(frames, spec.tower.chunk_frames):
            clips = torch.cat([features[:, starts[i] : starts[i + 1]] for i in group], dim=1)
            out = self.audio_tower(
                clips.to(self.audio_tower.dtype),
                feature_lens=torch.tensor([frames[i] for i in group], device=clips.device),
                aftercnn_lens=torch.tensor([rows[i] for i in group], device=clips.device),
            )
            for i, part in zip(group, out.split([rows[i] for i in group])):
                encoded[i] = part
        return list(self.audio_adaptor(torch.cat(encoded)).split(rows))

    def embed_input_ids(
        self,
        input_ids: torch.Tensor,
        multimodal_embeddings: Sequence[torch.Tensor] | torch.Tensor | None = None,
        *,
        is_multimodal: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        """Token embeddings, with the clips' features over their rows (the whole row, as ESPnet
        overwrites the summed embedding; aux streams of prompt rows are pad)."""
        embeds = self.model.embed_input_ids(input_ids)
        if multimodal_embeddings is None or len(multimodal_embeddings) == 0 or is_multimodal is None:
            return embeds
        if not isinstance(multimodal_embeddings, torch.Tensor):
            multimodal_embeddings = torch.cat(list(multimodal_embeddings))
        # vLLM hands the mask on the host (indexing with it needs no device sync; masked_scatter
        # would need it on the embeddings' device).
        embeds[is_multimodal] = multimodal_embeddings.to(embeds.dtype)
        return embeds
