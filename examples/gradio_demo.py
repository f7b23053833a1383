"""Gradio demo: type text, hear the answer while it is generated, see the time to first audio.

Talks to a running server (`vllm serve MODEL --omni --deploy-config stage_configs/...yaml`) over
its OpenAI API: `/v1/audio/speech` with `stream_format="audio"` (raw 16 kHz PCM16 chunks), the
chunks fed to a streaming, autoplaying audio player as they arrive.

    python examples/gradio_demo.py --server http://localhost:8000 --port 7860
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import gradio as gr
import numpy as np
import openai

SAMPLE_RATE = 16000


def speak(client: openai.OpenAI, text: str, cfg_scale: float, audio_temperature: float, text_temperature: float,
          seed: float | None, max_tokens: float, first_window: float):
    """Yields (audio chunk, status) as the server streams; the chunk is only the new audio."""
    body = {
        "max_new_tokens": int(max_tokens),
        "initial_codec_chunk_frames": int(first_window),
        "extra_params": {"cfg_scale": float(cfg_scale), "audio_temperature": float(audio_temperature),
                         "text_temperature": float(text_temperature)},
    }
    if seed is not None and seed >= 0:
        body["seed"] = int(seed)
    start, first, samples, pending = time.perf_counter(), None, 0, b""
    try:
        with client.audio.speech.with_streaming_response.create(
            model=client.models.list().data[0].id, voice="default", input=text, response_format="pcm",
            stream_format="audio", extra_body=body,
        ) as resp:
            for data in resp.iter_bytes():
                pending += data
                usable = len(pending) // 2 * 2
                chunk, pending = np.frombuffer(pending[:usable], dtype=np.int16), pending[usable:]
                if chunk.size == 0:
                    continue
                if first is None:
                    first = time.perf_counter() - start
                samples += chunk.size
                yield (SAMPLE_RATE, chunk), f"time to first audio: {first * 1000:.0f} ms · streaming…"
    except openai.APIStatusError as e:
        raise gr.Error(f"{e.status_code}: {e.response.text}") from e
    total = time.perf_counter() - start
    ttfa = "no audio" if first is None else f"time to first audio: {first * 1000:.0f} ms"
    yield None, f"{ttfa} · {samples / SAMPLE_RATE:.2f} s of audio in {total:.2f} s"


def build(server: str) -> gr.Blocks:
    client = openai.OpenAI(base_url=server.rstrip("/") + "/v1", api_key="unused", timeout=600)
    with gr.Blocks(title="Speech LM streaming demo") as demo:
        gr.Markdown("## Speech LM: streamed speech\nThe answer starts playing while it is generated.")
        text = gr.Textbox(label="Text", value="Hello! Please say something nice about the weather today.",
                          elem_id="text")
        with gr.Row():
            cfg = gr.Slider(1.0, 20.0, value=1.0, step=0.5, label="cfg scale", elem_id="cfg")
            audio_t = gr.Slider(0.0, 2.0, value=0.8, step=0.05, label="audio temperature", elem_id="audio_temperature")
            text_t = gr.Slider(0.0, 2.0, value=0.6, step=0.05, label="text temperature", elem_id="text_temperature")
        with gr.Row():
            seed = gr.Number(value=-1, precision=0, label="seed (-1: random)", elem_id="seed")
            max_tokens = gr.Slider(16, 4096, value=400, step=1, label="max tokens", elem_id="max_tokens")
            first_window = gr.Slider(1, 25, value=5, step=1, label="first window (frames)", elem_id="first_window")
        button = gr.Button("Speak", variant="primary", elem_id="speak")
        audio = gr.Audio(label="Answer", streaming=True, autoplay=True, elem_id="audio")
        status = gr.Markdown("", elem_id="status")
        button.click(
            lambda *a: (yield from speak(client, *a)),
            inputs=[text, cfg, audio_t, text_t, seed, max_tokens, first_window],
            outputs=[audio, status],
        )
    return demo


def ensure_ffmpeg() -> None:
    """Gradio encodes streamed audio with an `ffmpeg` process. Without one on PATH, use the binary
    that the imageio-ffmpeg wheel ships (already in the pinned stack)."""
    if shutil.which("ffmpeg"):
        return
    import imageio_ffmpeg

    bin_dir = tempfile.mkdtemp(prefix="speechlm-ffmpeg-")
    os.symlink(imageio_ffmpeg.get_ffmpeg_exe(), os.path.join(bin_dir, "ffmpeg"))
    os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--server", default="http://localhost:8000", help="the vllm-omni server's base URL")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=7860)
    args = parser.parse_args()
    ensure_ffmpeg()
    build(args.server).queue().launch(server_name=args.host, server_port=args.port, share=False)


if __name__ == "__main__":
    main()
