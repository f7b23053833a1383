"""What the API server knows about the served checkpoint: layout, tokenizer, length limit."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from vllm_omni_speechlm.config import SPEECHLM_KEY, SpeechLMConfig


@dataclass(frozen=True)
class ServedModel:
    model_dir: str
    cfg: SpeechLMConfig
    tokenizer: Tokenizer
    max_model_len: int  # stage 0's: prompt + generated stream-0 tokens

    def token_budget(self, prompt_len: int) -> int:
        """Stream-0 tokens a request with this prompt may still generate."""
        return self.max_model_len - prompt_len


def _stage0_max_model_len(engine_client: Any) -> int:
    stages = list(getattr(engine_client, "stage_configs", None) or ())
    for holder in ([stages[0]] if stages else []) + [engine_client]:
        model_config = getattr(holder, "model_config", None)
        value = getattr(model_config, "max_model_len", None)
        if isinstance(value, int) and value > 0:
            return value
    raise RuntimeError("speechlm serving: cannot find stage 0's max_model_len on the engine client")


def _model_dir(engine_client: Any) -> str:
    model = getattr(getattr(engine_client, "model_config", None), "model", None) or getattr(engine_client, "model", None)
    if not model:
        raise RuntimeError("speechlm serving: the engine client names no model directory")
    return str(model)


@functools.lru_cache(maxsize=4)
def _load(model_dir: str, max_model_len: int) -> ServedModel:
    cfg = SpeechLMConfig.from_model_dir(model_dir)
    tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    return ServedModel(model_dir, cfg, tokenizer, max_model_len)


def served_model(engine_client: Any) -> ServedModel:
    """The checkpoint behind `engine_client` (loaded once per directory)."""
    return _load(_model_dir(engine_client), _stage0_max_model_len(engine_client))


def is_speechlm(engine_client: Any) -> bool:
    """Whether the engine serves one of this project's speech LMs (a `speechlm` config section)."""
    hf_config = getattr(getattr(engine_client, "model_config", None), "hf_config", None)
    return isinstance(getattr(hf_config, SPEECHLM_KEY, None), dict)


def stage_names(engine_client: Any) -> set[str]:
    """The deployed stages' `model_stage` names (pipeline.SPEECH_LM_STAGE, CODEC_STAGE)."""
    names = set()
    for stage in getattr(engine_client, "stage_configs", None) or ():
        topology = getattr(stage, "stage_pipeline_config", None)
        name = getattr(topology, "model_stage", None) or getattr(getattr(stage, "engine_args", None), "model_stage", None)
        if name:
            names.add(name)
    return names
