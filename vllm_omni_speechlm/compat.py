"""Private vLLM / vllm-omni internals this project relies on, in one place.

Each hook names the private attribute it reads or replaces; `tests/test_compat.py` checks each
against the installed versions, so an upgrade that moves one fails there first.
"""

from __future__ import annotations

from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

# vLLM's sampler modules: their JIT kernels (top-k / top-p, rejection sampling) run only for
# requests that ask for them.
SAMPLER_KERNEL_MODULES = ("vllm.v1.sample.",)


def jit_warmup_kernels(model_runner: Any) -> dict[Any, list]:
    """The runner's JIT warm-up registrations, {kernel: [(args, kwargs), ...]}: vLLM's
    `JitWarmupRegistry._registrations`, filled while the runner, model and KV cache are built
    and compiled by `kernel_warmup` (`enable_jit_warmup`, which vllm-omni 0.30 lets no deploy
    YAML or CLI flag set)."""
    registry = getattr(model_runner, "jit_warmup_registry", None)
    return registry._registrations if registry is not None else {}


def is_sampler_kernel(kernel: Any) -> bool:
    """A kernel of vLLM's sampler; Triton dispatchers carry their function's `__module__`."""
    return getattr(kernel, "__module__", "").startswith(SAMPLER_KERNEL_MODULES)


def drop_sampler_jit_warmup(model_runner: Any) -> list[str]:
    """Leave vLLM's sampler kernels out of the runner's JIT warm-up; returns their names. The
    kernels the steps do launch (slot mapping, attention) stay, so no request compiles them."""
    kernels = jit_warmup_kernels(model_runner)
    dropped = [k for k in kernels if is_sampler_kernel(k)]
    for kernel in dropped:
        del kernels[kernel]
    return [getattr(k, "__name__", type(k).__name__) for k in dropped]


# ---- concurrent stage start ---------------------------------------------------------------
# The deploy YAML's top-level key for vllm-omni's `parallel_stage_init`: its stages start at once
# (each stage process imports for ~25 s on a GPU host, and stage 0 compiles for longer still).
# vllm-omni 0.30 takes the option only as an `Omni(...)` / `AsyncOmni(...)` keyword: `vllm serve`
# has no flag for it, and its deploy YAML loader drops keys it does not know.
PARALLEL_STAGE_INIT_KEY = "parallel_stage_init"


def parallel_stage_init_of(deploy: dict[str, Any], path: str) -> bool | None:
    """`parallel_stage_init` of a loaded deploy YAML (None: not set); a non-bool is an error."""
    value = deploy.get(PARALLEL_STAGE_INIT_KEY)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"deploy config {path}: {PARALLEL_STAGE_INIT_KEY}: expected true or false, got {value!r}")
    return value


def deploy_parallel_stage_init(path: str | None) -> bool | None:
    """The deploy YAML's `parallel_stage_init` (None: not set, or no YAML)."""
    if not path:
        return None
    import yaml

    with open(path, encoding="utf-8") as f:
        return parallel_stage_init_of(yaml.safe_load(f) or {}, path)


def with_deploy_parallel_stage_init(kwargs: dict[str, Any], on_cpu: bool) -> dict[str, Any]:
    """vllm-omni engine keyword arguments with the deploy YAML's `parallel_stage_init` where the
    caller set none. Not on CPU: vllm-omni's admission check budgets GPU memory."""
    if kwargs.get(PARALLEL_STAGE_INIT_KEY) is not None:
        return kwargs
    from_yaml = deploy_parallel_stage_init(kwargs.get("deploy_config"))
    if from_yaml is None:
        return kwargs
    if from_yaml and on_cpu:
        logger.info("%s: stages start one after the other on CPU", PARALLEL_STAGE_INIT_KEY)
        return kwargs
    return kwargs | {PARALLEL_STAGE_INIT_KEY: from_yaml}


def pass_parallel_stage_init_from_deploy() -> None:
    """Make vllm-omni's engine (`OmniEngineBase.__init__`, which reads the keyword) take
    `parallel_stage_init` from the deploy YAML. Idempotent."""
    import functools

    from vllm.platforms import current_platform
    from vllm_omni.engine.omni_engine_base import OmniEngineBase

    init = OmniEngineBase.__init__
    if getattr(init, "_reads_deploy_parallel_stage_init", False):
        return

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **with_deploy_parallel_stage_init(kwargs, current_platform.is_cpu()))

    __init__._reads_deploy_parallel_stage_init = True  # type: ignore[attr-defined]
    OmniEngineBase.__init__ = __init__
