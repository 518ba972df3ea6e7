//! The `optimizer` section: `optimizer NAME { lr betas momentum weight_decay
//! state impl }`.
//!
//! Defaults follow the libraries the names come from (`torch.optim`,
//! bitsandbytes, lion-pytorch, transformers' Adafactor): `lr` 1e-3 (Lion
//! 1e-4), `betas` (0.9, 0.999) (Lion (0.9, 0.99); Adafactor (0, 0.999): no
//! first moment, as transformers' Adafactor with `beta1=None`), `weight_decay`
//! 0.01 for AdamW and 0 otherwise, `momentum` 0, `state` fp32 (int8 for
//! adam8bit), `impl` foreach (`paged`: bitsandbytes' paged optimizers, for
//! adam, adamw, adam8bit and lion), `in_backward` false. SGD has no betas (stored as (0, 0)); only SGD
//! has momentum — writing the other optimizer's knob is an error, not
//! silently ignored.

use super::problem::{Inapplicable, NameKind, Problem, Range};
use super::values::{self, Cx, Fields};
use crate::spec::{Dtype, OptImpl, OptimizerKind, OptimizerSpec};
use rcoa_grammar::Section;

pub(crate) const KEYS: &[&str] = &[
    "lr",
    "betas",
    "momentum",
    "weight_decay",
    "state",
    "impl",
    "in_backward",
];

pub(crate) const NAMES: &[&str] = &[
    "adamw",
    "adam",
    "adam8bit",
    "adafactor",
    "lion",
    "sgd",
    "adam-mini",
];

const KINDS: &[(&str, OptimizerKind)] = &[
    ("adamw", OptimizerKind::Adamw),
    ("adam", OptimizerKind::Adam),
    ("adam8bit", OptimizerKind::Adam8bit),
    ("adafactor", OptimizerKind::Adafactor),
    ("lion", OptimizerKind::Lion),
    ("sgd", OptimizerKind::Sgd),
    ("adam-mini", OptimizerKind::AdamMini),
];
const STATES: &[(&str, Dtype)] = &[
    ("fp32", Dtype::Fp32),
    ("bf16", Dtype::Bf16),
    ("int8", Dtype::Int8),
];
const IMPLS: &[(&str, OptImpl)] = &[
    ("foreach", OptImpl::Foreach),
    ("fused", OptImpl::Fused),
    ("plain", OptImpl::Plain),
    ("paged", OptImpl::Paged),
];

/// bitsandbytes has paged versions of these only.
const PAGED: &[OptimizerKind] = &[
    OptimizerKind::Adamw,
    OptimizerKind::Adam,
    OptimizerKind::Adam8bit,
    OptimizerKind::Lion,
];

/// Without an `optimizer` section: `optimizer adamw`.
pub(super) fn default() -> OptimizerSpec {
    defaults(OptimizerKind::Adamw)
}

fn defaults(kind: OptimizerKind) -> OptimizerSpec {
    use OptimizerKind::*;
    OptimizerSpec {
        kind,
        lr: if kind == Lion { 1e-4 } else { 1e-3 },
        betas: match kind {
            Lion => (0.9, 0.99),
            Adafactor => (0.0, 0.999),
            Sgd => (0.0, 0.0),
            _ => (0.9, 0.999),
        },
        momentum: 0.0,
        weight_decay: if kind == Adamw { 0.01 } else { 0.0 },
        state: if kind == Adam8bit {
            Dtype::Int8
        } else {
            Dtype::Fp32
        },
        implementation: OptImpl::Foreach,
    }
}

/// The section, and whether each parameter's step runs in the backward (`in_backward`,
/// which [`crate::spec::Spec`] keeps apart from the optimizer).
pub(super) fn resolve(cx: &mut Cx, s: &Section) -> Option<(OptimizerSpec, bool)> {
    let mark = cx.mark();
    let kind = match s.args.as_slice() {
        [] => {
            cx.report(Problem::MissingArgument {
                section: "optimizer",
                span: s.name.span,
            });
            None
        }
        [name, rest @ ..] => {
            for e in rest {
                cx.report(Problem::UnexpectedArgument {
                    section: "optimizer",
                    span: e.span,
                });
            }
            cx.spans.insert("optimizer.args", name.span);
            values::pick(cx, name, "optimizer", NameKind::Optimizer, KINDS)
        }
    };
    let f = Fields::read(
        cx,
        "optimizer",
        "optimizer",
        s.name.span,
        s.body.as_ref(),
        KEYS,
    );
    let lr = f
        .get("lr")
        .map(|v| values::number(cx, v, "lr", Range::Positive));
    let betas = f
        .get("betas")
        .map(|v| values::pair(cx, v, "betas", Range::UnitInterval));
    let momentum = f
        .get("momentum")
        .map(|v| values::number(cx, v, "momentum", Range::UnitInterval));
    let wd = f
        .get("weight_decay")
        .map(|v| values::number(cx, v, "weight_decay", Range::NonNegative));
    let state = f
        .get("state")
        .map(|v| values::pick(cx, v, "state", NameKind::Dtype, STATES));
    let imp = f
        .get("impl")
        .map(|v| values::pick(cx, v, "impl", NameKind::Value, IMPLS));
    let in_backward = f
        .get("in_backward")
        .map(|v| values::boolean(cx, v, "in_backward"));
    let kind = kind?;
    if let (Some(Some(OptImpl::Paged)), Some(span)) = (imp, f.span("impl")) {
        if !PAGED.contains(&kind) {
            cx.report(Problem::NotApplicable {
                key: "impl = paged",
                because: Inapplicable::PagedNeedsBitsandbytes,
                span,
            });
        }
    }
    let is_sgd = kind == OptimizerKind::Sgd;
    // A zero momentum is "no momentum" for any optimizer (and what the
    // ground-truth generator writes for plain SGD); only a real value is an error.
    if let (false, Some(Some(m)), Some(span)) = (is_sgd, momentum, f.span("momentum")) {
        if m != 0.0 {
            cx.report(Problem::NotApplicable {
                key: "momentum",
                because: Inapplicable::MomentumNeedsSgd,
                span,
            });
        }
    }
    if let (true, Some(span)) = (is_sgd, f.span("betas")) {
        cx.report(Problem::NotApplicable {
            key: "betas",
            because: Inapplicable::SgdHasNoBetas,
            span,
        });
    }
    if !cx.clean_since(mark) {
        return None;
    }
    let mut o = defaults(kind);
    // Each `Some(None)` was reported above; the clean check returned already.
    if let Some(Some(x)) = lr {
        o.lr = x;
    }
    if let Some(Some(x)) = betas {
        o.betas = x;
    }
    if let Some(Some(x)) = momentum {
        o.momentum = x;
    }
    if let Some(Some(x)) = wd {
        o.weight_decay = x;
    }
    if let Some(Some(x)) = state {
        o.state = x;
    }
    if let Some(Some(x)) = imp {
        o.implementation = x;
    }
    Some((o, matches!(in_backward, Some(Some(true)))))
}
