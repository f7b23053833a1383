"""Stage 0's frames reach the client in blocks, not one tensor per request per step.

The worker fills one [N, S] host buffer of frames per step (`FrameRows`). Every tensor the
EngineCore sends costs 15-30 us of Python on its output thread (vLLM's msgpack tensor encoding),
and that thread holds the GIL the scheduling thread needs: on an H200, sending no frames at all
decoded 5% more frames/s at 64 requests and 15% more at 512 (benchmarks/README.md). Splitting
the buffer into per-request tensors, wrapping each in a payload dict and holding it cost another
~3 ms per step at 512 requests. So stage 0's runner hands the scheduler the whole buffer (`StepOutputs`);
the scheduler copies each request's row into that request's slot of a [slots, block, S] array
in one vectorised write per step, and sends a request's frames as one tensor when it has
`block` of them or finishes. A request's first block is shorter by its slot number modulo
`block`: requests admitted together would otherwise all send on the same step, a burst of
encoding on the output thread (~10 ms at 512 requests) that stalls the scheduling thread.
The client concatenates what it gets into the same [L, S].

A request whose client may end it on text it sees (stop strings: vLLM checks them in the client)
gets its frame every step, so nothing is held when the client stops it. One whose client reads no
frames (`CLIENT_CODES_KEY` false: the HTTP routes) gets none.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from vllm_omni_speechlm.frames import CLIENT_CODES_KEY, CODES_KEY, StepOutputs

FRAME_BLOCK_STEPS = 16


class ClientFrameBlocks:
    """Per request a slot of held frames, from its first frame until it is freed."""

    def __init__(self, num_streams: int, block: int = FRAME_BLOCK_STEPS):
        self.block = block
        self._slot: dict[str, int] = {}  # request id -> its slot
        self._free: list[int] = []
        self._held = np.zeros((0, block, num_streams), dtype=np.int64)  # [slots, block, S]
        self._count = np.zeros(0, dtype=np.int64)  # frames held per slot
        self._due_at = np.zeros(0, dtype=np.int64)  # frames to hold before sending (module docstring)
        self._every_step = np.zeros(0, dtype=bool)  # the slot's client may stop it (stop strings)
        self._gone: list[str] = []  # freed in this step's update: closed after `regroup`
        self._unread: set[str] = set()  # requests whose client reads no frames

    def admit(self, request_id: str, info: dict) -> None:
        """A new request, with its prompt's additional information."""
        if info.get(CLIENT_CODES_KEY) is False:
            self._unread.add(request_id)

    def regroup(self, outputs: list[Any], runner_outputs: StepOutputs | None, row_of: dict[str, int], requests: dict) -> None:
        """In place, on all of one step's EngineCore outputs (every client's; called once a step):
        hold each request's frame (its row, `row_of[request id]`, of the runner's step buffer)
        until it has `block` of them or finishes; then attach them to its output as one tensor.
        Without a step buffer (vllm-omni's own runner) the outputs carry their own frames."""
        if runner_outputs is not None:
            outs = [o for o in outputs
                    if (o.new_token_ids or o.finish_reason is not None) and o.request_id not in self._unread]
            if outs:
                self._hold_and_send(outs, runner_outputs.frames.host.numpy(), row_of, requests)
        for request_id in self._gone:
            self._close(request_id)
        self._gone = []

    def _hold_and_send(self, outs: list[Any], frames: np.ndarray, row_of: dict[str, int], requests: dict) -> None:
        slots = np.array([self._slot.get(o.request_id, -1) for o in outs])
        for j in np.flatnonzero(slots < 0).tolist():
            slots[j] = self._open(outs[j].request_id, requests)
        has_frame = np.array([bool(o.new_token_ids) for o in outs])  # a frame per new token
        rows = np.array([row_of[o.request_id] for o, new in zip(outs, has_frame) if new], dtype=np.int64)
        held = slots[has_frame]
        self._held[held, self._count[held]] = frames[rows]
        self._count[held] += 1
        finished = np.array([o.finish_reason is not None for o in outs])
        count = self._count[slots]
        due = (count > 0) & ((count >= self._due_at[slots]) | self._every_step[slots] | finished)
        for j in np.flatnonzero(due).tolist():
            codes = torch.from_numpy(self._held[slots[j], : count[j]].copy())
            outs[j].multimodal_output = (outs[j].multimodal_output or {}) | {CODES_KEY: codes}
        self._count[slots[due]] = 0
        self._due_at[slots[due]] = self.block

    def _open(self, request_id: str, requests: dict) -> int:
        if not self._free:
            self._grow(max(2 * len(self._count), 64))
        slot = self._slot[request_id] = self._free.pop()
        self._every_step[slot] = _client_may_stop(requests.get(request_id))
        self._due_at[slot] = self.block - slot % self.block
        return slot

    def _grow(self, size: int) -> None:
        old = len(self._count)
        held = np.zeros((size, *self._held.shape[1:]), dtype=np.int64)
        held[:old] = self._held
        self._held = held
        self._count = np.concatenate([self._count, np.zeros(size - old, dtype=np.int64)])
        self._due_at = np.concatenate([self._due_at, np.zeros(size - old, dtype=np.int64)])
        self._every_step = np.concatenate([self._every_step, np.zeros(size - old, dtype=bool)])
        self._free += range(size - 1, old - 1, -1)

    def _close(self, request_id: str) -> None:
        self._unread.discard(request_id)
        slot = self._slot.pop(request_id, None)
        if slot is not None:
            self._count[slot] = 0
            self._free.append(slot)

    def forget(self, request_id: str, *, after_this_step: bool) -> None:
        """The request is freed. Freed while its step's outputs are built (it stopped: its last
        output still comes to `regroup`), its frames go after that; otherwise (aborted) now."""
        if after_this_step:
            self._gone.append(request_id)
        else:
            self._close(request_id)

    def __len__(self) -> int:
        """Requests with a slot (freed requests have none)."""
        return len(self._slot)


def _client_may_stop(request: Any) -> bool:
    params = getattr(request, "sampling_params", None)
    return bool(params is not None and params.stop)
