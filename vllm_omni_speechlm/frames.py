"""Stage 0's step output: the frames of all S streams, from the model to the client.

Each sampled position gives one frame: a [S] row of unified token ids (stream 0 and the auxiliary
streams; pad 0 on non-audio rows). On its way out of stage 0 a step's frames are:

    model      `FrameRows`: the step's [N, S] host buffer (row i: request i's frame) under
               `codes.audio` of `make_omni_output`, or per-row [1, S] views when the runner
               asks for vllm-omni's generic payloads (`FRAME_ROWS_KWARG` false)
    runner     `StepOutputs`: the buffer whole, with each row's other payloads (stage0/runner.py)
    scheduler  per request, [k, S] blocks of frames under `CODES_KEY` (stage0/client_frames.py)
    client     vllm-omni concatenates them into [L, S] under `codes.audio` (unless the
               request's prompt says `CLIENT_CODES_KEY` false)

With async_chunk streaming the runner hands the rows over as `InterStageRows` (the buffer whole),
and the chunk adapter gets them as `{"codes": {"audio": [k, S]}}` (stage0/window_gate.py,
stage_input_processors/speech_codec.py).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

CODES_KEY = "codes.audio"  # the client's key of the frames (vllm-omni flattens nested keys)
# False in a prompt's additional_information: the client reads no frames (the HTTP routes take
# audio from a codec or fused stage and text from the token ids), so the scheduler sends none.
CLIENT_CODES_KEY = "client_codes"
# make_omni_output keyword: the runner takes the step's frames as one `FrameRows` (stage0/runner.py)
FRAME_ROWS_KWARG = "frame_rows"


@dataclass(frozen=True)
class FrameRows:
    """This step's frames: the [N, S] host buffer (row i: request i's frame, if `samples[i]`).
    One object, not per-row tensors: vllm-omni's generic payload code would copy every row twice
    per step, and stage 0's runner hands the whole buffer to the scheduler."""

    host: torch.Tensor
    samples: list[bool]

    def row(self, i: int) -> torch.Tensor:
        """Row i as a [1, S] view ([0, S] when it does not sample)."""
        return self.host[i : i + 1 if self.samples[i] else i]


class StepOutputs(Sequence):
    """A runner output's client multimodal outputs: per row, the payload of outputs other than
    the frames (None: none), which vllm-omni's scheduler attaches to the row's request output;
    and the step's frames whole, for the scheduler's client frame blocks."""

    def __init__(self, frames: FrameRows, rows: list[dict | None] | None):
        self.frames, self._rows = frames, rows

    def __len__(self) -> int:
        return len(self.frames.samples)

    def __getitem__(self, row: int) -> dict | None:
        return None if self._rows is None else self._rows[row]


class InterStageRows(Sequence):
    """A runner output's inter-stage payloads (async chunks): per row, the payload vllm-omni built
    with its frames as a view of the step's buffer, made when the scheduler reads the row. Across
    the worker -> engine-core queue the buffer then travels once, not as one tensor per row (~8 us
    per row to pickle and unpickle)."""

    def __init__(self, frames: FrameRows, payloads: Sequence[dict | None] | None = None):
        """`payloads` None: every row's payload is its frames alone (what vllm-omni builds when
        they are the step's only output), without one built per row."""
        self.frames, self.frames_only = frames, payloads is None
        if payloads is None:
            self._rest, self._framed = [{}] * len(frames.samples), [True] * len(frames.samples)
        else:
            self._rest = [None if p is None else without_frames(p) for p in payloads]
            self._framed = [p is not None and CODES_KEY in p for p in payloads]

    def __len__(self) -> int:
        return len(self._rest)

    def __getitem__(self, row: int) -> dict | None:
        rest = self._rest[row]
        return rest | {CODES_KEY: self.frames.row(row)} if self._framed[row] else rest


def without_frames(payload: dict | None) -> dict:
    """A payload less its frames (`CODES_KEY`)."""
    return {k: v for k, v in (payload or {}).items() if k != CODES_KEY}


def payload_frames(payload: Any) -> torch.Tensor | None:
    """A payload's frames as they came, unshaped: under the scheduler's flat key ("codes.audio") or
    nested (`{"codes": {"audio": tensor}}`); None when it carries none."""
    if not isinstance(payload, Mapping):
        return None
    step = payload.get(CODES_KEY)
    if step is None:
        codes = payload.get("codes")
        step = codes.get("audio") if isinstance(codes, Mapping) else None
    return step if isinstance(step, torch.Tensor) and step.numel() else None
