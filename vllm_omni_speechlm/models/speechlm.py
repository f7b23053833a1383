"""A delay-pattern speech LM as a vLLM model and vllm-omni AR stage (family-agnostic part).

Primary/auxiliary decomposition: the engine samples stream 0 like any token; the model samples
streams 1..S-1 in the same step. This class holds the layers (vLLM's backbone, the LM head, the
per-stream embeddings) and the vllm-omni runner hooks; the hooks hand each step to
`SpeechLMSteps` (steps.py), which keeps the per-request state and runs the step's device math.
The client sees the step's frames under `codes.audio` (frames.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
from vllm.model_executor.models.utils import AutoWeightsLoader, WeightsMapper, maybe_prefix

from vllm_omni_speechlm.config import AUDIO_INPUT_PREFIXES, SpeechLMConfig
from vllm_omni_speechlm.deploy_checks import check_parallelism
from vllm_omni_speechlm.frames import CODES_KEY
from vllm_omni_speechlm.models.steps import SpeechLMSteps
from vllm_omni_speechlm.models.tp_heads import aux_logits_sharded, aux_logits_unsharded, lm_head_aux_plan, tp_all_gather


class SpeechLMForCausalLM(nn.Module):
    """Subclasses set `make_backbone` (a vLLM decoder stack with `embed_input_ids`)."""

    # vllm-omni runner contract (no `has_preprocess`: the batched `prepare_runner_inputs`
    # replaces the runner's per-request preprocess loop)
    have_multimodal_outputs = True
    prefer_model_sampler = True
    requires_request_sample_eligibility = True
    skips_model_sampler_output_token_history = True
    omni_pooler_payload_include_hidden = False
    requires_full_prefix_cached_hidden_states = False
    omni_client_multimodal_output_keys = (CODES_KEY,)

    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    # A model without audio input drops a checkpoint's audio encoder and adaptor here, by name (any
    # other unknown weight still fails the load); one with it (bagpiper.py) loads them.
    hf_to_vllm_mapper = WeightsMapper(orig_to_new_prefix=dict.fromkeys(AUDIO_INPUT_PREFIXES))

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__()
        hf = vllm_config.model_config.hf_config
        self.speech = cfg = SpeechLMConfig.from_hf_config(hf)
        self._check_supported(vllm_config, cfg)
        self.model = self.make_backbone(vllm_config, maybe_prefix(prefix, "model"))
        self.lm_head = ParallelLMHead(hf.vocab_size, hf.hidden_size, prefix=maybe_prefix(prefix, "lm_head"))
        self.logits_processor = LogitsProcessor(hf.vocab_size)
        # This rank's part of the aux head under TP (on the model's device: vLLM builds the model
        # there); None with one rank, whose aux head is a view of the LM head's rows.
        self.aux_plan = lm_head_aux_plan(self.lm_head, cfg.streams[1].vocab_start, cfg.aux_stream_width, cfg.num_streams - 1)
        self.stream_embeddings = nn.Embedding(cfg.num_streams, hf.hidden_size)
        self.register_buffer("aux_start", torch.tensor([s.vocab_start for s in cfg.streams[1:]]), persistent=False)
        # The LM head's pad row, replicated on every rank (under TP only one holds it): the aux
        # streams' pad column under the delay rules (SpeechLMConfig.aux_sample_width).
        self.register_buffer("aux_pad_weight", torch.zeros(hf.hidden_size), persistent=False)
        # Summed aux-stream embeddings of each scheduled token, at a fixed address (CUDA graphs).
        tokens = vllm_config.scheduler_config.max_num_batched_tokens
        self.register_buffer("aux_input", torch.zeros(tokens, hf.hidden_size), persistent=False)
        # The backbone's input (stream 0 + aux streams), also at a fixed address: vLLM's piecewise
        # CUDA graphs (steps with prompt tokens) read their inputs where they were captured.
        self.register_buffer("backbone_input", torch.zeros(tokens, hf.hidden_size), persistent=False)
        self.steps = SpeechLMSteps(self, vllm_config)

    def make_backbone(self, vllm_config: VllmConfig, prefix: str) -> nn.Module:
        raise NotImplementedError

    @staticmethod
    def _check_supported(vllm_config: VllmConfig, cfg: SpeechLMConfig) -> None:
        # also at start-up (deploy_checks); here for any other path
        check_parallelism(vllm_config.parallel_config, vllm_config.model_config.hf_config.model_type)
        ends = [s.vocab_end for s in cfg.streams[1:-1]]
        if ends != [s.vocab_start for s in cfg.streams[2:]]:
            raise ValueError("speechlm config: stream_sizes: streams 1..S-1 must be adjacent in the vocabulary")

    # ---- layers -----------------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        return self.model.embed_input_ids(input_ids)

    def aux_embeds(self, aux: torch.Tensor) -> torch.Tensor:
        """[M, S-1] aux tokens -> [M, H] summed embeddings; pad (0) contributes zero."""
        emb = self.model.embed_input_ids(aux.reshape(-1).long()).view(*aux.shape, -1)
        keep = (aux != self.speech.specials.pad).to(emb.dtype)
        return (emb * keep[..., None]).sum(dim=1)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        **_: Any,
    ) -> torch.Tensor:
        # stream 0 (a multimodal model's runner embeds it, audio features included) plus the aux
        # streams staged by prepare_runner_inputs, summed into the fixed input buffer: a new tensor
        # there would leave a piecewise graph reading whatever now lies where it was captured
        # (vLLM's `cudagraph_copy_inputs` is off: its runner passes its own fixed buffers)
        if inputs_embeds is None:
            inputs_embeds = self.model.embed_input_ids(input_ids)
        n = inputs_embeds.shape[0]
        summed = torch.add(inputs_embeds, self.aux_input[:n], out=self.backbone_input[:n])
        return self.model(None, positions, intermediate_tensors, summed)

    def aux_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, S-1, W]: each aux stream projected on its own vocabulary slice only; under
        TP each rank projects the part its head shard holds, then one all-gather (tp_heads.py).
        Under the delay rules W has one more column, pad's (computed on every rank alike)."""
        cfg = self.speech
        aux_embeddings = self.stream_embeddings.weight[1:]
        if self.aux_plan is not None:
            logits = aux_logits_sharded(hidden, aux_embeddings, self.lm_head.weight, self.aux_plan, tp_all_gather)
        else:
            lo, hi, width = cfg.streams[1].vocab_start, cfg.streams[-1].vocab_end, cfg.aux_stream_width
            weight = self.lm_head.weight[lo:hi].view(cfg.num_streams - 1, width, -1)  # [S-1, W, H], a view
            logits = aux_logits_unsharded(hidden, aux_embeddings, weight)
        if cfg.aux_sample_width == cfg.aux_stream_width:
            return logits
        pad = (hidden[:, None, :] + aux_embeddings[None]) @ self.aux_pad_weight.to(hidden.dtype)  # [N, S-1]
        return torch.cat([logits, pad[..., None].to(logits.dtype)], dim=-1)

    def raw_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, H] -> [N, V] raw stream-0 logits."""
        if self.speech.primary_stream_embedding:
            hidden = hidden + self.stream_embeddings.weight[0]
        return self.logits_processor(self.lm_head, hidden)

    def _on_the_way(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterable[tuple[str, torch.Tensor]]:
        """The weights as the loader gets them, whole (under TP every rank sees the whole tensor
        here, before its shard is taken): the LM head's pad row is copied into `aux_pad_weight`,
        and the deferred eos's input embedding becomes the eos's (it is fed back as the eos it
        stands for, DecodingSpec), in the whole table, so the rank holding it gets it."""
        deferred = self.speech.decoding.deferred_eos
        for name, tensor in weights:
            if name == "lm_head.weight":
                self.aux_pad_weight.copy_(tensor[self.speech.specials.pad])
            elif name == "model.embed_tokens.weight" and deferred is not None:
                tensor = tensor.clone()
                tensor[deferred] = tensor[self.speech.specials.eos]
            yield name, tensor

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return AutoWeightsLoader(self).load_weights(self._on_the_way(weights), mapper=self.hf_to_vllm_mapper)

    # ---- vllm-omni runner hooks: each step is `SpeechLMSteps`' -------------------------------
    def prepare_runner_inputs(
        self,
        *,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        req_ids: list[str],
        num_computed_tokens: np.ndarray,
        num_scheduled_tokens: np.ndarray,
        input_ids_buffer: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A multimodal model's runner passes embeddings instead of ids (input_ids None)
        self.steps.prepare(input_ids if input_ids is not None else input_ids_buffer, req_ids, num_computed_tokens,
                           num_scheduled_tokens)
        return input_ids, positions

    def make_omni_output(self, model_outputs: torch.Tensor, **kwargs: Any) -> Any:
        from vllm_omni.model_executor.models.output_templates import OmniOutput

        codes = self.steps.output(model_outputs.device, **kwargs)
        return OmniOutput(text_hidden_states=model_outputs, multimodal_outputs={"codes": {"audio": codes}})

    def compute_logits(self, hidden_states: torch.Tensor, sampling_metadata: Any = None) -> torch.Tensor | None:
        return self.steps.logits(hidden_states)

    def sample(self, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        return self.steps.sample(logits, sampling_metadata)

    def on_requests_finished(self, finished_req_ids: set[str] | list[str]) -> None:
        self.steps.release(finished_req_ids)
