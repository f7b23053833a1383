"""Audio codecs that turn a speech LM's codec streams into waveforms.

Every decoder has the same interface: `forward(codes [B, Q, T])` (checked) and `decode` (not
checked, for the engine) return [B, samples]; `config.num_quantizers / hop_length /
sample_rate / codebook_size`. `load_codec_decoder` picks one from the checkpoint's `codec` spec.
"""

from __future__ import annotations

import os

import torch

from vllm_omni_speechlm.codec.dac import DacDecoder, write_tiny_dac
from vllm_omni_speechlm.codec.xcodec import XCodecDecoder, XCodecDecoderConfig, write_tiny_xcodec
from vllm_omni_speechlm.config import CodecSpec

__all__ = ["DacDecoder", "XCodecDecoder", "XCodecDecoderConfig", "decode_segments", "load_codec_decoder",
           "write_tiny_dac", "write_tiny_xcodec"]


def load_codec_decoder(spec: CodecSpec, model_dir: str | os.PathLike, device: str | torch.device = "cpu") -> torch.nn.Module:
    """The decoder of `spec.type` from `<model_dir>/<spec.path>`, in float32."""
    path = os.path.join(model_dir, spec.path)
    if spec.type == "xcodec":
        return XCodecDecoder.from_pretrained(path, device=device).eval()
    if spec.type == "dac":
        return DacDecoder.from_pretrained(path, num_quantizers=spec.num_quantizers, device=device).eval()
    raise ValueError(f"speechlm config: codec.type: expected 'xcodec' or 'dac', got {spec.type!r}")


def decode_segments(codec: torch.nn.Module, segments: list[torch.Tensor]) -> torch.Tensor | None:
    """An answer's audio: each segment's [T_i, Q] codes decoded on its own (ESPnet writes each
    segment to its own file), the waveforms back to back; None without audio segments."""
    if not segments:
        return None
    return torch.cat([codec(codes.T[None])[0] for codes in segments])
