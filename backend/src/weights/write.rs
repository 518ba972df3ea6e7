//! rcoa's weights out in the Hugging Face layout of the model's family
//! (`model.safetensors`, f32), the inverse of the load mapping.

use super::{origin, Family, Origin};
use crate::model::Model;
use burn::tensor::backend::Backend;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::Path;

/// One tensor: shape and f32 values.
pub type HfTensor = (Vec<usize>, Vec<f32>);

/// The prefix rcoa writes before the family's names (that of
/// `LlamaForCausalLM`, `GPT2LMHeadModel`, `XLMRobertaModel`).
pub fn save_prefix(family: Family) -> &'static str {
    match family {
        Family::Llama => "model.",
        Family::Gpt2 => "transformer.",
        Family::Bert => "",
    }
}

/// The model's base parameters as HF tensors: name → (shape, values).
pub fn hf_tensors<B: Backend>(
    model: &Model<B>,
    family: Family,
) -> Result<BTreeMap<String, HfTensor>, String> {
    let prefix = save_prefix(family);
    let mut out: BTreeMap<String, HfTensor> = BTreeMap::new();
    // GPT-2's q, k, v columns, gathered per fused tensor.
    let mut fused: BTreeMap<String, Vec<Option<HfTensor>>> = BTreeMap::new();
    let mut unmapped = vec![];
    model.export(
        &mut |name, shape, values| match origin(family, prefix, name) {
            None => unmapped.push(name.to_string()),
            Some(Origin::Whole { key, transpose }) => {
                if transpose {
                    let (r, c) = (shape[0], shape[1]);
                    out.insert(key, (vec![c, r], super::transpose2(&values, r, c)));
                } else {
                    out.insert(key, (shape, values));
                }
            }
            Some(Origin::Split { key, part, parts }) => {
                let slot = fused.entry(key).or_insert_with(|| vec![None; parts]);
                slot[part] = Some((shape, values));
            }
            Some(Origin::PositionsWithType { key, types }) => {
                let d = shape[1];
                out.insert(types, (vec![1, d], vec![0.0; d]));
                out.insert(key, (shape, values));
            }
        },
    );
    if !unmapped.is_empty() {
        return Err(format!("no {family:?} tensor for {}", unmapped.join(", ")));
    }
    for (key, parts) in fused {
        let parts: Vec<HfTensor> = parts.into_iter().flatten().collect();
        let cols: Vec<usize> = parts.iter().map(|(s, _)| *s.last().unwrap_or(&0)).collect();
        let rows = parts[0].1.len() / cols[0].max(1);
        let mut v = Vec::with_capacity(rows * cols.iter().sum::<usize>());
        for r in 0..rows {
            for ((_, vals), c) in parts.iter().zip(&cols) {
                v.extend_from_slice(&vals[r * c..(r + 1) * c]);
            }
        }
        let mut shape = parts[0].0.clone();
        if let Some(l) = shape.last_mut() {
            *l = cols.iter().sum();
        }
        out.insert(key, (shape, v));
    }
    Ok(out)
}

/// Write `model.safetensors` (f32) into `dir`.
pub fn write_safetensors(tensors: &BTreeMap<String, HfTensor>, dir: &Path) -> Result<(), String> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(k, (s, v))| {
            let b = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            (k.clone(), s.clone(), b)
        })
        .collect();
    let mut views = vec![];
    for (k, s, b) in &bytes {
        let view = TensorView::new(Dtype::F32, s.clone(), b).map_err(|e| format!("{k}: {e}"))?;
        views.push((k.clone(), view));
    }
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), &dir.join("model.safetensors")).map_err(|e| {
        format!(
            "cannot write {}: {e}",
            dir.join("model.safetensors").display()
        )
    })
}
