"""Audio input (understanding): a clip as the model reads it, shared by the engine and the reference.

Bagpiper hears audio as ESPnet's `ContinuousAudioIO` prepares it (multimodal_io/audio.py): 16 kHz
mono, the Qwen3-Omni feature extractor's 128-bin log-mel (transformers' WhisperFeatureExtractor,
waveform normalised to zero mean and unit variance, one frame per 160 samples), then the audio
tower and the adaptor. In the prompt a clip is `<|user|><|audio|>` and one row per encoder output
frame; those rows' embeddings are the features (ESPnet overwrites them whole).

Where this differs from ESPnet, on purpose: a multi-channel clip is averaged (ESPnet keeps its
first channel), and a clip longer than the extractor's `n_samples` is refused (ESPnet cuts it).
Resampling is torchaudio's `resample` with its defaults, as ESPnet's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from vllm_omni_speechlm.config import AudioInputSpec


def _fail(message: str) -> ValueError:
    return ValueError(f"audio: {message}")


def read_audio_file(path: str | os.PathLike) -> tuple[np.ndarray, int]:
    """(samples [channels, n] float32, sample rate) of an audio file (any format soundfile reads)."""
    import soundfile

    try:
        data, rate = soundfile.read(os.fspath(path), dtype="float32", always_2d=True)
    except (OSError, RuntimeError, soundfile.LibsndfileError) as e:
        raise _fail(f"cannot read {os.fspath(path)!r}: {e}") from None
    return data.T, rate


def to_channels_first(samples: Any) -> np.ndarray:
    """A waveform (1-D, or 2-D with the longer axis as time) -> [channels, n] float32."""
    if isinstance(samples, torch.Tensor):
        samples = samples.detach().cpu().numpy()
    try:
        wav = np.asarray(samples, dtype=np.float32)
    except (TypeError, ValueError):
        raise _fail(f"expected a waveform (array of samples), got {type(samples).__name__}") from None
    if wav.ndim == 1:
        wav = wav[None]
    if wav.ndim != 2:
        raise _fail(f"expected 1-D samples or 2-D [channels, samples], got shape {wav.shape}")
    return wav.T if wav.shape[0] > wav.shape[1] else wav


def prepare_audio(audio: Any, spec: AudioInputSpec, sample_rate: int | None = None) -> np.ndarray:
    """A clip -> [n] float32 mono at `spec.sample_rate`: `audio` is a path, or samples with
    `sample_rate` (a (samples, rate) pair works too). Channels are averaged; other rates are
    resampled. Empty, non-finite, too short or too long clips are a ValueError naming `audio`."""
    if isinstance(audio, tuple) and len(audio) == 2 and sample_rate is None:
        audio, sample_rate = audio
    if isinstance(audio, (str, os.PathLike)):
        wav, rate = read_audio_file(audio)
    else:
        if sample_rate is None:
            raise _fail("samples need their sample rate (sample_rate=..., or a (samples, rate) pair)")
        wav, rate = to_channels_first(audio), sample_rate
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or rate <= 0:
        raise _fail(f"sample rate must be a positive integer, got {rate!r}")
    if wav.size == 0:
        raise _fail("the clip is empty")
    if not np.isfinite(wav).all():
        raise _fail("the clip has non-finite samples")
    mono = wav.mean(axis=0, dtype=np.float32) if wav.shape[0] > 1 else wav[0]
    mono = resample(mono, int(rate), spec.sample_rate)
    check_length(mono.shape[0], spec)
    return mono


def resample(wav: np.ndarray, rate: int, target: int) -> np.ndarray:
    """torchaudio's band-limited sinc resampling with its defaults (ESPnet's `preprocess`)."""
    if rate == target:
        return np.ascontiguousarray(wav, dtype=np.float32)
    import torchaudio.functional

    return torchaudio.functional.resample(torch.from_numpy(np.ascontiguousarray(wav)), rate, target).numpy()


def check_length(num_samples: int, spec: AudioInputSpec) -> None:
    seconds = num_samples / spec.sample_rate
    if num_samples < spec.min_samples:
        need = f"at least {spec.min_samples} samples at {spec.sample_rate} Hz"
        raise _fail(f"{seconds:.4f} s is too short: the model needs {need}")
    if num_samples > spec.max_samples:
        limit = spec.max_samples / spec.sample_rate
        raise _fail(f"{seconds:.1f} s is longer than the model accepts ({limit:g} s)")


@functools.lru_cache(maxsize=4)
def feature_extractor(spec: AudioInputSpec) -> Any:
    """The Qwen3-Omni feature extractor (transformers' WhisperFeatureExtractor class, configured as
    Qwen3-Omni's preprocessor_config.json: no hub access)."""
    from transformers import WhisperFeatureExtractor

    return WhisperFeatureExtractor(
        feature_size=spec.tower.num_mel_bins,
        sampling_rate=spec.sample_rate,
        hop_length=spec.hop_length,
        chunk_length=spec.max_samples // spec.sample_rate,
        n_fft=spec.n_fft,
    )


def log_mel(wav: np.ndarray, spec: AudioInputSpec) -> torch.Tensor:
    """[n] 16 kHz samples -> [mel bins, n // hop_length] float32 log-mel, called as ESPnet's
    ContinuousAudioIO.preprocess calls the extractor (normalised waveform, no padding)."""
    out = feature_extractor(spec)(
        [wav],
        truncation=False,
        return_tensors="np",
        do_normalize=True,
        max_length=wav.shape[0],
        return_attention_mask=True,
        sampling_rate=spec.sample_rate,
    )
    return torch.from_numpy(out["input_features"][0, :, : spec.num_frames(wav.shape[0])].copy())


def expand_placeholders(
    prompt_ids: Sequence[int], lengths: Sequence[int], placeholder: int
) -> tuple[list[int], list[int]]:
    """A prompt with one placeholder per clip -> (the prompt with clip i's placeholder repeated
    lengths[i] times, the positions of those rows in order): what vLLM's processor does."""
    count = sum(1 for t in prompt_ids if t == placeholder)
    if count != len(lengths):
        raise _fail(f"the prompt holds {count} audio placeholders for {len(lengths)} clips")
    ids: list[int] = []
    positions: list[int] = []
    clips = iter(lengths)
    for token in prompt_ids:
        if token != placeholder:
            ids.append(token)
            continue
        n = next(clips)
        positions.extend(range(len(ids), len(ids) + n))
        ids.extend([placeholder] * n)
    return ids, positions
