"""Smallest honest vllm-omni pipelines, used to prove a platform runs omni stages end to end.

Not a product pipeline (the speech LM pipelines live elsewhere). Both take any checkpoint that
vLLM can load as ``Qwen3ForCausalLM`` and are selected only by name, through a deploy YAML's
``pipeline:`` key, so they never capture a real model by ``model_type`` or architecture:

* ``speechlm_selftest_ar``: one AR stage (vLLM's Qwen3 causal LM, text out).
* ``speechlm_selftest_echo``: the AR stage streams its new token ids through the omni connector
  (async_chunk) to a generation stage, ``SpeechLMSelftestEcho``, which returns them as a tensor;
  the client sees stage 1's tensor equal to stage 0's tokens.

Registered in every process (workers too) by the project's plugin when ``SPEECHLM_EXTRA_PLUGIN``
names this module (`enable`: tests/conftest.py, benchmarks/stage0_throughput.py).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

SELFTEST_AR_PIPELINE_NAME = "speechlm_selftest_ar"
SELFTEST_ECHO_PIPELINE_NAME = "speechlm_selftest_echo"
AR_ARCH = "SpeechLMSelftestQwen3ForCausalLM"
ECHO_ARCH = "SpeechLMSelftestEcho"
ECHO_OUTPUT_KEY = "model_outputs"


def forward_new_tokens(
    transfer_manager: Any,
    multimodal_output: Any,
    request: Any,
    is_finished: bool = False,
    new_token_ids: Sequence[int] = (),
) -> Any:
    """async_chunk producer of stage 0: ship this step's sampled token ids as stage 1's prompt.

    The adapter sends the terminal marker itself when this returns None on the final call.
    """
    from vllm_omni.data_entry_keys import CodesStruct, OmniPayloadStruct

    if not new_token_ids:
        return None
    return OmniPayloadStruct(codes=CodesStruct(audio=torch.tensor(list(new_token_ids), dtype=torch.long)))


def _ar_model_cls() -> type:
    # Built lazily: importing vLLM's Qwen3 module at plugin load would slow every process.
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

    class SpeechLMSelftestQwen3ForCausalLM(Qwen3ForCausalLM):
        """vLLM's Qwen3 with the one change an omni AR stage needs: ``forward`` takes the extra
        keyword arguments (sampling_metadata, per-request buffers, ...) the omni runner passes."""

        def forward(self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None, **_: Any):
            return super().forward(input_ids, positions, intermediate_tensors, inputs_embeds)

    SpeechLMSelftestQwen3ForCausalLM.__qualname__ = AR_ARCH  # importable as module:AR_ARCH
    SpeechLMSelftestQwen3ForCausalLM.__module__ = __name__
    return SpeechLMSelftestQwen3ForCausalLM


def __getattr__(name: str) -> Any:
    if name == AR_ARCH:
        cls = _ar_model_cls()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


class SpeechLMSelftestEcho(nn.Module):
    """Generation-stage model without weights: echoes each request's input ids as float32."""

    have_multimodal_outputs = True
    has_preprocess = False
    has_postprocess = False
    requires_raw_input_tokens = True

    def __init__(self, *, vllm_config: Any = None, prefix: str = "") -> None:
        super().__init__()

    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        # The runner asks for embeddings; this stage only looks at the ids.
        return torch.zeros((input_ids.shape[0], 1), device=input_ids.device, dtype=torch.float32)

    def compute_logits(self, hidden_states: Any, sampling_metadata: Any = None) -> None:
        return None

    def forward(self, input_ids: torch.Tensor | None = None, **kwargs: Any) -> Any:
        from vllm_omni.model_executor.models.output_templates import OmniOutput

        ids = input_ids.reshape(-1) if input_ids is not None else torch.zeros(0, dtype=torch.long)
        counts = kwargs.get("seq_token_counts") or [int(ids.numel())]
        per_request = [chunk.to(torch.float32).clone() for chunk in torch.split(ids, list(counts))]
        return OmniOutput(text_hidden_states=None, multimodal_outputs={ECHO_OUTPUT_KEY: per_request})

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _ in weights:  # the checkpoint is stage 0's; drain it
            pass
        return set()


def _pipelines() -> list[Any]:
    from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

    ar_stage = dict(
        stage_id=0,
        model_stage="ar",
        execution_type=StageExecutionType.LLM_AR,
        owns_tokenizer=True,
        model_arch=AR_ARCH,
    )
    return [
        PipelineConfig(
            model_type=SELFTEST_AR_PIPELINE_NAME,
            model_arch=AR_ARCH,
            stages=(StagePipelineConfig(**ar_stage, final_output=True, final_output_type="text"),),
        ),
        PipelineConfig(
            model_type=SELFTEST_ECHO_PIPELINE_NAME,
            model_arch=AR_ARCH,
            stages=(
                StagePipelineConfig(
                    **ar_stage,
                    engine_output_type="latent",
                    async_chunk_process_next_stage_input_func=f"{__name__}.forward_new_tokens",
                ),
                StagePipelineConfig(
                    stage_id=1,
                    model_stage="echo",
                    execution_type=StageExecutionType.LLM_GENERATION,
                    input_sources=(0,),
                    final_output=True,
                    final_output_type="latent",
                    engine_output_type="latent",
                    model_arch=ECHO_ARCH,
                ),
            ),
        ),
    ]


def enable() -> None:
    """Have the project's plugin register these pipelines in every process started from here on
    (their PYTHONPATH gets the repository root, which holds `devtools`, after the installed
    package's place)."""
    from vllm_omni_speechlm.plugin import EXTRA_PLUGIN_ENV

    root = str(Path(__file__).resolve().parents[1])
    os.environ[EXTRA_PLUGIN_ENV] = __name__
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), root) if p)


def register() -> None:
    """Register the self-test pipelines and the echo model (idempotent; every process)."""
    from vllm import ModelRegistry
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    for registry in (ModelRegistry, OmniModelRegistry):
        for arch in (AR_ARCH, ECHO_ARCH):
            if arch not in registry.get_supported_archs():
                registry.register_model(arch, f"{__name__}:{arch}")
    for pipeline in _pipelines():
        if pipeline.model_type not in OMNI_PIPELINES:
            register_pipeline(pipeline)
