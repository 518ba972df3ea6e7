//! rcoa's LoRA adapter out in PEFT's layout: `adapter_model.safetensors`
//! and `adapter_config.json`, as `PeftModel.save_pretrained` writes them.
//!
//! Keys are `base_model.model.<module>.lora_A.weight` (`[r, in]`) and
//! `…lora_B.weight` (`[out, r]`), `<module>` being the Hugging Face module
//! the adapted layer lives in (the load mapping's tensor name without
//! `.weight`), under the class rcoa saves for (`LlamaForCausalLM`,
//! `GPT2LMHeadModel`, `XLMRobertaModel`). rcoa's factors are stored
//! `[in, r]` and `[r, out]` and scaled by alpha / rank, as PEFT scales
//! without rsLoRA: the PEFT factors are their transposes.
//!
//! GPT-2 fuses q, k and v into one `Conv1D` (`c_attn`), Phi-3 into one
//! `nn.Linear` (`qkv_proj`, and gate and up into `gate_up_proj`), where rcoa
//! has one adapter per projection. Their sum is one LoRA of rank k·r (k targeted
//! projections): `lora_A` stacks the k `A`s, `lora_B` is block-diagonal
//! (each `B` in its projection's rows and its own columns, zeros elsewhere),
//! and alpha becomes k·alpha so the scale stays alpha / r (`rank_pattern`
//! and `alpha_pattern` when other modules keep rank r). The function is
//! exactly rcoa's; only further training in PEFT would differ (its one
//! dropout mask for the three, and the zero blocks are trainable there).
//!
//! `target_modules` lists, per adapted module, the shortest name suffix
//! that matches no module rcoa did not adapt (PEFT matches a module when its
//! name equals an entry or ends with `.` + entry): `q_proj`, `c_attn`,
//! `attention.output.dense` where XLM-R's `output.dense` alone would also
//! catch the unadapted attention output.

use super::lora::Factors;
use super::write::HfTensor;
use super::{origin, save_prefix, Family, Origin};
use std::collections::{BTreeMap, BTreeSet};

/// What PEFT needs besides the factors.
pub struct PeftInfo<'a> {
    pub family: Family,
    pub rank: u64,
    pub alpha: f64,
    pub dropout: f64,
    /// `base_model_name_or_path`: the checkpoint folder trained from.
    pub base: Option<&'a str>,
    /// Every linear layer of the model, by rcoa name (`layers.0.attn.q`),
    /// adapted or not: what `target_modules` must not catch by accident.
    pub linears: &'a [String],
}

/// The adapter's tensors (PEFT keys) and `adapter_config.json`.
pub fn peft_adapter(
    factors: &BTreeMap<String, Factors>,
    info: &PeftInfo<'_>,
) -> Result<(BTreeMap<String, HfTensor>, serde_json::Value), String> {
    if factors.is_empty() {
        return Err("the model has no LoRA adapter to save".into());
    }
    // Adapted layers grouped by the HF module they live in, each with its first row in
    // the module's output and the module's rows.
    let mut modules: BTreeMap<String, Vec<(usize, usize, &Factors)>> = BTreeMap::new();
    for (layer, f) in factors {
        let (module, block) = hf_module(info.family, layer)?;
        let cols = f.b.0[1];
        let (start, total) = match block {
            Block::Whole => (0, cols),
            Block::Part { part, parts } => (part * cols, parts * cols),
            Block::Rows { start, total } => (start, total),
        };
        modules.entry(module).or_default().push((start, total, f));
    }
    let r = info.rank as usize;
    let mut tensors = BTreeMap::new();
    // Rank of each module's LoRA (k·r for a fused module with k adapters).
    let mut ranks: BTreeMap<String, usize> = BTreeMap::new();
    for (module, mut parts) in modules {
        parts.sort_by_key(|p| p.0);
        for (_, _, f) in &parts {
            if f.a.0[1] != r {
                return Err(format!(
                    "the adapter of `{module}` has rank {}, the plan's is {r}",
                    f.a.0[1]
                ));
            }
        }
        let (a, b) = fuse(&parts);
        ranks.insert(module.clone(), a.0[0]);
        tensors.insert(format!("base_model.model.{module}.lora_A.weight"), a);
        tensors.insert(format!("base_model.model.{module}.lora_B.weight"), b);
    }
    let all: BTreeSet<String> = info
        .linears
        .iter()
        .map(|l| hf_module(info.family, l).map(|m| m.0))
        .collect::<Result<_, _>>()?;
    let adapted: BTreeSet<String> = ranks.keys().cloned().collect();
    let mut others = all;
    others.extend(extra_modules(info.family).iter().map(|m| m.to_string()));
    let targets = target_suffixes(&adapted, &others);

    // A module with k adapters has rank k·r and alpha k·alpha (the same
    // scale). One rank for all modules, or the plan's with patterns for the
    // fused ones.
    let alpha_for = |rank: usize| info.alpha * (rank / r) as f64;
    let distinct: BTreeSet<usize> = ranks.values().copied().collect();
    let mut rank_pattern = serde_json::Map::new();
    let mut alpha_pattern = serde_json::Map::new();
    let global_r = match distinct.iter().next() {
        Some(&only) if distinct.len() == 1 => only,
        _ => r,
    };
    for (module, &rank) in &ranks {
        if rank != global_r {
            let key = suffix_for(module, &targets);
            rank_pattern.insert(key.clone(), rank.into());
            alpha_pattern.insert(key, alpha_for(rank).into());
        }
    }
    // The task picks the class `AutoPeftModel` loads the base with:
    // `AutoModelForCausalLM`, or `AutoModel` for the encoders.
    let task = match info.family {
        Family::Llama | Family::Phi3(_) | Family::Gpt2 => "CAUSAL_LM",
        Family::Bert => "FEATURE_EXTRACTION",
    };
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": task,
        "base_model_name_or_path": info.base,
        "revision": null,
        "r": global_r,
        "lora_alpha": alpha_for(global_r),
        "lora_dropout": info.dropout,
        "target_modules": targets,
        "bias": "none",
        "fan_in_fan_out": info.family == Family::Gpt2,
        "use_rslora": false,
        "use_dora": false,
        "init_lora_weights": true,
        "inference_mode": true,
        "modules_to_save": null,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": rank_pattern,
        "alpha_pattern": alpha_pattern,
    });
    Ok((tensors, config))
}

/// Which outputs of its HF module a linear layer computes.
enum Block {
    /// All of them.
    Whole,
    /// Equal column blocks (GPT-2's `c_attn`): block `part` of `parts`.
    Part { part: usize, parts: usize },
    /// Rows `start..` of a module of `total` outputs (Phi-3's `qkv_proj`, `gate_up_proj`).
    Rows { start: usize, total: usize },
}

/// The HF module of rcoa's linear layer `layer` (`layers.0.attn.q`), and
/// which of its outputs the layer computes.
fn hf_module(family: Family, layer: &str) -> Result<(String, Block), String> {
    let weight = format!("{layer}.weight");
    let no = || format!("a {family:?} checkpoint has no module for `{layer}`");
    let (key, block) = match origin(family, save_prefix(family), &weight).ok_or_else(no)? {
        Origin::Whole { key, .. } => (key, Block::Whole),
        Origin::Split { key, part, parts } => (key, Block::Part { part, parts }),
        Origin::Rows {
            key, start, total, ..
        } => (key, Block::Rows { start, total }),
        Origin::PositionsWithType { .. } => return Err(no()),
    };
    Ok((strip(&key).ok_or_else(no)?, block))
}

fn strip(key: &str) -> Option<String> {
    key.strip_suffix(".weight").map(str::to_string)
}

/// Modules of the Hugging Face class outside the layers that PEFT could
/// match by suffix.
fn extra_modules(family: Family) -> &'static [&'static str] {
    match family {
        Family::Llama | Family::Phi3(_) | Family::Gpt2 => &["lm_head"],
        Family::Bert => &["pooler.dense"],
    }
}

/// PEFT's factors of one module: `(first row, the module's rows, factors)` sorted by
/// first row. One adapter over the whole module: `A^T`, `B^T`. Several (a fused
/// module): stacked `A^T`s and a block-diagonal `B^T`, each `B^T` in its layer's rows,
/// zeros in the rows no adapter computes.
fn fuse(parts: &[(usize, usize, &Factors)]) -> (HfTensor, HfTensor) {
    let (d_in, r) = (parts[0].2.a.0[0], parts[0].2.a.0[1]);
    let total = parts[0].1;
    let k = parts.len();
    let rk = r * k;
    // lora_A: [k·r, in], block j = A_j^T.
    let mut a = vec![0f32; rk * d_in];
    // lora_B: [total, k·r], B_j^T in its rows, columns of block j.
    let mut b = vec![0f32; total * rk];
    for (j, (start, _, f)) in parts.iter().enumerate() {
        let cols = f.b.0[1];
        for i in 0..d_in {
            for q in 0..r {
                a[(j * r + q) * d_in + i] = f.a.1[i * r + q];
            }
        }
        for q in 0..r {
            for o in 0..cols {
                b[(start + o) * rk + j * r + q] = f.b.1[q * cols + o];
            }
        }
    }
    ((vec![rk, d_in], a), (vec![total, rk], b))
}

/// For each adapted module, the shortest dotted suffix of its name that no
/// other module's name ends with (`name == s` or `name.ends_with(".s")`),
/// deduplicated in order.
fn target_suffixes(adapted: &BTreeSet<String>, others: &BTreeSet<String>) -> Vec<String> {
    let matches = |name: &str, s: &str| name == s || name.ends_with(&format!(".{s}"));
    let mut out: Vec<String> = vec![];
    for m in adapted {
        let segs: Vec<&str> = m.split('.').collect();
        let mut chosen = m.clone();
        for take in 1..=segs.len() {
            let s = segs[segs.len() - take..].join(".");
            if others
                .iter()
                .filter(|o| !adapted.contains(*o))
                .all(|o| !matches(o, &s))
            {
                // `layer.0.output.dense` reads better than `0.output.dense`
                // and matches the same modules.
                let index = segs[segs.len() - take].parse::<u64>().is_ok();
                chosen = if index && take < segs.len() {
                    segs[segs.len() - take - 1..].join(".")
                } else {
                    s
                };
                break;
            }
        }
        if !out.contains(&chosen) {
            out.push(chosen);
        }
    }
    out
}

/// The entry of `targets` that catches `module`.
fn suffix_for(module: &str, targets: &[String]) -> String {
    targets
        .iter()
        .find(|s| module == s.as_str() || module.ends_with(&format!(".{s}")))
        .cloned()
        .unwrap_or_else(|| module.to_string())
}
