"""Tokenizers over the unified vocabulary and the prompt format.

The tokenizer covers every id of the unified vocabulary: specials and codec slots are special
added tokens (so detokenizing stream-0 output never meets an unknown id, and
`skip_special_tokens` leaves only the text), text ids are the text model's ids shifted into
`text_range`.
"""

from __future__ import annotations

import json
import os
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


def special_token_strings(cfg: SpeechLMConfig) -> dict[int, str]:
    """Id -> text of every non-text token: named specials, reserved specials, codec slots."""
    named = {tok: SPECIAL_TOKEN_TEXT[name] for name, tok in cfg.specials.items()}
    out = {i: named.get(i, f"<|reserved_{i}|>") for i in range(*cfg.special_range)}
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


def build_tokenizer(cfg: SpeechLMConfig, text_vocab: dict[str, int], merges: list[tuple[str, str]]) -> Tokenizer:
    """A tokenizer whose ids are the unified vocabulary's ids."""
    lo, hi = cfg.text_range
    if len(text_vocab) != hi - lo:
        raise ValueError(f"text_range: {hi - lo} ids, but the text vocabulary has {len(text_vocab)}")
    specials = special_token_strings(cfg)
    vocab = {t: i + lo for t, i in text_vocab.items()} | {t: i for i, t in specials.items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([specials[i] for i in sorted(specials)])
    return tok


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
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)


class _Encoder(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


def encode_prompt(tokenizer: _Encoder, cfg: SpeechLMConfig, user: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn prompt (model facts' format), ending in <|assistant|>."""
    sp = cfg.specials

    def turn(role: int, text: str) -> list[int]:
        return [role, sp.text, *_encode(tokenizer, text), sp.eos]

    ids = [sp.bos]
    if system:
        ids += turn(sp.system, system)
    return ids + turn(sp.user, user) + [sp.assistant]


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


def decode_text(tokenizer, stream0: list[int], cfg: SpeechLMConfig) -> str | None:
    """The text part of an answer (stream-0 ids inside `text_range`), or None if there is none."""
    lo, hi = cfg.text_range
    ids = [t for t in stream0 if lo <= t < hi]
    return tokenizer.decode(ids) if ids else None
