#!/bin/bash
# The next GPU session's third call (docs/gpu-session.md, "Calls, in order", 1, after
# call1.sh): the two CUDA-only divergences rerun with collectives on the rank's stream,
# each as two processes with the compact pool: ZeRO-2 with bf16 weights past its step 3
# (an infinite loss at step 3 in 2026-11-25b), and the 1B ZeRO-3 with the optimizer
# offloaded (NaN at step 1), whose finite run is issue 11's bar (each rank within 5 %).
# About 9 minutes: the 1B's kernels compile cold, then about 15 s a step.
#
# Device tool: carry [".rcoa-bin"]. DRY=1 W=... OUT=... PLANS="plan:steps:port ..." runs
# small plans on the CPU with this machine's release build, to check the script.
set -u
W=${W:-/tmp/w3}; mkdir -p "$W"; FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
if [ "${DRY:-0}" = 1 ]; then
  DEVICE=cpu; RCOA=$(realpath "${BIN:-target/release/rcoa}"); POOL=""
else
  DEVICE=cuda; RCOA=/tmp/rcoa; POOL="--memory-pool compact"
  gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
  export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
fi
smi() { command -v nvidia-smi >/dev/null && nvidia-smi "$@"; }
(while true; do echo "$(date +%s),$(smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done) > "$W/smi.csv" 2>/dev/null &
SMI=$!
date +%T > "$W/times.txt"
printf '#!/bin/sh\nif [ "$1" = run ]; then exec %s "$@" %s; else exec %s "$@"; fi\n' "$RCOA" "$POOL" "$RCOA" > /tmp/rcoa-compact
chmod +x /tmp/rcoa-compact
PLANS=${PLANS:-backend/bench/llama125m_zero2_bf16.plan:6:29520 backend/bench/llama1b_zero3_offload.plan:3:29530}
P=()
for job in $PLANS; do
  IFS=: read -r plan steps port <<< "$job"
  name=$(basename "$plan" .plan)
  ( OUT=$W BIN=/tmp/rcoa-compact DEVICE=$DEVICE bash backend/bench/zero_ranks.sh "$plan" "$steps" "$port" 560 \
      > "$W/$name.txt" 2>&1
    echo "$name $(date +%T)" >> "$W/times.txt" ) & P+=($!)
done
wait "${P[@]}"
kill $SMI 2>/dev/null
for f in "$W"/*.err; do [ -f "$f" ] && cut -c1-600 "$f" > "$f.x" && mv "$f.x" "$f"; done
tar czf "$FINAL/call3.tgz" -C "$(dirname "$W")" "$(basename "$W")"
cat "$W/times.txt"
for job in $PLANS; do
  IFS=: read -r plan _ _ <<< "$job"
  name=$(basename "$plan" .plan)
  cut -c1-400 "$W/$name.txt"; grep -h '"loss"' "$W/$name"-rank0.jsonl | cut -c1-120
done
sort -t, -k2 -n "$W/smi.csv" | tail -1; ls -la "$FINAL"
