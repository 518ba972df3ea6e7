//! Per-rank memory terms of a multi-GPU layout, on top of [`super::evaluate`].
//!
//! [`super::evaluate`] already walks the worst pipeline stage (the first
//! stage with up to `pipeline` 1F1B micro-batches in flight, or the last
//! stage with the head), divides projected widths by the tensor degree,
//! tokens by the context degree, shards optimizer state (ZeRO ≥ 1),
//! gradients (ZeRO ≥ 2) and parameters (ZeRO-3, with the gathered weight of
//! the running op as scratch; offloaded parameters keep only those gathers).
//! What it leaves out, and this module adds:
//!
//! - **Communication buffers**: DDP's gradient buckets (25 MiB, one being
//!   reduced while the next fills), ZeRO-1/2's reduce and all-gather buckets
//!   (DeepSpeed's defaults: 5e8 elements each, never more than the gradients
//!   themselves), ZeRO-3's prefetch bucket (5e7 elements of the next
//!   layer's parameters) and reduce bucket, and the pipeline's send/receive
//!   buffers (one stage boundary activation each way).
//!
//! These buffers exist for the whole step, so they are added as one
//! `communication` category to the peak, to every timeline sample and to
//! every phase peak: the peak's location does not move. Invariant: a plan on
//! one GPU (data = tensor = pipeline = context = 1, nothing offloaded) gets
//! exactly [`super::evaluate`]'s report, so single-GPU calibration is
//! untouched. Sequence parallelism's division of norm/residual activations
//! is not subtracted (conservative: it only lowers memory).

use super::{evaluate as evaluate_one, Candidate, MemoryReport};
use crate::profile::Profile;
use crate::spec::Spec;

/// PyTorch DDP's default `bucket_cap_mb`.
pub const DDP_BUCKET_BYTES: u64 = 25 << 20;
/// DeepSpeed's default `reduce_bucket_size` and `allgather_bucket_size` (elements).
pub const ZERO_BUCKET_ELEMENTS: u64 = 500_000_000;
/// DeepSpeed's default `stage3_prefetch_bucket_size` (elements).
pub const ZERO3_PREFETCH_ELEMENTS: u64 = 50_000_000;

/// The bytes the layout adds per rank, by name (all zero on one GPU).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParallelTerms {
    /// Gradient reduce buckets (DDP or ZeRO).
    pub reduce_bucket: u64,
    /// ZeRO-1/2 parameter all-gather bucket, or ZeRO-3 prefetch of the next layer.
    pub gather_bucket: u64,
    /// Pipeline send/receive buffers.
    pub pipeline_buffers: u64,
}

impl ParallelTerms {
    pub fn added(&self) -> u64 {
        self.reduce_bucket + self.gather_bucket + self.pipeline_buffers
    }
}

/// Parameters of one transformer layer on one tensor-parallel rank (elements).
pub fn layer_params(m: &crate::spec::ModelSpec, tensor: u64) -> u64 {
    let t = tensor.max(1);
    let heads = m.heads.div_ceil(t);
    let kv = m.kv_heads.div_ceil(t);
    let ffn = m.ffn.div_ceil(t);
    let attn = m.hidden * (heads + 2 * kv) * m.head_dim + heads * m.head_dim * m.hidden;
    let mlp = match m.mlp {
        crate::spec::Mlp::Swiglu => 3 * m.hidden * ffn,
        crate::spec::Mlp::Gelu => 2 * m.hidden * ffn,
    };
    attn + mlp * m.experts.max(1) + 4 * m.hidden
}

/// Parameters of the whole model (elements): layers, embeddings and an untied head.
pub fn model_params(m: &crate::spec::ModelSpec) -> u64 {
    let embed = m.vocab * m.hidden;
    let head = if m.tie_embeddings { 0 } else { embed };
    m.layers * layer_params(m, 1) + embed + head + m.hidden
}

/// The per-rank terms for `cand`, given the single-stage report.
pub fn terms(spec: &Spec, cand: &Candidate, report: &MemoryReport) -> ParallelTerms {
    let d = cand.data.max(1);
    let grad_b = spec.precision.grads.bytes();
    let param_b = spec.precision.params.bytes();
    let trainable = report.params_trainable;
    let mut t = ParallelTerms::default();
    if d > 1 && trainable > 0 {
        // Full (unsharded) gradient bytes of this rank's stage.
        let full_grads = (trainable as f64 * grad_b) as u64;
        match cand.zero {
            0 => t.reduce_bucket = 2 * DDP_BUCKET_BYTES.min(full_grads),
            1 | 2 => {
                t.reduce_bucket = ((ZERO_BUCKET_ELEMENTS as f64 * grad_b) as u64).min(full_grads);
                // The all-gather of updated parameters runs after the step; the reduce bucket
                // is free then, so the larger of the two is what coexists with the peak.
                let gather = ((ZERO_BUCKET_ELEMENTS as f64 * param_b) as u64)
                    .min((report.params_total as f64 * param_b) as u64);
                t.reduce_bucket = t.reduce_bucket.max(gather);
            }
            _ => {
                t.reduce_bucket = ((ZERO_BUCKET_ELEMENTS as f64 * grad_b) as u64).min(full_grads);
                let next = layer_params(&spec.model, cand.tensor).min(ZERO3_PREFETCH_ELEMENTS);
                t.gather_bucket = (next as f64 * param_b) as u64;
            }
        }
    }
    if cand.pipeline > 1 {
        let tokens = (cand.micro_batch * spec.train.sequences_per_item() * spec.train.seq_len)
            .div_ceil(cand.context.max(1));
        let act = spec.precision.compute.bytes().min(4.0);
        // One activation received from the previous stage and one gradient from the next.
        t.pipeline_buffers = 2 * (tokens as f64 * spec.model.hidden as f64 * act) as u64;
    }
    t
}

/// [`super::evaluate`] plus the layout's per-rank terms: the worst rank's report.
pub fn evaluate(spec: &Spec, cand: &Candidate, profile: &Profile, timeline: bool) -> MemoryReport {
    let mut r = evaluate_one(spec, cand, profile, timeline);
    let t = terms(spec, cand, &r);
    apply(&mut r, &t);
    r
}

/// Add `t` to every sample of `r` (the buffers live through the whole step).
pub fn apply(r: &mut MemoryReport, t: &ParallelTerms) {
    let add = t.added();
    if add == 0 {
        return;
    }
    let shift = |b: u64| b + add;
    r.peak_bytes = shift(r.peak_bytes);
    for s in &mut r.timeline {
        s.bytes = shift(s.bytes);
    }
    for v in r.phase_peaks.values_mut() {
        *v = shift(*v);
    }
    *r.breakdown.entry("communication".to_string()).or_default() += add;
}

/// Ops whose `[tokens, hidden]` output lies outside the tensor-parallel regions: with
/// sequence parallelism each rank keeps `tokens / tensor` rows of it (Megatron-LM's
/// sequence parallelism; the row-parallel projections reduce-scatter instead of
/// all-reducing, the column-parallel ones all-gather their input).
const SEQUENCE_REGION_OPS: &[&str] = &[
    "residual",
    "o_proj",
    "down_proj",
    "embedding",
    "position_embedding",
    "layernorm",
    "normalize",
    "norm_scale",
];
/// Ops whose output is in the sequence region when their first input is.
const SEQUENCE_FOLLOWERS: &[&str] = &["cast", "dropout", "lora_add", "lora_scale"];

/// Sequence parallelism on a built tape: activations of the sequence region shrink to
/// `1 / tensor` of their rows. The full tensors still exist, briefly: the all-gather of a
/// projection's input and the partial sums before a reduce-scatter become scratch of that
/// op (forward, and backward where the input is gathered again). FLOPs do not change.
pub fn shard_sequence(tape: &mut super::tape::Tape, tokens: u64, hidden: u64, tensor: u64) {
    use super::tape::Role;
    let t = tensor.max(1);
    if t == 1 {
        return;
    }
    let n = tape.tensors.len();
    let mut sp = vec![false; n];
    for i in 0..n {
        let info = &tape.tensors[i];
        if info.shape != [tokens, hidden] || !matches!(info.role, Role::Activation | Role::Input) {
            continue;
        }
        sp[i] = match info.producer {
            None => info.role == Role::Input,
            Some(op) => {
                let o = &tape.ops[op.0 as usize];
                SEQUENCE_REGION_OPS.contains(&o.name)
                    || (SEQUENCE_FOLLOWERS.contains(&o.name)
                        && o.inputs.first().is_some_and(|x| sp[x.0 as usize]))
            }
        };
    }
    let mut full = vec![0u64; n];
    for i in 0..n {
        if sp[i] {
            full[i] = tape.tensors[i].bytes;
            tape.tensors[i].bytes = full[i].div_ceil(t);
        }
    }
    for o in &mut tape.ops {
        // A projection reading a sharded input gathers it (forward and backward).
        let gathered: u64 = o
            .inputs
            .iter()
            .filter(|x| sp[x.0 as usize] && o.flops > 0.0)
            .map(|x| full[x.0 as usize])
            .sum();
        // A row-parallel projection's partial sums exist in full before the reduce-scatter.
        let partial: u64 = if o.flops > 0.0 {
            o.outputs
                .iter()
                .filter(|x| sp[x.0 as usize])
                .map(|x| full[x.0 as usize])
                .sum()
        } else {
            0
        };
        o.fwd_workspace += gathered + partial;
        o.bwd_workspace += gathered + partial;
    }
}
