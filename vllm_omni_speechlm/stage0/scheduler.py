"""Stage-0 scheduler with paired CFG co-scheduling.

A request whose speech options ask for guidance (`cfg_scale > 1`) gets a hidden unconditional
companion (`cfg.py`), created here when the request arrives. The pair is one scheduling unit:

* admitted together: a pair whose two prompts do not both fit (slots, KV blocks, token budget)
  is held out of the waiting queue for that step, so requests behind it still run (no
  head-of-line blocking); after `MAX_PAIR_HOLD_STEPS` held steps nothing behind it is admitted
  until it fits (no starvation);
* preempted together: before vLLM's own scheduling pass, if the running requests' next blocks do
  not fit, whole units are preempted from the back of the running queue (vLLM would otherwise
  preempt one member and split the pair);
* finished and aborted together, and the companion's outputs never leave the EngineCore (nor
  reach the async_chunk connector).

With async_chunk streaming, a request's steps reach vllm-omni's chunk adapter only when they
complete a codec window (`WindowGate`, window_gate.py): the adapter
copies the request and wakes its save thread on every call it gets. The client gets a request's
frames (`codes.audio`) in blocks of steps (`ClientFrameBlocks`, client_frames.py).
Decode rows that only append a token take a short update path (`SteadyRowsMixin`, steady_rows.py).

Both members prefill completely in one step (chunked prefill is off) and then decode one token
per step, so they always sample the same output position in the same step. The all-pad
unconditional prompts are identical across pairs of equal length, so with prefix caching on they
share KV blocks.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus
from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler, OmniARScheduler
from vllm_omni.engine.serialization import deserialize_additional_information
from vllm_omni.request import OmniRequest

from vllm_omni_speechlm.cfg import companion_id, is_companion, unconditional_prompt, wants_guidance
from vllm_omni_speechlm.compat import gate_chunk_sends
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.frames import StepOutputs
from vllm_omni_speechlm.stage0.client_frames import ClientFrameBlocks
from vllm_omni_speechlm.stage0.steady_rows import SteadyRowsMixin
from vllm_omni_speechlm.stage0.window_gate import WindowGate
from vllm_omni_speechlm.stage_input_processors.speech_codec import chunk_settings, speechlm2codec_async_chunk

logger = init_logger(__name__)

MAX_PAIR_HOLD_STEPS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class _PairedCFGMixin:
    """Pair bookkeeping on top of vllm-omni's AR scheduler (sync or async variant)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.partner: dict[str, str] = {}  # both directions: main <-> companion
        self._held_steps: dict[str, int] = {}  # main id -> consecutive steps held back
        self._orphans: set[str] = set()  # pair members whose partner finished first
        logger.info("stage-0 scheduler: %s (paired CFG)", type(self).__name__)
        self.speech = SpeechLMConfig.from_hf_config(self.vllm_config.model_config.hf_config)
        self._gate: WindowGate | None = None
        self._gate_ended: set[str] = set()  # external ids freed since the last step
        self.frame_blocks = ClientFrameBlocks(self.speech.num_streams)
        self._updating = False  # inside update_from_output
        adapter = getattr(self, "chunk_transfer_adapter", None)
        if adapter is not None:
            self._gate_sends(adapter)

    def _gate_sends(self, adapter: Any) -> None:
        """Companions send nothing downstream; with the speech-codec processor, a main request's
        step reaches the adapter only when it completes a window (`WindowGate`)."""
        if adapter.custom_process_next_stage_input_func is speechlm2codec_async_chunk:
            self._gate = WindowGate(self.speech, chunk_settings(adapter))
            logger.info("stage-0 chunk sends: only window-completing steps reach the adapter (WindowGate)")
        gate_chunk_sends(adapter, self._offer_chunk)

    def _offer_chunk(self, request: Any, payload: Any, finished: bool) -> tuple[bool, Any]:
        if is_companion(request.request_id):
            return False, None
        if self._gate is None:
            return True, payload
        return self._gate.offer(request, payload, finished)

    # ---- arrival ----------------------------------------------------------------------------
    def add_request(self, request: Any) -> None:
        super().add_request(request)
        if self._wants_guidance(request):
            companion = self._companion_of(request)
            self.partner[request.request_id] = companion.request_id
            self.partner[companion.request_id] = request.request_id
            super().add_request(companion)

    def _wants_guidance(self, request: Any) -> bool:
        payload = getattr(request, "additional_information", None)
        info = deserialize_additional_information(payload) if payload is not None else {}
        return wants_guidance(info, self.speech)

    def _companion_of(self, main: Any) -> OmniRequest:
        return OmniRequest(
            request_id=companion_id(main.request_id),
            external_req_id=companion_id(main.external_req_id or main.request_id),
            client_index=main.client_index,
            prompt_token_ids=unconditional_prompt(main.prompt_token_ids, self.speech.specials.pad),
            sampling_params=main.sampling_params.clone(),
            pooling_params=None,
            arrival_time=main.arrival_time,
            priority=main.priority,
            block_hasher=main._block_hasher,
            additional_information=main.additional_information,
        )

    # ---- scheduling -------------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._finish_orphans()
        if self._gate_ended:  # their finishing save (if any) came after the free, last step
            self._gate.forget(self._gate_ended)
            self._gate_ended = set()
        self._forget_gone_pairs()
        if not self.partner:  # no pair anywhere: vLLM's scheduling, untouched
            return super().schedule(*args, **kwargs)
        self._preempt_units_for_room()
        held = self._hold_pairs_that_do_not_fit() if any(r.request_id in self.partner for r in self.waiting) else []
        try:
            output = super().schedule(*args, **kwargs)
        finally:
            for request in reversed(held):
                self.waiting.prepend_request(request)
        self._check_lockstep(output)
        return output

    def _forget_gone_pairs(self) -> None:
        """Drop pair entries of requests the scheduler no longer holds (belt and braces: every
        finish path already goes through `_free_request`)."""
        for request_id in [r for r in self.partner if r not in self.requests]:
            self.partner.pop(request_id, None)

    def _unit(self, request: Any) -> list[Any]:
        """The request and, for a pair member, its partner (main first)."""
        other = self.requests.get(self.partner.get(request.request_id, ""))
        if other is None:
            return [request]
        return [other, request] if is_companion(request.request_id) else [request, other]

    def _new_blocks(self, request: Any) -> int:
        """KV blocks `request` may allocate in its next step (decode: one token, plus in-flight
        async outputs; conservative)."""
        tokens = request.num_computed_tokens + request.num_output_placeholders + 2
        (owned,) = self.kv_cache_manager.get_block_ids(request.request_id)[:1]
        return max(0, _cdiv(tokens, self.block_size) - len(owned))

    def _spare_blocks(self) -> int:
        manager = self.kv_cache_manager
        return manager.block_pool.get_num_free_blocks() - manager.watermark_blocks

    def _preempt_units_for_room(self) -> None:
        """Preempt whole units from the back of the running queue until every running request's
        next step fits, so vLLM's pass never has to preempt a lone pair member."""
        free = self._spare_blocks()
        if free >= 2 * len(self.running):  # the common case, without a per-request walk
            return
        need = sum(self._new_blocks(r) for r in self.running)
        while need > free and len(self.running) > 1:
            unit = self._unit(self.running[-1])
            for request in unit:
                if request in self.running:
                    need -= self._new_blocks(request)
                    self.running.remove(request)
                    self._preempt_request(request, time.monotonic())
            free = self._spare_blocks()
            self.waiting.remove_requests(unit)  # keep the pair adjacent, main first
            for request in reversed(unit):
                self.waiting.prepend_request(request)

    def _hold_pairs_that_do_not_fit(self) -> list[Any]:
        """Take pairs that cannot be admitted together out of the waiting queue for this step.
        Requests ahead of a pair are budgeted conservatively (whole prompt, no cache hits), so a
        pair judged to fit is never split by vLLM's admission loop."""
        slots = self.max_num_running_reqs - len(self.running)
        tokens = self.max_num_scheduled_tokens - len(self.running)
        blocks = self._spare_blocks() - len(self.running)  # each running request may take a block
        held: list[Any] = []
        seen: set[str] = set()
        for request in list(self.waiting):
            if request.request_id in seen:
                continue
            unit = self._unit(request)
            seen.update(r.request_id for r in unit)
            need_tokens = sum(r.num_tokens - r.num_computed_tokens for r in unit)
            need_blocks = sum(_cdiv(r.num_tokens + 1, self.block_size) for r in unit)
            fits = len(unit) <= slots and need_tokens <= tokens and need_blocks <= blocks
            slots, tokens, blocks = slots - len(unit), tokens - need_tokens, blocks - need_blocks
            if len(unit) == 1 or fits:
                self._held_steps.pop(unit[0].request_id, None)
                continue
            steps = self._held_steps[unit[0].request_id] = self._held_steps.get(unit[0].request_id, 0) + 1
            if steps > MAX_PAIR_HOLD_STEPS:  # starving: admit nothing behind it until it fits
                rest = list(self.waiting)
                held += rest[rest.index(unit[0]) :]
                break
            held += unit
        self.waiting.remove_requests(held)
        return held

    def _check_lockstep(self, output: Any) -> None:
        scheduled = output.num_scheduled_tokens
        for main, companion in self.partner.items():
            if not is_companion(companion):
                continue
            if (main in scheduled) != (companion in scheduled):
                raise RuntimeError(f"CFG pair {main}: only one member was scheduled (pair invariant broken)")

    # ---- results and finishing --------------------------------------------------------------
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        had_pairs = bool(self.partner)
        runner_outputs = getattr(model_runner_output, "multimodal_outputs", None)
        runner_outputs = runner_outputs if isinstance(runner_outputs, StepOutputs) else None  # None: per-request payloads
        self._updating = True
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            self._updating = False
        self._finish_orphans()
        if had_pairs:
            self._drop_companion_outputs(outputs)
        # Once for the whole step (every client's outputs): it then drops the freed requests' frames.
        step_outputs = [o for e in outputs.values() for o in e.outputs]
        self.frame_blocks.regroup(step_outputs, runner_outputs, model_runner_output.req_id_to_index, self.requests)
        return outputs

    @staticmethod
    def _drop_companion_outputs(outputs: dict) -> None:
        for engine_outputs in outputs.values():
            engine_outputs.outputs = [o for o in engine_outputs.outputs if not is_companion(o.request_id)]
            if engine_outputs.finished_requests:
                engine_outputs.finished_requests = {r for r in engine_outputs.finished_requests if not is_companion(r)}

    def finish_requests(self, request_ids: Any, finished_status: Any) -> Any:
        if request_ids is not None:
            ids = {request_ids} if isinstance(request_ids, str) else set(request_ids)
            request_ids = ids | {self.partner[i] for i in ids if i in self.partner}
        return super().finish_requests(request_ids, finished_status)

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """Every finish path (stop, length, abort, error) ends here. A partner still alive is an
        orphan (it cannot decode alone); `_finish_orphans` ends it outside vLLM's finish loop."""
        if self._gate is not None:
            self._gate_ended.add(request.external_req_id)
        self.frame_blocks.forget(request.request_id, after_this_step=self._updating)
        other = self.partner.pop(request.request_id, None)
        self._held_steps.pop(request.request_id, None)
        if other in self.partner:
            self._orphans.add(other)
        return super()._free_request(request, *args, **kwargs)

    def _finish_orphans(self) -> None:
        orphans, self._orphans = self._orphans, set()
        alive = [rid for rid in orphans if rid in self.requests and not self.requests[rid].is_finished()]
        if alive:
            super().finish_requests(alive, RequestStatus.FINISHED_ABORTED)


class PairedCFGScheduler(_PairedCFGMixin, SteadyRowsMixin, OmniARScheduler):
    """Synchronous scheduling variant."""

    def __new__(cls, *args: Any, **kwargs: Any):
        # One dotted path for the pipeline; the variant follows the engine's async setting.
        vllm_config = kwargs.get("vllm_config", args[0] if args else None)
        if cls is PairedCFGScheduler and vllm_config.scheduler_config.async_scheduling:
            return PairedCFGAsyncScheduler(*args, **kwargs)
        return super().__new__(cls)


class PairedCFGAsyncScheduler(_PairedCFGMixin, SteadyRowsMixin, OmniARAsyncScheduler):
    """Asynchronous scheduling variant (vLLM's default on GPU)."""
