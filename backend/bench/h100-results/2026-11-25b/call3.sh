#!/bin/bash
# Session 2026-11-25b, call 3 (memory checks, concurrently, compact pool): QLoRA Mistral-7B's shape at 8
# layers with call 1's CubeCL cache (issue 12); why the 1B ZeRO-3 + offload loss was NaN at step 1:
# the same 1B alone (no ZeRO), and ZeRO-3 without offload (issue 11).
set -u
gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
W=/tmp/w3; mkdir -p $W; FINAL=$OUT
(cd /tmp && xz -dc $OLDPWD/.rcoa-cache-tgz/cubecl-caches.tar.xz | tar xf -)
(while true; do echo "$(date +%s),$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done) > $W/smi.csv &
SMI=$!
printf '#!/bin/sh\nif [ "$1" = run ]; then exec /tmp/rcoa "$@" --memory-pool compact; else exec /tmp/rcoa "$@"; fi\n' > /tmp/rcoa-compact; chmod +x /tmp/rcoa-compact
date +%T > $W/times.txt; P=()
( /tmp/rcoa compile .gpu/mistral7b_qlora_8l.plan --format json > $W/qlora8-predicted.json 2>&1
  RCOA_CACHE_DIR=/tmp/c-qlora timeout 530 /tmp/rcoa run .gpu/mistral7b_qlora_8l.plan --device cuda --memory-pool compact --steps 3 --format json > $W/qlora8.jsonl 2> $W/qlora8.err; echo "qlora8 rc=$? $(date +%T)" >> $W/times.txt ) & P+=($!)
( /tmp/rcoa compile .gpu/l1b_v1_single.plan --format json > $W/v1-predicted.json 2>&1
  RCOA_CACHE_DIR=/tmp/c-v1 timeout 530 /tmp/rcoa run .gpu/l1b_v1_single.plan --device cuda --memory-pool compact --steps 1 --format json > $W/v1.jsonl 2> $W/v1.err; echo "v1 rc=$? $(date +%T)" >> $W/times.txt ) & P+=($!)
( OUT=$W BIN=/tmp/rcoa-compact bash backend/bench/zero_ranks.sh .gpu/l1b_v2_zero3.plan 1 29500 530 > $W/v2.txt 2>&1; echo "v2 $(date +%T)" >> $W/times.txt ) & P+=($!)
wait "${P[@]}"
kill $SMI
for f in $W/*.err; do cut -c1-600 $f > $f.x; mv $f.x $f; done
cd /tmp && tar czf $FINAL/call3.tgz w3
cat $W/times.txt $W/v2.txt | cut -c1-400; for f in qlora8 v1; do echo "== $f"; tail -c 400 $W/$f.err; grep -v '"layer' $W/$f.jsonl | tail -3 | cut -c1-700; done; grep -o '"peak_bytes":[0-9]*' $W/qlora8-predicted.json $W/v1-predicted.json | head -3
