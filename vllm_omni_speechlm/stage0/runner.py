"""Stage 0's model runner: vllm-omni's AR runner with its per-request Python loops batched.

At a few hundred requests the speech LM stage is bound by host work per step, and vllm-omni's
AR runner does some of it once per request per step for every model:

* `_build_model_kwargs_extra` gathers each request's additional information, indexes a CPU
  tensor per request for token spans, and builds the sample-eligibility list request by request;
* the output builder copies each request's `codes.audio` row to the CPU (a no-op copy: it is
  already there), clones it, and builds, flattens, filters and checks its payload dict twice.

The speech LM reads a request's information only when it admits the request, ignores token spans
(it has its own rows), and hands the runner a fresh [N, S] host buffer of the step's frames that
nothing else writes (`FrameRows`). So this runner passes the information as a lazy per-row view,
takes eligibility from vLLM's own `discard_request_mask` (computed + scheduled < tokens), and
hands the frames to the scheduler whole (`StepOutputs`; the scheduler sends them to the client
in blocks, client_frames.py). vllm-omni's per-request payload builder is skipped when no connector
accumulates full payloads and either the payloads only go to the client (no async chunks) or, with
async chunks, the frames are the step's only output: every row's inter-stage payload is then its
frame view. Otherwise it puts each request's frame view in its payload as it is. Either way the
step's inter-stage payloads reach the scheduler as one `InterStageRows` (the buffer pickled once
under the multiprocess executor).
vllm-omni's own prefix cache is left out (`compat.without_omni_prefix_cache`), so with vLLM's
prefix caching on the frames still go whole.
Deploy YAMLs select it per platform (`worker_cls`: `SpeechLMARWorker` on GPUs,
`platforms.cpu_worker.CPUSpeechLMARWorker` on CPU). On GPUs it also batches vLLM's own per-request
loops of an async-scheduled step (`runner_loops.py`).

Both stages' GPU workers leave vLLM's sampler kernels out of the JIT warm-up
(`SamplerFreeWarmupMixin`): compiling them took minutes per stage, for kernels neither stage
launches.
"""

from __future__ import annotations

import os

from collections.abc import Mapping
from typing import Any

from vllm.logger import init_logger
from vllm_omni.data_entry_keys import flatten_payload
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_ar_worker import GPUARWorker
from vllm_omni.worker.gpu_generation_worker import GPUGenerationWorker

from vllm_omni_speechlm import window_trace
from vllm_omni_speechlm.compat import (drop_sampler_jit_warmup, launch_slot_mapping_kernel, without_kernel_warmup,
                                       without_omni_prefix_cache)
from vllm_omni_speechlm.frames import (CODES_KEY, FRAME_ROWS_KWARG, FrameRows, InterStageRows, StepOutputs,
                                       without_frames)
from vllm_omni_speechlm.stage0.runner_loops import BatchedRunnerLoopsMixin

logger = init_logger(__name__)


class RowInfo:
    """Each row's additional information, looked up only when read (`[row]`, `len`): the
    sequence vllm-omni builds eagerly, request by request, every step."""

    __slots__ = ("_req_ids", "_info")

    def __init__(self, req_ids: list[str], info: Mapping[str, dict]):
        self._req_ids, self._info = req_ids, info

    def __len__(self) -> int:
        return len(self._req_ids)

    def __getitem__(self, row: int) -> dict:
        return self._info.get(self._req_ids[row], {})


class SpeechLMRunnerMixin:
    """Batched replacements of vllm-omni AR runner steps (see the module docstring)."""

    _builds_payloads = False  # this step's payloads are built here, not by vllm-omni's per-request loop
    _traced_step = (0, 0)  # the step's rows and tokens (window_trace, when tracing)

    def initialize_metadata_builders(self, kv_cache_config: Any, kernel_block_sizes: Any) -> None:
        super().initialize_metadata_builders(kv_cache_config, kernel_block_sizes)
        without_omni_prefix_cache(self)

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if not window_trace.ENABLED:
            return super().execute_model(scheduler_output, *args, **kwargs)
        window_trace.worker_executing()
        self._traced_step = (len(scheduler_output.num_scheduled_tokens), scheduler_output.total_num_scheduled_tokens)
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        finally:
            window_trace.worker_executed()

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        out = super().sample_tokens(*args, **kwargs)
        if window_trace.ENABLED:
            window_trace.log_worker_step(*self._traced_step)
        return out

    def _build_model_kwargs_extra(self) -> dict:
        self._sync_local_stage_payloads()
        num_reqs = self.input_batch.num_reqs
        info = RowInfo(self.input_batch.req_ids, self.model_intermediate_buffer)
        extra: dict[str, Any] = {"model_intermediate_buffer": info, "runtime_additional_information": info}
        # vLLM set the mask for this step in _prepare_inputs: rows whose prompt is not all in yet.
        extra["request_sample_eligible"] = ~self.discard_request_mask.np[:num_reqs]
        extra[FRAME_ROWS_KWARG] = True
        return extra

    def _payloads_built_here(self, flat: dict[str, Any]) -> bool:
        """vllm-omni's per-request payload builder has nothing to add: no connector accumulates full
        payloads, and either the payloads only go to the client (no async chunks) or every row's
        payload is its frame view alone (the frames are the step's only output, the model
        post-processes none)."""
        if self._should_accumulate_full_payload_output():
            return False
        return not self._async_chunk or (isinstance(flat.get(CODES_KEY), FrameRows) and flat.keys() == {CODES_KEY}
                                         and not getattr(self.model, "has_postprocess", False))

    def _resolve_pooler_payload_req_ids(self, req_ids_output_copy: list[str]) -> tuple[str, list[str]]:
        if not self._builds_payloads:
            return super()._resolve_pooler_payload_req_ids(req_ids_output_copy)
        # vllm-omni's per-request builder gets no requests: the override below builds the payloads.
        return (self.vllm_config.model_config.engine_output_type or "").lower(), []

    def _build_omni_model_runner_output_from_snapshot(self, *, multimodal_outputs: Any, **kwargs: Any) -> Any:
        flat = flatten_payload(multimodal_outputs) if multimodal_outputs else {}
        frames = flat.get(CODES_KEY)
        built = self._payloads_built_here(flat)
        self._builds_payloads = built  # read by _resolve_pooler_payload_req_ids, inside this call
        try:
            output = super()._build_omni_model_runner_output_from_snapshot(multimodal_outputs=multimodal_outputs, **kwargs)
        finally:
            self._builds_payloads = False
        if not isinstance(frames, FrameRows):  # no step buffer: vllm-omni's payloads as they are
            return output
        if len(frames.samples) != len(output.req_ids):
            raise RuntimeError(f"speech LM runner: {len(frames.samples)} frame rows for {len(output.req_ids)} requests")
        if self._async_chunk and built:  # every row: its frames to the next stage, nothing else to the client
            output.multimodal_outputs = StepOutputs(frames, None)
            output.inter_stage_outputs = InterStageRows(frames)
        elif built:
            rest = without_frames(flat)
            output.multimodal_outputs = StepOutputs(frames, _row_payloads(rest, len(frames.samples)) if rest else None)
        elif output.multimodal_outputs is not None:  # vllm-omni's payloads; the frames go whole instead
            output.multimodal_outputs = StepOutputs(frames, [without_frames(p) or None for p in output.multimodal_outputs])
        # Neither: a connector accumulates the payloads, the client gets none per step.
        if output.inter_stage_outputs is not None and not built:  # async chunks: the frames cross whole
            output.inter_stage_outputs = InterStageRows(frames, output.inter_stage_outputs)
        return output

    def _build_omni_pooler_payload(self, *, rid: str, idx: int, mm_cpu: dict | None, **kwargs: Any) -> dict:
        """vllm-omni's per-request builder (async chunks, connectors): the row's frame view as it
        is, any other output (the fused model's clips) the usual way."""
        rows = mm_cpu.get(CODES_KEY) if mm_cpu else None
        if not isinstance(rows, FrameRows):
            return super()._build_omni_pooler_payload(rid=rid, idx=idx, mm_cpu=mm_cpu, **kwargs)
        rest = without_frames(mm_cpu)
        payload = super()._build_omni_pooler_payload(rid=rid, idx=idx, mm_cpu=rest, **kwargs) if rest else {}
        return payload | {CODES_KEY: rows.row(idx)}


def _row_payloads(outputs: dict[str, Any], num_rows: int) -> list[dict[str, Any]]:
    """{key: one value per row} -> one payload dict per row."""
    for key, values in outputs.items():
        if not isinstance(values, (list, tuple)) or len(values) != num_rows:
            raise TypeError(f"speech LM runner: multimodal output {key!r} must hold one tensor per row ({num_rows})")
    return [dict(zip(outputs, row)) for row in zip(*outputs.values())]


class SpeechLMARModelRunner(SpeechLMRunnerMixin, BatchedRunnerLoopsMixin, GPUARModelRunner):
    """vllm-omni's GPU AR runner with the batched speech LM steps and vLLM's async-step loops
    batched (runner_loops.py)."""


class SamplerFreeWarmupMixin:
    """A GPU worker whose stage never runs vLLM's top-k / top-p sampling kernels: stage 0 gives
    vLLM's sampler temperature only (the model applies its own per-modality top-k), the codec
    stage samples nothing. vLLM's JIT warm-up compiles the rest of its list (slot mapping,
    attention); stage 0's worker then launches the slot-mapping kernel once, so the first request
    builds nothing either."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # vLLM's profiling run samples once with top-k / top-p; through FlashInfer that builds its
        # sampling kernels first (minutes on a fresh host) for a path these stages never take.
        # Temperature-only sampling does not go through FlashInfer either way.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
        super().__init__(*args, **kwargs)

    def compile_or_warm_up_model(self) -> Any:
        dropped = drop_sampler_jit_warmup(self.model_runner)
        if dropped:
            logger.info("JIT kernel warm-up without vLLM's sampler kernels (%s)", ", ".join(dropped))
        return super().compile_or_warm_up_model()


class SpeechLMARWorker(SamplerFreeWarmupMixin, GPUARWorker):
    """vllm-omni's GPU AR worker running `SpeechLMARModelRunner`."""

    model_runner_cls = SpeechLMARModelRunner

    def compile_or_warm_up_model(self) -> Any:
        warmed = super().compile_or_warm_up_model()
        launch_slot_mapping_kernel(self.model_runner)  # compiled, not launched: its launcher is built here
        return warmed


class CodecStageWorker(SamplerFreeWarmupMixin, GPUGenerationWorker):
    """vllm-omni's GPU generation worker for the codec stage (deploy YAMLs: stage 1 `worker_cls`)."""

    def compile_or_warm_up_model(self) -> Any:
        # The codec runs PyTorch's own kernels only (no attention, KV cache or sampling): vLLM's JIT
        # warm-up and FlashInfer autotune (a dummy run of max_num_batched_tokens) have nothing of it
        # to warm. Its own shapes are decoded once in the dummy forward (codec_stage.py).
        without_kernel_warmup(self.vllm_config.kernel_config)
        return super().compile_or_warm_up_model()
