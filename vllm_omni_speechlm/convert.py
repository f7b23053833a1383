"""`speechlm-convert`: a released ESPnet SpeechLM checkpoint -> a directory this project serves.

    speechlm-convert --family bagpiper --espnet-checkpoint EXPORT.pth \
        --backbone-config Qwen3-8B-Base/config.json --text-tokenizer Qwen3-8B-Base/tokenizer.json \
        [--codec-config xcodec-hubert-general/config.json] --out DIR
    speechlm-convert --family {opuslm,opuslm-dialogue} --espnet-checkpoint EXP/model.pth \
        --text-tokenizer BACKBONE/tokenizer.json --codec DAC_DIR --out DIR \
        [--config EXP/config.yaml] [--backbone-config BACKBONE/config.json] [--min-audio-frames 50]

Output (both): config.json (backbone fields + the `speechlm` section), model.safetensors (Hugging
Face names + `stream_embeddings.weight`), tokenizer.json / tokenizer_config.json over the unified
vocabulary, codec/. A bad input is a ValueError naming the key or field (the CLI: exit 2).

Bagpiper. ESPnet's export_checkpoint.py writes `{"module": state_dict}` and nothing else: no
config, tokenizer or token list. Its names and what each becomes are in espnet_bagpiper.py: the
Qwen3 LM keeps its names, `stream_emb` becomes `stream_embeddings` (row 0 zero, as ESPnet uses
it), `vocab_weight` (a loss weight) is dropped, the Qwen3-Omni audio tower and its adaptor travel
as `audio_tower.*` / `audio_adaptor.*` (the `audio_input` section holds their geometry: the
tower's from `--audio-tower-config`, default the released Qwen3-Omni-30B-A3B's), and the
export's whole X-Codec model gives codec/ its decoder tensors. The layout is `bagpiper_layout`
over the backbone's text vocabulary (`vocab_size` of its config.json, 151936 for Qwen3-8B-Base,
checked against the embedding rows); the geometry comes from that config.json (default: the
released Qwen3-8B-Base) and every tensor's shape is checked against it. The tokenizer is the
backbone's BPE (its pre-tokenizer and normalizer kept), its ids shifted by 256; text ids it does
not use get placeholder tokens. The X-Codec config is a transformers XcodecConfig json
(hf-audio/xcodec-hubert-general's; default: the released geometry), written as codec/config.json.

OpusLM. ESPnet ships no `config.json`: the experiment has a `config.yaml` (the training
arguments) and a `*.pth` state dict. What this reads, and where the names come from (ESPnet master):
  config.yaml   `token_list` (every id's string, saved expanded by espnet2/tasks/speechlm.py
                `build_model`), `token_bias` (modality -> [start, end), `process_token_bias`),
                `codec_token_in_use` (nq: the number of streams), `transformer_conf.n_ctx`.
  model.pth     espnet2/speechlm/espnet_model.py keeps the core LM as `corelm`;
                core_lm/ar_parallel.py (ar_delay's base) names `emb` (input embedding, padding_idx
                0), `lm_head`, `head_emb` (per-stream head bias, 12 rows, the first nq used) and
                `decoders`; module/huggingface.py's `HFTransformerDecoder` keeps the backbone body
                (a transformers AutoModel: OLMo-2 or Llama, input embeddings removed) as
                `decoders.model`. Newer ESPnet adds `aux_lm_head` (Linear over the codec range
                for streams 1..S-1, tasks/speechlm.py `aux_vocab_size`).
The backbone's own config (heads, RoPE, eps) is not in the experiment (ESPnet names the HF model
by `hf_model_tag`): pass its config.json, or the family's released geometry is used; shapes are
checked against the weights. The text ids are the backbone tokenizer's ids shifted into
`token_bias["text_bpe"]`; its tokenizer.json gives the merges (checked against `token_list`).
The codec directory is a transformers `DacModel` checkpoint (descript/dac_16khz), copied.
`stream_embeddings.weight` = head_emb[:nq]; `aux_lm_head` rows go to lm_head's codec rows, which
stream 0 never samples.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
from typing import Any

import torch
import yaml
from safetensors.torch import save_file
from tokenizers import Tokenizer

from vllm_omni_speechlm.codec.xcodec import XCodecDecoderConfig, write_xcodec_dir
from vllm_omni_speechlm.config import (
    SPEECHLM_KEY,
    AudioInputSpec,
    AudioTowerSpec,
    SpeechLMConfig,
    bagpiper_layout,
    opuslm_layout,
)
from vllm_omni_speechlm.make_tiny import with_espnet_inference_config
from vllm_omni_speechlm.espnet_bagpiper import split_export
from vllm_omni_speechlm.make_tiny import BAGPIPER_8B, FAMILIES, BackboneGeometry, backbone_config, write_served_lm
from vllm_omni_speechlm.tokenizer import backbone_text_vocab, build_tokenizer, write_hf_tokenizer

# Backbone geometry of the released models (the HF models their `hf_model_tag` names).
RELEASED_BACKBONES = {
    "opuslm": dict(  # allenai/OLMo-2-1124-7B
        num_attention_heads=32, num_key_value_heads=32, rope_theta=500000.0, rms_norm_eps=1e-6
    ),
    "opuslm-dialogue": dict(  # HuggingFaceTB/SmolLM2-1.7B
        num_attention_heads=32, num_key_value_heads=32, rope_theta=130000.0, rms_norm_eps=1e-5
    ),
}
CORELM = "corelm."
# ESPnet special-token strings the layout relies on (espnet2/speechlm/definitions.py).
# The dialogue prompt's roles and task tokens too (tokenizer.encode_prompt).
EXPECTED_TOKENS = {0: "<pad>", 5: "<sos/eos>", 8: "<system_prompt>", 9: "<user_input>", 10: "<assistant_output>",
                   34: "<codec_ssl_start/end>", 35: "<text_bpe_start/end>", 88: "<text_dialogue_task>",
                   89: "<audio_dialogue_task>"}


def _fail(message: str) -> ValueError:
    return ValueError(f"speechlm-convert: {message}")


def read_espnet_config(path: str) -> dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        raw = yaml.safe_load(f)
    for key in ("token_list", "token_bias"):
        if key not in raw:
            raise _fail(f"{path}: no '{key}' (not an ESPnet SpeechLM config.yaml?)")
    if not isinstance(raw["token_list"], list):
        raise _fail(f"{path}: token_list must be the expanded list of token strings")
    return raw


def layout_from_espnet(family: str, raw: dict[str, Any], min_audio_frames: int = 50) -> SpeechLMConfig:
    """The family layout, sized by token_bias / token_list and checked against them."""
    tokens, bias = raw["token_list"], {k: tuple(v) for k, v in raw["token_bias"].items()}
    for key in ("ssl", "codec", "text_bpe"):
        if key not in bias:
            raise _fail(f"config.yaml token_bias: no '{key}' range (got {sorted(bias)})")
    text_lo, text_hi = bias["text_bpe"]
    layout = opuslm_layout(family, text_hi - text_lo, min_audio_frames, vocab_padding=len(tokens) - text_hi)
    s0, codec = layout.streams[0], layout.streams[1:]
    expected = {"ssl": (s0.vocab_start, s0.vocab_end), "codec": (codec[0].vocab_start, codec[-1].vocab_end)}
    expected["text_bpe"] = layout.text_range
    for key, rng in expected.items():
        if bias[key] != rng:
            raise _fail(f"config.yaml token_bias.{key}: {list(bias[key])}, the {family} layout has {list(rng)}")
    nq = raw.get("codec_token_in_use", layout.num_streams)
    if nq != layout.num_streams:
        raise _fail(f"config.yaml codec_token_in_use: {nq}, the {family} layout has {layout.num_streams} streams")
    for idx, name in EXPECTED_TOKENS.items():
        if tokens[idx] != name:
            raise _fail(f"config.yaml token_list[{idx}] is {tokens[idx]!r}, expected {name!r}")
    return layout


def load_espnet_state(path: str) -> dict[str, torch.Tensor]:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "model" in state and isinstance(state["model"], dict):
        state = state["model"]  # trainer checkpoints wrap the model's state dict
    if not any(k.startswith(CORELM) for k in state):
        raise _fail(f"{path}: no '{CORELM}*' tensors (not an ESPnet SpeechLM state dict?)")
    return state


def convert_weights(state: dict[str, torch.Tensor], layout: SpeechLMConfig) -> dict[str, torch.Tensor]:
    """ESPnet names -> the project's (Hugging Face backbone names + stream_embeddings)."""
    out: dict[str, torch.Tensor] = {}
    body = CORELM + "decoders.model."
    for key, tensor in state.items():
        if key.startswith(body):
            name = key[len(body) :]
            if "rotary_emb" in name or name.startswith("embed_tokens"):
                continue  # a buffer; the input embedding is corelm.emb
            out["model." + name] = tensor
    try:
        out["model.embed_tokens.weight"] = state[CORELM + "emb.weight"]
        lm_head = state[CORELM + "lm_head.weight"].clone()
        head_emb = state[CORELM + "head_emb.weight"]
    except KeyError as e:
        raise _fail(f"model.pth: missing {e.args[0]}") from None
    if head_emb.shape[0] < layout.num_streams:
        raise _fail(f"model.pth: head_emb has {head_emb.shape[0]} rows < {layout.num_streams} streams")
    aux = state.get(CORELM + "aux_lm_head.weight")
    if aux is not None:
        lo, hi = layout.streams[1].vocab_start, layout.streams[-1].vocab_end
        if aux.shape[0] != hi - lo:
            raise _fail(f"model.pth: aux_lm_head has {aux.shape[0]} rows, the codec range has {hi - lo}")
        lm_head[lo:hi] = aux
    out["lm_head.weight"] = lm_head
    out["stream_embeddings.weight"] = head_emb[: layout.num_streams]
    vocab = out["model.embed_tokens.weight"].shape[0]
    if vocab != layout.vocab_size or lm_head.shape[0] != vocab:
        raise _fail(f"model.pth: emb/lm_head have {vocab}/{lm_head.shape[0]} rows, token_list has {layout.vocab_size}")
    return {k: v.float().contiguous() for k, v in out.items()}


def infer_geometry(weights: dict[str, torch.Tensor], family: str, backbone: dict[str, Any] | None, n_ctx: int) -> BackboneGeometry:
    """Shapes from the weights; heads / RoPE / eps from the backbone config (or the release)."""
    known = dict(RELEASED_BACKBONES[family]) | {
        k: backbone[k] for k in ("num_attention_heads", "num_key_value_heads", "rms_norm_eps") if backbone and k in backbone
    }
    if backbone:
        rope = backbone.get("rope_parameters") or {}
        known["rope_theta"] = float(rope.get("rope_theta", backbone.get("rope_theta", known["rope_theta"])))
    hidden = weights["model.embed_tokens.weight"].shape[1]
    layers = 1 + max(int(k.split(".")[2]) for k in weights if k.startswith("model.layers."))
    q_dim = weights["model.layers.0.self_attn.q_proj.weight"].shape[0]
    kv_dim = weights["model.layers.0.self_attn.k_proj.weight"].shape[0]
    heads, kv_heads = known["num_attention_heads"], known["num_key_value_heads"]
    if q_dim % heads or kv_dim // (q_dim // heads) != kv_heads:
        raise _fail(f"q/k projections ({q_dim}, {kv_dim}) do not fit {heads} heads / {kv_heads} KV heads: pass --backbone-config")
    return BackboneGeometry(
        hidden_size=hidden,
        intermediate_size=weights["model.layers.0.mlp.gate_proj.weight"].shape[0],
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=q_dim // heads,
        rope_theta=known["rope_theta"],
        rms_norm_eps=known["rms_norm_eps"],
        max_position_embeddings=n_ctx,
    )


def text_tokenizer_parts(path: str, tokens: list[str], layout: SpeechLMConfig) -> tuple[dict[str, int], list]:
    """(vocab, merges) of the backbone's BPE tokenizer, checked against token_list's text ids."""
    spec = json.loads(Tokenizer.from_file(path).to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise _fail(f"{path}: expected a BPE tokenizer, got {model.get('type')}")
    vocab = model["vocab"]
    lo, hi = layout.text_range
    by_id = {i: t for t, i in vocab.items()}
    bad = [i for i in range(hi - lo) if by_id.get(i) != tokens[lo + i]]
    if len(vocab) != hi - lo or bad:
        raise _fail(f"{path}: its vocabulary ({len(vocab)} tokens) does not match token_list's text range "
                    f"[{lo}, {hi}) (first mismatch at text id {bad[0] if bad else len(vocab)})")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return vocab, merges


def convert(
    family: str,
    checkpoint: str,
    out_dir: str,
    text_tokenizer: str,
    codec: str,
    config_yaml: str | None = None,
    backbone_config_path: str | None = None,
    min_audio_frames: int = 50,
) -> SpeechLMConfig:
    if family not in RELEASED_BACKBONES:
        raise _fail(f"--family: expected one of {sorted(RELEASED_BACKBONES)}, got {family!r}")
    raw = read_espnet_config(config_yaml or os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "config.yaml"))
    layout = layout_from_espnet(family, raw, min_audio_frames)
    weights = convert_weights(load_espnet_state(checkpoint), layout)
    backbone = None
    if backbone_config_path:
        with open(backbone_config_path) as f:
            backbone = json.load(f)
    n_ctx = (raw.get("transformer_conf") or {}).get("n_ctx", 8192)
    geo = infer_geometry(weights, family, backbone, n_ctx)
    vocab, merges = text_tokenizer_parts(text_tokenizer, raw["token_list"], layout)

    os.makedirs(out_dir, exist_ok=True)
    fam = FAMILIES[family]
    config = backbone_config(layout, geo, fam.model_type, fam.arch)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
    write_hf_tokenizer(build_tokenizer(layout, vocab, merges), layout, out_dir)
    codec_out = os.path.join(out_dir, layout.codec.path)
    os.makedirs(codec_out, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(os.path.join(codec, name), os.path.join(codec_out, name))
    SpeechLMConfig.from_model_dir(out_dir)  # what the engine will read back
    assert config[SPEECHLM_KEY] == layout.to_dict()
    return layout


# ---- Bagpiper: ESPnet's export (espnet_bagpiper.py has the names) ----------------------------

BAGPIPER_TEXT_VOCAB = 151936  # Qwen3's embedding rows: the text range ESPnet keeps


def read_json(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise _fail(f"{what} {path}: {e}") from None


def read_yaml(path: str, what: str) -> dict[str, Any]:
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        raise _fail(f"{what} {path}: {e}") from None
    if not isinstance(data, dict) or not all(isinstance(data.get(m), dict) for m in ("text", "audio")):
        raise _fail(f"{what} {path}: expected text: and audio: sections (ESPnet's inference config)")
    return data


def qwen3_geometry(backbone: dict[str, Any] | None) -> tuple[BackboneGeometry, int]:
    """(geometry, text vocabulary size) from the backbone's config.json, or the released
    Qwen3-8B-Base's."""
    if backbone is None:
        return BAGPIPER_8B, BAGPIPER_TEXT_VOCAB
    if backbone.get("model_type") != "qwen3":
        raise _fail(f"--backbone-config: model_type {backbone.get('model_type')!r}, Bagpiper's backbone is 'qwen3'")
    try:
        heads, hidden = backbone["num_attention_heads"], backbone["hidden_size"]
        rope = backbone.get("rope_parameters") or {}
        geo = BackboneGeometry(
            hidden_size=hidden,
            intermediate_size=backbone["intermediate_size"],
            num_hidden_layers=backbone["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=backbone.get("num_key_value_heads", heads),
            head_dim=backbone.get("head_dim") or hidden // heads,
            rope_theta=float(rope.get("rope_theta", backbone.get("rope_theta", BAGPIPER_8B.rope_theta))),
            rms_norm_eps=backbone.get("rms_norm_eps", BAGPIPER_8B.rms_norm_eps),
            max_position_embeddings=backbone.get("max_position_embeddings", BAGPIPER_8B.max_position_embeddings),
        )
        return geo, backbone["vocab_size"]
    except KeyError as e:
        raise _fail(f"--backbone-config: no {e.args[0]!r}") from None


def audio_tower_spec(raw: dict[str, Any] | None) -> AudioTowerSpec:
    """The audio tower's geometry from a transformers Qwen3OmniMoeAudioEncoderConfig json or a whole
    Qwen3-Omni config.json (its thinker_config.audio_config); default: the released one."""
    if raw is None:
        return AudioTowerSpec()
    raw = (raw.get("thinker_config") or {}).get("audio_config", raw)
    known = {f.name for f in dataclasses.fields(AudioTowerSpec)}
    spec = AudioTowerSpec(**{k: v for k, v in raw.items() if k in known})
    try:
        spec.validate()
    except ValueError as e:
        raise _fail(f"--audio-tower-config: {e}") from None
    return spec


def load_bagpiper_export(path: str) -> dict[str, torch.Tensor]:
    """`{"module": state_dict}` as export_checkpoint.py saves it (a bare state dict is accepted)."""
    state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    if isinstance(state, dict) and isinstance(state.get("module"), dict):
        state = state["module"]
    if not isinstance(state, dict) or "lm_head.weight" not in state:
        raise _fail(f"{path}: no 'lm_head.weight' (not an ESPnet Bagpiper export?)")
    return state


def convert_bagpiper(
    checkpoint: str,
    out_dir: str,
    text_tokenizer: str,
    backbone_config_path: str | None = None,
    codec_config_path: str | None = None,
    inference_config_path: str | None = None,
    audio_tower_config_path: str | None = None,
) -> SpeechLMConfig:
    """ESPnet's Bagpiper export -> a served directory (the layout: `bagpiper_layout`; decoding
    defaults from ESPnet's inference config, default: the released SFT one; the audio tower's
    geometry from its transformers config, default: the released Qwen3-Omni one)."""
    backbone = read_json(backbone_config_path, "--backbone-config") if backbone_config_path else None
    geo, text_vocab = qwen3_geometry(backbone)
    codec_raw = XCodecDecoderConfig().to_xcodec_dict()  # the released geometry
    if codec_config_path:
        codec_raw = read_json(codec_config_path, "--codec-config")
    codec_config = XCodecDecoderConfig.from_dict(codec_raw)
    layout = bagpiper_layout(text_vocab)
    if inference_config_path:
        layout = with_espnet_inference_config(layout, read_yaml(inference_config_path, "--inference-config"))
    tower_raw = read_json(audio_tower_config_path, "--audio-tower-config") if audio_tower_config_path else None
    layout = dataclasses.replace(layout, audio_input=AudioInputSpec(tower=audio_tower_spec(tower_raw)))
    weights, codec = split_export(load_bagpiper_export(checkpoint), layout, geo, codec_config)
    base = Tokenizer.from_file(text_tokenizer)
    try:
        vocab, merges = backbone_text_vocab(base, text_vocab)
    except ValueError as e:
        raise _fail(f"--text-tokenizer {text_tokenizer}: {e}") from None

    fam = FAMILIES["bagpiper"]
    config = backbone_config(layout, geo, fam.model_type, fam.arch)
    config["dtype"] = str(weights["model.embed_tokens.weight"].dtype).removeprefix("torch.")
    write_served_lm(out_dir, config, weights, build_tokenizer(layout, vocab, merges, base=base), layout)
    write_xcodec_dir(os.path.join(out_dir, layout.codec.path), codec_raw, codec)
    SpeechLMConfig.from_model_dir(out_dir)  # what the engine will read back
    return layout


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="speechlm-convert", description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", required=True, choices=["bagpiper", *sorted(RELEASED_BACKBONES)])
    ap.add_argument("--espnet-checkpoint", required=True,
                    help="opuslm: the experiment's *.pth state dict; bagpiper: export_checkpoint.py's output")
    ap.add_argument("--text-tokenizer", required=True, help="the backbone's tokenizer.json")
    ap.add_argument("--backbone-config", help="the backbone's HF config.json (default: the released geometry)")
    ap.add_argument("--out", required=True, help="output directory")
    opus = ap.add_argument_group("opuslm, opuslm-dialogue")
    opus.add_argument("--config", help="the experiment's config.yaml (default: next to the checkpoint)")
    opus.add_argument("--codec", help="a transformers DacModel directory (descript/dac_16khz); required")
    opus.add_argument("--min-audio-frames", type=int, default=50, help="eos is masked before this many frames")
    bag = ap.add_argument_group("bagpiper")
    bag.add_argument("--codec-config", help="the X-Codec config.json (hf-audio/xcodec-hubert-general's; "
                     "default: the released geometry)")
    bag.add_argument("--inference-config", help="ESPnet's inference YAML (its text: / audio: sections become the "
                     "checkpoint's decoding defaults; default: the released conf/inference_sft.yaml)")
    bag.add_argument("--audio-tower-config", help="the audio tower's transformers config (a Qwen3-Omni config.json or "
                     "its audio_config; default: the released Qwen3-Omni-30B-A3B geometry)")
    a = ap.parse_args(argv)
    try:
        if a.family == "bagpiper":
            if a.codec or a.config:
                ap.error("--codec / --config: opuslm only (Bagpiper's codec is inside its export)")
            layout = convert_bagpiper(a.espnet_checkpoint, a.out, a.text_tokenizer, a.backbone_config, a.codec_config,
                                      a.inference_config, a.audio_tower_config)
        else:
            if not a.codec:
                ap.error(f"--codec is required for --family {a.family}")
            layout = convert(a.family, a.espnet_checkpoint, a.out, a.text_tokenizer, a.codec, a.config,
                             a.backbone_config, a.min_audio_frames)
    except ValueError as e:
        ap.exit(2, f"{e}\n")
    print(f"wrote {a.family} checkpoint to {a.out} (vocab {layout.vocab_size}, {layout.num_streams} streams)")


if __name__ == "__main__":
    main()
