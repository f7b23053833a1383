"""Tokenizers over the unified vocabulary and the prompt format.

The tokenizer covers every id of the unified vocabulary: specials and codec slots are special
added tokens (so detokenizing stream-0 output never meets an unknown id, and
`skip_special_tokens` leaves only the text), text ids are the text model's ids shifted into
`text_range`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Protocol

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vllm_omni_speechlm.config import SpeechLMConfig

SPECIAL_TOKEN_TEXT = {
    "pad": "<|pad|>",
    "bos": "<|bos|>",
    "eos": "<|eos|>",
    "eot": "<|eot|>",
    "system": "<|system|>",
    "user": "<|user|>",
    "assistant": "<|assistant|>",
    "text": "<|text|>",
    "audio": "<|audio|>",
}

# Prompt format (model facts):
#   <|bos|>[<|system|><|text|>SYSTEM<|eos|>]<|user|><|text|>USER<|eos|><|assistant|>
CHAT_TEMPLATE = (
    "{{ '<|bos|>' }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ '<|system|><|text|>' + m['content'] + '<|eos|>' }}"
    "{% elif m['role'] == 'user' %}{{ '<|user|><|text|>' + m['content'] + '<|eos|>' }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|assistant|><|text|>' + m['content'] + '<|eot|>' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

# A fixed corpus: the tiny tokenizer's merges are the same on every machine.
_CORPUS = """
The quick brown fox jumps over the lazy dog. Hello world, this is a speech language model.
It reads text and audio and writes text plus parallel codec streams under the delay pattern.
Please say something nice about the weather today. What time is it in the morning?
The rain in Spain stays mainly in the plain. A journey of a thousand miles begins with one step.
Speech synthesis turns written words into sound; recognition turns sound back into words.
Numbers: one two three four five six seven eight nine ten eleven twelve hundred thousand.
""".strip().splitlines()


def reserved_token_text(token_id: int) -> str:
    """The text of an unnamed special id (the audio placeholder is one)."""
    return f"<|reserved_{token_id}|>"


def special_token_strings(cfg: SpeechLMConfig) -> dict[int, str]:
    """Id -> text of every non-text token: named specials, reserved specials, codec slots."""
    named = {tok: SPECIAL_TOKEN_TEXT[name] for name, tok in cfg.specials.items()}
    out = {i: named.get(i, reserved_token_text(i)) for i in range(*cfg.special_range)}
    for s in cfg.streams:
        out[s.pad_id] = out.get(s.pad_id, f"<|s{s.index}_pad|>")
        for code in range(s.codebook_size):
            out[s.code_offset + code] = f"<|s{s.index}_{code}|>"
    return out


def train_text_bpe(vocab_size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """A byte-level BPE trained on the fixed corpus: (vocab token -> id from 0, merges)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    tok.train_from_iterator(_CORPUS, trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return model["vocab"], merges


def build_tokenizer(
    cfg: SpeechLMConfig, text_vocab: dict[str, int], merges: list[tuple[str, str]], base: Tokenizer | None = None
) -> Tokenizer:
    """A tokenizer whose ids are the unified vocabulary's ids. `base` (the backbone's own
    tokenizer) gives the normalizer, pre-tokenizer and decoder, so text splits as the backbone's
    does (Qwen's pre-tokenizer is not GPT-2's); default: plain byte-level."""
    lo, hi = cfg.text_range
    if len(text_vocab) != hi - lo:
        raise ValueError(f"text_range: {hi - lo} ids, but the text vocabulary has {len(text_vocab)}")
    specials = special_token_strings(cfg)
    vocab = {t: i + lo for t, i in text_vocab.items()} | {t: i for i, t in specials.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if base is not None:
        tok.pre_tokenizer, tok.decoder = base.pre_tokenizer, base.decoder
        if base.normalizer is not None:
            tok.normalizer = base.normalizer
    tok.add_special_tokens([specials[i] for i in sorted(specials)])
    return tok


def backbone_text_vocab(tokenizer: Tokenizer, size: int) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """(vocab over exactly `size` text ids, merges) of a backbone's byte-level BPE tokenizer.

    The backbone's embedding may have more rows than its tokenizer has tokens (Qwen3: 151936 rows,
    151669 tokens). Its added tokens (Qwen's `<|endoftext|>`, `<|im_start|>`, ...) keep their ids
    as plain text entries, and every id no token uses gets `<|text_unused_{id}|>`, so the unified
    tokenizer covers the whole text range."""
    spec = json.loads(tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"text tokenizer: expected a BPE model, got {model.get('type')}")
    vocab = dict(model["vocab"]) | {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    top = max(vocab.values(), default=-1)
    if top >= size or len(set(vocab.values())) != len(vocab):
        raise ValueError(f"text tokenizer: ids up to {top} ({len(vocab)} tokens) do not fit the {size} text ids")
    used = set(vocab.values())
    vocab |= {f"<|text_unused_{i}|>": i for i in range(size) if i not in used}
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return vocab, merges


def chat_template(cfg: SpeechLMConfig) -> str:
    """The tokenizer's chat template: `encode_prompt`'s format. ESPnet's dialogue format names its
    task by the answer's modality, which a template cannot see: it renders the audio one."""
    if cfg.dialogue_tasks is None:
        return CHAT_TEMPLATE
    names = special_token_strings(cfg)
    sp = cfg.specials
    gap = names[sp.pad] * (cfg.num_streams - 1)
    role = {"system": names[sp.system], "user": names[sp.user]}
    return (
        "{{ '" + names[sp.eos] + names[cfg.dialogue_tasks[1]] + "' }}"
        "{% for m in messages %}"
        + "".join(
            f"{{% {'if' if i == 0 else 'elif'} m['role'] == '{r}' %}}{{{{ '{t}{names[sp.text]}' + m['content'] + '{gap}' }}}}"
            for i, (r, t) in enumerate(role.items())
        )
        + "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '" + names[sp.assistant] + "' }}{% endif %}"
    )


def write_hf_tokenizer(tok: Tokenizer, cfg: SpeechLMConfig, out_dir: str | os.PathLike) -> None:
    """tokenizer.json + tokenizer_config.json, loadable by transformers' AutoTokenizer and vLLM."""
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    sp = SPECIAL_TOKEN_TEXT
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": sp["bos"],
        "eos_token": sp["eos"],
        "pad_token": sp["pad"],
        "add_bos_token": False,
        "model_max_length": 1 << 20,
        "chat_template": chat_template(cfg),
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def encode_prompt(
    tokenizer: _Encoder,
    cfg: SpeechLMConfig,
    user: str | None,
    system: str | None = None,
    text_only: bool = False,
    audio: int = 0,
) -> list[int]:
    """Token ids of a one-turn prompt, ending in <|assistant|>: the chat format (model facts'),
    or ESPnet's dialogue format where the layout has `dialogue_tasks` (`text_only`: the answer
    is text only, which picks the task token). `audio` clips come first in the user's turn, each
    `<|user|><|audio|>` and one audio placeholder (vLLM's processor expands it to the clip's
    rows), then the user's text if any."""
    if cfg.dialogue_tasks is not None:
        if audio:
            raise ValueError("audio: this model family takes no audio input yet")
        return _dialogue_prompt(tokenizer, cfg, user, system, text_only)
    if audio and cfg.audio_input is None:
        raise ValueError("audio: this checkpoint takes no audio input (no audio_input section)")
    messages = [("system", system)] if system else []
    messages += [("user", None)] * audio + ([("user", user or "")] if user or not audio else [])
    return chat_prompt(tokenizer, cfg, messages)


def chat_prompt(tokenizer: _Encoder, cfg: SpeechLMConfig, messages: list[tuple[str, str | None]]) -> list[int]:
    """ESPnet's Bagpiper preprocessing of (role, text) messages (None: an audio clip): <|bos|>,
    then per message its role, modality and content, closed by <|eot|> when the next message has
    the same role and by <|eos|> otherwise; then <|assistant|>."""
    sp = cfg.specials
    roles = {"system": sp.system, "user": sp.user}
    ids = [sp.bos]
    for i, (role, text) in enumerate(messages):
        same_next = i + 1 < len(messages) and messages[i + 1][0] == role
        ids += [roles[role], *_content(tokenizer, cfg, text), sp.eot if same_next else sp.eos]
    return ids + [sp.assistant]


def _content(tokenizer: _Encoder, cfg: SpeechLMConfig, text: str | None) -> list[int]:
    sp = cfg.specials
    if text is None:
        return [sp.audio, cfg.audio_input.placeholder_id]
    ids = _encode(tokenizer, text)
    if cfg.prompt_text_zero_is_pad:  # as the model was trained (SpeechLMConfig)
        ids = [sp.pad if t == cfg.text_range[0] else t for t in ids]
    return [sp.text, *ids]


def _dialogue_prompt(tokenizer: _Encoder, cfg: SpeechLMConfig, user: str, system: str | None, text_only: bool) -> list[int]:
    """ESPnet's dialogue sequence (the speechlm3 preprocessor's, which OpusLM was trained on):
    <sos/eos>, the task token, then per message its role, <text_bpe_start/end>, the text and
    S-1 pad rows (the delay pattern's gap between segments); then the answer's role."""
    sp = cfg.specials
    gap = [sp.pad] * (cfg.num_streams - 1)

    def message(role: int, text: str) -> list[int]:
        return [role, sp.text, *_encode(tokenizer, text), *gap]

    ids = [sp.eos, cfg.dialogue_tasks[0 if text_only else 1]]
    if system:
        ids += message(sp.system, system)
    return ids + message(sp.user, user) + [sp.assistant]


def _encode(tokenizer: _Encoder, text: str) -> list[int]:
    """User text -> ids. A special token's spelling typed in the text ("<|eos|>") stays text:
    the added tokens are matched before pre-tokenisation, so encoding with them would let a user
    end a turn or force a modality."""
    if isinstance(tokenizer, Tokenizer):
        return _without_added_tokens(tokenizer).encode(text, add_special_tokens=False).ids
    return list(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])


_PLAIN: dict[int, tuple[Tokenizer, Tokenizer]] = {}


def _without_added_tokens(tokenizer: Tokenizer) -> Tokenizer:
    """The same tokenizer with no added-token matching (cached per tokenizer object)."""
    cached = _PLAIN.get(id(tokenizer))
    if cached is None or cached[0] is not tokenizer:
        spec = json.loads(tokenizer.to_str())
        spec["added_tokens"] = []
        cached = _PLAIN[id(tokenizer)] = (tokenizer, Tokenizer.from_str(json.dumps(spec)))
    return cached[1]


def has_text(stream0: Sequence[int], cfg: SpeechLMConfig) -> bool:
    lo, hi = cfg.text_range
    return any(lo <= t < hi for t in stream0)


def decode_text(tokenizer, stream0: list[int], cfg: SpeechLMConfig) -> str | None:
    """The text part of an answer (stream-0 ids inside `text_range`), or None if there is none."""
    lo, hi = cfg.text_range
    ids = [t for t in stream0 if lo <= t < hi]
    return tokenizer.decode(ids) if ids else None
