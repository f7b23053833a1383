"""The OpenAI-compatible API of the speech LMs, on vLLM-Omni's server (`vllm serve --omni`).

- `speech.py`: `/v1/audio/speech` through vllm-omni's TTS adapter registry (its request schema,
  streaming, SSE and disconnect handling; this package only turns a request into an engine request).
- `chat.py`: `/v1/chat/completions` for these models: text and audio in (`input_audio`, `audio_url`),
  text, audio (base64 WAV) or both out.
- `transcription.py`: `/v1/audio/transcriptions` (ASR) for the models that hear audio.
- `audio_in.py`: a request's audio files decoded (vLLM's decoder), checked field by field.
- `options.py`, `model_info.py`: request options and the served checkpoint, shared by both.
- `admission.py`: the bound on held requests (`max_pending_requests`, 429 beyond it).
- `unserved.py`: vllm-omni's other generation routes answer 404 for these models.

`register()` runs from the plugin entry point; it only acts in the API server process.
"""

from __future__ import annotations

import sys

API_SERVER_MODULE = "vllm_omni.entrypoints.openai.api_server"


def register() -> None:
    """Register the speech adapter and the chat route. Only where vllm-omni's API server module is
    loaded (the `vllm serve --omni` process imports it before the plugins run); engine and worker
    processes never serve HTTP, so they skip the imports."""
    if API_SERVER_MODULE not in sys.modules:
        return
    from vllm_omni_speechlm.serving import chat, speech, transcription, unserved

    speech.register()
    chat.register_route()
    transcription.register_route()
    unserved.register_routes()
