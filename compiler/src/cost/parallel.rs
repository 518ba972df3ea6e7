//! Step time of a multi-GPU layout: the single-GPU model plus communication,
//! the pipeline bubble and offload traffic.
//!
//! [`super::estimate`] prices one rank's matmuls (recompute included),
//! memory-bound ops and optimizer step. This module replaces its simple
//! data-parallel term with a per-layout model and adds what a layout costs:
//!
//! - **data parallel**: ring collectives, `2(n-1)/n × bytes / bandwidth` for an
//!   all-reduce and half that for a reduce-scatter or all-gather. ZeRO-0/1
//!   all-reduce the gradients once per step (ZeRO-1's reduce-scatter plus
//!   parameter all-gather moves the same bytes); ZeRO-2 reduce-scatters every
//!   micro-step and all-gathers the parameters once; ZeRO-3 all-gathers the
//!   parameters for the forward and again for the backward of every
//!   micro-step and reduce-scatters the gradients.
//! - **tensor / sequence parallel**: per layer two all-reduces of the layer's
//!   output activation in the forward and two in the backward (sequence
//!   parallelism swaps each for an all-gather plus a reduce-scatter: the same
//!   bytes), two more per recomputed layer.
//! - **context parallel**: ring attention passes each rank's k/v chunk
//!   around the ring, once in the forward and twice in the backward.
//! - **pipeline**: activations and their gradients cross each stage
//!   boundary; the 1F1B bubble adds `(p-1)` micro-step times to the `m`
//!   micro-steps, the `(p-1)/(m+p-1)` share of the step.
//! - **offload**: bytes over PCIe (~25 GB/s per GPU) or NVMe (slower) and
//!   the CPU optimizer's update.
//!
//! Rank order is Megatron's: tensor fastest, then context, then data, then
//! pipeline, so a group stays on NVLink (`intra_node`) while it fits in a
//! node; otherwise it shares the node's `inter_node` bandwidth with the
//! node's other GPUs. Nothing is overlapped (pessimistic, as the base
//! model). Invariants: on one GPU the result equals [`super::estimate`];
//! every term is non-negative and grows with bytes moved, so more recompute,
//! more sharding traffic or more offload never predicts a faster step.

use super::{estimate as estimate_one, TimeEstimate};
use crate::memory::{Candidate, MemoryReport};
use crate::profile::Profile;
use crate::spec::{OffloadTo, OffloadWhat, Spec};
use serde::Serialize;

/// PCIe Gen5 x16 per GPU in practice (host ↔ device copies).
pub const PCIE_BYTES_PER_S: f64 = 25e9;
/// One NVMe drive's sustained read/write, shared by a GPU's offload traffic.
pub const NVME_BYTES_PER_S: f64 = 3.5e9;
/// Bytes of optimizer state, master weights and gradients a CPU Adam step
/// touches per second per GPU's share of the host (DeepSpeed CPU-Adam, AVX-512).
pub const CPU_OPTIMIZER_BYTES_PER_S: f64 = 20e9;

/// Step time with every term named.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepTime {
    /// The single-GPU model (compute, memory-bound ops, optimizer, its own DP term).
    pub base: TimeEstimate,
    pub data_parallel_s: f64,
    pub tensor_parallel_s: f64,
    pub context_parallel_s: f64,
    pub pipeline_p2p_s: f64,
    pub bubble_s: f64,
    pub offload_s: f64,
    pub step_seconds: f64,
    pub tokens_per_second: f64,
}

impl StepTime {
    pub fn communication_s(&self) -> f64 {
        self.data_parallel_s
            + self.tensor_parallel_s
            + self.context_parallel_s
            + self.pipeline_p2p_s
    }
    /// As the single-GPU estimate's type (communication = every collective and transfer).
    pub fn to_estimate(&self) -> TimeEstimate {
        let mut t = self.base.clone();
        t.step_seconds = self.step_seconds;
        t.tokens_per_second = self.tokens_per_second;
        t.communication_seconds = self.communication_s();
        t
    }
}

/// Bandwidth per GPU of a group spanning `span` consecutive ranks.
fn link(spec: &Spec, span: u64) -> f64 {
    let hw = &spec.hardware;
    if span <= hw.gpus_per_node.max(1) {
        hw.intra_node_bytes_per_s
    } else {
        // The node's inter-node bandwidth is shared by its GPUs, each in its own ring.
        hw.inter_node_bytes_per_s / hw.gpus_per_node.max(1) as f64
    }
}

fn ring(n: u64, bytes: f64, bw: f64) -> f64 {
    if n <= 1 {
        return 0.0;
    }
    (n - 1) as f64 / n as f64 * bytes / bw.max(1.0)
}

/// Step time of `cand` on the worst rank described by `report`.
pub fn estimate(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    report: &MemoryReport,
) -> StepTime {
    let base = estimate_one(spec, cand, profile, report);
    let (t, p, c, d) = (
        cand.tensor.max(1),
        cand.pipeline.max(1),
        cand.context.max(1),
        cand.data.max(1),
    );
    let ga = cand.grad_accum.max(1) as f64;
    // Parameters of this rank's stage, per tensor-parallel rank (the tape's shapes are sharded).
    let stage_params = report.params_total as f64;
    let stage_trainable = report.params_trainable as f64;
    let grad_bytes = stage_trainable * spec.precision.grads.bytes();
    let param_bytes = stage_params * spec.precision.params.bytes();
    let dp_bw = link(spec, t * c * d);
    let data_parallel_s = match cand.zero {
        0 | 1 => 2.0 * ring(d, grad_bytes, dp_bw),
        2 => ga * ring(d, grad_bytes, dp_bw) + ring(d, param_bytes, dp_bw),
        _ => ga * (2.0 * ring(d, param_bytes, dp_bw) + ring(d, grad_bytes, dp_bw)),
    };
    let tokens =
        (cand.micro_batch * spec.train.sequences_per_item() * spec.train.seq_len) as f64 / c as f64;
    let act = tokens * spec.model.hidden as f64 * spec.precision.compute.bytes().min(4.0);
    let layers = spec.model.layers.div_ceil(p) as f64;
    let recomputed = cand
        .checkpoint_layers
        .iter()
        .filter(|&&l| l < spec.model.layers.div_ceil(p))
        .count() as f64;
    let tensor_parallel_s = if t > 1 {
        ga * (4.0 * layers + 2.0 * recomputed) * 2.0 * ring(t, act, link(spec, t))
    } else {
        0.0
    };
    let context_parallel_s = if c > 1 {
        let kv_heads = spec.model.kv_heads.div_ceil(t) as f64;
        let chunk = tokens * 2.0 * kv_heads * spec.model.head_dim as f64 * 2.0;
        ga * layers * 3.0 * (c - 1) as f64 * chunk / link(spec, t * c).max(1.0)
    } else {
        0.0
    };
    let (pipeline_p2p_s, bubble_s) = if p > 1 {
        let bw = link(spec, t * c * d * 2);
        let micro = (base.step_seconds
            - base.optimizer_seconds
            - profile.step_overhead_s
            - base.communication_seconds)
            .max(0.0)
            / ga;
        (
            ga * 2.0 * act / t as f64 / bw.max(1.0),
            (p - 1) as f64 * micro,
        )
    } else {
        (0.0, 0.0)
    };
    let mut offload_s = 0.0;
    for o in &cand.offload {
        let bw = match o.to {
            OffloadTo::Cpu => PCIE_BYTES_PER_S,
            OffloadTo::Nvme => NVME_BYTES_PER_S,
        };
        let shard = if cand.zero >= 1 { d as f64 } else { 1.0 };
        offload_s += match o.what {
            // Gradients down, updated 16-bit weights up, and the CPU's update of the shard.
            OffloadWhat::Optimizer => {
                let state = stage_trainable * (spec.optimizer.state.bytes() * 2.0 + 4.0) / shard;
                (grad_bytes + param_bytes) / shard / bw + state / CPU_OPTIMIZER_BYTES_PER_S
            }
            // Fetched for the forward and again for the backward of every micro-step.
            OffloadWhat::Params => ga * 2.0 * param_bytes / d as f64 / bw,
            OffloadWhat::Grads => ga * grad_bytes / shard / bw,
            OffloadWhat::Activations => ga * 2.0 * act * recomputed / t as f64 / bw,
        };
    }
    let step_seconds = base.step_seconds - base.communication_seconds
        + data_parallel_s
        + tensor_parallel_s
        + context_parallel_s
        + pipeline_p2p_s
        + bubble_s
        + offload_s;
    let global_tokens = spec.train.seq_len as f64
        * (cand.micro_batch * spec.train.sequences_per_item()) as f64
        * ga
        * d as f64;
    StepTime {
        base,
        data_parallel_s,
        tensor_parallel_s,
        context_parallel_s,
        pipeline_p2p_s,
        bubble_s,
        offload_s,
        step_seconds,
        tokens_per_second: global_tokens / step_seconds.max(1e-12),
    }
}
