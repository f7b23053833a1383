"""Per-request speech sampling options: one typed object, validated where a request enters (API
routes, generator, reference) and carried to the engine in its wire form (`to_info` /
`from_info`: plain scalars in the prompt's additional information)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.decoding import OutputMode, RowValues

MAX_TEMPERATURE = 100.0
MAX_CFG_SCALE = 20.0  # beyond this guidance only amplifies noise
SPEECH_PARAMS_KEY = "speech_params"  # prompt["additional_information"][SPEECH_PARAMS_KEY]: the options


def _number(name: str, value, lo: float, hi: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name}: expected a number, got {type(value).__name__}")
    if not math.isfinite(value) or not lo <= value <= hi:
        raise ValueError(f"{name}: must be in [{lo}, {hi}], got {value!r}")
    return float(value)


def _integer(name: str, value, lo: int, hi: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {type(value).__name__}")
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{name}: must be in [{lo}, {hi if hi is not None else 'inf'}], got {value}")
    return value


UNBOUNDED = 1 << 40  # a segment length no request reaches (max_tokens bounds the answer)
SEGMENT_LIMITS = ("min_text_tokens", "max_text_tokens", "min_audio_frames", "max_audio_frames")


@dataclass(frozen=True)
class SpeechSamplingParams:
    """Options of one request. `None` fields take the checkpoint's defaults in `resolve`."""

    modality: OutputMode = OutputMode.AUTO
    text_temperature: float | None = None
    text_top_k: int | None = None
    audio_temperature: float | None = None
    audio_top_k: int | None = None
    cfg_scale: float | None = None  # guidance of audio segments; 1 = none
    max_tokens: int = 1024  # stream-0 tokens, forced ones and the final eos included
    # Rows of each text / audio segment: eos and eot are masked before the minimum; a segment
    # ends by itself at the maximum (None: the checkpoint's; a maximum of 0 there: no bound).
    min_text_tokens: int | None = None
    max_text_tokens: int | None = None
    min_audio_frames: int | None = None
    max_audio_frames: int | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "modality", OutputMode.parse(self.modality))
        for name in ("text_temperature", "audio_temperature"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, _number(name, getattr(self, name), 0.0, MAX_TEMPERATURE))
        for name in ("text_top_k", "audio_top_k"):
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), -1)
        if self.cfg_scale is not None:
            object.__setattr__(self, "cfg_scale", _number("cfg_scale", self.cfg_scale, 1.0, MAX_CFG_SCALE))
        _integer("max_tokens", self.max_tokens, 1)
        for name in SEGMENT_LIMITS:
            if getattr(self, name) is not None:
                _integer(name, getattr(self, name), 1 if name.startswith("max") else 0)
        if self.seed is not None:
            _integer("seed", self.seed, 0, 2**63 - 1)

    def resolve(self, cfg: SpeechLMConfig) -> SpeechSamplingParams:
        """Fill unset fields from the checkpoint's per-modality defaults."""
        t, a = cfg.text_sampling, cfg.audio_sampling

        def pick(value, default):
            return default if value is None else value

        p = dataclasses.replace(
            self,
            text_temperature=pick(self.text_temperature, t.temperature),
            text_top_k=pick(self.text_top_k, t.top_k),
            audio_temperature=pick(self.audio_temperature, a.temperature),
            audio_top_k=pick(self.audio_top_k, a.top_k),
            cfg_scale=pick(self.cfg_scale, a.cfg_scale if cfg.decoding.guidance else 1.0),
            min_text_tokens=pick(self.min_text_tokens, t.min_steps),
            max_text_tokens=pick(self.max_text_tokens, t.max_steps or None),
            min_audio_frames=pick(self.min_audio_frames, a.min_steps),
            max_audio_frames=pick(self.max_audio_frames, a.max_steps or None),
        )
        if p.use_cfg and not cfg.decoding.guidance:
            raise ValueError(f"cfg_scale: the {cfg.family} family has no classifier-free guidance (use 1.0)")
        return p

    @property
    def use_cfg(self) -> bool:
        return self.cfg_scale is not None and self.cfg_scale != 1.0

    @property
    def engine_temperature(self) -> float:
        """The one temperature vLLM applies to stream 0 (0: greedy)."""
        return self.audio_temperature if self.audio_temperature > 0 else self.text_temperature

    def row_values(self) -> RowValues:
        """The resolved options as `RowSampling` takes them. A greedy modality becomes top-1; a
        sampled one is rescaled to the engine temperature."""
        te = self.engine_temperature

        def k_and_scale(temp: float, top_k: int) -> tuple[int, float]:
            return (1, 1.0) if temp == 0 else (top_k, te / temp)

        tk, ts = k_and_scale(self.text_temperature, self.text_top_k)
        ak, as_ = k_and_scale(self.audio_temperature, self.audio_top_k)
        limits = [UNBOUNDED if v is None else v for v in (getattr(self, n) for n in SEGMENT_LIMITS)]
        return RowValues(tk, ak, ts, as_, self.audio_temperature or 1.0, *limits)

    def to_info(self) -> dict[str, Any]:
        """The wire form, for the stage-0 prompt's additional information: the options as plain
        scalars (msgpack). The seed is not among them: the model reads it from the engine's
        generator for the request (vLLM seeds it with SamplingParams.seed)."""
        options = {name: getattr(self, name) for name in MODEL_OPTIONS + ("max_tokens",)}
        return {SPEECH_PARAMS_KEY: options | {"modality": int(self.modality)}}

    @classmethod
    def from_info(cls, info: Mapping[str, Any] | None, seed: int | None = None) -> SpeechSamplingParams:
        """The options of a prompt's additional information (`to_info`), validated again."""
        return cls(**dict((info or {}).get(SPEECH_PARAMS_KEY) or {}), seed=seed)


# Options a request may set besides its route's own fields (modality, token limit and seed have
# route-specific names).
MODEL_OPTIONS = tuple(
    f.name for f in dataclasses.fields(SpeechSamplingParams) if f.name not in ("modality", "max_tokens", "seed")
)
