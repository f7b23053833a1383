"""The README's quick start (`make demo`): a tiny checkpoint, served on CPU, one request streamed.

Makes a tiny random Bagpiper-layout checkpoint (no download), starts
`vllm serve CKPT --omni --deploy-config stage_configs/bagpiper_streaming_cpu_tiny.yaml` on a free
local port, streams one `/v1/audio/speech` request through the OpenAI SDK into a WAV file, prints
the time to first audio, and stops the server. The tiny model's speech is noise; the point is the
path: prompt -> speech LM -> streamed codec windows -> audio bytes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import wave
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / "examples"), str(ROOT)]  # the client example; devtools

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM's CPU default is refused on small VMs
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", default=str(ROOT / "build" / "quickstart"))
    parser.add_argument("--out", default="quickstart.wav")
    parser.add_argument("--text", default="Hello! Please say something nice about the weather today.")
    parser.add_argument("--max-tokens", type=int, default=300)
    args = parser.parse_args()

    import openai
    from openai_stream_speech import SAMPLE_RATE, stream_pcm

    from devtools.launch import SpeechLMServer
    from vllm_omni_speechlm import stage_configs
    from vllm_omni_speechlm.make_tiny import make_tiny

    work = Path(args.workdir)
    ckpt = work / "tiny-bagpiper"
    if not (ckpt / "config.json").is_file():
        print(f"making a tiny checkpoint in {ckpt}")
        make_tiny("bagpiper", ckpt, seed=0)
    deploy = stage_configs.path("bagpiper_streaming_cpu_tiny.yaml")
    print(f"starting vllm serve {ckpt} --omni --deploy-config {deploy} (log: {work / 'server.log'}) ...")
    started = time.perf_counter()
    with SpeechLMServer(str(ckpt), deploy, work / "server.log") as server:
        server.wait_ready()
        print(f"server ready at {server.url} after {time.perf_counter() - started:.0f} s")
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=600)
        stream_pcm(client, "warm-up", sse=False, max_new_tokens=16)  # first request pays one-time setup
        t0 = time.perf_counter()
        pcm, first = stream_pcm(client, args.text, sse=False, seed=0, max_new_tokens=args.max_tokens,
                                initial_codec_chunk_frames=5)
        total = time.perf_counter() - t0
    with wave.open(args.out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm)
    if first is None:
        print("no audio came back", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {len(pcm) / 2 / SAMPLE_RATE:.2f} s of 16 kHz audio in {total:.2f} s; "
          f"time to first audio {first * 1000:.0f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
