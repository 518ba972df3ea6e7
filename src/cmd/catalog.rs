//! `rcoa catalog gpus|models [--format text|json]`: what the compiler knows
//! by name, with the numbers it uses.
//!
//! The text form is an aligned table (numbers right-aligned); the JSON form
//! is an array of the catalog entries as the compiler holds them (bytes,
//! bytes/s, TFLOP/s), for scripts.

use rcoa_compiler::catalog::{catalog, GpuEntry, ModelEntry};
use rcoa_compiler::spec::{Arch, Mlp, Norm, Positions};
use std::process::ExitCode;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum What {
    Gpus,
    Models,
}

pub use super::common::Format;

#[derive(clap::Args)]
pub struct Args {
    /// Which list to print.
    #[arg(value_enum)]
    pub what: What,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
}

pub fn run(args: Args) -> ExitCode {
    let c = catalog();
    let out = match (args.what, args.format) {
        (What::Gpus, Format::Text) => Ok(gpu_table(&c.gpus)),
        (What::Models, Format::Text) => Ok(model_table(&c.models)),
        (What::Gpus, Format::Json) => serde_json::to_string_pretty(&c.gpus),
        (What::Models, Format::Json) => serde_json::to_string_pretty(&c.models),
    };
    match out {
        Ok(s) => {
            println!("{}", s.trim_end());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: cannot serialize the catalog: {e}");
            ExitCode::from(2)
        }
    }
}

const GIB: f64 = (1u64 << 30) as f64;

fn gpu_table(gpus: &[GpuEntry]) -> String {
    let header = [
        "NAME",
        "SM",
        "MEMORY",
        "BYTES",
        "BF16 TFLOP/S",
        "FP16 TFLOP/S",
        "FP32 TFLOP/S",
        "HBM GB/S",
        "LINK",
        "INTRA GB/S",
        "INTER GB/S",
        "HOST",
        "SHARED/BLOCK",
        "PRODUCT",
    ];
    let rows = gpus
        .iter()
        .map(|g| {
            vec![
                g.name.clone(),
                g.sm.to_string(),
                format!("{:.2} GiB", g.memory_bytes as f64 / GIB),
                g.memory_bytes.to_string(),
                format!("{:.1}", g.bf16_tflops),
                format!("{:.1}", g.fp16_tflops),
                format!("{:.1}", g.fp32_tflops),
                format!("{:.0}", g.bandwidth_bytes_per_s / 1e9),
                g.interconnect.clone(),
                format!("{:.0}", g.intra_node_bytes_per_s / 1e9),
                format!("{:.1}", g.inter_node_bytes_per_s / 1e9),
                format!("{:.0} GiB", g.host_memory_bytes as f64 / GIB),
                format!("{} KiB", g.shared_memory_per_block_bytes / 1024),
                g.product.clone(),
            ]
        })
        .collect();
    // Left-aligned: names and text; the rest are numbers.
    table(&header, rows, &[0, 8, 13])
}

fn model_table(models: &[ModelEntry]) -> String {
    let header = [
        "NAME", "ARCH", "LAYERS", "HIDDEN", "HEADS", "KV", "HEAD_DIM", "FFN", "MLP", "NORM", "POS",
        "VOCAB", "MAX_POS", "TIED", "PARAMS", "HF ID",
    ];
    let rows = models
        .iter()
        .map(|e| {
            let m = &e.spec;
            vec![
                e.name.clone(),
                arch(m.arch),
                m.layers.to_string(),
                m.hidden.to_string(),
                m.heads.to_string(),
                m.kv_heads.to_string(),
                m.head_dim.to_string(),
                m.ffn.to_string(),
                mlp(m.mlp),
                norm(m.norm),
                positions(m.positions),
                m.vocab.to_string(),
                m.max_positions.to_string(),
                if m.tie_embeddings {
                    "yes".into()
                } else {
                    "no".into()
                },
                params(e.params),
                if e.hf_id.is_empty() {
                    "-".into()
                } else {
                    e.hf_id.clone()
                },
            ]
        })
        .collect();
    table(&header, rows, &[0, 1, 8, 9, 10, 13, 15])
}

/// How plans spell the spec's enums.
fn arch(a: Arch) -> String {
    match a {
        Arch::Decoder => "decoder",
        Arch::Encoder => "encoder",
    }
    .into()
}

fn mlp(m: Mlp) -> String {
    match m {
        Mlp::Swiglu => "swiglu",
        Mlp::Gelu => "gelu",
        Mlp::SquaredRelu => "squared_relu",
    }
    .into()
}

fn norm(n: Norm) -> String {
    match n {
        Norm::Rmsnorm => "rmsnorm",
        Norm::Layernorm => "layernorm",
    }
    .into()
}

fn positions(p: Positions) -> String {
    match p {
        Positions::Rope => "rope",
        Positions::Learned => "learned",
    }
    .into()
}

fn params(n: u64) -> String {
    let n = n as f64;
    if n >= 1e9 {
        format!("{:.2}B", n / 1e9)
    } else if n >= 1e6 {
        format!("{:.0}M", n / 1e6)
    } else {
        format!("{:.0}K", n / 1e3)
    }
}

/// Columns separated by two spaces; `left` lists the left-aligned columns.
fn table(header: &[&str], rows: Vec<Vec<String>>, left: &[usize]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in &rows {
        for (w, cell) in widths.iter_mut().zip(r) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<String>| {
        let mut s = String::new();
        for (i, (cell, w)) in cells.iter().zip(&widths).enumerate() {
            if i > 0 {
                s.push_str("  ");
            }
            if left.contains(&i) {
                s.push_str(&format!("{cell:<w$}"));
            } else {
                s.push_str(&format!("{cell:>w$}"));
            }
        }
        s.trim_end().to_string()
    };
    let mut out = line(header.iter().map(|h| h.to_string()).collect());
    out.push('\n');
    for r in rows {
        out.push_str(&line(r));
        out.push('\n');
    }
    out
}
