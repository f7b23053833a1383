"""Make the CUDA-only torchvision wheel importable next to CPU torch.

PyPI has no CPU build of torchvision for Linux. Its C++ ops cannot load with CPU torch, and
`torchvision/_meta_registrations.py` then fails at import (`operator torchvision::nms does not
exist`). vllm-omni imports `torchvision.transforms.v2` unconditionally, so we keep the
pure-Python parts and skip the fake-op registrations when the extension is missing.
Idempotent: running it twice changes nothing.
"""

import importlib.util
import pathlib
import sys

GUARD = "# speechlm: fake ops registered only when the C++ extension loaded\n"
SHIM = (
    GUARD
    + "def _register_fake(name):\n"
    + "    if torchvision.extension._has_ops():\n"
    + "        return torch.library.register_fake(name)\n"
    + "    return lambda fn: fn\n\n\n"
)


def main() -> int:
    spec = importlib.util.find_spec("torchvision")
    if spec is None or spec.origin is None:
        print("torchvision not installed: nothing to patch")
        return 0
    path = pathlib.Path(spec.origin).parent / "_meta_registrations.py"
    text = path.read_text()
    if GUARD in text:
        return 0
    anchor = "@functools.lru_cache(None)\ndef get_meta_lib():"
    if anchor not in text:
        print(f"unexpected layout of {path}; patch not applied", file=sys.stderr)
        return 1
    text = text.replace("@torch.library.register_fake(", "@_register_fake(")
    path.write_text(text.replace(anchor, SHIM + anchor, 1))
    print(f"patched {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
