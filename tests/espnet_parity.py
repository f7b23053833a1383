"""ESPnet's golden Bagpiper decodings (tests/data/espnet/bagpiper_goldens.json) as this project
states them: the checkpoint rebuilt from the seed, each case's request options, and the rows the
engine and the reference must emit.

The goldens were made by ESPnet's own ParallelLLM.inference (scripts/espnet_goldens.py) over the
export `speechlm-make-tiny --family bagpiper --espnet-export --seed 0` writes; CI rebuilds that
export without ESPnet and checks its bytes first, so a changed writer fails here, not as a
mysterious token mismatch.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.convert import convert_bagpiper
from vllm_omni_speechlm.make_tiny import write_tiny_bagpiper_export
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

GOLDENS = Path(__file__).parent / "data" / "espnet" / "bagpiper_goldens.json"
EXPORT_SEED = 0
REGENERATE = (
    "the tiny export's bytes changed: regenerate the goldens with ESPnet "
    "(scripts/espnet_goldens.py --export DIR, DIR from speechlm-make-tiny --family bagpiper --espnet-export --seed 0)"
)
# Where the project differs from ESPnet on purpose (README: decoding rules).
EXPECTED_TO_DIFFER: dict[str, str] = {
    "audio_question_long_clip": "a clip past the audio tower's 8-s attention window: ESPnet's CPU run "
    "(transformers 5.0.0rc3, sdpa) attends over the whole clip; flash attention (ESPnet's training and "
    "GPU inference), transformers 5.14 and vLLM's encoder attend within the windows, as the project does",
}
MODES = {None: "auto", ("text",): "text", ("audio",): "audio", ("text", "audio"): "text+audio"}


def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def load() -> dict:
    return read_json(GOLDENS)


def sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def build_checkpoint(out: Path, goldens: dict) -> str:
    """The goldens' export rebuilt from its seed (bytes checked), converted to a served dir."""
    files = write_tiny_bagpiper_export(str(out / "export"), EXPORT_SEED)
    assert sha256(files["checkpoint"]) == goldens["export_sha256"], REGENERATE
    served = str(out / "served")
    convert_bagpiper(files["checkpoint"], served, files["text_tokenizer"], files["backbone_config"],
                     files["codec_config"], files["inference_config"], files["audio_tower_config"])
    return served


def params(case: dict, max_tokens: int = 160) -> SpeechSamplingParams:
    """ESPnet's inference config of a case as request options (greedy: no seed needed)."""
    c = case["inference_config"]
    t, a = c["text"], c["audio"]
    enforce = c.get("enforce_modality")
    return SpeechSamplingParams(
        modality=MODES[tuple(enforce) if enforce else None],
        text_temperature=float(t["temperature"]), text_top_k=t["topk"],
        audio_temperature=float(a["temperature"]), audio_top_k=a["topk"],
        cfg_scale=float(a["cfg"]),
        min_text_tokens=t["min_step"], max_text_tokens=t["max_step"],
        min_audio_frames=a["min_step"], max_audio_frames=a["max_step"],
        max_tokens=max_tokens,
    )


def prompt_parts(case: dict) -> tuple[str | None, str | None, list[tuple]]:
    """(system text, user text, user audio clips as (float32 samples, rate)) of a case's dialogue,
    which lists them in the prompt builder's order: system, the clips, the user's text."""
    from devtools import audio_clips

    system = user = None
    clips = []
    order = []
    for role, modality, data in case["dialogue"]:
        order.append((role, modality))
        if modality == "audio":
            samples = audio_clips.clip(data["seconds"], data["pitch"])
            assert audio_clips.sha256(samples) == data["sha256"], f"{case['name']}: the clip's samples changed"
            clips.append((audio_clips.as_float(samples), data["rate"]))
        elif role == "system":
            system = data
        else:
            user = data
    assert order == sorted(order, key=lambda m: (m[0] != "system", m[1] != "audio")), case["name"]
    return system, user, clips


def prompt_rows(case: dict, cfg: SpeechLMConfig) -> list[int]:
    """ESPnet's prompt (stream 0; the other streams are pad) plus the `<|assistant|>` ESPnet
    prefills before the first segment: what the project's prompt builder must produce, with each
    clip's feature rows (pad in ESPnet's sequence) as the audio placeholder, expanded."""
    assert all(not any(row[1:]) for row in case["prompt"])
    ids = [row[0] for row in case["prompt"]]
    for start, length in case.get("audio_rows", []):
        assert ids[start : start + length] == [cfg.specials.pad] * length
        ids[start : start + length] = [cfg.audio_input.placeholder_id] * length
    return ids + [cfg.specials.assistant]


def expected_rows(case: dict, cfg: SpeechLMConfig) -> tuple[list[list[int]], bool]:
    """(every row the project emits for the case, whether that is the whole answer). Per segment:
    `<|assistant|>` (after the first), the modality token, the segment's rows; an eos that a
    later enforced segment outlives is emitted deferred; an answer ending at a max length gets a
    forced eos row. Where ESPnet raised, only the rows it made are known."""
    sp, s = cfg.specials, cfg.num_streams
    enforce = case["inference_config"].get("enforce_modality") or []
    rows: list[list[int]] = []
    segments = case["segments"]
    for k, seg in enumerate(segments):
        if k:
            rows.append([sp.assistant] + [0] * (s - 1))
        rows.append([seg["modality_token"]] + [0] * (s - 1))
        tokens = [list(r) for r in seg["tokens"]]
        if seg["end"] == "eos" and k < len(enforce) - 1:
            tokens[-1][0] = cfg.decoding.deferred_eos
        rows += tokens
    complete = "espnet_error" not in case
    if complete and segments[-1]["end"] == "max_step":
        rows.append([sp.eos] + [0] * (s - 1))
    return rows, complete


def case_ids(goldens: dict) -> list[str]:
    return [c["name"] for c in goldens["cases"]]


def case_marks(name: str):
    import pytest

    reason = EXPECTED_TO_DIFFER.get(name)
    return [pytest.mark.xfail(reason=reason, strict=True)] if reason else []


def cases_as_params(goldens: dict):
    import pytest

    return [pytest.param(c, id=c["name"], marks=case_marks(c["name"])) for c in goldens["cases"]]


__all__ = ["load", "build_checkpoint", "params", "prompt_parts", "prompt_rows", "expected_rows", "cases_as_params", "os"]
