#!/bin/sh
# Measures the single-GPU tail configurations of issue 14 on one CUDA GPU (encoders with
# eager attention at several head counts and sequence lengths, LoRA on q/v, dropout; bf16
# weights with Adafactor and with AdamW; XLM-R-XL-sized encoders with bf16 weights) with
# the script that measured tests/groundtruth/h100-pytorch.jsonl, in the same row format,
# then scores rcoa against them. One call:
#
#   sh tools/measure_tails.sh [OUT.jsonl]     # default tests/groundtruth/h100-pytorch-tails.jsonl
#
# Needs torch (CUDA), transformers and peft (tools/requirements.txt); the scoring step runs
# `$RCOA validate` (set RCOA to a built rcoa binary on a machine without cargo). About 19
# configurations of 3 steps each: ~10 minutes on an H100. The CPU traces of the same
# configurations are tools/memtrace/traces/tails.jsonl (docs/accuracy.md).
set -eu
cd "$(dirname "$0")/.."
OUT=${1:-tests/groundtruth/h100-pytorch-tails.jsonl}
PY=${PYTHON:-python3}
status=0
"$PY" tools/measure_pytorch.py tools/memtrace/tails-configs.jsonl -o "$OUT" || status=$?
if [ -n "${RCOA:-}" ]; then
  "$RCOA" validate "$OUT" || true
elif command -v cargo >/dev/null 2>&1; then
  cargo run -q -- validate "$OUT" || true
else
  echo "no cargo and no RCOA=path/to/rcoa: score later with \`rcoa validate $OUT\`" >&2
fi
exit "$status"
