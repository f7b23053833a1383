"""Stage 1's unread windows (vllm_omni_speechlm/stage1/scheduler.py) on vllm-omni's own
SharedMemoryConnector: windows put as stage 0 puts them, read and unlinked as stage 1 leaves them."""

from __future__ import annotations

import os
import threading
import time
import uuid

import pytest
import torch
from vllm_omni.data_entry_keys import MetaStruct, OmniPayloadStruct
from vllm_omni.distributed.omni_connectors.connectors.shm_connector import SharedMemoryConnector

from vllm_omni_speechlm.compat import window_key
from vllm_omni_speechlm.stage1.scheduler import UnreadWindows


@pytest.fixture
def stream():
    """(put window i, last?) from stage 0, and the names of this request's segments in /dev/shm."""
    sender = SharedMemoryConnector({"stage_id": 0})
    external_id = f"unread-{uuid.uuid4().hex}"

    def put(i: int, last: bool = False) -> None:
        meta = MetaStruct(finished=torch.tensor(last))
        ok, _, _ = sender.put("0", "1", window_key(external_id, 0, i), OmniPayloadStruct(meta=meta))
        assert ok

    def left() -> list[str]:
        return sorted(n for n in os.listdir("/dev/shm") if external_id in n)

    yield external_id, put, left
    sender.close()


def test_windows_up_to_the_last_are_unlinked_and_the_stream_dropped(stream):
    external_id, put, left = stream
    for i in range(6):
        put(i, last=i == 5)
    unread = UnreadWindows(SharedMemoryConnector({"stage_id": 1}))
    unread.add(external_id, 2)  # stage 1 had read windows 0 and 1
    unread.sweep()
    assert [n for n in left() if not n.startswith("shm_")] == [window_key(external_id, 0, i) for i in (0, 1)]
    assert len(unread) == 0


def test_windows_put_after_stage_1_ended_the_request_are_unlinked_as_they_come(stream):
    external_id, put, left = stream
    for i in range(3):
        put(i)
    unread = UnreadWindows(SharedMemoryConnector({"stage_id": 1}))
    unread.add(external_id, 0)
    unread.sweep()
    assert not left() and len(unread) == 1  # stage 0's last window is still to come
    put(3)
    put(4, last=True)
    unread.sweep()
    assert not left() and len(unread) == 0


def test_a_window_read_by_stage_1_as_it_ended_the_request_is_skipped(stream):
    external_id, put, left = stream
    receiver = SharedMemoryConnector({"stage_id": 1})
    for i in range(4):
        put(i, last=i == 3)
    assert receiver.get("0", "1", window_key(external_id, 0, 1)) is not None  # stage 1's reader, as it was ended
    unread = UnreadWindows(receiver)
    unread.add(external_id, 1)  # where stage 1 was when it ended the request
    unread.sweep()
    assert left() == sorted([window_key(external_id, 0, 0), f"shm_{window_key(external_id, 0, 0)}_lockfile.lock"])
    assert len(unread) == 0


def test_a_stream_whose_last_window_never_comes_is_dropped_after_the_grace(stream):
    """Stage 0 aborted before its last window: it unlinks its own, and nothing more comes."""
    external_id, put, left = stream
    put(0)
    unread = UnreadWindows(SharedMemoryConnector({"stage_id": 1}), grace_s=0.2)
    unread.add(external_id, 0)
    unread.sweep()
    assert not left() and len(unread) == 1
    time.sleep(0.3)
    unread.sweep()
    assert len(unread) == 0


def test_a_new_request_with_the_id_keeps_its_windows(stream):
    external_id, put, left = stream
    unread = UnreadWindows(SharedMemoryConnector({"stage_id": 1}))
    unread.add(external_id, 0)
    unread.forget(external_id)
    put(0)
    unread.sweep()
    assert window_key(external_id, 0, 0) in left()


def test_the_windows_go_without_a_sweep_call(stream):
    """The scheduler only hands a stream over; the object's own thread unlinks its windows."""
    external_id, put, left = stream
    for i in range(3):
        put(i, last=i == 2)
    unread = UnreadWindows(SharedMemoryConnector({"stage_id": 1}))
    unread.add(external_id, 0)
    deadline = time.monotonic() + 5
    while left() or len(unread):
        assert time.monotonic() < deadline, left()
        time.sleep(0.02)


class _SlowConnector(SharedMemoryConnector):
    """vllm-omni's connector whose reads wait until the test lets them go (slow shared memory)."""

    def __init__(self, config):
        super().__init__(config)
        self.reading, self.go = threading.Event(), threading.Event()

    def get(self, *args, **kwargs):
        self.reading.set()
        assert self.go.wait(10)
        return super().get(*args, **kwargs)


def test_the_scheduler_does_not_wait_for_a_sweep_and_a_forgotten_stream_stops(stream):
    """`add` / `forget` run on the scheduler's thread while a sweep reads; a stream forgotten
    mid-pass (a new request took its id) is read no further."""
    external_id, put, left = stream
    for i in range(3):
        put(i)
    connector = _SlowConnector({"stage_id": 1})
    unread = UnreadWindows(connector)
    unread.add(external_id, 0)
    assert connector.reading.wait(5)  # the object's thread is inside its first read
    started = time.monotonic()
    unread.forget(external_id)
    unread.add("other-" + external_id, 0)
    assert time.monotonic() - started < 2  # not blocked until the read ends (it waits for `go`)
    unread.forget("other-" + external_id)
    connector.go.set()
    deadline = time.monotonic() + 5
    while len(left()) != 4:  # windows 1 and 2 stay (the new request's), with their lock files
        assert time.monotonic() < deadline, left()
        time.sleep(0.02)
    time.sleep(0.2)
    assert left() == sorted(n for i in (1, 2) for n in (window_key(external_id, 0, i),
                                                       f"shm_{window_key(external_id, 0, i)}_lockfile.lock"))
