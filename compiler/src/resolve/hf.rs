//! `model hf "path/config.json"` or `model hf "path"`: an architecture read
//! from a Hugging Face `config.json` on disk (relative to the plan's folder).
//! When `model.safetensors` or `model.safetensors.index.json` sits beside the
//! config, the spec records that folder (absolute) so `rcoa run` starts from
//! those weights.
//!
//! The forward's numerics come from the config too (`Numerics`): the norm
//! epsilon (`rms_norm_eps`, `layer_norm_epsilon`, `layer_norm_eps`),
//! `rope_theta`, the activation (`hidden_act` / `activation_function`: exact
//! `gelu`, tanh `gelu_new` / `gelu_pytorch_tanh`, `silu` for SwiGLU) and
//! RoBERTa-style position ids starting at `pad_token_id + 1`, and RoPE's
//! rescaling (`rope_scaling`, or transformers 5's `rope_parameters`): `linear`,
//! `llama3` and `longrope` are computed by `rcoa run`; other types are kept by name,
//! which PyTorch targets predict (the scaling changes no tensor's size) and
//! `target burn` refuses. Mistral's `sliding_window` (4096 in v0.1's config
//! and when missing, null later) is full attention while the sequence is no
//! longer than the window; past it `rcoa run` masks the window (a query sees itself and
//! the `window - 1` positions before it) in the eager and selective attentions' bias, and
//! the fused kernels skip and mask the keys outside it. Qwen's `use_sliding_window =
//! true` is refused.
//!
//! Supported `model_type`s and the keys read:
//! - `llama`, `mistral` (and the three below): `pad_token_id` (the embedding row that
//!   gets no gradient, as `nn.Embedding`'s `padding_idx`), `num_hidden_layers`, `hidden_size`,
//!   `num_attention_heads`, `num_key_value_heads` (missing: Llama heads,
//!   Mistral 8, Qwen 32, as their config classes; `null`: heads),
//!   `head_dim` (default: hidden/heads), `intermediate_size`, `vocab_size`,
//!   `max_position_embeddings`, `tie_word_embeddings` (default false),
//!   `attention_dropout` (default 0); SwiGLU, RMSNorm, RoPE, decoder.
//!   Llama's `attention_bias` and `mlp_bias` together read as `bias = true`.
//! - `qwen2`: Llama's keys, with biases on the query, key and value
//!   projections (`bias = qkv`).
//! - `qwen3`: Llama's keys (`head_dim` default 128), RMSNorm over each head
//!   of the queries and keys (`qk_norm = true`); `attention_bias = true` is
//!   refused.
//! - `phi3`: Llama's keys (`rms_norm_eps` default 1e-5), q, k and v fused
//!   into `qkv_proj` and the MLP's gate and up into `gate_up_proj` in the
//!   checkpoint (`fused_projections`), `sliding_window` (default none) as
//!   Mistral's, `resid_pdrop` as the dropout (`attention_dropout` must equal
//!   it; transformers 5 applies no `embd_pdrop`); `partial_rotary_factor`
//!   (Phi-4-mini's 0.75: RoPE turns that share of each head, `rotary_dims`),
//!   and `longrope` with its `short_factor` and `long_factor` lists (one per
//!   rotated pair) and `attention_factor` (or the one transformers derives from
//!   `max_position_embeddings` over `original_max_position_embeddings`).
//! - `gpt2`: `n_layer`, `n_embd`, `n_head`, `n_inner` (null: 4 × n_embd),
//!   `vocab_size`, `n_positions`, `tie_word_embeddings` (default true),
//!   `resid_pdrop` (default 0.1); GELU, LayerNorm, learned positions, decoder.
//! - `xlm-roberta`, `xlm-roberta-xl`, `roberta`, `bert`: `num_hidden_layers`,
//!   `hidden_size`, `num_attention_heads`, `intermediate_size`, `vocab_size`,
//!   `max_position_embeddings`, `tie_word_embeddings` (default true),
//!   `hidden_dropout_prob` (default 0.1); GELU, LayerNorm, learned
//!   positions, encoder.
//!
//! The defaults are those of the `transformers` config classes, so a config
//! saved without a key means what it means to `transformers`. Any problem is
//! one `rcoa::hf_config` diagnostic on the path string.

use super::problem::{HfDetail, Problem};
use super::values::Cx;
use crate::spec::{
    Arch, Biases, DropoutSites, Mlp, ModelSpec, Norm, Numerics, Positions, RopeScaling,
};
use rcoa_grammar::Span;
use serde_json::{Map, Value as Json};

pub(crate) const MODEL_TYPES: &[&str] = &[
    "llama",
    "mistral",
    "gpt2",
    "xlm-roberta",
    "xlm-roberta-xl",
    "roberta",
    "bert",
    "qwen2",
    "qwen3",
    "phi3",
];

pub(super) fn load(cx: &mut Cx, path: &str, span: Span) -> Option<ModelSpec> {
    match read(cx, path) {
        Ok(spec) => {
            if let Err(p) = check_heads(&spec, span) {
                cx.report(p);
                return None;
            }
            Some(spec)
        }
        Err(detail) => {
            cx.report(Problem::HfConfig { detail, span });
            None
        }
    }
}

/// Hugging Face's default head size, `hidden / heads`; 0 when it does not divide,
/// which [`check_heads`] reports.
fn default_head_dim(hidden: u64, heads: u64) -> u64 {
    if heads != 0 && hidden.is_multiple_of(heads) {
        hidden / heads
    } else {
        0
    }
}

fn check_heads(m: &ModelSpec, span: Span) -> Result<(), Problem> {
    if m.head_dim == 0 {
        return Err(Problem::NotDivisible {
            what: "hidden",
            value: m.hidden,
            by_what: "heads",
            by: m.heads,
            span,
            by_span: None,
            divisor_is_primary: false,
            options: vec![],
        });
    }
    Ok(())
}

fn read(cx: &Cx, path: &str) -> Result<ModelSpec, HfDetail> {
    let mut full = cx.ctx.base_dir.join(path);
    if full.is_dir() {
        full = full.join("config.json");
    }
    // The message shows the path as written: absolute paths would make
    // diagnostics depend on where the plan lives.
    let text = std::fs::read_to_string(&full).map_err(|e| HfDetail::Read {
        path: path.to_string(),
        error: io_error_text(&e),
    })?;
    let json: Json = serde_json::from_str(&text).map_err(|e| HfDetail::Json(e.to_string()))?;
    let Json::Object(obj) = json else {
        return Err(HfDetail::NotObject);
    };
    let model_type = match obj.get("model_type") {
        Some(Json::String(t)) => t.clone(),
        Some(_) => {
            return Err(HfDetail::WrongType {
                key: "model_type",
                expected: "a string",
            })
        }
        None => return Err(HfDetail::NoModelType),
    };
    let c = Config {
        obj: &obj,
        model_type: &model_type,
    };
    let name = format!("hf:{path}");
    let weights = full.parent().and_then(checkpoint_dir);
    let mut spec = spec_of(&c, name)?;
    spec.weights = weights;
    spec.numerics = numerics(&c, spec.head_dim, spec.dropout)?;
    Ok(spec)
}

/// The folder's absolute path when it holds safetensors weights.
fn checkpoint_dir(dir: &std::path::Path) -> Option<String> {
    let has = |f: &str| dir.join(f).is_file();
    if !(has("model.safetensors") || has("model.safetensors.index.json")) {
        return None;
    }
    let abs = std::fs::canonicalize(dir).ok()?;
    Some(abs.to_string_lossy().into_owned())
}

/// The family's numerics; `dropout` is the model's one probability (`ModelSpec::dropout`).
fn numerics(c: &Config<'_>, head_dim: u64, dropout: f64) -> Result<Numerics, HfDetail> {
    let mut n = Numerics::default();
    let gpt2 = c.model_type == "gpt2";
    let (eps_key, eps_default) = match c.model_type {
        "llama" | "mistral" | "qwen2" | "qwen3" => ("rms_norm_eps", 1e-6),
        "phi3" => ("rms_norm_eps", 1e-5),
        "gpt2" => ("layer_norm_epsilon", 1e-5),
        _ => ("layer_norm_eps", 1e-12),
    };
    n.norm_eps = c.float(eps_key)?.unwrap_or(eps_default);
    if c.model_type == "qwen2" {
        // Qwen2Attention: `q_proj`, `k_proj` and `v_proj` with biases, `o_proj` and the MLP
        // without; no config key changes it.
        n.linear_bias = Some(Biases::Qkv);
    }
    if c.model_type == "qwen3" {
        // Qwen3Attention: RMSNorm over each head of q and k; `attention_bias` would put
        // biases on q, k, v and o but not the MLP, which no `bias` setting says.
        n.qk_norm = true;
        if c.flag("attention_bias", false)? {
            return Err(HfDetail::Unsupported {
                key: "attention_bias",
                value: "true (biases on the attention's projections only)".into(),
            });
        }
    }
    if matches!(c.model_type, "qwen2" | "qwen3") && c.flag("use_sliding_window", false)? {
        return Err(HfDetail::Unsupported {
            key: "use_sliding_window",
            value: "true (sliding-window attention)".into(),
        });
    }
    if c.model_type == "llama" {
        // LlamaConfig's `attention_bias` (q, k, v, o) and `mlp_bias` (gate, up, down):
        // the plan's `bias` says both at once.
        let attention = c.flag("attention_bias", false)?;
        let mlp = c.flag("mlp_bias", false)?;
        if attention != mlp {
            return Err(HfDetail::Unsupported {
                key: if attention {
                    "attention_bias"
                } else {
                    "mlp_bias"
                },
                value: "true (biases on one kind of projection only)".into(),
            });
        }
        if attention {
            n.linear_bias = Some(Biases::All);
        }
    }
    if c.model_type == "mistral" {
        // No different from full attention while the sequence fits in the window;
        // past it, `executed` refuses the fused attention for `rcoa run`.
        // MistralConfig's default is 4096; `null` is none.
        n.sliding_window = match c.obj.get("sliding_window") {
            None => Some(4096),
            Some(_) => c.opt("sliding_window")?,
        };
    }
    if c.model_type == "phi3" {
        // Phi3Config's default is none (Phi-3-mini-4k writes 2047).
        n.sliding_window = c.opt("sliding_window")?;
        n.fused_projections = true;
    }
    if matches!(
        c.model_type,
        "llama" | "mistral" | "qwen2" | "qwen3" | "phi3"
    ) {
        // Where these classes drop out at the model's one probability: Llama, Mistral and
        // Qwen only the attention probabilities; Phi-3 the residual branches too
        // (`resid_attn_dropout`, `resid_mlp_dropout`), not the embeddings (GPT-2 and the
        // encoders drop everywhere, the default). Said only where something drops:
        // without dropout the sites change nothing, and the numerics stay the presets'.
        if dropout > 0.0 {
            n.dropout_sites = DropoutSites {
                embedding: false,
                residual: c.model_type == "phi3",
                attention: true,
            };
        }
        rope(c, &mut n, head_dim)?;
        // `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`: the pad token's row
        // gets no gradient from the lookup (Phi-3: 32000, `<|endoftext|>`; many Llama
        // fine-tunes: 0). PyTorch counts a negative index from the end (the first Llama
        // conversions wrote -1: the last row).
        if let Some(pad) = c.token_id("pad_token_id")? {
            let vocab = c.req("vocab_size")?;
            let row = if pad < 0 { vocab as i64 + pad } else { pad };
            if !(0..vocab as i64).contains(&row) {
                return Err(HfDetail::Unsupported {
                    key: "pad_token_id",
                    value: format!("{pad} (outside the vocabulary of {vocab})"),
                });
            }
            n.padding_idx = Some(row as u64);
        }
    }
    let act_key = if gpt2 {
        "activation_function"
    } else {
        "hidden_act"
    };
    let act_default = match c.model_type {
        "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" => "silu",
        "gpt2" => "gelu_new",
        _ => "gelu",
    };
    let act = match c.obj.get(act_key) {
        None | Some(Json::Null) => act_default.to_string(),
        Some(Json::String(a)) => a.clone(),
        Some(_) => {
            return Err(HfDetail::WrongType {
                key: act_key,
                expected: "a string",
            })
        }
    };
    let swiglu = act_default == "silu";
    n.gelu_tanh = match act.as_str() {
        "silu" | "swish" if swiglu => false,
        "gelu" if !swiglu => false,
        "gelu_new" | "gelu_pytorch_tanh" if !swiglu => true,
        _ => {
            return Err(HfDetail::Unsupported {
                key: act_key,
                value: format!("\"{act}\""),
            })
        }
    };
    if matches!(c.model_type, "xlm-roberta" | "xlm-roberta-xl" | "roberta") {
        // RoBERTa's position ids count from `padding_idx + 1`.
        let pad = match c.token_id("pad_token_id")? {
            None => 1,
            Some(p) if p >= 0 => p as u64,
            Some(_) => {
                return Err(HfDetail::WrongType {
                    key: "pad_token_id",
                    expected: "a non-negative integer",
                })
            }
        };
        n.position_offset = pad + 1;
    }
    Ok(n)
}

/// RoPE's base, rescaling and rotated share of each head. transformers 4 writes
/// `rope_theta`, `partial_rotary_factor` and `rope_scaling` at the top; transformers 5 all
/// inside `rope_parameters`, and reads an old `rope_scaling` first.
fn rope(c: &Config<'_>, n: &mut Numerics, head_dim: u64) -> Result<(), HfDetail> {
    n.rope_theta = c.float("rope_theta")?.unwrap_or(10000.0);
    let mut partial = c.float("partial_rotary_factor")?;
    let mut params = None;
    for key in ["rope_scaling", "rope_parameters"] {
        match c.obj.get(key) {
            None | Some(Json::Null) => {}
            // transformers takes `rope_scaling or rope_parameters`: an empty one is absent.
            Some(Json::Object(o)) if o.is_empty() => {}
            Some(Json::Object(o)) => {
                params = Some(o);
                break;
            }
            Some(_) => {
                return Err(HfDetail::WrongType {
                    key,
                    expected: "an object",
                })
            }
        }
    }
    let p = params.map(|rp| Config {
        obj: rp,
        model_type: c.model_type,
    });
    if let Some(p) = &p {
        if let Some(t) = p.float("rope_theta")? {
            n.rope_theta = t;
        }
        // `standardize_rope_params` moves the top-level factor in only where none is inside.
        if let Some(f) = p.float("partial_rotary_factor")? {
            partial = Some(f);
        }
    }
    if let Some(f) = partial.filter(|&f| f != 1.0) {
        n.rotary_dims = Some(rotary_dims(c, f, head_dim)?);
    }
    let Some(p) = p else {
        return Ok(());
    };
    let name = match p.obj.get("rope_type").or_else(|| p.obj.get("type")) {
        None | Some(Json::Null) => return Ok(()),
        Some(Json::String(t)) => t.as_str(),
        Some(_) => {
            return Err(HfDetail::WrongType {
                key: "rope_type",
                expected: "a string",
            })
        }
    };
    let factor = || {
        p.float("factor")?.ok_or(HfDetail::MissingKey {
            model_type: format!("{} (rope_type {name})", c.model_type),
            key: "factor",
        })
    };
    // Phi3Config takes `default` and `longrope` only, reading the older `su` and `yarn`
    // as `longrope`.
    let name = match (c.model_type, name) {
        ("phi3", "su" | "yarn") => "longrope",
        ("phi3", t @ ("default" | "longrope")) => t,
        ("phi3", t) => {
            return Err(HfDetail::Unsupported {
                key: "rope_type",
                value: format!("\"{t}\" (Phi-3 takes default and longrope)"),
            })
        }
        (_, t) => t,
    };
    // As transformers' `standardize_rope_params`: the pretraining length written beside
    // the config's other keys (Phi-3's place), else inside, else `max_position_embeddings`.
    let original = || -> Result<u64, HfDetail> {
        match c.opt("original_max_position_embeddings")? {
            Some(o) => Ok(o),
            None => match p.opt("original_max_position_embeddings")? {
                Some(o) => Ok(o),
                None => c.req("max_position_embeddings"),
            },
        }
    };
    n.rope_scaling = match name {
        "default" => None,
        "linear" => Some(RopeScaling::Linear { factor: factor()? }),
        "llama3" => {
            let req = |key: &'static str| {
                p.float(key)?.ok_or(HfDetail::MissingKey {
                    model_type: format!("{} (rope_type llama3)", c.model_type),
                    key,
                })
            };
            let (low, high) = (req("low_freq_factor")?, req("high_freq_factor")?);
            if low >= high {
                return Err(HfDetail::Unsupported {
                    key: "low_freq_factor",
                    value: format!("{low} (not below high_freq_factor, {high})"),
                });
            }
            Some(RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_positions: original()?,
            })
        }
        "longrope" => {
            let pairs = n.rotary_dims.unwrap_or(head_dim) / 2;
            let (short_factor, long_factor) = (
                pair_factors(&p, "short_factor", pairs)?,
                pair_factors(&p, "long_factor", pairs)?,
            );
            let original = original()?;
            // transformers' `_compute_longrope_parameters`: Phi-3 scales the attention by
            // how far `max_position_embeddings` reaches past the pretraining length.
            let scale = match p.float("factor")? {
                Some(f) => f,
                None => c.req("max_position_embeddings")? as f64 / original as f64,
            };
            let attention_factor = match p.float("attention_factor")? {
                Some(a) => a,
                None if scale <= 1.0 => 1.0,
                // transformers divides by ln(original): a length of 1 raises there.
                None if original < 2 => {
                    return Err(HfDetail::Unsupported {
                        key: "original_max_position_embeddings",
                        value: format!(
                            "{original} (LongRoPE's attention factor divides by its logarithm; write `attention_factor`)"
                        ),
                    })
                }
                None => (1.0 + scale.ln() / (original as f64).ln()).sqrt(),
            };
            Some(RopeScaling::LongRope {
                short_factor,
                long_factor,
                original_max_positions: original,
                attention_factor,
            })
        }
        other => Some(RopeScaling::Other {
            name: other.to_string(),
        }),
    };
    Ok(())
}

/// How many of a head's values RoPE rotates: `int(head_dim * factor)`, as transformers,
/// an even number (RoPE turns pairs). Only Phi-3's attention slices the rotated part off;
/// Llama's and its kin's would fail on the shorter tables.
fn rotary_dims(c: &Config<'_>, factor: f64, head_dim: u64) -> Result<u64, HfDetail> {
    let bad = |why: &str| HfDetail::Unsupported {
        key: "partial_rotary_factor",
        value: format!("{factor} ({why})"),
    };
    if c.model_type != "phi3" {
        return Err(bad(&format!(
            "{}'s attention rotates whole heads",
            c.model_type
        )));
    }
    if !(factor > 0.0 && factor <= 1.0) {
        return Err(bad("not in (0, 1]"));
    }
    let dims = (head_dim as f64 * factor) as u64;
    if dims < 2 || !dims.is_multiple_of(2) {
        return Err(bad(&format!(
            "{dims} of the head's {head_dim} values, not a positive even number"
        )));
    }
    Ok(dims)
}

/// One LongRoPE factor per rotated pair, each positive.
fn pair_factors(p: &Config<'_>, key: &'static str, pairs: u64) -> Result<Vec<f64>, HfDetail> {
    let wrong = HfDetail::WrongType {
        key,
        expected: "a list of positive numbers",
    };
    let Some(Json::Array(list)) = p.obj.get(key) else {
        return Err(match p.obj.get(key) {
            None | Some(Json::Null) => HfDetail::MissingKey {
                model_type: format!("{} (rope_type longrope)", p.model_type),
                key,
            },
            Some(_) => wrong,
        });
    };
    let values: Vec<f64> = list.iter().filter_map(Json::as_f64).collect();
    if values.len() != list.len() || values.iter().any(|&v| !(v > 0.0 && v.is_finite())) {
        return Err(wrong);
    }
    if values.len() as u64 != pairs {
        return Err(HfDetail::Unsupported {
            key,
            value: format!(
                "{} factors (one per rotated pair of each head: {pairs})",
                values.len()
            ),
        });
    }
    Ok(values)
}

fn spec_of(c: &Config<'_>, name: String) -> Result<ModelSpec, HfDetail> {
    match c.model_type {
        "llama" | "mistral" | "qwen2" | "qwen3" | "phi3" => {
            let layers = c.req("num_hidden_layers")?;
            let hidden = c.req("hidden_size")?;
            let heads = c.req("num_attention_heads")?;
            // Qwen3Config's `head_dim` defaults to 128, not hidden / heads.
            let head_dim_default = if c.model_type == "qwen3" {
                128
            } else {
                default_head_dim(hidden, heads)
            };
            Ok(ModelSpec {
                name,
                arch: Arch::Decoder,
                layers,
                hidden,
                heads,
                kv_heads: match c.obj.get("num_key_value_heads") {
                    // The config class's default when the key is missing; `null` is `heads`.
                    None => match c.model_type {
                        "mistral" => 8,
                        "qwen2" | "qwen3" => 32,
                        _ => heads,
                    },
                    Some(_) => c.opt("num_key_value_heads")?.unwrap_or(heads),
                },
                head_dim: c.opt("head_dim")?.unwrap_or(head_dim_default),
                ffn: c.req("intermediate_size")?,
                mlp: Mlp::Swiglu,
                norm: Norm::Rmsnorm,
                positions: Positions::Rope,
                vocab: c.req("vocab_size")?,
                max_positions: c.req("max_position_embeddings")?,
                tie_embeddings: c.flag("tie_word_embeddings", false)?,
                experts: 1,
                experts_per_token: 1,
                dropout: dropout(c)?,
                numerics: Numerics::default(),
                weights: None,
            })
        }
        "gpt2" => {
            let layers = c.req("n_layer")?;
            let hidden = c.req("n_embd")?;
            let heads = c.req("n_head")?;
            Ok(ModelSpec {
                name,
                arch: Arch::Decoder,
                layers,
                hidden,
                heads,
                kv_heads: heads,
                head_dim: default_head_dim(hidden, heads),
                ffn: c.opt("n_inner")?.unwrap_or(hidden.saturating_mul(4)),
                mlp: Mlp::Gelu,
                norm: Norm::Layernorm,
                positions: Positions::Learned,
                vocab: c.req("vocab_size")?,
                max_positions: c.req("n_positions")?,
                tie_embeddings: c.flag("tie_word_embeddings", true)?,
                experts: 1,
                experts_per_token: 1,
                dropout: c.prob("resid_pdrop", 0.1)?,
                numerics: Numerics::default(),
                weights: None,
            })
        }
        "xlm-roberta" | "xlm-roberta-xl" | "roberta" | "bert" => {
            let layers = c.req("num_hidden_layers")?;
            let hidden = c.req("hidden_size")?;
            let heads = c.req("num_attention_heads")?;
            Ok(ModelSpec {
                name,
                arch: Arch::Encoder,
                layers,
                hidden,
                heads,
                kv_heads: heads,
                head_dim: default_head_dim(hidden, heads),
                ffn: c.req("intermediate_size")?,
                mlp: Mlp::Gelu,
                norm: Norm::Layernorm,
                positions: Positions::Learned,
                vocab: c.req("vocab_size")?,
                max_positions: c.req("max_position_embeddings")?,
                tie_embeddings: c.flag("tie_word_embeddings", true)?,
                experts: 1,
                experts_per_token: 1,
                dropout: c.prob("hidden_dropout_prob", 0.1)?,
                numerics: Numerics::default(),
                weights: None,
            })
        }
        t => Err(HfDetail::UnknownModelType(t.to_string())),
    }
}

/// The one dropout probability of a Llama-like config: `attention_dropout`; Phi-3's
/// `resid_pdrop` after the attention and the MLP as well, which must then be equal
/// (`Numerics::dropout_sites` says where each family drops).
fn dropout(c: &Config<'_>) -> Result<f64, HfDetail> {
    let attention = c.prob("attention_dropout", 0.0)?;
    if c.model_type != "phi3" {
        return Ok(attention);
    }
    let resid = c.prob("resid_pdrop", 0.0)?;
    if resid != attention {
        return Err(HfDetail::Unsupported {
            key: "resid_pdrop",
            value: format!("{resid} (the plan has one dropout; attention_dropout is {attention})"),
        });
    }
    Ok(resid)
}

/// The OS error without the platform-specific `(os error N)` suffix.
fn io_error_text(e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => "no such file".into(),
        std::io::ErrorKind::PermissionDenied => "permission denied".into(),
        std::io::ErrorKind::InvalidData => "not UTF-8 text".into(),
        _ => {
            let s = e.to_string();
            match s.find(" (os error") {
                Some(i) => s[..i].to_string(),
                None => s,
            }
        }
    }
}

struct Config<'a> {
    obj: &'a Map<String, Json>,
    model_type: &'a str,
}

impl Config<'_> {
    /// A positive integer the config must have.
    fn req(&self, key: &'static str) -> Result<u64, HfDetail> {
        self.opt(key)?.ok_or_else(|| HfDetail::MissingKey {
            model_type: self.model_type.to_string(),
            key,
        })
    }

    /// A positive integer, absent or `null` allowed.
    fn opt(&self, key: &'static str) -> Result<Option<u64>, HfDetail> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(None),
            // Capped like explicit model keys (16M), so that later arithmetic cannot overflow.
            Some(v) => match v.as_u64() {
                Some(n) if n > 0 && n <= 1 << 24 => Ok(Some(n)),
                _ => Err(HfDetail::WrongType {
                    key,
                    expected: "a positive integer (at most 16777216)",
                }),
            },
        }
    }

    /// A token id: an integer, zero and negative ones (counted from the vocabulary's end
    /// by PyTorch) included, within the 16M the other keys are capped at.
    fn token_id(&self, key: &'static str) -> Result<Option<i64>, HfDetail> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(v) => match v.as_i64() {
                Some(n) if n.unsigned_abs() <= 1 << 24 => Ok(Some(n)),
                _ => Err(HfDetail::WrongType {
                    key,
                    expected: "an integer (at most 16777216 either way)",
                }),
            },
        }
    }

    /// A positive number, absent or `null` allowed.
    fn float(&self, key: &'static str) -> Result<Option<f64>, HfDetail> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x > 0.0 && x.is_finite() => Ok(Some(x)),
                _ => Err(HfDetail::WrongType {
                    key,
                    expected: "a positive number",
                }),
            },
        }
    }

    fn flag(&self, key: &'static str, default: bool) -> Result<bool, HfDetail> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(default),
            Some(Json::Bool(b)) => Ok(*b),
            Some(_) => Err(HfDetail::WrongType {
                key,
                expected: "a boolean",
            }),
        }
    }

    fn prob(&self, key: &'static str, default: f64) -> Result<f64, HfDetail> {
        match self.obj.get(key) {
            None | Some(Json::Null) => Ok(default),
            Some(v) => match v.as_f64() {
                Some(p) if (0.0..1.0).contains(&p) => Ok(p),
                _ => Err(HfDetail::WrongType {
                    key,
                    expected: "a probability from 0 up to 1",
                }),
            },
        }
    }
}
