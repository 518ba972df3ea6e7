#!/bin/bash
# A short device call (about 7 minutes) after a change to the flash kernels or the pools, for
# a session's second call once gpu_one_call.sh has run. Each step is capped so that the whole
# ends within LIMIT seconds (default 400) and writes under $OUT as it finishes:
#
#  0. `--memory-pool expandable` beside pinned host memory (llama125m_activation_offload.plan,
#     4 steps, cold), in the background from the start beside step 1 (which times nothing)
#     and waited for before anything is timed. At most 150 s.
#  1. The tensor-core flash tests and the block products alone (tests_mma), cuBLAS's
#     products (kernels::gemm::tests_cuda, a whole training step's gradients among them)
#     and the embedding gradient's kernel (kernels::embedding::fused::tests_cuda). At most
#     90 s, 75 s and 20 s.
#     If they fail, the speed run takes the Rows kernels. Then the register kernels
#     (forward_registers, backward_registers; the default since 2026-11-30h, where steps 3
#     and 4 run them in the directions whose tests pass) and the probes under them (manual
#     MMA, ldmatrix), at most 60 s; the same copying blocks ahead, at most 60 s (35 s ran
#     out compiling on 2026-11-30h); the register backward in one pass, at most 45 s; the
#     block kernels' trial settings (four units a row, 2 x 2 tiles), at most 30 s.
#  2. The kernels alone (.rcoa-bin/flash-bench.gz): Rows against tensor cores, whose
#     backward runs in two passes and in one (dQ added atomically), and the register
#     kernels (one block at a time, then copied ahead; the backward in two passes, then in
#     one), with the millisecond and TFLOP/s of each. At most 80 s.
#  2b. The compile phase alone on the host's cores (.rcoa-bin/compile-phase-bench.gz): NVRTC in
#     threads against worker processes, 48 kernels, twice each. At most 60 s.
#  3. Issue 13's 350M shape from an empty kernel cache (speed.py, 12 steps): the cold first
#     step and its parts (the `compiled_ahead` line: recording, compiling in worker
#     processes, against 2026-11-28f's 91.0 s on 16 threads; then the first
#     step), tokens/s, and the pool's reserved bytes under the default pools and the default
#     one-pass backward. At most 200 s.
#  3a. The linear layers' products on CubeCL against cuBLAS (.rcoa-bin/gemm-bench.gz), in
#     step 3's kernel cache, if step 1's cuBLAS tests passed. At most 60 s.
#  3c. The embedding gradient alone (.rcoa-bin/embedding-bench.gz): Burn's select_assign
#     against kernels::embedding. At most 20 s.
#  3b. The same cold run with the linear layers on cuBLAS (RCOA_MATMUL=cublas, its own empty
#     cache), if step 1's cuBLAS tests passed: tokens/s and the cold start without CubeCL's
#     matmul kernels to compile. At most 150 s.
#  4. Where the warm step's time goes (--profile-kernels, 4 steps), CubeCL's matmuls then
#     cuBLAS's, then (4c) the register kernels copying blocks ahead if those tests passed,
#     and (4d) the block kernels (RCOA_FLASH_REGISTERS=0) for the ratio. At most 40 s each.
#  5. Nsight Compute on each tensor-core flash kernel's first launch in the bench (speed of
#     light, memory, occupancy, warp stalls), if `ncu` is there. At most 60 s each. (Its
#     2026-11-28f run matched no kernel: it asked for the Rust type names.)
#
# Keep what comes back to 8 files: call it as
#   OUT_DIR=$OUT; export OUT=/tmp/o; bash backend/bench/gpu_flash_call.sh;
#   tar czf $OUT_DIR/all.tgz -C /tmp/o .; cp /tmp/o/steps.txt $OUT_DIR/
# Device tool: carry [".rcoa-bin"] (rcoa.gz, flash-tests.gz, flash-bench.gz, gemm-bench.gz,
# embedding-bench.gz, compile-phase-bench.gz, built as
# docs/gpu-session.md says). DRY=1 checks the script on a CPU with this machine's release build.
set -u
LIMIT=${LIMIT:-400}
source backend/bench/gpu_call_common.sh

# 0. expandable beside pinned host memory, in the background.
start_expandable_jobs 150

# 1. The tensor-core kernels.
TC=0; BLAS=0
if [ -f .rcoa-bin/flash-tests.gz ] && [ "$DEVICE" = cuda ]; then
  gunzip -c .rcoa-bin/flash-tests.gz > /tmp/flash-tests && chmod +x /tmp/flash-tests
  timeout "$(cap 90)" /tmp/flash-tests tests_kernels::cuda::tensor_cores tests_mma::cuda \
    --test-threads 1 --nocapture > "$OUT/flash-tests.txt" 2>&1
  rc=$?
  log "1 tensor-core flash tests rc=$rc"; grep "test result" "$OUT/flash-tests.txt"
  if [ $rc = 0 ] && ! grep -q SKIPPED "$OUT/flash-tests.txt"; then TC=1; fi
  # cuBLAS's products (RCOA_MATMUL=cublas): step 3b runs only if they pass.
  cublas_tests 1
  # The embedding gradient's kernel against Burn's (the default on CUDA since 2026-11-29b).
  RCOA_REQUIRE=cuda timeout "$(cap 20)" /tmp/flash-tests kernels::embedding::fused::tests_cuda \
    --test-threads 1 > "$OUT/embedding-tests.txt" 2>&1
  log "1 embedding gradient tests rc=$?"; grep "test result\|panicked" "$OUT/embedding-tests.txt" | head -n 3
  # The register kernels (RCOA_FLASH_REGISTERS, FlashAttention-2's structure: step 2 times
  # them, step 4c runs the step with those that pass), with the probes they rest on: CubeCL's
  # manual MMA (register fragments) and ldmatrix. About 26 kernels to compile (45 s or so).
  timeout "$(cap 60)" /tmp/flash-tests tests_manual_mma::cuda fragments::tests::register_load \
    registers::tests::cuda::register_fragments --test-threads 1 > "$OUT/flash-trials.txt" 2>&1
  log "1 register kernels' tests rc=$?"; grep "test result\|panicked" "$OUT/flash-trials.txt" | head -n 4
  # The same with the other side's blocks copied a block ahead (bf16; 12 kernels).
  timeout "$(cap 60)" /tmp/flash-tests registers::tests::cuda::copied_ahead --test-threads 1 \
    >> "$OUT/flash-trials.txt" 2>&1
  log "1 register kernels copied ahead rc=$?"; grep "test result\|panicked" "$OUT/flash-trials.txt" | tail -n 2
  # The register backward in one pass (dQ added atomically; one block at a time and copied
  # ahead, bf16; about 16 kernels).
  timeout "$(cap 45)" /tmp/flash-tests backward_registers::tests::cuda::one_pass \
    --test-threads 1 >> "$OUT/flash-trials.txt" 2>&1
  log "1 register backward in one pass rc=$?"; grep "test result\|panicked" "$OUT/flash-trials.txt" | tail -n 2
  # The block kernels' settings under trial (4 units a row, 2 x 2 tiles): right or not, the
  # default runs. (Step 1 overlaps step 0's background run, which takes about 150 s.)
  timeout "$(cap 30)" /tmp/flash-tests tests_kernels::cuda::tensor_core_trials \
    tests_mma::trials_cuda --test-threads 1 >> "$OUT/flash-trials.txt" 2>&1
  log "1 trial settings' tests rc=$?"; grep "test result\|panicked" "$OUT/flash-trials.txt" | tail -n 2
else
  log "1 flash tests skipped (no .rcoa-bin/flash-tests.gz, or not on CUDA)"
fi

wait_expandable_jobs

# 2. The kernels alone.
if [ -f .rcoa-bin/flash-bench.gz ] && [ "$DEVICE" = cuda ]; then
  gunzip -c .rcoa-bin/flash-bench.gz > /tmp/flash-bench && chmod +x /tmp/flash-bench
  timeout "$(cap 80)" /tmp/flash-bench > "$OUT/flash-bench.txt" 2>&1
  log "2 flash bench rc=$?"; cat "$OUT/flash-bench.txt"
fi

# 2b. The compile phase on the host's cores, NVRTC in threads against worker processes (no GPU
# used; nothing else runs now). Step 3's cold run compiles in processes, the default.
if [ -f .rcoa-bin/compile-phase-bench.gz ]; then
  gunzip -c .rcoa-bin/compile-phase-bench.gz > /tmp/compile-phase-bench && chmod +x /tmp/compile-phase-bench
  timeout "$(cap 60)" /tmp/compile-phase-bench --kernels 48 > "$OUT/compile-phase-bench.txt" 2>&1
  log "2b compile phase bench rc=$?"; cat "$OUT/compile-phase-bench.txt"
fi

# The register kernels (the default since 2026-11-30h) run in steps 3 and 4 in the directions
# whose CUDA tests passed in step 1 (RCOA_FLASH_REGISTERS=0: neither), their backward in one
# pass if its test passed, else in two.
REGS=""; AHEAD=0
for dir in forward backward; do
  if grep -q "${dir}_registers::tests::cuda::register_fragments_match_the_reference ... ok" \
    "$OUT/flash-trials.txt" 2>/dev/null; then REGS="${REGS:+$REGS,}$dir"; fi
  if grep -q "${dir}_registers::tests::cuda::copied_ahead_match_the_reference ... ok" \
    "$OUT/flash-trials.txt" 2>/dev/null; then AHEAD=$((AHEAD + 1)); fi
done
export RCOA_FLASH_REGISTERS=${REGS:-0}
case $REGS in *backward*)
  grep -q "backward_registers::tests::cuda::one_pass_match_the_reference ... ok" \
    "$OUT/flash-trials.txt" 2>/dev/null || export RCOA_FLASH_ONE_PASS=0 ;;
esac
log "register kernels: ${REGS:-none}, one pass: ${RCOA_FLASH_ONE_PASS:-1}"

# 3. Cold 350M with fused attention (tensor cores if step 1 passed), default pools.
export RCOA_CACHE_DIR=/tmp/cache-flash-call
rm -rf "$RCOA_CACHE_DIR"
# The tensor-core kernels are the default on CUDA; =0 takes the Rows kernels if they failed.
if [ $TC = 1 ]; then export RCOA_FLASH_TENSOR_CORES=1; else export RCOA_FLASH_TENSOR_CORES=0; fi
t=$(cap 200)
if [ "$t" -ge 60 ]; then
  python3 $B/speed.py --rcoa "$RCOA" --device $DEVICE --shapes $SHAPE --steps 12 --timeout "$t" \
    --engines rcoa --rcoa-attention flash --out "$OUT/speed-cold" > "$OUT/speed-cold.txt" 2>&1
  log "3 cold 350M rc=$?"; tail -n 6 "$OUT/speed-cold.txt"
  grep -h '"compiled_ahead"\|"start"' "$OUT"/speed-cold/*.jsonl 2>/dev/null | cut -c1-600
  # The kernels the recording missed, compiled by the steps: how many, their seconds, the slowest.
  python3 -c '
import json, sys
for f in sys.argv[1:]:
    for line in open(f):
        try:
            d = json.loads(line)
        except ValueError:
            continue
        if d.get("event") == "summary" and "kernels_compiled_at_launch" in d:
            print("3 at launch:", d["kernels_compiled_at_launch"], "kernels,",
                  d.get("kernels_compiled_at_launch_seconds"), "s;",
                  json.dumps(d.get("kernels_compiled_at_launch_slowest"))[:500])
' "$OUT"/speed-cold/*.jsonl 2>/dev/null | tee -a "$OUT/steps.txt"
  grep -hv "^\s*$" "$OUT"/speed-cold/*.err 2>/dev/null | grep -v "^\[" | tail -n 12
  # The tunings it made (small JSON lines): what a shipped seed for this GPU would hold
  # (docs/cold-start.md, "Tunings").
  mkdir -p "$OUT/autotune-350m" && cp -r "$RCOA_CACHE_DIR"/*/autotune "$OUT/autotune-350m/" 2>/dev/null
  log "3 tunings kept: $(cat "$OUT"/autotune-350m/autotune/*/*/*.json.log 2>/dev/null | wc -l) entries"
else
  log "3 skipped: ${t}s left"
fi

# 3a. The linear layers' products alone, CubeCL's against cuBLAS's, in step 3's cache (its
# matmuls compiled and tuned there, so the bench times them, not their tuning).
if [ -f .rcoa-bin/gemm-bench.gz ] && [ "$DEVICE" = cuda ] && [ $BLAS = 1 ]; then
  gunzip -c .rcoa-bin/gemm-bench.gz > /tmp/gemm-bench && chmod +x /tmp/gemm-bench
  timeout "$(cap 60)" /tmp/gemm-bench > "$OUT/gemm-bench.txt" 2>&1
  log "3a gemm bench rc=$?"; cat "$OUT/gemm-bench.txt"
fi

# 3c. The embedding gradient alone, Burn's select_assign against kernels::embedding.
if [ -f .rcoa-bin/embedding-bench.gz ] && [ "$DEVICE" = cuda ]; then
  gunzip -c .rcoa-bin/embedding-bench.gz > /tmp/embedding-bench && chmod +x /tmp/embedding-bench
  timeout "$(cap 20)" /tmp/embedding-bench > "$OUT/embedding-bench.txt" 2>&1
  log "3c embedding bench rc=$?"; cat "$OUT/embedding-bench.txt"
fi

# 3b. The same, the linear layers on cuBLAS, from its own empty cache.
t=$(cap 150)
if [ $BLAS = 1 ] && [ "$t" -ge 60 ]; then
  RCOA_MATMUL=cublas RCOA_CACHE_DIR=/tmp/cache-cublas-call python3 $B/speed.py --rcoa "$RCOA" \
    --device $DEVICE --shapes $SHAPE --steps 12 --timeout "$t" --engines rcoa \
    --rcoa-attention flash --out "$OUT/speed-cublas" > "$OUT/speed-cublas.txt" 2>&1
  log "3b cold 350M, cuBLAS rc=$?"; tail -n 6 "$OUT/speed-cublas.txt"
  grep -h '"compiled_ahead"' "$OUT"/speed-cublas/*.jsonl 2>/dev/null | cut -c1-400
  grep -hv "^\s*$" "$OUT"/speed-cublas/*.err 2>/dev/null | grep -v "^\[" | tail -n 6
else
  log "3b cuBLAS run skipped (tests passed: $BLAS; ${t}s left)"
fi

# 4. Where the warm step's time goes, CubeCL's matmuls then cuBLAS's.
profile_kernels 4 "$OUT/speed-cold/speed-$SHAPE.plan" 40 profile 6
if [ $BLAS = 1 ]; then
  export RCOA_MATMUL=cublas RCOA_CACHE_DIR=/tmp/cache-cublas-call
  profile_kernels 4b "$OUT/speed-cold/speed-$SHAPE.plan" 40 profile-cublas 6
  unset RCOA_MATMUL; export RCOA_CACHE_DIR=/tmp/cache-flash-call
fi
# 4c. The warm step with the block kernels (RCOA_FLASH_REGISTERS=0), for the ratio to the
# register kernels' above; or, where both directions' copied-ahead tests passed, the
# register kernels copying the next block under this one's products (RCOA_FLASH_ASYNC_COPY).
if [ "$REGS" = forward,backward ] && [ $AHEAD = 2 ]; then
  export RCOA_FLASH_ASYNC_COPY=1
  log "4c register kernels copying blocks ahead"
  profile_kernels 4c "$OUT/speed-cold/speed-$SHAPE.plan" 40 profile-copied-ahead 6
  unset RCOA_FLASH_ASYNC_COPY
fi
RCOA_FLASH_REGISTERS=0 profile_kernels 4d "$OUT/speed-cold/speed-$SHAPE.plan" 40 profile-blocks 6
unset RCOA_FLASH_TENSOR_CORES RCOA_FLASH_REGISTERS RCOA_FLASH_ONE_PASS

# 5. Nsight Compute on each tensor-core kernel's first launch.
NCU=$(command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -n 1)
if [ "$DEVICE" = cuda ] && [ -x /tmp/flash-bench ] && [ -n "$NCU" ]; then
  # The kernels' CUDA names (ncu lists them when none matches), not their Rust types', and
  # how many of their launches to skip: the bench times the two-pass backward (2 warm-up
  # launches and 10 timed) before the one-pass one, whose key-block kernel has the same name.
  for ks in flash_forward_blocks:0 flash_backward_kv_blocks:0 flash_backward_q_blocks:0 \
    flash_backward_kv_blocks:12; do
    k=${ks%:*}; skip=${ks#*:}; name=$k; [ "$skip" = 0 ] || name=$k-one-pass
    t=$(cap 60)
    if [ "$t" -lt 25 ]; then log "5 ncu $name skipped: ${t}s left"; continue; fi
    timeout "$t" "$NCU" --clock-control none -k "regex:^${k}_" -s "$skip" -c 1 \
      --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
      --section LaunchStats --section WarpStateStats --section SchedulerStats /tmp/flash-bench \
      > "$OUT/ncu-$name.txt" 2>&1
    log "5 ncu $name rc=$?"
    grep -E "Duration|Throughput|Achieved Occupancy|Theoretical Occupancy|Registers Per|Shared Memory Config|Bank|Stall|One or More|Warp Cycles Per Issued" \
      "$OUT/ncu-$name.txt" | head -n 24
  done
else
  log "5 ncu skipped (no ncu, or not on CUDA)"
fi
log "done"
