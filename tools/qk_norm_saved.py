"""What Qwen3's norms over each head of q and k add to what autograd keeps:
a Qwen3 decoder layer against a Llama layer of the same shape, saved bytes
counted with `saved_tensors_hooks` (deduplicated by storage, the layer's
parameters and input left out). The memory model's test
`qk_norm_keeps_what_hf_rmsnorm_keeps` (compiler/src/memory/tests_setups.rs)
follows the bf16 line: 148,992 more bytes at 64 tokens, 4 heads of 64, 2
kv heads (transformers 5.23, torch 2.15, CPU).

    python tools/qk_norm_saved.py
"""
import torch
from transformers import LlamaConfig, Qwen3Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer, Qwen3RotaryEmbedding

def saved_bytes(layer_cls, rope_cls, cfg, dtype, seq=64):
    torch.manual_seed(0)
    layer = layer_cls(cfg, 0).to(dtype)
    rope = rope_cls(cfg)
    x = torch.randn(1, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
    pos = torch.arange(seq)[None]
    cos, sin = rope(x, pos)
    packed = []
    def pack(t):
        packed.append(t); return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
    seen = {}
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    for t in packed:
        k = t.untyped_storage().data_ptr()
        if k in params or k == x.untyped_storage().data_ptr(): continue
        seen[k] = t.untyped_storage().nbytes()
    return sum(seen.values()), len(seen)

if __name__ == "__main__":
    for dtype in [torch.float32, torch.bfloat16]:
        kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  rms_norm_eps=1e-6, attn_implementation="sdpa")
        l = saved_bytes(LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaConfig(**kw), dtype)
        q = saved_bytes(Qwen3DecoderLayer, Qwen3RotaryEmbedding, Qwen3Config(**kw), dtype)
        print(dtype, "llama", l, "qwen3", q, "delta", q[0]-l[0], "tokens*q", 64*256, "tokens*kv", 64*128)
