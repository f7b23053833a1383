"""Stage 0's scheduler update takes a short path for its steady decode rows.

vllm-omni's `OmniARScheduler.update_from_output` takes every scheduled request through the checks
its other pipelines need (KV-transfer triggers, streaming segments, stale async outputs, pooling,
logprobs, grammar, spec decode) and builds each output from 18 keyword arguments. In a decode
step almost every row is *steady*: one sampled token that does not stop its request, and nothing
else to settle. Those rows take the short path here: settle the in-flight count, append the token
through vLLM's own `_update_request_with_output` (placeholders, block caching), emit the output.
A steady row's inter-stage payload goes to the chunk adapter as vllm-omni's loop hands it over
(`save_async`, not finished), once the step's rows are updated (`_hand_over_steady_rows`, which
the stage-0 scheduler overrides to offer them to its window gate at once): with async_chunk
streaming every main request carries one each step, and leaving those rows to vllm-omni's loop
kept half the batch off the short path. Every other row, and every row of a step with step-wide
work (KV connector output, KV extraction, spec decode, logprobs, routed experts, perf metrics),
goes through vllm-omni's update unchanged, which also does the step's tail (finished sets, stats,
connector output).

On an H200 host's CPU this cuts the update from 3.0 to 1.2 ms per 512-request step
(benchmarks/scheduler_update.py); the 8B-geometry stage-0 benchmark there was no faster for it,
because its 512-request steps are not bound by the scheduling thread (benchmarks/README.md).
"""

from __future__ import annotations

import copy
from collections import defaultdict
from typing import Any

from vllm.v1.engine import EngineCoreOutputs
from vllm_omni.core.sched.omni_ar_scheduler import _should_emit_engine_output
from vllm_omni.engine import OmniEngineCoreOutput

from vllm_omni_speechlm.compat import stops_after


class SteadyRowsMixin:
    """Goes before vllm-omni's AR scheduler (sync or async) in the MRO."""

    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        if not self._steady_rows_allowed(scheduler_output, model_runner_output):
            return super().update_from_output(scheduler_output, model_runner_output)
        outputs, rest = self._update_steady_rows(scheduler_output, model_runner_output)
        if len(rest) == len(scheduler_output.num_scheduled_tokens):  # no steady row
            return super().update_from_output(scheduler_output, model_runner_output)
        others = copy.copy(scheduler_output)
        others.num_scheduled_tokens = rest
        engine_outputs = super().update_from_output(others, model_runner_output)
        for client, outs in outputs.items():
            if client in engine_outputs:
                engine_outputs[client].outputs.extend(outs)
            else:
                engine_outputs[client] = EngineCoreOutputs(outputs=outs)
        return engine_outputs

    def _steady_rows_allowed(self, scheduler_output: Any, runner_output: Any) -> bool:
        """No step-wide work that vllm-omni's loop settles per request."""
        return bool(runner_output.sampled_token_ids) and not (
            runner_output.kv_connector_output
            or getattr(runner_output, "kv_extracted_req_ids", None)
            or scheduler_output.scheduled_spec_decode_tokens
            or runner_output.logprobs is not None
            or runner_output.prompt_logprobs_dict
            or runner_output.routed_experts is not None
            or runner_output.pooler_output
            or (self.perf_metrics and self.perf_metrics.is_enabled())
            or getattr(self, "is_mm_encoder_only", False)
            or self.kv_transfer_criteria
        )

    def _update_steady_rows(self, scheduler_output: Any, runner_output: Any) -> tuple[dict[int, list], dict[str, int]]:
        """Update and emit the steady rows; return their outputs per client and the other rows'
        scheduled tokens."""
        sampled, row_of = runner_output.sampled_token_ids, runner_output.req_id_to_index
        client_rows = getattr(runner_output, "multimodal_outputs", None) or None
        nans = runner_output.num_nans_in_logits or {}
        emit = _should_emit_engine_output(self.vllm_config.model_config, stopped=False, has_control=False)
        inter_stage = (getattr(runner_output, "inter_stage_outputs", None) or None) if self.chunk_transfer_adapter else None
        outputs: dict[int, list] = defaultdict(list)
        rest: dict[str, int] = {}
        handed: list[tuple[Any, int, list[int]]] = []  # rows whose inter-stage payload goes to the chunk adapter
        for req_id, num_tokens in scheduler_output.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            row = row_of.get(req_id)
            if row is None or request is None or not _steady(request, sampled[row], self.max_model_len):
                rest[req_id] = num_tokens
                continue
            request.num_in_flight_tokens -= num_tokens
            new_token_ids, stopped = self._update_request_with_output(request, sampled[row])
            if stopped:
                raise RuntimeError(f"stage-0 scheduler: steady row {req_id} stopped (out of step with vLLM's check_stop)")
            if req_id in nans:
                request.num_nans_in_logits = nans[req_id]
            if emit:
                outputs[request.client_index].append(self._steady_output(request, new_token_ids, client_rows, row))
            if inter_stage is not None:
                handed.append((request, row, new_token_ids))
        if handed:
            self._hand_over_steady_rows(inter_stage, handed)
        return outputs, rest

    def _hand_over_steady_rows(self, inter_stage: Any, rows: list[tuple[Any, int, list[int]]]) -> None:
        """The steady rows' inter-stage payloads, as vllm-omni's loop hands them to the chunk adapter."""
        for request, row, new_token_ids in rows:
            payload = inter_stage[row]
            if payload is not None:
                self.chunk_transfer_adapter.save_async(
                    payload, request, False, new_token_ids=new_token_ids, confirmed_num_computed_tokens=None
                )

    def _steady_output(self, request: Any, new_token_ids: list[int], client_rows: Any, row: int) -> OmniEngineCoreOutput:
        prefill_stats = request.take_prefill_stats()
        if prefill_stats is not None:
            prefill_stats.finalize(self.kv_cache_manager.estimate_cached_tokens(request))
        return OmniEngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=new_token_ids,
            multimodal_output=None if client_rows is None else client_rows[row],
            stop_reason=request.stop_reason,
            events=request.take_events(),
            trace_headers=request.trace_headers,
            prefill_stats=prefill_stats,
            num_nans_in_logits=request.num_nans_in_logits,
            new_prompt_len_snapshot=self._new_prompt_len_snapshot.get(request.request_id),
            num_generation_tokens=len(request.output_token_ids),
        )


def _steady(request: Any, token_ids: list[int], max_model_len: int) -> bool:
    """One sampled token that leaves the request running (vLLM's stop rule, `compat.stops_after`),
    nothing else to settle."""
    if (
        len(token_ids) != 1
        or request.is_finished()
        or request.num_stale_output_tokens
        or request.has_encoder_inputs
        or request.use_structured_output
        or request.pooling_params is not None
    ):
        return False
    params = request.sampling_params
    if params.repetition_detection is not None:
        return False
    return not stops_after(
        token_ids[0], request.num_tokens + 1, request.num_output_tokens + 1, request.max_tokens, max_model_len,
        params.eos_token_id, params.stop_token_ids,
    )
