"""Tooling of the test suite and the benchmarks (not installed with the package): a server
launcher (`launch.py`) and the self-test pipelines that prove a platform runs omni stages
(`selftest_pipelines.py`). Importable from the repository root (pytest and the benchmarks put it
on the path)."""
