"""Real-time speech over HTTP: N listeners streaming `/v1/audio/speech` at once, next to the plain
text LM of the same backbone decoding N completions at once.

    python benchmarks/serve_load.py --out results.json                  # GPU host: 8B geometry
    python benchmarks/serve_load.py --tiny --out /tmp/serve_load.json   # CPU, the tiny checkpoint

Speech: `vllm serve CKPT --omni --deploy-config bagpiper_streaming.yaml` as shipped (`--deploy` for
another one; several: one server after the other, levels keyed "N @deploy"), with dummy weights as
the only change (Bagpiper layout at Qwen3-8B geometry, a random X-Codec decoder of the released
geometry). Every answer asks for exactly --gen-len audio frames
(its minimum and maximum) and takes the checkpoint's guidance (released: cfg 3) unless --cfg-scale
(several values: each is measured at every level on the same server, key "N cfg=X").
At each concurrency level N clients post at once, each streaming one audio-only answer (raw PCM, or
SSE with `--format sse`) to a text of its own (one question, numbered: stage 0's prefix caching
shares the system turn and the guidance companions' prompts, as in real traffic, not the whole
prompt), and the client times every chunk. `--arrivals steady` (levels "N steady") keeps N answers
streaming instead, as a service sees them once it runs: client i joins i/N of one answer's audio
length after the level starts and then streams answers back to back; the answers sent in the
--steady-s after the last client joined are measured (and each client's first after that, where
an answer outlasts the window), and the clients go on until each of those is done, so every
measured answer had N open beside it. Per level:
    first audio   request sent -> first audio bytes: p50 / p90 / max
    stall         a listener starts playing at the first byte (and, the second figure, 200 ms
                  later) and plays in real time; a stall is time it has nothing to play
    stall-free    share of answers with no stall (under 1 ms in all)
    first gaps    where each gapped answer's first gap came, in audio seconds played (first byte)
    first chunks  one listener's first chunks: (arrival s, audio s) each, to see where a stall starts
    rtf           answer's wall time / its audio seconds (mean)
    audio s / s   all audio received / the level's wall time
    errors, answers without audio
Text: vLLM's OpenAI server on the backbone alone (same geometry, dummy weights), N streamed
completions of --gen-len tokens at once (`ignore_eos`); per request decode tok/s = (tokens - 1) /
(last token - first token); a completion that failed or streamed fewer than two tokens is an
error (`error_samples` says which). The two servers run one after the other in one invocation.
The JSON is rewritten after every level, so a run cut short keeps what it measured.

Where the time goes (`server` per level, from the server's /metrics before and after the level):
per stage, the mean time between a request's outputs (stage 0: its step time as the engine
reports it), the mean tokens per engine step (stage 0: the batch; stage 1: code ids decoded per
call), engine steps, preemptions; the mean shared-memory send time from stage 0 to stage 1.
`--set STAGE.KEY=VALUE` changes one stage setting of the deploy YAML, `--set A.B.KEY=VALUE` one of
its other sections (diagnosis only; the recorded settings say so).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml

sys.path.append(str(Path(__file__).resolve().parents[1]))  # devtools
from stack_samples import sampled_phase  # noqa: E402
from streaming_latency import DELAY_STEPS, SAMPLE_RATE, _pct, device_name, write_checkpoint  # noqa: E402

from devtools.launch import OPENAI_SERVER, VLLM_SERVE, VllmServer  # noqa: E402

PROMPT = "Tell me about the sea."
# The server's environment that changes what is measured (recorded in the settings).
SERVER_ENV = ("SPEECHLM_TRACE_WINDOWS", "VLLM_OMNI_EVENT_DRIVEN_ORCH", "SPEECHLM_STACK_SAMPLES", "SPEECHLM_TRACE_LAUNCHERS",
              "SPEECHLM_NAN_WATCH")
BUFFER_S = 0.2
BURST_S = 1.0  # a level's first second (its requests' arrival and admission), sampled as a phase of its own
STALL_FREE_S = 1e-3
FIRST_CHUNKS = 12


# ---- files --------------------------------------------------------------------------------


def dummy_weights_deploy(name: str, out: Path, overrides: list[str] = ()) -> str:
    """The shipped deploy YAML `name`, its stages loading dummy weights, with `STAGE.KEY=VALUE`
    overrides (or `A.B.KEY=VALUE`: a key under the YAML's top-level section A, e.g.
    `connectors.shm.extra.codec_playout_margin_steps=0`)."""
    from vllm_omni_speechlm import stage_configs

    deploy = yaml.safe_load(Path(stage_configs.path(name)).read_text())
    for stage in deploy["stages"]:
        stage["load_format"] = "dummy"
    for item in overrides:
        where, value = item.split("=", 1)
        *path, key = where.split(".")
        section = deploy["stages"][int(path[0])] if path[0].isdigit() else deploy[path[0]]
        for part in path[1:]:
            section = section[part]
        section[key] = yaml.safe_load(value)
    out.write_text(yaml.safe_dump(deploy, sort_keys=False))
    return str(out)


# ---- one listener -------------------------------------------------------------------------


def _gaps(chunks: list[tuple[float, float]], buffer_s: float):
    """(audio seconds played before it, its seconds) per gap of a listener who starts `buffer_s`
    after the first chunk and pauses whenever it runs dry. `chunks`: (arrival time, audio seconds)."""
    plays_until, played = chunks[0][0] + buffer_s if chunks else 0.0, 0.0
    for at, seconds in chunks:
        if at > plays_until:
            yield played, at - plays_until
            plays_until = at
        plays_until += seconds
        played += seconds


def stall_s(chunks: list[tuple[float, float]], buffer_s: float) -> float:
    """Seconds a listener has nothing to play (`_gaps`)."""
    return sum(gap for _, gap in _gaps(chunks, buffer_s))


def first_gap_s(chunks: list[tuple[float, float]]) -> float | None:
    """Audio seconds a listener who starts at the first byte played before its first gap (None: no gap)."""
    return next((played for played, gap in _gaps(chunks, 0.0) if gap >= STALL_FREE_S), None)


def _sse_audio(line: str) -> bytes:
    if not line.startswith("data: "):
        return b""
    event = json.loads(line[6:])
    if event.get("type") == "error" or "error" in event:
        raise RuntimeError(f"SSE error event: {line[:300]}")
    return base64.b64decode(event["audio"]) if event.get("type") == "speech.audio.delta" else b""


async def listen(client: httpx.AsyncClient, body: dict, sse: bool) -> dict:
    """One streamed answer, timed at the client: (arrival, audio seconds) per chunk."""
    sent, sent_wall, chunks = time.perf_counter(), time.time(), []
    try:
        async with client.stream("POST", "/v1/audio/speech", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
            pieces = r.aiter_lines() if sse else r.aiter_bytes()
            async for piece in pieces:
                audio = _sse_audio(piece) if sse else piece
                if audio:
                    chunks.append((time.perf_counter() - sent, len(audio) / 2 / SAMPLE_RATE))
    except (httpx.HTTPError, RuntimeError) as e:  # when, and after how much audio: a stage dying shows as one moment
        heard = sum(seconds for _, seconds in chunks)
        return {"error": f"{type(e).__name__} after {time.perf_counter() - sent:.2f} s, {heard:.2f} s of audio: {e}"[:300]}
    wall = time.perf_counter() - sent
    audio_s = sum(seconds for _, seconds in chunks)
    return {
        "first_audio_s": chunks[0][0] if chunks else None,
        "audio_s": audio_s,
        "wall_s": wall,
        "stall_s": stall_s(chunks, 0.0),
        "stall_buffered_s": stall_s(chunks, BUFFER_S),
        "first_gap_s": first_gap_s(chunks),
        "chunks": len(chunks),
        "first_chunks": [(round(at, 4), round(seconds, 4)) for at, seconds in chunks[:FIRST_CHUNKS]],
        "sent_wall": sent_wall,
    }


def speech_summary(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    heard = [r for r in ok if r["audio_s"] > 0]
    first = [r["first_audio_s"] for r in heard]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "without_audio": len(ok) - len(heard),
        "first_audio_p50_s": _pct(first, 0.5),
        "first_audio_p90_s": _pct(first, 0.9),
        "first_audio_max_s": max(first, default=None),
        "stall_free": sum(r["stall_s"] < STALL_FREE_S for r in heard) / len(results) if results else None,
        "stall_free_buffered": sum(r["stall_buffered_s"] < STALL_FREE_S for r in heard) / len(results) if results else None,
        "stall_p50_s": _pct([r["stall_s"] for r in heard], 0.5),
        "stall_p90_s": _pct([r["stall_s"] for r in heard], 0.9),
        "stall_buffered_p90_s": _pct([r["stall_buffered_s"] for r in heard], 0.9),
        "rtf_mean": statistics.fmean(r["wall_s"] / r["audio_s"] for r in heard) if heard else None,
        "audio_s_per_request": statistics.fmean(r["audio_s"] for r in heard) if heard else 0.0,
        "audio_s_per_wall_s": sum(r["audio_s"] for r in heard) / wall,
        "wall_s": wall,
        "first_gaps_s": sorted(round(r["first_gap_s"], 2) for r in heard if r["first_gap_s"] is not None),
        "first_chunks": heard[0]["first_chunks"] if heard else [],
        "sent_wall": min((r["sent_wall"] for r in ok), default=None),  # the level's start (server logs)
    }


# ---- one text completion ------------------------------------------------------------------


async def complete(client: httpx.AsyncClient, model: str, tokens: int, seed: int) -> dict:
    body = {"model": model, "prompt": [1000 + (seed * 7 + i) % 5000 for i in range(64)], "max_tokens": tokens,
            "stream": True, "ignore_eos": True, "temperature": 0.8, "seed": seed}
    sent, times = time.perf_counter(), []
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    times.append(time.perf_counter() - sent)
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 and times[-1] > times[0] else None
    return {"first_token_s": times[0] if times else None, "tokens": len(times), "decode_tok_s": decode}


def text_summary(results: list[dict], wall: float) -> dict:
    ok, failed = [], []
    for r in results:  # a rate needs two tokens
        if "error" not in r and r["decode_tok_s"]:
            ok.append(r)
        else:
            failed.append(r.get("error") or f"{r['tokens']} tokens streamed")
    rates = [r["decode_tok_s"] for r in ok]
    return {
        "requests": len(results),
        "errors": len(failed),
        "error_samples": failed[:3],
        "decode_tok_s_per_request_p50": _pct(rates, 0.5),
        "decode_tok_s_per_request_p10": _pct(rates, 0.1),
        "first_token_p50_s": _pct([r["first_token_s"] for r in ok], 0.5),
        "tokens_per_wall_s": sum(r["tokens"] for r in ok) / wall,
        "wall_s": wall,
    }


# ---- the server's side --------------------------------------------------------------------

# (summary key, Prometheus family, the stage label or None): a histogram's mean over the level.
SERVER_MEANS = [
    ("step_s", "vllm:inter_token_latency_seconds", "stage"),
    ("tokens_per_step", "vllm:iteration_tokens_total", "stage"),
    ("shm_send_s", "vllm_omni:transfer_tx_s", None),
]
SERVER_COUNTS = [("steps", "vllm:iteration_tokens_total_count"), ("preemptions", "vllm:num_preemptions_total"),
                 ("generation_tokens", "vllm:generation_tokens_total")]


def scrape(url: str) -> dict[tuple[str, str], float]:
    """{(sample name, stage label or ""): value} summed over the other labels."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            key = (sample.name, sample.labels.get("stage", ""))
            samples[key] = samples.get(key, 0.0) + sample.value
    return samples


def server_summary(before: dict, after: dict) -> dict:
    delta = {k: v - before.get(k, 0.0) for k, v in after.items()}
    stages = sorted({stage for _, stage in delta} - {""}) or [""]
    out: dict[str, float | None] = {}
    for stage in stages:
        for key, family, label in SERVER_MEANS:
            at = stage if label else ""
            count = delta.get((family + "_count", at), 0.0)
            out[f"{key}[{at}]" if at else key] = delta.get((family + "_sum", at), 0.0) / count if count else None
        for key, name in SERVER_COUNTS:
            out[f"{key}[{stage}]" if stage else key] = delta.get((name, stage))
    return out


# ---- levels -------------------------------------------------------------------------------


HEALTH_EVERY_S = 5.0  # while a level runs, how often /health is asked


class ServerDown(RuntimeError):
    """/health failed while a level's requests were open (a dead engine leaves them hanging)."""


def health(url: str) -> int | str:
    """/health's status code, or why there was none."""
    try:
        return httpx.get(url + "/health", timeout=30).status_code
    except httpx.HTTPError as e:
        return f"{type(e).__name__}: {e}"[:300]


async def _until_unhealthy(client: httpx.AsyncClient) -> str:
    while True:
        await asyncio.sleep(HEALTH_EVERY_S)
        try:
            r = await client.get("/health", timeout=30)
        except httpx.HTTPError as e:
            return f"/health: {type(e).__name__}: {e}"[:300]
        if r.status_code != 200:
            return f"/health: HTTP {r.status_code}"


class Steady:
    """N clients streaming answers back to back, their joins spread over `join_s`; the answers
    sent in the `window_s` after the last join are the measured ones, and at least one per client
    (a server slower than real time may take the whole window for one answer)."""

    def __init__(self, n: int, join_s: float, window_s: float):
        self.n, self.join_s, self.window_s = n, join_s, window_s
        self.opens_at = join_s * (n - 1) / n
        self.closes_at = self.opens_at + window_s
        self.open = 0  # measured answers not done yet
        self.unmeasured = n  # clients that have not sent a measured answer yet
        self.sends_s = window_s  # from the window's start to the last measured send, at least the window

    async def client(self, request, client: httpx.AsyncClient, i: int, start: float) -> list[dict]:
        await asyncio.sleep(i * self.join_s / self.n)
        measured = []
        for k in itertools.count():
            at = time.perf_counter() - start
            if at >= self.closes_at and not self.open and not self.unmeasured:
                return measured
            counted = self.opens_at <= at and (at < self.closes_at or not measured)
            if counted:
                self.unmeasured -= not measured
                self.open += 1
                self.sends_s = max(self.sends_s, at - self.opens_at)
            answer = await request(client, i + k * self.n)
            self.open -= counted
            if counted:
                measured.append(answer)


async def run_level(url: str, n: int, request, summary, steady: Steady | None = None) -> dict:
    """N requests at once (or N streaming steadily) -> `summary(results, wall s)`; ServerDown if
    /health fails meanwhile."""
    limits = httpx.Limits(max_connections=n + 1, max_keepalive_connections=n + 1)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(900.0), limits=limits) as client:
        start = time.perf_counter()
        if steady:
            clients = (steady.client(request, client, i, start) for i in range(n))
        else:
            clients = (request(client, i) for i in range(n))
        answers = asyncio.ensure_future(asyncio.gather(*clients))
        watch = asyncio.ensure_future(_until_unhealthy(client))
        await asyncio.wait({answers, watch}, return_when=asyncio.FIRST_COMPLETED)
        if not answers.done():
            answers.cancel()
            await asyncio.gather(answers, return_exceptions=True)
            raise ServerDown(watch.result())
        watch.cancel()
        if steady:
            return summary([a for client_answers in answers.result() for a in client_answers], steady.sends_s)
        return summary(answers.result(), time.perf_counter() - start)


def measure(url: str, levels: list[str], request, summary, report: dict, save,
            steady_s: tuple[float, float] | None = None) -> None:
    """Each level `N`, `N steady` or either with ` cfg=X`: N requests at once (or N streaming
    steadily, `steady_s` = (join, window) seconds), and what the server saw meanwhile. A level
    whose server goes down is recorded as such, and the levels after it are not run."""
    for level in levels:
        before = scrape(url)
        n = int(level.split()[0])
        steady = Steady(n, *steady_s) if steady_s and " steady" in level else None
        try:
            with sampled_phase(f"{level} burst", then=level, after_s=BURST_S):
                stats = asyncio.run(run_level(url, n, request(level), summary, steady))
        except ServerDown as e:
            report[level] = {"server_down": str(e)}
            save()
            print(level, "server down:", e, flush=True)
            return
        if stats.get("errors"):  # a dead stage fails every answer at once, maybe before the watch looks
            stats["health_after"] = health(url)
        report[level] = stats | {"server": server_summary(before, scrape(url))}
        save()
        print(level, json.dumps({k: v for k, v in report[level].items() if k not in ("error_samples", "first_chunks")}), flush=True)


def level_names(levels: list[int], cfgs: list[float | None], arrivals: list[str]) -> dict[str, float | None]:
    """{"N" ("N steady"), with " cfg=X" when several: the guidance of the level's answers (None: the
    checkpoint's)}."""
    names = [f"{n}{' steady' if a == 'steady' else ''}" for a in arrivals for n in levels]
    if len(cfgs) == 1:
        return dict.fromkeys(names, cfgs[0])
    return {f"{name} cfg={c:g}": c for c in cfgs for name in names}


def first_requests(server: VllmServer, request, summary) -> dict:
    """The first requests after the server is ready (one-time costs show here), two at once."""
    server.wait_ready()
    return asyncio.run(run_level(server.url, 2, request, summary))


def serve_speech(model_dir: str, deploy_name: str, suffix: str, args, levels: list[int], frames: int, work: Path,
                 report: dict, save) -> None:
    """One speech server on `deploy_name`: its first requests, then every level (keys end in `suffix`)."""
    deploy = dummy_weights_deploy(deploy_name, work / deploy_name, args.set)
    body = {"input": PROMPT, "response_format": "pcm", "min_audio_frames": frames, "max_audio_frames": frames,
            "max_new_tokens": frames + DELAY_STEPS + 2}
    body |= {"stream": True, "stream_format": "sse"} if args.format == "sse" else {"stream_format": "audio"}
    log = work / f"speech{suffix.replace(' @', '_')}.log"
    with VllmServer(model_dir, ["--omni", "--deploy-config", deploy], log, entrypoint=VLLM_SERVE) as server:
        scales = {name + suffix: cfg for name, cfg in level_names(levels, args.cfg_scale or [None], args.arrivals).items()}

        answers = itertools.count()  # every answer its own text: prefix caching shares only what traffic shares

        def request(level: str):
            guided = body if scales[level] is None else body | {"cfg_scale": scales[level]}
            return lambda c, i: listen(c, guided | {"seed": i, "input": f"{PROMPT} Answer {next(answers)}."},
                                       args.format == "sse")

        report["first_requests"]["speech" + suffix] = first_requests(server, request(next(iter(scales))), speech_summary)
        measure(server.url, list(scales), request, speech_summary, report["speech"], save, args.steady)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint on CPU")
    ap.add_argument("--concurrency", type=int, nargs="+", help="default 1 16 64 128 192 256 (--tiny: 1 4)")
    ap.add_argument("--gen-len", type=int, help="audio frames per answer, tokens per completion (default 300; --tiny 60)")
    ap.add_argument("--format", choices=["pcm", "sse"], default="pcm", help="raw PCM stream or SSE events")
    ap.add_argument("--cfg-scale", type=float, nargs="+", help="every answer's guidance (default: the checkpoint's)")
    ap.add_argument("--deploy", nargs="+", help="shipped deploy YAMLs, served one after the other "
                    "(default bagpiper_streaming[_cpu_tiny].yaml)")
    ap.add_argument("--set", action="append", default=[], metavar="STAGE.KEY=VALUE",
                    help="change one stage setting of the deploy YAML (diagnosis)")
    ap.add_argument("--engines", nargs="+", default=["speech", "text"], choices=["speech", "text"])
    ap.add_argument("--arrivals", nargs="+", default=["burst"], choices=["burst", "steady"],
                    help="N answers sent at once, and/or N kept streaming (levels 'N steady')")
    ap.add_argument("--steady-s", type=float, help="seconds of sends measured per steady level (default: two answers' audio)")
    ap.add_argument("--workdir", help="checkpoints and server logs (default: a temporary folder)")
    args = ap.parse_args()
    levels = args.concurrency or ([1, 4] if args.tiny else [1, 16, 64, 128, 192, 256])
    frames = args.gen_len or (60 if args.tiny else 300)
    answer_s = (frames - DELAY_STEPS) / 50
    args.steady = (answer_s, args.steady_s or 2 * answer_s)  # clients join over one answer's audio
    deploys = args.deploy or ["bagpiper_streaming_cpu_tiny.yaml" if args.tiny else "bagpiper_streaming.yaml"]
    work = Path(args.workdir or tempfile.mkdtemp(prefix="serve-load-"))

    import torch
    import vllm
    import vllm_omni

    report = {
        "benchmark": "serve_load", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device_name(),
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "vllm_omni": vllm_omni.__version__},
        "settings": vars(args) | {"levels": levels, "gen_len": frames, "deploy": deploys,
                                  "audio_s_per_answer": answer_s, "buffer_s": BUFFER_S,
                                  "env": {k: v for k, v in os.environ.items() if k in SERVER_ENV}},
        "first_requests": {}, "speech": {}, "text": {}, "failed": {},
    }

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=2))

    if "speech" in args.engines:
        model_dir = write_checkpoint(str(work / "ckpt"), args.tiny)
        for name in deploys:
            suffix = f" @{Path(name).stem}" if len(deploys) > 1 else ""
            try:
                serve_speech(model_dir, name, suffix, args, levels, frames, work, report, save)
            except (RuntimeError, TimeoutError, httpx.HTTPError) as e:  # a server that fails: the next one still runs
                if len(deploys) == 1:
                    raise
                report["failed"][name] = f"{type(e).__name__}: {e}"[-3000:]
                save()
    if "text" in args.engines:
        from vllm_omni_speechlm.make_tiny import BAGPIPER_8B, BackboneGeometry, write_geometry_config

        text_dir = str(work / "ckpt" / "text")
        write_geometry_config(text_dir, BackboneGeometry() if args.tiny else BAGPIPER_8B, speech=False)
        extra = ["--load-format", "dummy", "--max-model-len", "4096", "--max-num-seqs", str(max(levels))]
        extra += ["--dtype", "float32", "--enforce-eager"] if args.tiny else []
        with VllmServer(text_dir, extra, work / "text.log", entrypoint=OPENAI_SERVER) as server:
            def request(level: str):
                return lambda c, i: complete(c, text_dir, frames, i)

            report["first_requests"]["text"] = first_requests(server, request(""), text_summary)
            measure(server.url, list(level_names(levels, [None], args.arrivals)), request, text_summary, report["text"],
                    save, args.steady)
    save()


if __name__ == "__main__":
    main()
