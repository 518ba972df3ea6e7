"""Supervised fine-tuning references for the llama fixture, one per dataset
format of TRL: prompt-completion text (sft.jsonl, sft_reference.json),
conversations (sft_chat.jsonl, sft_chat_reference.json: the loss on every token,
TRL's default) and conversational prompt-completion (sft_chat_prompt.jsonl,
sft_chat_prompt_reference.json). The conversations are rendered by the chat
template this script writes beside the fixture (chat_template.jinja, as
transformers 5 saves one: whitespace control, `.strip()`, `raise_exception`).

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


CHAT_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant'] %}
        {{- raise_exception('Unknown role: ' + message['role']) }}
    {%- endif %}
    {{- '<|' + message['role'] + '|>\\n' + message['content'].strip() + eos_token }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\\n' }}
{%- endif %}
"""

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "the cat sat on"},
                  {"role": "assistant", "content": " a red mat. "}]},
    {"messages": [{"role": "system", "content": "be happy"},
                  {"role": "user", "content": "a small bird"},
                  {"role": "assistant", "content": "flew."}]},
    {"messages": [{"role": "user", "content": "then it ran"},
                  {"role": "assistant", "content": "slowly under a green tree and then it was sad."}]},
]

CHAT_PROMPTS = [
    {"prompt": [{"role": "user", "content": "the blue house was"}],
     "completion": [{"role": "assistant", "content": "sad."}]},
    {"prompt": [{"role": "system", "content": "be sad"}, {"role": "user", "content": "the dog"}],
     "completion": [{"role": "assistant", "content": "ran quickly."}]},
]


def reference(name, examples, model, tok, seq):
    with open(os.path.join(FIXTURE, f"{name}.jsonl"), "w") as f:
        for e in examples:
            f.write(json.dumps(e) + "\n")
    with tempfile.TemporaryDirectory() as out:
        cfg = SFTConfig(output_dir=out, max_length=seq, report_to=[], packing=False,
                        completion_only_loss=True, use_cpu=True)
        trainer = SFTTrainer(model=model, args=cfg, train_dataset=Dataset.from_list(examples),
                             processing_class=tok)
        # TRL 1.x folds `completion_mask` into `labels` (-100 on the prompt).
        rows = [(list(r["input_ids"])[:seq], list(r.get("labels", r["input_ids"]))[:seq])
                for r in trainer.train_dataset]
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
           "seq_len": seq, "input_ids": [r[0] for r in rows],
           "labels": [r[1] for r in rows], "scored": count, "loss": total / count}
    json.dump(ref, open(os.path.join(FIXTURE, f"{name}_reference.json"), "w"), indent=1)
    print(name, "eval loss", total / count, "over", count, "scored tokens")


def main():
    with open(os.path.join(FIXTURE, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(FIXTURE)
    model = AutoModelForCausalLM.from_pretrained(FIXTURE, dtype=torch.float32).eval()
    reference("sft", EXAMPLES, model, tok, SEQ)
    # The template's markers take many of this small tokenizer's tokens: 64 (the
    # seq_len of tests/fixtures/eval/llama-sft-chat.plan).
    reference("sft_chat", CONVERSATIONS, model, tok, 64)
    reference("sft_chat_prompt", CHAT_PROMPTS, model, tok, 64)


if __name__ == "__main__":
    main()
