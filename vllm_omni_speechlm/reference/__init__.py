"""The project's oracle: plain-PyTorch sequential generation (no vLLM, no transformers)."""

from vllm_omni_speechlm.reference.model import ReferenceOutput, ReferenceSpeechLM, engine_sample

__all__ = ["ReferenceOutput", "ReferenceSpeechLM", "engine_sample"]
