//! The catalog: GPUs and model presets the compiler knows by name.
//!
//! The entries are data, not code: `compiler/catalog/gpus.toml` and
//! `compiler/catalog/models.toml` are embedded with `include_str!` and parsed
//! once, on first use, into a [`Catalog`]. Each file documents its units and
//! where every number comes from. Invariants (checked by the tests below, so
//! a bad edit of the data fails `cargo test` rather than a user's run):
//! the files parse, names are unique and sorted lookups are exact, every model
//! satisfies the same shape constraints the resolver applies to user models,
//! and each model's published parameter count matches its shape.
//!
//! Entries are listed in file order (the order `rcoa catalog` prints).

use crate::spec::{Arch, GpuSpec, Mlp, ModelSpec, Norm, Positions};
use serde::{Deserialize, Serialize};
use std::sync::OnceLock;

const GPUS_TOML: &str = include_str!("../../catalog/gpus.toml");
const MODELS_TOML: &str = include_str!("../../catalog/models.toml");

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;

/// A GPU of the catalog, with the defaults a `hardware` section takes from it.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GpuEntry {
    pub name: String,
    /// The product this entry stands for, e.g. `NVIDIA H100 80GB HBM3 (SXM5)`.
    pub product: String,
    /// CUDA compute capability x 10 (`sm_90`: 90).
    pub sm: u32,
    /// Device memory as PyTorch reports it (`total_memory`), bytes.
    pub memory_bytes: u64,
    /// Where `memory_bytes` comes from (measured, or as reported).
    pub memory_source: String,
    /// Dense bf16 throughput, TFLOP/s (the fp32 CUDA-core rate where there are no bf16 tensor cores).
    pub bf16_tflops: f64,
    /// Dense fp16 tensor-core throughput, TFLOP/s.
    pub fp16_tflops: f64,
    /// fp32 throughput of the CUDA cores (no tensor cores), TFLOP/s.
    pub fp32_tflops: f64,
    pub bf16_tensor_cores: bool,
    /// Device memory bandwidth, bytes/s.
    pub bandwidth_bytes_per_s: f64,
    /// How GPUs of a node talk to each other, e.g. `NVLink 4`.
    pub interconnect: String,
    /// Default `hardware.intra_node`, bytes/s.
    pub intra_node_bytes_per_s: f64,
    /// Default `hardware.inter_node`, bytes/s.
    pub inter_node_bytes_per_s: f64,
    /// Default `hardware.host_memory`: CPU memory of a typical node, bytes.
    pub host_memory_bytes: u64,
    /// The most shared memory one block may take (CUDA's opt-in limit), bytes.
    pub shared_memory_per_block_bytes: u64,
}

impl GpuEntry {
    /// The part of the entry a resolved plan carries.
    pub fn spec(&self) -> GpuSpec {
        GpuSpec {
            name: self.name.clone(),
            memory_bytes: self.memory_bytes,
            bf16_tflops: self.bf16_tflops,
            bandwidth_bytes_per_s: self.bandwidth_bytes_per_s,
            fp16_tflops: Some(self.fp16_tflops),
            fp32_tflops: Some(self.fp32_tflops),
            bf16_tensor_cores: self.bf16_tensor_cores,
            shared_memory_per_block_bytes: Some(self.shared_memory_per_block_bytes),
        }
    }
}

/// A model preset: a Hugging Face architecture by name.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ModelEntry {
    pub name: String,
    /// The Hugging Face model id the numbers come from (empty for the toy models).
    pub hf_id: String,
    /// Parameter count as published (see `models.toml` for what is counted).
    pub params: u64,
    /// The architecture; `spec.name` is the preset name.
    pub spec: ModelSpec,
}

/// Every GPU and model preset, in file order.
#[derive(Debug)]
pub struct Catalog {
    pub gpus: Vec<GpuEntry>,
    pub models: Vec<ModelEntry>,
}

impl Catalog {
    pub fn gpu(&self, name: &str) -> Option<&GpuEntry> {
        self.gpus.iter().find(|g| g.name == name)
    }
    pub fn model(&self, name: &str) -> Option<&ModelEntry> {
        self.models.iter().find(|m| m.name == name)
    }
    /// The entry of a GPU as CUDA names it (`cuDeviceGetName`: `NVIDIA H100 80GB
    /// HBM3`, `Tesla V100-SXM2-32GB`): the one whose product starts with that name
    /// and a word's end, `NVIDIA ` left off both (an `NVIDIA L40` is no L40S, an
    /// `NVIDIA H100 PCIe` no SXM5 H100).
    pub fn gpu_by_device_name(&self, name: &str) -> Option<&GpuEntry> {
        let strip = |s: &str| s.trim().trim_start_matches("NVIDIA ").to_string();
        let name = strip(name);
        if name.is_empty() {
            return None;
        }
        self.gpus.iter().find(|g| {
            let product = strip(&g.product);
            product
                .strip_prefix(&name)
                .is_some_and(|rest| rest.is_empty() || rest.starts_with([' ', '(']))
        })
    }
    pub fn gpu_names(&self) -> impl Iterator<Item = &str> {
        self.gpus.iter().map(|g| g.name.as_str())
    }
    pub fn model_names(&self) -> impl Iterator<Item = &str> {
        self.models.iter().map(|m| m.name.as_str())
    }
}

/// The catalog, parsed on first use.
pub fn catalog() -> &'static Catalog {
    static CATALOG: OnceLock<Catalog> = OnceLock::new();
    CATALOG.get_or_init(|| {
        // The data is compiled into the binary and the tests parse it, so a
        // failure here is a build defect, not a user error.
        parse(GPUS_TOML, MODELS_TOML).unwrap_or_else(|e| panic!("embedded catalog is invalid: {e}"))
    })
}

/// Convenience: a catalog GPU by name.
pub fn gpu(name: &str) -> Option<&'static GpuEntry> {
    catalog().gpu(name)
}

/// Convenience: a catalog model by name.
pub fn model(name: &str) -> Option<&'static ModelEntry> {
    catalog().model(name)
}

// ------------------------------------------------------------------ parsing

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct GpuFile {
    gpu: Vec<RawGpu>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    name: String,
    product: String,
    sm: u32,
    memory_mib: u64,
    memory_source: String,
    bf16_tflops: f64,
    fp16_tflops: f64,
    fp32_tflops: f64,
    bf16_tensor_cores: bool,
    shared_memory_per_block_kib: u64,
    bandwidth_gb_s: f64,
    interconnect: String,
    intra_node_gb_s: f64,
    inter_node_gbps: f64,
    host_memory_gib: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ModelFile {
    model: Vec<RawModel>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawModel {
    name: String,
    hf_id: String,
    arch: Arch,
    layers: u64,
    hidden: u64,
    heads: u64,
    kv_heads: u64,
    #[serde(default)]
    head_dim: Option<u64>,
    ffn: u64,
    mlp: Mlp,
    norm: Norm,
    positions: Positions,
    vocab: u64,
    max_positions: u64,
    tie_embeddings: bool,
    #[serde(default)]
    experts: Option<u64>,
    #[serde(default)]
    experts_per_token: Option<u64>,
    dropout: f64,
    params: u64,
}

fn parse(gpus: &str, models: &str) -> Result<Catalog, String> {
    let gpus: GpuFile = toml::from_str(gpus).map_err(|e| format!("gpus.toml: {e}"))?;
    let models: ModelFile = toml::from_str(models).map_err(|e| format!("models.toml: {e}"))?;
    let gpus = gpus
        .gpu
        .into_iter()
        .map(|g| GpuEntry {
            name: g.name,
            product: g.product,
            sm: g.sm,
            memory_bytes: g.memory_mib * MIB,
            memory_source: g.memory_source,
            bf16_tflops: g.bf16_tflops,
            fp16_tflops: g.fp16_tflops,
            fp32_tflops: g.fp32_tflops,
            bf16_tensor_cores: g.bf16_tensor_cores,
            bandwidth_bytes_per_s: g.bandwidth_gb_s * 1e9,
            interconnect: g.interconnect,
            intra_node_bytes_per_s: g.intra_node_gb_s * 1e9,
            inter_node_bytes_per_s: g.inter_node_gbps * 1e9 / 8.0,
            host_memory_bytes: g.host_memory_gib * GIB,
            shared_memory_per_block_bytes: g.shared_memory_per_block_kib * 1024,
        })
        .collect();
    let models = models
        .model
        .into_iter()
        .map(|m| {
            let head_dim = m
                .head_dim
                .unwrap_or(m.hidden.checked_div(m.heads).unwrap_or(0));
            ModelEntry {
                spec: ModelSpec {
                    name: m.name.clone(),
                    arch: m.arch,
                    layers: m.layers,
                    hidden: m.hidden,
                    heads: m.heads,
                    kv_heads: m.kv_heads,
                    head_dim,
                    ffn: m.ffn,
                    mlp: m.mlp,
                    norm: m.norm,
                    positions: m.positions,
                    vocab: m.vocab,
                    max_positions: m.max_positions,
                    tie_embeddings: m.tie_embeddings,
                    experts: m.experts.unwrap_or(1),
                    experts_per_token: m.experts_per_token.unwrap_or(1),
                    dropout: m.dropout,
                    numerics: Default::default(),
                    weights: None,
                },
                name: m.name,
                hf_id: m.hf_id,
                params: m.params,
            }
        })
        .collect();
    Ok(Catalog { gpus, models })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_gpu_is_found_by_the_name_cuda_gives_it() {
        let c = catalog();
        let found = |name| c.gpu_by_device_name(name).map(|g| g.name.as_str());
        assert_eq!(found("NVIDIA H100 80GB HBM3"), Some("h100-80gb"));
        assert_eq!(found("NVIDIA H200"), Some("h200-141gb"));
        assert_eq!(found("NVIDIA A100-SXM4-40GB"), Some("a100-40gb"));
        assert_eq!(found("Tesla V100-SXM2-32GB"), Some("v100-32gb"));
        assert_eq!(found("Quadro RTX 6000"), Some("rtx6000-24gb"));
        assert_eq!(found("NVIDIA L40S"), Some("l40s-48gb"));
        assert_eq!(found("NVIDIA GeForce RTX 4090"), Some("rtx4090-24gb"));
        assert_eq!(found("Tesla T4"), Some("t4-16gb"));
        // Other products that share a prefix are not these.
        for other in [
            "NVIDIA L40",
            "NVIDIA H100 PCIe",
            "NVIDIA A100 80GB PCIe",
            "NVIDIA",
            "",
        ] {
            assert_eq!(found(other), None, "{other}");
        }
    }
    use std::collections::BTreeSet;

    #[test]
    fn embedded_files_parse() {
        parse(GPUS_TOML, MODELS_TOML).unwrap();
    }

    #[test]
    fn names_are_unique_identifiers() {
        let c = catalog();
        let mut seen = BTreeSet::new();
        for n in c.gpu_names().chain(c.model_names()) {
            assert!(seen.insert(n.to_string()), "duplicate catalog name {n}");
            // Must be writable as a plan identifier: [a-z][a-z0-9_.-]*
            let mut chars = n.chars();
            assert!(chars.next().is_some_and(|c| c.is_ascii_lowercase()), "{n}");
            assert!(
                chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || "_.-".contains(c)),
                "{n}"
            );
        }
    }

    #[test]
    fn required_entries_exist() {
        for g in [
            "h100-80gb",
            "h200-141gb",
            "a100-80gb",
            "a100-40gb",
            "v100-32gb",
            "rtx6000-24gb",
            "l40s-48gb",
            "rtx4090-24gb",
            "t4-16gb",
        ] {
            assert!(gpu(g).is_some(), "missing GPU {g}");
        }
        for m in [
            "llama-3.2-1b",
            "llama-3.2-3b",
            "llama-3.1-8b",
            "llama-3.1-70b",
            "llama-3.1-405b",
            "xlm-roberta-large",
            "xlm-roberta-xl",
            "xlm-roberta-xxl",
            "gpt2-small",
            "mistral-7b",
            "tiny-decoder",
        ] {
            assert!(model(m).is_some(), "missing model {m}");
        }
    }

    #[test]
    fn h100_memory_is_the_measured_byte_count() {
        assert_eq!(gpu("h100-80gb").unwrap().memory_bytes, 85_017_493_504);
        assert_eq!(gpu("a100-40gb").unwrap().memory_bytes, 40_536 * MIB);
        assert_eq!(gpu("h100-80gb").unwrap().inter_node_bytes_per_s, 400e9);
    }

    #[test]
    fn famous_shapes() {
        let m = &model("llama-3.1-8b").unwrap().spec;
        assert_eq!(
            (
                m.layers,
                m.hidden,
                m.heads,
                m.kv_heads,
                m.ffn,
                m.vocab,
                m.tie_embeddings
            ),
            (32, 4096, 32, 8, 14336, 128256, false)
        );
        assert_eq!(m.head_dim, 128);
        let x = &model("xlm-roberta-large").unwrap().spec;
        assert_eq!(
            (
                x.layers,
                x.hidden,
                x.heads,
                x.ffn,
                x.vocab,
                x.max_positions,
                x.positions,
                x.tie_embeddings
            ),
            (24, 1024, 16, 4096, 250002, 514, Positions::Learned, true)
        );
        let g = &model("gpt2-small").unwrap().spec;
        assert_eq!(
            (g.layers, g.hidden, g.heads, g.ffn, g.vocab, g.mlp, g.norm),
            (12, 768, 12, 3072, 50257, Mlp::Gelu, Norm::Layernorm)
        );
    }

    /// Recomputes each published parameter count from the shape: Llama-style
    /// models have no biases; GPT-2 and (XLM-)RoBERTa have biases on every
    /// linear layer and layer norm, learned positions, and the encoders count
    /// a token-type embedding and the pooler but no MLM head.
    #[test]
    fn published_parameter_counts_match_shapes() {
        for e in &catalog().models {
            let m = &e.spec;
            let (h, l, v, f) = (m.hidden, m.layers, m.vocab, m.ffn);
            let q = m.heads * m.head_dim;
            let kv = m.kv_heads * m.head_dim;
            let count = match (m.mlp, m.arch) {
                (Mlp::Swiglu, _) => {
                    let layer = h * q + 2 * h * kv + q * h + 3 * h * f + 2 * h;
                    l * layer + h + v * h * if m.tie_embeddings { 1 } else { 2 }
                }
                (Mlp::Gelu, Arch::Decoder) => {
                    let layer = 2 * h
                        + (h * 3 * h + 3 * h)
                        + (h * h + h)
                        + 2 * h
                        + (h * f + f)
                        + (f * h + h);
                    v * h + m.max_positions * h + l * layer + 2 * h
                }
                (Mlp::Gelu, Arch::Encoder) => {
                    let emb = v * h + m.max_positions * h + h + 2 * h;
                    let layer = 4 * (h * h + h) + 2 * h + (h * f + f) + (f * h + h) + 2 * h;
                    emb + l * layer + h * h + h
                }
                (Mlp::SquaredRelu, _) => {
                    panic!("{}: count a squared-ReLU preset's parameters here", e.name)
                }
            };
            assert_eq!(
                count, e.params,
                "{}: shape gives {count}, published {}",
                e.name, e.params
            );
        }
    }
}
