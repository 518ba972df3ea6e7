#!/bin/bash
# The next GPU session's QLoRA call (docs/gpu-session.md, "Calls, in order", 2): the two
# executor fixes of 2026-11-25c (frozen weights without an fp32 master, dropout keeping a
# 1-byte mask) measured on Mistral-7B's shape at 8 layers (2026-11-25b: +28.4 %; expected
# about +2.8 %), its second step's samples printed (RCOA_MEMORY_TRACE=1) to place the
# rest, and beside it the full 32-layer plan (issue 12's 24 GB check). Compact pool,
# 3 steps each (a peak needs two). The CubeCL cache of 2026-11-25b (`c-qlora`: the full
# plan's kernels) is restored first; the changed dropout compiles anew.
#
# Device tool: carry [".rcoa-bin", ".rcoa-cache-tgz"]. DRY=1 runs it on the CPU with this
# machine's release build and PLANS="plan ..." (small plans), to check the script.
set -u
W=${W:-/tmp/w2}; mkdir -p "$W"; FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
if [ "${DRY:-0}" = 1 ]; then
  DEVICE=cpu; RCOA=$(realpath "${BIN:-target/release/rcoa}"); POOL=()
else
  DEVICE=cuda; RCOA=/tmp/rcoa; POOL=(--memory-pool compact)
  gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
  export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  (cd /tmp && xz -dc "$OLDPWD/.rcoa-cache-tgz/cubecl-caches.tar.xz" | tar xf -)
fi
smi() { command -v nvidia-smi >/dev/null && nvidia-smi "$@"; }
(while true; do echo "$(date +%s),$(smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done) > "$W/smi.csv" 2>/dev/null &
SMI=$!
date +%T > "$W/times.txt"
PLANS=${PLANS:-backend/bench/h100-results/2026-11-25b/mistral7b_qlora_8l.plan backend/bench/mistral7b_qlora_burn.plan}
P=()
for plan in $PLANS; do
  name=$(basename "$plan" .plan)
  ( "$RCOA" compile "$plan" --format json > "$W/$name-predicted.json" 2>&1
    RCOA_MEMORY_TRACE=1 RCOA_CACHE_DIR=/tmp/c-qlora timeout 540 "$RCOA" run "$plan" --device $DEVICE "${POOL[@]}" \
      --steps 3 --format json > "$W/$name.jsonl" 2> "$W/$name.err"
    echo "$name rc=$? $(date +%T)" >> "$W/times.txt" ) & P+=($!)
done
wait "${P[@]}"
kill $SMI 2>/dev/null
tar czf "$FINAL/call2.tgz" -C "$(dirname "$W")" "$(basename "$W")"
if command -v xz >/dev/null; then z="xz -T0 -6"; else z="gzip"; fi
[ -d /tmp/c-qlora ] && (cd /tmp && tar cf - --exclude=driver-jit c-qlora | $z | split -b 15M - "$FINAL/cache-part-")
cat "$W/times.txt"
for plan in $PLANS; do
  name=$(basename "$plan" .plan)
  python3 - "$W/$name.jsonl" "$name" <<'PY'
import json, sys
path, name = sys.argv[1:]
lines = [json.loads(l) for l in open(path) if l.startswith("{")]
s = next((l for l in lines if l.get("event") == "summary"), None)
if s is None:
    print(f"{name}: no summary")
else:
    print(f"{name}: measured {s.get('measured_peak_bytes')} predicted {s.get('predicted_peak_bytes')} "
          f"error {s.get('peak_error')} reserved {s.get('measured_reserved_bytes')} "
          f"first step {s.get('first_step_seconds')} s steady {s.get('steady_step_seconds')} s "
          f"loss {s.get('first_loss')} -> {s.get('last_loss')}")
PY
  grep '^memory' "$W/$name.err" | sort -k3 -n | tail -3; grep -v '^memory' "$W/$name.err" | tail -n 3 | cut -c1-300
done
sort -t, -k2 -n "$W/smi.csv" | tail -1; ls -la "$FINAL"
