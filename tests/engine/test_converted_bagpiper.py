"""The engine serves what `speechlm-convert --family bagpiper` writes from an ESPnet export (CPU,
float32): every stream and the audio equal the reference's on the converted directory. Served in
text-only mode (`limit_mm_per_prompt` audio 0: vLLM's plain token path, no tower built), the
engine skips the checkpoint's audio tower and adaptor by name and refuses audio."""

import base64

import numpy as np
import pytest
import torch
from safetensors import safe_open

from vllm_omni_speechlm.audio import read_wav
from vllm_omni_speechlm.config import AUDIO_INPUT_PREFIXES
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

ENGINE = dict(dtype="float32", enforce_eager=True, max_num_seqs=4, max_model_len=512, gpu_memory_utilization=0.3,
              limit_mm_per_prompt={"audio": 0})


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> str:
    from vllm_omni_speechlm.convert import convert_bagpiper
    from vllm_omni_speechlm.make_tiny import write_tiny_bagpiper_export

    files = write_tiny_bagpiper_export(tmp_path_factory.mktemp("export"), seed=3)
    out = str(tmp_path_factory.mktemp("converted"))
    convert_bagpiper(files["checkpoint"], out, files["text_tokenizer"], files["backbone_config"], files["codec_config"],
                     audio_tower_config_path=files["audio_tower_config"])
    return out


def test_engine_generates_from_the_converted_export(converted):
    from vllm_omni_speechlm.generator import SpeechLMGenerator
    from vllm_omni_speechlm.reference import ReferenceSpeechLM

    with safe_open(f"{converted}/model.safetensors", "pt") as f:
        assert any(k.startswith(AUDIO_INPUT_PREFIXES) for k in f.keys())
    reference = ReferenceSpeechLM(converted)
    kw = dict(modality="text+audio", max_text_tokens=5, max_tokens=40, seed=7)
    with SpeechLMGenerator(converted, **ENGINE) as gen:
        [result] = gen.generate("Say hello to the world.", system="Be brief.", **kw)
        ref = reference.generate(gen.encode("Say hello to the world.", "Be brief."), SpeechSamplingParams(**kw))
        with pytest.raises(ValueError, match="audio"):
            gen.generate("What is said?", audio=(np.zeros(1600, np.float32), 16000), max_tokens=4)
    assert torch.equal(torch.tensor(result["stream_token_ids"]), ref.tokens)
    assert result["text"] == ref.text and result["finish_reason"] == ref.finish_reason
    assert ref.audio is not None
    wav, rate = read_wav(base64.b64decode(result["audio"]))
    assert rate == 16000 and wav.shape == ref.audio.shape
    torch.testing.assert_close(wav, ref.audio.clamp(-1, 1), atol=1 / 16000, rtol=0)
