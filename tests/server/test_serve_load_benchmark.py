"""`benchmarks/serve_load.py`: the listener model, and a `--tiny` run of both servers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    "chunks, buffer_s, stalled, first_gap",
    [
        ([(1.0, 0.5), (1.4, 0.5), (1.9, 0.5)], 0.0, 0.0, None),  # each chunk before the last one plays out
        ([(1.0, 0.5), (2.0, 0.5)], 0.0, 0.5, 0.5),  # dry from 1.5 to 2.0
        ([(1.0, 0.5), (2.0, 0.5)], 0.5, 0.0, 0.5),  # a 0.5 s buffer covers it
        ([(1.0, 0.1), (1.05, 0.1), (2.0, 0.1), (3.0, 0.1)], 0.2, 0.6 + 0.9, 0.2),  # plays 1.2-1.4, dry to 2.0, plays to 2.1, dry to 3.0
        ([], 0.0, 0.0, None),
    ],
)
def test_a_listener_stalls_when_its_audio_plays_out_before_the_next_chunk(chunks, buffer_s, stalled, first_gap):
    """`first_gap` is the first-byte listener's: the audio it played before it first ran dry."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_load import first_gap_s, stall_s

    assert stall_s(chunks, buffer_s) == pytest.approx(stalled)
    assert first_gap_s(chunks) == (None if first_gap is None else pytest.approx(first_gap))


def test_a_text_completion_that_streams_under_two_tokens_is_an_error_and_says_so():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_load import text_summary

    done = {"first_token_s": 0.1, "tokens": 9, "decode_tok_s": 50.0}
    summary = text_summary([{"error": "HTTP 500"}, {"first_token_s": 0.1, "tokens": 1, "decode_tok_s": None}, done], 2.0)
    assert summary["errors"] == 2 and summary["error_samples"] == ["HTTP 500", "1 tokens streamed"]
    assert summary["decode_tok_s_per_request_p50"] == 50.0 and summary["tokens_per_wall_s"] == 4.5


def test_a_level_stops_when_the_server_goes_down(monkeypatch):
    """A dead engine leaves streamed requests open: the level ends on the first failed /health
    instead of waiting out the client timeout."""
    import asyncio
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serve_load

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # /health fails; anything else never answers
            if self.path != "/health":
                threading.Event().wait(3)
            self.send_response(500)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    monkeypatch.setattr(serve_load, "HEALTH_EVERY_S", 0.1)
    try:
        with pytest.raises(serve_load.ServerDown, match="HTTP 500"):
            asyncio.run(asyncio.wait_for(serve_load.run_level(f"http://127.0.0.1:{server.server_port}", 2,
                                                              lambda client, i: client.get("/answer"), None), 10))
    finally:
        server.shutdown()
        server.server_close()


def _steady_level(steady, n: int, answer_s) -> tuple[list[list[dict]], int]:
    """n clients of `steady` streaming fake answers of `answer_s(i)` seconds -> each client's
    measured answers ({"i", "sent", "open": the fewest answers open at its send and its end}) and
    how many answers were sent in all."""
    import asyncio
    import time

    open_now, sent_in_all = [0], [0]

    async def answer(client, i):
        open_now[0] += 1
        sent_in_all[0] += 1
        sent, beside = time.perf_counter() - start, open_now[0]
        await asyncio.sleep(answer_s(i))
        beside = min(beside, open_now[0])
        open_now[0] -= 1
        return {"i": i, "sent": sent, "open": beside}

    async def level():
        return await asyncio.gather(*(steady.client(answer, None, i, start) for i in range(n)))

    start = time.perf_counter()
    return asyncio.run(level()), sent_in_all[0]


def test_steady_clients_keep_n_answers_open_around_every_measured_one():
    """Clients join spread over join_s; each answer sent in the window after the last join is
    measured, and stays beside n - 1 others from its send to its end."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_load import Steady

    n, steady = 4, Steady(4, join_s=0.4, window_s=0.5)
    per_client, sent = _steady_level(steady, n, lambda i: 0.15 + 0.02 * (i % 3))
    measured = [a for answers in per_client for a in answers]
    assert steady.opens_at == pytest.approx(0.3)
    assert len(measured) >= n * 2 and not steady.open
    assert all(0.3 <= a["sent"] < 0.8 and a["open"] == n for a in measured), measured
    assert sent > len(measured)  # the joins before the window and the answers after it are not measured


def test_steady_clients_each_measure_an_answer_when_answers_outlast_the_window():
    """A server slower than real time: an answer takes longer than the window, yet every client
    measures one, beside n - 1 others, and the level's send span covers them."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from serve_load import Steady

    n, steady = 3, Steady(3, join_s=0.3, window_s=0.1)
    per_client, _ = _steady_level(steady, n, lambda i: 0.4)
    assert all(len(answers) == 1 for answers in per_client), per_client
    assert all(a["open"] == n for answers in per_client for a in answers)
    assert steady.sends_s > steady.window_s and not steady.open and not steady.unmeasured


def test_tiny_run_streams_to_concurrent_listeners_and_times_the_text_lm(tmp_path):
    out = tmp_path / "serve_load.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "serve_load.py"), "--tiny", "--out", str(out),
           "--workdir", str(tmp_path / "work"), "--concurrency", "2", "--gen-len", "30", "--arrivals", "burst", "steady"]
    samples = tmp_path / "stacks"  # every process sampled while a level runs (benchmarks/stack_sampler)
    env = os.environ | {"PYTHONUNBUFFERED": "1", "VLLM_OMNI_EVENT_DRIVEN_ORCH": "0", "SPEECHLM_STACK_SAMPLES": str(samples),
                        "SPEECHLM_TRACE_WINDOWS": "1", "VLLM_LOGGING_LEVEL": "INFO",  # the trace lines are INFO
                        "PYTHONPATH": os.pathsep.join([str(ROOT / "benchmarks" / "stack_sampler"), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["settings"]["env"]["VLLM_OMNI_EVENT_DRIVEN_ORCH"] == "0"  # the server's, recorded
    speech, text = report["speech"]["2"], report["text"]["2"]
    assert speech["errors"] == speech["without_audio"] == 0, speech
    assert speech["audio_s_per_request"] >= report["settings"]["audio_s_per_answer"]  # eos was masked that long
    assert 0 < speech["first_audio_p50_s"] <= speech["first_audio_max_s"] and speech["rtf_mean"] > 0
    assert 0.0 <= speech["stall_free"] <= speech["stall_free_buffered"] <= 1.0
    arrivals = [at for at, _ in speech["first_chunks"]]  # one listener's timeline
    assert arrivals == sorted(arrivals) and all(seconds > 0 for _, seconds in speech["first_chunks"])
    assert text["errors"] == 0 and text["decode_tok_s_per_request_p50"] > 0
    for steady in (report["speech"]["2 steady"], report["text"]["2 steady"]):  # two kept streaming
        assert steady["requests"] >= 2 and steady["errors"] == 0, steady
    assert report["speech"]["2 steady"]["without_audio"] == 0
    # What the server saw: stage 0 stepped a batch of both answers, stage 1 decoded windows.
    assert speech["server"]["steps[0]"] >= 30 and speech["server"]["tokens_per_step[0]"] > 1
    assert speech["server"]["steps[1]"] > 0 and speech["server"]["step_s[0]"] > 0
    assert text["server"]["steps"] >= 30 and report["first_requests"]["speech"]["errors"] == 0
    # The traced server's lines, as window_trace.py reads them: stage 0's steps and its worker's.
    sys.path.insert(0, str(ROOT / "benchmarks"))
    trace = tmp_path / "trace.json"
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "window_trace.py"), "--log", str(tmp_path / "work" / "speech.log"),
                    "--serve-load", str(out), "--out", str(trace)], check=True, capture_output=True, timeout=120)
    level = json.loads(trace.read_text())["2"]  # both answers whole (a slow machine's steady level may see no forward)
    assert sum(k["n"] for k in level["worker_kinds"].values()) > 10 and level["forwards"] > 0
    assert sum(v["n"] for k, v in level["step_kinds"]["by_hand_off"].items() if k.endswith(", handed")) > 0
    # The level's samples: some process stepped the speech LM (stage 0's worker) while it ran.
    from stack_samples import summarize

    level = ("2 burst", "2")  # the level's first second, then the rest
    stepping = [p for p, phases in summarize(samples, top=200, min_samples=1).items()
                if any("execute_model" in label for name in level for t in phases.get(name, {}).values()
                       for label, _ in t["inclusive"])]
    assert stepping and not (samples / "phase").exists(), sorted(summarize(samples, min_samples=1))
    assert any("2 burst" in phases for phases in summarize(samples, min_samples=1).values())  # the level's first second
