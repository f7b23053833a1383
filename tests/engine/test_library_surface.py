"""The library's entry points: the public imports, and the generator run from a script that has
no file for vLLM's spawned engine processes to re-import (stdin; `-c`, as a notebook)."""

import json
import os
import subprocess
import sys

import pytest

SCRIPT = """
import json
from vllm_omni_speechlm import SpeechLMConfig, SpeechLMGenerator, SpeechSamplingParams
assert SpeechLMConfig.from_model_dir({model!r}).family == "bagpiper"
with SpeechLMGenerator({model!r}, dtype="float32", max_num_seqs=2, max_model_len=256) as gen:
    [out] = gen.generate("Hello.", modality="text", max_tokens=5, seed=0)
print("RESULT", json.dumps({{"tokens": out["token_ids"], "cfg": SpeechSamplingParams(cfg_scale=2.0).use_cfg}}))
"""


@pytest.mark.parametrize("how", ["stdin", "-c"])
def test_the_generator_runs_from_a_script_without_a_file(tiny_bagpiper, tmp_path, how):
    script = SCRIPT.format(model=tiny_bagpiper)
    args, stdin = ([sys.executable, "-"], script) if how == "stdin" else ([sys.executable, "-c", script], None)
    proc = subprocess.run(args, input=stdin, capture_output=True, text=True, timeout=600, cwd=tmp_path,
                          env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    [line] = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    result = json.loads(line.removeprefix("RESULT "))
    assert len(result["tokens"]) == 5 and result["cfg"] is True
