#!/usr/bin/env python3
"""Writes the LoweredPlans measured on the H100 (docs/burn-h100.md) from
tiny.json (rcoa_backend::testing::tiny_plan, dumped by the backend test
`lowered_plans_round_trip_through_json` with RCOA_DUMP_TINY_PLAN=tiny.json).
Shapes follow tests/groundtruth (llama 125M / 350M), so Burn's numbers
sit beside PyTorch's on the same shape. Predictions are filled in by
`rcoa compile` when the compiler is available; here they are 0."""
import copy, json, sys

base = json.load(open(sys.argv[1] if len(sys.argv) > 1 else "tiny.json"))

def plan(name, hidden, layers, heads, ffn, precision, ckpt_all=False, mb=8, seq=1024):
    p = copy.deepcopy(base)
    m = p["model"]
    m.update(name=name, hidden=hidden, layers=layers, heads=heads, kv_heads=heads,
             head_dim=hidden // heads, ffn=ffn, vocab=32000, max_positions=2048)
    params, compute = precision
    p["precision"] = {"params": params, "compute": compute, "master": None if params == "fp32" else "fp32", "grads": params}
    p["optimizer"]["lr"] = 3e-4
    p["hardware"]["gpu"] = {"name": "h100-80gb", "memory_bytes": 85899345920, "bf16_tflops": 989.0, "bandwidth_bytes_per_s": 3.35e12}
    t = p["train"]
    t.update(seq_len=seq, global_batch=mb, micro_batch={"fixed": mb}, grad_accum={"fixed": 1})
    r = p["resolved"]
    r.update(micro_batch=mb, grad_accum=1, checkpoint="full" if ckpt_all else "none",
             checkpoint_layers=list(range(layers)) if ckpt_all else [])
    return p

plans = {
    "llama125m_fp32": plan("llama125m", 768, 12, 12, 2048, ("fp32", "fp32")),
    "llama125m_base": plan("llama125m", 768, 12, 12, 2048, ("fp32", "bf16")),
    "llama125m_bf16": plan("llama125m", 768, 12, 12, 2048, ("bf16", "bf16")),
    "llama350m_eager": plan("llama350m", 1024, 24, 16, 2816, ("fp32", "bf16")),
    "llama350m_gc": plan("llama350m", 1024, 24, 16, 2816, ("fp32", "bf16"), ckpt_all=True),
    "llama350m_fp32": plan("llama350m", 1024, 24, 16, 2816, ("fp32", "fp32")),
}
for k, v in plans.items():
    json.dump(v, open(f"{k}.json", "w"), indent=1)
print(" ".join(plans))
