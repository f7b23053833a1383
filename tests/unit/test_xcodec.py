"""X-Codec decoder: equality with transformers' XcodecModel.decode, shapes, batching, the tiny
checkpoint writer, input validation, config validation and the receptive field."""

from __future__ import annotations

import json
import math
import os
import shutil

os.environ["HF_HUB_OFFLINE"] = "1"  # no hub access anywhere
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from vllm_omni_speechlm.codec import XCodecDecoder, XCodecDecoderConfig, write_tiny_xcodec  # noqa: E402
from vllm_omni_speechlm.codec.xcodec import (  # noqa: E402
    TINY_CONFIG,
    measure_receptive_field,
    random_decoder_state,
)

HOP = 320
Q = 8
K = 1024


def _codes(batch: int, frames: int, seed: int = 0) -> torch.Tensor:
    """Random codes [batch, Q, frames]."""
    return torch.randint(0, K, (batch, Q, frames), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny_xcodec")
    write_tiny_xcodec(path, seed=0)
    return str(path)


@pytest.fixture(scope="module")
def tiny(tiny_dir) -> XCodecDecoder:
    return XCodecDecoder.from_pretrained(tiny_dir)


def _assert_close_audio(actual: torch.Tensor, expected: torch.Tensor) -> None:
    # float32 on the same CPU kernels: agreement is to rounding (in practice bit-exact).
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6 * max(scale, 1.0))


# ---------------------------------------------------------------------------------------------
# (1) oracle: transformers' XcodecModel
# ---------------------------------------------------------------------------------------------


def _randomize_decoder_side(model: torch.nn.Module, seed: int) -> None:
    """Random values for every tensor XcodecModel.decode reads (its init zeroes the codebooks),
    including weight-norm halves when a parametrization is applied."""
    gen = torch.Generator().manual_seed(seed)
    tensors = dict(model.named_parameters())
    tensors.update({n: b for n, b in model.named_buffers() if n.endswith(".codebook.embed")})
    with torch.no_grad():
        for name in sorted(tensors):
            if not name.startswith(("fc2.", "acoustic_decoder.", "quantizer.")):
                continue
            t = tensors[name]
            if name.endswith(".alpha") or name.endswith(".original0"):  # snake alpha, weight-norm g
                t.copy_(0.5 + torch.rand(t.shape, generator=gen))
            elif name.endswith(".embed"):
                t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(Q))
            elif name.endswith(".bias"):
                t.copy_(0.1 * torch.randn(t.shape, generator=gen))
            else:  # plain weights and weight-norm v
                fan = t.shape[1] * (t.shape[2] if t.dim() == 3 else 1)
                t.copy_(torch.randn(t.shape, generator=gen) / math.sqrt(fan))


def _xcodec_model(config_dir: str):
    from transformers import XcodecConfig, XcodecModel

    return XcodecModel(XcodecConfig.from_pretrained(config_dir)).eval()


def test_oracle_tiny_checkpoint_loads_into_xcodec_model(tiny_dir, tiny):
    from transformers import XcodecModel

    ref, info = XcodecModel.from_pretrained(tiny_dir, output_loading_info=True)
    ref.eval()
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    ours = set(tiny.state_dict())
    assert not ours & set(info["missing_keys"]), "a decoder tensor did not load into XcodecModel"
    assert ref.config.num_quantizers == Q and ref.config.hop_length == HOP

    codes = _codes(2, 9, seed=1)
    with torch.no_grad():
        expected = ref.decode(codes).audio_values  # [B, 1, N]
        actual = tiny(codes)
    assert expected.shape == (2, 1, 9 * HOP)
    _assert_close_audio(actual, expected[:, 0])


@pytest.mark.parametrize("weight_norm", ["none", "parametrized", "weight_g_v"])
def test_oracle_xcodec_model_checkpoint_loads_into_ours(tiny_dir, tmp_path, weight_norm):
    """A full XcodecModel checkpoint (encoder, HuBERT, fc, fc1, codebook statistics...) as
    save_pretrained writes it, with weight norm removed (hub format), as torch parametrizations,
    or in the original weight_g / weight_v naming."""
    ref = _xcodec_model(tiny_dir)
    if weight_norm != "none":
        ref.apply_weight_norm()
    _randomize_decoder_side(ref, seed=7)
    ref.save_pretrained(tmp_path)

    with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "encoder_semantic.conv.weight" in keys and "acoustic_encoder.conv1.bias" in keys
    wn_key = "acoustic_decoder.block.1.conv_t1.parametrizations.weight.original1"
    assert (wn_key in keys) == (weight_norm != "none")

    if weight_norm == "weight_g_v":
        legacy = {}
        with safe_open(os.path.join(tmp_path, "model.safetensors"), "pt") as f:
            for key in f.keys():
                new = key.replace(".parametrizations.weight.original0", ".weight_g")
                legacy[new.replace(".parametrizations.weight.original1", ".weight_v")] = f.get_tensor(key)
        assert "acoustic_decoder.conv1.weight_g" in legacy
        save_file(legacy, os.path.join(tmp_path, "model.safetensors"))

    ours = XCodecDecoder.from_pretrained(tmp_path)
    codes = _codes(3, 6, seed=2)
    with torch.no_grad():
        expected = ref.decode(codes).audio_values[:, 0]
        actual = ours(codes)
    assert expected.abs().max() > 0
    _assert_close_audio(actual, expected)


def test_from_pretrained_dtype_and_missing_tensor(tiny_dir, tmp_path):
    model = XCodecDecoder.from_pretrained(tiny_dir, dtype=torch.bfloat16)
    assert all(t.dtype == torch.bfloat16 for t in model.state_dict().values())
    assert model(_codes(1, 2)).dtype == torch.bfloat16
    assert not any(p.requires_grad for p in model.parameters())

    shutil.copy(os.path.join(tiny_dir, "config.json"), tmp_path)
    with safe_open(os.path.join(tiny_dir, "model.safetensors"), "pt") as f:
        state = {k: f.get_tensor(k) for k in f.keys() if k != "fc2.bias"}
    save_file(state, os.path.join(tmp_path, "model.safetensors"))
    with pytest.raises(ValueError, match="fc2.bias"):
        XCodecDecoder.from_pretrained(tmp_path)


# ---------------------------------------------------------------------------------------------
# (2) lengths, (3) batching
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("frames", [1, 2, 3, 7, 25])
def test_output_length(tiny, frames):
    assert tiny.hop_length == HOP and tiny.sample_rate == 16000
    with torch.no_grad():
        audio = tiny(_codes(2, frames, seed=frames))
    assert audio.shape == (2, frames * HOP)
    assert audio.dtype == torch.float32 and torch.isfinite(audio).all()


def test_batched_equals_per_item(tiny_dir):
    codes = _codes(4, 11, seed=3)
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-4)):
        # float32 conv kernels block the batch differently, so rows differ from single-item
        # decoding by rounding (about 2e-5 of full scale on the tiny codec); float64 shows it is
        # only rounding.
        model = XCodecDecoder.from_pretrained(tiny_dir, dtype=dtype)
        with torch.no_grad():
            batched = model(codes)
            single = torch.cat([model(codes[i : i + 1]) for i in range(codes.shape[0])])
        scale = single.abs().max().item()
        torch.testing.assert_close(batched, single, rtol=0, atol=tol * scale)
        assert not torch.allclose(batched[0], batched[1])


# ---------------------------------------------------------------------------------------------
# (4) tiny checkpoint determinism
# ---------------------------------------------------------------------------------------------


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def test_write_tiny_is_deterministic_per_seed(tmp_path):
    a, b, c = (str(tmp_path / n) for n in ("a", "b", "c"))
    write_tiny_xcodec(a, seed=5)
    write_tiny_xcodec(b, seed=5)
    write_tiny_xcodec(c, seed=6)
    for name in ("config.json", "model.safetensors"):
        assert _read(os.path.join(a, name)) == _read(os.path.join(b, name))
    assert _read(os.path.join(a, "config.json")) == _read(os.path.join(c, "config.json"))
    assert _read(os.path.join(a, "model.safetensors")) != _read(os.path.join(c, "model.safetensors"))

    codes = _codes(1, 4)
    with torch.no_grad():
        audio_a = XCodecDecoder.from_pretrained(a)(codes)
        audio_b = XCodecDecoder.from_pretrained(b)(codes)
        audio_c = XCodecDecoder.from_pretrained(c)(codes)
    assert torch.equal(audio_a, audio_b)
    assert not torch.allclose(audio_a, audio_c)


def test_tiny_config_is_xcodec_format(tiny_dir):
    with open(os.path.join(tiny_dir, "config.json")) as f:
        raw = json.load(f)
    assert raw["model_type"] == "xcodec" and raw["acoustic_model_config"]["model_type"] == "dac"
    config = XCodecDecoderConfig.from_dict(raw)
    assert config == TINY_CONFIG
    assert (config.sample_rate, config.hop_length, config.num_quantizers, config.codebook_size) == (16000, HOP, Q, K)


# ---------------------------------------------------------------------------------------------
# (5) bad codes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "codes, match",
    [
        (torch.zeros(Q, 5, dtype=torch.long), "shape"),  # missing batch dim
        (torch.zeros(1, 1, Q, 5, dtype=torch.long), "shape"),
        (torch.zeros(1, Q - 1, 5, dtype=torch.long), "quantizers"),
        (torch.zeros(1, 5, Q + 1, dtype=torch.long), "quantizers"),  # [B, T, Q] transposed
        (torch.zeros(1, Q, 0, dtype=torch.long), "frames >= 1"),
        (torch.full((1, Q, 3), K, dtype=torch.long), r"\[0, 1024\)"),
        (torch.full((1, Q, 3), -1, dtype=torch.long), r"\[0, 1024\)"),
        (torch.zeros(1, Q, 3), "integer"),
    ],
)
def test_bad_codes_raise(tiny, codes, match):
    with pytest.raises(ValueError, match=match):
        tiny(codes)


# ---------------------------------------------------------------------------------------------
# config validation and serialisation
# ---------------------------------------------------------------------------------------------


def test_real_geometry_defaults():
    config = XCodecDecoderConfig()
    assert (config.hop_length, config.num_quantizers, config.codebook_dim, config.frame_rate) == (320, 8, 1024, 50)
    assert XCodecDecoderConfig.from_dict(config.to_dict()) == config
    assert XCodecDecoderConfig.from_dict(config.to_xcodec_dict()) == config
    # An XcodecConfig config.json that leaves the acoustic config to XcodecConfig's defaults.
    assert XCodecDecoderConfig.from_dict({"model_type": "xcodec"}) == config
    # hop 160 -> 100 frames/s -> XcodecConfig derives 4 quantizers from the same bandwidths.
    half_hop = XCodecDecoderConfig(upsampling_ratios=(8, 5, 4))
    assert (half_hop.hop_length, half_hop.num_quantizers) == (160, 4)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"hop_length": 640}, "hop_length"),
        ({"upsampling_ratios": (8, 5, 4), "num_quantizers": 8}, "num_quantizers"),
        ({"codebook_dim": 512}, "codebook_dim"),
        ({"num_quantizers": 9}, "num_quantizers"),
        ({"upsampling_ratios": ()}, "upsampling_ratios"),
        ({"decoder_hidden_size": 8}, "decoder_hidden_size"),
        ({"codebook_size": 0}, "codebook_size"),
    ],
)
def test_config_validation_names_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        XCodecDecoderConfig(**kwargs)


def test_config_from_dict_rejects_unknown_and_mismatched_ratios():
    with pytest.raises(ValueError, match="hop_lenght"):
        XCodecDecoderConfig.from_dict({"hop_lenght": 320})
    bad = XCodecDecoderConfig().to_xcodec_dict()
    bad["acoustic_model_config"]["upsampling_ratios"] = [8, 5, 4, 4]  # decoder hop 640 != 320
    with pytest.raises(ValueError, match="hop_length"):
        XCodecDecoderConfig.from_dict(bad)


# ---------------------------------------------------------------------------------------------
# receptive field
# ---------------------------------------------------------------------------------------------


def test_receptive_field_tiny_matches_geometry(tiny):
    assert measure_receptive_field(tiny) == TINY_CONFIG.receptive_field_samples == (-3141, 3452)
    assert TINY_CONFIG.receptive_field_frames == (10, 10)


def test_receptive_field_real_geometry():
    config = XCodecDecoderConfig()
    with torch.device("meta"):
        model = XCodecDecoder(config)
    model.load_state_dict(random_decoder_state(config, seed=0), assign=True)
    assert measure_receptive_field(model, num_frames=24) == config.receptive_field_samples == (-3141, 3452)
    assert config.receptive_field_frames == (10, 10)


def test_streaming_window_with_context_matches_whole_clip(tiny):
    """Frames [s, e) decoded in a window with 10 frames of context each side equal whole-clip
    decoding; with 9 on either side they do not."""
    model = XCodecDecoder(TINY_CONFIG)
    model.load_state_dict(tiny.state_dict())
    model = model.double()
    left, right = TINY_CONFIG.receptive_field_frames
    codes = _codes(1, 40, seed=4)
    s, e = 20, 24
    with torch.no_grad():
        whole = model(codes)[:, s * HOP : e * HOP]

        def window(lc: int, rc: int) -> torch.Tensor:
            out = model(codes[:, :, s - lc : e + rc])
            return out[:, lc * HOP : (lc + e - s) * HOP]

        torch.testing.assert_close(window(left, right), whole, rtol=0, atol=1e-9)
        assert (window(left - 1, right) - whole).abs().max() > 1e-3
        assert (window(left, right - 1) - whole).abs().max() > 1e-3
        # Clip edges need no context: whole-clip decoding zero-pads there as a window does.
        torch.testing.assert_close(model(codes[:, :, : e + right])[:, : e * HOP], model(codes)[:, : e * HOP],
                                   rtol=0, atol=1e-9)
