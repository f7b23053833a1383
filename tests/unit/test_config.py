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
        (dict(audio_input__placeholder_id=8), "audio_input.placeholder_id"),  # <|audio|> itself
        (dict(audio_input__placeholder_id=255), "audio_input.placeholder_id"),  # the deferred eos
        (dict(audio_input__hop_length=0), "audio_input.hop_length"),
        (dict(audio_input__tower={"d_model": 16, "encoder_attention_heads": 3}), "audio_input.tower.encoder_attention_heads"),
        (dict(audio_input__tower={"n_window_infer": 150}), "audio_input.tower.n_window_infer"),
        (dict(audio_input__tower={"colour": 1}), "colour"),
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


def test_audio_input_section():
    """The released layout records the Qwen3-Omni feature extractor and tower; an OpusLM one none."""
    from vllm_omni_speechlm.config import opuslm_layout

    spec = bagpiper_layout().audio_input
    assert (spec.sample_rate, spec.n_fft, spec.hop_length, spec.max_samples) == (16000, 400, 160, 4_800_000)
    assert (spec.tower.d_model, spec.tower.output_dim, spec.tower.num_mel_bins, spec.placeholder_id) == (1280, 2048, 128, 254)
    assert opuslm_layout().audio_input is None


def test_encoder_output_length_is_qwen3_omnis():
    """Rows per clip: transformers' (and ESPnet's) Qwen3-Omni formula, for every mel length up to 4 chunks."""
    import torch
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

    spec = bagpiper_layout().audio_input
    frames = torch.arange(1, 401)
    assert [spec.output_length(int(n)) for n in frames] == _get_feat_extract_output_lengths(frames).tolist()
    assert spec.num_frames(16000) == 100 and spec.output_length(100) == 13
