"""Audio in over HTTP: N clients at once each send a clip, to `/v1/audio/transcriptions` (streamed
text back) and to `/v1/chat/completions` (a streamed spoken answer back), on one `vllm serve`.

    python benchmarks/audio_in_load.py --out results.json                        # GPU host: 8B geometry
    python benchmarks/audio_in_load.py --tiny --out /tmp/audio_in_load.json      # CPU, the tiny checkpoint

Server: `vllm serve CKPT --omni --deploy-config bagpiper_streaming.yaml` as shipped, with dummy
weights as the only change. Checkpoint: serve_load.py's (Bagpiper layout at Qwen3-8B geometry, a
random X-Codec decoder of the released geometry), whose config carries the released audio input
(Qwen3-Omni's 32-layer audio tower, adaptor 2048 -> 4096), with a tokenizer over the whole text
range. `--tiny`: the tiny checkpoint (make_tiny, its tiny tower) and bagpiper_streaming_cpu_tiny.yaml.
Clips: devtools/audio_clips.py's tone at a pitch of its own per request (16 kHz mono PCM16 WAV),
so no two requests share an encoder-cache entry.
At each concurrency level N and input length (--audio-seconds), N clients post at once; every
answer is timed at the client. Per level:
  transcription   `file` + `stream=true`, greedy, at most TRANSCRIPT_TOKENS_PER_S tokens per input
                  second (`max_completion_tokens`): first text (request sent -> first
                  `transcript.text.delta`) p50 / p90 / max, end-to-end p50, input audio seconds
                  per wall second (all clips' seconds / the level's wall time), text deltas, and
                  stage 0's tokens per request from /metrics, errors, answers without text
  chat            the clip as an `input_audio` part, `modalities: ["audio"]`, stream: exactly
                  --gen-len audio frames (min_audio_frames = max_audio_frames) with the checkpoint's
                  guidance: first audio (request sent -> first `delta.audio.data`) p50 / p90 / max,
                  end-to-end p50, input audio seconds per wall second, completion tokens (usage),
                  errors, answers without audio
`first_requests`: two requests at once per route and length before its levels (one-time costs show
there). `server` per level: serve_load.py's reading of /metrics. The JSON is rewritten after every
level, so a run cut short keeps what it measured. --workdir keeps the checkpoint, the server log
and the compile caches (reused: a warm start).
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import io
import itertools
import json
import math
import os
import sys
import tempfile
import time
import wave
from pathlib import Path

import httpx

sys.path.append(str(Path(__file__).resolve().parents[1]))  # devtools
from serve_load import dummy_weights_deploy, first_requests, measure  # noqa: E402
from startup import cache_env  # noqa: E402
from streaming_latency import DELAY_STEPS, SAMPLE_RATE, _pct, device_name, write_checkpoint  # noqa: E402

from devtools import audio_clips  # noqa: E402
from devtools.launch import VLLM_SERVE, VllmServer  # noqa: E402

TRANSCRIPT_TOKENS_PER_S = 4  # above speech's ~3 text tokens a second
ROUTES = ("transcription", "chat")
_pitches = itertools.count()


# ---- files --------------------------------------------------------------------------------


def write_model(root: Path, tiny: bool) -> str:
    """The served checkpoint: the tiny one, or serve_load's 8B one with a tokenizer over the whole
    text range (the geometry config's tiny tokenizer drops most sampled text ids: no text deltas)."""
    from vllm_omni_speechlm.make_tiny import make_tiny, write_released_tokenizer

    if tiny:
        make_tiny("bagpiper", root / "tiny", seed=0)
        return str(root / "tiny")
    model_dir = write_checkpoint(str(root), tiny=False)
    write_released_tokenizer(model_dir)
    return model_dir


def wav_bytes(seconds: float) -> bytes:
    """A clip no other request of the run sends (vLLM caches encoder outputs by content)."""
    samples = audio_clips.clip(seconds, pitch=100.0 + 0.25 * next(_pitches))
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(audio_clips.RATE)
        w.writeframes(samples.astype("<i2").tobytes())
    return buf.getvalue()


# ---- one request --------------------------------------------------------------------------


def _event(line: str) -> dict | None:
    if not line.startswith("data: {"):
        return None
    event = json.loads(line[6:])
    if event.get("type") == "error" or "error" in event:
        raise RuntimeError(f"SSE error event: {line[:300]}")
    return event


async def _post(client: httpx.AsyncClient, path: str, on_event, **request) -> dict:
    """One streamed answer: `on_event(event, seconds since sent)` per SSE event; its wall time."""
    sent = time.perf_counter()
    try:
        async with client.stream("POST", path, **request) as r:
            if r.status_code != 200:
                return {"error": f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"}
            async for line in r.aiter_lines():
                if (event := _event(line)) is not None:
                    on_event(event, time.perf_counter() - sent)
    except (httpx.HTTPError, RuntimeError, ValueError) as e:
        return {"error": f"{type(e).__name__}: {e}"[:300]}
    return {"wall_s": time.perf_counter() - sent}


async def transcribe(client: httpx.AsyncClient, form: dict, wav: bytes, seconds: float) -> dict:
    got = {"first_s": None, "text_deltas": 0, "input_s": seconds}

    def on_event(event: dict, at: float) -> None:
        if event.get("type") == "transcript.text.delta" and event.get("delta"):
            got["first_s"] = got["first_s"] or at
            got["text_deltas"] += 1

    files = {"file": ("clip.wav", wav, "audio/wav")}
    return got | await _post(client, "/v1/audio/transcriptions", on_event, data=form, files=files)


async def chat(client: httpx.AsyncClient, body: dict, seconds: float) -> dict:
    got = {"first_s": None, "audio_s": 0.0, "completion_tokens": None, "input_s": seconds}

    def on_event(event: dict, at: float) -> None:
        delta = (event.get("choices") or [{}])[0].get("delta") or {}
        if (audio := (delta.get("audio") or {}).get("data")):
            got["first_s"] = got["first_s"] or at
            got["audio_s"] += len(base64.b64decode(audio)) / 2 / SAMPLE_RATE
        if event.get("usage"):
            got["completion_tokens"] = event["usage"]["completion_tokens"]

    return got | await _post(client, "/v1/chat/completions", on_event, json=body)


# ---- a level ------------------------------------------------------------------------------


def summary(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    answered = [r for r in ok if r["first_s"] is not None]
    first = [r["first_s"] for r in answered]
    return {
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_samples": [r["error"] for r in results if "error" in r][:3],
        "without_output": len(ok) - len(answered),
        "first_p50_s": _pct(first, 0.5),
        "first_p90_s": _pct(first, 0.9),
        "first_max_s": max(first, default=None),
        "e2e_p50_s": _pct([r["wall_s"] for r in ok], 0.5),
        "input_audio_s_per_wall_s": sum(r["input_s"] for r in ok) / wall,
        "text_deltas_per_request": _mean([r.get("text_deltas") for r in ok]),
        "completion_tokens_per_request": _mean([r.get("completion_tokens") for r in ok]),
        "audio_out_s_per_request": _mean([r.get("audio_s") for r in ok]),
        "wall_s": wall,
    }


def _mean(values: list) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def requests_for(route: str, model: str, frames: int):
    """(input seconds, N) -> the level's request maker, every clip and body made before the
    level's clock starts."""

    def make(seconds: float, n: int):
        wavs = [wav_bytes(seconds) for _ in range(n)]
        if route == "transcription":
            form = {"model": model, "stream": "true", "max_completion_tokens": str(transcript_tokens(seconds))}
            return lambda c, i: transcribe(c, form, wavs[i], seconds)
        bodies = [chat_body(model, wav, frames, i) for i, wav in enumerate(wavs)]
        return lambda c, i: chat(c, bodies[i], seconds)

    return make


def transcript_tokens(seconds: float) -> int:
    return math.ceil(TRANSCRIPT_TOKENS_PER_S * seconds)


def chat_body(model: str, wav: bytes, frames: int, seed: int) -> dict:
    part = {"type": "input_audio", "input_audio": {"data": base64.b64encode(wav).decode(), "format": "wav"}}
    return {"model": model, "messages": [{"role": "user", "content": [part]}], "modalities": ["audio"],
            "stream": True, "stream_options": {"include_usage": True}, "seed": seed,
            "min_audio_frames": frames, "max_audio_frames": frames, "max_tokens": frames + DELAY_STEPS + 2}


def run_route(server: VllmServer, route: str, make, args, report: dict, save) -> None:
    """Two requests at once per length, then every level: {"N audio=Ss": ...}."""
    for s in args.audio_seconds:
        report["first_requests"][f"{route} audio={s:g}s"] = first_requests(server, make(s, 2), summary)
    names = {f"{n} audio={s:g}s": s for s in args.audio_seconds for n in args.concurrency}
    measure(server.url, list(names), lambda name: make(names[name], int(name.split()[0])), summary, report[route], save)


# ---- report -------------------------------------------------------------------------------


def out_tokens(route: str, level: dict) -> float | None:
    """Per request: chat's usage; a transcription stream has no count, so stage 0's from /metrics."""
    if route == "chat":
        return level["completion_tokens_per_request"]
    generated = (level.get("server") or {}).get("generation_tokens[0]")
    return generated / level["requests"] if generated is not None and level["requests"] else None


def table(report: dict) -> str:
    def cell(v, width: int, digits: int = 3) -> str:
        return f"{'-' if v is None else f'{v:.{digits}f}':>{width}}"

    lines = [f"{'route':<14}{'level':<16}{'first p50':>10}{'p90':>8}{'max':>8}{'e2e p50':>9}{'in s/s':>9}"
             f"{'tok/req':>9}{'errors':>8}{'empty':>7}"]
    for route in ROUTES:
        for name, r in report.get(route, {}).items():
            lines.append(f"{route:<14}{name:<16}{cell(r['first_p50_s'], 10)}{cell(r['first_p90_s'], 8)}"
                         f"{cell(r['first_max_s'], 8)}{cell(r['e2e_p50_s'], 9)}{cell(r['input_audio_s_per_wall_s'], 9, 2)}"
                         f"{cell(out_tokens(route, r), 9, 1)}{r['errors']:>8}{r['without_output']:>7}")
    return "\n".join(lines)


def settings(args, model_dir: str, deploy: str, frames: int) -> dict:
    from vllm_omni_speechlm.config import SpeechLMConfig

    cfg = SpeechLMConfig.from_model_dir(model_dir)
    return vars(args) | {
        "model": "tiny Bagpiper (make_tiny, seed 0)" if args.tiny else "Bagpiper layout, Qwen3-8B geometry, bf16",
        "weights": "dummy (load_format)", "deploy": deploy, "gen_len": frames, "audio_input": dataclasses.asdict(cfg.audio_input),
        "transcript_max_completion_tokens": {f"{s:g}": transcript_tokens(s) for s in args.audio_seconds},
        "chat": {"modalities": ["audio"], "min_audio_frames": frames, "max_audio_frames": frames,
                 "max_tokens": frames + DELAY_STEPS + 2, "cfg_scale": cfg.audio_sampling.cfg_scale},
        "clips": f"devtools/audio_clips.py clip at pitch 100 + 0.25 k Hz (k: the run's request count), {audio_clips.RATE} Hz PCM16 WAV",
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="the tiny checkpoint on CPU")
    ap.add_argument("--concurrency", type=int, nargs="+", help="default 1 16 64 (--tiny: 1 2)")
    ap.add_argument("--audio-seconds", type=float, nargs="+", help="input clip lengths (default 10 30; --tiny: 2 4)")
    ap.add_argument("--gen-len", type=int, default=100, help="audio frames per chat answer")
    ap.add_argument("--routes", nargs="+", default=list(ROUTES), choices=ROUTES)
    ap.add_argument("--workdir", help="checkpoint, logs and compile caches (reused: a warm start)")
    args = ap.parse_args()
    args.concurrency = args.concurrency or ([1, 2] if args.tiny else [1, 16, 64])
    args.audio_seconds = args.audio_seconds or ([2.0, 4.0] if args.tiny else [10.0, 30.0])
    work = Path(args.workdir or tempfile.mkdtemp(prefix="audio-in-load-"))
    deploy_name = "bagpiper_streaming_cpu_tiny.yaml" if args.tiny else "bagpiper_streaming.yaml"
    model_dir = write_model(work / "ckpt", args.tiny)
    deploy = dummy_weights_deploy(deploy_name, work / deploy_name)

    import torch
    import vllm
    import vllm_omni

    report = {
        "benchmark": "audio_in_load", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device_name(),
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "vllm_omni": vllm_omni.__version__},
        "settings": settings(args, model_dir, deploy_name, args.gen_len),
        "first_requests": {}, **{route: {} for route in args.routes},
    }

    def save() -> None:
        Path(args.out).write_text(json.dumps(report, indent=2))

    os.environ.update(cache_env(work / "cache"))  # the server's processes inherit it
    if args.tiny:  # as the Makefile and tests: vLLM's CPU default reserves 92% of the memory
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    with VllmServer(model_dir, ["--omni", "--deploy-config", deploy], work / "server.log", entrypoint=VLLM_SERVE) as server:
        for route in args.routes:
            run_route(server, route, requests_for(route, model_dir, args.gen_len), args, report, save)
    save()
    print(table(report), flush=True)


if __name__ == "__main__":
    main()
