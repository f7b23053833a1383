"""Per-request loops of vLLM's V1 model runner, batched for an async-scheduled step.

With async scheduling, the V1 runner (which vllm-omni's AR runner extends) walks every request
in Python three times per step: `_compute_prev_positions` and `_prepare_input_ids` find the rows
that continue from the previous step (they are fed its sampled ids on the GPU), and
`_bookkeeping_sync` writes a placeholder token per sampled row into the host token table.
Without speculative decoding each is a few array operations. At 512 requests they were 8% of
the engine core's main thread on an H200 host, and that thread is what bounds a 512-request
step on H100 hosts (benchmarks/README.md); Model Runner V2, which plain vLLM runs, has none of
these loops.

The overrides take the batched path only where it is the same computation: async scheduling,
no speculative decoding, no pipeline parallelism, no prompt embeddings, no NaN counting;
otherwise vLLM's own method runs. tests/test_runner_loops.py runs both against vLLM's methods on
the same states.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import vllm.envs as envs

from vllm_omni_speechlm.models.request_state import to_device


class BatchedRunnerLoopsMixin:
    """Goes before vLLM's `GPUModelRunner` in the MRO."""

    def _compute_prev_positions(self, num_reqs: int) -> None:
        prev_rows = self.input_batch.prev_req_id_to_index
        if not prev_rows:
            return super()._compute_prev_positions(num_reqs)
        self.prev_positions.np[:num_reqs] = [prev_rows.get(r, -1) for r in self.input_batch.req_ids[:num_reqs]]

    def _prepare_input_ids(
        self, scheduler_output: Any, num_reqs: int, total_num_scheduled_tokens: int, cu_num_tokens: np.ndarray
    ) -> None:
        batch = self.input_batch
        if (
            batch.prev_sampled_token_ids is None
            or scheduler_output.scheduled_spec_decode_tokens
            or self._pp_recv_work is not None
            or self.enable_prompt_embeds
        ):
            return super()._prepare_input_ids(scheduler_output, num_reqs, total_num_scheduled_tokens, cu_num_tokens)
        prev = self.prev_positions.np[:num_reqs]
        common = np.flatnonzero(prev >= 0)  # rows that sampled in the previous step
        if common.size < total_num_scheduled_tokens:  # the other tokens come from the host
            self.input_ids.copy_to_gpu(total_num_scheduled_tokens)
        if common.size == 0:
            return
        last = cu_num_tokens[common].astype(np.int64) - 1  # each such row's (only) token
        src = prev[common]
        sampled = batch.prev_sampled_token_ids
        if last[-1] == common.size - 1 and np.array_equal(src, last):  # the batch is unchanged
            self.input_ids.gpu[: common.size].copy_(sampled[: common.size, 0], non_blocking=True)
            return
        index, src = to_device(last, self.device), to_device(src, self.device)
        self.input_ids.gpu.scatter_(0, index, sampled[src, 0])

    def _bookkeeping_sync(
        self,
        scheduler_output: Any,
        sampler_output: Any,
        logits: Any,
        hidden_states: Any,
        num_scheduled_tokens: int,
    ) -> tuple:
        sampled = sampler_output.sampled_token_ids
        if not self.use_async_scheduling or sampled.shape[-1] != 1 or envs.VLLM_COMPUTE_NANS_IN_LOGITS:
            return super()._bookkeeping_sync(scheduler_output, sampler_output, logits, hidden_states, num_scheduled_tokens)
        batch, req_ids = self.input_batch, self.input_batch.req_ids
        discard = np.flatnonzero(self.discard_request_mask.np[: batch.num_reqs])  # partial prefill chunks
        discarded = discard.tolist()
        outputs = (req_ids.copy(), batch.req_id_to_index.copy())
        if batch.prev_sampled_token_ids is None:  # next step's input ids, read on the GPU
            batch.prev_sampled_token_ids = sampled
        prev_rows = dict(zip(req_ids, range(len(req_ids))))
        for i in discarded:  # not fed next step; their draws do not count (vLLM's own rule)
            del prev_rows[req_ids[i]]
            gen = batch.generators.get(i)
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        batch.prev_req_id_to_index = prev_rows
        self._append_placeholders(np.setdiff1d(np.arange(sampled.shape[0]), discard, assume_unique=True))
        prompt_logprobs = self._get_prompt_logprobs_dict(
            hidden_states[:num_scheduled_tokens], scheduler_output.num_scheduled_tokens
        )
        # vLLM's tuple: NaN counts (host, device), logprobs lists and valid sampled ids (with async
        # scheduling both come with the output), prompt logprobs, the batch's ids and rows, discarded rows.
        return {}, None, None, [], prompt_logprobs, *outputs, discarded

    def _append_placeholders(self, rows: np.ndarray) -> None:
        """The sampled rows' new token, not on the host yet: a -1 placeholder in the token table
        and the request's outputs (vLLM's input batch replaces it when it needs the ids)."""
        batch, req_ids = self.input_batch, self.input_batch.req_ids
        end = batch.num_tokens_no_spec[rows] + 1
        if rows.size and end.max() > self.max_model_len:
            raise RuntimeError(f"sampled token ids exceed the max model length ({self.max_model_len})")
        batch.token_ids_cpu[rows, end - 1] = -1
        batch.is_token_ids[rows, end - 1] = True
        batch.num_tokens_no_spec[rows] = end
        requests = self.requests
        for i in rows.tolist():
            requests[req_ids[i]].output_token_ids.append(-1)
