"""`vllm.general_plugins` entry point: runs in the API server, every EngineCore and worker."""

import importlib
import os
import sys

# A module whose `register()` runs here too, in every process: the test suite and the benchmarks
# name their self-test pipelines (devtools/selftest_pipelines.py) with it.
EXTRA_PLUGIN_ENV = "SPEECHLM_EXTRA_PLUGIN"
# vllm-omni's engine, loaded where stages are started (`vllm serve --omni`, `Omni(...)`).
ENGINE_MODULE = "vllm_omni.engine.omni_engine_base"
# Set to 1 to start `vllm serve`'s stage processes by fork instead of vllm-omni's spawn where no
# CUDA is initialized (off by default: docs/architecture.md, "Start-up and deploy checks").
FORK_STAGES_ENV = "SPEECHLM_FORK_STAGES"


def register() -> None:
    """Register the project's architectures (vLLM's and vllm-omni's registries: stages load
    models through the latter), pipelines and window connector; in the API server also the
    OpenAI routes (vllm_omni_speechlm/serving). Idempotent: it runs more than once per process."""
    from vllm_omni_speechlm import compat, serving
    from vllm_omni_speechlm.deploy_checks import check_deploy_devices

    compat.check_versions()
    register_speech_lms()

    serving.register()
    if ENGINE_MODULE in sys.modules:  # the process that starts the stages (API server, offline driver)
        compat.pass_parallel_stage_init_from_deploy(check_deploy_devices)
    # `vllm serve` only: the API server has imported all a stage needs and run no torch kernels (an
    # offline driver may have, and OpenMP does not survive a fork)
    if serving.API_SERVER_MODULE in sys.modules and os.environ.get(FORK_STAGES_ENV) == "1":
        compat.fork_stage_processes()
    extra = os.environ.get(EXTRA_PLUGIN_ENV)
    if extra:
        importlib.import_module(extra).register()


def register_speech_lms() -> None:
    from vllm import ModelRegistry
    from vllm_omni.config.pipeline_registry import OMNI_PIPELINES, register_pipeline
    from vllm_omni.model_executor.models.registry import OmniModelRegistry

    from vllm_omni_speechlm import connector
    from vllm_omni_speechlm.models import ARCHITECTURES
    from vllm_omni_speechlm.pipeline import PIPELINES

    for registry in (ModelRegistry, OmniModelRegistry):
        for arch, target in ARCHITECTURES.items():
            if arch not in registry.get_supported_archs():
                registry.register_model(arch, target)
    for pipeline in PIPELINES:
        if pipeline.model_type not in OMNI_PIPELINES:
            register_pipeline(pipeline)
    connector.register()
    from vllm_omni_speechlm.deploy_checks import register_startup_checks
    from vllm_omni_speechlm.models import CODEC_ARCHITECTURES

    register_startup_checks([a for a in ARCHITECTURES if a not in CODEC_ARCHITECTURES], list(CODEC_ARCHITECTURES))
