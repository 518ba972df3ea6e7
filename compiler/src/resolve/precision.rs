//! The `precision` section: the dtypes of weights, matmuls, the master copy
//! and the gradients.
//!
//! One-word forms: `precision bf16` is `{ params = bf16 compute = bf16
//! master = fp32 }` (so is `fp16` and `fp8` with their dtype); `precision
//! fp32` is `{ params = fp32 compute = fp32 master = none }` and `precision
//! tf32` is fp32 weights with tf32 matmuls. In the block, defaults are:
//! `params = bf16`, `compute = params` (fp32 for tf32-free fp32 weights),
//! `master = fp32` when params are narrower than 32 bits, else `none` (an
//! fp32 copy of fp32 weights would be a second copy of the same thing), and
//! `grads = params`. A one-word form followed by a block starts from the
//! word and lets the block override. `autocast = true` trains 16-bit weights
//! under autocast all the same (fp32 weights with 16-bit compute always are).

use super::problem::{NameKind, Problem};
use super::values::{self, Cx, Fields};
use crate::spec::{Dtype, PrecisionSpec};
use rcoa_grammar::Section;

pub(crate) const KEYS: &[&str] = &["params", "compute", "master", "grads", "autocast"];

const PARAMS: &[(&str, Dtype)] = &[
    ("fp32", Dtype::Fp32),
    ("bf16", Dtype::Bf16),
    ("fp16", Dtype::Fp16),
    ("fp8", Dtype::Fp8),
];
const COMPUTE: &[(&str, Dtype)] = &[
    ("fp32", Dtype::Fp32),
    ("tf32", Dtype::Tf32),
    ("bf16", Dtype::Bf16),
    ("fp16", Dtype::Fp16),
    ("fp8", Dtype::Fp8),
];
const MASTER: &[(&str, Option<Dtype>)] = &[("fp32", Some(Dtype::Fp32)), ("none", None)];
const GRADS: &[(&str, Dtype)] = PARAMS;
/// `precision WORD`: the params dtype and the compute dtype it stands for.
const ONE_WORD: &[(&str, (Dtype, Dtype))] = &[
    ("fp32", (Dtype::Fp32, Dtype::Fp32)),
    ("tf32", (Dtype::Fp32, Dtype::Tf32)),
    ("bf16", (Dtype::Bf16, Dtype::Bf16)),
    ("fp16", (Dtype::Fp16, Dtype::Fp16)),
    ("fp8", (Dtype::Fp8, Dtype::Fp8)),
];

/// Without a `precision` section: `precision bf16`.
pub(super) fn default() -> PrecisionSpec {
    from_parts(Dtype::Bf16, None, None, None)
}

fn default_master(params: Dtype) -> Option<Dtype> {
    (params.bytes() < Dtype::Fp32.bytes()).then_some(Dtype::Fp32)
}

fn from_parts(
    params: Dtype,
    compute: Option<Dtype>,
    master: Option<Option<Dtype>>,
    grads: Option<Dtype>,
) -> PrecisionSpec {
    PrecisionSpec {
        params,
        compute: compute.unwrap_or(params),
        master: master.unwrap_or_else(|| default_master(params)),
        grads: grads.unwrap_or(params),
        autocast: false,
    }
}

pub(super) fn resolve(cx: &mut Cx, s: &Section) -> Option<PrecisionSpec> {
    let mark = cx.mark();
    let mut word: Option<(Dtype, Dtype)> = None;
    match s.args.as_slice() {
        [] if s.body.is_none() => {
            cx.report(Problem::MissingArgument {
                section: "precision",
                span: s.name.span,
            });
            return None;
        }
        [] => {}
        [w, rest @ ..] => {
            for e in rest {
                cx.report(Problem::UnexpectedArgument {
                    section: "precision",
                    span: e.span,
                });
            }
            cx.spans.insert("precision.args", w.span);
            word = values::pick(cx, w, "precision", NameKind::Dtype, ONE_WORD);
        }
    }
    let f = Fields::read(
        cx,
        "precision",
        "precision",
        s.name.span,
        s.body.as_ref(),
        KEYS,
    );
    let params = f
        .get("params")
        .map(|v| values::pick(cx, v, "params", NameKind::Dtype, PARAMS));
    let compute = f
        .get("compute")
        .map(|v| values::pick(cx, v, "compute", NameKind::Dtype, COMPUTE));
    let master = f
        .get("master")
        .map(|v| values::pick(cx, v, "master", NameKind::Dtype, MASTER));
    let grads = f
        .get("grads")
        .map(|v| values::pick(cx, v, "grads", NameKind::Dtype, GRADS));
    let autocast = f
        .get("autocast")
        .map(|v| values::boolean(cx, v, "autocast"));
    if !cx.clean_since(mark) {
        return None;
    }
    let params = params
        .flatten()
        .or(word.map(|w| w.0))
        .unwrap_or(Dtype::Bf16);
    // The word's compute applies only if the block did not change params.
    let word_compute = word.filter(|w| w.0 == params).map(|w| w.1);
    let mut spec = from_parts(
        params,
        compute.flatten().or(word_compute),
        master.flatten(),
        grads.flatten(),
    );
    if let Some(on) = autocast.flatten() {
        let wider = spec.params.bytes() > spec.compute.bytes();
        if (on && spec.compute.bytes() >= 4.0) || (!on && wider) {
            cx.report(Problem::AutocastConflict {
                span: f.span("autocast").unwrap_or(s.name.span),
                on,
            });
            return None;
        }
        spec.autocast = on;
    }
    if spec.compute == Dtype::Tf32 && spec.params != Dtype::Fp32 {
        cx.report(Problem::Tf32NeedsFp32 {
            span: f
                .span("compute")
                .or(f.span("params"))
                .unwrap_or(s.name.span),
        });
        return None;
    }
    Some(spec)
}
