//! Reading `model.safetensors` or a sharded checkpoint
//! (`model.safetensors.index.json` naming one file per tensor) into f32.

use safetensors::{Dtype, SafeTensors};
use std::collections::{BTreeSet, HashMap};
use std::path::Path;

/// One tensor: its shape and its values as f32.
pub type Values = (Vec<usize>, Vec<f32>);

/// Tensors by name: shape and values as f32.
pub type Stored = HashMap<String, Values>;

const SINGLE: &str = "model.safetensors";
const INDEX: &str = "model.safetensors.index.json";

/// Every tensor of the checkpoint in `dir`, or a sentence naming the file
/// that could not be read and what to do.
pub fn read_checkpoint(dir: &Path) -> Result<Stored, String> {
    let mut out = Stored::new();
    for f in checkpoint_files(dir)? {
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

/// The files of the checkpoint in `dir`: `model.safetensors`, or the shards
/// its index names.
fn checkpoint_files(dir: &Path) -> Result<Vec<String>, String> {
    if dir.join(SINGLE).is_file() {
        Ok(vec![SINGLE.to_string()])
    } else if dir.join(INDEX).is_file() {
        shards(&dir.join(INDEX))
    } else {
        Err(format!(
            "{} has neither {SINGLE} nor {INDEX}",
            dir.display()
        ))
    }
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

/// The safetensors checkpoint in a folder, opened for reading one tensor at
/// a time: only the headers are read when it is opened, and each tensor's
/// bytes when it is asked for, so a model can be loaded unit by unit without
/// the whole checkpoint in memory.
pub struct Lazy {
    files: Vec<LazyFile>,
    /// Tensor name → index in `files`.
    at: HashMap<String, usize>,
}

struct LazyFile {
    path: std::path::PathBuf,
    /// Where the data section starts (after the length and the header).
    data_start: u64,
    meta: safetensors::tensor::Metadata,
}

impl Lazy {
    /// The checkpoint in `dir` (`model.safetensors` or a sharded index), or
    /// a sentence naming the file that could not be read and what to do.
    pub fn open(dir: &Path) -> Result<Lazy, String> {
        let files = checkpoint_files(dir)?;
        let mut lazy = Lazy {
            files: Vec::new(),
            at: HashMap::new(),
        };
        for f in files {
            let file = LazyFile::open(&dir.join(&f))?;
            for name in file.meta.tensors().into_keys() {
                lazy.at.insert(name, lazy.files.len());
            }
            lazy.files.push(file);
        }
        Ok(lazy)
    }

    /// Every tensor name.
    pub fn keys(&self) -> impl Iterator<Item = &String> {
        self.at.keys()
    }

    /// One tensor's shape and values as f32 (`None`: no such tensor; an
    /// error: its bytes could not be read).
    pub fn get(&self, name: &str) -> Result<Option<Values>, String> {
        let Some(&f) = self.at.get(name) else {
            return Ok(None);
        };
        let file = &self.files[f];
        let Some(info) = file.meta.info(name) else {
            return Ok(None);
        };
        let (s, e) = info.data_offsets;
        let mut bytes = vec![0u8; e - s];
        let mut read = || -> std::io::Result<()> {
            use std::io::{Read, Seek, SeekFrom};
            let mut h = std::fs::File::open(&file.path)?;
            h.seek(SeekFrom::Start(file.data_start + s as u64))?;
            h.read_exact(&mut bytes)
        };
        read().map_err(|e| {
            format!(
                "cannot read `{name}` from {}: {e}; it may be truncated: download or save it again",
                file.path.display()
            )
        })?;
        Ok(Some((info.shape.clone(), to_f32(info.dtype, &bytes))))
    }
}

impl LazyFile {
    fn open(path: &Path) -> Result<LazyFile, String> {
        use std::io::Read;
        let corrupt = |why: String| {
            format!(
                "{} is not a readable safetensors file ({why}); it may be truncated or corrupt: download or save it again",
                path.display()
            )
        };
        let mut h = std::fs::File::open(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let size = h
            .metadata()
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?
            .len();
        let mut n = [0u8; 8];
        h.read_exact(&mut n)
            .map_err(|_| corrupt("no header length".into()))?;
        let n = u64::from_le_bytes(n);
        if n.saturating_add(8) > size {
            return Err(corrupt(format!(
                "a header of {n} bytes in a file of {size}"
            )));
        }
        let mut header = vec![0u8; n as usize];
        h.read_exact(&mut header)
            .map_err(|e| corrupt(e.to_string()))?;
        // Deserializing validates the offsets: contiguous, each tensor's
        // bytes its shape times its dtype.
        let meta: safetensors::tensor::Metadata =
            serde_json::from_slice(&header).map_err(|e| corrupt(e.to_string()))?;
        let data_end = meta
            .tensors()
            .values()
            .map(|i| i.data_offsets.1 as u64)
            .max()
            .unwrap_or(0);
        if 8 + n + data_end != size {
            return Err(corrupt(format!(
                "the header describes {} bytes of data, the file holds {}",
                data_end,
                size - 8 - n
            )));
        }
        Ok(LazyFile {
            path: path.to_path_buf(),
            data_start: 8 + n,
            meta,
        })
    }
}

/// A tensor's little-endian bytes of `dtype` as f32. Integer and boolean
/// buffers (position ids, attention-mask buffers) are never parameters:
/// they come back empty, so a name nothing skips is still reported.
fn to_f32(dtype: Dtype, data: &[u8]) -> Vec<f32> {
    match dtype {
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
        _ => vec![],
    }
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
        let values = to_f32(view.dtype(), view.data());
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
