"""The plain-PyTorch reference: every phase, CFG, and a teacher-forced check of its semantics."""

import subprocess
import sys

import pytest
import torch

from vllm_omni_speechlm.decoding import RowKind
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
from vllm_omni_speechlm.tokenizer import encode_prompt

GREEDY = dict(text_temperature=0.0, audio_temperature=0.0)
K = RowKind


@pytest.fixture(scope="module")
def prompt(reference):
    return encode_prompt(reference.tokenizer, reference.cfg, "Say hello to the world.", system="Be brief.")


def _generate(reference, prompt, **kw):
    return reference.generate(prompt, SpeechSamplingParams(**kw))


def test_text_only_answer(reference, prompt):
    out = _generate(reference, prompt, modality="text", max_tokens=24, seed=3)
    cfg = reference.cfg
    assert out.kinds[0] == K.FORCE_TEXT and out.token_ids[0] == cfg.specials.text
    assert (out.kinds[1:] == K.TEXT).all()
    lo, hi = cfg.text_range
    body = out.tokens[1:, 0]
    ends = body == cfg.specials.eot
    assert ((body >= lo) & (body < hi) | ends | (body == cfg.specials.eos)).all()
    assert (out.tokens[:, 1:] == cfg.specials.pad).all()  # no aux streams outside audio
    assert out.audio is None and out.text
    assert out.finish_reason == ("stop" if ends.any() else "length")


def test_audio_only_answer_has_exact_length(reference, prompt):
    cfg = reference.cfg
    out = _generate(reference, prompt, modality="audio", max_tokens=40, seed=5)
    assert out.kinds[0] == K.FORCE_AUDIO and out.token_ids[0] == cfg.specials.audio
    audio_rows = out.tokens[1:]
    assert (out.kinds[1:] == K.AUDIO).all()
    for s in cfg.streams:  # every stream stays in its own slice of the vocabulary
        col = audio_rows[:, s.index]
        assert ((col >= s.vocab_start) & (col < s.vocab_end) | (col == cfg.specials.eos)).all()
    frames = len(audio_rows) - (cfg.num_streams - 1)
    assert out.codes.shape == (frames, 8)
    assert out.audio.shape == (frames * 320,)
    assert torch.isfinite(out.audio).all() and out.audio.abs().sum() > 0


def test_text_then_audio_walks_every_phase(reference, prompt):
    cfg = reference.cfg
    out = _generate(reference, prompt, modality="text+audio", max_tokens=30, max_text_tokens=6, seed=11)
    kinds = out.kinds.tolist()
    assert kinds[:10] == [K.FORCE_TEXT] + [K.TEXT_NO_EOS] * 6 + [K.FORCE_EOT, K.FORCE_ASSISTANT, K.FORCE_AUDIO]
    assert all(k == K.AUDIO for k in kinds[10:])
    sp = cfg.specials
    assert out.token_ids[7:10] == [sp.eot, sp.assistant, sp.audio]
    assert out.text and out.codes.shape[0] == 20 - (cfg.num_streams - 1)
    assert out.audio.shape == (out.codes.shape[0] * 320,)


def test_seeded_sampling_is_reproducible(reference, prompt):
    a = _generate(reference, prompt, modality="audio", max_tokens=16, seed=7)
    b = _generate(reference, prompt, modality="audio", max_tokens=16, seed=7)
    c = _generate(reference, prompt, modality="audio", max_tokens=16, seed=8)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.audio, b.audio)
    assert not torch.equal(a.tokens, c.tokens)


def test_cfg_changes_audio_rows_only(reference, prompt):
    kw = dict(modality="text+audio", max_tokens=24, max_text_tokens=6, seed=2)
    plain = _generate(reference, prompt, **kw)
    guided = _generate(reference, prompt, cfg_scale=3.0, **kw)
    assert torch.equal(plain.tokens[:10], guided.tokens[:10])  # text and transition untouched
    assert not torch.equal(plain.tokens[10:], guided.tokens[10:])


def _allowed(cfg, kind: int) -> torch.Tensor:
    """The masks, written independently of decoding.py from the model facts."""
    sp, ok = cfg.specials, torch.zeros(cfg.vocab_size, dtype=torch.bool)
    if kind in (K.TEXT, K.TEXT_NO_EOS):
        ok[cfg.text_range[0] : cfg.text_range[1]] = True
        ok[sp.eot] = True
        ok[sp.eos] = kind == K.TEXT
    elif kind == K.AUDIO:
        ok[cfg.streams[0].vocab_start : cfg.streams[0].vocab_end] = True
        ok[sp.eos] = True
    else:
        forced = {K.FORCE_TEXT: sp.text, K.FORCE_AUDIO: sp.audio, K.FORCE_ASSISTANT: sp.assistant, K.FORCE_EOT: sp.eot}
        ok[forced[kind]] = True
    return ok


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_teacher_forced_full_sequence_agrees(reference, prompt, cfg_scale):
    """Re-run the whole answer in one uncached forward pass (cond and all-pad uncond branches,
    every stream's tokens summed into the inputs) and re-derive each greedy choice."""
    cfg, w = reference.cfg, cfg_scale
    out = _generate(reference, prompt, modality="text+audio", max_tokens=26, max_text_tokens=4, cfg_scale=w, **GREEDY)
    n_prompt, n_out = len(prompt), len(out.tokens)
    seq = torch.zeros(2, n_prompt + n_out - 1, cfg.num_streams, dtype=torch.long)
    seq[0, :n_prompt, 0] = torch.tensor(prompt)
    seq[:, n_prompt:] = out.tokens[:-1]
    with torch.inference_mode():
        hidden = reference.backbone(reference.embed(seq), 0, reference.backbone.new_cache())[:, n_prompt - 1 :]
        for i in range(n_out):
            logits0, aux = reference.heads(hidden[:, i])
            kind = int(out.kinds[i])
            if kind == K.AUDIO:
                logits0, aux = w * logits0[0] + (1 - w) * logits0[1], w * aux[0] + (1 - w) * aux[1]
            else:
                logits0 = logits0[0]
            want0 = logits0.masked_fill(~_allowed(cfg, kind), float("-inf")).argmax()
            assert out.tokens[i, 0] == want0, f"step {i}"
            if kind == K.AUDIO:
                starts = torch.tensor([s.vocab_start for s in cfg.streams[1:]])
                assert torch.equal(out.tokens[i, 1:], aux.argmax(-1) + starts), f"step {i}"


def test_reference_needs_no_transformers(tiny_bagpiper):
    code = f"""
import sys
sys.modules['transformers'] = None  # any import of transformers now fails
from vllm_omni_speechlm.reference import ReferenceSpeechLM
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
ref = ReferenceSpeechLM({tiny_bagpiper!r})
out = ref.generate([1, 5, 7, 300, 2, 6], SpeechSamplingParams(modality='audio', max_tokens=12, seed=0))
print(out.audio.shape[0])
"""
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-1] == str((11 - 7) * 320)
