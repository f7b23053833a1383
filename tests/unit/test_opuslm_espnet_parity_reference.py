"""The reference decodes every golden OpusLM case as ESPnet's ARDelayLM.inference did (float32,
CPU, greedy): every stream of every row, the prompt ids included. No ESPnet needed: the
checkpoint is rebuilt from its seed (tests/espnet_parity_opuslm.py)."""

from __future__ import annotations

import pytest

import espnet_parity_opuslm as golden
from vllm_omni_speechlm.reference import ReferenceSpeechLM
from vllm_omni_speechlm.tokenizer import encode_prompt

pytestmark = pytest.mark.unit
GOLDENS = golden.load()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> ReferenceSpeechLM:
    return ReferenceSpeechLM(golden.build_checkpoint(tmp_path_factory.mktemp("opuslm-espnet-parity"), GOLDENS))


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=golden.case_ids(GOLDENS))
def test_prompt_is_espnets(reference, case):
    user, system, text_only = golden.prompt_args(case)
    assert encode_prompt(reference.tokenizer, reference.cfg, user, system, text_only=text_only) == golden.prompt_ids(case)


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=golden.case_ids(GOLDENS))
def test_reference_decodes_as_espnet(reference, case):
    out = reference.generate(golden.prompt_ids(case), golden.params(case))
    assert out.tokens.tolist() == golden.expected_rows(case, reference.cfg)
    assert out.finish_reason == "stop"


def test_goldens_cover_the_pad_mask_and_every_answer_shape():
    """The cases exercise what the rules exist for: an aux stream sampling pad inside a clip
    (after the warm-up, before eos), and text, audio and text-then-audio answers."""
    def pad_inside(rows: list[list[int]]) -> bool:
        eos = next(i for i, r in enumerate(rows) if r[0] == 5)
        warm = len(rows[0]) - 1  # stream S-1 is sampled from row S-1 on
        return any(0 in r[1:] for r in rows[warm:eos])

    audio = [s["rows"] for c in GOLDENS["cases"] for s in c["segments"] if s["modality"] == "codec_ssl"]
    assert any(pad_inside(rows) for rows in audio)
    assert {tuple(c["targets"]) for c in GOLDENS["cases"]} == set(golden.MODES)
