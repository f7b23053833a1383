"""The scheduler's short path for steady decode rows (steady_rows.py) against vllm-omni's own
update: two real schedulers, one with the short path, get the same requests, aborts and sampled
tokens (eos, stop tokens, length caps, preemption under a small KV cache), and must emit the same
outputs and leave the same request states, step by step."""

import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.plugins import load_general_plugins
from vllm.sampling_params import SamplingParams
from vllm.v1.request import RequestStatus
from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler, OmniARScheduler
from vllm_omni.outputs import OmniModelRunnerOutput
from vllm_omni.request import OmniRequest

from conftest import scheduler_with_blocks
from vllm_omni_speechlm.stage0.steady_rows import SteadyRowsMixin

BLOCK = 16
VOCAB, EOS, STOP = 32, 7, 9  # sampled from a vocabulary of 32: requests stop early and often


class SteadyScheduler(SteadyRowsMixin, OmniARScheduler):
    pass


class SteadyAsyncScheduler(SteadyRowsMixin, OmniARAsyncScheduler):
    pass


@pytest.fixture(scope="module")
def vllm_config(tiny_bagpiper):
    load_general_plugins()
    model = ModelConfig(model=tiny_bagpiper, dtype="float32", max_model_len=96, skip_tokenizer_init=True)
    scheduler = SchedulerConfig(
        max_num_seqs=12, max_num_batched_tokens=512, max_model_len=96, is_encoder_decoder=False, enable_chunked_prefill=False
    )
    cache = CacheConfig(block_size=BLOCK, enable_prefix_caching=False)
    return VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=cache)


def _scheduler(cls, vllm_config, num_blocks: int):
    return scheduler_with_blocks(cls, vllm_config, num_blocks, BLOCK)


def _requests(seed: int, count: int) -> list[OmniRequest]:
    rng = random.Random(seed)
    out = []
    for i in range(count):
        params = SamplingParams(
            max_tokens=rng.randint(4, 60), stop_token_ids=[STOP] if i % 3 == 0 else None, min_tokens=rng.choice([0, 0, 4])
        )
        params.update_from_generation_config({}, EOS if i % 4 else None)  # some ignore eos
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randint(3, 40))]
        out.append(OmniRequest(request_id=f"r{i}", prompt_token_ids=prompt, sampling_params=params, pooling_params=None, arrival_time=0.0))
    return out


def _runner_output(scheduler_output, step: int) -> OmniModelRunnerOutput:
    ids = list(scheduler_output.num_scheduled_tokens)
    tokens = [[random.Random(f"{step}/{rid}").randrange(VOCAB)] for rid in ids]
    payloads = [{"row": torch.tensor([step, i])} for i in range(len(ids))]
    handed = [{"handed": (step, rid)} if int(rid[1:]) % 2 else None for rid in ids]  # the chunk adapter's, on odd requests
    return OmniModelRunnerOutput(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=tokens, multimodal_outputs=payloads,
        inter_stage_outputs=handed,
    )


class ChunkAdapter:
    """What vllm-omni's update hands the chunk adapter, recorded; any other use of it fails."""

    def __init__(self):
        self.calls = []

    def save_async(self, payload, request, is_segment_finished, **kwargs):
        self.calls.append((request.request_id, payload, is_segment_finished, tuple(kwargs.get("new_token_ids") or ()),
                           kwargs.get("confirmed_num_computed_tokens"), kwargs.get("segment_generation")))

    def _confirmed_num_computed_tokens(self, request):
        return request.num_computed_tokens

    def cleanup_receiver(self, request_id):
        self.calls.append((request_id, "cleanup"))


def _summary(engine_outputs: dict) -> dict:
    """Everything a client gets from one step, in a comparable form (no timestamps)."""
    summary = {}
    for client, outs in engine_outputs.items():
        rows = sorted(
            (
                o.request_id,
                tuple(o.new_token_ids),
                o.finish_reason,
                o.stop_reason,
                getattr(o, "num_generation_tokens", None),
                None if getattr(o, "multimodal_output", None) is None else tuple(o.multimodal_output["row"].tolist()),
            )
            for o in outs.outputs
        )
        stats = outs.scheduler_stats
        summary[client] = (rows, outs.finished_requests, stats and (stats.num_running_reqs, stats.num_waiting_reqs))
    return summary


def _state(scheduler) -> dict:
    return {
        rid: (r.status, tuple(r.output_token_ids), r.num_computed_tokens, r.num_output_placeholders, r.num_preemptions, r.num_in_flight_tokens, r.num_stale_output_tokens)
        for rid, r in scheduler.requests.items()
    }


def _run(scheduler, requests, depth: int, aborts: dict[int, str]) -> list:
    """Drive `scheduler` like vLLM's EngineCore: `depth` steps in flight (2: async scheduling)."""
    for request in requests:
        scheduler.add_request(request)
    trace, in_flight, step = [], [], 0
    while scheduler.has_unfinished_requests() or in_flight:
        if step in aborts:
            scheduler.finish_requests(aborts[step], RequestStatus.FINISHED_ABORTED)
        if scheduler.has_unfinished_requests():
            in_flight.append(scheduler.schedule())
        if len(in_flight) == depth or not scheduler.has_unfinished_requests():
            scheduler_output = in_flight.pop(0)
            scheduler.chunk_transfer_adapter = adapter = ChunkAdapter()  # the update's part only (not schedule's)
            outputs = scheduler.update_from_output(scheduler_output, _runner_output(scheduler_output, step))
            scheduler.chunk_transfer_adapter = None
            trace.append((_summary(outputs), _state(scheduler), sorted(map(repr, adapter.calls))))
        step += 1
        assert step < 2000
    return trace


@pytest.mark.parametrize("num_blocks", [400, 8], ids=["roomy", "preempting"])
@pytest.mark.parametrize("plain,steady,depth", [(OmniARScheduler, SteadyScheduler, 1), (OmniARAsyncScheduler, SteadyAsyncScheduler, 2)], ids=["sync", "async"])
def test_steady_rows_match_vllm_omni_update(vllm_config, monkeypatch, plain, steady, depth, num_blocks):
    rows = {"steady": 0, "other": 0}
    update_rows = SteadyRowsMixin._update_steady_rows

    def counted(self, scheduler_output, runner_output):
        outputs, rest = update_rows(self, scheduler_output, runner_output)
        rows["steady"] += len(scheduler_output.num_scheduled_tokens) - len(rest)
        rows["other"] += len(rest)
        return outputs, rest

    monkeypatch.setattr(SteadyRowsMixin, "_update_steady_rows", counted)
    requests = _requests(seed=num_blocks + depth, count=16)
    aborts = {5: "r3", 11: "r8"}
    expected = _run(_scheduler(plain, vllm_config, num_blocks), copy.deepcopy(requests), depth, aborts)
    got = _run(_scheduler(steady, vllm_config, num_blocks), copy.deepcopy(requests), depth, aborts)
    assert len(got) == len(expected)
    for step, (g, e) in enumerate(zip(got, expected)):
        assert g == e, f"step {step}"
    assert rows["steady"] > 2 * rows["other"] > 0, rows
    assert sum(len(calls) for *_, calls in expected) > 50  # the adapter's hand-overs are compared too
    if num_blocks == 8:
        assert any(r[4] for _, state, _ in expected for r in state.values()), "the small cache must preempt"


def test_scheduler_update_benchmark_runs(tmp_path):
    """benchmarks/scheduler_update.py end to end at a small size (its numbers are not checked)."""
    out = tmp_path / "su.json"
    script = Path(__file__).parents[2] / "benchmarks" / "scheduler_update.py"
    cmd = [sys.executable, str(script), "--out", str(out), "--concurrency", "4", "--prompt-len", "8", "--gen-len", "12"]
    subprocess.run(cmd, check=True, timeout=300)
    result = json.loads(out.read_text())["results"]["4"]
    assert set(result) == {"vllm", "vllm_omni", "steady_rows", "stage0"}
    for run in result:
        assert result[run]["steps"] >= 12 and result[run]["update_from_output_us"] > 0
