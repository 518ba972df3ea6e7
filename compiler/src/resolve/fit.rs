//! The `fit` section: what the compiler may change to make the plan fit.
//!
//! Defaults (`DSL.md`): `budget = 100%`, `checkpoint = auto`, `offload =
//! []`, `objective = throughput`, `reserve` decided by the runtime model.
//! `checkpoint = every 1` is `full` (every layer recomputed): one spelling
//! per meaning downstream. Offload items are `what` (to the CPU) or
//! `what:cpu` / `what:nvme`; the list is stored sorted, without repeats.
//! Budget against GPU memory, and offload targets against the node's
//! storage, are checked in [`super::constraints`].

use super::problem::{Expected, NameKind, Problem};
use super::values::{self, Cx, Fields};
use crate::spec::{Budget, CheckpointChoice, FitSpec, Objective, Offload, OffloadTo, OffloadWhat};
use rcoa_grammar::{Section, Value, ValueKind};

pub(crate) const KEYS: &[&str] = &[
    "budget",
    "reserve",
    "checkpoint",
    "offload",
    "must_offload",
    "objective",
];

const CHECKPOINTS: &[(&str, CheckpointChoice)] = &[
    ("none", CheckpointChoice::None),
    ("full", CheckpointChoice::Full),
    ("selective", CheckpointChoice::Selective),
    ("selective_op", CheckpointChoice::SelectiveOp),
    ("auto", CheckpointChoice::Auto),
];
const OBJECTIVES: &[(&str, Objective)] = &[
    ("throughput", Objective::Throughput),
    ("memory", Objective::Memory),
];
const WHATS: &[(&str, OffloadWhat)] = &[
    ("optimizer", OffloadWhat::Optimizer),
    ("params", OffloadWhat::Params),
    ("grads", OffloadWhat::Grads),
    ("activations", OffloadWhat::Activations),
];
const PLACES: &[(&str, OffloadTo)] = &[("cpu", OffloadTo::Cpu), ("nvme", OffloadTo::Nvme)];

/// Without a `fit` section.
pub(super) fn default() -> FitSpec {
    FitSpec {
        budget: Budget::Fraction(1.0),
        reserve: None,
        checkpoint: CheckpointChoice::Auto,
        offload: Vec::new(),
        must_offload: Vec::new(),
        objective: Objective::Throughput,
    }
}

pub(super) fn resolve(cx: &mut Cx, s: &Section) -> Option<FitSpec> {
    let mark = cx.mark();
    for a in &s.args {
        cx.report(Problem::UnexpectedArgument {
            section: "fit",
            span: a.span,
        });
    }
    if s.body.is_none() {
        cx.report(Problem::MissingBlock {
            section: "fit",
            span: s.name.span,
        });
        return None;
    }
    let f = Fields::read(cx, "fit", "fit", s.name.span, s.body.as_ref(), KEYS);
    let d = default();
    let budget = f
        .get("budget")
        .map_or(Some(d.budget), |v| values::budget(cx, v, "budget"));
    let reserve = f.get("reserve").map(|v| values::size(cx, v, "reserve", 0));
    let checkpoint = f
        .get("checkpoint")
        .map_or(Some(d.checkpoint), |v| checkpoint(cx, v));
    let may = f
        .get("offload")
        .map_or(Some(Vec::new()), |v| offload(cx, v, "offload"));
    let must = f
        .get("must_offload")
        .map_or(Some(Vec::new()), |v| offload(cx, v, "must_offload"));
    let objective = f.get("objective").map_or(Some(d.objective), |v| {
        values::pick(cx, v, "objective", NameKind::Value, OBJECTIVES)
    });
    if !cx.clean_since(mark) {
        return None;
    }
    Some(FitSpec {
        budget: budget?,
        reserve: match reserve {
            Some(r) => Some(r?),
            None => None,
        },
        checkpoint: checkpoint?,
        offload: may?,
        must_offload: must?,
        objective: objective?,
    })
}

fn checkpoint(cx: &mut Cx, v: &Value) -> Option<CheckpointChoice> {
    match &v.kind {
        ValueKind::Every(n) => values::integer(cx, n, "checkpoint", 1).map(|n| match n {
            1 => CheckpointChoice::Full,
            n => CheckpointChoice::Every(n),
        }),
        // `auto` is a keyword of the grammar, not an identifier.
        ValueKind::Auto => Some(CheckpointChoice::Auto),
        ValueKind::Ident(_) | ValueKind::Str(_) => {
            values::pick(cx, v, "checkpoint", NameKind::Value, CHECKPOINTS)
        }
        other => {
            cx.report(Problem::WrongKind {
                slot: "checkpoint",
                expected: Expected::Checkpoint,
                found: super::wording::found(other),
                span: v.span,
            });
            None
        }
    }
}

/// An offload list (`offload`, `must_offload`: `slot`).
fn offload(cx: &mut Cx, v: &Value, slot: &'static str) -> Option<Vec<Offload>> {
    // A single item without brackets is unambiguous; accept it.
    let items: &[Value] = match &v.kind {
        ValueKind::List(items) => items,
        ValueKind::Ident(_) | ValueKind::Placed { .. } => std::slice::from_ref(v),
        other => {
            cx.report(Problem::WrongKind {
                slot,
                expected: Expected::OffloadList,
                found: super::wording::found(other),
                span: v.span,
            });
            return None;
        }
    };
    let mut out = Vec::new();
    let mut ok = true;
    for item in items {
        let one = match &item.kind {
            ValueKind::Ident(_) => {
                values::pick(cx, item, slot, NameKind::Value, WHATS).map(|what| Offload {
                    what,
                    to: OffloadTo::Cpu,
                })
            }
            ValueKind::Placed { what, place } => {
                let w = Value {
                    kind: ValueKind::Ident(what.name.clone()),
                    span: what.span,
                };
                let p = Value {
                    kind: ValueKind::Ident(place.name.clone()),
                    span: place.span,
                };
                let what = values::pick(cx, &w, slot, NameKind::Value, WHATS);
                let to = values::pick(cx, &p, slot, NameKind::Value, PLACES);
                what.zip(to).map(|(what, to)| Offload { what, to })
            }
            other => {
                cx.report(Problem::WrongKind {
                    slot,
                    expected: Expected::OffloadList,
                    found: super::wording::found(other),
                    span: item.span,
                });
                None
            }
        };
        match one {
            Some(o) => {
                cx.spans.insert(format!("fit.{slot}.{o}"), item.span);
                out.push(o);
            }
            None => ok = false,
        }
    }
    out.sort();
    out.dedup();
    ok.then_some(out)
}
