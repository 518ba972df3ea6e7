//! A `config.json` for full weights saved without a source checkpoint
//! (a model from a preset or written in the plan), so `transformers` can
//! load them: the inverse of the compiler's config reader
//! (`compiler/src/resolve/hf.rs`), for the shapes a `transformers` class
//! has exactly. Any other shape gets no config (its weights are still
//! written under the family's names).

use super::Family;
use rcoa_compiler::spec::{Arch, Biases, Mlp, ModelSpec, Norm, Positions, RopeScaling};

/// The config of `m` as its family's `transformers` class reads it, or
/// `None` where no class computes what rcoa's model computes.
pub fn hf_config(m: &ModelSpec) -> Option<serde_json::Value> {
    let n = &m.numerics;
    let common = serde_json::json!({
        "vocab_size": m.vocab,
        "tie_word_embeddings": m.tie_embeddings,
        "dtype": "float32",
    });
    let mut c = match Family::of(m) {
        Family::Llama | Family::Phi3(_) => {
            if (m.mlp, m.positions) != (Mlp::Swiglu, Positions::Rope) {
                return None;
            }
            // Qwen2's class is Llama's with biases on q, k and v; Qwen3's with a norm over
            // each head of q and k and no biases.
            // Mistral's is Llama's with a sliding window.
            let windowed = n.sliding_window.is_some();
            // Phi-3's is Llama's with q, k, v and gate, up fused in the checkpoint.
            let (class, model_type) = match (m.biases(), n.qk_norm, windowed) {
                (Biases::None, false, _) if n.fused_projections => ("Phi3ForCausalLM", "phi3"),
                _ if n.fused_projections => return None,
                (Biases::None, false, true) => ("MistralForCausalLM", "mistral"),
                (Biases::Qkv, false, false) => ("Qwen2ForCausalLM", "qwen2"),
                (Biases::None | Biases::All, false, false) => ("LlamaForCausalLM", "llama"),
                (Biases::None, true, false) if m.norm == Norm::Rmsnorm => {
                    ("Qwen3ForCausalLM", "qwen3")
                }
                _ => return None,
            };
            let all = m.biases() == Biases::All;
            let mut rope =
                serde_json::json!({ "rope_theta": n.rope_theta, "rope_type": "default" });
            match &n.rope_scaling {
                None => {}
                Some(RopeScaling::Linear { factor }) => {
                    rope["rope_type"] = "linear".into();
                    rope["factor"] = (*factor).into();
                }
                Some(RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_positions,
                }) => {
                    rope["rope_type"] = "llama3".into();
                    rope["factor"] = (*factor).into();
                    rope["low_freq_factor"] = (*low_freq_factor).into();
                    rope["high_freq_factor"] = (*high_freq_factor).into();
                    rope["original_max_position_embeddings"] = (*original_max_positions).into();
                }
                Some(RopeScaling::LongRope {
                    short_factor,
                    long_factor,
                    original_max_positions,
                    attention_factor,
                }) => {
                    rope["rope_type"] = "longrope".into();
                    rope["short_factor"] = short_factor.clone().into();
                    rope["long_factor"] = long_factor.clone().into();
                    rope["original_max_position_embeddings"] = (*original_max_positions).into();
                    rope["attention_factor"] = (*attention_factor).into();
                }
                // `rcoa run` does not train such a model.
                Some(RopeScaling::Other { .. }) => return None,
            }
            if let Some(r) = n.rotary_dims {
                // Only Phi-3's attention rotates part of each head; transformers takes
                // `int(head_dim * factor)` values, so the factor is rounded up to give `r`.
                if model_type != "phi3" {
                    return None;
                }
                let mut f = r as f64 / m.head_dim as f64;
                if ((m.head_dim as f64 * f) as u64) < r {
                    f = f.next_up();
                }
                rope["partial_rotary_factor"] = f.into();
            }
            let mut c = serde_json::json!({
                "architectures": [class],
                "model_type": model_type,
                "num_hidden_layers": m.layers,
                "max_position_embeddings": m.max_positions,
                "hidden_size": m.hidden,
                "intermediate_size": m.ffn,
                "num_attention_heads": m.heads,
                "num_key_value_heads": m.kv_heads,
                "head_dim": m.head_dim,
                "hidden_act": "silu",
                "rms_norm_eps": n.norm_eps,
                // Where transformers 4 and 5 read them.
                "rope_theta": n.rope_theta,
                "rope_parameters": rope.clone(),
                "attention_dropout": m.dropout,
            });
            match model_type {
                "llama" => {
                    c["attention_bias"] = all.into();
                    c["mlp_bias"] = all.into();
                }
                "mistral" => c["sliding_window"] = n.sliding_window.into(),
                "phi3" => {
                    c["sliding_window"] = n.sliding_window.into();
                    // Phi3Config's own default (4096) would replace the one inside.
                    if let Some(RopeScaling::LongRope {
                        original_max_positions,
                        ..
                    }) = &n.rope_scaling
                    {
                        c["original_max_position_embeddings"] = (*original_max_positions).into();
                    }
                    if let Some(f) = rope.get("partial_rotary_factor") {
                        c["partial_rotary_factor"] = f.clone();
                    }
                    // After the attention and the MLP (transformers 5 has no embedding
                    // dropout; rcoa's drops the embeddings too).
                    c["resid_pdrop"] = m.dropout.into();
                    // Phi3Config's token defaults (32000) lie outside a smaller vocabulary.
                    for key in ["bos_token_id", "eos_token_id"] {
                        c[key] = serde_json::Value::Null;
                    }
                }
                "qwen2" => c["use_sliding_window"] = false.into(),
                _ => {
                    c["use_sliding_window"] = false.into();
                    c["attention_bias"] = false.into();
                }
            }
            if n.rope_scaling.is_some() {
                rope.as_object_mut().map(|r| r.remove("rope_theta"));
                c["rope_scaling"] = rope;
            }
            // The embedding's `padding_idx` (null: none).
            c["pad_token_id"] = n.padding_idx.into();
            c
        }
        Family::Gpt2 => {
            let plain = m.mlp == Mlp::Gelu
                && m.biases() == Biases::All
                && m.positions == Positions::Learned
                && m.kv_heads == m.heads
                && m.heads * m.head_dim == m.hidden;
            if !plain {
                return None;
            }
            serde_json::json!({
                "architectures": ["GPT2LMHeadModel"],
                "model_type": "gpt2",
                "n_layer": m.layers,
                "n_embd": m.hidden,
                "n_head": m.heads,
                "n_inner": m.ffn,
                "n_positions": m.max_positions,
                "activation_function": if n.gelu_tanh { "gelu_new" } else { "gelu" },
                "layer_norm_epsilon": n.norm_eps,
                "resid_pdrop": m.dropout,
                "embd_pdrop": m.dropout,
                "attn_pdrop": m.dropout,
            })
        }
        Family::Bert => {
            let plain = m.arch == Arch::Encoder
                && m.norm == Norm::Layernorm
                && m.biases() == Biases::All
                && m.mlp == Mlp::Gelu
                && m.positions == Positions::Learned
                && m.kv_heads == m.heads
                && m.heads * m.head_dim == m.hidden
                && !n.gelu_tanh;
            if !plain {
                return None;
            }
            let mut c = serde_json::json!({
                "num_hidden_layers": m.layers,
                "max_position_embeddings": m.max_positions,
                "hidden_size": m.hidden,
                "intermediate_size": m.ffn,
                "num_attention_heads": m.heads,
                "hidden_act": "gelu",
                "layer_norm_eps": n.norm_eps,
                "hidden_dropout_prob": m.dropout,
                "attention_probs_dropout_prob": m.dropout,
                // rcoa folds the one token type into the positions.
                "type_vocab_size": 1,
            });
            // XLM-R counts positions from pad_token_id + 1; BERT from 0.
            if n.position_offset > 0 {
                c["architectures"] = serde_json::json!(["XLMRobertaModel"]);
                c["model_type"] = "xlm-roberta".into();
                c["pad_token_id"] = (n.position_offset - 1).into();
            } else {
                c["architectures"] = serde_json::json!(["BertModel"]);
                c["model_type"] = "bert".into();
            }
            c
        }
    };
    if let (Some(c), Some(common)) = (c.as_object_mut(), common.as_object()) {
        for (k, v) in common {
            c.entry(k.clone()).or_insert(v.clone());
        }
    }
    Some(c)
}
