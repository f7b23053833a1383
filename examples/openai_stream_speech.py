"""Stream speech from the server with the OpenAI Python SDK; write a WAV, report time to first audio.

    python examples/openai_stream_speech.py --server http://localhost:8000 "Hello there!" --out hello.wav
    python examples/openai_stream_speech.py --sse ...        # server-sent events instead of raw bytes

Raw streaming (`stream_format="audio"`, the default here) returns 16 kHz PCM16 bytes as they are
decoded; SSE (`stream_format="sse"`) returns `speech.audio.delta` events with base64 PCM16 and a
final `speech.audio.done`. The model's own options go in `extra_params`.
"""

from __future__ import annotations

import argparse
import base64
import json
import time
import wave

import openai

SAMPLE_RATE = 16000


def stream_pcm(client: openai.OpenAI, text: str, sse: bool, **extra) -> tuple[bytes, float | None]:
    """(PCM16 audio, seconds to the first audio bytes)."""
    start, first, pcm = time.perf_counter(), None, bytearray()
    with client.audio.speech.with_streaming_response.create(
        model=client.models.list().data[0].id, voice="default", input=text, response_format="pcm",
        stream_format="sse" if sse else "audio", extra_body=extra,
    ) as resp:
        if sse:
            for line in resp.iter_lines():
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event["type"] == "speech.audio.error":
                    raise RuntimeError(event["error"]["message"])
                if event["type"] == "speech.audio.delta":
                    first = first if first is not None else time.perf_counter() - start
                    pcm += base64.b64decode(event["audio"])
        else:
            for chunk in resp.iter_bytes():
                first = first if first is not None else time.perf_counter() - start
                pcm += chunk
    return bytes(pcm), first


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("text")
    parser.add_argument("--server", default="http://localhost:8000")
    parser.add_argument("--out", default="speech.wav")
    parser.add_argument("--sse", action="store_true", help="server-sent events instead of raw audio bytes")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--first-window", type=int, default=5, help="first streamed window, codec frames (20 ms)")
    parser.add_argument("--cfg-scale", type=float, default=1.0)
    parser.add_argument("--audio-temperature", type=float)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.server.rstrip("/") + "/v1", api_key="unused", timeout=600)
    options = {"cfg_scale": args.cfg_scale}
    if args.audio_temperature is not None:
        options["audio_temperature"] = args.audio_temperature
    extra = {"max_new_tokens": args.max_tokens, "initial_codec_chunk_frames": args.first_window,
             "extra_params": options}
    if args.seed is not None:
        extra["seed"] = args.seed
    start = time.perf_counter()
    pcm, first = stream_pcm(client, args.text, args.sse, **extra)
    total = time.perf_counter() - start
    with wave.open(args.out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(SAMPLE_RATE)
        w.writeframes(pcm)
    seconds = len(pcm) / 2 / SAMPLE_RATE
    ttfa = "no audio" if first is None else f"{first * 1000:.0f} ms"
    print(f"wrote {args.out}: {seconds:.2f} s of audio; time to first audio {ttfa}; total {total:.2f} s")


if __name__ == "__main__":
    main()
