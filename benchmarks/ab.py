"""Stage-0 decode throughput of two builds on one host, interleaved: is the new one slower?

    python benchmarks/ab.py --base /path/to/base-tree --out ab.json [--rounds 2] -- --concurrency 512 --gen-len 256
    python benchmarks/ab.py --base . --tiny --out /tmp/ab.json           # CPU smoke run: this tree twice

Each round runs `stage0_throughput.py --runs speech` once per build, base first, each in its own
process: the base from its own tree (its script, its package first on PYTHONPATH), the new one from
this tree. Arguments after `--` go to both. A host's speed drifts over minutes by more than the
differences asked about (two runs of one build on one H100 were 2.6% apart), so the builds
alternate and every timed run is kept. Per generation length and concurrency it reports each
build's runs (frames/s) over all rounds, their median and spread ((max - min) / median), and the
new median over the base's: "within noise" when the difference is no larger than the larger spread.
Also each build's digest of a seeded request's frames (equal when the builds decode alike). The
report is written after every run once both builds have one (`runs_done`), so a host taken back
mid-way still leaves one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUILDS = ("base", "new")


def run_build(tree: Path, args: list[str], out: Path) -> dict:
    """One `stage0_throughput.py --runs speech` of the build in `tree` -> its report."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, str(tree / "benchmarks" / "stage0_throughput.py"), "--runs", "speech", "--out", str(out), *args]
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    (out.with_suffix(".log")).write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: stage0_throughput.py exited {done.returncode}; log: {out.with_suffix('.log')}")
    return json.loads(out.read_text())


def levels(report: dict) -> dict[str, list[float]]:
    """"gen x concurrency" -> every timed run's frames/s in one report."""
    speech = report["speech_lm"]
    return {f"{gen} x {n}": level["runs_frames_per_s"] for gen, by_n in speech.items() if gen != "digest"
            for n, level in by_n.items() if isinstance(level, dict) and "runs_frames_per_s" in level}


def summary(runs: dict[str, dict[str, list[float]]]) -> dict:
    """{build: {level: runs}} -> per level, each build's median and spread, and new / base."""
    out = {}
    for level in runs["new"]:
        stats = {}
        for build in BUILDS:
            rates = runs[build][level]
            median = statistics.median(rates)
            stats[build] = {"frames_per_s": rates, "median": median, "spread": (max(rates) - min(rates)) / median}
        change = stats["new"]["median"] / stats["base"]["median"] - 1
        noise = max(stats["base"]["spread"], stats["new"]["spread"])
        out[level] = stats | {"new_over_base": change, "within_noise": abs(change) <= noise}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the base build's source tree")
    ap.add_argument("--out", required=True)
    ap.add_argument("--rounds", type=int, default=2, help="base then new, this many times")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run (stage0_throughput --tiny, small levels)")
    ap.add_argument("throughput_args", nargs="*", help="after --: stage0_throughput.py's own arguments")
    args = ap.parse_args()
    extra = args.throughput_args + (["--tiny", "--concurrency", "2", "4", "--gen-len", "8", "--repeats", "2"] if args.tiny else [])
    trees = {"base": Path(args.base).resolve(), "new": ROOT}
    out = Path(args.out)
    runs: dict[str, dict[str, list[float]]] = {build: {} for build in BUILDS}
    report = {"benchmark": "ab", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
              "settings": vars(args) | {"trees": {b: str(t) for b, t in trees.items()}}, "digests": {b: [] for b in BUILDS}}
    for round_ in range(args.rounds):
        for build in BUILDS:
            result = run_build(trees[build], extra, out.with_name(f"{out.stem}.{build}.{round_}.json"))
            report.setdefault("device", result.get("device"))
            report["digests"][build].append(result["speech_lm"].get("digest", {}).get("sha256"))
            for level, rates in levels(result).items():
                runs[build].setdefault(level, []).extend(rates)
            print(f"round {round_} {build}: " + ", ".join(f"{k} {statistics.median(v):.0f}" for k, v in levels(result).items()), flush=True)
            if runs["base"] and runs["new"]:  # after every run: a host taken back mid-way leaves a report
                report |= {"runs_done": {b: len(report["digests"][b]) for b in BUILDS}, "levels": summary(runs)}
                out.write_text(json.dumps(report, indent=2))
    for level, s in report["levels"].items():
        print(f"{level}: base {s['base']['median']:.0f} (spread {s['base']['spread']:.1%}), new {s['new']['median']:.0f} "
              f"(spread {s['new']['spread']:.1%}): {s['new_over_base']:+.1%}, {'within' if s['within_noise'] else 'outside'} noise")


if __name__ == "__main__":
    main()
