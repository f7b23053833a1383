"""The aux streams' head split as vLLM's vocab-parallel LM head splits the vocabulary: each
rank's part, gathered, equals the one-rank logits exactly (float32), on simulated shards and
over a real 2-process gloo group (vllm_omni_speechlm/models/tp_heads.py)."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from vllm_omni_speechlm.models.tp_heads import (
    aux_logits_sharded,
    aux_logits_unsharded,
    aux_shard_plan,
    local_aux_logits,
    vocab_shards,
)

HIDDEN = 48


def _weights(vocab: int, num_aux: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(vocab, HIDDEN, generator=g)
    aux_emb = torch.randn(num_aux, HIDDEN, generator=g)
    hidden = torch.randn(5, HIDDEN, generator=g)
    return head, aux_emb, hidden


def _shard_weight(head: torch.Tensor, shard) -> torch.Tensor:
    """A rank's [P, H] shard as vLLM's weight loader fills it: its ids, then zero padding rows."""
    out = torch.zeros(shard.rows, head.shape[1])
    out[: shard.end - shard.start] = head[shard.start : shard.end]
    return out


def _reference(head, aux_emb, hidden, lo, width, num_aux) -> torch.Tensor:
    """Today's one-rank path: a view of the head's aux rows."""
    return aux_logits_unsharded(hidden, aux_emb, head[lo : lo + num_aux * width].view(num_aux, width, -1))


# (vocab, lo, W, S-1, tp): a block straddling the rank boundary; padding on the last rank;
# the aux rows inside one rank; ranks holding no aux rows; blocks over three ranks.
LAYOUTS = [
    (1000, 300, 100, 7, 2),
    (1000, 301, 99, 7, 2),
    (1000, 600, 50, 8, 2),
    (1000, 700, 30, 10, 4),
    (1030, 30, 100, 10, 4),
    (1000, 300, 100, 7, 1),
]


@pytest.mark.parametrize("vocab, lo, width, num_aux, tp", LAYOUTS)
def test_gathered_shards_equal_the_unsharded_head(vocab, lo, width, num_aux, tp):
    head, aux_emb, hidden = _weights(vocab, num_aux)
    shards = vocab_shards(vocab, tp)
    assert sum(s.end - s.start for s in shards) == vocab and len({s.rows for s in shards}) == 1
    parts = []
    for rank, shard in enumerate(shards):
        plan = aux_shard_plan(shards, rank, lo, width, num_aux)
        parts.append(local_aux_logits(hidden, aux_emb, _shard_weight(head, shard), plan))
    assert len({p.shape for p in parts}) == 1  # one all-gather shape
    plan = aux_shard_plan(shards, 0, lo, width, num_aux)
    got = aux_logits_sharded(hidden, aux_emb, _shard_weight(head, shards[0]), plan, lambda _: torch.cat(parts, dim=-1))
    assert torch.equal(got, _reference(head, aux_emb, hidden, lo, width, num_aux))


def test_padding_follows_vllm(monkeypatch):
    """vLLM pads the vocabulary to a multiple of 64 before splitting it: 1000 ids -> 2 x 512 rows."""
    assert [(s.start, s.end, s.rows) for s in vocab_shards(1000, 2)] == [(0, 512, 512), (512, 1000, 512)]
    assert [(s.start, s.end, s.rows) for s in vocab_shards(1000, 4)][-1] == (768, 1000, 256)


def test_the_tiny_checkpoints_layout(tiny_bagpiper):
    from vllm_omni_speechlm.config import SpeechLMConfig

    cfg = SpeechLMConfig.from_model_dir(tiny_bagpiper)
    lo, width, num_aux = cfg.streams[1].vocab_start, cfg.aux_stream_width, cfg.num_streams - 1
    head, aux_emb, hidden = _weights(cfg.vocab_size, num_aux)
    shards = vocab_shards(cfg.vocab_size, 2)
    parts = [
        local_aux_logits(hidden, aux_emb, _shard_weight(head, s), aux_shard_plan(shards, r, lo, width, num_aux))
        for r, s in enumerate(shards)
    ]
    plan = aux_shard_plan(shards, 1, lo, width, num_aux)
    got = aux_logits_sharded(hidden, aux_emb, _shard_weight(head, shards[1]), plan, lambda _: torch.cat(parts, dim=-1))
    assert torch.equal(got, _reference(head, aux_emb, hidden, lo, width, num_aux))


# ---- a real 2-process group ---------------------------------------------------------------------


def _gloo_rank(rank: int, init_file: str, out_dir: str, layout: tuple, shards: list) -> None:
    """One rank: its shard, its part, one all-gather. The shards come from the parent, so the
    spawned process imports torch only (vLLM's own group: tests/engine/test_tp_group.py)."""
    import torch.distributed as dist

    vocab, lo, width, num_aux, tp = layout
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=tp)
    try:
        torch.set_num_threads(1)
        head, aux_emb, hidden = _weights(vocab, num_aux)
        plan = aux_shard_plan(shards, rank, lo, width, num_aux)

        def all_gather(x: torch.Tensor) -> torch.Tensor:
            parts = [torch.empty_like(x) for _ in range(tp)]
            dist.all_gather(parts, x.contiguous())
            return torch.cat(parts, dim=-1)

        got = aux_logits_sharded(hidden, aux_emb, _shard_weight(head, shards[rank]), plan, all_gather)
        torch.save(got, f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_two_rank_gloo_group(tmp_path):
    layout = LAYOUTS[0]
    vocab, lo, width, num_aux, tp = layout
    shards = vocab_shards(vocab, tp)
    mp.spawn(_gloo_rank, args=(str(tmp_path / "init"), str(tmp_path), layout, shards), nprocs=tp, join=True)
    want = _reference(*_weights(vocab, num_aux), lo, width, num_aux)
    for rank in range(tp):
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), want)
