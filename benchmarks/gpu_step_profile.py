"""Where a decode step's GPU time goes: Bagpiper (vLLM-Omni stage 0) against the plain Qwen3 text
LM, same geometry and settings as stage0_throughput.py, under vLLM's torch profiler.

    python benchmarks/gpu_step_profile.py --out summary.json [--concurrency 64] [--runs text speech]

For each run, --steps decode steps are traced after --skip steps (past the prefill). From the
trace: GPU busy time per step (union of kernels and copies) against the step's wall time, the
GPU time under each vLLM runner phase (preprocess, forward, postprocess, sample, ...) and the
top kernels. The profiler slows the host (every launch is recorded), so wall times here are
not throughput; GPU time per step is. Prints and saves JSON.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import glob
import gzip
import json
import os
import tempfile
import time

from stage0_throughput import OMNI_TEXT_DEPLOY, _engine_settings, _prompts, use_selftest_pipelines

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def _settings(args) -> dict:
    """stage0_throughput's engine settings for this one concurrency."""
    return _engine_settings(argparse.Namespace(**{**vars(args), "concurrency": [args.concurrency], "gen_len": [args.gen_len]}))


def _profiler_config(trace_dir: str, args) -> dict:
    return dict(
        profiler="torch",
        torch_profiler_dir=trace_dir,
        torch_profiler_with_stack=False,
        delay_iterations=args.skip,
        max_iterations=args.steps,
        ignore_frontend=True,
    )


def trace_text_lm(model_dir: str, trace_dir: str, args) -> None:
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, profiler_config=_profiler_config(trace_dir, args), **_settings(args))
    params = SamplingParams(temperature=0.8, max_tokens=args.gen_len, ignore_eos=True, detokenize=False)
    n = args.concurrency
    llm.generate([{"prompt_token_ids": p} for p in _prompts(8, args.prompt_len, 0)], params, use_tqdm=False)
    llm.start_profile()
    llm.generate([{"prompt_token_ids": p} for p in _prompts(n, args.prompt_len, n)], params, use_tqdm=False)
    llm.stop_profile()
    llm.llm_engine.engine_core.shutdown()


def trace_speech_lm(model_dir: str, trace_dir: str, args) -> None:
    from vllm_omni_speechlm import stage_configs

    from vllm_omni_speechlm.sampling_params import SPEECH_PARAMS_KEY

    speech = {SPEECH_PARAMS_KEY: {"modality": "audio", "audio_temperature": 0.8, "audio_top_k": 20}}
    _trace_omni(stage_configs.path("speech_lm_only.yaml"), model_dir, trace_dir, args, {"additional_information": speech}, top_k=0)


def trace_omni_text_lm(model_dir: str, trace_dir: str, args) -> None:
    """The plain text LM as a vllm-omni AR stage (stage0_throughput's omni-text run)."""
    use_selftest_pipelines()
    deploy = os.path.join(model_dir, "omni_text.yaml")
    with open(deploy, "w") as f:
        f.write(OMNI_TEXT_DEPLOY)
    _trace_omni(deploy, model_dir, trace_dir, args, {})


def _trace_omni(deploy: str, model_dir: str, trace_dir: str, args, extra: dict, **sampling) -> None:
    from vllm import SamplingParams
    from vllm_omni import Omni

    from vllm_omni_speechlm import plugin

    plugin.register()
    omni = Omni(model=model_dir, deploy_config=deploy, profiler_config=_profiler_config(trace_dir, args), **_settings(args))
    params = SamplingParams(temperature=0.8, max_tokens=args.gen_len, ignore_eos=True, detokenize=False, **sampling)
    n = args.concurrency
    try:
        omni.generate([{"prompt_token_ids": p, **extra} for p in _prompts(8, args.prompt_len, 0)], [params], use_tqdm=False)
        omni.start_profile()
        omni.generate([{"prompt_token_ids": p, **extra} for p in _prompts(n, args.prompt_len, n)], [params], use_tqdm=False)
        omni.stop_profile()
    finally:
        omni.close()


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total / 1e3


def summarize(trace_path: str, steps: int, top: int = 25) -> dict:
    """Chrome trace (torch profiler) -> GPU time per step, per runner phase and per kernel."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return {"trace": os.path.basename(trace_path), "error": "no GPU events (CPU run?)"}
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})}
    phases = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "user_annotation")
    starts = [p[0] for p in phases]

    def phase_of(ts: float) -> str:
        # innermost (latest-starting) annotation enclosing the launch
        for a, b, name in reversed(phases[: bisect.bisect_right(starts, ts)]):
            if a <= ts <= b:
                return name
        return "(none)"

    by_phase, by_kernel = collections.Counter(), collections.Counter()
    count = collections.Counter()
    for e in gpu:
        launch = launches.get(e.get("args", {}).get("correlation"))
        by_phase[phase_of(launch["ts"]) if launch else "(no launch)"] += e["dur"]
        by_kernel[e["name"][:100]] += e["dur"]
        count[e["name"][:100]] += 1
    window = (max(e["ts"] + e["dur"] for e in gpu) - min(e["ts"] for e in gpu)) / 1e3
    busy = _union_ms([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
    runtime = collections.Counter(e["name"] for e in events if e.get("cat") == "cuda_runtime")
    gaps = _idle_gaps(gpu, launches, phase_of, events)
    return {
        "trace": os.path.basename(trace_path),
        "steps": steps,
        "wall_ms_per_step": window / steps,
        "gpu_busy_ms_per_step": busy / steps,
        "gpu_busy_fraction": busy / window,
        "gpu_ms_per_step_by_phase": {k: v / 1e3 / steps for k, v in by_phase.most_common()},
        "top_kernels": [
            {"name": k, "ms_per_step": v / 1e3 / steps, "launches_per_step": count[k] / steps} for k, v in by_kernel.most_common(top)
        ],
        "runtime_calls_per_step": {k: v / steps for k, v in runtime.most_common(12)},
        "idle_ms_per_step": sum(g["ms"] for g in gaps.values()) / steps,
        "idle_gaps": {k: {"count": g["count"], "ms_per_step": g["ms"] / steps} for k, g in sorted(gaps.items(), key=lambda kv: -kv[1]["ms"])[:top]},
    }


def _idle_gaps(gpu: list[dict], launches: dict, phase_of, events: list[dict], min_us: float = 5.0) -> dict:
    """The GPU's idle intervals (>= min_us) by cause. A gap ends when its next kernel starts; if
    that kernel was launched inside the gap the GPU waited for the host ("starved: <phase of the
    launch>"), otherwise for a dependency ("queued"); "host in" names the runtime call the host
    was in at the gap's start (e.g. an event synchronize), if any."""
    spans = sorted((e["ts"], e["ts"] + e["dur"], e) for e in gpu)
    runtime = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events if e.get("cat") == "cuda_runtime")
    runtime_starts = [r[0] for r in runtime]
    gaps: dict = {}
    end = spans[0][1]
    for a, b, e in spans[1:]:
        if a - end >= min_us:
            launch = launches.get(e.get("args", {}).get("correlation"))
            starved = launch is not None and launch["ts"] > end
            cause = f"starved: {phase_of(launch['ts'])}" if starved else "queued"
            i = bisect.bisect_right(runtime_starts, end)
            waiting = [n for _, f, n in runtime[max(0, i - 64) : i] if f > end]
            key = f"{cause} | next {e['name'][:60]} | host in {waiting[-1] if waiting else '-'}"
            g = gaps.setdefault(key, {"ms": 0.0, "count": 0})
            g["ms"] += (a - end) / 1e3
            g["count"] += 1
        end = max(end, b)
    return gaps


def save_window(trace_path: str, fraction: float, out: str) -> None:
    """Every event (all threads, CPU and GPU) of `fraction` of the GPU's traced window, from its middle:
    a trace small enough to keep and read event by event (chrome://tracing, Perfetto)."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        trace = json.load(f)
    timed = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    spans = [e for e in timed if e.get("cat") in GPU_CATEGORIES] or timed  # the GPU's window (CPU run: all)
    lo, hi = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    a = lo + (hi - lo) * (1 - fraction) / 2
    b = a + (hi - lo) * fraction
    trace["traceEvents"] = [e for e in trace["traceEvents"] if e.get("ph") != "X" or (e["ts"] < b and e["ts"] + e.get("dur", 0) > a)]
    with gzip.open(out, "wt") as f:
        json.dump(trace, f)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--runs", nargs="+", default=["text", "speech"], choices=["text", "omni-text", "speech"])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--skip", type=int, default=24, help="steps before tracing (prefill, first decode steps)")
    ap.add_argument("--steps", type=int, default=16, help="decode steps traced")
    ap.add_argument("--keep-steps", type=int, default=0, help="also save every event of this many traced steps (mid-window) next to --out")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--tiny", action="store_true", help="tiny backbone (a CPU smoke run of the script)")
    args = ap.parse_args()

    from vllm_omni_speechlm.make_tiny import BAGPIPER_8B, BackboneGeometry, write_geometry_config

    geometry = BackboneGeometry() if args.tiny else BAGPIPER_8B
    root = tempfile.mkdtemp(prefix="gpu-step-profile-")
    report = {"benchmark": "gpu_step_profile", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "settings": vars(args)}
    tracers = {"text": trace_text_lm, "omni-text": trace_omni_text_lm, "speech": trace_speech_lm}
    for name in args.runs:
        model_dir, trace_dir = os.path.join(root, name), os.path.join(root, f"{name}-trace")
        write_geometry_config(model_dir, geometry, speech=name == "speech")
        tracers[name](model_dir, trace_dir, args)
        traces = sorted(glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True), key=os.path.getsize)
        report[name] = summarize(traces[-1], args.steps) if traces else {"error": f"no trace under {trace_dir}"}
        if traces and args.keep_steps:
            save_window(traces[-1], args.keep_steps / args.steps, f"{os.path.splitext(args.out)[0]}.{name}.trace.json.gz")
        print(json.dumps({name: report[name]}, indent=1), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
