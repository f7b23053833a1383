"""Per-step decoding rules shared by the reference and the vLLM stage: phases, row kinds, masks,
per-modality sampling and the random-number contract.

Everything here is batched over rows (one row = one request's sampled position) and stays on the
device: no host syncs, no branching on tensor values.

Phase machine (per request: phase, steps in the phase, segments ended so far; advanced by the
emitted stream-0 token). An answer is a run of segments, as ESPnet's ParallelLLM.inference
decodes it: the prompt ends with <|assistant|>; a segment is a modality token (the output mode's
enforced one, else the greedy choice of <|text|> / <|audio|>) and that modality's rows:

    START / AFTER_ASSISTANT --<|text|>--> TEXT, --<|audio|>--> AUDIO     (one mask per segment)
    TEXT / AUDIO --<|eot|>, or eos / max length while an enforced modality is still to come-->
        TRANSITION --(forced <|assistant|>)--> AFTER_ASSISTANT
    TEXT / AUDIO --<|eos|>--> DONE;  --max length, nothing enforced left--> FINAL --(forced eos)--> DONE
    AUDIO --deferred eos--> DRAIN --(S-1 rows, then a forced <|eos|>)--> DONE            (delay rules)
    TEXT --deferred eos (audio follows)--> TEXT_DRAIN --(S rows)--> TRANSITION          (delay rules)

Parallel rules (Bagpiper): eos and eot are masked before a segment's minimum length (text and
audio alike); nothing is forced at its maximum. A segment's last row is fed back with streams
1..S-1 pad. An eos that does not end the answer is emitted as `DecodingSpec.deferred_eos` (vLLM
stops on eos; the model embeds it as eos).

Delay rules (OpusLM, `parallel_segments` false, ESPnet's ar_delay.py): every segment ends with
eos (no eot; eos is forced at `max_text_tokens`), and, unless it is a text segment that ends the
answer, drains as ESPnet decodes it: the row after eos is sampled whole, drain row d >= 2 forces
streams < d to pad; every row is fed back as sampled (`aux_sampled`), while the emitted row pads
the cells past the clip's end (`aux_kept`). Stream 0 may also emit its segment's own marker,
streams 1..S-1 pad (one more aux column: `SpeechLMConfig.aux_sample_width`).

The row kind (which mask and which modality's sampling a row gets) follows from the phase, the
output mode and the segment index; `phase_step` (0 on the first row of a phase) gives the
minimum and maximum lengths and the family rules of `DecodingSpec`: in AUDIO, stream s is forced
to pad while phase_step < s (delay warm-up); in DRAIN (drain row d = phase_step + 1), row 1 is
DRAIN_AUDIO (all streams sampled), rows 2..S-1 FORCE_PAD (streams s >= d sampled), row S a
forced eos; in TEXT_DRAIN row 1 is a TEXT row, rows 2..S all pad.

Tensors are compared with `int(...)` of the enums: torch.compile (the engine compiles this math
on CUDA) folds `tensor == IntEnum` to a Python bool.

Random-number contract (what the engine path reproduces exactly):
  * stream 0 is sampled by vLLM's sampler from the logits `process_primary_logits` returns:
    `x / T_engine` -> softmax(float32) -> `argmax(p / q)`, q ~ Exp(1) over the row, drawn from a
    torch.Generator seeded with the request's seed (greedy when T_engine == 0).
  * streams 1..S-1 are sampled by `sample_aux_streams` at every sampled position: q ~ Exp(1) of
    shape [S-1, W], for a seeded request `seeded_exponential(aux_seed(seed), output index)`.
    Counter-based (a function of the seed, the position and the element only): a batch's seeded
    rows draw in one op, whatever else is in the batch, and a re-prefilled request redraws the
    same noise.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from vllm_omni_speechlm.config import SpeechLMConfig

NEG_INF = float("-inf")


class Phase(enum.IntEnum):
    START = 0  # the row after the prompt's <|assistant|>: the first segment's modality token
    TEXT = 1
    TRANSITION = 2  # a segment ended and another follows: <|assistant|> is forced next
    AFTER_ASSISTANT = 3  # the next segment's modality token
    AUDIO = 4
    DONE = 5
    DRAIN = 6  # after the (deferred) eos of a drain family's audio: streams 1..S-1 finish their frames
    FINAL = 7  # the answer ended at a segment's max length: a forced eos row stops the request
    TEXT_DRAIN = 8  # delay rules: after the (deferred) eos of a text part that another segment follows


class OutputMode(enum.IntEnum):
    """The modalities enforced on the answer's first segments (ESPnet's `enforce_modality`);
    later segments (after an eot) take the model's greedy choice."""

    AUTO = 0  # none enforced: the model chooses (released behaviour)
    TEXT = 1  # [text]
    AUDIO = 2  # [audio]
    TEXT_AUDIO = 3  # [text, audio]: a text answer, then its audio

    @classmethod
    def parse(cls, value: "str | int | OutputMode") -> "OutputMode":
        names = {"auto": cls.AUTO, "text": cls.TEXT, "audio": cls.AUDIO, "text+audio": cls.TEXT_AUDIO}
        if isinstance(value, int) and not isinstance(value, bool) and value in iter(cls):
            return cls(value)
        if value not in names:
            raise ValueError(f"modality: expected one of {sorted(names)}, got {value!r}")
        return names[value]


class RowKind(enum.IntEnum):
    TEXT = 0  # text, <|eos|> (parallel rules: also <|eot|>; delay rules: also the text marker)
    CHOOSE = 1  # a modality marker
    AUDIO = 2  # stream 0 codes, <|eos|> (and <|eot|> under the parallel rules); streams 1..S-1 sampled
    FORCE_TEXT = 3
    FORCE_AUDIO = 4
    FORCE_ASSISTANT = 5
    AUDIO_NO_EOS = 6  # an audio row before the minimum audio length: no eos, no eot
    FORCE_PAD = 7  # a drain row: stream 0 is pad
    FORCE_EOS = 8  # the drain is over, the answer ended at a max length, or a text part's budget is spent
    TEXT_NO_END = 9  # a text row before the minimum text length: no eos, no eot
    DRAIN_AUDIO = 10  # the first drain row: every stream sampled as audio (ESPnet's late finish index)
    FORCE_BLANK = 11  # a text drain row: every stream pad


# Enforced modality of segment k (k = 0, 1) per output mode; CHOOSE where none is enforced.
_ENFORCED = {
    OutputMode.AUTO: (RowKind.CHOOSE, RowKind.CHOOSE),
    OutputMode.TEXT: (RowKind.FORCE_TEXT, RowKind.CHOOSE),
    OutputMode.AUDIO: (RowKind.FORCE_AUDIO, RowKind.CHOOSE),
    OutputMode.TEXT_AUDIO: (RowKind.FORCE_TEXT, RowKind.FORCE_AUDIO),
}


def enforced_kind(mode: OutputMode, segment: int) -> RowKind:
    """Host form of the modality row of segment `segment`: FORCE_TEXT / FORCE_AUDIO where the
    output mode enforces it, else CHOOSE (the model's choice)."""
    return _ENFORCED[OutputMode(mode)][segment] if segment < 2 else RowKind.CHOOSE


def is_audio_row(kind: torch.Tensor) -> torch.Tensor:
    """[N] RowKind -> [N] bool: rows sampled as audio (audio settings, CFG, aux streams)."""
    return (kind == int(RowKind.AUDIO)) | (kind == int(RowKind.AUDIO_NO_EOS)) | (kind == int(RowKind.DRAIN_AUDIO))


def aux_seed(seed: int) -> int:
    """Seed of the auxiliary-stream noise: decorrelated from the stream-0 generator."""
    return (seed * 0x9E3779B1 + 0x5EED) % (2**63 - 1)


_MASK32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """x * c mod 2**32 for int64 x in [0, 2**32): c in 16-bit halves, so no product passes 2**49
    (int64 overflow is not defined behaviour everywhere)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _MASK32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash with full avalanche (Wellons' lowbias32) on int64 in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x21F0AAAD)
    x = x ^ (x >> 15)
    x = _mul32(x, 0xD35A2D97)
    return x ^ (x >> 15)


def seeded_exponential(seeds: torch.Tensor, positions: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """[N] seeds in [0, 2**63), [N] positions -> [N, *shape] float32 Exp(1) noise; element j of
    row i depends on (seeds[i], positions[i], j) only (counter-based, so batch-invariant). The
    log runs in float64: a float32 log can differ by an ulp between vectorised and scalar CPU
    paths, which would make a row's noise depend on where it sits in the batch."""
    row = _mix32(_mix32(_mix32(seeds & _MASK32) ^ (seeds >> 32)) ^ (positions & _MASK32))  # [N]
    j = torch.arange(math.prod(shape), device=seeds.device)
    bits = _mix32(_mix32((row[:, None] + _mul32(j, 0x9E3779B9)) & _MASK32))  # [N, prod(shape)]
    u = (bits.double() + 0.5) * 2.0**-32  # in (0, 1)
    return (-torch.log(u)).float().view(-1, *shape)


class DecodingRules:
    """Device tables for one checkpoint layout; every method is batched over rows."""

    def __init__(self, cfg: SpeechLMConfig, device: torch.device | str = "cpu"):
        self.cfg = cfg
        self.parallel = cfg.decoding.parallel_segments
        sp, v = cfg.specials, cfg.vocab_size
        allowed = torch.zeros(len(RowKind), v, dtype=torch.bool)
        allowed[RowKind.TEXT_NO_END, slice(*cfg.text_range)] = True
        s0 = cfg.streams[0]
        allowed[RowKind.AUDIO_NO_EOS, s0.vocab_start : s0.vocab_end] = True
        if not self.parallel:  # ESPnet's build_mask: stream 0 may emit its segment's own marker
            allowed[RowKind.TEXT_NO_END, sp.text] = True
            allowed[RowKind.AUDIO_NO_EOS, sp.audio] = True
        allowed[RowKind.TEXT] = allowed[RowKind.TEXT_NO_END]
        # Delay rules: a text part ends with eos, as audio does (ESPnet's text mask has no eot).
        allowed[RowKind.TEXT, [sp.eot, sp.eos] if self.parallel else sp.eos] = True
        allowed[RowKind.CHOOSE, [sp.text, sp.audio]] = True
        allowed[RowKind.AUDIO] = allowed[RowKind.AUDIO_NO_EOS]
        allowed[RowKind.AUDIO, [sp.eos, sp.eot] if self.parallel else sp.eos] = True
        allowed[RowKind.DRAIN_AUDIO] = allowed[RowKind.AUDIO]
        allowed[RowKind.FORCE_BLANK, sp.pad] = True
        allowed[RowKind.FORCE_TEXT, sp.text] = True
        allowed[RowKind.FORCE_AUDIO, sp.audio] = True
        allowed[RowKind.FORCE_ASSISTANT, sp.assistant] = True
        allowed[RowKind.FORCE_PAD, sp.pad] = True
        allowed[RowKind.FORCE_EOS, sp.eos] = True
        # Additive masks: 0 where allowed, -inf elsewhere.
        self.mask_bias = torch.zeros(allowed.shape).masked_fill_(~allowed, NEG_INF).to(device)
        # Every id a non-text row may take (stream 0's codec slice and specials, ~1k of ~160k):
        # batches without text rows are masked, top-k'd and scaled on these columns only.
        text_kinds = [RowKind.TEXT, RowKind.TEXT_NO_END]
        narrow = allowed[[k for k in RowKind if k not in text_kinds]].any(dim=0)
        self.non_text_columns = narrow.nonzero().squeeze(1).to(device)
        self.non_text_mask_bias = self.mask_bias[:, self.non_text_columns]
        self._tables(device)

    def _tables(self, device) -> None:
        P, M, K = Phase, OutputMode, RowKind
        cfg, sp, dec = self.cfg, self.cfg.specials, self.cfg.decoding
        # kind_by_phase[mode, phase] inside segments and between them; the modality rows
        # (START, AFTER_ASSISTANT) take `enforced[mode, segment]`.
        table = torch.full((len(M), len(P)), int(K.TEXT), dtype=torch.long)
        table[:, P.AUDIO] = K.AUDIO
        table[:, P.TRANSITION] = K.FORCE_ASSISTANT
        table[:, P.DRAIN] = K.FORCE_PAD  # DRAIN_AUDIO first, FORCE_EOS once it is over (row_kinds)
        table[:, P.TEXT_DRAIN] = K.FORCE_BLANK  # a TEXT row first (row_kinds)
        table[:, P.FINAL] = K.FORCE_EOS
        self.kind_by_phase = table.to(device)
        enforced = torch.tensor([[int(k) for k in (*_ENFORCED[m], K.CHOOSE)] for m in M], dtype=torch.long)
        self.enforced = enforced.to(device)  # [mode, segment clamped to 2]
        self.num_enforced = torch.tensor([sum(k != K.CHOOSE for k in _ENFORCED[m]) for m in M], device=device)
        # Aux stream index s (1..S-1) of each aux column, for the warm-up and drain rules.
        self.aux_index = torch.arange(1, cfg.num_streams, device=device)
        # Next phase by emitted token; -1 keeps the current phase.
        nxt = torch.full((cfg.vocab_size,), -1, dtype=torch.long)
        nxt[slice(*cfg.text_range)] = P.TEXT
        nxt[cfg.codec_start : cfg.codec_end] = P.AUDIO
        nxt[sp.text], nxt[sp.audio] = P.TEXT, P.AUDIO
        nxt[sp.eot], nxt[sp.assistant], nxt[sp.eos] = P.TRANSITION, P.AFTER_ASSISTANT, P.DONE
        if dec.deferred_eos is not None:  # drain: the audio's eos; parallel: an eos the answer outlives
            nxt[dec.deferred_eos] = P.DRAIN if dec.drain else P.TRANSITION
        self.phase_by_token = nxt.to(device)
        # Whether a sampled eos is emitted deferred, per phase (drain families: in AUDIO, and on
        # the first, sampled row of a drain: see `emitted_token`).
        defer = torch.zeros(len(P), dtype=torch.bool)
        if dec.drain:
            defer[P.AUDIO] = True
        self.defer_eos_by_phase = defer.to(device)
        # Phases from which a text row is at most two rows away (TextRowsWatch): a text
        # segment, a text drain, or between segments. From AUDIO the nearest is four rows on
        # (eot, <|assistant|>, the modality choice, text); START takes the enforced modality.
        soon = torch.zeros(len(P), dtype=torch.bool)
        soon[[P.TEXT, P.TEXT_DRAIN, P.TRANSITION, P.AFTER_ASSISTANT]] = True
        self.text_soon_by_phase = soon.to(device)

    # ---- phases ---------------------------------------------------------------------------
    def row_kinds(
        self,
        phase: torch.Tensor,
        mode: torch.Tensor,
        segment: torch.Tensor,
        phase_step: torch.Tensor,
        p: "RowSampling",
    ) -> torch.Tensor:
        """[N] phase, mode, segment index, steps in the current phase -> [N] RowKind. A segment's
        modality row is its enforced modality or the model's choice; inside a segment the kind
        follows the segment's modality (one mask per segment), with eos and eot masked before
        the segment's minimum length."""
        kind = self.kind_by_phase[mode, phase]
        choosing = (phase == int(Phase.START)) | (phase == int(Phase.AFTER_ASSISTANT))
        kind = torch.where(choosing, self.enforced[mode, segment.clamp(max=2)], kind)
        text = (phase == int(Phase.TEXT)) & (kind == int(RowKind.TEXT))
        kind = torch.where(text & (phase_step < p.min_text), int(RowKind.TEXT_NO_END), kind)
        # Delay rules: a text part over budget gets a forced eos (then drained when audio follows);
        # under the parallel rules the segment has ended there already (`step`).
        over_budget = (phase == int(Phase.TEXT)) & (phase_step >= p.max_text)
        kind = torch.where(over_budget, int(RowKind.FORCE_EOS), kind)
        dec, s = self.cfg.decoding, self.cfg.num_streams
        min_audio = p.min_audio.clamp(min=dec.min_audio_frames)
        too_short = (kind == int(RowKind.AUDIO)) & (phase_step < min_audio)
        kind = torch.where(too_short, int(RowKind.AUDIO_NO_EOS), kind)
        # A drain's first row is sampled whole with its segment's mask, eos allowed (ESPnet sets
        # its finish index one step after eos, so that row is not forced yet).
        first = phase_step == 0
        kind = torch.where((phase == int(Phase.DRAIN)) & first, int(RowKind.DRAIN_AUDIO), kind)
        kind = torch.where((phase == int(Phase.TEXT_DRAIN)) & first, int(RowKind.TEXT), kind)
        drained = (phase == int(Phase.DRAIN)) & (phase_step >= s - 1)
        return torch.where(drained, int(RowKind.FORCE_EOS), kind)

    def aux_sampled(self, kind: torch.Tensor, phase_step: torch.Tensor) -> torch.Tensor:
        """[N] kinds, [N] phase steps -> [N, S-1] bool: which aux streams keep their sampled
        token in the row fed back (the rest are pad). Audio rows: all (or, with the delay
        warm-up, streams s <= phase_step); the first drain row: all; drain row d = phase_step + 1
        >= 2: streams s >= d (ESPnet forces streams < d, counting from its late finish index)."""
        step = phase_step[:, None]
        draining = (kind == int(RowKind.FORCE_PAD))[:, None] & (step + 1 <= self.aux_index)
        return self._audio_aux(kind, step) | draining

    def aux_kept(self, kind: torch.Tensor, phase_step: torch.Tensor) -> torch.Tensor:
        """[N] kinds, [N] phase steps -> [N, S-1] bool: the aux tokens of the row emitted (the
        rest are pad): `aux_sampled` less the cells past the clip's end (stream s of drain row
        d = s, frame T, which ESPnet samples, feeds back and cuts), so that the emitted rows are
        exactly the clip's delay pattern."""
        step = phase_step[:, None]
        draining = (kind == int(RowKind.FORCE_PAD))[:, None] & (step + 1 < self.aux_index)
        first_drain = (kind == int(RowKind.DRAIN_AUDIO))[:, None] & (self.aux_index > 1)
        return (self._audio_aux(kind, step) & ~(kind == int(RowKind.DRAIN_AUDIO))[:, None]) | first_drain | draining

    def _audio_aux(self, kind: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
        """Audio rows' sampled aux streams: all, or with the delay warm-up streams s <= step (the
        first drain row has step 0 but is past the warm-up: all)."""
        audio = is_audio_row(kind)[:, None]
        if not self.cfg.decoding.delay_warmup:
            return audio.expand(-1, len(self.aux_index))
        return audio & ((step >= self.aux_index) | (kind == int(RowKind.DRAIN_AUDIO))[:, None])

    def _in_segment(self, phase: torch.Tensor) -> torch.Tensor:
        return (phase == int(Phase.TEXT)) | (phase == int(Phase.AUDIO))

    def _draining(self, phase: torch.Tensor) -> torch.Tensor:
        return (phase == int(Phase.DRAIN)) | (phase == int(Phase.TEXT_DRAIN))

    def _more_enforced(self, mode: torch.Tensor, segment: torch.Tensor) -> torch.Tensor:
        """[N] bool: an enforced modality is still to come after the current segment."""
        return segment + 1 < self.num_enforced[mode]

    def emitted_token(
        self, phase: torch.Tensor, phase_step: torch.Tensor, mode: torch.Tensor, segment: torch.Tensor, token: torch.Tensor
    ) -> torch.Tensor:
        """[N] phase, phase step, mode, segment, sampled stream-0 token -> the token the request
        emits: an eos that must not stop the request (vLLM stops on eos) is emitted as the
        deferred eos: a drain family's audio eos, an eos sampled on a drain's first row, or the
        eos of a segment that an enforced one follows."""
        defer = self.defer_eos_by_phase[phase] | (self._draining(phase) & (phase_step == 0))
        defer = defer | (self._in_segment(phase) & self._more_enforced(mode, segment))
        deferred = self.cfg.decoding.deferred_eos
        return torch.where((token == self.cfg.specials.eos) & defer, -1 if deferred is None else deferred, token)

    def step(
        self,
        phase: torch.Tensor,
        phase_step: torch.Tensor,
        mode: torch.Tensor,
        segment: torch.Tensor,
        token: torch.Tensor,
        p: "RowSampling",
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """[N] phase, phase step, mode, segment, emitted token -> next (phase, phase step,
        segment) and [N] bool: the row ended its segment (parallel rules: it is fed back with
        streams 1..S-1 pad, as ESPnet feeds a segment's last token)."""
        nxt = self.phase_by_token[token]
        nxt = torch.where(nxt < 0, phase, nxt)
        in_segment = self._in_segment(phase)
        if self.parallel:
            # A segment ends by itself after its max length: another follows only while an
            # enforced modality is still to come; else the answer is over (one forced eos row).
            limit = torch.where(phase == int(Phase.AUDIO), p.max_audio, p.max_text)
            at_max = in_segment & (nxt == phase) & (phase_step + 1 >= limit)
            after = torch.where(self._more_enforced(mode, segment), int(Phase.TRANSITION), int(Phase.FINAL))
            nxt = torch.where(at_max, after, nxt)
        else:
            nxt = self._drain_step(phase, phase_step, token, nxt)
        ended = in_segment & (nxt != phase)
        step = torch.where(nxt == phase, phase_step + 1, 0)
        return nxt, step, segment + ended.long(), ended & self.parallel

    def _drain_step(self, phase: torch.Tensor, phase_step: torch.Tensor, token: torch.Tensor, nxt: torch.Tensor) -> torch.Tensor:
        """Delay rules: a deferred eos in text starts a text drain; what a drain samples keeps
        the phase; the audio drain ends at its forced eos, a text drain after S rows, when the
        next segment's <|assistant|> is forced (ESPnet prefills the next target's role)."""
        nxt = torch.where(self._draining(phase), phase, nxt)
        nxt = torch.where((phase == int(Phase.DRAIN)) & (token == self.cfg.specials.eos), int(Phase.DONE), nxt)
        text_drained = (phase == int(Phase.TEXT_DRAIN)) & (phase_step + 1 >= self.cfg.num_streams)
        nxt = torch.where(text_drained, int(Phase.TRANSITION), nxt)
        deferred = -1 if self.cfg.decoding.deferred_eos is None else self.cfg.decoding.deferred_eos
        return torch.where((phase == int(Phase.TEXT)) & (token == deferred), int(Phase.TEXT_DRAIN), nxt)

    def replay(self, tokens: list[int], mode: OutputMode, p: "RowSampling") -> tuple[Phase, int, int]:
        """(phase, phase step, segment) after an emitted token history (e.g. a preempted request's
        outputs)."""
        state = torch.tensor([int(Phase.START)]), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        m = torch.tensor([int(mode)])
        for tok in tokens:
            phase, phase_step, segment, _ = self.step(state[0], state[1], m, state[2], torch.tensor([tok]), p)
            state = phase, phase_step, segment
        return Phase(int(state[0])), int(state[1]), int(state[2])

    # ---- sampling ------------------------------------------------------------------------
    def process_primary_logits(
        self, raw: torch.Tensor, kind: torch.Tensor, p: "RowSampling", no_text_rows: bool = False
    ) -> torch.Tensor:
        """[N, V] (CFG-merged) stream-0 logits -> what vLLM's sampler gets: masked, per-modality
        top-k, and text rows rescaled by T_engine / T_text because the engine divides every row
        of a request by one temperature (T_engine). `no_text_rows` (a host fact, e.g. an
        audio-only batch) does the work on `non_text_columns` only, with the same result."""
        is_audio = is_audio_row(kind)
        top_k = torch.where(is_audio, p.audio_top_k, p.text_top_k)
        if self.parallel:  # ESPnet takes the argmax of the modality tokens, whatever the temperature
            top_k = torch.where(kind == int(RowKind.CHOOSE), 1, top_k)
        scale = torch.where(is_audio, p.audio_scale, p.text_scale)[:, None]
        if not no_text_rows:
            return apply_top_k(raw.float() + self.mask_bias[kind], top_k, p.max_top_k) * scale
        cols = self.non_text_columns
        narrow = raw[:, cols].float() + self.non_text_mask_bias[kind]
        out = torch.full(raw.shape, NEG_INF, dtype=torch.float32, device=raw.device)
        return out.index_copy_(1, cols, apply_top_k(narrow, top_k, p.max_top_k) * scale)

    def aux_token_ids(self, slots: torch.Tensor, aux_start: torch.Tensor) -> torch.Tensor:
        """[N, S-1] sampled slots, [S-1] each stream's first id -> token ids: the slice's, or pad
        for the pad column (`SpeechLMConfig.aux_sample_width`)."""
        ids = slots + aux_start
        if self.parallel:
            return ids
        return torch.where(slots == self.cfg.aux_stream_width, self.cfg.specials.pad, ids)

    def sample_aux_streams(
        self, logits: torch.Tensor, p: "RowSampling", noise: torch.Tensor
    ) -> torch.Tensor:
        """[N, S-1, W] aux logits (CFG-merged; W = `aux_sample_width`), [N, S-1, W] Exp(1) noise
        -> [N, S-1] slot ids."""
        n, s, w = logits.shape
        flat = apply_top_k(logits.float().reshape(n * s, w), p.audio_top_k.repeat_interleave(s), p.max_top_k)
        probs = (flat.reshape(n, s, w) / p.audio_divisor[:, None, None]).softmax(dim=-1)
        return (probs / noise).argmax(dim=-1)


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's `top_k[i]` largest logits (ties at the k-th value kept); k <= 0 keeps all.
    `max_top_k` is a host int (max over the batch's requests), so the shape never depends on
    tensor values. No branch on it (a batch without top-k takes width 1 and keeps all): a
    compiled graph would otherwise split in two."""
    k = max(1, min(max_top_k, logits.shape[-1]))
    top = logits.topk(k, dim=-1).values
    kth = top.gather(-1, (top_k.clamp(1, k) - 1)[:, None])
    kth = torch.where(top_k[:, None] > 0, kth, NEG_INF)
    return logits.masked_fill(logits < kth, NEG_INF)


class RowValues(NamedTuple):
    """One request's sampling values of `RowSampling` (`SpeechSamplingParams.row_values`)."""

    text_top_k: int  # effective k (1 when the modality is greedy)
    audio_top_k: int
    text_scale: float  # T_engine / T_text (1 when greedy)
    audio_scale: float
    audio_divisor: float  # temperature the aux streams divide by (1 when greedy)
    min_text: int  # segment lengths (rows): eos / eot masked before the minimum
    max_text: int
    min_audio: int
    max_audio: int


INT_FIELDS = ("text_top_k", "audio_top_k", "min_text", "max_text", "min_audio", "max_audio")
FLOAT_FIELDS = ("text_scale", "audio_scale", "audio_divisor")


@dataclass
class RowSampling:
    """Per-row sampling tensors ([N] each): the rows' `RowValues`."""

    text_top_k: torch.Tensor  # effective k (1 when the modality is greedy)
    audio_top_k: torch.Tensor
    text_scale: torch.Tensor  # T_engine / T_text (1 when greedy)
    audio_scale: torch.Tensor
    audio_divisor: torch.Tensor  # temperature the aux streams divide by (1 when greedy)
    min_text: torch.Tensor
    max_text: torch.Tensor
    min_audio: torch.Tensor
    max_audio: torch.Tensor
    max_top_k: int

    @classmethod
    def from_tables(cls, ints: torch.Tensor, floats: torch.Tensor, max_top_k: int) -> "RowSampling":
        """[N, len(INT_FIELDS)] and [N, len(FLOAT_FIELDS)] columns in those orders."""
        named = {n: ints[:, i] for i, n in enumerate(INT_FIELDS)} | {n: floats[:, i] for i, n in enumerate(FLOAT_FIELDS)}
        return cls(**named, max_top_k=max_top_k)

    @classmethod
    def from_values(cls, values: list[RowValues], device) -> "RowSampling":
        ints = torch.tensor([[getattr(v, n) for n in INT_FIELDS] for v in values], dtype=torch.long, device=device)
        floats = torch.tensor([[getattr(v, n) for n in FLOAT_FIELDS] for v in values], dtype=torch.float32, device=device)
        max_k = max(max(v.text_top_k, v.audio_top_k) for v in values)
        return cls.from_tables(ints.reshape(-1, len(INT_FIELDS)), floats.reshape(-1, len(FLOAT_FIELDS)), max_k)
