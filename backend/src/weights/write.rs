//! rcoa's weights out in the Hugging Face layout of the model's family
//! (f32), the inverse of the load mapping: `model.safetensors`, or above
//! the shard size the files and index `transformers` writes
//! (`model-00001-of-00003.safetensors`, `model.safetensors.index.json`).

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
        Family::Llama | Family::Phi3(_) => "model.",
        Family::Gpt2 => "transformer.",
        Family::Bert => "",
    }
}

/// One rcoa parameter: name (`layers.0.attn.q.weight`), shape, f32 values.
pub type RcoaTensor = (String, Vec<usize>, Vec<f32>);

/// The model's base parameters as HF tensors: name → (shape, values).
pub fn hf_tensors<B: Backend>(
    model: &Model<B>,
    family: Family,
) -> Result<BTreeMap<String, HfTensor>, String> {
    let mut params: Vec<RcoaTensor> = vec![];
    model.export(&mut |name, shape, values| params.push((name.to_string(), shape, values)));
    hf_tensors_of(params, family)
}

/// rcoa parameters (as `Model::export` names them) as HF tensors.
pub fn hf_tensors_of(
    params: Vec<RcoaTensor>,
    family: Family,
) -> Result<BTreeMap<String, HfTensor>, String> {
    let prefix = save_prefix(family);
    let mut out: BTreeMap<String, HfTensor> = BTreeMap::new();
    // GPT-2's q, k, v columns, gathered per fused tensor.
    let mut fused: BTreeMap<String, Vec<Option<HfTensor>>> = BTreeMap::new();
    // Phi-3's row blocks, per fused `nn.Linear` weight: its rows, and each block's
    // first row with rcoa's `[in, len]`.
    let mut blocks: BTreeMap<String, (usize, Vec<(usize, HfTensor)>)> = BTreeMap::new();
    let mut unmapped = vec![];
    for (name, shape, values) in params {
        match origin(family, prefix, &name) {
            None => unmapped.push(name),
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
            Some(Origin::Rows {
                key,
                start,
                len,
                total,
            }) => {
                if shape.len() != 2 || shape[1] != len {
                    return Err(format!(
                        "`{name}` is {shape:?}, not a block of {len} rows of `{key}`"
                    ));
                }
                let slot = blocks.entry(key).or_insert_with(|| (total, vec![]));
                slot.1.push((start, (shape, values)));
            }
            Some(Origin::PositionsWithType { key, types }) => {
                let d = shape[1];
                out.insert(types, (vec![1, d], vec![0.0; d]));
                out.insert(key, (shape, values));
            }
        }
    }
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
    for (key, (total, mut parts)) in blocks {
        parts.sort_by_key(|p| p.0);
        let d_in = parts[0].1 .0[0];
        let mut v = vec![0f32; total * d_in];
        let mut next = 0;
        for (start, (shape, values)) in &parts {
            let len = shape[1];
            if *start != next || shape[0] != d_in {
                return Err(format!("`{key}`: its row blocks do not tile it"));
            }
            // `[in, len]` back to rows `start..start + len` of `[total, in]`.
            v[start * d_in..(start + len) * d_in]
                .copy_from_slice(&super::transpose2(values, d_in, len));
            next = start + len;
        }
        if next != total {
            return Err(format!("`{key}`: rows {next}..{total} have no parameter"));
        }
        out.insert(key, (vec![total, d_in], v));
    }
    Ok(out)
}

/// `transformers`' default `max_shard_size` ("5GB", decimal).
pub const DEFAULT_MAX_SHARD_BYTES: u64 = 5_000_000_000;

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// Write the model's tensors (f32) into `dir` as `transformers` does:
/// `model.safetensors` when they fit in one shard of `max_shard_bytes`, else
/// `model-0000k-of-0000N.safetensors` and `model.safetensors.index.json`.
/// Returns the files written.
pub fn write_model(
    tensors: &BTreeMap<String, HfTensor>,
    dir: &Path,
    max_shard_bytes: u64,
) -> Result<Vec<String>, String> {
    let shards = plan_shards(tensors, max_shard_bytes);
    if shards.len() <= 1 {
        write_file(tensors.iter(), &dir.join(SINGLE))?;
        return Ok(vec![SINGLE.to_string()]);
    }
    let n = shards.len();
    let mut files = vec![];
    let mut weight_map = serde_json::Map::new();
    for (i, keys) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", i + 1);
        write_file(keys.iter().map(|k| (*k, &tensors[*k])), &dir.join(&file))?;
        for k in keys {
            weight_map.insert((*k).clone(), file.clone().into());
        }
        files.push(file);
    }
    let total_size: u64 = tensors.values().map(|(_, v)| 4 * v.len() as u64).sum();
    let total_parameters: u64 = tensors.values().map(|(_, v)| v.len() as u64).sum();
    let index = serde_json::json!({
        "metadata": { "total_size": total_size, "total_parameters": total_parameters },
        "weight_map": weight_map,
    });
    let text = serde_json::to_string_pretty(&index).map_err(|e| e.to_string())?;
    std::fs::write(dir.join(INDEX), text + "\n")
        .map_err(|e| format!("cannot write {}: {e}", dir.join(INDEX).display()))?;
    files.push(INDEX.to_string());
    Ok(files)
}

/// The tensors of each shard, in order, as `huggingface_hub`'s
/// `split_torch_state_dict_into_shards` groups them: a tensor joins the
/// current shard unless that would pass `max` bytes; a tensor larger than
/// `max` gets a shard of its own.
fn plan_shards(tensors: &BTreeMap<String, HfTensor>, max: u64) -> Vec<Vec<&String>> {
    let mut shards: Vec<Vec<&String>> = vec![];
    let mut current: Vec<&String> = vec![];
    let mut size = 0u64;
    for (k, (_, v)) in tensors {
        let bytes = 4 * v.len() as u64;
        if bytes > max {
            shards.push(vec![k]);
            continue;
        }
        if size + bytes > max && !current.is_empty() {
            shards.push(std::mem::take(&mut current));
            size = 0;
        }
        current.push(k);
        size += bytes;
    }
    if !current.is_empty() {
        shards.push(current);
    }
    shards
}

/// One safetensors file (f32, `format: pt` as PyTorch's writers mark it).
pub fn write_file<'a>(
    tensors: impl Iterator<Item = (&'a String, &'a HfTensor)>,
    path: &Path,
) -> Result<(), String> {
    let bytes: Vec<(&String, &Vec<usize>, Vec<u8>)> = tensors
        .map(|(k, (s, v))| (k, s, v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let mut views = vec![];
    for (k, s, b) in &bytes {
        let view = TensorView::new(Dtype::F32, (*s).clone(), b).map_err(|e| format!("{k}: {e}"))?;
        views.push(((*k).clone(), view));
    }
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize_to_file(views, Some(meta), path)
        .map_err(|e| format!("cannot write {}: {e}", path.display()))
}
