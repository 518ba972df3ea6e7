#!/bin/bash
# Issue 13's bars in one device call (about 9 minutes), with the linear layers on cuBLAS
# where its CUDA tests pass:
#
#  1. cuBLAS's CUDA tests (kernels::gemm::tests_cuda: 48 products, padded rows, an offset
#     operand, the stream order, and a whole training step's gradients against CubeCL's).
#     At most 75 s. If they pass, every step below runs with RCOA_MATMUL=cublas; if not,
#     on CubeCL's matmuls, and the log says so. Then the RoPE kernel's tests (at most 45 s);
#     if they fail, the steps below use Burn's composition (RCOA_ROPE=composite).
#  2. speed.py on the 350M and the 1.24B shapes at seq 2048, rcoa (flash attention) against
#     PyTorch eager with SDPA and torch.compile, in one run: tokens/s, peak and reserved
#     bytes (over the sampled peak and over the highest in use), MFU, and rcoa's first step
#     from an empty kernel cache. At most 330 s.
#  3. The 350M again, rcoa alone, in the cache step 2 filled: the first step from a warm
#     cache. At most 60 s.
#  4. Where the 350M's warm step goes (--profile-kernels, 4 steps). At most 40 s.
#
# Device tool: carry [".rcoa-bin"] (rcoa.gz and flash-tests.gz, built as docs/gpu-session.md
# says); call it as
#   OUT_DIR=$OUT; export OUT=/tmp/s; LIMIT=530 bash backend/bench/gpu_speed_call.sh;
#   tar czf $OUT_DIR/speed.tgz -C /tmp/s .; cp /tmp/s/steps.txt /tmp/s/speed.txt $OUT_DIR/
# with timeout_s about 570. DRY=1 checks the script on a CPU with this machine's release
# build (the tiny shape; no tests, no PyTorch needed beyond what speed.py's CPU check uses).
set -u
LIMIT=${LIMIT:-530}
source backend/bench/gpu_call_common.sh

# 1. cuBLAS's tests.
BLAS=0
if [ -f .rcoa-bin/flash-tests.gz ] && [ "$DEVICE" = cuda ]; then
  gunzip -c .rcoa-bin/flash-tests.gz > /tmp/flash-tests && chmod +x /tmp/flash-tests
  cublas_tests 1
  if [ $BLAS = 1 ]; then export RCOA_MATMUL=cublas; fi
  rope_tests 1b
fi
log "matmuls on ${RCOA_MATMUL:-cubecl}, RoPE ${RCOA_ROPE:-kernel}"

# 2. Both shapes, three engines, rcoa cold.
export RCOA_CACHE_DIR=/tmp/cache-speed-call
rm -rf "$RCOA_CACHE_DIR"
SHAPES=350m,1b; ENGINES=rcoa,eager,compile
if [ "${DRY:-0}" = 1 ]; then SHAPES=tiny; ENGINES=rcoa; fi
t=$(cap 330)
python3 $B/speed.py --rcoa "$RCOA" --device $DEVICE --shapes $SHAPES --steps 12 \
  --timeout $(( t / 4 > 60 ? t / 4 : 60 )) --engines $ENGINES --rcoa-attention flash \
  --out "$OUT/speed" > "$OUT/speed.txt" 2>&1
log "2 speed, $SHAPES, $ENGINES rc=$?"; cat "$OUT/speed.txt"
grep -h '"compiled_ahead"' "$OUT"/speed/*.jsonl 2>/dev/null | cut -c1-400

# 3. The 350M's first step from the warm cache.
t=$(cap 60)
if [ "$t" -ge 20 ]; then
  python3 $B/speed.py --rcoa "$RCOA" --device $DEVICE --shapes "${SHAPES%%,*}" --steps 4 \
    --timeout "$t" --engines rcoa --rcoa-attention flash --out "$OUT/speed-warm" \
    > "$OUT/speed-warm.txt" 2>&1
  log "3 warm rc=$?"; grep -A2 "engine" "$OUT/speed-warm.txt"
fi

# 4. Where the warm step goes.
profile_kernels 4 "$OUT/speed/speed-350m.plan" 40 profile 8
log "done"
