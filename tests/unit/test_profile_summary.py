"""benchmarks/profile_summary.py reads py-spy profiles of the engine core taken either way:
`--subprocesses` from the benchmark's pid, or on the engine core's own pid with native frames."""

import sys
from pathlib import Path

sys.path.append(str(Path(__file__).parents[2] / "benchmarks"))
import profile_summary  # noqa: E402

CORE = "run_busy_loop (vllm/v1/engine/core.py:1411);step_with_batch_queue (vllm/v1/engine/core.py:658)"
UPDATE = "update_from_output (vllm_omni/core/sched/omni_ar_scheduler.py:744)"
WAIT = "_process_input_queue (vllm/v1/engine/core.py:1420);wait (threading.py:359)"
SCHEDULE = "schedule (vllm/v1/core/sched/scheduler.py:729)"


def _summary(tmp_path, lines: list[str]) -> dict:
    path = tmp_path / "prof.txt"
    path.write_text("\n".join(lines) + "\n")
    return profile_summary.summarize(str(path))


def test_subprocess_profile(tmp_path):
    root = 'process 10:"python bench.py";process 11:"VLLM::EngineCore"'
    s = _summary(tmp_path, [
        f"{root};thread (0x1): MainThread;{CORE};{UPDATE} 3",
        f"{root};thread (0x1): MainThread;{WAIT} 1",
        f'process 10:"python bench.py";thread (0x2): MainThread;main (bench.py:3) 50',  # not the engine core
    ])
    assert s["main_thread_samples"] == 4
    assert s["main_thread_share"]["idle"] == 0.25 and s["main_thread_share"]["scheduler.update_from_output"] == 0.75


def test_engine_core_profile_with_native_frames(tmp_path):
    thread = "thread (1601): MainThread"
    s = _summary(tmp_path, [
        f"{thread};{CORE};{UPDATE};THPVariable_clear (libtorch_python.so);pthread_cond_timedwait (libc.so.6) 2",
        f"{thread};{CORE};{SCHEDULE} 1",
        f"{thread};{WAIT};pthread_cond_timedwait (libc.so.6) 1",  # waiting: told by its last Python frame
    ])
    assert s["main_thread_samples"] == 4
    assert s["main_thread_share"]["idle"] == 0.25 and s["main_thread_share"]["scheduler.schedule"] == 0.25
    assert s["top_self"]["pthread_cond_timedwait (libc.so.6)"] == 0.5
    assert s["self_by_package"] == {"vllm_omni": 0.5, "vllm/v1/core": 0.25}  # the running Python frame's


def test_a_spin_on_the_multiprocess_executors_queue_is_idle(tmp_path):
    """Under the multiprocess executor the engine core waits for its worker's reply spinning in
    vLLM's shared-memory queue: on the CPU, but waiting."""
    result = "result (vllm/v1/executor/multiproc_executor.py:98);get_response (vllm/v1/executor/multiproc_executor.py:433)"
    shm = "acquire_read (vllm/distributed/device_communicators/shm_broadcast.py:794)"
    s = _summary(tmp_path, [
        f"thread (7): MainThread;{CORE};{result};{shm};sched_yield (vllm/distributed/utils.py:48) 2",
        f"thread (7): MainThread;{CORE};{result};{shm};memory_fence (vllm/distributed/device_communicators/shm_broadcast.py:95) 1",
        f"thread (7): MainThread;{CORE};{UPDATE} 1",
    ])
    assert s["main_thread_share"]["idle"] == 0.75
