"""Host time of stage 0's scheduler update per decode step with the windows handed over on its thread.

    python benchmarks/window_handoff.py --out results.json [--concurrency 64 128 256] [--step-ms 12] [--repeats 3]

No model and no GPU. Stage 0's scheduler (async variant, as on GPUs) over a tiny checkpoint's
config is driven as `scheduler_update.py` drives it, fed runner outputs of one audio frame per
request per step, `--step-ms` apart (the window gate times listeners by the clock). Per
concurrency it runs twice: with the shipped `bagpiper_streaming.yaml`'s window settings (vllm-omni's
chunk adapter, the window gate, the processor and the window connector, windows cut and written on
the scheduler's thread) and with no codec stage. A reader process takes every window with vllm-omni's
stock connector, as stage 1 would. Reported per setting, the median over `--repeats` runs (taken
in turns) of: the mean and median microseconds of `update_from_output` per step in the steady
decode window, and the windows handed over per step; and the difference per window. Prints and
saves JSON.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path

import torch
import yaml
from scheduler_update import _scheduler, _vllm_config
from vllm.plugins import load_general_plugins
from vllm.sampling_params import SamplingParams
from vllm_omni.outputs import OmniModelRunnerOutput
from vllm_omni.request import OmniRequest

from vllm_omni_speechlm import stage_configs
from vllm_omni_speechlm.connector import NAME, SHM_DIR
from vllm_omni_speechlm.frames import FrameRows, InterStageRows, StepOutputs
from vllm_omni_speechlm.make_tiny import make_tiny
from vllm_omni_speechlm.stage0.scheduler import PairedCFGAsyncScheduler

PROCESSOR = "vllm_omni_speechlm.stage_input_processors.speech_codec.speechlm2codec_async_chunk"


def _read_windows(prefix: str, stop) -> None:
    """Stage 1's part: take every window of `prefix` off /dev/shm with the stock connector."""
    from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

    reader = SharedMemoryConnector({"stage_id": 1})
    while not stop.is_set():
        for name in os.listdir(SHM_DIR):
            if name.startswith(prefix) and not name.endswith(".part"):
                reader.get("0", "1", name)
        time.sleep(0.002)


def _streaming(vllm_config) -> None:
    """Give stage 0's model config the async_chunk settings a streaming deploy gives it."""
    deploy = yaml.safe_load(Path(stage_configs.path("bagpiper_streaming.yaml")).read_text())
    extra = deploy["connectors"]["shm"]["extra"]
    settings = {"async_chunk": True, "stage_id": 0, "custom_process_next_stage_input_func": PROCESSOR,
                "stage_connector_config": {"name": NAME, "extra": extra}}
    for key, value in settings.items():
        object.__setattr__(vllm_config.model_config, key, value)


def _runner_output(scheduler, ids: list[str], generator: torch.Generator):
    """One frame per row, every stream a code of its own range (stream 0's is the sampled token)."""
    streams = scheduler.speech.streams
    host = torch.stack([torch.randint(s.vocab_start + 1, s.vocab_end, (len(ids),), generator=generator) for s in streams], 1)
    frames = FrameRows(host, [True] * len(ids))
    output = OmniModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                                   sampled_token_ids=[[t] for t in host[:, 0].tolist()],
                                   multimodal_outputs=StepOutputs(frames, None))
    output.inter_stage_outputs = InterStageRows(frames)
    return output


def _handed(scheduler) -> int:
    return scheduler._gate.handed_total if scheduler._gate is not None else 0


def _run(model_dir: str, n: int, streaming: bool, args) -> dict:
    gc.collect()
    vllm_config = _vllm_config(model_dir, args)
    prefix = f"handoff-{uuid.uuid4().hex[:8]}-"
    if streaming:
        _streaming(vllm_config)
    scheduler = _scheduler(PairedCFGAsyncScheduler, vllm_config)
    for i in range(n):
        params = SamplingParams(max_tokens=args.gen_len, ignore_eos=True)
        prompt = [(i + j) % 100 for j in range(args.prompt_len)]
        scheduler.add_request(OmniRequest(f"{prefix}{i}", prompt_token_ids=prompt, sampling_params=params,
                                          pooling_params=None, arrival_time=time.time()))
    generator = torch.Generator().manual_seed(0)
    update_us, handed, in_flight = [], [], []
    while scheduler.has_unfinished_requests() or in_flight:
        if scheduler.has_unfinished_requests():
            in_flight.append(scheduler.schedule())
        if len(in_flight) == 2 or not scheduler.has_unfinished_requests():
            output = in_flight.pop(0)
            runner_output = _runner_output(scheduler, list(output.num_scheduled_tokens), generator)
            before, start = _handed(scheduler), time.perf_counter()
            scheduler.update_from_output(output, runner_output)
            update_us.append((time.perf_counter() - start) * 1e6)
            handed.append(_handed(scheduler) - before)
            time.sleep(args.step_ms / 1e3)  # the step's GPU time, as the gate's pacer measures it
    window = slice(2, args.gen_len - 2)  # the decode steps with every request running
    result = {"update_us_mean": statistics.fmean(update_us[window]), "update_us_p50": statistics.median(update_us[window]),
              "windows_per_step": statistics.fmean(handed[window])}
    print(f"{n:4d} requests, {'windows' if streaming else 'no codec stage'}: update {result['update_us_mean']:7.0f} us "
          f"(p50 {result['update_us_p50']:7.0f}), {result['windows_per_step']:.2f} windows per step", flush=True)
    return result


def _median(runs: list[dict]) -> dict:
    return {key: statistics.median(run[key] for run in runs) for key in runs[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 128, 256])
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=300)
    parser.add_argument("--step-ms", type=float, default=12.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    load_general_plugins()
    stop = multiprocessing.get_context("spawn").Event()
    reader = multiprocessing.get_context("spawn").Process(target=_read_windows, args=("handoff-", stop), daemon=True)
    reader.start()
    results = {}
    try:
        with tempfile.TemporaryDirectory() as model_dir:
            make_tiny("bagpiper", model_dir, seed=0)
            for n in args.concurrency:
                runs = [(_run(model_dir, n, False, args), _run(model_dir, n, True, args)) for _ in range(args.repeats)]
                off, on = (_median([run[i] for run in runs]) for i in (0, 1))
                per_window = (on["update_us_mean"] - off["update_us_mean"]) / max(on["windows_per_step"], 1e-9)
                results[str(n)] = {"no_codec_stage": off, "windows": on, "us_per_window": per_window}
                print(f"{n:4d} requests: update {off['update_us_mean']:.0f} / {on['update_us_mean']:.0f} us without / with "
                      f"windows, {per_window:.0f} us per window handed over", flush=True)
    finally:
        time.sleep(0.2)  # the reader takes the last windows
        stop.set()
        reader.join(timeout=10)
    report = {"benchmark": "window_handoff", "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
              "host": platform.node(), "cpu": platform.processor() or platform.machine(),
              "python": platform.python_version(), "settings": vars(args), "results": results}
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
