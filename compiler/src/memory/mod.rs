//! The peak-memory model: what one GPU holds at every point of a training step.
//!
//! [`evaluate`] builds the step's tape for one [`Candidate`] (micro-batch,
//! parallel degrees, checkpointed layers, offloads) and walks it: the forward
//! (activations saved for the backward, autocast's weight copies, the logits),
//! the backward (gradients created as each op's backward runs, saved tensors
//! released, checkpointed layers recomputed from their input), and the
//! optimizer step (state, gradients and the implementation's temporaries).
//! The result, a [`MemoryReport`], holds the peak, where it happens, the
//! breakdown at the peak and a timeline. The walk is linear in the number of
//! ops (a few thousand for the largest presets), so a search can evaluate
//! thousands of candidates per second; layers are alike, so the tape repeats
//! one layer's ops with fresh ids.
//!
//! Invariants: the peak is over a steady-state step (the optimizer state
//! exists from step 2 on and only adds to step 1); every count is per device;
//! no constant here is fitted to a configuration — executor facts live in
//! [`crate::profile::Profile`].

pub mod build;
pub mod engines;
mod fsdp;
pub mod optimizer;
pub mod paged;
pub mod parallel;
pub mod quant;
pub mod tape;
#[cfg(test)]
mod tests_setups;
#[cfg(test)]
mod tests_techniques;
pub mod trace;

use crate::profile::Profile;
use crate::spec::{Offload, OffloadWhat, Spec};
use serde::Serialize;
use std::collections::BTreeMap;
pub use tape::{Phase, Sample};

/// Byte categories of the breakdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Category {
    Weights,
    /// Autocast's 16-bit copies of fp32 weights.
    WeightCopies,
    Grads,
    Optimizer,
    Activations,
    /// Gradients of activations in flight during the backward.
    ActivationGrads,
    /// Library workspaces, kernel scratch, optimizer temporaries.
    Workspace,
}

impl Category {
    pub const COUNT: usize = 7;
    pub const ALL: [Category; 7] = [
        Category::Weights,
        Category::WeightCopies,
        Category::Grads,
        Category::Optimizer,
        Category::Activations,
        Category::ActivationGrads,
        Category::Workspace,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            Category::Weights => "weights",
            Category::WeightCopies => "weight_copies",
            Category::Grads => "grads",
            Category::Optimizer => "optimizer",
            Category::Activations => "activations",
            Category::ActivationGrads => "activation_grads",
            Category::Workspace => "workspace",
        }
    }
}

/// One point of the search space: every value a pass may choose.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Candidate {
    /// Sequences (or contrastive anchors) per GPU per forward.
    pub micro_batch: u64,
    pub grad_accum: u64,
    pub data: u64,
    pub zero: u8,
    pub tensor: u64,
    pub pipeline: u64,
    pub context: u64,
    /// Sequence parallelism (with tensor parallelism).
    pub sequence: bool,
    /// Indices of the layers recomputed in the backward, sorted.
    pub checkpoint_layers: Vec<u64>,
    /// `checkpoint = selective`: every layer's attention core is recomputed in the backward
    /// (no quadratic tensor saved); no layer is recomputed whole by it.
    pub selective: bool,
    pub offload: Vec<Offload>,
}

impl Candidate {
    /// Does this candidate move `what` off the GPU?
    pub fn offloads(&self, what: OffloadWhat) -> bool {
        self.offload.iter().any(|o| o.what == what)
    }
}

/// Does the Burn executor run `cand` a whole unit at a time (`backend/src/shard/zero3.rs`):
/// its ZeRO-3 over more than one rank, parameter offload, or gradient offload? Then the
/// tape holds the units ([`tape::Unit`]) and gradients live per unit until reduced as the
/// backward leaves the unit. Whether the units are gathered: [`burn_units_gathered`].
pub fn burn_units(profile: &Profile, cand: &Candidate) -> bool {
    profile.burn_ops && (burn_units_gathered(profile, cand) || cand.offloads(OffloadWhat::Grads))
}

/// Are the Burn executor's units gathered into buffers of their own (ZeRO-3 over more than
/// one rank, or parameter offload)? With gradient offload alone every rank keeps its
/// weights whole on the device and a unit's parameters are views of them.
pub fn burn_units_gathered(profile: &Profile, cand: &Candidate) -> bool {
    profile.burn_ops && ((cand.zero >= 3 && cand.data > 1) || cand.offloads(OffloadWhat::Params))
}

/// Does the Burn executor step a flat sharded optimizer for `cand` (`backend/src/shard`,
/// `shard::layout::flat_zero`): ZeRO 1/2, or the optimizer on the host, with whole weights
/// on every rank? Its fp32 master shard is cut from each unit as the model is built.
pub fn burn_flat_zero(profile: &Profile, cand: &Candidate) -> bool {
    profile.burn_ops
        && (cand.zero >= 1 || cand.offloads(OffloadWhat::Optimizer))
        && !(cand.zero >= 3
            || cand.offloads(OffloadWhat::Params)
            || cand.offloads(OffloadWhat::Grads))
}

/// Is the fp32 gradient-shard accumulator of the Burn executor's ZeRO-3 in host memory?
pub fn burn_host_grad_accumulator(profile: &Profile, cand: &Candidate) -> bool {
    burn_units(profile, cand)
        && (crate::profile::ZERO3_HOST_GRAD_ACCUMULATOR || cand.offloads(OffloadWhat::Grads))
        && cand.offloads(OffloadWhat::Optimizer)
}

/// One unit the Burn executor gathers whole, as the memory model charges it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct UnitBytes {
    /// `embedding`, `layer` or `head`.
    pub name: &'static str,
    pub layer: Option<u64>,
    /// Its parameters gathered whole, storage dtype (a tied head counts the table again).
    pub gathered_bytes: u64,
    /// Checkpointed: freed after its forward, gathered again for its recompute.
    pub regathered: bool,
}

/// Where the peak happens.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PeakLocation {
    pub phase: Phase,
    pub op: String,
    pub layer: Option<u64>,
}

impl std::fmt::Display for PeakLocation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.layer {
            Some(l) => write!(f, "{}: layer {} {}", self.phase.as_str(), l, self.op),
            None => write!(f, "{}: {}", self.phase.as_str(), self.op),
        }
    }
}

/// The setup sample's op: the Burn executor's start-up build, one unit at a time
/// ([`burn_setup`]).
pub const SETUP_OP: &str = "model built one unit at a time";
/// The point of the Burn executor's gradient exchange (flat fp32 vectors) in the timeline.
pub const EXCHANGE_OP: &str = "gradient exchange";

/// The memory model's answer for one candidate on one GPU (the worst rank).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct MemoryReport {
    /// Highest bytes allocated during a steady-state step.
    pub peak_bytes: u64,
    pub peak: PeakLocation,
    /// Bytes per category at the peak (sums to `peak_bytes`).
    pub breakdown: BTreeMap<String, u64>,
    /// Highest bytes per phase.
    pub phase_peaks: BTreeMap<String, u64>,
    /// Live bytes through the step, one sample per op group (forward, backward, optimizer).
    pub timeline: Vec<Sample>,
    /// Bytes kept out of the budget (context, communication buffers, fragmentation, and
    /// the pool's pages beyond the bytes in use: `Profile::pool_factor`).
    pub reserve_bytes: u64,
    /// Of `reserve_bytes`, the allocator pool's pages beyond the reported peak.
    #[serde(skip_serializing_if = "is_zero")]
    pub reserve_pool_bytes: u64,
    /// The highest bytes in use at any op, transients inside segments included (what the
    /// pool term of the reserve covers; `peak_bytes` where the executor is not sampled).
    #[serde(skip)]
    pub in_use_max_bytes: u64,
    /// Parameter counts (all, trainable), per model (not per device).
    pub params_total: u64,
    pub params_trainable: u64,
    /// Forward + backward FLOPs of one micro-step on this device (recompute included).
    pub step_flops: f64,
    /// Of `step_flops`, those of the executor's own fused attention kernels
    /// (`flash_attention` ops), which run at `Profile::fused_attention_efficiency`.
    #[serde(skip_serializing_if = "is_zero_f64")]
    pub step_fused_attention_flops: f64,
    /// Of `step_flops`, those of the fused attention's `Rows` kernels on the CUDA cores
    /// (`flash_attention_rows` ops), at `Profile::fused_attention_rows_efficiency`.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub step_fused_attention_rows_flops: f64,
    /// Of `step_flops`, eager attention's score and value products (`scores`, `probs_v`),
    /// at `Profile::attention_matmul_efficiency`.
    #[serde(default, skip_serializing_if = "is_zero_f64")]
    pub step_attention_matmul_flops: f64,
    /// Bytes moved by memory-bound ops in one micro-step.
    pub step_bytes_moved: f64,
    /// Kernels launched by one micro-step (forward, recompute, backward).
    pub step_kernels: u64,
    /// Units gathered whole (the Burn executor's ZeRO-3 / parameter offload), forward order.
    pub units: Vec<UnitBytes>,
    /// Bytes of the parameters as this device keeps them between uses (a ZeRO-3 shard,
    /// nothing when offloaded; the whole model otherwise).
    pub resident_param_bytes: u64,
    /// Optimizer state in CUDA unified memory (`impl = paged`), counted in `peak_bytes`
    /// while the device has room; [`paged::evict`] takes off what it has not.
    #[serde(skip_serializing_if = "is_zero")]
    pub paged_bytes: u64,
    /// Of `paged_bytes`, what the driver keeps on the host at the peak ([`paged::evict`]).
    #[serde(skip_serializing_if = "is_zero")]
    pub paged_evicted_bytes: u64,
    /// Checkpointed layers' inputs held in host memory between their forward and their
    /// recompute (`offload = [activations]`, the Burn executor), one micro-batch's.
    #[serde(skip_serializing_if = "is_zero")]
    pub host_activation_bytes: u64,
    /// When the setup is the highest point: the step's highest point, where it is and its
    /// breakdown (the layout's communication buffers, which [`parallel::apply`] adds, exist
    /// from the first step on and may lift the step above the setup).
    #[serde(skip)]
    pub step_peak: Option<(u64, PeakLocation, BTreeMap<String, u64>)>,
}

fn is_zero_f64(v: &f64) -> bool {
    *v == 0.0
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A pipeline stage the model evaluates: its layers, whether it holds the embedding and
/// the head, and how many micro-batches' activations it keeps in flight.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Stage {
    /// 0-based stage index (0 on one stage).
    pub index: u64,
    pub stages: u64,
    /// Layer indices `first..end` of the stage.
    pub first_layer: u64,
    pub end_layer: u64,
    pub embedding: bool,
    pub head: bool,
    /// Micro-batches whose saved activations the stage holds at once, counted in model
    /// chunks: `virtual_stages` chunks make one micro-batch of the whole stage.
    pub in_flight: u64,
    /// Model chunks per rank (`parallel.virtual_stages`; 1 without interleaving).
    #[serde(skip_serializing_if = "is_one")]
    pub virtual_stages: u64,
}

fn is_one(v: &u64) -> bool {
    *v == 1
}

/// Model-chunk forwards whose activations pipeline rank `rank` of `p` holds at its highest
/// under Megatron's schedules with `m` micro-batches per step and `v` chunks per rank. 1F1B
/// (`v = 1`): the rank runs `p - rank - 1` warm-up forwards, then one more before its first
/// backward, `min(p - rank, m)`. Interleaved 1F1B (`schedules.py`,
/// `get_pp_rank_microbatches`): `(p - rank - 1) * 2 + (v - 1) * g` warm-up chunk forwards
/// (`g`, `microbatch_group_size_per_vp_stage`, defaults to `p`), then one more, out of
/// `m * v`.
pub fn chunks_in_flight(p: u64, rank: u64, m: u64, v: u64) -> u64 {
    let (p, m, v) = (p.max(1), m.max(1), v.max(1));
    if v == 1 {
        return (p - rank.min(p - 1)).min(m);
    }
    let warmup = (p - rank.min(p - 1) - 1) * 2 + (v - 1) * p;
    (warmup + 1).min(m * v)
}

/// The stages [`evaluate`] compares: the first stage (most micro-batches in flight under
/// 1F1B, the embedding) and, with a pipeline, the last (the head and the loss's logits).
/// Middle stages hold no more than the first, so the worst rank is one of these.
pub fn stages(spec: &Spec, cand: &Candidate) -> Vec<Stage> {
    let layers = spec.model.layers;
    let stages = cand.pipeline.max(1);
    let per_stage = layers.div_ceil(stages).min(layers);
    // Interleaving exists only across pipeline ranks.
    let chunks = if stages > 1 {
        spec.parallel.virtual_stages.max(1)
    } else {
        1
    };
    let m = cand.grad_accum.max(1);
    let mut v = vec![Stage {
        index: 0,
        stages,
        first_layer: 0,
        end_layer: per_stage,
        embedding: true,
        head: stages == 1,
        in_flight: chunks_in_flight(stages, 0, m, chunks),
        virtual_stages: chunks,
    }];
    if stages > 1 {
        v.push(Stage {
            index: stages - 1,
            stages,
            first_layer: layers - per_stage,
            end_layer: layers,
            embedding: false,
            head: true,
            in_flight: chunks_in_flight(stages, stages - 1, m, chunks),
            virtual_stages: chunks,
        });
    }
    v
}

/// Evaluate one candidate on one of its [`stages`].
pub fn evaluate_on(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    stage: &Stage,
    timeline: bool,
) -> MemoryReport {
    evaluate_stage(
        spec,
        cand,
        profile,
        stage.first_layer..stage.end_layer,
        stage.embedding,
        stage.head,
        (stage.in_flight, stage.virtual_stages),
        timeline,
    )
}

/// Evaluate one candidate. `timeline`: collect the samples (the search can skip them).
/// The worst of [`stages`] (the first on a tie).
pub fn evaluate(spec: &Spec, cand: &Candidate, profile: &Profile, timeline: bool) -> MemoryReport {
    let mut best: Option<MemoryReport> = None;
    for stage in stages(spec, cand) {
        let r = evaluate_on(spec, cand, profile, &stage, timeline);
        if best.as_ref().is_none_or(|b| r.peak_bytes > b.peak_bytes) {
            best = Some(r);
        }
    }
    best.expect("at least one stage")
}

#[allow(clippy::too_many_arguments)]
fn evaluate_stage(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    range: std::ops::Range<u64>,
    with_embedding: bool,
    with_head: bool,
    (in_flight, chunks): (u64, u64),
    timeline: bool,
) -> MemoryReport {
    let b = build::Builder::new(spec, profile, cand).build(range, with_embedding, with_head);
    let trainable = b.trainable.clone();
    let mut tape = b.tape;
    if cand.sequence && cand.tensor > 1 {
        let tokens = (cand.micro_batch * spec.train.sequences_per_item() * spec.train.seq_len)
            .div_ceil(cand.context.max(1));
        parallel::shard_sequence(&mut tape, tokens, spec.model.hidden, cand.tensor);
    }
    let dp = cand.data.max(1);
    let opt = optimizer::model(spec, profile, &tape, &trainable, cand);
    let mut persistent = tape::Persistent {
        grad_divisor: 1,
        sampled: profile.peak_sampled_at_segments,
        recompute_holds_output: profile.recompute_holds_output,
        ..Default::default()
    };
    let opt_on_gpu = !cand.offloads(OffloadWhat::Optimizer);
    let units = burn_units(profile, cand);
    let state = if opt_on_gpu && units && cand.offloads(OffloadWhat::Params) {
        // The fp32 master shard lives on the host with the parameter shards.
        (opt.state_bytes - opt.master_bytes).div_ceil(if cand.zero >= 1 { dp } else { 1 })
    } else if opt_on_gpu {
        opt.state_bytes
            .div_ceil(if cand.zero >= 1 { dp } else { 1 })
    } else {
        0
    };
    persistent.fixed[Category::Optimizer as usize] = state;
    let paged_bytes = if opt_on_gpu && spec.optimizer.implementation == crate::spec::OptImpl::Paged
    {
        // bitsandbytes pages its state tensors, not a master copy of the weights.
        (opt.state_bytes - opt.master_bytes).min(state)
    } else {
        0
    };
    let in_backward = spec.optimizer_in_backward;
    if in_backward {
        persistent.step_at = steps_in_backward(spec, profile, cand, &mut tape, &trainable);
    }
    if units {
        persistent.unit_grads = true;
        if !burn_host_grad_accumulator(profile, cand) {
            // The fp32 gradient-shard accumulator: 1/data of every trainable value (ZeRO ≥ 1).
            let values: u64 = trainable.iter().map(|(_, n)| n).sum();
            let shards = if cand.zero >= 1 { dp } else { 1 };
            persistent.unit_grad_acc = profile.allocated(4 * values.div_ceil(shards));
        }
    }
    persistent.fixed[Category::Workspace as usize] = profile.workspace_bytes;
    persistent.fixed[Category::Activations as usize] +=
        engines::burn_context_bytes(spec, profile, cand.micro_batch);
    let trainable_values: Vec<u64> = trainable.iter().map(|(_, n)| *n).collect();
    let grad_buffer = engines::contiguous_grad_bytes(spec, profile, trainable_values.iter().sum())
        .or_else(|| {
            engines::zero3_grad_partition_bytes(spec, profile, cand, trainable_values.iter().sum())
        });
    if let Some(b) = grad_buffer {
        // Megatron's gradient buffer replaces the gradients the backward would allocate.
        persistent.fixed[Category::Grads as usize] = b;
        persistent.grad_divisor = u64::MAX;
    } else if !units
        && ((cand.zero >= 2 && profile.grads_sharded_in_backward)
            || cand.offloads(OffloadWhat::Grads)
            || engines::grads_follow_host_optimizer(profile, cand))
    {
        persistent.grad_divisor = if cand.offloads(OffloadWhat::Grads)
            || engines::grads_follow_host_optimizer(profile, cand)
        {
            u64::MAX
        } else {
            dp
        };
    }
    if in_backward {
        // Each gradient lives only while its parameter's step runs (then `zero_grad`).
        persistent.grad_divisor = u64::MAX;
    }
    // Micro-batches in flight on a pipeline stage (1F1B: the first stage holds `stages`) keep
    // what their forward saved until their backward runs. The tape is one micro-batch
    // through all `chunks` model chunks of the stage; each further chunk forward in flight
    // holds a chunk's share of what it saved (layers are alike).
    if in_flight > chunks {
        let probe = tape::walk(&tape, &persistent, false);
        let a = Category::Activations as usize;
        let saved = probe.forward_end[a].saturating_sub(persistent.fixed[a]);
        persistent.fixed[a] +=
            ((in_flight - chunks) as u128 * saved as u128 / chunks.max(1) as u128) as u64;
    }
    let first = tape::walk(&tape, &persistent, timeline);
    // An executor that samples its memory between segments (Burn) reports the highest
    // boundary; the transients inside segments are covered by its pool factor.
    let pick = |w: &tape::WalkResult| {
        if profile.peak_sampled_at_segments {
            w.boundary_peak.clone()
        } else {
            w.peak.clone()
        }
    };
    let mut peak = pick(&first);
    // The highest bytes in use at any op, transients inside segments included.
    let mut in_use_max = first.peak.bytes;
    let mut samples = first.samples;
    let mut phase_peaks: BTreeMap<String, u64> = BTreeMap::new();
    for s in &samples {
        let e = phase_peaks.entry(s.phase.as_str().to_string()).or_default();
        *e = (*e).max(s.bytes);
    }
    if cand.grad_accum > 1 {
        // Later micro-batches start with every gradient already allocated.
        let mut p2 = persistent.clone();
        p2.grads_exist = true;
        let second = tape::walk(&tape, &p2, timeline);
        let second_peak = pick(&second);
        in_use_max = in_use_max.max(second.peak.bytes);
        if second_peak.bytes > peak.bytes {
            peak = second_peak;
        }
        for s in &second.samples {
            let e = phase_peaks.entry(s.phase.as_str().to_string()).or_default();
            *e = (*e).max(s.bytes);
        }
        if timeline {
            // Later micro-batches dominate the first (same ops, gradients already allocated):
            // the timeline shows one of them.
            samples = second.samples;
        }
    }
    // The optimizer step: what the backward left (params, grads, state) plus temporaries.
    let mut at_opt = first.end;
    if let Some(g) =
        engines::zero1_step_gradient_bytes(spec, profile, cand, trainable_values.iter().sum())
    {
        at_opt[Category::Grads as usize] = g;
    }
    at_opt[Category::ActivationGrads as usize] = 0;
    at_opt[Category::Activations as usize] = persistent.fixed[Category::Activations as usize];
    at_opt[Category::WeightCopies as usize] = 0;
    // The Burn executor's gradient exchange runs between the backward and the step, in
    // what the backward left (`parallel::burn_exchange`); its vectors are gradients.
    let exchange = parallel::burn_exchange(spec, cand, trainable_values.iter().sum());
    let at_exchange = exchange.map(|x| {
        let mut at = at_opt;
        if x.grads_leave {
            at[Category::Grads as usize] = 0;
        }
        at[Category::Grads as usize] += x.at_step_end;
        at
    });
    let mut step_temp = 0;
    if opt_on_gpu && !in_backward {
        step_temp = engines::step_temporaries(spec, profile, cand, &opt, &trainable_values)
            .unwrap_or_else(|| opt.temp_bytes.div_ceil(if cand.zero >= 1 { dp } else { 1 }));
        at_opt[Category::Workspace as usize] += step_temp;
    }
    if units && opt_on_gpu == cand.offloads(OffloadWhat::Params) {
        // The updated fp32 shard comes up from the host optimizer into the device weights,
        // or the host weights (the master) go up to the device optimizer.
        let values: u64 = trainable.iter().map(|(_, n)| n).sum();
        let shards = if cand.zero >= 1 { dp } else { 1 };
        at_opt[Category::Workspace as usize] += profile.allocated(4 * values.div_ceil(shards));
    }
    if units {
        // `Zero3::finish_step`: unless the update is the new resting shard as it is (the
        // weights are the optimizer's master, or fp32 in one shard layout), the old
        // weights are freed and the update replaces them a unit at a time, each unit's
        // slice of this rank's shard cast to the storage dtype and, with more optimizer
        // shards than weight shards (ZeRO 1/2), all-gathered in it. Beside the weights:
        // the largest unit's cast slice and gathered values (nothing for fp32 in one
        // layout).
        let wshards = if cand.zero >= 3 { dp } else { 1 };
        let oshards = if cand.zero >= 1 { dp } else { 1 };
        let stored = build::storage(spec.precision.params).bytes();
        let master_is_work = wshards == oshards
            && (stored >= 4.0 || opt.master_bytes == 0)
            && (cand.offloads(OffloadWhat::Params) || opt_on_gpu);
        if !master_is_work {
            let bytes = |values: u64| profile.allocated((stored * values as f64).ceil() as u64);
            let per_unit = tape
                .units
                .iter()
                .map(|u| {
                    let shard = u.trainable_values.div_ceil(oshards);
                    let cast = if stored < 4.0 { bytes(shard) } else { 0 };
                    let gathered = if wshards < oshards {
                        bytes(shard * oshards)
                    } else {
                        0
                    };
                    cast + gathered
                })
                .max()
                .unwrap_or(0);
            at_opt[Category::Workspace as usize] += per_unit;
        }
    }
    // An executor that samples between segments samples after the step, when the step's
    // temporaries are gone: the 16-bit plans of 2026-11-30h on an H200 measured exactly the
    // step's state without them (Adafactor, Adam-mini, a 1B AdamW: 9.5-12.8 % below a peak
    // that counted them). They are still the highest bytes in use, which the pool covers.
    if profile.peak_sampled_at_segments {
        in_use_max = in_use_max.max(at_opt.iter().sum());
        at_opt[Category::Workspace as usize] -= step_temp;
    }
    let mut before_setup: Option<tape::Peak> = None;
    // A point outside the walked tape (the optimizer step, the setup build): on the
    // timeline (first, or last), in the phase peaks, and the peak when it is the highest.
    let mut point = |phase: Phase, op: &str, by_category: tape::Bytes, first: bool| {
        let bytes: u64 = by_category.iter().sum();
        in_use_max = in_use_max.max(bytes);
        let e = phase_peaks.entry(phase.as_str().to_string()).or_default();
        *e = (*e).max(bytes);
        if timeline {
            let s = Sample {
                phase,
                op: op.to_string(),
                layer: None,
                bytes,
                by_category,
            };
            if first {
                samples.insert(0, s);
            } else {
                samples.push(s);
            }
        }
        if bytes > peak.bytes {
            if phase == Phase::Setup {
                before_setup = Some(peak.clone());
            }
            peak = tape::Peak {
                bytes,
                phase,
                op: op.to_string(),
                layer: None,
                by_category,
            };
        }
    };
    if let Some(at) = at_exchange {
        point(Phase::Optimizer, EXCHANGE_OP, at, false);
    }
    point(Phase::Optimizer, opt.name, at_opt, false);
    let (total, trainable_count) = param_counts(&tape);
    if profile.burn_ops {
        let at_setup = burn_setup(spec, cand, profile, &tape, opt.master_bytes);
        point(Phase::Setup, SETUP_OP, at_setup, true);
    }
    let categories = |p: &tape::Peak| -> BTreeMap<String, u64> {
        Category::ALL
            .iter()
            .map(|&c| (c.as_str().to_string(), p.by_category[c as usize]))
            .collect()
    };
    let breakdown = categories(&peak);
    let step_peak = before_setup.map(|p| {
        let location = PeakLocation {
            phase: p.phase,
            op: p.op.clone(),
            layer: p.layer,
        };
        (p.bytes, location, categories(&p))
    });
    let work = tape_work(&tape);
    // The allocator's pool beyond the reported peak (CubeCL keeps the pages it grew): a
    // measured factor of the highest bytes in use at any op (transients included), larger
    // when layers are recomputed, minus what the reported peak already counts.
    let factor = if cand.checkpoint_layers.is_empty() {
        profile.pool_factor
    } else {
        profile.pool_factor_recompute
    };
    let mut pooled = (in_use_max as f64 * factor.max(1.0)).ceil() as u64;
    if profile.burn_ops {
        // The compact pools keep tensors in whole pages (`parallel::compact_pool_page`: 8 MiB
        // pages up to 1 MiB, 1 GiB pages up to 1 GiB), whose last is partly empty: a page of
        // the largest tensors' kind above what is in use, which a small plan's factor falls
        // short of (Adam-mini's 125M plan: 3.10 GiB reserved for 1.94 GiB in use, cold on an
        // H200, 2026-11-30h).
        let largest = tape.tensors.iter().map(|t| t.bytes).max().unwrap_or(0);
        pooled = pooled.max(in_use_max + parallel::compact_pool_page(largest.min(1 << 30)));
    }
    let mut pool = pooled.saturating_sub(peak.bytes);
    if let Some(x) = exchange.filter(|_| cand.data > 1) {
        // The exchange comes after the step's other tensors, and its flat vector is the
        // largest tensor of the run: the pool may take a new page for it, and keeps it
        // (CubeCL's default pool took a 4.95 GiB page for 0.54 GB on an H100 and reserved
        // 11.58 GB for 4.59 GB in use, docs/burn-h100.md, "2026-11-25c"; `compact`'s page
        // for it is at most 1 GiB, or the vector's own size above that).
        pool += x.at_step_end.max(parallel::compact_pool_page(x.flat));
    }
    let reserve = spec.fit.reserve.unwrap_or(profile.default_reserve_bytes) + pool;
    let unit_bytes = tape
        .units
        .iter()
        .map(|u| UnitBytes {
            name: u.name,
            layer: u.layer.map(u64::from),
            gathered_bytes: u.bytes,
            regathered: u.regathered,
        })
        .collect();
    MemoryReport {
        peak_bytes: peak.bytes,
        peak: PeakLocation {
            phase: peak.phase,
            op: peak.op,
            layer: peak.layer,
        },
        breakdown,
        phase_peaks,
        timeline: compress(samples),
        reserve_bytes: reserve,
        reserve_pool_bytes: pool,
        in_use_max_bytes: in_use_max,
        params_total: total,
        params_trainable: trainable_count,
        step_flops: work.flops,
        step_fused_attention_flops: work.fused_flops,
        step_fused_attention_rows_flops: work.fused_rows_flops,
        step_attention_matmul_flops: work.attention_matmul_flops,
        step_bytes_moved: work.moved,
        step_kernels: work.kernels,
        units: unit_bytes,
        resident_param_bytes: tape
            .tensors
            .iter()
            .filter(|t| t.role == tape::Role::Param)
            .map(|t| t.bytes)
            .sum(),
        paged_bytes,
        paged_evicted_bytes: 0,
        host_activation_bytes: tape
            .layers
            .iter()
            .filter(|l| l.offloaded)
            .map(|l| tape.tensor(l.input).bytes)
            .sum(),
        step_peak,
    }
}

/// The optimizer step in the backward: each trainable parameter steps where its gradient is
/// complete, the backward of the first op (in forward order) that reads it; under the Burn
/// executor once the backward has left that op's unit (the embedding, a layer, the head
/// with the loss: `backend/src/in_backward.rs`), whose first op that is. The step's
/// temporaries are that op's backward scratch, the largest of the parameters stepping there
/// (one steps after another), and under Burn with data parallelism the unit's all-reduce.
/// Returns [`tape::Persistent::step_at`].
fn steps_in_backward(
    spec: &Spec,
    profile: &Profile,
    cand: &Candidate,
    tape: &mut tape::Tape,
    trainable: &[(tape::TensorId, u64)],
) -> Vec<u32> {
    let mut first_reader = vec![u32::MAX; tape.tensors.len()];
    for (o, op) in tape.ops.iter().enumerate() {
        for inp in &op.inputs {
            let r = &mut first_reader[inp.0 as usize];
            *r = (*r).min(o as u32);
        }
    }
    let unit_start = |o: u32| -> u32 {
        let (Some(first), Some(last)) = (tape.layers.first(), tape.layers.last()) else {
            return 0;
        };
        match tape.layer_of_op(o as usize) {
            Some(l) => l.first_op,
            None if o < first.first_op => 0,
            None => last.end_op,
        }
    };
    let mut step_at = vec![u32::MAX; tape.tensors.len()];
    let mut temp: BTreeMap<u32, u64> = BTreeMap::new();
    let mut values: BTreeMap<u32, u64> = BTreeMap::new();
    for &(id, n) in trainable {
        let first = first_reader[id.0 as usize];
        if first == u32::MAX {
            continue;
        }
        // The unit's first op with a backward: the backward of a layer behind a frozen
        // embedding leaves the layer at the first op that reads a trainable tensor.
        let at = if profile.burn_ops {
            (unit_start(first)..first)
                .find(|&o| tape.ops[o as usize].has_backward(tape))
                .unwrap_or(first)
        } else {
            first
        };
        step_at[id.0 as usize] = at;
        let t = optimizer::in_backward_step_temp(spec, profile, tape, (id, n), cand);
        let e = temp.entry(at).or_default();
        *e = (*e).max(t);
        *values.entry(at).or_default() += n;
    }
    for (at, t) in temp {
        // Data parallelism under Burn: the unit's gradients, flattened to one fp32 vector,
        // and its all-reduced mean, before the unit steps (`Collective::mean_step`).
        let exchange = if profile.burn_ops && cand.data > 1 {
            2 * profile.allocated(4 * values[&at])
        } else {
            0
        };
        tape.ops[at as usize].bwd_workspace += t + exchange;
    }
    step_at
}

/// The highest point of the Burn executor's start-up (`backend/src/setup.rs`), per device,
/// by category. The units (the embedding, each layer, the head) are made one at a time in
/// that order, each loaded from the Hugging Face checkpoint a tensor at a time when the plan
/// has weights, and then kept or cut into this rank's shards before the next unit is made:
/// - ZeRO-3 or parameter offload (`shard::zero3::wanted`): the unit is made in fp32 (the
///   values the master starts from); each of its device shards is cut into an fp32 buffer,
///   then cast to the storage dtype; host shards go down a parameter at a time (cast on the
///   device first); then the whole unit is dropped. At unit `u`: what the units before it
///   left + `u` in fp32 + `u`'s shards, plus the fp32 shard being cast (or the parameter
///   being cast for the host), or (loading) one tensor's fp32 values beside the old one.
/// - ZeRO 1/2 or the optimizer on the host with whole weights ([`burn_flat_zero`]): this
///   rank's fp32 master shard is one buffer made at the first unit (on the device unless
///   the optimizer is on the host); each unit is made in fp32 with an fp32 master (else in
///   its storage dtype), its part of the shard is cut a parameter at a time (a 16-bit
///   parameter cast to fp32 first; an fp32 one is read in place), then a 16-bit unit made
///   in fp32 is cast a parameter at a time and kept: what the units before it left + the
///   master buffer + `u` + the largest of those transients.
/// - otherwise the unit is made in the dtype the run keeps it in (fp32 with an fp32 master,
///   of which the 16-bit working copy is cast at the end): what the units before it left +
///   `u` + one tensor's fp32 draw before its 16-bit cast, or (loading) its fp32 values and
///   their cast.
///
/// The optimizer state and the gradient accumulator are made at the first step, not here.
fn burn_setup(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    tape: &tape::Tape,
    master_bytes: u64,
) -> tape::Bytes {
    use crate::spec::Dtype;
    // The executor cuts units whenever it runs ZeRO-3 or offloads the parameters or the
    // gradients, one rank of ZeRO-3 included (`shard::zero3::wanted`), which the step
    // charges as whole weights ([`burn_units`]).
    let units =
        cand.zero >= 3 || cand.offloads(OffloadWhat::Params) || cand.offloads(OffloadWhat::Grads);
    let flat = burn_flat_zero(profile, cand);
    let on_host = cand.offloads(OffloadWhat::Params);
    let opt_host = cand.offloads(OffloadWhat::Optimizer);
    let wshards = if cand.zero >= 3 { cand.data.max(1) } else { 1 };
    let oshards = if cand.zero >= 1 { cand.data.max(1) } else { 1 };
    let master = master_bytes > 0;
    let storage = build::storage(spec.precision.params);
    let sixteen = storage.bytes() < 4.0;
    let loads = spec.model.weights.is_some();
    let alloc = |b: f64| profile.allocated(b.ceil() as u64);
    // Each parameter's unit: that of the first op reading it (layer ops carry their
    // layer; the embedding's come before the first layer's, the head's after).
    let first_layer_op = tape.ops.iter().position(|o| o.layer.is_some());
    let mut unit_of: Vec<Option<(u8, u32)>> = vec![None; tape.tensors.len()];
    for (i, op) in tape.ops.iter().enumerate().rev() {
        let key = match op.layer {
            Some(l) => (1, l),
            None if first_layer_op.is_some_and(|f| i > f) => (2, 0),
            None => (0, 0),
        };
        for t in &op.inputs {
            unit_of[t.0 as usize] = Some(key);
        }
    }
    #[derive(Default)]
    struct Made {
        /// The unit as it is made (fp32 when sharded, trainable parameters fp32 beside a
        /// master; NF4 as NF4).
        built: u64,
        /// Its frozen parameters as made: beside a master they have none and are made in
        /// the storage dtype, which the working copy shares (`setup.rs`).
        built_frozen: u64,
        largest_frozen: u64,
        /// What it leaves on the device (the steady state's weights at rest).
        kept: u64,
        trainable: u64,
        frozen: u64,
        largest: u64,
        largest_trainable: u64,
    }
    let mut made: BTreeMap<(u8, u32), Made> = BTreeMap::new();
    for (i, t) in tape.tensors.iter().enumerate() {
        if t.role != tape::Role::Param {
            continue;
        }
        let m = made.entry(unit_of[i].unwrap_or((2, 0))).or_default();
        let n: u64 = t.shape.iter().product();
        let built = if t.dtype == Dtype::Nf4 {
            quant::nf4_parts(n, profile.nf4_double_quant)
                .iter()
                .filter(|b| **b > 0)
                .map(|b| profile.allocated(*b))
                .sum()
        } else if units || (master && t.requires_grad) {
            alloc(4.0 * n as f64)
        } else {
            alloc(t.dtype.bytes() * n as f64)
        };
        m.built += built;
        m.kept += t.bytes;
        if t.requires_grad {
            m.trainable += n;
        } else {
            m.frozen += n;
            m.built_frozen += built;
            if t.dtype != Dtype::Nf4 {
                m.largest_frozen = m.largest_frozen.max(n);
            }
        }
        if t.dtype != Dtype::Nf4 {
            m.largest = m.largest.max(n);
            if t.requires_grad {
                m.largest_trainable = m.largest_trainable.max(n);
            }
        }
    }
    let (mut weights, mut masters) = (0u64, 0u64);
    // The flat step's fp32 master shard, one buffer from the first unit on.
    let flat_master = if flat && !opt_host {
        let trainable: u64 = made.values().map(|m| m.trainable).sum();
        alloc(4.0 * trainable.div_ceil(oshards) as f64)
    } else {
        0
    };
    let mut peak: tape::Bytes = [0; Category::COUNT];
    let mut note = |w: u64, m: u64| {
        if w + m > peak.iter().sum::<u64>() {
            peak = [0; Category::COUNT];
            peak[Category::Weights as usize] = w;
            peak[Category::Optimizer as usize] = m;
        }
    };
    for m in made.values() {
        let load = if loads {
            alloc(4.0 * m.largest as f64)
        } else {
            0
        };
        // 16-bit weights without a master copy: each is drawn in fp32 and cast (the flat
        // and the whole-model paths; ZeRO-3 units cut their shards instead).
        let draw = if sixteen && !master {
            alloc(4.0 * m.largest as f64)
        } else {
            0
        };
        let cast = if loads && sixteen && !master {
            alloc(storage.bytes() * m.largest as f64)
        } else {
            0
        };
        if units {
            // The fp32 master shard stays on the device unless something is offloaded.
            let master_u = if master && !on_host && !opt_host {
                alloc(4.0 * m.trainable.div_ceil(oshards) as f64)
            } else {
                0
            };
            // A device shard is cut into an fp32 buffer, then cast; a host shard goes down a
            // parameter at a time, cast on the device first.
            let cut = if on_host {
                if sixteen {
                    alloc(storage.bytes() * m.largest as f64)
                } else {
                    0
                }
            } else if sixteen {
                alloc(4.0 * m.trainable.max(m.frozen).div_ceil(wshards) as f64)
            } else {
                0
            };
            note(
                weights + m.built + load.max(m.kept + cut),
                masters + master_u,
            );
            weights += m.kept;
            masters += master_u;
        } else if flat {
            let cut = if sixteen && !master {
                alloc(4.0 * m.largest_trainable as f64)
            } else {
                0
            };
            let to_storage = if sixteen && master {
                alloc(storage.bytes() * m.largest as f64)
            } else {
                0
            };
            let transient = draw.max(load + cast).max(cut).max(to_storage);
            note(weights + m.built + transient, flat_master);
            weights += m.kept;
        } else {
            if master {
                // Frozen parameters are drawn in fp32 and cast, or loaded and cast, like
                // 16-bit weights without a master.
                let frozen_draw = if sixteen {
                    alloc(4.0 * m.largest_frozen as f64)
                } else {
                    0
                };
                let frozen_cast = if loads && sixteen {
                    alloc(storage.bytes() * m.largest_frozen as f64)
                } else {
                    0
                };
                let trainable_built = m.built - m.built_frozen;
                note(
                    weights + m.built_frozen + frozen_draw.max(load + frozen_cast),
                    masters + trainable_built,
                );
                weights += m.built_frozen;
                masters += trainable_built;
            } else {
                note(weights + m.built + draw.max(load + cast), masters);
                weights += m.built;
            }
        }
    }
    if !units && !flat && master {
        // The 16-bit working copy, cast from the fp32 master.
        weights = made.values().map(|m| m.kept).sum();
    }
    note(weights, masters.max(flat_master));
    peak[Category::Workspace as usize] = profile.workspace_bytes;
    peak
}

fn param_counts(tape: &tape::Tape) -> (u64, u64) {
    let mut total = 0;
    let mut trainable = 0;
    for t in &tape.tensors {
        if t.role == tape::Role::Param {
            let n: u64 = t.shape.iter().product();
            total += n;
            if t.requires_grad {
                trainable += n;
            }
        }
    }
    (total, trainable)
}

/// What one micro-step does (forward, backward and recompute), from its tape.
#[derive(Default)]
struct Work {
    flops: f64,
    /// Of `flops`, the fused attention's on tensor cores, and its `Rows` kernels'.
    fused_flops: f64,
    fused_rows_flops: f64,
    /// Of `flops`, eager attention's two products.
    attention_matmul_flops: f64,
    /// Bytes moved by memory-bound ops.
    moved: f64,
    kernels: u64,
}

fn tape_work(tape: &tape::Tape) -> Work {
    let mut w = Work::default();
    let kept = tape.kept_mask();
    for (i, op) in tape.ops.iter().enumerate() {
        // A kept output's op does not run again in the recompute (a kept gathered weight is
        // no output of its computation).
        let recomputed = tape.layer_of_op(i).is_some_and(|l| l.checkpointed)
            && !op
                .outputs
                .iter()
                .any(|o| kept[o.0 as usize] && tape.tensor(*o).role != tape::Role::Gathered);
        let fwd_times = if recomputed { 2.0 } else { 1.0 };
        w.kernels += fwd_times as u64 + 2 * op.has_backward(tape) as u64;
        let op_flops = op.flops * fwd_times
            + if op.has_backward(tape) {
                op.bwd_flops
            } else {
                0.0
            };
        w.flops += op_flops;
        if op.name == build::FUSED_ATTENTION_OP {
            w.fused_flops += op_flops;
        } else if op.name == build::FUSED_ATTENTION_ROWS_OP {
            w.fused_rows_flops += op_flops;
        } else if op.name == build::SCORES_OP || op.name == build::PROBS_V_OP {
            w.attention_matmul_flops += op_flops;
        }
        if op.flops == 0.0 {
            // Forward (and recompute), and about as many bytes again in the backward.
            w.moved += op.bytes_moved * (fwd_times + 1.0);
        }
    }
    w
}

/// Keep one sample per run of (phase, layer): the highest.
fn compress(samples: Vec<Sample>) -> Vec<Sample> {
    let mut out: Vec<Sample> = Vec::new();
    for s in samples {
        match out.last_mut() {
            Some(last) if last.phase == s.phase && last.layer == s.layer && s.layer.is_some() => {
                if s.bytes > last.bytes {
                    *last = s;
                }
            }
            _ => out.push(s),
        }
    }
    out
}
