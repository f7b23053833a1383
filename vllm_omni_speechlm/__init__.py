"""Serve delay-pattern speech language models on stock vLLM + vLLM-Omni."""

import logging
from typing import Any

from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

# This package's loggers write through vLLM's handler and level (as vllm_omni's do); on their own
# they would have no handler, and INFO lines such as the scheduler variant would be dropped.
logging.getLogger(__name__).parent = logging.getLogger("vllm")

__all__ = ["SpeechLMConfig", "SpeechLMGenerator", "SpeechSamplingParams"]


def __getattr__(name: str) -> Any:
    # The generator imports vllm-omni's engine: loaded on first use, not in every stage process.
    if name == "SpeechLMGenerator":
        from vllm_omni_speechlm.generator import SpeechLMGenerator

        return SpeechLMGenerator
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
