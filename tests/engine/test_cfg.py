"""Paired CFG co-scheduling on the real vLLM-Omni engine (CPU, float32): guided requests equal
the reference's CFG on every stream, pairs never leak, and preempted pairs stay exact."""

import dataclasses
import os
import random
import threading
import time

import pytest
import torch

from vllm_omni_speechlm.cfg import companion_id, is_companion, main_id, wants_guidance
from vllm_omni_speechlm.sampling_params import SPEECH_PARAMS_KEY, SpeechSamplingParams

ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.3)
# 6 blocks of 128 tokens for up to 8 rows (4 pairs) growing past one block each: preemption.
SMALL_KV = dict(ENGINE, max_model_len=384, num_gpu_blocks_override=6)
PROMPTS = ["Hi.", "Say hello to the world.", "What time is it in the morning?", "Read this out loud please."]


def model_state(model) -> tuple[int, int, int]:
    return len(model.steps), model.steps.table.num_companions if model.steps.table else 0, model.steps.num_resumed_companions


def _state(generator) -> tuple[int, int, int]:
    [[state]] = generator.omni.engine.collective_rpc("apply_model", args=(model_state,), stage_ids=[0])
    return state


def _generator(model_dir, **engine):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc("apply_model")
    return SpeechLMGenerator(model_dir, **engine)


@pytest.fixture(scope="module")
def generator(tiny_bagpiper):
    with _generator(tiny_bagpiper, **ENGINE) as gen:
        yield gen


def _run_batch(generator, items):
    """items: (prompt, speech kwargs) sharing the engine-level params; -> results in item order."""
    batch = [generator.engine_request(generator.encode(p, None), SpeechSamplingParams(**kw)) for p, kw in items]
    assert all(b[1] == batch[0][1] for b in batch)  # only the speech options differ
    outputs = generator.omni.generate([b[0] for b in batch], [batch[0][1]], use_tqdm=False)
    assert len(outputs) == len(items)  # no companion output reaches the client
    return [generator.result(o) for o in sorted(outputs, key=lambda o: int(o.request_id.split("_", 1)[0]))]


def _assert_reference(generator, reference, prompt, kw, result):
    ref = reference.generate(generator.encode(prompt, None), SpeechSamplingParams(**kw))
    assert torch.equal(torch.tensor(result["stream_token_ids"]), ref.tokens)
    assert result["finish_reason"] == ref.finish_reason


def test_companion_naming_and_opt_in(reference):
    cid = companion_id("7_abc")
    assert is_companion(cid) and not is_companion("7_abc") and main_id(cid) == "7_abc"
    cfg = reference.cfg
    def info(scale):
        return {SPEECH_PARAMS_KEY: {"cfg_scale": scale}}

    assert wants_guidance(info(3.0), cfg) and not wants_guidance(info(1.0), cfg)
    assert not wants_guidance(info(float("nan")), cfg) and not wants_guidance(None, cfg)
    no_guidance = dataclasses.replace(cfg, decoding=dataclasses.replace(cfg.decoding, guidance=False))
    assert not wants_guidance(info(3.0), no_guidance)
    with pytest.raises(ValueError, match="cfg_scale"):
        SpeechSamplingParams(cfg_scale=3.0).resolve(no_guidance)


@pytest.mark.parametrize(
    "kw",
    [
        dict(modality="audio", seed=3),
        dict(modality="text+audio", max_text_tokens=5, seed=4),
        dict(modality="auto", seed=5),
        dict(modality="audio", audio_temperature=0.0, text_temperature=0.0),
    ],
    ids=["audio", "text+audio", "auto", "greedy"],
)
def test_cfg_matches_reference(generator, reference, kw):
    kw = dict(cfg_scale=3.0, max_tokens=40, **kw)
    [result] = generator.generate(PROMPTS[1], **kw)
    _assert_reference(generator, reference, PROMPTS[1], kw, result)
    unguided = dict(kw, cfg_scale=1.0)
    ref_unguided = reference.generate(generator.encode(PROMPTS[1], None), SpeechSamplingParams(**unguided))
    if kw["modality"] != "auto":  # guidance changed the audio (the test can fail)
        assert not torch.equal(torch.tensor(result["stream_token_ids"]), ref_unguided.tokens)


def test_mixed_cfg_batch_equals_solo_runs(generator, reference):
    """Guided and unguided requests of different lengths in one batch: each equals its solo
    reference run, and no pair state is left."""
    items = [
        (PROMPTS[i % 4] + " Thanks." * (i // 4), dict(modality="text+audio", max_text_tokens=1 + i, max_tokens=36, seed=9, cfg_scale=[1.0, 3.0, 2.0][i % 3]))
        for i in range(7)
    ]
    for (prompt, kw), result in zip(items, _run_batch(generator, items)):
        _assert_reference(generator, reference, prompt, kw, result)
    live, companions, _ = _state(generator)
    assert live == 0 and companions == 0


def test_abort_of_main_removes_companion(generator):
    done = threading.Event()
    thread = threading.Thread(
        target=lambda: (generator.generate(PROMPTS[0], modality="audio", cfg_scale=3.0, max_tokens=400, seed=0), done.set()),
        daemon=True,
    )
    thread.start()
    deadline = time.monotonic() + 60
    while _state(generator)[1] == 0:  # wait until the worker holds the pair
        assert time.monotonic() < deadline and not done.is_set()
        time.sleep(0.05)
    assert _state(generator)[0] == 2
    generator.omni.engine.abort(list(generator.omni.request_states))  # the client knows only the main
    thread.join(timeout=60)
    assert not thread.is_alive()
    deadline = time.monotonic() + 30
    while _state(generator)[:2] != (0, 0):
        assert time.monotonic() < deadline, "pair state left after abort"
        time.sleep(0.1)


def test_random_cfg_and_aborts_leave_nothing(generator):
    """100 requests, random guidance on/off, a random fifth aborted mid-flight."""
    rng = random.Random(0)
    items = [
        (PROMPTS[i % 4], dict(modality="audio", max_tokens=rng.randint(4, 24), seed=1, cfg_scale=rng.choice([1.0, 3.0])))
        for i in range(100)
    ]
    batch = [generator.engine_request(generator.encode(p, None), SpeechSamplingParams(**kw)) for p, kw in items]
    params = batch[0][1].clone()
    params.max_tokens = 24
    stop = threading.Event()

    def abort_some():
        while not stop.is_set():
            ids = list(generator.omni.request_states)
            if ids:
                generator.omni.engine.abort(rng.sample(ids, max(1, len(ids) // 5)))
            time.sleep(0.5)

    aborter = threading.Thread(target=abort_some, daemon=True)
    aborter.start()
    try:
        generator.omni.generate([b[0] for b in batch], [params], use_tqdm=False)
    finally:
        stop.set()
        aborter.join(timeout=10)
    deadline = time.monotonic() + 30
    while _state(generator)[:2] != (0, 0):
        assert time.monotonic() < deadline, f"left behind: {_state(generator)}"
        time.sleep(0.1)


def test_preempted_pairs_equal_reference(tiny_bagpiper, reference):
    prompts = [f"Please read sentence number {i} aloud." for i in range(4)]
    kws = [dict(modality="text+audio", max_text_tokens=6, max_tokens=200, seed=21, cfg_scale=3.0,
               min_audio_frames=200) for i in range(4)]
    with _generator(tiny_bagpiper, **SMALL_KV) as gen:
        results = _run_batch(gen, list(zip(prompts, kws)))
        live, companions, resumed = _state(gen)
    assert resumed > 0, "the KV cache was meant to force the preemption of a pair"
    assert live == 0 and companions == 0
    for prompt, kw, result in zip(prompts, kws, results):
        _assert_reference(gen, reference, prompt, kw, result)


def test_pair_that_does_not_fit_does_not_block_others(tiny_bagpiper, reference):
    """Two slots: a long plain request runs, a pair arrives (needs both slots), then a short plain
    request: the short one runs and finishes while the pair waits; all equal the reference."""
    items = [
        (PROMPTS[0], dict(modality="audio", max_tokens=60, seed=2)),
        (PROMPTS[1], dict(modality="audio", max_tokens=60, seed=2, cfg_scale=3.0)),
        (PROMPTS[2], dict(modality="audio", max_tokens=60, seed=2)),
    ]
    batch = [None] * 3
    with _generator(tiny_bagpiper, **dict(ENGINE, max_num_seqs=2)) as gen:
        requests = [gen.engine_request(gen.encode(p, None), SpeechSamplingParams(**kw)) for p, kw in items]
        outputs = gen.omni.generate([r[0] for r in requests], [requests[0][1]], use_tqdm=False)
        order = [int(o.request_id.split("_", 1)[0]) for o in outputs]  # completion order
        for o, i in zip(outputs, order):
            batch[i] = gen.result(o)
        assert _state(gen)[:2] == (0, 0)
    assert order.index(2) < order.index(1), f"the plain request waited behind the pair: {order}"
    for (prompt, kw), result in zip(items, batch):
        _assert_reference(gen, reference, prompt, kw, result)
