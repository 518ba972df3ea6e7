"""Three Adam-mini steps of the `llama` fixture in transformers with the
authors' package (`adam-mini` 1.1.1), one reference window per step, then
the loss of every reference window: `tests/fixtures/hf/llama/adam_mini.json`,
which `backend/tests/adam_mini_steps.rs` reproduces with rcoa's model and
optimizer (the blocks found from rcoa's module paths, the package's from the
transformers names).

    python tools/hf_fixtures/adam_mini_steps.py [tests/fixtures/hf/llama]
"""
import json
import sys
from pathlib import Path

import torch
from adam_mini import Adam_mini
from transformers import AutoModelForCausalLM

HYPER = {"lr": 2e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1}


def main():
    d = Path(sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf/llama")
    windows = json.loads((d / "reference.json").read_text())["windows"]
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    model.train()
    cfg = model.config
    opt = Adam_mini(
        named_parameters=model.named_parameters(),
        lr=HYPER["lr"],
        betas=tuple(HYPER["betas"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        dim=cfg.hidden_size,
        n_heads=cfg.num_attention_heads,
        n_kv_heads=cfg.num_key_value_heads,
        verbose=False,
    )
    stepped = windows[:3]
    losses = []
    for w in stepped:
        ids = torch.tensor([w])
        loss = model(input_ids=ids, labels=ids).loss
        losses.append(loss.item())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    with torch.no_grad():
        after = [model(input_ids=torch.tensor([w]), labels=torch.tensor([w])).loss.item() for w in windows]
    out = {
        "hyper": HYPER,
        "windows": stepped,
        "step_losses": losses,
        "after": {"windows": windows, "losses": after},
        "versions": {"torch": torch.__version__, "adam-mini": "1.1.1"},
    }
    (d / "adam_mini.json").write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({"step_losses": losses, "after": after}))


if __name__ == "__main__":
    main()
