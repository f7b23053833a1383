"""Per-window timing of the streaming path, for diagnosis (`SPEECHLM_TRACE_WINDOWS=1` in the
server's environment; off by default, and then nothing is added to a window or logged).

Stage 0's window gate stamps each window's rows with the wall clock it handed them over at
(`HANDED_KEY`), and the processor, on the adapter's save thread, the window with the time it cut it
(`SENT_KEY`; integers in microseconds, carried like the output rate). Stage 1 logs one line per
forward: how many windows, how long each waited on stage 0's save thread (`queue_ms_max`), how
long since each was cut (the hand-off: connector, polling, stage 1's scheduling) and how long the
decode took. Stage 0 logs every step (the time since the step before, its rows and tokens, the CPU
time of its scheduler's thread and of the process, what the update before it took and handed to
stage 1), and its worker's share of each (how long it waited, ran `execute_model` and
`sample_tokens`), each request as its scheduler takes it in
(the time since its arrival in the API server) and, per answer, how long after its arrival its
first window left. The API server logs when each streamed answer's first bytes left and, from its
first speech request on, once a second how late its event loop woke: the loop that streams every
answer, whose interpreter lock the thread relaying the stages' outputs (vllm-omni's orchestrator)
shares.
`benchmarks/window_trace.py` summarizes the lines of a server log.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

ENABLED = os.environ.get("SPEECHLM_TRACE_WINDOWS") == "1"
SENT_KEY = "window_sent_us"
HANDED_KEY = "window_handed_us"
LINE = "window trace:"
FIRST_LINE = "first window trace:"
LAG_LINE = "event loop trace:"
BYTES_LINE = "first bytes trace:"
STEP_LINE = "step trace:"
WORKER_LINE = "worker step trace:"
ADMIT_LINE = "admit trace:"
LAG_PERIOD_S = 0.01
logger = logging.getLogger(__name__)


def handed() -> dict[str, int]:
    """The gate's rows of a window: when they were handed over ({} when tracing is off)."""
    return {HANDED_KEY: time.time_ns() // 1000} if ENABLED else {}


def stamp(payload: Any = None) -> dict[str, int]:
    """A window's extra information: when it was cut, and when the gate handed its rows over (the
    gate's `payload`; 0: not known) ({} when tracing is off). Always both keys: stage 1 merges each
    window's keys into its request's information, so a missing one would keep the window before's."""
    if not ENABLED:
        return {}
    at = payload.get(HANDED_KEY) if isinstance(payload, dict) else None
    return {SENT_KEY: time.time_ns() // 1000, HANDED_KEY: at or 0}


def sent_us(info: Any, key: str = SENT_KEY) -> int | None:
    value = info.get(key) if isinstance(info, dict) else None
    if isinstance(value, list):  # scalars may arrive wrapped
        value = value[0] if value else None
    return None if value is None else int(value)


def log_forward(infos: list[dict], started: float, frames: int) -> None:
    """Stage 1, after a forward that began at `started` (time.time()) and decoded `frames`."""
    stamps = [(s, sent_us(i, HANDED_KEY)) for i in infos if (s := sent_us(i)) is not None]
    if not stamps:
        return
    done = time.time()
    sent = [s for s, _ in stamps]
    waits = sorted(started * 1e3 - s / 1e3 for s in sent)
    queued = [(s - h) / 1e3 for s, h in stamps if h]
    logger.info("%s t=%.3f windows=%d frames=%d wait_ms_min=%.1f wait_ms_max=%.1f decode_ms=%.1f queue_ms_max=%.1f",
                LINE, done, len(sent), frames, waits[0], waits[-1], (done - started) * 1e3, max(queued, default=0.0))


_last_step = (0.0, 0.0, 0.0)
_update = [0.0, 0.0, 0]  # the last update's start and end (time.time()), the payloads handed before it


def log_step(tokens: int, rows: int, handed: int = 0) -> None:
    """Stage 0, as a step's output arrives (before the scheduler's update of it); with the CPU time
    the scheduler's thread and the whole process spent since the step before (a thread's wall time
    beyond its CPU time is waiting: for the interpreter lock, or blocked), and what the update of
    the step before (inside this interval) took: its ms and the payloads it handed to the codec
    stage (`handed`: the gate's count so far)."""
    global _last_step
    if ENABLED:
        now = (time.time(), time.thread_time(), time.process_time())
        if _last_step[0]:
            wall, cpu, proc = ((a - b) * 1e3 for a, b in zip(now, _last_step))
            logger.info("%s t=%.3f ms=%.1f rows=%d tokens=%d cpu_ms=%.1f proc_cpu_ms=%.1f handed=%d update_ms=%.2f",
                        STEP_LINE, now[0], wall, rows, tokens, cpu, proc, handed - _update[2],
                        (_update[1] - _update[0]) * 1e3)
        _last_step = now
        _update[0], _update[2] = now[0], handed


def updated() -> None:
    """Stage 0, as the scheduler's update of a step ends."""
    if ENABLED:
        _update[1] = time.time()


_worker = [0.0, 0.0, 0.0]  # perf_counter: the last step's end, this step's execute_model start and end


def worker_executing() -> None:
    """Stage 0's worker, as `execute_model` starts."""
    _worker[1] = time.perf_counter()


def worker_executed() -> None:
    """... and as it returns."""
    _worker[2] = time.perf_counter()


def log_worker_step(rows: int, tokens: int) -> None:
    """Stage 0's worker, as `sample_tokens` returns: one line per step with how long the worker
    waited for it since the step before, and ran `execute_model` (inputs, forward) and
    `sample_tokens` (logits' tail, sampling, outputs). Under the multiprocess executor these are
    the worker's own; the step lines are the engine core's."""
    now = time.perf_counter()
    last, start, executed = _worker
    if last and start > last:  # not a step that only sampled
        logger.info("%s t=%.3f rows=%d tokens=%d idle_ms=%.2f execute_ms=%.2f sample_ms=%.2f", WORKER_LINE, time.time(),
                    rows, tokens, (start - last) * 1e3, (executed - start) * 1e3, (now - executed) * 1e3)
    _worker[0] = now


def log_admitted(arrival_time: float | None, started: float) -> None:
    """Stage 0's scheduler, once it took a request in (from `started`, time.perf_counter())."""
    if ENABLED and arrival_time:
        now = time.time()
        logger.info("%s t=%.3f since_arrival_ms=%.1f add_ms=%.2f", ADMIT_LINE, now, (now - arrival_time) * 1e3,
                    (time.perf_counter() - started) * 1e3)


def log_first_window(arrival_time: float | None, steps: int) -> None:
    """Stage 0, as an answer's first window leaves: since its arrival (time.time()) and its steps."""
    if ENABLED and arrival_time:
        now = time.time()
        logger.info("%s t=%.3f since_arrival_ms=%.1f steps=%d", FIRST_LINE, now, (now - arrival_time) * 1e3, steps)


def first_bytes_logged(response: Any, since: float) -> Any:
    """The API server: a streamed response whose first bytes are logged, with the time since
    the request came (`since`, time.time())."""
    if ENABLED and hasattr(response, "body_iterator"):
        response.body_iterator = _FirstBytesLogged(response.body_iterator, since)
    return response


class _FirstBytesLogged:
    def __init__(self, body: Any, since: float):
        self._body, self._since = body, since

    def __aiter__(self) -> _FirstBytesLogged:
        return self

    async def __anext__(self) -> Any:
        chunk = await self._body.__anext__()
        if self._since and chunk:
            now = time.time()
            logger.info("%s t=%.3f since_request_ms=%.1f", BYTES_LINE, now, (now - self._since) * 1e3)
            self._since = 0.0
        return chunk

    async def aclose(self) -> None:
        close = getattr(self._body, "aclose", None)
        if close is not None:
            await close()


_lag_watch: asyncio.Task | None = None


def watch_event_loop() -> None:
    """The API server, on a speech request: start logging its event loop's lateness (once)."""
    global _lag_watch
    if ENABLED and _lag_watch is None:
        _lag_watch = asyncio.get_running_loop().create_task(_log_lateness())


async def _log_lateness() -> None:
    """Every LAG_PERIOD_S a wake-up; once a second the median and largest lateness."""
    late, since = [], time.monotonic()
    while True:
        asleep = time.monotonic()
        await asyncio.sleep(LAG_PERIOD_S)
        now = time.monotonic()
        late.append((now - asleep - LAG_PERIOD_S) * 1e3)
        if now - since >= 1.0:
            late.sort()
            logger.info("%s t=%.3f late_ms_p50=%.1f late_ms_max=%.1f", LAG_LINE, time.time(), late[len(late) // 2], late[-1])
            late, since = [], now
