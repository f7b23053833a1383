"""vllm-omni AR / generation workers and model runners on vLLM's CPU backend.

See ``cpu.py`` for the platform and the overall design.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.v1.worker.cpu_model_runner import CPUModelRunner
from vllm.v1.worker.cpu_worker import CPUWorker
from vllm_omni.worker.gpu_ar_model_runner import GPUARModelRunner
from vllm_omni.worker.gpu_generation_model_runner import GPUGenerationModelRunner
from vllm_omni.worker.mixins import OmniWorkerMixin

from vllm_omni_speechlm.compat import building_cpu_runner, compile_cpu_random_sample, torch_cuda_wrapper
from vllm_omni_speechlm.stage0.runner import SpeechLMRunnerMixin


class _CPURunnerMixin:
    """Shared tail of the CPU runners.

    ``CPUModelRunner.__init__`` fakes ``torch.Event`` / ``torch.cuda.Stream`` only around
    ``GPUModelRunner.__init__``; vllm-omni's ``__init__`` bodies run after it returns (they
    create connectors and extra buffers), so the same fake is held around the whole chain.
    Buffers created there are re-aliased afterwards so ``.gpu`` is ``.cpu`` (no host copies).
    """

    def __init__(self, vllm_config: Any, device: torch.device) -> None:
        with torch_cuda_wrapper():
            super().__init__(vllm_config, device)  # type: ignore[call-arg]
        self._postprocess_tensors()  # type: ignore[attr-defined]


class CPUARModelRunner(_CPURunnerMixin, GPUARModelRunner, CPUModelRunner):
    """vllm-omni AR runner (hidden states, multimodal outputs, connectors) on vLLM's CPU runner."""


class CPUGenerationModelRunner(_CPURunnerMixin, GPUGenerationModelRunner, CPUModelRunner):
    """vllm-omni generation runner (no sampling; tensors out) on vLLM's CPU runner."""


class _CPUOmniWorker(OmniWorkerMixin, CPUWorker):
    model_runner_cls: type[CPUModelRunner]

    def init_device(self) -> None:
        if getattr(self.model_config, "use_v2_model_runner", False) or self.use_v2_model_runner:
            raise NotImplementedError(
                "vllm-omni's Model Runner V2 is CUDA-only; on CPU set `model_runner: v1` "
                "(deploy YAML, e.g. under `platforms: cpu:`) and leave VLLM_USE_V2_MODEL_RUNNER unset."
            )
        with building_cpu_runner(self.model_runner_cls):
            super().init_device()


class CPUARWorker(_CPUOmniWorker):
    """Worker for ``StageExecutionType.LLM_AR`` stages on CPU."""

    model_runner_cls = CPUARModelRunner

    def compile_or_warm_up_model(self) -> Any:
        compile_cpu_random_sample(self.model_config.get_vocab_size())  # before vLLM resets the seed
        return super().compile_or_warm_up_model()


class CPUGenerationWorker(_CPUOmniWorker):
    """Worker for ``StageExecutionType.LLM_GENERATION`` stages on CPU."""

    model_runner_cls = CPUGenerationModelRunner


class CPUSpeechLMARModelRunner(SpeechLMRunnerMixin, CPUARModelRunner):
    """The speech LM stage's runner (`vllm_omni_speechlm/runner.py`) on CPU."""


class CPUSpeechLMARWorker(CPUARWorker):
    """Worker for the speech LM stage on CPU (deploy YAMLs select it under `platforms: cpu:`)."""

    model_runner_cls = CPUSpeechLMARModelRunner
