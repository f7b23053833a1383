"""Stage 0's step graphs (models/step_graphs.py) on the real engine: graphed steps equal the reference.

On CPU the recorder runs the padded static-buffer step eagerly each time (what a graph replays:
same buffers, padding rows on the scratch slot, next step's aux input staged by the step), and
the oracle is the float32 reference. On a CUDA machine real CUDA graphs are recorded over the
Inductor-compiled step functions, and the oracle is the same functions run without graphs (GPU
float32 kernels do not match the CPU reference bit for bit: tests/test_stage0_engine.py's
comparisons are CPU facts).
"""

import functools
import os

import pytest
import torch

from conftest import worker_sum
from test_stage0_engine import PROMPTS, _assert_batch_equals_solo_runs, _assert_same, _compile_step_functions, _reference

ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.3)
SIZES = [2, 5, 8]  # 1 row runs padded to 2, 3 and 4 rows to 5: padding rows on the scratch slot
CASES = [  # one request each: a lone audio-only row, greedy, top-k, text then audio, CFG
    dict(modality="audio", seed=12),
    dict(modality="text+audio", max_text_tokens=4, text_temperature=0.0, audio_temperature=0.0),
    dict(modality="audio", audio_temperature=1.3, audio_top_k=5, seed=13),
    dict(modality="text+audio", max_text_tokens=5, seed=3),
    dict(modality="audio", cfg_scale=3.0, seed=14),
]
CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def generator(tiny_bagpiper):
    from vllm_omni_speechlm.generator import SpeechLMGenerator

    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc("apply_model")
    with SpeechLMGenerator(tiny_bagpiper, **ENGINE) as gen:
        yield gen


def _use_graphs(recorder: str | None, backend: str | None, model) -> int:
    """Step functions compiled by `backend` (None: eager), step graphs recorded by `recorder`
    (None: off)."""
    from vllm_omni_speechlm.models.step_graphs import cuda_graph, run_eagerly

    _compile_step_functions(backend, model)
    model.steps.use_step_graphs({"eager": run_eagerly, "cuda": cuda_graph, None: None}[recorder], SIZES)
    return 0


def _set_graphs(generator, recorder: str | None, backend: str | None = None) -> None:
    worker_sum(generator.omni, functools.partial(_use_graphs, recorder, backend))


def _graph_counts(model) -> tuple[int, int, int]:
    """(graphed steps, steps whose aux input a graph staged, live requests)."""
    return model.steps.graphs.num_replays, model.steps.num_graph_staged_steps, len(model.steps)


def _counts(generator) -> tuple[int, int, int]:
    [counts] = generator.omni.engine.collective_rpc("apply_model", args=(_graph_counts,), stage_ids=[0])
    return tuple(counts[0] if isinstance(counts, list) else counts)


def _single_runs(generator) -> list[dict]:
    return [generator.generate(PROMPTS[2], max_tokens=30, **kw)[0] for kw in CASES]


@pytest.mark.skipif(CUDA, reason="the float32 reference equals the engine bitwise on CPU only")
def test_graphed_steps_equal_reference(generator, reference):
    """A mixed batch (text rows, audio rows, requests finishing at different steps: batch sizes
    8 down to 1, padded) and the single requests all equal the reference."""
    _set_graphs(generator, "eager")
    try:
        _assert_batch_equals_solo_runs(generator, reference)
        for kw, result in zip(CASES, _single_runs(generator)):
            _assert_same(result, _reference(reference, generator, PROMPTS[2], **dict(kw, max_tokens=30)))
        replays, staged, live = _counts(generator)
        assert replays > 100 and staged > 100  # most steps replayed, and fed the next step
        assert live == 0
    finally:
        _set_graphs(generator, None)


@pytest.mark.skipif(CUDA, reason="the float32 reference equals the engine bitwise on CPU only")
def test_guided_steps_replay_the_graphs(generator, reference):
    """A batch of guided and unguided answers (2 CFG pairs and 2 lone rows: 6 rows padded to 8,
    padding rows paired with themselves) replays the step graphs and equals the reference."""
    from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

    _set_graphs(generator, "eager")
    try:
        kws = [dict(modality="audio", cfg_scale=scale, seed=5, max_tokens=30) for scale in (3.0, 1.0, 2.0, 1.0)]
        prompts = [generator.encode(prompt, None) for prompt in PROMPTS]
        results = generator.run([generator.engine_request(ids, SpeechSamplingParams(**kw)) for ids, kw in zip(prompts, kws)])
        for ids, kw, result in zip(prompts, kws, results):
            _assert_same(result, reference.generate(ids, SpeechSamplingParams(**kw)))
        replays, _, live = _counts(generator)
        assert replays > 20 and live == 0
    finally:
        _set_graphs(generator, None)


def _recorded_keys(model) -> int:
    return len(model.steps.graphs._graphs)


def _warm_up_graphs(model) -> int:
    from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

    values = SpeechSamplingParams().resolve(model.speech).row_values()
    return model.steps.graphs.warm_up(max(values.text_top_k, values.audio_top_k))


@pytest.mark.skipif(CUDA, reason="the float32 reference equals the engine bitwise on CPU only")
def test_warm_up_records_what_a_first_request_replays(generator, reference):
    """vLLM's warm-up records the graphs of one request with the checkpoint's sampling (one row
    or a CFG pair, text rows or none): that request, guided or not, records nothing more."""
    _set_graphs(generator, "eager")
    try:
        assert worker_sum(generator.omni, _warm_up_graphs) == 4  # size 2 (1 row and a pair run at 2)
        for cfg_scale in (1.0, 3.0):
            generator.generate(PROMPTS[1], max_tokens=30, modality="text+audio", max_text_tokens=3, cfg_scale=cfg_scale)
        assert worker_sum(generator.omni, _recorded_keys) == 4 and _counts(generator)[0] > 20
    finally:
        _set_graphs(generator, None)


def _failing_recorder(fn, pool):
    raise RuntimeError("no graphs here")


def _use_failing_recorder(model) -> int:
    model.steps.use_step_graphs(_failing_recorder, SIZES)
    return 0


def _recording_disabled(model) -> int:
    return int(model.steps.graphs.record is None and model.steps.graphs.num_replays == 0)


@pytest.mark.skipif(CUDA, reason="the float32 reference equals the engine bitwise on CPU only")
def test_steps_run_ungraphed_when_recording_fails(generator, reference):
    """A recorder failure is logged and the engine keeps serving, ungraphed and exactly."""
    worker_sum(generator.omni, _use_failing_recorder)
    try:
        kw = dict(modality="audio", seed=15, max_tokens=20)
        [result] = generator.generate(PROMPTS[1], **kw)
        _assert_same(result, _reference(reference, generator, PROMPTS[1], **kw))
        assert worker_sum(generator.omni, _recording_disabled) == 1
    finally:
        _set_graphs(generator, None)


@pytest.mark.skipif(not CUDA, reason="CUDA graphs")
def test_cuda_graphs_equal_the_steps_they_record(generator):
    """On the GPU: the single requests with the Inductor-compiled step functions, replayed from
    CUDA graphs (padded) and run as they are, give the same tokens."""
    try:
        _set_graphs(generator, None, "inductor")
        expected = _single_runs(generator)
        _set_graphs(generator, "cuda", "inductor")
        for result, want in zip(_single_runs(generator), expected):
            assert result["stream_token_ids"] == want["stream_token_ids"]
        replays, staged, live = _counts(generator)
        assert replays > 60 and staged > 60 and live == 0
    finally:
        _set_graphs(generator, None)


def test_table_keeps_rows_and_scratch_slot_when_it_grows():
    from vllm_omni_speechlm.config import bagpiper_layout
    from vllm_omni_speechlm.models.request_state import RequestTable
    from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

    cfg = bagpiper_layout()
    table = RequestTable(cfg, capacity=2, max_output_len=4, device=torch.device("cpu"))
    entries = [table.admit(f"r{i}", SpeechSamplingParams(audio_top_k=i + 1).resolve(cfg)) for i in range(3)]
    table.write_admitted()
    assert table.generation == 1 and table.capacity == 4 and table.scratch == 4
    assert sorted(e.slot for e in entries) == [0, 1, 2] and table.scratch not in table.free
    assert table.ints[[e.slot for e in entries], 1].tolist() == [1, 2, 3]
    assert table.phase.shape[0] == table.aux_history.shape[0] == 5


def _vllm_config(device: str, cudagraph_mode, extra: dict | None = None, tp: int = 1):
    from types import SimpleNamespace

    from vllm.config import CompilationMode

    compilation = SimpleNamespace(mode=CompilationMode.VLLM_COMPILE, cudagraph_mode=cudagraph_mode, cudagraph_capture_sizes=[1, 2, 4, 8])
    return SimpleNamespace(device_config=SimpleNamespace(device_type=device), compilation_config=compilation, additional_config=extra or {},
                           parallel_config=SimpleNamespace(tensor_parallel_size=tp))


def test_step_graphs_follow_vllms_graphs_and_the_switch():
    """On where vLLM graphs the backbone, at its capture sizes; off on CPU, with vLLM's graphs off
    (enforce_eager) and with `--additional-config '{"speech_lm_step_graphs": false}'`; on under tensor
    parallelism too."""
    from vllm.config import CUDAGraphMode

    from vllm_omni_speechlm.config import STEP_GRAPHS_KEY
    from vllm_omni_speechlm.models.steps import step_graph_sizes

    assert step_graph_sizes(_vllm_config("cuda", CUDAGraphMode.FULL_AND_PIECEWISE)) == [2, 4, 8]  # 1 row runs at 2
    assert step_graph_sizes(_vllm_config("cuda", CUDAGraphMode.FULL_AND_PIECEWISE, {STEP_GRAPHS_KEY: True})) == [2, 4, 8]
    assert step_graph_sizes(_vllm_config("cuda", CUDAGraphMode.FULL_AND_PIECEWISE, {STEP_GRAPHS_KEY: False})) == []
    assert step_graph_sizes(_vllm_config("cuda", CUDAGraphMode.NONE)) == []
    assert step_graph_sizes(_vllm_config("cpu", CUDAGraphMode.FULL_AND_PIECEWISE)) == []
    assert step_graph_sizes(_vllm_config("cuda", CUDAGraphMode.FULL_AND_PIECEWISE, tp=2)) == [2, 4, 8]
