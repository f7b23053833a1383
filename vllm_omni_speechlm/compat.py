"""Every private vLLM / vllm-omni internal this project relies on, named in one place.

Where vLLM and vllm-omni offer no public hook, the project extends their internals: the stage-0
scheduler, runner and workers override private methods (stage0/), the CPU platform builds vLLM's
CPU worker around vllm-omni's runners (platforms/), and a few objects are changed at run time
(the functions below). Each such internal is listed in `HOOKS` with the signature the project was
written against: `mismatched_hooks()` compares them with the installed code (tests/unit/
test_compat.py), so an upgrade that moves one fails there, in one place; `check_versions()`
stops start-up on versions the project was not tested with.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib
import inspect
import os
import re
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from vllm.logger import init_logger

logger = init_logger(__name__)

# ---- versions --------------------------------------------------------------------------------
# The releases the hooks below were written against (the version's prefix).
SUPPORTED_VERSIONS = {"vllm": "0.30.", "vllm_omni": "0.30."}
# Set to 1 to start on other versions anyway (a warning instead of an error).
ALLOW_UNTESTED_ENV = "SPEECHLM_ALLOW_UNTESTED_VERSIONS"


def check_versions(installed: dict[str, str] | None = None) -> None:
    """Stop with a clear error on a vLLM / vllm-omni release the project was not tested with."""
    installed = installed or {name: importlib.import_module(name).__version__ for name in SUPPORTED_VERSIONS}
    wrong = [f"{n} {v} (supported: {SUPPORTED_VERSIONS[n]}x)" for n, v in installed.items() if not v.startswith(SUPPORTED_VERSIONS[n])]
    if not wrong:
        return
    message = (f"vllm-omni-speechlm: untested {', '.join(wrong)}; it extends private internals of both "
               f"(vllm_omni_speechlm/compat.py). Install the supported versions, or set {ALLOW_UNTESTED_ENV}=1 to try.")
    if os.environ.get(ALLOW_UNTESTED_ENV) != "1":
        raise RuntimeError(message)
    logger.warning(message)


# ---- the internals, by owner -----------------------------------------------------------------


@dataclass(frozen=True)
class Hook:
    """`owner.name` ("module:Class", or "module" for a module-level name), as the project uses it
    (`use`: "override", "call", "attribute", "restated": a rule this project repeats, or "relied": a
    behaviour it depends on without calling). `params`: a callable's parameters as written
    against (names, defaults, `*` / `**` markers; no annotations), None for an attribute."""

    owner: str
    name: str
    use: str
    params: str | None = None


_SCHED = "vllm.v1.core.sched.scheduler:Scheduler"
_OMNI_SCHED = "vllm_omni.core.sched.omni_ar_scheduler:OmniARScheduler"
_RUNNER = "vllm.v1.worker.gpu_model_runner:GPUModelRunner"
_AR_RUNNER = "vllm_omni.worker.gpu_ar_model_runner:GPUARModelRunner"
_REQUEST = "vllm.v1.request:Request"
_ENC_CACHE = "vllm.v1.core.encoder_cache_manager:EncoderCacheManager"
_MM_PROC = "vllm.multimodal.processing.processor:BaseMultiModalProcessor"
_MM_INFO = "vllm.multimodal.processing.context:BaseProcessingInfo"
_MM_DUMMY = "vllm.multimodal.processing.dummy_inputs:BaseDummyInputsBuilder"
_VOCAB_EMB = "vllm.model_executor.layers.vocab_parallel_embedding:VocabParallelEmbedding"
_ADAPTER = "vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter:OmniChunkTransferAdapter"
_GEN_SCHED = "vllm_omni.core.sched.omni_generation_scheduler:OmniGenerationScheduler"
_SHM = "vllm_omni.distributed.omni_connectors.connectors.shm_connector:SharedMemoryConnector"
_SERIAL = "vllm_omni.distributed.omni_connectors.utils.serialization"

HOOKS = (
    # stage-0 scheduler (stage0/scheduler.py, stage0/steady_rows.py)
    Hook(_OMNI_SCHED, "add_request", "override", "self, request"),
    Hook(_OMNI_SCHED, "schedule", "override", "self, throttle_prefills=False"),
    Hook(_OMNI_SCHED, "update_from_output", "override", "self, scheduler_output, model_runner_output"),
    Hook(_OMNI_SCHED, "finish_requests", "override", "self, request_ids, finished_status"),
    Hook(_OMNI_SCHED, "_free_request", "override", "self, request, delay_free_blocks=False"),
    Hook(_SCHED, "_preempt_request", "call", "self, request, timestamp, drop_stale_output=False"),
    Hook(_SCHED, "_update_request_with_output", "call", "self, request, new_token_ids, is_stale=False"),
    Hook("vllm_omni.core.sched.omni_ar_scheduler", "_should_emit_engine_output", "call", "model_config, *, stopped, has_control"),
    Hook(_OMNI_SCHED, "chunk_transfer_adapter", "attribute"),
    Hook(_OMNI_SCHED, "kv_transfer_criteria", "attribute"),
    Hook(_OMNI_SCHED, "_new_prompt_len_snapshot", "attribute"),
    Hook(_SCHED, "perf_metrics", "attribute"),
    Hook(_SCHED, "cache_config", "attribute"),
    Hook("vllm.v1.core.kv_cache_manager:KVCacheManager", "watermark_blocks", "attribute"),
    Hook("vllm.v1.core.kv_cache_manager:KVCacheManager", "estimate_cached_tokens", "call", "self, request"),
    Hook(_REQUEST, "_block_hasher", "attribute"),
    Hook(_REQUEST, "cache_salt", "attribute"),  # salt_prefix_blocks
    Hook(_REQUEST, "block_hashes", "attribute"),
    Hook(_REQUEST, "update_block_hashes", "call", "self"),
    Hook(_REQUEST, "num_output_placeholders", "attribute"),
    Hook(_REQUEST, "num_in_flight_tokens", "attribute"),
    Hook(_REQUEST, "num_stale_output_tokens", "attribute"),
    # holds a running request out of a step: vLLM skips it while `current_step` is below this
    Hook(_REQUEST, "next_decode_eligible_step", "attribute"),
    Hook(_SCHED, "current_step", "attribute"),
    Hook(_REQUEST, "take_prefill_stats", "call", "self"),
    Hook(_REQUEST, "take_events", "call", "self"),
    Hook("vllm.v1.core.sched.utils", "check_stop", "restated", "request, max_model_len"),  # stops_after
    # the chunk adapter and the async_chunk processor (stage_input_processors/speech_codec.py)
    Hook(_ADAPTER, "save_async", "override", "self, multimodal_output=None, request=None, is_segment_finished=False, "
         "new_token_ids=None, confirmed_num_computed_tokens=None, segment_generation=None, force_request_finished=False"),
    Hook(_ADAPTER, "cleanup_sender", "call", "self, external_req_id"),  # frees the processor's state below
    # send_on_calling_thread: the save loop sends while its queue is truthy and waits on its
    # condition (woken per queued task); the queue, the condition and one send
    Hook(_ADAPTER, "save_loop", "relied", "self"),
    Hook(_ADAPTER, "_pending_save_reqs", "attribute"),
    Hook(_ADAPTER, "_save_cond", "attribute"),
    Hook(_ADAPTER, "_snapshot_processor_request", "override", "request"),  # the copy for a later send
    Hook(_ADAPTER, "_send_single_request", "call", "self, task"),
    Hook(_ADAPTER, "record_send_failure", "call", "self, request_id, reason"),
    Hook(_ADAPTER, "custom_process_next_stage_input_func", "attribute"),
    Hook(_ADAPTER, "code_prompt_token_ids", "attribute"),
    Hook(_ADAPTER, "request_payload", "attribute"),
    Hook(_ADAPTER, "connector", "attribute"),
    # merges a payload's top-level keys into the next stage's runtime information (window_payload)
    Hook(_ADAPTER, "_commit_received_chunk", "relied",
         "self, request, result, *, stage_id, req_id, chunk_id, connector_get_key"),
    # stage 1's scheduler: the windows of a request it ends early (stage1/scheduler.py)
    Hook(_GEN_SCHED, "add_request", "override", "self, request"),
    Hook(_GEN_SCHED, "finish_requests", "override", "self, request_ids, finished_status"),
    Hook(_GEN_SCHED, "chunk_transfer_adapter", "attribute"),
    Hook(_ADAPTER, "upstream_exhausted_requests", "attribute"),
    Hook(_ADAPTER, "get_req_chunk", "attribute"),
    Hook(_ADAPTER, "_poll_single_request", "relied", "self, entry"),  # window_key
    Hook(_SHM, "get", "call", "self, from_stage, to_stage, get_key, metadata=None"),
    # the window connector (connector.py): a cheaper sweep, flags as bools, its own segment write
    # in the layout the stock read opens (segment by key, lock file beside it)
    Hook(_SHM, "put", "override", "self, from_stage, to_stage, put_key, data"),
    Hook(_SHM, "reap_consumed", "override", "self"),
    Hook(_SHM, "_pending_keys", "attribute"),
    Hook(_SHM, "_pending_keys_lock", "attribute"),
    Hook(_SHM, "_metrics", "attribute"),
    Hook(_SHM, "serialize_obj", "call", "obj"),
    Hook(_SHM, "_get_by_key", "relied", "self, get_key"),
    # wire_tensor: a tensor as vllm-omni's serializer writes it, decoded by its receiving end
    Hook(_SERIAL, "_TENSOR_MARKER", "attribute"),
    Hook(_SERIAL + ":OmniMsgpackDecoder", "_decode_tensor", "relied", "self, obj"),
    Hook(_SHM, "cleanup", "call", "self, request_id"),
    Hook(_SHM, "stage_id", "attribute"),
    # stage-0 runner (stage0/runner.py, stage0/runner_loops.py)
    Hook("vllm_omni.worker.gpu_model_runner:OmniGPUModelRunner", "_build_model_kwargs_extra", "override", "self"),
    Hook("vllm_omni.worker.gpu_model_runner:OmniGPUModelRunner", "_sync_local_stage_payloads", "call", "self"),
    Hook(_AR_RUNNER, "_resolve_pooler_payload_req_ids", "override", "self, req_ids_output_copy"),
    Hook(_AR_RUNNER, "_build_omni_model_runner_output_from_snapshot", "override",
         "self, *, scheduler_output, hidden_states, staged_hidden_states_cpu, multimodal_outputs, req_ids_output_copy, "
         "req_id_to_index_output_copy, valid_sampled_token_ids, logprobs_lists, prompt_logprobs_dict, num_nans_in_logits, "
         "kv_connector_output, ec_connector_output, cudagraph_stats, kv_extracted_req_ids, num_scheduled_tokens_np, "
         "query_start_loc_cpu, postprocess_already_applied=False, prefix_cache_step_id=None"),
    Hook(_AR_RUNNER, "_build_omni_pooler_payload", "override",
         "self, *, rid, idx, start, end, hidden_states_cpu, req_hidden_states_cpu, combined_hidden_states, "
         "combined_multimodal_outputs, mm_cpu, audio_sparse_output, sparse_mm_index, hidden_seq_len, scheduled_seq_len"),
    Hook("vllm_omni.distributed.omni_connectors.model_runner.omni_connector_payload_transport:"
         "_OmniConnectorPayloadTransportMixin", "_should_accumulate_full_payload_output", "call", "self"),
    Hook(_AR_RUNNER, "_async_chunk", "attribute"),
    # without_omni_prefix_cache: vllm-omni stages its cache's config here, built on the first step
    Hook("vllm_omni.worker.gpu_model_runner:OmniGPUModelRunner", "initialize_metadata_builders", "override",
         "self, kv_cache_config, kernel_block_sizes"),
    Hook(_AR_RUNNER, "_omni_prefix_cache_cfg", "attribute"),
    Hook(_AR_RUNNER, "model_intermediate_buffer", "attribute"),
    Hook(_RUNNER, "discard_request_mask", "attribute"),
    Hook(_RUNNER, "_compute_prev_positions", "override", "self, num_reqs"),
    Hook(_RUNNER, "_prepare_input_ids", "override", "self, scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens"),
    Hook(_RUNNER, "_bookkeeping_sync", "override",
         "self, scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens"),
    Hook(_RUNNER, "_get_prompt_logprobs_dict", "call", "self, hidden_states, num_scheduled_tokens"),
    Hook(_RUNNER, "_pp_recv_work", "attribute"),
    Hook(_RUNNER, "encoder_cache", "attribute"),  # encoder_cache_rows (tests: the cache gives rows back)
    Hook(_SCHED, "encoder_cache_manager", "attribute"),  # encoder_cache_held (tests)
    Hook(_ENC_CACHE, "request_cached_ids", "attribute"),
    Hook(_ENC_CACHE, "num_freeable_slots", "attribute"),
    Hook(_ENC_CACHE, "cache_size", "attribute"),
    Hook(_RUNNER, "prev_positions", "attribute"),
    Hook("vllm.v1.worker.gpu_input_batch:InputBatch", "prev_sampled_token_ids", "attribute"),
    Hook("vllm.v1.worker.gpu_input_batch:InputBatch", "prev_req_id_to_index", "attribute"),
    # workers: the JIT warm-up list (stage0/runner.py)
    Hook("vllm.v1.worker.gpu_worker:Worker", "compile_or_warm_up_model", "override", "self"),
    Hook("vllm.model_executor.warmup.jit_warmup", "jit_warmup_registry", "attribute"),  # set on runners
    Hook("vllm.model_executor.warmup.jit_warmup:JitWarmupRegistry", "_registrations", "attribute"),
    Hook("vllm.v1.sample.ops.topk_topp_sampler", "compiled_random_sample", "call", "logits"),  # CPU worker
    # the first launch of the slot-mapping kernel at start-up (launch_slot_mapping_kernel)
    Hook("vllm.v1.worker.block_table:MultiGroupBlockTable", "compute_slot_mapping", "call",
         "self, num_reqs, query_start_loc, positions"),
    Hook(_RUNNER, "input_batch", "attribute"),
    Hook(_RUNNER, "query_start_loc", "attribute"),
    Hook(_RUNNER, "positions", "attribute"),
    # audio input through vLLM's multimodal processing (models/audio_processor.py, models/bagpiper.py)
    Hook(_MM_PROC, "_get_mm_fields_config", "override", "self, hf_inputs, hf_processor_mm_kwargs"),
    Hook(_MM_PROC, "_get_prompt_updates", "override", "self, mm_items, hf_processor_mm_kwargs, out_mm_kwargs"),
    Hook(_MM_PROC, "requires_tokenizer", "attribute"),
    Hook(_MM_INFO, "get_hf_processor", "override", "self, **kwargs"),
    Hook(_MM_INFO, "get_data_parser", "override", "self"),
    Hook(_MM_INFO, "get_supported_mm_limits", "override", "self"),
    Hook(_MM_INFO, "get_mm_max_tokens_per_item", "override", "self, seq_len, mm_counts"),
    Hook(_MM_DUMMY, "get_dummy_processor_inputs", "override", "self, seq_len, mm_counts, mm_options"),
    Hook(_MM_DUMMY, "_get_dummy_audios", "call", "self, *, length, num_audios, overrides=None"),
    Hook("vllm.model_executor.models.qwen3_omni_moe_thinker:Qwen3OmniMoeAudioEncoder", "forward", "call",
         "self, input_features, feature_lens, aftercnn_lens"),
    # CPU platform (platforms/cpu_worker.py)
    Hook("vllm.v1.worker.cpu_worker", "CPUModelRunner", "attribute"),  # replaced: building_cpu_runner
    Hook("vllm.v1.worker.cpu_model_runner", "_torch_cuda_wrapper", "call", ""),
    Hook("vllm.v1.worker.cpu_model_runner:CPUModelRunner", "_postprocess_tensors", "call", "self"),
    Hook("vllm.v1.worker.cpu_worker:CPUWorker", "init_device", "override", "self"),
    Hook("vllm.v1.worker.cpu_worker:CPUWorker", "compile_or_warm_up_model", "override", "self"),
    Hook("vllm_omni.platforms.interface:OmniPlatform", "_omni_enum", "attribute"),  # platforms/cpu.py
    # engine start (this module)
    Hook("vllm_omni.engine.stage_engine_core_proc_manager", "get_mp_context", "attribute"),  # fork_stage_processes
    Hook("vllm.utils.platform_utils", "cuda_is_initialized", "call", ""),
    Hook("vllm.utils.platform_utils", "xpu_is_initialized", "call", ""),
    Hook("vllm.platforms.interface", "in_wsl", "call", ""),
    Hook("vllm.ray.lazy_utils", "is_in_ray_actor", "call", ""),
    Hook("vllm_omni.engine.omni_engine_base:OmniEngineBase", "__init__", "override",
         "self, model, stage_init_timeout=300, init_timeout=600, single_stage_mode=False, transfer_emitter=None, "
         "prom_metrics=None, log_stats=False, tokenizer=None, trust_remote_code=None, client_config=None, **kwargs"),
    # API server (serving/)
    Hook("vllm_omni.entrypoints.openai.api_server", "router", "attribute"),  # dispatch_route, add_post_route
    Hook("vllm_omni.entrypoints.openai.api_server", "args", "attribute"),  # app.state.args: served_deploy_config
    Hook("vllm_omni.entrypoints.openai.tts_adapters.base:TTSModelAdapter", "_load_supported_speakers", "override", "self"),
    Hook("vllm_omni.entrypoints.openai.tts_adapters.base:TTSModelAdapter", "_load_codec_frame_rate", "override", "self"),
    Hook("vllm_omni.entrypoints.openai.tts_adapters.base:TTSModelAdapter", "validate", "override", "self, request"),
    Hook("vllm_omni.entrypoints.openai.tts_adapters.base:TTSModelAdapter", "build", "override",
         "self, request, sampling_params_list, has_inline_ref_audio"),
    Hook("vllm_omni.entrypoints.openai.tts_adapters.base:TTSModelAdapter", "apply_sampling_overrides", "override",
         "self, sampling_params_list, request, prompt=None, request_id=None"),
    Hook("vllm.model_executor.models.config", "MODELS_CONFIG_MAP", "attribute"),  # deploy_checks.py
    Hook("vllm.config.model", "_get_and_verify_max_len", "call", "hf_config, model_arch_config, tokenizer_config, "
         "max_model_len, disable_sliding_window, sliding_window, spec_target_max_model_len=None, encoder_config=None"),
    Hook("vllm.config.model:ModelConfig", "model_arch_config", "attribute"),  # position_limit
    # tensor-parallel stage 0 (models/tp_heads.py: vocab_shard_bounds; tests: custom_op_collectives)
    Hook(_VOCAB_EMB, "_get_indices", "call",
         "vocab_size_padded, org_vocab_size_padded, vocab_size, org_vocab_size, tp_rank, tp_size"),
    Hook(_VOCAB_EMB, "tp_rank", "attribute"),
    Hook(_VOCAB_EMB, "tp_size", "attribute"),
    Hook(_VOCAB_EMB, "org_vocab_size", "attribute"),
    Hook(_VOCAB_EMB, "padding_size", "attribute"),
    Hook("vllm.distributed.parallel_state:GroupCoordinator", "use_custom_op_call", "attribute"),
    Hook("vllm.distributed.parallel_state:GroupCoordinator", "_all_reduce_out_place", "override", "self, input_"),
    Hook("vllm.distributed.parallel_state", "graph_capture", "call", "device, graph_capture_context=None"),  # step graphs
    Hook("vllm.distributed.parallel_state:GraphCaptureContext", "stream", "attribute"),
    # the codec stage's kernel warm-up (without_kernel_warmup)
    Hook("vllm.config.kernel:KernelConfig", "enable_jit_warmup", "attribute"),
    Hook("vllm.config.kernel:KernelConfig", "enable_flashinfer_autotune", "attribute"),
)


def _resolve(owner: str) -> Any:
    module, _, qualname = owner.partition(":")
    obj = importlib.import_module(module)
    for part in filter(None, qualname.split(".")):
        obj = getattr(obj, part)
    return obj


def _params(fn: Any) -> str:
    """A callable's parameters without annotations: "self, x, *, y=1, **kw"."""
    out, star = [], False
    for p in inspect.signature(fn).parameters.values():
        if p.kind is p.KEYWORD_ONLY and not star:
            out.append("*")
        star = star or p.kind in (p.KEYWORD_ONLY, p.VAR_POSITIONAL)
        prefix = {p.VAR_POSITIONAL: "*", p.VAR_KEYWORD: "**"}.get(p.kind, "")
        default = "" if p.default is p.empty else f"={p.default!r}"
        out.append(prefix + p.name + default)
    return ", ".join(out)


def _has_attribute(owner: Any, name: str) -> bool:
    """A class or module attribute (annotated or set), or one its code assigns (`self.name =`)."""
    classes = owner.__mro__ if inspect.isclass(owner) else ()
    if hasattr(owner, name) or any(name in vars(k).get("__annotations__", {}) for k in classes):
        return True
    assigned = re.compile(rf"\.{re.escape(name)}\s*(:|=(?!=))")
    sources = [k for k in classes if k.__module__.startswith(("vllm.", "vllm_omni."))] if classes else [owner]
    return any(assigned.search(inspect.getsource(k)) for k in sources)


def mismatched_hooks(hooks: tuple[Hook, ...] = HOOKS) -> list[str]:
    """Each hook the installed vLLM / vllm-omni no longer has as written against (empty: all fit)."""
    problems = []
    for hook in hooks:
        try:
            owner = _resolve(hook.owner)
        except (ImportError, AttributeError) as e:
            problems.append(f"{hook.owner}: not found ({e})")
            continue
        if hook.params is None:
            if not _has_attribute(owner, hook.name):
                problems.append(f"{hook.owner}.{hook.name}: attribute not found")
            continue
        fn = getattr(owner, hook.name, None)
        if fn is None:
            problems.append(f"{hook.owner}.{hook.name}: not found")
        elif (got := _params(inspect.unwrap(fn))) != hook.params:
            problems.append(f"{hook.owner}.{hook.name}({got}): written against ({hook.params})")
    return problems


# ---- vLLM's stop rule, restated ------------------------------------------------------------


def stops_after(token: Any, num_tokens: Any, num_output_tokens: Any, max_tokens: Any, max_model_len: int,
                eos: int | None, stop_token_ids: Any = ()) -> Any:
    """vLLM's `check_stop` (vllm/v1/core/sched/utils.py) for a request that has just appended
    `token`, making it `num_tokens` long with `num_output_tokens` outputs: eos, a stop token id,
    or a length limit. Elementwise on tensors. Not covered (callers rule them out): min_tokens,
    repetition detection, stop strings."""
    stop = token == eos
    for stop_id in stop_token_ids or ():
        stop = stop | (token == stop_id)
    return stop | (num_tokens >= max_model_len) | (num_output_tokens >= max_tokens)


# ---- the checkpoint's positions -------------------------------------------------------------


def position_limit(model_config: Any) -> int:
    """The longest sequence the checkpoint's positions cover: the max_model_len vLLM derives when
    none is set (max_position_embeddings, with the RoPE scaling factor where it extends them)."""
    from vllm.config.model import _get_and_verify_max_len

    limit = _get_and_verify_max_len(
        hf_config=model_config.hf_text_config, model_arch_config=model_config.model_arch_config, tokenizer_config=None,
        max_model_len=None, disable_sliding_window=False, sliding_window=None,
    )
    return int(limit)


# ---- run-time changes: the chunk adapter, the CPU worker, the API routes -------------------------


def gate_chunk_sends(adapter: Any, offer: Callable[[Any, Any, bool], tuple[bool, Any]]) -> Callable[..., Any]:
    """Route each step a scheduler hands the chunk adapter (`save_async`) through `offer(request,
    payload, finished) -> (send now, payload to send)`; return the ungated `save_async`.
    vllm-omni's scheduler calls `save_async` for every request of every step and has no hook for
    which steps to send."""
    send = adapter.save_async

    def save_async(multimodal_output: Any = None, request: Any = None, is_segment_finished: bool = False, **kw: Any) -> Any:
        if request is None:
            return send(multimodal_output, request, is_segment_finished, **kw)
        finished = bool(is_segment_finished or kw.get("force_request_finished") or request.is_finished())
        hand_over, payload = offer(request, multimodal_output, finished)
        return send(payload, request, is_segment_finished, **kw) if hand_over else None

    adapter.save_async = save_async
    return send


class _CallerSends:
    """The chunk adapter's send queue, empty to its save thread: tasks wait in `tasks` for the
    thread that queued them (`send_on_calling_thread`)."""

    def __init__(self) -> None:
        self.tasks: collections.deque = collections.deque()

    def append(self, task: Any) -> None:
        self.tasks.append(task)

    def __len__(self) -> int:
        return 0


class _Unwoken(threading.Condition):
    """The save thread's condition once nothing is sent there: a queued task (`notify`) does not
    wake it, shutdown (`notify_all`) still does."""

    def notify(self, n: int = 1) -> None:
        pass


def send_on_calling_thread(adapter: Any) -> Callable[[], None]:
    """Make the chunk adapter's sends (the processor's cut and the connector's put of a window, the
    unlinking of an aborted request's windows) run on the thread that queues them: after each
    `save_async`, and whenever the returned `drain` is called. Its save thread then only reaps
    consumed keys on its own timeout. vllm-omni sends on that thread to keep the connector's I/O
    off the scheduler's, but in stage 0's process the two share the interpreter lock, and each of a
    send's system calls hands the lock over and waits to get it back; woken for every window, the
    thread would take the lock for its reap's system calls in the middle of the scheduler's step.
    Nor is the request copied for the processor (its token lists, its prompt element by element):
    the processor reads it before the scheduler changes it."""
    held = _CallerSends()
    adapter._pending_save_reqs = held
    adapter._save_cond = _Unwoken()
    adapter._snapshot_processor_request = lambda request: request  # sent before the request changes
    queue = adapter.save_async

    def drain() -> None:
        while held.tasks:
            task = held.tasks.popleft()
            try:
                adapter._send_single_request(task)
            except Exception as e:  # as the save loop does: the request fails now, not at the next stage's deadline
                request_id = getattr(task.get("request"), "request_id", None)
                logger.error("window send gave up for %s: %s", request_id, e)
                adapter.record_send_failure(request_id, f"{type(e).__name__}: {e}")

    def save_async(*args: Any, **kwargs: Any) -> Any:
        queued = queue(*args, **kwargs)
        drain()
        return queued

    adapter.save_async = save_async
    return drain


@contextlib.contextmanager
def building_cpu_runner(runner_cls: type) -> Iterator[None]:
    """Make `CPUWorker.init_device` construct `runner_cls` instead of `CPUModelRunner`. It does the
    CPU process setup (LD_PRELOAD checks, thread binding, gloo init, seeding) and then builds the
    module-global `CPUModelRunner`; swapping that one name for the call reuses all of it."""
    import vllm.v1.worker.cpu_worker as cpu_worker

    original = cpu_worker.CPUModelRunner
    cpu_worker.CPUModelRunner = runner_cls
    try:
        yield
    finally:
        cpu_worker.CPUModelRunner = original


@functools.lru_cache(maxsize=8)
def _payload_cls(keys: tuple[str, ...]) -> type:
    import msgspec
    from vllm_omni.data_entry_keys import OmniPayloadStruct

    fields = [(key, int | None, None) for key in keys]
    return msgspec.defstruct("SpeechLMWindowPayload", fields, bases=(OmniPayloadStruct,), kw_only=True)


def window_key(external_req_id: str, stage_id: int, chunk_id: int) -> str:
    """The connector key of a request's `chunk_id`-th window from stage `stage_id`, as vllm-omni's
    chunk adapter names it on both ends (`_poll_single_request`)."""
    return f"{external_req_id}_{stage_id}_{chunk_id}"


def wire_tensor(array: Any) -> dict[str, Any]:
    """A numpy array as vllm-omni's serializer writes a tensor (`_encode_tensor`), so the receiving
    end decodes a torch tensor; built without a torch call (on stage 0's save thread each one hands
    the interpreter lock to the scheduler's thread and waits to get it back)."""
    import numpy as np
    from vllm_omni.distributed.omni_connectors.utils.serialization import _TENSOR_MARKER

    array = np.ascontiguousarray(array)
    return {_TENSOR_MARKER: True, "dtype": str(array.dtype), "shape": list(array.shape), "data": array.tobytes()}


def window_payload(codes: Any, meta: Any, **info: int) -> Any:
    """An async_chunk payload (`codes`, `meta`) that also hands the next stage the integers `info`
    as top-level keys of its runtime information. vllm-omni's payload schema has no free field,
    but its receiving adapter merges every top-level key of a payload into that information
    (`_commit_received_chunk`); the wire is type-erased, so a subclass's extra fields arrive."""
    from vllm_omni.data_entry_keys import OmniPayloadStruct

    cls = _payload_cls(tuple(sorted(info))) if info else OmniPayloadStruct
    return cls(codes=codes, meta=meta, **info)


def torch_cuda_wrapper() -> contextlib.AbstractContextManager:
    """vLLM's fake of `torch.Event` / `torch.cuda.Stream` for building a GPU runner on CPU."""
    from vllm.v1.worker.cpu_model_runner import _torch_cuda_wrapper

    return _torch_cuda_wrapper()


def dispatch_route(path: str, serves: Callable[[Any], bool], handler: Callable[[Any, Any, Any], Any]) -> None:
    """Put a dispatcher in place of vllm-omni's POST `path` route (before its app is built):
    requests to an engine client for which `serves(engine_client)` go to `handler(request,
    raw_request, stock)`, every other one to vllm-omni's own handler `stock` (undecorated, under
    the same request parsing and decorators). vllm-omni has no hook for a model's own handling of
    a route. Idempotent."""
    import typing

    from fastapi.routing import APIRoute
    from vllm.entrypoints.serve.utils.api_utils import load_aware_call, with_cancellation
    from vllm_omni.entrypoints.openai import api_server

    routes = api_server.router.routes
    index = next((i for i, r in enumerate(routes) if isinstance(r, APIRoute) and r.path == path and "POST" in r.methods), None)
    if index is None or getattr(routes[index].endpoint, "_speechlm_dispatch", False):
        return  # already replaced (the plugin runs more than once), or nothing to replace
    stock = routes[index]
    stock_handler = inspect.unwrap(stock.endpoint)

    async def dispatch(request, raw_request):
        if serves(raw_request.app.state.engine_client):
            return await handler(request, raw_request, stock_handler)
        return await stock_handler(request, raw_request)

    # FastAPI reads the body and the raw request from the stock handler's own annotations.
    hints = typing.get_type_hints(stock_handler)
    names = list(inspect.signature(stock_handler).parameters)
    dispatch.__annotations__ = {"request": hints[names[0]], "raw_request": hints[names[1]]}
    endpoint = with_cancellation(load_aware_call(dispatch))
    endpoint._speechlm_dispatch = True  # type: ignore[attr-defined]
    del routes[index]
    api_server.router.add_api_route(path, endpoint, methods=["POST"], dependencies=stock.dependencies, responses=stock.responses)


def add_post_route(path: str, endpoint: Callable[..., Any]) -> None:
    """Add POST `path` to vllm-omni's router (before its app is built) under vLLM's request
    decorators, unless it has one. vLLM's own route of that path, where a model has one, is on the
    app ahead of vllm-omni's router and keeps answering. Idempotent."""
    from fastapi.routing import APIRoute
    from vllm.entrypoints.serve.utils.api_utils import load_aware_call, with_cancellation
    from vllm_omni.entrypoints.openai import api_server

    if any(isinstance(r, APIRoute) and r.path == path and "POST" in r.methods for r in api_server.router.routes):
        return
    api_server.router.add_api_route(path, with_cancellation(load_aware_call(endpoint)), methods=["POST"])


# ---- JIT warm-up ----------------------------------------------------------------------------

# vLLM's sampler modules: their JIT kernels (top-k / top-p, rejection sampling) run only for
# requests that ask for them.
SAMPLER_KERNEL_MODULES = ("vllm.v1.sample.",)


def without_kernel_warmup(kernel_config: Any) -> None:
    """vLLM's kernel warm-up off for a stage that runs none of vLLM's kernels: its JIT warm-up
    and FlashInfer autotune (`KernelConfig`, which vllm-omni 0.30 lets no deploy YAML set)."""
    kernel_config.enable_jit_warmup = False
    kernel_config.enable_flashinfer_autotune = False


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


def launch_slot_mapping_kernel(model_runner: Any) -> None:
    """Launch vLLM's slot-mapping kernel once for one request and for two, as every step does in
    `_prepare_inputs`. vLLM's JIT warm-up compiles its Triton kernels without launching them
    (Triton's `warmup`), so the first request launched it first: it built the kernel's launcher
    (~0.25 s of gcc on a fresh host) and loaded it, on that request's time. The mapping written here
    is overwritten by the first step."""
    block_table = model_runner.input_batch.block_table
    for num_reqs in (1, 2):
        block_table.compute_slot_mapping(num_reqs, model_runner.query_start_loc.gpu[: num_reqs + 1],
                                         model_runner.positions[: 2 * num_reqs])


def salt_prefix_blocks(request: Any, salt: str) -> None:
    """Rehash a request's blocks under vLLM's cache salt, which goes into its first block's hash
    and so into every block chained after it: no other request's blocks match its own."""
    request.cache_salt = salt
    request.block_hashes = []
    request.update_block_hashes()


def without_omni_prefix_cache(model_runner: Any) -> None:
    """With vLLM's prefix caching on, vllm-omni also keeps each step's hidden states and per-token
    outputs for prefix hits to return. The speech LM returns nothing for prompt positions (its
    frames come from sampling steps), so that cache would only cost copies and take its per-request
    payload path; vLLM's KV block reuse stays. Called after `initialize_metadata_builders` staged
    the cache's config, before the first step builds it."""
    model_runner._omni_prefix_cache_cfg = None


def compile_cpu_random_sample(vocab_size: int) -> None:
    """vLLM's CPU sampler compiles `compiled_random_sample` (torch.compile) at its first unseeded
    random sample: seconds of Inductor's C++ build inside the first request. Compile it now, for
    one row and for more (dynamo specializes a size of 1)."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import compiled_random_sample

    for rows in (1, 2):
        compiled_random_sample(torch.zeros(rows, vocab_size))


# ---- tensor parallelism ----------------------------------------------------------------------


def vocab_shard_bounds(padded: int, vocab_size: int, rank: int, tp_size: int) -> tuple[int, int]:
    """[start, end) of the vocabulary ids that rank `rank` of `tp_size` holds in a vocab-parallel
    table of `vocab_size` ids padded to `padded` (no added vocabulary), as vLLM lays it out."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    idx = VocabParallelEmbedding._get_indices(padded, padded, vocab_size, vocab_size, rank, tp_size)
    return idx.org_vocab_start_index, idx.org_vocab_end_index


def custom_op_collectives(on: bool) -> bool:
    """Make this process's TP group call its collectives through vLLM's custom ops
    (`torch.ops.vllm.all_reduce` / `all_gather`, which torch.compile traces), as on CUDA, or
    directly through the communicator (CPU's default); -> the previous setting (tests)."""
    from vllm.distributed import get_tp_group
    from vllm.distributed.parallel_state import GroupCoordinator

    group = get_tp_group()
    before, group.use_custom_op_call = group.use_custom_op_call, on
    # `vllm::all_reduce` is declared functional: a new output, its input untouched, as CUDA's
    # communicators run it. The CPU communicator reduces in place and returns its input, which a
    # compiled graph's first call rejects (torch._functorch.config.error_on_custom_op_aliasing, on
    # where $CI is set) and which would change a value the trace holds unchanged: reduce a copy.
    if on:
        group._all_reduce_out_place = lambda x: GroupCoordinator._all_reduce_out_place(group, x.clone())
    else:
        vars(group).pop("_all_reduce_out_place", None)
    return before


@contextlib.contextmanager
def graph_capture(device: Any) -> Iterator[Any]:
    """vLLM's context for recording CUDA graphs that hold TP collectives: custom all-reduce takes
    its graph path and, on exit, registers the graphs' buffers with the other ranks (a collective:
    every rank records the same graphs, in the same order). It records on a stream of its own;
    afterwards the caller's stream waits for that stream's work (a recording's eager first run)."""
    import torch
    from vllm.distributed.parallel_state import graph_capture as capture

    context = None
    try:
        with capture(device) as context:
            yield context
    finally:  # a failed recording too: its eager run may still be writing
        if context is not None:
            torch.cuda.current_stream(device).wait_stream(context.stream)


# ---- concurrent stage start ---------------------------------------------------------------
# The deploy YAML's top-level key for vllm-omni's `parallel_stage_init`: its stages start at once
# (each stage process imports for ~25 s on a GPU host, and stage 0 compiles for longer still).
# vllm-omni 0.30 takes the option only as an `Omni(...)` / `AsyncOmni(...)` keyword: `vllm serve`
# has no flag for it, and its deploy YAML loader drops keys it does not know.
PARALLEL_STAGE_INIT_KEY = "parallel_stage_init"


def parallel_stage_init_of(deploy: dict[str, Any], path: str | None) -> bool | None:
    """`parallel_stage_init` of a loaded deploy YAML (None: not set); a non-bool is an error."""
    value = deploy.get(PARALLEL_STAGE_INIT_KEY)
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"deploy config {path}: {PARALLEL_STAGE_INIT_KEY}: expected true or false, got {value!r}")
    return value


def _deploy_top_level(path: str | None) -> dict[str, Any]:
    """A deploy YAML's top level ({} without a YAML)."""
    if not path:
        return {}
    import yaml

    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f) or {}


def deploy_parallel_stage_init(path: str | None) -> bool | None:
    """The deploy YAML's `parallel_stage_init` (None: not set, or no YAML)."""
    return parallel_stage_init_of(_deploy_top_level(path), path)


# The deploy YAML's top-level bound on the requests the API server holds (serving/admission.py).
MAX_PENDING_KEY = "max_pending_requests"


def max_pending_of(deploy: dict[str, Any], path: str | None) -> int | None:
    """`max_pending_requests` of a loaded deploy YAML (None: no bound); not a positive int: an error."""
    value = deploy.get(MAX_PENDING_KEY)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"deploy config {path}: {MAX_PENDING_KEY}: expected a positive integer, got {value!r}")
    return value


def deploy_max_pending(path: str | None) -> int | None:
    """The deploy YAML's `max_pending_requests` (None: not set, or no YAML)."""
    return max_pending_of(_deploy_top_level(path), path)


def served_deploy_config(app: Any) -> str | None:
    """The deploy YAML `vllm serve --deploy-config` was given (vllm-omni keeps the CLI arguments
    on its app's state)."""
    return getattr(getattr(app.state, "args", None), "deploy_config", None)


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


def pass_parallel_stage_init_from_deploy(check_devices: Callable[[str | None], None]) -> None:
    """Make vllm-omni's engine (`OmniEngineBase.__init__`, which reads the keyword) take
    `parallel_stage_init` from the deploy YAML (and check the YAML's `max_pending_requests`, and
    its stage devices with `check_devices(path)`). Idempotent."""
    from vllm.platforms import current_platform
    from vllm_omni.engine.omni_engine_base import OmniEngineBase

    init = OmniEngineBase.__init__
    if getattr(init, "_reads_deploy_parallel_stage_init", False):
        return

    @functools.wraps(init)
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        deploy_max_pending(kwargs.get("deploy_config"))  # a bad value fails the start, not a request
        check_devices(kwargs.get("deploy_config"))  # before any stage process: a typo or a missing GPU
        init(self, *args, **with_deploy_parallel_stage_init(kwargs, current_platform.is_cpu()))

    __init__._reads_deploy_parallel_stage_init = True  # type: ignore[attr-defined]
    OmniEngineBase.__init__ = __init__


def fork_stage_processes() -> None:
    """Start vllm-omni's stage processes by fork where vLLM would fork its own engine process (no
    CUDA or XPU initialized here, not WSL, not a Ray actor). vllm-omni always spawns them, and a
    spawned stage process imports torch, vLLM, vllm-omni and this project again before its engine
    starts; a forked one starts with them. On CUDA vllm-omni's memory admission has initialized CUDA
    here by then, so they are still spawned. Idempotent."""
    import multiprocessing

    import vllm.platforms.interface as platform
    import vllm.ray.lazy_utils as ray
    import vllm.utils.platform_utils as devices
    import vllm_omni.engine.stage_engine_core_proc_manager as manager
    from vllm.utils.system_utils import get_mp_context

    def stage_context() -> Any:
        if devices.cuda_is_initialized() or devices.xpu_is_initialized() or platform.in_wsl() or ray.is_in_ray_actor():
            return get_mp_context()
        return multiprocessing.get_context("fork")

    manager.get_mp_context = stage_context


def encoder_cache_rows(runner: Any) -> int:
    """Rows of encoder output a model runner holds (vLLM keeps them by clip hash until its
    scheduler evicts them)."""
    return sum(t.shape[0] for t in runner.encoder_cache.values())


def encoder_cache_held(scheduler: Any) -> tuple[int, int]:
    """(requests holding encoder-cache entries, cache slots no eviction could reclaim) of a
    scheduler: (0, 0) once no live request needs a clip's encoder output."""
    manager = scheduler.encoder_cache_manager
    return len(manager.request_cached_ids), manager.cache_size - manager.num_freeable_slots
