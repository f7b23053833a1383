"""Audio codecs that turn a speech LM's codec streams into waveforms."""

from vllm_omni_speechlm.codec.xcodec import XCodecDecoder, XCodecDecoderConfig, write_tiny_xcodec

__all__ = ["XCodecDecoder", "XCodecDecoderConfig", "write_tiny_xcodec"]
