#!/usr/bin/env python3
"""PyTorch's fused attention (SDPA) timed alone on one shape: what `benches/flash.rs` times
rcoa's kernels on, for the ratio between them (issue #13). Forward, then backward (dQ, dK,
dV), bf16, causal; median of 10 after 2 warm-up runs, with CUDA events. Prints milliseconds
and TFLOP/s counted as benches/flash.rs counts them.

    python3 backend/bench/sdpa_time.py [batch heads kv_heads seq head_dim]   # default 4 16 16 2048 64
"""
import sys

import torch
import torch.nn.functional as F


def main():
    args = [int(a) for a in sys.argv[1:]]
    b, h, kvh, s, d = args if len(args) == 5 else (4, 16, 16, 2048, 64)
    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    k = torch.randn(b, kvh, s, d, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    v = torch.randn(b, kvh, s, d, device=dev, dtype=torch.bfloat16, generator=g, requires_grad=True)
    d_o = torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, generator=g)
    gqa = {"enable_gqa": True} if kvh != h else {}

    def forward():
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, **gqa)

    def timed(fn):
        for _ in range(2):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[5]

    fwd = timed(lambda: forward())
    out = forward()

    def backward():
        torch.autograd.grad(out, (q, k, v), d_o, retain_graph=True)

    bwd = timed(backward)
    flops = 4.0 * b * h * s * s * d / 2.0
    print(f"pytorch {torch.__version__} SDPA, batch {b} x {h} heads ({kvh} kv) x seq {s} x head dim {d}, "
          f"causal, bf16, {torch.cuda.get_device_name()}")
    print(f"  forward  {fwd * 1e3:8.3f} ms {flops / fwd / 1e12:7.1f} TFLOP/s")
    print(f"  backward {bwd * 1e3:8.3f} ms {2.5 * flops / bwd / 1e12:7.1f} TFLOP/s")


if __name__ == "__main__":
    main()
