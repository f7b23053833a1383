"""Single-stage fused mode: the speech LM stage decodes each finished clip with the codec itself.

The published deployment of these models: no codec stage, no connector. The AR worker runs the
speech LM exactly as `SpeechLMForCausalLM` does and, in the step where a request ends, de-interleaves
each audio segment of that request's answer and decodes it on its own with the checkpoint's codec
(`<model_dir>/codec`, float32) in the same worker, the segments' audio back to back. The clip goes to the client in that step's multimodal output under
`audio` ([T * hop] float32, 16 kHz for X-Codec) with `sr`; `codes.audio` still comes too.

Which requests end in a step is decided on the host from the step's sampled stream-0 tokens
(the engine's stop rules: `<|eos|>`, `max_tokens`, `max_model_len`). Those tokens are already copied
to the host once per step for `codes.audio`; the fused stage waits for that copy in `sample`. With
async scheduling off (stage_configs/bagpiper_fused.yaml) the runner waits for the same step's
sampled ids right after `sample` anyway, so this adds no stall, only moves it earlier.

Not supported: `ignore_eos=True` requests (the model cannot see that flag; such a request's clip
would be decoded at its first eos and again at its end).

Stream 0's history is kept per slot on the device (streams 1..S-1 already are, in the request
table), so a finishing request's [L, S] rows are one gather: nothing is accumulated on the host.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from vllm.config import VllmConfig

from vllm_omni_speechlm.codec import decode_segments, load_codec_decoder
from vllm_omni_speechlm.compat import stops_after
from vllm_omni_speechlm.delay_pattern import audio_segments
from vllm_omni_speechlm.models.bagpiper import BagpiperForCausalLM
from vllm_omni_speechlm.models.request_state import to_device

CODEC_PREFIX = "codec."


class FusedCodecDecoding:
    """Mixin over a `SpeechLMForCausalLM` subclass: decode finished clips in the worker."""

    omni_client_multimodal_output_keys = ("codes.audio", "audio", "sr")

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        model_dir = vllm_config.model_config.model
        device = vllm_config.device_config.device
        self.codec = load_codec_decoder(self.speech.codec, model_dir, device=device)
        self._max_model_len = vllm_config.model_config.max_model_len
        self._stream0_history: torch.Tensor | None = None  # [slots, max_output_len] int32
        self._step_multimodal: dict | None = None
        self.num_decoded_clips = 0  # observability, tests

    # ---- per-step bookkeeping ---------------------------------------------------------------
    def make_omni_output(self, model_outputs: torch.Tensor, **kwargs: Any) -> Any:
        out = super().make_omni_output(model_outputs, **kwargs)
        # The runner flattens this dict only after `sample`, which adds the finished clips to it.
        self._step_multimodal = out.multimodal_outputs
        return out

    def _history(self) -> torch.Tensor:
        table, _ = self.steps.state()
        hist = self._stream0_history
        if hist is None or hist.shape[0] != table.capacity:  # first use, or the table grew
            new = torch.zeros(table.capacity, table.max_output_len, dtype=torch.int32, device=table.device)
            if hist is not None:
                new[: hist.shape[0]] = hist
            self._stream0_history = hist = new
        return hist

    def sample(self, logits: torch.Tensor, sampling_metadata: Any) -> Any:
        step = self.steps.rows
        decoding = step.sampled is not None or step.graphed  # else profiling / warm-up
        out = super().sample(logits, sampling_metadata)
        if not decoding:
            return out
        rows = np.flatnonzero(step.samples)  # not partial prefill chunks
        token = out.sampled_token_ids[:, 0]
        if rows.size < token.shape[0]:
            token = token[to_device(rows, token.device)]
        generated = step.generated[rows]
        index = to_device(np.stack([step.slots[rows], generated]), token.device)
        self._history()[index[0], index[1]] = token.to(torch.int32)
        ending = self._ending_rows(rows.tolist(), generated.tolist(), token.device)
        if ending:
            self._emit_clips(ending, len(step.entries))
        return out

    def _ending_rows(self, rows: list[int], generated: list[int], device: torch.device) -> list[tuple[int, int]]:
        """(row, tokens generated) of the rows whose request the engine stops after this step."""
        if not rows:
            return []
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the host copy queued in sample
        token0 = self.steps.frames_host[rows, 0]  # host tensor: no device read
        entries = [self.steps.rows.entries[i] for i in rows]
        count = torch.tensor(generated) + 1  # outputs after this step's token
        length = torch.tensor([e.prompt_len for e in entries]) + count
        max_tokens = torch.tensor([e.params.max_tokens for e in entries])
        # A CFG companion ends with its main request; its output never reaches anyone: no clip.
        main = torch.tensor([e.guided_by is None for e in entries])
        ends = main & stops_after(token0, length, count, max_tokens, self._max_model_len, self.speech.specials.eos)
        return [(rows[j], generated[j] + 1) for j in torch.nonzero(ends).flatten().tolist()]

    @torch.inference_mode()
    def _emit_clips(self, ending: list[tuple[int, int]], num_rows: int) -> None:
        table, _ = self.steps.state()
        hist = self._history()
        empty = torch.zeros(0, dtype=torch.float32)
        audio = [empty] * num_rows
        for row, length in ending:
            slot = self.steps.rows.entries[row].slot
            tokens = torch.cat([hist[slot, :length, None], table.aux_history[slot, :length]], dim=1).long()
            clip = decode_segments(self.codec, audio_segments(tokens, self.speech))  # None: no audio in this answer
            if clip is not None:
                audio[row] = clip.float().cpu()
                self.num_decoded_clips += 1
        sr = torch.tensor(self.codec.sample_rate, dtype=torch.int32)
        self._step_multimodal["audio"] = audio
        self._step_multimodal["sr"] = [sr] * num_rows

    # ---- weights ------------------------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded = super().load_weights(weights)
        # The codec came from its own checkpoint in __init__; the LM's has none of its tensors.
        return loaded | {CODEC_PREFIX + name for name, _ in self.codec.named_parameters()}


class BagpiperFusedForCausalLM(FusedCodecDecoding, BagpiperForCausalLM):
    """Bagpiper with the X-Codec decoder in the AR worker (pipeline `bagpiper_fused`)."""
