#!/bin/bash
# Session 2026-11-25b, call 1: transport bench alone; then, concurrently (memory checks only):
# ZeRO-3 + optimizer offload 125M and 1B (issue 11), ZeRO-2 125M with the compact pool, QLoRA
# Mistral-7B warm-up (issue 12, cache packed for call 2), and a 1B Hugging Face fine-tune
# (issue 16) checked with transformers.
set -u
gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
gunzip -c .rcoa-bin/transport.gz > /tmp/transport && chmod +x /tmp/transport
export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
W=/tmp/w1; mkdir -p $W; FINAL=$OUT
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; free -g; } > $W/gpu.txt
(while true; do echo "$(date +%s),$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done) > $W/smi.csv &
SMI=$!
date +%T > $W/times.txt
timeout 60 /tmp/transport 16 256 > $W/transport.txt 2>&1; echo "transport rc=$? $(date +%T)" >> $W/times.txt
printf '#!/bin/sh\nif [ "$1" = run ]; then exec /tmp/rcoa "$@" --memory-pool compact; else exec /tmp/rcoa "$@"; fi\n' > /tmp/rcoa-compact; chmod +x /tmp/rcoa-compact
P=()
( OUT=$W BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh backend/bench/llama125m_zero3_offload.plan 4 29500 490 > $W/Z3-125m.txt 2>&1; echo "Z3-125m $(date +%T)" >> $W/times.txt ) & P+=($!)
( OUT=$W BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh backend/bench/llama1b_zero3_offload.plan 3 29510 490 > $W/Z3-1b.txt 2>&1; echo "Z3-1b $(date +%T)" >> $W/times.txt ) & P+=($!)
( OUT=$W BIN=/tmp/rcoa-compact bash backend/bench/zero_ranks.sh backend/bench/llama125m_zero2_bf16.plan 4 29520 490 > $W/Z2-compact.txt 2>&1; echo "Z2-compact $(date +%T)" >> $W/times.txt ) & P+=($!)
( RCOA_CACHE_DIR=/tmp/c-qlora timeout 490 /tmp/rcoa warmup backend/bench/mistral7b_qlora_burn.plan --device cuda > $W/qlora-warmup.txt 2> $W/qlora-warmup.err; echo "qlora-warmup rc=$? $(date +%T)" >> $W/times.txt ) & P+=($!)
( H=/tmp/hf1b
  python3 backend/bench/hf_finetune.py make $H > $W/hf-make.json 2> $W/hf-make.err; echo "hf-make rc=$? $(date +%T)" >> $W/times.txt
  RCOA_CACHE_DIR=/tmp/c-hf timeout 420 /tmp/rcoa run $H/finetune.plan --device cuda --data $H/train.jsonl --eval $H/eval.jsonl --eval-every 10 --steps 30 --save $H/saved --format json > $H/run.jsonl 2> $W/hf-run.err
  echo "hf-run rc=$? $(date +%T)" >> $W/times.txt; cp $H/run.jsonl $W/hf-run.jsonl; cp $H/finetune.plan $W/
  timeout 60 python3 backend/bench/hf_finetune.py check $H > $W/hf-check.json 2> $W/hf-check.err; echo "hf-check rc=$? $(date +%T)" >> $W/times.txt ) & P+=($!)
wait "${P[@]}"
kill $SMI
for f in $W/*.err; do grep -v "Task failed" $f > $f.x; mv $f.x $f; done
cd /tmp && tar czf $FINAL/call1.tgz w1
if command -v xz >/dev/null; then z="xz -T0 -6"; else z="gzip"; fi
tar cf - c-qlora c-hf 2>/dev/null | $z | split -b 15M - "$FINAL/cache-part-"
cat $W/times.txt $W/transport.txt $W/Z3-125m.txt $W/Z3-1b.txt $W/Z2-compact.txt | cut -c1-400; tail -c 600 $W/qlora-warmup.txt; tail -c 400 $W/qlora-warmup.err; cat $W/hf-make.json; tail -c 300 $W/hf-run.err; tail -c 1500 $W/hf-check.json; tail -c 300 $W/hf-check.err; du -sh /tmp/c-qlora /tmp/c-hf; ls -la $FINAL
