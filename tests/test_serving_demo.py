"""The Gradio demo in a real headless browser (Debian's Chromium through Playwright) against a
real server: the page loads, a request streams, audio reaches the page's player and plays, and the
time to first audio is shown.

Chromium comes from `make browser` (apt); Playwright drives it by `executable_path` (its own
browser download cannot work offline).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import start_speechlm_server
from vllm_omni_speechlm.serving.launch import free_port

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "examples" / "gradio_demo.py"


def _chromium() -> str:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    pytest.fail("no chromium on PATH: run `make browser` (apt-get install chromium)")


@pytest.fixture(scope="module")
def server(tiny_bagpiper, tmp_path_factory):
    yield from start_speechlm_server(tiny_bagpiper, "bagpiper_streaming_cpu_tiny.yaml",
                                     tmp_path_factory.mktemp("server"))


@pytest.fixture(scope="module")
def demo_url(server, tmp_path_factory):
    port = free_port()
    log = open(tmp_path_factory.mktemp("demo") / "demo.log", "w")
    env = dict(os.environ, GRADIO_ANALYTICS_ENABLED="False")
    proc = subprocess.Popen([sys.executable, str(DEMO), "--server", server.url, "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, f"demo exited with {proc.returncode}: see {log.name}"
            try:
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "demo did not start"
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


def test_demo_streams_audio_in_browser(demo_url):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(
            executable_path=_chromium(),
            args=["--no-sandbox", "--autoplay-policy=no-user-gesture-required", "--mute-audio"],
        )
        try:
            page = browser.new_page()
            streamed = []  # the page's audio stream (HLS playlist / segments) as it arrives
            page.on("response", lambda r: streamed.append(r.url) if "/stream/" in r.url else None)
            page.goto(demo_url, wait_until="networkidle")
            assert "Speech LM" in page.content()

            page.locator("#text textarea").fill("Please say something nice about the weather today.")
            page.locator("#seed input").fill("4")
            page.locator("#max_tokens input[type=number]").fill("200")
            page.locator("#max_tokens input[type=number]").press("Enter")
            page.locator("#speak").click()

            status = page.locator("#status")
            status.filter(has_text="time to first audio").wait_for(timeout=180_000)
            status.filter(has_text="s of audio in").wait_for(timeout=180_000)
            final = status.inner_text()
            ttfa = re.search(r"time to first audio: (\d+) ms", final)
            seconds = re.search(r"([\d.]+) s of audio", final)
            assert ttfa and seconds and float(seconds.group(1)) > 0, final

            # The player got the streamed audio and played it.
            page.wait_for_function(
                "() => { const a = document.querySelector('#audio audio');"
                " return a && a.currentTime > 0; }",
                timeout=60_000,
            )
            assert streamed, "the page fetched no audio stream"
        finally:
            browser.close()
