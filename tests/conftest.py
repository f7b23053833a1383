"""Shared fixtures: tiny checkpoints are made once per test session, never downloaded.

Tests are tiered by folder, each folder a pytest marker: `unit` (no engine), `engine` (real vLLM /
vllm-omni engines in this process, CPU), `server` (`vllm serve` driven over HTTP). `make test`
runs all; `make test PYTEST_ARGS="-m unit"` one tier.
"""

import os
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest

from devtools import selftest_pipelines

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# The self-test pipelines (devtools/), registered in every process: spawned engines, workers and
# servers inherit the variables.
selftest_pipelines.enable()

TIERS = ("unit", "engine", "server")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        tier = item.path.parent.name
        if tier in TIERS:
            item.add_marker(getattr(pytest.mark, tier))


@pytest.fixture(scope="session")
def tiny_bagpiper(tmp_path_factory) -> str:
    from vllm_omni_speechlm.make_tiny import make_tiny

    out = tmp_path_factory.mktemp("tiny-bagpiper")
    make_tiny("bagpiper", out, seed=0)
    return str(out)


@pytest.fixture(scope="session")
def reference(tiny_bagpiper):
    from vllm_omni_speechlm.reference import ReferenceSpeechLM

    return ReferenceSpeechLM(tiny_bagpiper)


def _make_tiny(tmp_path_factory, family: str) -> str:
    from vllm_omni_speechlm.make_tiny import make_tiny

    out = tmp_path_factory.mktemp(f"tiny-{family}")
    make_tiny(family, out, seed=0)
    return str(out)


@pytest.fixture(scope="session")
def tiny_opuslm(tmp_path_factory) -> str:
    return _make_tiny(tmp_path_factory, "opuslm")


@pytest.fixture(scope="session")
def tiny_opuslm_dialogue(tmp_path_factory) -> str:
    return _make_tiny(tmp_path_factory, "opuslm-dialogue")


# --- CPU platform tests (tests/test_cpu_platform*.py) -------------------------------------------


def _make_cpu_platform_tiny_qwen3(path: Path) -> Path:
    """Random tiny Qwen3ForCausalLM + a local word-level tokenizer (no hub access).

    head_dim is 32 because vLLM's CPU attention supports head sizes 32..512 only; float32 and a
    wide init keep greedy decoding free of near-ties, so two engines must agree token for token.
    """
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

    vocab = {f"t{i}": i for i in range(255)} | {"<eos>": 255}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<eos>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<eos>", unk_token="<eos>", pad_token="<eos>"
    ).save_pretrained(path)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        bos_token_id=255,
        eos_token_id=255,
        tie_word_embeddings=False,
        torch_dtype="float32",
        initializer_range=0.2,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def cpu_platform_tiny_qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _make_cpu_platform_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3"))


@pytest.fixture(scope="session")
def cpu_platform_plugins_loaded() -> None:
    """Run the installed ``vllm.general_plugins`` entry points in this (orchestrator) process.

    Engine and worker processes run them on their own; the offline ``Omni`` orchestrator does
    not before it resolves the pipeline, so tests do what an application has to do.
    """
    from vllm.plugins import load_general_plugins

    load_general_plugins()


CPU_PLATFORM_PROMPTS = ([1, 2, 3, 4, 5], [17, 200, 3, 99, 42, 8, 120])
CPU_PLATFORM_AR_DEPLOY = """\
pipeline: speechlm_selftest_ar
async_chunk: false
stages:
  - stage_id: 0
    max_num_seqs: 4
    max_model_len: 256
    enforce_eager: true
    dtype: float32
"""
CPU_PLATFORM_MAX_TOKENS = 12


@pytest.fixture(scope="session")
def cpu_platform_vllm_greedy(cpu_platform_tiny_qwen3) -> dict[tuple[int, ...], list[int]]:
    """Greedy tokens of plain vLLM (its own CPUWorker, no omni code) per prompt in
    ``CPU_PLATFORM_PROMPTS``; the engine is shut down before any Omni engine starts."""
    import gc

    from vllm import LLM, SamplingParams

    llm = LLM(
        model=str(cpu_platform_tiny_qwen3), dtype="float32", enforce_eager=True, max_model_len=256, max_num_seqs=4
    )
    try:
        params = SamplingParams(temperature=0.0, max_tokens=CPU_PLATFORM_MAX_TOKENS, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in CPU_PLATFORM_PROMPTS], params, use_tqdm=False)
        return {tuple(p): list(o.outputs[0].token_ids) for p, o in zip(CPU_PLATFORM_PROMPTS, outs)}
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


# --- shared memory ------------------------------------------------------------------------------
SHM_DIR = "/dev/shm"


def shm_names() -> set[str]:
    return set(os.listdir(SHM_DIR))


def _shm_mapped_by_others() -> set[str]:
    """/dev/shm names mapped by processes outside this test process's tree (another test run's
    engines on the same machine), which this run's checks must not count."""
    import psutil

    ours = {os.getpid()} | {p.pid for p in psutil.Process().children(recursive=True)}
    mapped = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in ours:
            continue
        try:
            with open(f"/proc/{pid}/maps") as f:
                mapped |= {line.split(SHM_DIR + "/", 1)[1].split()[0] for line in f if SHM_DIR + "/" in line}
        except (OSError, IndexError):
            continue
    return mapped


# Python's multiprocessing names its anonymous segments and semaphores so: vLLM's and vllm-omni's
# IPC buffers and locks, which the resource tracker unlinks when they are freed or at exit. This
# project's windows and their lock files are the connector's, named by request (`shm_*`, `*_0_N`).
MULTIPROCESSING_PREFIXES = ("psm_", "sem.mp-")


def new_shm(before: set[str]) -> set[str]:
    """Segments created since `before` that are this run's (held by it, or by nobody: leaked),
    multiprocessing's own left out (their unlinking may wait for the test process's exit)."""
    new = {n for n in shm_names() - before if not n.startswith(MULTIPROCESSING_PREFIXES)}
    return new - _shm_mapped_by_others()


# --- the OpenAI-compatible server (tests/test_serving_*.py) -------------------------------------


def start_speechlm_server(model_dir: str, deploy_yaml: str, log_dir: Path, env: dict[str, str] | None = None):
    """Start `vllm serve` on a free local port (with `env` added to its environment), wait until
    healthy, yield it, stop it (fixtures)."""
    from vllm_omni_speechlm import stage_configs
    from devtools.launch import SpeechLMServer

    server = SpeechLMServer(model_dir, stage_configs.path(deploy_yaml), log_dir / "server.log", env=env)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def flatten(values):
    """collective_rpc's results, nested per stage and worker, as one flat sequence."""
    for v in values:
        if isinstance(v, (list, tuple)):
            yield from flatten(v)
        else:
            yield v


def live_requests(model) -> int:
    """Requests whose per-request state stage 0's model still holds (for `worker_sum`)."""
    return len(model.steps)


def scheduler_with_blocks(cls, vllm_config, num_blocks: int, block_size: int):
    """A stage-0 scheduler `cls` over a KV cache of `num_blocks` blocks (no engine, no device)."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    vllm_config.cache_config.num_gpu_blocks = num_blocks  # read once, at construction
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=32, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["l0"], spec)])
    return cls(vllm_config=vllm_config, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vllm_config),
               block_size=block_size, log_stats=True)


def worker_sum(omni, fn) -> int:
    """Sum of `fn(model)` over stage 0's workers (collective_rpc "apply_model")."""
    return sum(flatten(omni.engine.collective_rpc("apply_model", args=(fn,), stage_ids=[0])))


def reference_with_clips(reference, generator, prompt: str, clips: list, system: str = "Be brief.", **kw):
    """The reference's answer to a prompt with audio clips (none: a text prompt)."""
    from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

    ids = generator.encode(prompt, system, audio=len(clips))
    return reference.generate(ids, SpeechSamplingParams(**kw), audio=clips)


def assert_result_equals_reference(result: dict, ref) -> None:
    """A generator result (waveform form) equals the reference: every stream, text, finish, audio."""
    import torch

    assert torch.equal(torch.tensor(result["stream_token_ids"]), ref.tokens)
    assert result["text"] == ref.text and result["finish_reason"] == ref.finish_reason
    if ref.audio is None:
        assert result["waveform"] is None
    else:
        torch.testing.assert_close(result["waveform"], ref.audio, atol=1e-5, rtol=0)


def step_graphs_eagerly(on: bool, model) -> int:
    """Stage 0's steps as step graphs replay them (models/step_graphs.py), run eagerly (CPU; 3 and
    4 rows pad to 5, 1 to 2), or not (False). For `worker_sum`."""
    from vllm_omni_speechlm.models.step_graphs import run_eagerly

    model.steps.use_step_graphs(run_eagerly if on else None, [2, 5, 8])
    return 0


# --- answers with several audio segments ------------------------------------------------------------

# A request whose answer holds two audio segments: audio, <|eot|>, the model's choice (greedy) of
# audio again, <|eot|>, then text. Found by searching seeds 0..299 of these options (modality audio
# and text+audio, prompts "Say hello to the world." and "Hi.", system "Be brief.") with the
# reference for answers whose audio rows form two runs: "Say hello to the world." in audio mode,
# seeds 89 (runs of 21 and 12 rows) and 230 (26 and 22: 19 and 15 frames).
TWO_SEGMENTS_PROMPT = ("Say hello to the world.", "Be brief.")
TWO_SEGMENTS = dict(modality="audio", seed=230, min_audio_frames=8, max_audio_frames=40, max_text_tokens=6,
                    max_tokens=120)


def espnet_segment_audio(tokens, cfg, codec):
    """The answer's audio as ESPnet's inference makes it (parallel.py `inference`, audio.py
    `decode_batch`): per audio segment, the rows after its `<|audio|>` modality row up to its end
    row (eos / eot) or the answer's next row, de-interleaved and decoded on their own; the
    segments' waveforms back to back. Also returns the segments' frame counts."""
    import torch

    from vllm_omni_speechlm.delay_pattern import CodebookMap, deinterleave

    s0 = cfg.streams[0]
    stream0 = tokens[:, 0].tolist()
    audio, frames = [], []
    for start in [i + 1 for i, t in enumerate(stream0) if t == cfg.specials.audio]:
        end = start
        while end < len(stream0) and s0.vocab_start <= stream0[end] < s0.vocab_end:
            end += 1
        codes = CodebookMap(cfg).to_codes(deinterleave(tokens[start:end]))[:, -cfg.codec.num_quantizers :]
        with torch.inference_mode():
            audio.append(codec(codes.T[None])[0].float())
        frames.append(codes.shape[0])
    return torch.cat(audio), frames


def commit_received(wire: dict) -> SimpleNamespace:
    """Stage 1's side of a window read off the wire: the request after vllm-omni's real receiving
    adapter code (`_commit_received_chunk`) committed `wire`, and whether it marked the upstream
    exhausted or the segment finished."""
    from vllm_omni.distributed.omni_connectors.transfer_adapter.chunk_transfer_adapter import (
        OmniChunkTransferAdapter as Adapter,
    )

    receiver = SimpleNamespace(
        get_req_chunk={"r": 0}, model_mode="generation", upstream_exhausted_requests=set(),
        segment_finished_requests=set(), _finished_load_reqs=set(), _is_truthy_scalar=Adapter._is_truthy_scalar,
        _refresh_generation_chunk_prefill_state=Adapter._refresh_generation_chunk_prefill_state,
    )
    request = SimpleNamespace(additional_information=None, prompt_token_ids=[], resumable=False)
    assert Adapter._commit_received_chunk(receiver, request, (wire, 0), stage_id=1, req_id="r", chunk_id=0,
                                          connector_get_key="k")
    return SimpleNamespace(request=request, exhausted="r" in receiver.upstream_exhausted_requests,
                           segment_finished="r" in receiver.segment_finished_requests)


# --- the stage-0 -> stage-1 processor outside an engine -------------------------------------------


class TransferManager:
    """The adapter attributes the processor may touch; __slots__ makes any other state an error."""

    __slots__ = ("config", "connector", "code_prompt_token_ids", "request_payload")

    def __init__(self, model_dir: str, **extra: int) -> None:
        from vllm_omni_speechlm.streaming import WINDOW_DEFAULTS

        self.config = SimpleNamespace(model=model_dir)
        self.connector = SimpleNamespace(config={"extra": {**WINDOW_DEFAULTS, **extra}})
        self.code_prompt_token_ids = defaultdict(list)
        self.request_payload = {}


def feed_processor(tm: TransferManager, tokens, *, gated: bool = False, req_id: str = "r0", first: int | None = None,
                   rate: int | None = None, step_s: float = 0.01):
    """Run the processor over [L, S] step rows the way the adapter does, each step offered to the
    scheduler's `WindowGate` first when `gated` (its clock advancing `step_s` per step); `first` /
    `rate`: the request's first window and output rate. Returns (payloads sent, processor calls)."""
    from vllm_omni.distributed.omni_connectors.utils.serialization import OmniSerializer

    from vllm_omni_speechlm.config import SpeechLMConfig
    from vllm_omni_speechlm.frames import FrameRows
    from vllm_omni_speechlm.resample import RATE_KEY
    from vllm_omni_speechlm.stage0.window_gate import WindowGate
    from vllm_omni_speechlm.stage_input_processors import speech_codec
    from vllm_omni_speechlm.streaming import INITIAL_CHUNK_KEY

    info = {k: v for k, v in ((INITIAL_CHUNK_KEY, first), (RATE_KEY, rate)) if v is not None} or None
    request = SimpleNamespace(external_req_id=req_id, additional_information=info, output_token_ids=[])
    now = [0.0]
    gate = WindowGate(SpeechLMConfig.from_model_dir(tm.config.model), speech_codec.chunk_settings(tm),
                      clock=lambda: now[0]) if gated else None
    sent, calls = [], 0
    for i, row in enumerate(tokens):
        now[0] += step_s
        finished, output = i == len(tokens) - 1, {"codes": {"audio": row[None]}}  # as the adapter passes it
        request.output_token_ids.append(int(row[0]))  # vLLM's request holds the step's token by then
        if gate is not None:  # as the scheduler offers a step: a running request's frames at once
            gate.tick()
            if finished:  # the scheduler's payload has flat keys; the adapter unflattens them
                hand_over, output = gate.offer(request, {"codes.audio": row[None]}, finished)
            else:
                handed = gate.offer_step(FrameRows(row[None], [True]), [(request, 0)])
                hand_over, output = bool(handed), handed[0][1] if handed else None
            if not hand_over:
                continue
        calls += 1
        payload = speech_codec.speechlm2codec_async_chunk(tm, output, request, is_finished=finished)
        if payload is not None:  # its codes as stage 1 decodes them off the wire
            payload.codes.audio = OmniSerializer.deserialize(OmniSerializer.serialize(payload.codes.audio))
            sent.append(payload)
    assert gate is None or len(gate) == 0  # the finishing step closed the request
    return sent, calls
