"""The CPU OmniPlatform plugin follows vLLM's own platform detection.

Each case runs in a fresh interpreter: vLLM and vllm-omni resolve their platforms once per
process, and the GPU case rewires vLLM's detection inputs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

CPU_OMNI = "vllm_omni_speechlm.platforms.cpu.CpuOmniPlatform"
CUDA_OMNI = "vllm_omni.platforms.cuda.platform.CudaOmniPlatform"


def _run(code: str, **env: str) -> dict[str, str]:
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **env},
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)


def test_cpu_build_activates_cpu_omni_platform():
    out = _run(
        """
        from vllm.platforms import current_platform
        from vllm_omni.platforms import current_omni_platform
        print("vllm_is_cpu=" + str(current_platform.is_cpu()))
        cls = type(current_omni_platform)
        print("omni=" + cls.__module__ + "." + cls.__qualname__)
        print("ar=" + current_omni_platform.get_omni_ar_worker_cls())
        print("gen=" + current_omni_platform.get_omni_generation_worker_cls())
        """
    )
    assert out["vllm_is_cpu"] == "True"
    assert out["omni"] == CPU_OMNI
    assert out["ar"] == "vllm_omni_speechlm.platforms.cpu_worker.CPUARWorker"
    assert out["gen"] == "vllm_omni_speechlm.platforms.cpu_worker.CPUGenerationWorker"


def test_gpu_host_keeps_plugin_inactive():
    """vLLM detects CUDA (NVML sees one GPU, CUDA build): vllm-omni must pick its CUDA platform.

    An out-of-tree plugin outranks vllm-omni's builtin ones, so a plugin that activated here would
    silently replace CudaOmniPlatform on every GPU host.
    """
    out = _run(
        """
        import sys, types
        import vllm_omni.platforms as omni_platforms  # import the stack on the real CPU platform
        import vllm.platforms as vllm_platforms
        import vllm.utils.import_utils as import_utils

        # Inputs of vLLM's detection as on a GPU host with the CUDA wheel: NVML reports a GPU,
        # the installed vLLM is not a CPU build, and the wheel's kernel module exists.
        nvml = types.SimpleNamespace(
            nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlDeviceGetCount=lambda: 1
        )
        import_utils.import_pynvml = lambda: nvml
        vllm_platforms.vllm_version_matches_substr = lambda substr: False
        sys.modules["vllm._C_stable_libtorch"] = types.ModuleType("vllm._C_stable_libtorch")
        vllm_platforms._current_platform = None  # forget the detection done at `import vllm`

        from vllm.platforms import current_platform
        print("vllm=" + vllm_platforms.resolve_current_platform_cls_qualname())
        print("vllm_is_cuda=" + str(current_platform.is_cuda()))
        print("omni=" + omni_platforms.resolve_current_omni_platform_cls_qualname())
        """,
        VLLM_TARGET_DEVICE="cuda",
    )
    assert out["vllm"] == "vllm.platforms.cuda.CudaPlatform"
    assert out["vllm_is_cuda"] == "True"
    assert out["omni"] == CUDA_OMNI
