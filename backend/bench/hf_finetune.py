"""A fine-tune of a >= 1B-parameter Hugging Face checkpoint with `rcoa run`, checked with `transformers`
(issue 16, on a GPU machine that has no network).

    python3 backend/bench/hf_finetune.py make WORK [--layers 24]
        WORK/model: a Llama of TinyLlama-1.1B's widths (hidden 2048, 32 heads, 4 KV heads,
        ffn 5632) with --layers layers (24: 1.06B parameters), random init (seed 0), saved by
        `save_pretrained` in bf16 as `model.safetensors` shards, with the llama fixture's
        tokenizer (tests/fixtures/hf/llama, a 259-token BPE); WORK/train.jsonl and
        WORK/eval.jsonl (sentences of the fixture's grammar); WORK/finetune.plan.
    rcoa run WORK/finetune.plan --device cuda --data WORK/train.jsonl --eval WORK/eval.jsonl \
        --eval-every 10 --steps 30 --save WORK/saved --format json > WORK/run.jsonl
    python3 backend/bench/hf_finetune.py check WORK
        Loads WORK/model and WORK/saved with AutoModelForCausalLM (fp32, on the GPU), computes the
        eval loss under the pinned causal convention (tools/hf_fixtures/README.md) and prints it
        beside rcoa's first eval (the weights in) and last eval (the weights out), as JSON.
"""
import json
import os
import shutil
import sys

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf", "llama")
# The fixtures' sentence grammar and the pinned causal evaluation (tools/hf_fixtures/README.md).
sys.path.insert(0, os.path.join(ROOT, "tools", "hf_fixtures"))
SEQ = 512

PLAN = """# A fine-tune of WORK/model (backend/bench/hf_finetune.py): bf16 autocast, fp32 master.
model hf "model"

hardware {{ gpu = h100-80gb }}

precision {{ params = fp32  compute = bf16  master = fp32 }}

optimizer adamw {{ lr = 1e-4  betas = (0.9, 0.95)  weight_decay = 0.0 }}

train {{
  seq_len = {seq}
  global_batch = 8
  micro_batch = 8
  loss = causal_lm
  attention = eager
}}

fit {{ checkpoint = full }}

target burn
"""


def make(work, layers):
    import torch
    from make_fixtures import corpus
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(work, exist_ok=True)
    base = json.load(open(os.path.join(FIXTURE, "config.json")))
    cfg = LlamaConfig(
        vocab_size=base["vocab_size"], hidden_size=2048, intermediate_size=5632,
        num_hidden_layers=layers, num_attention_heads=32, num_key_value_heads=4,
        max_position_embeddings=2048, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=base["bos_token_id"], eos_token_id=base["eos_token_id"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in model.parameters())
    out = os.path.join(work, "model")
    model.save_pretrained(out, max_shard_size="1GB")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(FIXTURE, f), out)
    for name, count, seed in (("train.jsonl", 20000, 1), ("eval.jsonl", 400, 2)):
        with open(os.path.join(work, name), "w") as f:
            for s in corpus(count, seed):
                f.write(json.dumps({"text": s}) + "\n")
    open(os.path.join(work, "finetune.plan"), "w").write(PLAN.format(seq=SEQ))
    print(json.dumps({"parameters": n, "layers": layers, "files": sorted(os.listdir(out))}))


def eval_loss(model_dir, work, eos):
    """The eval loss of the weights in `model_dir` on WORK/eval.jsonl, in fp32 on the GPU."""
    import torch
    from roundtrip import eval_loss as pinned_eval_loss
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    loss = pinned_eval_loss(model, os.path.join(FIXTURE, "tokenizer.json"),
                            os.path.join(work, "eval.jsonl"), SEQ, eos)
    del model
    torch.cuda.empty_cache()
    return loss


def check(work):
    eos = json.load(open(os.path.join(FIXTURE, "config.json")))["eos_token_id"]
    evals = []
    for line in open(os.path.join(work, "run.jsonl")):
        if line.startswith("{"):
            e = json.loads(line)
            if "eval_loss" in e and e.get("event") == "eval":
                evals.append(e)
    before = eval_loss(os.path.join(work, "model"), work, eos)
    after = eval_loss(os.path.join(work, "saved"), work, eos)
    out = {
        "transformers_before": before,
        "rcoa_before": evals[0]["eval_loss"] if evals else None,
        "transformers_after": after,
        "rcoa_after": evals[-1]["eval_loss"] if evals else None,
        "rcoa_evals": [(e["step"], e["eval_loss"]) for e in evals],
        "saved_files": sorted(os.listdir(os.path.join(work, "saved"))),
    }
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    if sys.argv[1] == "make":
        layers = int(sys.argv[sys.argv.index("--layers") + 1]) if "--layers" in sys.argv else 24
        make(sys.argv[2], layers)
    elif sys.argv[1] == "check":
        check(sys.argv[2])
    else:
        sys.exit(__doc__)
