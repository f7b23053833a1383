"""OpusLM and OpusLM-Dialogue Stage 0 on the real vLLM-Omni engine (CPU, float32): all 9 streams
equal the reference, the drain included (the de-interleaved matrix is complete: exactly T frames,
T = the number of SSL units before the eos)."""

import functools
import os

import pytest
import torch

from conftest import live_requests, step_graphs_eagerly, worker_sum
from vllm_omni_speechlm.decoding import RowKind
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.3)
PROMPT, SYSTEM = "Say hello to the world.", "Be brief."
FAMILIES = ["opuslm", "opuslm-dialogue"]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(generator, reference) of one family; one engine at a time (module fixture, per param)."""
    from vllm_omni_speechlm.generator import SpeechLMGenerator
    from vllm_omni_speechlm.reference import ReferenceSpeechLM

    model_dir = request.getfixturevalue("tiny_opuslm" if request.param == "opuslm" else "tiny_opuslm_dialogue")
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    with SpeechLMGenerator(model_dir, **ENGINE) as gen:
        yield gen, ReferenceSpeechLM(model_dir)


def drained(ref) -> bool:
    """The reference ended its audio with a drain: deferred eos, S drain rows, the last an eos."""
    return bool((ref.kinds == RowKind.FORCE_EOS).any())


def assert_complete_drain(tokens: torch.Tensor, codes: torch.Tensor, cfg) -> None:
    """[L, S] tokens ending in a drain -> T SSL units, T complete frames. The first drain row
    samples stream 0 too (ESPnet's late finish index): not a unit of the clip. Aux cells inside
    the clip are codes or pad (ESPnet's masks allow pad on streams 1..S-1)."""
    s, sp, dec = cfg.num_streams, cfg.specials, cfg.decoding
    s0 = tokens[:, 0].tolist()
    # The audio segment opens with its marker: the first row, or the row after <|assistant|>.
    start = max(i for i, t in enumerate(s0) if t == sp.audio and (i == 0 or s0[i - 1] == sp.assistant)) + 1
    eos_at = s0.index(dec.deferred_eos, start)
    assert s0[eos_at + 2 : eos_at + s] == [sp.pad] * (s - 2) and s0[-1] == sp.eos
    assert len(s0) == eos_at + s + 1
    num_units = eos_at - start
    ssl = cfg.streams[0]
    assert all(ssl.vocab_start <= t < ssl.vocab_end or t == sp.audio for t in s0[start:eos_at])
    assert codes.shape == (num_units, cfg.codec.num_quantizers)
    assert num_units >= dec.min_audio_frames
    for stream in range(1, s):
        rows = tokens[start + stream : start + stream + num_units, stream]
        spec = cfg.streams[stream]
        assert bool((((rows >= spec.vocab_start) & (rows < spec.vocab_end)) | (rows == sp.pad)).all())


CASES = {
    "audio-0": dict(modality="audio", seed=0),
    "audio-1": dict(modality="audio", seed=1),
    "audio-3": dict(modality="audio", seed=3),
    "text": dict(modality="text", seed=1),
    "auto": dict(modality="auto", seed=1),
    "text+audio": dict(modality="text+audio", max_text_tokens=3, seed=0),
    "greedy": dict(modality="audio", audio_temperature=0.0, text_temperature=0.0),
    "top-k": dict(modality="audio", audio_temperature=1.3, audio_top_k=5, seed=5),
}


@pytest.mark.parametrize("kw", CASES.values(), ids=CASES.keys())
def test_matches_reference(family, kw):
    gen, reference = family
    kw = dict(max_tokens=60, **kw)
    [result] = gen.generate(PROMPT, system=SYSTEM, **kw)
    ref = reference.generate(gen.encode(PROMPT, SYSTEM, SpeechSamplingParams(**kw)), SpeechSamplingParams(**kw))
    tokens = torch.tensor(result["stream_token_ids"])
    assert torch.equal(tokens, ref.tokens)
    assert result["token_ids"] == ref.token_ids
    assert result["text"] == ref.text and result["finish_reason"] == ref.finish_reason
    assert (result["audio"] is None) == (ref.audio is None)
    if drained(ref):
        assert_complete_drain(tokens, ref.codes, gen.cfg)


@pytest.mark.parametrize("graphs", [False, True], ids=["ungraphed", "step-graphs"])
def test_concurrent_requests_equal_solo_runs(family, graphs):
    """8 requests of different modes in one batch, ending and draining at different steps; also
    with the steps run as step graphs replay them (padded batches as requests end)."""
    gen, reference = family
    worker_sum(gen.omni, functools.partial(step_graphs_eagerly, graphs))
    try:
        _assert_batch_equals_solo_runs(gen, reference)
    finally:
        worker_sum(gen.omni, functools.partial(step_graphs_eagerly, False))


def _assert_batch_equals_solo_runs(gen, reference) -> None:
    modes = ["audio", "text+audio", "auto", "audio"] * 2
    batch = []
    for i, mode in enumerate(modes):
        kw = dict(modality=mode, seed=3, max_tokens=60, max_text_tokens=2 + i)
        ids = gen.encode(f"{PROMPT} {'again ' * i}".strip(), None)
        batch.append((gen.engine_request(ids, SpeechSamplingParams(**kw)), kw, ids))
    engine_params = batch[0][0][1]
    assert all(b[0][1] == engine_params for b in batch)  # only the speech options differ
    outputs = gen.omni.generate([b[0][0] for b in batch], [engine_params], use_tqdm=False)
    assert len(outputs) == 8
    num_drained = num_capped = 0
    for out in outputs:
        _, kw, ids = batch[int(out.request_id.split("_", 1)[0])]
        ref = reference.generate(ids, SpeechSamplingParams(**kw))
        assert torch.equal(torch.tensor(gen.result(out)["stream_token_ids"]), ref.tokens)
        num_drained += drained(ref)
        num_capped += ref.finish_reason == "length"
    assert num_drained >= 1 and num_capped >= 1  # requests drain while others still decode
    assert worker_sum(gen.omni, live_requests) == 0
