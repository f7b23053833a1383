"""Stage 0 -> stage 1's window connector: vllm-omni's shared-memory connector, cheaper per window.

Stage 0 puts every window on its scheduler's thread (`codec_windows_on_scheduler_thread`), or on
the chunk adapter's save thread, which shares the interpreter lock with it: either way a put's
host time is stage 0's step time. `SharedMemoryConnector` spends it in three places that grow
with the load:
- before each put it sweeps up to 64 of its pending keys for segments the reader has unlinked,
  one `stat` each (on one CPU ~130 of a put's ~190 us with 64 windows unread);
- the adapter's end-of-stream flags are 0-d tensors, each encoded with five torch calls, and every
  torch call hands the lock to the other thread and waits to get it back;
- the segment: a `SharedMemory` object registers it with the resource tracker (a pipe write),
  sizes and maps it and copies the bytes in, under an flock of its lock file.
Stage 1 reads them on the adapter's receive thread, which tries every waiting request's next key
once per pass; `get` opens the segment, and until the window is there each open fails, a system
call that hands stage 1's interpreter lock over. While stage 1's main thread runs Python the
receive thread then waits up to a switch interval (5 ms) for the lock, per key: on the development
CPU, beside a busy thread, a pass over 96 waiting keys took 180 ms (`benchmarks/recv_poll.py`).

`WindowConnector` sweeps `REAP_PER_PUT` keys per put (each put adds one key, so the pending keys
stay a few times the windows in flight), sends the flags as bools, writes the segment in six
system calls (`publish`; a put 89 -> 38 us on the development CPU), and opens a key it polled
before in vain only once a listing of /dev/shm (one system call, at most `LISTING_MAX_AGE_S`
old) shows it: a pass costs one hand-over of the lock, not one per waiting request. A key's first
read always opens it (a reader told the window is there reads once). Segments, lock files, key
names and the wire format are vllm-omni's: either end may be the stock connector. Deploy YAMLs
name it as `SpeechLMWindowConnector` (the plugin registers it in every process).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from typing import Any

import torch
from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

logger = logging.getLogger(__name__)

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
        try:
            self.reap_consumed()
            payload = self.serialize_obj(data)
            publish(put_key, payload)
        except Exception as e:  # as the stock put: the adapter records the failed send
            logger.error("window connector: put of %s failed: %s", put_key, e)
            return False, 0, None
        with self._pending_keys_lock:
            self._pending_keys[put_key] = None
        self._metrics["puts"] += 1
        self._metrics["bytes_transferred"] += len(payload)
        return True, len(payload), {"shm": {"name": put_key, "size": len(payload)}, "size": len(payload)}

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


def publish(key: str, payload: bytes) -> None:
    """Make `payload` the segment `key` as vllm-omni's readers open it (`SharedMemory(name=key)`,
    its lock file beside it), in six system calls: the lock file first (a reader that finds the
    segment opens it), then the segment written whole under a name of its own and renamed into
    place, so no reader sees it short. No `SharedMemory` object: each registers its segment with
    the process's resource tracker (a pipe write) and maps it to copy the bytes in. A failed put
    leaves neither file."""
    lock, part = f"{SHM_DIR}/shm_{key}_lockfile.lock", f"{SHM_DIR}/{key}.{os.getpid()}.part"
    os.close(os.open(lock, os.O_WRONLY | os.O_CREAT, 0o600))
    fd = -1
    try:
        fd = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view):]
        os.close(fd)
        fd = -1
        os.replace(part, f"{SHM_DIR}/{key}")
    except BaseException:
        if fd >= 0:
            os.close(fd)
        for path in (part, lock):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise


def register() -> None:
    """Make `NAME` a connector vllm-omni's factory builds (idempotent)."""
    from vllm_omni.distributed.omni_connectors.factory import OmniConnectorFactory

    if NAME not in OmniConnectorFactory.list_registered_connectors():
        OmniConnectorFactory.register_connector(NAME, WindowConnector)
