"""Build the tiny Hugging Face fixtures under tests/fixtures/hf/ and their
reference.json (losses / embeddings computed by `transformers`).

Run with a Python that has torch, transformers, safetensors and tokenizers:
    python tools/hf_fixtures/make_fixtures.py [OUT_DIR [NAME ...]]
OUT_DIR defaults to tests/fixtures/hf; NAMEs (llama, mistral, gpt2, xlmr, qwen2,
qwen3, llama3-rope, phi3, phi3-longrope, mistral-window) build only those, each from its own seed, so adding a fixture leaves
the others' files as they are.
Not run in CI: the Rust tests read the committed output.
"""
import json
import os
import random
import sys

import torch
import transformers
import tokenizers
from tokenizers import Tokenizer, models, pre_tokenizers, trainers, processors, decoders
from transformers import (
    GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, MistralConfig,
    MistralForCausalLM, Phi3Config, Phi3ForCausalLM, PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
    Qwen3ForCausalLM, XLMRobertaConfig, XLMRobertaModel,
)

SEQ = 16
VOCAB = 256
STEPS = 300
torch.manual_seed(0)
random.seed(0)

WORDS = ("the cat dog bird sat ran flew on under over a red blue green mat tree "
         "house quickly slowly and then it was big small happy sad").split()


def sentence(rng):
    n = rng.randint(4, 10)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def corpus(n, seed):
    rng = random.Random(seed)
    return [sentence(rng) for _ in range(n)]


def bpe_tokenizer(texts, specials, template):
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.post_processor = template(tok)
    return tok


def causal_tokenizer(texts, family):
    # Llama / Mistral: <s> prepended (BOS) by the post-processor; GPT-2: none.
    if family == "gpt2":
        return bpe_tokenizer(texts, ["<|endoftext|>"], lambda t: processors.ByteLevel(trim_offsets=False)), \
            dict(eos="<|endoftext|>", bos="<|endoftext|>", pad=None)
    def tmpl(t):
        return processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                             special_tokens=[("<s>", t.token_to_id("<s>"))])
    return bpe_tokenizer(texts, ["<unk>", "<s>", "</s>"], tmpl), dict(eos="</s>", bos="<s>", pad=None)


def encoder_tokenizer(texts):
    def tmpl(t):
        return processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>",
            special_tokens=[("<s>", t.token_to_id("<s>")), ("</s>", t.token_to_id("</s>"))])
    return bpe_tokenizer(texts, ["<s>", "<pad>", "</s>", "<unk>"], tmpl)


def windows(tok, texts, eos_id):
    ids = []
    for t in texts:
        ids += tok.encode(t).ids + [eos_id]
    n = len(ids) // SEQ
    return [ids[i * SEQ:(i + 1) * SEQ] for i in range(n)]


def train_causal(model, wins):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.tensor(wins)
    model.train()
    for step in range(STEPS):
        idx = torch.randint(0, len(data), (8,))
        x = data[idx]
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    return loss.item()


@torch.no_grad()
def causal_loss(model, wins):
    return [model(input_ids=torch.tensor([w]), labels=torch.tensor([w])).loss.item() for w in wins]


def save_tokenizer(tok, out, extra):
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=extra["eos"],
                                   bos_token=extra.get("bos"), pad_token=extra.get("pad"),
                                   unk_token=extra.get("unk"))
    fast.save_pretrained(out)


def causal_fixture(name, model, family, out_root, save_kw):
    out = os.path.join(out_root, name)
    os.makedirs(out, exist_ok=True)
    train_texts = corpus(400, 1)
    tok, extra = causal_tokenizer(train_texts, family)
    eos = tok.token_to_id(extra["eos"])
    wins = windows(tok, train_texts, eos)
    final = train_causal(model, wins)
    eval_texts = corpus(12, 2)
    ref_wins = windows(tok, eval_texts, eos)[:4]
    # Eval under the pinned convention: tokenizer(text) + EOS, concatenated, cut.
    eval_wins = windows(tok, eval_texts, eos)
    with open(os.path.join(out, "eval.jsonl"), "w") as f:
        for t in eval_texts:
            f.write(json.dumps({"text": t}) + "\n")
    losses = causal_loss(model, ref_wins)
    eval_losses = causal_loss(model, eval_wins)
    model.save_pretrained(out, **save_kw)
    save_tokenizer(tok, out, extra)
    ref = {
        "family": family, "seq_len": SEQ, "train_final_loss": final,
        "windows": ref_wins, "losses": losses,
        "eval": {"file": "eval.jsonl", "seq_len": SEQ, "windows": len(eval_wins),
                 "loss": sum(eval_losses) / len(eval_losses)},
    }
    json.dump(ref, open(os.path.join(out, "reference.json"), "w"), indent=1)
    print(name, "train loss", final, "ref losses", losses)


def encoder_fixture(out_root):
    out = os.path.join(out_root, "xlmr")
    os.makedirs(out, exist_ok=True)
    texts = corpus(400, 3)
    tok = encoder_tokenizer(texts)
    pad = tok.token_to_id("<pad>")
    cfg = XLMRobertaConfig(vocab_size=tok.get_vocab_size(), hidden_size=64, num_hidden_layers=2,
                           num_attention_heads=4, intermediate_size=128,
                           max_position_embeddings=SEQ + pad + 1, pad_token_id=pad,
                           bos_token_id=tok.token_to_id("<s>"), eos_token_id=tok.token_to_id("</s>"),
                           layer_norm_eps=1e-5, type_vocab_size=1)
    model = XLMRobertaModel(cfg, add_pooling_layer=True)

    def encode(batch):
        enc = [tok.encode(t).ids[:SEQ] for t in batch]
        ids = torch.full((len(enc), SEQ), pad)
        mask = torch.zeros((len(enc), SEQ), dtype=torch.long)
        for i, e in enumerate(enc):
            ids[i, :len(e)] = torch.tensor(e)
            mask[i, :len(e)] = 1
        return ids, mask

    def embed(ids, mask):
        h = model(input_ids=ids, attention_mask=mask).last_hidden_state
        m = mask.unsqueeze(-1).float()
        e = (h * m).sum(1) / m.sum(1)
        return torch.nn.functional.normalize(e, dim=-1)

    # Contrastive training: a sentence and its words shuffled are a pair.
    rng = random.Random(5)
    def pair(t):
        w = t.rstrip(".").split()
        rng.shuffle(w)
        return " ".join(w) + "."
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.train()
    for step in range(STEPS):
        batch = rng.sample(texts, 8)
        q = embed(*encode(batch))
        p = embed(*encode([pair(t) for t in batch]))
        loss = torch.nn.functional.cross_entropy(q @ p.T / 0.05, torch.arange(8))
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    seqs = corpus(4, 6)
    ids, mask = encode(seqs)
    with torch.no_grad():
        emb = embed(ids, mask)
    eval_q = corpus(16, 7)
    eval_p = [pair(t) for t in eval_q]
    with open(os.path.join(out, "eval.jsonl"), "w") as f:
        for a, b in zip(eval_q, eval_p):
            f.write(json.dumps({"query": a, "positive": b}) + "\n")
    micro = 4
    losses = []
    with torch.no_grad():
        for i in range(0, len(eval_q) - micro + 1, micro):
            q = embed(*encode(eval_q[i:i + micro]))
            p = embed(*encode(eval_p[i:i + micro]))
            losses.append(torch.nn.functional.cross_entropy(q @ p.T / 0.05, torch.arange(micro)).item())
    model.save_pretrained(out, max_shard_size="100KB")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   pad_token="<pad>", unk_token="<unk>", cls_token="<s>",
                                   sep_token="</s>")
    fast.save_pretrained(out)
    ref = {"family": "xlm-roberta", "seq_len": SEQ, "train_final_loss": loss.item(),
           "input_ids": ids.tolist(), "attention_mask": mask.tolist(),
           "embeddings": emb.tolist(),
           "eval": {"file": "eval.jsonl", "seq_len": SEQ, "micro_batch": micro,
                    "temperature": 0.05, "loss": sum(losses) / len(losses)}}
    json.dump(ref, open(os.path.join(out, "reference.json"), "w"), indent=1)
    print("xlmr train loss", loss.item())


def main():
    out_root = sys.argv[1] if len(sys.argv) > 1 else "tests/fixtures/hf"
    only = set(sys.argv[2:])
    want = lambda name: not only or name in only
    print("torch", torch.__version__, "transformers", transformers.__version__,
          "tokenizers", tokenizers.__version__)
    probe, _ = causal_tokenizer(corpus(400, 1), "llama")
    v = probe.get_vocab_size()
    common = dict(vocab_size=v, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  bos_token_id=probe.token_to_id("<s>"), eos_token_id=probe.token_to_id("</s>"))
    if want("llama"):
        llama = LlamaForCausalLM(LlamaConfig(**common, rms_norm_eps=1e-6, rope_theta=500000.0,
                                             tie_word_embeddings=False))
        causal_fixture("llama", llama, "llama", out_root, {})
    if want("mistral"):
        mistral = MistralForCausalLM(MistralConfig(**common, rms_norm_eps=1e-5, rope_theta=10000.0,
                                                   sliding_window=4096, tie_word_embeddings=True))
        # bf16 on disk: the reference losses are those of the bf16-rounded weights.
        mistral_out = os.path.join(out_root, "mistral")
        causal_fixture("mistral", mistral, "mistral", out_root, {})
        m16 = MistralForCausalLM.from_pretrained(mistral_out, dtype=torch.bfloat16)
        m16.save_pretrained(mistral_out)
        m32 = MistralForCausalLM.from_pretrained(mistral_out, dtype=torch.float32).eval()
        ref = json.load(open(os.path.join(mistral_out, "reference.json")))
        ref["losses"] = causal_loss(m32, ref["windows"])
        ref["dtype_on_disk"] = "bfloat16"
        json.dump(ref, open(os.path.join(mistral_out, "reference.json"), "w"), indent=1)
    if want("gpt2"):
        gtok, _ = causal_tokenizer(corpus(400, 1), "gpt2")
        gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=gtok.get_vocab_size(), n_embd=64, n_layer=2,
                                          n_head=4, n_positions=64,
                                          bos_token_id=gtok.token_to_id("<|endoftext|>"),
                                          eos_token_id=gtok.token_to_id("<|endoftext|>")))
        causal_fixture("gpt2", gpt2, "gpt2", out_root, {})
    if want("xlmr"):
        encoder_fixture(out_root)
    if want("qwen2"):
        # Biases on q, k and v only; tied embeddings and base 1e6 as Qwen2.5-0.5B.
        torch.manual_seed(11)
        qwen2 = Qwen2ForCausalLM(Qwen2Config(**common, rms_norm_eps=1e-6, rope_theta=1000000.0,
                                             tie_word_embeddings=True, use_sliding_window=False))
        causal_fixture("qwen2", qwen2, "qwen2", out_root, {})
    if want("qwen3"):
        # Norms over each head of q and k; heads of 32 (4 x 32 = 128 ≠ hidden 64) as Qwen3's
        # head_dim need not be hidden / heads; untied, base 1e6.
        torch.manual_seed(13)
        qwen3 = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, rms_norm_eps=1e-6,
                                             rope_theta=1000000.0, tie_word_embeddings=False,
                                             use_sliding_window=False))
        causal_fixture("qwen3", qwen3, "qwen3", out_root, {})
    if want("llama3-rope"):
        # Llama 3.1's RoPE rescaling, with a pretraining length (64) that puts the head's
        # 8 frequencies in all three bands: 1 kept, 1 blended, 6 divided by the factor.
        torch.manual_seed(12)
        rope = dict(common, max_position_embeddings=512)
        llama3 = LlamaForCausalLM(LlamaConfig(
            **rope, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 64}))
        causal_fixture("llama3-rope", llama3, "llama", out_root, {})
    if want("phi3"):
        # q, k and v fused into `qkv_proj` (4 query heads and 2 key/value heads of 16: rows
        # of unequal parts), gate and up into `gate_up_proj`; Phi-3-mini-4k's window of
        # 2047 (no window within the fixture's 16 tokens), eps 1e-5, untied.
        torch.manual_seed(14)
        phi3 = Phi3ForCausalLM(Phi3Config(**common, rms_norm_eps=1e-5, rope_theta=10000.0,
                                          tie_word_embeddings=False, sliding_window=2047,
                                          pad_token_id=None))
        causal_fixture("phi3", phi3, "phi3", out_root, {})
    if want("mistral-window"):
        # A sliding window of 5 inside the 16-token windows: each token attends to itself
        # and the 4 before it (transformers' `kv > q - window`); `reference.json` adds the
        # losses of the same weights with the window off, which must differ.
        torch.manual_seed(16)
        windowed = MistralForCausalLM(MistralConfig(**common, rms_norm_eps=1e-5,
                                                    rope_theta=10000.0, sliding_window=5,
                                                    tie_word_embeddings=False))
        causal_fixture("mistral-window", windowed, "mistral", out_root, {})
        out = os.path.join(out_root, "mistral-window")
        ref = json.load(open(os.path.join(out, "reference.json")))
        unwindowed = MistralForCausalLM.from_pretrained(out, sliding_window=None).eval()
        ref["losses_without_window"] = causal_loss(unwindowed, ref["windows"])
        json.dump(ref, open(os.path.join(out, "reference.json"), "w"), indent=1)
    if want("phi3-longrope"):
        # Phi-4-mini's RoPE in small: half of each 16-value head rotated (4 pairs), LongRoPE
        # over a pretraining length of 8 of 64 positions (attention factor sqrt 2), tied as
        # Phi-4-mini. The 16-token windows use the long factors; their first 8 tokens
        # (`short_windows`) the short ones.
        torch.manual_seed(15)
        longrope = Phi3ForCausalLM(Phi3Config(
            **common, rms_norm_eps=1e-5, tie_word_embeddings=True, sliding_window=None,
            pad_token_id=None, original_max_position_embeddings=8,
            rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                             "partial_rotary_factor": 0.5,
                             "short_factor": [1.0, 1.3, 2.1, 3.7],
                             "long_factor": [1.2, 2.5, 6.0, 15.0]}))
        causal_fixture("phi3-longrope", longrope, "phi3", out_root, {})
        out = os.path.join(out_root, "phi3-longrope")
        saved = Phi3ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        ref = json.load(open(os.path.join(out, "reference.json")))
        ref["short_windows"] = [w[:8] for w in ref["windows"]]
        ref["short_losses"] = causal_loss(saved, ref["short_windows"])
        json.dump(ref, open(os.path.join(out, "reference.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
