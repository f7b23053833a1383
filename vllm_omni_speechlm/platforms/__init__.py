"""Out-of-tree vllm-omni platforms (entry-point group ``vllm_omni.platform_plugins``).

vllm-omni 0.30 ships OmniPlatforms for CUDA/ROCm/NPU/XPU/MUSA only; on a CPU build of vLLM
it falls back to ``UnspecifiedOmniPlatform``, which cannot pick a worker. The plugin below
fills that gap. This module stays import-light: vllm-omni imports it in every process while
it resolves its platform, before it knows which one it needs.
"""

from __future__ import annotations

CPU_OMNI_PLATFORM = "vllm_omni_speechlm.platforms.cpu.CpuOmniPlatform"


def cpu_platform_plugin() -> str | None:
    """Return the CPU OmniPlatform qualname when vLLM itself resolved to its CPU platform.

    The rule defers to vLLM's own detection (``vllm.platforms.current_platform``) instead of
    probing hardware again: vllm-omni ranks an out-of-tree platform plugin above its builtin
    CUDA/ROCm ones, so activating on anything but vLLM's CPU platform would hijack a GPU host.
    """
    from vllm.platforms import current_platform

    return CPU_OMNI_PLATFORM if current_platform.is_cpu() else None
