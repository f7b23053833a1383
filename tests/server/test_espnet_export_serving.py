"""A released Bagpiper's path, on the tiny ESPnet export the goldens were made from: the export as
`speechlm-make-tiny --family bagpiper --espnet-export` writes it, converted by `speechlm-convert
--family bagpiper`, served by `vllm serve CKPT --omni --deploy-config bagpiper_streaming_cpu_tiny.yaml`.
Both routes must give what ESPnet's own inference gave (tests/data/espnet/bagpiper_goldens.json):
the answer's length in tokens, its text, and the audio of its audio segments decoded the way ESPnet
decodes them (each segment's rows without its end row, de-interleaved, through the codec).

The export's inference.yaml is replaced by the golden cfg-3 cases' ESPnet inference config (greedy,
guidance 3, as released), so the checkpoint's defaults are that config: a request that sets no
option decodes a cfg-3 case, and the other cases send only the options where they differ.
"""

from __future__ import annotations

import base64
import io
import json
import os
import subprocess
import sys
import wave

import httpx
import numpy as np
import pytest
import torch
import yaml

import espnet_parity as golden
from conftest import start_speechlm_server
from vllm_omni_speechlm.audio import to_pcm16
from vllm_omni_speechlm.codec import load_codec_decoder
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.delay_pattern import CodebookMap, deinterleave
from vllm_omni_speechlm.sampling_params import MODEL_OPTIONS, SpeechSamplingParams

DEPLOY = "bagpiper_streaming_cpu_tiny.yaml"
GOLDENS = golden.load()
CASES = {case["name"]: case for case in GOLDENS["cases"]}
DEFAULTS_CASE = "audio_cfg3"  # its inference config becomes the checkpoint's defaults
SEED = 1234  # the goldens are greedy: any seed must give them


def _cli(name: str, *args: str) -> None:
    cli = os.path.join(os.path.dirname(sys.executable), name)
    done = subprocess.run([cli, *args], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> str:
    export, out = tmp_path_factory.mktemp("export"), tmp_path_factory.mktemp("served")
    _cli("speechlm-make-tiny", "--family", "bagpiper", "--espnet-export", "--out", str(export), "--seed", "0")
    assert golden.sha256(str(export / "model.pth")) == GOLDENS["export_sha256"], golden.REGENERATE
    config = CASES[DEFAULTS_CASE]["inference_config"]
    (export / "inference.yaml").write_text(yaml.safe_dump({"text": config["text"], "audio": config["audio"]}))
    _cli("speechlm-convert", "--family", "bagpiper", "--espnet-checkpoint", str(export / "model.pth"),
         "--backbone-config", str(export / "backbone" / "config.json"),
         "--text-tokenizer", str(export / "backbone" / "tokenizer.json"),
         "--codec-config", str(export / "xcodec" / "config.json"),
         "--audio-tower-config", str(export / "audio_tower" / "config.json"),
         "--inference-config", str(export / "inference.yaml"), "--out", str(out))
    return str(out)


@pytest.fixture(scope="module")
def server(served, tmp_path_factory):
    yield from start_speechlm_server(served, DEPLOY, tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def cfg(served) -> SpeechLMConfig:
    return SpeechLMConfig.from_model_dir(served)


def _options(case: dict, cfg: SpeechLMConfig) -> dict:
    """The case's ESPnet inference config as request options, only where it differs from the
    checkpoint's defaults."""
    want, defaults = golden.params(case), SpeechSamplingParams().resolve(cfg)
    return {k: getattr(want, k) for k in MODEL_OPTIONS if getattr(want, k) != getattr(defaults, k)}


def _dialogue(case: dict) -> tuple[str, str]:
    (_, _, system), (_, _, user) = case["dialogue"]
    return system, user


def _espnet_audio(case: dict, served: str, cfg: SpeechLMConfig) -> torch.Tensor:
    """ESPnet's decoding of the case's audio segments (parallel.py `inference`: each segment's rows
    without its eos / eot row; audio.py `decode_batch`: de-interleave, codes, codec), back to back."""
    codec, audio = load_codec_decoder(cfg.codec, served), []
    for seg in case["segments"]:
        if seg["modality_token"] != cfg.specials.audio:
            continue
        rows = torch.tensor(seg["tokens"])
        rows = rows[:-1] if seg["end"] in ("eos", "eot") else rows
        codes = CodebookMap(cfg).to_codes(deinterleave(rows))[:, -cfg.codec.num_quantizers :]
        with torch.inference_mode():
            audio.append(codec(codes.T[None])[0].float())
    assert audio, f"{case['name']}: no audio segment"
    return torch.cat(audio)


def _speech_pcm16(waveform: torch.Tensor) -> np.ndarray:
    """The speech route's PCM16: vllm-omni encodes with soundfile (libsndfile's float -> PCM_16)."""
    import soundfile

    buf = io.BytesIO()
    soundfile.write(buf, waveform.numpy(), 16000, format="RAW", subtype="PCM_16")
    return np.frombuffer(buf.getvalue(), dtype=np.int16)


def _assert_pcm_equal(got: bytes, want: np.ndarray) -> None:
    pcm = np.frombuffer(got, dtype=np.int16)
    assert pcm.shape == want.shape
    # float32 rounding through the decoder can move a sample across a PCM16 rounding boundary
    assert np.abs(pcm.astype(np.int32) - want.astype(np.int32)).max() <= 1


def _num_rows(case: dict, cfg: SpeechLMConfig) -> int:
    rows, complete = golden.expected_rows(case, cfg)
    assert complete, f"{case['name']}: ESPnet raised; no whole answer to compare"
    return len(rows)


def _text(case: dict, served: str, cfg: SpeechLMConfig) -> str | None:
    from tokenizers import Tokenizer

    from vllm_omni_speechlm.tokenizer import decode_text

    rows, _ = golden.expected_rows(case, cfg)
    return decode_text(Tokenizer.from_file(os.path.join(served, "tokenizer.json")), [r[0] for r in rows], cfg)


def test_defaults_are_the_inference_config(cfg):
    """The converted checkpoint carries the ESPnet inference config's decoding defaults (cfg 3)."""
    assert cfg.audio_sampling.cfg_scale == 3.0
    assert _options(CASES[DEFAULTS_CASE], cfg) == {} and _options(CASES["text_then_audio_cfg3"], cfg) == {}
    assert _options(CASES["text_then_audio"], cfg) == {"cfg_scale": 1.0}


def test_streamed_speech_is_espnets(server, served, cfg):
    """`/v1/audio/speech`, SSE, the released decoding (text, then audio guided by 3, the
    checkpoint's): the streamed deltas are ESPnet's audio and the usage counts ESPnet's rows."""
    case = CASES["text_then_audio_cfg3"]
    system, user = _dialogue(case)
    body = {"input": user, "instructions": system, "modality": "text+audio", "seed": SEED, "response_format": "pcm",
            "stream_format": "sse"}
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=body, timeout=300) as resp:
        assert resp.status_code == 200, resp.read()[:500]
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    deltas = [base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta"]
    assert events[-1]["type"] == "speech.audio.done" and len(deltas) >= 2
    _assert_pcm_equal(b"".join(deltas), _speech_pcm16(_espnet_audio(case, served, cfg)))
    assert events[-1]["usage"]["output_tokens"] == _num_rows(case, cfg)


@pytest.mark.parametrize("name, modalities", [
    (DEFAULTS_CASE, ["audio"]),  # guidance 3 from the checkpoint
    ("bang_is_pad", ["text", "audio"]),  # "!" in the prompt is fed as pad
    ("text_only", ["text"]),  # a text answer that goes on with a second text segment
])
def test_chat_is_espnets(server, served, cfg, name, modalities):
    case = CASES[name]
    system, user = _dialogue(case)
    body = {"messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
            "modalities": modalities, "seed": SEED, **_options(case, cfg)}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=300)
    assert resp.status_code == 200, resp.text[:500]
    answer = resp.json()
    choice = answer["choices"][0]
    assert choice["message"]["content"] == _text(case, served, cfg)
    assert choice["finish_reason"] == "stop" and answer["usage"]["completion_tokens"] == _num_rows(case, cfg)
    if "audio" not in modalities:
        assert "audio" not in choice["message"]
        return
    with wave.open(io.BytesIO(base64.b64decode(choice["message"]["audio"]["data"]))) as w:
        assert w.getframerate() == 16000
        pcm = w.readframes(w.getnframes())
    want = np.frombuffer(to_pcm16(_espnet_audio(case, served, cfg)), dtype=np.int16)
    _assert_pcm_equal(pcm, want)
