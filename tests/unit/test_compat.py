"""The private vLLM / vllm-omni hooks of `vllm_omni_speechlm/compat.py`, against the installed versions."""

from __future__ import annotations

import dataclasses
import inspect
import os
import threading
import time
from types import SimpleNamespace

import pytest
import yaml
from vllm.model_executor.warmup import kernel_warmup
from vllm.model_executor.warmup.jit_warmup import JitWarmupRegistry
from vllm.model_executor.warmup.jit_warmup_triton_helper import VllmTritonJitKernel
from vllm.v1.sample.ops import topk_topp_triton
from vllm.v1.worker.block_table import _COMPUTE_SLOT_MAPPING_KERNEL
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import Worker

from vllm_omni_speechlm import stage_configs
from vllm_omni_speechlm import compat
from vllm_omni_speechlm.stage0.runner import CodecStageWorker, SamplerFreeWarmupMixin, SpeechLMARWorker


def test_every_named_internal_is_there_as_written_against():
    assert compat.mismatched_hooks() == []


def test_a_changed_private_signature_or_a_removed_attribute_is_reported(monkeypatch):
    """An upgrade that changes one named internal fails here, naming it."""
    from vllm_omni.core.sched.omni_ar_scheduler import OmniARScheduler
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import OmniChunkTransferAdapter

    def _free_request(self, request, delay_free_blocks=False, reason=None):
        pass

    monkeypatch.setattr(OmniARScheduler, "_free_request", _free_request)
    monkeypatch.delattr(OmniChunkTransferAdapter, "save_async")
    freed, saved = compat.mismatched_hooks()
    assert freed == ("vllm_omni.core.sched.omni_ar_scheduler:OmniARScheduler._free_request(self, request, "
                     "delay_free_blocks=False, reason=None): written against (self, request, delay_free_blocks=False)")
    assert saved.startswith(f"{compat._ADAPTER}.save_async(self, *args, **kwargs): written against (self, multimodal_output")
    gone = compat.Hook("vllm.v1.request:Request", "num_speech_frames", "attribute")
    moved = compat.Hook("vllm.v1.core.sched.no_such_module:Scheduler", "schedule", "override", "self")
    problems = compat.mismatched_hooks((gone, moved))
    assert problems[0] == "vllm.v1.request:Request.num_speech_frames: attribute not found"
    assert problems[1].startswith("vllm.v1.core.sched.no_such_module:Scheduler: not found")


def test_untested_versions_stop_start_up_unless_allowed(monkeypatch):
    compat.check_versions({"vllm": "0.30.1", "vllm_omni": "0.30.0"})
    with pytest.raises(RuntimeError, match=r"untested vllm_omni 0\.31\.0 \(supported: 0\.30\.x\)"):
        compat.check_versions({"vllm": "0.30.0", "vllm_omni": "0.31.0"})
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    compat.check_versions({"vllm": "0.31.0", "vllm_omni": "0.30.0"})


def test_stops_after_is_vllms_check_stop():
    """The restated stop rule against vLLM's own, on requests one token from each limit."""
    from vllm import SamplingParams
    from vllm.v1.core.sched.utils import check_stop
    from vllm.v1.request import Request

    for token, max_tokens, max_model_len, stop_ids in [(7, 9, 99, ()), (2, 9, 99, ()), (5, 9, 99, (5,)),
                                                       (7, 3, 99, ()), (7, 9, 6, ())]:
        params = SamplingParams(max_tokens=max_tokens, stop_token_ids=list(stop_ids))
        params.update_from_generation_config({}, eos_token_id=2)
        request = Request("r", prompt_token_ids=[1, 1, 1], sampling_params=params, pooling_params=None)
        request.append_output_token_ids([4, token])
        expected = check_stop(request, max_model_len)
        got = compat.stops_after(token, request.num_tokens, request.num_output_tokens, max_tokens, max_model_len, 2, stop_ids)
        assert got == expected, (token, max_tokens, max_model_len, stop_ids)


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


@pytest.mark.parametrize("preset", [None, "1"])
def test_stage_workers_build_vllms_sampler_without_flashinfer(monkeypatch, preset):
    """The stage workers set VLLM_USE_FLASHINFER_SAMPLER=0 before vLLM's worker builds its sampler
    (so its profiling run builds no FlashInfer sampling kernels); a user's own setting stays."""
    from vllm_omni_speechlm.stage0.runner import SamplerFreeWarmupMixin

    monkeypatch.delenv("VLLM_USE_FLASHINFER_SAMPLER", raising=False)
    if preset is not None:
        monkeypatch.setenv("VLLM_USE_FLASHINFER_SAMPLER", preset)

    class Worker:
        def __init__(self):
            self.seen = os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")

    class StageWorker(SamplerFreeWarmupMixin, Worker):
        pass

    assert StageWorker().seen == (preset or "0")


def test_a_runner_without_a_registry_has_nothing_to_drop():
    assert compat.drop_sampler_jit_warmup(SimpleNamespace()) == []


def test_vllm_warms_up_the_runner_registry_the_workers_prune():
    """What `drop_sampler_jit_warmup` relies on: vLLM's GPU worker warms up through
    `kernel_warmup`, which compiles `model_runner.jit_warmup_registry`, a dict of kernels."""
    assert "kernel_warmup(self)" in inspect.getsource(Worker.compile_or_warm_up_model)
    source = inspect.getsource(kernel_warmup.kernel_warmup)
    assert "worker.model_runner.jit_warmup_registry" in source and "registry.warmup()" in source
    assert isinstance(JitWarmupRegistry(vllm_config=None)._registrations, dict)
    assert "super().compile_or_warm_up_model()" in inspect.getsource(SpeechLMARWorker.compile_or_warm_up_model)
    for worker in (SpeechLMARWorker, CodecStageWorker):
        assert worker.__mro__.index(SamplerFreeWarmupMixin) < worker.__mro__.index(Worker)


def test_the_codec_stage_starts_without_vllms_kernel_warm_up(monkeypatch):
    """The codec stage's worker turns vLLM's JIT warm-up and FlashInfer autotune off before
    vllm-omni's GPU worker (which cannot run here: it only records what it would read) warms up,
    through the two `KernelConfig` switches `kernel_warmup` reads."""
    from vllm.config.kernel import KernelConfig

    source = inspect.getsource(kernel_warmup.kernel_warmup)
    assert "kernel_config.enable_jit_warmup" in source and "kernel_config.enable_flashinfer_autotune" in source
    seen = []

    def vllms_warm_up(self):
        seen.append((self.vllm_config.kernel_config.enable_jit_warmup, self.vllm_config.kernel_config.enable_flashinfer_autotune))

    from vllm_omni.worker.gpu_generation_worker import GPUGenerationWorker

    monkeypatch.setattr(GPUGenerationWorker, "compile_or_warm_up_model", vllms_warm_up)
    worker = object.__new__(CodecStageWorker)
    worker.vllm_config = SimpleNamespace(kernel_config=KernelConfig(enable_flashinfer_autotune=True))
    worker.model_runner = SimpleNamespace()
    worker.compile_or_warm_up_model()
    assert seen == [(False, False)]


def test_gpu_yamls_pick_the_pruning_workers_and_cpu_keeps_its_own():
    for name in ("bagpiper_streaming.yaml", "bagpiper_batch.yaml", "opuslm_streaming.yaml"):
        with open(stage_configs.path(name)) as f:
            deploy = yaml.safe_load(f)
        gpu = {s["stage_id"]: s["worker_cls"] for s in deploy["stages"]}
        cpu = {s["stage_id"]: s["worker_cls"] for s in deploy["platforms"]["cpu"]["stages"]}
        assert gpu == {0: "vllm_omni_speechlm.stage0.runner.SpeechLMARWorker", 1: "vllm_omni_speechlm.stage0.runner.CodecStageWorker"}
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

    from vllm_omni_speechlm.deploy_checks import check_deploy_devices

    compat.pass_parallel_stage_init_from_deploy(check_deploy_devices)
    compat.pass_parallel_stage_init_from_deploy(check_deploy_devices)  # idempotent: one wrapper
    init = OmniEngineBase.__init__
    assert init._reads_deploy_parallel_stage_init and not hasattr(init.__wrapped__, "__wrapped__")
    assert 'kwargs.get("parallel_stage_init")' in inspect.getsource(init.__wrapped__)
    assert "parallel_stage_init" not in {f.name for f in dataclasses.fields(DeployConfig)}


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "many"])
def test_a_bad_max_pending_requests_names_the_key(tmp_path, value):
    from vllm_omni_speechlm import plugin
    from vllm_omni_speechlm.deploy_checks import DeployPlan

    plugin.register()
    path = _deploy(tmp_path, max_pending_requests=value)
    with pytest.raises(ValueError, match=f"max_pending_requests: expected a positive integer, got {value!r}"):
        DeployPlan.from_yaml(path)
    assert compat.deploy_max_pending(_deploy(tmp_path, max_pending_requests=8)) == 8
    assert compat.deploy_max_pending(_deploy(tmp_path)) is None


def test_a_deploy_plan_rejects_a_bad_parallel_stage_init(tmp_path):
    from vllm_omni_speechlm import plugin
    from vllm_omni_speechlm.deploy_checks import DeployPlan

    plugin.register()
    with pytest.raises(ValueError, match="parallel_stage_init: expected true or false, got 1"):
        DeployPlan.from_yaml(_deploy(tmp_path, parallel_stage_init=1))


def test_a_window_payloads_extra_key_reaches_the_next_stage():
    """`window_payload`'s extra integer crosses vllm-omni's type-erased wire and its receiving
    adapter (the real `_commit_received_chunk`) merges it into the next stage's request information,
    beside `meta`; without extras the payload is vllm-omni's own struct."""
    import torch
    from conftest import commit_received
    from vllm_omni.data_entry_keys import CodesStruct, MetaStruct, OmniPayloadStruct
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer

    codes, meta = CodesStruct(audio=torch.arange(16)), MetaStruct(left_context_size=2, right_holdback_size=10)
    assert type(compat.window_payload(codes, meta)) is OmniPayloadStruct
    payload = compat.window_payload(codes, meta, output_sample_rate=8000)
    request = commit_received(OmniSerializer.deserialize(OmniSerializer.serialize(payload))).request
    info = request.additional_information
    assert info["output_sample_rate"] == 8000 and info["meta"]["left_context_size"] == 2
    assert request.prompt_token_ids == list(range(16))


def test_the_slot_mapping_kernel_is_launched_as_a_step_launches_it():
    """`launch_slot_mapping_kernel` reaches vLLM's slot-mapping kernel through the runner's block
    table and buffers, as `_prepare_inputs` does: here vLLM's CPU kernel (what its CPU runner puts
    in place of Triton's) maps the buffers' two requests of two tokens each."""
    import torch
    from vllm.v1.worker.block_table import MultiGroupBlockTable
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner

    CPUModelRunner._postprocess_triton(None)  # vLLM's CPU slot-mapping kernel, as its CPU runner sets it
    table = MultiGroupBlockTable(max_num_reqs=4, max_num_batched_tokens=8, pin_memory=False, device=torch.device("cpu"),
                                 block_sizes=[16], kernel_block_sizes=[16], max_num_blocks=[4])
    table.block_tables[0].block_table.gpu[:2, 0] = torch.tensor([3, 5], dtype=torch.int32)  # request i's first block
    runner = SimpleNamespace(input_batch=SimpleNamespace(block_table=table),
                             query_start_loc=SimpleNamespace(gpu=torch.tensor([0, 2, 4], dtype=torch.int32)),
                             positions=torch.tensor([0, 1, 7, 8], dtype=torch.int64))
    compat.launch_slot_mapping_kernel(runner)
    assert table.block_tables[0].slot_mapping.gpu[:4].tolist() == [48, 49, 87, 88]  # block * 16 + position
    assert "self.input_batch.block_table.compute_slot_mapping(" in inspect.getsource(GPUModelRunner._prepare_inputs)
    assert "warmup(grid=(1,)" in inspect.getsource(VllmTritonJitKernel.launch)  # compiled, never launched


def test_stage_processes_are_forked_unless_cuda_is_initialized(monkeypatch):
    """`fork_stage_processes`: vllm-omni's stage manager gets a fork context, and vLLM's own
    choice (spawn here, as vllm-omni sets it) once CUDA is initialized in the starting process."""
    import vllm.utils.platform_utils as platform_utils
    import vllm_omni.engine.stage_engine_core_proc_manager as manager

    monkeypatch.setattr(manager, "get_mp_context", manager.get_mp_context)  # restored after the test
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    compat.fork_stage_processes()
    compat.fork_stage_processes()  # idempotent
    assert manager.get_mp_context().get_start_method() == "fork"
    monkeypatch.setattr(platform_utils, "cuda_is_initialized", lambda: True)
    assert manager.get_mp_context().get_start_method() == "spawn"


@pytest.mark.parametrize("fork", [True, False])
def test_vllm_serve_forks_its_stages_when_asked(monkeypatch, fork):
    """In `vllm serve`'s process (vllm-omni's API server module loaded) the plugin forks the stage
    processes with SPEECHLM_FORK_STAGES=1 and leaves vllm-omni's spawn otherwise."""
    import vllm_omni.engine.stage_engine_core_proc_manager as manager
    import vllm_omni.entrypoints.openai.api_server  # noqa: F401  (what marks the serving process)

    from vllm_omni_speechlm import plugin

    monkeypatch.setattr(manager, "get_mp_context", manager.get_mp_context)  # restored after the test
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    monkeypatch.setenv(plugin.FORK_STAGES_ENV, "1" if fork else "0")
    plugin.register()
    assert manager.get_mp_context().get_start_method() == ("fork" if fork else "spawn")


def _adapter():
    """vllm-omni's transfer adapter base (its real save loop on its own thread) with a send that
    records the thread it ran on; task "bad" fails as a full connector would."""
    from vllm_omni.distributed.omni_connectors.transfer_adapter.base import OmniTransferAdapterBase

    class Adapter(OmniTransferAdapterBase):
        def __init__(self):
            self.sent = []
            super().__init__(config=None)

        def save_async(self, task):
            self._pending_save_reqs.append(task)
            with self._save_cond:
                self._save_cond.notify()

        def _send_single_request(self, task):
            if task["name"] == "bad":
                raise OSError("no space left")
            self.sent.append((task["name"], threading.get_ident()))

    return Adapter()


def _task(name: str) -> dict:
    return {"name": name, "request": SimpleNamespace(request_id=f"req-{name}")}


def _wait_for(condition, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_the_adapters_own_save_thread_sends_unless_told_otherwise():
    adapter = _adapter()
    try:
        adapter.save_async(_task("a"))
        _wait_for(lambda: adapter.sent)
        assert adapter.sent[0][1] == adapter.save_thread.ident != threading.get_ident()
    finally:
        adapter.shutdown()


def test_queued_sends_do_not_wake_the_save_thread_and_shutdown_still_stops_it():
    """After `send_on_calling_thread` the save thread wakes on its own timeout only (its reap runs
    ~10 times a second, not once per window), and shutdown still ends it at once."""
    adapter = _adapter()
    reaps = []
    adapter.connector = SimpleNamespace(reap_consumed=lambda: reaps.append(time.monotonic()), close=lambda: None)
    try:
        time.sleep(0.15)  # the loop is waiting on the condition it was built with
        compat.send_on_calling_thread(adapter)
        time.sleep(0.15)  # ... and now on the new one
        before, started = len(reaps), time.monotonic()
        for i in range(200):
            adapter.save_async(_task(f"w{i}"))
            time.sleep(0.001)
        woken = len(reaps) - before
        assert len(adapter.sent) == 200 and woken <= (time.monotonic() - started) / 0.1 + 2
    finally:
        adapter.shutdown()
    adapter.save_thread.join(timeout=1.0)
    assert not adapter.save_thread.is_alive()


def test_sends_run_on_the_thread_that_queues_them_in_order():
    """After `send_on_calling_thread`: each `save_async` sends on the caller's thread before it
    returns; a task queued outside it (an abort's unlinking) waits for `drain`; a send that fails
    is recorded against its request and the next still goes; the save thread, woken by every
    queue, never sends."""
    adapter = _adapter()
    try:
        drain = compat.send_on_calling_thread(adapter)
        request = SimpleNamespace(output_token_ids=[1, 2])
        assert adapter._snapshot_processor_request(request) is request  # sent at once: no copy for later
        adapter.save_async(_task("a"))
        assert adapter.sent == [("a", threading.get_ident())]
        adapter._pending_save_reqs.append(_task("cleanup"))
        adapter._pending_save_reqs.append(_task("bad"))
        adapter.save_async(_task("b"))
        assert [name for name, _ in adapter.sent] == ["a", "cleanup", "b"]
        assert adapter.collect_failed_send_request_ids() == {"req-bad": "OSError: no space left"}
        adapter._pending_save_reqs.append(_task("c"))
        time.sleep(0.3)  # the save loop wakes at least every 0.1 s
        assert len(adapter.sent) == 3
        drain()
        assert adapter.sent[-1] == ("c", threading.get_ident())
        assert {thread for _, thread in adapter.sent} == {threading.get_ident()}
    finally:
        adapter.shutdown()
