"""The auxiliary streams' head under tensor parallelism.

Streams 1..S-1 are projected on their own vocabulary slices: ids [lo, hi), S-1 blocks of W rows,
block s read with `hidden + stream_embeddings[s]`. With one rank that is a view of the LM head
(`aux_logits_unsharded`). vLLM's `ParallelLMHead` splits the vocabulary, padded to a multiple
of 64, evenly over the TP ranks: rank r holds ids [start_r, end_r) in the first rows of its
[P, H] shard, then padding rows. A block may straddle two ranks, so each rank projects the
blocks its ids touch, all ranks the same number of blocks (one all-gather shape), and after one
all-gather every rank picks each aux logit from the rank that holds its id. Each logit is the
same [N, H] x [H, W] product as with one rank, so the result is the unsharded one; every rank
holds all of it, samples it with the same noise (decoding.py) and gets the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class VocabShard:
    """One rank's part of a vocab-parallel head."""

    start: int  # first vocabulary id it holds
    end: int  # one past its last real id (padding rows follow)
    rows: int  # rows of its weight shard, padding included


def vocab_shards(vocab_size: int, tp_size: int, padding: int | None = None) -> list[VocabShard]:
    """Every rank's shard, as vLLM's `VocabParallelEmbedding` lays it out (no added vocabulary)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import DEFAULT_VOCAB_PADDING_SIZE, pad_vocab_size

    from vllm_omni_speechlm.compat import vocab_shard_bounds

    padded = pad_vocab_size(vocab_size, padding or DEFAULT_VOCAB_PADDING_SIZE)
    return [VocabShard(*vocab_shard_bounds(padded, vocab_size, rank, tp_size), padded // tp_size) for rank in range(tp_size)]


def lm_head_shards(lm_head) -> list[VocabShard]:
    """Every rank's shard of a built `ParallelLMHead` (its own padding and TP size)."""
    return vocab_shards(lm_head.org_vocab_size, lm_head.tp_size, lm_head.padding_size)


def tp_all_gather(x: torch.Tensor) -> torch.Tensor:
    """vLLM's TP all-gather along the last dimension (rank order)."""
    from vllm.distributed import tensor_model_parallel_all_gather

    return tensor_model_parallel_all_gather(x, dim=-1)


@dataclass(frozen=True)
class AuxShardPlan:
    """What one rank projects and where each aux logit sits after the all-gather."""

    width: int  # W, ids per aux stream
    streams: torch.Tensor  # [B] the aux stream (0-based) of each block this rank projects
    rows: torch.Tensor  # [B * W] its shard rows of those blocks (ids it does not hold: any row, never picked)
    pick: torch.Tensor  # [(S-1) * W] column of each aux logit in the gathered [N, tp * B * W]

    @property
    def blocks(self) -> int:
        return self.streams.numel()


def _block_range(shard: VocabShard, lo: int, width: int, num_aux: int) -> tuple[int, int]:
    """[first, last) aux streams whose ids the shard holds (first == last: none)."""
    first = min(max((shard.start - lo) // width, 0), num_aux)
    last = min(max(-(-(shard.end - lo) // width), 0), num_aux)
    return first, max(first, last)


def aux_shard_plan(shards: list[VocabShard], rank: int, lo: int, width: int, num_aux: int) -> AuxShardPlan:
    """The plan of `rank` for aux ids [lo, lo + num_aux * width) over these shards."""
    ranges = [_block_range(s, lo, width, num_aux) for s in shards]
    blocks = max(1, max(last - first for first, last in ranges))  # >= 1: a rank holding none still gathers
    first, shard = ranges[rank][0], shards[rank]
    streams = (first + torch.arange(blocks)).clamp(max=num_aux - 1)
    ids = lo + (first + torch.arange(blocks))[:, None] * width + torch.arange(width)
    rows = (ids - shard.start).clamp(0, shard.rows - 1).reshape(-1)
    ids = lo + torch.arange(num_aux * width)
    owner = torch.tensor([next(r for r, s in enumerate(shards) if s.start <= i < s.end) for i in ids.tolist()])
    first_of_owner = torch.tensor([f for f, _ in ranges])[owner]
    block = ids.sub(lo).div(width, rounding_mode="floor") - first_of_owner
    pick = (owner * blocks + block) * width + ids.sub(lo) % width
    return AuxShardPlan(width, streams, rows, pick)


def lm_head_aux_plan(lm_head, lo: int, width: int, num_aux: int) -> AuxShardPlan | None:
    """This rank's plan for a built `ParallelLMHead`; None with one rank (a view of its rows)."""
    if lm_head.tp_size == 1:
        return None
    return aux_shard_plan(lm_head_shards(lm_head), lm_head.tp_rank, lo, width, num_aux)


def aux_logits_unsharded(hidden: torch.Tensor, aux_embeddings: torch.Tensor, aux_weight: torch.Tensor) -> torch.Tensor:
    """[N, H], [S-1, H] stream embeddings, [S-1, W, H] the aux rows of the head -> [N, S-1, W]."""
    h = hidden[None, :, :] + aux_embeddings[:, None, :]  # [S-1, N, H]
    return torch.bmm(h, aux_weight.transpose(1, 2)).transpose(0, 1)


def local_aux_logits(hidden: torch.Tensor, aux_embeddings: torch.Tensor, shard: torch.Tensor, plan: AuxShardPlan) -> torch.Tensor:
    """This rank's part: [N, H], [S-1, H], its [P, H] head shard -> [N, B * W] (the same bmm as
    with one rank, over its B blocks)."""
    weight = shard[plan.rows].view(plan.blocks, plan.width, -1)
    logits = aux_logits_unsharded(hidden, aux_embeddings[plan.streams], weight)
    return logits.reshape(hidden.shape[0], -1)


def gathered_aux_logits(gathered: torch.Tensor, plan: AuxShardPlan) -> torch.Tensor:
    """Every rank's part concatenated in rank order, [N, tp * B * W] -> [N, S-1, W]."""
    return gathered.index_select(1, plan.pick).view(gathered.shape[0], -1, plan.width)


def aux_logits_sharded(
    hidden: torch.Tensor,
    aux_embeddings: torch.Tensor,
    shard: torch.Tensor,
    plan: AuxShardPlan,
    all_gather: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """[N, S-1, W] aux logits on every rank: project this rank's blocks, one all-gather (`all_gather`
    concatenates the ranks' [N, B * W] along the last dimension, in rank order)."""
    return gathered_aux_logits(all_gather(local_aux_logits(hidden, aux_embeddings, shard, plan)), plan)
