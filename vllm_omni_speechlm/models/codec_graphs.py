"""The codec stage's decode on CUDA graphs, one per (batch, frames) bucket it meets.

Stage 1 decodes a few windows per forward, and such a forward is launch-bound: X-Codec's decoder
is hundreds of small kernels, 4-8 ms eagerly for one window on an H100, ~1.5 ms replayed from a
graph (the same samples). Through `vllm serve` on one H100, stage 1's forwards at 64 listeners
took 7 ms against 24 and stage 0, which shares the GPU, stepped faster (`benchmarks/HISTORY.md`).

Shapes come from the stage's bucketing (`codec_stage.batch_bucket`, `frame_bucket`): the graphs
are recorded at start-up for every bucket a streamed window can meet, largest first, into one
memory pool (forwards never overlap). A shape without a graph (a window decoded at its own
length: a short lookahead without a full left context) runs eagerly. On wherever the stage runs
on CUDA; `additional_config: {speech_lm_codec_graphs: false}` in stage 1's section of a deploy
YAML turns them off.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)


class DecodeGraphs:
    """`decode(codes [B, Q, T]) -> audio [B, N]` replayed from a graph per recorded shape."""

    def __init__(self, decode: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.decode = decode
        self._graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def __len__(self) -> int:
        return len(self._graphs)

    def record(self, shapes: list[tuple[int, int, int]], device: torch.device) -> float:
        """Record a graph per [B, Q, T] shape (largest first: the pool is sized once); seconds."""
        started = time.perf_counter()
        for shape in sorted(shapes, key=lambda s: s[0] * s[2], reverse=True):
            codes = torch.zeros(shape, dtype=torch.long, device=device)
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):  # cuDNN picks its algorithms outside the capture
                self.decode(codes)
            torch.cuda.current_stream(device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                audio = self.decode(codes)
            self._graphs[shape] = (graph, codes, audio)
        return time.perf_counter() - started

    def __call__(self, codes: torch.Tensor) -> torch.Tensor:
        entry = self._graphs.get(tuple(codes.shape))
        if entry is None:
            return self.decode(codes)
        graph, static_codes, audio = entry
        static_codes.copy_(codes)
        graph.replay()
        return audio.clone()  # the next replay overwrites the graph's output
