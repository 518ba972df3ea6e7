//! Reading `model.safetensors` or a sharded checkpoint
//! (`model.safetensors.index.json` naming one file per tensor) into f32.

use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

/// Tensors by name: shape and values as f32.
pub type Stored = HashMap<String, (Vec<usize>, Vec<f32>)>;

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// Every tensor of the checkpoint in `dir`, or a sentence naming the file
/// that could not be read and what to do.
pub fn read_checkpoint(dir: &Path) -> Result<Stored, String> {
    let files: Vec<String> = if dir.join(SINGLE).is_file() {
        vec![SINGLE.to_string()]
    } else if dir.join(INDEX).is_file() {
        shards(&dir.join(INDEX))?
    } else {
        return Err(format!(
            "{} has neither {SINGLE} nor {INDEX}",
            dir.display()
        ));
    };
    let mut out = Stored::new();
    for f in files {
        read_file(&dir.join(&f), &mut out, &|_| true)?;
    }
    Ok(out)
}

/// Only the tensors of the checkpoint in `dir` whose names `keep` accepts,
/// opening only the shards that hold one; `None` without a checkpoint.
pub fn read_matching(dir: &Path, keep: &dyn Fn(&str) -> bool) -> Result<Option<Stored>, String> {
    let files: Vec<String> = if dir.join(SINGLE).is_file() {
        vec![SINGLE.to_string()]
    } else if dir.join(INDEX).is_file() {
        let json: serde_json::Value = std::fs::read_to_string(dir.join(INDEX))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default();
        let map = json["weight_map"].as_object().cloned().unwrap_or_default();
        let wanted: BTreeSet<String> = map
            .iter()
            .filter(|(k, _)| keep(k))
            .filter_map(|(_, f)| f.as_str().map(str::to_string))
            .collect();
        // The same checks as a full read (no file outside the folder).
        let all = shards(&dir.join(INDEX))?;
        all.into_iter().filter(|f| wanted.contains(f)).collect()
    } else {
        return Ok(None);
    };
    let mut out = Stored::new();
    for f in files {
        read_file(&dir.join(&f), &mut out, keep)?;
    }
    Ok(Some(out))
}

/// The shard files an index names, each once, in order.
fn shards(index: &Path) -> Result<Vec<String>, String> {
    let bad = |why: String| {
        format!(
            "cannot use the shard index {}: {why}; save the checkpoint again",
            index.display()
        )
    };
    let text = std::fs::read_to_string(index).map_err(|e| bad(e.to_string()))?;
    let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let map = json
        .get("weight_map")
        .and_then(|m| m.as_object())
        .ok_or_else(|| bad("it has no `weight_map` object".into()))?;
    let mut files = BTreeSet::new();
    for (k, v) in map {
        let f = v
            .as_str()
            .ok_or_else(|| bad(format!("the file of `{k}` is not a string")))?;
        if f.contains('/') || f.contains('\\') || f == ".." {
            return Err(bad(format!(
                "the file `{f}` is not in the checkpoint folder"
            )));
        }
        files.insert(f.to_string());
    }
    Ok(files.into_iter().collect())
}

fn read_file(path: &Path, out: &mut Stored, keep: &dyn Fn(&str) -> bool) -> Result<(), String> {
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let st = SafeTensors::deserialize(&bytes).map_err(|e| {
        format!(
            "{} is not a readable safetensors file ({e}); it may be truncated or corrupt: download or save it again",
            path.display()
        )
    })?;
    for (name, view) in st.tensors() {
        if !keep(&name) {
            continue;
        }
        let data = view.data();
        let values: Vec<f32> = match view.dtype() {
            Dtype::F32 => data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => data
                .chunks_exact(2)
                .map(|b| f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16))
                .collect(),
            Dtype::F16 => data
                .chunks_exact(2)
                .map(|b| f16_to_f32(u16::from_le_bytes([b[0], b[1]])))
                .collect(),
            Dtype::F64 => data
                .chunks_exact(8)
                .map(|b| f64::from_le_bytes(b.try_into().unwrap_or([0; 8])) as f32)
                .collect(),
            // Integer / boolean buffers (position ids, attention-mask
            // buffers) are never parameters: keep their shape only, so
            // they are reported if nothing skips them.
            _ => vec![],
        };
        out.insert(name, (view.shape().to_vec(), values));
    }
    Ok(())
}

/// IEEE half to single precision (exact).
fn f16_to_f32(h: u16) -> f32 {
    let sign = ((h >> 15) as u32) << 31;
    let exp = ((h >> 10) & 0x1f) as u32;
    let frac = (h & 0x3ff) as u32;
    let bits = match (exp, frac) {
        (0, 0) => sign,
        (0, f) => {
            // Subnormal: normalise.
            let mut e = 127 - 15 + 1;
            let mut f = f;
            while f & 0x400 == 0 {
                f <<= 1;
                e -= 1;
            }
            sign | ((e as u32) << 23) | ((f & 0x3ff) << 13)
        }
        (0x1f, f) => sign | 0x7f80_0000 | (f << 13),
        (e, f) => sign | ((e + 127 - 15) << 23) | (f << 13),
    };
    f32::from_bits(bits)
}

#[cfg(test)]
mod tests {
    use super::f16_to_f32;

    #[test]
    fn half_precision_values_convert_exactly() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert_eq!(f16_to_f32(0x7bff), 65504.0);
        assert!(f16_to_f32(0x7c00).is_infinite());
    }
}
