"""The batched runner loops (runner_loops.py) against vLLM's own methods on the same states.

vLLM runs these paths only with async scheduling, which its CPU platform turns off, so the
engine tests never reach them: here both implementations run on copies of one runner state
(vLLM's `CpuGpuBuffer`s and host arrays, the attributes the two methods read) for batches that
continue, reorder, add and drop rows, and the results and every state they write must match.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.v1.utils import CpuGpuBuffer
from vllm.v1.worker.gpu_model_runner import GPUModelRunner

from vllm_omni_speechlm.stage0.runner_loops import BatchedRunnerLoopsMixin

MAX_LEN = 32


class VLLMLoops:
    """A runner state with vLLM's own methods (only what the two loops read)."""

    _compute_prev_positions = GPUModelRunner._compute_prev_positions
    _prepare_input_ids = GPUModelRunner._prepare_input_ids
    _bookkeeping_sync = GPUModelRunner._bookkeeping_sync
    _get_prompt_logprobs_dict = GPUModelRunner._get_prompt_logprobs_dict

    def __init__(self, rng: np.random.Generator, prev_ids: list[str], req_ids: list[str], scheduled: np.ndarray):
        n = len(req_ids)
        self.device, self.max_model_len = torch.device("cpu"), MAX_LEN
        self.use_async_scheduling, self.enable_prompt_embeds = True, False
        self._pp_recv_work, self._draft_token_ids, self.prev_num_spec_tokens = None, None, 0
        self.num_prompt_logprobs: dict = {}
        self.input_ids = CpuGpuBuffer(64, dtype=torch.int32, device=self.device, pin_memory=False)
        self.input_ids.cpu[:] = torch.from_numpy(rng.integers(1000, 2000, 64, dtype=np.int32))
        self.prev_positions = CpuGpuBuffer(n, dtype=torch.int64, device=self.device, pin_memory=False)
        prev_index = {r: i for i, r in enumerate(prev_ids)}
        self.prev_positions.np[:] = [prev_index.get(r, -1) for r in req_ids]
        self.discard_request_mask = CpuGpuBuffer(n, dtype=torch.bool, device=self.device, pin_memory=False)
        self.discard_request_mask.np[:] = np.arange(n) % 4 == 1  # partial prefill chunks
        self.requests = {r: SimpleNamespace(output_token_ids=[7] * int(rng.integers(0, 4))) for r in req_ids}
        self.input_batch = SimpleNamespace(
            num_reqs=n,
            req_ids=list(req_ids),
            req_id_to_index={r: i for i, r in enumerate(req_ids)},
            generators={i: _OffsetGenerator(16) for i in range(0, n, 2)},
            prev_sampled_token_ids=torch.from_numpy(rng.integers(0, 900, (len(prev_ids), 1), dtype=np.int32)),
            prev_req_id_to_index=prev_index,
            token_ids_cpu=np.zeros((n, MAX_LEN), dtype=np.int32),
            is_token_ids=np.zeros((n, MAX_LEN), dtype=bool),
            num_tokens_no_spec=rng.integers(1, MAX_LEN - 1, n),
        )
        self.cu_num_tokens = np.cumsum(scheduled).astype(np.int32)


class Batched(BatchedRunnerLoopsMixin, VLLMLoops):
    pass


class _OffsetGenerator:
    """A CUDA generator's offset (CPU generators have none)."""

    def __init__(self, offset: int):
        self.offset = offset

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


def _states(seed: int, kind: str) -> tuple[VLLMLoops, Batched]:
    rng = np.random.default_rng(seed)
    prev_ids = [f"r{i}" for i in range(12)]
    if kind == "unchanged":
        req_ids = list(prev_ids)
    elif kind == "new only":
        req_ids = [f"n{i}" for i in range(5)]
    else:  # reordered, some gone, some new
        req_ids = list(rng.permutation(prev_ids[:9])) + [f"n{i}" for i in range(3)]
    scheduled = np.where([r in prev_ids for r in req_ids], 1, rng.integers(2, 5, len(req_ids)))
    ref = VLLMLoops(np.random.default_rng(seed), prev_ids, req_ids, scheduled)
    ours = Batched.__new__(Batched)
    ours.__dict__ = copy.deepcopy(ref.__dict__)
    return ref, ours


def _scheduler_output(req_ids: list[str]) -> SimpleNamespace:
    return SimpleNamespace(scheduled_spec_decode_tokens={}, num_scheduled_tokens={r: 1 for r in req_ids})


@pytest.mark.parametrize("kind", ["unchanged", "reordered", "new only"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_input_ids_match_vllm(kind: str, seed: int):
    ref, ours = _states(seed, kind)
    n, total = ref.input_batch.num_reqs, int(ref.cu_num_tokens[-1])
    for state in (ref, ours):
        state.prev_positions.np[:] = 99
        state._compute_prev_positions(n)
        state._prepare_input_ids(_scheduler_output(state.input_batch.req_ids), n, total, state.cu_num_tokens)
    np.testing.assert_array_equal(ours.prev_positions.np, ref.prev_positions.np)
    assert torch.equal(ours.input_ids.gpu[:total], ref.input_ids.gpu[:total])
    if kind != "new only":  # the continuing rows really got the previous step's ids
        assert not torch.equal(ours.input_ids.gpu[:total], ours.input_ids.cpu[:total])


@pytest.mark.parametrize("kind", ["unchanged", "reordered", "new only"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("first_async_step", [False, True])
def test_bookkeeping_matches_vllm(kind: str, seed: int, first_async_step: bool):
    ref, ours = _states(seed, kind)
    n = ref.input_batch.num_reqs
    sampled = torch.arange(n, dtype=torch.int32)[:, None]
    results = []
    for state in (ref, ours):
        if first_async_step:
            state.input_batch.prev_sampled_token_ids = None
        out = SimpleNamespace(sampled_token_ids=sampled, logprobs_tensors=None)
        hidden = torch.zeros(n, 4)
        results.append(state._bookkeeping_sync(_scheduler_output(state.input_batch.req_ids), out, None, hidden, n))
    assert results[1] == results[0]
    a, b = ref.input_batch, ours.input_batch
    for name in ("token_ids_cpu", "is_token_ids", "num_tokens_no_spec"):
        np.testing.assert_array_equal(getattr(b, name), getattr(a, name), err_msg=name)
    assert b.prev_req_id_to_index == a.prev_req_id_to_index
    assert torch.equal(b.prev_sampled_token_ids, a.prev_sampled_token_ids)
    assert {i: g.offset for i, g in b.generators.items()} == {i: g.offset for i, g in a.generators.items()}
    assert {r: s.output_token_ids for r, s in ours.requests.items()} == {r: s.output_token_ids for r, s in ref.requests.items()}


def test_spec_decode_takes_vllms_path():
    """A draft token moves a row's sampled token off its last position: the batched path would
    put it there, so equal results mean vLLM's method ran."""
    ref, ours = _states(0, "unchanged")
    for state in (ref, ours):
        scheduled = np.ones(12, dtype=np.int32)
        scheduled[3] = 2  # r3: its sampled token and one draft
        state.cu_num_tokens = np.cumsum(scheduled).astype(np.int32)
        state._draft_token_ids = torch.full((12, 1), 77, dtype=torch.int32)
        state.prev_num_spec_tokens = 1
        spec = SimpleNamespace(scheduled_spec_decode_tokens={"r3": [5]}, num_scheduled_tokens={})
        state._prepare_input_ids(spec, 12, 13, state.cu_num_tokens)
    assert torch.equal(ours.input_ids.gpu[:13], ref.input_ids.gpu[:13])
    assert ref.input_ids.gpu[4] == 77  # r3's draft
