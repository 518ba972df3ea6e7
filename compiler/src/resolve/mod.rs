//! From the syntax tree to a typed [`Spec`]: names to catalog entries, units
//! to bytes and counts, every default of `DSL.md` applied, every constraint
//! checked.
//!
//! Flow: [`resolve_with_spans`] sorts the file's sections (unknown and
//! duplicated ones are reported), resolves each section on its own (one
//! module per section), then checks the constraints that span sections
//! ([`constraints`]). Problems are collected, never thrown: every section is
//! read even after an error, and the result is all problems sorted by
//! location. Cross-section checks only look at sections that resolved
//! cleanly, so one typo does not cascade into follow-on errors.
//!
//! Detection and wording are apart: checks build [`problem::Problem`]
//! values; [`wording`] holds every sentence a user reads.
//!
//! Invariant: no input makes the resolver panic (a proptest in
//! `tests/resolve_props.rs` feeds it mutated plans).
//!
//! Error codes (stable; the golden files in `tests/diagnostics` use them):
//! - structure: `rcoa::unknown_section`, `rcoa::duplicate_section`,
//!   `rcoa::missing_section`, `rcoa::missing_argument`,
//!   `rcoa::unexpected_argument`, `rcoa::missing_block`,
//!   `rcoa::unexpected_block`, `rcoa::unknown_key`, `rcoa::duplicate_key`,
//!   `rcoa::missing_key`;
//! - names: `rcoa::unknown_model`, `rcoa::unknown_gpu`, `rcoa::unknown_dtype`,
//!   `rcoa::unknown_optimizer`, `rcoa::unknown_adapter`,
//!   `rcoa::unknown_target`, `rcoa::unknown_value`;
//! - values: `rcoa::wrong_kind` (a string where a number goes, `auto` where
//!   it is not allowed, ...), `rcoa::wrong_unit` (a unit of the wrong family
//!   for the slot), `rcoa::out_of_range`;
//! - constraints: `rcoa::not_divisible`, `rcoa::batch_mismatch`,
//!   `rcoa::parallel_mismatch`, `rcoa::conflict` (two settings that exclude
//!   each other), `rcoa::not_applicable` (a key meaningless here);
//! - `rcoa::hf_config` for `model hf "..."`; `rcoa::invalid_plan` heads a
//!   report of several problems.

mod adapter;
mod constraints;
mod error;
mod fit;
mod hardware;
mod hf;
mod model;
mod optimizer;
mod parallel;
mod precision;
mod problem;
mod spans;
mod suggest;
mod train;
mod values;
mod wording;

pub use error::{ResolveError, ResolveErrors};
pub use spans::SpanTable;

use crate::spec::{Spec, Target};
use problem::{NameKind, Problem};
use rcoa_grammar::{PlanFile, Section};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use values::Cx;

/// Every section a plan may have, in reference order.
pub const SECTIONS: &[&str] = &[
    "model",
    "adapter",
    "hardware",
    "precision",
    "optimizer",
    "train",
    "parallel",
    "fit",
    "target",
];

/// What the resolver needs besides the tree.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ResolveContext {
    /// The file's name, as diagnostics show it.
    pub name: String,
    /// The file's text (the tree's spans index into it).
    pub source: String,
    /// Where `model hf "config.json"` paths are relative to: the plan's folder.
    pub base_dir: PathBuf,
}

impl ResolveContext {
    pub fn new(
        name: impl Into<String>,
        source: impl Into<String>,
        base_dir: impl Into<PathBuf>,
    ) -> Self {
        ResolveContext {
            name: name.into(),
            source: source.into(),
            base_dir: base_dir.into(),
        }
    }
}

/// The nearest of `candidates` to a misspelt `name`, if one is a likely typo
/// (the resolver's "did you mean"), for commands that take names outside a plan.
pub fn did_you_mean<'c>(
    name: &str,
    candidates: impl IntoIterator<Item = &'c str>,
) -> Option<String> {
    suggest::nearest(name, candidates)
}

/// Resolves a parsed plan, or returns every problem found in it.
pub fn resolve(file: &PlanFile, ctx: &ResolveContext) -> Result<Spec, ResolveErrors> {
    resolve_with_spans(file, ctx).map(|(spec, _)| spec)
}

/// [`resolve`], also returning where each value was written (for later diagnostics).
pub fn resolve_with_spans(
    file: &PlanFile,
    ctx: &ResolveContext,
) -> Result<(Spec, SpanTable), ResolveErrors> {
    let mut cx = Cx::new(ctx);
    let (sections, misspelt) = collect_sections(&mut cx, file);
    let get = |name: &str| sections.get(name).copied();

    // Order matters only for defaults that depend on another section: the
    // train loss defaults by the model's arch, the LoRA base dtype is the
    // params dtype.
    let model = match get("model") {
        Some(s) => model::resolve(&mut cx, s),
        None => missing(&mut cx, &misspelt, "model"),
    };
    let hardware = match get("hardware") {
        Some(s) => hardware::resolve(&mut cx, s),
        None => missing(&mut cx, &misspelt, "hardware"),
    };
    let precision = match get("precision") {
        Some(s) => precision::resolve(&mut cx, s),
        None => Some(precision::default()),
    };
    let (optimizer, in_backward) = match get("optimizer") {
        Some(s) => match optimizer::resolve(&mut cx, s) {
            Some((o, b)) => (Some(o), b),
            None => (None, false),
        },
        None => (Some(optimizer::default()), false),
    };
    let train = match get("train") {
        Some(s) => train::resolve(&mut cx, s, model.as_ref().map(|m| m.arch)),
        None => missing(&mut cx, &misspelt, "train"),
    };
    // An explicit model block without `max_positions` (0 from `model::resolve`)
    // has as many positions as the plan trains on.
    let model = model.map(|mut m| {
        if m.max_positions == 0 {
            if let Some(t) = &train {
                m.max_positions = t.seq_len;
                cx.defaults.push((
                    format!("model.max_positions = {}", t.seq_len),
                    "train.seq_len, the longest sequence the plan trains on".into(),
                ));
            }
        }
        m
    });
    let parallel = match get("parallel") {
        Some(s) => parallel::resolve(&mut cx, s),
        None => Some(parallel::default()),
    };
    let fit = match get("fit") {
        Some(s) => fit::resolve(&mut cx, s),
        None => Some(fit::default()),
    };
    let adapter = match get("adapter") {
        Some(s) => adapter::resolve(&mut cx, s, precision.as_ref().map(|p| p.params)).map(Some),
        None => Some(None),
    };
    let target = match get("target") {
        Some(s) => resolve_target(&mut cx, s),
        None => Some(Target::Burn),
    };
    let optimizer = match (optimizer, target) {
        (Some(o), Some(t)) => Some(crate::profile::engines::default_optimizer_impl(
            o,
            t,
            cx.spans.get("optimizer.impl").is_some(),
            &mut cx.defaults,
        )),
        (o, _) => o,
    };

    constraints::check(
        &mut cx,
        constraints::Parts {
            model: model.as_ref(),
            adapter: adapter.as_ref(),
            hardware: hardware.as_ref(),
            train: train.as_ref(),
            parallel: parallel.as_ref(),
            fit: fit.as_ref(),
        },
    );
    if in_backward {
        constraints::in_backward(&mut cx, train.as_ref());
    }

    if cx.problems.is_empty() {
        if let (
            Some(model),
            Some(adapter),
            Some(hardware),
            Some(precision),
            Some(optimizer),
            Some(train),
            Some(parallel),
            Some(fit),
            Some(target),
        ) = (
            model, adapter, hardware, precision, optimizer, train, parallel, fit, target,
        ) {
            let spec = Spec {
                model,
                adapter,
                hardware,
                precision,
                optimizer,
                train,
                parallel,
                fit,
                target,
                optimizer_in_backward: in_backward,
                defaults: std::mem::take(&mut cx.defaults),
                deepspeed_zero: None,
            };
            return Ok((spec, cx.spans));
        }
    }
    let mut problems = std::mem::take(&mut cx.problems);
    // Stable: problems at the same place keep the order they were found in.
    problems.sort_by_key(|p| p.position());
    let errors: Vec<ResolveError> = problems.into_iter().map(wording::word).collect();
    Err(ResolveErrors::new(
        &ctx.name,
        &ctx.source,
        errors_or_internal(errors),
    ))
}

/// A section resolver returns `None` only after reporting; should that ever
/// not hold, say so rather than succeed with a half-built plan.
fn errors_or_internal(errors: Vec<ResolveError>) -> Vec<ResolveError> {
    if errors.is_empty() {
        vec![ResolveError {
            code: "rcoa::internal",
            message: "the plan could not be resolved, but no problem was recorded (a bug in rcoa)"
                .into(),
            labels: vec![],
            help: Some("please report this plan".into()),
        }]
    } else {
        errors
    }
}

/// Reports a required section as missing, unless an unknown section looks
/// like a misspelling of it: that was reported already ("did you mean
/// `model`?"), and saying it is missing as well adds nothing.
fn missing<T>(cx: &mut Cx, misspelt: &BTreeSet<String>, name: &'static str) -> Option<T> {
    if !misspelt.contains(name) {
        cx.report(Problem::MissingSection { name });
    }
    None
}

/// The known sections by name (unknown and repeated ones are reported), and
/// the sections the unknown ones look like misspellings of.
fn collect_sections<'f>(
    cx: &mut Cx,
    file: &'f PlanFile,
) -> (BTreeMap<&'static str, &'f Section>, BTreeSet<String>) {
    let mut found: BTreeMap<&'static str, &'f Section> = BTreeMap::new();
    let mut misspelt = BTreeSet::new();
    for s in &file.sections {
        let Some(name) = SECTIONS.iter().copied().find(|n| *n == s.name.name) else {
            misspelt.extend(suggest::nearest(&s.name.name, SECTIONS.iter().copied()));
            cx.report(Problem::UnknownSection {
                name: s.name.name.clone(),
                span: s.name.span,
            });
            continue;
        };
        if let Some(first) = found.get(name) {
            cx.report(Problem::DuplicateSection {
                name: name.to_string(),
                first: first.name.span,
                again: s.name.span,
            });
            continue;
        }
        cx.spans.insert(name, s.name.span);
        found.insert(name, s);
    }
    (found, misspelt)
}

/// `target burn` | `target pytorch`.
fn resolve_target(cx: &mut Cx, s: &Section) -> Option<Target> {
    let mark = cx.mark();
    if let Some(b) = &s.body {
        cx.report(Problem::UnexpectedBlock {
            section: "target",
            span: b.span,
        });
    }
    let target = match s.args.as_slice() {
        [] => {
            cx.report(Problem::MissingArgument {
                section: "target",
                span: s.name.span,
            });
            None
        }
        [v, rest @ ..] => {
            for extra in rest {
                cx.report(Problem::UnexpectedArgument {
                    section: "target",
                    span: extra.span,
                });
            }
            cx.spans.insert("target.args", v.span);
            values::pick(
                cx,
                v,
                "target",
                NameKind::Target,
                &Target::ALL.map(|t| (t.as_str(), t)),
            )
        }
    };
    if cx.clean_since(mark) {
        target
    } else {
        None
    }
}

#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_setups;
