//! The `train` section: sequence length and batch shape, attention kernel,
//! loss.
//!
//! `seq_len` and `global_batch` are required; `micro_batch` and
//! `grad_accum` default to `auto`; `attention` to `sdpa`; `loss` to
//! `causal_lm` for decoders and `masked_lm` for encoders. `positives` and
//! `negatives` (texts per anchor) default to 0 and apply only to
//! `loss = contrastive`. `chunked_loss` (a boolean) turns the chunked LM loss
//! on or off; unset, the engine's default holds. `assistant_only_loss` (a boolean,
//! `causal_lm` only) scores only the assistant's tokens of chat conversations; `packing`
//! (a boolean, `causal_lm` only) bins whole examples into each sequence with attention
//! kept within each. The batch arithmetic against the parallel degrees is
//! checked in [`super::constraints`].

use super::problem::{Inapplicable, NameKind, Problem};
use super::values::{self, Cx, Fields};
use crate::spec::{Arch, Attention, Choice, Loss, TrainSpec};
use rcoa_grammar::Section;

pub(crate) const KEYS: &[&str] = &[
    "seq_len",
    "global_batch",
    "micro_batch",
    "grad_accum",
    "steps",
    "attention",
    "loss",
    "positives",
    "negatives",
    "chunked_loss",
    "assistant_only_loss",
    "packing",
];

const ATTENTION: &[(&str, Attention)] = &[
    ("sdpa", Attention::Sdpa),
    ("flash", Attention::Flash),
    ("eager", Attention::Eager),
];
const LOSSES: &[(&str, Loss)] = &[
    ("causal_lm", Loss::CausalLm),
    ("masked_lm", Loss::MaskedLm),
    ("contrastive", Loss::Contrastive),
];

/// `arch` is the model's, when it resolved (it decides the default loss).
pub(super) fn resolve(cx: &mut Cx, s: &Section, arch: Option<Arch>) -> Option<TrainSpec> {
    let mark = cx.mark();
    for a in &s.args {
        cx.report(Problem::UnexpectedArgument {
            section: "train",
            span: a.span,
        });
    }
    if s.body.is_none() {
        cx.report(Problem::MissingBlock {
            section: "train",
            span: s.name.span,
        });
        return None;
    }
    let f = Fields::read(cx, "train", "train", s.name.span, s.body.as_ref(), KEYS);
    let seq_len = f
        .require(cx, "seq_len")
        .and_then(|v| values::integer_in(cx, v, "seq_len", 1, 1 << 24));
    let global = f
        .require(cx, "global_batch")
        .and_then(|v| values::integer(cx, v, "global_batch", 1));
    let micro = f.get("micro_batch").map_or(Some(Choice::Auto), |v| {
        values::auto_integer(cx, v, "micro_batch", 1)
    });
    let accum = f.get("grad_accum").map_or(Some(Choice::Auto), |v| {
        values::auto_integer(cx, v, "grad_accum", 1)
    });
    let steps = f.get("steps").map(|v| values::integer(cx, v, "steps", 1));
    let attention = f.get("attention").map_or(Some(Attention::Sdpa), |v| {
        values::pick(cx, v, "attention", NameKind::Value, ATTENTION)
    });
    let loss = f
        .get("loss")
        .map(|v| values::pick(cx, v, "loss", NameKind::Value, LOSSES));
    let positives = f
        .get("positives")
        .map_or(Some(0), |v| values::integer(cx, v, "positives", 0));
    let negatives = f
        .get("negatives")
        .map_or(Some(0), |v| values::integer(cx, v, "negatives", 0));

    let chunked_loss = f
        .get("chunked_loss")
        .map(|v| values::boolean(cx, v, "chunked_loss"));
    let assistant_only_loss = f.get("assistant_only_loss").map_or(Some(false), |v| {
        values::boolean(cx, v, "assistant_only_loss")
    });
    let packing = f
        .get("packing")
        .map_or(Some(false), |v| values::boolean(cx, v, "packing"));

    // Without a written loss and without a resolved model, the default is unknown.
    let loss = match loss {
        Some(l) => l,
        None => arch.map(|a| match a {
            Arch::Decoder => Loss::CausalLm,
            Arch::Encoder => Loss::MaskedLm,
        }),
    };
    if loss.is_some_and(|l| l != Loss::Contrastive) {
        for key in ["positives", "negatives"] {
            if let Some(span) = f.span(key) {
                cx.report(Problem::NotApplicable {
                    key,
                    because: Inapplicable::NeedsContrastive,
                    span,
                });
            }
        }
    }
    if loss.is_some_and(|l| l != Loss::CausalLm) {
        for key in ["assistant_only_loss", "packing"] {
            if let Some(span) = f.span(key) {
                cx.report(Problem::NotApplicable {
                    key,
                    because: Inapplicable::NeedsCausalLm,
                    span,
                });
            }
        }
    }
    if !cx.clean_since(mark) {
        return None;
    }
    Some(TrainSpec {
        seq_len: seq_len?,
        global_batch: global?,
        micro_batch: micro?,
        grad_accum: accum?,
        steps: match steps {
            Some(s) => Some(s?),
            None => None,
        },
        attention: attention?,
        loss: loss?,
        positives: positives?,
        negatives: negatives?,
        chunked_loss: match chunked_loss {
            Some(c) => Some(c?),
            None => None,
        },
        assistant_only_loss: assistant_only_loss?,
        packing: packing?,
    })
}
