"""Output sample rates (resample.py): which rates an answer can have, and the windowed resampler."""

from __future__ import annotations

import pytest
import torch

from vllm_omni_speechlm.resample import RATE_KEY, check_output_rate, requested_rate, resample


@pytest.mark.parametrize("rate", [8000, 22050, 24000, 44100, 48000])
def test_served_rates_are_whole_samples_per_frame(rate):
    check_output_rate(rate, 50.0, "wav")


@pytest.mark.parametrize("rate, frame_rate, fmt", [(22050, 60.0, "wav"), (22050, 50.0, "opus"), (44100, 50.0, "opus")])
def test_a_rate_the_answer_cannot_have_names_sample_rate(rate, frame_rate, fmt):
    with pytest.raises(ValueError, match="^sample_rate: "):
        check_output_rate(rate, frame_rate, fmt)


def test_the_rate_asked_for_arrives_plain_or_wrapped():
    assert requested_rate({RATE_KEY: 24000}, 16000) == requested_rate({RATE_KEY: [24000]}, 16000) == 24000
    assert requested_rate({"meta": {}}, 16000) == requested_rate(None, 16000) == 16000


def test_rows_resample_alone_as_in_a_batch():
    """Windows of one length share one call; each row is resampled on its own."""
    wav = torch.randn(3, 3200)
    batch = resample(wav, 16000, 22050)
    assert batch.shape == (3, 4410) and resample(wav, 16000, 16000) is wav
    torch.testing.assert_close(batch[1], resample(wav[1], 16000, 22050), atol=1e-6, rtol=0)
