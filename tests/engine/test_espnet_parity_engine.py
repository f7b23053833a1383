"""The engine (vLLM, float32, CPU) decodes every golden case as ESPnet's ParallelLLM.inference
did: every stream of every row, all cases in one batch (CFG companions and audio input
included: the clips' rows where ESPnet put them). The checkpoint
is rebuilt from its seed (tests/espnet_parity.py); the reference's side is
tests/unit/test_espnet_parity_reference.py."""

from __future__ import annotations

import pytest

import espnet_parity as golden

pytestmark = pytest.mark.engine
GOLDENS = golden.load()
ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=16, max_model_len=512, gpu_memory_utilization=0.3)


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> dict[str, dict]:
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    served = golden.build_checkpoint(tmp_path_factory.mktemp("espnet-parity"), GOLDENS)
    with SpeechLMGenerator(served, **ENGINE) as gen:
        requests = []
        for case in GOLDENS["cases"]:
            system, user, clips = golden.prompt_parts(case)
            ids = gen.encode(user or "", system, audio=len(clips))
            requests.append(gen.engine_request(ids, golden.params(case), gen.prepare_clips(clips)))
        results = gen.run(requests)
        return {case["name"]: dict(result, cfg=gen.cfg) for case, result in zip(GOLDENS["cases"], results)}


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=golden.case_ids(GOLDENS))
def test_engine_prompt_is_espnets(decoded, case):
    """The prompt vLLM ran: each clip's placeholder expanded to the rows ESPnet gave its features."""
    result = decoded[case["name"]]
    assert list(result["prompt_token_ids"]) == golden.prompt_rows(case, result["cfg"])


@pytest.mark.parametrize("case", golden.cases_as_params(GOLDENS))
def test_engine_decodes_as_espnet(decoded, case):
    result = decoded[case["name"]]
    want, complete = golden.expected_rows(case, result["cfg"])
    got = [list(row) for row in result["stream_token_ids"]]
    if complete:
        assert got == want
        assert result["finish_reason"] == "stop"
    else:  # ESPnet raised after these rows (README: what the project does there)
        assert got[: len(want)] == want
