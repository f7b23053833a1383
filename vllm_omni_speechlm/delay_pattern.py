"""MusicGen delay pattern: S parallel codec streams, stream s shifted right by s frames.

A clip of T frames, `aligned[T, S]`, becomes `interleaved[T + S - 1, S]` with
`interleaved[t + s, s] = aligned[t, s]`; the first s rows and the last S-1-s rows of stream s are
padding. All functions take any number of leading batch dimensions.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from vllm_omni_speechlm.config import SpeechLMConfig


@functools.lru_cache(maxsize=256)
def _delay_index(num_frames: int, num_streams: int, device: torch.device) -> torch.Tensor:
    """[T, S] row index into the interleaved matrix: t + s (cached: streaming cuts a window with
    it on every hand-over; read only)."""
    t = torch.arange(num_frames, device=device)[:, None]
    s = torch.arange(num_streams, device=device)[None, :]
    return t + s


def interleave(aligned: torch.Tensor, pad: torch.Tensor | int) -> torch.Tensor:
    """[..., T, S] -> [..., T + S - 1, S]; `pad` is a scalar or a per-stream [S] tensor."""
    *batch, num_frames, num_streams = aligned.shape
    if num_frames < 1 or num_streams < 1:
        raise ValueError(f"interleave needs T >= 1 and S >= 1, got shape {tuple(aligned.shape)}")
    pad = torch.as_tensor(pad, dtype=aligned.dtype, device=aligned.device)
    out = pad.expand(*batch, num_frames + num_streams - 1, num_streams).clone()
    index = _delay_index(num_frames, num_streams, aligned.device).expand_as(aligned)
    return out.scatter_(-2, index, aligned)


def deinterleave(interleaved: torch.Tensor) -> torch.Tensor:
    """[..., T + S - 1, S] -> [..., T, S]: `aligned[:, s] = interleaved[s : s + T, s]`."""
    *batch, num_rows, num_streams = interleaved.shape
    num_frames = num_rows - num_streams + 1
    if num_streams < 1 or num_frames < 1:
        raise ValueError(f"deinterleave needs >= S rows, got shape {tuple(interleaved.shape)}")
    index = _delay_index(num_frames, num_streams, interleaved.device)
    return interleaved.gather(-2, index.expand(*batch, num_frames, num_streams))


def num_complete_frames(num_rows: int, num_streams: int) -> int:
    """Frames whose S streams have all been emitted after `num_rows` interleaved rows."""
    return max(0, num_rows - num_streams + 1)


class CodebookMap:
    """Unified token ids <-> per-stream codebook indices, for a [..., S] tensor of streams.

    Token -> code is clamped to [0, codebook_size) so that pad slots decode as code 0, the way
    the released decoders treat them.
    """

    def __init__(self, cfg: SpeechLMConfig, device: torch.device | str = "cpu"):
        specs = cfg.streams
        self.offsets = torch.tensor([s.code_offset for s in specs], device=device)
        self.sizes = torch.tensor([s.codebook_size for s in specs], device=device)
        self.pads = torch.tensor([s.pad_id for s in specs], device=device)

    def to_codes(self, tokens: torch.Tensor) -> torch.Tensor:
        codes = tokens - self.offsets.to(tokens.device)
        return torch.minimum(codes.clamp_min(0), self.sizes.to(tokens.device) - 1)

    def to_tokens(self, codes: torch.Tensor) -> torch.Tensor:
        sizes = self.sizes.to(codes.device)
        if bool(((codes < 0) | (codes >= sizes)).any()):
            raise ValueError("codes outside [0, codebook_size) of their stream")
        return codes + self.offsets.to(codes.device)


@functools.lru_cache(maxsize=16)
def _codebook_map(cfg: SpeechLMConfig, device: torch.device) -> CodebookMap:
    return CodebookMap(cfg, device)


def audio_rows(tokens: torch.Tensor | np.ndarray, cfg: SpeechLMConfig) -> torch.Tensor | np.ndarray:
    """[L, S] generated stream tokens (a tensor or a host array) -> [L] bool: the rows of the
    interleaved audio matrix.

    Rows whose stream 0 is a codec token (the audio-row mask allows nothing else there, so text
    rows and Bagpiper's final eos row are False). A drain family (`DecodingSpec.drain`) adds its
    (deferred) eos row and drain rows while some stream still carries a frame: their stream 0 is
    a special but an aux stream is not pad (text and forced rows have all aux streams pad), so
    the last, all-pad drain row and the final eos drop out and T + S - 1 rows remain."""
    s0 = cfg.streams[0]
    rows = (tokens[:, 0] >= s0.vocab_start) & (tokens[:, 0] < s0.vocab_end)
    if cfg.decoding.drain:
        rows |= (tokens[:, 1:] != cfg.specials.pad).any(1)
    return rows


def segment_codes(rows: torch.Tensor, cfg: SpeechLMConfig) -> torch.Tensor | None:
    """[n, S] rows of one audio segment (all audio rows) -> [T, Q] codebook indices of its codec
    streams, or None (fewer than S rows); T = n - (S - 1)."""
    if rows.shape[0] < cfg.num_streams:
        return None
    aligned = _codebook_map(cfg, rows.device).to_codes(deinterleave(rows))
    return aligned[:, -cfg.codec.num_quantizers :]


def host_segment_codes(rows: np.ndarray, cfg: SpeechLMConfig) -> np.ndarray | None:
    """`segment_codes` of host rows, in numpy (the same cached index and codebook map): the chunk
    processor cuts a window with it on the save thread, where each small torch op would hand the
    interpreter lock to the scheduler's thread and wait to get it back."""
    if rows.shape[0] < cfg.num_streams:
        return None
    cpu = torch.device("cpu")
    index = _delay_index(rows.shape[0] - cfg.num_streams + 1, cfg.num_streams, cpu).numpy()
    cmap = _codebook_map(cfg, cpu)
    codes = np.take_along_axis(rows, index, axis=0) - cmap.offsets.numpy()
    aligned = np.minimum(np.maximum(codes, 0), cmap.sizes.numpy() - 1)  # CodebookMap.to_codes
    return aligned[:, -cfg.codec.num_quantizers :]


def audio_segments(tokens: torch.Tensor, cfg: SpeechLMConfig) -> list[torch.Tensor]:
    """[L, S] generated stream tokens -> [T_i, Q] codebook indices of each audio segment, in order.

    A segment is a run of audio rows (`audio_rows`); ESPnet de-interleaves and decodes each one on
    its own, so frames never span two segments. A run shorter than S rows has no frames (ESPnet
    fails on it) and is left out."""
    mask = audio_rows(tokens, cfg).to(torch.int8)
    edge = mask.new_zeros(1)
    steps = torch.diff(mask, prepend=edge, append=edge)
    starts = torch.nonzero(steps == 1).flatten().tolist()
    ends = torch.nonzero(steps == -1).flatten().tolist()
    codes = (segment_codes(tokens[a:b], cfg) for a, b in zip(starts, ends))
    return [c for c in codes if c is not None]
