"""ESPnet's golden OpusLM decodings (tests/data/espnet/opuslm_goldens.json) as this project
states them: the checkpoint rebuilt from the seed, each case's prompt and request options, and
the rows the engine and the reference must emit.

The goldens were made by ESPnet's own ARDelayLM.inference (scripts/espnet_goldens_opuslm.py)
over the experiment `speechlm-make-tiny --family opuslm --espnet-export --seed 0` writes; CI
rebuilds that experiment without ESPnet and checks its bytes first, so a changed writer fails
here, not as a mysterious token mismatch.

What the project emits for ESPnet's rows (README: OpusLM decoding), per target segment:
`<|assistant|>` (after the first: ESPnet prefills the next target's role), the modality marker
(ESPnet's last prefill row), the segment's rows up to its eos; then, unless a text segment ends
the answer, the eos is emitted deferred and the drain's S rows follow as ESPnet sampled and fed
them back, except that the cells past the clip's end (stream d of drain row d) are emitted as
pad, and an audio drain's last, all-pad row is the eos that stops the request. A final text
segment stops at its eos (ESPnet's drain after it only fills its KV cache).
"""

from __future__ import annotations

from pathlib import Path

from espnet_parity import read_json, sha256

from vllm_omni_speechlm.config import SpeechLMConfig
from vllm_omni_speechlm.convert import convert
from vllm_omni_speechlm.make_tiny import TINY_MIN_AUDIO_FRAMES, write_tiny_opuslm_export
from vllm_omni_speechlm.sampling_params import SpeechSamplingParams

GOLDENS = Path(__file__).parent / "data" / "espnet" / "opuslm_goldens.json"
EXPORT_SEED = 0
REGENERATE = (
    "the tiny OpusLM experiment's bytes changed: regenerate the goldens with ESPnet (scripts/espnet_goldens_opuslm.py "
    "--export DIR, DIR from speechlm-make-tiny --family opuslm --espnet-export --seed 0)"
)
MODES = {("codec_ssl",): "audio", ("text_bpe",): "text", ("text_bpe", "codec_ssl"): "text+audio"}


def load() -> dict:
    return read_json(GOLDENS)


def build_checkpoint(out: Path, goldens: dict) -> str:
    """The goldens' experiment rebuilt from its seed (bytes checked), converted to a served dir."""
    files = write_tiny_opuslm_export(str(out / "export"), EXPORT_SEED)
    assert sha256(files["checkpoint"]) == goldens["export_sha256"], REGENERATE
    served = str(out / "served")
    convert("opuslm", files["checkpoint"], served, files["text_tokenizer"], files["codec"], files["config"],
            files["backbone_config"], TINY_MIN_AUDIO_FRAMES)
    return served


def params(case: dict, max_tokens: int = 400) -> SpeechSamplingParams:
    """ESPnet's per-modality limits of a case as request options (greedy: no seed needed)."""
    text, audio = case["inference_config"]["text_bpe"], case["inference_config"]["codec_ssl"]
    return SpeechSamplingParams(
        modality=MODES[tuple(case["targets"])],
        text_temperature=0.0, audio_temperature=0.0,
        min_text_tokens=text["minlen"], max_text_tokens=text["maxlen"],
        min_audio_frames=audio["minlen"], max_audio_frames=audio["maxlen"],
        max_tokens=max_tokens,
    )


def prompt_args(case: dict) -> tuple[str, str | None, bool]:
    """(user text, system text, text-only answer) of a case's dialogue."""
    texts = {role: text for role, _, text in case["dialogue"]}
    return texts["user"], texts.get("system"), case["targets"] == ["text_bpe"]


def prompt_ids(case: dict) -> list[int]:
    """ESPnet's prompt (stream 0; the other streams are pad) up to the first target's role: what
    the project's prompt builder must produce (the project emits the targets' markers)."""
    assert all(not any(row[1:]) for row in case["prompt"])
    ids = [row[0] for row in case["prompt"]]
    return ids[: len(ids) - 2 * len(case["targets"]) + 1]


def expected_rows(case: dict, cfg: SpeechLMConfig) -> list[list[int]]:
    """Every row the project emits for the case (this module's docstring)."""
    sp, s = cfg.specials, cfg.num_streams
    segments = case["segments"]
    rows: list[list[int]] = []
    for k, seg in enumerate(segments):
        if k:
            rows.append([sp.assistant] + [sp.pad] * (s - 1))
        rows.append(list(seg["marker_row"]))
        esp = [list(r) for r in seg["rows"]]
        eos = next(i for i, r in enumerate(esp) if r[0] == sp.eos)
        if seg["modality"] == "text_bpe" and k == len(segments) - 1:
            return rows + esp[: eos + 1]
        assert len(esp) == eos + 1 + s, "ESPnet drains S rows after the row of eos"
        rows += esp[:eos] + _drained(esp[eos:], cfg, last=k == len(segments) - 1)
    return rows


def _drained(tail: list[list[int]], cfg: SpeechLMConfig, last: bool) -> list[list[int]]:
    """ESPnet's eos row and S drain rows as emitted: eos deferred (also on the first drain row),
    stream d of drain row d shown as pad, the answer's last row a forced eos."""
    sp, deferred = cfg.specials, cfg.decoding.deferred_eos
    for d, row in enumerate(tail):
        if row[0] == sp.eos and d < 2:
            row[0] = deferred
        if 1 <= d < cfg.num_streams:
            row[d] = sp.pad
    if last:
        tail[-1][0] = sp.eos
    return tail


def case_ids(goldens: dict) -> list[str]:
    return [c["name"] for c in goldens["cases"]]
