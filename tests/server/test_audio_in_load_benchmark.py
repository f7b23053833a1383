"""`benchmarks/audio_in_load.py`: its clips and checkpoint, and a `--tiny` run of both routes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_request_sends_a_clip_of_its_own():
    """vLLM caches encoder outputs by content: a repeated clip would skip the tower."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from audio_in_load import wav_bytes

    clips = [wav_bytes(0.5) for _ in range(3)]
    assert len(set(clips)) == 3 and len(clips[0]) == 44 + 2 * 8000  # WAV header + 16 kHz PCM16


def test_every_text_id_of_the_8b_checkpoint_decodes_to_text(tmp_path):
    from tokenizers import Tokenizer

    from vllm_omni_speechlm.config import bagpiper_layout
    from vllm_omni_speechlm.make_tiny import write_released_tokenizer
    from vllm_omni_speechlm.tokenizer import decode_text

    layout = bagpiper_layout()
    write_released_tokenizer(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    lo, hi = layout.text_range
    assert all(decode_text(tok, [i], layout) for i in (lo + 65, lo + 5000, hi - 1))


def test_tiny_run_times_transcriptions_and_spoken_answers(tmp_path):
    out = tmp_path / "audio_in_load.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "audio_in_load.py"), "--tiny", "--out", str(out),
           "--workdir", str(tmp_path / "work"), "--concurrency", "2", "--audio-seconds", "1.5", "--gen-len", "30"]
    done = subprocess.run(cmd, cwd=ROOT, env=os.environ | {"PYTHONUNBUFFERED": "1"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    text, chat = report["transcription"]["2 audio=1.5s"], report["chat"]["2 audio=1.5s"]
    for level in (text, chat):
        assert level["errors"] == level["without_output"] == 0, level
        assert 0 < level["first_p50_s"] <= level["first_max_s"] and level["input_audio_s_per_wall_s"] > 0
    assert 0 < text["server"]["generation_tokens[0]"] <= 2 * report["settings"]["transcript_max_completion_tokens"]["1.5"]
    assert chat["audio_out_s_per_request"] > 0 and chat["completion_tokens_per_request"] >= 30
    assert report["first_requests"]["chat audio=1.5s"]["errors"] == 0
    assert "transcription" in done.stdout and "first p50" in done.stdout  # the table
