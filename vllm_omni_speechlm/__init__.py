"""Serve delay-pattern speech language models on stock vLLM + vLLM-Omni."""

from vllm_omni_speechlm.config import SpeechLMConfig

__all__ = ["SpeechLMConfig"]
