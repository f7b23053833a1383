"""Whether a step may hold text rows, known on the host without waiting for the device.

A step whose rows are all audio, choice or forced rows computes its stream-0 logits on the
non-text columns only (`DecodingRules.process_primary_logits`, `no_text_rows`); a text row needs
the whole vocabulary (at 512 requests on an H100, every step on that path cost 2.2% of the
frames/s). Text rows come from
a request whose mode enforces or allows text at once (a host fact kept by the request table) or
from an audio answer whose segment ended with eot and whose next segment the model chose to be
text (parallel rules), which only the device phases show. From an audio row that text row is at
least four rows away (eot, <|assistant|>, the modality choice, then text).

So after each step's advance, the device notes whether any request's phase is at most two rows
from a text row, and the note comes back by a non-blocking copy. A note with none rules text out
of the next three steps: a step reads the newest note whose copy has landed, if it was taken at
most three advances ago; otherwise it assumes text rows. (With vLLM's async scheduling the host
prepares a step while the device still runs the ones before: at 512 audio answers on an H100,
reading at most two advances back, only a fifth of the steps ruled text out.)

Under tensor parallelism every rank must rule alike (the answer picks the step graphs' key, and
the ranks record graphs together), so a step reads the note of exactly DEPTH advances back, waiting
for its copy if it has not landed.
"""

from __future__ import annotations

import torch

DEPTH = 3  # advances a note covers


class TextRowsWatch:
    def __init__(self, device: torch.device, wait: bool = False):
        self.wait = wait  # read the note DEPTH advances back, landed or not (tensor parallelism)
        self.flag = torch.ones((), dtype=torch.bool, device=device)  # written by the advance (graphs too)
        pinned = device.type == "cuda"
        self._notes = [torch.ones(1, dtype=torch.bool, pin_memory=pinned) for _ in range(DEPTH)]
        self._events = [torch.cuda.Event() if pinned else None for _ in range(DEPTH)]
        self._published = 0
        self.num_read = [0] * (DEPTH + 1)  # steps that read the note 1..DEPTH advances back; [0]: none landed

    def publish(self) -> None:
        """After a step's advance: send its note to the host."""
        i = self._published % DEPTH
        self._notes[i].copy_(self.flag, non_blocking=True)
        if self._events[i] is not None:
            self._events[i].record()
        self._published += 1

    def text_rows_possible(self) -> bool:
        """Whether the next advance may meet a text row: the newest landed note of the last
        DEPTH advances, True when none has landed (`wait`: the note DEPTH back, True before it)."""
        first = DEPTH if self.wait else 1
        for back in range(first, min(DEPTH, self._published) + 1):
            i = (self._published - back) % DEPTH
            event = self._events[i]
            if event is not None and self.wait:
                event.synchronize()
            if event is None or event.query():
                self.num_read[back] += 1
                return bool(self._notes[i].numpy()[0])
        self.num_read[0] += 1
        return True
