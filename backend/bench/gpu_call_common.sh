# Sourced by gpu_one_call.sh, gpu_flash_call.sh and gpu_speed_call.sh: what a device call's
# script sets up first. Expects LIMIT (seconds the whole call may take) and OUT; sets B, END,
# DEVICE, RCOA, SHAPE, and cap, log, start_expandable_jobs, wait_expandable_jobs,
# profile_kernels, cublas_tests, rope_tests. DRY=1: the CPU, this machine's release build
# (BIN), tiny shapes.
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
END=$(( $(date +%s) + LIMIT ))
B=backend/bench
# Seconds a step may take: its cap, or what is left of the call minus 10 s to pack up.
cap() { local left=$(( END - $(date +%s) - 10 )); echo $(( left < $1 ? left : $1 )); }
log() { echo "$(date +%T) $*" | tee -a "$OUT/steps.txt"; }
if [ "${DRY:-0}" = 1 ]; then
  DEVICE=cpu; RCOA=$(realpath "${BIN:-target/release/rcoa}")
  SHAPE=tiny; BG="one:plans/tiny-cpu.plan:3"; POOLS=""
else
  DEVICE=cuda; RCOA=/tmp/rcoa; SHAPE=350m
  BG="one:$B/llama125m_activation_offload.plan:4"; POOLS="--memory-pool expandable"
  gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
  export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
  # cuBLAS for RCOA_MATMUL=cublas: the toolkit's if it has one, else the one PyTorch's wheels bring.
  if ! ls /usr/local/cuda/lib64/libcublas.so* > /dev/null 2>&1; then
    CUBLAS_DIR=$(python3 -c 'import glob, os, site
print(next(iter(sorted(os.path.dirname(p) for s in site.getsitepackages()
  for p in glob.glob(s + "/nvidia/**/libcublas.so*", recursive=True))), ""))' 2>/dev/null)
    [ -n "$CUBLAS_DIR" ] && export LD_LIBRARY_PATH=$CUBLAS_DIR:$LD_LIBRARY_PATH
  fi
  { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nproc
    echo "cuBLAS: $(ls /usr/local/cuda/lib64/libcublas.so* ${CUBLAS_DIR:-/nonexistent}/libcublas.so* 2>/dev/null | tr '\n' ' ')"
  } > "$OUT/gpu.txt" 2>&1
fi

# `--memory-pool expandable` beside pinned host memory (activation offload, 4 steps, cold), in
# the background for at most $1 seconds; the caller waits for it before timing anything.
start_expandable_jobs() {
  local t; t=$(cap "$1")
  W=/tmp/jobs-expandable OUT="$OUT/expandable" TMO=$(( t - 20 )) JOBS="$BG" POOL="$POOLS" TRANSPORT=0 \
    DRY="${DRY:-0}" BIN="$RCOA" bash $B/gpu_jobs.sh > "$OUT/expandable.txt" 2>&1 &
  BG_PID=$!
}
wait_expandable_jobs() {
  wait "$BG_PID"
  log "0 expandable jobs rc=$?"; grep -h "measured\|no summary\|rc=" "$OUT/expandable.txt" | head -n 6
  grep -h "memory_pool\|measured_reserved" /tmp/jobs-expandable/*.jsonl 2>/dev/null | cut -c1-400 | tail -n 2
}

# Where plan $2's warm step time goes: `rcoa run --profile-kernels` for 4 steps, at most $3
# seconds, into $OUT/$4.jsonl and .err; logs it as step $1 and prints the families and the $5
# longest kernels. Returns 1 (running nothing) off CUDA, without the plan, or with 20 s or
# less left.
profile_kernels() {
  local t; t=$(cap "$3")
  if [ "$DEVICE" != cuda ] || [ ! -f "$2" ] || [ "$t" -le 20 ]; then return 1; fi
  timeout "$t" "$RCOA" run "$2" --device cuda --steps 4 --profile-kernels --format json \
    > "$OUT/$4.jsonl" 2> "$OUT/$4.err"
  log "$1 kernel profile rc=$?"
  python3 - "$OUT/$4.jsonl" "$5" <<'PY' || true
import json, sys
for line in open(sys.argv[1]):
    v = json.loads(line)
    if v.get("event") != "kernel_profile":
        continue
    print(f"kernels {v['kernel_seconds']:.4f} s per {v['step_seconds']:.4f} s step, busy {v['busy']:.0%}, "
          f"{v['launches_per_step']:.0f} launches, compute {v.get('compute_tflops')} TFLOP/s")
    for r in v["families"] + v["kernels"][:int(sys.argv[2])]:
        print(f"  {r['name'][:70]:<70} {r['seconds_per_step'] * 1e3:8.2f} ms {r['share']:6.1%} {r['launches_per_step']:7.1f}")
PY
}

# The RoPE kernel's CUDA tests (kernels::rope::tests_cuda), at most 45 s, logged as step $1;
# where they fail, every run after uses Burn's composition (RCOA_ROPE=composite).
rope_tests() {
  RCOA_REQUIRE=cuda timeout "$(cap 45)" /tmp/flash-tests kernels::rope::tests_cuda \
    --test-threads 1 > "$OUT/rope-tests.txt" 2>&1
  local rc=$?
  log "$1 RoPE kernel tests rc=$rc"; grep "^test \|test result\|panicked" "$OUT/rope-tests.txt" | head -n 8
  if [ $rc != 0 ]; then export RCOA_ROPE=composite; fi
}

# cuBLAS's CUDA tests (kernels::gemm::tests_cuda, at most 75 s: the last compiles a tiny
# model's kernels for a whole training step on each engine) into $OUT/gemm-tests.txt, from
# /tmp/flash-tests (the caller unpacks it); logged as step $1. Sets BLAS=1 if they passed,
# or if only the whole step ran out of time (rc 124; it runs last, the tests going in name
# order) after every product test passed: a cold compile must not cost the call its cuBLAS
# timing, and the log says the step test is unknown.
cublas_tests() {
  RCOA_REQUIRE=cuda,cublas timeout "$(cap 75)" /tmp/flash-tests kernels::gemm::tests_cuda \
    --test-threads 1 > "$OUT/gemm-tests.txt" 2>&1
  local rc=$?
  log "$1 cuBLAS tests rc=$rc"; grep "^test \|test result\|panicked\|RCOA_REQUIRE" "$OUT/gemm-tests.txt" | head -n 12
  if [ $rc = 0 ]; then BLAS=1
  elif [ $rc = 124 ] && ! grep -q "FAILED\|panicked" "$OUT/gemm-tests.txt" \
      && [ "$(grep -c '^test .* \.\.\. ok$' "$OUT/gemm-tests.txt")" -ge 4 ]; then
    BLAS=1; log "$1 the whole-step test ran out of time, the product tests passed: cuBLAS runs"
  fi
}
