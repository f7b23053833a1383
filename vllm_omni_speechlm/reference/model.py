"""The oracle: sequential plain-PyTorch generation with the full delay-pattern semantics.

No vLLM, no transformers. It loads the same checkpoint directory as the engine and decodes one
request at a time: the phase machine, masks and sampling of `decoding.py`, stream-0 sampling the
way vLLM's sampler does it (`engine_sample`), streams 1..S-1 sampled in the same step,
stream-embedding input sums, audio input as ESPnet reads it (each clip's log-mel through the
Qwen3-Omni audio tower and the adaptor, written over the clip's prompt rows: audio_tower.py,
audio_input.py), CFG as ESPnet runs it (a second, all-pad branch for each guided segment, batched
with the first), de-interleave and codec decode.
The random-number contract is documented in `decoding.py`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from vllm_omni_speechlm.audio_input import expand_placeholders, log_mel, prepare_audio
from vllm_omni_speechlm.cfg import merge_guided
from vllm_omni_speechlm.codec import decode_segments, load_codec_decoder
from vllm_omni_speechlm.config import AUDIO_ADAPTOR_PREFIX, AUDIO_INPUT_PREFIXES, AUDIO_TOWER_PREFIX, SpeechLMConfig
from vllm_omni_speechlm.decoding import DecodingRules, Phase, RowSampling, aux_seed, is_audio_row, seeded_exponential
from vllm_omni_speechlm.delay_pattern import audio_segments
from vllm_omni_speechlm.reference.audio_tower import AudioTower
from vllm_omni_speechlm.reference.backbone import BackboneConfig, DecoderBackbone
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
from vllm_omni_speechlm.tokenizer import decode_text


SAMPLING_EPS = 1e-5  # vLLM's greedy threshold


@dataclass
class ReferenceOutput:
    tokens: torch.Tensor  # [L, S] per step: stream 0, then streams 1..S-1 (0 on non-audio rows)
    kinds: torch.Tensor  # [L] RowKind of each step
    finish_reason: str  # "stop" or "length"
    text: str | None
    codes: torch.Tensor | None  # [T, Q] codebook indices of the codec streams: every audio segment's frames, in order
    audio: torch.Tensor | None  # [T * hop_length] float waveform: each audio segment decoded on its own, back to back

    @property
    def token_ids(self) -> list[int]:
        return self.tokens[:, 0].tolist()


def engine_sample(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> torch.Tensor:
    """Stream-0 sampling op for op as vLLM 0.30's V1 sampler on CPU (`Sampler.forward` ->
    `TopKTopPSampler.forward_cpu`): fp32 logits, greedy argmax below its epsilon, else an
    in-place divide by a float32 temperature tensor, softmax, and `argmax(p / q)` with q ~ Exp(1)
    drawn over the whole row from the request's generator. [N, V] -> [N]."""
    logits = logits.to(torch.float32, copy=True)
    if temperature < SAMPLING_EPS:
        return logits.argmax(dim=-1)
    temp = torch.full((logits.shape[0],), temperature, dtype=torch.float32, device=logits.device)
    probs = logits.div_(temp.unsqueeze(1)).softmax(dim=-1, dtype=torch.float32)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1)


class ReferenceSpeechLM:
    def __init__(self, model_dir: str | os.PathLike, device: str = "cpu", dtype: torch.dtype = torch.float32):
        with open(os.path.join(model_dir, "config.json")) as f:
            raw = json.load(f)
        self.cfg = cfg = SpeechLMConfig.from_model_dir(model_dir)
        self.device, self.dtype = torch.device(device), dtype
        self.backbone = DecoderBackbone(BackboneConfig.from_json(raw))
        weights = load_file(os.path.join(model_dir, "model.safetensors"))
        self.audio_tower, self.audio_adaptor = self._audio_input(weights)
        weights = {k: v for k, v in weights.items() if not k.startswith(AUDIO_INPUT_PREFIXES)}
        self.lm_head = weights.pop("lm_head.weight").to(device, dtype)  # [V, H]
        self.stream_emb = weights.pop("stream_embeddings.weight").to(device, dtype)  # [S, H]
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        if cfg.decoding.deferred_eos is not None:  # the eos, under another id (see DecodingSpec)
            emb = weights["embed_tokens.weight"]
            emb[cfg.decoding.deferred_eos] = emb[cfg.specials.eos]
        self.backbone.load_state_dict(weights)
        self.backbone.to(device, dtype).eval()
        if not cfg.primary_stream_embedding:
            self.stream_emb[0] = 0.0
        aux = cfg.streams[1:]
        # [S-1, W, H]: each aux stream projects onto its own slice of the vocabulary only.
        self.aux_head = torch.stack([self.lm_head[s.vocab_start : s.vocab_end] for s in aux]) if aux else None
        if aux and cfg.aux_sample_width > cfg.aux_stream_width:  # the pad column (delay rules)
            pad_row = self.lm_head[cfg.specials.pad].expand(len(aux), 1, -1)
            self.aux_head = torch.cat([self.aux_head, pad_row], dim=1)
        self.aux_start = torch.tensor([s.vocab_start for s in aux], device=device)
        self.rules = DecodingRules(cfg, device)
        self.tokenizer = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
        self.codec = load_codec_decoder(cfg.codec, model_dir, device=device)

    def _audio_input(self, weights: dict[str, torch.Tensor]) -> tuple[AudioTower | None, torch.nn.Linear | None]:
        """The audio tower and adaptor of a checkpoint with an `audio_input` section."""
        spec = self.cfg.audio_input
        if spec is None:
            return None, None
        tower = AudioTower(spec.tower)
        tower.load_state_dict({k.removeprefix(AUDIO_TOWER_PREFIX): v for k, v in weights.items() if k.startswith(AUDIO_TOWER_PREFIX)})
        adaptor_weight = weights[AUDIO_ADAPTOR_PREFIX + "weight"]
        adaptor = torch.nn.Linear(adaptor_weight.shape[1], adaptor_weight.shape[0])
        adaptor.load_state_dict({k.removeprefix(AUDIO_ADAPTOR_PREFIX): v for k, v in weights.items() if k.startswith(AUDIO_ADAPTOR_PREFIX)})
        return tower.to(self.device, self.dtype).eval(), adaptor.to(self.device, self.dtype).eval()

    @torch.inference_mode()
    def audio_features(self, clip) -> torch.Tensor:
        """One clip (what `audio_input.prepare_audio` takes) -> [rows, H] prompt-row embeddings."""
        if self.audio_tower is None:
            raise ValueError("audio: this checkpoint takes no audio input (no audio_input section)")
        spec = self.cfg.audio_input
        mel = log_mel(prepare_audio(clip, spec), spec).to(self.device, self.dtype)
        return self.audio_adaptor(self.audio_tower(mel))

    def prompt(self, prompt_ids: list[int], audio: list | None) -> tuple[list[int], torch.Tensor]:
        """(the prompt with each clip's placeholder expanded to its rows, its [1, L, H] input
        embeddings): ESPnet sums the streams' embeddings of every row, then overwrites a clip's
        rows with its features."""
        features = [self.audio_features(clip) for clip in audio or []]
        rows: list[int] = []
        if self.cfg.audio_input is not None:
            lengths = [f.shape[0] for f in features]
            prompt_ids, rows = expand_placeholders(prompt_ids, lengths, self.cfg.audio_input.placeholder_id)
        elif features:
            raise ValueError("audio: this checkpoint takes no audio input (no audio_input section)")
        tokens = torch.zeros(1, len(prompt_ids), self.cfg.num_streams, dtype=torch.long, device=self.device)
        tokens[..., 0] = torch.tensor(prompt_ids, device=self.device)
        embeds = self.embed(tokens)
        if features:
            embeds[0, rows] = torch.cat(features).to(embeds.dtype)
        return prompt_ids, embeds

    # ---- one step -------------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """[B, L, S] stream tokens -> [B, L, H]: embed(stream 0) + sum of non-pad(0) streams."""
        emb = self.backbone.embed_tokens(tokens)  # [B, L, S, H]
        keep = torch.ones_like(tokens, dtype=emb.dtype)
        keep[..., 1:] = (tokens[..., 1:] != self.cfg.specials.pad).to(emb.dtype)
        return (emb * keep[..., None]).sum(dim=-2)

    def heads(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, H] -> raw stream-0 logits [B, V] and aux logits [B, S-1, W]."""
        logits0 = (hidden + self.stream_emb[0]) @ self.lm_head.T
        if self.aux_head is None:
            return logits0, hidden.new_zeros(hidden.shape[0], 0, 0)
        h_aux = hidden[:, None, :] + self.stream_emb[None, 1:, :]  # [B, S-1, H]
        return logits0, torch.einsum("bsh,swh->bsw", h_aux, self.aux_head)

    @staticmethod
    def cfg_merge(logits: torch.Tensor, scale: float) -> torch.Tensor:
        """[2, ...] (cond, uncond) -> [1, ...]: w * cond + (1 - w) * uncond."""
        return merge_guided(logits[:1], logits[1:2], scale)

    # ---- generation -----------------------------------------------------------------------
    def aux_noise(self, seed: int | None, generated: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """[1, S-1, W] Exp(1) noise of the aux streams at output index `generated` ([1])."""
        if seed is None:
            return torch.empty(1, *shape, device=self.device).exponential_()
        return seeded_exponential(torch.tensor([aux_seed(seed)], device=self.device), generated, shape)

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], params: SpeechSamplingParams, audio: list | None = None) -> ReferenceOutput:
        """`audio`: one clip per audio placeholder of `prompt_ids`, in order (a path, or a
        (samples, sample rate) pair)."""
        cfg, rules = self.cfg, self.rules
        p = params.resolve(cfg)
        rows = RowSampling.from_values([p.row_values()], self.device)
        g0 = None if p.seed is None else torch.Generator(self.device).manual_seed(p.seed)
        mode = torch.tensor([int(p.modality)], device=self.device)
        phase = torch.tensor([int(Phase.START)], device=self.device)
        phase_step = torch.zeros(1, dtype=torch.long, device=self.device)

        prompt_ids, embeds = self.prompt(prompt_ids, audio)
        cache = self.backbone.new_cache()
        hidden = self.backbone(embeds, 0, cache)[:, -1]  # [B, H]: B = 2 in a guided segment

        steps, kinds, finish = [], [], "length"
        segment = torch.zeros(1, dtype=torch.long, device=self.device)
        w = cfg.num_streams - 1
        for step in range(p.max_tokens):
            logits0, logits_aux = self.heads(hidden)
            generated = torch.tensor([step], device=self.device)
            kind = rules.row_kinds(phase, mode, segment, phase_step, rows)
            if hidden.shape[0] == 2:  # guidance on audio rows only
                audio = is_audio_row(kind)
                logits0 = torch.where(audio[:, None], self.cfg_merge(logits0, p.cfg_scale), logits0[:1])
                logits_aux = torch.where(audio[:, None, None], self.cfg_merge(logits_aux, p.cfg_scale), logits_aux[:1])
            tok0 = engine_sample(rules.process_primary_logits(logits0[:1], kind, rows), p.engine_temperature, g0)
            tok0 = rules.emitted_token(phase, phase_step, mode, segment, tok0)  # an eos the answer outlives is deferred
            noise = self.aux_noise(p.seed, generated, (w, cfg.aux_sample_width))
            aux = rules.aux_token_ids(rules.sample_aux_streams(logits_aux[:1], rows, noise), self.aux_start)
            pad = cfg.specials.pad
            kept = torch.where(rules.aux_kept(kind, phase_step), aux, pad)
            aux = torch.where(rules.aux_sampled(kind, phase_step), aux, pad)
            steps.append(torch.cat([tok0, kept[0]]))  # emitted: the clip's cells only
            kinds.append(kind[0])
            phase, phase_step, segment, ended = rules.step(phase, phase_step, mode, segment, tok0, rows)
            if int(phase) == Phase.DONE:
                finish = "stop"
                break
            token = torch.cat([tok0[:, None], aux], dim=1)  # [1, S] fed back: every sampled cell
            fed = torch.where(ended[:, None] & (torch.arange(cfg.num_streams, device=self.device) > 0), pad, token)
            position = len(prompt_ids) + step
            if bool(ended):  # the segment's last row is fed to the conditional branch only
                cache = [[k[:1], v[:1]] for k, v in cache]
            if p.use_cfg and int(tok0) == cfg.specials.audio:  # a guided segment starts
                cache = self.with_unguided_branch(cache, position)
            embeds = self.embed(fed.expand(len(cache[0][0]), -1)[:, None, :])  # every branch gets it
            hidden = self.backbone(embeds, position, cache)[:, -1]
        tokens, kinds_t = torch.stack(steps), torch.stack(kinds)
        return self.finish(tokens, kinds_t, finish)

    def with_unguided_branch(self, cache: list[list], length: int) -> list[list]:
        """ESPnet's `_prepare_cfg_cache`: the unguided branch is all pad over the whole context so
        far (`length` positions: the prompt, earlier segments and `<|assistant|>`), batched after
        the conditional one."""
        pad = torch.full((1, length, self.cfg.num_streams), self.cfg.specials.pad, dtype=torch.long, device=self.device)
        unguided = self.backbone.new_cache()
        self.backbone(self.embed(pad), 0, unguided)
        return [[torch.cat([k, ku]), torch.cat([v, vu])] for (k, v), (ku, vu) in zip(cache, unguided)]

    # ---- outputs --------------------------------------------------------------------------
    def finish(self, tokens: torch.Tensor, kinds: torch.Tensor, reason: str) -> ReferenceOutput:
        cfg = self.cfg
        text = decode_text(self.tokenizer, tokens[:, 0].tolist(), cfg)
        segments = audio_segments(tokens, cfg)
        codes = torch.cat(segments) if segments else None
        return ReferenceOutput(tokens, kinds, reason, text, codes, decode_segments(self.codec, segments))
