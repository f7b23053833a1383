"""Stage 0 under tensor parallelism: a real engine with tensor_parallel_size 2 on vLLM's CPU backend
(two worker processes, vLLM's CPU communicator), float32 tiny Bagpiper. Every stream of every row
equals the plain-PyTorch reference (what one rank gives: test_stage0_engine.py), greedy with audio
input, seeded sampling, a CFG pair, a mixed batch, also with the step functions compiled as on a GPU
and through the step graphs' padded path;
each rank holds its shard of the vocabulary-parallel tables and the project's own parameters whole;
every rank's per-request state is empty after the requests finish."""

import functools
import os

import pytest
import torch

from conftest import assert_result_equals_reference, flatten, live_requests, reference_with_clips, step_graphs_eagerly, worker_sum
from devtools import audio_clips
from devtools.cpu_ranks import cpu_ranks
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

TP = 2
ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.3,
              tensor_parallel_size=TP)
SYSTEM = "Be brief."
GREEDY = dict(text_temperature=0.0, audio_temperature=0.0)


def _clip(seconds: float, pitch: float):
    return audio_clips.as_float(audio_clips.clip(seconds, pitch)), audio_clips.RATE


@pytest.fixture(scope="module")
def generator(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    with cpu_ranks(TP), SpeechLMGenerator(tiny_bagpiper, **ENGINE) as gen:
        yield gen


def _per_rank(generator, fn) -> list:
    return list(flatten(generator.omni.engine.collective_rpc("apply_model", args=(fn,), stage_ids=[0])))


def _rank(model) -> str:
    return f"{model.lm_head.tp_rank}/{model.lm_head.tp_size}"


def test_two_ranks_hold_the_stage(generator):
    assert sorted(_per_rank(generator, _rank)) == ["0/2", "1/2"]


def _weight_mismatches(model_dir: str, model) -> list[str]:
    """Names of this rank's parameters that differ from the checkpoint: the vocabulary-parallel
    tables hold the rows [start, end) of their shard (the deferred eos's input row is the eos's),
    the project's own parameters are whole."""
    from safetensors.torch import load_file

    ckpt = load_file(os.path.join(model_dir, "model.safetensors"))
    cfg, head = model.speech, model.lm_head
    lo, hi = head.shard_indices.org_vocab_start_index, head.shard_indices.org_vocab_end_index
    emb = ckpt["model.embed_tokens.weight"].clone()
    emb[cfg.decoding.deferred_eos] = emb[cfg.specials.eos]
    want = {
        "lm_head": (head.weight[: hi - lo], ckpt["lm_head.weight"][lo:hi]),
        "embed_tokens": (model.model.embed_tokens.weight[: hi - lo], emb[lo:hi]),
        "aux_pad_weight": (model.aux_pad_weight, ckpt["lm_head.weight"][cfg.specials.pad]),
        "stream_embeddings": (model.stream_embeddings.weight, ckpt["stream_embeddings.weight"]),
    }
    mismatches = [name for name, (have, ckpt_value) in want.items() if not torch.equal(have.cpu(), ckpt_value)]
    for name in ("audio_adaptor", "audio_tower.proj2"):  # replicated linears, read through the layer
        layer, weight, bias = model.get_submodule(name), ckpt[f"{name}.weight"], ckpt[f"{name}.bias"]
        with torch.inference_mode():  # the CPU backend may repack a linear's weight: compare outputs
            have = layer(torch.eye(weight.shape[1]))
        have = have[0] if isinstance(have, tuple) else have
        mismatches += [] if torch.allclose(have, weight.T + bias, rtol=0, atol=1e-6) else [name]
    return mismatches


def test_each_rank_loads_its_shard_and_the_whole_of_the_rest(generator, tiny_bagpiper):
    """vLLM's loader shards the backbone and the LM head; the stream embeddings, the aux head's pad
    row, the adaptor and the tower's replicated layers are whole on every rank."""
    assert _per_rank(generator, functools.partial(_weight_mismatches, tiny_bagpiper)) == []


CASES = {
    # greedy, every stream: audio in (no text) -> text then speech; text and audio in -> speech
    "audio_prompt_greedy": ("", [_clip(0.7, 240.0)], dict(modality="text+audio", max_text_tokens=5, **GREEDY)),
    "text_audio_prompt_greedy": ("What is said in the recording?", [_clip(1.5, 180.0)], dict(modality="audio", **GREEDY)),
    "text_prompt_greedy": ("Say hello to the world.", [], dict(modality="text+audio", max_text_tokens=4, **GREEDY)),
    # sampled: stream 0 from vLLM's per-request generator, the aux streams' counter-based noise
    "seeded": ("Say hello to the world.", [], dict(modality="audio", seed=5, audio_top_k=5)),
    "seeded_text_audio": ("What time is it?", [], dict(modality="text+audio", max_text_tokens=5, seed=3)),
    # a CFG pair: the companion scheduled with its main on every rank, merged on the gathered logits
    "cfg3": ("Read this out loud please.", [], dict(modality="audio", cfg_scale=3.0, seed=8)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_reference(generator, reference, name):
    prompt, clips, kw = CASES[name]
    kw = dict(max_tokens=36, **kw)
    [result] = generator.generate(prompt, system=SYSTEM, audio=clips or None, **kw)
    assert_result_equals_reference(result, reference_with_clips(reference, generator, prompt, clips, **kw))


def test_a_batch_equals_its_solo_runs(generator, reference):
    """Requests of different lengths and modes in one batch, a CFG pair among them: each equals its
    reference run on every rank's replicated slots and tables."""
    _assert_batch_equals_reference(generator, reference)


def _assert_batch_equals_reference(generator, reference) -> None:
    prompts = ["Hi.", "Say hello to the world.", "What time is it in the morning?", "Thanks a lot."]
    kws = [dict(modality="audio"), dict(modality="text+audio", max_text_tokens=3),
           dict(modality="audio", cfg_scale=3.0), dict(modality="auto")]
    kws = [dict(kw, seed=7, max_tokens=30) for kw in kws]
    batch = [generator.engine_request(generator.encode(p, SYSTEM), SpeechSamplingParams(**kw)) for p, kw in zip(prompts, kws)]
    assert all(b[1] == batch[0][1] for b in batch)  # only the speech options differ
    outputs = generator.omni.generate([b[0] for b in batch], [batch[0][1]], use_tqdm=False)
    assert len(outputs) == len(prompts)
    for out in outputs:
        i = int(out.request_id.split("_", 1)[0])
        assert_result_equals_reference(generator.result(out), reference_with_clips(reference, generator, prompts[i], [], **kws[i]))


def _compile_step_functions(on: bool, model) -> int:
    """The step functions compiled as on CUDA (fullgraph, dynamic; vLLM's collectives as the custom
    ops torch.compile traces there), traced the same way but run by eager kernels (aot_eager), and
    warmed up as vLLM's dummy sampler run does; or back to eager (False). -> graphs compiled."""
    from torch._dynamo.utils import counters

    from vllm_omni_speechlm.compat import custom_op_collectives

    custom_op_collectives(on)
    counters.clear()
    model.steps.compile_step_functions("aot_eager" if on else None)
    if on:  # PyTorch's check that a custom op's output aliases no input errs here, not only under $CI
        with torch.inference_mode(), torch._functorch.config.patch(error_on_custom_op_aliasing=True):
            hidden = torch.randn(8, model.lm_head.weight.shape[1])
            model.steps.warm_up_step_functions(hidden, model.logits_processor(model.lm_head, hidden))
    return counters["stats"]["unique_graphs"]


def test_compiled_step_functions_match_reference(generator, reference):
    """The step functions as a GPU's TP stage 0 compiles them (the aux head's all-gather and the
    staging all-reduce inside one traced graph each): a batch with a CFG pair still equals the
    reference. A rank whose compile failed would raise here (steps.py), not run on eagerly."""
    graphs = _per_rank(generator, functools.partial(_compile_step_functions, True))
    try:
        assert len(graphs) == TP and min(graphs) >= 6  # 4 functions, one row and more, CFG pairs, ...
        _assert_batch_equals_reference(generator, reference)
    finally:
        _per_rank(generator, functools.partial(_compile_step_functions, False))


def _graph_replays(model) -> int:
    return model.steps.graphs.num_replays


def test_step_graphs_match_reference(generator, reference):
    """The steps as step graphs replay them on every rank (padded static buffers, the collectives
    inside; run eagerly on CPU): a batch with a CFG pair still equals the reference, and every rank
    replayed the same steps."""
    _per_rank(generator, functools.partial(step_graphs_eagerly, True))
    try:
        _assert_batch_equals_reference(generator, reference)
        replays = _per_rank(generator, _graph_replays)
        assert len(replays) == TP and replays[0] == replays[1] > 20
    finally:
        _per_rank(generator, functools.partial(step_graphs_eagerly, False))


def test_every_ranks_state_is_freed_after_finish(generator):
    generator.generate(["Hi.", "Say hello."], modality="audio", cfg_scale=3.0, max_tokens=8, seed=0)
    assert len(_per_rank(generator, live_requests)) == TP
    assert worker_sum(generator.omni, live_requests) == 0
