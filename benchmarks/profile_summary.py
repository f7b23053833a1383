"""Where stage 0's engine-core process spends a step: shares of py-spy samples per component.

    py-spy record --subprocesses --idle --threads -f raw -o prof.txt -p <benchmark pid>
    python benchmarks/profile_summary.py prof.txt --out summary.json

(`benchmarks/profile_stage0.sh` records such a profile during the 512-request decode.) A profile
recorded on the engine core's own pid (`-p <pid>`, no `--subprocesses`) and one with `--native`
frames read the same way; a sample's wait is then told by its last Python frame. A
component's share is the fraction of the engine core's main-thread samples whose stack contains
it (inclusive, so nested components overlap); `idle` is the main thread waiting (for work, I/O
or the GPU). The output thread that serialises each step's results for the client gets its own
busy share.

With `--gil RATE SECONDS` the profile is py-spy's `--gil` kind (a sample only from the thread
holding the GIL, if one does): the summary is each engine-core thread's share of the time it held
the GIL and its top functions. Threads of one process run Python one at a time, so shares that add
up to ~1 mean the engine core is bound by the GIL, not by any single thread.
"""

from __future__ import annotations

import argparse
import collections
import json

ENGINE_CORE = "EngineCore"  # in the engine core process's title (VLLM::StageEngineCoreProc, VLLM::EngineCore_DP0)
# Frames as "function (file" (py-spy 0.4.2 writes no class names; older ones wrote "Class.function").
COMPONENTS = {
    "scheduler.schedule": "schedule (vllm/v1/core/sched/scheduler.py",
    "scheduler.update_from_output": "update_from_output (",
    "runner.preprocess_hooks": "_preprocess (vllm_omni/worker/gpu_model_runner.py",
    "runner.model_kwargs_extra": "_build_model_kwargs_extra (",
    "runner.output_builder": "output_builder (",
    "runner.prepare_input_ids": "_prepare_input_ids (",  # vLLM's V1 loops (runner_loops.py)
    "runner.bookkeeping_sync": "_bookkeeping_sync (",
    "model.prepare_runner_inputs": "prepare_runner_inputs (vllm_omni_speechlm/models/speechlm.py",
    "model.make_omni_output": "make_omni_output (vllm_omni_speechlm/models/speechlm.py",
    "model.compute_logits": "compute_logits (vllm_omni_speechlm/models/speechlm.py",
    "model.sample": "sample (vllm_omni_speechlm/models/speechlm.py",
}
# Waiting: for work and I/O, or for the GPU.
# From `sched_yield` on: vLLM's shared-memory queue between an engine core and its workers
# (multiprocess executor) spins, yielding the CPU, while it waits for the other side's message.
_SHM = "(vllm/distributed/device_communicators/shm_broadcast.py"
IDLE = ("wait (threading.py", "select (selectors.py", "poll (zmq/sugar/poll.py", "synchronize (torch/cuda/streams.py",
        "sched_yield (vllm/distributed/utils.py", *(f"{fn} {_SHM}" for fn in ("timeout_ms", "memory_fence", "wait",
                                                                              "acquire_read", "check")))


def _bare(frame: str) -> str:
    """'Class.function (file:line)' -> 'function (file:line)'."""
    name, sep, where = frame.partition(" (")
    return name.rpartition(".")[2] + sep + where


def _function(frame: str) -> str:
    """'name (file.py:line)' -> 'name (file.py)': one entry per function, not per line."""
    name, _, where = frame.partition(" (")
    return f"{name} ({where.rpartition(':')[0] or where.rstrip(')')})"


def _package(frame: str) -> str:
    """'name (vllm/v1/worker/x.py:12)' -> 'vllm/v1/worker'; the other packages by their top name."""
    parts = frame.partition(" (")[2].split("/")
    if len(parts) == 1:  # no package: a generated file, the thread frame
        return "<other>"
    return "/".join(parts[:3]) if parts[0] == "vllm" and len(parts) > 3 else parts[0]


def _engine_core_stacks(path: str):
    """The engine core's stacks in a py-spy raw profile: (frames, index of its process frame (a
    process below the root; its thread follows; -1: a profile of the engine core alone), count)."""
    for line in open(path):
        stack, _, count = line.rstrip().rpartition(" ")
        frames = stack.split(";")
        core = next((i for i, f in enumerate(frames) if f.startswith("process ") and ENGINE_CORE in f), None)
        if core is None and frames[0].startswith("thread "):  # no process frame above its thread
            core = -1
        if core is not None and core + 1 < len(frames):
            yield frames, core, int(count)


def _last_python(frames: list[str]) -> str | None:
    """The innermost Python frame (native ones, `--native`, have no `.py:`)."""
    return next((f for f in reversed(frames) if ".py:" in f), None)


def summarize(path: str, top: int = 40) -> dict:
    main, output = collections.Counter(), collections.Counter()
    inclusive, own = collections.Counter(), collections.Counter()  # busy main-thread samples per function
    owners = collections.Counter()  # busy main-thread samples per package of the running frame
    for frames, core, count in _engine_core_stacks(path):
        bare = [_bare(f) for f in frames[core + 2 :]]
        last = _last_python(bare)
        thread, idle = frames[core + 1], last is not None and last.startswith(IDLE)
        if "MainThread" in thread:
            main["samples"] += count
            main["idle"] += idle * count
            for name, needle in COMPONENTS.items():
                main[name] += any(f.startswith(needle) for f in bare) * count
            if not idle:
                for function in {_function(f) for f in frames[core + 2 :]}:
                    inclusive[function] += count
                own[_function(frames[-1])] += count
                owners[_package(_last_python(frames) or frames[-1])] += count
        elif "process_output_sockets" in thread:
            output["samples"] += count
            output["busy"] += (not idle) * count
    total = max(main.pop("samples"), 1)
    shares = {name: round(main[name] / total, 3) for name in ["idle", *COMPONENTS]}
    return {
        "main_thread_samples": total,
        "main_thread_share": shares,
        "output_thread_busy_share": round(output["busy"] / max(output["samples"], 1), 3),
        # Where the busy main thread goes beyond the components above: shares of all its samples.
        "top_inclusive": {f: round(n / total, 3) for f, n in inclusive.most_common(top)},
        "top_self": {f: round(n / total, 3) for f, n in own.most_common(top)},
        "self_by_package": {p: round(n / total, 3) for p, n in owners.most_common(12)},
    }


def gil_shares(path: str, rate: float, seconds: float, top: int = 15) -> dict:
    """Per engine-core thread: the share of the window it held the GIL, and its top functions."""
    held: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    processes = set()
    for frames, core, count in _engine_core_stacks(path):
        processes.add(frames[core][:80])
        thread = frames[core + 1].rpartition(": ")[2].strip('"') or frames[core + 1]
        held[thread]["<all>"] += count
        held[thread][_function(frames[-1])] += count
    window = rate * seconds
    threads = {
        t: {"gil_share": round(c.pop("<all>") / window, 3), "top_self": {f: round(n / window, 3) for f, n in c.most_common(top)}}
        for t, c in held.items()
    }
    return {"processes": sorted(processes), "gil_held_share": round(sum(t["gil_share"] for t in threads.values()), 3), "threads": threads}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("profile", help="py-spy raw (collapsed) output")
    ap.add_argument("--out")
    ap.add_argument("--context", help="free text saved with the summary (device, run, commit)")
    ap.add_argument("--gil", nargs=2, type=float, metavar=("RATE", "SECONDS"), help="a py-spy --gil profile")
    args = ap.parse_args()
    summary = gil_shares(args.profile, *args.gil) if args.gil else summarize(args.profile)
    summary |= {"context": args.context} if args.context else {}
    print(json.dumps(summary, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(summary, f, indent=2)


if __name__ == "__main__":
    main()
