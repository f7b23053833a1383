"""The `speechlm` section of a checkpoint's config.json: vocabulary layout, streams, specials,
per-modality sampling defaults and codec settings.

A delay-pattern speech LM reads and writes one unified vocabulary:

    [special_range) specials | [text_range) text | [codec_start, codec_end) codec streams 0..S-1

Stream s owns the contiguous slice `streams[s]` of the codec range. Families differ in data only
(this file), never in code paths: Bagpiper gives every stream its own pad slot (slot 0 of the
slice), OpusLM pads every stream with the special pad token; OpusLM's codec streams come before
its text range. How audio starts and ends (delay warm-up, minimum length, drain) is the
`decoding` section (`DecodingSpec`), which `decoding.DecodingRules` turns into tables.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

STEP_GRAPHS_KEY = "speech_lm_step_graphs"  # additional_config switch of stage 0's step graphs (default on)
CODEC_GRAPHS_KEY = "speech_lm_codec_graphs"  # additional_config switch of stage 1's decode graphs (default on CUDA)
CODEC_FUSED_KEY = "speech_lm_codec_fused_snake"  # ... and of its one-kernel Snake activations (default on CUDA)
SPEECHLM_KEY = "speechlm"
# Audio-input weights a served checkpoint carries next to the LM (Bagpiper: the Qwen3-Omni audio
# encoder, named as transformers' and vLLM's Qwen3-Omni thinker name it, and the linear adaptor
# from its output to the LM's hidden size). Their geometry is the `audio_input` section.
AUDIO_TOWER_PREFIX = "audio_tower."
AUDIO_ADAPTOR_PREFIX = "audio_adaptor."
AUDIO_INPUT_PREFIXES = (AUDIO_TOWER_PREFIX, AUDIO_ADAPTOR_PREFIX)
# ESPnet's `<|unused_254|>`: stands for an audio clip in a prompt; vLLM's processor expands it to
# one row per encoder output frame, which the features overwrite.
BAGPIPER_AUDIO_PLACEHOLDER = 254


def _fail(name: str, message: str) -> ValueError:
    return ValueError(f"speechlm config: {name}: {message}")


@dataclass(frozen=True)
class StreamSpec:
    """One codec stream's slice of the unified vocabulary."""

    index: int
    vocab_start: int  # first id of the slice (the pad slot when the family has one)
    vocab_size: int  # slice width: what the stream samples from
    code_offset: int  # id of codebook index 0
    codebook_size: int
    pad_id: int  # the stream's delay-pattern pad token

    @property
    def vocab_end(self) -> int:
        return self.vocab_start + self.vocab_size


@dataclass(frozen=True)
class SpecialIds:
    """Special token ids (all inside `special_range`)."""

    pad: int
    bos: int
    eos: int
    eot: int
    system: int
    user: int
    assistant: int
    text: int  # the <|text|> modality marker
    audio: int  # the <|audio|> modality marker, also the audio-input placeholder

    def items(self) -> list[tuple[str, int]]:
        return [(f.name, getattr(self, f.name)) for f in dataclasses.fields(self)]


@dataclass(frozen=True)
class ModalitySampling:
    """Decoding defaults of one output modality, as ESPnet's inference config holds them per
    modality (0 temperature means greedy). A segment of this modality may end (eos or eot) only
    from its `min_steps`-th row on, and ends by itself after `max_steps` rows (0: no bound but the
    request's `max_tokens`)."""

    temperature: float
    top_k: int  # <= 0: no top-k
    min_steps: int = 0
    max_steps: int = 0
    cfg_scale: float = 1.0  # classifier-free guidance of this modality's segments (1: off)

    def validate(self, name: str) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise _fail(f"{name}.temperature", f"must be a finite number >= 0, got {t!r}")
        for key in ("top_k", "min_steps", "max_steps"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or (key != "top_k" and v < 0):
                raise _fail(f"{name}.{key}", f"must be an integer{'' if key == 'top_k' else ' >= 0'}, got {v!r}")
        c = self.cfg_scale
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 1:
            raise _fail(f"{name}.cfg_scale", f"must be a finite number >= 1, got {c!r}")


def espnet_modality_sampling(section: dict[str, Any]) -> ModalitySampling:
    """One modality of an ESPnet inference config (`text:` / `audio:` of inference_sft.yaml:
    temperature, topk, min_step, max_step, cfg; ESPnet's own defaults where a key is absent)."""
    return ModalitySampling(
        temperature=section["temperature"],
        top_k=section.get("topk", 0),
        min_steps=section.get("min_step", 1),
        max_steps=section["max_step"],
        cfg_scale=section.get("cfg", 1.0),
    )


@dataclass(frozen=True)
class CodecSpec:
    """The waveform codec that decodes the last `num_quantizers` streams."""

    type: str = "xcodec"
    path: str = "codec"  # checkpoint sub-directory, relative to the model directory
    sample_rate: int = 16000
    hop_length: int = 320
    num_quantizers: int = 8
    codebook_size: int = 1024

    @property
    def frame_rate(self) -> float:
        return self.sample_rate / self.hop_length


@dataclass(frozen=True)
class AudioTowerSpec:
    """A Qwen3-Omni audio encoder's geometry (transformers' Qwen3OmniMoeAudioEncoderConfig fields;
    defaults: Qwen3-Omni-30B-A3B's, whose output width 2048 Bagpiper's adaptor takes)."""

    d_model: int = 1280
    encoder_layers: int = 32
    encoder_attention_heads: int = 20
    encoder_ffn_dim: int = 5120
    downsample_hidden_size: int = 480
    output_dim: int = 2048
    num_mel_bins: int = 128
    n_window: int = 50  # mel frames are cut in chunks of 2 * n_window before the convolutions
    n_window_infer: int = 800  # attention windows span n_window_infer mel frames
    conv_chunksize: int = 500
    max_source_positions: int = 1500
    activation_function: str = "gelu"

    @property
    def chunk_frames(self) -> int:
        return 2 * self.n_window

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
                raise _fail(f"audio_input.tower.{f.name}", f"must be a positive integer, got {v!r}")
        if self.d_model % self.encoder_attention_heads:
            heads = self.encoder_attention_heads
            raise _fail("audio_input.tower.encoder_attention_heads", f"{heads} does not divide d_model {self.d_model}")
        if self.n_window_infer % self.chunk_frames:
            raise _fail("audio_input.tower.n_window_infer", f"must be a multiple of 2 * n_window = {self.chunk_frames}")


def conv_output_length(frames: int) -> int:
    """Length after the tower's three stride-2 convolutions (kernel 3, padding 1)."""
    for _ in range(3):
        frames = (frames - 1) // 2 + 1
    return frames


@dataclass(frozen=True)
class AudioInputSpec:
    """Audio input (understanding): the Qwen3-Omni feature extractor's settings (a Whisper log-mel
    of 16 kHz audio; `max_samples` is its n_samples, the longest input), the tower's geometry and
    the prompt placeholder id (see `BAGPIPER_AUDIO_PLACEHOLDER`)."""

    placeholder_id: int = BAGPIPER_AUDIO_PLACEHOLDER
    sample_rate: int = 16000
    n_fft: int = 400
    hop_length: int = 160
    max_samples: int = 4_800_000
    tower: AudioTowerSpec = field(default_factory=AudioTowerSpec)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AudioInputSpec:
        d = dict(d)
        if "tower" in d:
            d["tower"] = AudioTowerSpec(**d["tower"])
        return cls(**d)

    @property
    def min_samples(self) -> int:
        """The shortest input: the log-mel's reflect padding needs more than n_fft / 2 samples."""
        return self.n_fft // 2 + 1

    def num_frames(self, num_samples: int) -> int:
        """Log-mel frames of `num_samples` samples (ESPnet keeps samples // hop_length)."""
        return num_samples // self.hop_length

    def output_length(self, num_frames: int) -> int:
        """Encoder output rows (prompt rows) of `num_frames` mel frames: each whole chunk gives the
        convolutions' output of a chunk, the rest its own (transformers' and ESPnet's formula
        `_get_feat_extract_output_lengths` for n_window 50)."""
        chunk = self.tower.chunk_frames
        rest = num_frames % chunk
        return (num_frames // chunk) * conv_output_length(chunk) + (conv_output_length(rest) if rest else 0)

    def validate(self, cfg: "SpeechLMConfig") -> None:
        lo, hi = cfg.special_range
        p = self.placeholder_id
        named = {tok for _, tok in cfg.specials.items()} | {cfg.decoding.deferred_eos}
        if isinstance(p, bool) or not isinstance(p, int) or not lo <= p < hi or p in named:
            raise _fail("audio_input.placeholder_id", f"needs an unnamed special id in [{lo}, {hi}), got {p!r}")
        for key in ("sample_rate", "n_fft", "hop_length", "max_samples"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise _fail(f"audio_input.{key}", f"must be a positive integer, got {v!r}")
        self.tower.validate()


@dataclass(frozen=True)
class DecodingSpec:
    """Family decoding rules as data (defaults: Bagpiper, ESPnet's ParallelLLM.inference).

    `parallel_segments` (Bagpiper): the answer is a run of segments, each opened by
    `<|assistant|>` and a modality token (the enforced one, else the greedy choice between
    `<|text|>` and `<|audio|>`). A text or audio segment may end with eos or eot once it has
    `min_steps` rows, and ends by itself after `max_steps` rows. Another segment follows a
    segment that ended with eot, or while an enforced modality is still to come; otherwise the
    answer is over. An eos that does not end the answer is emitted as `deferred_eos` (vLLM stops
    on eos; the model embeds it as eos), and an answer that ends at a max length gets one forced
    eos row so that vLLM stops.

    False (OpusLM, ESPnet's ar_delay.py): each segment ends with eos (audio after
    `min_audio_frames`; text is forced to eos after `max_text_tokens`); stream 0 may also emit
    its segment's own modality marker, streams 1..S-1 pad (ESPnet's masks); the modality choice
    is sampled; stream s is forced to pad while the audio step is < s (delay warm-up). A segment
    that does not end the answer, and every audio segment, ends with a drain as ESPnet decodes
    it: the eos is emitted as `deferred_eos`; the next row is sampled whole (ESPnet sets its
    finish index one step late); drain row d = 2..S forces streams < d to pad. An audio drain's
    row S is a forced eos that stops the request; a text drain's is all pad, and the next
    segment's `<|assistant|>` and modality marker follow. Drain rows are fed back as sampled;
    the cells past the clip's end (stream s of drain row s) are emitted as pad.
    """

    parallel_segments: bool = True
    delay_warmup: bool = False
    min_audio_frames: int = 0
    drain: bool = False
    deferred_eos: int | None = None  # required with drain or parallel_segments: a special id the model never needs
    guidance: bool = True  # classifier-free guidance of audio segments against an all-pad context (OpusLM has none)

    def validate(self, cfg: "SpeechLMConfig") -> None:
        if isinstance(self.min_audio_frames, bool) or not isinstance(self.min_audio_frames, int) or self.min_audio_frames < 0:
            raise _fail("decoding.min_audio_frames", f"must be an integer >= 0, got {self.min_audio_frames!r}")
        if self.drain and self.parallel_segments:
            raise _fail("decoding.drain", "a drain belongs to the delay rules (parallel_segments false)")
        if not (self.drain or self.parallel_segments):
            return
        lo, hi = cfg.special_range
        d = self.deferred_eos
        if not isinstance(d, int) or not lo <= d < hi or d in {tok for _, tok in cfg.specials.items()}:
            raise _fail("decoding.deferred_eos", f"needs an unnamed special id in [{lo}, {hi}), got {d!r}")
        if not self.drain:
            return
        if cfg.stream_pad_slot:
            raise _fail("decoding.drain", "a drain pads streams with the special pad: needs stream_pad_slot false")
        if self.min_audio_frames < cfg.num_streams - 1:
            # The eos and drain rows are told apart from text rows by a stream still emitting.
            raise _fail("decoding.min_audio_frames", f"a drain needs >= S-1 = {cfg.num_streams - 1} audio frames")


@dataclass(frozen=True)
class SpeechLMConfig:
    """Validated layout of a delay-pattern speech LM. Build with `from_dict` / `from_model_dir`."""

    family: str
    vocab_size: int
    special_range: tuple[int, int]
    text_range: tuple[int, int]
    codec_start: int
    stream_sizes: tuple[int, ...]  # slice width of each stream, in stream order
    stream_pad_slot: bool  # True: slot 0 of each slice is that stream's pad (Bagpiper)
    specials: SpecialIds
    text_sampling: ModalitySampling = ModalitySampling(0.6, 20)
    audio_sampling: ModalitySampling = ModalitySampling(0.8, 20)
    # Prompt text id 0 is fed as pad (ESPnet's Bagpiper preprocessor maps text id 0, Qwen's "!",
    # to its pad id 0: speechlm_job.py, `this_seq == pad_id`). Sampled text ids are not mapped.
    prompt_text_zero_is_pad: bool = False
    # The stream embedding is added to stream 0 too (OpusLM's per-stream head bias).
    primary_stream_embedding: bool = False
    # ESPnet's dialogue prompt (OpusLM): the task token of a text-only answer and of any other
    # (text_dialogue, audio_dialogue); None: the chat prompt (tokenizer.encode_prompt).
    dialogue_tasks: tuple[int, int] | None = None
    codec: CodecSpec = field(default_factory=CodecSpec)
    decoding: DecodingSpec = field(default_factory=DecodingSpec)
    audio_input: AudioInputSpec | None = None  # None: the model takes no audio input

    # ---- derived layout -------------------------------------------------------------------
    @property
    def num_streams(self) -> int:
        return len(self.stream_sizes)

    @property
    def codec_end(self) -> int:
        return self.codec_start + sum(self.stream_sizes)

    @functools.cached_property  # read per window on stage 0's hot path; the layout never changes
    def streams(self) -> tuple[StreamSpec, ...]:
        specs, start = [], self.codec_start
        shift = 1 if self.stream_pad_slot else 0
        for s, size in enumerate(self.stream_sizes):
            pad = start if self.stream_pad_slot else self.specials.pad
            specs.append(StreamSpec(s, start, size, start + shift, size - shift, pad))
            start += size
        return tuple(specs)

    @property
    def aux_stream_width(self) -> int:
        """Width shared by streams 1..S-1 (sampled together in one batched projection)."""
        return self.stream_sizes[1] if self.num_streams > 1 else 0

    @property
    def aux_sample_width(self) -> int:
        """Columns streams 1..S-1 sample from: their slice, and under the delay rules a last
        column for the special pad (ESPnet's build_mask lets streams 1..S-1 emit pad)."""
        return self.aux_stream_width + (0 if self.decoding.parallel_segments else 1)

    # ---- validation -----------------------------------------------------------------------
    def __post_init__(self) -> None:
        self._validate_ranges()
        self._validate_streams()
        self._validate_specials()
        self.text_sampling.validate("text_sampling")
        self.audio_sampling.validate("audio_sampling")
        self._validate_codec()
        self.decoding.validate(self)
        if self.audio_input is not None:
            self.audio_input.validate(self)

    def _validate_ranges(self) -> None:
        if not isinstance(self.vocab_size, int) or self.vocab_size <= 0:
            raise _fail("vocab_size", f"must be a positive integer, got {self.vocab_size!r}")
        named = {
            "special_range": self.special_range,
            "text_range": self.text_range,
            "codec range (codec_start + sum(stream_sizes))": (self.codec_start, self.codec_end),
        }
        for name, (lo, hi) in named.items():
            if not 0 <= lo < hi <= self.vocab_size:
                raise _fail(name, f"[{lo}, {hi}) must be non-empty and inside [0, {self.vocab_size})")
        ordered = sorted(named.items(), key=lambda kv: kv[1][0])
        for (name_a, (_, hi_a)), (name_b, (lo_b, _)) in zip(ordered, ordered[1:]):
            if lo_b < hi_a:
                raise _fail(name_b, f"overlaps {name_a}")

    def _validate_streams(self) -> None:
        if len(self.stream_sizes) < 1:
            raise _fail("stream_sizes", "needs at least one stream")
        min_size = 2 if self.stream_pad_slot else 1
        if any(not isinstance(n, int) or n < min_size for n in self.stream_sizes):
            raise _fail("stream_sizes", f"each stream needs >= {min_size} ids, got {self.stream_sizes}")
        if len(set(self.stream_sizes[1:])) > 1:
            raise _fail("stream_sizes", f"streams 1..S-1 must share one width, got {self.stream_sizes}")

    def _validate_specials(self) -> None:
        lo, hi = self.special_range
        for name, tok in self.specials.items():
            if not isinstance(tok, int) or not lo <= tok < hi:
                raise _fail(f"specials.{name}", f"{tok!r} is outside special_range [{lo}, {hi})")
        tasks = self.dialogue_tasks
        if tasks is not None and (len(tasks) != 2 or not all(isinstance(t, int) and lo <= t < hi for t in tasks)):
            raise _fail("dialogue_tasks", f"needs two special ids in [{lo}, {hi}), got {tasks!r}")

    def _validate_codec(self) -> None:
        c = self.codec
        if c.num_quantizers < 1 or c.num_quantizers > self.num_streams:
            raise _fail("codec.num_quantizers", f"must be in [1, {self.num_streams}] (num streams), got {c.num_quantizers}")
        for s in self.streams[-c.num_quantizers :]:
            if s.codebook_size != c.codebook_size:
                raise _fail("codec.codebook_size", f"{c.codebook_size} != stream {s.index}'s codebook {s.codebook_size}")
        if c.sample_rate <= 0 or c.hop_length <= 0:
            raise _fail("codec.sample_rate", "sample_rate and hop_length must be positive")

    # ---- (de)serialisation ----------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any], vocab_size: int | None = None) -> SpeechLMConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise _fail(sorted(unknown)[0], "unknown field")
        if vocab_size is not None and d.get("vocab_size", vocab_size) != vocab_size:
            raise _fail("vocab_size", f"{d['vocab_size']} differs from the model's vocab_size {vocab_size}")
        kw = dict(d)
        kw.setdefault("vocab_size", vocab_size)
        for key in ("special_range", "text_range", "stream_sizes", "dialogue_tasks"):
            if kw.get(key) is not None:
                kw[key] = tuple(kw[key])
        nested = {"specials": SpecialIds, "codec": CodecSpec, "decoding": DecodingSpec}
        nested |= {"text_sampling": ModalitySampling, "audio_sampling": ModalitySampling}
        try:
            for key, kind in nested.items():
                if key in kw:
                    kw[key] = kind(**kw[key])
            if kw.get("audio_input") is not None:
                kw["audio_input"] = AudioInputSpec.from_dict(kw["audio_input"])
            return cls(**kw)
        except TypeError as e:  # a missing or unknown nested field
            raise ValueError(f"speechlm config: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for key in ("special_range", "text_range", "stream_sizes", "dialogue_tasks"):
            if d[key] is not None:
                d[key] = list(d[key])
        return d

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> SpeechLMConfig:
        """From a transformers config object (vLLM's `hf_config`) carrying the `speechlm` dict."""
        section = getattr(hf_config, SPEECHLM_KEY, None)
        if not isinstance(section, dict):
            raise ValueError(f"config.json has no '{SPEECHLM_KEY}' section: not a speech LM checkpoint")
        return cls.from_dict(section, vocab_size=hf_config.vocab_size)

    @classmethod
    def from_model_dir(cls, model_dir: str | os.PathLike) -> SpeechLMConfig:
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        if SPEECHLM_KEY not in raw:
            raise ValueError(f"{model_dir}/config.json has no '{SPEECHLM_KEY}' section")
        return cls.from_dict(raw[SPEECHLM_KEY], vocab_size=raw.get("vocab_size"))


def bagpiper_layout(text_vocab_size: int = 151936) -> SpeechLMConfig:
    """Bagpiper's layout: 256 specials, Qwen3 text ids + 256, then 8 streams x (pad + 1024 codes).

    The released model has `text_vocab_size` 151936 (vocab 160392); tiny checkpoints shrink only
    the text range so the codec side stays the real one.
    """
    text_end = 256 + text_vocab_size
    stream_sizes = (1025,) * 8
    return SpeechLMConfig(
        family="bagpiper",
        vocab_size=text_end + sum(stream_sizes),
        special_range=(0, 256),
        text_range=(256, text_end),
        codec_start=text_end,
        stream_sizes=stream_sizes,
        stream_pad_slot=True,
        specials=SpecialIds(pad=0, bos=1, eos=2, eot=3, system=4, user=5, assistant=6, text=7, audio=8),
        # The released SFT decoding (egs2/bagpiper/speechlm1/conf/inference_sft.yaml).
        text_sampling=ModalitySampling(0.6, 20, min_steps=1, max_steps=8192),
        audio_sampling=ModalitySampling(0.8, 20, min_steps=50, max_steps=2048, cfg_scale=3.0),
        prompt_text_zero_is_pad=True,
        decoding=DecodingSpec(deferred_eos=BAGPIPER_DEFERRED_EOS),
        audio_input=AudioInputSpec(),
    )


# ESPnet's `<|unused_255|>`: never sampled nor in a prompt; stands for an eos that does not end
# the answer (a text part followed by its enforced audio part).
BAGPIPER_DEFERRED_EOS = 255


# OpusLM special ids (ESPnet `espnet2/speechlm/definitions.py`: 0-31 general, 32-63 modality
# markers, 64-127 task tokens). ESPnet's dialogue prompt opens with <sos/eos> (`eos`), so `bos`
# is a placeholder; eot is never sampled (ESPnet ends every segment with eos).
OPUSLM_SPECIALS = SpecialIds(
    pad=0,
    bos=1,  # <unk>: not used by the dialogue prompt
    eos=5,  # <sos/eos>
    eot=6,  # <local_sos/eos>
    system=8,  # <system_prompt>
    user=9,  # <user_input>
    assistant=10,  # <assistant_output>
    text=35,  # <text_bpe_start/end>
    audio=34,  # <codec_ssl_start/end>
)
OPUSLM_DIALOGUE_TASKS = (88, 89)  # <text_dialogue_task>, <audio_dialogue_task> of the released token lists
OPUSLM_DEFERRED_EOS = 31  # <unused_token_31>: never in a prompt, never sampled
OPUSLM_TEXT_VOCAB = {"opuslm": 100352, "opuslm-dialogue": 49152}  # OLMo-2 / SmolLM2 tokenizers
OPUSLM_VOCAB_PADDING = 70  # released vocabularies: 113870 = 113800 + 70, 62670 = 62600 + 70


def opuslm_layout(
    family: str = "opuslm",
    text_vocab_size: int | None = None,
    min_audio_frames: int = 50,
    vocab_padding: int = OPUSLM_VOCAB_PADDING,
) -> SpeechLMConfig:
    """OpusLM's layout: 256 specials, SSL units (stream 0, 5000), DAC 8 x 1024 (no pad slots:
    the delay pad is token 0), then the backbone's text ids. Tiny checkpoints shrink the text
    range (and may lower `min_audio_frames`); the codec side stays the real one."""
    if family not in OPUSLM_TEXT_VOCAB:
        raise ValueError(f"family: expected one of {sorted(OPUSLM_TEXT_VOCAB)}, got {family!r}")
    text_vocab_size = OPUSLM_TEXT_VOCAB[family] if text_vocab_size is None else text_vocab_size
    stream_sizes = (5000,) + (1024,) * 8
    text_start = 256 + sum(stream_sizes)  # 13448
    text_end = text_start + text_vocab_size
    return SpeechLMConfig(
        family=family,
        vocab_size=text_end + vocab_padding,
        special_range=(0, 256),
        text_range=(text_start, text_end),
        codec_start=256,
        stream_sizes=stream_sizes,
        stream_pad_slot=False,
        specials=OPUSLM_SPECIALS,
        primary_stream_embedding=True,
        dialogue_tasks=OPUSLM_DIALOGUE_TASKS,
        codec=CodecSpec(type="dac"),
        decoding=DecodingSpec(
            parallel_segments=False,
            delay_warmup=True,
            min_audio_frames=min_audio_frames,
            drain=True,
            deferred_eos=OPUSLM_DEFERRED_EOS,
            guidance=False,
        ),
    )
