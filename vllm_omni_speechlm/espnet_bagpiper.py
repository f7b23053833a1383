"""ESPnet's Bagpiper export <-> the tensors of a checkpoint this project serves.

espnet2/speechlm/bin/export_checkpoint.py saves `{"module": model.state_dict()}` of the
`ParallelLLM` built by espnet2/speechlm/model/speechlm/lm/parallel.py: a transformers
Qwen3ForCausalLM subclass with the multimodal vocabulary, per-stream embeddings, the audio IOs and
the adaptors of the continuous ones. Its names, and what each becomes:

    ESPnet export                                            served checkpoint
    model.embed_tokens.weight, model.layers.{i}.*,           model.safetensors, same names
      model.norm.weight, lm_head.weight                        (Qwen3's Hugging Face names)
    stream_emb.weight [S, H]                                 stream_embeddings.weight, row 0 zero
    vocab_weight [V]                                         dropped (a training loss weight)
    adaptor.continuous_audio.{weight,bias}                   audio_adaptor.{weight,bias}
    multimodal_io_dict.continuous_audio.model.audio_tower.*  audio_tower.* (Qwen3-Omni's encoder;
                                                               shapes checked against its config)
    multimodal_io_dict.discrete_audio.codec_model.*          codec/model.safetensors: XcodecModel's
                                                               decoder tensors, same names

ESPnet adds `stream_emb[s]` to the hidden state before the LM head of stream s but forces row 0 to
zero at every use (`_step`, `_loss`); the served row 0 is that zero, whatever the export holds.
Decoding needs only X-Codec's quantizer codebooks, `fc2` and the acoustic decoder
(codec/xcodec.py); its acoustic encoder, semantic encoder/decoder, HuBERT, `fc` / `fc1` and the
codebooks' training statistics are dropped. Every export key is either mapped or dropped by name
here; any other key, a missing one or a shape that disagrees with the geometry is a ValueError
naming the export key.
"""

from __future__ import annotations

import re
from typing import Protocol

import torch

from vllm_omni_speechlm.codec.xcodec import XCodecDecoder, XCodecDecoderConfig, fold_weight_norm, decoder_source_key
from vllm_omni_speechlm.config import AUDIO_ADAPTOR_PREFIX, AUDIO_TOWER_PREFIX, AudioTowerSpec, SpeechLMConfig

STREAM_EMB = "stream_emb.weight"
VOCAB_WEIGHT = "vocab_weight"
ADAPTOR = "adaptor.continuous_audio."
AUDIO_TOWER = "multimodal_io_dict.continuous_audio.model.audio_tower."
CODEC = "multimodal_io_dict.discrete_audio.codec_model."
# XcodecModel parts that only encoding (or training) uses.
CODEC_ENCODE_ONLY = ("acoustic_encoder.", "encoder_semantic.", "decoder_semantic.", "semantic_model.", "fc.", "fc1.")
CODEBOOK_STATS = re.compile(r"quantizer\.quantizers\.\d+\.codebook\.(inited|cluster_size|embed_avg)$")
# The audio tower's last projection: its output width is the adaptor's input width.
AUDIO_TOWER_OUT = "proj2.weight"

_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)$")


class Geometry(Protocol):
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int


def _fail(message: str) -> ValueError:
    return ValueError(f"speechlm-convert: Bagpiper export: {message}")


def qwen3_shapes(layout: SpeechLMConfig, geo: Geometry) -> dict[str, tuple[int, ...]]:
    """Served LM tensor name -> shape, for a Qwen3 backbone of geometry `geo`."""
    h, i, d = geo.hidden_size, geo.intermediate_size, geo.head_dim
    q, kv = geo.num_attention_heads * d, geo.num_key_value_heads * d
    layer = {
        "input_layernorm.weight": (h,),
        "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h),
        "self_attn.k_proj.weight": (kv, h),
        "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (i, h),
        "mlp.up_proj.weight": (i, h),
        "mlp.down_proj.weight": (h, i),
    }
    shapes = {"model.embed_tokens.weight": (layout.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(geo.num_hidden_layers):
        shapes |= {f"model.layers.{n}.{name}": shape for name, shape in layer.items()}
    shapes["lm_head.weight"] = (layout.vocab_size, h)
    shapes["stream_embeddings.weight"] = (layout.num_streams, h)
    return shapes


def audio_tower_shapes(t: AudioTowerSpec) -> dict[str, tuple[int, ...]]:
    """Served audio tower tensor name -> shape (transformers' Qwen3OmniMoeAudioEncoder names)."""
    d, c, f = t.d_model, t.downsample_hidden_size, t.encoder_ffn_dim
    freq = t.num_mel_bins
    for _ in range(3):
        freq = (freq + 1) // 2  # the mel axis after three stride-2 convolutions
    shapes = {"conv2d1.weight": (c, 1, 3, 3), "conv2d1.bias": (c,), "conv_out.weight": (d, c * freq)}
    for n in (2, 3):
        shapes |= {f"conv2d{n}.weight": (c, c, 3, 3), f"conv2d{n}.bias": (c,)}
    shapes |= {"ln_post.weight": (d,), "ln_post.bias": (d,), "proj1.weight": (d, d), "proj1.bias": (d,)}
    shapes |= {"proj2.weight": (t.output_dim, d), "proj2.bias": (t.output_dim,)}
    layer = {f"self_attn.{p}_proj.{w}": (d, d) if w == "weight" else (d,) for p in "qkv" for w in ("weight", "bias")}
    layer |= {"self_attn.out_proj.weight": (d, d), "self_attn.out_proj.bias": (d,), "fc1.weight": (f, d), "fc1.bias": (f,)}
    layer |= {"fc2.weight": (d, f), "fc2.bias": (d,)}
    layer |= {f"{n}.{w}": (d,) for n in ("self_attn_layer_norm", "final_layer_norm") for w in ("weight", "bias")}
    for i in range(t.encoder_layers):
        shapes |= {f"layers.{i}.{k}": v for k, v in layer.items()}
    return {AUDIO_TOWER_PREFIX + k: v for k, v in shapes.items()}


def _served_name(key: str) -> str | None:
    """The served name of an LM or audio-input export key; None for codec and dropped keys."""
    if key == STREAM_EMB:
        return "stream_embeddings.weight"
    if key.startswith(ADAPTOR):
        return AUDIO_ADAPTOR_PREFIX + key[len(ADAPTOR) :]
    if key.startswith(AUDIO_TOWER):
        return AUDIO_TOWER_PREFIX + key[len(AUDIO_TOWER) :]
    if key.startswith(("model.", "lm_head.")):
        return key
    return None


def lm_weights(state: dict[str, torch.Tensor], layout: SpeechLMConfig, geo: Geometry) -> dict[str, torch.Tensor]:
    """The served model.safetensors tensors: the LM, its stream embeddings, the audio input."""
    expected = qwen3_shapes(layout, geo)
    tower = audio_tower_shapes(layout.audio_input.tower) if layout.audio_input is not None else {}
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name = _served_name(key)
        if name is None:
            continue
        if name.startswith(("model.", "lm_head.", "stream_embeddings.")):
            unknown = f"not a Qwen3 tensor of {geo.num_hidden_layers} layers"
            _check_shape(key, tensor, expected.get(name), unknown, "the geometry")
        elif name.startswith(AUDIO_TOWER_PREFIX):
            _check_shape(key, tensor, tower.get(name), "not a tensor of the audio tower config", "the audio tower config")
        out[name] = tensor
    missing = [n for n in [*expected, *tower] if n not in out]
    if missing:
        more = f" (+{len(missing) - 1} more)" if len(missing) > 1 else ""
        raise _fail(f"missing {_export_name(missing[0])!r}{more}")
    out["stream_embeddings.weight"] = out["stream_embeddings.weight"].clone()
    out["stream_embeddings.weight"][0] = 0.0  # ESPnet's stream 0 reads the hidden state as is
    _check_audio_input(out, geo.hidden_size)
    return {k: v.contiguous() for k, v in out.items()}


def _check_shape(key: str, tensor: torch.Tensor, shape: tuple[int, ...] | None, unknown: str, source: str) -> None:
    if shape is None:
        raise _fail(f"unexpected key {key!r} ({unknown})")
    if tuple(tensor.shape) != shape:
        raise _fail(f"{key} has shape {tuple(tensor.shape)}, {source} gives {shape}")


def _export_name(served: str) -> str:
    if served.startswith(AUDIO_TOWER_PREFIX):
        return AUDIO_TOWER + served[len(AUDIO_TOWER_PREFIX) :]
    return STREAM_EMB if served == "stream_embeddings.weight" else served


def _check_audio_input(weights: dict[str, torch.Tensor], hidden: int) -> None:
    """The adaptor maps the audio tower's output width to the LM's hidden size."""
    for name in ("weight", "bias"):
        if AUDIO_ADAPTOR_PREFIX + name not in weights:
            raise _fail(f"missing {ADAPTOR + name!r}")
    names = sorted(k[len(AUDIO_ADAPTOR_PREFIX) :] for k in weights if k.startswith(AUDIO_ADAPTOR_PREFIX))
    extra = [n for n in names if n not in ("weight", "bias")]
    if extra:
        raise _fail(f"unexpected key {ADAPTOR + extra[0]!r}")
    tower_out = weights.get(AUDIO_TOWER_PREFIX + AUDIO_TOWER_OUT)
    if tower_out is None:
        raise _fail(f"missing {AUDIO_TOWER + AUDIO_TOWER_OUT!r}")
    weight, bias = weights[AUDIO_ADAPTOR_PREFIX + "weight"], weights[AUDIO_ADAPTOR_PREFIX + "bias"]
    if tuple(weight.shape) != (hidden, tower_out.shape[0]) or tuple(bias.shape) != (hidden,):
        raise _fail(
            f"{ADAPTOR}weight/bias have shapes {tuple(weight.shape)}/{tuple(bias.shape)}: expected "
            f"({hidden}, {tower_out.shape[0]})/({hidden},) (the audio tower's output -> hidden size)"
        )


def codec_weights(state: dict[str, torch.Tensor], config: XCodecDecoderConfig) -> dict[str, torch.Tensor]:
    """The X-Codec decoder's tensors (XcodecModel names, weight norm folded), checked against
    `config`; the parts decoding does not use are dropped."""
    with torch.device("meta"):
        expected = {k: tuple(v.shape) for k, v in XCodecDecoder(config).state_dict().items()}
    raw: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        if not key.startswith(CODEC):
            continue
        name = key[len(CODEC) :]
        if name.startswith(CODEC_ENCODE_ONLY) or CODEBOOK_STATS.match(name):
            continue
        if decoder_source_key(name) not in expected:
            raise _fail(f"unexpected key {key!r} (not a part of transformers' XcodecModel)")
        raw[name] = tensor
    decoder = fold_weight_norm(raw)
    for name, shape in expected.items():
        if name not in decoder:
            raise _fail(f"missing {CODEC + name!r}")
        if tuple(decoder[name].shape) != shape:
            raise _fail(f"{CODEC + name} has shape {tuple(decoder[name].shape)}, the X-Codec config gives {shape}")
    return {k: v.contiguous() for k, v in decoder.items()}


def check_keys(state: dict[str, torch.Tensor]) -> None:
    """Every export key is one this module maps or drops on purpose."""
    for key in state:
        if _served_name(key) is None and key != VOCAB_WEIGHT and not key.startswith(CODEC):
            raise _fail(f"unexpected key {key!r}")


def check_vocab_weight(state: dict[str, torch.Tensor], layout: SpeechLMConfig) -> None:
    """Dropped, but its length is the export's vocabulary: one more check of the layout."""
    weight = state.get(VOCAB_WEIGHT)
    if weight is not None and tuple(weight.shape) != (layout.vocab_size,):
        raise _fail(f"{VOCAB_WEIGHT} has shape {tuple(weight.shape)}, the layout's vocabulary is {layout.vocab_size}")


def split_export(
    state: dict[str, torch.Tensor], layout: SpeechLMConfig, geo: Geometry, codec: XCodecDecoderConfig
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(served model.safetensors tensors, codec/model.safetensors tensors) of an export."""
    check_keys(state)
    weights = lm_weights(state, layout, geo)
    check_vocab_weight(state, layout)
    return weights, codec_weights(state, codec)


def export_state(weights: dict[str, torch.Tensor], codec_model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of `split_export`, for writing ESPnet-format exports in tests: served tensors
    plus a whole XcodecModel state dict -> the export's state dict (vocab_weight all ones)."""
    inverse = {"stream_embeddings.weight": STREAM_EMB}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.startswith(AUDIO_ADAPTOR_PREFIX):
            state[ADAPTOR + name[len(AUDIO_ADAPTOR_PREFIX) :]] = tensor
        elif name.startswith(AUDIO_TOWER_PREFIX):
            state[AUDIO_TOWER + name[len(AUDIO_TOWER_PREFIX) :]] = tensor
        else:
            state[inverse.get(name, name)] = tensor
    state[VOCAB_WEIGHT] = torch.ones(weights["lm_head.weight"].shape[0])
    state |= {CODEC + k: v for k, v in codec_model.items()}
    return state
