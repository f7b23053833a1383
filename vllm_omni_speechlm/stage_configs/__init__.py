"""Deploy YAMLs (vllm-omni `--deploy-config`), shipped with the package; `path(name)` finds one."""

from pathlib import Path

DIR = Path(__file__).resolve().parent

# Stage-0-only deploy YAML of each family (SpeechLMGenerator's default): its `pipeline:` names the
# family's stage-0 architecture.
LM_ONLY = {"bagpiper": "speech_lm_only.yaml", "opuslm": "opuslm_lm_only.yaml", "opuslm-dialogue": "opuslm_lm_only.yaml"}


def path(name: str) -> str:
    found = DIR / name
    if not found.is_file():
        raise ValueError(f"deploy config: no {name!r} in {DIR} (have {sorted(p.name for p in DIR.glob('*.yaml'))})")
    return str(found)
