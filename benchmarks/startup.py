"""Start-up of `vllm serve`: the streaming speech deployment next to the plain text LM of its backbone
(served by `python -m vllm.entrypoints.openai.api_server`, the server `vllm serve` runs).

    python benchmarks/startup.py --out results.json            # GPU host: 8B geometry, dummy weights
    python benchmarks/startup.py --tiny --out /tmp/startup.json # CPU: the tiny checkpoint, ~5 min

Each engine is started --starts times in a row (default 2): the first with empty caches (vLLM's
compile cache, Inductor, Triton and FlashInfer caches in a fresh folder per engine under
--workdir: "cold"), the next ones with what the first left ("warm"; so are later invocations
with the same --workdir). Per start it reports the seconds from launch to
`/health` 200, a timeline of the server's log (each process's first line, each stage's model
load, each stage's engine running) and the phases vLLM and this project log (weights,
torch.compile, the speech LM step functions, JIT kernel warm-up, CUDA graphs, engine init, per
stage). Then --requests sequential requests: the speech server streams `/v1/audio/speech` (raw
PCM, audio only) and the time to first audio of each is kept; the text LM streams
`/v1/completions` and keeps the time to first token. The first request against the steady ones
shows what a start-up left for the first user to pay; the files it added to the compile caches
(`first_request_cache_files`) name what it compiled on its way.

Model: the Bagpiper layout at Qwen3-8B geometry with dummy weights and a random X-Codec decoder
of the released geometry (`--tiny`: the tiny ones, on CPU); deploy: the shipped
`bagpiper_streaming.yaml` (`--tiny`: `bagpiper_streaming_cpu_tiny.yaml`) with the dummy-weight
overrides of `streaming_latency.py`, written next to the results. The JSON is rewritten after
every start, so a run cut short keeps what it measured. With `benchmarks/stack_sampler` on
PYTHONPATH and SPEECHLM_STACK_SAMPLES set, every process is sampled under the phases
"<start> start" (launch to ready) and "<start> requests" (`stack_samples.py` summarizes them).
`bytecode` records, per package, the share of its modules with compiled bytecode: pip compiles it
at install, and where it is missing (`--no-compile` with PYTHONDONTWRITEBYTECODE=1) every process
compiles vLLM and vllm-omni from source at each start.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))  # devtools
from stack_samples import sampled_phase  # noqa: E402
from streaming_latency import GPU_SHARE, device_name, write_checkpoint, write_deploy  # noqa: E402

from devtools.launch import OPENAI_SERVER, VLLM_SERVE, VllmServer  # noqa: E402

# Durations logged by vLLM and by this project: phase -> pattern with the seconds as group 1.
PHASES = {
    "weights_s": r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds",
    "torch_compile_s": r"torch\.compile took ([\d.]+) s in total",
    "step_functions_s": r"speech LM step functions compiled in ([\d.]+) s",
    "jit_warmup_s": r"JIT kernel warmup finished in ([\d.]+)s",
    "cuda_graphs_s": r"Graph capturing finished in ([\d.]+) secs",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)",
}
# Log moments -> timeline entries (seconds after launch), per stage where a stage is named.
MOMENTS = {
    "model_load_start": r"Starting to load model",
    "engine_running": r"\[StageEngineCoreClient\] stage-(\d+) .*EngineCore running",
}
# stack_sampler's SPEECHLM_TRACE_SPAWNS lines: epoch seconds, the process, the event, its subject.
SPAWN = re.compile(r"spawn trace: t=([\d.]+) pid=(\d+) (\w+)(?: (\S+))?(?: child=(\d+))?")
ANSI = re.compile(r"\x1b\[[0-9;]*m")
PREFIX = re.compile(r"^\((?P<proc>[A-Za-z_]+?)(?:_stage(?P<stage>\d+)_replica\d+)? pid=\d+\)\s*")
STAMP = re.compile(r"(?:INFO|WARNING|ERROR|DEBUG)\s+(\d\d-\d\d \d\d:\d\d:\d\d)")


def _stamp(line: str, year: int) -> float | None:
    m = STAMP.search(line)
    return datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S").timestamp() if m else None


def parse_log(text: str, launched: float) -> dict:
    """Timeline and phases of one server log. A line belongs to the stage of its process; worker
    lines (no stage in their prefix) to the stage whose engine process logged last (stages
    start one after the other)."""
    year = datetime.fromtimestamp(launched).year
    timeline: dict[str, float] = {}
    phases: dict[str, dict[str, float]] = {}
    stage = "0"
    for raw in text.splitlines():
        line = ANSI.sub("", raw)
        m = PREFIX.match(line)
        proc = m.group("proc") if m else "unprefixed"  # a process's lines before vLLM names it
        stage = m.group("stage") if m and m.group("stage") is not None else stage
        body = line[m.end():] if m else line
        at = _stamp(body, year)
        if at is None:
            continue
        offset = round(at - launched, 1)
        label = proc if proc in ("APIServer", "unprefixed") else f"{proc}[stage {stage}]"
        timeline.setdefault(f"first line: {label}", offset)
        for moment, pattern in MOMENTS.items():
            found = re.search(pattern, body)
            if found:
                which = found.group(1) if found.groups() else stage
                timeline.setdefault(f"{moment}[stage {which}]", offset)
        for phase, pattern in PHASES.items():
            found = re.search(pattern, body)
            if found:
                per_stage = phases.setdefault(f"stage {stage}", {})
                per_stage[phase] = round(per_stage.get(phase, 0.0) + float(found.group(1)), 2)
    timeline |= spawn_timeline(text, launched)
    return {"timeline": dict(sorted(timeline.items(), key=lambda kv: kv[1])), "phases": phases}


def spawn_timeline(text: str, launched: float) -> dict[str, float]:
    """`spawn <event>[<process>]` moments of the log's spawn trace lines (stack_sampler/): when the
    parent started each child, its interpreter came up, it re-ran the main module, it ran."""
    events = [m.groups() for m in SPAWN.finditer(text)]
    names = {child: name for _, _, event, name, child in events if event == "start"}
    out: dict[str, float] = {}
    for at, pid, event, name, _ in events:
        who = name or names.get(pid)  # a child's own events name it by its pid
        if who is not None:
            out.setdefault(f"spawn {event}[{who}]", round(float(at) - launched, 1))
    return out


def _model_name(url: str) -> str:
    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


def speech_ttfa(url: str, model: str, max_new_tokens: int) -> float | None:
    """Seconds to the first audio bytes of one streamed raw-PCM answer (audio only)."""
    body = {"model": model, "input": "Hello there, how are you today?", "voice": "default",
            "response_format": "pcm", "stream_format": "audio", "max_new_tokens": max_new_tokens,
            "initial_codec_chunk_frames": 2}
    start, first = time.perf_counter(), None
    with httpx.stream("POST", url + "/v1/audio/speech", json=body, timeout=600) as r:
        r.raise_for_status()
        for chunk in r.iter_bytes():
            if chunk and first is None:
                first = time.perf_counter() - start
    return first


def text_ttft(url: str, model: str, max_tokens: int) -> float | None:
    """Seconds to the first streamed completion token."""
    body = {"model": model, "prompt": [1000 + i for i in range(64)], "max_tokens": max_tokens,
            "stream": True, "ignore_eos": True}
    start = time.perf_counter()
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                return time.perf_counter() - start
    return None


def first_requests(probe, n: int, caches: dict[str, str] | None = None) -> dict:
    """n sequential requests' first-output times; with `caches`, the files the first request added
    to them (what it compiled on its way: a kernel the start-up left out)."""
    before = cache_files(caches or {})
    times = [probe()]
    added = sorted(cache_files(caches or {}) - before)
    times += [probe() for _ in range(n - 1)]
    steady = [t for t in times[1:] if t is not None]
    return {"seconds": times, "first_s": times[0], "tenth_s": times[9] if n >= 10 else None,
            "steady_median_s": statistics.median(steady) if steady else None,
            "first_request_cache_files": added[:100], "first_request_cache_files_count": len(added)}


def cache_files(caches: dict[str, str]) -> set[str]:
    """"NAME/relative path" of every file under each cache folder."""
    return {f"{name}/{f.relative_to(root)}" for name, folder in caches.items() if (root := Path(folder)).is_dir()
            for f in root.rglob("*") if f.is_file()}


def bytecode_share(packages=("vllm", "vllm_omni", "torch", "transformers")) -> dict:
    """Per package, the share of its modules with compiled bytecode beside them. Without it (an
    install with `--no-compile` where PYTHONDONTWRITEBYTECODE=1 keeps imports from writing it) every
    process compiles those modules from source at each start."""
    import importlib
    import importlib.util

    shares = {}
    for name in packages:
        sources = list(Path(importlib.import_module(name).__file__).parent.rglob("*.py"))
        compiled = sum(Path(importlib.util.cache_from_source(str(f))).exists() for f in sources)
        shares[name] = round(compiled / max(len(sources), 1), 3)
    return shares | {"PYTHONDONTWRITEBYTECODE": os.environ.get("PYTHONDONTWRITEBYTECODE")}


def cache_env(root: Path) -> dict[str, str]:
    """Every compile cache a start writes, under `root` (a fresh root: a cold start)."""
    return {"VLLM_CACHE_ROOT": str(root / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
            "TRITON_CACHE_DIR": str(root / "triton"), "FLASHINFER_WORKSPACE_BASE": str(root / "flashinfer")}


def start_once(engine: tuple, log: Path, caches: dict[str, str], args) -> dict:
    entrypoint, model_dir, serve_args, probe = engine
    os.environ.update(caches | {"VLLM_LOGGING_LEVEL": "INFO"})  # inherited by the server's processes
    launched = time.time()
    with sampled_phase(f"{log.stem} start"):  # with stack_sampler/: where each process's start-up goes
        server = VllmServer(model_dir, serve_args, log, entrypoint=entrypoint)
        try:
            server.wait_ready()
        except BaseException:
            server.stop()
            raise
    try:
        result = {"ready_s": round(time.time() - launched, 1)}
        result |= parse_log(log.read_text(errors="replace"), launched)
        model = _model_name(server.url)
        try:
            with sampled_phase(f"{log.stem} requests"):
                result["requests"] = first_requests(lambda: probe(server.url, model, args.gen_len), args.requests, caches)
        except Exception as e:  # noqa: BLE001 - the start was measured; say what the requests met
            result["requests"] = {"error": f"{type(e).__name__}: {e}"[-2000:]}
    finally:
        server.stop()
    return result


def _set_top_level(path: str, **keys) -> None:
    import yaml

    deploy = yaml.safe_load(Path(path).read_text()) | keys
    Path(path).write_text(yaml.safe_dump(deploy, sort_keys=False))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint on CPU")
    ap.add_argument("--starts", type=int, default=2, help="starts per engine (cold while its caches under --workdir are empty)")
    ap.add_argument("--requests", type=int, default=10, help="sequential requests after each start")
    ap.add_argument("--gen-len", type=int, default=60, help="stream-0 steps per speech request (tokens per text one)")
    ap.add_argument("--engines", nargs="+", default=["speech", "text"], choices=["speech", "text"])
    ap.add_argument("--serial", action="store_true", help="stages one after the other (parallel_stage_init: false)")
    ap.add_argument("--workdir", help="checkpoints, logs and caches (default: a temporary folder)")
    args = ap.parse_args()
    args.concurrency = [1]  # write_deploy sizes stage 0 for the load; start-up is measured unloaded
    work = Path(args.workdir or tempfile.mkdtemp(prefix="startup-"))
    speech_dir = write_checkpoint(str(work / "ckpt"), args.tiny)
    deploy = write_deploy("streaming", args, str(Path(args.out).with_suffix(".streaming.yaml")))
    if args.serial:
        _set_top_level(deploy, parallel_stage_init=False)
    text_dir = str(work / "ckpt" / "text")
    from vllm_omni_speechlm.make_tiny import BAGPIPER_8B, BackboneGeometry, write_geometry_config

    write_geometry_config(text_dir, BackboneGeometry() if args.tiny else BAGPIPER_8B, speech=False)
    text_extra = ["--load-format", "dummy", "--max-model-len", "4096"]
    text_extra += ["--dtype", "float32", "--enforce-eager"] if args.tiny else ["--gpu-memory-utilization", str(sum(GPU_SHARE["streaming"]))]
    engines = {
        "speech": (VLLM_SERVE, speech_dir, ["--omni", "--deploy-config", deploy], speech_ttfa),
        "text": (OPENAI_SERVER, text_dir, text_extra, text_ttft),
    }
    import torch
    import vllm

    report = {"device": device_name(), "versions": {"torch": torch.__version__, "vllm": vllm.__version__},
              "bytecode": bytecode_share(),
              "settings": vars(args) | {"deploy": Path(deploy).name}, "date": time.strftime("%Y-%m-%d"), "starts": {}}
    if Path(args.out).exists():  # a later invocation with the same --workdir adds its starts
        report["starts"] = json.loads(Path(args.out).read_text())["starts"]
    for name in args.engines:
        caches = work / "cache" / name
        for _ in range(args.starts):
            label = f"{name} {'warm' if caches.exists() else 'cold'} {len(report['starts']) + 1}"
            try:
                result = start_once(engines[name], work / f"{label.replace(' ', '-')}.log", cache_env(caches), args)
            except Exception as e:  # noqa: BLE001 - keep what the other starts measure
                result = {"error": f"{type(e).__name__}: {e}"[-2000:]}
            report["starts"][label] = result
            print(label, json.dumps({k: v for k, v in result.items() if k != "timeline"}, indent=1), flush=True)
            Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
