"""A stage process's helper threads take the interpreter lock back within SWITCH_INTERVAL_S."""

from __future__ import annotations

import sys

import pytest

from vllm_omni_speechlm import threads


def test_the_switch_interval_is_short_unless_measured_otherwise(monkeypatch):
    before = sys.getswitchinterval()
    try:
        monkeypatch.delenv(threads.SWITCH_INTERVAL_ENV, raising=False)
        threads.prompt_thread_switches()
        assert sys.getswitchinterval() == pytest.approx(threads.SWITCH_INTERVAL_S) and threads.SWITCH_INTERVAL_S < 0.005
        monkeypatch.setenv(threads.SWITCH_INTERVAL_ENV, "0.005")
        threads.prompt_thread_switches()
        assert sys.getswitchinterval() == pytest.approx(0.005)
    finally:
        sys.setswitchinterval(before)
