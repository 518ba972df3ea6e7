//! Hugging Face safetensors checkpoints in and out: the tensor names of each family
//! (Llama / Mistral / Qwen2 / Qwen3, Phi-3, GPT-2, XLM-R / RoBERTa / BERT) mapped onto
//! rcoa's parameters, with the layout changes between them (`nn.Linear` is
//! `[out, in]`, rcoa and GPT-2's `Conv1D` are `[in, out]`; GPT-2's fused
//! `c_attn` is split into q, k, v, Phi-3's `qkv_proj` into row blocks of unequal
//! sizes and its `gate_up_proj` into halves; XLM-R's `token_type_embeddings[0]`,
//! added to every token, is folded into the position table).
//!
//! Every problem — a missing tensor, a mis-shaped one, one the plan cannot
//! place — is collected and reported together as one `rcoa::weights` error.
//! Tensors the plan does not use (poolers, MLM / LM heads it does not run,
//! attention-mask buffers, RoPE frequency buffers) are skipped knowingly.
//!
//! Out (`export`): full weights (`write`, sharded as `transformers` shards),
//! LoRA adapters in PEFT's layout (`peft`, from the factors `lora` reads),
//! or LoRA merged into full weights.

mod config;
mod export;
mod lora;
mod peft;
mod read;
mod write;

use crate::model::Model;
use burn::tensor::backend::Backend;
use rcoa_compiler::spec::{Arch, ModelSpec, Norm};
use std::borrow::Cow;
use std::collections::BTreeSet;
use std::path::Path;

pub use config::hf_config;
pub use export::{Export, SaveOptions};
pub use lora::{lora_factors, merged_params, Factors};
pub use peft::{peft_adapter, PeftInfo};
pub use read::{read_checkpoint, Lazy, Stored};
pub use write::{
    hf_tensors, hf_tensors_of, save_prefix, write_file, write_model, HfTensor, RcoaTensor,
    DEFAULT_MAX_SHARD_BYTES,
};

/// The naming scheme of a checkpoint.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Family {
    /// Llama, Mistral, Qwen2 and Qwen3 (same names).
    Llama,
    /// Phi-3: Llama's names, but q, k and v in one `qkv_proj` and the MLP's gate and up
    /// in one `gate_up_proj`, whose row blocks have these sizes.
    Phi3(Fused),
    Gpt2,
    /// XLM-R, RoBERTa and BERT (same names under their own prefix).
    Bert,
}

/// The output rows of Phi-3's fused projections: q's (`heads · head_dim`), k's and v's
/// (`kv_heads · head_dim` each), gate's and up's (`ffn` each).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fused {
    pub q: usize,
    pub kv: usize,
    pub ffn: usize,
}

/// The family's name, as messages say it (`Phi3`'s sizes are not part of it).
impl std::fmt::Debug for Family {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Family::Llama => "Llama",
            Family::Phi3(_) => "Phi3",
            Family::Gpt2 => "Gpt2",
            Family::Bert => "Bert",
        })
    }
}

impl Family {
    /// The family whose layout this model has.
    pub fn of(m: &ModelSpec) -> Family {
        match (m.arch, m.norm) {
            (Arch::Encoder, _) => Family::Bert,
            (Arch::Decoder, Norm::Rmsnorm) if m.numerics.fused_projections => Family::Phi3(Fused {
                q: (m.heads * m.head_dim) as usize,
                kv: (m.kv_heads * m.head_dim) as usize,
                ffn: m.ffn as usize,
            }),
            (Arch::Decoder, Norm::Rmsnorm) => Family::Llama,
            (Arch::Decoder, Norm::Layernorm) => Family::Gpt2,
        }
    }

    /// The key of the token embedding, without prefix: it tells the prefix.
    fn embedding_key(self) -> &'static str {
        match self {
            Family::Llama | Family::Phi3(_) => "embed_tokens.weight",
            Family::Gpt2 => "wte.weight",
            Family::Bert => "embeddings.word_embeddings.weight",
        }
    }

    /// Tensors the executor never needs.
    fn ignorable(self, key: &str) -> bool {
        match self {
            Family::Llama | Family::Phi3(_) => key.ends_with("rotary_emb.inv_freq"),
            Family::Gpt2 => key.ends_with(".attn.bias") || key.ends_with(".attn.masked_bias"),
            Family::Bert => {
                key.starts_with("pooler.")
                    || key.contains(".pooler.")
                    || key.starts_with("lm_head.")
                    || key.starts_with("cls.")
                    || key.ends_with("embeddings.position_ids")
                    || key.ends_with("embeddings.token_type_ids")
            }
        }
    }
}

/// One rcoa parameter's origin in the checkpoint.
#[derive(Debug, Clone, PartialEq)]
pub enum Origin {
    /// The tensor as is, transposed when it is a `nn.Linear` weight.
    Whole { key: String, transpose: bool },
    /// Columns `part` of `parts` equal slices of the last dimension (GPT-2's `c_attn`).
    Split {
        key: String,
        part: usize,
        parts: usize,
    },
    /// The position table plus `token_type_embeddings[0]` (XLM-R, BERT).
    PositionsWithType { key: String, types: String },
    /// Rows `start..start + len` of an `nn.Linear` weight of `total` rows, transposed
    /// (Phi-3's `qkv_proj` and `gate_up_proj`).
    Rows {
        key: String,
        start: usize,
        len: usize,
        total: usize,
    },
}

/// Where rcoa's parameter `name` comes from in a `family` checkpoint whose
/// keys start with `prefix`; `None` for a name the family has no tensor for.
pub fn origin(family: Family, prefix: &str, name: &str) -> Option<Origin> {
    let parts: Vec<&str> = name.split('.').collect();
    let whole = |k: String, transpose: bool| Origin::Whole { key: k, transpose };
    let p = |k: &str| format!("{prefix}{k}");
    match family {
        Family::Phi3(f) => {
            let rows = |key: String, start: usize, len: usize, total: usize| Origin::Rows {
                key,
                start,
                len,
                total,
            };
            let qkv = f.q + 2 * f.kv;
            Some(match parts.as_slice() {
                ["layers", i, "attn", "q", "weight"] => rows(
                    p(&format!("layers.{i}.self_attn.qkv_proj.weight")),
                    0,
                    f.q,
                    qkv,
                ),
                ["layers", i, "attn", "k", "weight"] => rows(
                    p(&format!("layers.{i}.self_attn.qkv_proj.weight")),
                    f.q,
                    f.kv,
                    qkv,
                ),
                ["layers", i, "attn", "v", "weight"] => rows(
                    p(&format!("layers.{i}.self_attn.qkv_proj.weight")),
                    f.q + f.kv,
                    f.kv,
                    qkv,
                ),
                // `gate, up = gate_up_proj(x).chunk(2)`.
                ["layers", i, "mlp", gu @ ("gate" | "up"), "weight"] => rows(
                    p(&format!("layers.{i}.mlp.gate_up_proj.weight")),
                    if *gu == "gate" { 0 } else { f.ffn },
                    f.ffn,
                    2 * f.ffn,
                ),
                // Phi-3 has no biases; the rest is named as Llama's.
                [.., "bias"] => return None,
                _ => return origin(Family::Llama, prefix, name),
            })
        }
        Family::Llama => Some(match parts.as_slice() {
            ["embed", "tokens"] => whole(p("embed_tokens.weight"), false),
            ["head", "norm", "weight"] => whole(p("norm.weight"), false),
            ["head", "out"] => whole("lm_head.weight".into(), true),
            ["layers", i, "norm1", "weight"] => {
                whole(p(&format!("layers.{i}.input_layernorm.weight")), false)
            }
            ["layers", i, "norm2", "weight"] => whole(
                p(&format!("layers.{i}.post_attention_layernorm.weight")),
                false,
            ),
            // Qwen3's norms over each head of q and k.
            ["layers", i, "attn", qk @ ("q_norm" | "k_norm"), "weight"] => {
                whole(p(&format!("layers.{i}.self_attn.{qk}.weight")), false)
            }
            // Biases: Qwen2's q, k and v; Llama's with `attention_bias` and `mlp_bias`.
            ["layers", i, "attn", proj, wb @ ("weight" | "bias")] => whole(
                p(&format!("layers.{i}.self_attn.{proj}_proj.{wb}")),
                *wb == "weight",
            ),
            ["layers", i, "mlp", proj, wb @ ("weight" | "bias")] => whole(
                p(&format!("layers.{i}.mlp.{proj}_proj.{wb}")),
                *wb == "weight",
            ),
            _ => return None,
        }),
        Family::Gpt2 => Some(match parts.as_slice() {
            ["embed", "tokens"] => whole(p("wte.weight"), false),
            ["embed", "positions"] => whole(p("wpe.weight"), false),
            ["head", "norm", wb] => whole(p(&format!("ln_f.{wb}")), false),
            ["head", "out"] => whole("lm_head.weight".into(), true),
            ["layers", i, "norm1", wb] => whole(p(&format!("h.{i}.ln_1.{wb}")), false),
            ["layers", i, "norm2", wb] => whole(p(&format!("h.{i}.ln_2.{wb}")), false),
            ["layers", i, "attn", qkv @ ("q" | "k" | "v"), wb] => Origin::Split {
                key: p(&format!("h.{i}.attn.c_attn.{wb}")),
                part: ["q", "k", "v"].iter().position(|x| x == qkv)?,
                parts: 3,
            },
            ["layers", i, "attn", "o", wb] => whole(p(&format!("h.{i}.attn.c_proj.{wb}")), false),
            ["layers", i, "mlp", "up", wb] => whole(p(&format!("h.{i}.mlp.c_fc.{wb}")), false),
            ["layers", i, "mlp", "down", wb] => whole(p(&format!("h.{i}.mlp.c_proj.{wb}")), false),
            _ => return None,
        }),
        Family::Bert => {
            let lin = |k: String, wb: &str| whole(format!("{k}.{wb}"), wb == "weight");
            Some(match parts.as_slice() {
                ["embed", "tokens"] => whole(p("embeddings.word_embeddings.weight"), false),
                ["embed", "positions"] => Origin::PositionsWithType {
                    key: p("embeddings.position_embeddings.weight"),
                    types: p("embeddings.token_type_embeddings.weight"),
                },
                ["embed", "norm", wb] => whole(p(&format!("embeddings.LayerNorm.{wb}")), false),
                ["layers", i, "attn", proj, wb] => {
                    let l = p(&format!("encoder.layer.{i}.attention"));
                    let k = match *proj {
                        "q" => format!("{l}.self.query"),
                        "k" => format!("{l}.self.key"),
                        "v" => format!("{l}.self.value"),
                        "o" => format!("{l}.output.dense"),
                        _ => return None,
                    };
                    lin(k, wb)
                }
                ["layers", i, "norm1", wb] => whole(
                    p(&format!(
                        "encoder.layer.{i}.attention.output.LayerNorm.{wb}"
                    )),
                    false,
                ),
                ["layers", i, "mlp", "up", wb] => {
                    lin(p(&format!("encoder.layer.{i}.intermediate.dense")), wb)
                }
                ["layers", i, "mlp", "down", wb] => {
                    lin(p(&format!("encoder.layer.{i}.output.dense")), wb)
                }
                ["layers", i, "norm2", wb] => whole(
                    p(&format!("encoder.layer.{i}.output.LayerNorm.{wb}")),
                    false,
                ),
                _ => return None,
            })
        }
    }
}

/// The prefix the checkpoint puts before the family's names (`model.`,
/// `transformer.`, `roberta.`, or none).
fn prefix_of<'k>(family: Family, mut keys: impl Iterator<Item = &'k String>) -> Option<String> {
    let key = family.embedding_key();
    let mut found: Vec<&String> = keys.by_ref().filter(|k| k.ends_with(key)).collect();
    found.sort_by_key(|k| k.len());
    found.first().map(|k| k[..k.len() - key.len()].to_string())
}

/// Tensors by name: all read (`Stored`), or read one at a time as the
/// model's units ask for them (`read::Lazy`).
trait Tensors {
    fn names(&self) -> Vec<&String>;
    /// Shape and values; `Err`: the bytes could not be read.
    #[allow(clippy::type_complexity)]
    fn tensor(&self, key: &str) -> Result<Option<(Vec<usize>, Cow<'_, [f32]>)>, String>;
}

impl Tensors for Stored {
    fn names(&self) -> Vec<&String> {
        self.keys().collect()
    }
    fn tensor(&self, key: &str) -> Result<Option<(Vec<usize>, Cow<'_, [f32]>)>, String> {
        Ok(self
            .get(key)
            .map(|(s, v)| (s.clone(), Cow::Borrowed(v.as_slice()))))
    }
}

impl Tensors for Lazy {
    fn names(&self) -> Vec<&String> {
        self.keys().collect()
    }
    fn tensor(&self, key: &str) -> Result<Option<(Vec<usize>, Cow<'_, [f32]>)>, String> {
        Ok(self.get(key)?.map(|(s, v)| (s, Cow::Owned(v))))
    }
}

/// Fills a model's base parameters from a checkpoint, one unit or the whole
/// model at a time (`source`), and reports every problem together at the
/// end (`finish`): missing, mis-shaped, unreadable and unexpected tensors,
/// and parameters the family has no tensor for.
pub struct Loader<T> {
    tensors: T,
    family: Family,
    prefix: String,
    used: BTreeSet<String>,
    missing: Vec<String>,
    misshaped: Vec<String>,
    unmapped: Vec<String>,
    unreadable: Vec<String>,
    /// The fused tensor read last (Phi-3's `qkv_proj`, `gate_up_proj`; GPT-2's
    /// `c_attn`): its next blocks come from here, not from the files again.
    fused: Stored,
}

/// A loader reading each tensor from the files when a unit asks for it.
pub type LazyLoader = Loader<Lazy>;

impl LazyLoader {
    /// The checkpoint in `dir` for a model of `spec`'s family; only the
    /// files' headers are read here.
    pub fn open(spec: &ModelSpec, dir: &Path) -> Result<Self, crate::RunError> {
        let lazy = Lazy::open(dir).map_err(crate::RunError::Weights)?;
        Loader::new(lazy, Family::of(spec))
            .map_err(|e| crate::RunError::Weights(format!("{}: {e}", dir.display())))
    }
}

#[allow(private_bounds)]
impl<T: Tensors> Loader<T> {
    fn new(tensors: T, family: Family) -> Result<Self, String> {
        let Some(prefix) = prefix_of(family, tensors.names().into_iter()) else {
            return Err(format!(
                "no `{}` tensor: not a {family:?}-family checkpoint",
                family.embedding_key()
            ));
        };
        Ok(Loader {
            tensors,
            family,
            prefix,
            used: BTreeSet::new(),
            missing: vec![],
            misshaped: vec![],
            unmapped: vec![],
            unreadable: vec![],
            fused: Stored::new(),
        })
    }

    /// The values of rcoa's parameter `name` of `shape` (the `Source` that
    /// `Model::load` and the units' `load` read); `None` when the
    /// checkpoint cannot give them (recorded for `finish`).
    pub fn values(&mut self, name: &str, shape: &[usize]) -> Option<Vec<f32>> {
        let Some(o) = origin(self.family, &self.prefix, name) else {
            self.unmapped.push(name.to_string());
            return None;
        };
        let fused = match &o {
            Origin::Rows { key, .. } | Origin::Split { key, .. } => Some(key),
            _ => None,
        };
        if let Some(key) = fused.filter(|k| !self.fused.contains_key(*k)) {
            self.fused.clear();
            if let Ok(Some((s, v))) = self.tensors.tensor(key) {
                self.fused.insert(key.clone(), (s, v.into_owned()));
            }
        }
        let got = match fused.filter(|k| self.fused.contains_key(*k)) {
            Some(_) => fetch(&o, shape, &self.fused, &mut self.used),
            // Not fused, or unreadable: as any tensor, so the problem is reported.
            None => fetch(&o, shape, &self.tensors, &mut self.used),
        };
        match got {
            Ok(v) => Some(v),
            Err(Problem::Missing(k)) => {
                self.missing.push(k);
                None
            }
            Err(Problem::Shape(k)) => {
                // A fused tensor is read once per block: name it once.
                if !self.misshaped.contains(&k) {
                    self.misshaped.push(k);
                }
                None
            }
            Err(Problem::Unreadable(why)) => {
                self.unreadable.push(why);
                None
            }
        }
    }

    /// Every problem met, with the tensors no parameter asked for.
    pub fn finish(self) -> Result<(), String> {
        let family = self.family;
        let prefix = &self.prefix;
        // Tied heads: `lm_head.weight` may be stored too, equal to the embeddings.
        let mut unexpected: Vec<String> = self
            .tensors
            .names()
            .into_iter()
            .filter(|k| !self.used.contains(*k))
            .filter(|k| !k.starts_with(prefix) || !family.ignorable(&k[prefix.len()..]))
            .filter(|k| !(family != Family::Bert && *k == "lm_head.weight"))
            .filter(|k| !(family == Family::Bert && k.starts_with("lm_head.")))
            .cloned()
            .collect();
        unexpected.sort();
        let mut parts = vec![];
        if !self.unreadable.is_empty() {
            parts.push(format!(
                "unreadable tensors: {}",
                self.unreadable.join("; ")
            ));
        }
        if !self.missing.is_empty() {
            parts.push(format!("missing tensors: {}", list(&self.missing)));
        }
        if !self.misshaped.is_empty() {
            parts.push(format!(
                "tensors of the wrong shape: {}",
                self.misshaped.join(", ")
            ));
        }
        if !self.unmapped.is_empty() {
            parts.push(format!(
                "parameters a {family:?} checkpoint has no tensor for: {}",
                list(&self.unmapped)
            ));
        }
        if !unexpected.is_empty() {
            parts.push(format!("unexpected tensors: {}", list(&unexpected)));
        }
        if parts.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "the checkpoint does not fit the plan's model: {}",
                parts.join("; ")
            ))
        }
    }
}

/// Fill `model`'s base parameters from the safetensors checkpoint in `dir`,
/// one tensor read at a time.
pub fn load_into<B: Backend>(
    model: &mut Model<B>,
    spec: &ModelSpec,
    dir: &Path,
) -> Result<(), crate::RunError> {
    if crate::prebuild::recording() {
        // A recording pass launches what loading launches (each parameter's
        // upload and cast) and needs no values: reading a 7B checkpoint
        // would add tens of seconds to the cold start it shortens.
        model.load(&mut |_, shape| Some(vec![0.0; shape.iter().product()]));
        return Ok(());
    }
    let mut loader = LazyLoader::open(spec, dir)?;
    model.load(&mut |name, shape| loader.values(name, shape));
    loader
        .finish()
        .map_err(|e| crate::RunError::Weights(format!("{}: {e}", dir.display())))
}

/// [`load_into`] from tensors already read.
pub fn load_from<B: Backend>(
    model: &mut Model<B>,
    family: Family,
    stored: &Stored,
) -> Result<(), String> {
    let mut loader = Loader::new(stored, family)?;
    model.load(&mut |name, shape| loader.values(name, shape));
    loader.finish()
}

impl<T: Tensors> Tensors for &T {
    fn names(&self) -> Vec<&String> {
        (*self).names()
    }
    fn tensor(&self, key: &str) -> Result<Option<(Vec<usize>, Cow<'_, [f32]>)>, String> {
        (*self).tensor(key)
    }
}

fn list(v: &[String]) -> String {
    v.join(", ")
}

enum Problem {
    Missing(String),
    Shape(String),
    Unreadable(String),
}

/// The values of one parameter, in rcoa's layout, as f32.
fn fetch(
    o: &Origin,
    shape: &[usize],
    stored: &impl Tensors,
    used: &mut BTreeSet<String>,
) -> Result<Vec<f32>, Problem> {
    let get = |k: &str| match stored.tensor(k) {
        // Integer and 8-bit tensors read as no values (`read::to_f32`).
        Ok(Some((s, v))) if v.len() != s.iter().product::<usize>() => Err(Problem::Unreadable(
            format!("`{k}` is not stored as f32, f16, bf16 or f64"),
        )),
        Ok(Some(t)) => Ok(t),
        Ok(None) => Err(Problem::Missing(k.to_string())),
        Err(why) => Err(Problem::Unreadable(why)),
    };
    let bad = |k: &str, got: &[usize], want: String| {
        Problem::Shape(format!("`{k}` is {got:?}, the plan needs {want}"))
    };
    match o {
        Origin::Whole { key, transpose } => {
            let (s, v) = get(key)?;
            let (s, v) = (&s, v.as_ref());
            used.insert(key.clone());
            let want: Vec<usize> = if *transpose {
                shape.iter().rev().copied().collect()
            } else {
                shape.to_vec()
            };
            if *s != want {
                return Err(bad(key, s, format!("{want:?}")));
            }
            Ok(if *transpose {
                transpose2(v, s[0], s[1])
            } else {
                v.to_vec()
            })
        }
        Origin::Split { key, part, parts } => {
            let (s, v) = get(key)?;
            let (s, v) = (&s, v.as_ref());
            used.insert(key.clone());
            let cols = *shape.last().unwrap_or(&0);
            let mut want = shape.to_vec();
            if let Some(l) = want.last_mut() {
                *l *= parts;
            }
            if *s != want {
                return Err(bad(key, s, format!("{want:?}")));
            }
            let width = cols * parts;
            Ok(v.chunks(width)
                .flat_map(|row| row[part * cols..(part + 1) * cols].iter().copied())
                .collect())
        }
        Origin::Rows {
            key,
            start,
            len,
            total,
        } => {
            let (s, v) = get(key)?;
            let (s, v) = (&s, v.as_ref());
            used.insert(key.clone());
            // rcoa's `[in, len]` comes from rows of the `[total, in]` weight.
            let want = [*total, shape[0]];
            if shape.len() != 2 || shape[1] != *len || s.as_slice() != want {
                return Err(bad(key, s, format!("{want:?}")));
            }
            let d_in = shape[0];
            Ok(transpose2(
                &v[start * d_in..(start + len) * d_in],
                *len,
                d_in,
            ))
        }
        Origin::PositionsWithType { key, types } => {
            let (s, v) = get(key)?;
            used.insert(key.clone());
            if s != shape {
                return Err(bad(key, &s, format!("{shape:?}")));
            }
            let mut out = v.into_owned();
            if let Some((ts, tv)) = stored.tensor(types).map_err(Problem::Unreadable)? {
                let (ts, tv) = (&ts, tv.as_ref());
                used.insert(types.clone());
                let d = shape[1];
                if ts.len() != 2 || ts[1] != d {
                    return Err(bad(types, ts, format!("[_, {d}]")));
                }
                for row in out.chunks_mut(d) {
                    for (x, t) in row.iter_mut().zip(&tv[..d]) {
                        *x += t;
                    }
                }
            }
            Ok(out)
        }
    }
}

fn transpose2(v: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0.0; v.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = v[r * cols + c];
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::BTreeMap;

    /// Tensors in memory that count how often each is read.
    struct Counting {
        stored: Stored,
        reads: RefCell<BTreeMap<String, usize>>,
    }

    impl Tensors for Counting {
        fn names(&self) -> Vec<&String> {
            self.stored.keys().collect()
        }
        fn tensor(&self, key: &str) -> Result<Option<(Vec<usize>, Cow<'_, [f32]>)>, String> {
            *self.reads.borrow_mut().entry(key.into()).or_default() += 1;
            self.stored.tensor(key)
        }
    }

    /// Phi-3's `qkv_proj` of 2 query heads and 1 key/value head of 2 over a hidden size
    /// of 3: q, k and v are its row blocks (transposed to rcoa's `[in, out]`), read from
    /// the checkpoint once for the three.
    #[test]
    fn fused_row_blocks_are_cut_from_one_read() {
        let fused = Fused {
            q: 4,
            kv: 2,
            ffn: 5,
        };
        let key = "model.layers.0.self_attn.qkv_proj.weight".to_string();
        // Row r of the `[8, 3]` weight is [10r, 10r + 1, 10r + 2].
        let rows: Vec<f32> = (0..8)
            .flat_map(|r| (0..3).map(move |c| (10 * r + c) as f32))
            .collect();
        let mut stored = Stored::new();
        stored.insert(key.clone(), (vec![8, 3], rows));
        stored.insert(
            "model.embed_tokens.weight".into(),
            (vec![1, 3], vec![0.0; 3]),
        );
        let counting = Counting {
            stored,
            reads: RefCell::new(BTreeMap::new()),
        };
        let mut loader = Loader::new(&counting, Family::Phi3(fused)).unwrap();
        let q = loader.values("layers.0.attn.q.weight", &[3, 4]).unwrap();
        let k = loader.values("layers.0.attn.k.weight", &[3, 2]).unwrap();
        let v = loader.values("layers.0.attn.v.weight", &[3, 2]).unwrap();
        // `[in, out]`: element (i, o) is row `start + o`'s column i.
        let block = |start: usize, len: usize| -> Vec<f32> {
            (0..3)
                .flat_map(|i| (0..len).map(move |o| (10 * (start + o) + i) as f32))
                .collect()
        };
        assert_eq!((q, k, v), (block(0, 4), block(4, 2), block(6, 2)));
        assert_eq!(counting.reads.borrow()[&key], 1);
        // A block of the wrong width is named, once.
        assert!(loader.values("layers.0.attn.k.weight", &[3, 3]).is_none());
        assert!(loader.values("layers.0.attn.v.weight", &[3, 3]).is_none());
        assert_eq!(loader.misshaped.len(), 1, "{:?}", loader.misshaped);
    }
}
