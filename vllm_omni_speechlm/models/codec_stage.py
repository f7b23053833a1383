"""Stage 1 of the two-stage pipelines: the codec decoder (X-Codec for Bagpiper, DAC for
OpusLM, from the checkpoint's `codec.type`) as a vllm-omni generation model.

Each scheduled request carries one window from stage_input_processors/speech_codec.py as its
prompt: flattened codebook indices `[T_win * Q]` (frame-major) plus `meta.left_context_size` /
`meta.right_holdback_size` in its runtime information. One forward decodes all windows of the
step, windows of equal length together in one batched codec call (unequal lengths are not padded:
padding frames would change the last real frames' audio, which at a clip's end is kept), and
returns per request only the new audio: `[(T_win - left - holdback) * hop]` float32 at 16 kHz
(DAC's last window is 8 samples short, as its whole-clip decoding is: `codec/dac.py`).

Weights: the codec checkpoint under `<model_dir>/<speechlm.codec.path>` (not the LM's
safetensors, which the engine's loader streams through `load_weights` and this stage drains).
The codec runs in float32 whatever the engine dtype: it is small next to the LM, and streaming
is checked against float32 whole-clip decoding.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm_omni_speechlm.codec import load_codec_decoder
from vllm_omni_speechlm.config import SpeechLMConfig


def _meta_int(info: Any, key: str) -> int:
    meta = info.get("meta", {}) if isinstance(info, dict) else {}
    value = meta.get(key, 0) if isinstance(meta, dict) else 0
    if isinstance(value, list):  # scalars may arrive wrapped
        value = value[0] if value else 0
    return int(value)


class SpeechLMCodecDecoder(nn.Module):
    """Generation-stage codec decoder (decoder path only)."""

    have_multimodal_outputs = True
    has_preprocess = False
    has_postprocess = False
    requires_raw_input_tokens = True

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        self._setup(vllm_config.model_config.model, vllm_config.device_config.device)

    @classmethod
    def from_model_dir(cls, model_dir: str, device: str | torch.device = "cpu") -> SpeechLMCodecDecoder:
        """The same stage model outside an engine (tests, tools)."""
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model._setup(model_dir, device)
        return model

    def _setup(self, model_dir: str, device: str | torch.device) -> None:
        self.cfg = SpeechLMConfig.from_model_dir(model_dir)
        self.codec = load_codec_decoder(self.cfg.codec, model_dir, device=device)
        self.num_quantizers = self.codec.config.num_quantizers
        self.hop = self.codec.config.hop_length
        self.sample_rate = self.codec.config.sample_rate

    # ---- engine hooks ---------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        # The runner asks for embeddings; this stage reads the ids themselves.
        return torch.zeros((input_ids.shape[0], 1), device=input_ids.device, dtype=torch.float32)

    def compute_logits(self, hidden_states: Any, sampling_metadata: Any = None) -> None:
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _ in weights:  # the LM's tensors; the codec was loaded from its own checkpoint
            pass
        return {name for name, _ in self.named_parameters()}

    # ---- decode ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        runtime_additional_information: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> Any:
        """input_ids: [sum_i T_i * Q] windows back to back; seq_token_counts: [T_i * Q] per request."""
        from vllm_omni.model_executor.models.output_templates import OmniOutput

        ids = input_ids.reshape(-1) if input_ids is not None else torch.zeros(0, dtype=torch.long)
        counts = list(kwargs.get("seq_token_counts") or [int(ids.numel())])
        infos = list(runtime_additional_information or [])
        infos += [{}] * (len(counts) - len(infos))
        windows = [w[: w.numel() - w.numel() % self.num_quantizers] for w in torch.split(ids, counts)]
        audio = self.decode_windows(windows, infos)
        sr = torch.tensor(self.sample_rate, dtype=torch.int32)
        return OmniOutput(text_hidden_states=None, multimodal_outputs={"model_outputs": audio, "sr": [sr] * len(audio)})

    def decode_windows(self, windows: list[torch.Tensor], infos: list[dict]) -> list[torch.Tensor]:
        """windows[i]: [T_i * Q] frame-major codes -> [(T_i - left_i - holdback_i) * hop] new audio."""
        out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.float32)] * len(windows)
        by_len: dict[int, list[int]] = {}
        for i, w in enumerate(windows):
            if w.numel():
                by_len.setdefault(w.numel(), []).append(i)
        for idx in by_len.values():
            codes = torch.stack([windows[i] for i in idx]).view(len(idx), -1, self.num_quantizers)  # [B, T, Q]
            # The processor clamps to [0, codebook_size); clamp again so a stray id (a dummy run)
            # cannot index out of the codebooks.
            codes = codes.clamp(0, self.codec.config.codebook_size - 1).transpose(1, 2)  # [B, Q, T]
            wav = self.codec.decode(codes).float()  # [B, ~T * hop]
            for row, i in enumerate(idx):
                out[i] = self._trim(wav[row], codes.shape[-1], infos[i])
        return out

    def _trim(self, wav: torch.Tensor, num_frames: int, info: dict) -> torch.Tensor:
        """Keep the new frames: drop left context and right holdback (counted in frames: a
        decoder may return a few samples less than T * hop at the clip's end)."""
        start = _meta_int(info, "left_context_size") * self.hop
        end = min(wav.shape[-1], (num_frames - _meta_int(info, "right_holdback_size")) * self.hop)
        return wav[start:max(start, end)].contiguous()


BagpiperCodecDecoder = SpeechLMCodecDecoder  # the architecture name Bagpiper's pipelines use
SpeechLMCodecDecoderForGeneration = SpeechLMCodecDecoder
BagpiperCodecDecoderForGeneration = SpeechLMCodecDecoder
