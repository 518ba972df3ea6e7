//! The `adapter` section: `adapter lora { ... }` or `adapter qlora { ... }`.
//!
//! `rank`, `alpha` and `targets` are required (they decide what trains and
//! how much memory it takes; there is no neutral default); `dropout`
//! defaults to 0. QLoRA's frozen base is `nf4` (the default, and the only
//! value); a LoRA base keeps the `precision.params` dtype, and `base` is an
//! error there. Targets are stored sorted without repeats; whether the model
//! has each projection (`gate` needs a SwiGLU MLP) is checked in
//! [`super::constraints`].

use super::problem::{Expected, Inapplicable, NameKind, Problem, Range};
use super::values::{self, Cx, Fields};
use crate::spec::{AdapterKind, AdapterSpec, Dtype, Proj};
use rcoa_grammar::{Section, ValueKind};

pub(crate) const KEYS: &[&str] = &["rank", "alpha", "targets", "dropout", "base"];

const KINDS: &[(&str, AdapterKind)] = &[("lora", AdapterKind::Lora), ("qlora", AdapterKind::Qlora)];
const PROJS: &[(&str, Proj)] = &[
    ("q", Proj::Q),
    ("k", Proj::K),
    ("v", Proj::V),
    ("o", Proj::O),
    ("gate", Proj::Gate),
    ("up", Proj::Up),
    ("down", Proj::Down),
];
/// Every dtype name, so `base = int8` is "not nf4" rather than "unknown".
const BASES: &[(&str, Dtype)] = &[
    ("nf4", Dtype::Nf4),
    ("fp32", Dtype::Fp32),
    ("bf16", Dtype::Bf16),
    ("fp16", Dtype::Fp16),
    ("fp8", Dtype::Fp8),
    ("int8", Dtype::Int8),
];

/// `params` is the resolved `precision.params` (the LoRA base dtype), when known.
pub(super) fn resolve(cx: &mut Cx, s: &Section, params: Option<Dtype>) -> Option<AdapterSpec> {
    let mark = cx.mark();
    let kind = match s.args.as_slice() {
        [] => {
            cx.report(Problem::MissingArgument {
                section: "adapter",
                span: s.name.span,
            });
            None
        }
        [k, rest @ ..] => {
            for e in rest {
                cx.report(Problem::UnexpectedArgument {
                    section: "adapter",
                    span: e.span,
                });
            }
            cx.spans.insert("adapter.args", k.span);
            values::pick(cx, k, "adapter", NameKind::Adapter, KINDS)
        }
    };
    let f = Fields::read(cx, "adapter", "adapter", s.name.span, s.body.as_ref(), KEYS);
    let rank = f
        .require(cx, "rank")
        .and_then(|v| values::integer(cx, v, "rank", 1));
    let alpha = f
        .require(cx, "alpha")
        .and_then(|v| values::number(cx, v, "alpha", Range::Positive));
    let targets = f.require(cx, "targets").and_then(|v| targets(cx, v));
    let dropout = f.get("dropout").map_or(Some(0.0), |v| {
        values::number(cx, v, "dropout", Range::UnitInterval)
    });
    let base = f
        .get("base")
        .map(|v| (v, values::pick(cx, v, "base", NameKind::Dtype, BASES)));
    let kind = kind?;
    let base = match (kind, base) {
        (AdapterKind::Qlora, None) => Some(Dtype::Nf4),
        (AdapterKind::Qlora, Some((_, Some(Dtype::Nf4)))) => Some(Dtype::Nf4),
        (AdapterKind::Qlora, Some((v, Some(other)))) => {
            cx.report(Problem::QloraBase {
                base: other.as_str().to_string(),
                span: v.span,
            });
            None
        }
        (_, Some((_, None))) => None,
        (AdapterKind::Lora, Some((v, Some(_)))) => {
            cx.report(Problem::NotApplicable {
                key: "base",
                because: Inapplicable::BaseNeedsQlora,
                span: v.span,
            });
            None
        }
        (AdapterKind::Lora, None) => params,
    };
    if !cx.clean_since(mark) {
        return None;
    }
    Some(AdapterSpec {
        kind,
        rank: rank?,
        alpha: alpha?,
        targets: targets?,
        dropout: dropout?,
        base: base?,
    })
}

fn targets(cx: &mut Cx, v: &rcoa_grammar::Value) -> Option<Vec<Proj>> {
    let ValueKind::List(items) = &v.kind else {
        cx.report(Problem::WrongKind {
            slot: "targets",
            expected: Expected::NameList,
            found: super::wording::found(&v.kind),
            span: v.span,
        });
        return None;
    };
    if items.is_empty() {
        cx.report(Problem::EmptyTargets { span: v.span });
        return None;
    }
    let mut out = Vec::new();
    let mut ok = true;
    for item in items {
        match values::pick(cx, item, "targets", NameKind::Value, PROJS) {
            Some(p) => {
                cx.spans
                    .insert(format!("adapter.targets.{}", p.as_str()), item.span);
                out.push(p);
            }
            None => ok = false,
        }
    }
    out.sort();
    out.dedup();
    ok.then_some(out)
}
