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
EXPECTED_TO_DIFFER: dict[str, str] = {}
MODES = {None: "auto", ("text",): "text", ("audio",): "audio", ("text", "audio"): "text+audio"}


def load() -> dict:
    with open(GOLDENS) as f:
        return json.load(f)


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


def prompt_rows(case: dict, cfg: SpeechLMConfig) -> list[int]:
    """ESPnet's prompt (stream 0; the other streams are pad) plus the `<|assistant|>` ESPnet
    prefills before the first segment: what the project's prompt builder must produce."""
    assert all(not any(row[1:]) for row in case["prompt"])
    return [row[0] for row in case["prompt"]] + [cfg.specials.assistant]


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


__all__ = ["load", "build_checkpoint", "params", "prompt_rows", "expected_rows", "cases_as_params", "os"]
