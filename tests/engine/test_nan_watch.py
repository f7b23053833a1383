"""The NaN watch (`benchmarks/stack_sampler/nan_watch.py`, SPEECHLM_NAN_WATCH=1) on the real engine
(CPU): a prompt token whose input embedding is NaN is reported, with its row, the weights and the KV
blocks holding NaN."""

import functools
import os
from pathlib import Path

import pytest

from conftest import flatten, worker_sum
from test_stage0_engine import ENGINE, PROMPTS

SAMPLER = Path(__file__).resolve().parents[2] / "benchmarks" / "stack_sampler"


@pytest.fixture(scope="module")
def generator(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc("apply_model")
    with pytest.MonkeyPatch.context() as env:  # the stage processes load sitecustomize at start
        env.setenv("PYTHONPATH", f"{SAMPLER}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        env.setenv("SPEECHLM_NAN_WATCH", "1")
        with SpeechLMGenerator(tiny_bagpiper, **ENGINE) as gen:
            yield gen


def _poison_embedding(token: int, model) -> int:
    model.model.embed_tokens.weight.data[token] = float("nan")
    return 0


def _watched(model) -> dict:
    import nan_watch  # the stage process's, loaded by sitecustomize

    watch = nan_watch.WATCH
    return {"seen": sorted(watch.seen), "first": watch.first, "layers": len(watch.layers or [])}


def _watch_state(generator) -> dict:
    [state] = flatten(generator.omni.engine.collective_rpc("apply_model", args=(_watched,), stage_ids=[0]))
    return state


def test_a_nan_input_embedding_is_reported(generator):
    generator.generate(PROMPTS[0], modality="audio", max_tokens=4, seed=0)
    assert _watch_state(generator)["first"] is None  # finite steps report nothing
    token = generator.encode(PROMPTS[1], None)[-4]  # a prompt token before the assistant turn
    worker_sum(generator.omni, functools.partial(_poison_embedding, token))
    generator.generate(PROMPTS[1], modality="audio", max_tokens=4, seed=0)
    state = _watch_state(generator)
    first, layers = state["first"], state["layers"]
    assert len(state["seen"]) == 1 and first["bad_rows"] == first["rows"] == 1 and first["kv_non_finite"]
    assert first["weights"] == ["model.embed_tokens.weight"] and "backbone_input" in first["buffers"]
    assert layers >= 2 and first["kv_blocks"] == [1] * layers  # the prompt's one block, in every layer
