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
//! - **The Burn executor's ZeRO-3 / parameter offload**: the one staging buffer
//!   (a unit's size) through which offloaded shards are uploaded. Its gathered
//!   units, prefetch and per-unit gradients are tensors of the tape
//!   (`memory::build`, `Builder::begin_unit`), not terms here.
//! - **Communication buffers**: DDP's gradient buckets (25 MiB each, all of
//!   them allocated when the model is wrapped: a second copy of the gradients), ZeRO-1/2's reduce and all-gather buckets
//!   (DeepSpeed's defaults: 5e8 elements each, never more than the gradients
//!   themselves), ZeRO-3's prefetch bucket (5e7 elements of the next
//!   layer's parameters) and reduce bucket, and the pipeline's send/receive
//!   buffers (one stage boundary activation each way).
//!
//! [`evaluate`] compares the first and the last pipeline stage after these
//! terms and reports the worse; [`ranks`] describes both for `--explain`
//! (which layers, which shard of weights, gradients and optimizer state).
//!
//! These buffers exist for the whole step, so they are added as one
//! `communication` category to the peak, to every timeline sample and to
//! every phase peak: the peak's location does not move. Invariant: a plan on
//! one GPU (data = tensor = pipeline = context = 1, nothing offloaded) gets
//! exactly [`super::evaluate`]'s report, so single-GPU calibration is
//! untouched. Sequence parallelism's division of norm/residual activations
//! is not subtracted (conservative: it only lowers memory).

use super::{evaluate_on, Candidate, MemoryReport, Stage};
use crate::profile::Profile;
use crate::spec::Spec;
use serde::Serialize;

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
    /// The Burn executor's parameter offload: one unit-sized device buffer the host shards
    /// are uploaded through before each unit's gather.
    pub staging_buffer: u64,
    /// FSDP2's, DeepSpeed's or Megatron's own buffers (`memory::engines`), in place of the
    /// generic data-parallel buckets above.
    pub engine: Vec<super::engines::EngineBuffer>,
}

impl ParallelTerms {
    pub fn added(&self) -> u64 {
        self.reduce_bucket
            + self.gather_bucket
            + self.pipeline_buffers
            + self.staging_buffer
            + self.engine.iter().map(|b| b.bytes).sum::<u64>()
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
        crate::spec::Mlp::Gelu | crate::spec::Mlp::SquaredRelu => 2 * m.hidden * ffn,
    };
    // The MLP's biases are one set per expert.
    let (mlp_biases, others) =
        layer_vectors(m, tensor)
            .into_iter()
            .fold((0, 0), |(e, o), (what, n)| {
                if what.starts_with("mlp") {
                    (e + n, o)
                } else {
                    (e, o + n)
                }
            });
    attn + (mlp + mlp_biases) * m.experts.max(1) + others
}

/// The one-dimensional parameters of one transformer layer on one tensor-parallel rank,
/// with their lengths: the two norms' scales (and a LayerNorm's biases), the projections'
/// biases (`mlp…`: one per expert), Qwen3's norms over each head of q and k.
pub fn layer_vectors(m: &crate::spec::ModelSpec, tensor: u64) -> Vec<(&'static str, u64)> {
    use crate::spec::{Mlp, Norm, Proj};
    let t = tensor.max(1);
    let (heads, kv, ffn) = (
        m.heads.div_ceil(t),
        m.kv_heads.div_ceil(t),
        m.ffn.div_ceil(t),
    );
    let layernorm = m.norm == Norm::Layernorm;
    let mut v = vec![("norm", m.hidden), ("norm", m.hidden)];
    if layernorm {
        v.extend([("norm_bias", m.hidden), ("norm_bias", m.hidden)]);
    }
    if m.numerics.qk_norm {
        v.extend([("qk_norm", m.head_dim), ("qk_norm", m.head_dim)]);
        if layernorm {
            v.extend([("qk_norm_bias", m.head_dim), ("qk_norm_bias", m.head_dim)]);
        }
    }
    let projections = [
        (Proj::Q, "q_bias", heads * m.head_dim),
        (Proj::K, "k_bias", kv * m.head_dim),
        (Proj::V, "v_bias", kv * m.head_dim),
        // The row-parallel projections' biases are whole on every rank.
        (Proj::O, "o_bias", m.hidden),
        (Proj::Gate, "mlp_gate_bias", ffn),
        (Proj::Up, "mlp_up_bias", ffn),
        (Proj::Down, "mlp_down_bias", m.hidden),
    ];
    for (p, what, n) in projections {
        if m.bias_on(p) && (p != Proj::Gate || m.mlp == Mlp::Swiglu) {
            v.push((what, n));
        }
    }
    v
}

/// Parameters of the whole model (elements): layers, embeddings and an untied head.
pub fn model_params(m: &crate::spec::ModelSpec) -> u64 {
    let embed = m.vocab * m.hidden;
    let head = if m.tie_embeddings { 0 } else { embed };
    m.layers * layer_params(m, 1) + embed + head + m.hidden
}

/// The per-rank terms for `cand` on `stage`, given the stage's report.
pub fn terms(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    stage: &Stage,
    report: &MemoryReport,
) -> ParallelTerms {
    let d = cand.data.max(1);
    let grad_b = spec.precision.grads.bytes();
    let param_b = spec.precision.params.bytes();
    let trainable = report.params_trainable;
    let mut t = ParallelTerms::default();
    let burn = spec.target == crate::spec::Target::Burn;
    if let Some(bufs) = super::engines::buffers(spec, cand, profile, stage, report) {
        t.engine = bufs;
    } else if burn && !report.units.is_empty() {
        // The Burn executor's ZeRO-3 / parameter offload reduces each unit's gradient (a tape
        // transient) as the backward leaves it: no flat vectors. Offloaded weights are fp32
        // on the host: this rank's shard of a unit comes up as fp32 before its cast.
        if cand.offloads(crate::spec::OffloadWhat::Params) {
            let largest = report
                .units
                .iter()
                .map(|u| u.gathered_bytes)
                .max()
                .unwrap_or(0);
            let wshards = if cand.zero >= 3 { d } else { 1 };
            let fp32 = (largest as f64 * 4.0 / param_b.max(0.5)) as u64;
            t.staging_buffer = fp32.div_ceil(wshards);
        }
    } else if let Some(x) = burn_exchange(spec, cand, trainable) {
        // The exchange itself is a point at the step's end (`memory::evaluate_on`); only
        // the fp32 copy of the shard that fp32 weights keep lives through the step.
        t.reduce_bucket = x.whole_step;
    } else if !burn && d > 1 && trainable > 0 {
        // PyTorch engines' buckets (the Burn executor's exchanges are above, or transients of
        // the tape: each unit's as the backward leaves it under ZeRO-3, parameter and
        // gradient offload, and the step in the backward).
        // Full (unsharded) gradient bytes of this rank's stage.
        let full_grads = (trainable as f64 * grad_b) as u64;
        match cand.zero {
            // DDP's `Reducer` allocates every bucket's flat gradient buffer when the model is
            // wrapped (`reducer.cpp` `initialize_buckets`: one `at::empty` per bucket of up to
            // `bucket_cap_mb`, in the parameters' dtype) and keeps them for the run; with
            // `gradient_as_bucket_view=False` (the default) each `.grad` is a separate tensor
            // copied into its bucket view, so the buckets are a second copy of every
            // trainable gradient, whatever the bucket size (measured: ddp_* rows of
            // `tests/groundtruth/h100-multigpu.jsonl`, alloc after setup = 2 × weights).
            0 => t.reduce_bucket = full_grads,
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

/// The Burn executor's gradient exchange on one rank (`backend/src/shard`,
/// `backend/src/distributed.rs`): made after the last micro-batch's backward, when the
/// activations are gone, and freed before the next forward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BurnExchange {
    /// Device bytes of the exchange at its highest (flat fp32 vectors, received blocks).
    pub at_step_end: u64,
    /// The flat fp32 vector's bytes: the largest tensor of the exchange.
    pub flat: u64,
    /// The gradients are written into the flat vector one by one and leave as it fills,
    /// so the two never both exist whole (ZeRO 1/2, the optimizer offloaded); data
    /// parallelism without ZeRO keeps them beside it.
    pub grads_leave: bool,
    /// Bytes for the whole step: the fp32 copy of this rank's shard that fp32 weights keep
    /// beside them (16-bit weights charge their fp32 master with the optimizer state, an
    /// offloaded optimizer keeps it on the host).
    pub whole_step: u64,
}

/// [`BurnExchange`] of `cand`, `None` where the Burn executor exchanges no flat vector
/// (one rank without ZeRO or offload; ZeRO-3, parameter and gradient offload, and the step
/// in the backward, which reduce each unit's gradient as the backward leaves it; other
/// targets).
///
/// - ZeRO 1/2 (or the optimizer offloaded): one flat fp32 gradient vector. Stages 1 and 2
///   reduce-scatter it: burn-collective's ring keeps the vector while it receives and sums
///   (in place into the received buffer) the other ranks' blocks, up to d − 1 of them,
///   before it hands back this rank's shard. Stage 0 with the optimizer offloaded
///   all-reduces it: the ring's received blocks and its final concatenation make a second
///   full vector. The all-gather's full vector of updated weights comes after the flat
///   buffers are freed.
/// - ZeRO 0 over several ranks: every gradient concatenated into one flat fp32 vector and
///   all-reduced; the vector and the reduced result coexist with the gradients.
///
/// Device memory only: the transport's serialised copies are host bytes
/// (docs/distributed.md bounds them for `--device cpu`).
pub fn burn_exchange(spec: &Spec, cand: &Candidate, trainable: u64) -> Option<BurnExchange> {
    let d = cand.data.max(1);
    let host_optimizer = cand.offloads(crate::spec::OffloadWhat::Optimizer);
    let units = cand.zero >= 3
        || cand.offloads(crate::spec::OffloadWhat::Params)
        || cand.offloads(crate::spec::OffloadWhat::Grads);
    // A step in the backward reduces each unit as the backward leaves it (`memory::
    // steps_in_backward` charges it there): no whole-model vector.
    if spec.target != crate::spec::Target::Burn
        || trainable == 0
        || units
        || spec.optimizer_in_backward
    {
        return None;
    }
    let flat = trainable * 4;
    if host_optimizer || cand.zero >= 1 {
        let shards = if cand.zero >= 1 { d } else { 1 };
        let shard = trainable.div_ceil(shards) * 4;
        let exchange = match (d, cand.zero) {
            (1, _) => flat,
            (_, 1 | 2) => flat + (d - 1) * shard,
            _ => 2 * flat,
        };
        // 16-bit weights keep their fp32 master shard with the optimizer state, `master =
        // none` too (`memory::optimizer`: the flat step needs it).
        let whole_step =
            if host_optimizer || super::build::storage(spec.precision.params).bytes() < 4.0 {
                0
            } else {
                shard
            };
        Some(BurnExchange {
            at_step_end: exchange,
            flat,
            grads_leave: true,
            whole_step,
        })
    } else if d > 1 {
        Some(BurnExchange {
            at_step_end: 2 * flat,
            flat,
            grads_leave: false,
            whole_step: 0,
        })
    } else {
        None
    }
}

/// The page `rcoa run`'s default pools (`--memory-pool compact`, `backend/src/pool`) take
/// for a new tensor of `bytes`: 8 MiB pages hold tensors up to 1 MiB, 1 GiB pages anything
/// up to 1 GiB, and a larger tensor gets a page of its own, at most the size of the first
/// exclusive pool that takes it (1 GiB × 1.04^k). Mirrors `compact_pools` (the compiler does
/// not link the backend; the backend's tests hold the two equal).
pub fn compact_pool_page(bytes: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    const PAGE: u64 = 1 << 30;
    if bytes <= MIB {
        return 8 * MIB;
    }
    if bytes <= PAGE {
        return PAGE;
    }
    let mut max = PAGE as f64;
    while (max as u64) < bytes {
        max *= 1.04;
    }
    (max as u64).next_multiple_of(512)
}

/// [`super::evaluate_on`] plus the layout's per-rank terms, for each of [`super::stages`].
pub fn evaluate_stages(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    timeline: bool,
) -> Vec<(Stage, MemoryReport)> {
    super::stages(spec, cand)
        .into_iter()
        .map(|stage| {
            let mut r = evaluate_on(spec, cand, profile, &stage, timeline);
            let t = terms(spec, cand, profile, &stage, &r);
            apply(&mut r, &t);
            super::paged::evict(spec, &mut r);
            (stage, r)
        })
        .collect()
}

/// Index of the worst rank of [`evaluate_stages`]: the highest peak, the first on a tie.
pub fn worst(stages: &[(Stage, MemoryReport)]) -> usize {
    let mut w = 0;
    for (i, (_, r)) in stages.iter().enumerate() {
        if r.peak_bytes > stages[w].1.peak_bytes {
            w = i;
        }
    }
    w
}

/// The worst rank's report: [`super::evaluate`] plus the layout's per-rank terms, compared
/// after the terms (the stages' communication buffers may differ).
pub fn evaluate(spec: &Spec, cand: &Candidate, profile: &Profile, timeline: bool) -> MemoryReport {
    let mut v = evaluate_stages(spec, cand, profile, timeline);
    let w = worst(&v);
    v.swap_remove(w).1
}

/// What one rank holds of the model's persistent state, at its peak.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Holding {
    /// `weights`, `grads`, `optimizer` or `communication`.
    pub what: &'static str,
    /// Bytes on the GPU at the rank's peak.
    pub bytes: u64,
    /// Which part of the whole, e.g. `1/4 of the stage's optimizer state (ZeRO-1 over data = 4)`.
    pub share: String,
}

/// One rank of the layout as `--explain` shows it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct RankMemory {
    pub stage: Stage,
    /// e.g. `layers 0–31 of 126 (pipeline stage 1 of 4) + embedding`.
    pub layers: String,
    /// How the stage is cut across the rank's tensor / context / data peers.
    pub shards: Vec<String>,
    pub holds: Vec<Holding>,
    pub peak_bytes: u64,
    /// The rank whose peak `memory.peak_bytes` reports.
    pub worst: bool,
}

/// The ranks the model distinguishes (first and, with a pipeline, last stage), the worst
/// marked: what each holds and how its slice of the model is cut.
pub fn ranks(spec: &Spec, cand: &Candidate, profile: &Profile) -> Vec<RankMemory> {
    let v = evaluate_stages(spec, cand, profile, false);
    let w = worst(&v);
    v.into_iter()
        .enumerate()
        .map(|(i, (stage, r))| {
            // The terms depend on the parameter counts only, which `apply` leaves alone.
            let t = terms(spec, cand, profile, &stage, &r);
            describe(spec, cand, profile, stage, &r, &t, i == w)
        })
        .collect()
}

fn describe(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    stage: Stage,
    r: &MemoryReport,
    terms: &ParallelTerms,
    worst: bool,
) -> RankMemory {
    use crate::spec::OffloadWhat;
    let (t, c, d) = (cand.tensor.max(1), cand.context.max(1), cand.data.max(1));
    let total = spec.model.layers;
    let mut layers = if stage.end_layer > stage.first_layer {
        format!(
            "layers {}–{} of {}",
            stage.first_layer,
            stage.end_layer - 1,
            total
        )
    } else {
        format!("no layers of {total}")
    };
    if stage.stages > 1 {
        layers += &format!(" (pipeline stage {} of {})", stage.index + 1, stage.stages);
    }
    match (stage.embedding, stage.head) {
        (true, true) => layers += " + embedding and head",
        (true, false) => layers += " + embedding",
        (false, true) => layers += " + head",
        (false, false) => {}
    }
    let mut shards = Vec::new();
    if t > 1 {
        shards.push(format!("1/{t} of each layer's width (tensor = {t})"));
        if cand.sequence {
            shards.push(format!(
                "1/{t} of the tokens outside attention and MLP (sequence parallel)"
            ));
        }
    }
    if c > 1 {
        shards.push(format!("1/{c} of each sequence's tokens (context = {c})"));
    }
    if stage.virtual_stages > 1 {
        let v = stage.virtual_stages;
        shards.push(format!(
            "{v} model chunks of {} layers (virtual_stages = {v}); activations of {} chunk forwards in flight (interleaved 1F1B), {:.2} micro-batches of the whole stage",
            (stage.end_layer - stage.first_layer) / v,
            stage.in_flight,
            stage.in_flight as f64 / v as f64
        ));
    } else if stage.in_flight > 1 {
        shards.push(format!(
            "activations of {} micro-batches in flight (1F1B)",
            stage.in_flight
        ));
    }
    let of = |n: u64, what: &str, why: String| {
        if n > 1 {
            format!("1/{n} of the stage's {what} ({why})")
        } else {
            format!("all the stage's {what}")
        }
    };
    let dp = |zero: u8| format!("ZeRO-{zero} over data = {d}");
    let weights = if cand.offloads(OffloadWhat::Params) {
        "on the host; each layer's weights gathered for its use".to_string()
    } else if cand.zero >= 3 && d > 1 {
        of(d, "weights", dp(3)) + ", each layer gathered for its use"
    } else if d > 1 {
        format!("all the stage's weights (replicated over data = {d})")
    } else {
        of(1, "weights", String::new())
    };
    let grads = if cand.offloads(OffloadWhat::Grads) {
        "on the host".to_string()
    } else if cand.zero >= 2 && d > 1 && spec.target == crate::spec::Target::Burn {
        "all the stage's gradients (the Burn executor reduce-scatters them after the backward)"
            .to_string()
    } else if cand.zero >= 2 && d > 1 {
        of(d, "gradients", dp(cand.zero.min(3)))
    } else {
        of(1, "gradients", String::new())
    };
    let optimizer = if cand.offloads(OffloadWhat::Optimizer) {
        "on the host (updated by the CPU)".to_string()
    } else if cand.zero >= 1 && d > 1 {
        of(d, "optimizer state", dp(cand.zero.min(3)))
    } else {
        of(1, "optimizer state", String::new())
    };
    let (weights, grads, optimizer) = engine_shares(spec, cand, profile, weights, grads, optimizer);
    let at = |k: &str| r.breakdown.get(k).copied().unwrap_or(0);
    if !r.units.is_empty() {
        return RankMemory {
            stage,
            layers,
            shards,
            holds: burn_unit_holdings(spec, cand, r, terms),
            peak_bytes: r.peak_bytes,
            worst,
        };
    }
    let mut holds = vec![
        Holding {
            what: "weights",
            bytes: at("weights"),
            share: weights,
        },
        Holding {
            what: "grads",
            bytes: at("grads"),
            share: grads,
        },
        Holding {
            what: "optimizer",
            bytes: at("optimizer"),
            share: optimizer,
        },
    ];
    if terms.added() > 0 {
        let ddp = cand.zero == 0 && spec.target != crate::spec::Target::Burn;
        let named = [
            (
                terms.reduce_bucket,
                if ddp {
                    "DDP gradient buckets (a copy of every gradient, allocated when the model is wrapped)"
                } else {
                    "gradient reduce bucket"
                },
            ),
            (
                terms.gather_bucket,
                "prefetch of the next layer's gathered weights",
            ),
            (terms.pipeline_buffers, "pipeline send/receive buffers"),
        ];
        let share = named
            .iter()
            .filter(|(b, _)| *b > 0)
            .map(|(b, what)| format!("{what} {:.2} GiB", *b as f64 / (1u64 << 30) as f64))
            .chain(terms.engine.iter().map(|b| b.what.clone()))
            .collect::<Vec<_>>()
            .join(", ");
        holds.push(Holding {
            what: "communication",
            bytes: at("communication"),
            share,
        });
    }
    RankMemory {
        stage,
        layers,
        shards,
        holds,
        peak_bytes: r.peak_bytes,
        worst,
    }
}

/// The weights / gradients / optimizer lines in the words of the engine that holds them
/// (`memory::engines`); the generic ZeRO wording for eager PyTorch, DeepSpeed and Burn.
fn engine_shares(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    weights: String,
    grads: String,
    optimizer: String,
) -> (String, String, String) {
    use crate::profile::Engine;
    let d = cand.data.max(1);
    let p = &spec.precision;
    match profile.engine {
        // CPUOffloadPolicy: the sharded weights, gradients and optimizer state live in host
        // memory; only the gathered copies (and the upload of a shard) are on the device.
        Engine::Fsdp2 if cand.offloads(crate::spec::OffloadWhat::Params) => (
            format!(
                "1/{d} of the stage's weights in {} on the host (CPUOffloadPolicy); each layer's shard uploaded and gathered in {} for its use",
                p.params.as_str(),
                p.compute.as_str()
            ),
            format!("1/{d} of the stage's gradients on the host (CPUOffloadPolicy: each reduce-scattered shard goes down)"),
            format!("1/{d} of the stage's optimizer state on the host (the step runs on the CPU)"),
        ),
        Engine::Fsdp2 => (
            format!(
                "1/{d} of the stage's weights in {} (FSDP2 fully_shard), and the units gathered in {} while they run: the root (embedding, final norm, head), the running layer with its all-gather output or the next one's prefetch ({})",
                p.params.as_str(),
                p.compute.as_str(),
                if super::engines::fsdp_reshards_after_forward(cand.zero) {
                    "each resharded after its forward, gathered again for its backward"
                } else {
                    "each kept gathered from its forward to its backward"
                }
            ),
            format!(
                "1/{d} of the stage's gradients in {}, and the unsharded {} gradients of the unit whose backward runs with the previous unit's reduce-scatter input (FSDP2 reduces in {})",
                p.params.as_str(),
                p.compute.as_str(),
                p.params.as_str()
            ),
            format!("1/{d} of the stage's optimizer state (on FSDP2's sharded parameters)"),
        ),
        Engine::Megatron => (
            weights,
            format!(
                "all the stage's gradients in Megatron's contiguous {} gradient buffer (grad_reduce_in_fp32)",
                if crate::profile::engines::megatron::GRAD_REDUCE_IN_FP32 {
                    "fp32"
                } else {
                    p.grads.as_str()
                }
            ),
            if cand.zero >= 1 {
                format!("1/{d} of the fp32 main weights and Adam state (distributed optimizer over data = {d})")
            } else {
                "all the stage's fp32 main weights and Adam state (no distributed optimizer)".to_string()
            },
        ),
        Engine::DeepSpeed if super::engines::zero3_keeps_forward_gathers(profile, cand)
            && !cand.offloads(crate::spec::OffloadWhat::Params) =>
        {
            (
                format!(
                    "1/{d} of the stage's weights (ZeRO-3 over data = {d}), plus every matrix gathered whole from its use in the forward until its backward (DeepSpeed's parameter coordinator, from the second step)"
                ),
                if super::engines::grads_follow_host_optimizer(profile, cand) {
                    grads
                } else {
                    format!("1/{d} of the stage's gradients in DeepSpeed's flat partition, allocated with the optimizer")
                },
                optimizer,
            )
        }
        _ => (weights, grads, optimizer),
    }
}

/// What a rank of the Burn executor's ZeRO-3 / parameter offload holds at its peak: the
/// at-rest shards, the units gathered then, the gradient accumulator and the unit gradient
/// in flight, the optimizer's shard, the staging buffer.
fn burn_unit_holdings(
    spec: &Spec,
    cand: &Candidate,
    r: &MemoryReport,
    terms: &ParallelTerms,
) -> Vec<Holding> {
    use crate::spec::OffloadWhat;
    let d = if cand.zero >= 3 { cand.data.max(1) } else { 1 };
    let od = if cand.zero >= 1 { cand.data.max(1) } else { 1 };
    let at = |k: &str| r.breakdown.get(k).copied().unwrap_or(0);
    let host_params = cand.offloads(OffloadWhat::Params);
    let host_optimizer = cand.offloads(OffloadWhat::Optimizer);
    let profile = crate::profile::Profile::for_target(spec.target);
    let host_acc = super::burn_host_grad_accumulator(&profile, cand);
    let sharded = |n: u64, what: &str| {
        if n > 1 {
            format!("1/{n} of {what} (ZeRO-{} over data = {n})", cand.zero)
        } else {
            format!("all of {what}")
        }
    };
    let shard = |what: &str| sharded(d, what);
    let oshard = |what: &str| sharded(od, what);
    let resident = r.resident_param_bytes.min(at("weights"));
    let views = !super::burn_units_gathered(&profile, cand);
    let weights = if host_params {
        format!(
            "{} in host memory (parameter offload), uploaded a unit at a time through the staging buffer",
            shard("every unit's weights")
        )
    } else if views {
        "all of every unit's weights, whole on the device; each unit's parameters are read in place \
         (gradient offload steps a unit at a time, nothing is gathered)"
            .to_string()
    } else {
        shard("every unit's weights") + ", at rest between uses"
    };
    let units = r.units.len();
    let recomputed = r.units.iter().filter(|u| u.regathered).count();
    let layers = r.units.iter().filter(|u| u.layer.is_some()).count();
    let gathered = if views {
        format!("nothing: the {units} units (embedding, {layers} layers, head) are views of the weights at rest")
    } else {
        format!(
            "whole units gathered at the peak ({units} units: embedding, {layers} layers, head): the running one and {} prefetched, plus every non-checkpointed layer's until its backward; the {recomputed} checkpointed layers' are freed after their forward and gathered again for their recompute",
            crate::profile::ZERO3_PREFETCH_UNITS
        )
    };
    let grads = if host_acc {
        "the fp32 gradient of the unit whose backward runs, reduced as the backward leaves it (reduce-scattered under ZeRO 2 and 3); the fp32 gradient-shard accumulator is in host memory beside the optimizer".to_string()
    } else {
        format!(
            "{} as an fp32 accumulator (from the first reduce-scatter of the backward to the optimizer step), plus the fp32 gradient of the unit whose backward runs until it is reduce-scattered",
            oshard("the trainable values' gradients")
        )
    };
    let optimizer = if host_optimizer {
        "on the host (state, fp32 master shard and update)".to_string()
    } else if host_params {
        oshard("the optimizer state") + "; the fp32 weights on the host are its master"
    } else {
        oshard("the optimizer state and fp32 master")
    };
    let mut holds = vec![
        Holding {
            what: "weights",
            bytes: resident,
            share: weights,
        },
        Holding {
            what: "gathered",
            bytes: at("weights") - resident,
            share: gathered,
        },
        Holding {
            what: "grads",
            bytes: at("grads"),
            share: grads,
        },
        Holding {
            what: "optimizer",
            bytes: at("optimizer"),
            share: optimizer,
        },
    ];
    if terms.staging_buffer > 0 {
        holds.push(Holding {
            what: "communication",
            bytes: at("communication"),
            share: format!(
                "staging buffer: this rank's fp32 shard of the largest unit {:.2} GiB",
                terms.staging_buffer as f64 / (1u64 << 30) as f64
            ),
        });
    }
    holds
}

/// Add `t` to every sample of the step in `r` (the buffers live through the whole step;
/// they do not exist yet while the model is built, the `setup` phase).
pub fn apply(r: &mut MemoryReport, t: &ParallelTerms) {
    use super::Phase;
    let add = t.added();
    if add == 0 {
        return;
    }
    let shift = |b: u64| b + add;
    for s in &mut r.timeline {
        if s.phase != Phase::Setup {
            s.bytes = shift(s.bytes);
        }
    }
    let setup = Phase::Setup.as_str();
    for (phase, v) in r.phase_peaks.iter_mut() {
        if phase != setup {
            *v = shift(*v);
        }
    }
    if r.peak.phase != Phase::Setup {
        r.peak_bytes = shift(r.peak_bytes);
        *r.breakdown.entry("communication".to_string()).or_default() += add;
        return;
    }
    // The setup was the highest point; with the buffers the step may pass it.
    if let Some((bytes, at, breakdown)) = r.step_peak.take() {
        if bytes + add > r.peak_bytes {
            r.peak_bytes = bytes + add;
            r.peak = at;
            r.breakdown = breakdown;
            *r.breakdown.entry("communication".to_string()).or_default() += add;
        }
    }
}

/// The loss of a vocabulary-parallel head under PyTorch's DTensor tensor parallelism
/// (`loss_parallel`, `torch/distributed/tensor/parallel/loss.py`), as scratch beyond the fused
/// kernels eager PyTorch runs, for one rank's log-probabilities of `lsm_bytes` (its vocabulary
/// shard, fp32 after Hugging Face's upcast): `(log_softmax forward, nll_loss backward)`, or
/// `None` where the loss is not that one (one rank; Burn; Megatron-Core's fused
/// `vocab_parallel_cross_entropy` and DeepSpeed, which run their own).
///
/// - Forward, `_log_softmax`: `shifted = x - max` stays beside the input while `exp(shifted)`
///   and then `shifted - logsumexp` (the output) are made: one shard-sized tensor more than
///   the fused `log_softmax`, which writes only its output.
/// - Backward, `_nll_loss_and_log_softmax_backward` (run for `nll_loss_backward`; the
///   log-softmax backward handler then passes its gradient through): `grad_input =
///   zeros_like(x)`, `exp(x)`, their sum and its product with the loss gradient, three
///   shard-sized tensors at once (the sum and either `exp(x)` or the product beside
///   `grad_input`), where eager PyTorch's `nll_loss_backward` makes one before the fused
///   log-softmax backward.
///
/// Seen on an H100 (`tests/groundtruth/h100-multigpu.jsonl`, `tp_bf16_n2/4/8`): the forward
/// phase peaks 2.5 shards above its end and the backward 3 above it, exactly.
pub fn vocab_parallel_loss_scratch(
    profile: &Profile,
    cand: &Candidate,
    lsm_bytes: u64,
) -> Option<(u64, u64)> {
    use crate::profile::Engine;
    let dtensor = matches!(profile.engine, Engine::Eager | Engine::Fsdp2);
    (cand.tensor > 1 && dtensor && !profile.burn_ops).then_some((lsm_bytes, 2 * lsm_bytes))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The compact pools' pages, as `backend/src/pool`'s `compact_pools` sizes them.
    #[test]
    fn compact_pool_pages() {
        assert_eq!(compact_pool_page(1 << 10), 8 << 20);
        assert_eq!(compact_pool_page(1 << 20), 8 << 20);
        // The ZeRO-2 flat vector of the 125M decoder: sliced out of a 1 GiB page.
        assert_eq!(compact_pool_page(536_423_424), 1 << 30);
        assert_eq!(compact_pool_page(1 << 30), 1 << 30);
        // Just above a page: the first exclusive pool, 4 % larger.
        let first = ((1u64 << 30) as f64 * 1.04) as u64;
        assert_eq!(
            compact_pool_page((1 << 30) + 1),
            first.next_multiple_of(512)
        );
        // A page is never below its tensor, nor 4 % and a rounding above it.
        for gib in [2u64, 3, 5, 17] {
            let b = gib << 30;
            let p = compact_pool_page(b);
            assert!(
                p >= b && (p as f64) <= b as f64 * 1.04 + 512.0,
                "{gib} GiB: {p}"
            );
        }
    }

    fn spec() -> Spec {
        let src = "model \"tiny-decoder\"\nhardware { gpu = h100-80gb  gpus_per_node = 4 }\ntrain { seq_len = 128  global_batch = 64 }\n";
        let file = rcoa_grammar::parse("t.plan", src).unwrap();
        let ctx = crate::resolve::ResolveContext::new("t.plan", src, std::path::PathBuf::from("."));
        crate::resolve::resolve(&file, &ctx).unwrap()
    }

    fn cand(data: u64, zero: u8, pipeline: u64) -> Candidate {
        Candidate {
            micro_batch: 2,
            grad_accum: 4,
            data,
            zero,
            tensor: 1,
            pipeline,
            context: 1,
            sequence: false,
            checkpoint_layers: vec![],
            selective: false,
            offload: vec![],
        }
    }

    #[test]
    fn ranks_name_both_pipeline_ends_and_mark_the_reported_one() {
        let s = spec();
        let p = Profile::for_target(s.target);
        let c = cand(2, 1, 2);
        let ranks = ranks(&s, &c, &p);
        assert_eq!(ranks.len(), 2);
        let (first, last) = (&ranks[0], &ranks[1]);
        assert!(first.stage.embedding && !first.stage.head);
        assert!(!last.stage.embedding && last.stage.head);
        assert_eq!(first.stage.first_layer, 0);
        assert_eq!(last.stage.end_layer, s.model.layers);
        assert!(
            first.layers.contains("pipeline stage 1 of 2"),
            "{}",
            first.layers
        );
        assert!(
            last.layers.contains("pipeline stage 2 of 2"),
            "{}",
            last.layers
        );
        assert_eq!(ranks.iter().filter(|r| r.worst).count(), 1);
        let worst = ranks.iter().find(|r| r.worst).unwrap();
        assert_eq!(worst.peak_bytes, evaluate(&s, &c, &p, false).peak_bytes);
        assert!(ranks.iter().all(|r| r.peak_bytes <= worst.peak_bytes));
        let opt = &first.holds.iter().find(|h| h.what == "optimizer").unwrap();
        assert!(opt.share.starts_with("1/2 of"), "{}", opt.share);
        assert!(opt.share.contains("ZeRO-1 over data = 2"), "{}", opt.share);
    }

    /// DTensor's `loss_parallel` (tensor = 2, target pytorch): the log-softmax forward keeps
    /// one more fp32 vocabulary shard of log-probabilities beside its input, the fused
    /// backward of the loss two more; nothing on one rank, on Burn or on Megatron-Core.
    #[test]
    fn tensor_parallel_loss_scratch_is_one_and_two_vocabulary_shards() {
        let s = spec();
        let ops = |target: crate::spec::Target, tensor: u64| {
            let mut s = s.clone();
            s.target = target;
            let p = Profile::for_target(target);
            let c = Candidate {
                tensor,
                ..cand(1, 0, 1)
            };
            let tape = super::super::build::Builder::new(&s, &p, &c)
                .build(0..s.model.layers, true, true)
                .tape;
            let at = |name: &str| tape.ops.iter().rposition(|o| o.name == name);
            let lsm = at("log_softmax").map(|o| {
                let out = tape.ops[o].outputs[0];
                (
                    tape.ops[o].fwd_workspace,
                    tape.tensors[out.0 as usize].bytes,
                )
            });
            (lsm, at("nll_loss").map(|o| tape.ops[o].bwd_workspace))
        };
        use crate::spec::Target;
        let (Some((fwd, shard)), Some(bwd)) = ops(Target::Pytorch, 2) else {
            panic!("no loss ops");
        };
        // [tokens, vocab / 2] fp32 log-probabilities.
        let tokens = 2 * 128;
        assert_eq!(
            shard,
            Profile::pytorch().allocated(tokens * s.model.vocab / 2 * 4)
        );
        let (Some((fwd1, _)), Some(bwd1)) = ops(Target::Pytorch, 1) else {
            panic!("no loss ops");
        };
        assert_eq!((fwd - fwd1, bwd - bwd1), (shard, 2 * shard));
        let (Some((mfwd, _)), Some(mbwd)) = ops(Target::Megatron, 2) else {
            panic!("no loss ops");
        };
        assert_eq!((mfwd, mbwd), (fwd1, bwd1));
        assert_eq!(
            vocab_parallel_loss_scratch(
                &Profile::burn(),
                &Candidate {
                    tensor: 2,
                    ..cand(1, 0, 1)
                },
                1
            ),
            None
        );
    }

    #[test]
    fn one_gpu_has_one_rank_holding_everything() {
        let s = spec();
        let p = Profile::for_target(s.target);
        let c = cand(1, 0, 1);
        let ranks = ranks(&s, &c, &p);
        assert_eq!(ranks.len(), 1);
        assert!(ranks[0].worst && ranks[0].shards.is_empty());
        assert!(ranks[0]
            .holds
            .iter()
            .all(|h| h.share.starts_with("all the stage's")));
        assert_eq!(
            ranks[0].peak_bytes,
            crate::memory::evaluate(&s, &c, &p, false).peak_bytes
        );
    }
}
