"""`benchmarks/startup.py --tiny`: both servers start, answer, and the log is read into phases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

LOG = """\
INFO 11-25 15:15:36 [__init__.py:39] Available plugins
\x1b[0;36m(APIServer pid=3258)\x1b[0;0m INFO 11-25 15:15:44 [api_utils.py:347] vLLM server version 0.30.0
\x1b[0;36m(StageEngineCoreProc_stage0_replica0 pid=3324)\x1b[0;0m INFO 11-25 15:16:20 [gpu_model_runner.py:5317] Starting to load model /m...
(StageEngineCoreProc_stage0_replica0 pid=3324) INFO 11-25 15:16:23 [gpu_model_runner.py:5416] Model loading took 15.52 GiB memory and 0.800453 seconds
(StageEngineCoreProc_stage1_replica0 pid=3489) INFO 11-25 15:16:24 [kernel_warmup.py:185] JIT kernel warmup finished in 0.43s.
(StageEngineCoreProc_stage0_replica0 pid=3324) INFO 11-25 15:16:40 [speechlm.py:476] speech LM step functions compiled in 10.0 s
(StageEngineCoreProc_stage0_replica0 pid=3324) INFO 11-25 15:16:46 [speechlm.py:476] speech LM step functions compiled in 0.0 s
(APIServer pid=3258) INFO 11-25 15:16:48 [stage_engine_core_client.py:221] [StageEngineCoreClient] stage-0 [rep-0] EngineCore running
"""


def test_log_lines_become_a_timeline_and_per_stage_phases():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from startup import parse_log

    launched = datetime(datetime.now().year, 11, 25, 15, 15, 30).timestamp()
    parsed = parse_log(LOG, launched)
    assert parsed["phases"] == {
        "stage 0": {"weights_s": 0.8, "step_functions_s": 10.0},
        "stage 1": {"jit_warmup_s": 0.43},
    }
    assert parsed["timeline"] == {
        "first line: unprefixed": 6.0,
        "first line: APIServer": 14.0,
        "first line: StageEngineCoreProc[stage 0]": 50.0,
        "model_load_start[stage 0]": 50.0,
        "first line: StageEngineCoreProc[stage 1]": 54.0,
        "engine_running[stage 0]": 78.0,
    }


def test_first_request_names_what_it_added_to_the_caches(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from startup import first_requests

    cache = tmp_path / "triton"
    (cache / "old").mkdir(parents=True)
    (cache / "old" / "a.cubin").write_text("start-up")
    added = iter([cache / "k1" / "first.cubin", cache / "second.cubin", None])

    def probe() -> float:
        if (path := next(added)) is not None:
            path.parent.mkdir(exist_ok=True)
            path.write_text("compiled")
        return 0.1

    out = first_requests(probe, 3, {"TRITON_CACHE_DIR": str(cache)})
    assert out["first_request_cache_files"] == ["TRITON_CACHE_DIR/k1/first.cubin"]
    assert out["first_request_cache_files_count"] == 1 and out["seconds"] == [0.1] * 3


def test_bytecode_share_counts_the_modules_compiled_beside_their_source(tmp_path, monkeypatch):
    import py_compile

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from startup import bytecode_share

    pkg = tmp_path / "half_compiled"
    pkg.mkdir()
    for name in ("__init__", "a", "b", "c"):
        (pkg / f"{name}.py").write_text("X = 1\n")
    for name in ("__init__", "a"):
        py_compile.compile(str(pkg / f"{name}.py"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")  # importing it below writes no more
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    assert bytecode_share(("half_compiled",)) == {"half_compiled": 0.5, "PYTHONDONTWRITEBYTECODE": "1"}


def test_tiny_run_starts_both_servers_and_times_their_first_requests(tmp_path):
    out = tmp_path / "startup.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "startup.py"), "--tiny", "--out", str(out),
           "--workdir", str(tmp_path / "work"), "--starts", "1", "--requests", "2"]
    samples = tmp_path / "stacks"  # every process sampled per start (benchmarks/stack_sampler)
    env = os.environ | {"PYTHONUNBUFFERED": "1", "SPEECHLM_STACK_SAMPLES": str(samples), "SPEECHLM_TRACE_SPAWNS": "1",
                        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "stack_sampler"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    starts = report["starts"]
    assert list(starts) == ["speech cold 1", "text cold 2"]
    assert report["bytecode"]["vllm"] > 0.9  # a pip install compiles it
    for name, start in starts.items():
        assert "error" not in start, start
        assert start["ready_s"] > 0 and len(start["requests"]["seconds"]) == 2
        assert all(s is not None and s > 0 for s in start["requests"]["seconds"]), name
    assert {"engine_running[stage 0]", "engine_running[stage 1]", "spawn run[StageEngineCoreProc_stage0_replica0]",
            "spawn prepared[StageEngineCoreProc_stage1_replica0]"} <= set(starts["speech cold 1"]["timeline"])
    assert (tmp_path / "work" / "cache" / "speech" / "vllm").is_dir()  # the caches went where asked
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from stack_samples import summarize

    phases = {(proc.split()[0], phase) for proc, by_phase in summarize(samples, min_samples=1).items() for phase in by_phase}
    assert {("StageEngineCoreProc_stage0_replica0", "speech-cold-1 start"), ("EngineCore", "text-cold-2 start")} <= phases, phases
    assert ("MainProcess", "speech-cold-1 requests") in phases  # the phase is named (the client or the
    # API server); an engine core's sampler can take no sample of two short requests on 2 cores
