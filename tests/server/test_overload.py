"""`max_pending_requests`: beyond the bound the server refuses at once (429, Retry-After), the
admitted requests complete, and every place comes back (ended, closed early)."""

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from conftest import start_speechlm_server

from vllm_omni_speechlm import stage_configs

LIMIT = 4
BODY = {"input": "Tell me a long story.", "max_new_tokens": 400, "response_format": "pcm", "stream_format": "audio"}


@pytest.fixture(scope="module")
def server(tiny_bagpiper, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    with open(stage_configs.path("bagpiper_streaming_cpu_tiny.yaml")) as f:
        deploy = yaml.safe_load(f) | {"max_pending_requests": LIMIT}
    path = tmp / "deploy.yaml"
    path.write_text(yaml.safe_dump(deploy))
    yield from start_speechlm_server(tiny_bagpiper, str(path), tmp)


def _post(server, path: str, body: dict, start: threading.Barrier) -> tuple[int, float, httpx.Response]:
    start.wait()
    began = time.monotonic()
    resp = httpx.post(server.url + path, json=body, timeout=600)
    return resp.status_code, time.monotonic() - began, resp


def test_requests_beyond_the_bound_are_refused_at_once(server):
    """12 long speech requests and a chat request at once: LIMIT of them run to the end, the
    others get 429 + Retry-After within a second."""
    requests = [("/v1/audio/speech", BODY | {"seed": seed}) for seed in range(12)]
    requests.append(("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5}))
    start = threading.Barrier(len(requests))
    with ThreadPoolExecutor(len(requests)) as pool:
        results = list(pool.map(lambda r: _post(server, *r, start), requests))
    admitted = [resp for status, _, resp in results if status == 200]
    refused = [(seconds, resp) for status, seconds, resp in results if status == 429]
    assert len(admitted) == LIMIT and len(refused) == len(requests) - LIMIT, [r[0] for r in results]
    assert all(len(resp.content) > 0 for resp in admitted)
    for seconds, resp in refused:
        # At once: no engine work. The client's clock includes the event loop it shares with the
        # admitted streams, ~1.5 s at worst on a busy 2-core machine.
        assert seconds < 3.0 and resp.headers["retry-after"] == "1"
        assert "max_pending_requests" in resp.json()["error"]["message"]
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_places_come_back_when_streams_end_or_are_closed(server):
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=BODY | {"seed": 1}, timeout=600) as r:
        next(r.iter_raw())  # a listener that leaves after the first chunk
    deadline = time.monotonic() + 30
    while True:  # the abort reaches the route's body close asynchronously
        resp = httpx.post(server.url + "/v1/chat/completions", timeout=300,
                          json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
        if resp.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert resp.status_code == 200, resp.text[:300]
    start = threading.Barrier(LIMIT)
    with ThreadPoolExecutor(LIMIT) as pool:
        statuses = list(pool.map(lambda seed: _post(server, "/v1/audio/speech", BODY | {"seed": seed}, start)[0], range(LIMIT)))
    assert statuses == [200] * LIMIT
