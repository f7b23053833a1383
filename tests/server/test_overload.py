"""`max_pending_requests`: beyond the bound the server refuses at once (429, Retry-After), the
admitted requests complete, and every place comes back (ended, closed early).

Every answer is asked for exactly FRAMES audio frames (its minimum and maximum), so the admitted
answers cannot end early. A 429 itself shows that the bound was full when the request arrived; how
fast it came is not asserted (timing belongs to benchmarks; the tiny model may finish an 800-frame
answer within the tens of milliseconds a refusal takes on a loaded machine)."""

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
FRAMES = 800  # ~16 s of audio: longer than any refusal may take, on a loaded machine too
BODY = {"input": "Tell me a long story.", "min_audio_frames": FRAMES, "max_audio_frames": FRAMES, "max_new_tokens": FRAMES + 20,
        "cfg_scale": 1.0, "response_format": "pcm", "stream_format": "audio"}
CHAT = ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})


@pytest.fixture(scope="module")
def server(tiny_bagpiper, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("overload")
    with open(stage_configs.path("bagpiper_streaming_cpu_tiny.yaml")) as f:
        deploy = yaml.safe_load(f) | {"max_pending_requests": LIMIT}
    deploy["stages"][0]["max_model_len"] = 2 * FRAMES  # room for the long answers
    (tmp / "deploy.yaml").write_text(yaml.safe_dump(deploy))
    yield from start_speechlm_server(tiny_bagpiper, str(tmp / "deploy.yaml"), tmp)


def _post_together(client: httpx.Client, path: str, body: dict, start: threading.Barrier) -> httpx.Response:
    start.wait()
    return client.post(path, json=body)


def _streams_playing(server, n: int, pool: ThreadPoolExecutor, playing: threading.Barrier):
    """n streamed answers, each read to the end after all n have sent their first audio."""

    def listen(seed: int) -> bytes:
        with httpx.stream("POST", server.url + "/v1/audio/speech", json=BODY | {"seed": seed}, timeout=600) as r:
            assert r.status_code == 200, r.read()[:300]
            chunks = r.iter_raw()
            first = next(chunks)
            playing.wait()
            return first + b"".join(chunks)

    return [pool.submit(listen, seed) for seed in range(n)]


def test_requests_beyond_the_bound_are_refused_at_once(server):
    """LIMIT answers playing, then 8 more speech requests and a chat request at once: each gets
    429 + Retry-After, the playing answers run to their end, and then the places are free again."""
    extra = [("/v1/audio/speech", BODY | {"seed": 100 + i}) for i in range(8)] + [CHAT]
    playing = threading.Barrier(LIMIT + 1)
    with ThreadPoolExecutor(LIMIT + len(extra)) as pool:
        admitted = _streams_playing(server, LIMIT, pool, playing)
        playing.wait(timeout=300)
        start = threading.Barrier(len(extra))
        with httpx.Client(base_url=server.url, timeout=600, limits=httpx.Limits(max_connections=len(extra))) as client:
            refused = list(pool.map(lambda r: _post_together(client, *r, start), extra))
        answers = [f.result() for f in admitted]
    for resp in refused:
        assert resp.status_code == 429, resp.text[:300]
        assert resp.headers["retry-after"] == "1" and "max_pending_requests" in resp.json()["error"]["message"]
    frame_bytes = 2 * SpeechLMConfig.from_model_dir(server.model_dir).codec.hop_length  # 16-bit PCM
    assert all(len(a) >= (FRAMES - 8) * frame_bytes for a in answers)  # ran to the end (less the delay)
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
