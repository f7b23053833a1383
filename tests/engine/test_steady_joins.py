"""Answers joining a running batch as others leave (a service's steady traffic): twelve guided
audio answers of four lengths on eight rows, so pairs leave at different steps and the waiting
ones take their rows and slots; prompts share their first blocks (prefix caching on), each with
the step graphs (the CPU recorder) and without; every stream of every answer equals the reference.
(One H200 served a share of such answers silent from their first row; not reproduced here.)"""

import functools
import os

import pytest
import torch

from conftest import live_requests, step_graphs_eagerly, worker_sum
from test_prefix_caching import SYSTEM
from test_stage0_engine import PROMPTS

ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.3,
              enable_prefix_caching=True, block_size=32)


@pytest.fixture(scope="module")
def generator(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    with SpeechLMGenerator(tiny_bagpiper, **ENGINE) as gen:
        yield gen


@pytest.mark.skipif(torch.cuda.is_available(), reason="the float32 reference equals the engine bitwise on CPU only")
@pytest.mark.parametrize("graphs", [True, False], ids=["step-graphs", "no-step-graphs"])
def test_pairs_joining_as_others_leave_equal_the_reference(generator, reference, graphs):
    from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

    worker_sum(generator.omni, functools.partial(step_graphs_eagerly, graphs))
    try:
        # One seed: a batch shares one engine SamplingParams (`SpeechLMGenerator.run`).
        kws = [dict(modality="audio", cfg_scale=3.0, seed=5, min_audio_frames=6 + 5 * (i % 4),
                    max_audio_frames=6 + 5 * (i % 4), max_tokens=40) for i in range(12)]
        texts = [f"{PROMPTS[i % len(PROMPTS)]} Answer {i}." for i in range(12)]
        prompts = [generator.encode(text, SYSTEM) for text in texts]
        results = generator.run([generator.engine_request(ids, SpeechSamplingParams(**kw)) for ids, kw in zip(prompts, kws)])
        differ = [i for i, (ids, kw, result) in enumerate(zip(prompts, kws, results))
                  if not torch.equal(torch.tensor(result["stream_token_ids"]), reference.generate(ids, SpeechSamplingParams(**kw)).tokens)]
        assert not differ, differ
        assert worker_sum(generator.omni, live_requests) == 0  # every slot released
    finally:
        worker_sum(generator.omni, functools.partial(step_graphs_eagerly, False))
