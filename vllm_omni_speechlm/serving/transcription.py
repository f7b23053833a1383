"""`/v1/audio/transcriptions` for speech LMs that hear audio (Bagpiper): OpenAI's form fields,
answered by the model's ASR prompt, ESPnet's `audio_to_text` task (the user's clip, then the
assistant's text), decoded as text only.

    file             the audio (any container vLLM's decoder reads; mono-mixed, resampled)
    model            optional
    prompt           optional: given to the model as the system message (style, vocabulary)
    response_format  json (default) or text
    stream           OpenAI's SSE events: `transcript.text.delta`, then `transcript.text.done`
    temperature, seed, max_completion_tokens   the text's sampling (default: greedy)

The model detects the language itself: `language` is refused rather than ignored, as is any
other field. vLLM adds its own route for models with a transcription interface; this one
serves the speech LMs, and answers 404 for any other model.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Annotated, Any

from fastapi import Form, Request
from vllm.entrypoints.speech_to_text.transcription.protocol import TranscriptionRequest

from vllm_omni_speechlm.engine_request import engine_prompt, stage0_sampling_params
from vllm_omni_speechlm.serving import options
from vllm_omni_speechlm.serving.admission import admitted
from vllm_omni_speechlm.serving.chat import BadRequest, TextStream, audio_clip, engine_outputs, is_audio_output
from vllm_omni_speechlm.serving.model_info import ServedModel, is_speechlm, served_model
from vllm_omni_speechlm.tokenizer import encode_prompt

ROUTE = "/v1/audio/transcriptions"
FORMATS = ("json", "text")
ACCEPTED_FIELDS = {"file", "model", "prompt", "response_format", "stream", "temperature", "seed", "max_completion_tokens"}


def _check_fields(request: Any, sent: set[str]) -> None:
    """`sent`: the form's field names (the parsed request has every field, set or not)."""
    if request.language:
        raise BadRequest("language: this model detects the language itself; omit the field")
    unsupported = sorted(sent - ACCEPTED_FIELDS - {"language"})
    if unsupported:
        raise BadRequest(f"{', '.join(unsupported)}: not supported by this model's transcriptions")
    if request.response_format not in FORMATS:
        raise BadRequest(f"response_format: expected json or text, got {request.response_format!r}")


def build_request(request: Any, sent: set[str], data: bytes, model: ServedModel) -> tuple[dict, Any, float]:
    """(engine prompt, stage-0 SamplingParams, audio seconds) of a transcription request."""
    _check_fields(request, sent)
    clip = audio_clip(data, "file", model)
    system = options.text_input(request.prompt, "prompt") if request.prompt else None
    ids = encode_prompt(model.tokenizer, model.cfg, None, system=system, text_only=True, audio=1)
    text_options = {"text_temperature": request.temperature}
    params = options.sampling_params("text", text_options, seed=request.seed)
    limit = options.max_tokens(request.max_completion_tokens, model.token_budget(len(ids)), "max_completion_tokens")
    params = dataclasses.replace(params, max_tokens=limit).resolve(model.cfg)
    prompt = engine_prompt(ids, params, audio=[clip], client_codes=False)
    return prompt, stage0_sampling_params(model.cfg, params), clip[0].size / clip[1]


async def _deltas(engine_client: Any, text: TextStream, prompt: dict, stage0: Any, request_id: str, stream: bool):
    """The transcript's new parts as they come if `stream`, else all of it once at the end."""
    async for out in engine_outputs(engine_client, prompt, stage0, "text", request_id, stream_text=stream):
        if out.outputs and not is_audio_output(out) and (delta := text.add(out.outputs[0].token_ids)):
            yield delta
    if rest := text.rest():
        yield rest


async def _transcript(engine_client: Any, model: ServedModel, prompt: dict, stage0: Any, request_id: str) -> str:
    text = TextStream(model)
    async for _ in _deltas(engine_client, text, prompt, stage0, request_id, stream=False):
        pass
    return text.text


async def _events(engine_client: Any, model: ServedModel, prompt: dict, stage0: Any, request_id: str, seconds: float):
    """OpenAI's transcription stream: a `transcript.text.delta` event per new piece of text, then
    `transcript.text.done` with the whole text, then [DONE]."""
    text = TextStream(model)
    async for delta in _deltas(engine_client, text, prompt, stage0, request_id, stream=True):
        yield f"data: {json.dumps({'type': 'transcript.text.delta', 'delta': delta})}\n\n"
    done = {"type": "transcript.text.done", "text": text.text, "usage": _usage(seconds)}
    yield f"data: {json.dumps(done)}\n\ndata: [DONE]\n\n"


def _usage(seconds: float) -> dict:
    return {"type": "duration", "seconds": max(1, round(seconds))}


async def create_transcription(raw_request: Request, request: Annotated[TranscriptionRequest, Form()]) -> Any:
    from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from vllm.entrypoints.speech_to_text.base.utils import read_upload_with_limit

    engine_client = raw_request.app.state.engine_client
    if not is_speechlm(engine_client):
        return JSONResponse({"error": {"message": "The model does not support Transcriptions API", "code": 404}}, 404)
    model = served_model(engine_client)
    try:
        sent = set((await raw_request.form()).keys())  # parsed already: starlette keeps it
        prompt, stage0, seconds = build_request(request, sent, await read_upload_with_limit(request.file), model)
    except ValueError as e:
        return options.bad_request(str(e))
    request_id = f"trsc-{uuid.uuid4().hex}"

    async def answer() -> Any:
        if request.stream:
            return StreamingResponse(_events(engine_client, model, prompt, stage0, request_id, seconds), media_type="text/event-stream")
        text = await _transcript(engine_client, model, prompt, stage0, request_id)
        if request.response_format == "text":
            return PlainTextResponse(text)
        return JSONResponse({"text": text, "usage": _usage(seconds)})

    return await admitted(raw_request, answer)


def register_route() -> None:
    from vllm_omni_speechlm.compat import add_post_route

    add_post_route(ROUTE, create_transcription)
