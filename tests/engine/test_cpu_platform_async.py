"""AsyncOmni on the CPU OmniPlatform: two concurrent requests, then a clean shutdown."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import psutil
from conftest import CPU_PLATFORM_AR_DEPLOY as AR_DEPLOY
from conftest import CPU_PLATFORM_PROMPTS as PROMPTS

MAX_TOKENS = 10


def _children() -> dict[int, str]:
    out = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            out[proc.pid] = " ".join(proc.cmdline())
        except psutil.Error:
            pass
    return out


def _engine_children(before: dict[int, str]) -> dict[int, str]:
    # multiprocessing's resource tracker is one per interpreter (started on first use of shared
    # memory / semaphores) and outlives every engine by design; everything else must be gone.
    return {
        pid: cmd for pid, cmd in _children().items() if pid not in before and "resource_tracker" not in cmd
    }


async def _collect(engine, prompt: list[int], request_id: str, params) -> tuple[list[int], float, float]:
    first = last = None
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, request_id=request_id, sampling_params_list=[params]):
        now = time.monotonic()
        first = first or now
        last = now
        final = out
    assert final is not None and final.finished
    return list(final.outputs[0].token_ids), first, last


def test_async_omni_two_concurrent_requests_and_clean_shutdown(
    cpu_platform_tiny_qwen3, cpu_platform_plugins_loaded, cpu_platform_vllm_greedy, tmp_path
):
    from vllm import SamplingParams
    from vllm_omni import AsyncOmni

    deploy = Path(tmp_path) / "ar.yaml"
    deploy.write_text(AR_DEPLOY)
    before = _children()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)

    async def main():
        engine = AsyncOmni(model=str(cpu_platform_tiny_qwen3), deploy_config=str(deploy))
        try:
            assert _engine_children(before), "AsyncOmni should run its stage in child processes"
            return await asyncio.gather(
                *(_collect(engine, p, f"req-{i}", params) for i, p in enumerate(PROMPTS))
            )
        finally:
            engine.shutdown()

    results = asyncio.run(main())

    for prompt, (tokens, _, _) in zip(PROMPTS, results):
        assert tokens == cpu_platform_vllm_greedy[tuple(prompt)][:MAX_TOKENS]
    # Concurrent, not serialized: each request produced output before the other one finished.
    (_, first_a, last_a), (_, first_b, last_b) = results
    assert first_a <= last_b and first_b <= last_a

    deadline = time.monotonic() + 30
    while _engine_children(before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _engine_children(before) == {}
