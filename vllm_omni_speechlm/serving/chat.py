"""`/v1/chat/completions` for the speech LMs: text, audio, or both from one request.

vllm-omni's chat handler renders prompts through the tokenizer's chat template and sends the
engine OpenAI sampling fields; these models need their own prompt encoding (user text never
turns into special tokens), per-modality sampling and an output modality. So for a speech-LM
checkpoint this route builds the engine request itself (`engine_request.py`, the same as the
speech route) and sends it through the same engine client; for any other model it calls
vllm-omni's handler unchanged.

    modalities   ["text"] (default): a text answer; ["text", "audio"]: a text answer and its
                 audio (message.audio.data: base64 16 kHz WAV, transcript = the text);
                 ["audio"]: audio only
    messages     an optional system message, then one user message: a string, or content parts
                 (text; audio as `input_audio` {data: base64, format} or an `audio_url` data URL,
                 heard before the message's text, the order the model was trained on)
    temperature, top_k      the text part's sampling (or text_temperature / text_top_k)
    max_tokens / max_completion_tokens, seed, and the model options (options.MODEL_OPTIONS)

    stream, stream_options.include_usage
                 server-sent `chat.completion.chunk` events as the answer is generated: text as
                 delta.content, audio as delta.audio.data (base64 PCM16 at the codec's rate, only
                 the new samples; audio.format "pcm16"), then the finish reason, then [DONE]

A client that goes away cancels the handler (or closes the stream), and vllm-omni's engine client
then aborts the request in every stage.
"""

import base64
import dataclasses
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any

import torch

from vllm_omni_speechlm.audio import to_pcm16, to_wav
from vllm_omni_speechlm.compat import dispatch_route
from vllm_omni_speechlm.decoding import OutputMode
from vllm_omni_speechlm.engine_request import engine_prompt, stage0_sampling_params
from vllm_omni_speechlm.pipeline import CODEC_STAGE
from vllm_omni_speechlm.serving import options
from vllm_omni_speechlm.serving.admission import admitted
from vllm_omni_speechlm.serving.audio_in import decode_audio, part_audio_bytes
from vllm_omni_speechlm.serving.model_info import ServedModel, is_speechlm, served_model, stage_names
from vllm_omni_speechlm.streaming import TO_CODEC_KEY
from vllm_omni_speechlm.tokenizer import decode_text, encode_prompt, has_text

ROUTE = "/v1/chat/completions"

MODALITIES = {("text",): "text", ("audio", "text"): "text+audio", ("audio",): "audio"}
# Request fields this route reads; any other field a client sets is an error.
ACCEPTED_FIELDS = {"messages", "model", "modalities", "audio", "temperature", "top_k", "max_tokens",
                   "max_completion_tokens", "seed", "stream", "stream_options", "n", "user", "extra_params", *options.MODEL_OPTIONS}


class BadRequest(ValueError):
    pass


AUDIO_PARTS = ("input_audio", "audio_url")


def _message_content(message: Any, index: int, model: ServedModel) -> tuple[str, list[tuple]]:
    """A message's text and its audio clips ((waveform, rate) pairs, in order)."""
    content = message.get("content") if isinstance(message, dict) else None
    field = f"messages[{index}].content"
    if not isinstance(content, list):
        return options.text_input(content, field), []
    texts, clips = [], []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind == "text" and isinstance(part.get("text"), str):
            texts.append(part["text"])
        elif kind in AUDIO_PARTS:
            clips.append(audio_clip(*part_audio_bytes(part, f"{field}[{j}]"), model))
        else:
            raise BadRequest(f"{field}[{j}]: expected a text, input_audio or audio_url part, got {kind!r}")
    text = "".join(texts)
    return (options.text_input(text, field) if text or not clips else ""), clips


def audio_clip(data: bytes, field: str, model: ServedModel) -> tuple:
    """An encoded file at `field` -> (waveform, rate), within the lengths the model hears."""
    spec = model.cfg.audio_input
    if spec is None:
        raise BadRequest(f"{field}: this model takes no audio input")
    # One sample of margin on the shortest: vLLM's resampler may round the length down.
    shortest, longest = (spec.min_samples + 1) / spec.sample_rate, spec.max_samples / spec.sample_rate
    return decode_audio(data, field, longest, shortest)


def _system_and_user(messages: Any, model: ServedModel) -> tuple[str | None, str, list[tuple]]:
    """One optional system message (text), then one user message (text and audio); no
    multi-turn history yet."""
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list")
    roles = [m.get("role") if isinstance(m, dict) else None for m in messages]
    if roles not in (["user"], ["system", "user"]):
        raise BadRequest(f"messages: expected [system,] user; got roles {roles} (multi-turn history is not supported)")
    system = None
    if len(messages) == 2:
        system, clips = _message_content(messages[0], 0, model)
        if clips:
            raise BadRequest("messages[0].content: a system message carries text only")
    user, clips = _message_content(messages[-1], len(messages) - 1, model)
    return system, user, clips


def _modality(request: Any) -> str:
    requested = getattr(request, "modalities", None)
    if requested is None:
        return "text"
    if not isinstance(requested, list) or not all(isinstance(m, str) for m in requested):
        raise BadRequest("modalities: expected a list of strings")
    mode = MODALITIES.get(tuple(sorted(set(requested))))
    if mode is None:
        raise BadRequest(f"modalities: expected ['text'], ['text', 'audio'] or ['audio'], got {requested}")
    return mode


def _check_audio_param(request: Any) -> None:
    """`audio`: {format, voice}; the format is wav for a whole answer, pcm16 for a stream (OpenAI's)."""
    audio = getattr(request, "audio", None)
    if audio is None:
        return
    if not isinstance(audio, dict):
        raise BadRequest("audio: expected an object")
    unknown = sorted(set(audio) - {"format", "voice"})
    if unknown:
        raise BadRequest(f"audio.{unknown[0]}: unknown field")
    wanted = "pcm16" if request.stream else "wav"
    if audio.get("format", wanted) != wanted:
        raise BadRequest(f"audio.format: {'a stream' if request.stream else 'a whole answer'} comes as {wanted!r}, "
                         f"got {audio.get('format')!r}")
    if audio.get("voice") not in (None, "default"):
        raise BadRequest(f"audio.voice: this model has one voice; omit it or use 'default', got {audio.get('voice')!r}")


def _check_fields(request: Any) -> None:
    unsupported = sorted((set(request.model_fields_set) | set(request.model_extra or {})) - ACCEPTED_FIELDS)
    if unsupported:
        raise BadRequest(f"{', '.join(unsupported)}: not supported by this model's chat completions")
    if request.n not in (None, 1):
        raise BadRequest(f"n: only 1 is supported, got {request.n}")


def _model_options(request: Any) -> dict[str, Any]:
    extra = request.model_extra or {}
    top = {k: v for k, v in extra.items() if k in options.MODEL_OPTIONS}
    opts = options.model_options(options.placed_options(top, extra.get("extra_params")), "extra_params")
    for openai_name, name in (("temperature", "text_temperature"), ("top_k", "text_top_k")):
        value = getattr(request, openai_name, None)
        if value is None:
            continue
        if name in opts:
            raise BadRequest(f"{openai_name}: conflicts with {name}; set one of them")
        opts[name] = value
    return opts


def build_request(request: Any, model: ServedModel, messages: Any) -> tuple[dict, Any, str]:
    """(engine prompt, stage-0 SamplingParams, modality) of a chat request; BadRequest on bad input.
    `messages`: as the client sent them (the schema's typed parts turn a bad audio part into an
    error about the whole content)."""
    _check_fields(request)
    _check_audio_param(request)
    modality = _modality(request)
    system, user, clips = _system_and_user(messages, model)
    if request.seed is not None and request.seed < 0:
        raise BadRequest(f"seed: must be a non-negative integer, got {request.seed}")
    params = options.sampling_params(modality, _model_options(request), seed=request.seed)
    ids = encode_prompt(model.tokenizer, model.cfg, user, system=system, text_only=params.modality == OutputMode.TEXT,
                        audio=len(clips))
    requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
    field = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
    limit = options.max_tokens(requested, model.token_budget(len(ids)), field)
    params = dataclasses.replace(params, max_tokens=limit).resolve(model.cfg)
    prompt = engine_prompt(ids, params, audio=clips, client_codes=False)
    return prompt, stage0_sampling_params(model.cfg, params), modality


def _audio_chunks(output: Any) -> list[torch.Tensor]:
    """The new audio of a codec-stage output (a tensor, or a list of per-window tensors)."""
    mm = getattr(output, "multimodal_output", None) or {}
    audio = mm.get("model_outputs", mm.get("audio"))
    chunks = audio if isinstance(audio, list) else [audio]
    return [c.reshape(-1).float().cpu() for c in chunks if isinstance(c, torch.Tensor) and c.numel() > 0]


async def engine_outputs(engine_client: Any, prompt: dict, stage0: Any, modality: str, request_id: str,
                         stream_text: bool = False):
    """One request's outputs: stage 0's (its stream-0 tokens: every step's new ones if
    `stream_text`, else all of them once at the end) and, for audio, the codec stage's
    (final_output_type "audio", new audio each)."""
    from vllm_omni.entrypoints.utils import coerce_param_message_types

    from vllm.sampling_params import RequestOutputKind

    defaults = [sp.clone() for sp in engine_client.default_sampling_params_list]
    params = coerce_param_message_types([stage0, *defaults[1:]], is_streaming=False)
    if stream_text:
        params[0].output_kind = RequestOutputKind.DELTA
    if len(params) > 1:  # the codec stage streams windows; keep them all (each is new audio)
        params[1].output_kind = RequestOutputKind.DELTA
    modalities = ["text", "audio"]
    if modality == "text":  # the codec stage gets no request, so stage 0 must send it no window
        modalities = ["text"]
        prompt["additional_information"][TO_CODEC_KEY] = False
    async for out in engine_client.generate(prompt=prompt, request_id=request_id, sampling_params_list=params,
                                            output_modalities=modalities):
        yield out


def is_audio_output(out: Any) -> bool:
    return getattr(out, "final_output_type", None) == "audio"


async def _generate(engine_client: Any, prompt: dict, stage0: Any, modality: str, request_id: str) -> tuple:
    """Run one request; (stream-0 token ids, finish reason, audio waveform or None)."""
    tokens, finish, audio = [], None, []
    async for out in engine_outputs(engine_client, prompt, stage0, modality, request_id):
        if is_audio_output(out):
            audio.extend(_audio_chunks(out))
        elif out.outputs:
            tokens = list(out.outputs[0].token_ids)
            finish = out.outputs[0].finish_reason or finish
    wants_audio = modality != "text"
    waveform = torch.cat(audio) if audio else (torch.zeros(0) if wants_audio else None)
    return tokens, finish, waveform


async def _chunks(engine_client: Any, model: ServedModel, request: Any, prompt: dict, stage0: Any, modality: str,
                  request_id: str):
    """OpenAI's chat stream: one `chat.completion.chunk` per new piece of text or audio, then the
    finish reason (and usage, if asked), then [DONE]."""
    head = {"id": request_id, "object": "chat.completion.chunk", "created": int(time.time()),
            "model": request.model or model.model_dir}

    def event(delta: dict, finish: str | None = None, **extra: Any) -> str:
        choice = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        return f"data: {json.dumps(head | {'choices': [choice]} | extra)}\n\n"

    yield event({"role": "assistant", "content": ""})
    text, finish = TextStream(model), None
    async for out in engine_outputs(engine_client, prompt, stage0, modality, request_id, stream_text=modality != "audio"):
        if is_audio_output(out):
            for chunk in _audio_chunks(out):
                yield event({"audio": {"id": f"audio_{request_id}", "data": base64.b64encode(to_pcm16(chunk)).decode()}})
        elif out.outputs:
            finish = out.outputs[0].finish_reason or finish
            if delta := text.add(out.outputs[0].token_ids):
                yield event({"content": delta})
    if rest := text.rest():
        yield event({"content": rest})
    wants_usage = request.stream_options is not None and request.stream_options.include_usage
    usage = {"usage": _usage(len(prompt["prompt_token_ids"]), len(text.tokens))} if wants_usage else {}
    yield event({}, finish or "stop", **usage)
    yield "data: [DONE]\n\n"


class TextStream:
    """An answer's text as its stream-0 tokens arrive, and what a stream sends of it: each new
    part once its last character is whole (a token may cut one in two), the rest at the end."""

    def __init__(self, model: ServedModel) -> None:
        self.model, self.tokens, self.text, self.sent = model, [], "", ""

    def add(self, token_ids: Sequence[int]) -> str:
        """A step's tokens -> the new text to send now ("" while a character is cut)."""
        self.tokens += token_ids
        if has_text(token_ids, self.model.cfg):
            self.text = decode_text(self.model.tokenizer, self.tokens, self.model.cfg)
        if self.text.endswith("\ufffd") or self.text == self.sent:
            return ""
        delta, self.sent = self.text[len(self.sent):], self.text
        return delta

    def rest(self) -> str:
        """What is left to send at the end, a cut character included."""
        rest, self.sent = self.text[len(self.sent):], self.text
        return rest


def _response(request: Any, model: ServedModel, request_id: str, prompt_len: int, tokens: list[int],
              finish: str | None, waveform: torch.Tensor | None) -> dict:
    text = decode_text(model.tokenizer, tokens, model.cfg)
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if waveform is not None:
        wav = to_wav(waveform, model.cfg.codec.sample_rate)
        message["audio"] = {
            "id": f"audio_{request_id}",
            "data": base64.b64encode(wav).decode("ascii"),
            "expires_at": int(time.time()) + 3600,
            "transcript": text or "",
        }
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": request.model or model.model_dir,
        "choices": [{"index": 0, "message": message, "finish_reason": finish or "stop", "logprobs": None}],
        "usage": _usage(prompt_len, len(tokens)),
    }


def _usage(prompt_len: int, completion_len: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion_len, "total_tokens": prompt_len + completion_len}


async def create_speechlm_chat_completion(request: Any, raw_request: Any, stock: Any = None) -> Any:
    from fastapi.responses import JSONResponse, StreamingResponse

    engine_client = raw_request.app.state.engine_client
    model = served_model(engine_client)
    try:
        prompt, stage0, modality = build_request(request, model, (await raw_request.json()).get("messages"))
        if modality != "text" and CODEC_STAGE not in stage_names(engine_client):
            raise BadRequest("modalities: audio needs a deployment with the codec stage (e.g. bagpiper_streaming.yaml)")
    except ValueError as e:
        return options.bad_request(str(e))
    request_id = f"chatcmpl-{uuid.uuid4().hex}"

    async def answer() -> Any:
        if request.stream:
            events = _chunks(engine_client, model, request, prompt, stage0, modality, request_id)
            return StreamingResponse(events, media_type="text/event-stream")
        tokens, finish, waveform = await _generate(engine_client, prompt, stage0, modality, request_id)
        return JSONResponse(_response(request, model, request_id, len(prompt["prompt_token_ids"]), tokens, finish, waveform))

    return await admitted(raw_request, answer)


def register_route() -> None:
    """Speech-LM checkpoints get this module's handler, every other model vllm-omni's own."""
    dispatch_route(ROUTE, is_speechlm, create_speechlm_chat_completion)
