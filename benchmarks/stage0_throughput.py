"""Stage-0 decode throughput: Bagpiper (8 streams) on vLLM-Omni vs the plain Qwen3 text LM of the
same backbone on vLLM, dummy weights, fixed-length generation.

    python benchmarks/stage0_throughput.py --out results.json [--concurrency 64 512] [--gen-len 256 640] [--cfg]

Bagpiper requests are audio-only (`<|audio|>` forced, then one 8-stream frame per step: one audio
segment, eot masked as eos is) and ignore eos, so every request generates exactly --gen-len steps;
the baseline generates --gen-len text tokens per request. Several --gen-len values are measured on the same engines
(a step's GPU work grows with the context, its host work does not). Reported per generation
length and concurrency: frames/s (Bagpiper) or tok/s (text LM), the median of --repeats timed
runs (each run's rate is saved too), and the ratio frames/s / tok/s. With --cfg, per generation
length, max(concurrency)/2 guided requests (cfg_scale 3) run on the same engine: their decode
rows/s (main + companion) against the plain run's frames/s at the same row count is the cost of
guidance. The speech LM's report ends with a digest of a seeded request's frames (a same-host A/B
of two builds must print the same). --no-step-graphs runs stage 0 without its step graphs
(models/step_graphs.py): an A/B within one build. Prints and saves JSON.

With two or more --gen-len values the report also has each engine's decode phase alone
(`decode_phase`, and `ratio_decode_phase`): per concurrency, the marginal rate between the
shortest and the longest length, N * (g2 - g1) / (T2 - T1), which leaves out what a batch costs
once (submitting it, prefill, admission spread over steps, finishing and collecting outputs), and
the intercept T1 - g1 * (T2 - T1) / (g2 - g1). A step's cost grows with the context, so an
intercept is not a pure per-batch cost; the difference between two engines' intercepts is.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import platform
import sys
import tempfile
import time

import torch


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """Random text-token prompts (ids below 256 are special in the Bagpiper layout)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(256, 152192, (n, length), generator=g).tolist()


def _batch(args, n: int, gen: int, repeat: int) -> list[list[int]]:
    """The prompts of one timed run, new for every run: the text LM's prefix cache would otherwise
    skip almost all of its prefill from a batch's second run on, while the speech LM runs without
    one (docs/architecture.md). Both engines get the same prompts."""
    return _prompts(n, args.prompt_len, seed=(gen * 10_000 + n) * 100 + repeat)


ONE_SEGMENT = 100_000  # frames: no eot in an answer of any --gen-len


def _minus(a, b):
    return [x - y for x, y in zip(a, b)] if isinstance(a, list) else a - b


def _median_run(args, run) -> dict:
    """`run(repeat)` (-> items generated) for each of --repeats runs: the median run by rate, with
    every run's rate. Single runs of the same code on one host have differed by up to 25% (short
    windows: the prefill and the tail are part of each)."""
    runs = []
    for repeat in range(args.repeats):
        start = time.perf_counter()
        count = run(repeat)
        elapsed = time.perf_counter() - start
        runs.append({"seconds": elapsed, "count": count, "per_s": count / elapsed})
    median = sorted(runs, key=lambda r: r["per_s"])[len(runs) // 2]
    return {**median, "runs_per_s": [r["per_s"] for r in runs]}


def _text_runs(label: str, args, generate) -> dict[int, dict[int, dict]]:
    """Per generation length and concurrency, the median run of `generate(prompts, params)` (->
    outputs with one completion each)."""

    def tokens(prompts: list[list[int]], gen: int) -> int:
        outputs = generate([{"prompt_token_ids": p} for p in prompts], _text_params(gen, args.seed))
        return sum(len(o.outputs[0].token_ids) for o in outputs)

    tokens(_prompts(8, args.prompt_len, 0), 16)
    results: dict[int, dict[int, dict]] = {}
    for gen in args.gen_len:
        for n in args.concurrency:
            r = _median_run(args, lambda repeat: tokens(_batch(args, n, gen, repeat), gen))
            print(f"{label} gen {gen:4d} concurrency {n:4d}: {r['per_s']:9.1f} tok/s (median of {[round(x) for x in r['runs_per_s']]})", flush=True)
            results.setdefault(gen, {})[n] = {"seconds": r["seconds"], "tokens": r["count"], "tok_per_s": r["per_s"], "runs_tok_per_s": r["runs_per_s"]}
    return results


def _text_params(gen: int, seed: int | None):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.8, max_tokens=gen, ignore_eos=True, detokenize=False, seed=seed)


def _engine_settings(args) -> dict:
    return dict(
        load_format="dummy",
        max_num_seqs=max(args.concurrency),
        max_model_len=args.prompt_len + max(args.gen_len) + 16,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )


def bench_text_lm(model_dir: str, args) -> dict[int, dict[int, dict]]:
    from vllm import LLM

    llm = LLM(model=model_dir, **_engine_settings(args))
    try:
        return _text_runs("text LM  ", args, lambda prompts, params: llm.generate(prompts, params, use_tqdm=False))
    finally:
        llm.llm_engine.engine_core.shutdown()
        llm = None  # frees the engine before the next run
        gc.collect()
        torch.cuda.empty_cache()


# Plain Qwen3 as a vllm-omni AR stage: separates vllm-omni's runner cost from the speech LM's.
OMNI_TEXT_DEPLOY = """
pipeline: speechlm_selftest_ar
async_chunk: false
stages:
  - stage_id: 0
    enable_chunked_prefill: false
    enable_prefix_caching: false
"""


def use_selftest_pipelines() -> None:
    """Register devtools' self-test pipelines here and in every engine process this one starts."""
    sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # devtools, after the installed package
    from devtools import selftest_pipelines
    from vllm_omni_speechlm import plugin

    selftest_pipelines.enable()
    plugin.register()


def bench_omni_text_lm(model_dir: str, args) -> dict[int, dict[int, dict]]:
    from vllm_omni import Omni

    use_selftest_pipelines()
    deploy = os.path.join(model_dir, "omni_text.yaml")
    with open(deploy, "w") as f:
        f.write(OMNI_TEXT_DEPLOY + f"model_runner: {args.omni_model_runner}\n")
    omni = Omni(model=model_dir, deploy_config=deploy, **_engine_settings(args))
    try:
        return _text_runs("omni text", args, lambda prompts, params: omni.generate(prompts, [params], use_tqdm=False))
    finally:
        omni.close()


def bench_speech_lm(model_dir: str, args) -> dict:
    """Plain audio requests at each concurrency, then (--cfg) max(concurrency)/2 guided requests
    (cfg_scale 3): as many decode rows as the largest plain run, half of them hidden companions."""
    from vllm_omni_speechlm import stage_configs
    from vllm import SamplingParams
    from vllm_omni import Omni

    from vllm_omni_speechlm import plugin
    from vllm_omni_speechlm.config import STEP_GRAPHS_KEY
    from vllm_omni_speechlm.models.steps import step_counters
    from vllm_omni_speechlm.sampling_params import SPEECH_PARAMS_KEY

    plugin.register()
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of `step_counters`
    extra = {"worker_cls": args.speech_worker_cls} if args.speech_worker_cls else {}  # default: the YAML's
    if args.no_step_graphs:
        extra["additional_config"] = {STEP_GRAPHS_KEY: False}
    if args.no_audio_input:
        extra["limit_mm_per_prompt"] = {"audio": 0}  # vLLM's text-only mode: no tower, no multimodal path
    omni = Omni(model=model_dir, deploy_config=stage_configs.path("speech_lm_only.yaml"), **_engine_settings(args), **extra)

    def requests(prompts: list[list[int]], cfg_scale: float = 1.0) -> list[dict]:
        # One audio segment per answer, as a released model speaks: eot is masked (min_audio_frames)
        # where the dummy weights would draw it and wander into text segments.
        speech = {SPEECH_PARAMS_KEY: {"modality": "audio", "audio_temperature": 0.8, "audio_top_k": 20, "cfg_scale": cfg_scale,
                                      "min_audio_frames": ONE_SEGMENT}}
        return [{"prompt_token_ids": p, "additional_information": speech} for p in prompts]

    def frames(reqs: list[dict], gen: int) -> int:
        params = SamplingParams(temperature=0.8, top_k=0, max_tokens=gen, ignore_eos=True, detokenize=False, seed=args.seed)
        outs = omni.generate(reqs, [params], use_tqdm=False)
        assert len(outs) == len(reqs)  # companions never reach the client
        for o in outs:
            rows = o.multimodal_output["codes"]["audio"]
            assert rows.shape == (gen, 8), rows.shape  # every step one 8-stream frame
        return len(outs) * gen

    def digest(gen: int) -> dict:
        """One request's frames (all streams) under a seed, hashed, twice. Seeded dummy weights,
        engine settings, prompt and seed fix them, so two builds compared on one host must agree.
        (Several requests submitted together reach the engine over a varying number of steps, so
        their batches, and with them bf16 results, differ from run to run.)"""
        params = SamplingParams(temperature=0.8, top_k=0, max_tokens=gen, ignore_eos=True, detokenize=False, seed=1234)
        hashes = []
        for _ in range(2):
            (out,) = omni.generate(requests(_prompts(1, args.prompt_len, 7)), [params], use_tqdm=False)
            codes = torch.as_tensor(out.multimodal_output["codes"]["audio"])
            hashes.append(hashlib.sha256(codes.numpy().tobytes()).hexdigest())
        return {"frames": gen, "seed": 1234, "sha256": hashes[0], "stable": hashes[0] == hashes[1]}

    def counters() -> dict[str, int]:
        per_rank = omni.engine.collective_rpc("apply_model", args=(step_counters,), stage_ids=[0])
        while isinstance(per_rank, list):  # [stage][rank]: rank 0's
            per_rank = per_rank[0]
        return per_rank

    def timed(n: int, gen: int, label: str, cfg_scale: float = 1.0) -> dict:
        before = counters()
        r = _median_run(args, lambda repeat: frames(requests(_batch(args, n, gen, repeat), cfg_scale), gen))
        after = counters()
        rows_per_request = 2 if cfg_scale > 1 else 1
        result = {"requests": n, "seconds": r["seconds"], "frames": r["count"], "frames_per_s": r["per_s"]}
        result |= {"runs_frames_per_s": r["runs_per_s"], "decode_rows_per_s": rows_per_request * r["per_s"]}
        result["steps"] = {k: _minus(after[k], before[k]) for k in after}  # all runs: graphed and narrow of all
        print(f"speech LM gen {gen:4d} {label}: {r['per_s']:9.1f} frames/s, {result['decode_rows_per_s']:9.1f} rows/s "
              f"(median of {[round(x) for x in r['runs_per_s']]}), steps {result['steps']}", flush=True)
        return result

    results: dict = {}
    try:
        frames(requests(_prompts(8, args.prompt_len, 0)) + requests(_prompts(4, args.prompt_len, 1), 3.0), 16)
        for gen in args.gen_len:
            for n in args.concurrency:
                results.setdefault(gen, {})[n] = timed(n, gen, f"concurrency {n:4d}")
            if args.cfg:
                pairs = max(args.concurrency) // 2
                results[gen]["cfg_pairs"] = timed(pairs, gen, f"{pairs} CFG pairs", cfg_scale=3.0)
        results["digest"] = digest(min(args.gen_len))
        print(f"speech LM digest: {results['digest']}", flush=True)
    finally:
        omni.close()
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[64, 512])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, nargs="+", default=[256], help="tokens (frames) per request; several: a sweep")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per concurrency (the median is reported)")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    ap.add_argument("--tiny", action="store_true", help="tiny backbone (a CPU smoke run of the script)")
    ap.add_argument("--cfg", action="store_true", help="also max(concurrency)/2 CFG pairs (cfg_scale 3)")
    ap.add_argument("--speech-worker-cls", help="stage-0 worker (A/B: vllm_omni.worker.gpu_ar_worker.GPUARWorker, the stock one)")
    ap.add_argument("--runs", nargs="+", default=["text", "speech"], choices=["text", "omni-text", "speech"])
    ap.add_argument("--no-step-graphs", action="store_true", help="stage 0 without its step graphs (same-build A/B)")
    ap.add_argument("--no-audio-input", action="store_true", help="stage 0 without audio input (limit_mm_per_prompt audio 0)")
    ap.add_argument("--seed", type=int, help="every timed request of both engines seeded (the seeded sampling paths)")
    ap.add_argument("--omni-model-runner", choices=["v1", "v2"], default="v1", help="the omni-text stage's runner (V1 or Model Runner V2)")
    ap.add_argument("--previous", help="an earlier report of the same settings: its engines' results join this one's")
    args = ap.parse_args()

    from vllm_omni_speechlm.make_tiny import BAGPIPER_8B, BackboneGeometry, write_geometry_config

    geometry = BackboneGeometry() if args.tiny else BAGPIPER_8B

    root = tempfile.mkdtemp(prefix="stage0-bench-")
    speech_dir, text_dir = os.path.join(root, "bagpiper"), os.path.join(root, "qwen3")
    write_geometry_config(speech_dir, geometry, speech=True)
    write_geometry_config(text_dir, geometry, speech=False)

    runs = {"text": (bench_text_lm, text_dir), "omni-text": (bench_omni_text_lm, text_dir), "speech": (bench_speech_lm, speech_dir)}
    measured = _previous_runs(args.previous) if args.previous else {}
    for name in args.runs:  # the report is rewritten after each engine: a cut run keeps what it measured
        measured[name] = runs[name][0](runs[name][1], args)
        report = _report(args, geometry, measured)
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
    print(json.dumps({k: v for k, v in report.items() if k.startswith("ratio") or k == "decode_phase"}), flush=True)


def _report(args, geometry, measured: dict) -> dict:
    import vllm

    text, speech = measured.get("text"), measured.get("speech")
    report = {
        "benchmark": "stage0_throughput",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else platform.processor(),
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
        "settings": {**vars(args), "geometry": f"Bagpiper layout (vocab 160392), {geometry}, bf16, dummy weights"},
        "vllm_env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
    } | {key: measured.get(name) for name, key in REPORT_KEYS.items()}
    if text and speech:
        report["ratio_frames_per_text_tok"] = {
            gen: {n: speech[gen][n]["frames_per_s"] / text[gen][n]["tok_per_s"] for n in args.concurrency} for gen in args.gen_len
        }
    phases = {name: _decode_phase(measured.get(name), args) for name in REPORT_KEYS}
    if any(phases.values()):
        report["decode_phase"] = {name: phase for name, phase in phases.items() if phase}
    if phases["text"] and phases["speech"]:
        report["ratio_decode_phase"] = {n: phases["speech"][n]["per_s"] / phases["text"][n]["per_s"] for n in args.concurrency}
    if speech and args.cfg:  # pair decode rows/s vs plain frames/s at the same row count
        report["ratio_cfg_rows_per_plain_frames"] = {
            gen: speech[gen]["cfg_pairs"]["decode_rows_per_s"] / speech[gen][max(args.concurrency)]["frames_per_s"] for gen in args.gen_len
        }
    return report


REPORT_KEYS = {"text": "text_lm", "omni-text": "omni_text_lm", "speech": "speech_lm"}


def _previous_runs(path: str) -> dict:
    """Engine results of an earlier report (the engines can run in separate invocations, each
    within a device call's time limit), keys back to ints."""
    with open(path) as f:
        report = json.load(f)
    as_ints = lambda d: {int(k) if k.isdigit() else k: as_ints(v) if isinstance(v, dict) else v for k, v in d.items()}
    return {name: as_ints(report[key]) for name, key in REPORT_KEYS.items() if report.get(key)}


def _decode_phase(results: dict | None, args) -> dict | None:
    """Per concurrency: the decode phase's rate, step time and intercept (module docstring), from
    the median runs of the shortest and the longest generation length."""
    short, long = min(args.gen_len), max(args.gen_len)
    if not results or short == long or long not in results:
        return None
    phase = {}
    for n in args.concurrency:
        t_short, t_long = results[short][n]["seconds"], results[long][n]["seconds"]
        step = (t_long - t_short) / (long - short)
        phase[n] = {"per_s": n / step, "step_ms": 1e3 * step, "intercept_s": t_short - short * step}
    return phase


if __name__ == "__main__":
    main()
