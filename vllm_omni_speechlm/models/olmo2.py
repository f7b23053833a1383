"""OLMo-2 decoder stack on vLLM's layers (vLLM 0.30 serves Olmo2 only via its Transformers
backend, which cannot host a speech LM's heads and hooks).

OLMo-2 differs from Llama in two places: q/k RMSNorm over the whole projection (all heads, before
the head split and RoPE), and post-norm residuals: `x + norm(attn(x))`, then `+ norm(mlp(.))`.
Parameter names are the Hugging Face checkpoint's; q/k/v and gate/up load into vLLM's fused
projections. Tensor parallelism is refused for this backbone (deploy_checks.py), so the
q/k norms see the whole projection without a gather.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from vllm.compilation.decorators import support_torch_compile
from vllm.config import VllmConfig
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import QKVParallelLinear, RowParallelLinear
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
from vllm.model_executor.model_loader.weight_utils import default_weight_loader
from vllm.model_executor.models.llama import LlamaMLP


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Olmo2Attention(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, _head_dim(config)
        self.q_size, self.kv_size = heads * head_dim, kv_heads * head_dim
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size, head_dim, heads, kv_heads, bias=False, prefix=f"{prefix}.qkv_proj"
        )
        self.q_norm = RMSNorm(self.q_size, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.kv_size, eps=config.rms_norm_eps)
        self.o_proj = RowParallelLinear(self.q_size, config.hidden_size, bias=False, prefix=f"{prefix}.o_proj")
        self.rotary_emb = get_rope(
            head_dim,
            max_position=getattr(config, "max_position_embeddings", 4096),
            rope_parameters=config.rope_parameters,
            is_neox_style=True,
        )
        self.attn = Attention(
            heads,
            head_dim,
            head_dim**-0.5,
            num_kv_heads=kv_heads,
            cache_config=vllm_config.cache_config,
            prefix=f"{prefix}.attn",
        )

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, self.q_norm(q.contiguous()), self.k_norm(k.contiguous()))
        out, _ = self.o_proj(self.attn(q, k, v))
        return out


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, vllm_config: VllmConfig, prefix: str) -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.self_attn = Olmo2Attention(vllm_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(
            config.hidden_size, config.intermediate_size, config.hidden_act, prefix=f"{prefix}.mlp"
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.post_attention_layernorm(self.self_attn(positions, hidden_states))
        return hidden_states + self.post_feedforward_layernorm(self.mlp(hidden_states))


@support_torch_compile(dynamic_arg_dims={"input_ids": 0, "positions": -1, "inputs_embeds": 0})
class Olmo2Model(nn.Module):
    # checkpoint name -> (fused parameter, shard id)
    stacked_params_mapping = (
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    )

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        config = vllm_config.model_config.hf_config
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, prefix=f"{prefix}.embed_tokens")
        self.layers = nn.ModuleList(
            Olmo2DecoderLayer(vllm_config, f"{prefix}.layers.{i}") for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden_states = inputs_embeds if inputs_embeds is not None else self.embed_input_ids(input_ids)
        for layer in self.layers:
            hidden_states = layer(positions, hidden_states)
        return self.norm(hidden_states)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            for fused, part, shard in self.stacked_params_mapping:
                if part in name:
                    target = name.replace(part, fused)
                    param = params[target]
                    param.weight_loader(param, tensor, shard)
                    break
            else:
                target = name
                param = params[target]
                getattr(param, "weight_loader", default_weight_loader)(param, tensor)
            loaded.add(target)
        return loaded
