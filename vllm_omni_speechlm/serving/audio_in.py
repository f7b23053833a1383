"""Audio a request carries, decoded for the model: OpenAI `input_audio` content parts, `audio_url`
parts holding a data URL, and uploaded files. Decoding is vLLM's own (`AudioMediaIO`: soundfile,
then FFmpeg through PyAV; its size and decode-length guards), down-mixed to mono at the file's own
rate; the model's processor resamples. Every failure is a ValueError naming the field."""

from __future__ import annotations

import base64
import binascii
import re

import numpy as np

# The containers `input_audio.format` may name (OpenAI lists wav and mp3; FFmpeg decodes the rest).
INPUT_AUDIO_FORMATS = ("wav", "mp3", "flac", "ogg", "opus", "m4a", "webm")
_DATA_URL = re.compile(r"data:audio/[\w.+-]+;base64,(?P<data>.*)", re.DOTALL)


def decode_audio(data: bytes, field: str, max_seconds: float, min_seconds: float = 0.0) -> tuple[np.ndarray, int]:
    """(mono float32 waveform, its sample rate) of an encoded file; ValueError naming `field`
    when it is empty, not audio, corrupt, without finite samples, or shorter than `min_seconds` or
    longer than `max_seconds`."""
    from vllm.multimodal.media.audio import AudioMediaIO

    if not data:
        raise ValueError(f"{field}: empty audio")
    try:
        waveform, rate = AudioMediaIO().load_bytes(data)
    except Exception as e:  # soundfile, PyAV and vLLM's guards raise several kinds
        raise ValueError(f"{field}: not a decodable audio file ({type(e).__name__}: {e})") from e
    waveform = np.asarray(waveform, dtype=np.float32).reshape(-1)
    if waveform.size == 0 or not np.isfinite(waveform).all():
        raise ValueError(f"{field}: the audio has no samples, or non-finite ones")
    seconds = waveform.size / rate
    if seconds > max_seconds:
        raise ValueError(f"{field}: {seconds:.1f} s of audio; this model takes at most {max_seconds:g} s")
    if seconds < min_seconds:
        raise ValueError(f"{field}: {seconds * 1000:.1f} ms of audio; this model needs at least {min_seconds * 1000:.1f} ms")
    return waveform, int(rate)


def _base64(text: object, field: str) -> bytes:
    if not isinstance(text, str):
        raise ValueError(f"{field}: expected a base64 string")
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ValueError(f"{field}: not valid base64 ({e})") from e


def part_audio_bytes(part: dict, field: str) -> tuple[bytes, str]:
    """(the encoded file, the field that holds it) of an `input_audio` or `audio_url` content
    part at `field`."""
    if part.get("type") == "input_audio":
        spec = part.get("input_audio")
        if not isinstance(spec, dict):
            raise ValueError(f"{field}.input_audio: expected an object with data and format")
        fmt = spec.get("format")
        if fmt not in INPUT_AUDIO_FORMATS:
            raise ValueError(f"{field}.input_audio.format: expected one of {', '.join(INPUT_AUDIO_FORMATS)}, got {fmt!r}")
        return _base64(spec.get("data"), f"{field}.input_audio.data"), f"{field}.input_audio.data"
    spec = part.get("audio_url")
    url = spec.get("url") if isinstance(spec, dict) else None
    match = _DATA_URL.fullmatch(url) if isinstance(url, str) else None
    if match is None:
        raise ValueError(f"{field}.audio_url.url: expected a data URL (data:audio/...;base64,...); remote URLs are not fetched")
    return _base64(match["data"], f"{field}.audio_url.url"), f"{field}.audio_url.url"
