"""Tensor-parallel stage 0 against one rank: greedy answers of the tiny Bagpiper in float32, every
stream of every row, from an engine per tensor_parallel_size (one after the other, the same
requests), each also against the plain-PyTorch reference.

    python benchmarks/tp_parity.py --out results.json              # a host with two GPUs
    python benchmarks/tp_parity.py --tp 1 2 --out /tmp/tp.json     # CPU: vLLM's CPU communicator
    python benchmarks/tp_parity.py --graphed --out results.json    # GPU: vLLM's and the step graphs

Cases: a text prompt answered in speech, text then speech, audio in, a CFG pair (cfg 3), and a
batch of four prompts decoded at once (all of them guided). By default the engines run eagerly
(`enforce_eager`): the comparison is of the sharded heads and state. `--graphed` runs them as
served on a GPU: vLLM's CUDA graphs, the compiled step functions and the step graphs, and records
each rank's step counters (steps, steps replayed from step graphs). Prints and saves per case:
equal across TP sizes, equal to the reference, the first row that differs (None: none).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # devtools
from streaming_latency import device_name  # noqa: E402

from devtools import audio_clips  # noqa: E402
from devtools.cpu_ranks import cpu_ranks  # noqa: E402

SYSTEM = "Be brief."
GREEDY = dict(text_temperature=0.0, audio_temperature=0.0, max_tokens=48)
CLIP = (audio_clips.as_float(audio_clips.clip(0.7, 240.0)), audio_clips.RATE)
BATCH = ["Hi.", "Say hello to the world.", "What time is it in the morning?", "Thanks a lot."]
CASES = {  # name: (prompts, audio clips per prompt, options)
    "audio": (["Say hello to the world."], None, dict(modality="audio")),
    "text_then_audio": (["What time is it?"], None, dict(modality="text+audio", max_text_tokens=5)),
    "audio_in": ([""], [[CLIP]], dict(modality="text+audio", max_text_tokens=5)),
    "cfg3": (["Read this out loud please."], None, dict(modality="audio", cfg_scale=3.0)),
    "batch_cfg3": (BATCH, None, dict(modality="audio", cfg_scale=3.0)),
}
ENGINE = dict(dtype="float32", max_num_seqs=8, max_model_len=512, gpu_memory_utilization=0.3)


def answers(model_dir: str, tp: int, graphed: bool = False) -> tuple[dict[str, list[torch.Tensor]], list[dict]]:
    """{case: [L, S] stream tokens per prompt} from one engine of tensor_parallel_size `tp`, and
    each rank's step counters after the cases."""
    from vllm_omni_speechlm.generator import SpeechLMGenerator
    from vllm_omni_speechlm.models.steps import step_counters

    out = {}
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc of `step_counters`
    ranks = cpu_ranks(tp) if tp > 1 and not torch.cuda.is_available() else contextlib.nullcontext()
    with ranks, SpeechLMGenerator(model_dir, tensor_parallel_size=tp, **ENGINE, enforce_eager=not graphed) as gen:
        for name, (prompts, clips, kw) in CASES.items():
            results = gen.generate(prompts, system=SYSTEM, audio=clips, **GREEDY, **kw)
            out[name] = [torch.tensor(r["stream_token_ids"]) for r in results]
        counters = gen.omni.engine.collective_rpc("apply_model", args=(step_counters,), stage_ids=[0])
    while counters and isinstance(counters[0], list):  # [stage][rank]
        counters = counters[0]
    return out, counters


def references(model_dir: str) -> dict[str, list[torch.Tensor]]:
    from tokenizers import Tokenizer

    from vllm_omni_speechlm.reference import ReferenceSpeechLM
    from vllm_omni_speechlm.sampling_params import SpeechSamplingParams
    from vllm_omni_speechlm.tokenizer import encode_prompt

    ref = ReferenceSpeechLM(model_dir)
    tok = Tokenizer.from_file(os.path.join(model_dir, "tokenizer.json"))
    out = {}
    for name, (prompts, clips, kw) in CASES.items():
        params = SpeechSamplingParams(**GREEDY, **kw)
        clips = clips or [[]] * len(prompts)
        out[name] = [ref.generate(encode_prompt(tok, ref.cfg, p, system=SYSTEM, audio=len(c)), params, audio=c).tokens
                     for p, c in zip(prompts, clips)]
    return out


def first_difference(a: list[torch.Tensor], b: list[torch.Tensor]) -> list[int | None]:
    """Per prompt: the first row where the answers differ (a shorter answer differs where it ends)."""
    rows = []
    for x, y in zip(a, b):
        n = min(len(x), len(y))
        diff = (x[:n] != y[:n]).any(-1).nonzero()
        rows.append(int(diff[0]) if len(diff) else (None if len(x) == len(y) else n))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="tensor_parallel_size per engine")
    ap.add_argument("--workdir", help="the tiny checkpoint (default: a temporary folder)")
    ap.add_argument("--graphed", action="store_true", help="vLLM's CUDA graphs and the step graphs (default: eager)")
    args = ap.parse_args()
    from vllm_omni_speechlm.make_tiny import make_tiny

    model_dir = str(Path(args.workdir or tempfile.mkdtemp(prefix="tp-parity-")) / "tiny-bagpiper")
    make_tiny("bagpiper", model_dir, seed=0)
    ref = references(model_dir)
    runs, steps = {}, {}
    for tp in args.tp:
        runs[tp], steps[tp] = answers(model_dir, tp, args.graphed)
    base = runs[args.tp[0]]
    cases = {
        name: {
            "rows": [len(t) for t in ref[name]],
            "first_difference_from_reference": {tp: first_difference(run[name], ref[name]) for tp, run in runs.items()},
            f"first_difference_from_tp{args.tp[0]}": {tp: first_difference(run[name], base[name]) for tp, run in runs.items()},
        }
        for name in CASES
    }
    equal = all(row is None for case in cases.values() for by_tp in case.values() if isinstance(by_tp, dict)
                for rows in by_tp.values() for row in rows)
    report = {"benchmark": "tp_parity", "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "device": device_name(),
              "gpus": torch.cuda.device_count(), "settings": vars(args) | {"engine": ENGINE, "greedy": GREEDY},
              "all_equal": equal, "cases": cases, "steps_per_rank": steps}
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
