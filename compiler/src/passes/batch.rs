//! The batch pass: micro-batch and gradient accumulation consistent with the
//! global batch and each layout's data-parallel degree
//! (`global_batch = micro_batch × grad_accum × data`).
//!
//! A fixed micro-batch is the only value; `auto` ranges over the divisors
//! of the global batch whose tensors stay within [`crate::scale`]'s bound, and
//! the search keeps, per layout, those dividing its per-rank batch (and
//! matching a fixed `grad_accum`).

use super::{decide, Pass, Plan};
use crate::compile::CompileError;
use crate::explain::Decision;
use crate::spec::{Choice, Spec, TrainSpec};

pub struct Batch<'a> {
    train: &'a TrainSpec,
    /// The plan, only to size micro-batches against the tensor bound.
    spec: &'a Spec,
}

impl<'a> Batch<'a> {
    pub fn new(spec: &'a Spec) -> Self {
        Batch {
            train: &spec.train,
            spec,
        }
    }
}

impl Pass for Batch<'_> {
    fn name(&self) -> &'static str {
        "batch"
    }

    fn run(&self, plan: &mut Plan, log: &mut Vec<Decision>) -> Result<(), CompileError> {
        let g = self.train.global_batch.max(1);
        plan.space.grad_accum = self.train.grad_accum.fixed();
        plan.space.micro_batch = match self.train.micro_batch {
            Choice::Fixed(mb) => vec![mb],
            Choice::Auto => {
                let all = super::divisors(g);
                let v: Vec<u64> = all
                    .iter()
                    .copied()
                    .filter(|&mb| crate::scale::too_large(self.spec, mb).is_none())
                    .collect();
                if v.len() < all.len() {
                    decide(
                        log,
                        self,
                        format!("micro_batch ≤ {}", v.last().copied().unwrap_or(1)),
                        "larger micro-batches would make a tensor of over 2^40 elements, more than any GPU holds",
                    );
                }
                decide(
                    log,
                    self,
                    format!("micro_batch ∈ divisors of {g} ({} values)", v.len()),
                    "per layout, those dividing global_batch / data; memory grows with it, the pipeline bubble shrinks with more micro-batches",
                );
                v
            }
        };
        let ok = plan.space.layouts.iter().any(|l| {
            plan.space.micro_batch.iter().any(|&mb| {
                let per_rank = g / l.data.max(1);
                per_rank.is_multiple_of(mb)
                    && plan.space.grad_accum.is_none_or(|ga| mb * ga == per_rank)
            })
        });
        if !ok {
            return Err(CompileError::Inconsistent {
                what: format!(
                    "global_batch = {g} is not micro_batch × grad_accum × data for any layout"
                ),
                help: format!(
                    "micro_batch {:?}, grad_accum {:?}, data {{{}}}: choose values whose product is {g}",
                    self.train.micro_batch,
                    self.train.grad_accum,
                    plan.space.layouts.iter().map(|l| l.data.to_string()).collect::<Vec<_>>().join(", ")
                ),
            });
        }
        Ok(())
    }
}
