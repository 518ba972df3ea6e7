//! The pipeline entry: a resolved [`Spec`] in, a [`Compilation`] out.
//!
//! Reads top to bottom: check that the model can express the plan, decide
//! every `auto` (for now simple defaults, each recorded as a decision; the
//! search passes replace them later), evaluate memory and time for the chosen
//! candidate, lower. Nothing here prints; the CLI renders the result.

use crate::cost::{self, TimeEstimate};
use crate::explain::{Decision, Explain};
use crate::graph::{GraphSummary, TrainGraph};
use crate::lowered::{LoweredPlan, Prediction, Resolved};
use crate::memory::{self, Candidate, MemoryReport};
use crate::profile::Profile;
use crate::spec::{Arch, CheckpointChoice, Choice, Dtype, Loss, Spec};
use miette::Diagnostic;
use thiserror::Error;

/// Everything `rcoa compile` produces.
#[derive(Clone, Debug)]
pub struct Compilation {
    pub lowered: LoweredPlan,
    pub explain: Explain,
    pub report: MemoryReport,
    pub time: TimeEstimate,
    pub candidate: Candidate,
    pub graph: GraphSummary,
    pub profile: Profile,
}

/// A plan the memory model cannot express. Never a silent guess.
#[derive(Debug, Error, Diagnostic, Clone, PartialEq)]
pub enum CompileError {
    #[error("{feature} is not modelled by rcoa's memory model")]
    #[diagnostic(code(rcoa::unsupported))]
    Unsupported {
        feature: String,
        #[help]
        help: String,
    },
    #[error("{what}")]
    #[diagnostic(code(rcoa::inconsistent_plan))]
    Inconsistent {
        what: String,
        #[help]
        help: String,
    },
}

fn unsupported(feature: impl Into<String>, help: impl Into<String>) -> CompileError {
    CompileError::Unsupported {
        feature: feature.into(),
        help: help.into(),
    }
}

/// Features a plan may name that the model does not cover yet.
fn check_supported(spec: &Spec) -> Result<(), CompileError> {
    let m = &spec.model;
    if m.experts > 1 {
        return Err(unsupported(
            format!("mixture of experts (`experts = {}`)", m.experts),
            "rcoa models dense layers only; set `experts = 1` or predict this model elsewhere",
        ));
    }
    if spec.parallel.expert.fixed().is_some_and(|e| e > 1) {
        return Err(unsupported(
            "expert parallelism",
            "set `parallel.expert = 1`: rcoa models dense layers only",
        ));
    }
    let p = &spec.precision;
    for (slot, d) in [
        ("params", p.params),
        ("compute", p.compute),
        ("grads", p.grads),
    ] {
        if d == Dtype::Fp8 {
            return Err(unsupported(
                format!("fp8 `precision.{slot}`"),
                "fp8 training (scaling factors, amax history) is not modelled; use bf16",
            ));
        }
        if matches!(d, Dtype::Int8 | Dtype::Nf4) {
            return Err(unsupported(
                format!("{} `precision.{slot}`", d.as_str()),
                "weights are quantized only as QLoRA's frozen base (`adapter qlora { base = nf4 }`)",
            ));
        }
    }
    if m.arch == Arch::Decoder && spec.train.loss == Loss::MaskedLm {
        return Err(unsupported(
            "a masked-LM loss on a decoder",
            "use `loss = causal_lm` (or `contrastive`) with `arch = decoder`",
        ));
    }
    Ok(())
}

/// The settings as given, with simple defaults for what is `auto`.
fn choose(
    spec: &Spec,
    profile: &Profile,
    log: &mut Vec<Decision>,
) -> Result<Candidate, CompileError> {
    let gpus = spec.gpu_count().max(1);
    let fixed_or = |c: Choice<u64>, d: u64| c.fixed().unwrap_or(d);
    let tensor = fixed_or(spec.parallel.tensor, 1);
    let pipeline = fixed_or(spec.parallel.pipeline, 1);
    let context = fixed_or(spec.parallel.context, 1);
    let model_parallel = tensor * pipeline * context;
    let data = match spec.parallel.data {
        Choice::Fixed(d) => d,
        Choice::Auto => {
            let d = (gpus / model_parallel.max(1)).max(1);
            log.push(Decision::new(
                "defaults",
                format!("data = {d}"),
                format!("the GPUs left after tensor × pipeline × context = {model_parallel} ({gpus} GPUs)"),
            ));
            d
        }
    };
    let zero = match spec.parallel.zero {
        Choice::Fixed(z) => z,
        Choice::Auto => {
            let z = if data > 1 { 1 } else { 0 };
            log.push(Decision::new(
                "defaults",
                format!("zero = {z}"),
                if data > 1 {
                    "shard the optimizer state over the data-parallel ranks (no extra traffic over all-reduce)".to_string()
                } else {
                    "one data-parallel rank: nothing to shard".to_string()
                },
            ));
            z
        }
    };
    for (name, c) in [
        ("tensor", spec.parallel.tensor),
        ("pipeline", spec.parallel.pipeline),
        ("context", spec.parallel.context),
    ] {
        if c.is_auto() {
            log.push(Decision::new(
                "defaults",
                format!("{name} = 1"),
                "no model parallelism unless asked (the search comes later)",
            ));
        }
    }
    let sequence = spec.parallel.sequence.fixed().unwrap_or(false);
    let layers = spec.model.layers;
    let checkpoint_for = |c: CheckpointChoice| -> Vec<u64> {
        match c {
            CheckpointChoice::Full => (0..layers).collect(),
            CheckpointChoice::Every(n) => (0..layers).filter(|i| i % n.max(1) == 0).collect(),
            _ => Vec::new(),
        }
    };
    let global = spec.train.global_batch;
    let per_rank = global / data.max(1);
    if !global.is_multiple_of(data.max(1)) {
        return Err(CompileError::Inconsistent {
            what: format!("global_batch = {global} is not divisible by data = {data}"),
            help: format!("use a global_batch that is a multiple of {data}"),
        });
    }
    let mut cand = Candidate {
        micro_batch: 1,
        grad_accum: 1,
        data,
        zero,
        tensor,
        pipeline,
        context,
        sequence,
        checkpoint_layers: checkpoint_for(spec.fit.checkpoint),
        offload: Vec::new(),
    };
    let budget = spec.fit.budget_bytes(spec.hardware.gpu.memory_bytes);
    let reserve = spec.fit.reserve.unwrap_or(profile.default_reserve_bytes);
    let fits =
        |c: &Candidate| memory::evaluate(spec, c, profile, false).peak_bytes + reserve <= budget;
    // Checkpointing: `auto` starts from none and falls back to full when that does not fit.
    let ckpt_auto = spec.fit.checkpoint == CheckpointChoice::Auto;
    let mb_fixed = spec.train.micro_batch.fixed();
    let probe_mb = mb_fixed.unwrap_or(1);
    if ckpt_auto || spec.fit.checkpoint == CheckpointChoice::Selective {
        let mut c = cand.clone();
        c.micro_batch = probe_mb;
        if spec.fit.checkpoint == CheckpointChoice::Selective {
            log.push(Decision::new(
                "defaults",
                "checkpoint = full (for selective)",
                "selective recomputation (attention internals only) is not modelled yet; full per-layer checkpointing is the conservative stand-in",
            ));
            cand.checkpoint_layers = checkpoint_for(CheckpointChoice::Full);
        } else if fits(&c) {
            log.push(Decision::new(
                "defaults",
                "checkpoint = none",
                format!("micro_batch = {probe_mb} fits without recomputation"),
            ));
        } else {
            cand.checkpoint_layers = checkpoint_for(CheckpointChoice::Full);
            log.push(Decision::new(
                "defaults",
                "checkpoint = full",
                format!("micro_batch = {probe_mb} does not fit without recomputation; every layer keeps only its input"),
            ));
        }
    }
    // Micro-batch: the largest divisor of the per-rank batch that fits (halving from it).
    cand.micro_batch = match mb_fixed {
        Some(mb) => mb,
        None => {
            let mut mb = per_rank.max(1);
            let mut tried = Vec::new();
            loop {
                let mut c = cand.clone();
                c.micro_batch = mb;
                if mb == 1 || (per_rank.is_multiple_of(mb) && fits(&c)) {
                    break;
                }
                if per_rank.is_multiple_of(mb) {
                    tried.push(mb);
                }
                mb = (mb / 2).max(1);
                while mb > 1 && !per_rank.is_multiple_of(mb) {
                    mb -= 1;
                }
            }
            let why = if tried.is_empty() {
                format!("the whole per-rank batch ({per_rank} sequences) fits in one forward")
            } else {
                format!(
                    "the largest divisor of the per-rank batch ({per_rank}) that fits; {} did not fit",
                    tried.iter().map(|t| t.to_string()).collect::<Vec<_>>().join(", ")
                )
            };
            log.push(Decision::new(
                "defaults",
                format!("micro_batch = {mb}"),
                why,
            ));
            mb
        }
    };
    cand.grad_accum = match spec.train.grad_accum {
        Choice::Fixed(g) => g,
        Choice::Auto => {
            let g = (per_rank / cand.micro_batch.max(1)).max(1);
            log.push(Decision::new(
                "defaults",
                format!("grad_accum = {g}"),
                format!(
                    "global_batch {global} = micro_batch {} × grad_accum {g} × data {data}",
                    cand.micro_batch
                ),
            ));
            g
        }
    };
    if !spec.fit.offload.is_empty() {
        log.push(Decision::new(
            "defaults",
            "offload = []",
            format!(
                "{} allowed, nothing moved: offload placement is chosen by the fit search (not built yet)",
                spec.fit.offload.iter().map(|o| o.to_string()).collect::<Vec<_>>().join(", ")
            ),
        ));
    }
    Ok(cand)
}

fn checkpoint_string(spec: &Spec, layers: &[u64]) -> String {
    let n = spec.model.layers;
    if layers.is_empty() {
        return "none".into();
    }
    if layers.len() as u64 == n {
        return "full".into();
    }
    if let CheckpointChoice::Every(k) = spec.fit.checkpoint {
        return format!("every {k}");
    }
    format!("{} of {n} layers", layers.len())
}

/// Compile a resolved plan: decide the `auto`s, predict memory and time, lower.
pub fn compile(spec: &Spec) -> Result<Compilation, CompileError> {
    check_supported(spec)?;
    let profile = Profile::for_target(spec.target);
    let mut decisions = Vec::new();
    crate::explain::record_given(spec, &profile, &mut decisions);
    let cand = choose(spec, &profile, &mut decisions)?;
    let report = memory::evaluate(spec, &cand, &profile, true);
    let time = cost::estimate(spec, &cand, &profile, &report);
    let graph = TrainGraph::build(spec, &cand, &profile).summary();
    let budget = spec.fit.budget_bytes(spec.hardware.gpu.memory_bytes);
    let fits = report.peak_bytes + report.reserve_bytes <= budget;
    let mut breakdown = report.breakdown.clone();
    breakdown.insert("reserved".to_string(), report.reserve_bytes);
    let resolved = Resolved {
        micro_batch: cand.micro_batch,
        grad_accum: cand.grad_accum,
        data: cand.data,
        zero: cand.zero,
        tensor: cand.tensor,
        pipeline: cand.pipeline,
        context: cand.context,
        expert: 1,
        sequence: cand.sequence,
        checkpoint: checkpoint_string(spec, &cand.checkpoint_layers),
        checkpoint_layers: cand.checkpoint_layers.clone(),
        offload: cand.offload.clone(),
    };
    let prediction = Prediction {
        peak_bytes: report.peak_bytes,
        budget_bytes: budget,
        fits,
        breakdown,
        peak_at: report.peak.to_string(),
        step_seconds: time.step_seconds,
        tokens_per_second: time.tokens_per_second,
    };
    let lowered = LoweredPlan::from_parts(spec, resolved, prediction);
    Ok(Compilation {
        lowered,
        explain: Explain { decisions },
        report,
        time,
        candidate: cand,
        graph,
        profile,
    })
}
