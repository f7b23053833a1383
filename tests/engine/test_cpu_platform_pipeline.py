"""Two omni stages on CPU: AR -> generation through the SharedMemoryConnector, async_chunk on."""

from __future__ import annotations

import ctypes
import gc
import os
import re
import struct
from pathlib import Path

import pytest

from conftest import SHM_DIR, new_shm, shm_names
from conftest import CPU_PLATFORM_PROMPTS as PROMPTS

MAX_TOKENS = 8

ECHO_DEPLOY = """\
pipeline: speechlm_selftest_echo
async_chunk: true
connectors:
  shm:
    name: SharedMemoryConnector
    extra: {}
stages:
  - stage_id: 0
    max_num_seqs: 4
    max_model_len: 256
    enforce_eager: true
    dtype: float32
    output_connectors:
      to_stage_1: shm
  - stage_id: 1
    max_num_seqs: 4
    max_model_len: 256
    enforce_eager: true
    dtype: float32
    input_connectors:
      from_stage_0: shm
"""


class _ShmCreations:
    """Names created in /dev/shm while open, from inotify: the kernel queues every creation, so
    a segment that lives for a millisecond is still recorded (polling the directory missed them)."""

    _IN_CREATE, _IN_MOVED_TO, _IN_Q_OVERFLOW = 0x100, 0x80, 0x4000
    _HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len; then name

    def __enter__(self) -> "_ShmCreations":
        libc = ctypes.CDLL(None, use_errno=True)
        self._fd = libc.inotify_init1(os.O_NONBLOCK)
        if self._fd < 0 or libc.inotify_add_watch(self._fd, SHM_DIR.encode(), self._IN_CREATE | self._IN_MOVED_TO) < 0:
            raise OSError(ctypes.get_errno(), "inotify on " + SHM_DIR)
        self.names: set[str] = set()
        return self

    def __exit__(self, *exc) -> None:
        try:
            while True:
                try:
                    self._parse(os.read(self._fd, 1 << 16))
                except BlockingIOError:
                    return
        finally:
            os.close(self._fd)

    def _parse(self, buf: bytes) -> None:
        offset = 0
        while offset < len(buf):
            _, mask, _, size = self._HEADER.unpack_from(buf, offset)
            assert not mask & self._IN_Q_OVERFLOW, "inotify queue overflowed: creations were lost"
            offset += self._HEADER.size
            self.names.add(buf[offset : offset + size].rstrip(b"\0").decode())
            offset += size


@pytest.fixture(scope="module")
def echo_run(cpu_platform_tiny_qwen3, cpu_platform_plugins_loaded, tmp_path_factory, cpu_platform_vllm_greedy):
    # Depends on the reference so plain vLLM has finished (and freed its engine) first.
    from vllm import SamplingParams
    from vllm_omni import Omni

    deploy = Path(tmp_path_factory.mktemp("deploy")) / "echo.yaml"
    deploy.write_text(ECHO_DEPLOY)
    before = shm_names()
    omni = Omni(model=str(cpu_platform_tiny_qwen3), deploy_config=str(deploy))
    try:
        assert omni.async_chunk
        ar = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        gen = SamplingParams(temperature=0.0, max_tokens=1)
        with _ShmCreations() as created:
            outs = omni.generate([{"prompt_token_ids": p} for p in PROMPTS], [ar, gen])
        seen = created.names
    finally:
        omni.close()
        del omni
        gc.collect()
    after = shm_names()
    # Omni names request i "{i}_{uuid}" (stage 1's own prompt ids are connector placeholders).
    prompt_of = {out.request_id: tuple(PROMPTS[int(out.request_id.split("_", 1)[0])]) for out in outs}
    return {"outs": outs, "seen": seen, "before": before, "after": after, "prompt_of": prompt_of}


def test_stage1_receives_stage0_tokens(echo_run, cpu_platform_vllm_greedy):
    """Stage 1's output is the echo of stage 0's greedy tokens, chunk after chunk, in order."""
    outs = echo_run["outs"]
    assert len(outs) == len(PROMPTS)
    for out in outs:
        assert out.stage_id == 1 and out.finished and out.final_output_type == "latent"
        assert out.metrics["stage_metrics"]["0"]["num_tokens_out"] == MAX_TOKENS
        (echoed,) = out.outputs[0].multimodal_output.tensors.values()
        prompt = echo_run["prompt_of"][out.request_id]
        assert [int(v) for v in echoed.tolist()] == cpu_platform_vllm_greedy[prompt][:MAX_TOKENS]


def test_payload_went_through_shared_memory(echo_run):
    keys = {n for n in echo_run["seen"] if re.fullmatch(r".+_0_\d+", n)}
    for out in echo_run["outs"]:
        assert any(k.startswith(out.request_id) for k in keys), (out.request_id, sorted(keys))


def test_no_shared_memory_left_after_shutdown(echo_run):
    assert new_shm(echo_run["before"]) == set()
