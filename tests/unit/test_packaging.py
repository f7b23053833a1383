"""What `pip install .` puts in the wheel: setuptools installs only the packages pyproject.toml lists."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_package_of_the_source_tree_is_installed():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "vllm_omni_speechlm").rglob("__init__.py")}
    assert found == listed, f"missing from pyproject.toml: {sorted(found - listed)}; listed, not found: {sorted(listed - found)}"
