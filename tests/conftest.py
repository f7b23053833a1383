"""Shared fixtures: tiny checkpoints are made once per test session, never downloaded."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


@pytest.fixture(scope="session")
def tiny_bagpiper(tmp_path_factory) -> str:
    from vllm_omni_speechlm.make_tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny-bagpiper")
    make_tiny("bagpiper", out, seed=0)
    return str(out)


@pytest.fixture(scope="session")
def reference(tiny_bagpiper):
    from vllm_omni_speechlm.reference import ReferenceSpeechLM

    return ReferenceSpeechLM(tiny_bagpiper)
