"""Golden OpusLM decodings from ESPnet's own inference code (the parity oracle for OpusLM).

    ESPNET_SRC=/path/to/espnet python scripts/espnet_goldens_opuslm.py --export DIR --out GOLDENS.json \
        [--produced-by TEXT]

ESPNET_SRC is an ESPnet source tree with the OpusLM-era SpeechLM code (espnet2/speechlm/core_lm/
ar_delay.py, inference_utils.py, bin/speechlm_inference.py): jctian98/espnet master (42e484b;
current ESPnet deleted it). Run with a Python that has torch, transformers (OLMo-2), typeguard,
kaldiio and pyyaml (the Bagpiper goldens' venv plus `pip install typeguard kaldiio`).

DIR is the tiny ESPnet experiment `speechlm-make-tiny --family opuslm --espnet-export --seed 0`
writes: config.yaml (token_list, token_bias, codec_token_in_use), model.pth (`corelm.*`),
backbone/ (the OLMo-2 that `hf_model_tag` names; weights are drawn at random from its
config.json, then model.pth overwrites every one of them, strict).

What runs is ESPnet's: HFTransformerDecoder + ARDelayLM (its delay warm-up, its drain after eos)
built from the experiment's config, `SpeechLM.__call__` of bin/speechlm_inference.py in chat mode
(parse_sequence, one `ARDelayLM.inference` per target segment, the KV cache kept across them),
and inference_utils.build_mask's per-modality masks. Not imported (their module-level imports
need codec, audio and sentencepiece packages that decoding never touches): the task class
(tasks/speechlm.py; its build_model is replayed here: transformer -> ARDelayLM -> ESPnetSpeechLMModel,
strict load) and the preprocessor: master's SpeechLMPreprocessor predates the dialogue format the
OpusLM releases were trained on, so the prompt is spliced here by the rules of the speechlm3
branch's preprocessor (espnet2/train/preprocessor.py there): `<sos/eos>`, the task token, then per
message its role token (8 system, 9 user, 10 assistant), its modality marker (32-63), its
content on stream 0 (streams 1..S-1 pad), `<sos/eos>` after a target's content, and S-1 pad
rows after every message (ar_delay's inter_segment_pad). A target to decode is its role and
marker only.

Decoding is greedy: text `greedy_search`; audio `topk_sampling` with top-k 1 (ESPnet's config
builder allows no greedy search for codec_ssl; one candidate is the argmax).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import types

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from espnet_goldens import espnet_commit, sha256  # noqa: E402

ROLES = {"system": "<system_prompt>", "user": "<user_input>", "assistant": "<assistant_output>"}
TASKS = {"text_bpe": "text_dialogue", "codec_ssl": "audio_dialogue"}  # text_dialogue: text-only answers
SYSTEM = ["system", "text_bpe", "You are a helpful assistant."]
USER = ["user", "text_bpe", "Hello world, please say something nice about the weather."]


def limits(minlen: int, maxlen: int) -> dict:
    return {"minlen": minlen, "maxlen": maxlen}


# maxlen: large enough that every case ends with a sampled eos (ESPnet forces one at maxlen - (S-1)
# and then drains one row early, a case the project does not reproduce: README).
def case(name, targets, dialogue=(USER,), text=limits(1, 60), audio=limits(10, 200)):
    return {"name": name, "dialogue": [list(m) for m in dialogue], "targets": list(targets),
            "inference_config": {"text_bpe": text, "codec_ssl": audio}}


CASES = [
    case("audio", ["codec_ssl"]),
    case("system_audio", ["codec_ssl"], dialogue=(SYSTEM, USER)),
    case("audio_minlen_30", ["codec_ssl"], audio=limits(30, 80)),
    case("text", ["text_bpe"]),
    case("text_minlen_8", ["text_bpe"], text=limits(8, 60)),
    case("text_then_audio", ["text_bpe", "codec_ssl"]),
]


def setup_espnet() -> None:
    """sys.path, and empty modules for imports decoding never uses (audio I/O, codec and
    sentencepiece tokenizers, the task class). After transformers: it probes torchaudio."""
    src = os.environ.get("ESPNET_SRC")
    if not src or not os.path.isfile(os.path.join(src, "espnet2", "speechlm", "core_lm", "ar_delay.py")):
        sys.exit("ESPNET_SRC must name an ESPnet tree with espnet2/speechlm/core_lm/ar_delay.py "
                 "(jctian98/espnet master); see this script's docstring")
    sys.path.insert(0, src)
    import transformers  # noqa: F401

    stubs = {"torchaudio": {}, "sentencepiece": {}, "espnet2.speechlm.tokenizer.codec_tokenizer": {"CodecTokenizer": None},
             "espnet2.tasks.speechlm": {"SpeechLMTask": None}}
    for name, attrs in stubs.items():
        module = sys.modules.setdefault(name, types.ModuleType(name))
        for key, value in attrs.items():
            setattr(module, key, value)


def build_model(export: str, raw: dict, tmp: str):
    """tasks/speechlm.py build_model's steps for the experiment, then the strict load of
    model.pth (bin/speechlm_inference.py via build_model_from_file)."""
    import torch
    import transformers

    from espnet2.speechlm.core_lm.ar_delay import ARDelayLM
    from espnet2.speechlm.espnet_model import ESPnetSpeechLMModel
    from espnet2.speechlm.module.huggingface import HFTransformerDecoder

    backbone = os.path.join(tmp, "backbone")
    shutil.copytree(os.path.join(export, "backbone"), backbone)
    config = transformers.AutoConfig.from_pretrained(backbone)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(backbone)
    conf = dict(raw["transformer_conf"], hf_model_tag=backbone)
    transformer = HFTransformerDecoder(token_bias=dict(raw["token_bias"]), **conf)
    corelm = ARDelayLM(transformer=transformer, continuous_encoders={}, vocab_size=len(raw["token_list"]),
                       nq=raw["codec_token_in_use"], **raw.get("corelm_conf", {}))
    model = ESPnetSpeechLMModel(corelm=corelm, criterion=None)
    model.load_state_dict(torch.load(os.path.join(export, "model.pth"), map_location="cpu"), strict=True)
    return model.float().eval()


def inference_configs(train_args, spec: dict) -> dict:
    """bin/speechlm_inference.py's build_inference_config for greedy decoding (no detokenizers)."""
    from espnet2.speechlm.inference_utils import SpeechInferenceConfig, TextInferenceConfig, build_mask

    common = dict(device="cpu", nbest=1, nq=train_args.codec_token_in_use, eos=train_args.token_list.index("<sos/eos>"),
                  length_method="absolute")
    text = TextInferenceConfig(search_algo="greedy_search", mask=build_mask(train_args, "text_bpe"),
                               **common, **spec["text_bpe"])
    audio = SpeechInferenceConfig(search_algo="topk_sampling", topk=1, sampling_temperature=1.0,
                                  mask=build_mask(train_args, "codec_ssl"), **common, **spec["codec_ssl"])
    return {"text_bpe": text, "codec_ssl": audio}


def dialogue_sequence(spec: dict, tokens: list[str], text_tok, bias: dict, nq: int) -> list[list[int]]:
    """The prompt rows, by the speechlm3 preprocessor's rules (this module's docstring)."""
    def row(tok: int) -> list[int]:
        return [tok] + [0] * (nq - 1)

    task = TASKS["codec_ssl" if "codec_ssl" in spec["targets"] else "text_bpe"]
    rows = [row(tokens.index("<sos/eos>")), row(tokens.index(f"<{task}_task>"))]
    for role, modality, content in spec["dialogue"]:
        rows += [row(tokens.index(ROLES[role])), row(tokens.index(f"<{modality}_start/end>"))]
        rows += [row(bias["text_bpe"][0] + t) for t in text_tok.encode(content).ids]
        rows += [row(0)] * (nq - 1)
    for modality in spec["targets"]:
        rows += [row(tokens.index(ROLES["assistant"])), row(tokens.index(f"<{modality}_start/end>"))]
    return rows


class RowRecorder:
    """Every row ESPnet's decoder embeds, per `ARDelayLM.inference` call: the prefill (its last
    row apart), the prefill's last row (the target's marker), then each sampled row as it is fed
    back (warm-up and drain forcing applied; the last one only to keep the KV cache right)."""

    def __init__(self, corelm):
        self.calls, self.segments = [], []
        corelm.emb.register_forward_hook(lambda _m, args, _out: self.calls.append(args[0][0].tolist()))
        inner = corelm.inference

        def recorded(*args, **kwargs):
            self.calls.clear()
            result = inner(*args, **kwargs)
            self.segments.append((self.calls[1][0], [row for call in self.calls[2:] for row in call]))
            return result

        corelm.inference = recorded


def run_case(speechlm, recorder: RowRecorder, spec: dict, prompt: list[list[int]]) -> dict:
    import torch

    recorder.segments.clear()
    decoded = [s for s in speechlm(dict(dec_seq=torch.tensor([prompt]))) if isinstance(s, list)]
    out = dict(spec, prompt=prompt, segments=[])
    for modality, (marker, rows), frames in zip(spec["targets"], recorder.segments, decoded):
        # __call__ puts the target's role and marker before the returned frames.
        out["segments"].append({"modality": modality, "marker_row": marker, "rows": rows,
                                "frames": frames[0][2:].tolist()})
    return out


def goldens(export: str, tmp: str, produced_by: str | None) -> dict:
    import torch
    import transformers
    import yaml
    from tokenizers import Tokenizer

    from espnet2.bin.speechlm_inference import SpeechLM

    with open(os.path.join(export, "config.yaml")) as f:
        raw = yaml.safe_load(f)
    model = build_model(export, raw, tmp)
    train_args = argparse.Namespace(**raw)
    text_tok = Tokenizer.from_file(os.path.join(export, "backbone", "tokenizer.json"))
    recorder = RowRecorder(model.corelm)
    cases = []
    for spec in CASES:
        # SpeechLM.__init__ loads from files through the task class; the attributes it sets are these.
        speechlm = SpeechLM.__new__(SpeechLM)
        speechlm.model, speechlm.train_args, speechlm.nbest = model.corelm, train_args, 1
        speechlm.inference_config = inference_configs(train_args, spec["inference_config"])
        speechlm.inference_mode, speechlm.inference_last_segment = "chat", False
        prompt = dialogue_sequence(spec, raw["token_list"], text_tok, raw["token_bias"], raw["codec_token_in_use"])
        cases.append(run_case(speechlm, recorder, spec, prompt))
    return {
        "espnet_commit": espnet_commit(),
        "export_sha256": sha256(os.path.join(export, "model.pth")),
        "export_produced_by": produced_by,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "dtype": "float32",
        "format": "prompt: ESPnet's dec_seq rows [stream 0..S-1] (chat format, the targets' role + marker last). "
        "segments: one per target, decoded by ARDelayLM.inference: marker_row is the prefill's last row (the "
        "target's modality marker), rows every row it sampled and fed back in the delay pattern (warm-up "
        "pads, the eos row, then S rows of drain: the first fully sampled, the later ones with streams 0..k "
        "forced to pad), frames what it returned (de-interleaved, cut before eos).",
        "cases": cases,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--export", required=True, help="the tiny ESPnet OpusLM experiment directory")
    ap.add_argument("--out", required=True, help="golden JSON to write")
    ap.add_argument("--produced-by", help="how the export was made, recorded in the JSON")
    args = ap.parse_args()
    export = os.path.abspath(args.export)
    setup_espnet()
    import torch

    torch.manual_seed(0)  # the backbone's placeholder weights (all overwritten by model.pth)
    with tempfile.TemporaryDirectory() as tmp:
        data = goldens(export, tmp, args.produced_by)
    with open(args.out, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")
    print(f"wrote {args.out}: {len(data['cases'])} cases")


if __name__ == "__main__":
    main()
