"""Stage 0 -> stage 1's window connector: vllm-omni's shared-memory connector, cheaper per window.

Stage 0 puts every window from the chunk adapter's save thread, which shares the process's
interpreter lock with the scheduler's thread (the one that runs each step). `SharedMemoryConnector`
spends most of a window's put on that thread in two places that grow with the load:
- before each put it sweeps up to 64 of its pending keys for segments the reader has unlinked,
  one `stat` each (on one CPU ~130 of a put's ~190 us with 64 windows unread);
- the adapter's end-of-stream flags are 0-d tensors, each encoded with five torch calls, and every
  torch call hands the lock to the scheduler's thread and waits to get it back.

`WindowConnector` sweeps `REAP_PER_PUT` keys per put (each put adds one key, so the pending keys
stay a few times the windows in flight) and sends the flags as bools. Segments, lock files, key
names and the wire format are vllm-omni's: either end may be the stock connector. Deploy YAMLs
name it as `SpeechLMWindowConnector` (the plugin registers it in every process).
"""

from __future__ import annotations

import os
from typing import Any

import torch
from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

NAME = "SpeechLMWindowConnector"
REAP_PER_PUT = 4
_FLAGS = ("finished", "is_segment_finished")


class WindowConnector(SharedMemoryConnector):
    """`SharedMemoryConnector` with a bounded sweep and bool flags (module docstring)."""

    def put(self, from_stage: str, to_stage: str, put_key: str, data: Any) -> tuple[bool, int, dict[str, Any] | None]:
        meta = getattr(data, "meta", None)
        for name in _FLAGS:
            flag = getattr(meta, name, None)
            if isinstance(flag, torch.Tensor) and flag.numel() == 1:
                setattr(meta, name, bool(flag))
        return super().put(from_stage, to_stage, put_key, data)

    def reap_consumed(self) -> None:
        """Forget the oldest pending keys whose segment the reader has unlinked, `REAP_PER_PUT`
        at most; the others go to the back of the line."""
        with self._pending_keys_lock:
            for _ in range(min(REAP_PER_PUT, len(self._pending_keys))):
                key, _ = self._pending_keys.popitem(last=False)
                if os.path.exists(f"/dev/shm/{key}"):
                    self._pending_keys[key] = None


def register() -> None:
    """Make `NAME` a connector vllm-omni's factory builds (idempotent)."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    if NAME not in OmniConnectorFactory.list_registered_connectors():
        OmniConnectorFactory.register_connector(NAME, WindowConnector)
