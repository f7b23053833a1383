"""Serve delay-pattern speech language models on stock vLLM + vLLM-Omni."""

import logging

from vllm_omni_speechlm.config import SpeechLMConfig

# This package's loggers write through vLLM's handler and level (as vllm_omni's do); on their own
# they would have no handler, and INFO lines such as the scheduler variant would be dropped.
logging.getLogger(__name__).parent = logging.getLogger("vllm")

__all__ = ["SpeechLMConfig"]
