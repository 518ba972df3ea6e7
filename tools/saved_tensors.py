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
    print("ok")


if __name__ == "__main__":
    main()
