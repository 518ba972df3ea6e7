"""Three steps of the Adam-mini reference (`pip install adam-mini==1.1.1`,
the authors' package) over a small Llama-named parameter set, printed as the
Rust constants of `backend/src/optim/adam_mini.rs`'s test
`three_steps_match_the_reference`.

Every parameter and gradient is a formula of its index (`value`), so the
Rust test rebuilds the same tensors without reading a file. Torch's layout
is `[out, in]`; rcoa's linear weights are `[in, out]`, the test transposes.

    python tools/adam_mini_reference.py
"""
import math

import numpy as np
import torch
from adam_mini import Adam_mini

# name, torch shape
PARAMS = [
    ("model.embed_tokens.weight", (6, 4)),
    ("model.layers.0.self_attn.q_proj.weight", (4, 4)),  # 2 heads of 2
    ("model.layers.0.self_attn.k_proj.weight", (2, 4)),  # 1 kv head
    ("model.layers.0.self_attn.v_proj.weight", (2, 4)),
    ("model.layers.0.self_attn.q_proj.bias", (4,)),
    ("model.layers.0.input_layernorm.weight", (4,)),
    ("model.layers.0.mlp.down_proj.weight", (4, 3)),
    ("lm_head.weight", (6, 4)),
]


def value(k, i, t):
    """Parameter `k`'s value `i` (row-major in torch's layout) at step `t` (0: the
    initial weight, 1..: the gradients)."""
    return math.sin(0.7 * i + 1.3 * k + 0.5 * t) * (1.0 + 0.1 * k)


def tensor(k, shape, t):
    n = math.prod(shape)
    return torch.tensor([value(k, i, t) for i in range(n)], dtype=torch.float32).reshape(shape)


def main():
    params = [(name, torch.nn.Parameter(tensor(k, shape, 0))) for k, (name, shape) in enumerate(PARAMS)]
    opt = Adam_mini(
        named_parameters=params,
        lr=1e-2,
        betas=(0.9, 0.95),
        eps=1e-8,
        weight_decay=0.1,
        dim=4,
        n_heads=2,
        n_kv_heads=1,
        verbose=False,
    )
    for t in (1, 2, 3):
        for k, (name, p) in enumerate(params):
            p.grad = tensor(k, tuple(p.shape), t)
        opt.step()
    print("// tools/adam_mini_reference.py: the weights after three steps, torch's layout")
    print("const REFERENCE: &[&[f32]] = &[")
    for name, p in params:
        # The shortest decimal that reads back as the same f32.
        vals = ", ".join(str(np.float32(v)) for v in p.detach().flatten().tolist())
        print(f"    // {name}")
        print(f"    &[{vals}],")
    print("];")


if __name__ == "__main__":
    main()
