//! The `parallel` section: data, ZeRO, tensor, pipeline, sequence, context
//! and expert parallelism.
//!
//! Defaults (`DSL.md`): `data = auto` (the GPUs left over), `zero = 0`,
//! `tensor = 1`, `pipeline = 1`, `sequence = false`, `context = 1`,
//! `expert = 1`, `virtual_stages = 1`; every key but `virtual_stages` may be
//! `auto`. Divisibility by the model's
//! dimensions and the product against the GPU count are checked in
//! [`super::constraints`].

use super::problem::Problem;
use super::values::{self, Cx, Fields};
use crate::spec::{Choice, ParallelSpec};
use rcoa_grammar::Section;

pub(crate) const KEYS: &[&str] = &[
    "data",
    "zero",
    "tensor",
    "pipeline",
    "sequence",
    "context",
    "expert",
    "virtual_stages",
];

/// Without a `parallel` section.
pub(super) fn default() -> ParallelSpec {
    ParallelSpec {
        data: Choice::Auto,
        zero: Choice::Fixed(0),
        tensor: Choice::Fixed(1),
        pipeline: Choice::Fixed(1),
        sequence: Choice::Fixed(false),
        context: Choice::Fixed(1),
        expert: Choice::Fixed(1),
        virtual_stages: 1,
    }
}

pub(super) fn resolve(cx: &mut Cx, s: &Section) -> Option<ParallelSpec> {
    let mark = cx.mark();
    for a in &s.args {
        cx.report(Problem::UnexpectedArgument {
            section: "parallel",
            span: a.span,
        });
    }
    if s.body.is_none() {
        cx.report(Problem::MissingBlock {
            section: "parallel",
            span: s.name.span,
        });
        return None;
    }
    let f = Fields::read(
        cx,
        "parallel",
        "parallel",
        s.name.span,
        s.body.as_ref(),
        KEYS,
    );
    let d = default();
    let degree = |cx: &mut Cx, key: &'static str, default: Choice<u64>| {
        f.get(key)
            .map_or(Some(default), |v| values::auto_integer(cx, v, key, 1))
    };
    let data = degree(cx, "data", d.data);
    let tensor = degree(cx, "tensor", d.tensor);
    let pipeline = degree(cx, "pipeline", d.pipeline);
    let context = degree(cx, "context", d.context);
    let expert = degree(cx, "expert", d.expert);
    let zero = f.get("zero").map_or(Some(d.zero), |v| {
        values::auto_integer_in(cx, v, "zero", 0, 3).map(|c| match c {
            Choice::Auto => Choice::Auto,
            // In range 0..=3 by the read above.
            Choice::Fixed(z) => Choice::Fixed(z as u8),
        })
    });
    let sequence = f
        .get("sequence")
        .map_or(Some(d.sequence), |v| values::auto_bool(cx, v, "sequence"));
    // A schedule, not a degree the search weighs: never `auto`.
    let virtual_stages = f.get("virtual_stages").map_or(Some(1), |v| {
        values::integer_in(cx, v, "virtual_stages", 1, 1 << 16)
    });
    if !cx.clean_since(mark) {
        return None;
    }
    Some(ParallelSpec {
        data: data?,
        zero: zero?,
        tensor: tensor?,
        pipeline: pipeline?,
        sequence: sequence?,
        context: context?,
        expert: expert?,
        virtual_stages: virtual_stages?,
    })
}
