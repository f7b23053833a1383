"""The paired-CFG scheduler's guided segments, on real vLLM-Omni schedulers driven as vLLM's
EngineCore drives them (sync; async with one step in flight) by a scripted model: each request
emits the rows of its script, and a companion emits its main's row (as the model makes it).

Every audio row must be computed in a step that also schedules the main's companion, no text row
may be, and each companion's prompt must be ESPnet's unguided context: all pad over the main's
context before the segment's modality token, then that token (or, for an answer that opens with
audio, the all-pad prompt the pair starts with). The scheduler itself raises if a pair's members
are scheduled apart or at different lengths."""

import copy
import random

import pytest
from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
from vllm.plugins import load_general_plugins
from vllm.sampling_params import SamplingParams
from vllm_omni.outputs import OmniModelRunnerOutput
from vllm_omni.request import OmniRequest

from conftest import scheduler_with_blocks
from vllm_omni_speechlm.cfg import is_companion, main_id
from vllm_omni_speechlm.compat import encoder_cache_held
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
from vllm_omni_speechlm.stage0.scheduler import PairedCFGAsyncScheduler, PairedCFGScheduler

pytestmark = pytest.mark.unit
BLOCK = 16

# (output mode, rows): T a text token, C a stream-0 audio code, dfe the deferred eos.
SCRIPTS = {
    "text+audio": ("text+audio", "text T T T eot asst audio" + " C" * 12 + " eos"),
    "deferred_eos": ("text+audio", "text T T dfe asst audio" + " C" * 8 + " eos"),
    "audio_twice": ("audio", "audio" + " C" * 8 + " eot asst audio" + " C" * 6 + " eos"),
    "auto": ("auto", "text T T eot asst audio" + " C" * 6 + " eos"),
    "audio_at_max": ("text+audio", "text T eot asst audio" + " C" * 5 + " asst text T T eos"),
    "unguided": ("audio", "audio" + " C" * 5 + " eos"),
}


@pytest.fixture(scope="module")
def speech(tiny_bagpiper) -> SpeechLMConfig:
    return SpeechLMConfig.from_model_dir(tiny_bagpiper)


def _vllm_config(model_dir: str, max_num_seqs: int) -> VllmConfig:
    load_general_plugins()
    model = ModelConfig(model=model_dir, dtype="float32", max_model_len=128, skip_tokenizer_init=True)
    scheduler = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=512, max_model_len=128, is_encoder_decoder=False,
        enable_chunked_prefill=False,
    )
    return VllmConfig(model_config=model, scheduler_config=scheduler, cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=False))


def _scheduler(cls, vllm_config: VllmConfig, num_blocks: int = 400):
    return scheduler_with_blocks(cls, vllm_config, num_blocks, BLOCK)


def _ids(speech: SpeechLMConfig, script: str) -> list[int]:
    sp = speech.specials
    names = {"text": sp.text, "audio": sp.audio, "asst": sp.assistant, "eot": sp.eot, "eos": sp.eos,
             "dfe": speech.decoding.deferred_eos, "T": speech.text_range[0] + 10, "C": speech.streams[0].vocab_start + 3}
    return [names[t] for t in script.split()]


def _clip(speech: SpeechLMConfig, rng: random.Random, i: int) -> tuple[list[int], list[MultiModalFeatureSpec]]:
    """A clip's placeholder rows after <|user|><|audio|>, as vLLM's processor leaves a prompt; every
    third request hears the same clip (one cached encoder output, several references)."""
    rows = rng.randint(3, 9)
    spec = MultiModalFeatureSpec(data=None, modality="audio", identifier=f"clip-{i % 3}-{rows}",
                                 mm_position=PlaceholderRange(offset=3, length=rows))
    sp = speech.specials
    return [sp.bos, sp.user, sp.audio] + [speech.audio_input.placeholder_id] * rows + [sp.eos], [spec]


def _requests(speech: SpeechLMConfig, names: list[str], clips: bool = False) -> tuple[list[OmniRequest], dict[str, list[int]]]:
    rng = random.Random(0)
    requests, scripts = [], {}
    for i, name in enumerate(names):
        mode, script = SCRIPTS[name]
        rid = f"{i}_{name}"
        scripts[rid] = _ids(speech, script)
        params = SamplingParams(max_tokens=len(scripts[rid]) + 4)
        params.update_from_generation_config({}, speech.specials.eos)
        info = SpeechSamplingParams(modality=mode, cfg_scale=1.0 if name == "unguided" else 3.0).to_info()
        prompt = [speech.text_range[0] + rng.randrange(50) for _ in range(rng.randint(4, 12))]
        audio, features = _clip(speech, rng, i) if clips else ([], None)
        requests.append(OmniRequest(request_id=rid, prompt_token_ids=audio + prompt, sampling_params=params,
                                    pooling_params=None, arrival_time=float(i), additional_information=info,
                                    mm_features=features))
    return requests, scripts


def _rows(scheduler, scheduler_output) -> dict[str, int]:
    """The main-request output row each scheduled request samples in this step."""
    rows = {}
    for rid in scheduler_output.num_scheduled_tokens:
        main = scheduler.requests[main_id(rid)]
        rows[rid] = scheduler.requests[rid].num_computed_tokens - main.num_prompt_tokens
    return rows


def _row(script: list[int], row: int) -> int:
    return script[row] if row < len(script) else 0


def _run(scheduler, requests, scripts, depth: int):
    """Drive `scheduler` like vLLM's EngineCore, `depth` steps in flight. Returns each main's
    emitted tokens, the rows each main computed with its companion, and the companions' prompts."""
    for request in requests:
        scheduler.add_request(request)
    emitted = {r.request_id: [] for r in requests}
    guided = {r.request_id: set() for r in requests}
    prompts = []
    in_flight, step = [], 0
    while scheduler.has_unfinished_requests() or in_flight:
        if scheduler.has_unfinished_requests():
            output = scheduler.schedule()
            rows = _rows(scheduler, output)
            new = [r for r in output.scheduled_new_reqs if is_companion(r.req_id)]
            prompts += [(main_id(r.req_id), rows[r.req_id], r.prompt_token_ids) for r in new]
            for rid, row in rows.items():
                if is_companion(rid):
                    assert rows[main_id(rid)] == row
                    guided[main_id(rid)].add(row)
            in_flight.append((output, rows))
        if len(in_flight) == depth or not scheduler.has_unfinished_requests():
            output, rows = in_flight.pop(0)
            ids = list(output.num_scheduled_tokens)
            # Async scheduling runs a step past a request's end before it sees the end: any token.
            tokens = [[_row(scripts[main_id(rid)], rows[rid])] for rid in ids]
            runner = OmniModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=tokens)
            for outs in scheduler.update_from_output(output, runner).values():
                for out in outs.outputs:
                    assert not is_companion(out.request_id)
                    emitted[out.request_id] += out.new_token_ids
        step += 1
        assert step < 2000
    return emitted, guided, prompts


def _segments(speech: SpeechLMConfig, script: list[int]) -> tuple[set[int], set[int]]:
    """(audio rows, text rows) of a script: the rows after a modality token through its end."""
    sp, audio, text = speech.specials, set(), set()
    rows, current = None, None
    for i, tok in enumerate(script):
        if tok in (sp.text, sp.audio):
            current, rows = tok, (audio if tok == sp.audio else text)
            continue
        if current is None:
            continue
        if tok == sp.assistant:  # forced after a max length: not a segment row
            current = None
            continue
        rows.add(i)
        if tok in (sp.eos, sp.eot, speech.decoding.deferred_eos):
            current = None
    return audio, text


def _expected_prompts(speech: SpeechLMConfig, requests, scripts) -> list[tuple[str, int, list[int]]]:
    """(main, row of the companion's first step, prompt) of each companion, as ESPnet builds the
    unguided context."""
    sp, out = speech.specials, []
    for request in requests:
        mode, _ = SCRIPTS[request.request_id.split("_", 1)[1]]
        if request.request_id.endswith("unguided"):
            continue
        script, p = scripts[request.request_id], request.num_prompt_tokens
        for row, tok in enumerate(script):
            if tok != sp.audio:
                continue
            if row == 0 and mode == "audio":  # the pair starts at arrival, computing the modality row
                out.append((request.request_id, 0, [sp.pad] * p))
            else:
                out.append((request.request_id, row + 1, [sp.pad] * (p + row) + [sp.audio]))
    return sorted(out)


@pytest.mark.parametrize("max_num_seqs,num_blocks", [(16, 400), (3, 400), (16, 10)], ids=["roomy", "three_slots", "ten_blocks"])
@pytest.mark.parametrize("cls,depth", [(PairedCFGScheduler, 1), (PairedCFGAsyncScheduler, 2)], ids=["sync", "async"])
def test_companion_lives_exactly_through_guided_segments(tiny_bagpiper, speech, cls, depth, max_num_seqs, num_blocks):
    names = list(SCRIPTS) * 2
    requests, scripts = _requests(speech, names)
    scheduler = _scheduler(cls, _vllm_config(tiny_bagpiper, max_num_seqs), num_blocks)
    engine_requests = copy.deepcopy(requests)
    emitted, guided, prompts = _run(scheduler, engine_requests, scripts, depth)
    assert emitted == scripts
    if num_blocks < 400:
        assert any(r.num_preemptions for r in engine_requests), "the small cache must preempt"
    for request in requests:
        rid = request.request_id
        audio, text = _segments(speech, scripts[rid])
        if rid.endswith("unguided"):
            assert not guided[rid]
            continue
        assert audio <= guided[rid], f"{rid}: audio rows decoded unguided: {sorted(audio - guided[rid])}"
        assert not text & guided[rid], f"{rid}: text rows with a companion: {sorted(text & guided[rid])}"
    assert sorted(prompts) == _expected_prompts(speech, requests, scripts)
    assert not scheduler.partner and not scheduler._guided and not scheduler._guided_from and not scheduler.requests


@pytest.mark.parametrize("num_blocks", [400, 10], ids=["roomy", "ten_blocks"])
@pytest.mark.parametrize("cls,depth", [(PairedCFGScheduler, 1), (PairedCFGAsyncScheduler, 2)], ids=["sync", "async"])
def test_clips_are_given_back_when_requests_finish(tiny_bagpiper, speech, cls, depth, num_blocks):
    """Prompts with clips (shared between requests), CFG pairs, preemption: the answers are the
    scripts, and once every request has finished no encoder-cache entry is held."""
    requests, scripts = _requests(speech, list(SCRIPTS) * 2, clips=True)
    scheduler = _scheduler(cls, _vllm_config(tiny_bagpiper, 16), num_blocks)
    assert scheduler.encoder_cache_manager is not None  # the model takes audio: vLLM budgets its encoder
    emitted, _, _ = _run(scheduler, copy.deepcopy(requests), scripts, depth)
    assert emitted == scripts
    assert encoder_cache_held(scheduler) == (0, 0)


@pytest.mark.parametrize("cls", [PairedCFGScheduler, PairedCFGAsyncScheduler], ids=["sync", "async"])
def test_clips_are_given_back_when_requests_abort(tiny_bagpiper, speech, cls):
    """Aborted mid-answer (mains of guided segments included): no encoder-cache entry is held."""
    from vllm.v1.request import RequestStatus

    requests, scripts = _requests(speech, list(SCRIPTS), clips=True)
    scheduler = _scheduler(cls, _vllm_config(tiny_bagpiper, 16))
    for request in requests:
        scheduler.add_request(request)
    for step in range(4):  # prefilled, a few rows in
        output = scheduler.schedule()
        if step == 0:  # the clips' encoder outputs are scheduled and held by their requests
            assert output.scheduled_encoder_inputs and min(encoder_cache_held(scheduler)) > 0
        ids = list(output.num_scheduled_tokens)
        rows = _rows(scheduler, output)
        tokens = [[_row(scripts[main_id(rid)], rows[rid])] for rid in ids]
        runner = OmniModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, sampled_token_ids=tokens)
        scheduler.update_from_output(output, runner)
    assert encoder_cache_held(scheduler)[0] == 0  # prefilled: vLLM drops a clip's reference once its rows ran
    scheduler.finish_requests([r.request_id for r in requests], RequestStatus.FINISHED_ABORTED)
    assert encoder_cache_held(scheduler) == (0, 0) and not scheduler.requests and not scheduler.partner


def test_a_companion_of_a_seeded_request_is_not_seeded(tiny_bagpiper, speech):
    """Its samples are replaced by its main's, so only the main keeps the seed (a seeded row makes
    vLLM's sampler draw that row's noise on its own)."""
    requests, _ = _requests(speech, ["audio_twice", "unguided"])
    for seed, request in enumerate(requests, start=7):
        request.sampling_params.seed = seed
    scheduler = _scheduler(PairedCFGScheduler, _vllm_config(tiny_bagpiper, 16))
    for request in requests:
        scheduler.add_request(request)
    scheduler.schedule()  # an answer that opens with audio has its companion from arrival
    seeds = {rid: r.sampling_params.seed for rid, r in scheduler.requests.items()}
    assert seeds == {"0_audio_twice": 7, "0_audio_twice::cfg-uncond": None, "1_unguided": 8}, seeds
