"""The reference decodes every golden case as ESPnet's ParallelLLM.inference did (float32, CPU,
greedy): every stream of every row, the prompt ids included. No ESPnet needed: the checkpoint is
rebuilt from its seed (tests/espnet_parity.py)."""

from __future__ import annotations

import pytest

import espnet_parity as golden
from vllm_omni_speechlm.reference import ReferenceSpeechLM
from vllm_omni_speechlm.tokenizer import encode_prompt

pytestmark = pytest.mark.unit
GOLDENS = golden.load()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> ReferenceSpeechLM:
    return ReferenceSpeechLM(golden.build_checkpoint(tmp_path_factory.mktemp("espnet-parity"), GOLDENS))


def _prompt(reference: ReferenceSpeechLM, case: dict) -> list[int]:
    (_, _, system), (_, _, user) = case["dialogue"]
    return encode_prompt(reference.tokenizer, reference.cfg, user, system)


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=golden.case_ids(GOLDENS))
def test_prompt_is_espnets(reference, case):
    assert _prompt(reference, case) == golden.prompt_rows(case, reference.cfg)


@pytest.mark.parametrize("case", golden.cases_as_params(GOLDENS))
def test_reference_decodes_as_espnet(reference, case):
    want, complete = golden.expected_rows(case, reference.cfg)
    out = reference.generate(_prompt(reference, case), golden.params(case))
    got = out.tokens.tolist()
    if complete:
        assert got == want
        assert out.finish_reason == "stop"
    else:  # ESPnet raised after these rows (README: what the project does there)
        assert got[: len(want)] == want
