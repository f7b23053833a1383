"""vllm-omni on vLLM's CPU backend: the OmniPlatform (workers: ``cpu_worker.py``).

How the pieces fit:

* ``CpuOmniPlatform`` is vLLM's ``CpuPlatform`` (attention backend, config fix-ups, gloo,
  memory queries) with vllm-omni's ``OmniPlatform`` interface on top. OmniPlatform declares
  device hooks that raise ``NotImplementedError``; they are given CPU answers here.
* The model runners put vLLM's ``CPUModelRunner`` *directly before vLLM's GPUModelRunner* in
  the MRO, below vllm-omni's runners. Every method the two sides both override
  (``__init__``, ``load_model``, ``_to_list``) calls ``super()`` in vllm-omni, so the omni stage
  logic runs first and ends in vLLM's CPU implementation instead of the CUDA one.
* The workers are vLLM's ``CPUWorker`` (thread binding, gloo init, CPU KV-cache sizing) with
  vllm-omni's plugin/connector mixin and the runners above.

Only Model Runner V1 is supported: vllm-omni's V2 runners are CUDA-only.
"""

from __future__ import annotations

from typing import Any

import psutil
import torch
from vllm.platforms.cpu import CpuPlatform
from vllm_omni.platforms.interface import OmniPlatform, OmniPlatformEnum

# Workers live in their own module: vllm-omni resolves its platform while ``import vllm_omni``
# is still running, so this module must not import vllm-omni's worker stack.
_WORKERS = "vllm_omni_speechlm.platforms.cpu_worker"


class CpuOmniPlatform(OmniPlatform, CpuPlatform):
    """vLLM's CpuPlatform with the OmniPlatform hooks vllm-omni calls."""

    # OOT: vllm-omni has no CPU member; ``is_cpu()`` still comes from vLLM's ``_enum``.
    _omni_enum = OmniPlatformEnum.OOT

    @classmethod
    def get_omni_ar_worker_cls(cls) -> str:
        return f"{_WORKERS}.CPUARWorker"

    @classmethod
    def get_omni_generation_worker_cls(cls) -> str:
        return f"{_WORKERS}.CPUGenerationWorker"

    @classmethod
    def get_default_stage_config_path(cls) -> str:
        return "vllm_omni/deploy"

    @classmethod
    def get_diffusion_attn_backend_cls(
        cls, selected_backend: str | None, head_size: int, allow_trtllm_default: bool = False
    ) -> str:
        from vllm_omni.diffusion.attention.backends.registry import DiffusionAttentionBackendEnum

        if selected_backend is not None:
            cls.validate_diffusion_attn_backend(selected_backend)
            return DiffusionAttentionBackendEnum[selected_backend.upper()].get_path()
        return DiffusionAttentionBackendEnum.TORCH_SDPA.get_path()

    @classmethod
    def supports_diffusion_dense_flash_attention(cls) -> bool:
        return False

    @classmethod
    def supports_torch_inductor(cls) -> bool:
        # Only diffusion runners ask; keep them eager (no compiler warm-up on small hosts).
        return False

    @classmethod
    def supports_talker_mtp_graph_capture(cls) -> bool:
        return False

    # The host is the one "device": stage placement and device locks count ordinals.
    @classmethod
    def get_torch_device(cls, local_rank: int | None = None) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def get_device_count(cls) -> int:
        return 1

    @classmethod
    def get_device_version(cls) -> str | None:
        return None

    # Work on the CPU is synchronous and there is no caching allocator to flush.
    @classmethod
    def synchronize(cls) -> None:
        return None

    @classmethod
    def empty_cache(cls) -> None:
        return None

    @classmethod
    def reset_peak_memory_stats(cls, device: Any = None) -> None:
        return None

    @classmethod
    def max_memory_allocated(cls, device: Any = None) -> int:
        return 0

    @classmethod
    def get_free_memory(cls, device: torch.device | None = None) -> int:
        return int(psutil.virtual_memory().available)

    @classmethod
    def get_device_memory(cls, device: torch.device | None = None) -> tuple[int, int]:
        mem = psutil.virtual_memory()
        return int(mem.available), int(mem.total)
