#!/bin/bash
# Call 2: rcoa on CUDA, every run cold and concurrent (separate kernel caches):
# ZeRO-3 + optimizer offload 1B on two processes (issue 11), ZeRO-2 then ZeRO-1 bf16+master 125M on two
# processes, QLoRA mistral-7b under burn (issue 12), the speed benchmark's 350M with the compact pool
# (issue 13; its cache is packed for call 3), and the flash kernels' CUDA tests + tiny flash/eager.
set -u
gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
gunzip -c .rcoa-bin/flash-tests.gz > /tmp/flash-tests && chmod +x /tmp/flash-tests
printf '#!/bin/sh\nexec /tmp/rcoa "$@" --memory-pool compact\n' > /tmp/rcoa-compact && chmod +x /tmp/rcoa-compact
export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-} PYTHONUNBUFFERED=1
W=/tmp/w2; mkdir -p $W; FINAL=$OUT
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > $W/gpu.txt
(while true; do echo "$(date +%s),$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 1; done) > $W/smi.csv &
SMI=$!
date +%T > $W/times.txt
P=()
( OUT=$W BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh backend/bench/llama1b_zero3_offload.plan 3 29500 490 > $W/A-zero3.txt 2>&1; echo "A $(date +%T)" >> $W/times.txt ) & P+=($!)
( RCOA_CACHE_DIR=/tmp/c-qlora timeout 490 /tmp/rcoa run backend/bench/mistral7b_qlora_burn.plan --device cuda --steps 2 --format json > $W/qlora.jsonl 2> $W/qlora.err; echo "B rc=$? $(date +%T)" >> $W/times.txt ) & P+=($!)
( OUT=$W BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh backend/bench/llama125m_zero2_bf16.plan 5 29510 330 > $W/C-zero2.txt 2>&1
  for r in 0 1; do cp -r /tmp/rcoa-caches/llama125m_zero2_bf16-rank0 /tmp/rcoa-caches/llama125m_zero1_bf16-rank$r; done
  OUT=$W BIN=/tmp/rcoa bash backend/bench/zero_ranks.sh backend/bench/llama125m_zero1_bf16.plan 5 29520 150 > $W/C-zero1.txt 2>&1; echo "C $(date +%T)" >> $W/times.txt ) & P+=($!)
( RCOA_CACHE_DIR=/tmp/c-350 python3 backend/bench/speed.py --rcoa /tmp/rcoa-compact --shapes 350m --steps 8 --engines rcoa --timeout 490 --out $W/speed350-compact > $W/E-speed350.txt 2>&1; echo "E $(date +%T)" >> $W/times.txt ) & P+=($!)
( timeout 200 /tmp/flash-tests tests_kernels::cuda --test-threads 1 > $W/flash-tests.txt 2>&1; echo "D rc=$? $(date +%T)" >> $W/times.txt
  for a in eager flash; do RCOA_CACHE_DIR=/tmp/c-tiny python3 backend/bench/speed.py --rcoa /tmp/rcoa --shapes tiny --steps 20 --engines rcoa --rcoa-attention $a --timeout 150 --out $W/flash-$a > $W/D-tiny-$a.txt 2>&1; done; echo "D2 $(date +%T)" >> $W/times.txt ) & P+=($!)
wait "${P[@]}"
kill $SMI
cd /tmp && tar czf $FINAL/call2.tgz w2 && tar czf - c-350 | split -b 15M - $FINAL/cache-part-
ls -la $FINAL; cat $W/times.txt; cat $W/A-zero3.txt $W/C-zero2.txt $W/C-zero1.txt $W/E-speed350.txt | cut -c1-400; tail -5 $W/flash-tests.txt; tail -3 $W/qlora.err; tail -c 600 $W/qlora.jsonl
