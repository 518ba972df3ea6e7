//! The `hardware` section: which GPU, how many, and the node around them.
//!
//! `gpu` is a catalog name or a block `gpu { memory = .. bf16_tflops = ..
//! bandwidth = .. }` (all three required: a custom GPU has nothing to
//! default from; `fp16_tflops`, `bf16_tensor_cores` and `shared_memory`,
//! what the catalog also knows, are optional). `gpus_per_node` and `nodes`
//! default to 1. `intra_node`, `inter_node` and `host_memory` default to
//! the catalog entry's typical node (see `catalog/gpus.toml`); for a custom
//! GPU, to a PCIe 4.0 x16 link and a 100 Gb/s network, with no host memory
//! assumed (CPU offload then needs `host_memory`). `nvme` has no default: NVMe offload needs it.

use super::problem::{Expected, NameKind, Problem, Range};
use super::values::{self, Cx, Fields};
use crate::catalog;
use crate::spec::{GpuSpec, HardwareSpec};
use rcoa_grammar::{Section, ValueKind};

pub(crate) const KEYS: &[&str] = &[
    "gpu",
    "gpus_per_node",
    "nodes",
    "host_memory",
    "nvme",
    "intra_node",
    "inter_node",
];
pub(crate) const GPU_KEYS: &[&str] = &[
    "memory",
    "bf16_tflops",
    "bandwidth",
    "fp16_tflops",
    "bf16_tensor_cores",
    "shared_memory",
];

/// Caps far above real machines (NVL72 racks, 100k-GPU clusters), so the
/// GPU count stays below 2^30.
const MAX_GPUS_PER_NODE: u64 = 1 << 10;
const MAX_NODES: u64 = 1 << 20;

/// PCIe 4.0 x16, both directions added (how `intra_node` is counted).
const CUSTOM_INTRA_NODE_BYTES_PER_S: f64 = 64e9;
/// 100 Gb/s Ethernet.
const CUSTOM_INTER_NODE_BYTES_PER_S: f64 = 100e9 / 8.0;

pub(super) fn resolve(cx: &mut Cx, s: &Section) -> Option<HardwareSpec> {
    let mark = cx.mark();
    for a in &s.args {
        cx.report(Problem::UnexpectedArgument {
            section: "hardware",
            span: a.span,
        });
    }
    if s.body.is_none() {
        cx.report(Problem::MissingBlock {
            section: "hardware",
            span: s.name.span,
        });
        return None;
    }
    let f = Fields::read(
        cx,
        "hardware",
        "hardware",
        s.name.span,
        s.body.as_ref(),
        KEYS,
    );

    // (spec, intra, inter, host) from the catalog or a custom block
    let gpu = f.require(cx, "gpu").and_then(|v| match &v.kind {
        ValueKind::Block(b) => {
            let g = Fields::read(cx, "gpu", "hardware.gpu", v.span, Some(b), GPU_KEYS);
            let memory = g
                .require(cx, "memory")
                .and_then(|v| values::size(cx, v, "memory", 1));
            let tflops = g
                .require(cx, "bf16_tflops")
                .and_then(|v| values::number(cx, v, "bf16_tflops", Range::Positive));
            let bw = g
                .require(cx, "bandwidth")
                .and_then(|v| values::bandwidth(cx, v, "bandwidth"));
            // Optional: `None` when absent, `Some(None)` when given and wrong.
            let fp16 = g
                .get("fp16_tflops")
                .map(|v| values::number(cx, v, "fp16_tflops", Range::Positive));
            let bf16_cores = g
                .get("bf16_tensor_cores")
                .map(|v| values::boolean(cx, v, "bf16_tensor_cores"));
            let shared = g
                .get("shared_memory")
                .map(|v| values::size(cx, v, "shared_memory", 1));
            let mut spec = GpuSpec::custom("custom", memory?, tflops?, bw?);
            spec.fp16_tflops = match fp16 {
                Some(t) => Some(t?),
                None => None,
            };
            spec.bf16_tensor_cores = bf16_cores.unwrap_or(Some(true))?;
            spec.shared_memory_per_block_bytes = match shared {
                Some(b) => Some(b?),
                None => None,
            };
            Some((
                spec,
                CUSTOM_INTRA_NODE_BYTES_PER_S,
                CUSTOM_INTER_NODE_BYTES_PER_S,
                None,
            ))
        }
        _ => {
            let Some(name) = values::name_of(v) else {
                cx.report(Problem::WrongKind {
                    slot: "gpu",
                    expected: Expected::GpuNameOrBlock,
                    found: super::wording::found(&v.kind),
                    span: v.span,
                });
                return None;
            };
            match catalog::gpu(name) {
                Some(e) => Some((
                    e.spec(),
                    e.intra_node_bytes_per_s,
                    e.inter_node_bytes_per_s,
                    Some(e.host_memory_bytes),
                )),
                None => {
                    cx.report(Problem::UnknownName {
                        kind: NameKind::Gpu,
                        slot: "gpu",
                        name: name.to_string(),
                        span: v.span,
                        choices: catalog::catalog().gpu_names().map(str::to_string).collect(),
                    });
                    None
                }
            }
        }
    });

    let gpus_per_node = f.get("gpus_per_node").map_or(Some(1), |v| {
        values::integer_in(cx, v, "gpus_per_node", 1, MAX_GPUS_PER_NODE)
    });
    let nodes = f.get("nodes").map_or(Some(1), |v| {
        values::integer_in(cx, v, "nodes", 1, MAX_NODES)
    });
    let host = f
        .get("host_memory")
        .map(|v| values::size(cx, v, "host_memory", 1));
    let nvme = f.get("nvme").map(|v| values::size(cx, v, "nvme", 1));
    let intra = f
        .get("intra_node")
        .map(|v| values::bandwidth(cx, v, "intra_node"));
    let inter = f
        .get("inter_node")
        .map(|v| values::bandwidth(cx, v, "inter_node"));

    let (gpu, default_intra, default_inter, default_host) = gpu?;
    if !cx.clean_since(mark) {
        return None;
    }
    Some(HardwareSpec {
        gpu,
        gpus_per_node: gpus_per_node?,
        nodes: nodes?,
        host_memory_bytes: match host {
            Some(h) => Some(h?),
            None => default_host,
        },
        nvme_bytes: match nvme {
            Some(n) => Some(n?),
            None => None,
        },
        intra_node_bytes_per_s: intra.unwrap_or(Some(default_intra))?,
        inter_node_bytes_per_s: inter.unwrap_or(Some(default_inter))?,
    })
}
