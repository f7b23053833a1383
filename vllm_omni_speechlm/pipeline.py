"""Pipeline topologies of the speech LM families (deployment settings live in stage_configs/).

Selected by vllm-omni from the checkpoint: config.json keeps its backbone's `model_type`
(e.g. qwen3), so the match is on the architecture plus the presence of the `speechlm` section.
"""

from __future__ import annotations

from vllm_omni.config.stage_config import PipelineConfig, StageExecutionType, StagePipelineConfig

from vllm_omni_speechlm.config import SPEECHLM_KEY

BAGPIPER_ARCH = "BagpiperForCausalLM"
# Paired CFG co-scheduling (hidden unconditional companions); plain vLLM scheduling otherwise.
SPEECH_LM_SCHEDULER = "vllm_omni_speechlm.stage0.scheduler.PairedCFGScheduler"
# vllm-omni's generation scheduler, unlinking the windows of a request it ends early.
CODEC_SCHEDULER = "vllm_omni_speechlm.stage1.scheduler.CodecStageScheduler"
# Stage names (`model_stage`): the API server finds the speech stage by them (serving/speech.py).
SPEECH_LM_STAGE = "speech_lm"
CODEC_STAGE = "codec"


def _is_speechlm(hf_config) -> bool:
    return isinstance(getattr(hf_config, SPEECHLM_KEY, None), dict)


def speech_lm_stage(arch: str, **overrides) -> StagePipelineConfig:
    """Stage 0: the AR speech LM. Its client output is text (stream 0) plus `codes.audio`, one
    [1, S] row of all streams per generated token (sent in blocks of steps: stage0/client_frames.py)."""
    fields = dict(
        stage_id=0,
        model_stage=SPEECH_LM_STAGE,
        execution_type=StageExecutionType.LLM_AR,
        owns_tokenizer=True,
        model_arch=arch,
        scheduler_cls=SPEECH_LM_SCHEDULER,
        engine_output_type="latent",
        final_output=True,
        final_output_type="text",
    )
    return StagePipelineConfig(**(fields | overrides))


def lm_only_pipeline(model_type: str, arch: str) -> PipelineConfig:
    """Stage 0 alone; selected from the checkpoint (architecture + `speechlm` section)."""
    return PipelineConfig(
        model_type=model_type,
        model_arch=arch,
        stages=(speech_lm_stage(arch),),
        hf_architectures=(arch,),
        hf_config_predicate=_is_speechlm,
    )


BAGPIPER_AR_PIPELINE = lm_only_pipeline("bagpiper", BAGPIPER_ARCH)

# ---- two stages: speech LM -> X-Codec decoder (streamed windows, or whole clips in batch mode) ---
CODEC_DECODER_ARCH = "BagpiperCodecDecoder"
SPEECH_CODEC_PROCESSOR = "vllm_omni_speechlm.stage_input_processors.speech_codec.speechlm2codec_async_chunk"
# Batch mode (deploy async_chunk: false, stage_configs/bagpiper_batch.yaml): the orchestrator hands
# stage 1 the whole clip once stage 0 finishes. vllm-omni reads this on the consuming stage.
SPEECH_CODEC_BATCH_PROCESSOR = "vllm_omni_speechlm.stage_input_processors.speech_codec.speechlm2codec"


def codec_decoder_stage(**overrides) -> StagePipelineConfig:
    """Stage 1: the X-Codec decoder (generation stage). Its prompt is one window of codebook
    indices from stage 0's processor; its client output is the window's new 16 kHz audio."""
    fields = dict(
        stage_id=1,
        model_stage=CODEC_STAGE,
        execution_type=StageExecutionType.LLM_GENERATION,
        input_sources=(0,),
        model_arch=CODEC_DECODER_ARCH,
        scheduler_cls=CODEC_SCHEDULER,
        engine_output_type="audio",
        final_output=True,
        final_output_type="audio",
    )
    return StagePipelineConfig(**(fields | overrides))


def two_stage_pipeline(model_type: str, arch: str, codec_arch: str, **lm_overrides) -> PipelineConfig:
    """Speech LM -> codec decoder, selected by name (deploy YAML `pipeline:`); the deployment's
    async_chunk picks streamed windows or whole clips. `lm_overrides`: stage-0 fields."""
    return PipelineConfig(
        model_type=model_type,
        model_arch=arch,
        stages=(
            speech_lm_stage(arch, async_chunk_process_next_stage_input_func=SPEECH_CODEC_PROCESSOR, **lm_overrides),
            codec_decoder_stage(model_arch=codec_arch, sync_process_input_func=SPEECH_CODEC_BATCH_PROCESSOR),
        ),
    )


# Both stages are final outputs: stage 0 gives the text (chat completions), stage 1 the audio.
# vllm-omni's orchestrator forwards every final stage's outputs to the client; a request's output
# modalities decide which stages it waits for (["audio"]: done with the audio). The speech route
# ignores stage 0's outputs (one small message per step).
BAGPIPER_TWO_STAGE_PIPELINE = two_stage_pipeline("bagpiper_two_stage", BAGPIPER_ARCH, CODEC_DECODER_ARCH)

# ---- one stage, fused: the speech LM stage decodes each finished clip itself -------------------
BAGPIPER_FUSED_ARCH = "BagpiperFusedForCausalLM"

BAGPIPER_FUSED_PIPELINE = PipelineConfig(
    model_type="bagpiper_fused",  # by name only (deploy YAML `pipeline:`)
    model_arch=BAGPIPER_FUSED_ARCH,
    # Text (stream 0), `codes.audio` rows (in blocks of steps), and `audio` + `sr` in the step a request ends.
    stages=(speech_lm_stage(BAGPIPER_FUSED_ARCH),),
)

# ---- OpusLM / OpusLM-Dialogue: the same stages; the codec stage decodes DAC (codec.type) ------
OPUSLM_ARCH = "OpusLMForCausalLM"
SPEECHLM_CODEC_DECODER_ARCH = "SpeechLMCodecDecoder"

OPUSLM_AR_PIPELINE = lm_only_pipeline("opuslm", OPUSLM_ARCH)
# Only stage 1's audio reaches the client (no chat route for this family yet).
OPUSLM_TWO_STAGE_PIPELINE = two_stage_pipeline(
    "opuslm_two_stage", OPUSLM_ARCH, SPEECHLM_CODEC_DECODER_ARCH, final_output=False
)

PIPELINES = (
    BAGPIPER_AR_PIPELINE,
    BAGPIPER_TWO_STAGE_PIPELINE,
    BAGPIPER_FUSED_PIPELINE,
    OPUSLM_AR_PIPELINE,
    OPUSLM_TWO_STAGE_PIPELINE,
)
