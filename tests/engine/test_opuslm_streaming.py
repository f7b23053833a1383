"""`opuslm_two_stage` on CPU for both OpusLM families: speech LM -> DAC decoder, audio streamed.

One two-stage engine per family (tiny checkpoints, float32). In one batch, requests that drain
and requests cut by max_tokens: each stream, concatenated, equals whole-clip DAC decoding of the
reference's codes (T frames: the drain rows complete the matrix, the final eos is not audio).
"""

from __future__ import annotations

import time
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from vllm_omni_speechlm import stage_configs
from conftest import TransferManager, feed_processor, new_shm, shm_names
from vllm_omni_speechlm.stage_input_processors import speech_codec
from vllm_omni_speechlm.decoding import RowKind
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

# float32 rounding through the tiny DAC: measured max 1.9e-4 (tanh-saturating random weights round
# more than X-Codec's); a wrong frame or window gives O(0.1) errors (tests/test_dac.py, float64).
ATOL = 1e-3
SYSTEM = "Be brief."
PROMPTS = ["Hi.", "Say hello to the world.", "What time is it in the morning?"]
KW = dict(modality="audio", seed=5, max_tokens=100)  # one engine SamplingParams per call: one seed
# Per-request speech options: the first clip cannot end before max_tokens (it is cut there).
PROMPT_KW = [dict(min_audio_frames=95), {}, {}]
FAMILIES = {"opuslm": "tiny_opuslm", "opuslm-dialogue": "tiny_opuslm_dialogue"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request):
    from vllm_omni_speechlm.generator import SpeechLMGenerator
    from vllm_omni_speechlm.reference import ReferenceSpeechLM

    model_dir = request.getfixturevalue(FAMILIES[request.param])
    deploy = stage_configs.path("opuslm_streaming_cpu_tiny.yaml")
    with SpeechLMGenerator(model_dir, deploy_config=deploy) as gen:
        yield gen, ReferenceSpeechLM(model_dir), model_dir


def _codec_params():
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=0.0, max_tokens=1, output_kind=RequestOutputKind.DELTA)


def _whole_clip(gen, ref) -> torch.Tensor:
    with torch.inference_mode():
        return gen.codec(ref.codes.T[None])[0]


def test_streams_equal_whole_clip_decoding(family):
    gen, reference, _ = family
    before = shm_names()
    requests = [gen.engine_request(gen.encode(p, SYSTEM), SpeechSamplingParams(**KW, **kw)) for p, kw in zip(PROMPTS, PROMPT_KW)]
    chunks: dict[int, list[torch.Tensor]] = defaultdict(list)
    outs = gen.omni.generate([r[0] for r in requests], [requests[0][1], _codec_params()], py_generator=True, use_tqdm=False)
    for out in outs:
        audio = (out.multimodal_output or {}).get("audio")
        if audio is not None and audio.numel():
            chunks[int(out.request_id.split("_", 1)[0])].append(audio.reshape(-1).float())
    drained = capped = 0
    for i, prompt in enumerate(PROMPTS):
        ref = reference.generate(gen.encode(prompt, SYSTEM), SpeechSamplingParams(**KW, **PROMPT_KW[i]))
        streamed = torch.cat(chunks[i])
        whole = _whole_clip(gen, ref)
        assert streamed.shape == whole.shape == (gen.codec.config.num_samples(ref.codes.shape[0]),)
        torch.testing.assert_close(streamed, whole, atol=ATOL, rtol=0)
        torch.testing.assert_close(streamed, ref.audio, atol=ATOL, rtol=0)
        drained += bool((ref.kinds == RowKind.FORCE_EOS).any())
        capped += ref.finish_reason == "length"
    assert drained >= 1 and capped >= 1
    assert max(len(c) for c in chunks.values()) >= 3  # windows, not one whole clip
    deadline = time.monotonic() + 10
    while new_shm(before):
        assert time.monotonic() < deadline, f"shared memory left: {sorted(new_shm(before))}"
        time.sleep(0.1)


# ---- the processor alone (no engine) -----------------------------------------------------------


@pytest.mark.parametrize("fixture", list(FAMILIES.values()))
def test_processor_windows_of_a_drained_clip_equal_the_whole_clip(request, fixture):
    """The streaming processor + codec stage outside an engine, on a clip that drains."""
    from vllm_omni_speechlm.models.codec_stage import SpeechLMCodecDecoder
    from vllm_omni_speechlm.reference import ReferenceSpeechLM
    from vllm_omni_speechlm.tokenizer import encode_prompt

    model_dir = request.getfixturevalue(fixture)
    ref_model = ReferenceSpeechLM(model_dir)
    # Room for the clips to end by draining, and long enough for several windows.
    params = SpeechSamplingParams(**KW | {"max_tokens": 300, "min_audio_frames": 40})
    refs = [ref_model.generate(encode_prompt(ref_model.tokenizer, ref_model.cfg, p, system=SYSTEM), params) for p in PROMPTS]
    drained = [r for r in refs if bool((r.kinds == RowKind.FORCE_EOS).any())]
    assert drained, "no prompt's clip drains"
    ref = max(drained, key=lambda r: r.tokens.shape[0])  # the longest clip that drains: several windows
    payloads, _ = feed_processor(TransferManager(model_dir), ref.tokens)
    gated, calls = feed_processor(TransferManager(model_dir), ref.tokens, gated=True)  # the scheduler's gate
    assert calls == len(gated) == len(payloads)
    assert all(torch.equal(a.codes.audio, b.codes.audio) for a, b in zip(payloads, gated))
    stage = SpeechLMCodecDecoder.from_model_dir(model_dir)
    infos = [{"meta": {"left_context_size": p.meta.left_context_size, "right_holdback_size": p.meta.right_holdback_size}}
             for p in payloads]
    with torch.inference_mode():
        streamed = torch.cat(stage.decode_windows([p.codes.audio for p in payloads], infos))
    assert len(payloads) >= 3
    assert streamed.shape == ref.audio.shape
    torch.testing.assert_close(streamed, ref.audio, atol=ATOL, rtol=0)
    # Batch mode's hand-off (async_chunk off): the whole clip, exactly its T frames, in one window.
    finished = SimpleNamespace(finished=True, outputs=[SimpleNamespace(multimodal_output={"codes": {"audio": ref.tokens}})])
    [prompt] = speech_codec.speechlm2codec([finished], target_model_config=SimpleNamespace(model=model_dir))
    assert prompt["prompt_token_ids"] == ref.codes.reshape(-1).tolist()
