"""CUDA graphs of a speech LM step after the backbone.

vLLM graphs the backbone. What follows it (LM head, phase machine, aux-stream sampling, the
stream-0 logits vLLM's sampler gets, then the emitted ids and next phases) is three
`torch.compile`d calls and a dozen eager ops per step. At 64 requests on an H100 host the
compiled-call path alone was 13% of the engine core's busy time (dynamo, AOT wrappers, Triton
launchers), and that step is host-bound. Here a step whose rows all sample replays two graphs
around vLLM's sampler (with CFG pairs too: they are whole-row index and scale buffers, so a
guided step has an unguided step's shapes):

    logits   [n, H] hidden states, rows' slots and output indices -> [n, V] stream-0 logits;
             writes the frames' aux streams, the aux history and next step's staged aux input
    advance  [n, 1] sampled stream-0 ids -> [n] emitted ids; writes the frames' stream 0 and
             the rows' next phases

Batches are padded to the next of vLLM's capture sizes; padding rows read and write the
request table's scratch slot. A graph is recorded the first time its key (size, top-k width,
text rows or not, CFG pairs or not) is met, into one memory pool for all of them with outputs held
weakly (vLLM's own scheme): replays share one size's worth of memory, as the steps never overlap.
vLLM's warm-up records the keys of a first request (`warm_up`), which would otherwise wait for the
recording before its first audio.

Under tensor parallelism the logits graph holds collectives (the stream-0 and aux heads' gathers,
the staging's all-reduce). Graphs are recorded inside vLLM's `graph_capture`, as its own are, and
every rank meets the same keys at the same step (their inputs are host facts every rank shares), so
the ranks record together. A failed recording there stops the engine: one rank falling back to
unrecorded steps would leave the others waiting in a collective.
"""

from __future__ import annotations

import bisect
import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from vllm.logger import init_logger
from vllm.utils.torch_utils import weak_ref_tensors

from vllm_omni_speechlm.compat import graph_capture
from vllm_omni_speechlm.models.request_state import to_device

logger = init_logger(__name__)

Recorder = Callable[[Callable[[], Any], Any], Callable[[], Any]]


def cuda_graph(fn: Callable[[], Any], pool: Any) -> Callable[[], Any]:
    """Record `fn` as a CUDA graph in `pool` -> a replay returning its outputs (held weakly). It
    runs once first, on the capture stream: a recompile or lazy init must not happen in capture."""
    side, graph = torch.cuda.Stream(), torch.cuda.CUDAGraph()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            out = weak_ref_tensors(fn())
        finally:
            graph.capture_end()
    torch.cuda.current_stream().wait_stream(side)

    def replay() -> Any:
        graph.replay()
        return out

    return replay


def run_eagerly(fn: Callable[[], Any], pool: Any) -> Callable[[], Any]:
    """The recorder of CPU tests: the same padded static-buffer step, run each time."""
    return fn


@dataclass
class _Graphs:
    logits: Callable[[], torch.Tensor]
    advance: Callable[[], torch.Tensor]


class StepGraphs:
    """Static inputs and the recorded graphs of one model (see the module docstring). The model's
    `SpeechLMSteps` supplies the bodies: `logits_step`, `advance_step`, `stage_next_aux`."""

    def __init__(self, steps: Any, sizes: Sequence[int], record: Recorder = cuda_graph, tensor_parallel: bool = False):
        self.steps, self.record, self.tensor_parallel = steps, record, tensor_parallel
        self.sizes = sorted(set(sizes))
        weight = steps.model.lm_head.weight
        m, device = self.sizes[-1], weight.device
        self.hidden = torch.zeros(m, weight.shape[1], dtype=weight.dtype, device=device)
        self._index = torch.zeros(2 * m, dtype=torch.long, device=device)  # [2, size] views, contiguous
        self.sampled = torch.zeros(m, 1, dtype=torch.int32, device=device)
        self.frames = torch.zeros(m, steps.speech.num_streams, dtype=torch.long, device=device)
        # CFG pairs as whole rows (`SpeechLMSteps._guidance`); padding rows pair with themselves.
        self._pairs = torch.zeros(2 * m, dtype=torch.long, device=device)  # [2, size] views, contiguous
        self._scale = torch.ones(m, dtype=torch.float32, device=device)
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self._graphs: dict[tuple, _Graphs] = {}
        self._table_generation = -1
        self._current: _Graphs | None = None
        self._size = 0  # the padded size of the step `logits` replayed
        self.num_replays = 0  # steps that replayed the graphs (tests, observability)

    def padded(self, n: int) -> int | None:
        """The capture size a batch of n rows runs at, or None (larger than all of them)."""
        i = bisect.bisect_left(self.sizes, n)
        return self.sizes[i] if i < len(self.sizes) else None

    def index(self, size: int) -> torch.Tensor:
        return self._index[: 2 * size].view(2, size)

    def logits(
        self, hidden: torch.Tensor, slots: np.ndarray, generated: np.ndarray, max_top_k: int, no_text_rows: bool,
        guidance: tuple[np.ndarray, np.ndarray] | None = None,
    ) -> torch.Tensor | None:
        """Replay the logits graph for these rows (and CFG pairs, `SpeechLMSteps._guidance`) ->
        [n, V] stream-0 logits; None when the batch has no graph (too large, or recording failed)."""
        n, size = hidden.shape[0], self.padded(hidden.shape[0])
        graphs = None if size is None else self._graphs_for((size, max_top_k, no_text_rows, guidance is not None))
        if graphs is None:
            return None
        index = np.zeros((2, size), dtype=np.int64)  # padding rows: the scratch slot, output 0
        index[0] = self.steps.table.scratch
        index[0, :n], index[1, :n] = slots, generated
        self.index(size).copy_(to_device(index, hidden.device), non_blocking=True)
        if guidance is not None:
            self._set_guidance(size, *guidance)
        self._size = size
        self.hidden[:n].copy_(hidden)
        self._current = graphs
        self.num_replays += 1
        return graphs.logits()[:n]

    def _set_guidance(self, size: int, pair: np.ndarray, scale: np.ndarray) -> None:
        n = pair.shape[1]
        padded = np.tile(np.arange(size), (2, 1))
        padded[:, :n] = pair
        self._pair(size).copy_(to_device(padded, self._pairs.device), non_blocking=True)
        scales = np.ones(size, dtype=np.float32)
        scales[:n] = scale
        self._scale[:size].copy_(to_device(scales, self._scale.device), non_blocking=True)

    def guided(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The replayed step's guidance, the first n rows (`SpeechLMSteps.sample` mirrors the
        companions' sampled ids with it)."""
        return self._pair(self._size)[:, :n], self._scale[:n]

    def _pair(self, size: int) -> torch.Tensor:
        return self._pairs[: 2 * size].view(2, size)

    def advance(self, sampled: torch.Tensor) -> torch.Tensor:
        """Replay the advance graph of the step `logits` ran -> [n] emitted stream-0 ids."""
        n = sampled.shape[0]
        self.sampled[:n].copy_(sampled)
        graphs, self._current = self._current, None
        return graphs.advance()[:n]

    def warm_up(self, max_top_k: int) -> int:
        """Record the keys one request meets with the checkpoint's default sampling (`max_top_k`):
        one row or a CFG pair (both at the smallest size), text rows or none. Returns how many
        keys have graphs."""
        keys = [(self.sizes[0], max_top_k, no_text_rows, guided) for no_text_rows in (False, True) for guided in (False, True)
                if self.sizes[0] > 1 or not guided]
        return sum(self._graphs_for(key) is not None for key in keys)

    def _graphs_for(self, key: tuple) -> _Graphs | None:
        table = self.steps.table
        if table.generation != self._table_generation:  # the table grew: graphs hold old addresses
            self._graphs.clear()
            self._table_generation = table.generation
        graphs = self._graphs.get(key)
        if graphs is None and self.record is not None:
            graphs = self._graphs[key] = self._record(*key)
        return graphs

    def _record(self, size: int, max_top_k: int, no_text_rows: bool, guided: bool) -> _Graphs | None:
        """Record both graphs of a key. Their first (eager) runs touch only the scratch slot."""
        steps, index = self.steps, self.index(size)
        index[0], index[1] = steps.table.scratch, 0
        hidden, sampled, frames = self.hidden[:size], self.sampled[:size], self.frames[:size]
        guidance = None
        if guided:  # recorded unpaired (every row its own partner); a replay reads the buffers
            guidance = self._pair(size), self._scale[:size]
            guidance[0][:] = torch.arange(size, device=self._pairs.device)
            guidance[1][:] = 1.0

        def logits() -> torch.Tensor:
            out = steps.logits_step(hidden, index, max_top_k, no_text_rows, guidance, frames, slice(None))
            steps.stage_next_aux(index)
            return out

        def advance() -> torch.Tensor:  # a companion advances with its main's sampled ids
            return steps.advance_step(sampled[guidance[0][1]] if guided else sampled, index, slice(None), frames)

        capture = graph_capture(index.device) if index.device.type == "cuda" else contextlib.nullcontext()
        started = time.perf_counter()
        try:
            with capture:
                graphs = _Graphs(self.record(logits, self.pool), self.record(advance, self.pool))
        except Exception:
            if self.tensor_parallel:
                raise
            logger.exception("speech LM step graphs: recording failed; steps run without them")
            self.record = None
            return None
        logger.info("speech LM step graphs recorded: %d rows, top-k width %d, text rows %s, CFG pairs %s (%.0f ms)", size,
                    max_top_k, not no_text_rows, guided, (time.perf_counter() - started) * 1e3)
        return graphs
