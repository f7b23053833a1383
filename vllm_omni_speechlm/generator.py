"""`SpeechLMGenerator`: offline generation on vLLM-Omni.

Any deploy YAML of stage_configs/ works: with `speech_lm_only.yaml` (the default) the audio is
decoded in-process from the returned codes; with `bagpiper_fused.yaml` it comes decoded from the
engine; with the two-stage ones (`bagpiper_streaming.yaml`, `bagpiper_batch.yaml`) it comes from the
codec stage, and `generate_stream` yields it window by window as it is decoded.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import Any

import torch
from tokenizers import Tokenizer

import vllm_omni_speechlm.stage_configs as stage_configs
from vllm_omni_speechlm.audio import to_wav_base64
from vllm_omni_speechlm.audio_input import prepare_audio
from vllm_omni_speechlm.codec import decode_segments, load_codec_decoder
from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.decoding import OutputMode
from vllm_omni_speechlm.delay_pattern import audio_segments
from vllm_omni_speechlm.deploy_checks import DeployPlan, check_deploy_devices
from vllm_omni_speechlm.engine_request import engine_prompt, stage0_sampling_params
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
from vllm_omni_speechlm.tokenizer import decode_text, encode_prompt


def _stream_tokens(output: Any, num_streams: int) -> torch.Tensor:
    """[L, S] tokens of every step from an OmniRequestOutput (`codes.audio` rows). Rows come in
    blocks of steps (stage0/client_frames.py): a request aborted before its first block has none."""
    codes = (output.multimodal_output or {}).get("codes", {}).get("audio")
    if codes is None:
        return torch.zeros(0, num_streams, dtype=torch.long)
    if not isinstance(codes, torch.Tensor):
        raise TypeError(f"codes.audio: expected a tensor, got {type(codes).__name__}")
    return codes.to(torch.long).cpu()


def _waveform(output: Any) -> torch.Tensor | None:
    """The `audio` of an output as one [N] float32 tensor (pieces in order), or None."""
    audio = (output.multimodal_output or {}).get("audio")
    if isinstance(audio, list):  # not consolidated: the pieces in order
        audio = torch.cat([a.reshape(-1) for a in audio]) if audio else None
    if audio is None:
        return None
    if not isinstance(audio, torch.Tensor):
        raise TypeError(f"audio: expected a tensor, got {type(audio).__name__}")
    return audio.reshape(-1).float().cpu()


@contextlib.contextmanager
def _spawnable_main() -> Iterator[None]:
    """vLLM starts its engine processes with spawn, which re-runs the parent's `__main__` from its
    file. A script read from stdin (`python - < script.py`) has a `__file__`, '<stdin>', that is
    no file, and every engine process would fail on it. While the engine starts, such a `__file__`
    is hidden: the children then skip `__main__`, as they do for a notebook or `python -c`."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or os.path.isfile(path):
        yield
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


class SpeechLMGenerator:
    """Batch generation of text and/or audio answers.

    >>> gen = SpeechLMGenerator("/path/to/model", max_num_seqs=64)
    >>> gen.generate(["Hello!"], modality="audio", seed=0)[0]["audio"]  # base64 16 kHz WAV

    The deploy config defaults to the family's stage-0-only one (`stage_configs.LM_ONLY`).
    """

    def __init__(self, model_dir: str | os.PathLike, *, deploy_config: str | None = None, **engine_kwargs: Any):
        from vllm_omni_speechlm import compat, plugin

        plugin.register()  # this process resolves the pipeline; workers load it by entry point
        from vllm_omni import Omni

        compat.pass_parallel_stage_init_from_deploy(check_deploy_devices)

        self.model_dir = str(model_dir)
        self.cfg = SpeechLMConfig.from_model_dir(self.model_dir)
        # `limit_mm_per_prompt={"audio": 0}`: vLLM's text-only mode (no tower built)
        audio_limit = (engine_kwargs.get("limit_mm_per_prompt") or {}).get("audio")
        self.takes_audio = self.cfg.audio_input is not None and audio_limit != 0
        self.tokenizer = Tokenizer.from_file(os.path.join(self.model_dir, "tokenizer.json"))
        self.codec = load_codec_decoder(self.cfg.codec, self.model_dir)
        deploy = deploy_config or stage_configs.path(stage_configs.LM_ONLY[self.cfg.family])
        # What the stages return, and a clear error for a YAML that cannot work, before any engine.
        self.plan = DeployPlan.from_yaml(deploy, async_chunk=engine_kwargs.get("async_chunk"))
        with _spawnable_main():
            self.omni = Omni(model=self.model_dir, deploy_config=deploy, **engine_kwargs)

    def close(self) -> None:
        self.omni.close()

    def __enter__(self) -> SpeechLMGenerator:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- requests -------------------------------------------------------------------------
    def encode(
        self, prompt: str, system: str | None, params: SpeechSamplingParams | None = None, audio: int = 0
    ) -> list[int]:
        """A prompt's ids; `params` (the request's options) tells a text-only answer, which
        ESPnet's dialogue prompt (OpusLM) marks with its task token. `audio` clips come before the
        prompt's text (which may then be empty: a transcription)."""
        if not isinstance(prompt, str) or not (prompt.strip() or audio):
            raise ValueError(f"prompts: each prompt must be a non-empty string, got {prompt!r}")
        text_only = params is not None and params.modality == OutputMode.TEXT
        return encode_prompt(self.tokenizer, self.cfg, prompt, system=system, text_only=text_only, audio=audio)

    def engine_request(
        self, prompt_ids: list[int], params: SpeechSamplingParams, audio: list | None = None
    ) -> tuple[dict, Any]:
        """(prompt dict, vLLM SamplingParams) of one request (see `engine_request.py`); `audio`:
        the prompt's clips as `prepare_clips` returns them."""
        p = params.resolve(self.cfg)
        return engine_prompt(prompt_ids, p, audio=audio), stage0_sampling_params(self.cfg, p)

    def prepare_clips(self, clips: Any) -> list:
        """One prompt's audio (a clip or a list of clips; a clip is a path or a (samples, sample
        rate) pair) -> 16 kHz mono float32 waveforms, checked (ValueError naming audio)."""
        if clips is None:
            return []
        if not self.takes_audio:
            raise ValueError("audio: this engine takes no audio input (no audio_input section, or "
                             "limit_mm_per_prompt audio 0)")
        if not isinstance(clips, list):
            clips = [clips]
        return [prepare_audio(clip, self.cfg.audio_input) for clip in clips]

    def generate(
        self,
        prompts: str | list[str],
        *,
        system: str | None = None,
        text_only: bool = False,
        modality: str | None = None,
        audio: Any = None,
        **sampling: Any,
    ) -> list[dict[str, Any]]:
        """One dict per prompt: text, audio (base64 16 kHz PCM16 WAV), waveform (the same audio as a
        float32 tensor, or None), finish_reason, token_ids (stream 0) and stream_token_ids ([L][S],
        every stream of every step).

        `audio`: audio input (Bagpiper), heard before the prompt's text: for one prompt, a clip or
        a list of clips; for a list of prompts, a list with one such entry (or None) per prompt. A
        clip is a file path or a (samples, sample rate) pair: 1-D samples, or 2-D channels x
        samples (averaged); any rate (resampled to 16 kHz). With audio a prompt may be "" (a
        transcription).

        `sampling`: cfg_scale, text_temperature, text_top_k, audio_temperature, audio_top_k,
        max_tokens, min/max_text_tokens, min/max_audio_frames, seed (see SpeechSamplingParams). `text_only=True` is
        `modality="text"`; modality defaults to "auto" (the model chooses)."""
        single = isinstance(prompts, str)
        prompts = [prompts] if single else prompts
        if not isinstance(prompts, list) or not prompts:
            raise ValueError("prompts: expected a non-empty string or list of strings")
        clips = self._clips_per_prompt(audio, len(prompts), single)
        params = self._params(text_only, modality, sampling)
        return self.run([self.engine_request(self.encode(p, system, params, len(c)), params, c)
                         for p, c in zip(prompts, clips)])

    def run(self, requests: list[tuple[dict, Any]]) -> list[dict[str, Any]]:
        """The results of `engine_request`s decoded as one batch, in order. Omni takes one
        SamplingParams per stage for the whole call: the first request's serve all (each request's
        speech options travel in its prompt)."""
        stage_params = [requests[0][1], *self._codec_stage_params(streamed=False)]
        by_request: dict[str, list[Any]] = {}  # two-stage: stage 0's text and stage 1's audio
        for output in self.omni.generate([r[0] for r in requests], stage_params, use_tqdm=False):
            by_request.setdefault(output.request_id, []).append(output)
        # Omni names request i "{i}_{uuid}" and returns them in completion order.
        ordered = sorted(by_request.items(), key=lambda item: int(item[0].split("_", 1)[0]))
        return [self.result(*outputs) for _, outputs in ordered]

    def generate_stream(
        self,
        prompt: str,
        *,
        system: str | None = None,
        text_only: bool = False,
        modality: str | None = None,
        audio: Any = None,
        **sampling: Any,
    ) -> Iterator[torch.Tensor]:
        """Yield the answer's 16 kHz audio as it is decoded: [N_i] float32 chunks, each only new
        samples; together they are the whole clip (what `generate` returns as `waveform`).

        With a streaming deployment (`bagpiper_streaming.yaml`) a chunk is one window (the first
        after ~10 frames); with any other deployment the whole clip is one chunk at the end.
        Closing the iterator early aborts the request. Options (`audio` included) as in `generate`."""
        params = self._params(text_only, modality, sampling)
        clips = self.prepare_clips(audio)
        request = self.engine_request(self.encode(prompt, system, params, len(clips)), params, clips)
        if not self.plan.two_stage:
            [result] = self.generate(
                prompt, system=system, text_only=text_only, modality=modality, audio=audio, **sampling
            )
            if result["waveform"] is not None:
                yield result["waveform"]
            return
        stage_params = [request[1], *self._codec_stage_params(streamed=True)]
        finished = False
        try:
            for output in self.omni.generate([request[0]], stage_params, py_generator=True, use_tqdm=False):
                finished = finished or bool(getattr(output, "finished", False))
                chunk = _waveform(output)
                if chunk is not None and chunk.numel():
                    yield chunk
        finally:
            if not finished:  # the caller stopped early (or failed): free the request's stages
                self.omni.engine.abort(list(self.omni.request_states))

    def _clips_per_prompt(self, audio: Any, num_prompts: int, single: bool) -> list[list]:
        if audio is None:
            return [[] for _ in range(num_prompts)]
        if single:
            return [self.prepare_clips(audio)]
        if not isinstance(audio, list) or len(audio) != num_prompts:
            raise ValueError(f"audio: with {num_prompts} prompts, expected a list of {num_prompts} entries (a clip, "
                             "a list of clips or None each)")
        return [self.prepare_clips(a) for a in audio]

    def _params(self, text_only: bool, modality: str | None, sampling: dict) -> SpeechSamplingParams:
        if text_only and modality not in (None, "text"):
            raise ValueError(f"text_only: conflicts with modality={modality!r}")
        params = SpeechSamplingParams(modality="text" if text_only else (modality or "auto"), **sampling)
        return params

    def _codec_stage_params(self, streamed: bool) -> list[Any]:
        """Stage 1's SamplingParams in two-stage deployments (none otherwise): DELTA gives one
        output per decoded window, FINAL_ONLY the whole clip in one output."""
        if not self.plan.two_stage:
            return []
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kind = RequestOutputKind.DELTA if streamed else RequestOutputKind.FINAL_ONLY
        return [SamplingParams(temperature=0.0, max_tokens=1, output_kind=kind)]

    def result(self, *outputs: Any) -> dict[str, Any]:
        """A request's outputs (one per final stage) -> the result dict of `generate`: text and
        tokens from the speech LM stage, audio from the stage that decoded it (codec stage, fused
        stage) or, with the LM stage alone, decoded here from its codes."""
        waveform = next((w for w in map(_waveform, outputs) if w is not None), None)
        lm = next((o for o in outputs if getattr(o, "stage_id", 0) == 0), None)
        if lm is None:  # only the codec stage's audio reached the client
            return self._result_dict(None, waveform, None, [], [], None)
        tokens = _stream_tokens(lm, self.cfg.num_streams)
        completion = lm.outputs[0]
        if waveform is None:
            with torch.inference_mode():
                clip = decode_segments(self.codec, audio_segments(tokens, self.cfg))
            waveform = None if clip is None else clip.float()
        text = decode_text(self.tokenizer, tokens[:, 0].tolist(), self.cfg)
        prompt = lm.prompt_token_ids  # as vLLM ran it: each clip's placeholder expanded to its rows
        return self._result_dict(text, waveform, completion.finish_reason, list(completion.token_ids), tokens.tolist(),
                                 None if prompt is None else list(prompt))

    def _result_dict(self, text, waveform, finish_reason, token_ids, stream_token_ids, prompt_token_ids) -> dict[str, Any]:
        if waveform is not None and waveform.numel() == 0:
            waveform = None  # a text-only answer
        audio = None if waveform is None else to_wav_base64(waveform, self.cfg.codec.sample_rate)
        return {
            "text": text,
            "audio": audio,
            "waveform": waveform,
            "finish_reason": finish_reason,
            "token_ids": token_ids,
            "stream_token_ids": stream_token_ids,
            "prompt_token_ids": prompt_token_ids,
        }
