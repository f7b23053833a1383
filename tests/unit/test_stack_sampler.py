"""`benchmarks/stack_sampler/sitecustomize.py` (loaded by every process with it on PYTHONPATH) and
`benchmarks/stack_samples.py`: samples only while a phase is named, and Triton builds traced."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SAMPLER = ROOT / "benchmarks" / "stack_sampler"
sys.path.insert(0, str(ROOT / "benchmarks"))

from stack_samples import summarize  # noqa: E402

BUSY = textwrap.dedent("""
    import time
    def spin_in_phase():
        t = time.time()
        while time.time() - t < 0.8:
            sum(range(1000))
    spin_in_phase()
""")


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": f"{SAMPLER}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"} | env
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_a_process_is_sampled_under_the_phase_that_is_named(tmp_path):
    (tmp_path / "phase").write_text("64")
    assert _python(BUSY, SPEECHLM_STACK_SAMPLES=str(tmp_path), SPEECHLM_STACK_SAMPLE_MS="2").returncode == 0
    (proc, phases), = summarize(tmp_path, min_samples=10).items()
    assert proc.startswith("MainProcess ") and list(phases) == ["64"]
    main = phases["64"]["MainThread"]
    assert main["self"][0][0] == "spin_in_phase (<string>)" and main["self"][0][1] > 0.5, main


def test_nothing_is_sampled_while_no_phase_is_named(tmp_path):
    assert _python(BUSY, SPEECHLM_STACK_SAMPLES=str(tmp_path), SPEECHLM_STACK_SAMPLE_MS="2").returncode == 0
    assert not list(tmp_path.glob("stacks-*.txt"))


@pytest.mark.skipif(shutil.which("gcc") is None, reason="Triton builds its C modules with gcc")
def test_a_triton_module_built_is_traced_with_its_caller_and_a_cached_one_is_not(tmp_path):
    code = textwrap.dedent("""
        import time
        import triton.runtime.build as build
        time.sleep(0.3)  # the sampler thread wraps the build once the module is loaded
        SRC = '''#include <Python.h>
        static struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "probe_mod", NULL, -1, NULL};
        PyMODINIT_FUNC PyInit_probe_mod(void) { return PyModule_Create(&m); }'''
        def first_launch():
            return build.compile_module_from_src(SRC, "probe_mod")
        first_launch()
        first_launch()
    """)
    done = _python(code, SPEECHLM_TRACE_LAUNCHERS="1", TRITON_CACHE_DIR=str(tmp_path))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stderr.count("launcher build trace:") == 1, done.stderr[-2000:]
    assert "module=probe_mod" in done.stderr and "first_launch" in done.stderr


def test_a_spawned_child_is_traced_from_its_start_to_its_run(tmp_path):
    script = tmp_path / "probe.py"  # spawn re-imports the parent's main module: it needs a file
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp
        def work():
            pass
        if __name__ == "__main__":
            child = mp.get_context("spawn").Process(target=work, name="probe-child")
            child.start()
            child.join()
    """))
    launched = time.time()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env=os.environ | {"PYTHONPATH": f"{SAMPLER}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                                            "SPEECHLM_TRACE_SPAWNS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    from startup import spawn_timeline

    moments = spawn_timeline(done.stderr, launched)
    order = ["start", "interpreter", "prepared", "run"]
    assert list(moments) == [f"spawn {event}[probe-child]" for event in order], done.stderr[-2000:]
    assert list(moments.values()) == sorted(moments.values()) and 0 <= moments["spawn start[probe-child]"] < 60


def test_a_phase_can_be_renamed_after_its_first_seconds(tmp_path, monkeypatch):
    from stack_samples import sampled_phase

    monkeypatch.setenv("SPEECHLM_STACK_SAMPLES", str(tmp_path))
    with sampled_phase("64 burst", then="64", after_s=0.1):
        assert (tmp_path / "phase").read_text() == "64 burst"
        time.sleep(0.4)
        assert (tmp_path / "phase").read_text() == "64"
    with sampled_phase("1 burst", then="1", after_s=30):  # a level shorter than its burst
        pass
    time.sleep(0.1)
    assert not (tmp_path / "phase").exists()
