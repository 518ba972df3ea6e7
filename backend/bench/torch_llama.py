"""PyTorch eager baseline for backend/bench/vs_pytorch.sh: the llama350m_eager shape of
tests/groundtruth (Hugging Face LlamaForCausalLM, eager attention, fp32 weights,
bf16 autocast, AdamW) trained on random tokens; prints one JSON line with the median
step time of steps 2..N, measured with CUDA synchronisation around each step."""
import argparse, json, statistics, time
import torch
from transformers import LlamaConfig, LlamaForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=20)
p.add_argument("--attn", default="eager", choices=["eager", "sdpa"])
p.add_argument("--layers", type=int, default=24)
p.add_argument("--hidden", type=int, default=1024)
p.add_argument("--heads", type=int, default=16)
p.add_argument("--ffn", type=int, default=2816)
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=1024)
a = p.parse_args()

torch.manual_seed(0)
cfg = LlamaConfig(hidden_size=a.hidden, num_hidden_layers=a.layers, num_attention_heads=a.heads,
                  num_key_value_heads=a.heads, intermediate_size=a.ffn, vocab_size=32000,
                  max_position_embeddings=2048, tie_word_embeddings=False)
cfg._attn_implementation = a.attn
model = LlamaForCausalLM(cfg).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
times = []
for step in range(a.steps):
    ids = torch.randint(0, 32000, (a.batch, a.seq), device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t0)
steady = statistics.median(times[1:])
print(json.dumps({"event": "summary", "engine": f"pytorch {torch.__version__} {a.attn}",
                  "steady_step_seconds": steady, "tokens_per_second": a.batch * a.seq / steady,
                  "steps": a.steps, "peak_allocated_bytes": torch.cuda.max_memory_allocated()}))
