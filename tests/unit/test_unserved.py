"""Why vllm-omni's `/v1/audio/speech/batch` is refused for the speech LMs (serving/unserved.py)."""

from __future__ import annotations


def test_stock_speech_batch_items_lose_seed_and_the_models_options():
    """vllm-omni 0.30's batch schema has no `seed` or `extra_params`, for an item or the batch, and
    its merge builds each item's speech request without them: an item's seed and model options,
    nested or top-level, are dropped without an error. When this fails, vllm-omni carries them:
    the route could then be wrapped as `/v1/audio/speech` is (`speech.with_top_level_options`)."""
    from vllm_omni.entrypoints.openai.protocol.audio import BatchSpeechRequest
    from vllm_omni.entrypoints.openai.serving_speech import OmniOpenAIServingSpeech

    options = {"seed": 3, "extra_params": {"cfg_scale": 3.0}}
    item = {"input": "Hi", "cfg_scale": 2.0} | options
    batch = BatchSpeechRequest.model_validate({"items": [item]} | options)
    request = OmniOpenAIServingSpeech._merge_batch_item(batch, batch.items[0])
    assert request.input == "Hi"
    assert request.seed is None and request.extra_params is None
    assert "cfg_scale" not in request.model_dump(exclude_none=True)
