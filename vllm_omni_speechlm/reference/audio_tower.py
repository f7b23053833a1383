"""The Qwen3-Omni audio encoder in plain PyTorch (the reference's; no transformers, no vLLM).

One clip at a time, as ESPnet runs transformers' encoder for one request: the log-mel is cut in
chunks of 2 * n_window frames, the chunks are right-padded to the longest one (a clip of one
chunk is not padded), three stride-2 convolutions and a linear layer give each chunk's rows plus
sinusoidal positions, the rows of all chunks are concatenated, and the transformer layers attend
within windows of n_window_infer mel frames' worth of rows. Parameter names are transformers'
(`conv2d1`, `layers.0.self_attn.q_proj`, `ln_post`, `proj2`, ...).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from vllm_omni_speechlm.config import AudioTowerSpec, conv_output_length


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> torch.Tensor:
    """[length, channels] sin | cos positions (Whisper's)."""
    increment = math.log(max_timescale) / (channels // 2 - 1)
    inv = torch.exp(-increment * torch.arange(channels // 2).float())
    scaled = torch.arange(length)[:, None] * inv[None, :]
    return torch.cat([scaled.sin(), scaled.cos()], dim=1)


class Attention(nn.Module):
    def __init__(self, t: AudioTowerSpec):
        super().__init__()
        self.heads = t.encoder_attention_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(t.d_model, t.d_model) for _ in range(4))

    def forward(self, x: torch.Tensor, window: int) -> torch.Tensor:
        """x [L, d]; attention within consecutive windows of `window` rows (the last shorter)."""
        n, d = x.shape
        q, k, v = (p(x).view(n, self.heads, d // self.heads).transpose(0, 1) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = [F.scaled_dot_product_attention(*(t[:, s : s + window] for t in (q, k, v))) for s in range(0, n, window)]
        return self.out_proj(torch.cat(out, dim=1).transpose(0, 1).reshape(n, d))


class EncoderLayer(nn.Module):
    def __init__(self, t: AudioTowerSpec):
        super().__init__()
        self.self_attn = Attention(t)
        self.self_attn_layer_norm = nn.LayerNorm(t.d_model)
        self.fc1 = nn.Linear(t.d_model, t.encoder_ffn_dim)
        self.fc2 = nn.Linear(t.encoder_ffn_dim, t.d_model)
        self.final_layer_norm = nn.LayerNorm(t.d_model)

    def forward(self, x: torch.Tensor, window: int) -> torch.Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x), window)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class AudioTower(nn.Module):
    def __init__(self, t: AudioTowerSpec):
        super().__init__()
        if t.activation_function != "gelu":
            raise ValueError(f"audio_input.tower.activation_function: only gelu is modelled, got {t.activation_function!r}")
        self.spec = t
        c = t.downsample_hidden_size
        self.conv2d1 = nn.Conv2d(1, c, 3, 2, padding=1)
        self.conv2d2 = nn.Conv2d(c, c, 3, 2, padding=1)
        self.conv2d3 = nn.Conv2d(c, c, 3, 2, padding=1)
        freq = conv_output_length(t.num_mel_bins)
        self.conv_out = nn.Linear(c * freq, t.d_model, bias=False)
        self.layers = nn.ModuleList(EncoderLayer(t) for _ in range(t.encoder_layers))
        self.ln_post = nn.LayerNorm(t.d_model)
        self.proj1 = nn.Linear(t.d_model, t.d_model)
        self.proj2 = nn.Linear(t.d_model, t.output_dim)
        self.register_buffer("positions", sinusoids(t.max_source_positions, t.d_model), persistent=False)

    def forward(self, mel: torch.Tensor) -> torch.Tensor:
        """[mel bins, T] -> [rows, output_dim]."""
        chunks = mel.split(self.spec.chunk_frames, dim=1)
        width = max(c.shape[1] for c in chunks)
        x = torch.stack([F.pad(c, (0, width - c.shape[1])) for c in chunks])[:, None]  # [C, 1, mels, width]
        for conv in (self.conv2d1, self.conv2d2, self.conv2d3):
            x = F.gelu(conv(x))
        n, c, f, t = x.shape
        x = self.conv_out(x.permute(0, 3, 1, 2).reshape(n, t, c * f)) + self.positions[:t].to(x.dtype)
        h = torch.cat([x[i, : conv_output_length(chunk.shape[1])] for i, chunk in enumerate(chunks)])
        # transformers sizes the windows by the longest chunk's rows (so does vLLM's encoder)
        window = conv_output_length(width) * (self.spec.n_window_infer // self.spec.chunk_frames)
        for layer in self.layers:
            h = layer(h, window)
        return self.proj2(F.gelu(self.proj1(self.ln_post(h))))
