"""Audio in a request: every container a client may send decodes to the same mono waveform, and
every bad part is a ValueError naming its field."""

import base64
import io

import numpy as np
import pytest
import soundfile as sf

from vllm_omni_speechlm.serving.audio_in import decode_audio, part_audio_bytes

pytestmark = pytest.mark.unit

RATE = 22050
TONE = (0.3 * np.sin(2 * np.pi * 440 * np.arange(RATE) / RATE)).astype(np.float32)  # 1 s


def _encoded(fmt: str, signal: np.ndarray = TONE, rate: int = RATE, subtype: str | None = None) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, signal, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


@pytest.mark.parametrize("fmt, tolerance", [("WAV", 1e-4), ("FLAC", 1e-4), ("OGG", 0.05), ("MP3", 0.05)])
def test_containers_decode_to_the_signal(fmt, tolerance):
    waveform, rate = decode_audio(_encoded(fmt), "file", max_seconds=30)
    assert rate == RATE and waveform.dtype == np.float32
    n = min(len(waveform), len(TONE))  # lossy codecs pad or delay by a few ms
    assert abs(len(waveform) - len(TONE)) < RATE // 10
    if tolerance < 0.01:
        np.testing.assert_allclose(waveform[:n], TONE[:n], atol=tolerance)
    else:  # lossy: the same tone, in energy
        assert abs(np.sqrt(np.mean(waveform**2)) - np.sqrt(np.mean(TONE**2))) < tolerance


def test_stereo_is_down_mixed():
    left, right = TONE, np.zeros_like(TONE)
    waveform, _ = decode_audio(_encoded("WAV", np.stack([left, right], axis=1), subtype="FLOAT"), "file", 30)
    np.testing.assert_allclose(waveform, (left + right) / 2, atol=1e-6)


@pytest.mark.parametrize(
    "data, message",
    [
        (b"", "file: empty audio"),
        (b"this is plain text, not a sound file at all" * 4, "file: not a decodable audio file"),
        (_encoded("WAV")[:30], "file: not a decodable audio file"),  # a header cut short
    ],
)
def test_bad_files_name_the_field(data, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        decode_audio(data, "file", max_seconds=30)


def test_too_long_or_too_short_names_the_limit():
    with pytest.raises(ValueError, match=r"^file: 1\.0 s of audio; this model takes at most 0\.5 s"):
        decode_audio(_encoded("WAV"), "file", max_seconds=0.5)
    with pytest.raises(ValueError, match=r"^file: 1000\.0 ms of audio; this model needs at least 2000\.0 ms"):
        decode_audio(_encoded("WAV"), "file", max_seconds=5, min_seconds=2)


def test_parts_carry_base64_files():
    wav = _encoded("WAV")
    b64 = base64.b64encode(wav).decode()
    part = {"type": "input_audio", "input_audio": {"data": b64, "format": "wav"}}
    assert part_audio_bytes(part, "p") == (wav, "p.input_audio.data")
    url = {"type": "audio_url", "audio_url": {"url": f"data:audio/wav;base64,{b64}"}}
    assert part_audio_bytes(url, "p") == (wav, "p.audio_url.url")


@pytest.mark.parametrize(
    "part, field",
    [
        ({"type": "input_audio", "input_audio": "abc"}, "p.input_audio"),
        ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "aiff"}}, "p.input_audio.format"),
        ({"type": "input_audio", "input_audio": {"data": "not base64!", "format": "wav"}}, "p.input_audio.data"),
        ({"type": "input_audio", "input_audio": {"data": 5, "format": "wav"}}, "p.input_audio.data"),
        ({"type": "audio_url", "audio_url": {"url": "https://example.com/a.wav"}}, "p.audio_url.url"),
        ({"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,@@"}}, "p.audio_url.url"),
        ({"type": "audio_url", "audio_url": "data:audio/wav;base64,AAAA"}, "p.audio_url.url"),
    ],
)
def test_bad_parts_name_the_field(part, field):
    with pytest.raises(ValueError, match=f"^{field.replace('.', chr(92) + '.')}: "):
        part_audio_bytes(part, "p")
