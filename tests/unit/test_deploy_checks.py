"""Deploy settings are checked at start-up: a wrong YAML fails before any engine process starts,
with a message naming the key (vllm_omni_speechlm/deploy_checks.py)."""

from __future__ import annotations

import copy

import psutil
import pytest
import yaml

from vllm_omni_speechlm import stage_configs
from vllm_omni_speechlm.deploy_checks import (
    DeployPlan,
    check_parallelism,
    check_positions,
    check_speech_lm_stage,
    codec_reach,
)
from vllm_omni_speechlm.streaming import WINDOW_DEFAULTS, max_window_ids, window_settings

XCODEC_REACH = (10, 10)


# ---- the validator ------------------------------------------------------------------------------


def test_defaults_and_overrides():
    exact = {"codec_min_right_holdback_frames": 10, "codec_ramp_min_right_holdback_frames": 10}  # unset: the holdback
    assert window_settings(None, XCODEC_REACH) == WINDOW_DEFAULTS | exact
    got = window_settings({"codec_chunk_frames": 40, "initial_codec_chunk_frames": 5, "stage_id": 0}, XCODEC_REACH)
    assert got == WINDOW_DEFAULTS | exact | {"codec_chunk_frames": 40, "initial_codec_chunk_frames": 5}
    paced = {"codec_min_right_holdback_frames": 2, "codec_playout_margin_steps": 4}
    assert window_settings(paced, XCODEC_REACH) == WINDOW_DEFAULTS | exact | paced  # less lookahead is a choice, not an error
    assert max_window_ids(WINDOW_DEFAULTS, 8) == (25 + 25 + 10) * 8


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"codec_chunk_frames": 0}, "codec_chunk_frames must be >= 1"),
        ({"codec_chunk_frames": -3}, "codec_chunk_frames must be a non-negative int"),
        ({"codec_chunk_frames": "25"}, "codec_chunk_frames must be a non-negative int"),
        ({"codec_chunk_frames": 25.0}, "codec_chunk_frames must be a non-negative int"),
        ({"codec_left_context_frames": True}, "codec_left_context_frames must be a non-negative int"),
        ({"codec_right_holdback_frames": 9}, "codec_right_holdback_frames must be >= 10"),
        ({"codec_chunk_frames": 12, "codec_right_holdback_frames": 13}, "codec_right_holdback_frames (13) must be <="),
        ({"codec_left_context_frames": 9}, "codec_left_context_frames must be >= 10"),
        ({"initial_codec_chunk_frames": 26}, "initial_codec_chunk_frames (26) must be <= codec_chunk_frames (25)"),
        ({"codec_chunk_frame": 25}, "unknown key 'codec_chunk_frame'"),
        ({"codec_min_right_holdback_frames": 11}, "codec_min_right_holdback_frames (11) must be <= codec_right_holdback_frames (10)"),
        ({"codec_min_right_holdback_frames": -1}, "codec_min_right_holdback_frames must be a non-negative int"),
        ({"codec_playout_margin_steps": 2.5}, "codec_playout_margin_steps must be a non-negative int"),
        ({"codec_paced_max_step_ms": 8}, "codec_paced_max_step_ms applies to paced windows"),
        ({"codec_paced_max_streams": 4}, "codec_paced_max_streams applies to paced windows"),
        ({"codec_batch_steps": 26}, "codec_batch_steps (26) must be <= codec_chunk_frames (25)"),
        ({"codec_batch_steps": -1}, "codec_batch_steps must be a non-negative int"),
        ({"codec_windows_on_scheduler_thread": 2}, "codec_windows_on_scheduler_thread must be 0 or 1"),
        ({"codec_windows_on_scheduler_thread": True}, "codec_windows_on_scheduler_thread must be a non-negative int"),
        ({"codec_queued_windows": 2}, "unknown key 'codec_queued_windows'"),
    ],
)
def test_bad_window_settings_name_the_key(extra, key):
    with pytest.raises(ValueError) as err:
        window_settings(extra, XCODEC_REACH)
    assert key in str(err.value)


def test_exactness_bounds_come_from_the_checkpoints_codec(tiny_bagpiper):
    assert codec_reach(tiny_bagpiper) == XCODEC_REACH
    # Without the codec's reach (the processor's own re-check) only types and ranges are checked.
    assert window_settings({"codec_right_holdback_frames": 0})["codec_right_holdback_frames"] == 0


def test_deploy_plans_of_the_shipped_yamls():
    from vllm_omni_speechlm import plugin

    plugin.register()
    plans = {name: DeployPlan.from_yaml(stage_configs.path(name)) for name in (
        "speech_lm_only.yaml", "bagpiper_fused.yaml", "bagpiper_batch.yaml", "bagpiper_streaming.yaml",
        "bagpiper_streaming_2gpu.yaml", "bagpiper_streaming_tp2.yaml")}
    assert [(p.num_stages, p.streaming) for p in plans.values()] == [(1, False), (1, False), (2, False), (2, True), (2, True),
                                                                      (2, True)]
    assert DeployPlan.from_yaml(stage_configs.path("bagpiper_streaming.yaml"), async_chunk=False).streaming is False


def _two_gpu_yaml() -> dict:
    with open(stage_configs.path("bagpiper_streaming_2gpu.yaml")) as f:
        return yaml.safe_load(f)


def test_two_gpu_yaml_places_the_stages_apart():
    from vllm_omni_speechlm import plugin

    plugin.register()
    plan = DeployPlan.from_yaml(stage_configs.path("bagpiper_streaming_2gpu.yaml"), visible=2)
    assert (plan.num_stages, plan.streaming) == (2, True)
    assert [s["devices"] for s in _two_gpu_yaml()["stages"]] == ["0", "1"]


def test_tp2_yaml_shards_stage0_over_two_gpus():
    """Stage 0 on GPUs 0 and 1 (one per rank), the codec stage beside its rank 1; one GPU is not enough."""
    from types import SimpleNamespace

    from vllm_omni_speechlm import plugin

    plugin.register()
    path = stage_configs.path("bagpiper_streaming_tp2.yaml")
    plan = DeployPlan.from_yaml(path, visible=2)
    assert (plan.num_stages, plan.streaming) == (2, True)
    with open(path) as f:
        stages = yaml.safe_load(f)["stages"]
    assert [s["devices"] for s in stages] == ["0,1", "1"] and stages[0]["tensor_parallel_size"] == 2
    check_parallelism(SimpleNamespace(tensor_parallel_size=stages[0]["tensor_parallel_size"]), "qwen3")
    with pytest.raises(ValueError, match=r"stages\[0\]\.devices: GPU 1 does not exist: this process sees 1"):
        DeployPlan.from_yaml(path, visible=1)


@pytest.mark.parametrize(
    "stage, devices, visible, message",
    [
        (1, "gpu1", 2, "stages[1].devices: expected GPU indices such as \"0\" or \"0,1\", got 'gpu1'"),
        (1, "-1", 2, "stages[1].devices: expected GPU indices"),
        (0, "0,x", 2, "stages[0].devices: expected GPU indices"),
        (0, True, 2, "stages[0].devices: expected GPU indices"),
        (1, "1", 1, "stages[1].devices: GPU 1 does not exist: this process sees 1"),
        (0, "0,1", 2, "stages[0].devices: '0,1' names 2 GPU(s) but the stage has 1 rank(s)"),
    ],
)
def test_bad_devices_name_the_key(tmp_path, stage, devices, visible, message):
    from vllm_omni_speechlm import plugin

    plugin.register()
    deploy = _two_gpu_yaml()
    deploy["stages"][stage]["devices"] = devices
    with pytest.raises(ValueError) as err:
        DeployPlan.from_yaml(_write(tmp_path, "devices.yaml", deploy), visible=visible)
    assert message in str(err.value)


def test_devices_as_an_int_or_under_runtime(tmp_path):
    from vllm_omni_speechlm import plugin

    plugin.register()
    deploy = _two_gpu_yaml()
    deploy["stages"][1]["devices"] = 1
    DeployPlan.from_yaml(_write(tmp_path, "int.yaml", deploy), visible=2)
    deploy["stages"][1].pop("devices")
    deploy["stages"][1]["runtime"] = {"devices": "3"}
    with pytest.raises(ValueError, match=r"stages\[1\]\.devices: GPU 3 does not exist"):
        DeployPlan.from_yaml(_write(tmp_path, "runtime.yaml", deploy), visible=2)
    DeployPlan.from_yaml(_write(tmp_path, "unchecked.yaml", deploy), visible=None)  # no GPU count: format only
    deploy["stages"][1]["runtime"] = {"devices": "0,1", "num_replicas": 2}  # one GPU per replica
    DeployPlan.from_yaml(_write(tmp_path, "replicas.yaml", deploy), visible=2)


def _write(tmp_path, name: str, deploy: dict) -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(deploy))
    return str(path)


def _streaming_yaml() -> dict:
    with open(stage_configs.path("bagpiper_streaming_cpu_tiny.yaml")) as f:
        return yaml.safe_load(f)


def test_deploy_plan_rejects_what_vllm_omni_would_ignore(tmp_path):
    """vllm-omni turns async_chunk off for one-stage pipelines without a word; a user asking for
    streaming there gets an error instead."""
    from vllm_omni_speechlm import plugin

    plugin.register()
    one_stage = {"pipeline": "bagpiper", "async_chunk": True, "stages": [{"stage_id": 0}]}
    with pytest.raises(ValueError, match="async_chunk is true but pipeline 'bagpiper' has no async-chunk processor"):
        DeployPlan.from_yaml(_write(tmp_path, "one.yaml", one_stage))
    with pytest.raises(ValueError, match="pipeline 'bagpiper_streaming' is not registered"):
        DeployPlan.from_yaml(_write(tmp_path, "name.yaml", {"pipeline": "bagpiper_streaming"}))
    typo = _streaming_yaml()
    typo["connectors"]["shm"]["extra"]["codec_holdback_frames"] = 10
    with pytest.raises(ValueError, match=r"connectors\.shm: connector extra: unknown key 'codec_holdback_frames'"):
        DeployPlan.from_yaml(_write(tmp_path, "typo.yaml", typo))


def _stage0_config(model_dir: str, tp: int, pp: int = 1, additional_config: dict | None = None):
    from types import SimpleNamespace

    return SimpleNamespace(
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp),
        model_config=_model_config(model_dir, 512),
        additional_config=additional_config or {},
    )


def test_stage0_tensor_parallel_bagpiper_starts(tiny_bagpiper):
    check_speech_lm_stage(_stage0_config(tiny_bagpiper, 2))
    for graphs in (True, False):
        check_speech_lm_stage(_stage0_config(tiny_bagpiper, 2, additional_config={"speech_lm_step_graphs": graphs}))


@pytest.mark.parametrize(
    "tp, pp, extra, message",
    [
        (1, 2, {}, "pipeline_parallel_size 2 is not supported"),
        (2, 2, {}, "pipeline_parallel_size 2 is not supported"),
    ],
)
def test_stage0_parallelism_is_refused_at_start_up(tiny_bagpiper, tp, pp, extra, message):
    """The speech LM stage's start-up check (before any worker) says what works and what to use."""
    with pytest.raises(ValueError) as err:
        check_speech_lm_stage(_stage0_config(tiny_bagpiper, tp, pp, extra))
    assert message in str(err.value)
    check_speech_lm_stage(_stage0_config(tiny_bagpiper, 1, 1, extra))


@pytest.mark.parametrize(
    "model_type, why",
    [
        ("olmo2", "normalises q and k over the whole projection (all heads), which under tensor parallelism needs the "
         "sum of squares all-reduced"),
        ("llama", "Llama backbone is not verified under tensor parallelism"),
        ("gpt2", "backbone 'gpt2' is not supported under tensor parallelism"),
    ],
)
def test_stage0_tensor_parallelism_of_other_backbones_is_refused(model_type, why):
    from types import SimpleNamespace

    with pytest.raises(ValueError) as err:
        check_parallelism(SimpleNamespace(tensor_parallel_size=4, pipeline_parallel_size=1), model_type)
    message = str(err.value)
    assert "tensor_parallel_size 4" in message and why in message and "set tensor_parallel_size: 1" in message
    assert "run the codec stage on it (stage_configs/bagpiper_streaming_2gpu.yaml)" in message
    check_parallelism(SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1), model_type)


def _model_config(model_dir: str, max_model_len: int):
    from vllm.config import ModelConfig

    return ModelConfig(model=model_dir, dtype="float32", max_model_len=max_model_len, skip_tokenizer_init=True)


def test_stage0_max_model_len_is_held_to_the_checkpoints_positions(tiny_bagpiper, monkeypatch):
    """vllm-omni lets a YAML's max_model_len pass the checkpoint's positions (it sets
    VLLM_ALLOW_LONG_MAX_MODEL_LEN); past them an answer decodes garbage, and so do the requests
    that reuse its KV blocks (queued answers lost their audio). The speech LM stage refuses it."""
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # as vllm-omni sets it
    check_positions(_model_config(tiny_bagpiper, 4096))  # the tiny checkpoint's max_position_embeddings
    with pytest.raises(ValueError, match=r"max_model_len \(4097\) must be <= 4096"):
        check_positions(_model_config(tiny_bagpiper, 4097))


# ---- real engine starts ---------------------------------------------------------------------------


def _set(path: tuple, value):
    def apply(deploy: dict) -> dict:
        node = deploy
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return deploy

    return apply


EXTRA = ("connectors", "shm", "extra")
BAD_STARTS = {
    "holdback_below_reach": (_set((*EXTRA, "codec_right_holdback_frames"), 5), "codec_right_holdback_frames must be >= 10"),
    "chunk_not_int": (_set((*EXTRA, "codec_chunk_frames"), "25"), "codec_chunk_frames must be a non-negative int"),
    "unknown_key": (_set((*EXTRA, "codec_left_frames"), 25), "unknown key 'codec_left_frames'"),
    "stage1_too_short": (_set(("stages", 1, "max_model_len"), 400), "stage 1 (codec): max_model_len (400) must be >= 480"),
    # vllm-omni lets a stage's max_model_len pass the checkpoint's positions (the tiny one has 4096)
    "stage0_beyond_positions": (_set(("stages", 0, "max_model_len"), 4097), "max_model_len (4097) must be <= 4096"),
    "device_not_an_index": (_set(("stages", 1, "devices"), "gpu1"), "stages[1].devices: expected GPU indices"),
}


# vllm-omni re-raises the orchestrator thread's error in the caller; pytest also reports the thread's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("case", sorted(BAD_STARTS))
def test_engine_start_fails_naming_the_key(tiny_bagpiper, tmp_path, case):
    """`Omni(...)` with a bad streaming YAML raises before any engine process exists (well under
    a second instead of a 45 s start), and leaves no process behind."""
    from vllm_omni import Omni

    from vllm_omni_speechlm import plugin

    plugin.register()
    mutate, message = BAD_STARTS[case]
    path = _write(tmp_path, f"{case}.yaml", mutate(copy.deepcopy(_streaming_yaml())))
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(Exception) as err:
        Omni(model=tiny_bagpiper, deploy_config=path)
    assert message in str(err.value)
    left = {p.pid for p in psutil.Process().children(recursive=True)} - children_before
    assert not left, f"processes left after a failed start: {left}"


# vllm-omni re-raises the orchestrator thread's error in the caller; pytest also reports the thread's.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_opuslm_tensor_parallel_start_fails_naming_why(tiny_opuslm):
    """OpusLM's OLMo-2 backbone under tensor_parallel_size 2: the start fails before any engine
    process, saying why and what to set."""
    from vllm_omni import Omni

    from vllm_omni_speechlm import plugin

    plugin.register()
    children_before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(Exception) as err:
        Omni(model=tiny_opuslm, deploy_config=stage_configs.path("opuslm_lm_only.yaml"), tensor_parallel_size=2)
    assert "tensor_parallel_size 2: OpusLM's OLMo-2 backbone normalises q and k" in str(err.value)
    assert "set tensor_parallel_size: 1" in str(err.value)
    assert not {p.pid for p in psutil.Process().children(recursive=True)} - children_before
