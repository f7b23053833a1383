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
from vllm_omni_speechlm.compat import max_pending_of, parallel_stage_init_of, position_limit
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


# What to do instead of sharding stage 0, in the refusals below.
MORE_GPUS_HINT = (
    "to use a second GPU, run the codec stage on it (stage_configs/bagpiper_streaming_2gpu.yaml) or start one "
    "server per GPU"
)
# Backbones (config.json model_type) whose stage 0 runs under tensor parallelism; the others' refusal.
TP_BACKBONES = ("qwen3",)
TP_REFUSALS = {
    "olmo2": "OpusLM's OLMo-2 backbone normalises q and k over the whole projection (all heads), which under tensor "
    "parallelism needs the sum of squares all-reduced across ranks; that is not implemented",
    "llama": "OpusLM-Dialogue's Llama backbone is not verified under tensor parallelism yet",
}


def check_parallelism(parallel_config: Any, model_type: str | None = None) -> None:
    """Tensor parallelism for the backbones in `TP_BACKBONES` (Bagpiper's Qwen3): vLLM shards the
    layers, the aux head is sharded (tp_heads.py), per-request state is replicated on every rank
    (docs/architecture.md, "Tensor-parallel stage 0"). Pipeline stages would split the step itself:
    the aux streams sampled after the last layer are the next step's input on the first."""
    tp = getattr(parallel_config, "tensor_parallel_size", 1)
    pp = getattr(parallel_config, "pipeline_parallel_size", 1)
    if pp != 1:
        raise ValueError(
            f"speech LM stage: pipeline_parallel_size {pp} is not supported (the aux streams sampled after the "
            f"last layer feed the next step's first layer); set pipeline_parallel_size: 1 and use "
            f"tensor_parallel_size to shard a Bagpiper stage 0; or {MORE_GPUS_HINT}"
        )
    if tp != 1 and model_type not in TP_BACKBONES:
        why = TP_REFUSALS.get(model_type, f"backbone {model_type!r} is not supported under tensor parallelism")
        raise ValueError(
            f"speech LM stage: tensor_parallel_size {tp}: {why}; set tensor_parallel_size: 1 (one H100 holds the 8B "
            f"model in bfloat16); {MORE_GPUS_HINT}"
        )


def check_positions(model_config: Any) -> None:
    """max_model_len within the checkpoint's positions. vLLM refuses more unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN is set, and vllm-omni sets it for every stage whose YAML names a
    max_model_len. Past the positions RoPE reads outside its table: the answer turns to garbage
    (audio ends early, as a row that is not audio ends a segment), and so do later requests that
    reuse its KV blocks."""
    limit = position_limit(model_config)
    if model_config.max_model_len > limit:
        raise ValueError(
            f"speech LM stage: max_model_len ({model_config.max_model_len}) must be <= {limit}, the positions of "
            f"the checkpoint (max_position_embeddings, with its RoPE scaling); longer sequences decode garbage"
        )


def check_speech_lm_stage(vllm_config: Any) -> None:
    """The speech LM stage: its parallelism, max_model_len within the checkpoint's positions; window
    settings when it produces streamed windows."""
    model_config = vllm_config.model_config
    check_parallelism(vllm_config.parallel_config, getattr(model_config.hf_config, "model_type", None))
    check_positions(model_config)
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


def _stage_value(stage: dict, key: str, section: str) -> Any:
    """A stage's setting, flat or under `runtime:` / `engine_args:` (vllm-omni reads both)."""
    nested = stage.get(section) or {}
    return nested[key] if key in nested else stage.get(key)


def stage_devices_of(stage: dict, where: str, visible: int | None = None) -> list[int] | None:
    """A stage's `devices` as GPU indices (None: not set, or "cpu"). Each must be a non-negative
    integer, one per rank (tensor x pipeline parallel size; or per rank of every replica, as
    vllm-omni allows), and below `visible`, the GPUs this process sees (None: not checked).
    vllm-omni reads the value only as the stage starts, where a typo or a missing GPU fails far
    from the YAML."""
    value = _stage_value(stage, "devices", "runtime")
    if value is None or value == "cpu":
        return None
    parts = [value] if isinstance(value, int) and not isinstance(value, bool) else str(value).split(",")
    if isinstance(value, bool) or not all(str(p).strip().isdigit() for p in parts):
        raise ValueError(f"{where}.devices: expected GPU indices such as \"0\" or \"0,1\", got {value!r}")
    ids = [int(str(p).strip()) for p in parts]
    ranks = 1
    for key in ("tensor_parallel_size", "pipeline_parallel_size"):
        ranks *= int(_stage_value(stage, key, "engine_args") or 1)
    replicas = int(_stage_value(stage, "num_replicas", "runtime") or 1)
    if len(ids) not in (ranks, ranks * replicas):
        raise ValueError(f"{where}.devices: {value!r} names {len(ids)} GPU(s) but the stage has {ranks} rank(s) "
                         "(tensor_parallel_size x pipeline_parallel_size)")
    missing = [i for i in ids if visible is not None and i >= visible]
    if missing:
        raise ValueError(f"{where}.devices: GPU {missing[0]} does not exist: this process sees {visible} GPU(s) "
                         "(indices count within CUDA_VISIBLE_DEVICES when it is set)")
    return ids


def visible_gpus() -> int | None:
    """GPUs this process sees (within CUDA_VISIBLE_DEVICES); None off CUDA (the CPU platform does
    not use `devices`). vLLM's count, which creates no CUDA context before the stages start."""
    from vllm.platforms import current_platform

    return current_platform.device_count() if current_platform.is_cuda() else None


def check_deploy_devices(path: str | None, visible: int | None = -1) -> None:
    """Every stage's `devices` in the deploy YAML at `path` (none: nothing to check); `visible` as
    in `DeployPlan.from_yaml`."""
    if not path:
        return
    import yaml

    with open(path, encoding="utf-8") as f:
        deploy = yaml.safe_load(f) or {}
    visible = visible_gpus() if visible == -1 else visible
    for i, stage in enumerate(deploy.get("stages") or []):
        stage_devices_of(stage or {}, f"deploy config {path}: stages[{i}]", visible)


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
    def from_yaml(cls, path: str | os.PathLike, async_chunk: bool | None = None, visible: int | None = -1) -> DeployPlan:
        """`async_chunk`: the caller's override of the YAML's (None: the YAML decides); `visible`:
        the GPUs the stages' `devices` must exist among (-1: this process's; None: not checked)."""
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
        check_deploy_devices(str(path), visible)
        for conn_name, conn in (deploy.get("connectors") or {}).items():
            try:
                window_settings((conn or {}).get("extra"))
            except ValueError as e:
                raise ValueError(f"deploy config {path}: connectors.{conn_name}: {e}") from None
        return cls(name, len(pipeline.stages), chunked)
