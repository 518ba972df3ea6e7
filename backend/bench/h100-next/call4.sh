#!/bin/bash
# One device call that does what calls 1-3 and 6 of docs/gpu-session.md can do from an empty
# kernel cache (the 2026-11-27 session had 15 minutes of device time and no carried cache):
# every run at once as its own process, compact pool, each process with its own cache.
#   - the CUDA transport benchmark, bf16 then fp32 (the ZeRO-2 bf16 fault: in the ring or not);
#   - issue 11's bar: the 1B ZeRO-3 + optimizer offload over two processes (3 steps), and
#     beside it the same with untied embeddings (its NaN first loss of 2026-11-25b, bisected);
#   - the 125M ZeRO-3 + optimizer offload again (collectives now on the rank's stream);
#   - activation offload (one process) and gradient offload (two), new since 2026-11-27;
#   - issue 12's bars: QLoRA at Mistral-7B's shape, 8 layers and 32, with the memory trace;
#     selective recomputation and the chunked loss at 125M.
# About 9 minutes, most of it the cold first steps.
#
# Device tool: carry [".rcoa-bin"] (rcoa.gz, transport-cuda.gz). DRY=1 JOBS="..." runs
# small jobs on the CPU with this machine's release build, to check the script.
set -u
W=${W:-/tmp/w4}; mkdir -p "$W"; FINAL=${OUT:-/tmp/out}; mkdir -p "$FINAL"
TMO=${TMO:-500}
if [ "${DRY:-0}" = 1 ]; then
  DEVICE=cpu; RCOA=$(realpath "${BIN:-target/release/rcoa}"); POOL=""
else
  DEVICE=cuda; RCOA=/tmp/rcoa; POOL="--memory-pool compact"
  gunzip -c .rcoa-bin/rcoa.gz > /tmp/rcoa && chmod +x /tmp/rcoa
  gunzip -c .rcoa-bin/transport-cuda.gz > /tmp/transport-cuda && chmod +x /tmp/transport-cuda
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
JOBS=${JOBS:-"ranks:$B/llama1b_zero3_offload.plan:3:29500 ranks:$B/llama1b_zero3_offload_untied.plan:2:29510
  ranks:$B/llama125m_zero3_offload.plan:4:29520 ranks:$B/llama125m_zero2_grads_offload.plan:6:29530
  one:$B/h100-results/2026-11-25b/mistral7b_qlora_8l.plan:3 one:$B/mistral7b_qlora_burn.plan:3
  one:$B/llama125m_activation_offload.plan:4 one:$B/llama125m_full_recompute.plan:4
  one:$B/llama125m_selective.plan:3 one:$B/llama125m_chunked_loss.plan:3"}
P=()
if [ "$DEVICE" = cuda ]; then
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
tar czf "$FINAL/call4.tgz" -C "$(dirname "$W")" "$(basename "$W")"
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
