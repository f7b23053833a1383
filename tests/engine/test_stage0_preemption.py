"""A KV cache too small for the batch forces preemption: results still equal the reference."""

import os

import pytest
import torch

from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

# 4 blocks of 128 tokens: 8 requests growing past one block each cannot all stay resident.
ENGINE = dict(
    dtype="float32",
    enforce_eager=True,
    max_num_seqs=8,
    max_model_len=384,
    gpu_memory_utilization=0.3,
    num_gpu_blocks_override=4,
)


def resumed_and_live(model) -> tuple[int, int]:
    return model.steps.num_resumed, len(model.steps)


@pytest.fixture(scope="module")
def generator(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc("apply_model")
    with SpeechLMGenerator(tiny_bagpiper, **ENGINE) as gen:
        yield gen


def test_preempted_requests_equal_reference(generator, reference):
    prompts = [f"Please read sentence number {i} aloud." for i in range(8)]
    # Long answers (audio may not end before max_tokens) fill the small KV cache.
    kw = dict(modality="text+audio", max_text_tokens=10, max_tokens=200, seed=21, min_audio_frames=200)
    results = generator.generate(prompts, **kw)
    [[(resumed, live)]] = generator.omni.engine.collective_rpc("apply_model", args=(resumed_and_live,), stage_ids=[0])
    assert resumed > 0, "the KV cache was meant to force preemption"
    assert live == 0
    for prompt, result in zip(prompts, results):
        ref = reference.generate(generator.encode(prompt, None), SpeechSamplingParams(**kw))
        assert torch.equal(torch.tensor(result["stream_token_ids"]), ref.tokens)


def test_token_outputs_index_the_aux_history_of_every_scheduled_token():
    """A re-prefill (prompt + outputs), a fresh prompt and a decode token in one step: each token's
    output index is its position minus the prompt length (negative: a prompt token)."""
    import numpy as np

    from vllm_omni_speechlm.models.steps import _token_outputs

    computed, scheduled, prompt_len = np.array([0, 0, 7]), np.array([5, 2, 1]), np.array([3, 1 << 62, 4])
    row, output = _token_outputs(computed, scheduled, prompt_len)
    assert row.tolist() == [0, 0, 0, 0, 0, 1, 1, 2]
    assert output[:5].tolist() == [-3, -2, -1, 0, 1]  # resumed: outputs 0 and 1 come from the history
    assert (output[5:7] < 0).all()  # a request not admitted yet: prompt only
    assert output[7] == 3  # decode: position 7 is output 3
