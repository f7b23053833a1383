"""The engine (vLLM, float32, CPU) decodes every golden case as ESPnet's ParallelLLM.inference
did: every stream of every row, all cases in one batch (CFG companions included). The checkpoint
is rebuilt from its seed (tests/espnet_parity.py); the reference's side is
tests/unit/test_espnet_parity_reference.py."""

from __future__ import annotations

import pytest

import espnet_parity as golden

pytestmark = pytest.mark.engine
GOLDENS = golden.load()
GOLDENS["cases"] = [c for c in GOLDENS["cases"] if "audio_rows" not in c]  # audio input: not in the engine yet
ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=16, max_model_len=512, gpu_memory_utilization=0.3)


@pytest.fixture(scope="module")
def decoded(tmp_path_factory) -> dict[str, dict]:
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    served = golden.build_checkpoint(tmp_path_factory.mktemp("espnet-parity"), GOLDENS)
    with SpeechLMGenerator(served, **ENGINE) as gen:
        requests = []
        for case in GOLDENS["cases"]:
            (_, _, system), (_, _, user) = case["dialogue"]
            ids = gen.encode(user, system)
            assert ids == golden.prompt_rows(case, gen.cfg)
            requests.append(gen.engine_request(ids, golden.params(case)))
        outputs = {}
        for out in gen.omni.generate([r[0] for r in requests], [requests[0][1]], use_tqdm=False):
            outputs.setdefault(out.request_id, []).append(out)
        ordered = sorted(outputs.items(), key=lambda item: int(item[0].split("_", 1)[0]))
        results = [gen.result(*outs) for _, outs in ordered]
        return {case["name"]: dict(result, cfg=gen.cfg) for case, result in zip(GOLDENS["cases"], results)}


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
