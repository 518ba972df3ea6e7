#!/bin/bash
# Multi-process data parallelism on CUDA, on the device machine (one GPU): rcoa
# orchestrate plus two `rcoa run --device cuda` ranks of backend/bench/tiny_dp2.plan on
# GPU 0 over loopback, beside one process training plans/tiny-cpu.plan (the same global
# batch). Prints both loss curves, the largest difference and the parameter checksums;
# then what `--devices 2` says on a machine with one GPU.
set -u
export CUDA_PATH=/usr/local/cuda
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
OUT=${OUT:-/tmp/rcoa-out}; mkdir -p "$OUT"
BIN=${BIN:-.rcoa-bin/rcoa}
if [ ! -x "$BIN" ] && [ -f "$BIN.gz" ]; then gunzip -c "$BIN.gz" > /tmp/rcoa-bench && chmod +x /tmp/rcoa-bench && BIN=/tmp/rcoa-bench; fi
if ls .rcoa-cache-tgz/part-* >/dev/null 2>&1; then
  # xz (packed below where the machine has it) or gzip, told apart by the first bytes.
  if head -c 6 "$(ls .rcoa-cache-tgz/part-* | head -1)" | grep -q 7zXZ; then unz="xz -dc"; else unz="gzip -dc"; fi
  cat .rcoa-cache-tgz/part-* | $unz | tar xf - ; fi
STEPS=${1:-20}
run() { RCOA_CACHE_DIR=$PWD/.rcoa-cache timeout 400 "$BIN" run "$@" --device cuda --steps "$STEPS" --format json; }
run plans/tiny-cpu.plan > "$OUT/dp-single.jsonl" 2> "$OUT/dp-single.err"; echo "single: rc=$?"
"$BIN" orchestrate --port 29500 --timeout 420 > "$OUT/dp-orchestrator.log" 2>&1 &
ORCH=$!
sleep 1
for r in 0 1; do
  run backend/bench/tiny_dp2.plan --nodes 2 --node-rank $r --orchestrator 127.0.0.1:29500 \
    --node-address 127.0.0.1:$((29600 + r)) > "$OUT/dp-rank$r.jsonl" 2> "$OUT/dp-rank$r.err" &
  PIDS[$r]=$!
done
for r in 0 1; do wait ${PIDS[$r]}; echo "rank $r: rc=$?"; done
kill $ORCH 2>/dev/null
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def read(name):
    lines = [json.loads(l) for l in open(f"{out}/{name}.jsonl") if l.startswith("{")]
    return [l["loss"] for l in lines if "step" in l and "loss" in l], next((l for l in lines if l.get("event") == "summary"), {})
one, s1 = read("dp-single")
r0, s0 = read("dp-rank0")
r1, sr1 = read("dp-rank1")
print("single :", [round(x, 5) for x in one])
print("rank 0 :", [round(x, 5) for x in r0])
print("rank 1 :", [round(x, 5) for x in r1])
n = min(len(one), len(r0), len(r1))
if n:
    print(f"max |rank0 - single| over {n} steps: {max(abs(a - b) for a, b in zip(one, r0)):.2e}; max |rank0 - rank1|: {max(abs(a - b) for a, b in zip(r0, r1)):.2e}")
print("checksums: single", s1.get("param_checksum"), "rank0", s0.get("param_checksum"), "rank1", sr1.get("param_checksum"))
print("step seconds (median): single", s1.get("steady_step_seconds"), "rank0", s0.get("steady_step_seconds"))
PY
tail -n 3 "$OUT"/dp-rank*.err "$OUT/dp-single.err" 2>/dev/null | cut -c1-300
echo "--- --devices 2 on this machine:"
RCOA_CACHE_DIR=$PWD/.rcoa-cache timeout 120 "$BIN" run backend/bench/tiny_dp2.plan --devices 2 --device cuda --steps 2; echo "rc=$?"
