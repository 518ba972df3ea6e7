//! What to say when nothing fits: the smallest plan the search found, its
//! peak against the budget, and what would make it fit.
//!
//! Detecting and wording are separate: [`diagnose`] re-runs the pass
//! pipeline on relaxed copies of the plan (offload allowed, checkpointing
//! left to the compiler, `auto` micro-batch and parallel degrees, more
//! nodes) and records which relaxations fit; [`DoesNotFit`] is the
//! diagnostic (`rcoa::does_not_fit`) the CLI renders. Every suggestion is
//! backed by a search of the relaxed plan, never by a rule of thumb.

use super::Outcome;
use crate::passes;
use crate::profile::Profile;
use crate::spec::{CheckpointChoice, Choice, Offload, OffloadTo, OffloadWhat, Spec};
use miette::Diagnostic;
use thiserror::Error;

/// The plan cannot be made to fit within what it allows.
#[derive(Debug, Error, Diagnostic, Clone, PartialEq)]
#[error(
    "the plan does not fit: the smallest plan found needs {need} per GPU, the budget is {budget}"
)]
#[diagnostic(code(rcoa::does_not_fit))]
pub struct DoesNotFit {
    /// Peak plus reserve of the smallest candidate, e.g. `44.10 GiB`.
    pub need: String,
    pub budget: String,
    /// The smallest candidate's settings.
    pub smallest: String,
    /// One line per relaxation tried: what it changes and what the search then finds.
    pub suggestions: Vec<String>,
    #[help]
    pub help: String,
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Fits or not, and the peak, of `spec` after the whole pipeline (decisions discarded).
fn try_fit(spec: &Spec, profile: &Profile) -> Option<(bool, u64)> {
    let plan = passes::run(spec, profile, &mut Vec::new()).ok()?;
    let o = plan.outcome?;
    Some((o.fits, o.eval.need_bytes()))
}

/// The diagnostic for a plan whose search found nothing that fits.
pub fn diagnose(spec: &Spec, profile: &Profile, outcome: &Outcome) -> DoesNotFit {
    let p = &outcome.point;
    let e = &outcome.eval;
    let layers = spec.model.layers;
    let smallest = format!(
        "{}, zero {}, micro_batch {} × grad_accum {}, checkpoint {}, offload [{}]",
        p.layout,
        p.zero,
        p.micro_batch,
        p.grad_accum,
        p.checkpoint_string(layers),
        p.offload
            .iter()
            .map(|o| o.to_string())
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut relaxations: Vec<(String, Spec)> = Vec::new();
    // Megatron-Core runs no parameter offload (`profile::engines::offload_refusal`); FSDP2
    // offloads parameters, gradients and the optimizer step together (CPUOffloadPolicy).
    let fsdp = spec.target == crate::spec::Target::Fsdp;
    let can_offload = (spec.target.is_pytorch_engine() || spec.gpu_count() > 1)
        && spec.target != crate::spec::Target::Megatron;
    let wanted: &[OffloadWhat] = if fsdp {
        &crate::profile::engines::FSDP_CPU_OFFLOAD
    } else {
        &[OffloadWhat::Optimizer, OffloadWhat::Params]
    };
    if can_offload
        && !wanted
            .iter()
            .all(|w| spec.fit.offload.iter().any(|o| o.what == *w))
    {
        let mut s = spec.clone();
        for &w in wanted {
            if !s.fit.offload.iter().any(|o| o.what == w) {
                s.fit.offload.push(Offload {
                    what: w,
                    to: OffloadTo::Cpu,
                });
            }
        }
        s.fit.offload.sort();
        if s.parallel.zero.fixed().is_some_and(|z| z < 3) {
            s.parallel.zero = Choice::Auto;
        }
        let label = if fsdp {
            "`offload = [optimizer, params, grads]` (FSDP2's CPUOffloadPolicy, with `zero = auto`)"
        } else {
            "`offload = [optimizer, params]` (with `zero = auto`)"
        };
        relaxations.push((label.into(), s));
    }
    if matches!(
        spec.fit.checkpoint,
        CheckpointChoice::None
            | CheckpointChoice::Every(_)
            | CheckpointChoice::Selective
            | CheckpointChoice::SelectiveOp
    ) {
        let mut s = spec.clone();
        s.fit.checkpoint = CheckpointChoice::Auto;
        relaxations.push(("`checkpoint = auto`".into(), s));
    }
    let mut notes = Vec::new();
    match spec.train.micro_batch {
        Choice::Fixed(1) => notes.push("micro_batch = 1 is already the smallest".to_string()),
        Choice::Fixed(_) => {
            let mut s = spec.clone();
            s.train.micro_batch = Choice::Auto;
            s.train.grad_accum = Choice::Auto;
            relaxations.push(("`micro_batch = auto` and `grad_accum = auto`".into(), s));
        }
        Choice::Auto if p.micro_batch == 1 => {
            notes.push("a smaller micro_batch is impossible (the smallest plan uses 1)".to_string())
        }
        Choice::Auto => {}
    }
    let par = &spec.parallel;
    if spec.gpu_count() > 1
        && [
            par.zero.is_auto(),
            par.tensor.is_auto(),
            par.pipeline.is_auto(),
            par.data.is_auto(),
        ]
        .iter()
        .any(|a| !a)
    {
        let mut s = spec.clone();
        s.parallel.zero = Choice::Auto;
        s.parallel.tensor = Choice::Auto;
        s.parallel.pipeline = Choice::Auto;
        s.parallel.data = Choice::Auto;
        relaxations.push(("`zero`, `data`, `tensor` and `pipeline` = auto".into(), s));
    }
    let mut suggestions = Vec::new();
    for (what, s) in &relaxations {
        match try_fit(s, profile) {
            Some((true, need)) => suggestions.push(format!(
                "with {what} it fits: {} ≤ {}",
                gib(need),
                gib(e.budget_bytes)
            )),
            Some((false, need)) => suggestions.push(format!(
                "with {what} the smallest plan still needs {}",
                gib(need)
            )),
            None => {}
        }
    }
    // More GPUs: double the nodes (up to 16×), sharding and batch split left to the compiler.
    for factor in [2u64, 4, 8, 16] {
        let mut s = spec.clone();
        s.hardware.nodes *= factor;
        let gpus = s.gpu_count();
        s.train.global_batch = s.train.global_batch.div_ceil(gpus) * gpus;
        s.parallel.zero = Choice::Auto;
        s.parallel.data = Choice::Auto;
        s.train.micro_batch = Choice::Auto;
        s.train.grad_accum = Choice::Auto;
        if let Some((true, need)) = try_fit(&s, profile) {
            suggestions.push(format!(
                "with {} nodes ({gpus} GPUs, global_batch {}, zero = auto) it fits: {} ≤ {}",
                s.hardware.nodes,
                s.train.global_batch,
                gib(need),
                gib(e.budget_bytes)
            ));
            break;
        }
    }
    suggestions.extend(notes);
    let help = if suggestions.is_empty() {
        format!(
            "smallest plan: {smallest}; raise `fit.budget` or use GPUs with more than {} of memory",
            gib(spec.hardware.gpu.memory_bytes)
        )
    } else {
        format!("smallest plan: {smallest}\n{}", suggestions.join("\n"))
    };
    DoesNotFit {
        need: gib(e.need_bytes()),
        budget: gib(e.budget_bytes),
        smallest,
        suggestions,
        help,
    }
}
