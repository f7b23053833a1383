"""Deploy settings are checked at start-up: a wrong YAML fails before any engine process starts,
with a message naming the key (vllm_omni_speechlm/deploy_checks.py)."""

from __future__ import annotations

import copy

import psutil
import pytest
import yaml

from vllm_omni_speechlm import stage_configs
from vllm_omni_speechlm.deploy_checks import DeployPlan, codec_reach
from vllm_omni_speechlm.streaming import WINDOW_DEFAULTS, max_window_ids, window_settings

XCODEC_REACH = (10, 10)


# ---- the validator ------------------------------------------------------------------------------


def test_defaults_and_overrides():
    assert window_settings(None, XCODEC_REACH) == WINDOW_DEFAULTS
    got = window_settings({"codec_chunk_frames": 40, "initial_codec_chunk_frames": 5, "stage_id": 0}, XCODEC_REACH)
    assert got == WINDOW_DEFAULTS | {"codec_chunk_frames": 40, "initial_codec_chunk_frames": 5}
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
        "speech_lm_only.yaml", "bagpiper_fused.yaml", "bagpiper_batch.yaml", "bagpiper_streaming.yaml")}
    assert [(p.num_stages, p.streaming) for p in plans.values()] == [(1, False), (1, False), (2, False), (2, True)]
    assert DeployPlan.from_yaml(stage_configs.path("bagpiper_streaming.yaml"), async_chunk=False).streaming is False


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
