"""Stage 1's receive pass: the time to poll N waiting requests' next window keys once, as vllm-omni's
chunk adapter does every pass, while another thread of the process runs Python (stage 1's main
thread between its forwards).

    python benchmarks/recv_poll.py --out results.json [--waiting 16 64 96 128] [--repeats 7]

No model and no GPU: the stock `SharedMemoryConnector` and this project's `WindowConnector` read
keys by name (as the adapter does) whose windows have not come yet, each key polled once before
(the loop polls every pass), the passes a back-off apart. Per count of waiting keys, each
connector's median pass in ms, with that thread idle and busy. Prints and saves JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
import uuid

from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

from vllm_omni_speechlm.connector import LISTING_MAX_AGE_S, WindowConnector


def _pass_ms(reader, keys: list[str], repeats: int) -> float:
    for key in keys:  # the loop's earlier passes
        reader.get("0", "1", key)
    times = []
    for _ in range(repeats):
        time.sleep(2 * LISTING_MAX_AGE_S)  # the loop's back-off: each pass lists /dev/shm anew
        start = time.perf_counter()
        for key in keys:
            reader.get("0", "1", key)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _measured(reader, keys: list[str], repeats: int, busy: bool) -> float:
    stop = threading.Event()

    def spin() -> None:  # pure Python: it keeps the interpreter lock until the switch interval
        n = 0
        while not stop.is_set():
            n += 1

    thread = threading.Thread(target=spin) if busy else None
    if thread is not None:
        thread.start()
        time.sleep(0.02)
    try:
        return _pass_ms(reader, keys, repeats)
    finally:
        stop.set()
        if thread is not None:
            thread.join()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--waiting", type=int, nargs="+", default=[16, 64, 96, 128])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    report = {"benchmark": "recv_poll", "date": time.strftime("%Y-%m-%d"), "host": platform.node(),
              "cpu": platform.processor() or platform.machine(), "python": sys.version.split()[0],
              "switch_interval_s": sys.getswitchinterval(), "settings": vars(args), "pass_ms": {}}
    for n in args.waiting:
        keys = [f"recv-poll-{uuid.uuid4().hex}_0_{i}" for i in range(n)]
        row = {}
        for name, cls in (("stock", SharedMemoryConnector), ("window", WindowConnector)):
            for busy in (False, True):
                row[f"{name}, {'busy' if busy else 'idle'}"] = round(_measured(cls({"stage_id": 1}), keys, args.repeats, busy), 3)
        report["pass_ms"][str(n)] = row
        print(n, json.dumps(row), flush=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
