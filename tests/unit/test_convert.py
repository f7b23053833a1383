"""`speechlm-convert` on tiny checkpoints the test writes in ESPnet's SpeechLM format.

The ESPnet experiment is built from a `speechlm-make-tiny` checkpoint (key names and files as
ESPnet writes them, see vllm_omni_speechlm/convert.py for their sources), converted back, and
must equal the original: config.json, every tensor, the tokenizer, the codec, and the reference's
generation.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.make_tiny import TINY_MIN_AUDIO_FRAMES, TINY_TEXT_VOCAB, espnet_token_list
from vllm_omni_speechlm.tokenizer import train_text_bpe

def write_espnet_experiment(model_dir: str, exp: str, backbone_type: str) -> dict[str, str]:
    """An ESPnet SpeechLM experiment (config.yaml + model.pth) holding the tiny model, plus the
    backbone's text tokenizer and HF config (what `hf_model_tag` would give)."""
    cfg = SpeechLMConfig.from_model_dir(model_dir)
    hf = json.load(open(os.path.join(model_dir, "config.json")))
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    text_vocab, merges = train_text_bpe(TINY_TEXT_VOCAB)
    os.makedirs(exp, exist_ok=True)
    lo, hi = cfg.streams[1].vocab_start, cfg.streams[-1].vocab_end
    config = {
        "token_list": espnet_token_list(cfg, text_vocab),
        "token_bias": {"special_token": [0, 256], "ssl": [256, lo], "codec": [lo, hi], "text_bpe": list(cfg.text_range)},
        "codec_token_in_use": cfg.num_streams,
        "corelm": "ar_delay",
        "transformer": "huggingface",
        "transformer_conf": {"hf_model_tag": backbone_type, "n_ctx": hf["max_position_embeddings"]},
    }
    with open(os.path.join(exp, "config.yaml"), "w") as f:
        yaml.safe_dump(config, f)
    lm_head = weights["lm_head.weight"].clone()
    head_emb = torch.cat([weights["stream_embeddings.weight"], torch.randn(12 - cfg.num_streams, hf["hidden_size"])])
    state = {
        "corelm.emb.weight": weights["model.embed_tokens.weight"],
        "corelm.lm_head.weight": lm_head,
        "corelm.aux_lm_head.weight": lm_head[lo:hi].clone(),  # newer ESPnet: streams 1..S-1's head
        "corelm.head_emb.weight": head_emb,
        "corelm.decoders.model.rotary_emb.inv_freq": torch.ones(16),
    }
    lm_head[lo:hi] = torch.randn(hi - lo, hf["hidden_size"])  # never read: aux_lm_head wins
    for key, tensor in weights.items():
        if key.startswith("model.") and key != "model.embed_tokens.weight":
            state["corelm.decoders." + key] = tensor
    torch.save(state, os.path.join(exp, "valid.acc.ave.pth"))
    text_tok = Tokenizer(models.BPE(vocab=text_vocab, merges=merges))
    text_tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    text_tok.decoder = decoders.ByteLevel()
    text_tok.save(os.path.join(exp, "text_tokenizer.json"))
    backbone = {k: hf[k] for k in ("num_attention_heads", "num_key_value_heads", "rms_norm_eps", "rope_parameters")}
    with open(os.path.join(exp, "backbone_config.json"), "w") as f:
        json.dump(backbone, f)
    return {
        "checkpoint": os.path.join(exp, "valid.acc.ave.pth"),
        "text_tokenizer": os.path.join(exp, "text_tokenizer.json"),
        "backbone": os.path.join(exp, "backbone_config.json"),
        "codec": os.path.join(model_dir, cfg.codec.path),
    }


@pytest.fixture(params=["opuslm", "opuslm-dialogue"])
def tiny(request):
    fixture = "tiny_opuslm" if request.param == "opuslm" else "tiny_opuslm_dialogue"
    return request.param, request.getfixturevalue(fixture)


def _cli(family: str, files: dict, out: str, *extra: str) -> subprocess.CompletedProcess:
    args = ["--family", family, "--espnet-checkpoint", files["checkpoint"], "--text-tokenizer", files["text_tokenizer"]]
    args += ["--codec", files["codec"], "--backbone-config", files["backbone"], "--out", out]
    args += ["--min-audio-frames", str(TINY_MIN_AUDIO_FRAMES), *extra]
    cmd = [sys.executable, "-m", "vllm_omni_speechlm.convert", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=os.environ | {"PYTHONPATH": os.getcwd()})


def test_round_trip(tiny, tmp_path):
    family, model_dir = tiny
    files = write_espnet_experiment(model_dir, str(tmp_path / "exp"), family)
    out = str(tmp_path / "converted")
    run = _cli(family, files, out)
    assert run.returncode == 0, run.stderr[-2000:]
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "codec/config.json", "codec/model.safetensors"):
        with open(os.path.join(model_dir, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), name
    original, converted = (load_file(os.path.join(d, "model.safetensors")) for d in (model_dir, out))
    assert sorted(original) == sorted(converted)
    for key in original:
        assert torch.equal(original[key], converted[key]), key


def test_espnet_export_converts_to_the_tiny_checkpoint(tiny, tmp_path):
    """`speechlm-make-tiny --espnet-export` writes the experiment the parity goldens come from;
    converted, it is the tiny checkpoint byte for byte."""
    from vllm_omni_speechlm.convert import convert
    from vllm_omni_speechlm.make_tiny import write_tiny_opuslm_export

    family, model_dir = tiny
    files = write_tiny_opuslm_export(str(tmp_path / "exp"), 0, family)
    out = str(tmp_path / "converted")
    convert(family, files["checkpoint"], out, files["text_tokenizer"], files["codec"], files["config"],
            files["backbone_config"], TINY_MIN_AUDIO_FRAMES)
    names = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "codec/config.json",
             "codec/model.safetensors")
    for name in names:
        with open(os.path.join(model_dir, name), "rb") as a, open(os.path.join(out, name), "rb") as b:
            assert a.read() == b.read(), name
    state = torch.load(files["checkpoint"], weights_only=True)
    assert all(k.startswith("corelm.") for k in state) and state["corelm.head_emb.weight"].shape[0] == 9


def test_converted_checkpoint_generates_like_the_original(tiny_opuslm, tmp_path):
    from vllm_omni_speechlm.convert import convert
    from vllm_omni_speechlm.reference import ReferenceSpeechLM
    from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
    from vllm_omni_speechlm.tokenizer import encode_prompt

    files = write_espnet_experiment(tiny_opuslm, str(tmp_path / "exp"), "opuslm")
    out = str(tmp_path / "converted")
    convert("opuslm", files["checkpoint"], out, files["text_tokenizer"], files["codec"], None, files["backbone"],
            TINY_MIN_AUDIO_FRAMES)
    params = SpeechSamplingParams(modality="audio", seed=0, max_tokens=40)
    a, b = ReferenceSpeechLM(tiny_opuslm), ReferenceSpeechLM(out)
    ids = encode_prompt(a.tokenizer, a.cfg, "Say hello.")
    ra, rb = a.generate(ids, params), b.generate(ids, params)
    assert torch.equal(ra.tokens, rb.tokens) and torch.equal(ra.audio, rb.audio)


def _edit_yaml(path: str, **changes) -> None:
    raw = yaml.safe_load(open(path))
    raw.update(changes)
    yaml.safe_dump(raw, open(path, "w"))


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(token_bias={"ssl": [256, 5256], "codec": [5256, 13000], "text_bpe": [13448, 13848]}), "token_bias.codec"),
        (dict(codec_token_in_use=8), "codec_token_in_use"),
        (dict(token_list=None), "token_list"),
    ],
    ids=["codec-range", "streams", "no-token-list"],
)
def test_bad_experiment_is_rejected_with_the_field(tiny_opuslm, tmp_path, change, message):
    from vllm_omni_speechlm.convert import convert

    files = write_espnet_experiment(tiny_opuslm, str(tmp_path / "exp"), "opuslm")
    _edit_yaml(str(tmp_path / "exp" / "config.yaml"), **change)
    with pytest.raises(ValueError, match=message):
        convert("opuslm", files["checkpoint"], str(tmp_path / "out"), files["text_tokenizer"], files["codec"],
                None, files["backbone"])


def test_wrong_text_tokenizer_is_rejected(tiny_opuslm, tmp_path):
    from vllm_omni_speechlm.convert import convert

    files = write_espnet_experiment(tiny_opuslm, str(tmp_path / "exp"), "opuslm")
    vocab, merges = train_text_bpe(TINY_TEXT_VOCAB - 10)
    Tokenizer(models.BPE(vocab=vocab, merges=merges)).save(files["text_tokenizer"])
    with pytest.raises(ValueError, match="does not match token_list"):
        convert("opuslm", files["checkpoint"], str(tmp_path / "out"), files["text_tokenizer"], files["codec"],
                None, files["backbone"])
