"""OpusLM's decoding rules as data (`DecodingSpec`): layout, delay warm-up, minimum audio length,
the drain with its deferred eos, and the audio rows that de-interleave to exactly T frames."""

import pytest
import torch

from vllm_omni_speechlm.config import DecodingSpec, SpeechLMConfig, opuslm_layout
from vllm_omni_speechlm.decoding import DecodingRules, OutputMode, Phase, RowKind, RowSampling
from vllm_omni_speechlm.delay_pattern import audio_rows, audio_segments, interleave
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

CFG = opuslm_layout("opuslm", text_vocab_size=300, min_audio_frames=12)
SP, DEC, S = CFG.specials, CFG.decoding, CFG.num_streams
RULES = DecodingRules(CFG)
P, M, K = Phase, OutputMode, RowKind


def test_released_layouts():
    big, dialogue = opuslm_layout("opuslm"), opuslm_layout("opuslm-dialogue")
    assert (big.vocab_size, dialogue.vocab_size) == (113870, 62670)
    assert big.text_range == (13448, 113800) and dialogue.text_range == (13448, 62600)
    ssl, dac = big.streams[0], big.streams[1:]
    assert (ssl.vocab_start, ssl.codebook_size, ssl.pad_id) == (256, 5000, 0)
    assert [(s.vocab_start, s.codebook_size, s.pad_id) for s in dac] == [(5256 + 1024 * i, 1024, 0) for i in range(8)]
    assert (SP.eos, SP.audio, SP.text) == (5, 34, 35)
    assert big.primary_stream_embedding and big.codec.type == "dac" and big.decoding.min_audio_frames == 50
    assert SpeechLMConfig.from_dict(big.to_dict()) == big


@pytest.mark.parametrize(
    "decoding, field",
    [
        (dict(deferred_eos=5), "decoding.deferred_eos"),  # a named special (eos itself)
        (dict(deferred_eos=None), "decoding.deferred_eos"),
        (dict(min_audio_frames=7), "decoding.min_audio_frames"),  # < S-1: drain rows unrecognisable
        (dict(min_audio_frames=-1), "decoding.min_audio_frames"),
    ],
)
def test_bad_decoding_spec_names_the_field(decoding, field):
    d = CFG.to_dict()
    d["decoding"] |= decoding
    with pytest.raises(ValueError, match=field):
        SpeechLMConfig.from_dict(d)


def _rows(n: int) -> RowSampling:
    return RowSampling.from_values([SpeechSamplingParams().resolve(CFG).row_values()] * n, "cpu")


def test_auto_mode_follows_the_phase_not_the_argmax():
    raw = torch.zeros(2, CFG.vocab_size)
    raw[:, CFG.text_range[0]] = 10.0  # a text argmax on an audio row must not make it a text row
    kinds = RULES.row_kinds(
        torch.tensor([P.AUDIO, P.TEXT]), torch.tensor([M.AUTO, M.AUTO]), torch.zeros(2, dtype=torch.long),
        torch.tensor([20, 3]), _rows(2),
    )
    assert kinds.tolist() == [K.AUDIO, K.TEXT]


def test_min_length_masks_eos_on_early_audio_rows():
    step = torch.tensor([0, DEC.min_audio_frames - 1, DEC.min_audio_frames])
    kinds = RULES.row_kinds(
        torch.full((3,), int(P.AUDIO)), torch.full((3,), int(M.AUDIO)), torch.zeros(3, dtype=torch.long), step, _rows(3),
    )
    assert kinds.tolist() == [K.AUDIO_NO_EOS, K.AUDIO_NO_EOS, K.AUDIO]
    eos_bias = RULES.mask_bias[kinds, SP.eos]
    assert eos_bias.tolist() == [float("-inf"), float("-inf"), 0.0]
    ssl = CFG.streams[0]
    assert bool((RULES.mask_bias[K.AUDIO_NO_EOS, ssl.vocab_start : ssl.vocab_end] == 0).all())


def _walk_clip(T: int, drain_token: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """A clip of T frames through the phase machine (stream 0 samples a code, eos at step T, then
    `drain_token` on the first drain row): (emitted stream 0, kept and fed aux masks per row)."""
    phase, step = torch.tensor([int(P.AUDIO)]), torch.tensor([0])
    mode, segment = torch.tensor([int(M.AUDIO)]), torch.zeros(1, dtype=torch.long)
    stream0, kept, fed = [], [], []
    for a in range(T + S + 1):
        kind = RULES.row_kinds(phase, mode, segment, step, _rows(1))
        kept.append(RULES.aux_kept(kind, step)[0])
        fed.append(RULES.aux_sampled(kind, step)[0])
        sampled = CFG.streams[0].vocab_start + 7 if a < T else SP.eos if a == T else drain_token
        allowed = RULES.mask_bias[kind[0]] == 0
        token = sampled if bool(allowed[sampled]) else int(allowed.nonzero()[0])  # forced rows
        token = RULES.emitted_token(phase, step, mode, segment, torch.tensor([token]))
        stream0.append(int(token))
        phase, step, segment, ended = RULES.step(phase, step, mode, segment, token, _rows(1))
        assert not bool(ended) or a == T  # delay rules: every row is fed back as sampled
    assert int(phase) == P.DONE
    return stream0, torch.stack(kept), torch.stack(fed)


@pytest.mark.parametrize("drain_token", [CFG.streams[0].vocab_start + 3, SP.eos, SP.audio])
def test_drain_is_espnets_and_emits_exactly_the_delay_pattern_frames(drain_token):
    """ESPnet's drain (ar_delay.py): the row after eos is sampled whole (stream 0 with the audio
    mask, eos included: emitted deferred), drain row d >= 2 samples streams >= d, row S ends the
    request. Emitted aux cells are exactly the delay pattern's (stream s carries frame t at audio
    step t + s); fed-back ones also hold the cells past the end (stream d of drain row d)."""
    T = 15
    stream0, kept, fed = _walk_clip(T, drain_token)
    first = DEC.deferred_eos if drain_token == SP.eos else drain_token
    assert stream0 == [CFG.streams[0].vocab_start + 7] * T + [DEC.deferred_eos, first] + [SP.pad] * (S - 2) + [SP.eos]
    expected = torch.zeros(T + S + 1, S - 1, dtype=torch.bool)
    for s in range(1, S):
        expected[s : s + T, s - 1] = True
    assert torch.equal(kept, expected)
    past_end = torch.zeros_like(expected)
    for s in range(1, S):
        past_end[T + s, s - 1] = True  # frame T: drain row d = s
    assert torch.equal(fed, expected | past_end)


def test_text_part_before_audio_ends_with_eos_and_a_text_drain():
    """text+audio: the text's eos is deferred, S drain rows follow (the first sampled as text,
    the rest all pad), then <|assistant|> and <|audio|> are forced (ESPnet's next prefill)."""
    mode, segment = torch.tensor([int(M.TEXT_AUDIO)]), torch.zeros(1, dtype=torch.long)
    phase, step = torch.tensor([int(P.TEXT)]), torch.tensor([3])
    kinds, emitted = [], []
    for sampled in [SP.eos, CFG.text_range[0]] + [CFG.text_range[0]] * (S - 1) + [SP.assistant, SP.audio]:
        kind = RULES.row_kinds(phase, mode, segment, step, _rows(1))
        allowed = RULES.mask_bias[kind[0]] == 0
        token = sampled if bool(allowed[sampled]) else int(allowed.nonzero()[0])
        token = RULES.emitted_token(phase, step, mode, segment, torch.tensor([token]))
        kinds.append(int(kind))
        emitted.append(int(token))
        assert not RULES.aux_sampled(kind, step).any()
        phase, step, segment, _ = RULES.step(phase, step, mode, segment, token, _rows(1))
    assert kinds == [K.TEXT, K.TEXT] + [K.FORCE_BLANK] * (S - 1) + [K.FORCE_ASSISTANT, K.FORCE_AUDIO]
    assert emitted == [DEC.deferred_eos, CFG.text_range[0]] + [SP.pad] * (S - 1) + [SP.assistant, SP.audio]
    assert int(phase) == P.AUDIO and int(segment) == 1


def test_masks_are_espnets():
    """inference_utils.build_mask: stream 0 may emit its segment's marker (and eos once allowed),
    text rows never eot; streams 1..S-1 sample pad as one more column."""
    bias = RULES.mask_bias
    ok = lambda kind, tok: bool(bias[kind, tok] == 0)  # noqa: E731
    assert ok(K.AUDIO_NO_EOS, SP.audio) and not ok(K.AUDIO_NO_EOS, SP.eos) and ok(K.AUDIO, SP.eos)
    assert ok(K.TEXT_NO_END, SP.text) and ok(K.TEXT, SP.eos) and not ok(K.TEXT, SP.eot)
    assert not ok(K.AUDIO, SP.text) and not ok(K.TEXT, SP.audio)
    assert CFG.aux_sample_width == CFG.aux_stream_width + 1
    slots = torch.tensor([[0, CFG.aux_stream_width] + [1] * (S - 3)])
    start = torch.tensor([s.vocab_start for s in CFG.streams[1:]])
    assert RULES.aux_token_ids(slots, start)[0, :2].tolist() == [CFG.streams[1].vocab_start, SP.pad]


def test_audio_rows_of_a_drained_answer_deinterleave_to_t_frames():
    T = 13
    codes = torch.randint(0, 1024, (T, S))
    codes[:, 0] = torch.randint(0, 5000, (T,))
    offsets = torch.tensor([s.code_offset for s in CFG.streams])
    rows = interleave(codes + offsets, pad=SP.pad)  # [T + S - 1, S]
    rows[T, 0], rows[T + 1, 0], rows[T + 2 :, 0] = DEC.deferred_eos, CFG.streams[0].vocab_start + 9, SP.pad  # as emitted
    text = torch.zeros(3, S, dtype=torch.long)
    text[:, 0] = torch.tensor([SP.audio, CFG.text_range[0], SP.text])
    tail = torch.zeros(2, S, dtype=torch.long)
    tail[1, 0] = SP.eos  # the all-pad last drain row, then the final eos
    tokens = torch.cat([text, rows, tail])
    assert audio_rows(tokens, CFG).tolist() == [False] * 3 + [True] * (T + S - 1) + [False] * 2
    [segment] = audio_segments(tokens, CFG)  # one segment: the drain rows are its own
    assert torch.equal(segment, codes[:, 1:])


def test_bagpiper_keeps_its_behaviour():
    """Bagpiper has no warm-up, family minimum or drain: its audio eos ends an audio-only answer."""
    from vllm_omni_speechlm.config import BAGPIPER_DEFERRED_EOS, bagpiper_layout

    cfg = bagpiper_layout(text_vocab_size=300)
    assert cfg.decoding == DecodingSpec(deferred_eos=BAGPIPER_DEFERRED_EOS)
    rules = DecodingRules(cfg)
    kind = torch.tensor([K.AUDIO])
    assert bool(rules.aux_sampled(kind, torch.tensor([0])).all())
    mode, segment = torch.tensor([int(M.AUDIO)]), torch.zeros(1, dtype=torch.long)
    eos = rules.emitted_token(torch.tensor([P.AUDIO]), torch.tensor([5]), mode, segment, torch.tensor([cfg.specials.eos]))
    assert int(eos) == cfg.specials.eos
    rows = RowSampling.from_values([SpeechSamplingParams().resolve(cfg).row_values()], "cpu")
    assert rules.replay([cfg.specials.audio, cfg.codec_start + 1, cfg.specials.eos], M.AUDIO, rows)[0] == P.DONE
