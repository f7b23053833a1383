"""Bagpiper's audio input through vLLM's multimodal processing (the API-server / orchestrator side).

A request carries `multi_modal_data={"audio": [clip, ...]}` (each clip a waveform, or a
(waveform, sample rate) pair) and one audio placeholder per clip in its prompt
(`tokenizer.encode_prompt(..., audio=n)`). vLLM's data parser resamples to 16 kHz and averages
channels (torchaudio, as ESPnet resamples); this processor computes each clip's log-mel
(`audio_input.log_mel`, ESPnet's call of the Qwen3-Omni feature extractor) and replaces its
placeholder by one placeholder per encoder output row, the rows `embed_input_ids` overwrites with
the features. vLLM then schedules the encoder, caches its outputs by the clip's hash and frees
them with the request.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from transformers.feature_extraction_utils import BatchFeature
from vllm.multimodal.inputs import MultiModalFieldConfig, MultiModalKwargsItems
from vllm.multimodal.parse import MultiModalDataItems, MultiModalDataParser
from vllm.multimodal.processing import (
    BaseDummyInputsBuilder,
    BaseMultiModalProcessor,
    BaseProcessingInfo,
    ProcessorInputs,
    PromptReplacement,
    PromptUpdate,
)

from vllm_omni_speechlm.audio_input import check_length, log_mel
from vllm_omni_speechlm.config import AudioInputSpec, SpeechLMConfig
from vllm_omni_speechlm.tokenizer import special_token_strings

FEATURES = "input_features"  # [mel bins, frames] per clip, concatenated along frames
FRAMES = "feature_lens"  # [clips] mel frames of each clip


class LogMelProcessor:
    """The "HF processor" vLLM calls on a request's clips: 16 kHz mono waveforms -> their log-mels
    concatenated along frames, and each clip's frame count."""

    def __init__(self, spec: AudioInputSpec):
        self.spec = spec

    def __call__(self, audios: Sequence[np.ndarray] = (), **_: Any) -> BatchFeature:
        mels = []
        for wav in audios:
            wav = np.asarray(wav, dtype=np.float32)
            if wav.ndim != 1 or not np.isfinite(wav).all():
                raise ValueError("audio: expected finite mono samples")
            check_length(wav.shape[0], self.spec)
            mels.append(log_mel(wav, self.spec))
        return BatchFeature({FEATURES: torch.cat(mels, dim=1), FRAMES: torch.tensor([m.shape[1] for m in mels])})


class BagpiperProcessingInfo(BaseProcessingInfo):
    def speech(self) -> SpeechLMConfig:
        if not hasattr(self, "_speech"):  # parsed once: the processor asks per request
            self._speech = SpeechLMConfig.from_hf_config(self.get_hf_config())
        return self._speech

    def audio_spec(self) -> AudioInputSpec:
        spec = self.speech().audio_input
        if spec is None:
            raise ValueError("audio: this checkpoint takes no audio input (no audio_input section)")
        return spec

    def get_supported_mm_limits(self) -> Mapping[str, int | None]:
        return {"audio": None if self.speech().audio_input is not None else 0}

    def get_data_parser(self) -> MultiModalDataParser:
        spec = self.speech().audio_input
        rate = spec.sample_rate if spec is not None else None
        return MultiModalDataParser(target_sr=rate, target_channels=1, audio_resample_method="torchaudio")

    def get_hf_processor(self, **kwargs: object) -> LogMelProcessor:
        return LogMelProcessor(self.audio_spec())

    def max_rows(self, seq_len: int) -> int:
        """Rows of the longest clip the model accepts, within `seq_len`."""
        spec = self.audio_spec()
        return min(spec.output_length(spec.num_frames(spec.max_samples)), seq_len)

    def get_mm_max_tokens_per_item(self, seq_len: int, mm_counts: Mapping[str, int] | None = None) -> Mapping[str, int]:
        if not (mm_counts or {}).get("audio", 0) or self.speech().audio_input is None:
            return {}
        return {"audio": self.max_rows(seq_len)}


class BagpiperDummyInputs(BaseDummyInputsBuilder[BagpiperProcessingInfo]):
    """vLLM's profiling input: the longest clip that fits the sequence, once per audio item; the
    prompt is the placeholder ids themselves (no tokenizer needed)."""

    def get_dummy_text(self, mm_counts: Mapping[str, int]) -> str:
        cfg = self.info.speech()
        return special_token_strings(cfg)[cfg.audio_input.placeholder_id] * mm_counts.get("audio", 0)

    def get_dummy_processor_inputs(
        self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Mapping[str, Any]
    ) -> ProcessorInputs:
        data = self.get_dummy_mm_data(seq_len, mm_counts, mm_options)
        prompt = [self.info.audio_spec().placeholder_id] * mm_counts.get("audio", 0)
        return ProcessorInputs(prompt=prompt, mm_data_items=self.info.parse_mm_data(data, validate=False))

    def get_dummy_mm_data(self, seq_len: int, mm_counts: Mapping[str, int], mm_options: Mapping[str, Any]) -> dict:
        spec = self.info.audio_spec()
        rows = self.info.max_rows(seq_len)
        frames = max(f for f in range(0, spec.num_frames(spec.max_samples) + 1, spec.tower.chunk_frames // 4)
                     if spec.output_length(f) <= rows)
        samples = max(frames * spec.hop_length, spec.min_samples)
        return {"audio": self._get_dummy_audios(length=samples, num_audios=mm_counts.get("audio", 0),
                                                overrides=mm_options.get("audio"))}


class BagpiperAudioProcessor(BaseMultiModalProcessor[BagpiperProcessingInfo]):
    requires_tokenizer = False  # the placeholder is an id; the log-mel needs no text
    def _get_mm_fields_config(
        self, hf_inputs: BatchFeature, hf_processor_mm_kwargs: Mapping[str, object]
    ) -> Mapping[str, MultiModalFieldConfig]:
        frames = hf_inputs.get(FRAMES, torch.empty(0, dtype=torch.long))
        return {
            FEATURES: MultiModalFieldConfig.flat_from_sizes("audio", frames, dim=1),
            FRAMES: MultiModalFieldConfig.batched("audio", keep_on_cpu=True),
        }

    def _get_prompt_updates(
        self, mm_items: MultiModalDataItems, hf_processor_mm_kwargs: Mapping[str, object], out_mm_kwargs: MultiModalKwargsItems
    ) -> Sequence[PromptUpdate]:
        spec = self.info.audio_spec()
        frames = out_mm_kwargs.get_data().get(FRAMES)
        rows = [] if frames is None else [spec.output_length(int(n)) for n in frames]
        placeholder = spec.placeholder_id
        return [PromptReplacement(modality="audio", target=[placeholder], replacement=lambda i: [placeholder] * rows[i])]
