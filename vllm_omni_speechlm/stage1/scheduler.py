"""Stage 1's scheduler: vllm-omni's generation scheduler, and the windows a request ended early
leaves unread.

Stage 0 puts a request's windows into shared memory; stage 1 unlinks each as it reads it. When
stage 0 ends a request before its last window (an abort), vllm-omni's adapter unlinks every
window stage 0 put. When stage 1 ends it first (its listener left) after stage 0 sent its last
window, nobody does: stage 0 counts the windows delivered, and the ones stage 1 had not read stay
in /dev/shm until the server stops. `UnreadWindows` reads and unlinks them, from the one stage 1
was due to read next up to the request's last window (or, where stage 0 was aborted before
sending it, until no window has come for `GRACE_S`), on its own thread, off the scheduler's.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from vllm.v1.request import RequestStatus
from vllm_omni.core.sched.omni_generation_scheduler import OmniGenerationScheduler
from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

from vllm_omni_speechlm.compat import window_key

GRACE_S = 30.0  # stage 0 is aborted too, so its last window (if any) follows within a step
POLL_S = 0.05
SHM_DIR = "/dev/shm/"  # where SharedMemoryConnector's segments are named


@dataclass
class _Unread:
    next_chunk: int
    deadline: float


class UnreadWindows:
    """The windows of requests stage 1 ended before it read them all, read and unlinked."""

    def __init__(self, connector: Any, *, grace_s: float = GRACE_S, poll_s: float = POLL_S):
        self._connector = connector
        self._grace_s, self._poll_s = grace_s, poll_s
        self._streams: dict[str, _Unread] = {}  # external request id -> where its unread windows start
        self._lock = threading.Lock()  # the table's
        self._sweeping = threading.Lock()  # one pass at a time
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, external_id: str, next_chunk: int) -> None:
        with self._lock:
            self._streams[external_id] = _Unread(next_chunk, time.monotonic() + self._grace_s)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="speechlm-unread-windows", daemon=True)
            self._thread.start()
        self._wake.set()

    def forget(self, external_id: str) -> None:
        """A new request took this id: its windows are its own."""
        with self._lock:
            self._streams.pop(external_id, None)

    def sweep(self) -> None:
        """One pass over every stream: unlink the windows that are there; drop a stream at its
        last window or past its deadline. The table's lock is never held across shared-memory
        I/O: the scheduler's `add` and `forget` do not wait for a pass (a mass disconnect gives
        it hundreds of windows)."""
        with self._sweeping:
            with self._lock:
                streams = list(self._streams.items())
            for external_id, unread in streams:
                if self._drain(external_id, unread):
                    with self._lock:
                        if self._streams.get(external_id) is unread:
                            del self._streams[external_id]

    def _drain(self, external_id: str, unread: _Unread) -> bool:
        source = self._connector.stage_id - 1
        while self._streams.get(external_id) is unread:  # not forgotten meanwhile
            key = window_key(external_id, source, unread.next_chunk)
            got = self._connector.get(str(source), str(self._connector.stage_id), key)
            if got is None:
                if not os.path.exists(SHM_DIR + window_key(external_id, source, unread.next_chunk + 1)):
                    return time.monotonic() > unread.deadline  # not put yet, or still being written
                self._connector.cleanup(key)  # read by stage 1's own reader as it was ended (or unreadable)
            unread.next_chunk += 1
            unread.deadline = time.monotonic() + self._grace_s
            if got is not None and _is_last(got[0]):
                return True
        return False

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self.sweep()
            with self._lock:
                if not self._streams:
                    self._wake.clear()
            time.sleep(self._poll_s)


def _is_last(payload: Any) -> bool:
    finished = (payload.get("meta") or {}).get("finished") if isinstance(payload, dict) else None
    return finished is not None and bool(finished)


class CodecStageScheduler(OmniGenerationScheduler):
    """vllm-omni's generation scheduler; a request it ends before stage 0's last window reached it
    hands its unread windows to `UnreadWindows`."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        adapter = self.chunk_transfer_adapter
        connector = getattr(adapter, "connector", None)
        self._unread = UnreadWindows(connector) if isinstance(connector, SharedMemoryConnector) else None

    def add_request(self, request: Any) -> None:
        if self._unread is not None:
            self._unread.forget(request.external_req_id)
        super().add_request(request)

    def finish_requests(self, request_ids: Any, finished_status: RequestStatus) -> list[Any]:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        ids = list(self.requests if request_ids is None else request_ids)
        if self._unread is not None:
            self._hand_over_unread(ids)
        return super().finish_requests(ids, finished_status)

    def _hand_over_unread(self, request_ids: list[str]) -> None:
        adapter = self.chunk_transfer_adapter
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None and request_id not in adapter.upstream_exhausted_requests:
                self._unread.add(request.external_req_id, adapter.get_req_chunk.get(request_id, 0))
