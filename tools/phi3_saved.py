"""What Phi-3's fused projections change in what autograd keeps: a Phi-3
decoder layer against a Llama layer of the same shape (`qk_norm_saved.
saved_bytes`: storages deduplicated and counted whole, the layer's
parameters and input left out).

SDPA saves `v`, a view into the output of `qkv_proj`, so the whole
`[tokens, (heads + 2·kv)·head_dim]` output stays for the backward, where
Llama frees q's and k's projections once RoPE has read them (`q * cos`
saves `cos`, not `q`): the "q and k outputs" column, which the memory
model charges (`phi3_keeps_the_fused_projection_output`,
compiler/src/memory/tests_setups.rs). The rest of the delta, one more
`[tokens, heads·head_dim]` tensor, is CPU-only: Phi-3's RoPE ends in a
`cat` that makes q contiguous, CPU SDPA then returns a `[b, h, s, d]`
output, and `transpose(1, 2).contiguous()` copies it for `o_proj`; CUDA's
fused kernels return `[b, s, h, d]` memory, which needs no copy.

    python tools/phi3_saved.py
"""
import torch
from qk_norm_saved import saved_bytes
from transformers import LlamaConfig, Phi3Config
from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
from transformers.models.phi3.modeling_phi3 import Phi3DecoderLayer, Phi3RotaryEmbedding


for kv in [4, 2]:
    for dtype in [torch.float32, torch.bfloat16]:
        kw = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=kv,
                  rms_norm_eps=1e-5, attn_implementation="sdpa")
        l = saved_bytes(LlamaDecoderLayer, LlamaRotaryEmbedding, LlamaConfig(**kw), dtype)
        p = saved_bytes(Phi3DecoderLayer, Phi3RotaryEmbedding, Phi3Config(**kw, pad_token_id=None), dtype)
        hd = 256 // 4
        qk = 64 * (4 + kv) * hd * (4 if dtype == torch.float32 else 2)
        print(f"kv {kv} {dtype}: llama {l} phi3 {p} delta {p[0] - l[0]} (q and k outputs: {qk})")
