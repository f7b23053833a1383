#!/bin/bash
# py-spy profile of the engine core during a decode of stage0_throughput.py (GPU host): the
# second of two runs, 64 requests then CONC (default 512).
#   OUT=/some/dir bash benchmarks/profile_stage0.sh      (py-spy on PATH, or PYSPY_WHEEL=path)
# Writes $OUT/log.txt, $OUT/prof.txt (py-spy raw), $OUT/gpu_util.csv, $OUT/profile_summary.json;
# with GIL=1 then also $OUT/gil.txt and $OUT/gil_summary.json (which thread holds the GIL).
# Settings: RUNS (the engine: speech, omni-text or text; default speech), GEN (tokens per request,
# default 512), REPEATS (timed runs per concurrency, 1), DELAY (s after the 64-request run, 4),
# DUR (s per profile, 6), CONC (requests of the profiled run, 512).
set -u
OUT=${OUT:?set OUT to a directory}
[[ -n ${PYSPY_WHEEL:-} ]] && pip install -q --no-deps "$PYSPY_WHEEL"
DUR=${DUR:-6}
PYTHONUNBUFFERED=1 python3 benchmarks/stage0_throughput.py --out "$OUT/throughput.json" --runs "${RUNS:-speech}" \
  --concurrency 64 "${CONC:-512}" --gen-len "${GEN:-512}" --repeats "${REPEATS:-1}" > "$OUT/log.txt" 2>&1 &
bench=$!
for _ in $(seq 1 600); do grep -q "concurrency   64" "$OUT/log.txt" && break; kill -0 $bench 2>/dev/null || exit 1; sleep 1; done
sleep "${DELAY:-4}"  # past the profiled run's prefill
nvidia-smi --query-gpu=utilization.gpu --format=csv -lms 200 > "$OUT/gpu_util.csv" 2>&1 &
smi=$!
py-spy record --subprocesses --idle --threads --nonblocking -r 200 -d "$DUR" -f raw -o "$OUT/prof.txt" -p $bench
[[ ${GIL:-0} == 1 ]] && py-spy record --subprocesses --gil --threads --nonblocking -r 200 -d "$DUR" -f raw -o "$OUT/gil.txt" -p $bench
kill $smi
wait $bench
python3 benchmarks/profile_summary.py "$OUT/prof.txt" --out "$OUT/profile_summary.json"
[[ ${GIL:-0} == 1 ]] && python3 benchmarks/profile_summary.py "$OUT/gil.txt" --gil 200 "$DUR" --out "$OUT/gil_summary.json"
exit 0
