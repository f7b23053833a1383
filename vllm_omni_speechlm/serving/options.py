"""The models' own request options (both routes): validated into `SpeechSamplingParams`.

Every error is a ValueError whose message starts with the offending field, which the routes turn
into HTTP 400.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from vllm_omni_speechlm.sampling_params import MODEL_OPTIONS, SpeechSamplingParams

# Longest input text accepted before tokenizing (the token limit is checked after).
MAX_INPUT_CHARS = 100_000
# When a request sets no max tokens: at most this many, within the model's length limit.
DEFAULT_MAX_TOKENS = 2048


def model_options(options: Mapping[str, Any] | None, where: str) -> dict[str, Any]:
    """The known options of `options` (a JSON object); an unknown name is an error."""
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ValueError(f"{where}: expected a JSON object, got {type(options).__name__}")
    unknown = sorted(set(options) - set(MODEL_OPTIONS))
    if unknown:
        raise ValueError(f"{where}.{unknown[0]}: unknown option (known: {', '.join(MODEL_OPTIONS)})")
    return {k: v for k, v in options.items() if v is not None}


def placed_options(top: Mapping[str, Any], nested: Any) -> dict[str, Any]:
    """Options given at a request's top level (vLLM's place for sampling extensions) and in its
    `extra_params`, as one dict; an option set in both places is an error naming it."""
    if nested is None:
        return dict(top)
    if not isinstance(nested, Mapping):
        raise ValueError(f"extra_params: expected a JSON object, got {type(nested).__name__}")
    both = sorted(set(top) & set(nested))
    if both:
        raise ValueError(f"{both[0]}: set at the top level and in extra_params; set it in one place")
    return {**nested, **top}


def bad_request(message: str) -> Any:
    """An OpenAI-style HTTP 400 whose `param` is the field the message starts with."""
    from fastapi.responses import JSONResponse

    param = message.split(":", 1)[0] if ":" in message else None
    body = {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}
    return JSONResponse(content=body, status_code=400)


def text_input(value: Any, field: str) -> str:
    if not isinstance(value, str):
        raise ValueError(f"{field}: expected a string, got {type(value).__name__}")
    if not value.strip():
        raise ValueError(f"{field}: must not be empty")
    if len(value) > MAX_INPUT_CHARS:
        raise ValueError(f"{field}: {len(value)} characters, more than the limit of {MAX_INPUT_CHARS}")
    return value


def max_tokens(requested: int | None, budget: int, field: str) -> int:
    """Stream-0 tokens for a request whose prompt leaves `budget` tokens of the model's length."""
    if budget < 2:
        raise ValueError(f"input: the prompt leaves {budget} tokens of the model's length limit")
    if requested is None:
        return min(DEFAULT_MAX_TOKENS, budget)
    if isinstance(requested, bool) or not isinstance(requested, int) or requested < 1:
        raise ValueError(f"{field}: expected a positive integer, got {requested!r}")
    if requested > budget:
        raise ValueError(f"{field}: {requested} is more than this prompt leaves of the model's length ({budget})")
    return requested


def sampling_params(modality: str, options: dict[str, Any], **fields: Any) -> SpeechSamplingParams:
    """SpeechSamplingParams from validated pieces; its own checks name the field."""
    try:
        return SpeechSamplingParams(modality=modality, **options, **fields)
    except TypeError as e:  # a wrong keyword never reaches here (model_options filters names)
        raise ValueError(str(e)) from e
