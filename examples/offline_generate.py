"""Offline generation (no server): text and/or audio answers with `SpeechLMGenerator`.

    python examples/offline_generate.py MODEL_DIR "Hello there." --modality text+audio --out answer.wav

Runs the speech LM as a vLLM-Omni stage in this process (stage_configs/speech_lm_only.yaml) and
decodes the audio with the checkpoint's codec. On CPU add `--cpu-tiny` (float32, eager, small
batches) for the tiny test checkpoints (`speechlm-make-tiny`).
"""

from __future__ import annotations

import argparse
import base64

from vllm_omni_speechlm.generator import SpeechLMGenerator


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("prompts", nargs="+")
    parser.add_argument("--system", default="You are a helpful assistant.")
    parser.add_argument("--modality", default="text+audio", choices=["auto", "text", "audio", "text+audio"])
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--max-text-tokens", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="answer.wav", help="WAV path; several prompts get _0, _1, ... suffixes")
    parser.add_argument("--cpu-tiny", action="store_true", help="CPU settings for tiny checkpoints")
    args = parser.parse_args()

    engine = dict(dtype="float32", enforce_eager=True, max_num_seqs=8, max_model_len=1024) if args.cpu_tiny else {}
    with SpeechLMGenerator(args.model_dir, **engine) as gen:
        outs = gen.generate(args.prompts, system=args.system, modality=args.modality, max_tokens=args.max_tokens,
                            max_text_tokens=args.max_text_tokens, seed=args.seed)
    for i, out in enumerate(outs):
        print(f"[{i}] finish={out['finish_reason']} text={out['text']!r}")
        if out["audio"] is not None:
            path = args.out if len(outs) == 1 else args.out.replace(".wav", f"_{i}.wav")
            with open(path, "wb") as f:
                f.write(base64.b64decode(out["audio"]))
            print(f"[{i}] audio -> {path}")


if __name__ == "__main__":
    main()
