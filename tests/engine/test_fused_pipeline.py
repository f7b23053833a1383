"""`bagpiper_fused` on CPU: one stage; the speech LM worker decodes each finished clip itself.

One engine for the module (tiny checkpoint, float32). Each request returns text, its stream
tokens and the whole clip's audio from the engine; the audio must equal the reference's
whole-clip decoding and the batch mode's decoding of the same codes (its hand-off + codec stage).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import pytest
import torch

from vllm_omni_speechlm import stage_configs
from conftest import TWO_SEGMENTS, TWO_SEGMENTS_PROMPT, espnet_segment_audio, step_graphs_eagerly, worker_sum
from vllm_omni_speechlm.stage_input_processors import speech_codec
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

HOP = 320
ATOL = 1e-4  # float32 rounding through the decoder; a wrong frame gives errors of order 0.1-1
SYSTEM = "Be brief."
PROMPTS = ["Hi.", "Say hello to the world.", "What time is it in the morning?"]


def worker_state(model) -> tuple[int, int]:
    return len(model.steps), model.num_decoded_clips


@pytest.fixture(scope="module")
def gen(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc("apply_model", fn)
    with SpeechLMGenerator(tiny_bagpiper, deploy_config=stage_configs.path("bagpiper_fused_cpu_tiny.yaml")) as g:
        yield g


def _worker_state(gen) -> tuple[int, int]:
    [[state]] = gen.omni.engine.collective_rpc("apply_model", args=(worker_state,), stage_ids=[0])
    return tuple(state)


def _batch_mode_audio(model_dir: str, stream_token_ids: list) -> torch.Tensor:
    """The batch deployment's path for the same stage-0 output, without its engine."""
    from vllm_omni_speechlm.models.codec_stage import BagpiperCodecDecoder

    source = SimpleNamespace(
        finished=True, outputs=[SimpleNamespace(multimodal_output={"codes": {"audio": torch.tensor(stream_token_ids)}})]
    )
    [prompt] = speech_codec.speechlm2codec([source], target_model_config=SimpleNamespace(model=model_dir))
    stage = BagpiperCodecDecoder.from_model_dir(model_dir)
    with torch.inference_mode():
        [audio] = stage.decode_windows([torch.tensor(prompt["prompt_token_ids"])], [prompt["additional_information"]])
    return audio


@pytest.mark.parametrize("graphs", [False, True], ids=["ungraphed", "step-graphs"])
def test_fused_clips_equal_reference_and_batch_mode(gen, reference, tiny_bagpiper, graphs):
    """3 concurrent requests whose audio starts at different steps (the text part's length
    varies): each returns text, tokens equal to the reference's, and the whole clip, T x 320
    samples, equal to the reference's audio and to the batch mode's decoding; also when the
    steps run as step graphs (3 rows padded to 5)."""
    worker_sum(gen.omni, functools.partial(step_graphs_eagerly, graphs))
    try:
        _assert_fused_clips(gen, reference, tiny_bagpiper)
    finally:
        worker_sum(gen.omni, functools.partial(step_graphs_eagerly, False))


def _assert_fused_clips(gen, reference, tiny_bagpiper) -> None:
    kws = [dict(modality="text+audio", min_text_tokens=2 + 12 * i, max_text_tokens=2 + 12 * i, seed=7, max_tokens=110)
           for i in range(3)]
    # generate() takes one set of options per call; the speech options ride per request, so send
    # the three as one engine batch the way generate does.
    requests = [gen.engine_request(gen.encode(p, SYSTEM), SpeechSamplingParams(**kw)) for p, kw in zip(PROMPTS, kws)]
    outputs = gen.omni.generate([r[0] for r in requests], [requests[0][1]], use_tqdm=False)
    assert len(outputs) == 3
    lengths = set()
    for out in outputs:
        i = int(out.request_id.split("_", 1)[0])
        result = gen.result(out)
        ref = reference.generate(gen.encode(PROMPTS[i], SYSTEM), SpeechSamplingParams(**kws[i]))
        assert ref.codes is not None, "the test request must produce audio"
        assert result["stream_token_ids"] == ref.tokens.tolist()
        assert result["text"] == ref.text
        audio = result["waveform"]
        assert audio is not None and audio.shape == (ref.codes.shape[0] * HOP,)
        torch.testing.assert_close(audio, ref.audio, atol=ATOL, rtol=0)
        torch.testing.assert_close(audio, _batch_mode_audio(tiny_bagpiper, result["stream_token_ids"]), atol=ATOL, rtol=0)
        lengths.add(audio.numel())
    assert len(lengths) == 3, lengths


def test_text_only_and_cut_off_requests(gen, reference):
    """A text answer gets no audio (and no decode); a request cut by max_tokens mid-audio gets the
    clip of its complete frames, decoded in the step it stopped. Per-request state is freed."""
    _, decoded_before = _worker_state(gen)
    [text] = gen.generate(PROMPTS[0], system=SYSTEM, modality="text", seed=1, max_tokens=20)
    assert text["waveform"] is None and text["audio"] is None and text["text"]
    kw = dict(modality="audio", seed=2, max_tokens=40)
    [cut] = gen.generate(PROMPTS[1], system=SYSTEM, **kw)
    ref = reference.generate(gen.encode(PROMPTS[1], SYSTEM), SpeechSamplingParams(**kw))
    assert cut["finish_reason"] == "length"
    torch.testing.assert_close(cut["waveform"], ref.audio, atol=ATOL, rtol=0)
    assert _worker_state(gen) == (0, decoded_before + 1)


def test_guided_request_decodes_only_the_main_clip(gen, reference):
    """CFG (the scheduler's hidden companion rides along): the main request's clip equals the
    reference's guided audio, and the companion's clip is never decoded."""
    _, decoded_before = _worker_state(gen)
    kw = dict(modality="audio", cfg_scale=3.0, seed=5, max_tokens=60)
    [guided] = gen.generate(PROMPTS[1], system=SYSTEM, **kw)
    ref = reference.generate(gen.encode(PROMPTS[1], SYSTEM), SpeechSamplingParams(**kw))
    assert guided["stream_token_ids"] == ref.tokens.tolist()
    torch.testing.assert_close(guided["waveform"], ref.audio, atol=ATOL, rtol=0)
    assert _worker_state(gen) == (0, decoded_before + 1)


def test_audio_segments_decoded_one_by_one(gen, reference, tiny_bagpiper):
    """An answer with two audio segments: the fused clip and the batch mode's are ESPnet's
    per-segment decodings, back to back."""
    prompt, system = TWO_SEGMENTS_PROMPT
    [result] = gen.generate(prompt, system=system, **TWO_SEGMENTS)
    want, frames = espnet_segment_audio(torch.tensor(result["stream_token_ids"]), gen.cfg, gen.codec)
    assert len(frames) == 2, "the request must give two audio segments (conftest.TWO_SEGMENTS)"
    ref = reference.generate(gen.encode(prompt, system), SpeechSamplingParams(**TWO_SEGMENTS))
    assert result["stream_token_ids"] == ref.tokens.tolist()
    assert result["waveform"].shape == want.shape == (sum(frames) * HOP,)
    torch.testing.assert_close(result["waveform"], want, atol=ATOL, rtol=0)
    torch.testing.assert_close(_batch_mode_audio(tiny_bagpiper, result["stream_token_ids"]), want, atol=ATOL, rtol=0)


def test_generate_stream_yields_the_whole_clip_once(gen, reference):
    """Without a codec stage there is nothing to stream: one chunk, the whole clip."""
    kw = dict(modality="audio", seed=4, max_tokens=60)
    chunks = list(gen.generate_stream(PROMPTS[2], system=SYSTEM, **kw))
    ref = reference.generate(gen.encode(PROMPTS[2], SYSTEM), SpeechSamplingParams(**kw))
    assert len(chunks) == 1
    torch.testing.assert_close(chunks[0], ref.audio, atol=ATOL, rtol=0)
