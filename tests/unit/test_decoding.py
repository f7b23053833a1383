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


def _kinds(phase, mode, segment, phase_step, *params):
    n = len(phase)
    rows = _rows(*(params or [SpeechSamplingParams()] * n))
    t = lambda v: torch.tensor([int(x) for x in v])  # noqa: E731
    return RULES.row_kinds(t(phase), t(mode), t(segment), t(phase_step), rows).tolist()


def test_modality_rows_take_the_enforced_modality_else_the_choice():
    phase = [P.START, P.START, P.START, P.AFTER_ASSISTANT, P.AFTER_ASSISTANT, P.AFTER_ASSISTANT]
    mode = [M.AUTO, M.TEXT, M.TEXT_AUDIO, M.TEXT_AUDIO, M.TEXT_AUDIO, M.AUDIO]
    segment = [0, 0, 0, 1, 2, 1]
    assert _kinds(phase, mode, segment, [0] * 6) == [K.CHOOSE, K.FORCE_TEXT, K.FORCE_TEXT, K.FORCE_AUDIO, K.CHOOSE, K.CHOOSE]


def test_one_mask_per_segment_with_minimum_lengths():
    """Inside a segment the kind is the segment's modality (no re-classification); eos and eot
    are masked before the segment's minimum length, in text and audio alike."""
    p = SpeechSamplingParams(min_text_tokens=2, min_audio_frames=3)
    phase = [P.TEXT, P.TEXT, P.AUDIO, P.AUDIO, P.TRANSITION]
    kinds = _kinds(phase, [M.AUTO] * 5, [0] * 5, [1, 2, 2, 3, 0], *[p] * 5)
    assert kinds == [K.TEXT_NO_END, K.TEXT, K.AUDIO_NO_EOS, K.AUDIO, K.FORCE_ASSISTANT]


def _walk(mode: OutputMode, tokens: list[int], p: SpeechSamplingParams):
    """Emitted tokens -> [(phase, segment, ended)] after each."""
    rows = _rows(p)
    phase, step, seg = torch.tensor([int(P.START)]), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
    m, out = torch.tensor([int(mode)]), []
    for tok in tokens:
        tok = RULES.emitted_token(phase, step, m, seg, torch.tensor([tok]))
        phase, step, seg, ended = RULES.step(phase, step, m, seg, tok, rows)
        out.append((int(tok), int(phase), int(seg), bool(ended)))
    return out


def test_eos_of_a_text_part_goes_on_to_the_enforced_audio():
    walk = _walk(M.TEXT_AUDIO, [SP.text, CFG.text_range[0] + 1, SP.eos, SP.assistant, SP.audio], SpeechSamplingParams())
    deferred = CFG.decoding.deferred_eos
    assert walk[2] == (deferred, P.TRANSITION, 1, True)  # emitted deferred: vLLM would stop on eos
    assert [w[1] for w in walk[3:]] == [P.AFTER_ASSISTANT, P.AUDIO]
    assert _walk(M.TEXT_AUDIO, [SP.text, SP.eos], SpeechSamplingParams())[1][1] == P.TRANSITION
    code = CFG.codec_start + 2
    end = _walk(M.TEXT_AUDIO, [SP.text, SP.eot, SP.assistant, SP.audio, code, SP.eos], SpeechSamplingParams())
    assert end[-1] == (SP.eos, P.DONE, 2, True)  # no enforced modality left: eos ends the answer


def test_eot_starts_another_segment_and_max_length_ends_one():
    code = CFG.codec_start + 2
    walk = _walk(M.AUDIO, [SP.audio, code, SP.eot, SP.assistant, SP.text], SpeechSamplingParams())
    assert [w[1] for w in walk] == [P.AUDIO, P.AUDIO, P.TRANSITION, P.AFTER_ASSISTANT, P.TEXT]
    capped = _walk(M.TEXT_AUDIO, [SP.text, *[CFG.text_range[0]] * 2, SP.assistant], SpeechSamplingParams(max_text_tokens=2))
    assert [w[1:] for w in capped[1:3]] == [(P.TEXT, 0, False), (P.TRANSITION, 1, True)]  # nothing forced at the max
    last = _walk(M.AUDIO, [SP.audio, code, code], SpeechSamplingParams(max_audio_frames=2))
    assert last[-1][1:] == (P.FINAL, 1, True)  # the answer is over: one forced eos row next
    assert _kinds([P.FINAL], [M.AUDIO], [1], [0]) == [K.FORCE_EOS]


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
    assert allowed[s0.vocab_start : s0.vocab_end].all() and allowed[SP.eos] and allowed[SP.eot]
    assert int(allowed.sum()) == s0.vocab_size + 2
    torch.testing.assert_close(out[1, s0.vocab_start : s0.vocab_end], raw[1, s0.vocab_start : s0.vocab_end])


@pytest.mark.parametrize("family", ["bagpiper", "opuslm"])
def test_no_text_rows_path_equals_the_full_vocabulary_path(family):
    """Audio-only batches are processed on the non-text columns: bit-identical logits."""
    from vllm_omni_speechlm.config import opuslm_layout

    cfg = CFG if family == "bagpiper" else opuslm_layout("opuslm", text_vocab_size=300)
    rules = DecodingRules(cfg)
    kinds = [k for k in RowKind if k not in (K.TEXT, K.TEXT_NO_END)]
    g = torch.Generator().manual_seed(0)
    raw = torch.randn(3 * len(kinds), cfg.vocab_size, generator=g).to(torch.bfloat16)
    kind = torch.tensor(kinds * 3)
    params = [SpeechSamplingParams(audio_top_k=k, audio_temperature=t) for k, t in [(0, 0.8), (20, 1.1), (1, 0.0)]]
    rows = RowSampling.from_values([q.resolve(cfg).row_values() for q in params for _ in kinds], "cpu")
    full = rules.process_primary_logits(raw, kind, rows)
    assert torch.equal(rules.process_primary_logits(raw, kind, rows, no_text_rows=True), full)
    assert torch.isfinite(full).sum(dim=1).min() >= 1


def test_greedy_modality_becomes_top1():
    raw = torch.randn(1, CFG.vocab_size, generator=torch.Generator().manual_seed(0))
    rows = _rows(SpeechSamplingParams(text_temperature=0.0, audio_temperature=0.9))
    out = RULES.process_primary_logits(raw, torch.tensor([K.TEXT]), rows)
    assert int(torch.isfinite(out).sum()) == 1
    allowed = torch.isfinite(RULES.mask_bias[K.TEXT])  # the text range, eos and eot
    assert int(out.argmax()) == int(raw[0].masked_fill(~allowed, float("-inf")).argmax())


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


@pytest.mark.parametrize("family", ["bagpiper", "opuslm"])
def test_text_rows_are_three_notes_away(family):
    """`TextRowsWatch`'s premise: a text row is computed only in a phase `text_soon_by_phase`
    marks, and so are the two rows before it (a step may read the note of three advances ago).
    Random audio answers (the other modes are text-capable on the host from the start), each
    row's token drawn from what its kind allows, segment markers often."""
    from vllm_omni_speechlm.config import opuslm_layout

    cfg = CFG if family == "bagpiper" else opuslm_layout("opuslm", text_vocab_size=300)
    rules, g = DecodingRules(cfg), torch.Generator().manual_seed(0)
    text_kinds = (int(K.TEXT), int(K.TEXT_NO_END))
    sp = cfg.specials
    markers = torch.tensor([sp.eos, sp.eot, sp.text, sp.audio, sp.assistant])
    text_rows = 0
    for walk in range(300):
        p = SpeechSamplingParams(min_audio_frames=walk % 3, min_text_tokens=walk % 2, max_audio_frames=6, max_text_tokens=4)
        rows = RowSampling.from_values([p.resolve(cfg).row_values()], "cpu")
        phase, step, seg = torch.tensor([int(P.START)]), torch.zeros(1, dtype=torch.long), torch.zeros(1, dtype=torch.long)
        m = torch.tensor([int(M.AUDIO)])
        soon = []  # the note after each row: whether its next row's phase is text-soon
        for _ in range(30):
            if int(phase) in (P.DONE, P.FINAL):
                break
            kind = rules.row_kinds(phase, m, seg, step, rows)
            if int(kind) in text_kinds:
                text_rows += 1
                assert len(soon) >= 3 and soon[-3:] == [True, True, True]
            allowed = torch.isfinite(rules.mask_bias[kind[0]]).nonzero().squeeze(1)
            marked = allowed[torch.isin(allowed, markers)]  # drawn often: they change the phase
            pool = marked if len(marked) and torch.rand(1, generator=g) < 0.3 else allowed
            tok = pool[torch.randint(len(pool), (1,), generator=g)]
            tok = rules.emitted_token(phase, step, m, seg, tok)
            phase, step, seg, _ = rules.step(phase, step, m, seg, tok, rows)
            soon.append(bool(rules.text_soon_by_phase[phase]))
    if cfg.decoding.parallel_segments:
        assert text_rows > 50  # audio answers did turn to text


@pytest.mark.parametrize("wait, reads", [(False, [True, False, True, True, False]), (True, [True, True, True, False, True])])
def test_text_rows_note_read_back(wait, reads):
    """A step reads the newest note (one rank), or under tensor parallelism (`wait`) the note of
    exactly three advances back, which every rank has alike; before any (or the third) note: text
    rows possible."""
    from vllm_omni_speechlm.models.text_rows import TextRowsWatch

    watch = TextRowsWatch(torch.device("cpu"), wait=wait)
    got = [watch.text_rows_possible()]
    for flag in (False, True, True, False):
        watch.flag.fill_(flag)
        watch.publish()
        got.append(watch.text_rows_possible())
    assert got == reads
