"""Prompt-completion (supervised fine-tuning) reference for the llama fixture:
tests/fixtures/hf/llama/sft.jsonl and sft_reference.json.

TRL's SFTTrainer prepares the examples (EOS added to each completion, prompt and
completion tokenized together, `completion_mask` where the prompt's own ids and
the whole's part, cut to `max_length` 32, the seq_len of tests/fixtures/eval/llama-sft.plan); transformers
then computes the cross-entropy of every completion token (labels -100 on the
prompt), and the reference is their mean over the whole file, the convention
`rcoa eval` pins for such files. The token ids and labels TRL made are recorded
too, so a mismatch says whether tokenization or the loss differs.

Run with a Python that has torch, transformers, datasets and trl, from the
repository root:
    python tools/hf_fixtures/sft_reference.py
Not run in CI: tests/cli_eval.rs reads the committed output.
"""
import json
import os
import tempfile

import torch
import transformers
import trl
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import SFTConfig, SFTTrainer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf", "llama")
SEQ = 32

# Prompts and completions from the fixture corpus's words; the second runs past 32
# tokens (cut), the third's completion starts without a space (a seam merge).
EXAMPLES = [
    {"prompt": "the cat sat on", "completion": " a red mat."},
    {"prompt": "the dog ran under the big tree and then it was", "completion": " happy and the bird flew over the house quickly."},
    {"prompt": "a small bird", "completion": "flew."},
    {"prompt": "the blue house was", "completion": " sad."},
    {"prompt": "then it ran", "completion": " slowly under a green tree."},
    # Cut inside the prompt: no completion token within 32, dropped (by TRL too).
    {"prompt": "the cat and the dog and the bird sat on the mat under the tree", "completion": " then."},
]


def main():
    with open(os.path.join(FIXTURE, "sft.jsonl"), "w") as f:
        for e in EXAMPLES:
            f.write(json.dumps(e) + "\n")
    tok = AutoTokenizer.from_pretrained(FIXTURE)
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as out:
        cfg = SFTConfig(output_dir=out, max_length=SEQ, report_to=[], packing=False,
                        completion_only_loss=True, use_cpu=True)
        trainer = SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(EXAMPLES),
                             processing_class=tok)
        prepared = trainer.train_dataset
        # TRL 1.x folds `completion_mask` into `labels` (-100 on the prompt).
        rows = [(list(r["input_ids"])[:SEQ], list(r["labels"])[:SEQ]) for r in prepared]
    total, count = 0.0, 0
    for ids, labels in rows:
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0]
        lp = torch.log_softmax(logits.double(), -1)
        for p in range(len(ids) - 1):
            if labels[p + 1] != -100:
                total -= lp[p, labels[p + 1]].item()
                count += 1
    ref = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                        "trl": trl.__version__},
           "seq_len": SEQ, "input_ids": [r[0] for r in rows],
           "labels": [r[1] for r in rows], "scored": count, "loss": total / count}
    json.dump(ref, open(os.path.join(FIXTURE, "sft_reference.json"), "w"), indent=1)
    print("sft eval loss", total / count, "over", count, "completion tokens")


if __name__ == "__main__":
    main()
