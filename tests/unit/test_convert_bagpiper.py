"""`speechlm-convert --family bagpiper` on the tiny ESPnet export `speechlm-make-tiny --espnet-export`
writes (ESPnet's names: vllm_omni_speechlm/espnet_bagpiper.py).

The converted directory must be the tiny Bagpiper the other tests serve, byte for byte; every
export key is mapped or dropped by name, and a bad export fails naming the key.
"""

import hashlib
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer, models

from vllm_omni_speechlm import espnet_bagpiper as eb
from vllm_omni_speechlm.codec.xcodec import TINY_CONFIG
from vllm_omni_speechlm.config import AUDIO_INPUT_PREFIXES, SpeechLMConfig
from vllm_omni_speechlm.convert import convert_bagpiper
from vllm_omni_speechlm.make_tiny import BackboneGeometry, tiny_bagpiper_parts, write_tiny_bagpiper_export
from vllm_omni_speechlm.tokenizer import backbone_text_vocab

SERVED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                "codec/config.json", "codec/model.safetensors")
# Key, shape, dtype of the state dict ESPnet's own code (smellslikeml/espnet@6892551, float32)
# builds for a Bagpiper of the tiny geometry.
ESPNET_KEYS = os.path.join(os.path.dirname(__file__), "..", "data", "espnet", "tiny_bagpiper_keys.txt")


def _bin(name: str) -> str:
    return os.path.join(os.path.dirname(sys.executable), name)


def _run(*args: str) -> subprocess.CompletedProcess:
    env = os.environ | {"PYTHONPATH": os.getcwd()}
    return subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)


def _convert_cli(files: dict, out: str) -> subprocess.CompletedProcess:
    return _run(sys.executable, "-m", "vllm_omni_speechlm.convert", "--family", "bagpiper",
                "--espnet-checkpoint", files["checkpoint"], "--backbone-config", files["backbone_config"],
                "--text-tokenizer", files["text_tokenizer"], "--codec-config", files["codec_config"],
                "--inference-config", files["inference_config"], "--audio-tower-config", files["audio_tower_config"],
                "--out", out)


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> dict:
    return write_tiny_bagpiper_export(tmp_path_factory.mktemp("export"), seed=0)


def _digest(path) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_cli_export_is_deterministic_per_seed(tmp_path, export):
    for seed in (0, 1):
        run = _run(_bin("speechlm-make-tiny"), "--family", "bagpiper", "--espnet-export",
                   "--out", str(tmp_path / str(seed)), "--seed", str(seed))
        assert run.returncode == 0, run.stderr[-2000:]
    names = ["model.pth", "backbone/config.json", "backbone/tokenizer.json", "xcodec/config.json"]
    fixture = os.path.dirname(export["checkpoint"])
    assert [_digest(tmp_path / "0" / n) for n in names] == [_digest(os.path.join(fixture, n)) for n in names]
    assert _digest(tmp_path / "0" / "model.pth") != _digest(tmp_path / "1" / "model.pth")


def test_export_has_espnets_names(export):
    saved = torch.load(export["checkpoint"], weights_only=True)
    assert set(saved) == {"module"}
    state = saved["module"]
    assert {k.split(".")[0] for k in state} == {"model", "lm_head", "stream_emb", "vocab_weight", "adaptor",
                                                 "multimodal_io_dict"}
    for part in ("acoustic_decoder.conv1.weight", "acoustic_encoder.conv1.weight",
                 "semantic_model.feature_projection.projection.weight", "quantizer.quantizers.7.codebook.embed",
                 "quantizer.quantizers.7.codebook.embed_avg"):
        assert eb.CODEC + part in state, part
    assert eb.AUDIO_TOWER + eb.AUDIO_TOWER_OUT in state and eb.ADAPTOR + "weight" in state
    backbone = json.load(open(export["backbone_config"]))
    assert backbone["architectures"] == ["Qwen3ForCausalLM"] and "speechlm" not in backbone


def test_export_is_what_espnet_writes(export):
    """Every key, shape and dtype of the state dict ESPnet's own code builds at the tiny geometry."""
    with open(ESPNET_KEYS) as f:
        espnet = dict((k, (shape, dtype)) for k, shape, dtype in (line.split() for line in f if line.strip()))
    state = torch.load(export["checkpoint"], weights_only=True)["module"]
    ours = {k: (f"[{','.join(map(str, v.shape))}]", str(v.dtype).removeprefix("torch.")) for k, v in state.items()}
    assert sorted(ours) == sorted(espnet)
    assert {k: v for k, v in ours.items() if espnet[k] != v} == {}


def test_converted_export_is_the_tiny_checkpoint(tmp_path, export, tiny_bagpiper):
    out = tmp_path / "converted"
    run = _convert_cli(export, str(out))
    assert run.returncode == 0, run.stderr[-2000:]
    for name in SERVED_FILES:
        assert _digest(out / name) == _digest(os.path.join(tiny_bagpiper, name)), name
    weights = load_file(out / "model.safetensors")
    assert any(k.startswith(AUDIO_INPUT_PREFIXES[0]) for k in weights)
    assert sorted(k for k in weights if k.startswith(AUDIO_INPUT_PREFIXES[1])) == ["audio_adaptor.bias", "audio_adaptor.weight"]
    cfg = SpeechLMConfig.from_model_dir(str(out))
    assert weights["model.embed_tokens.weight"].shape[0] == weights["lm_head.weight"].shape[0] == cfg.vocab_size


def test_tensors_map_one_to_one(export):
    """Each served tensor is its export tensor (the names of espnet_bagpiper's table)."""
    layout, geo, state = tiny_bagpiper_parts(0)
    weights, codec = eb.split_export(state, layout, geo, TINY_CONFIG)
    assert torch.equal(weights["stream_embeddings.weight"], state[eb.STREAM_EMB])
    assert torch.equal(weights["audio_adaptor.weight"], state[eb.ADAPTOR + "weight"])
    assert torch.equal(weights["audio_tower.proj2.weight"], state[eb.AUDIO_TOWER + "proj2.weight"])
    assert torch.equal(weights["model.layers.1.mlp.down_proj.weight"], state["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(codec["acoustic_decoder.conv2.weight"], state[eb.CODEC + "acoustic_decoder.conv2.weight"])
    assert not any(k.startswith(("acoustic_encoder.", "semantic_model.", "fc.", "fc1.")) for k in codec)
    dropped = {k for k in state if k.startswith(eb.CODEC)} - {eb.CODEC + k for k in codec}
    assert len(dropped) == len([k for k in state if k.startswith(eb.CODEC)]) - len(codec)
    assert eb.VOCAB_WEIGHT not in weights


def test_stream_embedding_zero_is_forced(tmp_path, export, reference):
    """ESPnet zeroes stream_emb[0] at use: a non-zero exported row 0 must not change the model."""
    from vllm_omni_speechlm.reference import ReferenceSpeechLM
    from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
    from vllm_omni_speechlm.tokenizer import encode_prompt

    saved = torch.load(export["checkpoint"], weights_only=True)
    saved["module"][eb.STREAM_EMB][0] = 1.0
    files = dict(export, checkpoint=str(tmp_path / "model.pth"))
    torch.save(saved, files["checkpoint"])
    out = str(tmp_path / "converted")
    convert_bagpiper(files["checkpoint"], out, files["text_tokenizer"], files["backbone_config"], files["codec_config"],
                     files["inference_config"], files["audio_tower_config"])
    assert (load_file(os.path.join(out, "model.safetensors"))["stream_embeddings.weight"][0] == 0).all()
    converted = ReferenceSpeechLM(out)
    ids = encode_prompt(reference.tokenizer, reference.cfg, "Say hello.", system="Be brief.")
    for kw in (dict(modality="text+audio", max_text_tokens=4, seed=1), dict(modality="audio", seed=2)):
        params = SpeechSamplingParams(max_tokens=30, **kw)
        a, b = reference.generate(ids, params), converted.generate(ids, params)
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.audio, b.audio)


def _split(state):
    layout, geo, _ = tiny_bagpiper_parts(0)
    return eb.split_export(state, layout, geo, TINY_CONFIG)


def _edited(edit):
    state = dict(tiny_bagpiper_parts(0)[2])
    edit(state)
    return state


BAD_EXPORTS = {
    "unknown-top": (lambda s: s.update({"talker.weight": torch.zeros(1)}), "unexpected key 'talker.weight'"),
    "unknown-layer": (lambda s: s.update({"model.layers.0.mlp.extra.weight": torch.zeros(1)}),
                      "unexpected key 'model.layers.0.mlp.extra.weight'"),
    "extra-layer": (lambda s: s.update({"model.layers.2.mlp.up_proj.weight": torch.zeros(128, 64)}),
                    "unexpected key 'model.layers.2.mlp.up_proj.weight'"),
    "unknown-codec": (lambda s: s.update({eb.CODEC + "vocoder.weight": torch.zeros(1)}),
                      f"unexpected key '{eb.CODEC}vocoder.weight'"),
    "unknown-adaptor": (lambda s: s.update({eb.ADAPTOR + "scale": torch.zeros(1)}), f"unexpected key '{eb.ADAPTOR}scale'"),
    "missing-layer": (lambda s: s.pop("model.layers.1.self_attn.k_norm.weight"),
                      "missing 'model.layers.1.self_attn.k_norm.weight'"),
    "missing-stream-emb": (lambda s: s.pop(eb.STREAM_EMB), "missing 'stream_emb.weight'"),
    "missing-adaptor": (lambda s: s.pop(eb.ADAPTOR + "bias"), f"missing '{eb.ADAPTOR}bias'"),
    "missing-tower": (lambda s: s.pop(eb.AUDIO_TOWER + "proj2.weight"), f"missing '{eb.AUDIO_TOWER}proj2.weight'"),
    "missing-codec": (lambda s: s.pop(eb.CODEC + "acoustic_decoder.conv2.weight"),
                      f"missing '{eb.CODEC}acoustic_decoder.conv2.weight'"),
    "shape-lm-head": (lambda s: s.update({"lm_head.weight": s["lm_head.weight"][:-1]}), "lm_head.weight has shape"),
    "shape-vocab-weight": (lambda s: s.update({eb.VOCAB_WEIGHT: torch.ones(3)}), "vocab_weight has shape"),
    "shape-adaptor": (lambda s: s.update({eb.ADAPTOR + "weight": torch.zeros(64, 47)}), "adaptor.continuous_audio.weight"),
    "shape-codebook": (lambda s: s.update({eb.CODEC + "quantizer.quantizers.3.codebook.embed": torch.zeros(1024, 31)}),
                       f"{eb.CODEC}quantizer.quantizers.3.codebook.embed has shape"),
    "shape-tower": (lambda s: s.update({eb.AUDIO_TOWER + "layers.0.fc1.weight": torch.zeros(33, 16)}),
                    f"{eb.AUDIO_TOWER}layers.0.fc1.weight has shape"),
    "extra-tower-layer": (lambda s: s.update({eb.AUDIO_TOWER + "layers.1.fc1.weight": torch.zeros(32, 16)}),
                          f"unexpected key '{eb.AUDIO_TOWER}layers.1.fc1.weight'"),
    "missing-tower-layer": (lambda s: s.pop(eb.AUDIO_TOWER + "layers.0.self_attn.q_proj.bias"),
                            f"missing '{eb.AUDIO_TOWER}layers.0.self_attn.q_proj.bias'"),
}


@pytest.mark.parametrize("name", sorted(BAD_EXPORTS))
def test_bad_export_fails_naming_the_key(name):
    edit, message = BAD_EXPORTS[name]
    with pytest.raises(ValueError, match=message.replace(".", r"\.").replace("(", r"\(")):
        _split(_edited(edit))


def test_cli_reports_a_bad_export_naming_the_key(tmp_path, export):
    saved = torch.load(export["checkpoint"], weights_only=True)
    del saved["module"]["model.norm.weight"]
    files = dict(export, checkpoint=str(tmp_path / "model.pth"))
    torch.save(saved, files["checkpoint"])
    run = _convert_cli(files, str(tmp_path / "out"))
    assert run.returncode == 2 and "missing 'model.norm.weight'" in run.stderr and "Traceback" not in run.stderr


def test_backbone_config_that_disagrees_with_the_weights_fails(tmp_path, export):
    backbone = json.load(open(export["backbone_config"])) | {"vocab_size": 399}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(backbone))
    with pytest.raises(ValueError, match="model.embed_tokens.weight has shape"):
        convert_bagpiper(export["checkpoint"], str(tmp_path / "out"), export["text_tokenizer"], str(path),
                         export["codec_config"], audio_tower_config_path=export["audio_tower_config"])


def test_codec_config_that_disagrees_with_the_weights_fails(tmp_path, export):
    codec = json.load(open(export["codec_config"]))
    codec["acoustic_model_config"]["decoder_hidden_size"] = 128
    path = tmp_path / "xcodec.json"
    path.write_text(json.dumps(codec))
    with pytest.raises(ValueError, match="acoustic_decoder.conv1.weight has shape"):
        convert_bagpiper(export["checkpoint"], str(tmp_path / "out"), export["text_tokenizer"],
                         export["backbone_config"], str(path), audio_tower_config_path=export["audio_tower_config"])


def test_audio_tower_config_that_disagrees_with_the_weights_fails(tmp_path, export):
    """Without --audio-tower-config the released geometry is expected; the tiny tower is not it."""
    with pytest.raises(ValueError, match="audio_tower.* has shape .*, the audio tower config gives"):
        convert_bagpiper(export["checkpoint"], str(tmp_path / "out"), export["text_tokenizer"],
                         export["backbone_config"], export["codec_config"])
    bad = json.load(open(export["audio_tower_config"])) | {"encoder_attention_heads": 3}
    path = tmp_path / "tower.json"
    path.write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="--audio-tower-config: .*encoder_attention_heads: 3 does not divide d_model 16"):
        convert_bagpiper(export["checkpoint"], str(tmp_path / "out"), export["text_tokenizer"],
                         export["backbone_config"], export["codec_config"], audio_tower_config_path=str(path))


def test_audio_tower_config_of_a_whole_qwen3_omni_config():
    from vllm_omni_speechlm.config import AudioTowerSpec
    from vllm_omni_speechlm.convert import audio_tower_spec

    tower = {"d_model": 16, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 32,
             "downsample_hidden_size": 8, "output_dim": 24, "dropout": 0.0}
    spec = audio_tower_spec({"thinker_config": {"audio_config": tower}, "model_type": "qwen3_omni_moe"})
    assert spec == audio_tower_spec(tower) == AudioTowerSpec(**{k: v for k, v in tower.items() if k != "dropout"})
    assert audio_tower_spec(None) == AudioTowerSpec() and AudioTowerSpec().output_dim == 2048


def test_released_audio_tower_shapes_are_qwen3_omnis():
    """The released geometry's shapes are those transformers' Qwen3-Omni encoder builds."""
    import dataclasses

    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    from vllm_omni_speechlm.config import AudioTowerSpec

    spec = dataclasses.replace(AudioTowerSpec(), encoder_layers=2)  # two layers stand for 32
    with torch.device("meta"):
        model = Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**dataclasses.asdict(spec)))
    theirs = {"audio_tower." + k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert eb.audio_tower_shapes(spec) == theirs


def test_weight_normalised_codec_is_folded():
    """An XcodecModel saved with weight norm applied converts to the same decoder."""
    state = dict(tiny_bagpiper_parts(0)[2])
    key = eb.CODEC + "acoustic_decoder.conv1.weight"
    w = state.pop(key)
    g = w.norm(dim=(1, 2), keepdim=True)
    state[key.replace(".weight", ".parametrizations.weight.original0")] = g
    state[key.replace(".weight", ".parametrizations.weight.original1")] = w * 3.0
    _, codec = _split(state)
    torch.testing.assert_close(codec["acoustic_decoder.conv1.weight"], w)


def test_text_vocabulary_fills_the_embedding_rows():
    """Qwen3's tokenizer has fewer tokens than embedding rows: added tokens keep their ids, the
    rest of the text range gets placeholders; a tokenizer larger than the range fails."""
    vocab = {"a": 0, "b": 1, "ab": 2}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("a", "b")]))
    tok.add_special_tokens(["<|endoftext|>"])  # id 3
    full, merges = backbone_text_vocab(tok, 6)
    assert full == vocab | {"<|endoftext|>": 3, "<|text_unused_4|>": 4, "<|text_unused_5|>": 5}
    assert merges == [("a", "b")]
    with pytest.raises(ValueError, match="do not fit the 3 text ids"):
        backbone_text_vocab(tok, 3)


def test_released_geometry_is_qwen3_8b():
    from vllm_omni_speechlm.convert import qwen3_geometry
    from vllm_omni_speechlm.config import bagpiper_layout

    geo, text = qwen3_geometry(None)
    shapes = eb.qwen3_shapes(bagpiper_layout(text), geo)
    assert bagpiper_layout(text).vocab_size == 160392 and shapes["model.embed_tokens.weight"] == (160392, 4096)
    assert len([k for k in shapes if k.startswith("model.") or k == "lm_head.weight"]) == 399
    assert shapes["model.layers.35.mlp.down_proj.weight"] == (4096, 12288)
    assert geo == BackboneGeometry(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, max_position_embeddings=40960)


def test_engine_skips_the_audio_input_weights_by_name():
    from vllm_omni_speechlm.models.speechlm import SpeechLMForCausalLM

    mapper = SpeechLMForCausalLM.hf_to_vllm_mapper
    assert mapper._map_name("audio_tower.layers.0.fc1.weight") is None
    assert mapper._map_name("audio_adaptor.weight") is None
    assert mapper._map_name("model.norm.weight") == "model.norm.weight"
    assert mapper._map_name("audio_towers.x") == "audio_towers.x"  # anything else still reaches the loader
