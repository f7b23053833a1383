"""X-Codec decoder only: audio codes [B, Q, T] -> 16 kHz waveform [B, T * hop_length].

This is the decode half of X-Codec as transformers' `XcodecModel.decode` runs it, in plain
PyTorch and without the semantic (HuBERT) model, the semantic encoder/decoder or the acoustic
encoder, none of which decoding touches:

    codes [B, Q, T]
      -> residual VQ decode: sum_q embed_q[codes[:, q]]            [B, T, codebook_dim]
      -> fc2 (Linear codebook_dim -> acoustic_hidden_size)         [B, acoustic_hidden_size, T]
      -> acoustic decoder (DAC decoder as X-Codec adjusts it):
           conv1 (k7)                                              [B, decoder_hidden_size, T]
           per upsampling ratio r_i (channels halve each block):
             Snake -> ConvTranspose1d(k=2r, stride=r, pad=ceil(r/2), output_padding=r%2)
             -> 3 residual units (Snake, conv k7 dilation 1/3/9, Snake, conv k1, + skip)
           Snake -> conv2 (k7, -> 1 channel); no tanh (X-Codec drops DAC's final tanh)
                                                                   [B, 1, T * hop_length]

Parameter names are those of transformers' `XcodecModel` checkpoints (`fc2.*`,
`acoustic_decoder.*`, `quantizer.quantizers.{q}.codebook.embed`), so a real
`hf-audio/xcodec-hubert-general` `model.safetensors` loads as is; its encoder, semantic and
codebook-statistics tensors are skipped. Weight-normalised convolutions are folded at load time,
both in the original `weight_g`/`weight_v` naming and in torch's parametrization naming
(`parametrizations.weight.original0/1`). (transformers' conversion script removes weight norm
before saving, so the hf-audio checkpoints should hold plain `weight`s.)

Receptive field. Measured with `measure_receptive_field` (change all Q codes of one frame t in
the middle of a clip, float64, see which output samples change; random weights, so this is the
structural support, which trained weights cannot widen) and computed from the layer geometry by
`XCodecDecoderConfig.receptive_field_samples` / `receptive_field_frames`; the two agree (tests):

    geometry (upsampling 8,5,4,2; hop 320)       frame t changes samples        frame f depends on
    real:  256 -> 1024 -> 512 -> ... -> 64 ch    t*320 - 3141 .. t*320 + 3452   frames f-10 .. f+10
    tiny:   16 ->   64 ->  32 -> ... ->  4 ch    same (channel counts do not matter)

The reach is dominated by the first block (after conv1's +-3 frames, the 8x block's residual
units add +-39 samples at 8 samples/frame, about +-5 frames). The codec is not causal: a
streaming decoder that decodes a window and keeps the output of frames [s, e) matches whole-clip
decoding (to float rounding: < 1e-9 in float64) iff the window holds >= 10 frames of left
context before s and >= 10 frames of lookahead after e - 1, clip edges excepted (whole-clip
decoding zero-pads there too). Verified by decoding windows: with 9 frames on either side the
kept frames' error is O(1) with random weights.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"

# XcodecConfig merges these under any `acoustic_model_config` dict it is given (and uses them when
# there is none), so a checkpoint's config.json may omit them.
_XCODEC_ACOUSTIC_DEFAULTS: dict[str, Any] = {
    "encoder_hidden_size": 64,
    "downsampling_ratios": [8, 5, 4, 2],
    "decoder_hidden_size": 1024,
    "upsampling_ratios": [8, 5, 4, 2],
    "hidden_size": 256,
}
# HubertConfig's default hidden size (the semantic model's width enters fc2's input size).
_HUBERT_DEFAULT_HIDDEN_SIZE = 768

# DAC residual units: kernel 7, dilations 1, 3, 9 (fixed by the architecture, not the config).
_RES_UNIT_KERNEL = 7
_RES_UNIT_DILATIONS = (1, 3, 9)
_OUTER_CONV_KERNEL = 7


def _fail(name: str, message: str) -> ValueError:
    return ValueError(f"xcodec config: {name}: {message}")


# ------------------------------------------------------------------------------------------------
# Config
# ------------------------------------------------------------------------------------------------


@dataclass
class XCodecDecoderConfig:
    """The decode-relevant part of transformers' `XcodecConfig`.

    Field names follow XcodecConfig; the acoustic (DAC) ones are flattened with an `acoustic_`
    prefix where XcodecConfig nests them in `acoustic_model_config`. Derived fields (`hop_length`,
    `num_quantizers`, `codebook_dim`) may be left None and are then computed the way XcodecConfig
    computes them; when given they must agree.
    """

    sample_rate: int = 16000
    codebook_size: int = 1024
    # XcodecConfig derives the number of quantizers from the highest target bandwidth:
    # 1000 * bw[-1] // (frame_rate * ceil(log2(codebook_size))) -> 4000 // (50 * 10) = 8.
    target_bandwidths: tuple[float, ...] = (0.5, 1, 1.5, 2, 4)
    num_quantizers: int | None = None
    # Codebook vector width == fc2's input width == XcodecConfig.hidden_size
    # (acoustic hidden size + semantic hidden size).
    codebook_dim: int | None = None
    semantic_hidden_size: int = _HUBERT_DEFAULT_HIDDEN_SIZE
    acoustic_hidden_size: int = 256  # DacConfig.hidden_size: fc2 output, decoder input channels
    decoder_hidden_size: int = 1024  # DacConfig.decoder_hidden_size: channels after conv1
    upsampling_ratios: tuple[int, ...] = (8, 5, 4, 2)
    hop_length: int | None = None  # samples per frame == prod(upsampling_ratios)

    def __post_init__(self) -> None:
        self.target_bandwidths = tuple(self.target_bandwidths)
        self.upsampling_ratios = tuple(self.upsampling_ratios)
        for name in ("sample_rate", "codebook_size", "semantic_hidden_size", "acoustic_hidden_size",
                     "decoder_hidden_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise _fail(name, f"must be a positive int, got {value!r}")
        if self.codebook_size < 2:
            raise _fail("codebook_size", f"must be >= 2, got {self.codebook_size}")
        if not self.upsampling_ratios or any(
            isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in self.upsampling_ratios
        ):
            raise _fail("upsampling_ratios", f"must be non-empty positive ints, got {self.upsampling_ratios}")
        if self.decoder_hidden_size // 2 ** len(self.upsampling_ratios) < 1:
            raise _fail(
                "decoder_hidden_size",
                f"{self.decoder_hidden_size} halves to 0 channels over {len(self.upsampling_ratios)} upsampling blocks",
            )

        hop = math.prod(self.upsampling_ratios)
        if self.hop_length is None:
            self.hop_length = hop
        elif self.hop_length != hop:
            raise _fail(
                "hop_length",
                f"must equal the product of upsampling_ratios {list(self.upsampling_ratios)} = {hop}, "
                f"got {self.hop_length}",
            )

        if not self.target_bandwidths or any(b <= 0 for b in self.target_bandwidths):
            raise _fail("target_bandwidths", f"must be non-empty and positive, got {self.target_bandwidths}")
        derived_q = int(1000 * self.target_bandwidths[-1] // (self.frame_rate * self.codebook_nbits))
        if self.num_quantizers is None:
            self.num_quantizers = derived_q
        elif self.num_quantizers != derived_q:
            raise _fail(
                "num_quantizers",
                f"{self.num_quantizers} disagrees with XcodecConfig's derivation from target_bandwidths "
                f"{list(self.target_bandwidths)}, sample_rate {self.sample_rate}, hop_length {self.hop_length} "
                f"and codebook_size {self.codebook_size}: {derived_q}",
            )
        if self.num_quantizers < 1:
            raise _fail("num_quantizers", f"must be >= 1, got {self.num_quantizers}")

        fc2_in = self.acoustic_hidden_size + self.semantic_hidden_size
        if self.codebook_dim is None:
            self.codebook_dim = fc2_in
        elif self.codebook_dim != fc2_in:
            # XcodecModel.decode feeds the summed codebook vectors straight into fc2.
            raise _fail(
                "codebook_dim",
                f"must equal acoustic_hidden_size + semantic_hidden_size = {fc2_in} (fc2's input), "
                f"got {self.codebook_dim}",
            )

    @property
    def frame_rate(self) -> int:
        return math.ceil(self.sample_rate / self.hop_length)

    @property
    def codebook_nbits(self) -> int:
        return math.ceil(math.log2(self.codebook_size))

    @property
    def receptive_field_samples(self) -> tuple[int, int]:
        """(lo, hi): frame t's codes can change output samples t*hop + lo .. t*hop + hi
        (away from the clip edges), from the layer geometry."""
        return _frame_support(self.upsampling_ratios)

    @property
    def receptive_field_frames(self) -> tuple[int, int]:
        """(left, right): output frame f depends exactly on input frames f-left .. f+right.

        Computed by pushing the index support of one frame through every layer (pointwise ops
        do not widen it). `left` is the left context and `right` the lookahead a streaming window
        needs around the frames it keeps to match whole-clip decoding.
        """
        return receptive_field_frames(self.upsampling_ratios)

    # --- serialisation -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Flat form of this config (round-trips through `from_dict`)."""
        out = dataclasses.asdict(self)
        out["target_bandwidths"] = list(self.target_bandwidths)
        out["upsampling_ratios"] = list(self.upsampling_ratios)
        return out

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> XCodecDecoderConfig:
        """Build from either this class's flat `to_dict` form or an `XcodecConfig` config.json."""
        if not isinstance(config, dict):
            raise ValueError(f"xcodec config: expected a dict, got {type(config).__name__}")
        if config.get("model_type") == "xcodec" or "acoustic_model_config" in config:
            return cls._from_xcodec_dict(config)
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - names)
        if unknown:
            raise ValueError(f"xcodec config: unknown fields {unknown} (known: {sorted(names)})")
        return cls(**config)

    @classmethod
    def _from_xcodec_dict(cls, config: dict[str, Any]) -> XCodecDecoderConfig:
        acoustic = {**_XCODEC_ACOUSTIC_DEFAULTS, **(config.get("acoustic_model_config") or {})}
        semantic = config.get("semantic_model_config") or {}
        sample_rate = config.get("sample_rate", 16000)
        # XcodecConfig's hop_length (which sets frame rate and thus num_quantizers) is the product
        # of the *down*sampling ratios; the decoder upsamples by the upsampling ratios. Passing
        # the former as hop_length makes a mismatch a validation error instead of a silent one.
        return cls(
            sample_rate=sample_rate,
            codebook_size=config.get("codebook_size", 1024),
            target_bandwidths=tuple(config.get("target_bandwidths", (0.5, 1, 1.5, 2, 4))),
            codebook_dim=config.get("codebook_dim"),
            semantic_hidden_size=semantic.get("hidden_size", _HUBERT_DEFAULT_HIDDEN_SIZE),
            acoustic_hidden_size=acoustic["hidden_size"],
            decoder_hidden_size=acoustic["decoder_hidden_size"],
            upsampling_ratios=tuple(acoustic["upsampling_ratios"]),
            hop_length=math.prod(acoustic["downsampling_ratios"]),
        )

    def to_xcodec_dict(
        self,
        semantic_model_config: dict[str, Any] | None = None,
        encoder_hidden_size: int = 64,
    ) -> dict[str, Any]:
        """This config in XcodecConfig's config.json format (transformers can build XcodecModel
        from it). The semantic model and acoustic encoder are not ours; their settings only have
        to be consistent (`semantic_model_config["hidden_size"]` is forced to ours)."""
        semantic = {"model_type": "hubert", **(semantic_model_config or {})}
        semantic["hidden_size"] = self.semantic_hidden_size
        return {
            "architectures": ["XcodecModel"],
            "model_type": "xcodec",
            "sample_rate": self.sample_rate,
            "codebook_size": self.codebook_size,
            "codebook_dim": self.codebook_dim,
            "target_bandwidths": list(self.target_bandwidths),
            "kernel_size": 3,
            "channel_ratios": [1, 1],
            "strides": [1, 1],
            "block_dilations": [1, 1],
            "unit_kernel_size": 3,
            "acoustic_model_config": {
                "model_type": "dac",
                "encoder_hidden_size": encoder_hidden_size,
                # X-Codec's encoder downsamples by the same list the decoder upsamples by.
                "downsampling_ratios": list(self.upsampling_ratios),
                "upsampling_ratios": list(self.upsampling_ratios),
                "decoder_hidden_size": self.decoder_hidden_size,
                "hidden_size": self.acoustic_hidden_size,
                "sampling_rate": self.sample_rate,
            },
            "semantic_model_config": semantic,
        }


def _frame_support(upsampling_ratios: tuple[int, ...]) -> tuple[int, int]:
    """Sample offsets [lo, hi] (relative to t * hop_length) that frame t's codes can change,
    ignoring clip edges."""
    res_reach = sum((_RES_UNIT_KERNEL - 1) // 2 * d for d in _RES_UNIT_DILATIONS)  # 3 + 9 + 27
    outer = (_OUTER_CONV_KERNEL - 1) // 2
    # Index support [lo, hi] at the current rate, starting at frame rate around index 0.
    lo, hi = -outer, outer  # decoder conv1
    for r in upsampling_ratios:
        pad = math.ceil(r / 2)
        # ConvTranspose1d(k=2r, stride=r, padding=pad): input i writes outputs i*r - pad + [0, 2r).
        lo, hi = lo * r - pad, hi * r - pad + 2 * r - 1
        lo, hi = lo - res_reach, hi + res_reach
    return lo - outer, hi + outer  # decoder conv2


# ------------------------------------------------------------------------------------------------
# Quantizer (decode side of XcodecResidualVectorQuantization)
# ------------------------------------------------------------------------------------------------


class XCodecEuclideanCodebook(nn.Module):
    """One codebook. Only `embed` is used to decode; it is a buffer, as in XcodecModel."""

    def __init__(self, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        self.register_buffer("embed", torch.zeros(codebook_size, codebook_dim))

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T] -> vectors [B, T, codebook_dim]"""
        return F.embedding(codes, self.embed)


class XCodecVectorQuantizer(nn.Module):
    """Holds `codebook` so parameter names match `quantizer.quantizers.{q}.codebook.embed`."""

    def __init__(self, codebook_size: int, codebook_dim: int) -> None:
        super().__init__()
        self.codebook = XCodecEuclideanCodebook(codebook_size, codebook_dim)

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, T] -> vectors [B, T, codebook_dim]"""
        return self.codebook(codes)


class XCodecResidualVQ(nn.Module):
    """Residual VQ decode: the sum of every quantizer's codebook vectors."""

    def __init__(self, config: XCodecDecoderConfig) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(
            XCodecVectorQuantizer(config.codebook_size, config.codebook_dim) for _ in range(config.num_quantizers)
        )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """codes [B, Q, T] -> summed vectors [B, T, codebook_dim]"""
        # Same order of additions as XcodecResidualVectorQuantization.decode (q = 0, 1, ...).
        quantized = self.quantizers[0](codes[:, 0])
        for q in range(1, codes.shape[1]):
            quantized = quantized + self.quantizers[q](codes[:, q])
        return quantized


def receptive_field_frames(upsampling_ratios: tuple[int, ...]) -> tuple[int, int]:
    """(left, right) input frames an output frame depends on, for the DAC-style acoustic decoder
    (X-Codec's and DAC's) with these upsampling ratios."""
    lo, hi = _frame_support(upsampling_ratios)
    # Frame t changes samples [t*hop + lo, t*hop + hi]; output frame f (samples
    # [f*hop, f*hop + hop - 1]) sees frame t = f - d iff d*hop <= hi and d*hop + hop - 1 >= lo.
    hop = math.prod(upsampling_ratios)
    return hi // hop, (hop - 1 - lo) // hop


# ------------------------------------------------------------------------------------------------
# Acoustic decoder (DacDecoder as XcodecModel adjusts it)
# ------------------------------------------------------------------------------------------------


def snake(x: torch.Tensor, alpha: torch.Tensor) -> torch.Tensor:
    """Snake activation x + sin^2(alpha x) / alpha: x [B, C, N], alpha [1, C, 1]."""
    # Same expression (and 1e-9 guard) as transformers' DAC Snake1d, for bitwise-close output.
    return x + (alpha + 1e-9).reciprocal() * torch.sin(alpha * x).pow(2)


class Snake1d(nn.Module):
    """Snake activation, per channel: `snake`, or one kernel once `fuse_snakes` ran."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(1, channels, 1))
        self.inv_alpha: torch.Tensor | None = None  # set by fuse_snakes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, N] -> [B, C, N]"""
        if self.inv_alpha is None:
            return snake(x, self.alpha)
        from vllm_omni_speechlm.codec.fused_snake import fused_snake

        return fused_snake(x, self.alpha, self.inv_alpha)


def fuse_snakes(decoder: nn.Module) -> None:
    """Compute every Snake of a decoder on CUDA as one Triton kernel (codec/fused_snake.py: the
    same samples, ~1.6x faster decodes under load on an H100)."""
    snakes = [m for m in decoder.modules() if isinstance(m, Snake1d)]
    if snakes and snakes[0].alpha.device.type != "cuda":
        raise ValueError(f"fused Snakes need a decoder on CUDA, not {snakes[0].alpha.device}")
    for m in snakes:
        m.inv_alpha = (m.alpha.detach() + 1e-9).reciprocal()  # as `snake` computes it


class XCodecResidualUnit(nn.Module):
    """Snake -> dilated conv k7 -> Snake -> conv k1, plus the skip. Length-preserving (DAC's too)."""

    def __init__(self, channels: int, dilation: int) -> None:
        super().__init__()
        pad = (_RES_UNIT_KERNEL - 1) * dilation // 2
        self.snake1 = Snake1d(channels)
        self.conv1 = nn.Conv1d(channels, channels, kernel_size=_RES_UNIT_KERNEL, dilation=dilation, padding=pad)
        self.snake2 = Snake1d(channels)
        self.conv2 = nn.Conv1d(channels, channels, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C, N] -> [B, C, N]"""
        return x + self.conv2(self.snake2(self.conv1(self.snake1(x))))


class XCodecDecoderBlock(nn.Module):
    """Snake -> ConvTranspose1d upsampling by `stride` (channels halve) -> 3 residual units.
    DAC's decoder block too (`exact_length=False`)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int, exact_length: bool = True) -> None:
        super().__init__()
        self.snake1 = Snake1d(in_channels)
        # X-Codec sets output_padding = stride % 2 so the output is exactly N * stride samples for
        # odd strides too (the 5 in 8, 5, 4, 2); DAC (exact_length=False) uses 0.
        self.conv_t1 = nn.ConvTranspose1d(
            in_channels,
            out_channels,
            kernel_size=2 * stride,
            stride=stride,
            padding=math.ceil(stride / 2),
            output_padding=stride % 2 if exact_length else 0,
        )
        self.res_unit1 = XCodecResidualUnit(out_channels, dilation=_RES_UNIT_DILATIONS[0])
        self.res_unit2 = XCodecResidualUnit(out_channels, dilation=_RES_UNIT_DILATIONS[1])
        self.res_unit3 = XCodecResidualUnit(out_channels, dilation=_RES_UNIT_DILATIONS[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, C_in, N] -> [B, C_out, N * stride]"""
        x = self.conv_t1(self.snake1(x))
        return self.res_unit3(self.res_unit2(self.res_unit1(x)))


class XCodecAcousticDecoder(nn.Module):
    """conv1 -> upsampling blocks -> Snake -> conv2 (to 1 channel). No final tanh (X-Codec)."""

    def __init__(self, config: XCodecDecoderConfig) -> None:
        super().__init__()
        channels = config.decoder_hidden_size
        outer_pad = (_OUTER_CONV_KERNEL - 1) // 2
        self.conv1 = nn.Conv1d(config.acoustic_hidden_size, channels, kernel_size=_OUTER_CONV_KERNEL,
                               padding=outer_pad)
        # Channel widths use floor division, as DAC's decoder does.
        self.block = nn.ModuleList(
            XCodecDecoderBlock(channels // 2**i, channels // 2 ** (i + 1), stride)
            for i, stride in enumerate(config.upsampling_ratios)
        )
        out_channels = channels // 2 ** len(config.upsampling_ratios)
        self.snake1 = Snake1d(out_channels)
        self.conv2 = nn.Conv1d(out_channels, 1, kernel_size=_OUTER_CONV_KERNEL, padding=outer_pad)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, acoustic_hidden_size, T] -> [B, 1, T * hop_length]"""
        x = self.conv1(x)
        for block in self.block:
            x = block(x)
        return self.conv2(self.snake1(x))


# ------------------------------------------------------------------------------------------------
# The decoder
# ------------------------------------------------------------------------------------------------


class XCodecDecoder(nn.Module):
    """X-Codec codes -> waveform, equal to `XcodecModel.decode` for the same weights."""

    def __init__(self, config: XCodecDecoderConfig) -> None:
        super().__init__()
        self.config = config
        self.quantizer = XCodecResidualVQ(config)
        self.fc2 = nn.Linear(config.codebook_dim, config.acoustic_hidden_size)
        self.acoustic_decoder = XCodecAcousticDecoder(config)

    @property
    def hop_length(self) -> int:
        return self.config.hop_length

    @property
    def sample_rate(self) -> int:
        return self.config.sample_rate

    @property
    def num_quantizers(self) -> int:
        return self.config.num_quantizers

    def check_codes(self, codes: torch.Tensor) -> None:
        """Raise ValueError unless `codes` is an integer [B, num_quantizers, T] tensor with
        B >= 1, T >= 1 and every value in [0, codebook_size)."""
        if not isinstance(codes, torch.Tensor):
            raise ValueError(f"xcodec decode: codes must be a torch.Tensor, got {type(codes).__name__}")
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            raise ValueError(f"xcodec decode: codes must be an integer tensor, got {codes.dtype}")
        if codes.dim() != 3:
            raise ValueError(
                f"xcodec decode: codes must be [batch, num_quantizers={self.num_quantizers}, frames], "
                f"got shape {tuple(codes.shape)}"
            )
        batch, num_q, frames = codes.shape
        if num_q != self.num_quantizers:
            raise ValueError(
                f"xcodec decode: codes must have {self.num_quantizers} quantizers in dim 1 "
                f"([batch, num_quantizers, frames]), got shape {tuple(codes.shape)}"
            )
        if batch < 1 or frames < 1:
            raise ValueError(f"xcodec decode: codes must have batch >= 1 and frames >= 1, got {tuple(codes.shape)}")
        lo, hi = int(codes.min()), int(codes.max())
        if lo < 0 or hi >= self.config.codebook_size:
            raise ValueError(
                f"xcodec decode: codes must lie in [0, {self.config.codebook_size}), got values in [{lo}, {hi}]"
            )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        """Decode codes to audio.

        Args:
            codes: LongTensor [B, Q, T], Q == num_quantizers, values in [0, codebook_size).
        Returns:
            FloatTensor [B, T * hop_length] at `sample_rate`, in the module's dtype
            (XcodecModel.decode's [B, 1, N] without the channel dim). Not clipped to [-1, 1].
        """
        self.check_codes(codes)
        return self.decode(codes.to(device=self.fc2.weight.device))

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """`forward` without the checks (no host sync): codes must already be valid."""
        quantized = self.quantizer(codes.long())  # [B, T, codebook_dim]
        acoustic = self.fc2(quantized).transpose(1, 2)  # [B, acoustic_hidden_size, T]
        return self.acoustic_decoder(acoustic).squeeze(1)  # [B, T * hop_length]

    # --- loading -------------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike,
        dtype: torch.dtype = torch.float32,
        device: str | torch.device = "cpu",
    ) -> XCodecDecoder:
        """Load from a directory with `config.json` (XcodecConfig format or our flat one) and
        `model.safetensors` (an XcodecModel checkpoint or a decoder-only one)."""
        path = os.fspath(path)
        with open(os.path.join(path, CONFIG_NAME), encoding="utf-8") as f:
            config = XCodecDecoderConfig.from_dict(json.load(f))
        # Build on the meta device: every tensor is replaced by the checkpoint's.
        with torch.device("meta"):
            model = cls(config)
        return load_decoder_weights(model, os.path.join(path, WEIGHTS_NAME), "xcodec", dtype, device)


def load_decoder_weights(model: nn.Module, weights: str, codec: str, dtype: torch.dtype, device) -> nn.Module:
    """Fill a decoder built on the meta device from a safetensors file: only the tensors the
    decoder has (a full codec checkpoint also holds encoder ones), weight norm folded; a missing
    tensor or a shape that disagrees with the config fails naming it."""
    from safetensors import safe_open

    expected = model.state_dict()
    raw: dict[str, torch.Tensor] = {}
    with safe_open(weights, framework="pt", device="cpu") as f:
        for key in f.keys():
            if decoder_source_key(key) in expected:
                raw[key] = f.get_tensor(key)
    state = fold_weight_norm(raw)

    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"{codec} checkpoint {weights}: missing decoder tensors {missing[:8]}"
                         + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""))
    for key, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[key].shape):
            raise ValueError(
                f"{codec} checkpoint {weights}: {key} has shape {tuple(tensor.shape)}, "
                f"config {model.config} expects {tuple(expected[key].shape)}"
            )
    state = {k: v.to(device=device, dtype=dtype) for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.requires_grad_(False).eval()


_WEIGHT_NORM_SUFFIXES = {
    ".weight_g": "g",
    ".weight_v": "v",
    ".parametrizations.weight.original0": "g",
    ".parametrizations.weight.original1": "v",
}


def decoder_source_key(key: str) -> str:
    """Map a checkpoint key to the decoder key it feeds (weight-norm halves -> `.weight`)."""
    for suffix in _WEIGHT_NORM_SUFFIXES:
        if key.endswith(suffix):
            return key[: -len(suffix)] + ".weight"
    return key


def fold_weight_norm(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """weight = g * v / ||v|| (norm over all dims but 0: torch's weight_norm default, which the
    original X-Codec/DAC checkpoints used for Conv1d and ConvTranspose1d alike)."""
    state: dict[str, torch.Tensor] = {}
    halves: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in raw.items():
        for suffix, part in _WEIGHT_NORM_SUFFIXES.items():
            if key.endswith(suffix):
                halves.setdefault(key[: -len(suffix)] + ".weight", {})[part] = tensor
                break
        else:
            state[key] = tensor
    for key, parts in halves.items():
        if set(parts) != {"g", "v"}:
            raise ValueError(f"xcodec checkpoint: {key} has only the weight-norm part(s) {sorted(parts)}")
        if key in state:
            raise ValueError(f"xcodec checkpoint: {key} is given both plain and weight-normalised")
        g, v = parts["g"].float(), parts["v"].float()
        state[key] = torch._weight_norm(v, g, 0)
    return state


# ------------------------------------------------------------------------------------------------
# Tiny random checkpoint (tests) and receptive-field measurement
# ------------------------------------------------------------------------------------------------

TINY_CONFIG = XCodecDecoderConfig(
    semantic_hidden_size=16,
    acoustic_hidden_size=16,
    decoder_hidden_size=64,  # 64 -> 32 -> 16 -> 8 -> 4 channels over the 4 blocks
)
# A HuBERT small enough that building transformers' XcodecModel from the tiny config is cheap.
_TINY_SEMANTIC_MODEL_CONFIG: dict[str, Any] = {
    "model_type": "hubert",
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "conv_dim": [16] * 7,
    "num_conv_pos_embeddings": 16,
    "num_conv_pos_embedding_groups": 4,
}


def random_decoder_state(config: XCodecDecoderConfig, seed: int) -> dict[str, torch.Tensor]:
    """A full random decoder state dict, deterministic per (config, seed), scaled so the audio is
    roughly within [-1, 1] (XcodecModel's own init zeroes the codebooks: silent output)."""
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in XCodecDecoder(config).state_dict().items()}
    gen = torch.Generator().manual_seed(seed)
    state = {}
    for key in sorted(shapes):  # fixed draw order -> same tensors per seed
        shape = shapes[key]
        if key.endswith(".alpha"):
            t = 0.5 + torch.rand(shape, generator=gen)
        elif key.endswith(".embed"):
            # The Q codebook vectors are summed: keep the sum at unit scale.
            t = torch.randn(shape, generator=gen) / math.sqrt(config.num_quantizers)
        elif key.endswith(".bias"):
            t = 0.1 * torch.randn(shape, generator=gen)
        else:  # Linear [out, in], Conv1d [out, in, k], ConvTranspose1d [in, out, k]
            fan = shape[1] * (shape[2] if len(shape) == 3 else 1)
            t = torch.randn(shape, generator=gen) / math.sqrt(fan)
            if key == "acoustic_decoder.conv2.weight":
                t = t * 0.01  # the residual stacks grow the signal; bring audio to about +-1
        state[key] = t.contiguous()
    return state


def write_random_xcodec(
    out_dir: str | os.PathLike, config: XCodecDecoderConfig, seed: int, **xcodec_dict_kwargs: Any
) -> None:
    """Write a random decoder checkpoint of geometry `config` to `out_dir` (config.json in
    XcodecConfig's format + model.safetensors with the decoder's tensors only). Same seed ->
    byte-identical files. `XCodecDecoderConfig()` is the released X-Codec geometry (benchmarks)."""
    write_xcodec_dir(out_dir, config.to_xcodec_dict(**xcodec_dict_kwargs), random_decoder_state(config, seed))


def write_xcodec_dir(out_dir: str | os.PathLike, config: dict[str, Any], state: dict[str, torch.Tensor]) -> None:
    """A codec directory `XCodecDecoder.from_pretrained` reads: `config` (an XcodecConfig dict) as
    config.json, `state` (decoder tensors) as model.safetensors. Same inputs -> same bytes."""
    from safetensors.torch import save_file

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, CONFIG_NAME), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(state, os.path.join(out_dir, WEIGHTS_NAME), metadata={"format": "pt"})


def write_tiny_xcodec(out_dir: str | os.PathLike, seed: int) -> None:
    """Write a tiny random decoder checkpoint to `out_dir` (config.json + model.safetensors).

    16 kHz, hop 320, 8 quantizers x 1024 codes, 16/64-channel decoder. The config is in
    XcodecConfig's format (transformers' XcodecModel can be built from it; the tiny HuBERT in it
    is never run by us). The weights are the decoder's only. Same seed -> byte-identical files.
    """
    write_xcodec_dir(out_dir, tiny_xcodec_config(), random_decoder_state(TINY_CONFIG, seed))


def tiny_xcodec_config() -> dict[str, Any]:
    """The tiny geometry as an XcodecConfig dict (what the tiny codec's config.json holds)."""
    return TINY_CONFIG.to_xcodec_dict(semantic_model_config=_TINY_SEMANTIC_MODEL_CONFIG, encoder_hidden_size=4)


@torch.no_grad()
def measure_receptive_field(decoder: XCodecDecoder, num_frames: int = 48, seed: int = 0) -> tuple[int, int]:
    """Empirical (first, last) sample offsets, relative to t * hop_length, that changing every
    codebook's code of one frame t in the middle of a `num_frames` clip changes. Runs in float64
    on a copy so rounding cannot hide or invent a change."""
    import copy

    model = copy.deepcopy(decoder).to(torch.float64)
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, cfg.codebook_size, (1, cfg.num_quantizers, num_frames), generator=gen)
    t = num_frames // 2
    perturbed = codes.clone()
    perturbed[:, :, t] = (codes[:, :, t] + 1 + cfg.codebook_size // 2) % cfg.codebook_size
    diff = (model(codes) - model(perturbed))[0].abs()
    changed = torch.nonzero(diff > 0).flatten()
    if changed.numel() == 0:
        raise ValueError("changing a frame's codes changed no output sample (degenerate weights?)")
    first, last = int(changed[0]), int(changed[-1])
    if first == 0 or last == diff.numel() - 1:
        raise ValueError(f"num_frames={num_frames} too short: the change reaches the clip edge")
    return first - t * cfg.hop_length, last - t * cfg.hop_length


__all__ = [
    "XCodecDecoderConfig",
    "XCodecDecoder",
    "write_tiny_xcodec",
    "write_random_xcodec",
    "write_xcodec_dir",
    "tiny_xcodec_config",
    "random_decoder_state",
    "measure_receptive_field",
    "TINY_CONFIG",
]
