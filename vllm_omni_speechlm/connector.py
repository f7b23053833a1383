"""Stage 0 -> stage 1's window connector: vllm-omni's shared-memory connector, cheaper per window.

Stage 0 puts every window from the chunk adapter's save thread, which shares the process's
interpreter lock with the scheduler's thread (the one that runs each step). `SharedMemoryConnector`
spends most of a window's put on that thread in two places that grow with the load:
- before each put it sweeps up to 64 of its pending keys for segments the reader has unlinked,
  one `stat` each (on one CPU ~130 of a put's ~190 us with 64 windows unread);
- the adapter's end-of-stream flags are 0-d tensors, each encoded with five torch calls, and every
  torch call hands the lock to the scheduler's thread and waits to get it back.
Stage 1 reads them on the adapter's receive thread, which tries every waiting request's next key
once per pass; `get` opens the segment, and until the window is there each open fails, a system
call that hands stage 1's interpreter lock over. While stage 1's main thread runs Python the
receive thread then waits up to a switch interval (5 ms) for the lock, per key: on the development
CPU, beside a busy thread, a pass over 96 waiting keys took 180 ms (`benchmarks/recv_poll.py`).

`WindowConnector` sweeps `REAP_PER_PUT` keys per put (each put adds one key, so the pending keys
stay a few times the windows in flight), sends the flags as bools, and opens a key it polled
before in vain only once a listing of /dev/shm (one system call, at most `LISTING_MAX_AGE_S`
old) shows it: a pass costs one hand-over of the lock, not one per waiting request. A key's first
read always opens it (a reader told the window is there reads once). Segments, lock files, key
names and the wire format are vllm-omni's: either end may be the stock connector. Deploy YAMLs
name it as `SpeechLMWindowConnector` (the plugin registers it in every process).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

NAME = "SpeechLMWindowConnector"
REAP_PER_PUT = 4
LISTING_MAX_AGE_S = 1e-3  # the receive loop's back-off between passes that found nothing
MAX_MISSED = 4096  # keys polled in vain remembered (an aborted request's last key is never found)
SHM_DIR = "/dev/shm"
_FLAGS = ("finished", "is_segment_finished")


class WindowConnector(SharedMemoryConnector):
    """`SharedMemoryConnector` with a bounded sweep, bool flags and listed polls (module docstring)."""

    def __init__(self, config: Any) -> None:
        super().__init__(config)
        self._missed: set[str] = set()  # keys read by name that were not there
        self._listing: frozenset[str] = frozenset()
        self._listed_at = float("-inf")

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        meta = getattr(data, "meta", None)
        for name in _FLAGS:
            flag = getattr(meta, name, None)
            if isinstance(flag, torch.Tensor) and flag.numel() == 1:
                setattr(meta, name, bool(flag))
        return super().put(from_stage, to_stage, put_key, data)

    def get(self, from_stage: str, to_stage: str, get_key: str, metadata: Any = None) -> tuple[Any, int] | None:
        """The stock read; a key read by name (no segment handle in `metadata`) that was not there
        before and is not listed now is still not there: None without a system call."""
        handle = metadata.get(get_key, metadata) if isinstance(metadata, dict) else metadata
        by_name = not (isinstance(handle, dict) and "shm" in handle)
        if by_name and get_key in self._missed and get_key not in self._listed():
            return None
        result = super().get(from_stage, to_stage, get_key, metadata)
        if by_name and result is not None:
            self._missed.discard(get_key)
        elif by_name:
            if len(self._missed) >= MAX_MISSED:
                self._missed.clear()
            self._missed.add(get_key)
        return result

    def _listed(self) -> frozenset[str]:
        now = time.monotonic()
        if now - self._listed_at > LISTING_MAX_AGE_S:
            self._listing, self._listed_at = frozenset(os.listdir(SHM_DIR)), now
        return self._listing

    def reap_consumed(self) -> None:
        """Forget the oldest pending keys whose segment the reader has unlinked, `REAP_PER_PUT`
        at most; the others go to the back of the line."""
        with self._pending_keys_lock:
            for _ in range(min(REAP_PER_PUT, len(self._pending_keys))):
                key, _ = self._pending_keys.popitem(last=False)
                if os.path.exists(f"{SHM_DIR}/{key}"):
                    self._pending_keys[key] = None


def register() -> None:
    """Make `NAME` a connector vllm-omni's factory builds (idempotent)."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    if NAME not in OmniConnectorFactory.list_registered_connectors():
        OmniConnectorFactory.register_connector(NAME, WindowConnector)
