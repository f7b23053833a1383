"""The interpreter lock in the processes of a deployment, whose threads hand on every window.

vllm-omni's chunk adapter cuts and writes each window on a save thread of stage 0's EngineCore
process and reads it on a receive thread of stage 1's, while the main thread schedules and
steps; in the API server, vllm-omni's orchestrator thread passes requests and outputs between the
stages and the event loop. Every torch op and syscall on a helper thread lets go of the lock, and taking it back
waits for the main thread to hand it over: up to the switch interval (Python's default 5 ms)
while the main thread runs Python. A window's hand-off takes a dozen such waits, so at 64
listeners stage 0's save thread fell hundreds of ms behind the steps that made the windows.
A thread cutting windows next to one running Python: 250 ms a window at Python's 5 ms interval,
11 ms at 0.5 ms, 2.6 ms at 0.1 ms, the busy thread no slower (CPU, torch ops on small tensors).
"""

from __future__ import annotations

import os
import sys

SWITCH_INTERVAL_S = 0.0001
# For measurement: another interval (Python's default: 0.005).
SWITCH_INTERVAL_ENV = "SPEECHLM_GIL_SWITCH_INTERVAL_S"


def prompt_thread_switches() -> None:
    """Called as the API server and each stage's EngineCore process set up: a thread waiting for
    the lock waits at most the interval."""
    sys.setswitchinterval(float(os.environ.get(SWITCH_INTERVAL_ENV, SWITCH_INTERVAL_S)))
