"""A delay-pattern speech LM as a vLLM model and vllm-omni AR stage (family-agnostic part).

Primary/auxiliary decomposition: the engine samples stream 0 like any token; the model samples
streams 1..S-1 in the same step. Per step (hooks in the order vllm-omni's AR runner calls them):

    preprocess[_decode_batch]  input embeds = embed(stream 0) + sum embed(streams 1..S-1 of the
                               previous step), read from the request table; note each row's slot
    forward                    the backbone (vLLM layers, PagedAttention, CUDA graphs)
    make_omni_output           hand the runner per-request views of this step's [N, S] host
                               frame buffer (filled below, copied to the host once in sample)
    compute_logits             raw stream-0 logits -> row kinds (phase machine / argmax rule);
                               streams 1..S-1 projected on their own vocabulary slices in one
                               batched matmul and sampled; stream-0 masks, top-k, temperature
                               compensation; returns what vLLM's sampler gets
    sample                     vLLM's own Sampler picks stream 0; the phase machine advances

The client sees one [1, S] row per sampled position under `codes.audio` (stream 0 and the
auxiliary streams; pad 0 on non-audio rows), concatenated by vllm-omni into [L, S].
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.logger import init_logger
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import AutoWeightsLoader, maybe_prefix
from vllm.v1.sample.sampler import Sampler

from vllm_omni_speechlm.cfg import merge_guided
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.decoding import DecodingRules, is_audio_row
from vllm_omni_speechlm.models.request_state import RequestEntry, RequestTable
from vllm_omni_speechlm.sampling_params import SPEECH_PARAMS_KEY, SpeechSamplingParams

logger = init_logger(__name__)



@dataclass
class StepRows:
    """What the preprocess hooks learned about this step's rows, in logits-row order."""

    entries: list[RequestEntry] = field(default_factory=list)
    generated: list[int] = field(default_factory=list)  # output index of the token each row samples
    samples: list[bool] = field(default_factory=list)  # False: a partial prefill chunk
    sampled: tuple[torch.Tensor, torch.Tensor] | None = None  # (row index, slot) of sampling rows
    guided: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # CFG (main row, companion row, scale)


def _to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """Host ints -> device tensor without a blocking copy (pinned staging on CUDA)."""
    t = torch.tensor(values, dtype=torch.long, pin_memory=device.type == "cuda")
    return t.to(device, non_blocking=True)


class SpeechLMForCausalLM(nn.Module):
    """Subclasses set `make_backbone` (a vLLM decoder stack with `embed_input_ids`)."""

    # vllm-omni runner contract
    has_preprocess = True
    have_multimodal_outputs = True
    prefer_model_sampler = True
    requires_request_sample_eligibility = True
    skips_model_sampler_output_token_history = True
    omni_pooler_payload_include_hidden = False
    requires_full_prefix_cached_hidden_states = False
    omni_client_multimodal_output_keys = ("codes.audio",)

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        self.speech = cfg = SpeechLMConfig.from_hf_config(hf)
        self._check_supported(vllm_config, cfg)
        self.model = self.make_backbone(vllm_config, maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(hf.vocab_size)
        self.stream_embeddings = nn.Embedding(cfg.num_streams, hf.hidden_size)
        self.sampler = Sampler()
        aux = cfg.streams[1:]
        self.register_buffer("aux_start", torch.tensor([s.vocab_start for s in aux]), persistent=False)
        sched = vllm_config.scheduler_config
        self._table_shape = (2 * sched.max_num_seqs, vllm_config.model_config.max_model_len)
        self.table: RequestTable | None = None  # built on first use, on the weights' device
        self.rules: DecodingRules | None = None
        self._step = StepRows()
        self._frames: torch.Tensor | None = None
        self._frames_host: torch.Tensor | None = None
        self.num_resumed = 0  # re-prefills after preemption (observability, tests)
        self.num_resumed_companions = 0

    def make_backbone(self, vllm_config: VllmConfig, prefix: str) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def _check_supported(vllm_config: VllmConfig, cfg: SpeechLMConfig) -> None:
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError("speech LM stage: tensor/pipeline parallelism is not supported yet (TP=PP=1)")
        ends = [s.vocab_end for s in cfg.streams[1:-1]]
        if ends != [s.vocab_start for s in cfg.streams[2:]]:
            raise ValueError("speechlm config: stream_sizes: streams 1..S-1 must be adjacent in the vocabulary")

    # ---- lazily built device state ---------------------------------------------------------
    def _state(self) -> tuple[RequestTable, DecodingRules]:
        if self.table is None:
            device = self.lm_head.weight.device
            self.rules = DecodingRules(self.speech, device)
            self.table = RequestTable(self.speech, *self._table_shape, device)
        return self.table, self.rules

    # ---- inputs ---------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def _aux_embeds(self, aux: torch.Tensor) -> torch.Tensor:
        """[M, S-1] aux tokens -> [M, H] summed embeddings; pad (0) contributes zero."""
        emb = self.model.embed_input_ids(aux.reshape(-1).long()).view(*aux.shape, -1)
        keep = (aux != self.speech.specials.pad).to(emb.dtype)
        return (emb * keep[..., None]).sum(dim=1)

    def preprocess_batch(self, *, req_ids: list[str], **_: Any) -> None:
        self._step = StepRows()  # a new step begins; the hooks below append its rows in order

    def preprocess(
        self, input_ids: torch.Tensor, input_embeds: torch.Tensor | None, **info: Any
    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """One request's scheduled span: a (re-)prefill chunk or a single decode token."""
        table, _ = self._state()
        req_id = info["request_id"]
        prompt_len, start = info["_omni_prompt_len"], info["_omni_num_computed_tokens"]
        entry = table.entries.get(req_id)
        if entry is None:
            entry = table.admit(req_id, self._params(info), prompt_len)
        elif start == 0:  # preempted and now re-prefilled: outputs come back from the history
            self.num_resumed += 1
            self.num_resumed_companions += entry.guided_by is not None
        embeds = self.model.embed_input_ids(input_ids)
        first_output = max(prompt_len - start, 0)  # span index of the first output token
        if first_output < input_ids.numel():  # outputs in the span: add their aux streams
            lo, hi = start + first_output - prompt_len, start + input_ids.numel() - prompt_len
            aux = table.aux_history[entry.slot, lo:hi]
            embeds[first_output:] += self._aux_embeds(aux)
        self._note_row(entry, start + input_ids.numel() - prompt_len)
        return input_ids, embeds, {}

    def preprocess_decode_batch(self, *, input_ids: torch.Tensor, req_infos: list[dict]) -> tuple:
        """All single-token decode rows of a contiguous run, in one batched lookup."""
        table, _ = self._state()
        entries = [table.entries[info["request_id"]] for info in req_infos]
        generated = [info["_omni_num_computed_tokens"] + 1 - e.prompt_len for info, e in zip(req_infos, entries)]
        slots = _to_device([e.slot for e in entries], input_ids.device)
        prev = _to_device([g - 1 for g in generated], input_ids.device)
        embeds = self.model.embed_input_ids(input_ids) + self._aux_embeds(table.aux_history[slots, prev])
        for entry, gen in zip(entries, generated):
            self._note_row(entry, gen)
        return input_ids, embeds, [{} for _ in req_infos]

    def _note_row(self, entry: RequestEntry, generated: int) -> None:
        self._step.entries.append(entry)
        self._step.generated.append(generated)

    def _params(self, info: dict) -> SpeechSamplingParams:
        """The request's speech options. They are validated where requests enter (API, generator);
        one that slips through invalid must not take the engine down, so it decodes with the
        checkpoint defaults and the error is logged."""
        raw = dict(info.get(SPEECH_PARAMS_KEY) or {})
        engine = {"seed": info.get("_omni_seed"), "max_tokens": info.get("_omni_max_tokens")}
        raw |= {k: v for k, v in engine.items() if v is not None}
        try:
            return SpeechSamplingParams(**raw).resolve(self.speech)
        except (TypeError, ValueError) as e:
            logger.error("request %s: invalid speech params (%s); using defaults", info.get("request_id"), e)
            return SpeechSamplingParams(**{k: v for k, v in engine.items() if v is not None}).resolve(self.speech)

    # ---- backbone -------------------------------------------------------------------------
    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, intermediate_tensors, inputs_embeds)

    def make_omni_output(self, model_outputs: torch.Tensor, **kwargs: Any) -> Any:
        from vllm_omni.model_executor.models.output_templates import OmniOutput

        eligible = kwargs.get("request_sample_eligible")
        rows = self._step.entries
        if eligible is None or len(eligible) != len(rows):
            eligible = [True] * len(rows)
        self._step.samples = list(eligible)
        # This step's [N, S] frames are filled on the device (compute_logits, sample) and copied
        # to the host once, in `sample`; the runner gets per-request views of the host copy, so
        # its per-request `.to("cpu")` moves nothing (one tiny synchronous copy per request per
        # step halved throughput at 512 requests). Fresh buffers per step: the runner may
        # serialise them after the next step began.
        shape, device = (len(rows), self.speech.num_streams), model_outputs.device
        self._frames = torch.zeros(shape, dtype=torch.long, device=device)
        self._frames_host = host = torch.empty(shape, dtype=torch.long, pin_memory=device.type == "cuda")
        per_request = [host[i : i + 1] if ok else host[i:i] for i, ok in enumerate(eligible)]
        return OmniOutput(text_hidden_states=model_outputs, multimodal_outputs={"codes": {"audio": per_request}})

    # ---- heads and sampling ---------------------------------------------------------------
    def _aux_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, S-1, W]: each aux stream projected on its own vocabulary slice only."""
        cfg = self.speech
        lo, hi, width = cfg.streams[1].vocab_start, cfg.streams[-1].vocab_end, cfg.aux_stream_width
        weight = self.lm_head.weight[lo:hi].view(cfg.num_streams - 1, width, -1)  # [S-1, W, H]
        h = hidden[None, :, :] + self.stream_embeddings.weight[1:, None, :]  # [S-1, N, H]
        return torch.bmm(h, weight.transpose(1, 2)).transpose(0, 1)

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: Any = None) -> torch.Tensor | None:
        step, n = self._step, hidden_states.shape[0]
        h0 = hidden_states
        if self.speech.primary_stream_embedding:
            h0 = hidden_states + self.stream_embeddings.weight[0]
        raw = self.logits_processor(self.lm_head, h0)
        step.sampled = None
        if len(step.entries) != n or self._frames is None:  # profiling / warm-up: no requests
            return raw
        table, rules = self._state()
        slots = _to_device([e.slot for e in step.entries], raw.device)
        generated = _to_device(step.generated, raw.device).clamp_(max=table.max_output_len - 1)
        rows = table.row_sampling(slots, step.entries)
        phase_step = table.phase_step[slots]
        kinds = rules.row_kinds(table.phase[slots], table.mode[slots], raw, generated, rows, phase_step)
        aux_logits = self._aux_logits(hidden_states)
        step.guided = self._guided_rows(step, raw.device) if table.num_companions else None
        if step.guided is not None:
            raw, aux_logits = self._merge_guided(raw, aux_logits, kinds, step.guided)
        noise = table.aux_noise(step.entries, step.samples, self.speech.aux_stream_width)
        aux = rules.sample_aux_streams(aux_logits, rows, noise) + self.aux_start
        aux = torch.where(rules.aux_sampled(kinds, phase_step), aux, self.speech.specials.pad)
        if step.guided is not None:  # the companion is fed the main's tokens
            main, companion, _ = step.guided
            aux[companion] = aux[main]
        self._frames[:, 1:] = aux
        # Rows that really sample (not a partial prefill chunk) update the request's state.
        idx = _to_device([i for i, ok in enumerate(step.samples) if ok], raw.device)
        step.sampled = (idx, slots[idx])
        table.aux_history[slots[idx], generated[idx]] = aux[idx].to(torch.int32)
        return rules.process_primary_logits(raw, kinds, rows, no_text_rows=table.num_text_capable == 0)

    def _guided_rows(self, step: StepRows, device: torch.device) -> tuple | None:
        """(main row, companion row, cfg scale) of this step's CFG pairs, or None. The scheduler
        schedules a pair's members together, so both rows sample the same output position."""
        row = {e.req_id: i for i, e in enumerate(step.entries)}
        pairs = [
            (row[e.guided_by], i, step.entries[row[e.guided_by]].params.cfg_scale)
            for i, e in enumerate(step.entries)
            if e.guided_by in row and step.samples[i]
        ]
        if not pairs:
            return None
        main, companion, scale = zip(*pairs)
        scale = torch.tensor(scale, dtype=torch.float32, pin_memory=device.type == "cuda").to(device, non_blocking=True)
        return _to_device(list(main), device), _to_device(list(companion), device), scale

    @staticmethod
    def _merge_guided(raw: torch.Tensor, aux: torch.Tensor, kinds: torch.Tensor, guided: tuple) -> tuple:
        """CFG on the main rows' raw logits, every stream, audio rows only (the row kind was read
        from the conditional logits, so modality choices are never guided). Companion rows take
        their main's kind: whatever they sample is replaced by the main's tokens."""
        main, companion, scale = guided
        kinds[companion] = kinds[main]
        audio = is_audio_row(kinds[main])
        raw, aux = raw.float(), aux.float()
        merged = merge_guided(raw[main], raw[companion], scale[:, None])
        raw[main] = torch.where(audio[:, None], merged, raw[main])
        merged = merge_guided(aux[main], aux[companion], scale[:, None, None])
        aux[main] = torch.where(audio[:, None, None], merged, aux[main])
        return raw, aux

    def sample(self, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        out = self.sampler(logits, sampling_metadata)
        if self._step.sampled is None:
            return out
        idx, slots = self._step.sampled
        table, rules = self._state()
        if self._step.guided is not None:  # in place: vLLM feeds these ids to the next step
            main, companion, _ = self._step.guided
            out.sampled_token_ids[companion] = out.sampled_token_ids[main]
        # A drain family's first eos is emitted deferred (vLLM would stop on it): rewrite in place.
        token = out.sampled_token_ids[:, 0].long()
        token[idx] = rules.emitted_token(table.phase[slots], token[idx])
        out.sampled_token_ids[:, 0] = token.to(out.sampled_token_ids.dtype)
        self._frames[:, 0] = token
        # Stream-ordered before vLLM's own copy of the sampled ids, whose wait covers this one.
        self._frames_host.copy_(self._frames, non_blocking=True)
        table.phase[slots], table.phase_step[slots] = rules.step(table.phase[slots], table.phase_step[slots], token[idx])
        self._step.sampled = None
        return out

    # ---- lifecycle ------------------------------------------------------------------------
    def on_requests_finished(self, finished_req_ids: set[str] | list[str]) -> None:
        if self.table is not None:
            self.table.release(finished_req_ids)

    def num_live_requests(self) -> int:
        """Requests holding per-request state (tests assert it returns to 0)."""
        return 0 if self.table is None else len(self.table)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(weights)
