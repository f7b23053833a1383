"""`benchmarks/ab.py --tiny`: two builds' stage-0 runs interleaved, each from its own tree, summed up
per level; and the noise rule on made-up rates."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

from ab import summary  # noqa: E402


def test_a_difference_counts_only_past_the_larger_spread():
    runs = {"base": {"a": [100.0, 104.0], "b": [100.0, 101.0]}, "new": {"a": [98.0, 99.0], "b": [96.0, 97.0]}}
    levels = summary(runs)
    assert levels["a"]["within_noise"] and round(levels["a"]["new_over_base"], 4) == round(98.5 / 102 - 1, 4)
    assert not levels["b"]["within_noise"] and levels["b"]["base"]["spread"] == 1 / 100.5


def test_tiny_run_alternates_the_builds(tmp_path):
    out = tmp_path / "ab.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "ab.py"), "--base", str(ROOT), "--tiny", "--rounds", "1", "--out", str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["levels"]) == {"8 x 2", "8 x 4"} and report["runs_done"] == {"base": 1, "new": 1}
    for level in report["levels"].values():
        assert all(len(level[build]["frames_per_s"]) == 2 and level[build]["median"] > 0 for build in ("base", "new"))
    assert report["digests"]["base"] == report["digests"]["new"] and None not in report["digests"]["base"]  # one tree twice
    assert sorted(p.name for p in tmp_path.glob("ab.*.json")) == ["ab.base.0.json", "ab.new.0.json"]
