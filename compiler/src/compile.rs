//! The pipeline entry: a resolved [`Spec`] in, a [`Compilation`] out.
//!
//! Reads top to bottom: check that the model can express the plan, decide
//! every `auto` with the pass pipeline and its fit search, evaluate memory
//! and time for the chosen candidate with its full timeline, lower. Nothing
//! here prints; the CLI renders the result.

use crate::cost::{self, TimeEstimate};
use crate::explain::Explain;
use crate::graph::{GraphSummary, TrainGraph};
use crate::lowered::{LoweredPlan, Prediction, Resolved};
use crate::memory::{self, Candidate, MemoryReport};
use crate::profile::Profile;
use crate::spec::{Arch, Dtype, Loss, Spec};
use miette::Diagnostic;
use thiserror::Error;

/// Everything `rcoa compile` produces.
#[derive(Clone, Debug)]
pub struct Compilation {
    pub lowered: LoweredPlan,
    pub explain: Explain,
    pub report: MemoryReport,
    pub time: TimeEstimate,
    /// The step time's terms and the worst rank's traffic, row by row (what `time` sums).
    pub step: cost::parallel::StepTime,
    /// The ranks the memory model distinguishes (first and last pipeline stage), worst marked.
    pub ranks: Vec<memory::parallel::RankMemory>,
    pub candidate: Candidate,
    pub graph: GraphSummary,
    pub profile: Profile,
    /// When nothing fits: the smallest plan, its peak against the budget and what would fit.
    pub does_not_fit: Option<crate::search::diagnose::DoesNotFit>,
    /// How much of the space the fit search walked.
    pub search: crate::search::SearchStats,
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
    #[diagnostic(code(rcoa::too_large))]
    TooLarge {
        what: String,
        #[help]
        help: String,
    },
    /// A setup the plan's engine does not run (`crate::executed`).
    #[error("{what}")]
    #[diagnostic(code(rcoa::not_executed))]
    NotExecuted {
        what: String,
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

/// Reject plans whose tensors are too large to hold anywhere even at micro-batch 1,
/// before the memory model's integer arithmetic sees them (see [`crate::scale`]).
fn check_scale(spec: &Spec) -> Result<(), CompileError> {
    let micro = spec.train.micro_batch.fixed().unwrap_or(1);
    match crate::scale::too_large(spec, micro) {
        None => Ok(()),
        Some((what, elements)) => Err(CompileError::TooLarge {
            what: format!("{what} would hold {elements} elements, more than any GPU can hold"),
            help: "rcoa models tensors of up to 2^40 elements; reduce micro_batch, seq_len or \
                   the model's widths"
                .to_string(),
        }),
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
                "fp8 compute as Transformer Engine runs it keeps an fp8 copy (and transpose) of \
                 every weight beside the bf16 one, per-tensor scales with an amax history, and \
                 saves some activations in fp8; none of it has been measured here, so rcoa \
                 refuses rather than guess. Plan with `compute = bf16`, and add the fp8 weight \
                 copies (about 2 bytes per parameter) to your margin",
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

/// Compile a resolved plan: decide the `auto`s, predict memory and time, lower.
pub fn compile(spec: &Spec) -> Result<Compilation, CompileError> {
    check_supported(spec)?;
    crate::executed::check(spec)?;
    check_scale(spec)?;
    crate::profile::engines::check_precision(spec)?;
    crate::profile::engines::check_schedule(spec)?;
    let profile = Profile::for_target(spec.target);
    let mut decisions = Vec::new();
    crate::explain::record_given(spec, &profile, &mut decisions);
    // The passes narrow every setting's domain and the fit pass searches them.
    let plan = crate::passes::run(spec, &profile, &mut decisions)?;
    let outcome = plan.outcome.ok_or_else(|| CompileError::Inconsistent {
        what: "the fit search returned no candidate".into(),
        help: "this is a bug in rcoa's pass pipeline".into(),
    })?;
    let point = outcome.point.clone();
    let cand = point.candidate(spec.model.layers);
    // The chosen candidate again, with the timeline (the search walks without one).
    let report = memory::parallel::evaluate(spec, &cand, &profile, true);
    let step = cost::parallel::estimate(spec, &cand, &profile, &report);
    let time = step.to_estimate();
    let ranks = memory::parallel::ranks(spec, &cand, &profile);
    let graph = TrainGraph::build(spec, &cand, &profile).summary();
    let budget = spec.fit.budget_bytes(spec.hardware.gpu.memory_bytes);
    let fits = outcome.fits && report.peak_bytes + report.reserve_bytes <= budget;
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
        checkpoint: point.checkpoint_string(spec.model.layers),
        checkpoint_layers: cand.checkpoint_layers.clone(),
        offload: cand.offload.clone(),
        virtual_stages: if cand.pipeline > 1 {
            spec.parallel.virtual_stages.max(1)
        } else {
            1
        },
        optimizer_in_backward: spec.optimizer_in_backward,
    };
    let prediction = Prediction {
        peak_bytes: report.peak_bytes,
        budget_bytes: budget,
        fits,
        breakdown,
        peak_at: report.peak.to_string(),
        step_seconds: time.step_seconds,
        tokens_per_second: time.tokens_per_second,
        in_use_max_bytes: report.in_use_max_bytes,
    };
    let lowered = LoweredPlan::from_parts(spec, resolved, prediction);
    let does_not_fit = (!fits).then(|| crate::search::diagnose::diagnose(spec, &profile, &outcome));
    Ok(Compilation {
        lowered,
        explain: Explain {
            decisions,
            rejected: outcome.rejected.clone(),
        },
        report,
        time,
        step,
        ranks,
        candidate: cand,
        graph,
        profile,
        does_not_fit,
        search: plan.stats,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::Choice;

    fn tiny() -> Spec {
        let src = "model \"tiny-decoder\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 32  global_batch = 8 }\n";
        let file = rcoa_grammar::parse("t.plan", src).unwrap();
        let ctx = crate::resolve::ResolveContext::new("t.plan", src, std::path::PathBuf::from("."));
        crate::resolve::resolve(&file, &ctx).unwrap()
    }

    #[test]
    fn tensors_beyond_any_gpu_are_refused_before_the_memory_model() {
        let mut spec = tiny();
        assert!(compile(&spec).is_ok());
        spec.model.layers = 65_536;
        spec.model.hidden = 1 << 20;
        spec.model.heads = 1 << 10;
        spec.model.kv_heads = 1 << 10;
        spec.model.head_dim = 1 << 10;
        spec.train.seq_len = 1 << 24;
        spec.train.global_batch = 1 << 22;
        spec.train.micro_batch = Choice::Auto;
        let err = compile(&spec).unwrap_err();
        assert!(matches!(err, CompileError::TooLarge { .. }), "{err:?}");
    }

    /// The lowered plan carries the highest bytes in use beside the sampled peak, so a run
    /// can hold its reserved bytes to what the pool covers: under `target burn` the loss's
    /// fp32 log-softmax lives inside the loss segment, above the peak the run samples.
    #[test]
    fn the_prediction_carries_the_highest_bytes_in_use() {
        let mut spec = tiny();
        let torch = compile(&spec).unwrap().lowered.prediction;
        assert!(torch.in_use_max_bytes >= torch.peak_bytes, "{torch:?}");
        spec.target = crate::spec::Target::Burn;
        let burn = compile(&spec).unwrap().lowered.prediction;
        assert!(burn.in_use_max_bytes > burn.peak_bytes, "{burn:?}");
        // A plan lowered before the field existed still reads, as 0.
        let mut json = serde_json::to_value(&burn).unwrap();
        json.as_object_mut().unwrap().remove("in_use_max_bytes");
        let old: Prediction = serde_json::from_value(json).unwrap();
        assert_eq!(old.in_use_max_bytes, 0);
    }
}
