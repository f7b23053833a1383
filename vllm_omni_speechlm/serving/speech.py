"""`/v1/audio/speech` for the speech LMs: a vllm-omni TTS adapter.

vllm-omni's speech server owns the endpoint: its request schema (`input`, `response_format`,
`stream`, `stream_format`, `seed`, `max_new_tokens`, `initial_codec_chunk_frames`,
`instructions`, `extra_params`), non-streaming encoding (wav, pcm, flac, mp3, opus), raw-audio
and SSE streaming, and aborting the request in every stage when the client goes away. This adapter
turns one request into the engine request:

- prompt: `input` as the user turn, `instructions` (or DEFAULT_SYSTEM) as the system turn
- the model's options (`options.MODEL_OPTIONS`) and `modality` ("audio", the default, or
  "text+audio": the model writes a text answer first and speaks it), at the top level (vLLM's
  place for sampling extensions) or in `extra_params`. vllm-omni's schema drops unknown top-level
  fields, so this module's route (`create_speech`) reads them from the raw body and moves them
  into `extra_params`; any other unknown field is an error.
- `initial_codec_chunk_frames`: this request's first streaming window (faster first audio)
- `sample_rate`: any of OUTPUT_SAMPLE_RATES. The codec stage resamples (`resample.py`) and reports
  the rate, so vllm-omni, whose stream and whole-answer resamplers differ, resamples neither.

Every field this model does not support (voices, reference audio, speed, ...) is rejected with a
message naming it (vllm-omni answers HTTP 400), never silently ignored.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any, ClassVar

from pydantic import AliasChoices
from vllm_omni.entrypoints.openai.tts_adapters import TTS_ADAPTER_REGISTRY, register_tts_adapter
from vllm_omni.entrypoints.openai.tts_adapters.base import ARTTSAdapter, PreparedRequest

from vllm_omni_speechlm import window_trace
from vllm_omni_speechlm.compat import dispatch_route
from vllm_omni_speechlm.engine_request import engine_prompt, stage0_sampling_params
from vllm_omni_speechlm.pipeline import CODEC_STAGE, SPEECH_LM_STAGE
from vllm_omni_speechlm.resample import check_output_rate
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
from vllm_omni_speechlm.serving import options
from vllm_omni_speechlm.serving.admission import admitted
from vllm_omni_speechlm.serving.model_info import is_speechlm, served_model
from vllm_omni_speechlm.streaming import initial_chunk_frames
from vllm_omni_speechlm.tokenizer import encode_prompt

ROUTE = "/v1/audio/speech"
# The released model often stops before any audio without a system turn (model facts).
DEFAULT_SYSTEM = "You are a helpful assistant. Answer in speech."
SPEECH_MODALITIES = ("audio", "text+audio")
# Top-level fields besides vllm-omni's schema: the model's options.
TOP_LEVEL_OPTIONS = (*options.MODEL_OPTIONS, "modality")
# Output rates (the codec's 16 kHz resampled by the codec stage): telephony to studio.
OUTPUT_SAMPLE_RATES = frozenset({8000, 16000, 22050, 24000, 44100, 48000})
MAX_INSTRUCTIONS_CHARS = 10_000
# Request fields of vllm-omni's schema that other TTS models use and these models do not (their
# schema default is None): a value is an error, not silently ignored.
UNSUPPORTED_FIELDS = ("task_type", "language", "ref_audio", "ref_text", "ref_audio_2", "ambient_sound",
                      "duration_seconds", "x_vector_only_mode", "speaker_embedding", "non_streaming_mode")


def _check_unsupported(request: Any) -> None:
    for name in UNSUPPORTED_FIELDS:
        if getattr(request, name, None) is not None:
            raise ValueError(f"{name}: not supported by this model")
    if request.voice is not None:  # vllm-omni maps "default" to None before the adapter runs
        raise ValueError(f"voice: this model has one voice; omit voice or use 'default', got {request.voice!r}")
    if request.speed not in (None, 1.0):
        raise ValueError(f"speed: not supported by this model (only 1.0), got {request.speed}")


def speech_params(request: Any) -> SpeechSamplingParams:
    """The request's speech options (max_tokens is settled once the prompt length is known)."""
    extra = dict(request.extra_params or {})  # the schema makes it a JSON object
    modality = extra.pop("modality", "audio")
    if modality not in SPEECH_MODALITIES:
        raise ValueError(f"extra_params.modality: expected one of {list(SPEECH_MODALITIES)}, got {modality!r}")
    opts = options.model_options(extra, "extra_params")
    seed = request.seed
    if seed is not None and seed < 0:
        raise ValueError(f"seed: must be a non-negative integer, got {seed}")
    return options.sampling_params(modality, opts, seed=seed)


class SpeechLMSpeechAdapter(ARTTSAdapter):
    """Serves `/v1/audio/speech` from the speech LM stage of a two-stage (LM -> codec) pipeline."""

    name: ClassVar[str] = "speechlm"
    # The speech LM stage of every family (pipeline.speech_lm_stage); the adapter reads the
    # checkpoint's own layout, so it is not tied to one architecture.
    stage_keys: ClassVar[frozenset[str]] = frozenset({SPEECH_LM_STAGE})
    supported_output_sample_rates: ClassVar[frozenset[int]] = OUTPUT_SAMPLE_RATES

    @classmethod
    def stage_serves_speech(cls, model_stage: str | None, all_stage_keys: frozenset[str]) -> bool:
        # Audio comes from the codec stage; the LM-only deployment returns codes, not audio.
        return CODEC_STAGE in all_stage_keys

    def _load_supported_speakers(self) -> list[str]:
        return []

    def _load_codec_frame_rate(self) -> float | None:
        return float(served_model(self.ctx.engine_client).cfg.codec.frame_rate)

    def validate(self, request: Any) -> str | None:
        try:
            options.text_input(request.input, "input")
            if request.instructions is not None:
                if not isinstance(request.instructions, str) or len(request.instructions) > MAX_INSTRUCTIONS_CHARS:
                    raise ValueError(f"instructions: expected a string of at most {MAX_INSTRUCTIONS_CHARS} characters")
            _check_unsupported(request)
            initial_chunk_frames(request.initial_codec_chunk_frames, "initial_codec_chunk_frames")
            self._output_rate(request)
            speech_params(request)
        except ValueError as e:
            return str(e)
        return None

    def _output_rate(self, request: Any) -> int | None:
        """The rate the codec stage is to resample to (None: its own)."""
        codec = served_model(self.ctx.engine_client).cfg.codec
        if request.sample_rate is None or request.sample_rate == codec.sample_rate:
            return None
        check_output_rate(request.sample_rate, codec.frame_rate, request.response_format)
        return request.sample_rate

    def _params(self, request: Any, prompt_len: int) -> SpeechSamplingParams:
        """Resolved options, max_tokens within what the prompt leaves of the model's length."""
        model = served_model(self.ctx.engine_client)
        limit = options.max_tokens(request.max_new_tokens, model.token_budget(prompt_len), "max_new_tokens")
        return dataclasses.replace(speech_params(request), max_tokens=limit).resolve(model.cfg)

    async def build(self, request: Any, sampling_params_list: list, has_inline_ref_audio: bool) -> PreparedRequest:
        model = served_model(self.ctx.engine_client)
        system = request.instructions if request.instructions and request.instructions.strip() else DEFAULT_SYSTEM
        ids = encode_prompt(model.tokenizer, model.cfg, request.input, system=system)
        first = initial_chunk_frames(request.initial_codec_chunk_frames, "initial_codec_chunk_frames")
        prompt = engine_prompt(ids, self._params(request, len(ids)), first, sample_rate=self._output_rate(request),
                               client_codes=False)
        return PreparedRequest(prompt=prompt, model_type=self.name)

    def apply_sampling_overrides(
        self, sampling_params_list: list, request: Any, prompt: dict | None = None, request_id: str | None = None
    ) -> list:
        """Stage 0 samples the way the model's per-modality rules need (engine temperature, no
        engine top-k, the request's token limit: the options `build` put in the prompt); the
        codec stage keeps its deploy defaults."""
        params = SpeechSamplingParams.from_info((prompt or {}).get("additional_information"), seed=request.seed)
        out = list(sampling_params_list)
        cfg = served_model(self.ctx.engine_client).cfg
        out[0] = stage0_sampling_params(cfg, params, output_kind=out[0].output_kind)
        return out


@functools.lru_cache(maxsize=4)
def _schema_keys(request_cls: Any) -> frozenset[str]:
    """The top-level names a request schema reads: its fields and their aliases."""
    keys = set()
    for name, field in request_cls.model_fields.items():
        alias = field.validation_alias
        keys |= {name, field.alias} | (set(alias.choices) if isinstance(alias, AliasChoices) else {alias})
    return frozenset(k for k in keys if isinstance(k, str))


def with_top_level_options(request: Any, body: Any) -> Any:
    """The request with the model options of its raw JSON `body`'s top level moved into
    `extra_params`; any other field the schema does not know is an error naming it."""
    if not isinstance(body, dict):
        return request
    top = {k: v for k, v in body.items() if k not in _schema_keys(type(request))}
    unknown = sorted(set(top) - set(TOP_LEVEL_OPTIONS))
    if unknown:
        raise ValueError(f"{unknown[0]}: unknown field (the model's options: {', '.join(TOP_LEVEL_OPTIONS)})")
    if not top:
        return request
    return request.model_copy(update={"extra_params": options.placed_options(top, request.extra_params)})


async def create_speech(request: Any, raw_request: Any, stock: Any) -> Any:
    """vllm-omni's speech route, for these models: the top-level options first (module docstring)."""
    window_trace.watch_event_loop()
    since = time.time()
    try:
        request = with_top_level_options(request, await raw_request.json())
    except ValueError as e:
        return options.bad_request(str(e))
    return window_trace.first_bytes_logged(await admitted(raw_request, lambda: stock(request, raw_request)), since)


def register() -> None:
    """Register the adapter and the route once per process (the plugin entry point runs more than
    once; vllm-omni's registry raises on a duplicate name)."""
    if SpeechLMSpeechAdapter.name not in TTS_ADAPTER_REGISTRY:
        register_tts_adapter(SpeechLMSpeechAdapter)
    dispatch_route(ROUTE, is_speechlm, create_speech)
