#!/bin/bash
# The one device call that serves the most open items, for a session with 15 minutes of device
# time (one call of about 10 minutes after the machine's start). Each step is capped so that
# the whole ends within LIMIT seconds (default 560), and writes under $OUT as it finishes, so a
# call cut short still brings back what it reached. In order of value:
#
#  0. `--memory-pool expandable` beside pinned host memory (llama125m_activation_offload.plan,
#     4 steps, cold: 2026-11-28f's try ran out of time compiling), in the background from
#     the start, beside step 1 (which times nothing), and waited for before anything is
#     timed. At most 240 s. (This step measured issue 12's 8-bit Adam row on 2026-11-28f.)
#  1. The flash kernel tests on CUDA (.rcoa-bin/flash-tests.gz, docs/gpu-session.md "Fused
#     attention on CUDA"): the tensor-core kernels' first run anywhere, and the Rows kernels
#     with their loops unrolled; if the tensor-core ones fail, their scalar twins, to tell a
#     fault of the cmma calls from one of the data flow. At most 210 s. If neither passes,
#     the speed runs take eager attention.
#     If they pass, the kernels alone against the scalar ones and PyTorch's SDPA
#     (.rcoa-bin/flash-bench.gz, backend/bench/sdpa_time.py). At most 105 s.
#  2. Issue 13 on its own shape (speed.py's 350M decoder, bf16, seq 2048), rcoa with fused
#     attention (the tensor-core kernels if step 1 passed) from an empty kernel cache: the
#     cold first step, compiled ahead on every core (bar: 60 s), and tokens/s. At most 300 s.
#  3. The same again on the now warm cache: the warm first step (bar: 2 s). At most 90 s.
#     Then where that step's time goes (rcoa run --profile-kernels, 4 steps). At most 60 s.
#  4. PyTorch eager with SDPA on the same shape, for the ratio. At most 150 s.
#  5. The memory pools on the same plan and the warm cache, 6 steps each: `expandable`
#     (mapped as used; its first run on a GPU), then `compact`: reserved ÷ in use and the
#     step time, beside step 3's default pool (docs/memory-pool.md). At most 50 s each.
#
# The tool brings back at most 8 files: pack them as backend/bench/gpu_flash_call.sh says.
# Device tool: carry [".rcoa-bin"] (rcoa.gz, flash-tests.gz and flash-bench.gz, built as docs/gpu-session.md
# says). DRY=1 checks the script on a CPU with this machine's release build and tiny shapes.
set -u
LIMIT=${LIMIT:-560}
source backend/bench/gpu_call_common.sh

# 0. expandable beside pinned host memory, in the background from the start, beside the
# flash tests (which time nothing); waited for before anything is timed.
start_expandable_jobs 240

# 1. Flash kernels: the tensor-core ones and the Rows ones (their loops unrolled on CUDA
# since the 2026-11-28c session; they passed on an H100 before that).
TC=0; ATTENTION=flash
if [ -f .rcoa-bin/flash-tests.gz ] && [ "$DEVICE" = cuda ]; then
  gunzip -c .rcoa-bin/flash-tests.gz > /tmp/flash-tests && chmod +x /tmp/flash-tests
  # --nocapture: a test without a device prints SKIPPED and passes; that is not a pass here.
  # tests_mma: the tensor-core block products alone, in the kernels' layouts (a failure of
  # the flash tests with these passing is in the data flow around the products).
  timeout "$(cap 150)" /tmp/flash-tests tests_kernels::cuda::tensor_cores tests_kernels::cuda::rows \
    tests_mma::cuda --test-threads 1 --nocapture > "$OUT/flash-tests.txt" 2>&1
  log "1 tensor-core and Rows flash tests rc=$?"
  # A kind passed: every test the binary lists for it passed, its dropout test aside (the
  # speed plans have no dropout; that test's result is in the file all the same).
  passed() {
    want=$(/tmp/flash-tests --list "tests_kernels::cuda::$1::" 2>/dev/null | grep ': test$' \
      | grep -vc '::dropout:')
    got=$(grep "cuda::$1::.* \.\.\. ok" "$OUT/flash-tests.txt" | grep -vc '::dropout ')
    [ "$want" -gt 0 ] && [ "$got" = "$want" ] && ! grep -q SKIPPED "$OUT/flash-tests.txt"
  }
  # Neither kind passed: the speed runs take eager attention, not wrong kernels.
  if ! passed tensor_cores && ! passed rows; then ATTENTION=eager; fi
  log "1 attention for the speed runs: $ATTENTION"
  if passed tensor_cores; then TC=1
  else
    # Their tiling on scalar FMAs and their data flow (both pass on lavapipe): passing
    # here puts the fault in the cmma calls themselves.
    timeout "$(cap 60)" /tmp/flash-tests tests_kernels::cuda::tiled tests_kernels::cuda::blocks \
      --test-threads 1 --nocapture > "$OUT/flash-tests-blocks.txt" 2>&1
    log "1 scalar block-product flash tests rc=$?"
  fi
else
  log "1 flash tests skipped (no .rcoa-bin/flash-tests.gz, or not on CUDA)"
fi

wait_expandable_jobs

# 1b. The kernels alone: rcoa's scalar and tensor-core kernels in one run (benches/flash.rs),
# then PyTorch's SDPA on the same shape.
if [ $TC = 1 ] && [ -f .rcoa-bin/flash-bench.gz ]; then
  gunzip -c .rcoa-bin/flash-bench.gz > /tmp/flash-bench && chmod +x /tmp/flash-bench
  timeout "$(cap 60)" /tmp/flash-bench > "$OUT/flash-bench.txt" 2>&1
  log "1b flash bench rc=$?"; cat "$OUT/flash-bench.txt"
  timeout "$(cap 45)" python3 $B/sdpa_time.py > "$OUT/sdpa-time.txt" 2>&1
  log "1b sdpa rc=$?"; cat "$OUT/sdpa-time.txt"
fi

# 2-4. Speed and start-up on issue 13's shape; rcoa's kernel cache starts empty.
export RCOA_CACHE_DIR=/tmp/cache-speed
rm -rf "$RCOA_CACHE_DIR"
speed() {
  local name=$1 limit=$2; shift 2
  local t; t=$(cap "$limit")
  if [ "$t" -lt 45 ]; then log "$name skipped: ${t}s left"; return; fi
  python3 $B/speed.py --rcoa "$RCOA" --device $DEVICE --shapes $SHAPE --steps 12 --timeout "$t" \
    --out "$OUT/speed-$name" "$@" > "$OUT/speed-$name.txt" 2>&1
  log "$name rc=$?"; tail -n 6 "$OUT/speed-$name.txt"
}
# The tensor-core kernels are the default on CUDA; =0 takes the Rows kernels if they failed.
if [ $TC = 1 ]; then export RCOA_FLASH_TENSOR_CORES=1; else export RCOA_FLASH_TENSOR_CORES=0; fi
speed 2-rcoa-cold 300 --engines rcoa --rcoa-attention $ATTENTION
# Which flash kernels ran (rcoa says so once when RCOA_FLASH_TENSOR_CORES=1).
grep -h "tensor cores\|RCOA_FLASH\|compiling kernels ahead\|note:" "$OUT"/speed-2-rcoa-cold/*.err 2>/dev/null | head -n 8
speed 3-rcoa-warm 90 --engines rcoa --rcoa-attention $ATTENTION
# 3b. Where the warm step's time goes: every kernel timed on the GPU (--profile-kernels),
# by family and the longest kernels, beside the plan's FLOPs.
PLAN350="$OUT/speed-3-rcoa-warm/speed-$SHAPE.plan"
if profile_kernels 3b "$PLAN350" 60 "profile-$SHAPE" 8; then
  # No kernel_profile line (the event timing failed): CubeCL's own profiler instead, which
  # syncs around every kernel (its per-kernel lines and a summary table per step).
  t=$(cap 40)
  if ! grep -q kernel_profile "$OUT/profile-$SHAPE.jsonl" && [ "$t" -gt 20 ]; then
    CUBECL_DEBUG_OPTION=profile CUBECL_DEBUG_LOG="$OUT/cubecl-profile-$SHAPE.log" timeout "$t" \
      "$RCOA" run "$PLAN350" --device cuda --steps 3 --format json > "$OUT/cubecl-profile-$SHAPE.jsonl" 2>&1
    log "3b CubeCL's profiler rc=$?"; grep -A 25 "Duration" "$OUT/cubecl-profile-$SHAPE.log" | tail -n 26
  fi
fi
speed 4-pytorch 150 --engines eager

# 5. The pools on the warm cache: bytes reserved against in use, and the step time.
for pool in expandable compact; do
  t=$(cap 50)
  if [ "$DEVICE" != cuda ] || [ ! -f "$PLAN350" ] || [ "$t" -lt 25 ]; then
    log "5 $pool skipped"; continue
  fi
  timeout "$t" "$RCOA" run "$PLAN350" --device cuda --steps 6 --memory-pool $pool --format json \
    > "$OUT/pool-$pool.jsonl" 2> "$OUT/pool-$pool.err"
  log "5 $pool rc=$?"; tail -n 3 "$OUT/pool-$pool.err"
  python3 - "$OUT/pool-$pool.jsonl" <<'PY' || true
import json, sys
for line in open(sys.argv[1]):
    v = json.loads(line)
    if v.get("event") == "start":
        print("pool", v.get("memory_pool"))
    elif v.get("event") == "summary":
        print({k: v.get(k) for k in ("measured_reserved_bytes", "measured_peak_bytes", "predicted_peak_bytes",
                                     "first_step_seconds", "steady_step_seconds", "tokens_per_second")})
PY
done
unset RCOA_FLASH_TENSOR_CORES

log "done"
