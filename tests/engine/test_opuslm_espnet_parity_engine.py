"""The engine (vLLM, float32, CPU) decodes every golden OpusLM case as ESPnet's
ARDelayLM.inference did: every stream of every row, all cases in one batch, prompts from the
project's prompt builder. The checkpoint is rebuilt from its seed (tests/espnet_parity_opuslm.py);
the reference's side is tests/unit/test_opuslm_espnet_parity_reference.py."""

from __future__ import annotations

import pytest

import espnet_parity_opuslm as golden

pytestmark = pytest.mark.engine
GOLDENS = golden.load()
ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.3)


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> dict[str, dict]:
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    served = golden.build_checkpoint(tmp_path_factory.mktemp("opuslm-espnet-parity"), GOLDENS)
    with SpeechLMGenerator(served, **ENGINE) as gen:
        requests = []
        for case in GOLDENS["cases"]:
            user, system, _ = golden.prompt_args(case)
            ids = gen.encode(user, system, golden.params(case))
            assert ids == golden.prompt_ids(case)
            requests.append(gen.engine_request(ids, golden.params(case)))
        results = gen.run(requests)
        return {case["name"]: dict(result, cfg=gen.cfg) for case, result in zip(GOLDENS["cases"], results)}


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=golden.case_ids(GOLDENS))
def test_engine_decodes_as_espnet(decoded, case):
    result = decoded[case["name"]]
    assert [list(row) for row in result["stream_token_ids"]] == golden.expected_rows(case, result["cfg"])
    assert result["finish_reason"] == "stop"
