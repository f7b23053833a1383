"""Plain-PyTorch decoders (no vLLM, no transformers): the reference's backbones.

Three variants of one pre-LN/RoPE/SwiGLU stack, chosen by config.json's `model_type`:
  qwen3   per-head q/k RMSNorm, pre-norm layers (Bagpiper)
  olmo2   q/k RMSNorm over the whole projection (all heads), post-norm layers:
          x + norm(attn(x)), then + norm(mlp(.)) (`post_feedforward_layernorm`) (OpusLM 7B)
  llama   no q/k norm, pre-norm layers (SmolLM2: OpusLM-Dialogue)
Written for clarity and exactness, not speed: one concatenating KV cache, SDPA attention.
Parameter names are the Hugging Face checkpoint's (`model.layers.N.self_attn.q_proj.weight`, ...).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class BackboneConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rms_norm_eps: float
    model_type: str = "qwen3"

    @property
    def qk_norm(self) -> str:
        return {"qwen3": "head", "olmo2": "full"}.get(self.model_type, "none")

    @property
    def post_norm(self) -> bool:
        return self.model_type == "olmo2"

    @classmethod
    def from_json(cls, raw: dict) -> BackboneConfig:
        rope = raw.get("rope_parameters") or {}
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
        fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        return cls(
            **{k: raw[k] for k in fields},
            num_key_value_heads=raw.get("num_key_value_heads", raw["num_attention_heads"]),
            head_dim=head_dim,
            rope_theta=float(theta),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            model_type=raw.get("model_type", "qwen3"),
        )


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """Neox-style rotary embedding over the whole head_dim."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, L, d], positions [L] -> rotated x."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    def __init__(self, c: BackboneConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, self.heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * c.head_dim, c.hidden_size, bias=False)
        self.qk_norm = c.qk_norm
        if c.qk_norm != "none":
            full = c.qk_norm == "full"
            self.q_norm = RMSNorm(self.heads * c.head_dim if full else c.head_dim, c.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_heads * c.head_dim if full else c.head_dim, c.rms_norm_eps)

    def _project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, L, H] -> q [B, L, heads, d], k, v [B, L, kv_heads, d] (q/k normed)."""
        b, n, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.view(b, n, self.heads, self.head_dim), k.view(b, n, self.kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v.view(b, n, self.kv_heads, self.head_dim)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, rotary: Rotary, cache: list) -> torch.Tensor:
        """x [B, L, H]; `cache` is this layer's [k, v] ([B, kv_heads, past, d] or empty)."""
        b, n, _ = x.shape
        q, k, v = (t.transpose(1, 2) for t in self._project(x))
        q, k = rotary(q, positions), rotary(k, positions)
        if cache:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        cache[:] = [k, v]
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=n > 1, enable_gqa=self.heads != self.kv_heads, scale=1.0 / math.sqrt(self.head_dim)
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, n, self.heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, c: BackboneConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, c: BackboneConfig):
        super().__init__()
        self.post_norm = c.post_norm
        if not c.post_norm:
            self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        if c.post_norm:
            self.post_feedforward_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = MLP(c)

    def forward(self, x, positions, rotary, cache):
        if self.post_norm:  # OLMo-2
            x = x + self.post_attention_layernorm(self.self_attn(x, positions, rotary, cache))
            return x + self.post_feedforward_layernorm(self.mlp(x))
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderBackbone(nn.Module):
    """Embeddings + decoder layers + final norm. `forward` takes input embeddings (the speech LM
    sums several streams' embeddings per position) and returns final-normed hidden states."""

    def __init__(self, c: BackboneConfig):
        super().__init__()
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(c) for _ in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.head_dim, c.rope_theta)

    def new_cache(self) -> list[list]:
        return [[] for _ in self.layers]

    def forward(self, embeds: torch.Tensor, start_pos: int, cache: list[list]) -> torch.Tensor:
        """embeds [B, L, H] at positions start_pos.. -> hidden [B, L, H]."""
        positions = torch.arange(start_pos, start_pos + embeds.shape[1], device=embeds.device)
        x = embeds
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, positions, self.rotary, layer_cache)
        return self.norm(x)

