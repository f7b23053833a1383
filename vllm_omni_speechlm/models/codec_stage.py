"""Stage 1 of the two-stage pipelines: the codec decoder (X-Codec for Bagpiper, DAC for
OpusLM, from the checkpoint's `codec.type`) as a vllm-omni generation model.

Each scheduled request carries one window from stage_input_processors/speech_codec.py as its
prompt: flattened codebook indices `[T_win * Q]` (frame-major) plus `meta.left_context_size` /
`meta.right_holdback_size` in its runtime information. One forward decodes all windows of the
step in a few batched codec calls and returns per request only the new audio:
`[(T_win - left - holdback) * hop]` float32 at 16 kHz (DAC's last window is 8 samples short, as
its whole-clip decoding is: `codec/dac.py`), or at the rate the request asked for (`resample.py`:
each window resampled whole, then trimmed), reported as its `sr`. A streamed window lies inside
one audio segment; the whole-answer hand-off's single window lists its segments' lengths
(`meta.segment_frames`), and each segment is decoded (and resampled) on its own.

Shapes: a window is padded to a multiple of FRAME_BUCKET frames where padding leaves its new
frames' audio as it is: behind a lookahead of the codec's right reach (frames past the lookahead
cannot reach the kept ones), or else in front of a left context of its left reach (a short
lookahead's or a clip's end stays where it is: whole-clip decoding ends with zeros there). Each
call's batch is padded to a bucket size (`batch_bucket`). So the decoder meets a few shapes, which
vLLM's first dummy forward (its memory profile) decodes once each (`warm_up`): a shape's first
decode picks cuDNN algorithms and allocates, ~50-100 ms on an H100, which a listener would hear.
A window with neither (a segment's first windows with a short lookahead) keeps its length; the
dummy forward decodes the deployment's ramped first window at its own length too.

Weights: the codec checkpoint under `<model_dir>/<speechlm.codec.path>` (not the LM's
safetensors, which the engine's loader streams through `load_weights` and this stage drains).
The codec runs in float32 whatever the engine dtype: it is small next to the LM, and streaming
is checked against float32 whole-clip decoding.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from vllm_omni_speechlm import window_trace
from vllm_omni_speechlm.codec import load_codec_decoder
from vllm_omni_speechlm.codec.xcodec import fuse_snakes
from vllm_omni_speechlm.config import CODEC_FUSED_KEY, CODEC_GRAPHS_KEY, SpeechLMConfig
from vllm_omni_speechlm.models.codec_graphs import DecodeGraphs
from vllm_omni_speechlm.resample import requested_rate, resample
from vllm_omni_speechlm.streaming import max_window_ids, short_first_window_frames, window_settings

logger = logging.getLogger(__name__)


def _meta(info: Any, key: str) -> Any:
    meta = info.get("meta", {}) if isinstance(info, dict) else {}
    return meta.get(key) if isinstance(meta, dict) else None


def _meta_int(info: Any, key: str) -> int:
    value = _meta(info, key)
    if isinstance(value, list):  # scalars may arrive wrapped
        value = value[0] if value else None
    return 0 if value is None else int(value)


def _meta_ints(info: Any, key: str) -> list[int]:
    value = _meta(info, key)
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else []


FRAME_BUCKET = 16


def batch_bucket(n: int) -> int:
    """The batch a call of n windows runs at: a power of two up to 16, then a multiple of 16."""
    return 1 << (n - 1).bit_length() if n <= 16 else -(-n // 16) * 16


def frame_bucket(frames: int) -> int:
    return -(-frames // FRAME_BUCKET) * FRAME_BUCKET


def _cuda_switch(vllm_config: Any, key: str) -> bool:
    """Whether a CUDA-only speed-up of the decode is on: on CUDA unless `additional_config` sets
    `key: false`; asked for elsewhere, a warning and the plain eager decode."""
    switches = getattr(vllm_config, "additional_config", None)
    asked = switches.get(key) if isinstance(switches, dict) else None
    if asked is not None and not isinstance(asked, bool):
        raise ValueError(f"additional_config.{key}: expected true or false, got {asked!r}")
    device = vllm_config.device_config.device
    if torch.device(device).type == "cuda":
        return asked is not False
    if asked:
        logger.warning("codec stage: %s needs CUDA; decoding eagerly on %s", key, device)
    return False


class SpeechLMCodecDecoder(nn.Module):
    """Generation-stage codec decoder (decoder path only)."""

    have_multimodal_outputs = True
    has_preprocess = False
    has_postprocess = False
    requires_raw_input_tokens = True

    def __init__(self, *, vllm_config: Any, prefix: str = "") -> None:
        super().__init__()
        self._setup(vllm_config.model_config.model, vllm_config.device_config.device)
        model_config = vllm_config.model_config
        extra = (getattr(model_config, "stage_connector_config", None) or {}).get("extra") or {}
        # The shapes a streamed window can take (async_chunk), warmed by the first dummy forward.
        sched = vllm_config.scheduler_config
        settings = window_settings(extra)
        own = short_first_window_frames(settings)
        self._warm_shapes = (
            (sched.max_num_seqs, max_window_ids(settings, self.num_quantizers) // self.num_quantizers,
             sched.max_num_batched_tokens, (own,) if own else ()) if getattr(model_config, "async_chunk", False) else None
        )
        if _cuda_switch(vllm_config, CODEC_FUSED_KEY):
            fuse_snakes(self.codec)
        if _cuda_switch(vllm_config, CODEC_GRAPHS_KEY):
            self._graphs = DecodeGraphs(self.codec.decode)

    @classmethod
    def from_model_dir(cls, model_dir: str, device: str | torch.device = "cpu", graphs: bool = False,
                       fused: bool = False) -> SpeechLMCodecDecoder:
        """The same stage model outside an engine (tests, tools); `graphs`: decode on CUDA graphs
        of the shapes `warm_up` meets; `fused`: the Snake activations as one kernel each
        (`fuse_snakes`)."""
        model = cls.__new__(cls)
        nn.Module.__init__(model)
        model._setup(model_dir, device)
        if fused:
            fuse_snakes(model.codec)
        model._graphs = DecodeGraphs(model.codec.decode) if graphs else None
        return model

    def _setup(self, model_dir: str, device: str | torch.device) -> None:
        self.cfg = SpeechLMConfig.from_model_dir(model_dir)
        self.codec = load_codec_decoder(self.cfg.codec, model_dir, device=device)
        self.num_quantizers = self.codec.config.num_quantizers
        self.hop = self.codec.config.hop_length
        self.sample_rate = self.codec.config.sample_rate
        self.left_reach, self.right_reach = self.codec.config.receptive_field_frames
        self._warm_shapes: tuple[int, int, int, tuple[int, ...]] | None = None  # (windows, frames, codes a step, own lengths)
        self._graphs: DecodeGraphs | None = None

    def warm_up(self, max_batch: int, max_frames: int, max_ids: int, own_frames: tuple[int, ...] = ()) -> int:
        """Decode once every (batch bucket, frame bucket) a streamed window can meet: up to
        `max_batch` windows of up to `max_frames`, at most `max_ids` codes a step, and the
        `own_frames` lengths of windows decoded unpadded (the deployment's short first lookahead)
        -> shapes."""
        device = next(self.codec.parameters()).device
        lengths = [*range(FRAME_BUCKET, frame_bucket(max_frames) + 1, FRAME_BUCKET), *own_frames]
        shapes = [(b, t) for b in sorted({batch_bucket(n) for n in range(1, max_batch + 1)}) for t in lengths
                  if batch_bucket(max(1, max_ids // (t * self.num_quantizers))) >= b]
        if self._graphs is not None:  # recording decodes each shape once before its capture
            try:
                seconds = self._graphs.record([(b, self.num_quantizers, t) for b, t in shapes], device)
            except Exception:  # the decode stays correct eagerly; the stage keeps running
                logger.exception("codec stage: recording the decode graphs failed; decoding eagerly")
                self._graphs = None
            else:
                logger.info("codec stage: %d decode graphs recorded in %.1f s", len(self._graphs), seconds)
                return len(shapes)
        for b, t in shapes:
            self.codec.decode(torch.zeros((b, self.num_quantizers, t), dtype=torch.long, device=device))
        return len(shapes)

    # ---- engine hooks ---------------------------------------------------------------------
    def embed_input_ids(self, input_ids: torch.Tensor, **_: Any) -> torch.Tensor:
        # The runner asks for embeddings; this stage reads the ids themselves.
        return torch.zeros((input_ids.shape[0], 1), device=input_ids.device, dtype=torch.float32)

    def compute_logits(self, hidden_states: Any, sampling_metadata: Any = None) -> None:
        return None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        for _ in weights:  # the LM's tensors; the codec was loaded from its own checkpoint
            pass
        return {name for name, _ in self.named_parameters()}

    # ---- decode ---------------------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
        intermediate_tensors: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        runtime_additional_information: list[dict[str, Any]] | None = None,
        **kwargs: Any,
    ) -> Any:
        """input_ids: [sum_i T_i * Q] windows back to back; seq_token_counts: [T_i * Q] per request."""
        from vllm_omni.model_executor.models.output_templates import OmniOutput

        ids = input_ids.reshape(-1) if input_ids is not None else torch.zeros(0, dtype=torch.long)
        counts = list(kwargs.get("seq_token_counts") or [int(ids.numel())])
        ids = ids[: sum(counts)]  # vLLM pads a step's tokens to a CUDA-graph size past the windows
        infos = list(runtime_additional_information or [])
        if not infos and self._warm_shapes is not None and not _capturing(ids):  # vLLM's dummy forward
            shapes, self._warm_shapes = self._warm_shapes, None
            logger.info("codec stage: %d window shapes decoded once", self.warm_up(*shapes))
        infos += [{}] * (len(counts) - len(infos))
        windows = [w[: w.numel() - w.numel() % self.num_quantizers] for w in torch.split(ids, counts)]
        started = time.time() if window_trace.ENABLED else 0.0
        audio = self.decode_windows(windows, infos)
        if window_trace.ENABLED and not _capturing(ids):
            if ids.is_cuda:  # diagnosis only: waits for the decode
                torch.cuda.synchronize(ids.device)
            window_trace.log_forward(infos, started, sum(w.numel() for w in windows) // self.num_quantizers)
        sr = [torch.tensor(requested_rate(info, self.sample_rate), dtype=torch.int32) for info in infos]
        return OmniOutput(text_hidden_states=None, multimodal_outputs={"model_outputs": audio, "sr": sr})

    def decode_windows(self, windows: list[torch.Tensor], infos: list[dict]) -> list[torch.Tensor]:
        """windows[i]: [T_i * Q] frame-major codes -> [(T_i - left_i - holdback_i) * hop_i] new audio
        (hop_i: samples per frame at the request's rate). A window of several audio segments
        (`meta.segment_frames`: the whole-answer hand-off) is decoded segment by segment, back to
        back: codec context never crosses a segment's edge."""
        pieces = [(i, *piece) for i, (w, info) in enumerate(zip(windows, infos)) for piece in self._segments(w, info)]
        audio = self._decode_pieces([p[1:] for p in pieces])
        out: list[list[torch.Tensor]] = [[] for _ in windows]
        for (i, *_), wav in zip(pieces, audio):
            out[i].append(wav)
        return [torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32) for parts in out]

    def _segments(self, window: torch.Tensor, info: dict) -> list[tuple[torch.Tensor, int, int, int]]:
        """(codes [T_j, Q], left context, holdback, output rate) per segment of a window; the
        window's left context belongs to its first segment, its holdback to its last."""
        codes = window.reshape(-1, self.num_quantizers)
        if not codes.shape[0]:
            return []
        frames = _meta_ints(info, "segment_frames") or [codes.shape[0]]
        if sum(frames) != codes.shape[0] or min(frames) < 1:
            raise ValueError(f"codec stage: meta.segment_frames {frames} do not split a window of {codes.shape[0]} frames")
        parts = codes.split(frames)
        last = len(parts) - 1
        left, holdback = _meta_int(info, "left_context_size"), _meta_int(info, "right_holdback_size")
        rate = requested_rate(info, self.sample_rate)
        return [(c, left if j == 0 else 0, holdback if j == last else 0, rate) for j, c in enumerate(parts)]

    def _decode_pieces(self, pieces: list[tuple[torch.Tensor, int, int, int]]) -> list[torch.Tensor]:
        """Decode (codes [T, Q], left, holdback, rate) pieces, those of one (bucketed) length and
        rate in one batched call; keep each piece's new audio."""
        out: list[torch.Tensor] = [torch.zeros(0, dtype=torch.float32)] * len(pieces)
        padded = [self._bucketed(codes, left, holdback) for codes, left, holdback, _ in pieces]
        groups: dict[tuple[int, int], list[int]] = {}
        for i, ((codes, _), (*_, rate)) in enumerate(zip(padded, pieces)):
            groups.setdefault((codes.shape[0], rate), []).append(i)
        for (_, rate), idx in groups.items():
            rows = [padded[i][0] for i in idx]
            batch = torch.stack(rows + rows[:1] * (batch_bucket(len(rows)) - len(rows)))  # [B, T, Q]
            # The processor clamps to [0, codebook_size); clamp again so a stray id (a dummy run)
            # cannot index out of the codebooks.
            batch = batch.clamp(0, self.codec.config.codebook_size - 1).transpose(1, 2)  # [B, Q, T]
            # The whole window, context included: the filter reaches across the kept edges.
            decode = self._graphs if self._graphs is not None else self.codec.decode
            wav = resample(decode(batch).float(), self.sample_rate, rate)  # [B, ~T * hop]
            hop = self.hop * rate // self.sample_rate
            for row, i in enumerate(idx):
                (codes, left, holdback, _), front = pieces[i], padded[i][1]
                out[i] = self._trim(wav[row], front + codes.shape[0], front + left, holdback, hop)
        return out

    def _bucketed(self, codes: torch.Tensor, left: int, holdback: int) -> tuple[torch.Tensor, int]:
        """(codes padded to their frame bucket, frames padded in front), padded where the new
        frames' audio stays the same: behind a lookahead of the codec's right reach, or else in
        front of a left context of its left reach (a short lookahead's end, a clip's end). A window
        with neither decodes at its own length."""
        frames = frame_bucket(codes.shape[0])
        if holdback > 0 and holdback >= self.right_reach:
            return _pad_frames(codes, frames), 0
        if left >= self.left_reach and frames > codes.shape[0]:
            front = frames - codes.shape[0]
            return torch.cat([codes[:1].expand(front, -1), codes]), front
        return codes, 0

    @staticmethod
    def _trim(wav: torch.Tensor, num_frames: int, left: int, holdback: int, hop: int) -> torch.Tensor:
        """Keep the new frames: drop left context and right holdback (counted in frames: a
        decoder may return a few samples less than T * hop at the clip's end)."""
        start = left * hop
        end = min(wav.shape[-1], (num_frames - holdback) * hop)
        return wav[start:max(start, end)].contiguous()


def _pad_frames(codes: torch.Tensor, frames: int) -> torch.Tensor:
    """[T, Q] codes -> [frames, Q], the last frame repeated (any codes do: past the lookahead)."""
    return torch.cat([codes, codes[-1:].expand(frames - codes.shape[0], -1)]) if frames > codes.shape[0] else codes


def _capturing(ids: torch.Tensor) -> bool:
    return ids.is_cuda and torch.cuda.is_current_stream_capturing()


BagpiperCodecDecoder = SpeechLMCodecDecoder  # the architecture name Bagpiper's pipelines use
SpeechLMCodecDecoderForGeneration = SpeechLMCodecDecoder
BagpiperCodecDecoderForGeneration = SpeechLMCodecDecoder
