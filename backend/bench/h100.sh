#!/bin/bash
# Runs `rcoa run --device cuda` on the plans named, on the device machine,
# from the repository root. Each argument is NAME:STEPS:TIMEOUT_S[:TAG]; the
# plan is backend/bench/NAME.json, or backend/bench/NAME.plan when NAME ends in .plan. Per run: the JSON lines in $OUT/NAME-TAG.jsonl,
# stderr in .err; nvidia-smi's memory.used is sampled every 0.5 s into
# $OUT/smi.csv (driver view: includes the CUDA context and CubeCL's pools).
# The CubeCL kernel/autotune cache lives in .rcoa-cache; if a previous call
# carried it back as .rcoa-cache-tgz/part-*, it is restored first, and it is
# packed into $OUT/cache-part-* at the end (xz, else gzip; 15 MB pieces) to carry to the next call.
set -u
export CUDA_PATH=/usr/local/cuda
export LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
export RCOA_CACHE_DIR=$PWD/.rcoa-cache
OUT=${OUT:-/tmp/rcoa-out}; mkdir -p "$OUT"
BIN=${BIN:-.rcoa-bin/rcoa}
# A stripped, gzipped binary (11 MB instead of 55) fits the device tool's carry limit.
if [ ! -x "$BIN" ] && [ -f "$BIN.gz" ]; then gunzip -c "$BIN.gz" > /tmp/rcoa-bench && chmod +x /tmp/rcoa-bench && BIN=/tmp/rcoa-bench; fi
if ls .rcoa-cache-tgz/part-* >/dev/null 2>&1; then
  # xz (packed below where the machine has it) or gzip, told apart by the first bytes.
  if head -c 6 "$(ls .rcoa-cache-tgz/part-* | head -1)" | grep -q 7zXZ; then unz="xz -dc"; else unz="gzip -dc"; fi
  cat .rcoa-cache-tgz/part-* | $unz | tar xf - ; echo "cache restored: $(du -sh .rcoa-cache | cut -f1)"; fi
nvidia-smi --query-gpu=name,driver_version,memory.total,memory.used --format=csv,noheader
(while true; do echo "$(date +%s.%N),$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 0.5; done) > "$OUT/smi.csv" &
SMI=$!
for spec in "$@"; do
  IFS=: read -r name steps tmo tag <<< "$spec"
  tag=${tag:-run}
  echo "=== $name ($tag) steps=$steps $(date +%T)"
  t0=$(date +%s.%N)
  # NAME.plan runs the .plan (compiled here, so the prediction is reported); NAME the .json.
  case "$name" in *.plan) src=("backend/bench/$name") ;; *) src=(--lowered "backend/bench/$name.json") ;; esac
  timeout "$tmo" "$BIN" run "${src[@]}" --device cuda --steps "$steps" --format json > "$OUT/$name-$tag.jsonl" 2> "$OUT/$name-$tag.err"
  rc=$?
  [ -s "$OUT/$name-$tag.err" ] || rm -f "$OUT/$name-$tag.err"
  echo "nvidia-smi max memory.used during the run: $(python3 -c "
import sys
m=[int(l.split(',')[1]) for l in open('$OUT/smi.csv') if l.count(',')==1 and l.split(',')[1].strip().isdigit() and float(l.split(',')[0])>=$t0]
print(max(m) if m else 'n/a', 'MiB')")"
  echo "rc=$rc wall=$(python3 -c "import time;print(round(time.time()-$t0,1))")s"
  grep -h '"step"' "$OUT/$name-$tag.jsonl" | head -3 | cut -c1-200
  tail -n1 "$OUT/$name-$tag.jsonl" | cut -c1-600
  tail -n4 "$OUT/$name-$tag.err" | cut -c1-400
done
kill $SMI
rm -f "$OUT/smi.csv"
echo "cache: $(du -sh .rcoa-cache 2>/dev/null | cut -f1)"
# xz packs the PTX text under half as large as gzip: 290 MB of a 350M plan's cache took
# 63 MB gzipped, 23 MB with xz -9 (the whole cache gzipped, 70 MB, was more than one
# device call returns: 64 MiB).
if command -v xz >/dev/null; then z="xz -T0 -6"; else z="gzip"; fi
tar cf - .rcoa-cache 2>/dev/null | $z | split -b 15M - "$OUT/cache-part-"
ls -la "$OUT"
