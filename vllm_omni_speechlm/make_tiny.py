"""`speechlm-make-tiny`: write a complete tiny random checkpoint of a model family.

    speechlm-make-tiny --family {bagpiper,opuslm,opuslm-dialogue} --out DIR [--seed N]
    speechlm-make-tiny --family {bagpiper,opuslm,opuslm-dialogue} --espnet-export --out DIR [--seed N]

The directory is what a real converted checkpoint looks like: `config.json` (backbone fields +
the `speechlm` section), `model.safetensors` (Hugging Face parameter names plus
`stream_embeddings.weight`), a tokenizer over the unified vocabulary, and `codec/` (an
X-Codec-architecture decoder for Bagpiper, a DAC one for OpusLM). Same seed, same bytes.
Geometry: head_dim 32 (vLLM's CPU attention needs >= 32), 2 layers, so engine start dominates
test time. Backbones: Qwen3 (Bagpiper), OLMo-2 (OpusLM), Llama/SmolLM2 (OpusLM-Dialogue).

Bagpiper's tiny checkpoint is the conversion of a tiny ESPnet export (espnet_bagpiper.py), so it
also carries a tiny Qwen3-Omni audio tower and adaptor (`audio_tower.*`, `audio_adaptor.*`; the
released structure and names, 128 mel bins; config.json's `audio_input` records the geometry).
`--espnet-export` writes that export itself: `model.pth` (`{"module": state_dict}`),
`backbone/config.json` + `backbone/tokenizer.json` (the tiny Qwen3), `xcodec/config.json`,
`audio_tower/config.json` (the tower's transformers config, which the converter takes).

OpusLM's `--espnet-export` writes the tiny checkpoint as an ESPnet experiment: `config.yaml`
(token_list, token_bias, codec_token_in_use, ...) and `model.pth` (`corelm.*` names, as
espnet2/speechlm/espnet_model.py saves them), plus `backbone/` (the tiny OLMo-2 / Llama that
`hf_model_tag` names: config.json over the text vocabulary, tokenizer.json) and `codec/` (the
tiny DAC). `speechlm-convert --family F` of it gives back the `speechlm-make-tiny --family F`
directory byte for byte.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import yaml
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from vllm_omni_speechlm.codec.dac import write_tiny_dac
from vllm_omni_speechlm.codec.xcodec import TINY_CONFIG as TINY_CODEC
from vllm_omni_speechlm.codec.xcodec import (
    random_decoder_state,
    tiny_xcodec_config,
    write_tiny_xcodec,
    write_xcodec_dir,
)
from vllm_omni_speechlm.config import (
    AUDIO_ADAPTOR_PREFIX,
    AUDIO_TOWER_PREFIX,
    SPEECHLM_KEY,
    AudioInputSpec,
    AudioTowerSpec,
    espnet_modality_sampling,
    SpeechLMConfig,
    bagpiper_layout,
    opuslm_layout,
)
from vllm_omni_speechlm.espnet_bagpiper import export_state, split_export
from vllm_omni_speechlm.tokenizer import backbone_text_vocab, build_tokenizer, train_text_bpe, write_hf_tokenizer


@dataclass(frozen=True)
class BackboneGeometry:
    hidden_size: int = 64
    intermediate_size: int = 128
    num_hidden_layers: int = 2
    num_attention_heads: int = 2
    num_key_value_heads: int = 1
    head_dim: int = 32
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 4096


# The released Bagpiper backbone (Qwen3-8B), for dummy-weight benchmarks.
BAGPIPER_8B = BackboneGeometry(
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
)

TINY_TEXT_VOCAB = 400  # byte-level BPE: 256 bytes + merges
# OpusLM's released minimum is 50 frames; tiny checkpoints end audio sooner (a drain needs >= S-1).
TINY_MIN_AUDIO_FRAMES = 10


@dataclass(frozen=True)
class Family:
    model_type: str  # the backbone's Hugging Face model_type (picks the backbone)
    arch: str
    layout: Callable[[int], SpeechLMConfig]  # text vocabulary size -> layout
    write_codec: Callable[[str, int], None]
    rope_theta: float
    rms_norm_eps: float


# The tiny Bagpiper's decoding defaults, as an ESPnet inference config (the tiny export carries it
# as inference.yaml): the released temperatures and top-k, no guidance; audio runs until the
# request's max_tokens unless the request lowers min_audio_frames (the tiny model's eos is strong:
# streaming and preemption tests need long clips).
TINY_BAGPIPER_INFERENCE = {
    "text": {"temperature": 0.6, "topk": 20, "cfg": 1, "min_step": 1, "max_step": 8192},
    "audio": {"temperature": 0.8, "topk": 20, "cfg": 1, "min_step": 2048, "max_step": 2048},
}


def with_espnet_inference_config(layout: SpeechLMConfig, inference: dict) -> SpeechLMConfig:
    """`layout` with the decoding defaults of an ESPnet inference config (`text:` / `audio:`)."""
    return dataclasses.replace(
        layout,
        text_sampling=espnet_modality_sampling(inference["text"]),
        audio_sampling=espnet_modality_sampling(inference["audio"]),
    )


# A Qwen3-Omni audio encoder small enough to build in milliseconds: the released structure and
# names, 128 mel bins and chunking as released; its output width feeds the adaptor.
TINY_AUDIO_TOWER = AudioTowerSpec(
    d_model=16, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, downsample_hidden_size=8, output_dim=24
)


def tiny_bagpiper_layout(text_vocab_size: int) -> SpeechLMConfig:
    layout = with_espnet_inference_config(bagpiper_layout(text_vocab_size), TINY_BAGPIPER_INFERENCE)
    return dataclasses.replace(layout, audio_input=AudioInputSpec(tower=TINY_AUDIO_TOWER))


FAMILIES = {
    "bagpiper": Family("qwen3", "BagpiperForCausalLM", tiny_bagpiper_layout, write_tiny_xcodec, 1e6, 1e-6),
    "opuslm": Family(
        "olmo2",
        "OpusLMForCausalLM",
        lambda n: opuslm_layout("opuslm", n, min_audio_frames=TINY_MIN_AUDIO_FRAMES),
        write_tiny_dac,
        5e5,
        1e-6,
    ),
    "opuslm-dialogue": Family(
        "llama",
        "OpusLMForCausalLM",
        lambda n: opuslm_layout("opuslm-dialogue", n, min_audio_frames=TINY_MIN_AUDIO_FRAMES),
        write_tiny_dac,
        1.3e5,
        1e-5,
    ),
}


def backbone_config(layout: SpeechLMConfig, geo: BackboneGeometry, model_type: str, arch: str) -> dict:
    """config.json: the backbone's Hugging Face fields plus the speechlm section."""
    sp = layout.specials
    return {
        "architectures": [arch],
        "model_type": model_type,
        "vocab_size": layout.vocab_size,
        "hidden_size": geo.hidden_size,
        "intermediate_size": geo.intermediate_size,
        "num_hidden_layers": geo.num_hidden_layers,
        "num_attention_heads": geo.num_attention_heads,
        "num_key_value_heads": geo.num_key_value_heads,
        "head_dim": geo.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": geo.rms_norm_eps,
        "rope_parameters": {"rope_type": "default", "rope_theta": geo.rope_theta},
        "max_position_embeddings": geo.max_position_embeddings,
        "attention_bias": False,
        "tie_word_embeddings": False,
        "dtype": "float32",
        "bos_token_id": sp.bos,
        "eos_token_id": sp.eos,
        "pad_token_id": sp.pad,
        SPEECHLM_KEY: layout.to_dict(),
    }


def _layer_norm_names(model_type: str) -> tuple[tuple[str, ...], bool]:
    """(per-layer hidden-size norms, q/k norm over all heads?) of a backbone; q/k norms: Qwen3
    per head, OLMo-2 over the whole projection, Llama none."""
    if model_type == "olmo2":
        return ("post_attention_layernorm", "post_feedforward_layernorm"), True
    return ("input_layernorm", "post_attention_layernorm"), False


def random_weights(
    layout: SpeechLMConfig, geo: BackboneGeometry, seed: int, model_type: str = "qwen3"
) -> dict[str, torch.Tensor]:
    """Random backbone weights. Larger-than-usual scales keep logits peaked, so argmax
    decisions are far from ties and float32 engines agree with the reference."""
    g = torch.Generator().manual_seed(seed)
    h, kv = geo.hidden_size, geo.num_key_value_heads * geo.head_dim

    def randn(*shape: int, std: float) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * std

    def norm(n: int) -> torch.Tensor:  # not all ones: a norm weight that fails to load shows
        return 1.0 + randn(n, std=0.1)

    w = {"model.embed_tokens.weight": randn(layout.vocab_size, h, std=0.5)}
    layer_norms, full_qk = _layer_norm_names(model_type)
    q = geo.num_attention_heads * geo.head_dim
    for i in range(geo.num_hidden_layers):
        p = f"model.layers.{i}."
        w |= {p + name + ".weight": norm(h) for name in layer_norms}
        w |= {
            p + "self_attn.q_proj.weight": randn(q, h, std=h**-0.5),
            p + "self_attn.k_proj.weight": randn(kv, h, std=h**-0.5),
            p + "self_attn.v_proj.weight": randn(kv, h, std=h**-0.5),
            p + "self_attn.o_proj.weight": randn(h, q, std=q**-0.5),
            p + "mlp.gate_proj.weight": randn(geo.intermediate_size, h, std=h**-0.5),
            p + "mlp.up_proj.weight": randn(geo.intermediate_size, h, std=h**-0.5),
            p + "mlp.down_proj.weight": randn(h, geo.intermediate_size, std=geo.intermediate_size**-0.5),
        }
        if model_type != "llama":
            w[p + "self_attn.q_norm.weight"] = norm(q if full_qk else geo.head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(kv if full_qk else geo.head_dim)
    stream_emb = randn(layout.num_streams, h, std=0.5)
    if not layout.primary_stream_embedding:
        stream_emb[0] = 0.0  # Bagpiper's e_0 is zero
    w |= {
        "model.norm.weight": norm(h),
        "lm_head.weight": randn(layout.vocab_size, h, std=0.5),
        "stream_embeddings.weight": stream_emb,
    }
    # ESPnet builds the embedding with padding_idx 0: the pad row starts at zero and gets no
    # gradient, so a released checkpoint's row 0 is zero (pad streams and the CFG branch's
    # all-pad context embed to nothing).
    w["model.embed_tokens.weight"][layout.specials.pad] = 0.0
    if layout.decoding.drain:
        # A stronger eos row makes the random model end its audio within tens of steps, so
        # tests exercise the drain.
        w["lm_head.weight"][layout.specials.eos] *= TINY_EOS_BOOST
    else:
        # Stronger eos and eot rows: segments end by themselves within tens of steps, so tests
        # exercise minimum lengths and the answer going on after <|eot|>, not only max lengths.
        w["lm_head.weight"][[layout.specials.eos, layout.specials.eot]] *= TINY_SEGMENT_END_BOOST
    return {k: v.contiguous() for k, v in w.items()}


TINY_EOS_BOOST = 2.0
TINY_SEGMENT_END_BOOST = 3.0


def write_geometry_config(out_dir: str | os.PathLike, geo: BackboneGeometry, speech: bool = True) -> None:
    """config.json + tokenizer of the released Bagpiper layout at geometry `geo`, no weights: for
    `load_format="dummy"` engines. speech=False writes the plain Qwen3 text LM of the same
    backbone and vocabulary (the benchmarks' baseline). The tokenizer is the tiny one (prompts
    are token ids; it only has to load). The tiny geometry gets the tiny audio tower (a CPU run
    need not build the released 32-layer one)."""
    layout = bagpiper_layout()
    if geo == BackboneGeometry():
        layout = dataclasses.replace(layout, audio_input=AudioInputSpec(tower=TINY_AUDIO_TOWER))
    family = FAMILIES["bagpiper"]
    config = backbone_config(layout, geo, family.model_type, family.arch if speech else "Qwen3ForCausalLM")
    config["dtype"] = "bfloat16"
    if not speech:
        del config[SPEECHLM_KEY]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    text_vocab, merges = train_text_bpe(TINY_TEXT_VOCAB)
    tiny = bagpiper_layout(text_vocab_size=len(text_vocab))
    write_hf_tokenizer(build_tokenizer(tiny, text_vocab, merges), tiny, out_dir)


def write_released_tokenizer(out_dir: str | os.PathLike) -> None:
    """A tokenizer over the released Bagpiper layout's ids, for a dummy-weight checkpoint whose
    text answers are read (transcriptions): the tiny BPE, `<|text_unused_N|>` for the rest of the
    text range, so every text id a random model samples decodes to text (write_geometry_config's
    tokenizer knows only the tiny layout's ids)."""
    layout = bagpiper_layout()
    text_tok = tiny_text_tokenizer()
    vocab, merges = backbone_text_vocab(text_tok, layout.text_range[1] - layout.text_range[0])
    write_hf_tokenizer(build_tokenizer(layout, vocab, merges, base=text_tok), layout, out_dir)


def write_served_lm(
    out_dir: str | os.PathLike,
    config: dict,
    weights: dict[str, torch.Tensor],
    tokenizer: Tokenizer,
    layout: SpeechLMConfig,
) -> None:
    """config.json, model.safetensors and the tokenizer of a served checkpoint (the codec apart)."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
    save_file(weights, os.path.join(out_dir, "model.safetensors"), {"format": "pt"})
    write_hf_tokenizer(tokenizer, layout, out_dir)


def make_tiny(family: str, out_dir: str | os.PathLike, seed: int = 0) -> SpeechLMConfig:
    """Write the tiny checkpoint; returns its layout."""
    if family not in FAMILIES:
        raise ValueError(f"family: expected one of {sorted(FAMILIES)}, got {family!r}")
    if family == "bagpiper":
        return _make_tiny_bagpiper(out_dir, seed)
    fam = FAMILIES[family]
    text_vocab, merges = train_text_bpe(TINY_TEXT_VOCAB)
    layout = fam.layout(len(text_vocab))
    geo = BackboneGeometry(rope_theta=fam.rope_theta, rms_norm_eps=fam.rms_norm_eps)
    config = backbone_config(layout, geo, fam.model_type, fam.arch)
    weights = random_weights(layout, geo, seed, fam.model_type)
    write_served_lm(out_dir, config, weights, build_tokenizer(layout, text_vocab, merges), layout)
    fam.write_codec(os.path.join(out_dir, layout.codec.path), seed)
    return layout


# ---- Bagpiper: the tiny checkpoint is what `speechlm-convert` makes of the tiny ESPnet export ----

# Files of a tiny export: ESPnet's state dict, and what ESPnet reads from the hub by name.
EXPORT_CHECKPOINT = "model.pth"
EXPORT_BACKBONE = "backbone"  # the Qwen3 directory `model_hf_tag` names: config.json, tokenizer.json
EXPORT_CODEC_CONFIG = os.path.join("xcodec", "config.json")  # hf-audio/xcodec-hubert-general's
EXPORT_INFERENCE_CONFIG = "inference.yaml"  # ESPnet's inference config (conf/inference_sft.yaml's keys)
# The audio tower's transformers config (Qwen3OmniMoeAudioEncoderConfig): ESPnet reads it from the
# Qwen3-Omni model it names; an export has no copy, so the converter takes it as an argument.
EXPORT_AUDIO_TOWER_CONFIG = os.path.join("audio_tower", "config.json")


def _meta_shapes(build: Callable[[], torch.nn.Module]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    with torch.device("meta"):
        return {k: (tuple(v.shape), v.dtype) for k, v in build().state_dict().items()}


def _random_tensors(shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int) -> dict[str, torch.Tensor]:
    """Small random values in a fixed (sorted) draw order: same seed, same tensors."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for key in sorted(shapes):
        shape, dtype = shapes[key]
        t = torch.randn(shape, generator=g) * 0.05
        out[key] = t.to(dtype) if dtype.is_floating_point else torch.zeros(shape, dtype=dtype)
    return out


def tiny_audio_input(hidden_size: int, seed: int, tower: AudioTowerSpec = TINY_AUDIO_TOWER) -> dict[str, torch.Tensor]:
    """Random audio tower + adaptor under their served names: transformers' Qwen3-Omni encoder's
    tensors, at scales that keep activations near unit size, so different audio gives clearly
    different feature rows (near-zero weights would make every clip the adaptor's bias)."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    config = Qwen3OmniMoeAudioEncoderConfig(**dataclasses.asdict(tower))
    shapes = {AUDIO_TOWER_PREFIX + k: v for k, v in _meta_shapes(lambda: Qwen3OmniMoeAudioEncoder(config)).items()}
    shapes |= {
        AUDIO_ADAPTOR_PREFIX + "weight": ((hidden_size, config.output_dim), torch.float32),
        AUDIO_ADAPTOR_PREFIX + "bias": ((hidden_size,), torch.float32),
    }
    g = torch.Generator().manual_seed(seed + 1)  # its own draws: the LM's stay those of random_weights
    return {key: _unit_scale(key, shapes[key][0], g) for key in sorted(shapes)}


# Gains over fan-in scaling: the three gelu convolutions shrink the signal (measured on the tiny
# tower: with gain 1 the output rows of two clips differed by 0.1% and the clip never changed an
# answer; with 2, five test clips give five different answers, features of std ~0.3 where
# token embeddings have 0.5).
TINY_AUDIO_GAINS = {AUDIO_TOWER_PREFIX + "conv2d": 2.0}


def _unit_scale(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Norm weights near 1, biases small, weights with fan-in scaling times their gain."""
    noise = torch.randn(shape, generator=g)
    if len(shape) == 1:  # a LayerNorm's weight, or a bias
        return 1.0 + 0.1 * noise if name.endswith(".weight") else 0.01 * noise
    gain = next((v for k, v in TINY_AUDIO_GAINS.items() if name.startswith(k)), 1.0)
    return noise * math.prod(shape[1:]) ** -0.5 * gain


def tiny_xcodec_model_state(seed: int) -> dict[str, torch.Tensor]:
    """A whole transformers XcodecModel state dict of the tiny geometry: the decoder's tensors are
    the tiny codec's (`random_decoder_state`), the encode-only parts random."""
    from transformers import XcodecConfig, XcodecModel

    config = XcodecConfig(**tiny_xcodec_config())
    decoder = random_decoder_state(TINY_CODEC, seed)
    rest = {k: v for k, v in _meta_shapes(lambda: XcodecModel(config)).items() if k not in decoder}
    return _random_tensors(rest, seed + 2) | decoder


def tiny_text_tokenizer() -> Tokenizer:
    """The tiny backbone's own tokenizer.json: a byte-level BPE over text ids from 0."""
    text_vocab, merges = train_text_bpe(TINY_TEXT_VOCAB)
    tok = Tokenizer(models.BPE(vocab=text_vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def tiny_qwen3_config(geo: BackboneGeometry, text_vocab_size: int) -> dict:
    """The tiny backbone's own config.json (a Qwen3ForCausalLM over the text vocabulary only)."""
    return text_backbone_config(bagpiper_layout(text_vocab_size), geo, "qwen3", "Qwen3ForCausalLM", text_vocab_size)


def text_backbone_config(layout: SpeechLMConfig, geo: BackboneGeometry, model_type: str, arch: str, text_vocab_size: int) -> dict:
    """A backbone's own config.json: the plain Hugging Face text LM over the text vocabulary."""
    config = backbone_config(layout, geo, model_type, arch)
    for key in (SPEECHLM_KEY, "bos_token_id", "eos_token_id", "pad_token_id"):
        del config[key]  # the unified vocabulary's, not the text model's
    return config | {"vocab_size": text_vocab_size}


def tiny_bagpiper_parts(seed: int) -> tuple[SpeechLMConfig, BackboneGeometry, dict[str, torch.Tensor]]:
    """(layout, geometry, ESPnet export state dict) of the tiny Bagpiper of `seed`."""
    fam = FAMILIES["bagpiper"]
    layout = fam.layout(TINY_TEXT_VOCAB)
    geo = BackboneGeometry(rope_theta=fam.rope_theta, rms_norm_eps=fam.rms_norm_eps)
    weights = random_weights(layout, geo, seed, fam.model_type) | tiny_audio_input(geo.hidden_size, seed)
    return layout, geo, export_state(weights, tiny_xcodec_model_state(seed))


def write_tiny_bagpiper_export(out_dir: str | os.PathLike, seed: int = 0) -> dict[str, str]:
    """A tiny Bagpiper export as ESPnet writes it (`{"module": state_dict}`, ESPnet's names) plus
    the backbone's config.json / tokenizer.json and the X-Codec config; returns their paths."""
    layout, geo, state = tiny_bagpiper_parts(seed)
    paths = {
        "checkpoint": os.path.join(out_dir, EXPORT_CHECKPOINT),
        "backbone_config": os.path.join(out_dir, EXPORT_BACKBONE, "config.json"),
        "text_tokenizer": os.path.join(out_dir, EXPORT_BACKBONE, "tokenizer.json"),
        "codec_config": os.path.join(out_dir, EXPORT_CODEC_CONFIG),
        "inference_config": os.path.join(out_dir, EXPORT_INFERENCE_CONFIG),
        "audio_tower_config": os.path.join(out_dir, EXPORT_AUDIO_TOWER_CONFIG),
    }
    for path in paths.values():
        os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save({"module": state}, paths["checkpoint"])
    with open(paths["backbone_config"], "w") as f:
        json.dump(tiny_qwen3_config(geo, layout.text_range[1] - layout.text_range[0]), f, indent=2, sort_keys=True)
    tiny_text_tokenizer().save(paths["text_tokenizer"])
    # As a Hugging Face model directory has it: without it, transformers would load the tokenizer
    # as Qwen2's class, which adds its own <|endoftext|> and so one more text id than the model has.
    with open(os.path.join(out_dir, EXPORT_BACKBONE, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    with open(paths["codec_config"], "w") as f:
        json.dump(tiny_xcodec_config(), f, indent=2, sort_keys=True)
    with open(paths["inference_config"], "w") as f:
        yaml.safe_dump(TINY_BAGPIPER_INFERENCE, f)
    with open(paths["audio_tower_config"], "w") as f:
        json.dump(qwen3_omni_audio_config(layout.audio_input.tower), f, indent=2, sort_keys=True)
    return paths


def qwen3_omni_audio_config(tower: AudioTowerSpec) -> dict:
    """The tower as transformers writes a Qwen3OmniMoeAudioEncoderConfig (what the converter reads)."""
    return {"model_type": "qwen3_omni_moe_audio_encoder"} | dataclasses.asdict(tower)


def _make_tiny_bagpiper(out_dir: str | os.PathLike, seed: int) -> SpeechLMConfig:
    """The tiny export's tensors mapped as `speechlm-convert --family bagpiper` maps them (a test
    converts the written export and compares the directories byte for byte)."""
    layout, geo, state = tiny_bagpiper_parts(seed)
    weights, codec = split_export(state, layout, geo, TINY_CODEC)
    fam = FAMILIES["bagpiper"]
    text_tok = tiny_text_tokenizer()
    vocab, merges = backbone_text_vocab(text_tok, TINY_TEXT_VOCAB)
    tokenizer = build_tokenizer(layout, vocab, merges, base=text_tok)
    write_served_lm(out_dir, backbone_config(layout, geo, fam.model_type, fam.arch), weights, tokenizer, layout)
    write_xcodec_dir(os.path.join(out_dir, layout.codec.path), tiny_xcodec_config(), codec)
    return layout


# ---- OpusLM: the tiny checkpoint as an ESPnet experiment (what `speechlm-convert` reads) --------

# espnet2/speechlm/definitions.py: general specials (roles at 8..10), modality markers from 32,
# task tokens from 64. The released OpusLM token lists put the dialogue tasks at 88 / 89 (the
# layout's `dialogue_tasks`); the other task slots are unused here.
ESPNET_GENERAL = ["<pad>", "<unk>", "<blank>", "<space>", "<continuous_placeholder>", "<sos/eos>", "<local_sos/eos>",
                  "<unkown_task_identifer>", "<system_prompt>", "<user_input>", "<assistant_output>", "<eou>"]
ESPNET_MODALITIES = ["codec", "ssl", "codec_ssl", "text_bpe", "g2p", "spk", "class", "bool", "video_ssl", "svs_lb",
                     "image"]
ESPNET_TASKS = {64: "textlm", 65: "codec_ssl_audiolm", 66: "codec_ssl_asr", 67: "codec_ssl_tts",
                88: "text_dialogue", 89: "audio_dialogue"}
ESPNET_EXPERIMENT_CONFIG = "config.yaml"
ESPNET_BACKBONE_ARCH = {"olmo2": "Olmo2ForCausalLM", "llama": "LlamaForCausalLM"}


def espnet_token_list(layout: SpeechLMConfig, text_vocab: dict[str, int]) -> list[str]:
    """ESPnet's expanded token_list for an OpusLM layout: specials, SSL units, codec codes per
    layer, the backbone's text tokens, then unused padding up to the vocabulary size."""
    specials = [f"<unused_token_{i}>" for i in range(256)]
    specials[: len(ESPNET_GENERAL)] = ESPNET_GENERAL
    specials[32 : 32 + len(ESPNET_MODALITIES)] = [f"<{m}_start/end>" for m in ESPNET_MODALITIES]
    for idx, task in ESPNET_TASKS.items():
        specials[idx] = f"<{task}_task>"
    ssl = [f"<ssl_code{i + 1}>" for i in range(layout.streams[0].codebook_size)]
    codec = [f"<codec_layer{q}_code{c}>" for q, s in enumerate(layout.streams[1:]) for c in range(s.codebook_size)]
    text = [t for t, _ in sorted(text_vocab.items(), key=lambda kv: kv[1])]
    tokens = specials + ssl + codec + text
    return tokens + [f"<unused_text_token_{i}>" for i in range(len(tokens), layout.vocab_size)]


def espnet_experiment_config(layout: SpeechLMConfig, text_vocab: dict[str, int], n_ctx: int) -> dict:
    """The keys of an ESPnet SpeechLM config.yaml that the core LM's build and the converter read."""
    lo, hi = layout.streams[1].vocab_start, layout.streams[-1].vocab_end
    return {
        "token_list": espnet_token_list(layout, text_vocab),
        # process_token_bias's output (modality -> [start, end)), as build_model saves it.
        "token_bias": {"special_token": [0, 256], "ssl": [layout.streams[0].vocab_start, lo], "codec": [lo, hi],
                       "text_bpe": list(layout.text_range)},
        "codec_token_in_use": layout.num_streams,
        "corelm": "ar_delay",
        "corelm_conf": {},
        "transformer": "huggingface",
        "transformer_conf": {"hf_model_tag": EXPORT_BACKBONE, "n_ctx": n_ctx, "dtype": "float32",
                             "attention_choice": "sdpa"},
    }


def espnet_corelm_state(weights: dict[str, torch.Tensor], layout: SpeechLMConfig) -> dict[str, torch.Tensor]:
    """Served names -> ESPnet's (`convert_weights` in reverse): the body under
    corelm.decoders.model (its input embedding removed, as HFTransformerDecoder does), `emb`,
    `lm_head`, and `head_emb` with one row per stream (ARParallelLM's nq rows)."""
    state = {
        "corelm.emb.weight": weights["model.embed_tokens.weight"],
        "corelm.lm_head.weight": weights["lm_head.weight"],
        "corelm.head_emb.weight": weights["stream_embeddings.weight"][: layout.num_streams],
    }
    for key, tensor in sorted(weights.items()):
        if key.startswith("model.") and key != "model.embed_tokens.weight":
            state["corelm.decoders." + key] = tensor
    return state


def write_tiny_opuslm_export(out_dir: str | os.PathLike, seed: int = 0, family: str = "opuslm") -> dict[str, str]:
    """The tiny OpusLM of `seed` as an ESPnet experiment; returns the paths `speechlm-convert`
    takes (checkpoint, config, text_tokenizer, backbone_config, codec)."""
    fam = FAMILIES[family]
    text_vocab, merges = train_text_bpe(TINY_TEXT_VOCAB)
    layout = fam.layout(len(text_vocab))
    geo = BackboneGeometry(rope_theta=fam.rope_theta, rms_norm_eps=fam.rms_norm_eps)
    weights = random_weights(layout, geo, seed, fam.model_type)
    paths = {
        "checkpoint": os.path.join(out_dir, EXPORT_CHECKPOINT),
        "config": os.path.join(out_dir, ESPNET_EXPERIMENT_CONFIG),
        "backbone_config": os.path.join(out_dir, EXPORT_BACKBONE, "config.json"),
        "text_tokenizer": os.path.join(out_dir, EXPORT_BACKBONE, "tokenizer.json"),
        "codec": os.path.join(out_dir, "codec"),
    }
    os.makedirs(os.path.join(out_dir, EXPORT_BACKBONE), exist_ok=True)
    torch.save(espnet_corelm_state(weights, layout), paths["checkpoint"])
    with open(paths["config"], "w") as f:
        yaml.safe_dump(espnet_experiment_config(layout, text_vocab, geo.max_position_embeddings), f)
    backbone = text_backbone_config(layout, geo, fam.model_type, ESPNET_BACKBONE_ARCH[fam.model_type], len(text_vocab))
    with open(paths["backbone_config"], "w") as f:
        json.dump(backbone, f, indent=2, sort_keys=True)
    tiny_text_tokenizer().save(paths["text_tokenizer"])
    with open(os.path.join(out_dir, EXPORT_BACKBONE, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast"}, f)
    fam.write_codec(paths["codec"], seed)
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="speechlm-make-tiny", description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", required=True, choices=sorted(FAMILIES))
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--espnet-export", action="store_true",
                    help="write ESPnet's format instead (the input of speechlm-convert): bagpiper's export, "
                    "opuslm's experiment directory")
    args = ap.parse_args(argv)
    if args.espnet_export:
        if args.family == "bagpiper":
            write_tiny_bagpiper_export(args.out, args.seed)
        else:
            write_tiny_opuslm_export(args.out, args.seed, args.family)
        print(f"wrote a tiny ESPnet {args.family} export to {args.out}")
        return
    layout = make_tiny(args.family, args.out, args.seed)
    print(f"wrote tiny {args.family} checkpoint to {args.out} (vocab {layout.vocab_size}, {layout.num_streams} streams)")


if __name__ == "__main__":
    main()
