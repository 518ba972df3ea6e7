#!/usr/bin/env python3
"""`rcoa run` beside what users run today, on the same shapes, in one call (issue #13).

For each shape: rcoa's Burn executor (`rcoa run PLAN --format json`), PyTorch eager
with SDPA attention, and `torch.compile` of the same model; Hugging Face
`LlamaForCausalLM`, fp32 weights with bf16 autocast, AdamW, random tokens. Every engine
runs in a fresh process, so each peak is its own. Prints per engine: steady step time,
tokens/s, first-step time (kernel compilation included: for rcoa, compiling ahead and
the first step), peak and reserved device
memory, MFU; then rcoa's ratios to eager SDPA and to torch.compile.

    # on the device machine, from the repository root (binary built here, see docs/burn-h100.md):
    python3 backend/bench/speed.py --rcoa .rcoa-bin/rcoa --shapes 350m,1b --steps 20
    # anywhere, a check of the script itself (tiny shape, CPU; no MFU):
    python3 backend/bench/speed.py --rcoa target/debug/rcoa --shapes tiny --device cpu --steps 3

`--cold` points rcoa's kernel cache at an empty directory, so its first step includes
compiling every kernel (the issue's cold-start figure); without it the cache in
`$RCOA_CACHE_DIR` is used as it is. MFU counts 6 FLOPs per parameter of every matmul
(layers and LM head) per token plus causal attention's `6 · layers · seq · hidden`
(scores and probs·v, forward and backward, half the matrix), over the GPU's dense bf16
peak (`--peak-tflops`, default from the device name)."""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = {
    # tests/groundtruth's llama350m and llama1b shapes (the "350M" and ">= 1B").
    "350m": dict(hidden=1024, layers=24, heads=16, kv_heads=16, ffn=2816, vocab=32000, batch=4, seq=2048, tie=False),
    "1b": dict(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192, vocab=128256, batch=4, seq=2048, tie=True),
    # A shape for checking the script on a CPU in seconds.
    "tiny": dict(hidden=64, layers=2, heads=4, kv_heads=4, ffn=128, vocab=256, batch=2, seq=64, tie=False),
}

# Dense bf16 tensor-core peaks, TFLOP/s, by a substring of the device name.
PEAKS = {"H100": 989.4, "H200": 989.4, "A100": 312.0}


def matmul_params(s):
    hd = s["hidden"] // s["heads"]
    attn = s["hidden"] * (s["heads"] * hd + 2 * s["kv_heads"] * hd) + s["heads"] * hd * s["hidden"]
    mlp = 3 * s["hidden"] * s["ffn"]
    return s["layers"] * (attn + mlp) + s["hidden"] * s["vocab"]


def flops_per_token(s):
    return 6 * matmul_params(s) + 6 * s["layers"] * s["seq"] * s["hidden"]


def plan_text(name, s, attention=None):
    attention = f"\n  attention = {attention}" if attention else ""
    return f"""# {name}: the speed benchmark's shape (backend/bench/speed.py), as PyTorch runs it:
# fp32 weights, bf16 compute, AdamW, every activation kept.
model {{
  arch = decoder  layers = {s['layers']}  hidden = {s['hidden']}  heads = {s['heads']}
  kv_heads = {s['kv_heads']}  ffn = {s['ffn']}  vocab = {s['vocab']}  max_positions = {max(2048, s['seq'])}
  mlp = swiglu  norm = rmsnorm  tie_embeddings = {str(s['tie']).lower()}
}}

hardware {{ gpu = h100-80gb }}

precision {{ params = fp32  compute = bf16 }}

optimizer adamw {{ lr = 3e-4  betas = (0.9, 0.95)  weight_decay = 0.0 }}

train {{
  seq_len = {s['seq']}
  global_batch = {s['batch']}
  micro_batch = {s['batch']}
  grad_accum = 1{attention}
}}

fit {{ checkpoint = none }}

target burn
"""


def torch_worker(a):
    """One PyTorch engine on one shape, in this process; prints one JSON line."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = SHAPES[a.shape]
    dev = a.device
    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=s["hidden"], num_hidden_layers=s["layers"],
                      num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"],
                      intermediate_size=s["ffn"], vocab_size=s["vocab"],
                      max_position_embeddings=max(2048, s["seq"]), tie_word_embeddings=s["tie"])
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    fwd = torch.compile(model) if a.worker == "compile" else model
    cuda = dev == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(a.steps):
        ids = torch.randint(0, s["vocab"], (s["batch"], s["seq"]), device=dev)
        sync()
        t0 = time.perf_counter()
        with torch.autocast(dev, dtype=torch.bfloat16):
            loss = fwd(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    steady = statistics.median(times[1:]) if len(times) > 1 else times[0]
    print(json.dumps({
        "engine": f"pytorch {torch.__version__} " + ("torch.compile" if a.worker == "compile" else "eager sdpa"),
        "steady_step_seconds": steady,
        "first_step_seconds": times[0],
        "tokens_per_second": s["batch"] * s["seq"] / steady,
        "peak_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "reserved_bytes": torch.cuda.max_memory_reserved() if cuda else None,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "last_loss": loss.item(),
    }))


def run_capped(cmd, timeout, env=None):
    """`cmd`'s exit status, stdout and stderr; a run past `timeout` seconds is killed and
    reported with status None and what it printed so far (a cold kernel cache can take
    minutes: the other engines' rows still come out)."""
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")
        return None, text(e.stdout), text(e.stderr) + f"\ntimed out after {timeout} s"


def run_torch(a, shape, engine):
    cmd = [sys.executable, __file__, "--worker", engine, "--shape", shape,
           "--device", a.device, "--steps", str(a.steps)]
    rc, out, err = run_capped(cmd, a.timeout)
    if rc != 0:
        return {"engine": f"pytorch {engine}", "error": err.strip().splitlines()[-1:] or ["failed"]}
    return json.loads(out.strip().splitlines()[-1])


def rcoa_engine(a):
    """The name of rcoa's row: with the memory pool when one was asked for."""
    return ("rcoa run (burn)" + (f", {a.rcoa_memory_pool} pool" if a.rcoa_memory_pool else "")
            + (", cuBLAS matmuls" if os.environ.get("RCOA_MATMUL") == "cublas" else ""))


def run_rcoa(a, shape, out):
    s = SHAPES[shape]
    plan = os.path.join(out, f"speed-{shape}.plan")
    with open(plan, "w") as f:
        f.write(plan_text(shape, s, a.rcoa_attention))
    env = dict(os.environ)
    if a.cold:
        env["RCOA_CACHE_DIR"] = tempfile.mkdtemp(prefix="rcoa-cold-cache-")
    cmd = [a.rcoa, "run", plan, "--device", a.device, "--steps", str(a.steps), "--format", "json"]
    if a.rcoa_memory_pool:
        cmd += ["--memory-pool", a.rcoa_memory_pool]
    t0 = time.perf_counter()
    rc, stdout, stderr = run_capped(cmd, a.timeout, env)
    wall = time.perf_counter() - t0
    with open(os.path.join(out, f"speed-{shape}-rcoa.jsonl"), "w") as f:
        f.write(stdout)
    # Compiling ahead and the first step report on stderr (what was recorded, refused, missed).
    with open(os.path.join(out, f"speed-{shape}-rcoa.err"), "w") as f:
        f.write(stderr)
    event = lambda name: next((json.loads(l) for l in stdout.splitlines() if f'"{name}"' in l), None)
    summary = event("summary")
    if rc != 0 or summary is None:
        return {"engine": rcoa_engine(a), "error": stderr.strip().splitlines()[-3:] or ["failed"]}
    # A cold cache is compiled on every core before the first step (docs/cold-start.md):
    # the user waits for that and the first step together.
    ahead = event("compiled_ahead")
    ahead_s = ahead["record_seconds"] + ahead["compile_seconds"] if ahead else 0.0
    start = event("start") or {}
    return {
        "engine": rcoa_engine(a),
        # The pool the run says it took (compact unless asked; none on the CPU), and its
        # device ("cuda:0 NVIDIA H200 (...)"), which names the GPU's peak for the MFU when
        # no PyTorch row ran beside it.
        "memory_pool": start.get("memory_pool") or a.rcoa_memory_pool,
        "device_name": start.get("device"),
        "steady_step_seconds": summary["steady_step_seconds"],
        "first_step_seconds": ahead_s + summary["first_step_seconds"],
        "compiled_ahead_seconds": ahead_s,
        "kernels_compiled_at_launch": summary.get("kernels_compiled_at_launch"),
        # What those kernels cost the first step, and which they were (what the recording missed).
        "kernels_compiled_at_launch_seconds": summary.get("kernels_compiled_at_launch_seconds"),
        "kernels_compiled_at_launch_slowest": summary.get("kernels_compiled_at_launch_slowest"),
        "tokens_per_second": summary["tokens_per_second"],
        "peak_bytes": summary["measured_peak_bytes"],
        "reserved_bytes": summary.get("measured_reserved_bytes"),
        "predicted_peak_bytes": summary.get("predicted_peak_bytes"),
        "predicted_in_use_max_bytes": summary.get("predicted_in_use_max_bytes"),
        "last_loss": summary.get("last_loss"),
        "wall_seconds": wall,
    }


def gib(b):
    return "n/a" if b is None else f"{b / 2**30:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rcoa", default=".rcoa-bin/rcoa", help="the rcoa binary")
    ap.add_argument("--shapes", default="350m,1b", help=f"comma-separated, of {sorted(SHAPES)}")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--engines", default="rcoa,eager,compile")
    ap.add_argument("--rcoa-attention", choices=["flash", "eager", "sdpa"], default=None,
                    help="`train { attention = ... }` of rcoa's plan (flash: the fused kernels)")
    ap.add_argument("--rcoa-memory-pool", choices=["compact", "expandable", "cubecl"], default=None,
                    help="`rcoa run --memory-pool` (CUDA; compact without it; docs/memory-pool.md)")
    ap.add_argument("--cold", action="store_true", help="rcoa starts from an empty kernel cache")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--timeout", type=int, default=1800, help="seconds per engine run")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/rcoa-speed"))
    ap.add_argument("--worker", choices=["eager", "compile"], help=argparse.SUPPRESS)
    ap.add_argument("--shape", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        return torch_worker(a)
    shapes = [x for x in a.shapes.split(",") if x]
    for x in shapes:
        if x not in SHAPES:
            sys.exit(f"unknown shape `{x}`; the shapes are {', '.join(sorted(SHAPES))}")
    engines = [e for e in a.engines.split(",") if e]
    for e in engines:
        if e not in ("rcoa", "eager", "compile"):
            sys.exit(f"unknown engine `{e}`; the engines are rcoa, eager, compile")
    os.makedirs(a.out, exist_ok=True)
    results = []
    for shape in shapes:
        s = SHAPES[shape]
        rows = {}
        for e in engines:
            rows[e] = run_rcoa(a, shape, a.out) if e == "rcoa" else run_torch(a, shape, e)
        name = next((r.get("device_name") for r in rows.values() if r.get("device_name")), a.device)
        peak = a.peak_tflops or next((v for k, v in PEAKS.items() if k in name), None)
        if a.device == "cpu":
            peak = None
        print(f"\n{shape}: {matmul_params(s) / 1e6:,.1f} M matmul params, batch {s['batch']} x seq {s['seq']}, "
              f"fp32 weights + bf16 compute, AdamW, {a.steps} steps on {name}")
        print(f"  {'engine':34} {'step s':>8} {'tokens/s':>10} {'first s':>8} {'peak GiB':>9} {'resv GiB':>9} {'MFU':>6}")
        for e, r in rows.items():
            r["shape"] = shape
            if "error" in r:
                print(f"  {r['engine']:34} failed: {' | '.join(r['error'])}")
                continue
            mfu = flops_per_token(s) * r["tokens_per_second"] / (peak * 1e12) if peak else None
            r["mfu"] = mfu
            print(f"  {r['engine']:34} {r['steady_step_seconds']:8.4f} {r['tokens_per_second']:10.0f} "
                  f"{r['first_step_seconds']:8.2f} {gib(r['peak_bytes']):>9} {gib(r['reserved_bytes']):>9} "
                  f"{'n/a' if mfu is None else f'{mfu:.1%}':>6}")
        rc = rows.get("rcoa", {})
        if "tokens_per_second" in rc:
            if rc.get("predicted_peak_bytes") and rc.get("peak_bytes"):
                print(f"  rcoa predicted peak {gib(rc['predicted_peak_bytes'])} GiB, measured {gib(rc['peak_bytes'])} GiB "
                      f"({rc['predicted_peak_bytes'] / rc['peak_bytes'] - 1:+.1%})")
            if rc.get("reserved_bytes") and rc.get("peak_bytes"):
                print(f"  rcoa reserved / sampled peak: {rc['reserved_bytes'] / rc['peak_bytes']:.3f}")
                # The run samples between segments (layers, the loss), so its peak misses what
                # lives only inside one: the loss's fp32 log-softmax, the flash backward's
                # scratch. The pool's pages cover those too; the model knows their bytes.
                transients = (rc.get("predicted_in_use_max_bytes") or 0) - (rc.get("predicted_peak_bytes") or 0)
                if rc.get("predicted_in_use_max_bytes") and transients >= 0:
                    highest = rc["peak_bytes"] + transients
                    print(f"  rcoa reserved / highest in use: {rc['reserved_bytes'] / highest:.3f} "
                          f"(the sampled peak measured, plus the model's {gib(transients)} GiB inside segments)")
            for e in ("eager", "compile"):
                t = rows.get(e, {})
                if "tokens_per_second" in t:
                    line = f"  rcoa / {t['engine']}: tokens/s x{rc['tokens_per_second'] / t['tokens_per_second']:.3f}"
                    if t.get("peak_bytes") and rc.get("peak_bytes"):
                        line += f", peak x{rc['peak_bytes'] / t['peak_bytes']:.3f}"
                    print(line)
        results.extend(rows.values())
    with open(os.path.join(a.out, "speed.jsonl"), "w") as f:
        for r in results:
            f.write(json.dumps(r) + "\n")
    print(f"\nraw results: {a.out}/speed.jsonl")
    if any("error" in r for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
