"""What Phi-3's fused projections change in what autograd keeps: a Phi-3
decoder layer against a Llama layer of the same shape, saved bytes counted
with `saved_tensors_hooks` (deduplicated by storage, whole storages counted,
the layer's parameters and input left out). SDPA saves `v`, a view into the
output of `qkv_proj`, so the whole `[tokens, (heads + 2·kv)·head_dim]`
output stays for the backward, where Llama frees q's and k's projections
once RoPE has read them (`q * cos` saves `cos`, not `q`). The memory model's
test `phi3_keeps_the_fused_projection_output` (compiler/src/memory/
tests_setups.rs) follows the bf16 line.

    python tools/phi3_saved.py
"""
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3RotaryEmbedding


def saved_bytes(layer_cls, rope_cls, cfg, dtype, seq=64):
    torch.manual_seed(0)
    layer = layer_cls(cfg, 0).to(dtype)
    layer.train()
    rope = rope_cls(cfg)
    x = torch.randn(1, seq, cfg.hidden_size, dtype=dtype, requires_grad=True)
    pos = torch.arange(seq)[None]
    cos, sin = rope(x, pos)
    packed = []

    def pack(t):
        packed.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, attention_mask=None, position_ids=pos, position_embeddings=(cos, sin))
    seen = {}
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    for t in packed:
        k = t.untyped_storage().data_ptr()
        if k in params or k == x.untyped_storage().data_ptr():
            continue
        seen[k] = t.untyped_storage().nbytes()
    return sum(seen.values()), len(seen)


for kv in [4, 2]:
    for dtype in [torch.float32, torch.bfloat16]:
        kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=kv,
                  rms_norm_eps=1e-5, attn_implementation="sdpa")
        l = saved_bytes(LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaConfig(**kw), dtype)
        p = saved_bytes(Phi3DecoderLayer, Phi3RotaryEmbedding, Phi3Config(**kw, pad_token_id=None), dtype)
        hd = 256 // 4
        qk = 64 * (4 + kv) * hd * (4 if dtype == torch.float32 else 2)
        print(f"kv {kv} {dtype}: llama {l} phi3 {p} delta {p[0] - l[0]} (q and k outputs: {qk})")
