"""Stage 0 on the real vLLM-Omni engine (CPU, float32): all S streams equal the reference."""

import functools
import os
import threading
import time

import pytest
import torch

from conftest import flatten, live_requests, worker_sum
from vllm_omni_speechlm.audio import read_wav
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.3)
PROMPTS = [
    "Hi.",
    "Say hello to the world.",
    "What time is it in the morning?",
    "Please say something nice about the weather today, it is sunny.",
]


@pytest.fixture(scope="module")
def generator(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    # Lets the tests ship a function to the worker (collective_rpc "apply_model").
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    with SpeechLMGenerator(tiny_bagpiper, **ENGINE) as gen:
        yield gen


def _reference(reference, generator, prompt: str, system=None, **kw):
    return reference.generate(generator.encode(prompt, system), SpeechSamplingParams(**kw))


def _assert_same(result: dict, ref) -> None:
    assert torch.equal(torch.tensor(result["stream_token_ids"]), ref.tokens)
    assert result["token_ids"] == ref.token_ids
    assert result["text"] == ref.text
    if ref.audio is None:
        assert result["audio"] is None
    else:
        import base64

        wav, rate = read_wav(base64.b64decode(result["audio"]))
        assert rate == 16000 and wav.shape == ref.audio.shape
        torch.testing.assert_close(wav, ref.audio.clamp(-1, 1), atol=1 / 16000, rtol=0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(modality="text", seed=1),
        dict(modality="audio", seed=2),
        dict(modality="text+audio", max_text_tokens=5, seed=3),
        dict(modality="auto", seed=4),
        dict(modality="text+audio", max_text_tokens=4, text_temperature=0.0, audio_temperature=0.0),
        dict(modality="audio", audio_temperature=1.3, audio_top_k=5, text_temperature=0.2, seed=5),
    ],
    ids=["text", "audio", "text+audio", "auto", "greedy", "top-k"],
)
def test_matches_reference(generator, reference, kw):
    kw = dict(max_tokens=40, **kw)
    [result] = generator.generate(PROMPTS[1], system="Be brief.", **kw)
    ref = _reference(reference, generator, PROMPTS[1], system="Be brief.", **kw)
    _assert_same(result, ref)
    assert result["finish_reason"] == ref.finish_reason


def test_concurrent_requests_equal_solo_runs(generator, reference):
    """8 requests of different lengths and output modes in one batch: each equals its solo
    reference run (no crosstalk through slots, history or generators)."""
    _assert_batch_equals_solo_runs(generator, reference)


def _assert_batch_equals_solo_runs(generator, reference) -> None:
    modes = ["audio", "text+audio", "auto", "text+audio"] * 2
    prompts = PROMPTS + [p + " Thanks a lot." for p in PROMPTS]
    batch = []
    for i, (prompt, mode) in enumerate(zip(prompts, modes)):
        kw = dict(modality=mode, seed=7, max_tokens=36, max_text_tokens=2 + i)
        prompt_ids = generator.encode(prompt, None)
        batch.append((generator.engine_request(prompt_ids, SpeechSamplingParams(**kw)), kw, prompt_ids))
    engine_params = batch[0][0][1]
    assert all(b[0][1] == engine_params for b in batch)  # only the speech options differ
    outputs = generator.omni.generate([b[0][0] for b in batch], [engine_params], use_tqdm=False)
    assert len(outputs) == 8
    for out in outputs:
        _, kw, prompt_ids = batch[int(out.request_id.split("_", 1)[0])]
        _assert_same(generator.result(out), reference.generate(prompt_ids, SpeechSamplingParams(**kw)))


def _narrow_steps(model) -> int:
    return model.steps.num_narrow_steps


def test_audio_answers_that_turn_to_text_match_reference(generator, reference):
    """Audio answers in one batch, two of which end their audio with eot and go on in text
    (parallel rules; seed 2: from rows 13 and 9): the steps before skip the text columns
    (`TextRowsWatch`), the text rows get the whole vocabulary, and every stream of every answer
    equals its reference."""
    before = worker_sum(generator.omni, _narrow_steps)
    kw = dict(modality="audio", seed=2, min_audio_frames=4, max_audio_frames=40, max_text_tokens=6, max_tokens=48)
    prompts = [generator.encode(prompt, None) for prompt in PROMPTS]
    results = generator.run([generator.engine_request(ids, SpeechSamplingParams(**kw)) for ids in prompts])
    refs = [reference.generate(ids, SpeechSamplingParams(**kw)) for ids in prompts]
    lo, hi = generator.cfg.text_range
    assert sum(any(lo <= t < hi for t in ref.tokens[:, 0].tolist()) for ref in refs) == 2
    for result, ref in zip(results, refs):
        _assert_same(result, ref)
    assert worker_sum(generator.omni, _narrow_steps) - before >= 4


def _compile_step_functions(backend, model) -> int:
    """Compile with `backend` (None: eager) and warm up as vLLM's dummy sampler run does on CUDA;
    -> graphs compiled."""
    from torch._dynamo.utils import counters

    counters.clear()
    model.steps.compile_step_functions(backend)
    if backend is not None:
        _warm_up(model, model.steps.compile_step_functions_now)
    return _compiled_graphs(model)


def _warm_up(model, warm_up) -> None:
    threads = torch.get_num_threads()  # the warm-up sets vLLM's serving count
    with torch.inference_mode():  # as vLLM runs its dummy sampler run
        hidden = torch.randn(8, model.lm_head.weight.shape[1], device=model.lm_head.weight.device)
        warm_up(hidden, model.logits_processor(model.lm_head, hidden))
    torch.set_num_threads(threads)


def _compiled_graphs(model) -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def test_compiled_step_functions_match_reference(generator, reference):
    """The per-step device math as stage 0 runs it on CUDA (torch.compile, fullgraph, dynamic
    shapes, warmed up at start), traced the same way but run by eager kernels (aot_eager: CPU has
    no Inductor build here): the mixed batch, a guided request and a lone request (the
    batch-size-1 graphs) still equal the reference, and none of them compiles a new graph."""
    warm = worker_sum(generator.omni, functools.partial(_compile_step_functions, "aot_eager"))
    assert warm >= 6  # 3 functions, batch sizes 1 and >= 2, and more variants
    try:
        _assert_batch_equals_solo_runs(generator, reference)
        for kw in (dict(modality="audio", cfg_scale=3.0, seed=8), dict(modality="text+audio", max_text_tokens=3, seed=9)):
            [result] = generator.generate(PROMPTS[2], max_tokens=24, **kw)
            _assert_same(result, _reference(reference, generator, PROMPTS[2], **dict(kw, max_tokens=24)))
        assert worker_sum(generator.omni, _compiled_graphs) == warm
    finally:
        worker_sum(generator.omni, functools.partial(_compile_step_functions, None))


def _failing_backend(graph, example_inputs):
    raise RuntimeError("no compiler here")


def _warm_up_with_failing_compiler(model) -> int:
    model.steps.compile_step_functions(_failing_backend)
    _warm_up(model, model.steps.warm_up_step_functions)
    return int(model.steps.step_backend is None)


def test_step_functions_run_eagerly_when_compiling_fails(generator, reference):
    """A compiler failure in the warm-up leaves the engine serving, eagerly and exactly."""
    assert worker_sum(generator.omni, _warm_up_with_failing_compiler) == 1
    kw = dict(modality="audio", seed=11, max_tokens=16)
    [result] = generator.generate(PROMPTS[1], **kw)
    _assert_same(result, _reference(reference, generator, PROMPTS[1], **kw))


def _live(generator) -> int:
    return worker_sum(generator.omni, live_requests)


def _watch_backbone_inputs(model) -> int:
    """Record the address and rows of every input the backbone gets (for `worker_sum`)."""
    backbone, seen = model.model, []

    def forward(input_ids, positions, intermediate_tensors=None, inputs_embeds=None):
        seen.append((inputs_embeds.data_ptr(), inputs_embeds.shape[0]))
        return type(backbone).forward(backbone, input_ids, positions, intermediate_tensors, inputs_embeds)

    forward.seen = seen
    backbone.forward = forward
    return 0


def _backbone_inputs(model) -> tuple[int, int]:
    """(inputs the backbone got outside the fixed input buffer, distinct row counts); the watch removed."""
    seen = model.model.__dict__.pop("forward").seen
    fixed = getattr(model, "backbone_input", None)
    outside = [ptr for ptr, _ in seen if fixed is None or ptr != fixed.data_ptr()]
    return len(outside), len({rows for _, rows in seen})


def test_backbone_input_stays_at_one_address(generator):
    """vLLM's piecewise CUDA graphs (steps with prompt tokens) read their inputs where they were
    captured: every step's summed embeddings must reach the backbone in the one fixed buffer."""
    worker_sum(generator.omni, _watch_backbone_inputs)
    generator.generate(PROMPTS, modality="audio", max_tokens=6, seed=0)
    generator.generate(PROMPTS[1], modality="audio", max_tokens=4, seed=1)
    outside, sizes = flatten(generator.omni.engine.collective_rpc("apply_model", args=(_backbone_inputs,), stage_ids=[0]))
    assert outside == 0
    assert sizes >= 3  # prompts of several lengths and single decode rows


def test_state_is_freed_after_finish(generator):
    generator.generate(PROMPTS[:2], modality="audio", max_tokens=8, seed=0)
    assert _live(generator) == 0


def test_state_is_freed_after_abort(generator):
    done = threading.Event()
    thread = threading.Thread(
        target=lambda: (generator.generate(PROMPTS[0], modality="audio", max_tokens=400, seed=0), done.set()),
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + 60
    while _live(generator) == 0:  # wait until the worker holds the request
        assert time.monotonic() < deadline and not done.is_set()
        time.sleep(0.05)
    generator.omni.engine.abort(list(generator.omni.request_states))
    thread.join(timeout=60)
    assert not thread.is_alive() and done.is_set()  # generate returned the partial result
    deadline = time.monotonic() + 30
    while _live(generator) != 0:
        assert time.monotonic() < deadline, "per-request state left after abort"
        time.sleep(0.1)


@pytest.mark.parametrize(
    "kw, field",
    [(dict(cfg_scale=float("nan")), "cfg_scale"), (dict(max_tokens=0), "max_tokens"), (dict(modality="x"), "modality")],
)
def test_bad_arguments_raise(generator, kw, field):
    with pytest.raises(ValueError, match=field):
        generator.generate("hello", **kw)


def test_empty_prompt_is_rejected(generator):
    with pytest.raises(ValueError, match="prompts"):
        generator.generate([""])


def _runner_classes(omni) -> set[str]:
    return set(flatten([omni.engine.collective_rpc(lambda worker: type(worker.model_runner).__name__, stage_ids=[0])]))


def test_deploy_yaml_selects_the_batched_runner(generator):
    """speech_lm_only.yaml names the GPU runner and, under `platforms: cpu:`, its CPU twin."""
    assert _runner_classes(generator.omni) == {"CPUSpeechLMARModelRunner"}


@pytest.mark.parametrize("worker", ["CPUSpeechLMARWorker", "CPUARWorker"])
def test_chunked_prefill_matches_reference(tiny_bagpiper, reference, worker):
    """Prompts prefilled in 8-token chunks next to decoding rows: a row samples only once its
    whole prompt is in (the batched runner reads that from vLLM's discard mask, vllm-omni's stock
    runner builds it per request; the model runs under both). Greedy: no seeded generator to rewind."""
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    engine = ENGINE | dict(enable_chunked_prefill=True, max_num_batched_tokens=8)
    with SpeechLMGenerator(tiny_bagpiper, worker_cls=f"vllm_omni_speechlm.platforms.cpu_worker.{worker}", **engine) as gen:
        assert _runner_classes(gen.omni) == {worker.replace("Worker", "ModelRunner")}
        kw = dict(modality="text+audio", max_text_tokens=4, max_tokens=30, text_temperature=0.0, audio_temperature=0.0)
        for prompt, result in zip(PROMPTS[1:3], gen.generate(PROMPTS[1:3], **kw)):
            _assert_same(result, _reference(reference, gen, prompt, **kw))
