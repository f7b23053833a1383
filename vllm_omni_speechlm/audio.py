"""Waveform containers: PCM16 WAV bytes and their base64 form (what the APIs return)."""

from __future__ import annotations

import base64
import io
import wave

import torch


def to_pcm16(waveform: torch.Tensor) -> bytes:
    """[N] float waveform in [-1, 1] (clipped) -> little-endian PCM16 bytes."""
    pcm = (waveform.detach().float().cpu().clamp(-1.0, 1.0) * 32767.0).round().to(torch.int16)
    return pcm.numpy().tobytes()


def to_wav(waveform: torch.Tensor, sample_rate: int) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(to_pcm16(waveform))
    return buf.getvalue()


def to_wav_base64(waveform: torch.Tensor, sample_rate: int) -> str:
    return base64.b64encode(to_wav(waveform, sample_rate)).decode("ascii")


def read_wav(data: bytes) -> tuple[torch.Tensor, int]:
    """PCM16 mono WAV bytes -> ([N] float waveform, sample rate)."""
    with wave.open(io.BytesIO(data), "rb") as w:
        frames = w.readframes(w.getnframes())
        rate = w.getframerate()
    return torch.frombuffer(bytearray(frames), dtype=torch.int16).float() / 32767.0, rate
