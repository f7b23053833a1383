"""`max_pending_requests`: beyond the bound the server refuses at once (429, Retry-After), the
admitted requests complete, and every place comes back (ended, closed early).

Stage 0 decodes one request at a time, and the first admitted answer is a long one the test does
not read, closed after the refusals: its audio (10 MB) is more than the sockets between server and
test can buffer, so its body cannot end before then however fast the server decodes. The other
admitted requests are sent once it plays, and the refusals once their responses have begun
(admitted, waiting in stage 0's queue), so the bound is full while they go. (Stage 0's queue
gauges in /metrics are no signal for this: they change only when stage 0 reports, and one scrape
can take seconds.) The other admitted answers are asked for exactly FRAMES frames (their minimum and maximum), so they
cannot end early. How fast a refusal comes is not asserted (timing belongs to benchmarks)."""

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from conftest import start_speechlm_server

from vllm_omni_speechlm import stage_configs
from vllm_omni_speechlm.config import SpeechLMConfig

LIMIT = 4
FRAMES = 800
POSITIONS = 16384  # a copy of the tiny checkpoint with these positions (RoPE is computed: no weight depends on them)
LONG = POSITIONS - 200  # 10 MB of PCM: more than loopback sockets buffer (about 4 MB on Linux)
BODY = {"input": "Tell me a long story.", "min_audio_frames": FRAMES, "max_audio_frames": FRAMES, "max_new_tokens": FRAMES + 20,
        "cfg_scale": 1.0, "response_format": "pcm", "stream_format": "audio"}
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})


@pytest.fixture(scope="module")
def server(tiny_bagpiper, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    model = tmp / "model"
    shutil.copytree(tiny_bagpiper, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": POSITIONS}))
    with open(stage_configs.path("bagpiper_streaming_cpu_tiny.yaml")) as f:
        deploy = yaml.safe_load(f) | {"max_pending_requests": LIMIT}
    deploy["stages"][0]["max_model_len"] = POSITIONS
    deploy["stages"][0]["max_num_seqs"] = 1  # admitted answers queue behind the one that plays
    (tmp / "deploy.yaml").write_text(yaml.safe_dump(deploy))
    yield from start_speechlm_server(str(model), str(tmp / "deploy.yaml"), tmp)


def _post_together(client: httpx.Client, path: str, body: dict, start: threading.Barrier) -> httpx.Response:
    start.wait()
    return client.post(path, json=body)


def _listen(server, seed: int, admitted: threading.Semaphore) -> bytes:
    with httpx.stream("POST", server.url + "/v1/audio/speech", json=BODY | {"seed": seed}, timeout=600) as r:
        assert r.status_code == 200, r.read()[:300]
        admitted.release()  # the response began: the request holds its place until the body ends
        return b"".join(r.iter_raw())


def test_requests_beyond_the_bound_are_refused_at_once(server):
    """LIMIT answers admitted (a long one decoding, the rest queued in stage 0), then 8 more speech
    requests and a chat request at once: each gets 429 + Retry-After; once the long answer is
    closed, the queued answers run to their end, and the server still answers."""
    extra = [("/v1/audio/speech", BODY | {"seed": 100 + i}) for i in range(8)] + [CHAT]
    long_body = BODY | {"min_audio_frames": LONG, "max_audio_frames": LONG, "max_new_tokens": LONG + 20}
    with ThreadPoolExecutor(LIMIT + len(extra)) as pool, httpx.Client(base_url=server.url, timeout=600) as client:
        with client.stream("POST", "/v1/audio/speech", json=long_body) as playing:
            chunks = playing.iter_raw()  # held: a dropped iterator closes the stream
            next(chunks)
            admitted = threading.Semaphore(0)
            queued = [pool.submit(_listen, server, seed, admitted) for seed in range(1, LIMIT)]
            for _ in queued:
                assert admitted.acquire(timeout=300), [f.exception() for f in queued if f.done()]
            start = threading.Barrier(len(extra))
            refused = list(pool.map(lambda r: _post_together(client, *r, start), extra))
        answers = [f.result() for f in queued]
    for resp in refused:
        assert resp.status_code == 429, resp.text[:300]
        assert resp.headers["retry-after"] == "1" and "max_pending_requests" in resp.json()["error"]["message"]
    frame_bytes = 2 * SpeechLMConfig.from_model_dir(server.model_dir).codec.hop_length  # 16-bit PCM
    assert all(len(a) >= (FRAMES - 8) * frame_bytes for a in answers), ([len(a) for a in answers], frame_bytes)  # ran to the end (less the delay)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.post(server.url + CHAT[0], json=CHAT[1], timeout=300).status_code == 200


def test_places_come_back_when_streams_end_or_are_closed(server):
    for seed in range(LIMIT):  # listeners that leave after the first chunk
        with httpx.stream("POST", server.url + "/v1/audio/speech", json=BODY | {"seed": seed}, timeout=600) as r:
            next(r.iter_raw())
    deadline = time.monotonic() + 60
    with ThreadPoolExecutor(LIMIT) as pool:
        while True:  # the aborts reach the routes' bodies asynchronously
            burst = list(pool.map(lambda _: httpx.post(server.url + CHAT[0], json=CHAT[1], timeout=300), range(LIMIT)))
            if all(r.status_code == 200 for r in burst) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert [r.status_code for r in burst] == [200] * LIMIT
