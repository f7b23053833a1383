"""`SpeechLMGenerator`: offline generation on vLLM-Omni (stage 0), audio decoded in-process."""

from __future__ import annotations

import os
from typing import Any

import torch
from tokenizers import Tokenizer

import stage_configs
from vllm_omni_speechlm.audio import to_wav_base64
from vllm_omni_speechlm.codec import load_codec_decoder
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.decoding import OutputMode
from vllm_omni_speechlm.delay_pattern import audio_codes
from vllm_omni_speechlm.models.speechlm import SPEECH_PARAMS_KEY
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
from vllm_omni_speechlm.tokenizer import decode_text, encode_prompt


def _stream_tokens(output: Any) -> torch.Tensor:
    """[L, S] tokens of every step from an OmniRequestOutput (`codes.audio` rows)."""
    codes = output.multimodal_output["codes"]["audio"]
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes.audio: expected a tensor, got {type(codes).__name__}")
    return codes.to(torch.long).cpu()


class SpeechLMGenerator:
    """Batch generation of text and/or audio answers.

    >>> gen = SpeechLMGenerator("/path/to/model", max_num_seqs=64)
    >>> gen.generate(["Hello!"], modality="audio", seed=0)[0]["audio"]  # base64 16 kHz WAV

    The deploy config defaults to the family's stage-0-only one (`stage_configs.LM_ONLY`).
    """

    def __init__(self, model_dir: str | os.PathLike, *, deploy_config: str | None = None, **engine_kwargs: Any):
        from vllm_omni_speechlm import plugin

        plugin.register()  # this process resolves the pipeline; workers load it by entry point
        from vllm_omni import Omni

        self.model_dir = str(model_dir)
        self.cfg = SpeechLMConfig.from_model_dir(self.model_dir)
        self.tokenizer = Tokenizer.from_file(os.path.join(self.model_dir, "tokenizer.json"))
        self.codec = load_codec_decoder(self.cfg.codec, self.model_dir)
        deploy = deploy_config or stage_configs.path(stage_configs.LM_ONLY[self.cfg.family])
        self.omni = Omni(model=self.model_dir, deploy_config=deploy, **engine_kwargs)

    def close(self) -> None:
        self.omni.close()

    def __enter__(self) -> SpeechLMGenerator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- requests -------------------------------------------------------------------------
    def encode(self, prompt: str, system: str | None) -> list[int]:
        if not isinstance(prompt, str) or not prompt.strip():
            raise ValueError(f"prompts: each prompt must be a non-empty string, got {prompt!r}")
        return encode_prompt(self.tokenizer, self.cfg, prompt, system=system)

    def engine_request(self, prompt_ids: list[int], params: SpeechSamplingParams) -> tuple[dict, Any]:
        """(prompt dict, vLLM SamplingParams) of one request: the engine samples stream 0 at the
        engine temperature with no top-k of its own (the model applies per-modality top-k)."""
        from vllm import SamplingParams

        p = params.resolve(self.cfg)
        speech = {"modality": int(p.modality), "cfg_scale": p.cfg_scale}  # plain scalars: msgpack
        for name in ("text_temperature", "text_top_k", "audio_temperature", "audio_top_k", "max_text_tokens"):
            speech[name] = getattr(p, name)
        stop = [self.cfg.specials.eot] if p.modality == OutputMode.TEXT else []
        sampling = SamplingParams(
            temperature=p.engine_temperature,
            top_k=0,
            seed=p.seed,
            max_tokens=p.max_tokens,
            stop_token_ids=stop,
            detokenize=False,
        )
        return {"prompt_token_ids": prompt_ids, "additional_information": {SPEECH_PARAMS_KEY: speech}}, sampling

    def generate(
        self,
        prompts: str | list[str],
        *,
        system: str | None = None,
        text_only: bool = False,
        modality: str | None = None,
        **sampling: Any,
    ) -> list[dict[str, Any]]:
        """One dict per prompt: text, audio (base64 16 kHz PCM16 WAV), finish_reason, token_ids
        (stream 0) and stream_token_ids ([L][S], every stream of every step).

        `sampling`: cfg_scale, text_temperature, text_top_k, audio_temperature, audio_top_k,
        max_tokens, max_text_tokens, seed (see SpeechSamplingParams). `text_only=True` is
        `modality="text"`; modality defaults to "auto" (the model chooses)."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts: expected a non-empty string or list of strings")
        if text_only and modality not in (None, "text"):
            raise ValueError(f"text_only: conflicts with modality={modality!r}")
        params = SpeechSamplingParams(modality="text" if text_only else (modality or "auto"), **sampling)
        if params.use_cfg:
            raise ValueError("cfg_scale: classifier-free guidance is not served yet (use 1.0)")
        requests = [self.engine_request(self.encode(p, system), params) for p in prompts]
        # One stage, one SamplingParams for the whole call (Omni takes one per stage).
        outputs = self.omni.generate([r[0] for r in requests], [requests[0][1]], use_tqdm=False)
        # Omni names request i "{i}_{uuid}" and returns them in completion order.
        outputs = sorted(outputs, key=lambda o: int(o.request_id.split("_", 1)[0]))
        return [self.result(o) for o in outputs]

    def result(self, output: Any) -> dict[str, Any]:
        tokens = _stream_tokens(output)
        completion = output.outputs[0]
        codes = audio_codes(tokens, self.cfg)
        audio = None
        if codes is not None:
            with torch.inference_mode():
                audio = to_wav_base64(self.codec(codes.T[None])[0], self.cfg.codec.sample_rate)
        return {
            "text": decode_text(self.tokenizer, tokens[:, 0].tolist(), self.cfg),
            "audio": audio,
            "finish_reason": completion.finish_reason,
            "token_ids": list(completion.token_ids),
            "stream_token_ids": tokens.tolist(),
        }
