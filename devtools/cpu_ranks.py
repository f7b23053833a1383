"""The environment of a tensor-parallel engine on vLLM's CPU backend (tests, benchmarks)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


@contextlib.contextmanager
def cpu_ranks(tp: int) -> Iterator[None]:
    """For the block: each of `tp` ranks bound to its own share of this process's CPUs, and
    functions allowed through collective_rpc. vLLM's default (auto) binds each rank to a NUMA node
    of its own and refuses to start with fewer nodes than ranks (vllm/utils/ompmultiprocessing.py,
    `_get_autobind_cpu_ids`)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // tp)
    bind = "|".join(",".join(map(str, cpus[r * per : (r + 1) * per] or cpus[-1:])) for r in range(tp))
    env = {"VLLM_CPU_OMP_THREADS_BIND": bind, "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v
