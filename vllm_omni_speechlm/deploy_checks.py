"""Deploy-config checks that run at engine start-up, before any worker or request exists.

vllm-omni calls the async_chunk processor only once requests flow, and swallows its exceptions
there; a wrong window setting would show up as silent or garbled audio. So the settings are
checked where every start path (`vllm serve --omni`, `Omni`, `AsyncOmni`) passes with the whole
stage configuration in hand: vLLM's per-architecture config hook (`MODELS_CONFIG_MAP`,
`VerifyAndUpdateConfig.verify_and_update_config`), which runs while each stage's `VllmConfig` is
built in the orchestrator. `vllm_omni_speechlm.plugin` registers `SpeechLMStageCheck` for the
project's architectures. A bad value raises ValueError naming the YAML key.

The window settings (streaming.py) are checked against the checkpoint's codec here. The codec
stage's max_model_len and max_num_batched_tokens must hold the largest window, (left + chunk +
holdback) x Q ids: a window split across steps or cut by the length limit would decode wrongly.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import dataclass
from typing import Any

from vllm_omni_speechlm.codec.dac import DacDecoderConfig
from vllm_omni_speechlm.codec.xcodec import XCodecDecoderConfig
from vllm_omni_speechlm.compat import max_pending_of, parallel_stage_init_of
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.streaming import max_window_ids, window_settings


@functools.lru_cache(maxsize=8)
def codec_reach(model_dir: str) -> tuple[int, int]:
    """(left, right) frames around a kept frame that the checkpoint's codec reads."""
    cfg = SpeechLMConfig.from_model_dir(model_dir)
    with open(os.path.join(model_dir, cfg.codec.path, "config.json"), encoding="utf-8") as f:
        raw = json.load(f)
    codec = DacDecoderConfig.from_dac_dict(raw) if cfg.codec.type == "dac" else XCodecDecoderConfig.from_dict(raw)
    return codec.receptive_field_frames


def check_codec_stage(vllm_config: Any) -> None:
    """The codec stage (stage 1) of a streaming deployment: window settings and sizing."""
    model_config = vllm_config.model_config
    if not getattr(model_config, "async_chunk", False):
        return  # batch mode: one whole clip per prompt, sized by its YAML (bagpiper_batch.yaml)
    extra = (getattr(model_config, "stage_connector_config", None) or {}).get("extra") or {}
    model_dir = str(model_config.model)
    settings = window_settings(extra, codec_reach(model_dir))
    need = max_window_ids(settings, SpeechLMConfig.from_model_dir(model_dir).codec.num_quantizers)
    for name, have in (
        ("max_model_len", model_config.max_model_len),
        ("max_num_batched_tokens", vllm_config.scheduler_config.max_num_batched_tokens),
    ):
        if have < need:
            raise ValueError(
                f"stage 1 (codec): {name} ({have}) must be >= {need}, the longest window: (codec_left_context_frames "
                f"{settings['codec_left_context_frames']} + codec_chunk_frames {settings['codec_chunk_frames']} + "
                f"codec_right_holdback_frames {settings['codec_right_holdback_frames']}) frames x Q codebooks"
            )


def check_speech_lm_stage(vllm_config: Any) -> None:
    """The speech LM stage: window settings when it produces streamed windows."""
    model_config = vllm_config.model_config
    if getattr(model_config, "async_chunk", False):
        extra = (getattr(model_config, "stage_connector_config", None) or {}).get("extra") or {}
        window_settings(extra, codec_reach(str(model_config.model)))


class SpeechLMStageCheck:
    """vLLM `VerifyAndUpdateConfig` for the speech LM architectures (checks only, no updates)."""

    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        check_speech_lm_stage(vllm_config)

    @staticmethod
    def verify_and_update_model_config(model_config: Any) -> None:
        return


class CodecStageCheck(SpeechLMStageCheck):
    @staticmethod
    def verify_and_update_config(vllm_config: Any) -> None:
        check_codec_stage(vllm_config)


def register_startup_checks(speech_lm_archs: list[str], codec_archs: list[str]) -> None:
    """Hook the checks into vLLM's per-architecture config verification (idempotent)."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    for arch in speech_lm_archs:
        MODELS_CONFIG_MAP.setdefault(arch, SpeechLMStageCheck)
    for arch in codec_archs:
        MODELS_CONFIG_MAP.setdefault(arch, CodecStageCheck)


# ---- the deploy YAML itself (offline entry points of this project) ----------------------------


@dataclass(frozen=True)
class DeployPlan:
    """What a deploy YAML runs, read before any engine starts (SpeechLMGenerator, benchmarks).

    Catches what the start-up hooks cannot see: vllm-omni silently turns async_chunk off for a
    single-stage pipeline, so `async_chunk: true` there would quietly give no streaming."""

    pipeline: str
    num_stages: int
    async_chunk: bool

    @property
    def two_stage(self) -> bool:
        return self.num_stages > 1

    @property
    def streaming(self) -> bool:
        return self.two_stage and self.async_chunk

    @classmethod
    def from_yaml(cls, path: str | os.PathLike, async_chunk: bool | None = None) -> DeployPlan:
        """`async_chunk`: the caller's override of the YAML's (None: the YAML decides)."""
        import yaml
        from vllm_omni.config.pipeline_registry import OMNI_PIPELINES

        with open(path, encoding="utf-8") as f:
            deploy = yaml.safe_load(f) or {}
        name = deploy.get("pipeline")
        if name not in OMNI_PIPELINES:
            raise ValueError(f"deploy config {path}: pipeline {name!r} is not registered (known: {sorted(OMNI_PIPELINES)})")
        pipeline = OMNI_PIPELINES[name]
        chunked = bool(deploy.get("async_chunk", False) if async_chunk is None else async_chunk)
        if chunked and not any(s.async_chunk_process_next_stage_input_func for s in pipeline.stages):
            raise ValueError(
                f"deploy config {path}: async_chunk is true but pipeline {name!r} has no async-chunk processor "
                "(it has nothing to stream to); set async_chunk: false or use pipeline bagpiper_two_stage"
            )
        parallel_stage_init_of(deploy, str(path))  # a bad value fails here, not in the engine
        max_pending_of(deploy, str(path))
        for conn_name, conn in (deploy.get("connectors") or {}).items():
            try:
                window_settings((conn or {}).get("extra"))
            except ValueError as e:
                raise ValueError(f"deploy config {path}: connectors.{conn_name}: {e}") from None
        return cls(name, len(pipeline.stages), chunked)
