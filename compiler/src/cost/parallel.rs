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
//!   micro-steps, the `(p-1)/(m+p-1)` share of the step. Interleaved over
//!   `v` virtual stages, each boundary is crossed `v` times per micro-batch
//!   and the bubble is `(p-1)/v` micro-step times.
//! - **offload**: bytes over PCIe (~25 GB/s per GPU) or NVMe (slower) and
//!   the CPU optimizer's update.
//! - **FSDP2** (`target fsdp`, [`super::fsdp`]): all-gathers of the `param_dtype` copy
//!   (cast before the collective), reduce-scatters in fp32, `CPUOffloadPolicy`'s transfers.
//! - **the Burn executor's ZeRO-3** (units: embedding, layers, head): every
//!   unit all-gathered for its forward, the checkpointed layers again for
//!   their recompute (the others keep theirs), every unit's fp32 gradient
//!   reduce-scattered as the backward leaves it, each micro-step; with
//!   parameter offload each gathered shard is first uploaded over PCIe, and
//!   with the optimizer on the host each unit's gradient shard goes down as
//!   it is reduce-scattered and the updated fp32 shard comes up once a step
//!   (not at all when the weights are on the host too).
//!
//! Every byte that crosses a link is first a [`Traffic`] row (collective,
//! what it carries, group, link, bytes per call, calls per step, seconds per
//! step), built in one place, [`traffic`]; the step time sums those rows, and
//! `--explain` prints the same rows, so the traffic shown is exactly the
//! traffic priced.
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
use std::fmt;

/// PCIe Gen5 x16 per GPU in practice (host ↔ device copies).
pub const PCIE_BYTES_PER_S: f64 = 25e9;
/// One NVMe drive's sustained read/write, shared by a GPU's offload traffic.
pub const NVME_BYTES_PER_S: f64 = 3.5e9;
/// Bytes of optimizer state, master weights and gradients a CPU Adam step
/// touches per second per GPU's share of the host (DeepSpeed CPU-Adam, AVX-512).
pub const CPU_OPTIMIZER_BYTES_PER_S: f64 = 20e9;

/// The collective (or transfer) a [`Traffic`] row stands for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Collective {
    /// Ring all-reduce: each rank sends `2(n-1)/n` of the buffer.
    AllReduce,
    /// Ring all-gather: each rank sends `(n-1)/n` of the gathered buffer.
    AllGather,
    /// Ring reduce-scatter: each rank sends `(n-1)/n` of the full buffer.
    ReduceScatter,
    /// Point-to-point send/receive (pipeline stage boundaries, ring attention hops).
    SendRecv,
    /// Host ↔ device copy (offload).
    HostTransfer,
}

impl Collective {
    pub fn as_str(self) -> &'static str {
        match self {
            Collective::AllReduce => "all-reduce",
            Collective::AllGather => "all-gather",
            Collective::ReduceScatter => "reduce-scatter",
            Collective::SendRecv => "send/recv",
            Collective::HostTransfer => "host transfer",
        }
    }

    /// Bytes one rank puts on its link for one call on a buffer of `bytes` in a group of `n`.
    pub fn sent_bytes(self, n: u64, bytes: f64) -> f64 {
        let n = n.max(1);
        let share = (n - 1) as f64 / n as f64;
        match self {
            Collective::AllReduce => 2.0 * share * bytes,
            Collective::AllGather | Collective::ReduceScatter => share * bytes,
            Collective::SendRecv | Collective::HostTransfer => bytes,
        }
    }
}

impl fmt::Display for Collective {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The link a [`Traffic`] row crosses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Link {
    /// Inside a node (NVLink / NVSwitch): `hardware.intra_node` per GPU.
    IntraNode,
    /// Between nodes: `hardware.inter_node` per node, shared by its GPUs.
    InterNode,
    /// Between nodes through the executor's own transport (rcoa's Burn executor:
    /// burn-collective's ring through host memory and WebSocket): the slower of
    /// `hardware.inter_node` and the transport's measured rate, per node.
    HostTransport,
    /// Host memory over PCIe.
    Pcie,
    /// An NVMe drive behind the host.
    Nvme,
}

impl Link {
    pub fn as_str(self) -> &'static str {
        match self {
            Link::IntraNode => "intra_node",
            Link::InterNode => "inter_node",
            Link::HostTransport => "transport",
            Link::Pcie => "pcie",
            Link::Nvme => "nvme",
        }
    }
}

impl fmt::Display for Link {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The parallel group a [`Traffic`] row runs in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Group {
    Data,
    Tensor,
    Context,
    Pipeline,
    /// The rank and its host (offload).
    Host,
}

impl Group {
    pub fn as_str(self) -> &'static str {
        match self {
            Group::Data => "data",
            Group::Tensor => "tensor",
            Group::Context => "context",
            Group::Pipeline => "pipeline",
            Group::Host => "host",
        }
    }
}

impl fmt::Display for Group {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// How often a [`Traffic`] row's call happens.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Cadence {
    /// Every micro-step (forward + backward of one micro-batch).
    MicroStep,
    /// Once per optimizer step.
    OptimizerStep,
}

impl Cadence {
    pub fn as_str(self) -> &'static str {
        match self {
            Cadence::MicroStep => "micro-step",
            Cadence::OptimizerStep => "step",
        }
    }
}

/// One kind of traffic of the worst rank in one training step.
///
/// Invariant: `seconds_per_step = calls_per_step × sent_bytes_per_call / link_bytes_per_s`,
/// and the step time's communication and offload terms are sums of these rows.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Traffic {
    pub collective: Collective,
    /// What the bytes are, e.g. `gradients`, `ZeRO-3 weight gather (forward)`.
    pub what: &'static str,
    pub group: Group,
    /// Ranks in the parallel group (its degree; 1 for host transfers). Point-to-point
    /// rows send to one neighbour of the group.
    pub group_size: u64,
    pub link: Link,
    /// Bandwidth this rank gets on the link (bytes per second).
    pub link_bytes_per_s: f64,
    /// The buffer one call works on (the full all-reduced / gathered tensor).
    pub bytes_per_call: f64,
    /// Bytes this rank sends per call (ring: `2(n-1)/n` or `(n-1)/n` of the buffer).
    pub sent_bytes_per_call: f64,
    /// Calls per micro-step or per optimizer step, as `cadence` says.
    pub calls: f64,
    pub cadence: Cadence,
    /// Calls per optimizer step (`calls × grad_accum` for per-micro-step traffic).
    pub calls_per_step: f64,
    pub seconds_per_step: f64,
}

impl Traffic {
    /// Bytes this rank sends per optimizer step.
    pub fn sent_bytes_per_step(&self) -> f64 {
        self.sent_bytes_per_call * self.calls_per_step
    }
}

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
    /// Host transfers plus the CPU optimizer's update.
    pub offload_s: f64,
    /// The CPU optimizer's update of its shard (part of `offload_s`, not traffic).
    pub host_optimizer_s: f64,
    /// Every transfer of the worst rank; the `*_s` communication terms are its sums.
    pub traffic: Vec<Traffic>,
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

/// The link a group spanning `span` consecutive ranks uses, and its bandwidth per GPU.
fn link(spec: &Spec, profile: &Profile, span: u64) -> (Link, f64) {
    let hw = &spec.hardware;
    if span <= hw.gpus_per_node.max(1) {
        (Link::IntraNode, hw.intra_node_bytes_per_s)
    } else if let Some(rate) = profile.process_transport_bytes_per_s {
        // One ring per node (its devices are reduced locally first), at the transport's rate.
        (Link::HostTransport, hw.inter_node_bytes_per_s.min(rate))
    } else {
        // The node's inter-node bandwidth is shared by its GPUs, each in its own ring.
        (
            Link::InterNode,
            hw.inter_node_bytes_per_s / hw.gpus_per_node.max(1) as f64,
        )
    }
}

/// Builds [`Traffic`] rows, pricing each the same way.
pub(super) struct Rows {
    ga: f64,
    rows: Vec<Traffic>,
}

impl Rows {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn push(
        &mut self,
        collective: Collective,
        what: &'static str,
        group: Group,
        group_size: u64,
        (link, bw): (Link, f64),
        bytes: f64,
        calls: f64,
        cadence: Cadence,
    ) {
        let sent = collective.sent_bytes(group_size, bytes);
        if sent <= 0.0 || calls <= 0.0 {
            return;
        }
        let calls_per_step = match cadence {
            Cadence::MicroStep => self.ga * calls,
            Cadence::OptimizerStep => calls,
        };
        self.rows.push(Traffic {
            collective,
            what,
            group,
            group_size,
            link,
            link_bytes_per_s: bw,
            bytes_per_call: bytes,
            sent_bytes_per_call: sent,
            calls,
            cadence,
            calls_per_step,
            seconds_per_step: calls_per_step * sent / bw.max(1.0),
        });
    }
}

/// Every transfer of the rank `report` describes in one step of `cand`, and the CPU
/// optimizer's seconds (offloaded optimizer only). The one place traffic is derived.
pub fn traffic(spec: &Spec, cand: &Candidate, report: &MemoryReport) -> (Vec<Traffic>, f64) {
    let (t, p, c, d) = (
        cand.tensor.max(1),
        cand.pipeline.max(1),
        cand.context.max(1),
        cand.data.max(1),
    );
    let ga = cand.grad_accum.max(1) as f64;
    let mut r = Rows {
        ga,
        rows: Vec::new(),
    };
    let profile = Profile::for_target(spec.target);
    // Parameters of this rank's stage, per tensor-parallel rank (the tape's shapes are sharded).
    let stage_params = report.params_total as f64;
    let stage_trainable = report.params_trainable as f64;
    let grad_bytes = stage_trainable * spec.precision.grads.bytes();
    let param_bytes = stage_params * spec.precision.params.bytes();
    let units = !report.units.is_empty();
    // The Burn executor's units: bytes gathered for the forward and for recomputes.
    let gathered_fwd: f64 = report.units.iter().map(|u| u.gathered_bytes as f64).sum();
    let gathered_bwd: f64 = report
        .units
        .iter()
        .filter(|u| u.regathered)
        .map(|u| u.gathered_bytes as f64)
        .sum();
    // Weights at rest and optimizer state (with the gradient accumulator) are sharded
    // separately: ZeRO-3 shards both, ZeRO 1/2 with offloaded weights only the latter.
    let wshards = if cand.zero >= 3 { d } else { 1 };
    let oshards = if cand.zero >= 1 { d } else { 1 };
    let fsdp = spec.target == crate::spec::Target::Fsdp;
    if fsdp && d > 1 {
        super::fsdp::data_parallel(
            &mut r,
            spec,
            cand,
            report,
            d,
            link(spec, &profile, t * c * d),
        );
    } else if units && d > 1 {
        let dp = link(spec, &profile, t * c * d);
        let (g, n, mi, op) = (Group::Data, d, Cadence::MicroStep, Cadence::OptimizerStep);
        if wshards > 1 {
            let f = "units gathered for their forward (Burn ZeRO-3)";
            r.push(Collective::AllGather, f, g, n, dp, gathered_fwd, 1.0, mi);
            let b = "checkpointed layers gathered again for their recompute (Burn ZeRO-3)";
            r.push(Collective::AllGather, b, g, n, dp, gathered_bwd, 1.0, mi);
        }
        let grads = stage_trainable * 4.0;
        if cand.zero >= 2 {
            let w = "fp32 unit gradients, reduce-scattered as the backward leaves each (Burn)";
            r.push(Collective::ReduceScatter, w, g, n, dp, grads, 1.0, mi);
        } else {
            let w = "fp32 unit gradients, all-reduced as the backward leaves each (Burn)";
            r.push(Collective::AllReduce, w, g, n, dp, grads, 1.0, mi);
        }
        if oshards > wshards {
            let u = "updated fp32 shards gathered into every rank's whole weights (Burn)";
            r.push(Collective::AllGather, u, g, n, dp, grads, 1.0, op);
        }
    } else if d > 1 {
        let dp = link(spec, &profile, t * c * d);
        let (g, n, mi, op) = (Group::Data, d, Cadence::MicroStep, Cadence::OptimizerStep);
        let burn = spec.target == crate::spec::Target::Burn;
        match cand.zero {
            // rcoa's Burn executor (backend/src/shard): one flat fp32 vector once per step;
            // stage 1 all-reduces it whole, stage 2 reduce-scatters it; the updated fp32
            // shards are all-gathered.
            1 | 2 if burn => {
                let flat = stage_trainable * 4.0;
                if cand.zero == 1 {
                    let w = "flat fp32 gradients (Burn ZeRO-1: all-reduced whole, once per step)";
                    r.push(Collective::AllReduce, w, g, n, dp, flat, 1.0, op);
                } else {
                    let w = "flat fp32 gradients (Burn ZeRO-2: reduce-scattered once per step)";
                    r.push(Collective::ReduceScatter, w, g, n, dp, flat, 1.0, op);
                }
                let u = "updated fp32 weight shards (Burn ZeRO)";
                r.push(Collective::AllGather, u, g, n, dp, flat, 1.0, op);
            }
            // DDP all-reduces once per step (no_sync while accumulating); ZeRO-1's
            // reduce-scatter plus all-gather of the updated shard moves the same bytes.
            0 => r.push(
                Collective::AllReduce,
                "gradients",
                g,
                n,
                dp,
                grad_bytes,
                1.0,
                op,
            ),
            1 => r.push(
                Collective::AllReduce,
                "gradients (ZeRO-1: reduce-scatter + all-gather of the updated shard)",
                g,
                n,
                dp,
                grad_bytes,
                1.0,
                op,
            ),
            2 => {
                let w = "gradients (ZeRO-2, every micro-step)";
                r.push(Collective::ReduceScatter, w, g, n, dp, grad_bytes, 1.0, mi);
                let u = "updated weights (ZeRO-2)";
                r.push(Collective::AllGather, u, g, n, dp, param_bytes, 1.0, op);
            }
            _ => {
                let f = "ZeRO-3 weight gather (forward)";
                r.push(Collective::AllGather, f, g, n, dp, param_bytes, 1.0, mi);
                let b = "ZeRO-3 weight gather (backward)";
                r.push(Collective::AllGather, b, g, n, dp, param_bytes, 1.0, mi);
                let w = "gradients (ZeRO-3)";
                r.push(Collective::ReduceScatter, w, g, n, dp, grad_bytes, 1.0, mi);
            }
        }
    }
    let tokens =
        (cand.micro_batch * spec.train.sequences_per_item() * spec.train.seq_len) as f64 / c as f64;
    let act = tokens * spec.model.hidden as f64 * spec.precision.compute.bytes().min(4.0);
    let layers = spec.model.layers.div_ceil(p) as f64;
    let recomputed = cand
        .checkpoint_layers
        .iter()
        .filter(|&&l| l < spec.model.layers.div_ceil(p))
        .count() as f64;
    if t > 1 {
        // Two per layer in the forward, two in the backward, two per recomputed layer.
        let calls = 4.0 * layers + 2.0 * recomputed;
        let tp = link(spec, &profile, t);
        let (g, mi) = (Group::Tensor, Cadence::MicroStep);
        if cand.sequence {
            let ag = "TP activations (sequence parallel: gather before a projection)";
            r.push(Collective::AllGather, ag, g, t, tp, act, calls, mi);
            let rs = "TP activations (sequence parallel: scatter after a projection)";
            r.push(Collective::ReduceScatter, rs, g, t, tp, act, calls, mi);
        } else {
            r.push(
                Collective::AllReduce,
                "TP activations",
                g,
                t,
                tp,
                act,
                calls,
                mi,
            );
        }
    }
    if c > 1 {
        let kv_heads = spec.model.kv_heads.div_ceil(t) as f64;
        let chunk = tokens * 2.0 * kv_heads * spec.model.head_dim as f64 * 2.0;
        let cp = link(spec, &profile, t * c);
        let hops = layers * (c - 1) as f64;
        let (g, mi) = (Group::Context, Cadence::MicroStep);
        let f = "ring attention k/v chunks (forward)";
        r.push(Collective::SendRecv, f, g, c, cp, chunk, hops, mi);
        let b = "ring attention k/v chunks and their gradients (backward)";
        r.push(Collective::SendRecv, b, g, c, cp, chunk, 2.0 * hops, mi);
    }
    if p > 1 {
        let pp = link(spec, &profile, t * c * d * 2);
        let (g, mi) = (Group::Pipeline, Cadence::MicroStep);
        // With tensor parallelism each rank sends its 1/t slice of the boundary activation;
        // interleaved, every one of its model chunks sends its own.
        let v = spec.parallel.virtual_stages.max(1) as f64;
        let f = "stage boundary activation (forward)";
        r.push(Collective::SendRecv, f, g, p, pp, act / t as f64, v, mi);
        let b = "its gradient (backward)";
        r.push(Collective::SendRecv, b, g, p, pp, act / t as f64, v, mi);
    }
    if report.paged_evicted_bytes > 0 {
        // `memory::paged`: the evicted pages go out as the step needs the room and come
        // back when the optimizer step reads them.
        let w = "paged optimizer state evicted to the host and read back";
        let bytes = 2.0 * report.paged_evicted_bytes as f64;
        let pcie = (Link::Pcie, PCIE_BYTES_PER_S);
        r.push(
            Collective::HostTransfer,
            w,
            Group::Host,
            1,
            pcie,
            bytes,
            1.0,
            Cadence::OptimizerStep,
        );
    }
    let mut host_optimizer_s = 0.0;
    if fsdp {
        host_optimizer_s += super::fsdp::offload(&mut r, spec, cand, report);
    }
    for o in cand.offload.iter().filter(|_| !fsdp) {
        let to = match o.to {
            OffloadTo::Cpu => (Link::Pcie, PCIE_BYTES_PER_S),
            OffloadTo::Nvme => (Link::Nvme, NVME_BYTES_PER_S),
        };
        let shard = if cand.zero >= 1 { d as f64 } else { 1.0 };
        let (h, ht, mi, op) = (
            Group::Host,
            Collective::HostTransfer,
            Cadence::MicroStep,
            Cadence::OptimizerStep,
        );
        match o.what {
            OffloadWhat::Optimizer if units => {
                // Burn ZeRO-3: each unit's fp32 gradient shard goes down as it is
                // reduce-scattered (every micro-step) when the accumulator is on the host,
                // else the accumulated shard once a step; the updated fp32 shard comes up
                // unless the weights live on the host.
                let shard_bytes = stage_trainable * 4.0 / oshards as f64;
                let cadence = if crate::memory::burn_host_grad_accumulator(&profile, cand) {
                    mi
                } else {
                    op
                };
                let g = "fp32 gradient shards to the host optimizer";
                r.push(ht, g, h, 1, to, shard_bytes, 1.0, cadence);
                if !cand.offloads(OffloadWhat::Params) {
                    let w = "updated fp32 weight shard from the host optimizer";
                    r.push(ht, w, h, 1, to, shard_bytes, 1.0, op);
                }
                // backend/src/optim/host.rs: 28 bytes per AdamW parameter (see below).
                host_optimizer_s +=
                    stage_trainable * 28.0 / oshards as f64 / profile.host_optimizer_bytes_per_s;
            }
            OffloadWhat::Params if units => {
                // Each unit's shard, fp32 on the host, is uploaded before its gather: every
                // unit for the forward, the checkpointed layers again for their recompute.
                let w = "offloaded fp32 weight shards uploaded before each gather";
                let fp32 = 4.0 / spec.precision.params.bytes().max(0.5);
                let bytes = (gathered_fwd + gathered_bwd) * fp32 / wshards as f64;
                r.push(ht, w, h, 1, to, bytes, 1.0, mi);
            }
            // Gradients down, updated 16-bit weights up, and the CPU's update of the shard.
            OffloadWhat::Optimizer => {
                let g = "gradients to the host optimizer";
                r.push(ht, g, h, 1, to, grad_bytes / shard, 1.0, op);
                let w = "updated weights from the host optimizer";
                r.push(ht, w, h, 1, to, param_bytes / shard, 1.0, op);
                let state = if spec.target == crate::spec::Target::Burn {
                    // backend/src/optim/host.rs: fp32 weights, gradients and two moments
                    // read, weights and moments written (28 bytes per AdamW parameter).
                    stage_trainable * 28.0 / shard
                } else {
                    stage_trainable * (spec.optimizer.state.bytes() * 2.0 + 4.0) / shard
                };
                host_optimizer_s += state / profile.host_optimizer_bytes_per_s;
            }
            // Fetched for the forward and again for the backward of every micro-step.
            OffloadWhat::Params => {
                let w = "offloaded weights (forward and backward)";
                r.push(ht, w, h, 1, to, param_bytes / d as f64, 2.0, mi);
            }
            // The Burn executor's per-unit step: the optimizer's gradient-shard row above
            // is the gradients' trip to the host.
            OffloadWhat::Grads if units => {}
            OffloadWhat::Grads => {
                let g = "offloaded gradients";
                r.push(ht, g, h, 1, to, grad_bytes / shard, 1.0, mi);
            }
            OffloadWhat::Activations => {
                let a = "checkpointed layer inputs (out and back)";
                // The Burn executor's are the tape's offloaded inputs (the first layer's
                // stays on the device: `memory::build`).
                let bytes = if spec.target == crate::spec::Target::Burn {
                    report.host_activation_bytes as f64
                } else {
                    act * recomputed / t as f64
                };
                r.push(ht, a, h, 1, to, bytes, 2.0, mi);
            }
        }
    }
    (r.rows, host_optimizer_s)
}

/// Seconds per step of the rows of `group`.
fn seconds_of(rows: &[Traffic], group: Group) -> f64 {
    // A fold from +0.0: `Iterator::sum` of no floats is -0.0, which would print as such.
    rows.iter()
        .filter(|x| x.group == group)
        .fold(0.0, |acc, x| acc + x.seconds_per_step)
}

/// Step time of `cand` on the worst rank described by `report`.
pub fn estimate(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    report: &MemoryReport,
) -> StepTime {
    let base = estimate_one(spec, cand, profile, report);
    let (p, d) = (cand.pipeline.max(1), cand.data.max(1));
    let ga = cand.grad_accum.max(1) as f64;
    let (traffic, host_optimizer_s) = traffic(spec, cand, report);
    let data_parallel_s = seconds_of(&traffic, Group::Data);
    let tensor_parallel_s = seconds_of(&traffic, Group::Tensor);
    let context_parallel_s = seconds_of(&traffic, Group::Context);
    let pipeline_p2p_s = seconds_of(&traffic, Group::Pipeline);
    let offload_s = seconds_of(&traffic, Group::Host) + host_optimizer_s;
    let bubble_s = if p > 1 {
        // 1F1B: (p-1) micro-step times of idle on top of the m micro-steps; interleaved over
        // v model chunks, (p-1)/v (Narayanan et al. 2021, §2.2).
        let micro = (base.step_seconds
            - base.optimizer_seconds
            - profile.step_overhead_s
            - base.communication_seconds)
            .max(0.0)
            / ga;
        (p - 1) as f64 * micro / spec.parallel.virtual_stages.max(1) as f64
    } else {
        0.0
    };
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
        host_optimizer_s,
        traffic,
        step_seconds,
        tokens_per_second: global_tokens / step_seconds.max(1e-12),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::parallel::evaluate;
    use crate::spec::Offload;

    /// A small decoder on two nodes of four H100s.
    fn spec() -> Spec {
        let src = "model \"tiny-decoder\"\nhardware { gpu = h100-80gb  gpus_per_node = 4  nodes = 2  intra_node = 900 GB/s  inter_node = 400 Gbps }\ntrain { seq_len = 128  global_batch = 64 }\n";
        let file = rcoa_grammar::parse("t.plan", src).unwrap();
        let ctx = crate::resolve::ResolveContext::new("t.plan", src, std::path::PathBuf::from("."));
        crate::resolve::resolve(&file, &ctx).unwrap()
    }

    fn cand(data: u64, zero: u8, tensor: u64, grad_accum: u64) -> Candidate {
        Candidate {
            micro_batch: 2,
            grad_accum,
            data,
            zero,
            tensor,
            pipeline: 1,
            context: 1,
            sequence: false,
            checkpoint_layers: vec![],
            selective: false,
            offload: vec![],
        }
    }

    fn rows(s: &Spec, c: &Candidate) -> (Vec<Traffic>, MemoryReport) {
        let p = Profile::for_target(s.target);
        let r = evaluate(s, c, &p, false);
        (traffic(s, c, &r).0, r)
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1e-30)
    }

    #[test]
    fn ring_collectives_send_their_share_of_the_buffer() {
        assert!(close(Collective::AllReduce.sent_bytes(4, 1000.0), 1500.0));
        assert!(close(Collective::AllReduce.sent_bytes(8, 800.0), 1400.0));
        assert!(close(Collective::AllGather.sent_bytes(4, 1000.0), 750.0));
        assert!(close(
            Collective::ReduceScatter.sent_bytes(4, 1000.0),
            750.0
        ));
        assert_eq!(Collective::AllReduce.sent_bytes(1, 1000.0), 0.0);
        assert_eq!(Collective::SendRecv.sent_bytes(4, 1000.0), 1000.0);
        assert_eq!(Collective::HostTransfer.sent_bytes(1, 1000.0), 1000.0);
    }

    #[test]
    fn ddp_all_reduces_the_gradients_once_per_step() {
        let s = spec();
        let c = cand(4, 0, 1, 4);
        let (t, r) = rows(&s, &c);
        assert_eq!(t.len(), 1, "{t:#?}");
        let g = &t[0];
        let grads = r.params_trainable as f64 * s.precision.grads.bytes();
        assert_eq!(g.collective, Collective::AllReduce);
        assert_eq!((g.group, g.group_size), (Group::Data, 4));
        assert!(close(g.bytes_per_call, grads));
        assert!(close(g.sent_bytes_per_call, 2.0 * 3.0 / 4.0 * grads));
        // Accumulation does not multiply it: the all-reduce runs once per optimizer step.
        assert_eq!((g.cadence, g.calls_per_step), (Cadence::OptimizerStep, 1.0));
        // Data = 4 with tensor = 1 stays inside a node of four.
        assert_eq!(g.link, Link::IntraNode);
        assert!(close(
            g.seconds_per_step,
            g.sent_bytes_per_call / s.hardware.intra_node_bytes_per_s
        ));
    }

    #[test]
    fn zero3_gathers_weights_twice_per_micro_step_and_reduce_scatters_gradients() {
        let mut s = spec();
        s.target = crate::spec::Target::Pytorch;
        let c = cand(8, 3, 1, 3);
        let (t, r) = rows(&s, &c);
        let params = r.params_total as f64 * s.precision.params.bytes();
        let grads = r.params_trainable as f64 * s.precision.grads.bytes();
        let gathers: Vec<_> = t
            .iter()
            .filter(|x| x.collective == Collective::AllGather)
            .collect();
        assert_eq!(gathers.len(), 2, "forward and backward: {t:#?}");
        for g in &gathers {
            assert!(close(g.bytes_per_call, params));
            assert!(close(g.sent_bytes_per_call, 7.0 / 8.0 * params));
            assert_eq!((g.cadence, g.calls_per_step), (Cadence::MicroStep, 3.0));
            // Eight data ranks span both nodes.
            assert_eq!(g.link, Link::InterNode);
        }
        let rs: Vec<_> = t
            .iter()
            .filter(|x| x.collective == Collective::ReduceScatter)
            .collect();
        assert_eq!(rs.len(), 1);
        assert!(close(rs[0].bytes_per_call, grads));
        assert_eq!(rs[0].calls_per_step, 3.0);
        assert_eq!(t.len(), 3);
        let bw = s.hardware.inter_node_bytes_per_s / 4.0;
        assert!(close(rs[0].link_bytes_per_s, bw));
    }

    /// Between nodes the Burn executor's traffic goes through its own transport (one ring per
    /// node, at the slower of the transport and the network), within a node over NVLink;
    /// PyTorch's goes through NCCL at the network's rate per GPU.
    #[test]
    fn burn_prices_traffic_between_nodes_at_its_transport() {
        let mut s = spec();
        s.target = crate::spec::Target::Burn;
        let rate = Profile::burn().process_transport_bytes_per_s.unwrap();
        assert!(rate < s.hardware.inter_node_bytes_per_s);
        let (t, _) = rows(&s, &cand(8, 2, 1, 1));
        assert!(!t.is_empty());
        for row in &t {
            assert_eq!(row.link, Link::HostTransport, "{row:?}");
            assert!(close(row.link_bytes_per_s, rate));
            assert!(close(
                row.seconds_per_step,
                row.calls_per_step * row.sent_bytes_per_call / rate
            ));
        }
        // A network slower than the transport is the limit.
        s.hardware.inter_node_bytes_per_s = rate / 2.0;
        let (t, _) = rows(&s, &cand(8, 2, 1, 1));
        assert!(t.iter().all(|row| close(row.link_bytes_per_s, rate / 2.0)));
        // Four ranks fit in a node: NVLink, no transport.
        let (t, _) = rows(&s, &cand(4, 2, 1, 1));
        assert!(t.iter().all(|row| row.link == Link::IntraNode), "{t:#?}");
        // PyTorch: NCCL, the node's network shared by its four GPUs.
        s.target = crate::spec::Target::Pytorch;
        s.hardware.inter_node_bytes_per_s = 50e9;
        let (t, _) = rows(&s, &cand(8, 2, 1, 1));
        assert!(t
            .iter()
            .all(|row| row.link == Link::InterNode && close(row.link_bytes_per_s, 50e9 / 4.0)));
    }

    /// The Burn executor's ZeRO-3: every unit gathered once for the forward, only the
    /// checkpointed layers again, and the fp32 gradients reduce-scattered, each micro-step.
    #[test]
    fn burn_zero3_gathers_checkpointed_layers_again_and_scatters_fp32_gradients() {
        let mut s = spec();
        s.target = crate::spec::Target::Burn;
        let mut c = cand(8, 3, 1, 3);
        let (t, r) = rows(&s, &c);
        let params = r.params_total as f64 * s.precision.params.bytes();
        let gathers: Vec<_> = t
            .iter()
            .filter(|x| x.collective == Collective::AllGather)
            .collect();
        // No layer checkpointed: every graph keeps its weights, nothing is gathered again.
        assert_eq!(gathers.len(), 1, "{t:#?}");
        // Every parameter once (the tiny decoder's head is untied), 4-byte rounding aside.
        let g = gathers[0].bytes_per_call;
        assert!(g >= params && g < params * 1.01, "{g} vs {params}");
        assert_eq!(gathers[0].calls_per_step, 3.0);
        let rs: Vec<_> = t
            .iter()
            .filter(|x| x.collective == Collective::ReduceScatter)
            .collect();
        assert_eq!(rs.len(), 1);
        assert!(close(rs[0].bytes_per_call, r.params_trainable as f64 * 4.0));
        // Checkpointing two layers gathers exactly those two again.
        c.checkpoint_layers = vec![0, 1];
        let (t2, r2) = rows(&s, &c);
        let again: Vec<_> = t2
            .iter()
            .filter(|x| x.collective == Collective::AllGather)
            .collect();
        assert_eq!(again.len(), 2, "{t2:#?}");
        let layers: f64 = r2
            .units
            .iter()
            .filter(|u| u.layer.is_some_and(|l| l < 2))
            .map(|u| u.gathered_bytes as f64)
            .sum();
        assert!(close(again[1].bytes_per_call, layers));
    }

    #[test]
    fn tensor_parallel_all_reduces_per_layer_forward_backward_and_recompute() {
        let s = spec();
        let layers = s.model.layers;
        let mut c = cand(1, 0, 2, 2);
        let (t, _) = rows(&s, &c);
        assert_eq!(t.len(), 1, "{t:#?}");
        let act = (2 * s.train.seq_len * s.model.hidden) as f64 * s.precision.compute.bytes();
        assert_eq!(t[0].collective, Collective::AllReduce);
        assert_eq!((t[0].group, t[0].link), (Group::Tensor, Link::IntraNode));
        assert!(close(t[0].bytes_per_call, act));
        assert_eq!(t[0].calls, 4.0 * layers as f64);
        assert_eq!(t[0].calls_per_step, 2.0 * 4.0 * layers as f64);
        // Every layer recomputed: two more all-reduces each.
        c.checkpoint_layers = (0..layers).collect();
        let (t, _) = rows(&s, &c);
        assert_eq!(t[0].calls, 6.0 * layers as f64);
        // Sequence parallelism: an all-gather and a reduce-scatter in place of each
        // all-reduce, the same bytes and time.
        c.sequence = true;
        let (sp, _) = rows(&s, &c);
        assert_eq!(sp.len(), 2);
        let total: f64 = sp.iter().map(|x| x.seconds_per_step).sum();
        assert!(close(total, t[0].seconds_per_step));
    }

    #[test]
    fn one_gpu_plans_have_no_traffic_and_the_single_gpu_time() {
        let s = spec();
        let p = Profile::for_target(s.target);
        let c = cand(1, 0, 1, 4);
        let r = evaluate(&s, &c, &p, false);
        let st = estimate(&s, &c, &p, &r);
        assert!(st.traffic.is_empty(), "{:#?}", st.traffic);
        assert_eq!(st.communication_s(), 0.0);
        assert_eq!(st.step_seconds, st.base.step_seconds);
        // Offload is host traffic, not network traffic.
        let mut o = c.clone();
        o.offload = vec![Offload {
            what: OffloadWhat::Optimizer,
            to: OffloadTo::Cpu,
        }];
        let r = evaluate(&s, &o, &p, false);
        let st = estimate(&s, &o, &p, &r);
        assert_eq!(st.traffic.len(), 2);
        assert!(st
            .traffic
            .iter()
            .all(|x| x.collective == Collective::HostTransfer && x.link == Link::Pcie));
        assert_eq!(st.communication_s(), 0.0);
    }

    #[test]
    fn traffic_rows_sum_to_the_step_times_communication_and_offload_terms() {
        let s = spec();
        let p = Profile::for_target(s.target);
        let layouts = [
            (cand(4, 0, 2, 4), 1, 1),
            (cand(2, 2, 2, 2), 2, 1),
            (cand(8, 3, 1, 1), 1, 1),
            (cand(2, 1, 2, 4), 1, 2),
            (cand(1, 3, 4, 2), 2, 1),
        ];
        for (mut c, pipeline, context) in layouts {
            c.pipeline = pipeline;
            c.context = context;
            c.checkpoint_layers = vec![0, 1];
            c.offload = vec![Offload {
                what: OffloadWhat::Optimizer,
                to: OffloadTo::Nvme,
            }];
            let r = evaluate(&s, &c, &p, false);
            let st = estimate(&s, &c, &p, &r);
            let network: f64 = st
                .traffic
                .iter()
                .filter(|x| x.group != Group::Host)
                .map(|x| x.seconds_per_step)
                .sum();
            let host: f64 = st
                .traffic
                .iter()
                .filter(|x| x.group == Group::Host)
                .map(|x| x.seconds_per_step)
                .sum();
            assert!(close(network, st.communication_s()), "{c:?}");
            assert!(close(network, st.to_estimate().communication_seconds));
            assert!(close(host + st.host_optimizer_s, st.offload_s));
            let rebuilt = st.base.step_seconds - st.base.communication_seconds
                + st.communication_s()
                + st.bubble_s
                + st.offload_s;
            assert!(close(rebuilt, st.step_seconds), "{c:?}");
            for x in &st.traffic {
                assert!(close(
                    x.seconds_per_step,
                    x.calls_per_step * x.sent_bytes_per_call / x.link_bytes_per_s
                ));
            }
        }
    }
}
