#!/bin/bash
# Memory rows on a CUDA GPU in one device call from an empty kernel cache: every job at once,
# each its own process (two for a "ranks" job, over loopback: zero_ranks.sh) with its own
# kernel cache under $CACHE_ROOT, compact pool, RCOA_MEMORY_TRACE=1 for one-process jobs;
# then each job's measured peak against `rcoa compile --format json`'s. The CUDA transport
# benchmark runs first when .rcoa-bin/transport-cuda.gz is there. Cold first steps take
# 300-500 s with ten processes compiling at once (docs/burn-h100.md, "2026-11-27").
#
# JOBS="kind:plan:steps[:port] ...": kind "ranks" (port for the orchestrator, the ranks
# take the next two) or "one". The default is what docs/gpu-session.md has next.
# TMO: each process's limit in seconds. W: the working folder, packed into $OUT.
# POOL: the runs' pool flags (default "--memory-pool compact"). TRANSPORT=0: no transport
# benchmark.
#
# Run on 2026-11-27 (an H200; docs/burn-h100.md "2026-11-27"; raw outputs in
# h100-results/2026-11-27/), twice on one warm machine, the second reusing the first's
# caches in /tmp/rcoa-caches:
#   call1/: TMO=500 JOBS="ranks:$B/llama1b_zero3_offload.plan:3:29500
#     ranks:$B/llama1b_zero3_offload_untied.plan:2:29510 ranks:$B/llama125m_zero3_offload.plan:4:29520
#     ranks:$B/llama125m_zero2_grads_offload.plan:6:29530 one:$B/h100-results/2026-11-25b/mistral7b_qlora_8l.plan:3
#     one:$B/mistral7b_qlora_burn.plan:3 one:$B/llama125m_activation_offload.plan:4
#     one:$B/llama125m_full_recompute.plan:4 one:$B/llama125m_selective.plan:3
#     one:$B/llama125m_chunked_loss.plan:3" bash backend/bench/gpu_jobs.sh
#   call2/: W=/tmp/w5 TMO=230 JOBS="ranks:$B/llama1b_zero3_offload.plan:3:29600
#     one:$B/h100-results/2026-11-25b/mistral7b_qlora_8l.plan:3 one:$B/mistral7b_qlora_burn.plan:3"
#   ($B = backend/bench)
#
# Device tool: carry [".rcoa-bin"] (rcoa.gz, and transport-cuda.gz if wanted). DRY=1 JOBS="..."
# runs small jobs on the CPU with this machine's release build, to check the script.
set -u
W=${W:-/tmp/jobs}; mkdir -p "$W"; FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
TMO=${TMO:-500}
if [ "${DRY:-0}" = 1 ]; then
  DEVICE=cpu; RCOA=$(realpath "${BIN:-target/release/rcoa}"); POOL=""
else
  DEVICE=cuda; RCOA=/tmp/rcoa; POOL=${POOL:-"--memory-pool compact"}
  gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
  [ -f .rcoa-bin/transport-cuda.gz ] && gunzip -c .rcoa-bin/transport-cuda.gz > /tmp/transport-cuda \
    && chmod +x /tmp/transport-cuda
  export CUDA_PATH=/usr/local/cuda LD_LIBRARY_PATH=/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}
fi
smi() { command -v nvidia-smi >/dev/null && nvidia-smi "$@"; }
{ smi --query-gpu=name,driver_version,memory.total --format=csv; nproc; free -g; } > "$W/gpu.txt" 2>&1
(while true; do echo "$(date +%s),$(smi --query-gpu=memory.used --format=csv,noheader,nounits)"; sleep 2; done) > "$W/smi.csv" 2>/dev/null &
SMI=$!
date +%T > "$W/times.txt"
printf '#!/bin/sh\nif [ "$1" = run ]; then exec %s "$@" %s; else exec %s "$@"; fi\n' "$RCOA" "$POOL" "$RCOA" > /tmp/rcoa-compact
chmod +x /tmp/rcoa-compact
export CACHE_ROOT=/tmp/rcoa-caches
B=backend/bench
# kind:plan:steps[:port]; "ranks" = two processes over loopback (zero_ranks.sh), "one" = one process.
JOBS=${JOBS:-"ranks:$B/llama125m_zero2_grads_offload.plan:4:29500 ranks:$B/llama1b_zero3_offload.plan:3:29510
  ranks:$B/llama125m_zero2_bf16.plan:6:29520 ranks:$B/h100-results/2026-11-25b/l125_zero3_nooff.plan:4:29530"}
P=()
if [ -x /tmp/transport-cuda ] && [ "$DEVICE" = cuda ] && [ "${TRANSPORT:-1}" = 1 ]; then
  ( timeout 80 /tmp/transport-cuda 16 256 --cuda --bf16 > "$W/transport-cuda-bf16.txt" 2>&1
    echo "transport bf16 rc=$? $(date +%T)" >> "$W/times.txt"
    timeout 80 /tmp/transport-cuda 16 256 --cuda > "$W/transport-cuda.txt" 2>&1
    echo "transport fp32 rc=$? $(date +%T)" >> "$W/times.txt" ) & P+=($!)
fi
for job in $JOBS; do
  IFS=: read -r kind plan steps port <<< "$job"
  name=$(basename "$plan" .plan)
  if [ "$kind" = ranks ]; then
    ( OUT=$W BIN=/tmp/rcoa-compact DEVICE=$DEVICE bash $B/zero_ranks.sh "$plan" "$steps" "$port" "$TMO" \
        > "$W/$name.txt" 2>&1
      echo "$name $(date +%T)" >> "$W/times.txt" ) & P+=($!)
  else
    ( "$RCOA" compile "$plan" --format json > "$W/$name-predicted.json" 2>&1
      RCOA_MEMORY_TRACE=1 RCOA_CACHE_DIR="$CACHE_ROOT/$name" timeout "$TMO" "$RCOA" run "$plan" \
        --device $DEVICE $POOL --steps "$steps" --format json > "$W/$name.jsonl" 2> "$W/$name.err"
      echo "$name rc=$? $(date +%T)" >> "$W/times.txt" ) & P+=($!)
  fi
done
wait "${P[@]}"
kill $SMI 2>/dev/null
tar czf "$FINAL/jobs.tgz" -C "$(dirname "$W")" "$(basename "$W")"
cat "$W/gpu.txt" "$W/times.txt"; tail -n 3 "$W"/transport-cuda*.txt 2>/dev/null | cut -c1-300
for job in $JOBS; do
  IFS=: read -r kind plan _ _ <<< "$job"
  name=$(basename "$plan" .plan)
  if [ "$kind" = ranks ]; then
    grep -v '^memory' "$W/$name.txt" | cut -c1-420
    grep -h '"loss"' "$W/$name"-rank0.jsonl | cut -c1-110
  else
    python3 - "$W/$name.jsonl" "$W/$name-predicted.json" "$name" <<'PY'
import json, sys
path, pred_path, name = sys.argv[1:]
lines = [json.loads(l) for l in open(path) if l.startswith("{")]
s = next((l for l in lines if l.get("event") == "summary"), None)
losses = [round(l["loss"], 4) for l in lines if "loss" in l]
if s is None:
    print(f"{name}: no summary; losses {losses}")
else:
    print(f"{name}: measured {s.get('measured_peak_bytes')} predicted {s.get('predicted_peak_bytes')} "
          f"error {s.get('peak_error')} reserved {s.get('measured_reserved_bytes')} "
          f"first step {s.get('first_step_seconds')} s steady {s.get('steady_step_seconds')} s losses {losses}")
PY
    grep -v '^memory' "$W/$name.err" | tail -n 2 | cut -c1-300
  fi
done
sort -t, -k2 -n "$W/smi.csv" | tail -1; ls -la "$FINAL"
