"""`bagpiper_streaming` on CPU: speech LM -> X-Codec decoder, audio streamed in windows.

One two-stage engine for the module (tiny checkpoint, float32). The streamed chunks of each
request, concatenated, must equal whole-clip decoding of the reference's codes: the processor
holds back 10 frames of lookahead (the codec's reach), so the only difference is float rounding.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from conftest import (TWO_SEGMENTS, TWO_SEGMENTS_PROMPT, TransferManager, espnet_segment_audio, feed_processor, new_shm,
                      shm_names)

from vllm_omni_speechlm import stage_configs
from vllm_omni_speechlm.frames import CLIENT_CODES_KEY
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
from vllm_omni_speechlm.streaming import INITIAL_CHUNK_KEY, SCHEDULER_THREAD_KEY

HOP = 320
# Measured max |streamed - whole clip| on these tests: 1.8e-5 (float32 rounding through the
# decoder; audio is about +-1). Any wrong frame or window boundary gives errors of order 0.1-1.
ATOL = 1e-4
SYSTEM = "Be brief."
PROMPTS = [
    "Hi.",
    "Say hello to the world.",
    "What time is it in the morning?",
    "Please say something nice about the weather today, it is sunny.",
]


@pytest.fixture(scope="module")
def gen(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    with SpeechLMGenerator(tiny_bagpiper, deploy_config=stage_configs.path("bagpiper_streaming_cpu_tiny.yaml")) as g:
        yield g


def _request(gen, prompt: str, extra_info: dict | None = None, **kw):
    ids = gen.encode(prompt, SYSTEM)
    engine_prompt, sampling = gen.engine_request(ids, SpeechSamplingParams(**kw))
    engine_prompt["modalities"] = ["audio"]  # finished when stage 1 is (stage 0's text is a final output too)
    engine_prompt["additional_information"] |= extra_info or {}
    return engine_prompt, sampling, ids


def _codec_params():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    # DELTA: each output carries only the audio of one new window.
    return SamplingParams(temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.DELTA)


def _stream(gen, requests) -> dict[int, list[torch.Tensor]]:
    """Run requests [(prompt, sampling, ids)] (same engine sampling params); chunks per index."""
    chunks: dict[int, list[torch.Tensor]] = defaultdict(list)
    outs = gen.omni.generate(
        [r[0] for r in requests], [requests[0][1], _codec_params()], py_generator=True, use_tqdm=False
    )
    for out in outs:
        if out.stage_id == 0:  # stage 0's text output (both stages are final outputs)
            continue
        assert out.stage_id == 1
        audio = (out.multimodal_output or {}).get("audio")
        if audio is not None and audio.numel():
            chunks[int(out.request_id.split("_", 1)[0])].append(audio.reshape(-1).float())
    return chunks


def _whole_clip(gen, ref) -> torch.Tensor:
    with torch.inference_mode():
        return gen.codec(ref.codes.T[None])[0]


def _assert_matches_reference(gen, reference, chunks, ids, kw) -> None:
    ref = reference.generate(ids, SpeechSamplingParams(**kw))
    assert ref.codes is not None, "the test request must produce audio"
    streamed = torch.cat(chunks)
    assert streamed.shape == (ref.codes.shape[0] * HOP,)
    # Whole-clip decoding of the reference's codes (its `audio` is that decoding too).
    torch.testing.assert_close(streamed, _whole_clip(gen, ref), atol=ATOL, rtol=0)
    torch.testing.assert_close(streamed, ref.audio, atol=ATOL, rtol=0)


def test_stream_equals_whole_clip_decoding(gen, reference):
    """Chunks: a 2-frame first window (deploy default), windows ramping up to 25 frames (each as
    long as all earlier ones together), then the flush; together exactly T x 320 samples, equal
    to decoding the reference's codes in one go (which also proves the codes equal the
    reference's: one wrong code changes ~20 frames by O(0.1))."""
    kw = dict(modality="audio", seed=2, max_tokens=120)
    prompt, sampling, ids = _request(gen, PROMPTS[1], **kw)
    [chunks] = _stream(gen, [(prompt, sampling, ids)]).values()
    sizes = [c.numel() // HOP for c in chunks]
    assert sizes[:7] == [2, 2, 4, 8, 16, 25, 25] and len(sizes) >= 8, sizes
    assert all(0 < s <= 25 + 10 for s in sizes[7:]), sizes  # the flush: the rest, no holdback
    _assert_matches_reference(gen, reference, chunks, ids, kw)


def test_per_request_first_window(gen, reference):
    kw = dict(modality="text+audio", max_text_tokens=3, seed=3, max_tokens=60)
    prompt, sampling, ids = _request(gen, PROMPTS[2], {INITIAL_CHUNK_KEY: 3}, **kw)
    [chunks] = _stream(gen, [(prompt, sampling, ids)]).values()
    assert [c.numel() // HOP for c in chunks[:4]] == [3, 3, 6, 12]
    _assert_matches_reference(gen, reference, chunks, ids, kw)


def test_a_client_that_reads_no_frames_gets_none(gen, reference):
    """The HTTP routes' prompts say `client_codes: false`: stage 0's outputs then carry no
    `codes.audio` while the audio streams as before; a request without the key gets every row."""
    kw = dict(modality="audio", seed=4, max_tokens=60)
    requests = [_request(gen, PROMPTS[0], {CLIENT_CODES_KEY: False}, **kw), _request(gen, PROMPTS[0], **kw)]
    rows, chunks = defaultdict(list), defaultdict(list)
    outs = gen.omni.generate([r[0] for r in requests], [requests[0][1], _codec_params()], py_generator=True,
                             use_tqdm=False)
    for out in outs:
        i = int(out.request_id.split("_", 1)[0])
        mm = out.multimodal_output or {}
        if out.stage_id == 0:
            rows[i].append(mm.get("codes", {}).get("audio"))
        elif mm.get("audio") is not None and mm["audio"].numel():
            chunks[i].append(mm["audio"].reshape(-1).float())
    ref = reference.generate(requests[1][2], SpeechSamplingParams(**kw))
    assert rows[0] and all(r is None for r in rows[0])
    assert torch.equal(rows[1][-1], ref.tokens)
    for i in (0, 1):
        _assert_matches_reference(gen, reference, chunks[i], requests[i][2], kw)


def test_concurrent_requests_no_crosstalk(gen, reference):
    """4 requests with audio of different lengths in one batch (Omni takes one SamplingParams per
    stage, so max_tokens is shared; the text part's length, a per-request speech option, varies
    where the audio starts): each stream equals its own whole clip."""
    _assert_concurrent_streams_exact(gen, reference)


def _assert_concurrent_streams_exact(gen, reference) -> None:
    batch = []
    for i, prompt in enumerate(PROMPTS):
        kw = dict(modality="text+audio", min_text_tokens=2 + 12 * i, max_text_tokens=2 + 12 * i, seed=7, max_tokens=110)
        batch.append((*_request(gen, prompt, **kw), kw))
    chunks = _stream(gen, [b[:3] for b in batch])
    assert sorted(chunks) == [0, 1, 2, 3]
    lengths = {sum(c.numel() for c in chunks[i]) for i in range(4)}
    assert len(lengths) == 4, lengths
    for i, (_, _, ids, kw) in enumerate(batch):
        _assert_matches_reference(gen, reference, chunks[i], ids, kw)


def test_abort_mid_stream_leaves_nothing(gen, reference):
    """Abort after the first chunk reached the client: no /dev/shm segment is left behind and the
    engine serves the next request exactly (stale processor state would corrupt its windows)."""
    _assert_abort_mid_stream_leaves_nothing(gen, reference)


def _assert_abort_mid_stream_leaves_nothing(gen, reference) -> None:
    before = shm_names()
    prompt, sampling, _ = _request(gen, PROMPTS[0], modality="audio", seed=1, max_tokens=400)
    first_chunk, done = threading.Event(), threading.Event()

    def run():
        for out in gen.omni.generate([prompt], [sampling, _codec_params()], py_generator=True, use_tqdm=False):
            if (out.multimodal_output or {}).get("audio") is not None:
                first_chunk.set()
        done.set()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert first_chunk.wait(120), "no audio chunk arrived"
    gen.omni.engine.abort(list(gen.omni.request_states))
    thread.join(timeout=60)
    assert not thread.is_alive()
    _assert_nothing_left_and_streams_exactly(gen, reference, before, timeout_s=10)


def _assert_nothing_left_and_streams_exactly(gen, reference, before: set[str], timeout_s: float) -> None:
    """No /dev/shm segment made since `before` stays, and the engine still streams exactly (stale
    processor state would corrupt the next request's windows)."""
    deadline = time.monotonic() + timeout_s
    while new_shm(before):
        assert time.monotonic() < deadline, f"shared memory left: {sorted(new_shm(before))}"
        time.sleep(0.1)
    kw = dict(modality="audio", seed=2, max_tokens=50)
    prompt, sampling, ids = _request(gen, PROMPTS[1], **kw)
    [chunks] = _stream(gen, [(prompt, sampling, ids)]).values()
    _assert_matches_reference(gen, reference, chunks, ids, kw)


def _stage_process(stage_id: int):
    """The engine-core process of stage `stage_id` (vllm-omni titles it by stage)."""
    import psutil

    found = [p for p in psutil.Process().children(recursive=True)
             if f"StageEngineCoreProc_stage{stage_id}_" in " ".join(p.cmdline())]
    assert len(found) == 1, [" ".join(p.cmdline()) for p in found]
    return found[0]


def test_windows_stage_1_never_read_are_unlinked_when_it_ends_the_request(gen, reference):
    """A listener who leaves after stage 0 sent its last window: stage 0 counts every window
    delivered, so the ones stage 1 has not read yet are stage 1's to unlink. Stage 1 is held
    still while stage 0 generates the whole answer and the request is aborted; once it runs
    again it has nearly all windows unread, and none may stay in /dev/shm."""
    before = shm_names()
    prompt, sampling, _ = _request(gen, PROMPTS[2], modality="audio", seed=1, max_tokens=160)
    stage1 = _stage_process(1)
    stage1.suspend()
    try:
        for out in gen.omni.generate([prompt], [sampling, _codec_params()], py_generator=True, use_tqdm=False):
            if out.stage_id == 0 and out.finished:
                break
        assert len(new_shm(before)) >= 2 * 8, sorted(new_shm(before))  # 8+ windows: a segment and a lock file each
        gen.omni.engine.abort(list(gen.omni.request_states))
    finally:
        stage1.resume()
    _assert_nothing_left_and_streams_exactly(gen, reference, before, timeout_s=20)


def test_audio_segments_stream_as_espnet_decodes_them(gen, reference):
    """An answer with two audio segments: each is streamed as a clip of its own (windows restart at
    the segment's edge, no codec context crosses it), equal to ESPnet's per-segment decoding."""
    prompt, system = TWO_SEGMENTS_PROMPT
    ids = gen.encode(prompt, system)
    engine_prompt, sampling = gen.engine_request(ids, SpeechSamplingParams(**TWO_SEGMENTS))
    engine_prompt["modalities"] = ["audio"]
    [chunks] = _stream(gen, [(engine_prompt, sampling, ids)]).values()
    ref = reference.generate(ids, SpeechSamplingParams(**TWO_SEGMENTS))
    want, frames = espnet_segment_audio(ref.tokens, reference.cfg, reference.codec)
    assert len(frames) == 2, "the request must give two audio segments (conftest.TWO_SEGMENTS)"
    assert frames[0] in torch.tensor([c.numel() // HOP for c in chunks]).cumsum(0).tolist()  # a window ends there
    streamed = torch.cat(chunks)
    assert streamed.shape == want.shape == (sum(frames) * HOP,)
    torch.testing.assert_close(streamed, want, atol=ATOL, rtol=0)
    torch.testing.assert_close(ref.audio, want, atol=ATOL, rtol=0)


# ---- SpeechLMGenerator on the streaming deployment ----------------------------------------------


def test_generator_stream_equals_non_streamed_audio(gen, reference):
    """`generate_stream` yields the windows as they are decoded (only new samples each); joined,
    they equal `generate`'s audio on the same deployment (stage 1's outputs consolidated) and the
    reference's whole-clip decoding."""
    kw = dict(modality="audio", seed=6, max_tokens=90)
    chunks = list(gen.generate_stream(PROMPTS[1], system=SYSTEM, **kw))
    assert [c.numel() // HOP for c in chunks[:4]] == [2, 2, 4, 8] and len(chunks) >= 5
    [whole] = gen.generate(PROMPTS[1], system=SYSTEM, **kw)
    streamed = torch.cat(chunks)
    assert whole["waveform"] is not None and streamed.shape == whole["waveform"].shape
    torch.testing.assert_close(streamed, whole["waveform"], atol=ATOL, rtol=0)
    ref = reference.generate(gen.encode(PROMPTS[1], SYSTEM), SpeechSamplingParams(**kw))
    torch.testing.assert_close(streamed, ref.audio, atol=ATOL, rtol=0)


def test_generator_stream_closed_early_aborts(gen, reference):
    """Stopping after the first chunk aborts the request: no shared memory is left and the next
    stream is exact."""
    before = shm_names()
    stream = gen.generate_stream(PROMPTS[0], system=SYSTEM, modality="audio", seed=1, max_tokens=400)
    assert next(stream).numel() == 2 * HOP
    stream.close()
    assert not gen.omni.request_states
    deadline = time.monotonic() + 10
    while new_shm(before):
        assert time.monotonic() < deadline, f"shared memory left after close: {sorted(new_shm(before))}"
        time.sleep(0.1)
    kw = dict(modality="audio", seed=2, max_tokens=50)
    streamed = torch.cat(list(gen.generate_stream(PROMPTS[1], system=SYSTEM, **kw)))
    ref = reference.generate(gen.encode(PROMPTS[1], SYSTEM), SpeechSamplingParams(**kw))
    torch.testing.assert_close(streamed, ref.audio, atol=ATOL, rtol=0)


# ---- the processor alone (no engine) -----------------------------------------------------------


def _decode(tiny_bagpiper, payloads) -> torch.Tensor:
    """Stage 1 on the payloads, each as the receiving adapter hands it over: its wire form's
    top-level keys (meta, an output rate) become the runtime information."""
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer

    from vllm_omni_speechlm.models.codec_stage import BagpiperCodecDecoder

    stage = BagpiperCodecDecoder.from_model_dir(tiny_bagpiper)
    windows = [p.codes.audio for p in payloads]
    infos = [{k: v for k, v in OmniSerializer.deserialize(OmniSerializer.serialize(p)).items() if k != "codes"}
             for p in payloads]
    with torch.inference_mode():
        return torch.cat(stage.decode_windows(windows, infos))


def _gate_windows(gate, tokens, starts, before_step=lambda: None, per_row: bool = False) -> dict[str, list]:
    """Answers "a0", "a1", ... through the scheduler's `gate`, answer i offering row r of `tokens`
    at step starts[i] + r + 1, never finished (`before_step` runs first in each step); each step's
    rows at once as the scheduler offers them (`offer_step`), or one by one (`per_row`) -> each
    answer's [(step, (end, holdback), codes)] windows. The answers are closed in the gate afterwards."""
    from vllm_omni_speechlm.frames import FrameRows
    from vllm_omni_speechlm.streaming import WINDOW_KEY

    answers = [SimpleNamespace(external_req_id=f"a{i}", additional_information=None, output_token_ids=[])
               for i in range(len(starts))]
    windows = {a.external_req_id: [] for a in answers}
    for step in range(1, len(tokens) + max(starts) + 1):
        before_step()
        gate.tick()
        live = [(answer, step - 1 - start) for answer, start in zip(answers, starts) if 0 <= step - 1 - start < len(tokens)]
        for answer, row in live:
            answer.output_token_ids.append(int(tokens[row][0]))
        if per_row:
            offers = [(answer, gate.offer(answer, {"codes.audio": tokens[row][None]}, False)) for answer, row in live]
            handed = [(answer, payload) for answer, (hand_over, payload) in offers if hand_over]
        else:
            frames = FrameRows(tokens[[row for _, row in live]], [True] * len(live))
            handed = gate.offer_step(frames, [(answer, i) for i, (answer, _) in enumerate(live)])
        for answer, payload in handed:
            if WINDOW_KEY in payload:
                windows[answer.external_req_id].append((step, payload[WINDOW_KEY], payload["codes"]["audio"]))
    gate.forget(list(windows))
    return windows


@pytest.fixture(scope="module")
def long_clip(tiny_bagpiper, reference):
    from vllm_omni_speechlm.tokenizer import encode_prompt

    ids = encode_prompt(reference.tokenizer, reference.cfg, PROMPTS[3], system=SYSTEM)
    return reference.generate(ids, SpeechSamplingParams(modality="audio", seed=5, max_tokens=160))


@pytest.fixture(scope="module")
def gen_on_scheduler_thread(tiny_bagpiper, tmp_path_factory):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    deploy = yaml.safe_load(Path(stage_configs.path("bagpiper_streaming_cpu_tiny.yaml")).read_text())
    deploy["connectors"]["shm"]["extra"][SCHEDULER_THREAD_KEY] = 1
    path = tmp_path_factory.mktemp("deploy") / "windows_on_scheduler_thread.yaml"
    path.write_text(yaml.safe_dump(deploy, sort_keys=False))
    with SpeechLMGenerator(tiny_bagpiper, deploy_config=str(path)) as g:
        yield g


def test_windows_cut_on_the_scheduler_thread_stream_exactly(gen_on_scheduler_thread, reference):
    """`codec_windows_on_scheduler_thread`: stage 0's scheduler thread cuts and writes the windows
    instead of vllm-omni's save thread; concurrent answers still each equal their whole clip, and
    an abort (its windows unlinked from the scheduler's thread too) leaves no segment behind."""
    _assert_concurrent_streams_exact(gen_on_scheduler_thread, reference)
    _assert_abort_mid_stream_leaves_nothing(gen_on_scheduler_thread, reference)


def test_processor_state_is_only_in_adapter_dicts(tiny_bagpiper, long_clip):
    """All per-request state sits in the two dicts vllm-omni's adapter pops on finish and abort
    (`_clear_sender_state_locked`, called by `cleanup_sender`): run that real method here."""
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter,
    )

    tm = TransferManager(tiny_bagpiper)
    feed_processor(tm, long_clip.tokens[: len(long_clip.tokens) // 2])  # mid-stream
    assert tm.request_payload and tm.code_prompt_token_ids
    # Rows no window can reach again are freed as the stream goes.
    assert sum(map(len, tm.code_prompt_token_ids["r0"])) <= 25 + 35 + 7
    adapter_state = SimpleNamespace(
        put_req_chunk={}, requests_num_chunks_sent={}, _segment_generation={}, ramp_chunk_count={},
        _adaptive_states={}, _pending_streaming_prefills={},
        request_payload=tm.request_payload, code_prompt_token_ids=tm.code_prompt_token_ids,
    )
    OmniChunkTransferAdapter._clear_sender_state_locked(adapter_state, "r0")
    assert not tm.request_payload and not tm.code_prompt_token_ids


@pytest.mark.parametrize("holdback", [10, 0])
def test_holdback_makes_windows_exact(tiny_bagpiper, long_clip, holdback):
    """Holdback 10 (deployed): exact to float rounding. Holdback 0: the tail of every window
    misses its lookahead; the error is documented here (measured ~0.3-1 with the tiny codec)."""
    payloads, _ = feed_processor(TransferManager(tiny_bagpiper, codec_right_holdback_frames=holdback), long_clip.tokens)
    streamed = _decode(tiny_bagpiper, payloads)
    assert streamed.shape == long_clip.audio.shape
    err = float((streamed - long_clip.audio).abs().max())
    print(f"holdback={holdback}: max |streamed - whole clip| = {err:.3g}")
    if holdback == 10:
        assert err < ATOL
    else:
        assert err > 100 * ATOL


@pytest.mark.parametrize("step_s", [0.007, 0.015])
def test_a_bound_on_the_step_leaves_longer_steps_to_the_fixed_ramp(tiny_bagpiper, long_clip, step_s):
    """`codec_paced_max_step_ms` 10: at 7 ms a step the windows are paced from a first lookahead
    of 2; at 15 ms they are the fixed ramp's, every one with the full lookahead."""
    extra = {"initial_codec_chunk_frames": 2, "codec_min_right_holdback_frames": 2, "codec_playout_margin_steps": 4,
             "codec_paced_max_step_ms": 10}
    bounded, _ = feed_processor(TransferManager(tiny_bagpiper, **extra), long_clip.tokens, gated=True, step_s=step_s)
    fixed, _ = feed_processor(TransferManager(tiny_bagpiper, initial_codec_chunk_frames=2), long_clip.tokens, gated=True)

    def windows(payloads):
        return [(p.codes.audio.numel() // 8, p.meta.right_holdback_size) for p in payloads]

    assert (windows(bounded) == windows(fixed)) == (step_s > 0.010)
    assert bounded[0].meta.right_holdback_size == (2 if step_s < 0.010 else 10)


@pytest.mark.parametrize("streams", [1, 2])
def test_a_bound_on_the_streams_leaves_answers_past_it_to_the_fixed_ramp(tiny_bagpiper, long_clip, streams):
    """`codec_paced_max_streams` 1, at 7 ms a step: an answer streaming alone is paced (its first
    window decoded with a lookahead of 2); while two stream, each takes the fixed ramp with the full
    lookahead. The bound counts answers the gate still holds open."""
    from vllm_omni_speechlm.config import SpeechLMConfig
    from vllm_omni_speechlm.stage0.window_gate import WindowGate
    from vllm_omni_speechlm.streaming import window_settings

    extra = {"initial_codec_chunk_frames": 2, "codec_min_right_holdback_frames": 2, "codec_playout_margin_steps": 4,
             "codec_paced_max_streams": 1}
    now = [0.0]

    def next_step() -> None:
        now[0] += 0.007

    gate = WindowGate(SpeechLMConfig.from_model_dir(tiny_bagpiper), window_settings(extra), clock=lambda: now[0])
    windows = _gate_windows(gate, long_clip.tokens, [0] * streams, before_step=next_step)
    first = {answer: w[0][1][1] for answer, w in windows.items()}  # answer -> its first window's lookahead
    assert first == {f"a{i}": 2 if streams == 1 else 10 for i in range(streams)}
    assert len(gate) == 0 and gate._streams == 0


@pytest.mark.parametrize("min_holdback", [10, 2])
def test_paced_windows_through_the_gate(tiny_bagpiper, long_clip, min_holdback):
    """Paced windows (the gate's clock at 15 ms a step, 4 steps of margin): more, smaller windows
    than the fixed ramp's while the lead builds, tiling the clip. Each window decoded with the full
    lookahead (all of them when the minimum is the full one) equals whole-clip decoding; with less
    at first, those windows differ near their end."""
    extra = {"initial_codec_chunk_frames": 2, "codec_min_right_holdback_frames": min_holdback, "codec_playout_margin_steps": 4}
    payloads, calls = feed_processor(TransferManager(tiny_bagpiper, **extra), long_clip.tokens, gated=True, step_s=0.015)
    fixed, _ = feed_processor(TransferManager(tiny_bagpiper, initial_codec_chunk_frames=2), long_clip.tokens, gated=True)
    assert calls == len(payloads) > len(fixed)
    streamed = _decode(tiny_bagpiper, payloads)
    assert streamed.shape == long_clip.audio.shape
    new = [p.codes.audio.numel() // 8 - p.meta.left_context_size - p.meta.right_holdback_size for p in payloads]
    hop = long_clip.audio.numel() // sum(new)
    errors = {}  # window's lookahead -> max |streamed - whole clip| over its new samples
    for p, start, n in zip(payloads, [0, *torch.tensor(new).cumsum(0).tolist()], new):
        held = 10 if p is payloads[-1] else p.meta.right_holdback_size  # the flush ends the clip
        err = float((streamed[start * hop : (start + n) * hop] - long_clip.audio[start * hop : (start + n) * hop]).abs().max())
        errors[held] = max(errors.get(held, 0.0), err)
    assert errors.pop(10) < ATOL
    assert bool(errors) == (min_holdback < 10) and min(errors, default=10) == min_holdback
    assert min_holdback == 10 or errors[min_holdback] > 100 * ATOL


@pytest.mark.parametrize("step_s", [0.008, 0.0133])
def test_a_ramp_that_follows_the_step_through_the_gate(tiny_bagpiper, long_clip, step_s):
    """`codec_ramp_min_speed_percent` 125: at 13.3 ms a step (1.5x real time) the gate's ramp grows
    by half the frames sent, not by all of them, every window with the full lookahead (whole-clip
    audio); at 8 ms (faster than twice real time) it is the doubling ramp."""
    ramp = {"initial_codec_chunk_frames": 2, "codec_ramp_min_speed_percent": 125}
    followed, _ = feed_processor(TransferManager(tiny_bagpiper, **ramp), long_clip.tokens, gated=True, step_s=step_s)
    fixed, _ = feed_processor(TransferManager(tiny_bagpiper, initial_codec_chunk_frames=2), long_clip.tokens, gated=True)

    def sizes(payloads):
        return [p.codes.audio.numel() // 8 - p.meta.left_context_size - p.meta.right_holdback_size for p in payloads]

    assert sizes(fixed)[:4] == [2, 2, 4, 8]
    assert sizes(followed)[:6] == ([2, 2, 2, 3, 4, 6] if step_s > 0.01 else sizes(fixed)[:6])
    torch.testing.assert_close(_decode(tiny_bagpiper, followed), long_clip.audio, atol=ATOL, rtol=0)


@pytest.mark.parametrize("step_s", [0.0125, 0.025])
def test_a_ramp_from_a_short_lookahead_through_the_gate(tiny_bagpiper, long_clip, step_s):
    """`codec_ramp_min_right_holdback_frames` 2: at 12.5 ms a step the first window leaves when the
    exact ramp's (2 frames) would, with 10 frames and 2 of lookahead, the next ones' lookahead grows
    back to 10 and every window from then on is exact; slower than the speed floor (25 ms) the ramp
    is the exact one."""
    extra = {"initial_codec_chunk_frames": 2, "codec_ramp_min_speed_percent": 125, "codec_ramp_min_right_holdback_frames": 2}
    payloads, calls = feed_processor(TransferManager(tiny_bagpiper, **extra), long_clip.tokens, gated=True, step_s=step_s)
    holdbacks = [p.meta.right_holdback_size for p in payloads[:-1]]  # the last flushes the clip
    if step_s > 0.02:
        assert set(holdbacks) == {10}
    else:
        assert holdbacks[:5] == [2, 2, 2, 5, 10] and holdbacks == sorted(holdbacks)
    streamed = _decode(tiny_bagpiper, payloads)
    new = [p.codes.audio.numel() // 8 - p.meta.left_context_size - p.meta.right_holdback_size for p in payloads]
    assert new[0] == (2 if step_s > 0.02 else 10)
    exact_from = sum(n for n, h in zip(new, holdbacks) if h < 10) * long_clip.audio.numel() // sum(new)
    assert streamed.shape == long_clip.audio.shape and calls == len(payloads)
    torch.testing.assert_close(streamed[exact_from:], long_clip.audio[exact_from:], atol=ATOL, rtol=0)
    assert (exact_from > 0) == (step_s < 0.02)


@pytest.mark.parametrize("rate", [8000, 22050, 48000])
def test_windows_resampled_tile_the_whole_clip_resampled(tiny_bagpiper, long_clip, rate):
    """At a rate asked for, each window is resampled whole (its context and holdback reach across
    the kept edges) and trimmed: joined, the whole clip resampled by torchaudio, to float rounding,
    with no state kept from one window to the next."""
    import torchaudio

    payloads, _ = feed_processor(TransferManager(tiny_bagpiper), long_clip.tokens, first=2, rate=rate)
    assert len(payloads) >= 5
    streamed = _decode(tiny_bagpiper, payloads)
    want = torchaudio.functional.resample(long_clip.audio.float(), 16000, rate)
    assert streamed.shape == want.shape == (long_clip.audio.numel() * rate // 16000,)
    torch.testing.assert_close(streamed, want, atol=ATOL, rtol=0)


def test_processor_streams_each_audio_segment_on_its_own(tiny_bagpiper, reference):
    """The processor alone, called every step or through the gate: the same windows, none across
    the two segments' edge; decoded, ESPnet's per-segment audio."""
    from vllm_omni_speechlm.tokenizer import encode_prompt

    prompt, system = TWO_SEGMENTS_PROMPT
    clip = reference.generate(encode_prompt(reference.tokenizer, reference.cfg, prompt, system=system),
                              SpeechSamplingParams(**TWO_SEGMENTS))
    want, frames = espnet_segment_audio(clip.tokens, reference.cfg, reference.codec)
    plain, _ = feed_processor(TransferManager(tiny_bagpiper), clip.tokens, first=3)
    gated, calls = feed_processor(TransferManager(tiny_bagpiper), clip.tokens, first=3, gated=True)
    assert len(frames) == 2 and len(gated) == len(plain)
    assert calls == len(gated) + 1  # the gate's calls: the windows, and the finish (after text: nothing to send)
    for a, b in zip(plain, gated):
        assert torch.equal(a.codes.audio, b.codes.audio)
        assert (a.meta.left_context_size, a.meta.right_holdback_size) == (b.meta.left_context_size, b.meta.right_holdback_size)
    new = [p.codes.audio.numel() // 8 - p.meta.left_context_size - p.meta.right_holdback_size for p in plain]
    assert frames[0] in torch.tensor(new).cumsum(0).tolist()
    torch.testing.assert_close(_decode(tiny_bagpiper, plain), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("modality", ["audio", "text+audio"])
@pytest.mark.parametrize("first, holdback", [(None, 10), (3, 10), (None, 0)])
def test_window_gate_hands_over_only_window_steps(tiny_bagpiper, reference, modality, first, holdback):
    """The scheduler's gate in front of the processor: the same windows (codes and meta), with
    the processor called once per window instead of once per step."""
    from vllm_omni_speechlm.tokenizer import encode_prompt

    ids = encode_prompt(reference.tokenizer, reference.cfg, PROMPTS[3], system=SYSTEM)
    clip = reference.generate(ids, SpeechSamplingParams(modality=modality, max_text_tokens=8, seed=7, max_tokens=160))
    extra = {"codec_right_holdback_frames": holdback}
    plain, steps = feed_processor(TransferManager(tiny_bagpiper, **extra), clip.tokens, first=first)
    gated, calls = feed_processor(TransferManager(tiny_bagpiper, **extra), clip.tokens, first=first, gated=True)
    assert steps == len(clip.tokens) and len(plain) >= 4
    assert calls == len(gated)
    assert len(gated) == len(plain)
    for a, b in zip(plain, gated):
        assert torch.equal(a.codes.audio, b.codes.audio)
        assert (a.meta.left_context_size, a.meta.right_holdback_size) == (b.meta.left_context_size, b.meta.right_holdback_size)


def test_traced_windows_carry_when_the_gate_handed_them_over(tiny_bagpiper, long_clip, monkeypatch):
    """SPEECHLM_TRACE_WINDOWS: every window the gate hands over, the flush at finish too, carries
    its hand-over time and, no earlier, the time the processor cut it (stage 1's `queue_ms_max`:
    the save thread's lag). Stage 1 merges each window's keys into its request's information, so
    a window without the hand-over time would show the window before's."""
    from vllm_omni_speechlm import window_trace

    monkeypatch.setattr(window_trace, "ENABLED", True)
    payloads, _ = feed_processor(TransferManager(tiny_bagpiper, initial_codec_chunk_frames=2), long_clip.tokens, gated=True)
    stamps = [(getattr(p, window_trace.HANDED_KEY, None), getattr(p, window_trace.SENT_KEY, None)) for p in payloads]
    assert len(stamps) > 2 and all(handed and 0 <= sent - handed < 10_000_000 for handed, sent in stamps)


@pytest.mark.parametrize("modality, rows, reported", [("audio", "text", True), ("audio", "audio", False), ("text", "text", False)])
def test_an_answer_that_had_to_speak_and_did_not_is_reported(tiny_bagpiper, long_clip, caplog, modality, rows, reported):
    """The gate warns, with the stream-0 tokens, when an answer whose modality enforces audio ends
    without one audio row."""
    from vllm_omni_speechlm.config import SpeechLMConfig
    from vllm_omni_speechlm.stage0.window_gate import WindowGate
    from vllm_omni_speechlm.stage_input_processors.speech_codec import chunk_settings

    cfg = SpeechLMConfig.from_model_dir(tiny_bagpiper)
    gate = WindowGate(cfg, chunk_settings(TransferManager(tiny_bagpiper)))
    tokens = long_clip.tokens[:40].clone()
    if rows == "text":
        tokens[:, 0] = cfg.streams[0].vocab_start - 1  # not a codec code
    info = SpeechSamplingParams(modality=modality).to_info()
    request = SimpleNamespace(external_req_id="r0", additional_information=info, output_token_ids=[])
    with caplog.at_level(logging.WARNING):
        for i, row in enumerate(tokens):
            request.output_token_ids.append(int(row[0]))
            gate.offer(request, {"codes": {"audio": row[None]}}, i == len(tokens) - 1)
    warned = [r.getMessage() for r in caplog.records if "asked for audio and ended without any" in r.getMessage()]
    assert len(warned) == reported and len(gate) == 0
    if reported:
        assert "after 40 rows" in warned[0] and str(int(tokens[0, 0])) in warned[0]


def test_full_windows_leave_together_every_batch_steps(tiny_bagpiper, long_clip):
    """`codec_batch_steps` 3, four answers starting one step apart: each full-chunk window waits for
    the next step that is a multiple of 3, so they reach the codec stage on a third of the steps at
    most; first and ramp windows leave when due, as without it. One answer's windows still tile the
    clip and decode to it exactly."""
    from vllm_omni_speechlm.config import SpeechLMConfig
    from vllm_omni_speechlm.stage0.window_gate import WindowGate
    from vllm_omni_speechlm.streaming import window_settings

    def handed(batch: int) -> dict:
        """answer -> [(step, new frames)] of its windows; answer i starts i steps later."""
        gate = WindowGate(SpeechLMConfig.from_model_dir(tiny_bagpiper),
                          window_settings({"initial_codec_chunk_frames": 2, "codec_batch_steps": batch}))
        out = {}
        for answer, windows in _gate_windows(gate, long_clip.tokens[:-1], [0, 1, 2, 3]).items():
            ends = [end for _, (end, _), _ in windows]
            out[answer] = [(step, end - before) for (step, _, _), end, before in zip(windows, ends, [0, *ends])]
        return out

    every, batched = handed(0), handed(3)
    for answer, windows in batched.items():
        assert [n for _, n in windows] == [n for _, n in every[answer]]  # the same windows, some later
        assert all(step % 3 == 0 for step, n in windows if n == 25) and windows[:5] == every[answer][:5]
    full_steps = {step for windows in batched.values() for step, n in windows if n == 25}
    assert len(full_steps) < len({step for windows in every.values() for step, n in windows if n == 25})
    payloads, _ = feed_processor(TransferManager(tiny_bagpiper, initial_codec_chunk_frames=2, codec_batch_steps=3),
                                 long_clip.tokens, gated=True)
    streamed = _decode(tiny_bagpiper, payloads)
    assert streamed.shape == long_clip.audio.shape and float((streamed - long_clip.audio).abs().max()) < ATOL


def test_a_step_offered_at_once_hands_over_what_its_rows_one_by_one_would(tiny_bagpiper, long_clip):
    """The shipped streaming YAML's windows (clocked: a short first lookahead that grows), six
    answers starting at different steps, at 12 ms a step: the scheduler's one `offer_step` per
    step hands over the same windows, at the same steps, with the same codes, as an `offer` per row."""
    from vllm_omni_speechlm.config import SpeechLMConfig
    from vllm_omni_speechlm.stage0.window_gate import WindowGate
    from vllm_omni_speechlm.streaming import window_settings

    extra = yaml.safe_load(Path(stage_configs.path("bagpiper_streaming.yaml")).read_text())["connectors"]["shm"]["extra"]

    def windows(per_row: bool) -> dict:
        now = [0.0]

        def next_step() -> None:
            now[0] += 0.012

        gate = WindowGate(SpeechLMConfig.from_model_dir(tiny_bagpiper), window_settings(extra), clock=lambda: now[0])
        return _gate_windows(gate, long_clip.tokens, [0, 0, 1, 5, 9, 30], next_step, per_row=per_row)

    at_once, one_by_one = windows(False), windows(True)
    assert sum(map(len, at_once.values())) >= 6 * 5
    for answer, want in one_by_one.items():
        got = at_once[answer]
        assert [(step, window) for step, window, _ in got] == [(step, window) for step, window, _ in want]
        assert all(torch.equal(a, b) for (_, _, a), (_, _, b) in zip(got, want))


def test_a_request_no_codec_stage_takes_gets_no_window(tiny_bagpiper, long_clip):
    """`to_codec_stage: false` (a text answer): not one step reaches the adapter, not even the
    finish, and the gate keeps nothing after it."""
    from vllm_omni_speechlm.config import SpeechLMConfig
    from vllm_omni_speechlm.stage0.window_gate import WindowGate
    from vllm_omni_speechlm.stage_input_processors.speech_codec import chunk_settings
    from vllm_omni_speechlm.streaming import TO_CODEC_KEY

    gate = WindowGate(SpeechLMConfig.from_model_dir(tiny_bagpiper), chunk_settings(TransferManager(tiny_bagpiper)))
    info = SpeechSamplingParams(modality="audio").to_info() | {TO_CODEC_KEY: False}
    request = SimpleNamespace(external_req_id="r0", additional_information=info, output_token_ids=[])
    handed = []
    for i, row in enumerate(long_clip.tokens):
        request.output_token_ids.append(int(row[0]))
        handed.append(gate.offer(request, {"codes": {"audio": row[None]}}, i == len(long_clip.tokens) - 1)[0])
    assert len(handed) > 100 and not any(handed)
    assert len(gate) == 0
