"""Make the CUDA-only torchaudio wheel importable next to CPU torch (pure-Python mode).

PyPI has no CPU build of torchaudio for Linux, and its C++ libraries cannot load with CPU torch
(`Could not load this library: .../_torchaudio.abi3.so`). vllm-omni's API server imports
torchaudio unconditionally (resampling, time stretch: pure PyTorch code), so `vllm serve --omni`
needs an importable torchaudio. torchaudio runs without its extension when the libraries are
absent from `torchaudio/lib/` (`_extension.utils._load_lib` returns False), so we move them into
a subdirectory it does not search. Idempotent: running it twice changes nothing.
"""

import importlib.util
import pathlib
import sys

PARKED = "cuda-only"


def main() -> int:
    spec = importlib.util.find_spec("torchaudio")
    if spec is None or spec.origin is None:
        print("torchaudio not installed: nothing to patch")
        return 0
    lib = pathlib.Path(spec.origin).parent / "lib"
    libs = sorted(lib.glob("*.so"))
    if not libs:
        return 0
    (lib / PARKED).mkdir(exist_ok=True)
    for path in libs:
        path.rename(lib / PARKED / path.name)
        print(f"parked {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
