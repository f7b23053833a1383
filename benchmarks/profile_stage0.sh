#!/bin/bash
# py-spy profile of stage 0 during the 512-request decode of stage0_throughput.py (GPU host).
#   OUT=/some/dir bash benchmarks/profile_stage0.sh      (py-spy on PATH, or PYSPY_WHEEL=path)
# Writes $OUT/log.txt, $OUT/prof.txt (py-spy raw), $OUT/gpu_util.csv, $OUT/profile_summary.json.
# Settings: GEN (tokens per request, default 512), REPEATS (timed runs per concurrency, 1),
# DELAY (s after the 64-request run, 4), DUR (s, 6).
set -u
OUT=${OUT:?set OUT to a directory}
[[ -n ${PYSPY_WHEEL:-} ]] && pip install -q --no-deps "$PYSPY_WHEEL"
PYTHONUNBUFFERED=1 python3 benchmarks/stage0_throughput.py --out "$OUT/speech.json" --runs speech \
  --concurrency 64 512 --gen-len "${GEN:-512}" --repeats "${REPEATS:-1}" > "$OUT/log.txt" 2>&1 &
bench=$!
for _ in $(seq 1 600); do grep -q "concurrency   64" "$OUT/log.txt" && break; sleep 1; done
sleep "${DELAY:-4}"  # past the 512-request prefill
nvidia-smi --query-gpu=utilization.gpu --format=csv -lms 200 > "$OUT/gpu_util.csv" 2>&1 &
smi=$!
py-spy record --subprocesses --idle --threads --nonblocking -r 200 -d "${DUR:-6}" -f raw -o "$OUT/prof.txt" -p $bench
kill $smi
wait $bench
python3 benchmarks/profile_summary.py "$OUT/prof.txt" --out "$OUT/profile_summary.json"
