"""Stage 0's frames to the client in blocks (`client_frames.py`), on vllm-omni's real output
structs. The engine tests check the same end to end: every stream equals the reference."""

from types import SimpleNamespace

import torch
from vllm import SamplingParams
from vllm.v1.engine import FinishReason
from vllm_omni.engine import OmniEngineCoreOutput

from vllm_omni_speechlm.frames import CODES_KEY, FrameRows, StepOutputs
from vllm_omni_speechlm.stage0.client_frames import ClientFrameBlocks

S = 8


def _frame(rid: str, step: int) -> int:
    return 100 * (ord(rid) - ord("a")) + step


def _step(blocks, step: int, rows=("a",), finished=(), requests=None) -> dict[str, OmniEngineCoreOutput]:
    """One step: the worker's rows are `rows` (a row named "-" belongs to a request without an
    output, e.g. a finished one still in flight); request r's frame is filled with `_frame(r, step)`.
    The outputs come in reverse row order, as vLLM does not promise row order."""
    host = torch.tensor([[_frame(r, step) if r != "-" else -1] * S for r in rows])
    outputs = [
        OmniEngineCoreOutput(
            request_id=r,
            new_token_ids=[step],
            multimodal_output={"other": torch.zeros(1)},
            finish_reason=FinishReason.LENGTH if r in finished else None,
        )
        for r in reversed(rows)
        if r != "-"
    ]
    requests = requests or {r: SimpleNamespace(sampling_params=SamplingParams()) for r in rows}
    frames = StepOutputs(FrameRows(host, [True] * len(rows)), None)
    blocks.regroup(outputs, frames, {r: i for i, r in enumerate(rows)}, requests)
    return {o.request_id: o for o in outputs}


def _frames(out) -> list[int]:
    codes = (out.multimodal_output or {}).get(CODES_KEY)
    if codes is not None:
        assert codes.shape[1] == S and bool((codes == codes[:, :1]).all())  # whole rows
    return [] if codes is None else codes[:, 0].tolist()


def test_frames_go_in_blocks_and_the_rest_with_the_last_output():
    blocks, sent = ClientFrameBlocks(S, block=4), {"a": [], "b": []}
    for step in range(10):
        if step == 5:  # a stops: freed while its last output is built, which comes after
            blocks.forget("a", after_this_step=True)
        rows = ("a", "b") if step <= 5 else ("-", "b") if step == 6 else ("b",)
        outs = _step(blocks, step, rows=rows, finished={"a"} if step == 5 else set())
        for r, out in outs.items():
            sent[r] += _frames(out)
            assert out.multimodal_output["other"] is not None  # other outputs still go every step
    assert sent["a"] == [0, 1, 2, 3, 4, 5]  # slot 1: a block of 3, then the rest at its finish
    assert sent["b"] == [100, 101, 102, 103, 104, 105, 106, 107]  # slot 0: two blocks; 108, 109 still held
    assert len(blocks) == 1
    blocks.forget("b", after_this_step=False)  # aborted between steps: dropped at once
    assert len(blocks) == 0


def test_requests_admitted_together_send_on_different_steps():
    """A batch in lockstep sends 1/block of its requests' frames per step, not all every block-th
    step; each request still gets every frame, in order, in blocks of at most `block`."""
    blocks, rids = ClientFrameBlocks(S, block=4), "abcdefgh"
    sent = {r: [] for r in rids}
    for step in range(12):
        outs = _step(blocks, step, rows=tuple(rids))
        assert sum(_frames(o) != [] for o in outs.values()) == 2
        for r, out in outs.items():
            assert len(_frames(out)) <= 4
            sent[r] += _frames(out)
    for r in rids:
        assert sent[r] == [_frame(r, step) for step in range(len(sent[r]))] and len(sent[r]) >= 12 - 3


def test_requests_with_stop_strings_get_every_frame():
    """vLLM checks stop strings in the client, which may end such a request at any step."""
    blocks = ClientFrameBlocks(S, block=4)
    requests = {"a": SimpleNamespace(sampling_params=SamplingParams(stop=["."]))}
    assert [_frames(_step(blocks, step, requests=requests)["a"]) for step in range(3)] == [[0], [1], [2]]


def test_slots_are_reused_and_grow():
    """Many requests over time hold no more slots than are live; a freed slot starts empty."""
    blocks = ClientFrameBlocks(S, block=4)
    for wave in range(3):
        rids = [chr(ord("a") + i) for i in range(70)]  # more than the first allocation
        for step in range(2):
            _step(blocks, 10 * wave + step, rows=tuple(rids))
        assert len(blocks) == 70
        for r in rids:
            blocks.forget(r, after_this_step=False)
    assert len(blocks) == 0 and len(blocks._count) == 128
    out = _step(blocks, 0, rows=("a",), finished={"a"})["a"]
    assert _frames(out) == [0]  # nothing left over from the slot's last owner


def test_a_request_whose_client_reads_no_frames_gets_none():
    """The HTTP routes' prompts say `client_codes: false` (engine_prompt): such a request's outputs
    carry no frames and take no slot, to its end; the others' are unchanged."""
    from vllm_omni_speechlm.engine_request import engine_prompt
    from vllm_omni_speechlm.frames import CLIENT_CODES_KEY
    from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

    http = engine_prompt([1, 2], SpeechSamplingParams(), client_codes=False)["additional_information"]
    assert http[CLIENT_CODES_KEY] is False
    assert CLIENT_CODES_KEY not in engine_prompt([1, 2], SpeechSamplingParams())["additional_information"]
    blocks, sent = ClientFrameBlocks(S, block=4), {"a": [], "b": []}
    blocks.admit("a", http)
    blocks.admit("b", {})
    for step in range(6):
        if step == 5:  # both stop: freed while their last outputs are built, as the scheduler does
            blocks.forget("a", after_this_step=True)
            blocks.forget("b", after_this_step=True)
        outs = _step(blocks, step, rows=("a", "b"), finished={"a", "b"} if step == 5 else set())
        for r, out in outs.items():
            sent[r] += _frames(out)
            assert out.multimodal_output["other"] is not None
    assert sent == {"a": [], "b": [100 + step for step in range(6)]}
    assert len(blocks) == 0 and not blocks._unread


def test_inter_stage_rows_cross_a_process_boundary_as_one_buffer():
    """The runner's inter-stage payloads (async chunks) unpickle to the payloads vllm-omni built,
    pickling the step's buffer once: vLLM's multiprocess executor reduces every tensor it meets on
    its own (one buffer each), so per-row views would cost one reduction per row."""
    import copyreg
    import io
    import pickle

    from vllm_omni_speechlm.frames import InterStageRows

    host = torch.arange(4 * 3).reshape(4, 3)
    frames = FrameRows(host, [True, True, False, True])
    meta = torch.ones(1)
    built = [{CODES_KEY: frames.row(0)}, None, {CODES_KEY: frames.row(2)}, {CODES_KEY: frames.row(3), "meta.x": meta}]
    reduced = []

    def reduce(tensor):
        reduced.append(tuple(tensor.shape))
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)

    def dumps(obj) -> bytes:
        with io.BytesIO() as bio:
            pickler = pickle.Pickler(bio, protocol=pickle.HIGHEST_PROTOCOL)
            pickler.dispatch_table = copyreg.dispatch_table | {torch.Tensor: reduce}
            pickler.dump(obj)
            return bio.getvalue()

    rows = pickle.loads(dumps(InterStageRows(frames, built)))
    assert sorted(reduced) == [(1,), (4, 3)]
    assert len(rows) == 4 and rows[1] is None and rows[2][CODES_KEY].shape == (0, 3)
    for got, want in zip(rows, built):
        if want is not None:
            assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    reduced.clear()
    dumps(built)  # what crossed before: a reduction per row's view
    assert len(reduced) == 4
    reduced.clear()
    only = pickle.loads(dumps(InterStageRows(frames)))  # the payloads when frames are all
    assert reduced == [(4, 3)] and len(only) == 4
    assert all(got.keys() == {CODES_KEY} and torch.equal(got[CODES_KEY], frames.row(i)) for i, got in enumerate(only))
