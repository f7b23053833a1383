"""Where a streamed window's time goes between stage 0 and stage 1, per serve_load level: a
summary of the `window trace:` lines (vllm_omni_speechlm/window_trace.py) of a server started
with SPEECHLM_TRACE_WINDOWS=1.

    python benchmarks/window_trace.py --log speech.log --serve-load serve_load.json [--out trace.json]

Per level (the lines between the level's first request and its end): stage 1's forwards, windows
per forward, the interval between forwards, the wait from a window's making in stage 0 to the
start of the forward that decoded it (largest in each forward), and the decode time, p50 / p90;
and, from stage 0, how long after an answer's arrival its first window left and after how many
steps, the level's first steps (ms, rows, tokens, CPU ms each), the step's wall and CPU time, and the
steps by kind (a prompt joined, rows left, a codec forward beside it, none; the last two split by
whether the update before handed windows over), and the worker's wait, `execute_model` and
`sample_tokens` per step kind (multiprocess executor); how long after its
request the API server sent an answer's first bytes; and how late the API server's event loop
woke (the per-second medians' median, the largest).
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
from pathlib import Path

LINE = re.compile(r"window trace: t=([\d.]+) windows=(\d+) frames=(\d+) wait_ms_min=([-\d.]+) wait_ms_max=([-\d.]+) "
                  r"decode_ms=([\d.]+)(?: queue_ms_max=([-\d.]+))?")  # older logs have no queue_ms_max
FIRST = re.compile(r"first window trace: t=([\d.]+) since_arrival_ms=([-\d.]+) steps=(\d+)")
BYTES = re.compile(r"first bytes trace: t=([\d.]+) since_request_ms=([-\d.]+)")
WORKER = re.compile(r"worker step trace: t=([\d.]+) rows=(\d+) tokens=(\d+) idle_ms=([-\d.]+) execute_ms=([\d.]+) sample_ms=([\d.]+)")
STEP = re.compile(r"step trace: t=([\d.]+) ms=([\d.]+) rows=(\d+) tokens=(\d+)(?: cpu_ms=([\d.]+) proc_cpu_ms=([\d.]+))?"
                  r"(?: handed=(\d+) update_ms=([\d.]+))?")  # older logs have fewer fields
LAG = re.compile(r"event loop trace: t=([\d.]+) late_ms_p50=([-\d.]+) late_ms_max=([-\d.]+)")
FIRST_STEPS = 30


def _pct(values: list[float], q: float) -> float | None:
    return statistics.quantiles(values, n=100, method="inclusive")[round(q * 100) - 1] if len(values) > 1 else (values[0] if values else None)


def _values(match: re.Match) -> tuple[float | None, ...]:
    return tuple(None if g is None else float(g) for g in match.groups())


def summarize(lines: list[tuple[float, ...]], firsts: list[tuple[float, ...]], sends: list[tuple[float, ...]],
              lags: list[tuple[float, ...]], steps: list[tuple[float, ...]] = (), worker: list[tuple[float, ...]] = ()) -> dict:
    t = [x[0] for x in lines]
    gaps = [b - a for a, b in zip(t, t[1:])]
    out = {"forwards": len(lines), "windows_per_forward": statistics.fmean(x[1] for x in lines) if lines else None}
    steps = list(steps)[1:]  # the level's first step also waited while the server was idle
    cpu, proc_cpu = ([x[i] for x in steps if x[i] is not None] for i in (4, 5))  # older logs have no CPU times
    for name, values in (("interval_ms", [g * 1e3 for g in gaps]), ("wait_ms_max", [x[4] for x in lines]),
                         ("decode_ms", [x[5] for x in lines]), ("queue_ms_max", [x[6] for x in lines if x[6] is not None]),
                         ("first_window_ms", [x[1] for x in firsts]), ("first_window_steps", [x[2] for x in firsts]),
                         ("first_bytes_ms", [x[1] for x in sends]), ("step_ms", [x[1] for x in steps]),
                         ("step_cpu_ms", cpu), ("step_proc_cpu_ms", proc_cpu)):
        out[name] = {"p50": _pct(values, 0.5), "p90": _pct(values, 0.9)}
    # ms, rows, tokens (and the CPU ms of the scheduler's thread and of the process)
    out["first_steps"] = [[round(x[1], 1), int(x[2]), int(x[3]), *(round(c, 1) for c in x[4:6] if c is not None)]
                          for x in steps[:FIRST_STEPS]]
    out["event_loop_late_ms"] = {"p50": _pct([x[1] for x in lags], 0.5), "max": max((x[2] for x in lags), default=None)}
    out["step_kinds"] = step_kinds(steps, lines)
    if worker:
        out["worker_kinds"] = worker_kinds(list(worker)[1:], lines)
    return out


def step_kinds(steps: list[tuple[float, ...]], forwards: list[tuple[float, ...]]) -> dict:
    """Stage 0's steps by what else happened in them, the first that applies: a prompt joined
    (tokens > rows), rows left (fewer than the step before), a forward of stage 1 ran in part of
    it (the two processes share the GPU), or none: count and ms p50 / p90 each. `by_hand_off`
    (newer logs): the last two kinds split by whether the scheduler's update inside the step
    handed windows to stage 1 (its CPU work, not the GPU's), with that update's ms.
    `codec_ms_per_s`: stage 1's forwards per second of the steps' span."""
    spans, ends = _forward_spans(forwards)
    kinds: dict[str, list[float]] = {"join": [], "leave": [], "codec": [], "plain": []}
    handed: dict[str, list[tuple[float, float]]] = {f"{k}, {h}": [] for k in ("codec", "plain") for h in ("handed", "none handed")}
    for before, step in zip([None, *steps], steps):
        t, ms, rows, tokens = step[:4]
        kind = _kind(t - ms / 1e3, t, rows, tokens, before and before[2], spans, ends)
        kinds[kind].append(ms)
        if len(step) > 7 and step[6] is not None and kind in ("codec", "plain"):
            handed[f"{kind}, {'handed' if step[6] else 'none handed'}"].append((ms, step[7]))
    span_s = steps[-1][0] - steps[0][0] + steps[0][1] / 1e3 if steps else 0.0
    out = {k: {"n": len(v), "p50": _pct(v, 0.5), "p90": _pct(v, 0.9)} for k, v in kinds.items()}
    out["by_hand_off"] = {k: {"n": len(v), "p50": _pct([m for m, _ in v], 0.5), "update_ms_p50": _pct([u for _, u in v], 0.5)}
                          for k, v in handed.items() if v}
    return out | {"codec_ms_per_s": sum(b - a for a, b in spans) * 1e3 / span_s if span_s else None}


def _forward_spans(forwards: list[tuple[float, ...]]) -> tuple[list[tuple[float, float]], list[float]]:
    """Stage 1's forwards as (start, end) in order, and their ends (it runs one at a time)."""
    spans = sorted((f[0] - f[5] / 1e3, f[0]) for f in forwards)
    return spans, [b for _, b in spans]


def _kind(start: float, end: float, rows: int, tokens: int, rows_before: int | None, spans: list, ends: list) -> str:
    i = bisect.bisect_right(ends, start)  # the first forward that ends in or after the step
    overlaps = i < len(spans) and spans[i][0] < end
    return ("join" if tokens > rows else "leave" if rows_before is not None and rows < rows_before
            else "codec" if overlaps else "plain")


def worker_kinds(worker: list[tuple[float, ...]], forwards: list[tuple[float, ...]]) -> dict:
    """Stage 0's worker per step kind (as `step_kinds`, over the worker's own busy span): count
    and the p50 ms it waited for the step, ran `execute_model` and ran `sample_tokens`."""
    spans, ends = _forward_spans(forwards)
    kinds: dict[str, list[tuple[float, ...]]] = {"join": [], "leave": [], "codec": [], "plain": []}
    for before, (t, rows, tokens, idle, execute, sample) in zip([None, *worker], worker):
        kinds[_kind(t - (execute + sample) / 1e3, t, rows, tokens, before and before[1], spans, ends)].append((idle, execute, sample))
    return {k: {"n": len(v), **{f"{name}_ms_p50": _pct([x[j] for x in v], 0.5) for j, name in enumerate(("idle", "execute", "sample"))}}
            for k, v in kinds.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--log", required=True, help="the speech server's log")
    ap.add_argument("--serve-load", required=True, help="serve_load.py's JSON of the same run")
    ap.add_argument("--out")
    args = ap.parse_args()
    text = Path(args.log).read_text(errors="replace").splitlines()
    traces = [[_values(m) for m in map(pattern.search, text) if m] for pattern in (LINE, FIRST, BYTES, LAG, STEP, WORKER)]
    report = {}
    for level, stats in json.loads(Path(args.serve_load).read_text())["speech"].items():
        start = stats.get("sent_wall")
        if start is None:
            continue
        report[level] = summarize(*([x for x in rows if start <= x[0] <= start + stats["wall_s"]] for rows in traces))
        print(level, json.dumps(report[level]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
