"""Audio input outside the engine: clip preparation (resample, downmix, bad input), the reference's
plain-PyTorch Qwen3-Omni tower against transformers', and the clip reaching the reference's answer.
ESPnet parity of the whole path: test_espnet_parity_reference.py."""

import dataclasses

import numpy as np
import pytest
import soundfile
import torch

from devtools import audio_clips
from vllm_omni_speechlm.audio_input import expand_placeholders, log_mel, prepare_audio
from vllm_omni_speechlm.config import SpeechLMConfig, bagpiper_layout
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
from vllm_omni_speechlm.tokenizer import encode_prompt

SPEC = bagpiper_layout().audio_input


def test_stereo_is_averaged_and_other_rates_resampled():
    import torchaudio.functional

    left = audio_clips.as_float(audio_clips.clip(0.5, 200.0, rate=48000))
    right = audio_clips.as_float(audio_clips.clip(0.5, 330.0, rate=48000))
    got = prepare_audio(np.stack([left, right]), SPEC, sample_rate=48000)
    mono = torch.from_numpy((left + right) / 2)
    assert got.dtype == np.float32 and got.shape == (8000,)
    np.testing.assert_allclose(got, torchaudio.functional.resample(mono, 48000, 16000).numpy(), atol=1e-6)
    # [samples, channels] (soundfile's layout) reads the same; a (samples, rate) pair too
    np.testing.assert_array_equal(prepare_audio((np.stack([left, right]).T, 48000), SPEC), got)


def test_a_wav_file_reads_as_its_samples(tmp_path):
    samples = audio_clips.clip(0.4)
    path = tmp_path / "clip.wav"
    soundfile.write(path, samples, 16000, subtype="PCM_16")
    np.testing.assert_array_equal(prepare_audio(str(path), SPEC), audio_clips.as_float(samples))


@pytest.mark.parametrize(
    "audio, rate, message",
    [
        (np.zeros(0, np.float32), 16000, "empty"),
        (np.array([0.1, np.nan] * 200, np.float32), 16000, "non-finite"),
        (np.zeros(150, np.float32), 16000, "too short"),
        (np.zeros(16000 * 301, np.float32), 16000, r"longer than the model accepts \(300 s\)"),
        (np.zeros((2, 2, 400), np.float32), 16000, "shape"),
        (np.zeros(400, np.float32), None, "sample rate"),
        (np.zeros(400, np.float32), 0, "sample rate"),
        ({"samples": [0.0]}, 16000, "waveform"),
    ],
)
def test_bad_clips_are_value_errors_naming_audio(audio, rate, message):
    with pytest.raises(ValueError, match=f"^audio: .*{message}"):
        prepare_audio(audio, SPEC, sample_rate=rate)


def test_a_file_that_is_not_audio_fails_naming_audio(tmp_path):
    path = tmp_path / "notes.wav"
    path.write_text("not audio")
    with pytest.raises(ValueError, match="^audio: cannot read"):
        prepare_audio(str(path), SPEC)


def test_placeholders_expand_to_each_clips_rows():
    ids, rows = expand_placeholders([1, 5, 8, 254, 3, 5, 8, 254, 2], [3, 2], 254)
    assert ids == [1, 5, 8, 254, 254, 254, 3, 5, 8, 254, 254, 2] and rows == [3, 4, 5, 9, 10]
    with pytest.raises(ValueError, match="^audio: the prompt holds 2 audio placeholders for 1 clips"):
        expand_placeholders([254, 254], [3], 254)


@pytest.mark.parametrize("frames", [7, 99, 100, 101, 250, 1234])
def test_reference_tower_is_transformers(frames):
    """The plain-PyTorch tower equals transformers' Qwen3OmniMoeAudioEncoder on one clip: chunks
    under one, exactly one and several 100-frame chunks, and more rows than one attention window."""
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import Qwen3OmniMoeAudioEncoderConfig
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import Qwen3OmniMoeAudioEncoder

    from vllm_omni_speechlm.make_tiny import TINY_AUDIO_TOWER, tiny_audio_input
    from vllm_omni_speechlm.reference.audio_tower import AudioTower

    spec = dataclasses.replace(TINY_AUDIO_TOWER, encoder_layers=2)
    weights = {k.removeprefix("audio_tower."): v for k, v in tiny_audio_input(64, 0, spec).items() if k.startswith("audio_tower.")}
    theirs = Qwen3OmniMoeAudioEncoder(Qwen3OmniMoeAudioEncoderConfig(**dataclasses.asdict(spec))).eval()
    ours = AudioTower(spec).eval()
    theirs.load_state_dict(weights)
    ours.load_state_dict(weights)
    mel = torch.randn(128, frames, generator=torch.Generator().manual_seed(frames))
    with torch.no_grad():
        want = theirs(mel, feature_lens=torch.tensor([frames])).last_hidden_state
        got = ours(mel)
    assert got.shape == (SPEC.output_length(frames), spec.output_dim)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_log_mel_frames():
    wav = audio_clips.as_float(audio_clips.clip(1.234))
    mel = log_mel(wav, SPEC)
    assert mel.shape == (128, 123) and mel.dtype == torch.float32
    assert torch.isfinite(mel).all() and mel.std() > 0.1


def test_the_clip_reaches_the_answer(reference):
    """Each clip's rows are its features, and another clip gives another answer."""
    cfg = reference.cfg
    ids = encode_prompt(reference.tokenizer, cfg, "What is said?", system="Be brief.", audio=1)
    clip = (audio_clips.as_float(audio_clips.clip(1.3)), 16000)
    expanded, embeds = reference.prompt(ids, [clip])
    rows = [i for i, t in enumerate(expanded) if t == cfg.audio_input.placeholder_id]
    torch.testing.assert_close(embeds[0, rows], reference.audio_features(clip), atol=0, rtol=0)
    params = SpeechSamplingParams(modality="text", max_text_tokens=12, max_tokens=20, text_temperature=0.0)
    other = (audio_clips.as_float(audio_clips.clip(1.3, pitch=260.0)), 16000)
    a, b = (reference.generate(ids, params, audio=[c]).tokens for c in (clip, other))
    assert not torch.equal(a, b)


def test_audio_needs_a_model_that_takes_it(tiny_opuslm, reference):
    cfg = SpeechLMConfig.from_model_dir(tiny_opuslm)
    with pytest.raises(ValueError, match="^audio: "):
        encode_prompt(reference.tokenizer, cfg, "hi", audio=1)
    with pytest.raises(ValueError, match="^audio: the prompt holds 0 audio placeholders for 1 clips"):
        reference.generate(encode_prompt(reference.tokenizer, reference.cfg, "hi"), SpeechSamplingParams(max_tokens=2),
                           audio=[(np.zeros(1600, np.float32), 16000)])
