"""TRL's `assistant_only_loss` on the llama fixture's tokenizer: which tokens of a
conversation are scored when only the assistant's turns are (`train {
assistant_only_loss = true }`).

Writes `tests/fixtures/hf/llama-marked/`: the llama fixture's tokenizer with a chat
template whose assistant turns sit in `{% generation %}` blocks (as TRL's training
templates have them), two JSONL files (conversations; conversational
prompt-completion) and `reference.json`. For each example the reference holds the ids
and `assistant_masks` that transformers' `apply_chat_template(...,
return_assistant_tokens_mask=True)` gives, and the labels TRL 1.x's `SFTTrainer` builds
from them: -100 where the prompt's own ids (rendered with the assistant's turn opened)
and the whole's agree (`completion_mask`), and -100 where the assistant mask is 0 (its
collator applies both). `variant` renders the conversations with a second template
whose blocks end inside a message's text, on a character of two bytes, so a mask that
counted bytes for characters would show.

TRL needs torch, which this reference does not: it runs the two steps of TRL's
`tokenize` and collator it depends on, with transformers alone:
    pip install transformers==5.23.0
    python tools/hf_fixtures/sft_assistant_reference.py
Not run in CI: backend tests read the committed output.
"""
import json
import os

import tokenizers
import transformers
from transformers import AutoTokenizer

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
FIXTURE = os.path.join(ROOT, "tests", "fixtures", "hf", "llama-marked")

# The assistant's text and its end-of-turn token inside the block, the role header
# outside; whitespace control on both tags, and one block tag on its own line
# (trim_blocks and lstrip_blocks).
CHAT_TEMPLATE = """{{- bos_token }}
{%- for message in messages %}
    {%- if message['role'] == 'assistant' %}
        {{- '<|assistant|>\\n' }}
        {%- generation %}
        {{- message['content'].strip() + eos_token }}
        {%- endgeneration %}
    {%- else %}
        {{- '<|' + message['role'] + '|>\\n' + message['content'].strip() + eos_token }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|assistant|>\\n' }}
{%- endif %}
"""

# Blocks without whitespace control, the end-of-turn token outside them.
VARIANT = """{% for m in messages %}<|{{ m['role'] }}|>
{% if m['role'] == 'assistant' %}
  {% generation %}
{{ m['content'] }}{% endgeneration %}
{{ eos_token }}{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}
{% endfor %}"""

CONVERSATIONS = [
    {"messages": [{"role": "user", "content": "the cat sat on"},
                  {"role": "assistant", "content": " a red mat. "},
                  {"role": "user", "content": "then it ran"},
                  {"role": "assistant", "content": "\u00e9t\u00e9 under a green tree"}]},
    {"messages": [{"role": "system", "content": "be happy"},
                  {"role": "user", "content": "a small bird"},
                  {"role": "assistant", "content": "flew to the caf\u00e9"}]},
    {"messages": [{"role": "user", "content": "the dog"},
                  {"role": "assistant", "content": "ran quickly."}]},
]

CHAT_PROMPTS = [
    {"prompt": [{"role": "user", "content": "the blue house was"},
                {"role": "assistant", "content": "sad."},
                {"role": "user", "content": "and then"}],
     "completion": [{"role": "assistant", "content": "it was happy."}]},
    {"prompt": [{"role": "user", "content": "the dog"}],
     "completion": [{"role": "assistant", "content": "ran under the caf\u00e9 tree."}]},
]


def example(tok, messages, prompt=None, template=None):
    kw = {"chat_template": template} if template else {}
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True,
                                  return_assistant_tokens_mask=True, **kw)
    ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    assert 1 in mask, "TRL raises: an example with no assistant tokens"
    start = 0
    if prompt is not None:
        p = tok.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True,
                                    return_dict=True, **kw)["input_ids"]
        while start < min(len(p), len(ids)) and p[start] == ids[start]:
            start += 1
    labels = [t if (i >= start and m) else -100 for i, (t, m) in enumerate(zip(ids, mask))]
    return {"input_ids": ids, "assistant_masks": mask, "labels": labels}


def main():
    with open(os.path.join(FIXTURE, "chat_template.jinja"), "w") as f:
        f.write(CHAT_TEMPLATE)
    tok = AutoTokenizer.from_pretrained(FIXTURE)
    for name, rows in [("conversations", CONVERSATIONS), ("prompts", CHAT_PROMPTS)]:
        with open(os.path.join(FIXTURE, f"{name}.jsonl"), "w") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    ref = {
        "versions": {"transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
        "conversations": [example(tok, r["messages"]) for r in CONVERSATIONS],
        "prompts": [example(tok, r["prompt"] + r["completion"], prompt=r["prompt"]) for r in CHAT_PROMPTS],
        "variant_template": VARIANT,
        "variant": [dict(example(tok, r["messages"], template=VARIANT),
                         text=tok.apply_chat_template(r["messages"], tokenize=False, chat_template=VARIANT))
                    for r in CONVERSATIONS],
    }
    with open(os.path.join(FIXTURE, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1, ensure_ascii=False)
        f.write("\n")
    for k in ("conversations", "prompts", "variant"):
        print(k, [sum(e["assistant_masks"]) for e in ref[k]], [sum(l != -100 for l in e["labels"]) for e in ref[k]])


if __name__ == "__main__":
    main()
