"""Audio latency of the deploy modes: streaming (two stages, async_chunk) vs batch (two stages,
whole clip) vs fused (one stage, the codec in the LM worker), under concurrent load.

    python benchmarks/streaming_latency.py --out results.json [--concurrency 1 4 16 64]
    python benchmarks/streaming_latency.py --tiny --out /tmp/lat.json      # CPU smoke run, ~3 min

Model: the Bagpiper layout at Qwen3-8B geometry with dummy weights (`load_format=dummy`) and an
X-Codec decoder of the released geometry (transformers' XcodecConfig defaults, the decoder of
hf-audio/xcodec-hubert-general) with random weights. `--tiny`: the tiny backbone and tiny codec.
Deploy settings: the production YAMLs (stage_configs/bagpiper_{streaming,batch,fused}.yaml; the
`*_cpu_tiny.yaml` ones with --tiny) plus per-stage overrides for the dummy checkpoint (load
format, GPU memory share); written next to the results as `<out>.<mode>.yaml`.

Requests: random text-range prompts of --prompt-len ids, audio-only (`<|audio|>` forced), exactly
--gen-len steps each (min_tokens = max_tokens, so a random model cannot stop early): gen_len - 8
audio frames (gen_len - 8) / 50 s of audio. At each concurrency, N requests are submitted at once
to AsyncOmni and timed at the client:
    ttfa  time to first audio: submit -> first output carrying audio samples
    e2e   submit -> final output
    rtf   e2e / seconds of audio returned (per request)
Reported per (mode, concurrency): p50/p90 of ttfa and e2e, mean/p50/p90 of rtf, audio seconds per
wall second. The JSON (device, versions, settings, date) is rewritten after every measurement, so
a run cut short keeps what it measured; a mode that fails to start or times out is recorded as
an error and the next mode runs.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import platform
import statistics
import tempfile
import time
import traceback
import uuid

import torch
import yaml

MODES = ("streaming", "batch", "fused")
DEPLOY = {
    "streaming": "bagpiper_streaming.yaml",
    "batch": "bagpiper_batch.yaml",
    "fused": "bagpiper_fused.yaml",
}
# GPU memory share per stage when both stages sit on one GPU (the production YAMLs leave the
# placement to the deployment). The codec stage needs little: no KV cache to speak of.
GPU_SHARE = {"streaming": (0.70, 0.12), "batch": (0.70, 0.15), "fused": (0.85,)}
SAMPLE_RATE = 16000
DELAY_STEPS = 8  # <|audio|> + the 7-step delay tail: gen_len - 8 complete frames


# ---- checkpoint and deploy files ---------------------------------------------------------------


def write_checkpoint(root: str, tiny: bool, seed: int = 0) -> str:
    """Bagpiper layout config (+ tokenizer) for dummy weights, and a random X-Codec decoder."""
    from vllm_omni_speechlm.codec.xcodec import TINY_CONFIG, XCodecDecoderConfig, write_random_xcodec
    from vllm_omni_speechlm.config import SpeechLMConfig
    from vllm_omni_speechlm.make_tiny import BAGPIPER_8B, BackboneGeometry, write_geometry_config

    model_dir = os.path.join(root, "bagpiper")
    write_geometry_config(model_dir, BackboneGeometry() if tiny else BAGPIPER_8B, speech=True)
    codec_dir = os.path.join(model_dir, SpeechLMConfig.from_model_dir(model_dir).codec.path)
    write_random_xcodec(codec_dir, TINY_CONFIG if tiny else XCodecDecoderConfig(), seed)
    return model_dir


def write_deploy(mode: str, args, path: str) -> str:
    """The mode's shipped YAML with the dummy-checkpoint overrides, written to `path`."""
    from vllm_omni_speechlm import stage_configs

    name = DEPLOY[mode].replace(".yaml", "_cpu_tiny.yaml") if args.tiny else DEPLOY[mode]
    with open(stage_configs.path(name)) as f:
        deploy = yaml.safe_load(f)
    deploy = copy.deepcopy(deploy)
    for stage, share in zip(deploy["stages"], GPU_SHARE[mode]):
        stage["load_format"] = "dummy"
        if not args.tiny:
            stage["gpu_memory_utilization"] = share
    deploy["stages"][0]["max_num_seqs"] = max(deploy["stages"][0].get("max_num_seqs", 0), max(args.concurrency))
    with open(path, "w") as f:
        yaml.safe_dump(deploy, f, sort_keys=False)
    return path


# ---- requests -----------------------------------------------------------------------------------


def stage_params(mode: str, args, seed: int) -> list:
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    lm = SamplingParams(
        temperature=0.8,
        top_k=0,
        seed=seed,
        max_tokens=args.gen_len,
        min_tokens=args.gen_len,  # no early eos from a random model: every request is gen_len steps
        detokenize=False,
        # fused: the clip arrives in the last output; skip the per-step deltas to the client.
        output_kind=RequestOutputKind.FINAL_ONLY if mode == "fused" else RequestOutputKind.DELTA,
    )
    if mode == "fused":
        return [lm]
    codec_kind = RequestOutputKind.DELTA if mode == "streaming" else RequestOutputKind.FINAL_ONLY
    return [lm, SamplingParams(temperature=0.0, max_tokens=1, output_kind=codec_kind)]


def make_prompt(args, seed: int) -> dict:
    from vllm_omni_speechlm.decoding import OutputMode
    from vllm_omni_speechlm.sampling_params import SPEECH_PARAMS_KEY

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(256, 152192, (args.prompt_len,), generator=g).tolist()
    speech = {"modality": int(OutputMode.AUDIO), "audio_temperature": 0.8, "audio_top_k": 20}
    return {"prompt_token_ids": ids, "additional_information": {SPEECH_PARAMS_KEY: speech}}


def _samples(output) -> int:
    """Audio samples carried by one output (tensor or list of pieces; absent -> 0)."""
    audio = (getattr(output, "multimodal_output", None) or {}).get("audio")
    if isinstance(audio, torch.Tensor):
        return int(audio.numel())
    if isinstance(audio, list):
        return sum(int(a.numel()) for a in audio if isinstance(a, torch.Tensor))
    return 0


async def one_request(engine, mode: str, args, seed: int, request_id: str | None = None) -> dict:
    """Submit one request and time it at the client."""
    request_id = request_id or f"lat-{seed}-{uuid.uuid4().hex[:8]}"
    start = time.perf_counter()
    first = None
    samples = 0
    final = None
    async for out in engine.generate(make_prompt(args, seed), request_id=request_id, sampling_params_list=stage_params(mode, args, seed)):
        n = _samples(out)
        if n and first is None:
            first = time.perf_counter() - start
        # DELTA outputs carry new audio; FINAL_ONLY ones the whole clip once.
        samples += n
        final = out
    e2e = time.perf_counter() - start
    audio_s = samples / SAMPLE_RATE
    return {
        "ttfa_s": first,
        "e2e_s": e2e,
        "audio_s": audio_s,
        "rtf": e2e / audio_s if audio_s else None,
        "finished": bool(getattr(final, "finished", False)),
    }


def _pct(values: list[float], q: float) -> float | None:
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: list[dict], wall: float, expected_audio_s: float) -> dict:
    ttfa = [r["ttfa_s"] for r in results]
    e2e = [r["e2e_s"] for r in results]
    rtf = [r["rtf"] for r in results if r["rtf"] is not None]
    audio = sum(r["audio_s"] for r in results)
    return {
        "requests": len(results),
        "ttfa_p50_s": _pct(ttfa, 0.5),
        "ttfa_p90_s": _pct(ttfa, 0.9),
        "e2e_p50_s": _pct(e2e, 0.5),
        "e2e_p90_s": _pct(e2e, 0.9),
        "rtf_mean": statistics.fmean(rtf) if rtf else None,
        "rtf_p50": _pct(rtf, 0.5),
        "rtf_p90": _pct(rtf, 0.9),
        "audio_s_per_request": audio / len(results) if results else 0.0,
        "audio_s_expected": expected_audio_s,
        "audio_s_per_wall_s": audio / wall if wall else None,
        "wall_s": wall,
        "without_audio": sum(1 for r in results if not r["audio_s"]),
    }


async def run_round(engine, mode: str, args, n: int, seed: int) -> list[dict]:
    """n concurrent requests, submitted together."""
    ids = [f"lat-{n}-{i}-{uuid.uuid4().hex[:8]}" for i in range(n)]
    tasks = [asyncio.create_task(one_request(engine, mode, args, seed + i, rid)) for i, rid in enumerate(ids)]
    try:
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=args.level_timeout)
    except asyncio.TimeoutError:
        await engine.abort(ids)  # free the engine before the next mode (wait_for cancelled the tasks)
        raise


async def run_level(engine, mode: str, args, n: int) -> dict:
    """`--rounds` rounds of n concurrent requests; percentiles over all of them (one request per
    round at concurrency 1 alone would make p50 a single sample)."""
    results, per_round, wall = [], [], 0.0
    for r in range(args.rounds):
        start = time.perf_counter()
        batch = await run_round(engine, mode, args, n, 1000 * n + 100 * r)
        wall += time.perf_counter() - start
        results += batch
        per_round.append(_pct([b["ttfa_s"] for b in batch], 0.5))
    stats = summarize(results, wall, (args.gen_len - DELAY_STEPS) / 50)
    stats["ttfa_p50_per_round_s"] = per_round
    return stats


# ---- modes --------------------------------------------------------------------------------------


async def bench_mode(mode: str, model_dir: str, args, report: dict, save) -> None:
    from vllm_omni import AsyncOmni

    deploy = write_deploy(mode, args, f"{args.out}.{mode}.yaml")
    with open(deploy) as f:
        entry = report["modes"].setdefault(mode, {"deploy_config": yaml.safe_load(f), "levels": {}})
    start = time.perf_counter()
    engine = AsyncOmni(model=model_dir, deploy_config=deploy, stage_init_timeout=args.start_timeout)
    try:
        entry["engine_start_s"] = time.perf_counter() - start
        print(f"[{mode}] engine up in {entry['engine_start_s']:.1f} s", flush=True)
        await asyncio.wait_for(asyncio.gather(*(one_request(engine, mode, args, seed=i) for i in range(2))), args.level_timeout)
        for n in args.concurrency:
            try:
                stats = await run_level(engine, mode, args, n)
            except asyncio.TimeoutError:
                entry["levels"][str(n)] = {"error": f"timed out after {args.level_timeout} s"}
                save()
                print(f"[{mode}] concurrency {n}: timed out", flush=True)
                break
            entry["levels"][str(n)] = stats
            save()
            print(
                f"[{mode}] concurrency {n:3d}: ttfa p50 {stats['ttfa_p50_s']:.3f} s p90 {stats['ttfa_p90_s']:.3f} s | "
                f"e2e p50 {stats['e2e_p50_s']:.3f} s p90 {stats['e2e_p90_s']:.3f} s | rtf mean {stats['rtf_mean']:.3f} "
                f"| {stats['audio_s_per_request']:.2f} s audio/request",
                flush=True,
            )
    finally:
        engine.shutdown()


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else (platform.processor() or platform.machine())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON (rewritten after every measurement)")
    ap.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    ap.add_argument("--concurrency", type=int, nargs="+", default=None, help="default 1 4 16 64 (--tiny: 1 4)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=None, help="steps per request (default 258 = 5 s of audio; --tiny 68)")
    ap.add_argument("--start-timeout", type=int, default=600, help="seconds for one mode's engine start")
    ap.add_argument("--level-timeout", type=float, default=600.0, help="seconds for one round of a concurrency level")
    ap.add_argument("--rounds", type=int, default=3, help="rounds per concurrency level (percentiles over all)")
    ap.add_argument("--tiny", action="store_true", help="tiny backbone and codec on CPU (a smoke run of the script)")
    args = ap.parse_args()
    args.concurrency = args.concurrency or ([1, 4] if args.tiny else [1, 4, 16, 64])
    args.gen_len = args.gen_len or (68 if args.tiny else 258)

    from vllm_omni_speechlm import plugin

    plugin.register()  # this process resolves the pipelines; engines load the plugin themselves
    import vllm
    import vllm_omni

    root = tempfile.mkdtemp(prefix="latency-bench-")
    model_dir = write_checkpoint(root, args.tiny)
    report = {
        "benchmark": "streaming_latency",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device_name(),
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "vllm_omni": vllm_omni.__version__},
        "settings": {
            **{k: v for k, v in vars(args).items() if k != "out"},
            "model": ("tiny backbone + tiny X-Codec" if args.tiny else "Bagpiper layout, Qwen3-8B geometry, bf16")
            + ", dummy LM weights, random codec weights",
            "audio_s_per_request": (args.gen_len - DELAY_STEPS) / 50,
        },
        "modes": {},
    }

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)

    save()
    for mode in args.modes:
        try:
            asyncio.run(bench_mode(mode, model_dir, args, report, save))
        except Exception as e:  # record it and go on with the next mode
            report["modes"].setdefault(mode, {})["error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            print(f"[{mode}] failed: {type(e).__name__}: {e}", flush=True)
        save()
    print(json.dumps({m: r.get("levels", r.get("error")) for m, r in report["modes"].items()}, indent=1), flush=True)


if __name__ == "__main__":
    main()
    # Every engine is shut down and the JSON written: skip interpreter teardown, which was seen
    # to hang for minutes on the GPU host after engine runs (docs/stack-facts.md).
    os._exit(0)
