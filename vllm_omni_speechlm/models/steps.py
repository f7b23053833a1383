"""The per-step decoding of a speech LM stage: rows, admission, device math, step graphs.

`SpeechLMForCausalLM` (speechlm.py) holds the layers; vllm-omni's AR runner calls its hooks,
which hand each step to `SpeechLMSteps`, in this order:

    prepare        note the step's rows; stage sum embed(streams 1..S-1 of each token's previous
                   step), read from the request table, in the model's fixed aux-input buffer
                   (batched; no per-request runner hooks)
    output         admit new requests; hand the runner this step's [N, S] host frame buffer
                   (filled below, copied once in `sample`; frames.py)
    logits         row kinds from the phase machine; streams 1..S-1
                   projected on their own vocabulary slices in one batched matmul and sampled;
                   CFG pairs merged; stream-0 masks, top-k, temperature compensation; returns
                   what vLLM's sampler gets
    sample         vLLM's own Sampler picks stream 0; the phase machine advances

On CUDA the device math runs as four `torch.compile`d functions (the `*_eager` methods;
`compile_step_functions`), compiled in vLLM's warm-up: eagerly it is ~100 small kernel launches
per step, the host's critical path at tens of requests. A step whose rows all sample (CFG pairs
too) replays CUDA graphs of `logits_step` and `advance_step` instead (step_graphs.py); the one
after it, if it decodes the same rows, finds its aux input staged by them.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.fx.experimental._config as fx_config
from vllm.config import CompilationMode, CUDAGraphMode, VllmConfig
from vllm.logger import init_logger
from vllm.utils.torch_utils import set_torch_threads_for_runtime
from vllm.v1.sample.sampler import Sampler

from vllm_omni_speechlm.cfg import merge_guided
from vllm_omni_speechlm.config import STEP_GRAPHS_KEY, SpeechLMConfig
from vllm_omni_speechlm.decoding import DecodingRules, is_audio_row
from vllm_omni_speechlm.frames import FRAME_ROWS_KWARG, FrameRows
from vllm_omni_speechlm.models.request_state import RequestEntry, RequestTable, to_device
from vllm_omni_speechlm.models.step_graphs import Recorder, StepGraphs, cuda_graph
from vllm_omni_speechlm.models.text_rows import TextRowsWatch
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

logger = init_logger(__name__)

UNKNOWN_LEN = 1 << 62  # prompt length of a request not admitted yet: all its tokens are prompt


class StepModel(Protocol):
    """What the steps use of the model (`SpeechLMForCausalLM`)."""

    speech: SpeechLMConfig
    lm_head: torch.nn.Module
    aux_start: torch.Tensor  # [S-1] each aux stream's first vocabulary id
    aux_input: torch.Tensor  # [max tokens, H] the next forward's summed aux-stream embeddings

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def aux_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...
    def aux_embeds(self, aux: torch.Tensor) -> torch.Tensor: ...


@dataclass
class StepRows:
    """This step's rows (one per scheduled request, in logits-row order)."""

    req_ids: list[str] = field(default_factory=list)
    entries: list[RequestEntry | None] = field(default_factory=list)  # None until admitted
    computed: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # tokens computed before
    scheduled: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # tokens this step
    # Per row, set in prepare and completed at admission (output):
    slots: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    prompt_len: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # UNKNOWN_LEN until known
    generated: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # output index each row samples
    samples: list[bool] = field(default_factory=list)  # False: a partial prefill chunk
    max_top_k: int | None = None  # over the entries; None: not known yet (logits)
    num_released: int = 0  # the table's count of releases when the rows were read
    sampled: slice | torch.Tensor | None = None  # the rows that sample; slice(None) when all do (no gather)
    index: torch.Tensor | None = None  # [2, N] device slots and output indices (logits)
    graphed: bool = False  # logits replayed the step graphs
    guided: tuple[torch.Tensor, torch.Tensor] | None = None  # CFG: [2, N] partner and source rows, [N] scale (`_guidance`)


def _token_outputs(computed: np.ndarray, scheduled: np.ndarray, prompt_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-request [R] counts -> per scheduled token [T]: its request row and its output index
    (position - prompt length; negative for prompt tokens)."""
    row = np.repeat(np.arange(len(scheduled)), scheduled)
    first = np.repeat(np.cumsum(scheduled) - scheduled, scheduled)  # flat index of each row's first token
    return row, computed[row] + (np.arange(row.size) - first) - prompt_len[row]


def step_compile_backend(vllm_config: VllmConfig) -> str | None:
    """Inductor on CUDA; eager on CPU and where the user turned compilation off (enforce_eager, -O0)."""
    if vllm_config.device_config.device_type != "cuda" or vllm_config.compilation_config.mode == CompilationMode.NONE:
        return None
    return "inductor"


def tensor_parallel_size(vllm_config: VllmConfig) -> int:
    parallel = getattr(vllm_config, "parallel_config", None)
    return getattr(parallel, "tensor_parallel_size", 1)


def step_graph_sizes(vllm_config: VllmConfig) -> list[int]:
    """vLLM's capture sizes of two rows and more where the step functions compile and vLLM graphs
    the backbone, unless the user switched the step graphs off (`--additional-config
    '{"speech_lm_step_graphs": false}'`). One row runs padded to two: the step functions then never
    meet one row, and compile a variant fewer at start-up."""
    graphs = vllm_config.compilation_config.cudagraph_mode
    extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
    if step_compile_backend(vllm_config) is None or graphs in (None, CUDAGraphMode.NONE) or not extra.get(STEP_GRAPHS_KEY, True):
        return []
    return [size for size in vllm_config.compilation_config.cudagraph_capture_sizes or [] if size > 1]


class SpeechLMSteps:
    """Step state and device math of one speech LM stage model (see the module docstring)."""

    def __init__(self, model: StepModel, vllm_config: VllmConfig):
        self.model, self.speech = model, model.speech
        self.sampler = Sampler()
        sched = vllm_config.scheduler_config
        self._table_shape = (2 * sched.max_num_seqs, vllm_config.model_config.max_model_len)
        self.table: RequestTable | None = None  # built on first use, on the weights' device
        self.rules: DecodingRules | None = None
        self.graphs: StepGraphs | None = None  # built with the table where there are capture sizes
        self._graph_sizes = step_graph_sizes(vllm_config)
        self._partial_chunks = bool(sched.enable_chunked_prefill)  # steps with rows that do not sample
        self._tensor_parallel = tensor_parallel_size(vllm_config) > 1
        self.rows = StepRows()
        self._frames: torch.Tensor | None = None
        self.frames_host: torch.Tensor | None = None  # this step's [N, S] frames, on the host after `sample`
        self.num_resumed = 0  # re-prefills after preemption (observability, tests)
        self.num_resumed_companions = 0
        self.num_graph_staged_steps = 0  # steps whose aux input the step graphs staged
        self.num_narrow_steps = 0  # steps whose stream-0 logits skipped the text columns
        self.num_steps = 0  # steps with requests
        self.text_rows: TextRowsWatch | None = None
        self.compile_step_functions(step_compile_backend(vllm_config))

    def compile_step_functions(self, backend: str | Callable | None) -> None:
        """Run the per-step device math (`*_eager` below) compiled by torch.compile with `backend`,
        or eagerly (None). Eagerly it is ~100 small kernel launches per step, the engine's critical
        path at tens of requests; Inductor fuses them into a few kernels. dynamic=True: one graph
        serves every batch size >= 2. fullgraph: a graph break is an error, not a slow path."""
        fns = (self._staged_aux_eager, self._decode_rows_eager, self._primary_logits_eager, self._advance_rows_eager)
        self.step_backend = backend
        if backend is not None:
            fns = tuple(torch.compile(fn, backend=backend, fullgraph=True, dynamic=True) for fn in fns)
        self._staged_aux, self._decode_rows, self._primary_logits, self._advance_rows = fns

    def state(self) -> tuple[RequestTable, DecodingRules]:
        """The request table and decoding rules, built on first use on the weights' device."""
        if self.table is None:
            device = self.model.lm_head.weight.device
            self.rules = DecodingRules(self.speech, device)
            self.table = RequestTable(self.speech, *self._table_shape, device)
            self.text_rows = TextRowsWatch(device, wait=self._tensor_parallel)
            if self._graph_sizes:
                self.graphs = StepGraphs(self, self._graph_sizes, tensor_parallel=self._tensor_parallel)
        return self.table, self.rules

    def use_step_graphs(self, record: Recorder | None = cuda_graph, sizes: list[int] | None = None) -> None:
        """Step graphs recorded by `record` at `sizes` (default: vLLM's), or none (None)."""
        self.state()
        sizes = sizes or self._graph_sizes
        self.graphs = StepGraphs(self, sizes, record, self._tensor_parallel) if record is not None and sizes else None

    def __len__(self) -> int:
        """Requests holding per-request state (tests assert it returns to 0)."""
        return 0 if self.table is None else len(self.table)

    def release(self, req_ids: Sequence[str] | set[str]) -> None:
        if self.table is not None:
            self.table.release(req_ids)

    # ---- prepare: the step's rows and aux input ----------------------------------------------
    def prepare(self, input_ids: torch.Tensor, req_ids: list[str], computed: np.ndarray, scheduled: np.ndarray) -> None:
        """Before each forward, outside CUDA graphs: note the step's rows and stage the summed
        aux-stream embeddings of every scheduled token in the model's aux input, which its
        `forward` adds. The token at position p of a request is output p - prompt_len when
        p >= prompt_len, and its aux streams are `aux_history[slot, p - prompt_len]` (a
        re-prefill after preemption rebuilds them from there); prompt tokens have none."""
        table, _ = self.state()
        last = self.rows
        step = self.rows = StepRows(list(req_ids), computed=computed.astype(np.int64), scheduled=scheduled.astype(np.int64))
        same_rows = step.req_ids == last.req_ids and table.num_released == last.num_released
        if same_rows:  # the last step's batch (a decode step's usual case): its rows as that step left them
            step.entries, step.slots, step.prompt_len, step.max_top_k = last.entries, last.slots, last.prompt_len, last.max_top_k
        else:
            self._read_rows(step, table)
        step.num_released = table.num_released
        for i in np.flatnonzero(step.computed == 0).tolist():  # a first chunk: new, or preempted and now re-prefilled
            if step.entries[i] is not None:
                self.num_resumed += 1
                self.num_resumed_companions += step.entries[i].guided_by is not None
        if same_rows and last.graphed and (step.scheduled == 1).all():
            self.num_graph_staged_steps += 1  # each row feeds what it sampled: the step graphs staged it
            return
        row, output = _token_outputs(step.computed, step.scheduled, step.prompt_len)
        index = to_device(np.stack([step.slots[row], output]), input_ids.device)  # one copy
        self.model.aux_input[: row.size] = self._staged_aux(index)

    @staticmethod
    def _read_rows(step: StepRows, table: RequestTable) -> None:
        entries = step.entries = [table.entries.get(r) for r in step.req_ids]  # None: not admitted yet (output)
        step.prompt_len = np.array([UNKNOWN_LEN if e is None or e.prompt_len is None else e.prompt_len for e in entries])
        step.slots = np.array([0 if e is None else e.slot for e in entries], dtype=np.int64)

    def _staged_aux_eager(self, index: torch.Tensor) -> torch.Tensor:
        """[2, T] slot and output index (negative: a prompt token) of each scheduled token ->
        [T, H] summed embeddings of its aux streams (none for prompt tokens)."""
        slot, output = index
        aux = self.table.aux_history[slot, output.clamp(min=0)]
        aux = torch.where((output >= 0)[:, None], aux, self.speech.specials.pad)
        return self.model.aux_embeds(aux)

    # ---- output: admission and the step's frame buffer ----------------------------------------
    def _params(self, info: dict, seed: int | None, req_id: str) -> SpeechSamplingParams:
        """The request's speech options. They are validated where requests enter (API, generator);
        one that slips through invalid must not take the engine down, so it decodes with the
        checkpoint defaults and the error is logged."""
        try:
            return SpeechSamplingParams.from_info(info, seed).resolve(self.speech)
        except (TypeError, ValueError) as e:
            logger.error("request %s: invalid speech params (%s); using defaults", req_id, e)
            return SpeechSamplingParams(seed=seed).resolve(self.speech)

    def _admit(self, row: int, buffers: Sequence[dict] | None, sampling_metadata: Any) -> RequestEntry:
        """Admit a request on its first step. Its speech options come from its additional
        information; the aux-stream seed from the engine's own generator for the request
        (vLLM seeds it with SamplingParams.seed), so both streams follow one seed."""
        req_id = self.rows.req_ids[row]
        info = buffers[row] if buffers is not None and row < len(buffers) else {}
        generators = getattr(sampling_metadata, "generators", None) or {}
        seed = generators[row].initial_seed() if row in generators else None
        return self.table.admit(req_id, self._params(info, seed, req_id))

    def output(self, device: torch.device, **kwargs: Any) -> FrameRows | list[torch.Tensor]:
        """Admit the step's new requests; the step's frames, as one `FrameRows` when the runner
        asks for it (`FRAME_ROWS_KWARG`), else as per-row [1, S] views."""
        step = self.rows
        eligible = kwargs.get("request_sample_eligible")
        if eligible is None or len(eligible) != len(step.entries):
            eligible = [True] * len(step.entries)
        step.samples = np.asarray(eligible, dtype=bool).tolist()  # a list, or the runner's array
        ends = step.computed + step.scheduled
        buffers, metadata = kwargs.get("model_intermediate_buffer"), kwargs.get("sampling_metadata")
        for i in np.flatnonzero(step.prompt_len == UNKNOWN_LEN).tolist():  # not admitted, or prompt not all in
            entry = step.entries[i]
            if entry is None:
                entry = step.entries[i] = self._admit(i, buffers, metadata)
                step.slots[i], step.max_top_k = entry.slot, None
            if step.samples[i]:  # its first sampling step: the whole prompt is in
                entry.prompt_len = step.prompt_len[i] = int(ends[i])
        self.table.write_admitted()
        step.generated = ends - np.minimum(step.prompt_len, ends)  # 0 while the prompt is not all in
        # The [N, S] frames are filled on the device (logits, sample) and copied to the host once,
        # in `sample` (one tiny synchronous copy per request per step halved throughput at 512
        # requests). A fresh host buffer per step: it is read after the next step began.
        shape = (len(step.entries), self.speech.num_streams)
        self.frames_host = host = torch.empty(shape, dtype=torch.long, pin_memory=device.type == "cuda")
        frames = FrameRows(host, step.samples)
        return frames if kwargs.get(FRAME_ROWS_KWARG) else [frames.row(i) for i in range(len(step.samples))]

    # ---- logits ----------------------------------------------------------------------------
    def logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        step, n, device = self.rows, hidden_states.shape[0], hidden_states.device
        step.sampled, step.graphed = None, False
        if len(step.entries) != n or self.frames_host is None:  # profiling / warm-up: no requests
            raw = self.model.raw_logits(hidden_states)
            if self.step_backend is not None and n >= 4:
                self.warm_up_step_functions(hidden_states, raw)
            return raw
        table, _ = self.state()
        self.num_steps += 1
        if step.max_top_k is None:
            step.max_top_k = max(e.max_top_k for e in step.entries)
        generated = np.minimum(step.generated, table.max_output_len - 1)
        no_text_rows = table.num_text_capable == 0 and not self.text_rows.text_rows_possible()
        self.num_narrow_steps += no_text_rows
        guidance = self._guidance(step) if table.num_companions else None
        all_sample = all(step.samples)
        if self.graphs is not None and all_sample:
            logits = self.graphs.logits(hidden_states, step.slots, generated, step.max_top_k, no_text_rows, guidance)
            if logits is not None:
                step.graphed, step.guided = True, self.graphs.guided(n) if guidance is not None else None
                return logits
        step.guided = None if guidance is None else (to_device(guidance[0], device), to_device(guidance[1], device))
        step.index = to_device(np.stack([step.slots, generated]), device)  # [2, N], one copy
        # Rows that really sample (not a partial prefill chunk) update the request's state.
        step.sampled = slice(None) if all_sample else to_device(np.flatnonzero(step.samples), device)
        self._frames = torch.zeros(n, self.speech.num_streams, dtype=torch.long, device=device)
        return self.logits_step(hidden_states, step.index, step.max_top_k, no_text_rows, step.guided, self._frames, step.sampled)

    def logits_step(
        self,
        hidden: torch.Tensor,
        index: torch.Tensor,
        max_top_k: int,
        no_text_rows: bool,
        guided: tuple | None,
        frames: torch.Tensor,
        rows: slice | torch.Tensor,
    ) -> torch.Tensor:
        """`logits`' device work (also the body of a step graph): [N, H] hidden states, [2, N]
        slots and output indices -> [N, V] what vLLM's sampler gets; writes the aux streams into
        [N, S] `frames` and, for the sampling `rows`, into the aux history."""
        raw = self.model.raw_logits(hidden)
        noise = self._global_aux_noise(hidden.shape[0], hidden.device)
        raw, kinds, aux, kept = self._decode_rows(hidden, raw, index, max_top_k, noise, guided)
        frames[:, 1:] = kept  # emitted: the clip's cells; fed back (the history): every sampled one
        self.table.aux_history[index[0][rows], index[1][rows]] = aux[rows]
        return self._primary_logits(raw, kinds, index, max_top_k, no_text_rows)

    def stage_next_aux(self, index: torch.Tensor) -> None:
        """[2, N] slots and output indices -> this step's aux streams as fed back (the history
        `logits_step` wrote) staged as the next step's aux input, should it decode the same rows
        (a step graph's tail; `prepare` restages any other step)."""
        self.model.aux_input[: index.shape[1]] = self.model.aux_embeds(self.table.aux_history[index[0], index[1]])

    def _global_aux_noise(self, n: int, device: torch.device) -> torch.Tensor:
        """[N, S-1, W] Exp(1) noise from the global RNG (`_decode_rows` gives seeded rows their own)."""
        return torch.empty(n, self.speech.num_streams - 1, self.speech.aux_sample_width, device=device).exponential_()

    def _decode_rows_eager(
        self,
        hidden: torch.Tensor,
        raw: torch.Tensor,
        index: torch.Tensor,
        max_top_k: int,
        noise: torch.Tensor,
        guided: tuple | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The step's math after the LM head, without side effects: [N, H] hidden states, [N, V]
        raw stream-0 logits, [2, N] slots and output indices, the rows' largest top-k,
        [N, S-1, W] noise from the global RNG (seeded rows get their own) -> stream-0 logits
        (CFG-merged), [N] row kinds, [N, S-1] aux stream ids fed back and [N, S-1] emitted (int32;
        pad where not sampled, and where past a drained clip's end: `DecodingRules.aux_kept`)."""
        table, rules = self.table, self.rules
        slots, generated = index
        rows = table.row_sampling(slots, max_top_k)
        phase_step = table.phase_step[slots]
        kinds = rules.row_kinds(table.phase[slots], table.mode[slots], table.segment[slots], phase_step, rows)
        aux_logits = self.model.aux_logits(hidden)
        if guided is not None:
            raw, aux_logits, kinds = _merge_guided(raw, aux_logits, kinds, guided)
        slots_sampled = rules.sample_aux_streams(aux_logits, rows, table.aux_noise(slots, generated, noise))
        aux = rules.aux_token_ids(slots_sampled, self.model.aux_start)
        pad = self.speech.specials.pad
        kept = torch.where(rules.aux_kept(kinds, phase_step), aux, pad)
        aux = torch.where(rules.aux_sampled(kinds, phase_step), aux, pad)
        if guided is not None:  # the companion is fed the main's tokens
            src = guided[0][1]
            aux, kept = aux[src], kept[src]
        return raw, kinds, aux.to(torch.int32), kept.to(torch.int32)

    def _primary_logits_eager(
        self, raw: torch.Tensor, kinds: torch.Tensor, index: torch.Tensor, max_top_k: int, no_text_rows: bool
    ) -> torch.Tensor:
        """What vLLM's sampler gets (a function of its own: its variants double the graphs)."""
        rows = self.table.row_sampling(index[0], max_top_k)
        return self.rules.process_primary_logits(raw, kinds, rows, no_text_rows)

    @staticmethod
    def _guidance(step: StepRows) -> tuple[np.ndarray, np.ndarray] | None:
        """This step's CFG pairs as whole-batch rows, or None: [2, N] each row's unconditional
        partner (a main's companion, else itself) and the row whose tokens it takes (a
        companion's main, else itself), [N] its cfg scale (1 but on mains: the merge is then the
        row itself, exactly). The scheduler schedules a pair's members together, so both rows
        sample the same output position. Whole rows keep the shapes of a step graph's."""
        row = {e.req_id: i for i, e in enumerate(step.entries)}
        pairs = [(row[e.guided_by], i) for i, e in enumerate(step.entries) if e.guided_by in row and step.samples[i]]
        if not pairs:
            return None
        main, companion = np.array(pairs).T
        pair = np.tile(np.arange(len(step.entries)), (2, 1))
        pair[0, main], pair[1, companion] = companion, main
        scale = np.ones(len(step.entries), dtype=np.float32)
        scale[main] = [step.entries[m].params.cfg_scale for m in main]
        return pair, scale

    # ---- sample ----------------------------------------------------------------------------
    def sample(self, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        out = self.sampler(logits, sampling_metadata)
        step, sampled = self.rows, out.sampled_token_ids
        if step.graphed:
            token, frames = self.graphs.advance(sampled), self.graphs.frames[: sampled.shape[0]]
        elif step.sampled is not None:
            if step.guided is not None:  # in place: vLLM feeds these ids to the next step
                sampled.copy_(sampled[step.guided[0][1]])
            token, frames = self.advance_step(sampled, step.index, step.sampled, self._frames), self._frames
        else:
            return out
        sampled[:, 0] = token  # in place: vLLM stops on (and feeds) what is emitted
        if step.guided is not None:  # the companion emits what its main emits: vLLM stops both alike
            sampled.copy_(sampled[step.guided[0][1]])
        # Stream-ordered before vLLM's own copy of the sampled ids, whose wait covers this one.
        self.frames_host.copy_(frames, non_blocking=True)
        self.text_rows.publish()
        step.sampled = None
        return out

    def advance_step(self, sampled: torch.Tensor, index: torch.Tensor, rows: slice | torch.Tensor, frames: torch.Tensor) -> torch.Tensor:
        """`sample`'s device work (also the body of a step graph): [N, 1] sampled ids -> [N] emitted
        ids, written into stream 0 of `frames`; the sampling `rows` advance their phases."""
        token, phase, phase_step, segment, ended = self._advance_rows(sampled, index, rows)
        frames[:, 0] = token
        table, slots, outputs = self.table, index[0][rows], index[1][rows]
        table.phase[slots], table.phase_step[slots], table.segment[slots] = phase, phase_step, segment
        # A segment's last row is fed back with streams 1..S-1 pad (ESPnet prefills it so): in
        # the history (next steps, re-prefills) and in the aux input a step graph staged.
        table.aux_history[slots, outputs] = torch.where(ended[:, None], self.speech.specials.pad, table.aux_history[slots, outputs])
        ended_rows = torch.zeros(token.shape[0], dtype=torch.bool, device=token.device)
        ended_rows[rows] = ended
        aux_input = self.model.aux_input[: token.shape[0]]
        aux_input.copy_(torch.where(ended_rows[:, None], 0.0, aux_input))
        self.text_rows.flag.copy_(table.text_soon(self.rules))
        return token

    def _advance_rows_eager(
        self, sampled: torch.Tensor, index: torch.Tensor, idx: slice | torch.Tensor
    ) -> tuple[torch.Tensor, ...]:
        """[N, 1] sampled stream-0 ids, [2, N] rows' slots and output indices, the rows that
        sample (`idx`) -> [N] emitted ids (an eos that must not stop the request is emitted
        deferred: vLLM would stop on it), the sampling rows' next phase, phase step and segment,
        and whether each ended its segment."""
        table, rules = self.table, self.rules
        slots = index[0][idx]
        token, phase, mode, segment = sampled[:, 0].clone(), table.phase[slots], table.mode[slots], table.segment[slots]
        phase_step = table.phase_step[slots]
        token[idx] = rules.emitted_token(phase, phase_step, mode, segment, token[idx].long()).to(token.dtype)
        rows = table.row_sampling(slots, 1)
        return token, *rules.step(phase, phase_step, mode, segment, token[idx].long(), rows)

    # ---- compiling the step functions in vLLM's warm-up --------------------------------------
    def warm_up_step_functions(self, hidden: torch.Tensor, raw: torch.Tensor) -> None:
        """Compile now; if that fails, the step math runs eagerly (correct, slower) rather than
        the engine going down. Not under tensor parallelism: the warm-up runs collectives, and a
        rank leaving it early would leave the others waiting in one; the start fails instead."""
        try:
            self.compile_step_functions_now(hidden, raw)
        except Exception:
            if self._tensor_parallel:
                raise
            logger.exception("speech LM step functions failed to compile; running them eagerly")
            self.compile_step_functions(None)
            return
        if self.graphs is not None:
            values = SpeechSamplingParams().resolve(self.speech).row_values()
            recorded = self.graphs.warm_up(max(values.text_top_k, values.audio_top_k))
            logger.info("speech LM step graphs of a first request recorded (%d keys)", recorded)

    @torch.inference_mode()  # as vLLM runs steps: grad mode is part of a graph's guards
    def compile_step_functions_now(self, hidden: torch.Tensor, raw: torch.Tensor) -> None:
        """vLLM's dummy sampler run: compile the step functions now for the variants serving
        meets (one row or more, text rows or none, CFG pairs, partial prefill chunks: at most 6
        graphs a function, under dynamo's limit of 8, which fullgraph makes an error), so no
        request waits on a compile. With step graphs, the functions run only inside a recording
        of two rows or more, except the aux staging, which runs before every forward; without
        chunked prefill every row samples. Inputs take the forms a step passes (a graph guards
        on dtypes, strides and offsets); the functions are pure, so slot 0 is left as it was."""
        self.state()  # the tables the functions read
        start, device = time.perf_counter(), hidden.device
        set_torch_threads_for_runtime()  # what vLLM sets after its warm-up; graphs guard on it
        arange = functools.partial(torch.arange, device=device)
        one_row = () if self._graph_sizes else ((1, 0),)  # (rows, CFG pairs)
        # No duck shapes: a batch size equal to a table's length would tie the two in the graph.
        with fx_config.patch(use_duck_shape=False):
            for n, pairs in ((hidden.shape[0], 0), *one_row, (2, 1), (4, 2)):
                index = to_device(np.zeros((2, n), dtype=np.int64), device)  # slot 0, output 0
                noise = self._global_aux_noise(n, device)
                guided = _warm_up_guidance(n, pairs, device) if pairs else None
                merged, kinds, *_ = self._decode_rows(hidden[:n], raw[:n], index, 2, noise, guided)
                for no_text_rows in (False, True):
                    self._primary_logits(merged, kinds, index, 2, no_text_rows)
                sampled = torch.zeros(n, 1, dtype=torch.int32, device=device)
                partial = (arange(0), arange(1), arange(min(n, 2))) if self._partial_chunks else ()
                for idx in (slice(None), *partial):
                    self._advance_rows(sampled, index, idx)
            for n in (hidden.shape[0], 1):
                self._staged_aux(to_device(np.zeros((2, n), dtype=np.int64), device))
        logger.info("speech LM step functions compiled in %.1f s", time.perf_counter() - start)


def _merge_guided(raw: torch.Tensor, aux: torch.Tensor, kinds: torch.Tensor, guided: tuple) -> tuple:
    """CFG on the raw logits, every stream, audio rows only (the row kind was read from the
    conditional logits, so modality choices are never guided), over whole rows (`_guidance`):
    a main merges with its companion; any other row with itself at scale 1, which is the row.
    Companion rows take their main's kind: whatever they sample is replaced by the main's tokens."""
    pair, scale = guided
    partner, src = pair[0], pair[1]
    kinds = kinds[src]
    audio = is_audio_row(kinds)
    raw, aux = raw.float(), aux.float()
    raw = torch.where(audio[:, None], merge_guided(raw, raw[partner], scale[:, None]), raw)
    aux = torch.where(audio[:, None, None], merge_guided(aux, aux[partner], scale[:, None, None]), aux)
    return raw, aux, kinds


def _warm_up_guidance(n: int, pairs: int, device: torch.device) -> tuple:
    """Whole-row guidance of `pairs` pairs (rows i and pairs + i) in n rows, as a step passes it."""
    pair = np.tile(np.arange(n), (2, 1))
    pair[0, :pairs], pair[1, pairs : 2 * pairs] = np.arange(pairs) + pairs, np.arange(pairs)
    return to_device(pair, device), torch.ones(n, device=device)


def step_counters(model: StepModel) -> dict[str, int]:
    """A stage model's steps with requests, those that replayed the step graphs, those that skipped
    the text columns, and how old the text-rows note each read was (`TextRowsWatch.num_read`)
    (benchmarks, through collective_rpc: did a run take the fast paths?)."""
    steps = model.steps
    graphed = 0 if steps.graphs is None else steps.graphs.num_replays
    notes = [] if steps.text_rows is None else steps.text_rows.num_read
    return {"steps": steps.num_steps, "graphed": graphed, "narrow": steps.num_narrow_steps, "notes_read": notes}
