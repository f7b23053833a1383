"""Stage-0 scheduler with paired CFG co-scheduling.

A request whose speech options ask for guidance (`cfg_scale` > 1) gets a hidden unconditional
companion (`cfg.py`) for each of its guided (audio) segments, as ESPnet rebuilds its unguided
branch at each guided segment's start: all pad over the main's context before the segment's
modality row, then the modality token. The companion joins the main
* at arrival, when the answer opens with an enforced audio segment: prompt all pad, as long as
  the main's; both compute the modality row, and the companion is fed the main's token;
* otherwise at the segment's first row, once the main's modality token is known (sampled, or
  forced by the output mode while it is still in flight): prompt all pad over the main's context
  before the modality row, then the modality token. A main whose in-flight modality row is the
  model's choice (async scheduling) waits one step for it.
It ends when the main's segment does (the main emits anything but a stream-0 audio code). While
it lives, the pair is one scheduling unit:

* admitted together: a pair whose members to admit do not all fit (slots, KV blocks, token
  budget) is held out of the waiting queue for that step, so requests behind it still run (no
  head-of-line blocking); after `MAX_PAIR_HOLD_STEPS` held steps nothing behind it is admitted
  until it fits (no starvation). A running main whose new companion does not fit is preempted
  and waits with it (mains holding slots while they wait for their companions could deadlock);
* preempted together: before vLLM's own scheduling pass, if the running requests' next blocks do
  not fit, whole units are preempted from the back of the running queue (vLLM would otherwise
  preempt one member and split the pair);
* finished and aborted together (the main's end ends its companion; a companion that ends before
  its segment does ends its main, which must not decode a guided segment unguided), and the
  companion's outputs never leave the EngineCore (nor reach the async_chunk connector).

With async_chunk streaming, a request's steps reach vllm-omni's chunk adapter only when they
complete a codec window (`WindowGate`, window_gate.py): the adapter
copies the request and wakes its save thread on every call it gets. The client gets a request's
frames (`codes.audio`) in blocks of steps (`ClientFrameBlocks`, client_frames.py).
Decode rows that only append a token take a short update path (`SteadyRowsMixin`, steady_rows.py).

A companion prefills completely in one step (chunked prefill is off) in the step where its main
computes the same output position, and the two then decode one token per step: both members are
always as long as each other (`_check_lockstep`; a companion that lost that because its main was
preempted before it started is made again). Both see the same length limits (the companion's
`max_tokens` is cut to the main's remaining budget) and the same stop tokens (the model emits the
main's token for both).
"""

from __future__ import annotations

import time
from typing import Any

from vllm.logger import init_logger
from vllm.v1.request import RequestStatus
from vllm_omni.core.sched.omni_ar_scheduler import OmniARAsyncScheduler, OmniARScheduler
from vllm_omni.engine.serialization import deserialize_additional_information
from vllm_omni.request import OmniRequest

from vllm_omni_speechlm import window_trace
from vllm_omni_speechlm.cfg import companion_id, guided_mode, is_companion, unconditional_prompt
from vllm_omni_speechlm.compat import gate_chunk_sends, salt_prefix_blocks, send_on_calling_thread
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.decoding import OutputMode, RowKind, enforced_kind
from vllm_omni_speechlm.frames import InterStageRows, StepOutputs
from vllm_omni_speechlm.stage0.client_frames import ClientFrameBlocks
from vllm_omni_speechlm.stage0.steady_rows import SteadyRowsMixin
from vllm_omni_speechlm.stage0.window_gate import WindowGate
from vllm_omni_speechlm.stage_input_processors.speech_codec import chunk_settings, speechlm2codec_async_chunk
from vllm_omni_speechlm.streaming import SCHEDULER_THREAD_KEY

logger = init_logger(__name__)

MAX_PAIR_HOLD_STEPS = 64


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _length(request: Any) -> int:
    """Tokens known or in flight. A pair's members are always equally long: a companion starts as
    long as its main (its prompt ends where the main's next step feeds) and both then grow in step."""
    return request.num_tokens + request.num_output_placeholders


class _PairedCFGMixin:
    """Pair bookkeeping on top of vllm-omni's AR scheduler (sync or async variant)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.partner: dict[str, str] = {}  # both directions: main <-> companion
        self._guided: dict[str, OutputMode] = {}  # live main requests that ask for guidance: their output mode
        self._guided_from: dict[str, int] = {}  # main with a companion -> output index of its segment's first row
        self._held_steps: dict[str, int] = {}  # main id -> consecutive steps held back
        self._orphans: set[str] = set()  # pair members whose partner finished first
        self._updates_without_pairs = 2  # scheduler updates since a pair last existed
        logger.info("stage-0 scheduler: %s (paired CFG)", type(self).__name__)
        self.speech = SpeechLMConfig.from_hf_config(self.vllm_config.model_config.hf_config)
        self._gate: WindowGate | None = None
        self._gate_ended: set[str] = set()  # external ids freed since the last step
        self.frame_blocks = ClientFrameBlocks(self.speech.num_streams)
        self._updating = False  # inside update_from_output
        self._drain_sends = lambda: None  # sends queued outside `save_async` (an abort's unlinking), when sent inline
        adapter = getattr(self, "chunk_transfer_adapter", None)
        if adapter is not None:
            self._gate_sends(adapter)

    def _gate_sends(self, adapter: Any) -> None:
        """Companions send nothing downstream; with the speech-codec processor, a main request's
        step reaches the adapter only when it completes a window (`WindowGate`), and with
        `codec_windows_on_scheduler_thread` the window is cut and written on this thread."""
        if adapter.custom_process_next_stage_input_func is speechlm2codec_async_chunk:
            settings = chunk_settings(adapter)
            self._gate = WindowGate(self.speech, settings)
            logger.info("stage-0 chunk sends: only window-completing steps reach the adapter (WindowGate)")
            if settings[SCHEDULER_THREAD_KEY]:
                self._drain_sends = send_on_calling_thread(adapter)
                logger.info("stage-0 windows: cut and written on the scheduler's thread")
        self._send_chunk = gate_chunk_sends(adapter, self._offer_chunk)

    def _offer_chunk(self, request: Any, payload: Any, finished: bool) -> tuple[bool, Any]:
        if is_companion(request.request_id):
            return False, None
        if self._gate is None:
            return True, payload
        return self._gate.offer(request, payload, finished)

    def _hand_over_steady_rows(self, inter_stage: Any, rows: list[tuple[Any, int, list[int]]]) -> None:
        """A step's steady rows that carry frames alone go through the gate at once (`offer_step`):
        no payload built and no adapter call per row."""
        if self._gate is None or not isinstance(inter_stage, InterStageRows) or not inter_stage.frames_only:
            return super()._hand_over_steady_rows(inter_stage, rows)
        new_tokens = {request.request_id: new for request, _, new in rows}
        mains = [(request, row) for request, row, _ in rows if not is_companion(request.request_id)]
        for request, payload in self._gate.offer_step(inter_stage.frames, mains):
            self._send_chunk(payload, request, False, new_token_ids=new_tokens[request.request_id],
                             confirmed_num_computed_tokens=None)

    # ---- arrival and guided segments --------------------------------------------------------
    def add_request(self, request: Any) -> None:
        started = time.perf_counter()
        if self.cache_config.enable_prefix_caching and max(request.prompt_token_ids or [0]) >= self.speech.codec_start:
            # Codec ids are audio rows: their KV depends on streams the block hash leaves out
            # (docs/architecture.md, "Prefix caching"), so such a prompt shares no block.
            salt_prefix_blocks(request, f"codec-ids:{request.request_id}")
        super().add_request(request)
        payload = getattr(request, "additional_information", None)
        info = deserialize_additional_information(payload) if payload is not None else {}
        self.frame_blocks.admit(request.request_id, info)
        mode = guided_mode(info, self.speech)
        if mode is not None:
            self._guided[request.request_id] = mode
            if enforced_kind(mode, 0) == RowKind.FORCE_AUDIO:  # opens with a guided segment: pair from arrival
                self._add_companion(request, request.num_prompt_tokens, None, first_row=1)
        window_trace.log_admitted(getattr(request, "arrival_time", None), started)

    def _start_guided_segments(self) -> None:
        """Give each guided main whose next step computes a guided segment's first row its
        companion; hold one step a main whose in-flight modality row is the model's choice."""
        for main_id, mode in self._guided.items():
            main = self.requests.get(main_id)
            if main is None or main.num_stale_output_tokens:
                continue
            if main_id in self.partner:
                if not self._companion_out_of_step(main):
                    continue
                self._end_companion(main_id)  # made again below, as long as its main now is
            row = main.num_output_tokens + main.num_output_placeholders - 1  # the row its next step feeds
            starts = self._opens_guided_segment(main, mode, row)
            if starts is None:
                self._hold(main)
            elif starts:
                self._add_companion(main, main.num_prompt_tokens + row, self.speech.specials.audio, first_row=row + 1)
                if main_id in self.partner:  # admitted before anything else waiting (with its main, if preempted)
                    self._to_front([r for r in self._unit(main) if r.status != RequestStatus.RUNNING])

    def _companion_out_of_step(self, main: Any) -> bool:
        """Whether the main's companion has not run yet and is no longer as long as its main: the
        main was preempted before the pair's first step and lost the row in flight it was made for."""
        companion = self.requests[self.partner[main.request_id]]
        not_run = companion.num_computed_tokens == 0 and not companion.num_output_tokens
        return not_run and not companion.num_stale_output_tokens and _length(companion) != _length(main)

    def _opens_guided_segment(self, main: Any, mode: OutputMode, row: int) -> bool | None:
        """Whether output `row` of `main` is an audio modality token (a guided segment starts
        after it); None while that is not known yet (a modality row of the model's choice in
        flight). Read from the main's emitted tokens, host facts the scheduler already has."""
        if row < 0:
            return False
        outputs, sp = main.output_token_ids, self.speech.specials
        if row < main.num_output_tokens:
            return outputs[row] == sp.audio
        if row > 0 and outputs[row - 1] != sp.assistant:  # in flight, and not a modality row
            return False
        kind = enforced_kind(mode, outputs[:row].count(sp.assistant))  # a segment follows each <|assistant|>
        return None if kind == RowKind.CHOOSE else kind == RowKind.FORCE_AUDIO

    def _add_companion(self, main: Any, context_len: int, modality: int | None, first_row: int) -> None:
        prompt = unconditional_prompt(context_len, self.speech.specials.pad, modality)
        # The same last position as the main's: vLLM's length checks stop (or skip) both alike.
        params = main.sampling_params.clone()
        params.max_tokens = main.num_prompt_tokens + main.max_tokens - len(prompt)
        # What it samples is replaced by its main's tokens: a seed would only make vLLM's sampler
        # draw its noise row by row (a seeded row's own generator) instead of with the batch's.
        params.seed = None
        if params.max_tokens <= 0:  # the answer ends before the segment's first row
            return
        companion = OmniRequest(
            request_id=companion_id(main.request_id),
            external_req_id=companion_id(main.external_req_id or main.request_id),
            client_index=main.client_index,
            prompt_token_ids=prompt,
            sampling_params=params,
            pooling_params=None,
            arrival_time=main.arrival_time,
            priority=main.priority,
            block_hasher=main._block_hasher,
            additional_information=main.additional_information,
        )
        self.partner[main.request_id] = companion.request_id
        self.partner[companion.request_id] = main.request_id
        self._guided_from[main.request_id] = first_row
        super().add_request(companion)

    def _to_front(self, requests: list[Any]) -> None:
        """Requests to the front of the waiting queue, in this order."""
        self.waiting.remove_requests(requests)
        for request in reversed(requests):
            self.waiting.prepend_request(request)

    def _hold(self, request: Any) -> None:
        """Keep a running request out of this step: vLLM's scheduler skips a running request
        while its step counter (advanced as `schedule` starts) is below this."""
        request.next_decode_eligible_step = self.current_step + 2

    def _end_guided_segments(self) -> None:
        """End the companions whose main has left its guided segment: the main emitted anything
        but a stream-0 audio code (eos, eot, deferred eos; after a max length, the forced
        `<|assistant|>` or eos)."""
        first_code, end_code = self.speech.streams[0].vocab_start, self.speech.streams[0].vocab_end
        for main_id, first_row in list(self._guided_from.items()):
            main = self.requests.get(main_id)
            if main is None or main.num_output_tokens <= first_row:
                continue
            if not first_code <= main.output_token_ids[-1] < end_code:
                self._end_companion(main_id)

    def _end_companion(self, main_id: str) -> None:
        companion = self.partner.pop(main_id)
        del self.partner[companion], self._guided_from[main_id]  # not an orphan: its main goes on
        super().finish_requests(companion, RequestStatus.FINISHED_ABORTED)

    # ---- scheduling -------------------------------------------------------------------------
    def schedule(self, *args: Any, **kwargs: Any) -> Any:
        self._finish_orphans()
        if self._gate_ended:  # their finishing save (if any) came after the free, last step
            self._gate.forget(self._gate_ended)
            self._gate_ended = set()
        self._forget_gone_pairs()
        if self._guided:
            self._start_guided_segments()
        if not self.partner:  # no pair anywhere: vLLM's scheduling, untouched (holds included)
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
        pair judged to fit is never split by vLLM's admission loop. A running main whose new
        companion does not fit is preempted and waits with it: holding its slot instead could
        deadlock with other mains doing the same."""
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
            admit = [r for r in unit if r.status != RequestStatus.RUNNING]
            need_tokens = sum(r.num_tokens - r.num_computed_tokens for r in admit)
            need_blocks = sum(_cdiv(r.num_tokens + 1, self.block_size) for r in admit)
            fits = len(admit) <= slots and need_tokens <= tokens and need_blocks <= blocks
            fits = fits and not any(r.num_stale_output_tokens for r in admit)  # a member's length is still in flight
            slots, tokens, blocks = slots - len(admit), tokens - need_tokens, blocks - need_blocks
            if len(unit) == 1 or fits:
                self._held_steps.pop(unit[0].request_id, None)
                continue
            steps = self._held_steps[unit[0].request_id] = self._held_steps.get(unit[0].request_id, 0) + 1
            if steps > MAX_PAIR_HOLD_STEPS:  # starving: admit nothing behind it until it fits
                rest = list(self.waiting)
                held += rest[rest.index(admit[0]) :]
                break
            held += admit
        held = self._with_preempted_mains(held)
        self.waiting.remove_requests(held)
        return held

    def _with_preempted_mains(self, held: list[Any]) -> list[Any]:
        """`held` with the running main of each held companion preempted and put just before it
        (it must not run without it, and the pair stays adjacent in the queue). A main with a step
        in flight is held for this step instead: preempted now, it would lose the row its
        companion was made for."""
        out = []
        for request in held:
            main = self.requests.get(self.partner.get(request.request_id, "")) if is_companion(request.request_id) else None
            if main is not None and main.status == RequestStatus.RUNNING and main.num_output_placeholders:
                self._hold(main)
            elif main is not None and main.status == RequestStatus.RUNNING:
                self.running.remove(main)
                self._preempt_request(main, time.monotonic())
                out.append(main)
            out.append(request)
        return out

    def _check_lockstep(self, output: Any) -> None:
        scheduled = output.num_scheduled_tokens
        for main, companion in self.partner.items():
            if not is_companion(companion) or (main not in scheduled and companion not in scheduled):
                continue
            lengths = {self.requests[r].num_computed_tokens for r in (main, companion) if r in scheduled}
            if main not in scheduled or companion not in scheduled or len(lengths) != 1:
                raise RuntimeError(f"CFG pair {main}: members out of step (pair invariant broken)")

    # ---- results and finishing --------------------------------------------------------------
    def update_from_output(self, scheduler_output: Any, model_runner_output: Any) -> Any:
        # A companion ended while a step of it was in flight still reports (async scheduling).
        had_pairs = bool(self.partner) or self._updates_without_pairs < 2
        runner_outputs = getattr(model_runner_output, "multimodal_outputs", None)
        runner_outputs = runner_outputs if isinstance(runner_outputs, StepOutputs) else None  # None: per-request payloads
        if self._gate is not None:
            self._gate.tick()
        window_trace.log_step(scheduler_output.total_num_scheduled_tokens, len(scheduler_output.num_scheduled_tokens),
                              self._gate.handed_total if self._gate is not None else 0)
        self._updating = True
        try:
            outputs = super().update_from_output(scheduler_output, model_runner_output)
        finally:
            self._updating = False
            window_trace.updated()
        self._finish_orphans()
        if had_pairs:
            self._end_guided_segments()
            self._drop_companion_outputs(outputs)
        self._updates_without_pairs = 0 if self.partner else self._updates_without_pairs + 1
        # Once for the whole step (every client's outputs): it then drops the freed requests' frames.
        step_outputs = [o for e in outputs.values() for o in e.outputs]
        self.frame_blocks.regroup(step_outputs, runner_outputs, model_runner_output.req_id_to_index, self.requests)
        self._drain_sends()
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
        finished = super().finish_requests(request_ids, finished_status)
        self._drain_sends()
        return finished

    def _free_request(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        """Every finish path (stop, length, abort, error) ends here. A partner still alive is an
        orphan (it cannot decode alone); `_finish_orphans` ends it outside vLLM's finish loop."""
        if self._gate is not None:
            self._gate_ended.add(request.external_req_id)
        self.frame_blocks.forget(request.request_id, after_this_step=self._updating)
        other = self.partner.pop(request.request_id, None)
        self._held_steps.pop(request.request_id, None)
        self._guided.pop(request.request_id, None)
        self._guided_from.pop(request.request_id, None)
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
