"""Round trip of rcoa's saved weights through `transformers` and `peft`.

rcoa trains the tiny fixtures of tests/fixtures/hf/ for a few steps and saves
them (`rcoa run --save`): a full fine-tune (sharded on purpose), LoRA
adapters (PEFT's layout) and the same adapters merged (`--merge-lora`). This
script loads each folder the way a user would — `AutoModelForCausalLM` /
`AutoModel.from_pretrained` for full and merged weights, `PeftModel` for the
adapters, and `from_pretrained(adapter_dir)` through transformers' own PEFT
integration — and prints their losses (causal) or embeddings (XLM-R) next to
what rcoa reports for the same weights.

Run with a Python that has torch, transformers, peft, safetensors and
tokenizers, from the repository root:
    python tools/hf_fixtures/roundtrip.py [--rcoa target/debug/rcoa] [--steps 20]
                                          [--record tests/fixtures/hf/roundtrip]
                                          [--only CASE,CASE]
`--only` runs those cases; recorded, they replace their own entries of an
existing roundtrip.json and leave the others as they are.
`--record` copies the Hugging Face files of each save (not rcoa's own
model.bin / optimizer.bin) and roundtrip.json (what transformers and peft
computed) into that folder; backend/tests/hf_weights.rs checks rcoa against it
in CI. Not run in CI itself.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import peft
import safetensors
import tokenizers
import torch
import transformers
from peft import PeftModel
from transformers import AutoModel, AutoModelForCausalLM

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURES = os.path.join(ROOT, "tests", "fixtures", "hf")

# name, fixture, loss, adapter (None: full fine-tune), extra `rcoa run` flags
CASES = [
    ("llama-full", "llama", "causal_lm", None, ["--max-shard-size", "150KB"]),
    ("llama-lora", "llama", "causal_lm", "rank = 4 alpha = 8 targets = [q, k, v, o, gate, up, down]", []),
    ("gpt2-lora", "gpt2", "causal_lm", "rank = 4 alpha = 16 targets = [q, v, o]", []),
    ("xlmr-lora", "xlmr", "contrastive", "rank = 4 alpha = 8 targets = [q, v, down]", []),
    # Qwen2's q, k and v biases (kept in the base under LoRA); Llama 3.1's RoPE rescaling.
    ("qwen2-full", "qwen2", "causal_lm", None, []),
    ("qwen2-lora", "qwen2", "causal_lm", "rank = 4 alpha = 8 targets = [q, k, v, o]", []),
    ("llama3-rope-full", "llama3-rope", "causal_lm", None, []),
    # Qwen3's norms over each head of q and k (frozen in the base under LoRA).
    ("qwen3-full", "qwen3", "causal_lm", None, []),
    ("qwen3-lora", "qwen3", "causal_lm", "rank = 4 alpha = 8 targets = [q, k, v, o, gate, up, down]", []),
    # Phi-3's fused `qkv_proj` and `gate_up_proj`: the adapters of q and v (k's rows of
    # lora_B zero) and of gate (up's half zero) become one LoRA per fused module.
    ("phi3-full", "phi3", "causal_lm", None, []),
    ("phi3-lora", "phi3", "causal_lm", "rank = 4 alpha = 8 targets = [q, v, gate, down]", []),
    # Phi-4-mini's RoPE: half of each head rotated, LongRoPE's factors and attention factor.
    ("phi3-longrope-full", "phi3-longrope", "causal_lm", None, []),
    # Mistral v0.1's sliding window, shorter than the sequence.
    ("mistral-window-full", "mistral-window", "causal_lm", None, []),
]
# Files a recorded save keeps (rcoa's own record and state stay out).
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "special_tokens_map.json", "adapter_config.json", "adapter_model.safetensors",
            "model.safetensors", "model.safetensors.index.json")


def plan_text(fixture, loss, adapter):
    lines = [f'model hf "{os.path.join(FIXTURES, fixture)}"']
    if adapter:
        lines.append(f"adapter lora {{ {adapter} dropout = 0.0 }}")
    lines += [
        "hardware { gpu = h100-80gb }",
        "precision fp32",
        "optimizer adamw { lr = 1e-2 }",
        f"train {{ seq_len = 16 global_batch = 4 micro_batch = 4 loss = {loss} }}",
        "target burn",
    ]
    return "\n".join(lines) + "\n"


def rcoa(binary, args):
    """Run rcoa with --format json; return its JSON lines."""
    out = subprocess.run([binary, *args, "--format", "json"], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"rcoa {' '.join(args)} failed ({out.returncode}):\n{out.stderr}")
    return [json.loads(l) for l in out.stdout.splitlines() if l.startswith("{")]


def train(binary, work, name, fixture, loss, adapter, extra, steps, merge=False):
    plan = os.path.join(work, f"{name}.plan")
    with open(plan, "w") as f:
        f.write(plan_text(fixture, loss, adapter))
    out = os.path.join(work, name + ("-merged" if merge else ""))
    args = ["run", plan, "--steps", str(steps), "--seed", "5", "--save", out, *extra]
    if merge:
        args.append("--merge-lora")
    lines = rcoa(binary, args)
    losses = [l["loss"] for l in lines if "step" in l and "loss" in l]
    return out, plan, losses


def rcoa_eval(binary, saved, fixture, loss, work):
    """rcoa's own eval loss of a saved full/merged folder (`rcoa eval`), or
    None where this rcoa has no `eval` subcommand yet."""
    plan = os.path.join(work, os.path.basename(saved) + "-eval.plan")
    with open(plan, "w") as f:
        f.write(plan_text(fixture, loss, None).replace(os.path.join(FIXTURES, fixture), saved))
    try:
        lines = rcoa(binary, ["eval", plan, "--data", os.path.join(FIXTURES, fixture, "eval.jsonl")])
    except RuntimeError as e:
        if "unrecognized subcommand" in str(e) or "unexpected argument" in str(e):
            return None
        raise
    for l in lines:
        if "eval_loss" in l:
            return l["eval_loss"]
    return None


@torch.no_grad()
def window_losses(model, windows):
    ids = [torch.tensor([w], device=model.device) for w in windows]
    return [model(input_ids=w, labels=w).loss.item() for w in ids]


@torch.no_grad()
def eval_loss(model, tokenizer_json, eval_jsonl, seq, eos):
    """The pinned causal convention: tokenizer(text) + EOS, concatenated, cut
    into consecutive seq-token windows (remainder dropped), mean loss."""
    tok = tokenizers.Tokenizer.from_file(tokenizer_json)
    ids = []
    for line in open(eval_jsonl):
        ids += tok.encode(json.loads(line)["text"]).ids + [eos]
    wins = [ids[i * seq:(i + 1) * seq] for i in range(len(ids) // seq)]
    losses = window_losses(model, wins)
    return sum(losses) / len(losses)


@torch.no_grad()
def embeddings(model, ref):
    ids = torch.tensor(ref["input_ids"])
    mask = torch.tensor(ref["attention_mask"])
    h = model(input_ids=ids, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).to(h.dtype)
    e = (h * m).sum(1) / m.sum(1)
    return torch.nn.functional.normalize(e, dim=-1).tolist()


def max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rcoa", default=os.path.join(ROOT, "target", "debug", "rcoa"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--work", default=None, help="keep the saves here (default: a temporary folder)")
    ap.add_argument("--record", default=None, help="copy the saves and roundtrip.json here")
    ap.add_argument("--only", default=None, help="comma-separated case names")
    a = ap.parse_args()
    cases = [c for c in CASES if a.only is None or c[0] in a.only.split(",")]
    work = a.work or tempfile.mkdtemp(prefix="rcoa-roundtrip-")
    os.makedirs(work, exist_ok=True)
    torch.manual_seed(0)
    results = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, "safetensors": safetensors.__version__,
                     "tokenizers": tokenizers.__version__},
        "steps": a.steps,
        "cases": {},
    }
    ok = True
    for name, fixture, loss, adapter, extra in cases:
        ref = json.load(open(os.path.join(FIXTURES, fixture, "reference.json")))
        fixdir = os.path.join(FIXTURES, fixture)
        saved, plan, train_losses = train(a.rcoa, work, name, fixture, loss, adapter, extra, a.steps)
        case = {"fixture": fixture, "rcoa_train_losses": train_losses, "files": sorted(os.listdir(saved))}
        causal = loss == "causal_lm"
        Auto = AutoModelForCausalLM if causal else AutoModel

        def measure(model):
            model.eval()
            if causal:
                cfg = json.load(open(os.path.join(fixdir, "config.json")))
                eos = cfg["eos_token_id"]
                eos = eos[0] if isinstance(eos, list) else eos
                return {"window_losses": window_losses(model, ref["windows"]),
                        "eval_loss": eval_loss(model, os.path.join(saved, "tokenizer.json"),
                                               os.path.join(fixdir, "eval.jsonl"), ref["seq_len"], eos)}
            return {"embeddings": embeddings(model, ref)}

        if adapter is None:
            case["transformers"] = measure(Auto.from_pretrained(saved))
            case["rcoa_eval_loss"] = rcoa_eval(a.rcoa, saved, fixture, loss, work) if causal else None
        else:
            base = Auto.from_pretrained(fixdir)
            case["peft"] = measure(PeftModel.from_pretrained(base, saved))
            # transformers' own PEFT integration: the folder alone.
            case["transformers_adapter"] = measure(Auto.from_pretrained(saved))
            merged, _, merged_losses = train(a.rcoa, work, name, fixture, loss, adapter, extra,
                                             a.steps, merge=True)
            case["merged_same_training"] = merged_losses == train_losses
            case["transformers_merged"] = measure(Auto.from_pretrained(merged))
            case["rcoa_eval_loss"] = rcoa_eval(a.rcoa, merged, fixture, loss, work) if causal else None
        results["cases"][name] = case

        # Print and check what must agree.
        main_key = "transformers" if adapter is None else "peft"
        got = case[main_key]
        if causal:
            line = f"{name:11s} {main_key} eval_loss {got['eval_loss']:.6f}"
            for k in ("transformers_adapter", "transformers_merged"):
                if k in case:
                    d = abs(case[k]["eval_loss"] - got["eval_loss"])
                    line += f" | {k} {case[k]['eval_loss']:.6f} (diff {d:.1e})"
                    ok &= d < 1e-5
            r = case["rcoa_eval_loss"]
            line += f" | rcoa eval {r:.6f} (diff {abs(r - got['eval_loss']):.1e})" if r is not None \
                else " | rcoa eval: not in this build (CI test checks windows)"
            if r is not None:
                ok &= abs(r - got["eval_loss"]) < 2e-3
        else:
            line = f"{name:11s} peft embeddings"
            for k in ("transformers_adapter", "transformers_merged"):
                d = max_diff(case[k]["embeddings"], got["embeddings"])
                line += f" | {k} max diff {d:.1e}"
                ok &= d < 1e-5
        line += f" | rcoa train loss {train_losses[0]:.4f} -> {train_losses[-1]:.4f}"
        if "merged_same_training" in case:
            ok &= case["merged_same_training"]
        print(line)

    if a.record:
        os.makedirs(a.record, exist_ok=True)
        for name, fixture, loss, adapter, _ in cases:
            for suffix in ([""] if adapter is None else ["", "-merged"]):
                src = os.path.join(work, name + suffix)
                if suffix == "-merged" and fixture not in ("gpt2", "phi3"):
                    continue  # the fused modules' merged saves are enough in the repo
                dst = os.path.join(a.record, name + suffix)
                shutil.rmtree(dst, ignore_errors=True)
                os.makedirs(dst)
                for f in os.listdir(src):
                    if f in HF_FILES or f.startswith("model-"):
                        shutil.copy(os.path.join(src, f), dst)
                cfg = os.path.join(dst, "adapter_config.json")
                if os.path.exists(cfg):
                    # The base as the repository names it, not this machine's path.
                    c = json.load(open(cfg))
                    c["base_model_name_or_path"] = f"tests/fixtures/hf/{fixture}"
                    json.dump(c, open(cfg, "w"), indent=2)
        for case in results["cases"].values():
            case.pop("files", None)
        record = os.path.join(a.record, "roundtrip.json")
        if a.only is not None and os.path.exists(record):
            old = json.load(open(record))
            old["cases"].update(results["cases"])
            old.setdefault("versions_by_case", {}).update(
                {name: results["versions"] for name in results["cases"]})
            results = old
        json.dump(results, open(os.path.join(a.record, "roundtrip.json"), "w"), indent=1)
        print("recorded in", a.record)
    print("round trip:", "ok" if ok else "MISMATCH")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
