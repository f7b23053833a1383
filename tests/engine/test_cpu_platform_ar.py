"""One AR stage on the CPU OmniPlatform generates exactly what plain vLLM generates."""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import CPU_PLATFORM_MAX_TOKENS as MAX_TOKENS
from conftest import CPU_PLATFORM_AR_DEPLOY as AR_DEPLOY
from conftest import CPU_PLATFORM_PROMPTS as PROMPTS


def _greedy():
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def omni_ar(cpu_platform_tiny_qwen3, cpu_platform_plugins_loaded, tmp_path_factory, cpu_platform_vllm_greedy):
    # Depends on the reference so plain vLLM has finished (and freed its engine) first.
    from vllm_omni import Omni

    deploy = Path(tmp_path_factory.mktemp("deploy")) / "ar.yaml"
    deploy.write_text(AR_DEPLOY)
    omni = Omni(model=str(cpu_platform_tiny_qwen3), deploy_config=str(deploy))
    yield omni
    omni.close()


def test_omni_ar_stage_matches_plain_vllm(omni_ar, cpu_platform_vllm_greedy):
    outs = omni_ar.generate([{"prompt_token_ids": p} for p in PROMPTS], [_greedy()])
    by_prompt = {tuple(o.prompt_token_ids): o for o in outs}
    assert len(by_prompt) == len(PROMPTS)
    for prompt in PROMPTS:
        out, expected = by_prompt[tuple(prompt)], cpu_platform_vllm_greedy[tuple(prompt)]
        assert out.stage_id == 0 and out.finished
        assert len(expected) == MAX_TOKENS
        assert list(out.outputs[0].token_ids) == expected


def test_omni_ar_stage_runs_on_cpu_worker(omni_ar):
    """The stage really ran through this project's CPU worker (not a fallback)."""
    from vllm_omni.platforms import current_omni_platform

    assert type(current_omni_platform).__name__ == "CpuOmniPlatform"
    stage_meta = omni_ar.engine.get_stage_metadata(0)
    assert stage_meta.stage_type != "diffusion"
