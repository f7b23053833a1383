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


TEXT_KINDS = (K.TEXT, K.TEXT_NO_END)
AUDIO_KINDS = (K.AUDIO, K.AUDIO_NO_EOS)


def _first_segment(out, cfg) -> int:
    """Rows of the answer's first segment (after its modality row)."""
    ends = {cfg.specials.eos, cfg.specials.eot, cfg.decoding.deferred_eos}
    rows = out.token_ids[1:]
    return next((i + 1 for i, t in enumerate(rows) if t in ends), len(rows))


def test_text_only_answer(reference, prompt):
    out = _generate(reference, prompt, modality="text", max_tokens=24, seed=3)
    cfg = reference.cfg
    assert out.kinds[0] == K.FORCE_TEXT and out.token_ids[0] == cfg.specials.text
    n = _first_segment(out, cfg)
    assert out.kinds[1] == K.TEXT_NO_END and all(k in TEXT_KINDS for k in out.kinds[1 : n + 1].tolist())
    lo, hi = cfg.text_range
    body = out.tokens[1:n, 0]
    assert ((body >= lo) & (body < hi)).all()
    assert (out.tokens[:, 1:] == cfg.specials.pad).all() or out.codes is not None  # aux streams only in audio
    assert out.text


def test_audio_only_answer_has_exact_length(reference, prompt):
    cfg = reference.cfg
    out = _generate(reference, prompt, modality="audio", max_tokens=40, seed=5, min_audio_frames=10)
    assert out.kinds[0] == K.FORCE_AUDIO and out.token_ids[0] == cfg.specials.audio
    n = _first_segment(out, cfg)
    assert n > 10  # eos / eot masked before the minimum
    audio_rows = out.tokens[1 : n + 1]
    assert all(k in AUDIO_KINDS for k in out.kinds[1 : n + 1].tolist())
    for s in cfg.streams:  # every stream stays in its own slice of the vocabulary
        col = audio_rows[:, s.index]
        assert ((col >= s.vocab_start) & (col < s.vocab_end) | (col <= cfg.special_range[1])).all()
    frames = int(((out.tokens[:, 0] >= cfg.codec_start) & (out.tokens[:, 0] < cfg.codec_end)).sum()) - (cfg.num_streams - 1)
    assert out.codes.shape == (frames, 8)
    assert out.audio.shape == (frames * 320,)
    assert torch.isfinite(out.audio).all() and out.audio.abs().sum() > 0


def test_text_then_audio_walks_every_phase(reference, prompt):
    cfg, sp = reference.cfg, reference.cfg.specials
    out = _generate(reference, prompt, modality="text+audio", max_tokens=30, max_text_tokens=6, seed=11)
    kinds = out.kinds.tolist()
    n = _first_segment(out, cfg)
    assert n <= 6 and kinds[:2] == [K.FORCE_TEXT, K.TEXT_NO_END] and all(k in TEXT_KINDS for k in kinds[1 : n + 1])
    assert kinds[n + 1 : n + 3] == [K.FORCE_ASSISTANT, K.FORCE_AUDIO]  # nothing forced at the text max
    assert out.token_ids[n + 1 : n + 3] == [sp.assistant, sp.audio]
    assert kinds[n + 3] == K.AUDIO_NO_EOS and out.text


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
    first_audio = plain.kinds.tolist().index(K.FORCE_AUDIO) + 1
    assert torch.equal(plain.tokens[:first_audio], guided.tokens[:first_audio])  # text and transition untouched
    assert not torch.equal(plain.tokens[first_audio:], guided.tokens[first_audio:])


def _allowed(cfg, kind: int) -> torch.Tensor:
    """The masks, written independently of decoding.py from ESPnet's ParallelLLM."""
    sp, ok = cfg.specials, torch.zeros(cfg.vocab_size, dtype=torch.bool)
    if kind in (K.TEXT, K.TEXT_NO_END):
        ok[cfg.text_range[0] : cfg.text_range[1]] = True
        ok[[sp.eot, sp.eos]] = kind == K.TEXT
    elif kind in (K.AUDIO, K.AUDIO_NO_EOS):
        ok[cfg.streams[0].vocab_start : cfg.streams[0].vocab_end] = True
        ok[[sp.eot, sp.eos]] = kind == K.AUDIO
    else:
        forced = {K.FORCE_TEXT: sp.text, K.FORCE_AUDIO: sp.audio, K.FORCE_ASSISTANT: sp.assistant, K.FORCE_EOS: sp.eos,
                  K.CHOOSE: [sp.text, sp.audio]}
        ok[forced[kind]] = True
    return ok


@pytest.mark.parametrize("cfg_scale", [1.0, 3.0])
def test_teacher_forced_full_sequence_agrees(reference, prompt, cfg_scale):
    """Re-run the whole answer in one uncached forward pass (every stream's tokens summed into the
    inputs, a segment's last row fed with streams 1..S-1 pad; the unguided branch all pad up to
    the audio segment's modality token, as ESPnet rebuilds it) and re-derive each greedy choice."""
    cfg, w = reference.cfg, cfg_scale
    out = _generate(reference, prompt, modality="text+audio", max_tokens=40, max_text_tokens=4, cfg_scale=w, **GREEDY)
    n_prompt, n_out = len(prompt), len(out.tokens)
    fed = out.tokens[:-1].clone()
    kinds = out.kinds.tolist()
    segment_ends = [i for i in range(n_out - 1) if kinds[i + 1] in (K.FORCE_ASSISTANT, K.FORCE_EOS)]
    fed[segment_ends, 1:] = cfg.specials.pad
    deferred = fed[:, 0] == cfg.decoding.deferred_eos
    fed[deferred, 0] = cfg.specials.eos  # the deferred eos is fed as eos
    seq = torch.zeros(2, n_prompt + n_out - 1, cfg.num_streams, dtype=torch.long)
    seq[0, :n_prompt, 0] = torch.tensor(prompt)
    seq[0, n_prompt:] = fed
    audio_row = kinds.index(K.FORCE_AUDIO)  # the unguided branch: pad before it, then what was fed
    seq[1, n_prompt + audio_row :] = fed[audio_row:]
    with torch.inference_mode():
        hidden = reference.backbone(reference.embed(seq), 0, reference.backbone.new_cache())[:, n_prompt - 1 :]
        for i in range(n_out):
            logits0, aux = reference.heads(hidden[:, i])
            kind = kinds[i]
            if kind in AUDIO_KINDS:
                logits0, aux = w * logits0[0] + (1 - w) * logits0[1], w * aux[0] + (1 - w) * aux[1]
            else:
                logits0 = logits0[0]
            want0 = int(logits0.masked_fill(~_allowed(cfg, kind), float("-inf")).argmax())
            got0 = int(out.tokens[i, 0])
            assert (cfg.specials.eos if got0 == cfg.decoding.deferred_eos else got0) == want0, f"step {i}"
            if kind in AUDIO_KINDS:
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
