"""Decoding rules: phases, row kinds, masks and per-modality sampling, batched over rows."""

import pytest
import torch

from vllm_omni_speechlm.config import bagpiper_layout
from vllm_omni_speechlm.decoding import DecodingRules, OutputMode, Phase, RowKind, RowSampling, _mul32, apply_top_k, seeded_exponential
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

CFG = bagpiper_layout(text_vocab_size=300)
SP = CFG.specials
RULES = DecodingRules(CFG)
P, M, K = Phase, OutputMode, RowKind


def _rows(*params: SpeechSamplingParams) -> RowSampling:
    return RowSampling.from_values([p.resolve(CFG).row_values() for p in params], "cpu")


def _peaked(token: int) -> torch.Tensor:
    logits = torch.zeros(CFG.vocab_size)
    logits[token] = 10.0
    return logits


def test_auto_mode_reads_the_modality_from_the_raw_argmax():
    text_tok, code_tok = CFG.text_range[0] + 5, CFG.codec_start + 9
    raw = torch.stack([_peaked(SP.audio), _peaked(code_tok), _peaked(text_tok), _peaked(SP.eos)])
    phase = torch.full((4,), int(P.TEXT))
    mode = torch.full((4,), int(M.AUTO))
    rows = _rows(*[SpeechSamplingParams()] * 4)
    kinds = RULES.row_kinds(phase, mode, raw, torch.zeros(4, dtype=torch.long), rows)
    assert kinds.tolist() == [K.CHOOSE, K.AUDIO, K.TEXT, K.TEXT]


def test_forced_modes_ignore_the_logits():
    raw = _peaked(CFG.codec_start).expand(5, -1)
    phase = torch.tensor([P.START, P.START, P.TEXT, P.TRANSITION, P.AFTER_ASSISTANT])
    mode = torch.tensor([M.TEXT, M.AUDIO, M.TEXT_AUDIO, M.TEXT_AUDIO, M.TEXT_AUDIO])
    rows = _rows(*[SpeechSamplingParams()] * 5)
    kinds = RULES.row_kinds(phase, mode, raw, torch.zeros(5, dtype=torch.long), rows)
    assert kinds.tolist() == [K.FORCE_TEXT, K.FORCE_AUDIO, K.TEXT_NO_EOS, K.FORCE_ASSISTANT, K.FORCE_AUDIO]


def test_text_budget_forces_eot():
    rows = _rows(SpeechSamplingParams(max_text_tokens=3), SpeechSamplingParams(max_text_tokens=3))
    phase, mode = torch.tensor([P.TEXT, P.TEXT]), torch.tensor([M.TEXT_AUDIO, M.TEXT_AUDIO])
    kinds = RULES.row_kinds(phase, mode, torch.zeros(2, CFG.vocab_size), torch.tensor([3, 4]), rows)
    assert kinds.tolist() == [K.TEXT_NO_EOS, K.FORCE_EOT]


def test_phase_transitions_and_replay():
    history = [SP.text, CFG.text_range[0], SP.eot, SP.assistant, SP.audio, CFG.codec_start + 3]
    expected = [P.TEXT, P.TEXT, P.TRANSITION, P.AFTER_ASSISTANT, P.AUDIO, P.AUDIO]
    phase = torch.tensor([int(P.START)])
    for tok, want in zip(history, expected):
        phase = RULES.advance(phase, torch.tensor([tok]))
        assert int(phase) == want
    assert RULES.replay(history + [SP.eos]) == P.DONE


def test_masks_and_temperature_compensation():
    raw = torch.randn(2, CFG.vocab_size)
    kind = torch.tensor([K.TEXT, K.AUDIO])
    p = SpeechSamplingParams(text_temperature=0.5, audio_temperature=0.8, text_top_k=0, audio_top_k=0)
    out = RULES.process_primary_logits(raw, kind, _rows(p))
    lo, hi = CFG.text_range
    assert torch.isfinite(out[0, lo:hi]).all() and torch.isinf(out[0, CFG.codec_start :]).all()
    # vLLM divides by T_engine (0.8): text rows then end up divided by their own 0.5.
    torch.testing.assert_close(out[0, lo:hi] / 0.8, raw[0, lo:hi] / 0.5)
    s0 = CFG.streams[0]
    allowed = torch.isfinite(out[1])
    assert allowed[s0.vocab_start : s0.vocab_end].all() and allowed[SP.eos]
    assert int(allowed.sum()) == s0.vocab_size + 1
    torch.testing.assert_close(out[1, s0.vocab_start : s0.vocab_end], raw[1, s0.vocab_start : s0.vocab_end])


@pytest.mark.parametrize("family", ["bagpiper", "opuslm"])
def test_no_text_rows_path_equals_the_full_vocabulary_path(family):
    """Audio-only batches are processed on the non-text columns: bit-identical logits."""
    from vllm_omni_speechlm.config import opuslm_layout

    cfg = CFG if family == "bagpiper" else opuslm_layout("opuslm", text_vocab_size=300)
    rules = DecodingRules(cfg)
    kinds = [k for k in RowKind if k not in (K.TEXT, K.TEXT_NO_EOS)]
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(3 * len(kinds), cfg.vocab_size, generator=g).to(torch.bfloat16)
    kind = torch.tensor(kinds * 3)
    params = [SpeechSamplingParams(audio_top_k=k, audio_temperature=t) for k, t in [(0, 0.8), (20, 1.1), (1, 0.0)]]
    rows = RowSampling.from_values([q.resolve(cfg).row_values() for q in params for _ in kinds], "cpu")
    full = rules.process_primary_logits(raw, kind, rows)
    assert torch.equal(rules.process_primary_logits(raw, kind, rows, no_text_rows=True), full)
    assert torch.isfinite(full).sum(dim=1).min() >= 1


def test_greedy_modality_becomes_top1():
    raw = torch.randn(1, CFG.vocab_size)
    rows = _rows(SpeechSamplingParams(text_temperature=0.0, audio_temperature=0.9))
    out = RULES.process_primary_logits(raw, torch.tensor([K.TEXT]), rows)
    assert int(torch.isfinite(out).sum()) == 1
    lo, hi = CFG.text_range
    assert int(out.argmax()) == lo + int(raw[0, lo:hi].argmax())


def test_top_k_per_row_keeps_ties_and_disables_at_zero():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    out = apply_top_k(logits, torch.tensor([1, 2, 0]), max_top_k=2)
    assert torch.isfinite(out).tolist() == [
        [False, True, True, False],  # k=1 keeps both tied maxima
        [False, False, True, True],
        [True, True, True, True],  # k=0: no top-k
    ]
    assert torch.equal(apply_top_k(logits, torch.tensor([0, -1, 0]), max_top_k=0), logits)  # no row has top-k


def test_aux_sampling_is_greedy_at_temperature_zero():
    logits = torch.randn(3, CFG.num_streams - 1, CFG.aux_stream_width)
    rows = _rows(*[SpeechSamplingParams(audio_temperature=0.0, text_temperature=0.5)] * 3)
    noise = torch.empty_like(logits).exponential_()
    assert torch.equal(RULES.sample_aux_streams(logits, rows, noise), logits.argmax(-1))


def test_mul32_is_multiplication_mod_2_32():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 2**32, (1000,), generator=g)
    for c in (0x21F0AAAD, 0xD35A2D97, 0x9E3779B9, 1, 0xFFFFFFFF):
        assert _mul32(x, c).tolist() == [v * c % 2**32 for v in x.tolist()]


def test_seeded_noise_is_keyed_on_seed_and_position_only():
    """Counter-based: a row's noise is the same alone or anywhere in any batch (the engine's rows
    must equal the reference's one-request draws), and changes with the seed or the position."""
    seeds = torch.tensor([0, 1, 2**63 - 2, 12345, 12345, 7])
    positions = torch.tensor([0, 0, 3, 3, 4, 2**31 + 5])
    batch = seeded_exponential(seeds, positions, (7, 33))
    for i in range(len(seeds)):
        assert torch.equal(seeded_exponential(seeds[i : i + 1], positions[i : i + 1], (7, 33))[0], batch[i])
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    assert torch.equal(seeded_exponential(seeds[order], positions[order], (7, 33)), batch[order])
    flat = batch.flatten(1)
    for a, b in ((0, 1), (3, 4)):  # another seed, the next position
        assert (flat[a] != flat[b]).float().mean() > 0.99
    assert torch.isfinite(batch).all() and (batch > 0).all()


def test_seeded_noise_is_exp1_and_uncorrelated():
    n, width = 4000, 256
    q = seeded_exponential(torch.full((n,), 99), torch.arange(n), (width,)).double()
    assert abs(q.mean() - 1) < 0.01 and abs(q.var() - 1) < 0.03
    assert abs((q < torch.log(torch.tensor(2.0))).double().mean() - 0.5) < 0.005  # median ln 2
    corr = lambda a, b: torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1].abs()
    assert corr(q[:-1], q[1:]) < 0.01  # consecutive positions
    assert corr(q[:, :-1], q[:, 1:]) < 0.01  # neighbouring elements


def test_seeded_noise_samples_the_softmax():
    """Gumbel-max with the counter-based noise: argmax(p / q) is a draw from p."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    n = 40_000
    q = seeded_exponential(torch.full((n,), 3), torch.arange(n), (4,))
    freq = torch.bincount((probs / q).argmax(-1), minlength=4) / n
    assert torch.allclose(freq, probs, atol=0.01)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(cfg_scale=float("nan")), "cfg_scale"),
        (dict(cfg_scale=0.5), "cfg_scale"),
        (dict(cfg_scale=1e6), "cfg_scale"),
        (dict(text_temperature=-0.1), "text_temperature"),
        (dict(audio_temperature="hot"), "audio_temperature"),
        (dict(audio_top_k=2.5), "audio_top_k"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_text_tokens=0), "max_text_tokens"),
        (dict(seed=-1), "seed"),
        (dict(modality="video"), "modality"),
    ],
)
def test_bad_sampling_params_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SpeechSamplingParams(**kwargs)


def test_the_wire_form_carries_every_option_but_the_seed():
    from vllm_omni_speechlm.sampling_params import MODEL_OPTIONS, SPEECH_PARAMS_KEY

    p = SpeechSamplingParams(modality="text+audio", cfg_scale=2.5, text_top_k=7, audio_temperature=0.5,
                             max_tokens=90, max_text_tokens=12, seed=4).resolve(CFG)
    info = p.to_info()
    assert set(info[SPEECH_PARAMS_KEY]) == {*MODEL_OPTIONS, "modality", "max_tokens"}
    assert SpeechSamplingParams.from_info(info, seed=4) == p
    assert SpeechSamplingParams.from_info(None) == SpeechSamplingParams()
    with pytest.raises(ValueError, match="^cfg_scale"):
        SpeechSamplingParams.from_info({SPEECH_PARAMS_KEY: {"cfg_scale": float("nan")}})
