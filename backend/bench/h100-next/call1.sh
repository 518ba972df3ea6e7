#!/bin/bash
# The next GPU session's first call (docs/gpu-session.md, "Calls, in order", 1): the
# streams fix of 2026-11-25c measured. The CUDA transport benchmark (bf16, then fp32: a
# panic "... the result is off by ..." places the ZeRO-2 bf16 fault in the ring); then
# both 125M ZeRO-3 plans at once, two processes each, compact pool, 4 steps, with
# nvidia-smi's total and per-process memory beside them (the probe now sees the gathered
# units: expected 4.59 GB in use with the optimizer offloaded, 5.12 GB without); their
# CubeCL caches packed for the calls after. About 8 minutes, most of it the cold first step.
#
# Device tool: carry [".rcoa-bin"] (rcoa.gz and transport-cuda.gz: docs/gpu-session.md).
# DRY=1 runs the same steps on the CPU with this machine's release build and no
# transport benchmark, to check the script (BIN=target/release/rcoa; PLANS="plan:port ..."
# for plans small enough for a CPU).
set -u
W=${W:-/tmp/w1}; mkdir -p "$W"; FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
if [ "${DRY:-0}" = 1 ]; then
  DEVICE=cpu; RCOA=$(realpath "${BIN:-target/release/rcoa}")
else
  DEVICE=cuda; RCOA=/tmp/rcoa
  gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
  gunzip -c .rcoa-bin/transport-cuda.gz > /tmp/transport-cuda && chmod +x /tmp/transport-cuda
  export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
fi
smi() { command -v nvidia-smi >/dev/null && nvidia-smi "$@"; }
{ smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; free -g; } > "$W/gpu.txt" 2>&1
(while true; do echo "$(date +%s),$(smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done) > "$W/smi.csv" 2>/dev/null &
SMI=$!
(while true; do smi --query-compute-apps=pid,used_memory --format=csv,noheader | sed "s/^/$(date +%s),/"; sleep 5; done) > "$W/apps.csv" 2>/dev/null &
APPS=$!
date +%T > "$W/times.txt"
if [ "$DEVICE" = cuda ]; then
  timeout 90 /tmp/transport-cuda 16 256 --cuda --bf16 > "$W/transport-cuda-bf16.txt" 2>&1; echo "transport bf16 rc=$? $(date +%T)" >> "$W/times.txt"
  timeout 90 /tmp/transport-cuda 16 256 --cuda > "$W/transport-cuda.txt" 2>&1; echo "transport fp32 rc=$? $(date +%T)" >> "$W/times.txt"
fi
# `rcoa run` with the compact pool (a CUDA setting: not in the dry run); other
# subcommands (the orchestrator) as they are.
POOL="--memory-pool compact"; [ "$DEVICE" = cpu ] && POOL=""
printf '#!/bin/sh\nif [ "$1" = run ]; then exec %s "$@" %s; else exec %s "$@"; fi\n' "$RCOA" "$POOL" "$RCOA" > /tmp/rcoa-compact
chmod +x /tmp/rcoa-compact
export CACHE_ROOT=/tmp/rcoa-caches
P=()
PLANS=${PLANS:-backend/bench/llama125m_zero3_offload.plan:29500 backend/bench/h100-results/2026-11-25b/l125_zero3_nooff.plan:29510}
for job in $PLANS; do
  set -- "${job%%:*}" "${job##*:}"
  ( OUT=$W BIN=/tmp/rcoa-compact DEVICE=$DEVICE bash backend/bench/zero_ranks.sh "$1" 4 "$2" 520 \
      > "$W/$(basename "$1" .plan).txt" 2>&1
    echo "$(basename "$1" .plan) $(date +%T)" >> "$W/times.txt" ) & P+=($!)
done
wait "${P[@]}"
kill $SMI $APPS 2>/dev/null
for f in "$W"/*.err; do [ -f "$f" ] && cut -c1-600 "$f" > "$f.x" && mv "$f.x" "$f"; done
tar czf "$FINAL/call1.tgz" -C "$(dirname "$W")" "$(basename "$W")"
# Only CubeCL's own cache (<gpu>-driver<version>/), not the driver's JIT cache.
if command -v xz >/dev/null; then z="xz -T0 -6"; else z="gzip"; fi
(cd "$CACHE_ROOT" 2>/dev/null && tar cf - --exclude=driver-jit . | $z | split -b 15M - "$FINAL/cache-part-")
cat "$W/times.txt"; tail -n 4 "$W"/transport-cuda*.txt 2>/dev/null | cut -c1-300
for job in $PLANS; do j=${job%%:*}; cut -c1-400 "$W/$(basename "$j" .plan).txt"; done
sort -t, -k2 -n "$W/smi.csv" | tail -1; tail -n 8 "$W/apps.csv"; ls -la "$FINAL"
