"""Per-request decoding state of a speech LM worker, in device tables indexed by slot.

A request holds a slot from its first prefill until vLLM reports it finished or aborted; a
preempted request keeps its slot (vLLM re-prefills prompt + outputs, and the auxiliary streams
of those outputs come back from `aux_history`). Everything a step needs is gathered by slot in
one indexing op; no per-request device work happens per step, and a step's admissions reach
the tables in one copy per table (`write_admitted`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from vllm_omni_speechlm.cfg import is_companion, main_id
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.decoding import FLOAT_FIELDS, INT_FIELDS, OutputMode, Phase, RowSampling, aux_seed, seeded_exponential
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

UNSEEDED = -1  # the aux-seed column of a request without a seed
SEED_COLUMN = len(INT_FIELDS)  # `ints`: the RowSampling int fields, then the aux seed


def to_device(values: list | np.ndarray, device: torch.device) -> torch.Tensor:
    """Host ints (list) or an array -> a new device tensor (never aliasing the host values, which
    may be updated in place) without a blocking copy (pinned staging on CUDA)."""
    t = torch.tensor(values) if isinstance(values, np.ndarray) else torch.tensor(values, dtype=torch.long)
    return (t.pin_memory() if device.type == "cuda" else t).to(device, non_blocking=True)


@dataclass
class RequestEntry:
    req_id: str
    slot: int
    params: SpeechSamplingParams  # resolved against the checkpoint's defaults
    prompt_len: int | None  # None until the request's first sampling step
    max_top_k: int  # host copy, so a step's top-k width needs no device read
    guided_by: str | None = None  # a CFG companion: the id of the main request it guides


class RequestTable:
    """Slots, phases, sampling rows and the auxiliary-stream history of live requests."""

    def __init__(self, cfg: SpeechLMConfig, capacity: int, max_output_len: int, device: torch.device):
        self.cfg, self.device = cfg, device
        self.max_output_len = max_output_len
        self.entries: dict[str, RequestEntry] = {}
        self.num_companions = 0
        self.num_text_capable = 0  # live requests whose modality enforces or allows text at once
        self.num_released = 0  # requests released so far (a step's rows read before are stale)
        self._admitted: list[tuple[int, int, tuple, tuple]] = []  # slot, mode, ints, floats: not yet written
        self._released: list[int] = []  # slots whose phase is not yet reset (TextRowsWatch reads all)
        self.generation = -1  # bumped by each allocation (step graphs hold the tables' addresses)
        self._allocate(capacity)

    def _allocate(self, capacity: int) -> None:
        """`capacity` slots and one scratch slot, which no request holds (step graphs' padding rows)."""
        d, s1, rows = self.device, self.cfg.num_streams - 1, capacity + 1
        self.capacity, self.scratch = capacity, capacity
        self.generation += 1
        self.free = list(range(capacity - 1, -1, -1))
        self.phase = torch.zeros(rows, dtype=torch.long, device=d)
        self.phase_step = torch.zeros(rows, dtype=torch.long, device=d)  # steps in the current phase
        self.segment = torch.zeros(rows, dtype=torch.long, device=d)  # segments of the answer ended so far
        self.mode = torch.zeros(rows, dtype=torch.long, device=d)
        self.ints = torch.zeros(rows, SEED_COLUMN + 1, dtype=torch.long, device=d)  # INT_FIELDS, aux seed
        self.floats = torch.ones(rows, len(FLOAT_FIELDS), dtype=torch.float32, device=d)
        self.aux_history = torch.zeros(rows, self.max_output_len, s1, dtype=torch.int32, device=d)

    def _grow(self) -> None:
        """Double the tables (more live requests than expected: preempted ones keep slots)."""
        tables = lambda: (self.phase, self.phase_step, self.segment, self.mode, self.ints, self.floats, self.aux_history)  # noqa: E731
        old = tables()
        n = self.capacity
        self._allocate(2 * n)
        for new, prev in zip(tables(), old):
            new[:n] = prev[:n]
        self.free = [s for s in self.free if s >= n]

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.entries

    def admit(self, req_id: str, params: SpeechSamplingParams) -> RequestEntry:
        if not self.free:
            self._grow()
        slot = self.free.pop()
        v = params.row_values()
        seed = UNSEEDED if params.seed is None else aux_seed(params.seed)
        entry = RequestEntry(req_id, slot, params, None, max(v.text_top_k, v.audio_top_k))
        if is_companion(req_id):
            entry.guided_by = main_id(req_id)
            self.num_companions += 1
        self.entries[req_id] = entry
        self.num_text_capable += self.text_capable(params)
        ints = tuple(getattr(v, n) for n in INT_FIELDS) + (seed,)
        self._admitted.append((slot, int(params.modality), ints, tuple(getattr(v, n) for n in FLOAT_FIELDS)))
        return entry

    @staticmethod
    def text_capable(params: SpeechSamplingParams) -> bool:
        """Whether a request may have a text row within its first rows. An audio answer may
        reach text only after its audio segment ends (parallel rules): `TextRowsWatch` sees that
        coming from the device phases."""
        return params.modality != OutputMode.AUDIO

    def text_soon(self, rules) -> torch.Tensor:
        """[] bool: any slot's phase is at most two rows from a text row (released slots are
        reset to START, the scratch slot is left out)."""
        return rules.text_soon_by_phase[self.phase[: self.capacity]].any()

    def write_admitted(self) -> None:
        """The table rows of the requests admitted since the last call, and released slots' phases
        reset. One copy per table: a blocking copy per request (a host tensor written into a device
        one) would wait for the step's forward each time."""
        # index_fill_, not `t[idx] = value`: that copies the value to the device from pageable
        # memory, and the copy waits for the whole queue (the step's forward).
        if self._released:
            self.phase.index_fill_(0, to_device(self._released, self.device), int(Phase.START))
            self._released = []
        if not self._admitted:
            return
        slots, modes, ints, floats = zip(*self._admitted)
        self._admitted = []
        idx = to_device(list(slots), self.device)
        self.phase.index_fill_(0, idx, int(Phase.START))
        self.phase_step.index_fill_(0, idx, 0)
        self.segment.index_fill_(0, idx, 0)
        self.mode[idx] = to_device(list(modes), self.device)
        self.ints[idx] = to_device(np.array(ints, dtype=np.int64), self.device)
        self.floats[idx] = to_device(np.array(floats, dtype=np.float32), self.device)

    def release(self, req_ids) -> None:
        for req_id in req_ids:
            entry = self.entries.pop(req_id, None)
            if entry is not None:
                self.num_released += 1
                self.free.append(entry.slot)
                self._released.append(entry.slot)
                self.num_companions -= entry.guided_by is not None
                self.num_text_capable -= self.text_capable(entry.params)

    def row_sampling(self, slots: torch.Tensor, max_top_k: int) -> RowSampling:
        """Rows' sampling tensors; `max_top_k` is the host max over their entries' `max_top_k`."""
        return RowSampling.from_tables(self.ints[slots, :SEED_COLUMN], self.floats[slots], max_top_k)

    def aux_noise(self, slots: torch.Tensor, generated: torch.Tensor, unseeded: torch.Tensor) -> torch.Tensor:
        """[N] rows' slots and output indices, [N, S-1, W] Exp(1) noise from the global RNG ->
        the rows' noise: a seeded request's own (`seeded_exponential`, the contract in
        `decoding.py`), the others' `unseeded`. No host work: the step functions compile it."""
        seeds = self.ints[slots, SEED_COLUMN]
        seeded = seeded_exponential(seeds.clamp(min=0), generated, unseeded.shape[1:])
        return torch.where((seeds != UNSEEDED)[:, None, None], seeded, unseeded)
