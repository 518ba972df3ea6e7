#!/bin/bash
# Session 2026-11-25b, call 2 (memory checks, concurrently): ZeRO-3 + optimizer offload 125M and ZeRO-3
# without offload (why the 1B ZeRO-3 + offload loss was NaN at step 1 in call 1), ZeRO-2 125M (the new
# host transport on CUDA, against 3.29 s/step before), and the 1B Hugging Face fine-tune with call 1's
# CubeCL cache (issue 16).
set -u
gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
W=/tmp/w2; mkdir -p $W; FINAL=$OUT
(cd /tmp && xz -dc $OLDPWD/.rcoa-cache-tgz/cubecl-caches.tar.xz | tar xf -); du -sh /tmp/c-hf /tmp/c-qlora > $W/restored.txt
(while true; do echo "$(date +%s),$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done) > $W/smi.csv &
SMI=$!
printf '#!/bin/sh\nif [ "$1" = run ]; then exec /tmp/rcoa "$@" --memory-pool compact; else exec /tmp/rcoa "$@"; fi\n' > /tmp/rcoa-compact; chmod +x /tmp/rcoa-compact
date +%T > $W/times.txt; P=()
( OUT=$W BIN=/tmp/rcoa-compact bash backend/bench/zero_ranks.sh backend/bench/llama125m_zero3_offload.plan 4 29500 470 > $W/A-z3off.txt 2>&1; echo "A $(date +%T)" >> $W/times.txt ) & P+=($!)
( OUT=$W BIN=/tmp/rcoa-compact bash backend/bench/zero_ranks.sh .gpu/l125_zero3_nooff.plan 4 29510 470 > $W/B-z3.txt 2>&1; echo "B $(date +%T)" >> $W/times.txt ) & P+=($!)
( OUT=$W BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh backend/bench/llama125m_zero2_bf16.plan 4 29520 470 > $W/C-z2.txt 2>&1; echo "C $(date +%T)" >> $W/times.txt ) & P+=($!)
( H=/tmp/hf1b
  python3 backend/bench/hf_finetune.py make $H > $W/hf-make.json 2> $W/hf-make.err; echo "hf-make rc=$? $(date +%T)" >> $W/times.txt
  RCOA_CACHE_DIR=/tmp/c-hf timeout 420 /tmp/rcoa run $H/finetune.plan --device cuda --memory-pool compact --data $H/train.jsonl --eval $H/eval.jsonl --eval-every 10 --steps 30 --save $H/saved --format json > $H/run.jsonl 2> $W/hf-run.err
  echo "hf-run rc=$? $(date +%T)" >> $W/times.txt; cp $H/run.jsonl $W/hf-run.jsonl; ls -la $H/saved > $W/hf-saved.txt 2>&1
  timeout 70 python3 backend/bench/hf_finetune.py check $H > $W/hf-check.json 2> $W/hf-check.err; echo "hf-check rc=$? $(date +%T)" >> $W/times.txt ) & P+=($!)
wait "${P[@]}"
kill $SMI
for f in $W/*.err; do cut -c1-600 $f > $f.x; mv $f.x $f; done
cd /tmp && tar czf $FINAL/call2.tgz w2
cat $W/restored.txt $W/times.txt $W/A-z3off.txt $W/B-z3.txt $W/C-z2.txt | cut -c1-400; grep -h "Task failed\|panicked" $W/*.err | sort | uniq -c | head -5 | cut -c1-500; tail -c 300 $W/hf-run.err; grep -v '"layer' $W/hf-run.jsonl | tail -4 | cut -c1-400; tail -c 1200 $W/hf-check.json; tail -c 300 $W/hf-check.err
