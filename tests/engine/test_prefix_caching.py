"""vLLM's prefix caching on stage 0 (CPU, float32): prompts sharing a system turn, and CFG
companions (all-pad prompts), reuse KV blocks, and every stream still equals the reference.

vllm-omni's own prefix cache (hidden states and per-token outputs kept for hits) stays off
(`compat.without_omni_prefix_cache`): with it, no window reached the codec stage."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch
import yaml

from vllm_omni_speechlm import stage_configs
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

# vLLM's CPU attention takes blocks of 32 tokens; the system turn fills two of them.
CACHING = dict(enable_prefix_caching=True, block_size=32)
SYSTEM = "You are a helpful assistant who answers every question in speech, clearly and briefly, always."
PROMPTS = ["Hi.", "Say hello to the world.", "What time is it in the morning?"]
ATOL = 1e-4  # as the streaming tests: float32 rounding through the codec


@pytest.fixture(scope="module")
def gen(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    with SpeechLMGenerator(tiny_bagpiper, dtype="float32", enforce_eager=True, max_num_seqs=8, max_model_len=512,
                           max_num_batched_tokens=512, **CACHING) as g:
        yield g


def _requests(gen, items):
    batch = [gen.engine_request(gen.encode(p, SYSTEM), SpeechSamplingParams(**kw)) for p, kw in items]
    assert all(b[1] == batch[0][1] for b in batch)  # one engine SamplingParams per stage
    return batch


def _by_index(outputs):
    return sorted(outputs, key=lambda o: int(o.request_id.split("_", 1)[0]))


# One batch, one engine SamplingParams (seed, length); the speech options differ per request.
KINDS = [
    dict(modality="audio", cfg_scale=3.0),  # a pair from arrival: the companion's prompt is all pad
    dict(modality="text+audio", min_text_tokens=4, max_text_tokens=4, cfg_scale=3.0),  # a pair mid-answer
    dict(modality="audio", cfg_scale=1.0),
]


def test_cached_prefixes_leave_every_stream_equal(gen, reference):
    items = [(p, dict(kind, seed=5, max_tokens=60)) for p, kind in zip(PROMPTS, KINDS)]
    for round_ in range(2):  # the second round finds the first's blocks too
        batch = _requests(gen, items)
        outputs = _by_index(gen.omni.generate([b[0] for b in batch], [batch[0][1]], use_tqdm=False))
        for (prompt, kw), out in zip(items, outputs):
            ref = reference.generate(gen.encode(prompt, SYSTEM), SpeechSamplingParams(**kw))
            assert torch.equal(torch.tensor(gen.result(out)["stream_token_ids"]), ref.tokens), (round_, prompt)
        cached = [out.num_cached_tokens for out in outputs]
        assert min(cached[1:] if round_ == 0 else cached) >= 64, cached


def test_cached_audio_input(gen, reference):
    """A repeated audio question: its system turn and clip rows come from the cache (vLLM hashes
    the clip into the blocks it fills), the answer is the reference's."""
    from conftest import assert_result_equals_reference, reference_with_clips
    from devtools import audio_clips

    clips = [(audio_clips.as_float(audio_clips.clip(1.5, 180.0)), audio_clips.RATE)]
    kw = dict(modality="audio", cfg_scale=3.0, seed=3, max_tokens=40)
    want = reference_with_clips(reference, gen, PROMPTS[1], clips, system=SYSTEM, **kw)
    for round_ in range(2):
        ids = gen.encode(PROMPTS[1], SYSTEM, audio=len(clips))
        prompt, sampling = gen.engine_request(ids, SpeechSamplingParams(**kw), gen.prepare_clips(clips))
        [out] = gen.omni.generate([prompt], [sampling], use_tqdm=False)
        assert_result_equals_reference(gen.result(out), want)
        assert round_ == 0 or out.num_cached_tokens > len(ids), out.num_cached_tokens


def test_a_prompt_holding_codec_ids_shares_no_block(gen, reference):
    """A raw prompt that repeats an earlier answer's audio rows by their stream-0 ids would match
    that answer's blocks, whose KV was computed with its other streams (without the salt: 96
    tokens matched and the answer differed): it gets blocks of its own and the reference's answer."""
    kw = dict(modality="audio", cfg_scale=1.0, seed=3, max_tokens=60)
    ids = gen.encode(PROMPTS[0], SYSTEM)
    [first] = gen.generate(PROMPTS[0], system=SYSTEM, **kw)
    echo = ids + [row[0] for row in first["stream_token_ids"]][: 128 - len(ids)]  # 4 whole blocks
    assert max(echo) >= gen.cfg.codec_start and len(echo) == 128
    prompt, sampling = gen.engine_request(echo, SpeechSamplingParams(**kw))
    [out] = gen.omni.generate([prompt], [sampling], use_tqdm=False)
    assert out.num_cached_tokens == 0
    ref = reference.generate(echo, SpeechSamplingParams(**kw))
    assert torch.equal(torch.tensor(gen.result(out)["stream_token_ids"]), ref.tokens)


def test_streamed_audio_with_cached_prefixes(tiny_bagpiper, reference, tmp_path):
    """The streaming deployment with stage 0's prefix caching on: windows reach the codec stage
    and each answer's audio equals whole-clip decoding of the reference's codes."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    from vllm_omni_speechlm.generator import SpeechLMGenerator

    deploy = yaml.safe_load(open(stage_configs.path("bagpiper_streaming_cpu_tiny.yaml")))
    deploy["stages"][0].update(CACHING)
    path = tmp_path / "streaming_prefix_caching.yaml"
    path.write_text(yaml.safe_dump(deploy))
    kw = dict(modality="audio", cfg_scale=3.0, seed=6, max_tokens=80)
    codec = SamplingParams(temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.DELTA)
    with SpeechLMGenerator(tiny_bagpiper, deploy_config=str(path)) as gen:
        for round_ in range(2):
            batch = _requests(gen, [(p, kw) for p in PROMPTS])
            chunks, cached = defaultdict(list), {}
            for out in gen.omni.generate([b[0] for b in batch], [batch[0][1], codec], py_generator=True, use_tqdm=False):
                i = int(out.request_id.split("_", 1)[0])
                if out.stage_id == 0:
                    cached[i] = out.num_cached_tokens
                elif (audio := (out.multimodal_output or {}).get("audio")) is not None and audio.numel():
                    chunks[i].append(audio.reshape(-1).float())
            if round_:
                assert min(cached.values()) >= 64, cached
            for i, prompt in enumerate(PROMPTS):
                ref = reference.generate(gen.encode(prompt, SYSTEM), SpeechSamplingParams(**kw))
                with torch.inference_mode():
                    whole = gen.codec(ref.codes.T[None])[0]
                torch.testing.assert_close(torch.cat(chunks[i]), whole, atol=ATOL, rtol=0)
