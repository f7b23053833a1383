"""DAC decoder only: audio codes [B, Q, T] -> waveform [B, T * hop - trim], as transformers'
`DacModel.decode(audio_codes=...)` runs it, in plain PyTorch and without the encoder:

    codes [B, Q, T]
      -> residual VQ from codes: sum_q out_proj_q(codebook_q[codes[:, q]])   [B, hidden, T]
      -> decoder: conv1 (k7)                                                 [B, decoder_hidden, T]
           per upsampling ratio r (channels halve each block):
             Snake -> ConvTranspose1d(k=2r, stride=r, pad=ceil(r/2)) -> 3 residual units
             (Snake, conv k7 dilation 1/3/9, Snake, conv k1, + skip)
           Snake -> conv2 (k7, -> 1 channel) -> tanh                         [B, 1, N]

OpusLM decodes its 8 DAC streams with the first 8 quantizers of the 16 kHz DAC (hop 320,
12 codebooks of 1024); `num_quantizers` < the checkpoint's `n_codebooks` loads only those.
The transposed convolutions have no output padding, so an odd ratio loses one sample per input
frame of that block: for ratios (8, 5, 4, 2) N = 320 T - 8 (the last 8 samples of the clip are
missing; frames still start at t * 320, so windows decode in place).

Parameter names are transformers' `DacModel`'s (`quantizer.quantizers.{q}.codebook.weight`,
`quantizer.quantizers.{q}.out_proj.*`, `decoder.*`), so a `descript/dac_16khz` checkpoint loads as
is (encoder and `in_proj` tensors skipped, weight norm folded). Receptive field: the decoder has
X-Codec's acoustic-decoder geometry (codec/xcodec.py), so frame f depends on frames f-10..f+10
and the streaming processor's 10-frame holdback keeps windowed decoding exact.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vllm_omni_speechlm.codec.xcodec import (  # X-Codec's acoustic decoder is DAC's
    Snake1d,
    XCodecDecoderBlock,
    load_decoder_weights,
    receptive_field_frames,
)

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class DacDecoderConfig:
    hidden_size: int = 1024  # encoder_hidden_size * 2 ** len(downsampling_ratios)
    decoder_hidden_size: int = 1536
    upsampling_ratios: tuple[int, ...] = (8, 5, 4, 2)
    num_quantizers: int = 8  # used by the speech LM (<= the checkpoint's n_codebooks)
    codebook_size: int = 1024
    codebook_dim: int = 8
    sample_rate: int = 16000

    @property
    def hop_length(self) -> int:
        return math.prod(self.upsampling_ratios)

    @property
    def receptive_field_frames(self) -> tuple[int, int]:
        """(left, right) input frames an output frame depends on (streaming windows' margins)."""
        return receptive_field_frames(self.upsampling_ratios)

    def num_samples(self, num_frames: int) -> int:
        """Output length of `num_frames` frames (odd ratios drop a sample per input step)."""
        n = num_frames
        for r in self.upsampling_ratios:
            n = (n - 1) * r - 2 * math.ceil(r / 2) + 2 * r
        return n

    @classmethod
    def from_dac_dict(cls, d: dict[str, Any], num_quantizers: int | None = None) -> DacDecoderConfig:
        """From transformers' DacConfig fields (config.json of a DacModel checkpoint)."""
        down = tuple(d.get("downsampling_ratios", (2, 4, 8, 8)))
        n_codebooks = d.get("n_codebooks", 9)
        num_q = n_codebooks if num_quantizers is None else num_quantizers
        if not 1 <= num_q <= n_codebooks:
            raise ValueError(f"dac checkpoint: num_quantizers {num_q} not in [1, n_codebooks={n_codebooks}]")
        return cls(
            hidden_size=d.get("encoder_hidden_size", 64) * 2 ** len(down),
            decoder_hidden_size=d.get("decoder_hidden_size", 1536),
            upsampling_ratios=down[::-1],
            num_quantizers=num_q,
            codebook_size=d.get("codebook_size", 1024),
            codebook_dim=d.get("codebook_dim", 8),
            sample_rate=d.get("sampling_rate", 16000),
        )


class DacWaveDecoder(nn.Module):
    def __init__(self, c: DacDecoderConfig) -> None:
        super().__init__()
        self.conv1 = nn.Conv1d(c.hidden_size, c.decoder_hidden_size, kernel_size=7, padding=3)
        chans = [c.decoder_hidden_size // 2**i for i in range(len(c.upsampling_ratios) + 1)]
        self.block = nn.ModuleList(
            XCodecDecoderBlock(chans[i], chans[i + 1], r, exact_length=False) for i, r in enumerate(c.upsampling_ratios)
        )
        self.snake1 = Snake1d(chans[-1])
        self.conv2 = nn.Conv1d(chans[-1], 1, kernel_size=7, padding=3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return torch.tanh(self.conv2(self.snake1(x)))


class DacCodebook(nn.Module):
    def __init__(self, c: DacDecoderConfig) -> None:
        super().__init__()
        self.codebook = nn.Embedding(c.codebook_size, c.codebook_dim)
        self.out_proj = nn.Conv1d(c.codebook_dim, c.hidden_size, kernel_size=1)


class DacQuantizer(nn.Module):
    def __init__(self, c: DacDecoderConfig) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(DacCodebook(c) for _ in range(c.num_quantizers))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, Q, T] -> [B, hidden, T] (summed in quantizer order, as transformers does)."""
        out = 0.0
        for q, vq in enumerate(self.quantizers):
            out = out + vq.out_proj(vq.codebook(codes[:, q, :]).transpose(1, 2))
        return out


class DacDecoder(nn.Module):
    """Decoder-only DAC with the codec-stage interface shared with `XCodecDecoder`."""

    def __init__(self, config: DacDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.quantizer = DacQuantizer(config)
        self.decoder = DacWaveDecoder(config)

    def check_codes(self, codes: torch.Tensor) -> None:
        c = self.config
        if not isinstance(codes, torch.Tensor) or codes.dtype.is_floating_point or codes.dim() != 3:
            raise ValueError(f"dac decode: codes must be an integer [batch, {c.num_quantizers}, frames] tensor")
        if codes.shape[1] != c.num_quantizers or codes.shape[0] < 1 or codes.shape[2] < 1:
            raise ValueError(f"dac decode: codes must be [batch, {c.num_quantizers}, frames], got {tuple(codes.shape)}")
        if int(codes.min()) < 0 or int(codes.max()) >= c.codebook_size:
            raise ValueError(f"dac decode: codes must lie in [0, {c.codebook_size})")

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """[B, Q, T] valid codes -> [B, num_samples(T)] (no checks, no host sync)."""
        return self.decoder(self.quantizer(codes.long())).squeeze(1)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        self.check_codes(codes)
        return self.decode(codes.to(self.decoder.conv1.weight.device))

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike, num_quantizers: int | None = None, dtype=torch.float32, device="cpu"
    ) -> DacDecoder:
        """A DacModel checkpoint directory (config.json in DacConfig's format, model.safetensors)."""
        path = os.fspath(path)
        with open(os.path.join(path, CONFIG_NAME), encoding="utf-8") as f:
            config = DacDecoderConfig.from_dac_dict(json.load(f), num_quantizers)
        with torch.device("meta"):
            model = cls(config)
        return load_decoder_weights(model, os.path.join(path, WEIGHTS_NAME), "dac", dtype, device)


# ---- tiny random checkpoint (tests) ---------------------------------------------------------
# DacConfig fields of a tiny 16 kHz / hop 320 / 8 x 1024 DAC (hidden 2 * 2**4 = 32).
TINY_DAC_CONFIG = {
    "model_type": "dac",
    "architectures": ["DacModel"],
    "encoder_hidden_size": 2,
    "downsampling_ratios": [2, 4, 5, 8],
    "decoder_hidden_size": 64,
    "n_codebooks": 8,
    "codebook_size": 1024,
    "codebook_dim": 8,
    "sampling_rate": 16000,
}


def write_tiny_dac(out_dir: str | os.PathLike, seed: int) -> None:
    """config.json (DacConfig format: transformers' DacModel builds from it) + the decoder's random
    weights (the encoder is never used here). Same seed -> same bytes."""
    from safetensors.torch import save_file

    config = DacDecoderConfig.from_dac_dict(TINY_DAC_CONFIG)
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in DacDecoder(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for key in sorted(shapes):
        shape = shapes[key]
        if key.endswith("alpha"):
            t = 1.0 + 0.2 * torch.rand(shape, generator=gen)
        elif key.endswith("codebook.weight"):
            t = torch.randn(shape, generator=gen)
        elif key.endswith("bias"):
            t = 0.01 * torch.randn(shape, generator=gen)
        else:  # conv weights: fan-in scaled (ConvTranspose1d's fan-in is dim 0)
            fan_in = (shape[0] if "conv_t" in key else shape[1]) * shape[2]
            t = torch.randn(shape, generator=gen) / math.sqrt(fan_in)
            if key == "decoder.conv2.weight":
                t = 0.2 * t  # keep the final tanh mostly out of saturation
        state[key] = t.contiguous()
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(TINY_DAC_CONFIG, f, indent=2, sort_keys=True)
    save_file(state, os.path.join(out_dir, WEIGHTS_NAME), metadata={"format": "pt"})
