"""`vllm.general_plugins` entry point: runs in the API server, every EngineCore and worker."""


def register() -> None:
    """Register the project's architectures and pipelines (filled in by the stage issues)."""
    # Platform self-test pipelines (tests/test_cpu_platform*.py); selected only by name.
    from vllm_omni_speechlm.platforms import selftest

    selftest.register()
