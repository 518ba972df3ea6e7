//! The fit pass: search the product of the domains the earlier passes left
//! (see [`crate::search`]) and record what was chosen, with the numbers
//! behind each choice and the best rejected alternatives.
//!
//! Only settings whose domain held more than one value are logged here
//! (values the plan fixed are logged as `given`). When nothing fits, the
//! smallest-peak candidate is kept so the report and the `does_not_fit`
//! diagnostic can say how far over it is.

use super::{decide, gib, Pass, Plan};
use crate::compile::CompileError;
use crate::explain::Decision;
use crate::profile::Profile;
use crate::search::{self, evaluate_point, Outcome, Point};
use crate::spec::Spec;

pub struct Fit<'a> {
    spec: &'a Spec,
    profile: &'a Profile,
}

impl<'a> Fit<'a> {
    pub fn new(spec: &'a Spec, profile: &'a Profile) -> Self {
        Fit { spec, profile }
    }
}

impl Pass for Fit<'_> {
    fn name(&self) -> &'static str {
        "fit"
    }

    fn run(&self, plan: &mut Plan, log: &mut Vec<Decision>) -> Result<(), CompileError> {
        let space = &plan.space;
        let layers = self.spec.model.layers;
        let (best, ev, stats) = search::search(self.spec, self.profile, space);
        let Some((point, eval)) = best else {
            return Err(CompileError::Inconsistent {
                what: "the search space is empty".into(),
                help: "no micro_batch, layout and offload combination is consistent with the plan"
                    .into(),
            });
        };
        let (_, time) = evaluate_point(self.spec, self.profile, space, &point);
        let budget = space.budget_bytes;
        let memo_eval = |p: &Point| ev.memo_get(p);
        let l = point.layout;
        if space.layouts.len() > 1 {
            decide(
                log,
                self,
                format!("{l}"),
                format!(
                    "{:.3} s/step: compute {:.3} s, data-parallel {:.3} s, tensor-parallel {:.3} s, context {:.3} s, pipeline p2p {:.3} s + bubble {:.3} s, offload {:.3} s",
                    time.step_seconds,
                    time.base.compute_seconds + time.base.memory_seconds + time.base.optimizer_seconds,
                    time.data_parallel_s,
                    time.tensor_parallel_s,
                    time.context_parallel_s,
                    time.pipeline_p2p_s,
                    time.bubble_s,
                    time.offload_s
                ),
            );
        }
        if space.zero.len() > 1 && l.data > 1 {
            decide(
                log,
                self,
                format!("zero = {}", point.zero),
                match point.zero {
                    0 => "every rank keeps full optimizer state, gradients and weights: the least traffic".to_string(),
                    1 => format!("optimizer state sharded over {} data-parallel ranks; same traffic as ZeRO-0", l.data),
                    2 if self.profile.grads_sharded_in_backward => format!("optimizer state and gradients sharded over {} ranks; gradients reduce-scattered every micro-step", l.data),
                    // rcoa's executor keeps whole gradients through the backward and
                    // reduce-scatters one flat vector before the optimizer step.
                    2 => format!("optimizer state and gradients sharded over {} ranks; gradients reduce-scattered once per step, before the optimizer", l.data),
                    _ => format!("optimizer state, gradients and weights sharded over {} ranks; weights all-gathered for every forward and backward", l.data),
                },
            );
        }
        if space.sequence.len() > 1 && l.tensor > 1 {
            decide(
                log,
                self,
                format!("sequence = {}", point.sequence),
                "the faster of the two that fit",
            );
        }
        if space.micro_batch.len() > 1 {
            decide(
                log,
                self,
                format!(
                    "micro_batch = {}, grad_accum = {}",
                    point.micro_batch, point.grad_accum
                ),
                format!(
                    "global_batch {} = micro_batch {} × grad_accum {} × data {}",
                    self.spec.train.global_batch, point.micro_batch, point.grad_accum, l.data
                ),
            );
        }
        if matches!(space.checkpoint, super::CheckpointDomain::AnyBlock { .. }) {
            let none = Point {
                recompute: super::Recompute::Block(0),
                ..point.clone()
            };
            let why = match memo_eval(&none) {
                // The search takes the fastest candidate that fits: recomputation can win
                // on time alone (selective recomputation's backward is predicted cheaper
                // than reading back the saved scores).
                Some(e) if none != point && e.fits => format!(
                    "without recomputation it fits too ({} + reserve {} ≤ {} budget), but this is predicted faster: {:.4} s/step against {:.4} s",
                    gib(e.peak_bytes as f64),
                    gib(e.reserve_bytes as f64),
                    gib(budget as f64),
                    eval.step_seconds,
                    e.step_seconds
                ),
                Some(e) if none != point => format!(
                    "without recomputation the peak is {} + reserve {} > {} budget; recomputing frees {} for {:+.3} s/step",
                    gib(e.peak_bytes as f64),
                    gib(e.reserve_bytes as f64),
                    gib(budget as f64),
                    gib(e.peak_bytes.saturating_sub(eval.peak_bytes) as f64),
                    eval.step_seconds - e.step_seconds
                ),
                _ if none == point => "everything fits without recomputation: no extra forward".to_string(),
                _ => "the fewest recomputed layers that fit".to_string(),
            };
            decide(
                log,
                self,
                format!("checkpoint = {}", point.checkpoint_string(layers)),
                why,
            );
        }
        if space.offload.len() > 1 {
            let what = format!(
                "offload = [{}]",
                point
                    .offload
                    .iter()
                    .map(|o| o.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            let why = if point.offload.is_empty() {
                "everything stays on the GPU: offload traffic over PCIe only slows the step"
                    .to_string()
            } else {
                format!(
                    "{} per node moved to the host for {:.3} s/step of transfers and CPU updates",
                    gib(eval.host_bytes as f64),
                    time.offload_s
                )
            };
            decide(log, self, what, why);
        }
        decide(
            log,
            self,
            if eval.fits {
                format!(
                    "fits: {} + reserve {} ≤ {}",
                    gib(eval.peak_bytes as f64),
                    gib(eval.reserve_bytes as f64),
                    gib(budget as f64)
                )
            } else {
                format!(
                    "nothing fits: the smallest peak is {} + reserve {} > {}",
                    gib(eval.peak_bytes as f64),
                    gib(eval.reserve_bytes as f64),
                    gib(budget as f64)
                )
            },
            format!(
                "searched {} candidates, walked {} tapes ({} groups pruned by bounds)",
                stats.space, stats.evaluated, stats.pruned_groups
            ),
        );
        let rejected = search::rejected(&ev, &point, &eval, layers, space.objective);
        plan.stats = stats;
        plan.outcome = Some(Outcome {
            fits: eval.fits,
            point,
            eval,
            rejected,
        });
        Ok(())
    }
}
