#!/bin/bash
# Throughput of `rcoa run --device cuda` beside PyTorch eager on the same shape, both
# measured in this call on this GPU (run on the device machine from the repository
# root, after h100.sh has warmed the kernel cache or with time for a cold compile):
#   bash backend/bench/vs_pytorch.sh [STEPS]
# Prints the summaries and the ratios of tokens per second: rcoa / PyTorch eager, and
# rcoa with its one-node softmax / with Burn's composite softmax.
set -u
STEPS=${1:-20}
OUT=${OUT:-/tmp/rcoa-out}; mkdir -p "$OUT"
bash backend/bench/h100.sh "llama350m_eager.plan:$STEPS:400:vs-pytorch" > "$OUT/vs-pytorch-rcoa.log" 2>&1
# The same binary with Burn's composite softmax (backend/src/ops.rs) for the second ratio.
RCOA_COMPOSITE_SOFTMAX=1 bash backend/bench/h100.sh "llama350m_eager.plan:$STEPS:120:vs-composite" > "$OUT/vs-composite-rcoa.log" 2>&1
python3 backend/bench/torch_llama.py --steps "$STEPS" --attn eager > "$OUT/vs-pytorch-torch.jsonl" 2> "$OUT/vs-pytorch-torch.err"
python3 - "$OUT" <<'PY'
import json, sys
out = sys.argv[1]
def summary(path):
    for line in open(path):
        if line.startswith("{") and '"summary"' in line:
            return json.loads(line)
    sys.exit(f"no summary in {path}")
r = summary(f"{out}/llama350m_eager.plan-vs-pytorch.jsonl")
c = summary(f"{out}/llama350m_eager.plan-vs-composite.jsonl")
t = summary(f"{out}/vs-pytorch-torch.jsonl")
print(f"rcoa (burn, fused):  {r['steady_step_seconds']:.4f} s/step  {r['tokens_per_second']:.0f} tokens/s")
print(f"rcoa, composite softmax:  {c['steady_step_seconds']:.4f} s/step  {c['tokens_per_second']:.0f} tokens/s")
print(f"{t['engine']}:  {t['steady_step_seconds']:.4f} s/step  {t['tokens_per_second']:.0f} tokens/s")
print(f"ratio rcoa / pytorch eager: {r['tokens_per_second'] / t['tokens_per_second']:.3f}")
print(f"ratio softmax_last / composite softmax: {r['tokens_per_second'] / c['tokens_per_second']:.3f}")
PY
