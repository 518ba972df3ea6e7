//! Constraints that span sections (`DSL.md`): model dimensions against the
//! tensor degree, the parallel product against the GPU count, the batch
//! arithmetic, positions, budget and offload against the hardware, adapter
//! targets against the model.
//!
//! Each check runs only when the sections it reads resolved cleanly (a
//! `None` part is skipped), so a typo elsewhere does not produce follow-on
//! errors. Arithmetic is done in `u128`: no product of user numbers can
//! overflow. The problems point at the text that set the value (the span
//! table), or at the section when the value is a default.

use super::model::divisors;
use super::problem::{Inapplicable, ParallelProduct, Problem};
use super::values::Cx;
use crate::spec::{
    AdapterSpec, Budget, CheckpointChoice, Choice, FitSpec, HardwareSpec, Mlp, ModelSpec,
    OffloadTo, ParallelSpec, Positions, Proj, TrainSpec,
};
use rcoa_grammar::Span;

/// The sections that resolved cleanly.
pub(super) struct Parts<'a> {
    pub model: Option<&'a ModelSpec>,
    pub adapter: Option<&'a Option<AdapterSpec>>,
    pub hardware: Option<&'a HardwareSpec>,
    pub train: Option<&'a TrainSpec>,
    pub parallel: Option<&'a ParallelSpec>,
    pub fit: Option<&'a FitSpec>,
}

pub(super) fn check(cx: &mut Cx, p: Parts) {
    if let (Some(m), Some(par)) = (p.model, p.parallel) {
        model_vs_parallel(cx, m, par, p.hardware);
    }
    if let Some(par) = p.parallel {
        sequence_needs_tensor(cx, par);
    }
    if let (Some(m), Some(par)) = (p.model, p.parallel) {
        virtual_stages(cx, m, par, p.train);
    }
    let mut product_ok = true;
    if let (Some(par), Some(hw)) = (p.parallel, p.hardware) {
        product_ok = parallel_vs_gpus(cx, par, hw);
    }
    if let (Some(t), Some(par)) = (p.train, p.parallel) {
        let hw = p.hardware.filter(|_| product_ok);
        batch(cx, t, par, hw);
        if let Choice::Fixed(c) = par.context {
            if c > 1 && t.seq_len % c != 0 {
                let span = span_or(cx, "train.seq_len", "train");
                cx.report(Problem::NotDivisible {
                    what: "seq_len",
                    value: t.seq_len,
                    by_what: "context",
                    by: c,
                    span,
                    by_span: cx.spans.get("parallel.context"),
                    divisor_is_primary: false,
                    options: vec![],
                });
            }
        }
    }
    if let (Some(t), Some(m)) = (p.train, p.model) {
        if m.positions == Positions::Learned && t.seq_len > m.max_positions {
            let span = span_or(cx, "train.seq_len", "train");
            cx.report(Problem::SeqLenTooLong {
                seq_len: t.seq_len,
                max_positions: m.max_positions,
                span,
            });
        }
    }
    if let (Some(f), Some(hw)) = (p.fit, p.hardware) {
        fit_vs_hardware(cx, f, hw);
    }
    if let Some(f) = p.fit {
        must_offload_places(cx, f);
    }
    if let (Some(f), Some(m)) = (p.fit, p.model) {
        if let CheckpointChoice::Every(n) = f.checkpoint {
            if n > m.layers {
                let span = span_or(cx, "fit.checkpoint", "fit");
                cx.report(Problem::CheckpointEveryTooLarge {
                    every: n,
                    layers: m.layers,
                    span,
                });
            }
        }
    }
    if let (Some(Some(a)), Some(m)) = (p.adapter, p.model) {
        if m.mlp != Mlp::Swiglu && a.targets.contains(&Proj::Gate) {
            let span = span_or(cx, "adapter.targets.gate", "adapter");
            cx.report(Problem::TargetNotInModel {
                target: "gate",
                span,
            });
        }
    }
}

fn span_or(cx: &Cx, path: &str, fallback: &str) -> Span {
    cx.spans
        .get(path)
        .or_else(|| cx.spans.get(fallback))
        .unwrap_or_default()
}

/// Tensor parallelism splits heads, kv heads, the hidden and MLP dimensions
/// and the vocabulary (embedding and head) evenly; pipeline stages need a
/// layer each; expert parallelism splits the experts.
fn model_vs_parallel(cx: &mut Cx, m: &ModelSpec, par: &ParallelSpec, hw: Option<&HardwareSpec>) {
    if let Choice::Fixed(t) = par.tensor {
        let dims = [
            ("heads", m.heads),
            ("kv_heads", m.kv_heads),
            ("hidden", m.hidden),
            ("ffn", m.ffn),
            ("vocab", m.vocab),
        ];
        if let Some((what, value)) = dims.iter().copied().find(|(_, v)| v % t != 0) {
            // Degrees that split every dimension (and, with hardware, the GPU count).
            let gpus = hw.map(|h| h.gpus_per_node as u128 * h.nodes as u128);
            let options = divisors(m.heads)
                .into_iter()
                .filter(|d| {
                    dims.iter().all(|(_, v)| v % d == 0) && gpus.is_none_or(|g| g % *d as u128 == 0)
                })
                .collect();
            let span = span_or(cx, "parallel.tensor", "parallel");
            cx.report(Problem::NotDivisible {
                what,
                value,
                by_what: "tensor",
                by: t,
                span,
                by_span: None,
                divisor_is_primary: true,
                options,
            });
        }
    }
    if let Choice::Fixed(pp) = par.pipeline {
        if pp > m.layers {
            let span = span_or(cx, "parallel.pipeline", "parallel");
            cx.report(Problem::PipelineTooDeep {
                pipeline: pp,
                layers: m.layers,
                span,
            });
        }
    }
    if let Choice::Fixed(e) = par.expert {
        if e > 1 && (m.experts <= 1 || !m.experts.is_multiple_of(e)) {
            let span = span_or(cx, "parallel.expert", "parallel");
            cx.report(Problem::ExpertNeedsExperts {
                expert: e,
                experts: m.experts,
                span,
            });
        }
    }
}

fn sequence_needs_tensor(cx: &mut Cx, par: &ParallelSpec) {
    if par.sequence == Choice::Fixed(true) && par.tensor == Choice::Fixed(1) {
        let span = span_or(cx, "parallel.sequence", "parallel");
        cx.report(Problem::SequenceNeedsTensor {
            span,
            tensor_span: cx.spans.get("parallel.tensor"),
        });
    }
}

/// data × tensor × pipeline × context = GPUs (or divides it, with autos).
/// Returns whether the check passed.
fn parallel_vs_gpus(cx: &mut Cx, par: &ParallelSpec, hw: &HardwareSpec) -> bool {
    let gpus = hw.gpus_per_node as u128 * hw.nodes as u128;
    let all = [
        ("data", par.data),
        ("tensor", par.tensor),
        ("pipeline", par.pipeline),
        ("context", par.context),
    ];
    let terms: Vec<(&'static str, u64)> = all
        .iter()
        .filter_map(|(n, c)| c.fixed().map(|v| (*n, v)))
        .collect();
    let product: u128 = terms.iter().map(|(_, v)| *v as u128).product();
    let complete = terms.len() == all.len();
    let ok = if complete {
        product == gpus
    } else {
        gpus.is_multiple_of(product)
    };
    if ok {
        return true;
    }
    let written: Vec<(Span, &'static str, u64)> = terms
        .iter()
        .filter_map(|(n, v)| cx.spans.get(&format!("parallel.{n}")).map(|s| (s, *n, *v)))
        .collect();
    let hw_written = [("gpus_per_node", hw.gpus_per_node), ("nodes", hw.nodes)]
        .into_iter()
        .filter_map(|(n, v)| cx.spans.get(&format!("hardware.{n}")).map(|s| (s, n, v)));
    let span = written
        .first()
        .map(|w| w.0)
        .unwrap_or_else(|| span_or(cx, "parallel", "hardware"));
    let others = written.iter().skip(1).copied().chain(hw_written).collect();
    cx.report(Problem::ParallelMismatch {
        check: ParallelProduct {
            terms,
            product: product.min(u64::MAX as u128) as u64,
            gpus_per_node: hw.gpus_per_node,
            nodes: hw.nodes,
            complete,
        },
        span,
        others,
    });
    false
}

/// global_batch = micro_batch × grad_accum × data, as far as the fixed values tell.
fn batch(cx: &mut Cx, t: &TrainSpec, par: &ParallelSpec, hw: Option<&HardwareSpec>) {
    // The data degree is known when written, or when every other degree is
    // fixed and the hardware resolved: the GPUs left over.
    let data: Option<(u64, bool)> = match par.data {
        Choice::Fixed(d) => Some((d, false)),
        Choice::Auto => match (
            hw,
            par.tensor.fixed(),
            par.pipeline.fixed(),
            par.context.fixed(),
        ) {
            (Some(h), Some(tp), Some(pp), Some(c)) => {
                let gpus = h.gpus_per_node as u128 * h.nodes as u128;
                let rest = tp as u128 * pp as u128 * c as u128;
                gpus.is_multiple_of(rest)
                    .then(|| ((gpus / rest).min(u64::MAX as u128) as u64, true))
            }
            _ => None,
        },
    };
    let global = t.global_batch;
    let span = span_or(cx, "train.global_batch", "train");
    let others: Vec<(Span, &'static str, u64)> = [
        ("train.micro_batch", "micro_batch", t.micro_batch.fixed()),
        ("train.grad_accum", "grad_accum", t.grad_accum.fixed()),
        ("parallel.data", "data", par.data.fixed()),
    ]
    .into_iter()
    .filter_map(|(path, name, v)| Some((cx.spans.get(path)?, name, v?)))
    .collect();
    match (t.micro_batch.fixed(), t.grad_accum.fixed(), data) {
        (Some(m), Some(a), Some((d, derived))) => {
            if m as u128 * a as u128 * d as u128 != global as u128 {
                cx.report(Problem::BatchMismatch {
                    micro: m,
                    accum: a,
                    data: d,
                    data_derived: derived,
                    global,
                    span,
                    others,
                });
            }
        }
        (None, None, Some((d, derived))) => {
            if !global.is_multiple_of(d) {
                cx.report(Problem::NotDivisible {
                    what: "global_batch",
                    value: global,
                    by_what: "data",
                    by: d,
                    span,
                    by_span: if derived {
                        None
                    } else {
                        cx.spans.get("parallel.data")
                    },
                    divisor_is_primary: false,
                    options: vec![],
                });
            }
        }
        (m, a, d) => {
            let mut factors = Vec::new();
            if let Some(m) = m {
                factors.push(("micro_batch", m));
            }
            if let Some(a) = a {
                factors.push(("grad_accum", a));
            }
            if let Some((d, _)) = d {
                factors.push(("data", d));
            }
            let product: u128 = factors.iter().map(|(_, v)| *v as u128).product();
            if !(global as u128).is_multiple_of(product) {
                cx.report(Problem::BatchNotMultiple {
                    factors,
                    global,
                    span,
                    others,
                });
            }
        }
    }
}

fn fit_vs_hardware(cx: &mut Cx, f: &FitSpec, hw: &HardwareSpec) {
    let memory = hw.gpu.memory_bytes;
    if let Budget::Bytes(b) = f.budget {
        if b > memory {
            let span = span_or(cx, "fit.budget", "fit");
            cx.report(Problem::BudgetTooLarge {
                budget: b,
                gpu: hw.gpu.name.clone(),
                memory,
                span,
            });
            return;
        }
    }
    if let Some(r) = f.reserve {
        let budget = f.budget_bytes(memory);
        if r >= budget {
            let span = span_or(cx, "fit.reserve", "fit");
            cx.report(Problem::ReserveTooLarge {
                reserve: r,
                budget,
                span,
            });
        }
    }
    for (list, o) in f
        .offload
        .iter()
        .map(|o| ("offload", o))
        .chain(f.must_offload.iter().map(|o| ("must_offload", o)))
    {
        let missing = match o.to {
            OffloadTo::Nvme => hw.nvme_bytes.is_none(),
            OffloadTo::Cpu => hw.host_memory_bytes.is_none(),
        };
        if missing {
            let span = span_or(cx, &format!("fit.{list}.{o}"), "fit");
            cx.report(Problem::OffloadNeedsStorage {
                nvme: o.to == OffloadTo::Nvme,
                span,
            });
        }
    }
}

/// A required offload puts its kind of tensor in one place: no other place for it in
/// `must_offload` or `offload`.
fn must_offload_places(cx: &mut Cx, f: &FitSpec) {
    for (i, m) in f.must_offload.iter().enumerate() {
        let clash = f.must_offload[i + 1..]
            .iter()
            .map(|o| ("must_offload", o))
            .chain(f.offload.iter().map(|o| ("offload", o)))
            .find(|(_, o)| o.what == m.what && o.to != m.to);
        if let Some((list, o)) = clash {
            let span = span_or(cx, &format!("fit.must_offload.{m}"), "fit");
            let other_span = cx.spans.get(&format!("fit.{list}.{o}"));
            cx.report(Problem::OffloadTwoPlaces {
                item: m.to_string(),
                other: o.to_string(),
                span,
                other_span,
            });
        }
    }
}

/// Megatron's interleaved schedule: a fixed pipeline of 2 or more, every model chunk the
/// same number of layers (`num_layers` divisible by pipeline × virtual stages), and the
/// micro-batches per step a multiple of the pipeline (Megatron's
/// `microbatch_group_size_per_vp_stage`, the pipeline size by default; an `auto`
/// `grad_accum` is searched over such values only).
fn virtual_stages(cx: &mut Cx, m: &ModelSpec, par: &ParallelSpec, t: Option<&TrainSpec>) {
    let v = par.virtual_stages;
    if v <= 1 {
        return;
    }
    let span = span_or(cx, "parallel.virtual_stages", "parallel");
    let Some(p) = par.pipeline.fixed().filter(|p| *p > 1) else {
        cx.report(Problem::NotApplicable {
            key: "virtual_stages",
            because: Inapplicable::VirtualStagesNeedPipeline,
            span,
        });
        return;
    };
    if !m.layers.is_multiple_of(p * v) {
        cx.report(Problem::NotDivisible {
            what: "layers",
            value: m.layers,
            by_what: "pipeline × virtual_stages",
            by: p * v,
            span,
            by_span: None,
            divisor_is_primary: true,
            // pipeline × virtual_stages products that cut the layers evenly.
            options: divisors(m.layers)
                .into_iter()
                .filter(|d| d.is_multiple_of(p))
                .collect(),
        });
    }
    if let Some(a) = t.and_then(|t| t.grad_accum.fixed()) {
        if !a.is_multiple_of(p) {
            cx.report(Problem::NotDivisible {
                what: "grad_accum",
                value: a,
                by_what: "pipeline",
                by: p,
                span: span_or(cx, "train.grad_accum", "train"),
                by_span: cx.spans.get("parallel.pipeline"),
                divisor_is_primary: false,
                options: vec![],
            });
        }
    }
}

/// `optimizer { in_backward = true }`: one backward per step (no accumulation).
pub(super) fn in_backward(cx: &mut Cx, t: Option<&TrainSpec>) {
    if t.and_then(|t| t.grad_accum.fixed()).is_some_and(|a| a > 1) {
        let span = span_or(cx, "optimizer.in_backward", "optimizer");
        cx.report(Problem::NotApplicable {
            key: "optimizer.in_backward",
            because: Inapplicable::InBackwardNoAccumulation,
            span,
        });
    }
}
