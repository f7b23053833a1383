"""Gradio demo: speak or type, choose the answer (audio, text + audio, text), hear the audio while
it is generated and read the text beside it.

Talks to a running server (`vllm serve MODEL --omni --deploy-config stage_configs/...yaml`) over
its OpenAI API. Typed text answered in audio goes to `/v1/audio/speech` with
`stream_format="audio"` (raw PCM16 chunks); a question with audio (microphone or file), or an answer
with text, goes to `/v1/chat/completions` with `stream=true` (text deltas, base64 PCM16 audio
deltas). Guidance and temperatures start as the checkpoint's own defaults (sent as nothing: the
server fills them in); unchecking "the checkpoint's decoding" sends the sliders' values.

    python examples/gradio_demo.py --server http://localhost:8000 --port 7860
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import gradio as gr
import httpx
import numpy as np

SAMPLE_RATE = 16000
MODES = {"audio": ["audio"], "text + audio": ["text", "audio"], "text": ["text"]}
AUDIO_FORMATS = {".wav": "wav", ".mp3": "mp3", ".flac": "flac", ".ogg": "ogg"}


def decoding(checkpoint_defaults: bool, cfg_scale, audio_temperature, text_temperature, seed) -> dict:
    """The decoding fields to send (none of the three with the checkpoint's defaults)."""
    body = {} if checkpoint_defaults else {
        "cfg_scale": float(cfg_scale), "audio_temperature": float(audio_temperature),
        "text_temperature": float(text_temperature)}
    if seed is not None and seed >= 0:
        body["seed"] = int(seed)
    return body


def user_content(text: str, audio_path: str | None) -> list[dict]:
    parts = []
    if audio_path:
        fmt = AUDIO_FORMATS.get(Path(audio_path).suffix.lower())
        if fmt is None:
            raise gr.Error(f"audio: expected one of {', '.join(AUDIO_FORMATS)}, got {Path(audio_path).name}")
        parts.append({"type": "input_audio",
                      "input_audio": {"data": base64.b64encode(Path(audio_path).read_bytes()).decode(), "format": fmt}})
    if text.strip():
        parts.append({"type": "text", "text": text})
    if not parts:
        raise gr.Error("type a text or record / upload audio")
    return parts


def _speech_stream(http: httpx.Client, text: str, body: dict, first_window: int):
    """(text delta, PCM16 bytes) pieces of a streamed `/v1/audio/speech` answer."""
    request = {"input": text, "response_format": "pcm", "stream_format": "audio",
               "initial_codec_chunk_frames": first_window} | body
    with http.stream("POST", "/v1/audio/speech", json=request) as resp:
        _check(resp)
        for data in resp.iter_bytes():
            yield "", data


def _chat_stream(http: httpx.Client, parts: list[dict], mode: str, body: dict):
    """(text delta, PCM16 bytes) pieces of a streamed chat answer."""
    request = {"messages": [{"role": "user", "content": parts}], "modalities": MODES[mode], "stream": True} | body
    with http.stream("POST", "/v1/chat/completions", json=request) as resp:
        _check(resp)
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            delta = json.loads(line[6:])["choices"][0]["delta"]
            audio = base64.b64decode(delta["audio"]["data"]) if "audio" in delta else b""
            yield delta.get("content") or "", audio


def _check(resp: httpx.Response) -> None:
    if resp.status_code != 200:
        raise gr.Error(f"{resp.status_code}: {resp.read().decode(errors='replace')[:500]}")


def answer(http: httpx.Client, text: str, audio_path: str | None, mode: str, checkpoint_defaults: bool, cfg_scale,
           audio_temperature, text_temperature, seed, max_tokens: float, first_window: float):
    """Yields (audio chunk, text answer so far, status) as the server streams."""
    body = decoding(checkpoint_defaults, cfg_scale, audio_temperature, text_temperature, seed)
    if mode == "audio" and not audio_path:
        pieces = _speech_stream(http, text, body | {"max_new_tokens": int(max_tokens)}, int(first_window))
    else:
        pieces = _chat_stream(http, user_content(text, audio_path), mode, body | {"max_tokens": int(max_tokens)})
    start, first, samples, pending, said = time.perf_counter(), None, 0, b"", ""
    for delta, data in pieces:
        said += delta
        pending += data
        usable = len(pending) // 2 * 2
        chunk, pending = np.frombuffer(pending[:usable], dtype=np.int16), pending[usable:]
        if chunk.size and first is None:
            first = time.perf_counter() - start
        samples += chunk.size
        ttfa = "" if first is None else f"time to first audio: {first * 1000:.0f} ms · "
        yield ((SAMPLE_RATE, chunk) if chunk.size else None), said, f"{ttfa}streaming…"
    total = time.perf_counter() - start
    ttfa = "no audio" if first is None else f"time to first audio: {first * 1000:.0f} ms"
    yield None, said, f"{ttfa} · {samples / SAMPLE_RATE:.2f} s of audio in {total:.2f} s"


def build(server: str) -> gr.Blocks:
    http = httpx.Client(base_url=server.rstrip("/"), timeout=600)
    with gr.Blocks(title="Speech LM streaming demo") as demo:
        gr.Markdown("## Speech LM: ask by voice or text\nThe audio answer starts playing while it is generated.")
        with gr.Row():
            text = gr.Textbox(label="Text", value="Hello! Please say something nice about the weather today.",
                              elem_id="text")
            user_audio = gr.Audio(label="Your audio (optional)", sources=["upload", "microphone"], type="filepath",
                                  elem_id="user_audio")
        mode = gr.Radio(list(MODES), value="audio", label="Answer", elem_id="mode")
        with gr.Accordion("Decoding", open=False, elem_id="decoding"):
            defaults = gr.Checkbox(True, label="the checkpoint's decoding (uncheck to send the three below)",
                                   elem_id="checkpoint_defaults")
            with gr.Row():
                cfg = gr.Slider(1.0, 20.0, value=3.0, step=0.5, label="cfg scale", elem_id="cfg")
                audio_t = gr.Slider(0.0, 2.0, value=0.8, step=0.05, label="audio temperature", elem_id="audio_temperature")
                text_t = gr.Slider(0.0, 2.0, value=0.6, step=0.05, label="text temperature", elem_id="text_temperature")
            with gr.Row():
                seed = gr.Number(value=-1, precision=0, label="seed (-1: random)", elem_id="seed")
                max_tokens = gr.Slider(16, 4096, value=400, step=1, label="max tokens", elem_id="max_tokens")
                first_window = gr.Slider(1, 25, value=5, step=1, label="first window (frames, typed text → audio)",
                                         elem_id="first_window")
        button = gr.Button("Answer", variant="primary", elem_id="speak")
        with gr.Row():
            said = gr.Textbox(label="Text answer", interactive=False, elem_id="answer_text")
            audio = gr.Audio(label="Audio answer", streaming=True, autoplay=True, elem_id="audio")
        status = gr.Markdown("", elem_id="status")
        button.click(
            lambda *a: (yield from answer(http, *a)),
            inputs=[text, user_audio, mode, defaults, cfg, audio_t, text_t, seed, max_tokens, first_window],
            outputs=[audio, said, status],
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
