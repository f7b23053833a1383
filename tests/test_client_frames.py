"""Stage 0's frames to the client in blocks (`client_frames.py`), on vllm-omni's real output
structs. The engine tests check the same end to end: every stream equals the reference."""

from types import SimpleNamespace

import torch
from vllm import SamplingParams
from vllm.v1.engine import FinishReason
from vllm_omni.engine import OmniEngineCoreOutput

from vllm_omni_speechlm.client_frames import ClientFrameBlocks
from vllm_omni_speechlm.models.speechlm import CODES_KEY

S = 8


def _step(blocks, step: int, rids=("a",), finished=(), requests=None) -> dict[str, OmniEngineCoreOutput]:
    """One step's outputs: request r's frame is filled with 100 * ("a", "b", ...).index(r) + step."""
    outs = [
        OmniEngineCoreOutput(
            request_id=r,
            new_token_ids=[step],
            multimodal_output={CODES_KEY: torch.full((1, S), 100 * (ord(r) - ord("a")) + step), "other": torch.zeros(1)},
            finish_reason=FinishReason.LENGTH if r in finished else None,
        )
        for r in rids
    ]
    blocks.regroup(outs, requests or {r: SimpleNamespace(sampling_params=SamplingParams()) for r in rids})
    return {o.request_id: o for o in outs}


def _frames(out) -> list[int]:
    codes = (out.multimodal_output or {}).get(CODES_KEY)
    return [] if codes is None else codes[:, 0].tolist()


def test_frames_go_in_blocks_and_the_rest_with_the_last_output():
    blocks, sent = ClientFrameBlocks(block=4), {"a": [], "b": []}
    for step in range(10):
        if step == 5:  # a stops: freed while its last output is built, which comes after
            blocks.forget("a", after_this_step=True)
        outs = _step(blocks, step, rids=("a", "b") if step <= 5 else ("b",), finished={"a"} if step == 5 else set())
        for r, out in outs.items():
            sent[r] += _frames(out)
            assert out.multimodal_output["other"] is not None  # other outputs still go every step
    assert sent["a"] == [0, 1, 2, 3, 4, 5]  # a block of 4, then the rest at its finish
    assert sent["b"] == [100, 101, 102, 103, 104, 105, 106, 107]  # two blocks; 108, 109 still held
    assert len(blocks) == 1
    blocks.forget("b", after_this_step=False)  # aborted between steps: dropped at once
    assert len(blocks) == 0


def test_requests_with_stop_strings_get_every_frame():
    """vLLM checks stop strings in the client, which may end such a request at any step."""
    blocks = ClientFrameBlocks(block=4)
    requests = {"a": SimpleNamespace(sampling_params=SamplingParams(stop=["."]))}
    assert [_frames(_step(blocks, step, requests=requests)["a"]) for step in range(3)] == [[0], [1], [2]]
    assert len(blocks) == 0
