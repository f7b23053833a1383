"""`bagpiper_batch` on CPU: speech LM -> X-Codec decoder, the whole clip decoded once stage 0 ends.

One two-stage engine for the module (tiny checkpoint, float32, deploy async_chunk: false). Each
request's audio arrives in one piece and must equal the reference's whole-clip decoding: the
hand-off (`speech_codec.speechlm2codec`) sends one window with no context and no holdback, so the
only difference is float rounding.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from conftest import TWO_SEGMENTS, TWO_SEGMENTS_PROMPT, espnet_segment_audio
from vllm_omni_speechlm import stage_configs
from vllm_omni_speechlm.stage_input_processors import speech_codec
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

HOP = 320
ATOL = 1e-4  # float32 rounding through the decoder; a wrong frame gives errors of order 0.1-1
SYSTEM = "Be brief."
PROMPTS = [
    "Hi.",
    "Say hello to the world.",
    "What time is it in the morning?",
]


@pytest.fixture(scope="module")
def gen(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    with SpeechLMGenerator(tiny_bagpiper, deploy_config=stage_configs.path("bagpiper_batch_cpu_tiny.yaml")) as g:
        yield g


def _request(gen, prompt: str, **kw):
    ids = gen.encode(prompt, SYSTEM)
    engine_prompt, sampling = gen.engine_request(ids, SpeechSamplingParams(**kw))
    engine_prompt["modalities"] = ["audio"]  # finished when stage 1 is (stage 0's text is a final output too)
    return engine_prompt, sampling, ids


def _codec_params():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # FINAL_ONLY: one output per request, the whole clip's audio.
    return SamplingParams(temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.FINAL_ONLY)


def _run(gen, requests) -> dict[int, list]:
    """Run requests [(prompt, sampling, ids)] (same stage-0 sampling params); outputs per index."""
    outs: dict[int, list] = {}
    stream = gen.omni.generate(
        [r[0] for r in requests], [requests[0][1], _codec_params()], py_generator=True, use_tqdm=False
    )
    for out in stream:
        if out.stage_id == 0:  # stage 0's text output (both stages are final outputs)
            continue
        outs.setdefault(int(out.request_id.split("_", 1)[0]), []).append(out)
    return outs


def _audio(out) -> torch.Tensor | None:
    audio = (out.multimodal_output or {}).get("audio")
    if isinstance(audio, list):  # not consolidated: pieces in order
        audio = torch.cat([a.reshape(-1) for a in audio]) if audio else None
    return None if audio is None else audio.reshape(-1).float()


def test_concurrent_clips_equal_whole_clip_decoding(gen, reference):
    """3 requests with audio of different lengths in one batch (the text part's length varies where
    the audio starts; max_tokens is shared): each gets its audio once, exactly T x 320 samples,
    equal to the reference's whole-clip audio (which also proves the codes are the reference's)."""
    batch = []
    for i, prompt in enumerate(PROMPTS):
        kw = dict(modality="text+audio", min_text_tokens=2 + 12 * i, max_text_tokens=2 + 12 * i, seed=7, max_tokens=110)
        batch.append((*_request(gen, prompt, **kw), kw))
    outs = _run(gen, [b[:3] for b in batch])
    assert sorted(outs) == [0, 1, 2]
    lengths = set()
    for i, (_, _, ids, kw) in enumerate(batch):
        [out] = outs[i]  # FINAL_ONLY: the whole clip in one output
        assert out.stage_id == 1 and out.finished and not getattr(out, "error", None)
        ref = reference.generate(ids, SpeechSamplingParams(**kw))
        assert ref.codes is not None, "the test request must produce audio"
        audio = _audio(out)
        assert audio is not None and audio.shape == (ref.codes.shape[0] * HOP,)
        torch.testing.assert_close(audio, ref.audio, atol=ATOL, rtol=0)
        lengths.add(audio.numel())
    assert len(lengths) == 3, lengths


def test_text_only_request_finishes_without_audio(gen, reference):
    """A text answer has no audio rows: no stage-1 prompt is made, and the request still finishes
    (empty audio from the final stage, no error). An audio request in the same batch is unaffected."""
    text_kw = dict(modality="text", seed=1, max_tokens=20)
    audio_kw = dict(modality="audio", seed=2, max_tokens=60)
    text_req = _request(gen, PROMPTS[0], **text_kw)
    audio_req = _request(gen, PROMPTS[1], **audio_kw)
    # Omni takes one stage-0 SamplingParams per call: run them as two calls on the same engine.
    [text_out] = _run(gen, [text_req])[0]
    assert text_out.finished and not getattr(text_out, "error", None)
    text_audio = _audio(text_out)
    assert text_audio is None or text_audio.numel() == 0
    [audio_out] = _run(gen, [audio_req])[0]
    ref = reference.generate(audio_req[2], SpeechSamplingParams(**audio_kw))
    torch.testing.assert_close(_audio(audio_out), ref.audio, atol=ATOL, rtol=0)


def test_audio_segments_decoded_one_by_one(gen, reference):
    """An answer with two audio segments: stage 1 gets one window listing the segments' frames and
    decodes each on its own, as ESPnet does: its audio is ESPnet's per-segment decodings, back to back."""
    prompt, system = TWO_SEGMENTS_PROMPT
    ids = gen.encode(prompt, system)
    engine_prompt, sampling = gen.engine_request(ids, SpeechSamplingParams(**TWO_SEGMENTS))
    engine_prompt["modalities"] = ["audio"]
    [out] = _run(gen, [(engine_prompt, sampling, ids)])[0]
    ref = reference.generate(ids, SpeechSamplingParams(**TWO_SEGMENTS))
    want, frames = espnet_segment_audio(ref.tokens, reference.cfg, reference.codec)
    assert len(frames) == 2, "the request must give two audio segments (conftest.TWO_SEGMENTS)"
    torch.testing.assert_close(_audio(out), want, atol=ATOL, rtol=0)


# ---- the hand-off alone (no engine) ------------------------------------------------------------


def _source(tokens: torch.Tensor | None, finished: bool = True):
    """A stage-0 output as the orchestrator passes it: codes.audio holds all [L, S] rows."""
    mm = {} if tokens is None else {"codes": {"audio": tokens}}
    return SimpleNamespace(finished=finished, outputs=[SimpleNamespace(multimodal_output=mm)])


def test_handoff_is_one_whole_clip_window(tiny_bagpiper, reference):
    """The prompt is the reference's [T, Q] codes, frame-major, context 0 / holdback 0, and the
    codec stage decodes it to the reference's audio."""
    from vllm_omni_speechlm.models.codec_stage import BagpiperCodecDecoder
    from vllm_omni_speechlm.resample import RATE_KEY, resample
    from vllm_omni_speechlm.tokenizer import encode_prompt

    ids = encode_prompt(reference.tokenizer, reference.cfg, PROMPTS[2], system=SYSTEM)
    ref = reference.generate(ids, SpeechSamplingParams(modality="text+audio", max_text_tokens=4, seed=5, max_tokens=80))
    model_config = SimpleNamespace(model=tiny_bagpiper)
    [prompt] = speech_codec.speechlm2codec([_source(ref.tokens)], target_model_config=model_config)
    assert prompt["prompt_token_ids"] == ref.codes.reshape(-1).tolist()
    stage = BagpiperCodecDecoder.from_model_dir(tiny_bagpiper)
    with torch.inference_mode():
        [audio] = stage.decode_windows([torch.tensor(prompt["prompt_token_ids"])], [prompt["additional_information"]])
    torch.testing.assert_close(audio, ref.audio, atol=ATOL, rtol=0)
    # The rate the stage-0 prompt asked for reaches the codec stage, which resamples the clip.
    asked = {"prompt_token_ids": ids, "additional_information": {RATE_KEY: 24000}}
    [prompt] = speech_codec.speechlm2codec([_source(ref.tokens)], asked, target_model_config=model_config)
    with torch.inference_mode():
        [audio] = stage.decode_windows([torch.tensor(prompt["prompt_token_ids"])], [prompt["additional_information"]])
    torch.testing.assert_close(audio, resample(ref.audio.float(), 16000, 24000), atol=ATOL, rtol=0)
    # Unfinished outputs, text-only answers and empty payloads make no prompt.
    assert speech_codec.speechlm2codec([_source(ref.tokens, finished=False)], target_model_config=model_config) == []
    s0 = reference.cfg.streams[0]
    text_only = ref.tokens[(ref.tokens[:, 0] < s0.vocab_start) | (ref.tokens[:, 0] >= s0.vocab_end)]
    assert text_only.shape[0] > 0
    assert speech_codec.speechlm2codec([_source(text_only)], target_model_config=model_config) == []
    assert speech_codec.speechlm2codec([_source(None)], target_model_config=model_config) == []
