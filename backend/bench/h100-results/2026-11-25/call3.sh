#!/bin/bash
# Call 3: ZeRO-3 + optimizer offload and ZeRO-2 on a 125M decoder, two processes each (issue 11);
# QLoRA mistral-7b alone with a longer limit (issue 12); where the 1B ZeRO-3 setup error comes from.
set -u
gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
W=/tmp/w3; mkdir -p $W/diag; FINAL=$OUT
(while true; do echo "$(date +%s),$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done) > $W/smi.csv &
SMI=$!
date +%T > $W/times.txt; P=()
( OUT=$W BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh backend/bench/llama125m_zero3_offload.plan 4 29500 535 > $W/J1-zero3.txt 2>&1; echo "J1 $(date +%T)" >> $W/times.txt ) & P+=($!)
( OUT=$W BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh backend/bench/llama125m_zero2_bf16.plan 4 29510 535 > $W/J2-zero2.txt 2>&1; echo "J2 $(date +%T)" >> $W/times.txt ) & P+=($!)
( RCOA_CACHE_DIR=/tmp/c-qlora timeout 540 /tmp/rcoa run backend/bench/mistral7b_qlora_burn.plan --device cuda --steps 2 --format json > $W/qlora.jsonl 2> $W/qlora.err; echo "J3 rc=$? $(date +%T)" >> $W/times.txt ) & P+=($!)
( D=$W/diag
  RCOA_CACHE_DIR=/tmp/c-d1 timeout 40 /tmp/rcoa run .gpu/l1b_single.plan --device cuda --steps 1 --format json > $D/single.jsonl 2> $D/single.err; echo "single rc=$?" >> $D/rc.txt
  CUDA_LAUNCH_BLOCKING=1 RUST_BACKTRACE=1 OUT=$D BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh backend/bench/llama1b_zero3_offload.plan 1 29520 60 > $D/zero3off.txt 2>&1
  OUT=$D BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh .gpu/l1b_zero3_nooff.plan 1 29530 45 > $D/zero3.txt 2>&1
  OUT=$D BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh .gpu/l1b_zero2.plan 1 29540 45 > $D/zero2.txt 2>&1
  echo "diag $(date +%T)" >> $W/times.txt ) & P+=($!)
wait "${P[@]}"
kill $SMI
for f in $W/diag/*.err; do grep -v "Task failed" $f > $f.x; mv $f.x $f; done
cd /tmp && tar czf $FINAL/call3.tgz w3; cat $W/times.txt $W/diag/rc.txt $W/J1-zero3.txt $W/J2-zero2.txt | cut -c1-400; for f in $W/diag/*.err; do echo "== $f"; head -c 700 $f; done; grep -v "Task failed" $W/qlora.err | tail -5; tail -c 800 $W/qlora.jsonl
