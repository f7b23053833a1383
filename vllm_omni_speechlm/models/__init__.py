"""vLLM model classes of the speech LM families (registered by `vllm_omni_speechlm.plugin`)."""

# architecture name in config.json -> "module:class"
ARCHITECTURES = {
    "BagpiperForCausalLM": "vllm_omni_speechlm.models.bagpiper:BagpiperForCausalLM",
    "OpusLMForCausalLM": "vllm_omni_speechlm.models.opuslm:OpusLMForCausalLM",
}
ARCHITECTURES["BagpiperCodecDecoder"] = "vllm_omni_speechlm.models.codec_stage:BagpiperCodecDecoder"
# The codec stage reads its codec type (X-Codec, DAC) from the checkpoint; one class, any family.
ARCHITECTURES["SpeechLMCodecDecoder"] = "vllm_omni_speechlm.models.codec_stage:SpeechLMCodecDecoder"
