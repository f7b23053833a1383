"""The window trace (vllm_omni_speechlm/window_trace.py): off, a window carries nothing extra; on,
stage 1's line parses in benchmarks/window_trace.py and gives each window's wait and the decode."""

from __future__ import annotations

import logging
import re
import sys
import time
from pathlib import Path

import pytest

from vllm_omni_speechlm import window_trace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_off_adds_nothing(monkeypatch):
    monkeypatch.setattr(window_trace, "ENABLED", False)
    assert window_trace.stamp() == {}


def test_a_window_without_a_hand_over_time_still_carries_the_key(monkeypatch):
    """Stage 1 merges each window's keys into its request's information: a window the gate did not
    stamp must overwrite the window before's hand-over time, not inherit it."""
    monkeypatch.setattr(window_trace, "ENABLED", True)
    assert window_trace.stamp(None)[window_trace.HANDED_KEY] == 0
    assert window_trace.stamp({window_trace.HANDED_KEY: 7})[window_trace.HANDED_KEY] == 7


def test_a_forward_line_gives_the_waits_and_the_decode(monkeypatch, caplog):
    from window_trace import LINE, summarize

    monkeypatch.setattr(window_trace, "ENABLED", True)
    now = time.time()
    infos = [{window_trace.SENT_KEY: [int((now - 0.030) * 1e6)], window_trace.HANDED_KEY: int((now - 0.042) * 1e6)},
             {window_trace.SENT_KEY: int((now - 0.010) * 1e6), window_trace.HANDED_KEY: 0}, {}]  # 0: not known
    with caplog.at_level(logging.INFO, logger=window_trace.__name__):
        window_trace.log_forward(infos, started=now, frames=120)
    [line] = [r.getMessage() for r in caplog.records]
    t, windows, frames, wait_min, wait_max, decode, queue = map(float, LINE.search(line).groups())
    assert (windows, frames) == (2, 120)  # the untraced window is not counted
    assert wait_min == pytest.approx(10, abs=0.2) and wait_max == pytest.approx(30, abs=0.2)
    assert queue == pytest.approx(12, abs=0.2)  # handed over 12 ms before it was cut
    assert 0 <= decode < 1000 and t >= now - 1e-3  # logged to the millisecond
    summary = summarize([(t, windows, frames, wait_min, wait_max, decode, queue), (t + 0.05, 1, 60, 1.0, 1.0, 2.0, None)], [], [], [])
    assert summary["forwards"] == 2 and summary["windows_per_forward"] == 1.5
    assert summary["interval_ms"]["p50"] == pytest.approx(50, abs=0.01)
    assert summary["queue_ms_max"]["p50"] == queue  # a line of an older log has none


def test_a_first_window_line_gives_the_time_since_arrival(monkeypatch, caplog):
    from window_trace import FIRST, summarize

    monkeypatch.setattr(window_trace, "ENABLED", True)
    with caplog.at_level(logging.INFO, logger=window_trace.__name__):
        window_trace.log_first_window(time.time() - 0.120, steps=12)
        window_trace.log_first_window(None, steps=3)  # no arrival time: nothing to say
    [line] = [r.getMessage() for r in caplog.records]
    first = tuple(map(float, FIRST.search(line).groups()))
    assert first[1] == pytest.approx(120, abs=5) and first[2] == 12
    assert summarize([], [first], [], [])["first_window_steps"]["p50"] == 12


def test_the_event_loop_line_gives_its_lateness(monkeypatch, caplog):
    """A loop kept busy 50 ms once in a second: the median wake-up is on time, the largest late by most of it."""
    import asyncio

    from window_trace import LAG, summarize

    async def busy_once() -> None:
        window_trace.watch_event_loop()
        window_trace.watch_event_loop()  # once per process
        await asyncio.sleep(0.3)
        time.sleep(0.05)  # holds the loop
        await asyncio.sleep(0.8)
        window_trace._lag_watch.cancel()

    monkeypatch.setattr(window_trace, "ENABLED", True)
    monkeypatch.setattr(window_trace, "_lag_watch", None)
    with caplog.at_level(logging.INFO, logger=window_trace.__name__):
        asyncio.run(busy_once())
    [line] = [r.getMessage() for r in caplog.records]
    lag = tuple(map(float, LAG.search(line).groups()))
    assert lag[1] < 10 and 35 < lag[2] < 100  # woken 40-50 ms late: its 10 ms sleep had begun
    assert summarize([], [], [], [lag])["event_loop_late_ms"] == {"p50": lag[1], "max": lag[2]}


def test_a_streamed_answer_logs_when_its_first_bytes_left(monkeypatch, caplog):
    """Once per answer, at its first non-empty chunk; the body is still read whole and closed."""
    import asyncio

    from window_trace import BYTES, summarize

    class Body:
        closed = False

        def __init__(self):
            self.chunks = iter([b"", b"pcm1", b"pcm2"])

        def __aiter__(self):
            return self

        async def __anext__(self):
            await asyncio.sleep(0.01)
            try:
                return next(self.chunks)
            except StopIteration:
                raise StopAsyncIteration from None

        async def aclose(self):
            Body.closed = True

    async def stream():
        response = type("Response", (), {"body_iterator": Body()})()
        window_trace.first_bytes_logged(response, time.time() - 0.1)
        chunks = [c async for c in response.body_iterator]
        await response.body_iterator.aclose()
        return chunks

    monkeypatch.setattr(window_trace, "ENABLED", True)
    with caplog.at_level(logging.INFO, logger=window_trace.__name__):
        assert asyncio.run(stream()) == [b"", b"pcm1", b"pcm2"]
    [line] = [r.getMessage() for r in caplog.records]
    sent = tuple(map(float, BYTES.search(line).groups()))
    assert 115 <= sent[1] < 1000 and Body.closed  # the request's 100 ms and two reads
    assert summarize([], [], [sent], [])["first_bytes_ms"]["p50"] == sent[1]


def test_a_step_line_gives_the_time_since_the_step_before_and_the_cpu_time(monkeypatch, caplog):
    """Steps ~30 ms apart, the thread busy for ~20 ms of each: the lines say so."""
    from window_trace import STEP, summarize

    monkeypatch.setattr(window_trace, "ENABLED", True)
    monkeypatch.setattr(window_trace, "_last_step", (0.0, 0.0, 0.0))
    with caplog.at_level(logging.INFO, logger=window_trace.__name__):
        for rows, handed in ((2, 0), (2, 0), (34, 3)):  # the second update hands 3 windows over
            window_trace.log_step(tokens=rows * 3, rows=rows, handed=handed)
            busy = time.thread_time() + 0.02
            while time.thread_time() < busy:
                pass
            window_trace.updated()  # the update took the ~20 ms of work
            time.sleep(0.01)
    steps = [tuple(map(float, STEP.search(r.getMessage()).groups())) for r in caplog.records]
    assert [s[2:4] for s in steps] == [(2, 6), (34, 102)]  # the first step has no step before it
    assert all(29 <= s[1] < 300 and 19 <= s[4] <= s[1] and s[5] >= s[4] - 1 for s in steps)
    assert [s[6] for s in steps] == [0, 3] and all(19 <= s[7] < s[1] for s in steps)
    summary = summarize([], [], [], [], steps)  # a level's first step waited while the server was idle
    assert summary["first_steps"] == [[round(steps[1][1], 1), 34, 102, round(steps[1][4], 1), round(steps[1][5], 1)]]
    assert summary["step_cpu_ms"]["p50"] == steps[1][4]


def test_an_admit_line_gives_the_time_since_arrival_and_the_scheduler_work(monkeypatch, caplog):
    monkeypatch.setattr(window_trace, "ENABLED", True)
    with caplog.at_level(logging.INFO, logger=window_trace.__name__):
        window_trace.log_admitted(time.time() - 0.3, started=time.perf_counter() - 0.002)
        window_trace.log_admitted(None, started=time.perf_counter())  # no arrival time: nothing to say
    [line] = [r.getMessage() for r in caplog.records]
    since, added = (float(x) for x in re.search(r"since_arrival_ms=([\d.]+) add_ms=([\d.]+)", line).groups())
    assert line.startswith(window_trace.ADMIT_LINE) and 295 < since < 400 and 1.9 < added < 100


def test_steps_are_told_apart_by_a_joining_prompt_rows_leaving_and_a_codec_forward_beside_them():
    from window_trace import step_kinds

    # (t, ms, rows, tokens, cpu, proc): steps ending at 1.010 .. 1.060 s
    steps = [(1.010, 10.0, 4, 4, 1, 1), (1.020, 10.0, 4, 4, 1, 1), (1.040, 20.0, 6, 90, 1, 1),
             (1.050, 10.0, 4, 4, 1, 1), (1.060, 10.0, 4, 4, 1, 1)]
    # stage 1: one forward of 5 ms ending at 1.058 (inside the last step), one long before
    forwards = [(0.5, 2, 60, 1.0, 1.0, 5.0, None), (1.058, 2, 60, 1.0, 1.0, 5.0, None)]
    kinds = step_kinds(steps, forwards)
    assert {k: v["n"] for k, v in kinds.items() if k in ("join", "leave", "codec", "plain")} == {
        "join": 1, "leave": 1, "codec": 1, "plain": 2}
    assert kinds["by_hand_off"] == {}  # older lines: no hand-off fields
    assert kinds["join"]["p50"] == 20.0 and kinds["codec"]["p50"] == 10.0
    assert kinds["codec_ms_per_s"] == pytest.approx(10.0 / 0.060)


def test_codec_and_plain_steps_are_split_by_whether_their_update_handed_windows_over():
    """A slow step beside a codec forward is the GPU's share or the hand-off's CPU work: the
    split tells them apart."""
    from window_trace import step_kinds

    # (t, ms, rows, tokens, cpu, proc, handed, update_ms)
    steps = [(1.010, 10.0, 4, 4, 1, 1, 0, 1.0), (1.022, 12.0, 4, 4, 1, 1, 2, 3.0), (1.030, 8.0, 4, 4, 1, 1, 0, 1.0),
             (1.044, 14.0, 4, 4, 1, 1, 1, 4.0), (1.053, 9.0, 4, 4, 1, 1, 0, 1.5)]
    forwards = [(1.043, 2, 60, 1.0, 1.0, 4.0, None)]  # beside the fourth step only
    split = step_kinds(steps, forwards)["by_hand_off"]
    assert split == {"codec, handed": {"n": 1, "p50": 14.0, "update_ms_p50": 4.0},
                     "plain, handed": {"n": 1, "p50": 12.0, "update_ms_p50": 3.0},
                     "plain, none handed": {"n": 3, "p50": 9.0, "update_ms_p50": 1.0}}


def test_the_worker_line_gives_its_wait_and_its_two_calls_and_the_summary_splits_them_by_kind(monkeypatch, caplog):
    """Stage 0's worker: the wait since the step before, execute_model and sample_tokens, each
    timed; `worker_kinds` reads them per step kind."""
    from window_trace import WORKER, worker_kinds

    monkeypatch.setattr(window_trace, "_worker", [0.0, 0.0, 0.0])
    with caplog.at_level(logging.INFO, logger=window_trace.__name__):
        for rows, tokens in ((4, 4), (4, 4), (6, 90)):  # the third step: a prompt joined
            time.sleep(0.004)  # waiting for the step
            window_trace.worker_executing()
            time.sleep(0.006)
            window_trace.worker_executed()
            time.sleep(0.002)
            window_trace.log_worker_step(rows, tokens)
    lines = [tuple(map(float, WORKER.search(r.getMessage()).groups())) for r in caplog.records]
    assert [x[1:3] for x in lines] == [(4, 4), (6, 90)]  # the first step has no step before it
    assert all(4 <= idle < 50 and 6 <= execute < 50 and 2 <= sample < 40 for *_, idle, execute, sample in lines)
    kinds = worker_kinds(lines, forwards=[])
    assert kinds["plain"]["n"] == kinds["join"]["n"] == 1 and kinds["join"]["execute_ms_p50"] == lines[1][4]
