"""vLLM model classes of the speech LM families (registered by `vllm_omni_speechlm.plugin`)."""

# architecture name in config.json -> "module:class"
ARCHITECTURES = {
    "BagpiperForCausalLM": "vllm_omni_speechlm.models.bagpiper:BagpiperForCausalLM",
    "BagpiperFusedForCausalLM": "vllm_omni_speechlm.models.fused:BagpiperFusedForCausalLM",
    "OpusLMForCausalLM": "vllm_omni_speechlm.models.opuslm:OpusLMForCausalLM",
    "BagpiperCodecDecoder": "vllm_omni_speechlm.models.codec_stage:BagpiperCodecDecoder",
    # The codec stage reads its codec type (X-Codec, DAC) from the checkpoint; one class, any family.
    "SpeechLMCodecDecoder": "vllm_omni_speechlm.models.codec_stage:SpeechLMCodecDecoder",
}
# Codec stages; the other architectures are speech LM stages.
CODEC_ARCHITECTURES = ("BagpiperCodecDecoder", "SpeechLMCodecDecoder")
