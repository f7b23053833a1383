"""Stage 1 alone: how long the codec stage's model takes to decode a step's windows (diagnosis for
the streaming path; the user's numbers come from serve_load.py).

    python benchmarks/codec_decode.py --out results.json          # GPU: the released X-Codec geometry
    python benchmarks/codec_decode.py --tiny --out /tmp/cd.json   # CPU smoke run
    python benchmarks/codec_decode.py --graphs --out results.json # GPU: eager against CUDA graphs
    python benchmarks/codec_decode.py --graphs --fused --out r.json # ... and graphs with one-kernel Snakes

`SpeechLMCodecDecoder.decode_windows` (what the stage's forward calls) on B windows at once, timed
with the device synchronized, median of --repeats after 3 warm-up calls; also the first call's
time (`first_call_ms`: the process meets the shape for the first time, as a server does under
load). The windows are what a streamed answer sends with the shipped settings (first window 2 frames, ramp, chunk 25, left
context 25, holdback 10): "T=12" (a first window) ... "T=60" (a full window), all B of one length,
and "ramp": B windows spread over the six lengths, as one step with answers at different points
gives. The stage decodes them at its shape buckets (`models/codec_stage.py`: 16-frame multiples,
bucketed batches), as it does when serving. Per case: ms per step, windows per second, and new audio
seconds decoded per wall second. With --graphs, each case also runs on the stage's decode graphs
(`models/codec_graphs.py`, recorded for the shipped YAML's shapes first): `graphs_ms_per_step` and
the largest difference of any audio sample from the eager decode (`graphs_max_abs_diff`). With
--fused, the same on graphs recorded with the Snake activations as one kernel each
(`codec/fused_snake.py`), as the stage decodes by default on CUDA (`fused_ms_per_step`,
`fused_max_abs_diff`); `audio_max_abs`: the eager decode's largest sample, the scale of those
differences.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))
from streaming_latency import device_name, write_checkpoint  # noqa: E402

FRAME_RATE = 50
HOLDBACK = 10
RAMP = [(0, 2), (2, 2), (4, 4), (8, 8), (16, 16), (25, 25)]  # (left context, new frames) per window


def windows(lengths: list[tuple[int, int]], batch: int, num_quantizers: int, codebook: int, device) -> tuple[list, list]:
    """B windows cycling through `lengths`: flattened codes and their meta."""
    picks = [lengths[i % len(lengths)] for i in range(batch)]
    codes = [torch.randint(0, codebook, ((left + new + HOLDBACK) * num_quantizers,), device=device) for left, new in picks]
    infos = [{"meta": {"left_context_size": left, "right_holdback_size": HOLDBACK}} for left, _ in picks]
    return codes, infos


def time_step(decoder, codes: list, infos: list, repeats: int, sync) -> tuple[float, float]:
    """(the first call's seconds: shapes this process has not decoded yet, the median after warm-up)."""
    sync()
    start = time.perf_counter()
    decoder.decode_windows(codes, infos)
    sync()
    first = time.perf_counter() - start
    for _ in range(2):
        decoder.decode_windows(codes, infos)
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        decoder.decode_windows(codes, infos)
        sync()
        times.append(time.perf_counter() - start)
    return first, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tiny", action="store_true", help="the tiny codec on CPU")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--graphs", action="store_true", help="also on the decode graphs (CUDA), against eager")
    ap.add_argument("--fused", action="store_true", help="also on graphs with the one-kernel Snakes, against eager")
    args = ap.parse_args()
    if (args.graphs or args.fused) and not torch.cuda.is_available():
        ap.error("--graphs and --fused need CUDA")
    from vllm_omni_speechlm.models.codec_stage import SpeechLMCodecDecoder

    device = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    model_dir = write_checkpoint(tempfile.mkdtemp(prefix="codec-decode-"), args.tiny)
    decoder = SpeechLMCodecDecoder.from_model_dir(model_dir, device)
    q, codebook = decoder.num_quantizers, decoder.codec.config.codebook_size
    variants = {}  # name -> a decoder on graphs, recorded for the shipped YAML's shapes
    for name in [n for n in ("graphs", "fused") if getattr(args, n)]:
        variants[name] = SpeechLMCodecDecoder.from_model_dir(model_dir, device, graphs=True, fused=name == "fused")
        with torch.inference_mode():  # 256 windows of <= 60 frames, 32768 codes a step
            variants[name].warm_up(max(args.batch), 60, 32768)
    cases = {f"T={left + new + HOLDBACK}": [(left, new)] for left, new in RAMP} | {"ramp": RAMP}
    report = {"benchmark": "codec_decode", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device_name(),
              "settings": vars(args), "results": {}}
    with torch.inference_mode():
        for name, lengths in cases.items():
            for batch in args.batch:
                codes, infos = windows(lengths, batch, q, codebook, device)
                first, seconds = time_step(decoder, codes, infos, args.repeats, sync)
                new_audio = sum(new for _, new in (lengths[i % len(lengths)] for i in range(batch))) / FRAME_RATE
                report["results"][f"{name} B={batch}"] = {
                    "ms_per_step": seconds * 1e3, "first_call_ms": first * 1e3, "windows_per_s": batch / seconds, "audio_s_per_wall_s": new_audio / seconds}
                if variants:  # the eager samples the variants are compared with
                    want = decoder.decode_windows(codes, infos)
                    report["results"][f"{name} B={batch}"]["audio_max_abs"] = max(float(a.abs().max()) for a in want)
                for variant, other in variants.items():
                    _, other_s = time_step(other, codes, infos, args.repeats, sync)
                    diff = max(float((a - b).abs().max()) for a, b in zip(want, other.decode_windows(codes, infos)) if a.numel())
                    report["results"][f"{name} B={batch}"] |= {f"{variant}_ms_per_step": other_s * 1e3,
                                                               f"{variant}_max_abs_diff": diff}
                print(f"{name} B={batch}", json.dumps(report["results"][f"{name} B={batch}"]), flush=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
