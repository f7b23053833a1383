"""Stage 0's frames reach the client in blocks, not one tensor per request per step.

The worker hands each request one [1, S] frame per step (`codes.audio`). Every tensor the
EngineCore sends costs 15-30 us of Python on its output thread (vLLM's msgpack tensor encoding),
and that thread holds the GIL the scheduling thread needs: on an H200, sending no frames at all
decoded 5% more frames/s at 64 requests and 15% more at 512
(benchmarks/results/stage0_throughput_h200_2026-11-22_v10_payloads.json). So the scheduler
holds a request's frames back and sends them `block` steps at a time, concatenated, and the rest
with the request's last output. The client concatenates what it gets into the same [L, S].

A request whose client may end it on text it sees (stop strings: vLLM checks them in the client)
gets its frame every step, so nothing is held when the client stops it.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni_speechlm.models.speechlm import CODES_KEY

FRAME_BLOCK_STEPS = 16


class ClientFrameBlocks:
    def __init__(self, block: int = FRAME_BLOCK_STEPS):
        self.block = block
        self._held: dict[str, list[torch.Tensor]] = {}  # request id -> frames not sent yet
        self._gone: list[str] = []  # freed requests, whose held frames are dropped after the step

    def regroup(self, outputs: list[Any], requests: dict[str, Any]) -> None:
        """In place, on all of one step's EngineCore outputs (every client's; called once a step):
        hold back each request's frames until it has `block` of them or finishes; then send them
        as one tensor."""
        for out in outputs:
            payload = out.multimodal_output
            if not payload or CODES_KEY not in payload:
                continue
            held = self._held.setdefault(out.request_id, [])
            held.append(payload[CODES_KEY])
            if out.finish_reason is None and len(held) < self.block and not _client_may_stop(requests.get(out.request_id)):
                out.multimodal_output = {k: v for k, v in payload.items() if k != CODES_KEY} or None
                continue
            out.multimodal_output = payload | {CODES_KEY: held[0] if len(held) == 1 else torch.cat(held)}
            del self._held[out.request_id]
        for request_id in self._gone:  # flushed above, unless it had no output this step
            self._held.pop(request_id, None)
        self._gone = []

    def forget(self, request_id: str, *, after_this_step: bool) -> None:
        """The request is freed. Freed while its step's outputs are built (it stopped: its last
        output still comes to `regroup`), its frames go after that; otherwise (aborted) now."""
        if after_this_step:
            self._gone.append(request_id)
        else:
            self._held.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._held)


def _client_may_stop(request: Any) -> bool:
    params = getattr(request, "sampling_params", None)
    return bool(params is not None and params.stop)
