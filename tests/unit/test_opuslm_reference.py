"""The reference's OLMo-2 / Llama backbones against transformers, the tiny OpusLM checkpoints,
and the per-stream head bias on stream 0."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

FAMILIES = {"opuslm": "tiny_opuslm", "opuslm-dialogue": "tiny_opuslm_dialogue"}


@pytest.fixture(params=list(FAMILIES))
def tiny(request):
    return request.param, request.getfixturevalue(FAMILIES[request.param])


@torch.no_grad()
def test_backbone_matches_transformers(tiny):
    import transformers

    from vllm_omni_speechlm.reference import ReferenceSpeechLM

    family, model_dir = tiny
    raw = json.load(open(os.path.join(model_dir, "config.json")))
    config_cls, model_cls = {"olmo2": ("Olmo2Config", "Olmo2Model"), "llama": ("LlamaConfig", "LlamaModel")}[raw["model_type"]]
    config = getattr(transformers, config_cls)(**{k: v for k, v in raw.items() if k != "speechlm"})
    hf = getattr(transformers, model_cls)(config).eval()
    weights = load_file(os.path.join(model_dir, "model.safetensors"))
    hf.load_state_dict({k.removeprefix("model."): v for k, v in weights.items() if k.startswith("model.")})
    ref = ReferenceSpeechLM(model_dir)
    embeds = torch.randn(1, 11, raw["hidden_size"], generator=torch.Generator().manual_seed(0))
    want = hf(inputs_embeds=embeds).last_hidden_state
    prefill = ref.backbone(embeds[:, :8], 0, cache := ref.backbone.new_cache())
    steps = [ref.backbone(embeds[:, i : i + 1], i, cache) for i in range(8, 11)]  # KV-cached decode
    torch.testing.assert_close(torch.cat([prefill, *steps], dim=1), want, atol=1e-4, rtol=1e-4)


def test_stream_zero_logits_include_the_head_bias(tiny):
    from vllm_omni_speechlm.reference import ReferenceSpeechLM

    _, model_dir = tiny
    ref = ReferenceSpeechLM(model_dir)
    e0 = load_file(os.path.join(model_dir, "model.safetensors"))["stream_embeddings.weight"][0]
    assert float(e0.abs().sum()) > 0 and torch.equal(ref.stream_emb[0], e0)
    h = torch.randn(2, e0.shape[0])
    logits0, _ = ref.heads(h)
    torch.testing.assert_close(logits0, (h + e0) @ ref.lm_head.T)


def test_tiny_checkpoints_have_the_family_backbone(tiny):
    family, model_dir = tiny
    raw = json.load(open(os.path.join(model_dir, "config.json")))
    names = set(load_file(os.path.join(model_dir, "model.safetensors")))
    layer = "model.layers.0."
    if family == "opuslm":
        assert raw["model_type"] == "olmo2" and raw["architectures"] == ["OpusLMForCausalLM"]
        assert {layer + "post_feedforward_layernorm.weight", layer + "self_attn.q_norm.weight"} <= names
        assert layer + "input_layernorm.weight" not in names
    else:
        assert raw["model_type"] == "llama"
        assert layer + "input_layernorm.weight" in names and layer + "self_attn.q_norm.weight" not in names
    assert raw["speechlm"]["family"] == family and raw["speechlm"]["codec"]["type"] == "dac"
    assert set(os.listdir(os.path.join(model_dir, "codec"))) == {"config.json", "model.safetensors"}


def test_cli_writes_the_same_checkpoint(tiny, tmp_path):
    family, model_dir = tiny
    cmd = [sys.executable, "-m", "vllm_omni_speechlm.make_tiny", "--family", family, "--out", str(tmp_path)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=120, env=os.environ | {"PYTHONPATH": os.getcwd()})
    for name in ("config.json", "model.safetensors", "tokenizer.json", "codec/model.safetensors"):
        with open(os.path.join(model_dir, name), "rb") as a, open(tmp_path / name, "rb") as b:
            assert a.read() == b.read(), name
