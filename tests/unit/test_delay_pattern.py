import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from vllm_omni_speechlm.config import bagpiper_layout
from vllm_omni_speechlm.delay_pattern import CodebookMap, audio_segments, deinterleave, interleave, num_complete_frames

shapes = st.tuples(st.integers(0, 2), st.integers(1, 40), st.integers(1, 10))  # batch, T, S


def _codes(batch: int, frames: int, streams: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (frames, streams) if batch == 0 else (batch, frames, streams)
    return torch.randint(1, 1000, shape, generator=g)


@settings(max_examples=200, deadline=None)
@given(shapes, st.integers(0, 2**31))
def test_round_trip_any_shape(shape, seed):
    aligned = _codes(*shape, seed)
    rows = interleave(aligned, pad=-7)
    assert rows.shape[-2:] == (shape[1] + shape[2] - 1, shape[2])
    assert torch.equal(deinterleave(rows), aligned)


@settings(max_examples=100, deadline=None)
@given(shapes, st.integers(0, 2**31))
def test_padding_placement_and_delay(shape, seed):
    _, frames, streams = shape
    aligned = _codes(0, frames, streams, seed)
    pad = torch.arange(streams) * -1 - 1  # a distinct pad per stream
    rows = interleave(aligned, pad)
    for s in range(streams):
        assert torch.equal(rows[s : s + frames, s], aligned[:, s])  # stream s delayed by s rows
        assert (rows[:s, s] == pad[s]).all() and (rows[s + frames :, s] == pad[s]).all()


def test_needs_enough_rows():
    with pytest.raises(ValueError, match="rows"):
        deinterleave(torch.zeros(6, 8, dtype=torch.long))
    with pytest.raises(ValueError, match="T >= 1"):
        interleave(torch.zeros(0, 8, dtype=torch.long), 0)
    assert [num_complete_frames(n, 8) for n in (0, 7, 8, 20)] == [0, 0, 1, 13]


def test_codebook_map_round_trip_and_pad_clamp():
    cfg = bagpiper_layout()
    cmap = CodebookMap(cfg)
    codes = torch.randint(0, 1024, (5, 8))
    tokens = cmap.to_tokens(codes)
    assert torch.equal(tokens[:, 2] - codes[:, 2], torch.full((5,), 152192 + 2 * 1025 + 1))
    assert torch.equal(cmap.to_codes(tokens), codes)
    pads = torch.tensor([s.pad_id for s in cfg.streams])
    assert (cmap.to_codes(pads) == 0).all()  # the pad slot decodes as code 0
    with pytest.raises(ValueError, match="codebook"):
        cmap.to_tokens(codes + 1024)


def test_audio_segments_are_deinterleaved_one_by_one():
    """Audio, eot, <|assistant|>, <|audio|>, audio, eot, <|assistant|>, <|audio|>, a run shorter
    than S, eos: each segment's own frames (ESPnet decodes segments one by one); the short run has
    none. Frames of one matrix over all audio rows would mix the segments' edges."""
    cfg = bagpiper_layout()
    sp, s = cfg.specials, cfg.num_streams
    cmap = CodebookMap(cfg)
    first, second = torch.randint(0, 1024, (9, s)), torch.randint(0, 1024, (4, s))

    def segment(codes: torch.Tensor) -> torch.Tensor:
        rows = interleave(cmap.to_tokens(codes), pad=torch.tensor([st.pad_id for st in cfg.streams]))
        rows[len(codes) :, 0] = cmap.to_tokens(codes)[0, 0]  # stream 0 past the clip: sampled codes too
        return rows

    def special(*ids: int) -> torch.Tensor:
        rows = torch.zeros(len(ids), s, dtype=torch.long)
        rows[:, 0] = torch.tensor(ids)
        return rows

    short = segment(torch.randint(0, 1024, (1, s)))[: s - 1]
    tokens = torch.cat([special(sp.audio), segment(first), special(sp.eot, sp.assistant, sp.audio), segment(second),
                        special(sp.eot, sp.assistant, sp.audio), short, special(sp.eos)])
    got = audio_segments(tokens, cfg)
    assert len(got) == 2
    assert torch.equal(got[0], first[:, -cfg.codec.num_quantizers :])
    assert torch.equal(got[1], second[:, -cfg.codec.num_quantizers :])
    assert audio_segments(special(sp.text, cfg.text_range[0], sp.eos), cfg) == []


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 40), st.integers(0, 2**31), st.sampled_from(["bagpiper", "opuslm"]))
def test_host_segment_codes_cut_what_segment_codes_cut(frames, seed, family):
    """The chunk processor's numpy cut of a window equals the torch one, pad slots included."""
    from vllm_omni_speechlm.config import opuslm_layout
    from vllm_omni_speechlm.delay_pattern import audio_rows, host_segment_codes, segment_codes

    cfg = bagpiper_layout() if family == "bagpiper" else opuslm_layout()
    cmap = CodebookMap(cfg)
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1024, (frames, cfg.num_streams), generator=g)
    rows = interleave(cmap.to_tokens(codes), pad=torch.tensor([s.pad_id for s in cfg.streams]))
    host = rows.numpy()
    assert torch.equal(torch.from_numpy(host_segment_codes(host, cfg)), segment_codes(rows, cfg))
    assert (audio_rows(host, cfg) == audio_rows(rows, cfg).numpy()).all()
    assert host_segment_codes(host[: cfg.num_streams - 1], cfg) is None
