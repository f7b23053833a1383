"""Deterministic test clips: the same int16 samples on every machine, with no RNG and no files.

A clip is a few harmonics under slow pitch and amplitude modulation plus a click train: enough
spectral change that a random audio tower gives each frame different features. The ESPnet
goldens record each clip's sha256 (scripts/espnet_goldens.py); the tests rebuild it from here.
"""

from __future__ import annotations

import hashlib

import numpy as np

RATE = 16000


def clip(seconds: float, pitch: float = 180.0, rate: int = RATE) -> np.ndarray:
    """[round(seconds * rate)] int16 samples."""
    t = np.arange(round(seconds * rate), dtype=np.float64) / rate
    f0 = pitch * (1.0 + 0.15 * np.sin(2 * np.pi * 0.7 * t))
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voice = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t) ** 2
    clicks = (np.mod(np.arange(t.size), rate // 8) < 40).astype(np.float64)
    return np.round(np.clip(0.25 * envelope * voice + 0.1 * clicks, -1.0, 1.0) * 32767.0).astype(np.int16)


def as_float(samples: np.ndarray) -> np.ndarray:
    """int16 -> float32 in [-1, 1) (what a PCM16 WAV reads as)."""
    return samples.astype(np.float32) / 32768.0


def sha256(samples: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(samples, dtype="<i2").tobytes()).hexdigest()
