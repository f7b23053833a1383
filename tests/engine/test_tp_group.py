"""The aux head as the model wires it, in vLLM's own TP group on CPU (2 processes, vLLM's CPU
communicator): a real `ParallelLMHead` loaded by its weight loader, stream 0 through vLLM's
`LogitsProcessor`, the aux streams through `tp_heads`; every rank gets the one-rank logits. In the
engine tier: each process imports vLLM (tens of seconds on a busy host)."""

from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp

from vllm_omni_speechlm.models.tp_heads import aux_logits_sharded, aux_logits_unsharded

VOCAB, LO, WIDTH, NUM_AUX, TP, HIDDEN = 1000, 300, 100, 7, 2, 48  # stream 2 straddles the two shards


def _weights() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return torch.randn(VOCAB, HIDDEN, generator=g), torch.randn(NUM_AUX, HIDDEN, generator=g), torch.randn(5, HIDDEN, generator=g)


def _vllm_rank(rank: int, init_file: str, out_dir: str, ident: str) -> None:
    """One rank of a TP=2 vLLM group on gloo: a real `ParallelLMHead` loaded by its own weight
    loader, stream 0 through vLLM's `LogitsProcessor` (its all-gather), the aux streams as the
    model wires them (the head's own shards, vLLM's all-gather)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    from vllm_omni_speechlm.models.tp_heads import lm_head_aux_plan, tp_all_gather

    torch.set_num_threads(1)
    os.environ["VLLM_DIST_IDENT"] = ident  # names the CPU communicator's shared memory (vLLM's CPU executor sets it)
    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(TP, rank, f"file://{init_file}", rank, backend="gloo")
        ensure_model_parallel_initialized(TP, 1)
        head, aux_emb, hidden = _weights()
        lm_head = ParallelLMHead(VOCAB, HIDDEN, params_dtype=torch.float32)
        lm_head.weight_loader(lm_head.weight, head)
        lm_head.quant_method.process_weights_after_loading(lm_head)  # as vLLM's loader does
        plan = lm_head_aux_plan(lm_head, LO, WIDTH, NUM_AUX)  # what the model builds
        aux = aux_logits_sharded(hidden, aux_emb, lm_head.weight, plan, tp_all_gather)  # what its aux_logits runs
        stream0 = LogitsProcessor(VOCAB)(lm_head, hidden)
        destroy_model_parallel()
        destroy_distributed_environment()
    torch.save((stream0, aux), f"{out_dir}/vllm{rank}.pt")


def test_two_rank_vllm_group(tmp_path):
    """The model's wiring under vLLM's own TP group (CPU communicator): every rank gets the
    one-rank stream-0 and aux logits."""
    ident = f"speechlm-tp-heads-{os.getpid()}"  # unique: other test runs may share /dev/shm
    mp.spawn(_vllm_rank, args=(str(tmp_path / "init"), str(tmp_path), ident), nprocs=TP, join=True)
    head, aux_emb, hidden = _weights()
    want = aux_logits_unsharded(hidden, aux_emb, head[LO : LO + NUM_AUX * WIDTH].view(NUM_AUX, WIDTH, -1))
    for rank in range(TP):
        stream0, aux = torch.load(tmp_path / f"vllm{rank}.pt")
        assert torch.equal(aux, want)
        torch.testing.assert_close(stream0, hidden @ head.T, rtol=0, atol=1e-5)
