"""Golden Bagpiper decodings from ESPnet's own inference code (the parity oracle). OpusLM's:
scripts/espnet_goldens_opuslm.py (it shares this script's helpers).

    ESPNET_SRC=/path/to/espnet python scripts/espnet_goldens.py --export DIR --out GOLDENS.json \
        [--keys KEYS.txt] [--produced-by TEXT]
    ESPNET_SRC=/path/to/espnet python scripts/espnet_goldens.py --make-export DIR --seed 0

ESPNET_SRC is an ESPnet source tree with the Bagpiper-era `espnet2/speechlm/model/speechlm/`
(smellslikeml/espnet 6892551; PyPI wheels lack it). ESPnet is not a dependency of this project:
run this with a Python that has ESPnet's pinned transformers (5.0.0rc3: later versions return
an output object from Qwen3-Omni's get_audio_features, which ESPnet's prefill cannot split):
    python3 -m venv V && V/bin/pip install torch==2.13.0 transformers==5.0.0rc3 numpy joblib \
        soundfile pyyaml safetensors pillow && V/bin/pip install --no-deps torchvision==0.28.0 \
        && V/bin/python scripts/patch_torchvision.py
(torchvision and pillow: transformers' Qwen3-Omni processor, which ESPnet loads for its feature
extractor.) The JSON records ESPnet's commit from `git -C $ESPNET_SRC`, else $ESPNET_COMMIT.

An export DIR holds what ESPnet's build and `bin/inference.py` need:
  model.pth     {"module": state_dict}, as espnet2/speechlm/bin/export_checkpoint.py saves it
  qwen3/ or backbone/  the backbone's Hugging Face config.json (vocab_size = text vocabulary
                size) and the text tokenizer (text ids from 0, as Qwen's)
  xcodec/       transformers' XcodecConfig config.json
  qwen3_omni/   optional: Qwen3OmniMoeConfig config.json + processor (default: write_tiny_omni,
                its audio tower from audio_tower/config.json when the export has one)
Weight files there are optional: ESPnet's build loads pretrained weights that model.pth then
overwrites (strict), so missing ones are drawn at random from the configs.

Audio cases put deterministic clips (devtools/audio_clips.py, recorded by seconds, pitch and the
sha256 of their int16 samples) in the user's turn; ESPnet reads them with its continuous_audio IO
(the tiny Qwen3-Omni tower), and each case runs as bin/inference.py runs a sample: the
preprocessor's collate_fn builds the batch (the features' rows included), then
ParallelLLM.inference.

Decoding is greedy (temperature 0). ESPnet samples with torch.multinomial under a fixed seed, so
its sampled decodings repeat on one torch build, but no serving engine draws the same stream:
they are not comparable token for token.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import traceback
import types

OMNI_TAG = "Qwen/Qwen3-Omni-30B-A3B-Instruct"  # ContinuousAudioIO accepts only this literal tag
EOS_EOT = [2, 3]  # <|eos|>, <|eot|> (speechlm_job.py's fixed special slots)
SEED = 42  # bin/inference.py's default, reset before every sample


def espnet_config(qwen3: str, xcodec: str) -> dict:
    """The released Bagpiper training config (egs2/bagpiper/speechlm1/conf/
    train_stage3_qwen3_base.yaml), pointed at tiny local directories, float32 + sdpa."""
    return {
        "job_type": "speechlm",
        "multimodal_io": {  # order matters: it is the vocabulary order
            "text": {"tokenizer_name": qwen3},
            "discrete_audio": {
                "codec_choice": "Xcodec",
                "codec_hf_model_tag": xcodec,
                "ssl_choice": None,
                "ssl_hf_model_tag": None,
                "delay_interleave": True,
                "stream_weights": [0.125] * 8,
            },
            "continuous_audio": {
                "encoder_choice": "huggingface",
                "encoder_hf_model_tag": OMNI_TAG,
                "attn_implementation": "sdpa",
                "dtype": "float32",
            },
        },
        "model": {
            "model_choice": "parallel",
            "model_hf_tag": qwen3,
            "model_conf": {"attn_implementation": "sdpa", "dtype": "float32"},
        },
        "preprocessor": {
            "audio_input": "continuous_audio",
            "audio_output": "discrete_audio",
            "loss_region": "assistant",
            "audio_cfg": 0.05,  # training-only (is_train=False ignores it)
        },
        "data_loading": {"batchfy_method": "pack", "batch_size": 20000},
    }


# ------------------------------------------------------------------------------------------------
# Making ESPnet importable and buildable on CPU, offline
# ------------------------------------------------------------------------------------------------


def setup_espnet(tmp: str) -> None:
    """sys.path, and an offline Hugging Face hub whose only model, OMNI_TAG, is tmp/hf/omni
    (filled by build_job). Runs before transformers is imported: the hub reads its env then."""
    src = os.environ.get("ESPNET_SRC")
    if not src or not os.path.isdir(os.path.join(src, "espnet2", "speechlm")):
        sys.exit("ESPNET_SRC must name an ESPnet source tree with espnet2/speechlm "
                 "(e.g. smellslikeml/espnet at 6892551); see this script's docstring")
    sys.path.insert(0, src)
    repo = os.path.join(tmp, "hub", "models--" + OMNI_TAG.replace("/", "--"))
    os.makedirs(os.path.join(repo, "refs"))
    os.makedirs(os.path.join(repo, "snapshots"))
    with open(os.path.join(repo, "refs", "main"), "w") as f:
        f.write("0" * 40)
    os.symlink(os.path.join(tmp, "hf", "omni"), os.path.join(repo, "snapshots", "0" * 40))
    os.environ.update(HF_HUB_CACHE=os.path.join(tmp, "hub"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")


def stub_training_imports() -> None:
    """liger_kernel is imported for the training loss only; torchaudio only resamples input
    audio that is not 16 kHz (none here). Called after transformers is imported, so that it
    does not take the torchaudio stub for the real package."""
    for name in ("liger_kernel", "liger_kernel.ops", "liger_kernel.ops.fused_linear_cross_entropy"):
        sys.modules.setdefault(name, types.ModuleType(name))
    sys.modules["liger_kernel.ops.fused_linear_cross_entropy"].LigerFusedLinearCrossEntropyFunction = None
    try:
        import torchaudio  # noqa: F401
    except ImportError:
        sys.modules["torchaudio"] = types.ModuleType("torchaudio")


def materialise(src: str, kind: str, tmp: str) -> str:
    """A copy of `src` under tmp/hf/kind, with random weights from its config.json if it has
    none (ESPnet's build loads pretrained weights that the export's model.pth overwrites)."""
    import transformers

    dst = os.path.join(tmp, "hf", kind)
    shutil.copytree(src, dst)
    if any(n.endswith((".safetensors", ".bin")) for n in os.listdir(dst)):
        return dst
    config = transformers.AutoConfig.from_pretrained(dst)
    cls = {"qwen3": transformers.AutoModelForCausalLM, "xcodec": transformers.XcodecModel,
           "omni": transformers.Qwen3OmniMoeForConditionalGeneration}[kind]
    (cls.from_config(config) if kind == "qwen3" else cls(config)).save_pretrained(dst)
    return dst


@contextlib.contextmanager
def flash_attention_label():
    """parallel.py asserts flash attention right after loading the backbone (its training
    kernels need it); CPU has none. The backbone loads with sdpa and wears a flash label only
    for that assert; build_model's caller restores sdpa before anything runs."""
    import transformers

    base = transformers.PreTrainedModel.from_pretrained.__func__

    def labelled(cls, *args, **kwargs):
        model = base(cls, *args, **kwargs)
        model.config._attn_implementation = "flash_attention_2"
        return model

    transformers.Qwen3ForCausalLM.from_pretrained = classmethod(labelled)
    try:
        yield
    finally:
        del transformers.Qwen3ForCausalLM.from_pretrained


def build_job(export: str, tmp: str):
    """ESPnet's job template and its ParallelLLM for the export's config (random weights)."""
    import transformers  # noqa: F401  (before the stubs)

    stub_training_imports()
    from espnet2.speechlm.model.speechlm.speechlm_job import SpeechLMJobTemplate

    omni = os.path.join(export, "qwen3_omni")
    if not os.path.isdir(omni):  # optional in an export: the tiny tower below is the default
        write_tiny_omni(omni := os.path.join(tmp, "qwen3_omni"), export_audio_tower(export))
    materialise(omni, "omni", tmp)  # OMNI_TAG resolves here
    # qwen3/: --make-export's name; backbone/: speechlm-make-tiny --espnet-export's.
    backbone = next(os.path.join(export, d) for d in ("qwen3", "backbone") if os.path.isdir(os.path.join(export, d)))
    config = espnet_config(materialise(backbone, "qwen3", tmp),
                           materialise(os.path.join(export, "xcodec"), "xcodec", tmp))
    job = SpeechLMJobTemplate(config, is_train=False)
    with flash_attention_label():
        model = job.build_model()
    model.config._attn_implementation = "sdpa"
    return job, model.float().eval()


# ------------------------------------------------------------------------------------------------
# --make-export: a tiny random export written by ESPnet itself
# ------------------------------------------------------------------------------------------------


def write_tiny_hf_dirs(export: str) -> None:
    """Configs + tokenizer only: the project's tiny geometry (2-layer Qwen3, head_dim 32, 400
    text tokens, its tiny X-Codec) and a 1-layer Qwen3-Omni audio tower."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from vllm_omni_speechlm.codec.xcodec import _TINY_SEMANTIC_MODEL_CONFIG, TINY_CONFIG
    from vllm_omni_speechlm.make_tiny import TINY_TEXT_VOCAB, BackboneGeometry
    from vllm_omni_speechlm.tokenizer import train_text_bpe

    geo = BackboneGeometry()
    qwen3 = os.path.join(export, "qwen3")
    transformers.Qwen3Config(
        vocab_size=TINY_TEXT_VOCAB, hidden_size=geo.hidden_size, intermediate_size=geo.intermediate_size,
        num_hidden_layers=geo.num_hidden_layers, num_attention_heads=geo.num_attention_heads,
        num_key_value_heads=geo.num_key_value_heads, head_dim=geo.head_dim, rms_norm_eps=geo.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": geo.rope_theta},
        max_position_embeddings=geo.max_position_embeddings, tie_word_embeddings=False,
        architectures=["Qwen3ForCausalLM"],
    ).save_pretrained(qwen3)
    vocab, merges = train_text_bpe(TINY_TEXT_VOCAB)  # "!" is id 0, as in Qwen's vocabulary
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(qwen3)

    os.makedirs(os.path.join(export, "xcodec"))
    with open(os.path.join(export, "xcodec", "config.json"), "w") as f:
        json.dump(TINY_CONFIG.to_xcodec_dict(_TINY_SEMANTIC_MODEL_CONFIG, encoder_hidden_size=4), f, indent=2)

    write_tiny_omni(os.path.join(export, "qwen3_omni"))


def export_audio_tower(export: str) -> dict | None:
    """The audio tower config speechlm-make-tiny --espnet-export writes (audio_tower/config.json)."""
    path = os.path.join(export, "audio_tower", "config.json")
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return {k: v for k, v in json.load(f).items() if k != "model_type"}


def write_tiny_omni(path: str, audio: dict | None = None) -> None:
    """Qwen3-Omni config (talker off) + a processor ESPnet takes the feature extractor from (the
    released Qwen3-Omni's settings: 128 bins, 300 s). Only the audio tower survives ESPnet's
    build; the rest only has to be constructible."""
    import transformers
    from tokenizers import Tokenizer, models

    audio = audio or {"num_mel_bins": 128, "encoder_layers": 1, "encoder_attention_heads": 2, "encoder_ffn_dim": 32,
                      "d_model": 16, "output_dim": 24, "downsample_hidden_size": 8}
    vision = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": 32,
              "deepstack_visual_indexes": [0], "num_position_embeddings": 16}
    text = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 32, "moe_intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
            "num_experts": 2, "num_experts_per_tok": 1}
    thinker = {"audio_config": audio, "vision_config": vision, "text_config": text}
    config = transformers.Qwen3OmniMoeConfig(thinker_config=thinker, enable_audio_output=False)
    config.architectures = ["Qwen3OmniMoeForConditionalGeneration"]
    config.save_pretrained(path)
    # The processor's tokenizer must name the Omni placeholder tokens; nothing else of it is used.
    names = ("image_pad", "audio_pad", "video_pad", "vision_start", "vision_end", "audio_start", "audio_end")
    keys = ("image", "audio", "video", "vision_bos", "vision_eos", "audio_bos", "audio_eos")
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
        extra_special_tokens={f"{k}_token": f"<|{n}|>" for k, n in zip(keys, names)},
    )
    transformers.Qwen3OmniMoeProcessor(
        image_processor=transformers.Qwen2VLImageProcessor(),
        video_processor=transformers.Qwen2VLVideoProcessor(),
        feature_extractor=transformers.WhisperFeatureExtractor(feature_size=128, chunk_length=300),
        tokenizer=tok,
    ).save_pretrained(path)


def peaked_lm_weights(state: dict, seed: int) -> None:
    """Re-draw the language model's tensors (in place) at scales that keep logits peaked, so
    greedy decisions are far from ties. ESPnet's own init (std 0.02, zero stream embeddings)
    would leave them near-flat. Codec, audio tower and vocab_weight keep their values."""
    import torch

    g = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if not (name.startswith(("model.", "lm_head", "stream_emb")) and t.is_floating_point()):
            continue
        if name.endswith("norm.weight"):
            t.copy_(1.0 + 0.1 * torch.randn(t.shape, generator=g))
        elif name in ("model.embed_tokens.weight", "lm_head.weight", "stream_emb.weight"):
            t.copy_(0.5 * torch.randn(t.shape, generator=g))
        else:
            t.copy_(torch.randn(t.shape, generator=g) * t.shape[-1] ** -0.5)
    # nn.Embedding(padding_idx=0): the pad row starts at zero and gets no gradient, so a
    # trained checkpoint keeps it zero (pad in stream 0 and the CFG branch embed to zero).
    state["model.embed_tokens.weight"][0] = 0.0
    # Stronger eos/eot rows: segments then end by themselves within tens of steps, so the cases
    # exercise min_step, eot-continuation and eot inside audio, not only max_step.
    state["lm_head.weight"][EOS_EOT] *= 3.0


def make_export(export: str, seed: int, tmp: str) -> None:
    import torch

    write_tiny_hf_dirs(export)
    torch.manual_seed(seed)
    _, model = build_job(export, tmp)
    state = model.state_dict()
    peaked_lm_weights(state, seed)
    torch.save({"module": state}, os.path.join(export, "model.pth"))
    print(f"wrote {export}/model.pth ({len(state)} tensors)")


# ------------------------------------------------------------------------------------------------
# --export: decode the cases
# ------------------------------------------------------------------------------------------------

SYSTEM = ["system", "text", "You are a helpful assistant."]
USER = ["user", "text", "Hello world, please say something nice about the weather."]


def greedy(max_step: int, min_step: int = 1, cfg: float = 1) -> dict:
    return {"temperature": 0, "topk": 20, "cfg": cfg, "min_step": min_step, "max_step": max_step}


def clip_message(seconds: float, pitch: float) -> list:
    """A user audio message: a devtools/audio_clips.py clip at 16 kHz."""
    from devtools import audio_clips

    samples = audio_clips.clip(seconds, pitch)
    return ["user", "audio", {"seconds": seconds, "pitch": pitch, "rate": audio_clips.RATE,
                              "sha256": audio_clips.sha256(samples)}]


def espnet_dialogue(dialogue: list) -> list:
    """The case's dialogue as ESPnet's preprocessor takes it: an audio message's data is
    (samples [channels, n] float32, sample rate)."""
    from devtools import audio_clips

    out = []
    for role, modality, data in dialogue:
        if modality == "audio":
            data = (audio_clips.as_float(audio_clips.clip(data["seconds"], data["pitch"]))[None], data["rate"])
        out.append([role, modality, data])
    return out


def case(name, enforce, text=greedy(12), audio=greedy(24, min_step=10), dialogue=(SYSTEM, USER)):
    config = {"num_hypo": 1, "text": text, "audio": audio}
    if enforce is not None:
        config["enforce_modality"] = enforce
    return {"name": name, "dialogue": [list(m) for m in dialogue], "inference_config": config}


CASES = [
    case("text_only", ["text"]),
    case("audio_only", ["audio"]),
    case("text_then_audio", ["text", "audio"]),
    case("audio_cfg3", ["audio"], audio=greedy(24, min_step=10, cfg=3)),
    # The released SFT setting (conf/inference_sft.yaml) with greedy decoding and small limits.
    case("text_then_audio_cfg3", ["text", "audio"], audio=greedy(24, min_step=10, cfg=3)),
    case("auto_modality", None),
    case("bang_is_pad", ["text", "audio"],
         dialogue=(SYSTEM, ["user", "text", "Hello! Say it again!"])),  # "!" is text id 0 -> pad
    case("text_min_step_1_max_step_3", ["text", "audio"], text=greedy(3)),
    case("audio_min_step_1", ["audio"], audio=greedy(40, min_step=1)),
    case("audio_min_step_25", ["audio"], audio=greedy(40, min_step=25)),  # past the natural end (20)
    # Fewer rows than streams: ESPnet's de-interleave has no whole frame to decode.
    case("audio_max_step_4", ["audio"], audio=greedy(4)),
    # Audio in: a question about a clip of more than one encoder chunk (100 mel frames) and less,
    # answered in text; a transcription (a clip under one chunk, no system prompt); speech in and
    # speech out with cfg 3. The clips are ones whose greedy decodings keep every top-2 logit gap
    # above 0.015 (random tiny models meet near-ties, where float32 rounding between two
    # implementations may pick either).
    case("audio_question_text", ["text"],
         dialogue=(SYSTEM, clip_message(1.5, 180.0), ["user", "text", "What is said in the recording?"])),
    case("audio_transcription", ["text"], dialogue=(clip_message(0.7, 240.0),)),
    case("speech_to_speech_cfg3", ["audio"], audio=greedy(24, min_step=10, cfg=3),
         dialogue=(SYSTEM, clip_message(5.3, 140.0))),
    # A clip past one attention window of the tower (8 s): on CPU (sdpa) ESPnet's transformers
    # 5.0.0rc3 attends over the whole clip; flash attention (ESPnet's training and GPU runs),
    # later transformers and vLLM attend within the windows (tests/espnet_parity.py).
    case("audio_question_long_clip", ["text"],
         dialogue=(SYSTEM, clip_message(9.3, 160.0), ["user", "text", "What is said in the recording?"])),
]


class SegmentRecorder:
    """Wraps the model's inference_segment to keep what inference() discards: each segment's
    modality token and every generated row (eos/eot row included)."""

    def __init__(self, model):
        self.segments, self._inner = [], model.inference_segment
        model.inference_segment = self

    def __call__(self, config, cache, prev_token, mask):
        hypos, cache, logits = self._inner(config=config, cache=cache, prev_token=prev_token, mask=mask)
        self.segments.append({"modality_token": prev_token.flatten()[0].item(),
                              "tokens": hypos[0].tolist()})
        return hypos, cache, logits


def run_case(preprocessor, model, spec: dict) -> dict:
    import torch

    key = ("dialogue", "goldens", spec["name"])
    batch = preprocessor.collate_fn([(key, {"dialogue": espnet_dialogue(spec["dialogue"])})])
    batch.pop("keys")
    out = dict(spec, prompt=batch["seqs"][0].tolist())
    if "continuous_audio_indices" in batch:  # [batch, start, length] of each clip's feature rows
        out["audio_rows"] = [row[1:] for row in batch["continuous_audio_indices"].tolist()]
    recorder = SegmentRecorder(model)
    torch.manual_seed(SEED)
    try:
        messages, _ = model.inference(spec["inference_config"], **batch)
    except Exception as e:  # an upstream crash: the case is undefined in ESPnet, say so
        messages, out["espnet_error"] = [], "".join(traceback.format_exception_only(e)).strip()
    finally:
        del model.inference_segment
    vocab = model.vocab
    for seg, msg in zip(recorder.segments, messages + [None] * len(recorder.segments)):
        seg["modality"] = vocab[seg["modality_token"]].strip("<|>")
        last = seg["tokens"][-1][0]
        seg["end"] = {model.eos_token_id: "eos", model.eot_token_id: "eot"}.get(last, "max_step")
        if msg is not None:
            seg["content"] = msg[2][0] if msg[1] == "text" else {"num_samples": int(msg[2][1][0])}
    out["segments"] = recorder.segments
    return out


def write_keys(checkpoint: str, path: str) -> None:
    import torch

    state = torch.load(checkpoint, map_location="cpu", weights_only=True)["module"]
    with open(path, "w") as f:
        for name, t in state.items():
            f.write(f"{name} {list(t.shape)} {str(t.dtype).removeprefix('torch.')}\n".replace(", ", ","))


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def espnet_commit() -> str | None:
    src = os.environ["ESPNET_SRC"]
    try:
        return subprocess.run(["git", "-C", src, "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("ESPNET_COMMIT")  # an exported tree has no .git


def goldens(export: str, tmp: str, produced_by: str | None) -> dict:
    import torch
    import transformers

    job, model = build_job(export, tmp)
    checkpoint = os.path.join(export, "model.pth")
    # As espnet2/speechlm/bin/inference.py: strict load, then prepare_inference().
    model.load_state_dict(torch.load(checkpoint, map_location="cpu", weights_only=True)["module"], strict=True)
    model.prepare_inference()
    preprocessor = job.build_preprocessor()
    return {
        "espnet_commit": espnet_commit(),
        "export_sha256": sha256(checkpoint),
        "export_produced_by": produced_by,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "dtype": "float32",
        "rng_seed": SEED,
        "format": "prompt: rows [stream 0..7] as ESPnet's preprocessor built them (an audio clip's rows "
        "are pad; audio_rows: [start, length] of each clip's feature rows). segments: one "
        "per inference_segment call; modality_token is what followed the forced <|assistant|>; "
        "tokens are every row it sampled, the final eos/eot row included (inference() drops "
        "that row from the decoded content and feeds it back with streams 1..7 zeroed); end is "
        "eos, eot or max_step. espnet_error: ESPnet raised (the segments before it are kept).",
        "vocab_intervals": model.vocab_intervals,
        "cases": [run_case(preprocessor, model, spec) for spec in CASES],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--export", help="a tiny ESPnet-format export directory to decode with")
    mode.add_argument("--make-export", help="write a tiny random export (made by ESPnet) here")
    ap.add_argument("--out", help="golden JSON to write (with --export)")
    ap.add_argument("--seed", type=int, default=0, help="weights seed (with --make-export)")
    ap.add_argument("--produced-by", help="how the export was made, recorded in the JSON")
    ap.add_argument("--keys", help="also write the export's state_dict keys (key shape dtype) here")
    args = ap.parse_args()
    if args.export and not args.out:
        ap.error("--export needs --out")
    export = os.path.abspath(args.export or args.make_export)
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project
    with tempfile.TemporaryDirectory() as tmp:
        setup_espnet(tmp)
        if args.make_export:
            make_export(export, args.seed, tmp)
            return
        data = goldens(export, tmp, args.produced_by)
    if args.keys:
        write_keys(os.path.join(export, "model.pth"), args.keys)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(data['cases'])} cases")


if __name__ == "__main__":
    main()
