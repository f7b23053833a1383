"""The reference decodes every golden case as ESPnet's ParallelLLM.inference did (float32, CPU,
greedy): every stream of every row, the prompt ids included, audio input cases too (the clips'
rows where ESPnet put them). No ESPnet needed: the checkpoint is rebuilt from its seed
(tests/espnet_parity.py)."""

from __future__ import annotations

import pytest

import espnet_parity as golden
from vllm_omni_speechlm.audio_input import expand_placeholders
from vllm_omni_speechlm.reference import ReferenceSpeechLM
from vllm_omni_speechlm.tokenizer import encode_prompt

pytestmark = pytest.mark.unit
GOLDENS = golden.load()


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> ReferenceSpeechLM:
    return ReferenceSpeechLM(golden.build_checkpoint(tmp_path_factory.mktemp("espnet-parity"), GOLDENS))


def _prompt(reference: ReferenceSpeechLM, case: dict) -> tuple[list[int], list]:
    system, user, clips = golden.prompt_parts(case)
    return encode_prompt(reference.tokenizer, reference.cfg, user, system, audio=len(clips)), clips


@pytest.mark.parametrize("case", GOLDENS["cases"], ids=golden.case_ids(GOLDENS))
def test_prompt_is_espnets(reference, case):
    ids, clips = _prompt(reference, case)
    lengths = [reference.audio_features(clip).shape[0] for clip in clips]
    assert lengths == [n for _, n in case.get("audio_rows", [])]
    expanded, _ = expand_placeholders(ids, lengths, reference.cfg.audio_input.placeholder_id)
    assert expanded == golden.prompt_rows(case, reference.cfg)


@pytest.mark.parametrize("case", golden.cases_as_params(GOLDENS))
def test_reference_decodes_as_espnet(reference, case):
    want, complete = golden.expected_rows(case, reference.cfg)
    ids, clips = _prompt(reference, case)
    out = reference.generate(ids, golden.params(case), audio=clips)
    got = out.tokens.tolist()
    if complete:
        assert got == want
        assert out.finish_reason == "stop"
    else:  # ESPnet raised after these rows (README: what the project does there)
        assert got[: len(want)] == want
