"""Paced windows in the two-stage engine (CPU, tiny checkpoint): the stage-0 scheduler's clock, the
window gate's (end, holdback) through vllm-omni's chunk adapter to the processor. With the full
lookahead throughout, the streamed audio equals whole-clip decoding whatever windows the pace
gives (`tests/unit/test_streaming.py` covers which windows)."""

from __future__ import annotations

import pytest
import yaml
from test_streaming_pipeline import HOP, PROMPTS, _assert_matches_reference, _request, _stream

from vllm_omni_speechlm import stage_configs


@pytest.fixture(scope="module")
def paced_gen(tiny_bagpiper, tmp_path_factory):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    deploy = yaml.safe_load(open(stage_configs.path("bagpiper_streaming_cpu_tiny.yaml")))
    deploy["connectors"]["shm"]["extra"]["codec_playout_margin_steps"] = 4
    path = tmp_path_factory.mktemp("paced") / "paced.yaml"
    path.write_text(yaml.safe_dump(deploy))
    with SpeechLMGenerator(tiny_bagpiper, deploy_config=str(path)) as g:
        yield g


def test_paced_stream_equals_whole_clip_decoding(paced_gen, reference):
    kw = dict(modality="audio", seed=2, max_tokens=120)
    requests = [_request(paced_gen, PROMPTS[i], **kw) for i in (1, 3)]
    chunks = _stream(paced_gen, requests)
    for i, (_, _, ids) in enumerate(requests):
        print("paced windows (frames):", [c.numel() // HOP for c in chunks[i]])
        _assert_matches_reference(paced_gen, reference, chunks[i], ids, kw)
