"""The decoder-only DAC: bit-exact against transformers' `DacModel.decode`, loads real-format
checkpoints (weight norm folded, extra quantizers and the encoder skipped), window decoding
matches whole-clip decoding with the streaming processor's context and holdback."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_omni_speechlm.codec.dac import TINY_DAC_CONFIG, DacDecoder, DacDecoderConfig, write_tiny_dac


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("tiny-dac"))
    write_tiny_dac(out, seed=0)
    return out


def _transformers_dac(tiny_dir: str):
    from transformers import DacConfig, DacModel

    kwargs = {k: v for k, v in TINY_DAC_CONFIG.items() if k not in ("model_type", "architectures")}
    model = DacModel(DacConfig(**kwargs)).eval()
    missing, unexpected = model.load_state_dict(load_file(os.path.join(tiny_dir, "model.safetensors")), strict=False)
    assert not unexpected and all(k.startswith("encoder.") or ".in_proj." in k for k in missing)
    return model


@torch.no_grad()
def test_bit_exact_against_transformers(tiny_dir):
    ours, theirs = DacDecoder.from_pretrained(tiny_dir), _transformers_dac(tiny_dir)
    codes = torch.randint(0, 1024, (2, 8, 37), generator=torch.Generator().manual_seed(0))
    a, b = ours(codes), theirs.decode(audio_codes=codes).audio_values
    assert a.shape == b.shape == (2, ours.config.num_samples(37)) == (2, 37 * 320 - 8)
    assert torch.equal(a, b)
    assert 0.05 < float(a.abs().mean()) < 0.9  # not silent, not saturated


@torch.no_grad()
def test_real_checkpoint_format_loads(tiny_dir, tmp_path):
    """A 12-codebook DacModel checkpoint with weight-normalised convolutions (descript/dac_16khz's
    shape): the first 8 quantizers are used, weight norm folds to the same decoder."""
    theirs = _transformers_dac(tiny_dir)
    config = TINY_DAC_CONFIG | {"n_codebooks": 12}
    state = load_file(os.path.join(tiny_dir, "model.safetensors"))
    for q in range(8, 12):
        state[f"quantizer.quantizers.{q}.codebook.weight"] = torch.randn(1024, 8)
        state[f"quantizer.quantizers.{q}.out_proj.weight"] = torch.randn(32, 8, 1)
        state[f"quantizer.quantizers.{q}.out_proj.bias"] = torch.randn(32)
    w = state.pop("decoder.conv1.weight")
    g = w.norm(dim=(1, 2), keepdim=True)
    state["decoder.conv1.parametrizations.weight.original0"] = g
    state["decoder.conv1.parametrizations.weight.original1"] = w / g * 3.0
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(config))
    ours = DacDecoder.from_pretrained(tmp_path, num_quantizers=8)
    codes = torch.randint(0, 1024, (1, 8, 20))
    # Folding rounds (g * v / ||v|| is not bit-exact w); a wrong fold gives errors of order 0.1-1.
    torch.testing.assert_close(ours(codes), theirs.decode(audio_codes=codes).audio_values, atol=1e-3, rtol=0)


def test_bad_codes_are_rejected(tiny_dir):
    ours = DacDecoder.from_pretrained(tiny_dir)
    for codes in (torch.zeros(1, 7, 5, dtype=torch.long), torch.full((1, 8, 5), 1024), torch.zeros(1, 8, 5)):
        with pytest.raises(ValueError, match="dac decode"):
            ours(codes)


@torch.no_grad()
def test_windows_with_10_frames_of_context_and_holdback_equal_the_whole_clip(tiny_dir):
    dac = DacDecoder.from_pretrained(tiny_dir).to(torch.float64)
    hop, t = dac.config.hop_length, 80
    codes = torch.randint(0, 1024, (1, 8, t))
    whole = dac(codes)[0]
    start, end = 30, 45  # keep frames [30, 45) of a window [20, 55)
    window = dac(codes[:, :, start - 10 : end + 10])[0]
    kept = window[10 * hop : (10 + end - start) * hop]
    torch.testing.assert_close(kept, whole[start * hop : end * hop], atol=1e-9, rtol=0)
    window9 = dac(codes[:, :, start - 9 : end + 9])[0][9 * hop : (9 + end - start) * hop]
    assert not torch.allclose(window9, whole[start * hop : end * hop], atol=1e-9, rtol=0)


def test_config_from_dac_fields():
    c = DacDecoderConfig.from_dac_dict({"encoder_hidden_size": 64, "downsampling_ratios": [2, 4, 5, 8],
                                        "decoder_hidden_size": 1536, "n_codebooks": 12}, num_quantizers=8)
    assert (c.hidden_size, c.upsampling_ratios, c.hop_length, c.num_quantizers) == (1024, (8, 5, 4, 2), 320, 8)
    with pytest.raises(ValueError, match="num_quantizers"):
        DacDecoderConfig.from_dac_dict({"n_codebooks": 4}, num_quantizers=8)
