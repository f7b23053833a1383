"""Host time of stage 0's scheduler per decode step, against vLLM's own scheduler (the text LM's).

    python benchmarks/scheduler_update.py --out results.json [--concurrency 64 512]

No model and no GPU: real schedulers (async variants, as on GPUs) over a tiny checkpoint's config
are driven like vLLM's EngineCore with one step in flight, and fed runner outputs of one sampled
token per request per step; every request generates --gen-len tokens (eos ignored). Per
concurrency, each scheduler's mean microseconds per step of `schedule()` and of
`update_from_output()` in the steady decode window (prefill and tail steps excluded):

* `vllm`: vLLM's AsyncScheduler, what the plain text LM runs;
* `vllm_omni`: vllm-omni's AR scheduler;
* `steady_rows`: the same with the short path for steady decode rows (steady_rows.py);
* `stage0`: stage 0's scheduler (stage0/scheduler.py: paired CFG, steady rows, client frame blocks),
  fed the runner's step frame buffer as on GPUs.

All with the same scheduler and cache settings (prefix caching off). Prints and saves JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import tempfile
import time

import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.plugins import load_general_plugins
from vllm.sampling_params import SamplingParams
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler
from vllm_omni.outputs import OmniModelRunnerOutput
from vllm_omni.request import OmniRequest

from vllm_omni_speechlm.make_tiny import make_tiny
from vllm_omni_speechlm.frames import FrameRows, StepOutputs
from vllm_omni_speechlm.stage0.scheduler import PairedCFGAsyncScheduler
from vllm_omni_speechlm.stage0.steady_rows import SteadyRowsMixin

BLOCK = 16


class SteadyAsyncScheduler(SteadyRowsMixin, OmniARAsyncScheduler):
    pass


def _vllm_config(model_dir: str, args) -> VllmConfig:
    max_len = args.prompt_len + args.gen_len + 16
    blocks = max(args.concurrency) * (max_len // BLOCK + 2)
    model = ModelConfig(model=model_dir, dtype="float32", max_model_len=max_len, skip_tokenizer_init=True)
    scheduler = SchedulerConfig(
        max_num_seqs=max(args.concurrency),
        max_num_batched_tokens=max(args.concurrency) * max_len,
        max_model_len=max_len,
        is_encoder_decoder=False,
        enable_chunked_prefill=False,
        async_scheduling=True,
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    cache.num_gpu_blocks = blocks
    return VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache)


def _scheduler(cls, vllm_config: VllmConfig):
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(
        num_blocks=vllm_config.cache_config.num_gpu_blocks,
        kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)],
    )
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=BLOCK,
        log_stats=True,
    )


SCHEDULERS = {
    "vllm": AsyncScheduler,
    "vllm_omni": OmniARAsyncScheduler,
    "steady_rows": SteadyAsyncScheduler,
    "stage0": PairedCFGAsyncScheduler,
}


def _run(cls, vllm_config: VllmConfig, n: int, args) -> dict:
    gc.collect()  # the previous run's requests, not this run's steps
    scheduler = _scheduler(cls, vllm_config)
    request_cls = Request if cls is AsyncScheduler else OmniRequest
    for i in range(n):
        params = SamplingParams(max_tokens=args.gen_len, ignore_eos=True)
        prompt = [(i + j) % 100 for j in range(args.prompt_len)]
        scheduler.add_request(request_cls(f"r{i}", prompt_token_ids=prompt, sampling_params=params, pooling_params=None, arrival_time=0.0))
    schedule_us, update_us, in_flight = [], [], []
    while scheduler.has_unfinished_requests() or in_flight:
        if scheduler.has_unfinished_requests():
            start = time.perf_counter()
            in_flight.append(scheduler.schedule())
            schedule_us.append((time.perf_counter() - start) * 1e6)
        if len(in_flight) == 2 or not scheduler.has_unfinished_requests():
            output = in_flight.pop(0)
            ids = list(output.num_scheduled_tokens)
            runner_output = _runner_output(scheduler, ids)
            start = time.perf_counter()
            scheduler.update_from_output(output, runner_output)
            update_us.append((time.perf_counter() - start) * 1e6)
    window = slice(2, args.gen_len - 2)  # the decode steps with every request running
    result = {
        "schedule_us": statistics.fmean(schedule_us[window]),
        "update_from_output_us": statistics.fmean(update_us[window]),
        "steps": len(update_us),
    }
    print(f"{cls.__name__:24s} concurrency {n:4d}: schedule {result['schedule_us']:8.0f} us, update_from_output {result['update_from_output_us']:8.0f} us per step", flush=True)
    return result


def _runner_output(scheduler, ids: list[str]):
    """One sampled token per row; stage 0's runner also hands over the step's frame buffer."""
    common = dict(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=[[101] for _ in ids])
    if type(scheduler) is AsyncScheduler:
        return ModelRunnerOutput(**common)
    if isinstance(scheduler, PairedCFGAsyncScheduler):
        frames = FrameRows(torch.zeros(len(ids), scheduler.speech.num_streams, dtype=torch.int64), [True] * len(ids))
        return OmniModelRunnerOutput(**common, multimodal_outputs=StepOutputs(frames, None))
    return OmniModelRunnerOutput(**common, multimodal_outputs=[None] * len(ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 512])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=128)
    args = parser.parse_args()
    load_general_plugins()
    with tempfile.TemporaryDirectory() as model_dir:
        make_tiny("bagpiper", model_dir, seed=0)
        vllm_config = _vllm_config(model_dir, args)
        results = {str(n): {name: _run(cls, vllm_config, n, args) for name, cls in SCHEDULERS.items()} for n in args.concurrency}
    report = {
        "benchmark": "scheduler_update",
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "settings": vars(args),
        "results": results,
    }
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
