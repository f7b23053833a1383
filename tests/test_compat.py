"""The private vLLM / vllm-omni hooks of `vllm_omni_speechlm/compat.py`, against the installed versions."""

from __future__ import annotations

import dataclasses
import inspect
from types import SimpleNamespace

import pytest
import yaml
from vllm.model_executor.warmup import kernel_warmup
from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
from vllm.v1.sample.ops import topk_topp_triton
from vllm.v1.worker.block_table import _COMPUTE_SLOT_MAPPING_KERNEL
from vllm.v1.worker.gpu_worker import Worker

import stage_configs
from vllm_omni_speechlm import compat
from vllm_omni_speechlm.runner import CodecStageWorker, SamplerFreeWarmupMixin, SpeechLMARWorker


def _runner_with_registrations() -> SimpleNamespace:
    """A runner's warm-up list as vLLM builds it: the sampler's kernels (every runner's Sampler
    registers them) and the slot-mapping kernel (its block table)."""
    registry = JitWarmupRegistry(vllm_config=None)
    with registry.activate():
        topk_topp_triton._topk_topp.register_warmup()
        topk_topp_triton._topp_split_stats.register_warmup()
        _COMPUTE_SLOT_MAPPING_KERNEL.register_warmup(
            kv_cache_block_size=16, blocks_per_kv_block=1, total_cp_world_size=1, total_cp_rank=0,
            cp_kv_cache_interleave_size=1, block_table_stride=64, block_size=16,
        )
    return SimpleNamespace(jit_warmup_registry=registry)


def test_sampler_kernels_leave_the_jit_warmup_and_the_rest_stays():
    runner = _runner_with_registrations()
    assert len(runner.jit_warmup_registry) == 3
    assert sorted(compat.drop_sampler_jit_warmup(runner)) == ["_topk_topp", "_topp_split_stats"]
    assert list(compat.jit_warmup_kernels(runner)) == [_COMPUTE_SLOT_MAPPING_KERNEL]
    assert compat.drop_sampler_jit_warmup(runner) == []


def test_a_runner_without_a_registry_has_nothing_to_drop():
    assert compat.drop_sampler_jit_warmup(SimpleNamespace()) == []


def test_vllm_warms_up_the_runner_registry_the_workers_prune():
    """What `drop_sampler_jit_warmup` relies on: vLLM's GPU worker warms up through
    `kernel_warmup`, which compiles `model_runner.jit_warmup_registry`, a dict of kernels."""
    assert "kernel_warmup(self)" in inspect.getsource(Worker.compile_or_warm_up_model)
    source = inspect.getsource(kernel_warmup.kernel_warmup)
    assert "worker.model_runner.jit_warmup_registry" in source and "registry.warmup()" in source
    assert isinstance(JitWarmupRegistry(vllm_config=None)._registrations, dict)
    for worker in (SpeechLMARWorker, CodecStageWorker):
        assert worker.compile_or_warm_up_model is SamplerFreeWarmupMixin.compile_or_warm_up_model
        assert worker.__mro__.index(SamplerFreeWarmupMixin) < worker.__mro__.index(Worker)


def test_gpu_yamls_pick_the_pruning_workers_and_cpu_keeps_its_own():
    for name in ("bagpiper_streaming.yaml", "bagpiper_batch.yaml", "opuslm_streaming.yaml"):
        with open(stage_configs.path(name)) as f:
            deploy = yaml.safe_load(f)
        gpu = {s["stage_id"]: s["worker_cls"] for s in deploy["stages"]}
        cpu = {s["stage_id"]: s["worker_cls"] for s in deploy["platforms"]["cpu"]["stages"]}
        assert gpu == {0: "vllm_omni_speechlm.runner.SpeechLMARWorker", 1: "vllm_omni_speechlm.runner.CodecStageWorker"}
        assert cpu == {0: "vllm_omni_speechlm.platforms.cpu_worker.CPUSpeechLMARWorker",
                       1: "vllm_omni_speechlm.platforms.cpu_worker.CPUGenerationWorker"}, name


# ---- parallel_stage_init from the deploy YAML ------------------------------------------------


def _deploy(tmp_path, **top) -> str:
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"pipeline": "bagpiper_two_stage", **top}))
    return str(path)


def test_the_deploy_yaml_sets_parallel_stage_init_where_the_caller_did_not(tmp_path):
    on = _deploy(tmp_path, parallel_stage_init=True)
    assert compat.with_deploy_parallel_stage_init({"deploy_config": on}, on_cpu=False)["parallel_stage_init"] is True
    caller = {"deploy_config": on, "parallel_stage_init": False}
    assert compat.with_deploy_parallel_stage_init(caller, on_cpu=False) == caller
    assert "parallel_stage_init" not in compat.with_deploy_parallel_stage_init({"deploy_config": on}, on_cpu=True)
    unset = {"deploy_config": _deploy(tmp_path)}
    assert compat.with_deploy_parallel_stage_init(unset, on_cpu=False) == unset
    assert compat.with_deploy_parallel_stage_init({}, on_cpu=False) == {}


def test_a_bad_parallel_stage_init_names_the_key(tmp_path):
    with pytest.raises(ValueError, match="parallel_stage_init: expected true or false, got 'yes please'"):
        compat.deploy_parallel_stage_init(_deploy(tmp_path, parallel_stage_init="yes please"))


def test_vllm_omni_engine_reads_the_keyword_the_hook_passes():
    """What `pass_parallel_stage_init_from_deploy` relies on: vllm-omni's engine takes the option
    as a keyword (its CLI has no flag), and its deploy loader has no field of that name."""
    from vllm_omni.config.stage_config import DeployConfig
    from vllm_omni.engine.omni_engine_base import OmniEngineBase

    compat.pass_parallel_stage_init_from_deploy()
    compat.pass_parallel_stage_init_from_deploy()  # idempotent: one wrapper
    init = OmniEngineBase.__init__
    assert init._reads_deploy_parallel_stage_init and not hasattr(init.__wrapped__, "__wrapped__")
    assert 'kwargs.get("parallel_stage_init")' in inspect.getsource(init.__wrapped__)
    assert "parallel_stage_init" not in {f.name for f in dataclasses.fields(DeployConfig)}


def test_a_deploy_plan_rejects_a_bad_parallel_stage_init(tmp_path):
    from vllm_omni_speechlm import plugin
    from vllm_omni_speechlm.deploy_checks import DeployPlan

    plugin.register()
    with pytest.raises(ValueError, match="parallel_stage_init: expected true or false, got 1"):
        DeployPlan.from_yaml(_deploy(tmp_path, parallel_stage_init=1))
