"""Audio input through vLLM's multimodal machinery in stage 0 (CPU, float32): every stream equals the
reference's, for an audio question answered in text, a transcription, speech out with cfg 3 and a
clip past one attention window; clips batched across requests equal their solo runs; the encoder
cache gives back what finished and aborted requests held. ESPnet's goldens:
test_espnet_parity_engine.py."""

import os
import threading
import time

import numpy as np
import pytest
import soundfile
import torch

from conftest import assert_result_equals_reference, flatten, live_requests, reference_with_clips, worker_sum
from devtools import audio_clips

# max_num_batched_tokens also sizes vLLM's encoder cache (rows of encoder output): 512 holds four
# 9-s clips, so the eviction test below needs the cache to give back what requests held.
ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=8, max_model_len=512, max_num_batched_tokens=512,
              gpu_memory_utilization=0.3)
SYSTEM = "Be brief."
QUESTION = "What is said in the recording?"


def clip(seconds: float, pitch: float = 180.0) -> tuple[np.ndarray, int]:
    return audio_clips.as_float(audio_clips.clip(seconds, pitch)), audio_clips.RATE


@pytest.fixture(scope="module")
def generator(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc("apply_model")
    with SpeechLMGenerator(tiny_bagpiper, **ENGINE) as gen:
        yield gen


CASES = {
    "question_text": (QUESTION, [clip(1.5)], dict(modality="text", seed=1, max_tokens=30)),
    "transcription": ("", [clip(0.7, 240.0)], dict(modality="text", seed=2, max_tokens=30)),
    "speech_out_cfg3": (QUESTION, [clip(1.5)], dict(modality="audio", cfg_scale=3.0, seed=3, max_tokens=40)),
    "text_then_speech_cfg3": ("", [clip(2.2, 200.0)],
                              dict(modality="text+audio", max_text_tokens=5, cfg_scale=3.0, seed=4, max_tokens=40)),
    "long_clip": (QUESTION, [clip(9.3, 160.0)], dict(modality="text", text_temperature=0.0, max_tokens=20)),
    "two_clips": (QUESTION, [clip(0.7, 240.0), clip(1.5)], dict(modality="text", seed=5, max_tokens=30)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(generator, reference, name):
    prompt, clips, kw = CASES[name]
    [result] = generator.generate(prompt, system=SYSTEM, audio=clips, **kw)
    assert_result_equals_reference(result, reference_with_clips(reference, generator, prompt, clips, **kw))


def test_batched_requests_equal_solo_runs(generator, reference):
    """Clips of several requests in one encoder call (under one chunk, over one, past a window; a
    text-only request among them), with CFG companions: each equals its solo run."""
    prompts = [QUESTION, "", QUESTION, "Say hello."]
    clips = [[clip(1.5)], [clip(0.7, 240.0)], [clip(9.3, 160.0), clip(0.6, 300.0)], None]
    kw = dict(modality="text+audio", max_text_tokens=5, cfg_scale=3.0, seed=7, max_tokens=36)
    batched = generator.generate(prompts, system=SYSTEM, audio=clips, **kw)
    for prompt, c, result in zip(prompts, clips, batched):
        [solo] = generator.generate(prompt, system=SYSTEM, audio=c, **kw)
        assert result["stream_token_ids"] == solo["stream_token_ids"]
        assert_result_equals_reference(result, reference_with_clips(reference, generator, prompt, c or [], **kw))


def test_a_stereo_file_at_another_rate(generator, reference, tmp_path):
    """A path: read, channels averaged, resampled to 16 kHz (torchaudio), as the reference does."""
    left, right = (audio_clips.as_float(audio_clips.clip(1.2, p, rate=44100)) for p in (170.0, 230.0))
    path = str(tmp_path / "stereo.wav")
    soundfile.write(path, np.stack([left, right], axis=1), 44100, subtype="FLOAT")
    kw = dict(modality="text", seed=8, max_tokens=24)
    [result] = generator.generate(QUESTION, system=SYSTEM, audio=path, **kw)
    assert_result_equals_reference(result, reference_with_clips(reference, generator, QUESTION, [path], **kw))


def _live(generator) -> int:
    return worker_sum(generator.omni, live_requests)


def _encoder_cache_rows(generator) -> int:
    """Rows the worker's encoder cache holds (vLLM's runner keeps encoder outputs by clip hash
    until its scheduler evicts them)."""
    from vllm_omni_speechlm.compat import encoder_cache_rows

    return sum(flatten(generator.omni.engine.collective_rpc(lambda w: encoder_cache_rows(w.model_runner), stage_ids=[0])))


def test_encoder_cache_gives_back_finished_and_aborted_requests(generator):
    """Ten distinct 9-s clips (121 rows each; the cache holds 512 rows), some aborted mid-answer:
    each runs only if the clips before it gave their rows back, and the worker holds no more than
    the cache."""
    for i in range(10):
        c = [clip(9.0 + 0.03 * i, 150.0 + 7 * i)]
        if i % 3:
            generator.generate(QUESTION, system=SYSTEM, audio=c, modality="text", max_tokens=4, seed=i)
            continue
        done = threading.Event()
        thread = threading.Thread(target=lambda: (generator.generate(
            QUESTION, system=SYSTEM, audio=c, modality="audio", max_tokens=400, seed=i), done.set()), daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while _live(generator) == 0:  # the worker holds the request
            assert time.monotonic() < deadline and not done.is_set()
            time.sleep(0.05)
        generator.omni.engine.abort(list(generator.omni.request_states))
        thread.join(timeout=60)
        assert done.is_set()
    assert 0 < _encoder_cache_rows(generator) <= 512
    deadline = time.monotonic() + 30
    while _live(generator) != 0:
        assert time.monotonic() < deadline, "per-request state left"
        time.sleep(0.1)


@pytest.mark.parametrize(
    "audio, message",
    [
        ((np.zeros(0, np.float32), 16000), "empty"),
        ((np.zeros(100, np.float32), 16000), "too short"),
        (np.zeros(16000, np.float32), "sample rate"),
        ([[clip(1.0)], [clip(1.0)]], "expected a list of 1 entries"),
    ],
)
def test_bad_audio_raises_naming_audio(generator, audio, message):
    prompts = "hello" if "entries" not in message else ["hello"]
    with pytest.raises(ValueError, match=f"^audio: .*{message}"):
        generator.generate(prompts, audio=audio, max_tokens=4)
