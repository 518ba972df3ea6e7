"""What PyTorch autograd keeps for the backward of small modules.

Counts every tensor packed by `torch.autograd.graph.saved_tensors_hooks`
during a forward, deduplicated by storage (a tensor saved by two ops, or a
parameter, is one buffer), and prints which forward tensors they are. The
memory model (`compiler/src/memory/build.rs`) follows these facts; run it to
check a claim there:

    python tools/saved_tensors.py

CPU only; torch >= 2.0.
"""

import torch
import torch.nn.functional as F


def saved(fn, named):
    """Run `fn()`; return the names (from `named`) of the tensors autograd saved.

    Unknown saved tensors are reported by shape, so nothing kept is missed.
    """
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    seen, names = set(), []
    for t in packed:
        key = t.untyped_storage().data_ptr()
        if key in seen:
            continue
        seen.add(key)
        name = next(
            (n for n, v in named().items() if v is not None and v.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()),
            f"<unnamed {tuple(t.shape)} {t.dtype}>",
        )
        names.append(name)
    return out, names


def sac():
    """torchtitan's op-level selective recomputation (`selective_ac_option = "op"`):
    its policy keeps the outputs of ops on the save list "except every second mm",
    counting `aten.mm` per layer forward. In a Llama block (q, k, v, o, w1, w3, w2)
    that keeps the 1st, 3rd, 5th and 7th matmuls. `F.linear` with a bias dispatches
    `aten.addmm`, which is not on the list: a biased projection is neither kept nor
    counted."""
    from collections import defaultdict

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 8, 16, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    b = torch.randn(32, requires_grad=True)
    with Ops() as plain:
        F.linear(x, w)
    with Ops() as biased:
        F.linear(x, w, b)
    assert torch.ops.aten.mm.default in plain.ops, plain.ops
    assert torch.ops.aten.addmm.default in biased.ops, biased.ops
    assert torch.ops.aten.mm.default not in biased.ops, biased.ops
    print("F.linear dispatches: no bias -> aten.mm, bias -> aten.addmm")

    save_list = {torch.ops.aten.mm.default}
    kept = []

    def context():
        meta = defaultdict(int)

        def policy(ctx, func, *args, **kwargs):
            mode = "recompute" if ctx.is_recompute else "forward"
            if func == torch.ops.aten.mm.default:
                meta[mode] += 1
            save = func in save_list and not (
                func == torch.ops.aten.mm.default and meta[mode] % 2 == 0
            )
            if save and not ctx.is_recompute:
                kept.append(meta[mode])
            return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE

        return create_selective_checkpoint_contexts(policy)

    ws = [torch.randn(16, 16, requires_grad=True) for _ in range(7)]

    def block(h):
        q, k, v = (F.linear(h, w) for w in ws[:3])
        o = F.linear(q + k + v, ws[3])
        return F.linear(F.silu(F.linear(o, ws[4])) * F.linear(o, ws[5]), ws[6])

    y = checkpoint(block, x[..., :16], use_reentrant=False, context_fn=context)
    y.sum().backward()
    print("torchtitan op-SAC keeps the outputs of matmuls", kept, "of 7")
    assert kept == [1, 3, 5, 7], kept


def main():
    torch.manual_seed(0)
    tokens, h, f = 8, 16, 64
    x = torch.randn(tokens, h, requires_grad=True)
    w1 = torch.randn(f, h, requires_grad=True)
    b1 = torch.randn(f, requires_grad=True)
    w2 = torch.randn(h, f, requires_grad=True)
    b2 = torch.randn(h, requires_grad=True)
    env = {}

    def named():
        return dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2, **env)

    # F.linear with a bias: the bias' gradient is a sum of the output gradient,
    # so nothing more than F.linear without one is saved (x and w).
    def linear_bias():
        env["y"] = F.linear(x, w1, b1)
        return env["y"]

    _, s = saved(linear_bias, named)
    print("F.linear(x, w, b) saves:", sorted(s))
    assert sorted(s) == ["w1", "x"], s

    def linear_nobias():
        return F.linear(x, w1)

    _, s = saved(linear_nobias, named)
    print("F.linear(x, w) saves:", sorted(s))
    assert sorted(s) == ["w1", "x"], s

    # Megatron's squared_relu: `torch.pow(F.relu(x), 2)`. relu saves its output
    # `r`, pow saves its input (`r` again: one buffer), the second matmul its
    # input `a`: two [tokens, ffn] tensors, as many as a GELU MLP keeps.
    def squared_relu_mlp():
        env["h"] = F.linear(x, w1, b1)
        env["r"] = F.relu(env["h"])
        env["a"] = torch.pow(env["r"], 2)
        env["y"] = F.linear(env["a"], w2, b2)
        return env["y"]

    _, s = saved(squared_relu_mlp, named)
    print("linear -> relu -> pow 2 -> linear saves:", sorted(s))
    assert sorted(s) == ["a", "r", "w1", "w2", "x"], s

    # The same with `relu(x) ** 2` spelled as the operator.
    def squared_relu_op():
        env["h"] = F.linear(x, w1, b1)
        env["r"] = F.relu(env["h"])
        env["a"] = env["r"] ** 2
        return env["a"]

    _, s = saved(squared_relu_op, named)
    print("relu(h) ** 2 saves:", sorted(s))
    assert sorted(s) == ["r", "w1", "x"], s

    # GELU for comparison: saves its input `h` (relu's backward needs only its output).
    def gelu_mlp():
        env["h"] = F.linear(x, w1, b1)
        env["a"] = F.gelu(env["h"])
        return F.linear(env["a"], w2, b2)

    _, s = saved(gelu_mlp, named)
    print("linear -> gelu -> linear saves:", sorted(s))
    assert sorted(s) == ["a", "h", "w1", "w2", "x"], s
    sac()
    print("ok")


if __name__ == "__main__":
    main()
