import dataclasses

import pytest

from vllm_omni_speechlm.config import SpeechLMConfig, bagpiper_layout


def test_bagpiper_layout_matches_the_released_model():
    cfg = bagpiper_layout()
    assert cfg.vocab_size == 160392
    assert (cfg.text_range, cfg.codec_start, cfg.num_streams) == ((256, 152192), 152192, 8)
    s3 = cfg.streams[3]
    assert (s3.pad_id, s3.code_offset, s3.codebook_size) == (152192 + 3 * 1025, 152192 + 3 * 1025 + 1, 1024)
    assert cfg.aux_stream_width == 1025
    assert (cfg.specials.eos, cfg.specials.eot, cfg.specials.audio) == (2, 3, 8)


def test_round_trip_through_dict_and_model_dir(tiny_bagpiper):
    cfg = SpeechLMConfig.from_model_dir(tiny_bagpiper)
    assert SpeechLMConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.codec.hop_length == 320 and cfg.codec.sample_rate == 16000


def _broken(**changes) -> dict:
    d = bagpiper_layout(text_vocab_size=1000).to_dict()
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            d[section][field] = value
        else:
            d[section] = value
    return d


@pytest.mark.parametrize(
    "changes, field",
    [
        (dict(text_range=[256, 1300]), "codec range"),  # text runs into the codec streams
        (dict(special_range=[0, 300]), "text_range"),  # specials overlap text
        (dict(stream_sizes=[1025] * 7 + [1024]), "stream_sizes"),  # aux streams of unequal width
        (dict(stream_sizes=[]), "stream_sizes"),
        (dict(codec__num_quantizers=9), "codec.num_quantizers"),  # more quantizers than streams
        (dict(codec__codebook_size=2048), "codec.codebook_size"),
        (dict(specials__eos=9999), "specials.eos"),  # outside the specials (and the vocab)
        (dict(specials__audio=-1), "specials.audio"),
        (dict(vocab_size=100), "special_range"),  # ranges beyond the vocabulary
        (dict(text_sampling={"temperature": -1, "top_k": 20}), "text_sampling.temperature"),
        (dict(colour="blue"), "colour"),
    ],
)
def test_inconsistent_layouts_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        SpeechLMConfig.from_dict(_broken(**changes))


def test_vocab_size_must_match_the_model():
    d = bagpiper_layout().to_dict()
    with pytest.raises(ValueError, match="vocab_size"):
        SpeechLMConfig.from_dict(d, vocab_size=d["vocab_size"] + 1)


def test_missing_special_is_an_error():
    d = bagpiper_layout().to_dict()
    del d["specials"]["eot"]
    with pytest.raises(ValueError, match="eot"):
        SpeechLMConfig.from_dict(d)


def test_config_is_immutable():
    with pytest.raises(dataclasses.FrozenInstanceError):
        bagpiper_layout().vocab_size = 3
