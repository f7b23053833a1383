"""Where each process of a server spent its Python time, from `stack_sampler/sitecustomize.py`'s
samples: per process, phase and thread, the share of samples in which each function was on the
stack (inclusive) and at its top (self).

    SPEECHLM_STACK_SAMPLES=/tmp/st PYTHONPATH=benchmarks/stack_sampler:$PYTHONPATH \\
        python benchmarks/serve_load.py ...               # a sample's phase: its level ("64 burst": its first second)
    python benchmarks/stack_samples.py /tmp/st --out stacks.json [--top 25] [--min-samples 50]

A thread that waits (a lock, a socket, a CUDA synchronization) is sampled too: its waiting
function shows how much of the phase it was idle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import threading
from collections import Counter, defaultdict
from pathlib import Path

HEADER = re.compile(r"# pid=(?P<pid>\d+) name=(?P<name>\S+)")


@contextlib.contextmanager
def sampled_phase(name: str, then: str | None = None, after_s: float = 0.0):
    """Name the phase the samplers count under while the block runs (SPEECHLM_STACK_SAMPLES's
    `phase` file; nothing when it is unset): serve_load.py's levels, startup.py's starts. With
    `then`, the phase is renamed `then` after `after_s` seconds (a level's burst of arrivals, then
    the rest)."""
    folder = os.environ.get("SPEECHLM_STACK_SAMPLES")
    phase = Path(folder or ".", "phase")
    rename = threading.Timer(after_s, phase.write_text, (then,)) if folder and then else None
    if folder:
        phase.parent.mkdir(parents=True, exist_ok=True)
        phase.write_text(name)
    if rename is not None:
        rename.start()
    try:
        yield
    finally:
        if rename is not None:
            rename.cancel()
            rename.join()  # not renamed after the phase ends
        if folder:
            phase.unlink(missing_ok=True)


def read_samples(folder: Path) -> dict[str, dict[tuple[str, str], Counter]]:
    """{"name pid": {(phase, thread): Counter(folded stack -> samples)}}."""
    out: dict[str, dict[tuple[str, str], Counter]] = {}
    for path in sorted(folder.glob("stacks-*.txt")):
        lines = path.read_text(errors="replace").splitlines()
        m = HEADER.match(lines[0]) if lines else None
        if m is None:
            continue
        threads: dict[tuple[str, str], Counter] = defaultdict(Counter)
        for line in lines[1:]:
            phase, n, thread, stack = line.split("\t", 3)
            threads[(phase, thread)][stack] += int(n)
        out[f"{m['name']} {m['pid']}"] = threads
    return out


def top_functions(stacks: Counter, top: int) -> dict:
    """Samples, and the `top` functions by self and by inclusive share of them (leaving out the
    frames on nearly every stack: the thread's entry and loop)."""
    total = sum(stacks.values())
    inclusive: Counter = Counter()
    leaf: Counter = Counter()
    for stack, n in stacks.items():
        frames = stack.split(";")
        inclusive.update({f: n for f in set(frames)})
        leaf[frames[-1]] += n

    def shares(c: Counter) -> list[list]:
        return [[f, round(n / total, 3)] for f, n in c.most_common() if n < 0.98 * total or c is leaf][:top]

    return {"samples": total, "self": shares(leaf), "inclusive": shares(inclusive)}


def summarize(folder: Path, top: int = 25, min_samples: int = 50) -> dict:
    """{"name pid": {"phase": {"thread": top_functions}}} for threads with at least `min_samples`."""
    report: dict = {}
    for proc, threads in read_samples(folder).items():
        for (phase, thread), stacks in sorted(threads.items()):
            if sum(stacks.values()) >= min_samples:
                report.setdefault(proc, {}).setdefault(phase, {})[thread] = top_functions(stacks, top)
    return report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder")
    ap.add_argument("--out")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--min-samples", type=int, default=50)
    args = ap.parse_args()
    report = summarize(Path(args.folder), args.top, args.min_samples)
    for proc, phases in report.items():
        for phase, threads in phases.items():
            for thread, s in threads.items():
                print(f"== {proc} | phase {phase} | {thread}: {s['samples']} samples; self, then inclusive")
                for kind in ("self", "inclusive"):
                    for label, share in s[kind]:
                        print(f"   {share:6.1%}  {label}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
