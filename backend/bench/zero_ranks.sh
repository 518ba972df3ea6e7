#!/bin/bash
# Two data-parallel ranks of PLAN as two `rcoa run --device cuda` processes sharing the
# device machine's one GPU over loopback (issue 11: ZeRO and offload on a GPU), beside
# the compiler's per-rank prediction. Usage, from the repository root:
#   BIN=/tmp/rcoa OUT=dir [DEVICE=cpu] bash backend/bench/zero_ranks.sh PLAN STEPS PORT [TIMEOUT_S]
# Writes $OUT/NAME-predicted.json (`rcoa compile --format json`), $OUT/NAME-rank{0,1}.jsonl
# and .err, and prints each rank's measured peak against its prediction. Each rank keeps
# its CubeCL kernel cache in $CACHE_ROOT/NAME-rank{0,1} (default /tmp/rcoa-caches), so the
# two cold processes never write one cache file at once.
set -u
PLAN=$1; STEPS=$2; PORT=$3; TMO=${4:-500}
NAME=$(basename "$PLAN" .plan)
OUT=${OUT:-/tmp/rcoa-out}; mkdir -p "$OUT"
BIN=${BIN:-/tmp/rcoa}
CACHE_ROOT=${CACHE_ROOT:-/tmp/rcoa-caches}
export CUDA_PATH=${CUDA_PATH:-/usr/local/cuda}
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
"$BIN" compile "$PLAN" --format json > "$OUT/$NAME-predicted.json" 2>&1
"$BIN" orchestrate --port "$PORT" --timeout "$((TMO + 30))" > "$OUT/$NAME-orchestrator.log" 2>&1 &
ORCH=$!
sleep 1
for r in 0 1; do
  RCOA_CACHE_DIR="$CACHE_ROOT/$NAME-rank$r" timeout "$TMO" "$BIN" run "$PLAN" --device "${DEVICE:-cuda}" --steps "$STEPS" \
    --format json --nodes 2 --node-rank $r --devices 1 --orchestrator 127.0.0.1:$PORT \
    --node-address 127.0.0.1:$((PORT + 1 + r)) --collective-timeout "$TMO" \
    > "$OUT/$NAME-rank$r.jsonl" 2> "$OUT/$NAME-rank$r.err" &
  PIDS[$r]=$!
done
for r in 0 1; do wait ${PIDS[$r]}; echo "$NAME rank $r: rc=$?"; done
kill $ORCH 2>/dev/null
python3 - "$OUT" "$NAME" <<'PY'
import json, sys
out, name = sys.argv[1:]
try:
    pred = json.load(open(f"{out}/{name}-predicted.json"))
    ranks = pred.get("parallel", {}).get("ranks", [])
    predicted = [r.get("peak_bytes") for r in ranks] or [pred.get("peak_bytes")]
except Exception as e:  # the compile failed: its output is in the file
    predicted = [None]
    print(f"{name}: no prediction ({e})")
for r in (0, 1):
    lines = [json.loads(l) for l in open(f"{out}/{name}-rank{r}.jsonl") if l.startswith("{")]
    s = next((l for l in lines if l.get("event") == "summary"), None)
    if s is None:
        print(f"{name} rank {r}: no summary"); continue
    m, p = s.get("measured_peak_bytes"), predicted[min(r, len(predicted) - 1)]
    err = f"{(m - p) / p:+.2%}" if m and p else "n/a"
    print(f"{name} rank {r}: measured {m} predicted {p} error {err} reserved {s.get('measured_reserved_bytes')} "
          f"first step {s.get('first_step_seconds')} s steady {s.get('steady_step_seconds')} s "
          f"checksum {s.get('param_checksum')} last loss {s.get('last_loss')}")
PY
tail -n 3 "$OUT/$NAME"-rank*.err | cut -c1-300
