"""Output sample rates other than the codec's: the codec stage resamples each window it decodes.

A request asks for its rate in its stage-0 prompt's additional information (`RATE_KEY`); the
stage-input processor hands it to stage 1 with every window (`compat.window_payload`), or in the
whole clip's prompt (`speechlm2codec`). Stage 1 reports that rate as the audio's `sr`, so
vllm-omni's API server, which resamples a stream and a whole answer with two different filters,
resamples neither.

Resampling is torchaudio's windowed sinc (`transforms.Resample`, its defaults). A streamed window
is decoded with up to 25 frames of left context and 10 of holdback, far more than the filter
reaches (13 input samples at 16 -> 8 kHz, fewer above), so resampling the whole window and keeping
its new frames equals resampling the whole clip, up to float rounding, with no state carried from
one window to the next. A frame is `rate / frame_rate` output samples, an integer at every served
rate, so the kept pieces tile the clip.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

RATE_KEY = "output_sample_rate"
# Rates libsndfile's Ogg/Opus encoder takes.
OPUS_RATES = frozenset({8000, 12000, 16000, 24000, 48000})


def check_output_rate(rate: int, frame_rate: float, response_format: str | None) -> None:
    """A served rate this answer can have: whole samples per codec frame, and one Opus encodes."""
    if rate % frame_rate:
        raise ValueError(f"sample_rate: {rate} Hz is not whole samples per codec frame ({frame_rate} frames/s)")
    if response_format == "opus" and rate not in OPUS_RATES:
        raise ValueError(f"sample_rate: opus takes {', '.join(map(str, sorted(OPUS_RATES)))} Hz, got {rate}")


def requested_rate(info: Any, default: int) -> int:
    """The rate a stage-1 request's additional information asks for (`default`: none asked)."""
    value = info.get(RATE_KEY) if isinstance(info, dict) else None
    if isinstance(value, list):  # scalars may arrive wrapped
        value = value[0] if value else None
    return default if value is None else int(value)


@functools.lru_cache(maxsize=16)
def _resampler(source: int, target: int, device: str) -> Any:
    import torchaudio

    return torchaudio.transforms.Resample(source, target).to(device)  # the kernel, built once


def resample(wav: torch.Tensor, source: int, target: int) -> torch.Tensor:
    """[..., N] float32 at `source` Hz -> [..., ceil(N * target / source)] at `target` Hz."""
    if source == target:
        return wav
    return _resampler(source, target, str(wav.device))(wav)
