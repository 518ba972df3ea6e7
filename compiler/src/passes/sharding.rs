//! The sharding pass: which data × tensor × pipeline × context layouts,
//! ZeRO stages and sequence-parallel settings the search may use.
//!
//! Fixed degrees are kept; `auto` ones range over what the model and the
//! hardware allow: tensor parallelism divides the attention heads and the
//! key/value heads and stays inside a node (its per-layer all-reduces need
//! NVLink), pipeline parallelism gives every stage at least one layer,
//! context parallelism splits the sequence evenly and stays inside a node,
//! and data parallelism takes the GPUs left over and must divide the
//! global batch. ZeRO `auto` tries every stage (stages only differ with
//! data > 1). Sequence parallelism `auto` is on wherever tensor > 1: it
//! moves the same bytes as tensor parallelism's all-reduces and divides
//! the activations between them. Expert parallelism: dense models only.
//! The Burn executor (`target burn`) runs data parallelism only, one process
//! or thread per rank, with ZeRO 0, 1, 2 and 3 (`backend/src/shard`; ZeRO-3
//! gathers a unit — embedding, layer, head — at a time): its `auto` degrees
//! stay at 1 and its `auto` ZeRO stage ranges over what it runs
//! ([`crate::profile::BURN_RUNS_ZERO3`]); a fixed stage it does not run is an
//! error, so the search never picks what `rcoa run` refuses.

use super::{decide, divisors, Layout, Pass, Plan};
use crate::compile::CompileError;
use crate::explain::Decision;
use crate::spec::{Choice, HardwareSpec, ModelSpec, ParallelSpec, Target, TrainSpec};

pub struct Sharding<'a> {
    parallel: &'a ParallelSpec,
    hardware: &'a HardwareSpec,
    model: &'a ModelSpec,
    train: &'a TrainSpec,
    target: Target,
}

fn list(v: &[u64]) -> String {
    v.iter()
        .map(|x| x.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl<'a> Sharding<'a> {
    pub fn new(
        parallel: &'a ParallelSpec,
        hardware: &'a HardwareSpec,
        model: &'a ModelSpec,
        train: &'a TrainSpec,
        target: Target,
    ) -> Self {
        Sharding {
            parallel,
            hardware,
            model,
            train,
            target,
        }
    }

    /// The Burn executor has data parallelism only (BURN.md; `rcoa run` refuses the rest).
    fn data_parallel_only(&self) -> bool {
        self.target == Target::Burn
    }

    fn domain(&self, c: Choice<u64>, auto: impl Fn() -> Vec<u64>) -> Vec<u64> {
        match c {
            Choice::Fixed(v) => vec![v],
            Choice::Auto if self.data_parallel_only() => vec![1],
            Choice::Auto => auto(),
        }
    }
}

impl Pass for Sharding<'_> {
    fn name(&self) -> &'static str {
        "sharding"
    }

    fn run(&self, plan: &mut Plan, log: &mut Vec<Decision>) -> Result<(), CompileError> {
        let gpus = (self.hardware.gpus_per_node * self.hardware.nodes).max(1);
        let per_node = self.hardware.gpus_per_node.max(1);
        let m = self.model;
        let tensor = self.domain(self.parallel.tensor, || {
            divisors(per_node)
                .into_iter()
                .filter(|t| m.heads.is_multiple_of(*t) && m.kv_heads.is_multiple_of(*t))
                .collect()
        });
        let pipeline = self.domain(self.parallel.pipeline, || {
            divisors(gpus)
                .into_iter()
                .filter(|p| *p <= m.layers)
                .collect()
        });
        let context = self.domain(self.parallel.context, || {
            divisors(per_node)
                .into_iter()
                .filter(|c| self.train.seq_len.is_multiple_of(*c))
                .collect()
        });
        let model_parallel_auto = [
            self.parallel.tensor,
            self.parallel.pipeline,
            self.parallel.context,
        ]
        .iter()
        .any(|c| c.is_auto());
        let burn_zero3 = crate::profile::BURN_RUNS_ZERO3;
        if self.data_parallel_only() && (model_parallel_auto || self.parallel.zero.is_auto()) {
            if burn_zero3 {
                decide(log, self, "tensor = pipeline = context = 1, zero ∈ {0, 1, 2, 3} (where auto)",
                    "the Burn executor trains data-parallel only (one process per rank) with ZeRO 1 (optimizer state sharded, gradients all-reduced), 2 (gradients reduce-scattered) or 3 (weights sharded too, each unit — embedding, layer, head — gathered for its use and its gradient reduce-scattered as the backward leaves it); model parallelism runs on PyTorch engines (`target pytorch`, `rcoa emit`)");
            } else {
                decide(log, self, "tensor = pipeline = context = 1, zero ∈ {0, 1, 2} (where auto)",
                    "the Burn executor trains data-parallel only (one process per rank) with ZeRO 1 (optimizer state sharded, gradients all-reduced) or 2 (gradients reduce-scattered) and weights gathered after the step; model parallelism and ZeRO-3 run on PyTorch engines (`target pytorch`, `rcoa emit`)");
            }
        }
        if self.parallel.tensor.is_auto() && !self.data_parallel_only() {
            decide(log, self, format!("tensor ∈ {{{}}}", list(&tensor)),
                format!("divisors of the {per_node} GPUs of a node that divide heads {} and kv_heads {}: tensor-parallel all-reduces run every layer and need intra-node links", m.heads, m.kv_heads));
        }
        if self.parallel.pipeline.is_auto() && !self.data_parallel_only() {
            decide(
                log,
                self,
                format!("pipeline ∈ {{{}}}", list(&pipeline)),
                format!(
                    "divisors of {gpus} GPUs with at least one of the {} layers per stage",
                    m.layers
                ),
            );
        }
        if self.parallel.context.is_auto() && !self.data_parallel_only() {
            decide(
                log,
                self,
                format!("context ∈ {{{}}}", list(&context)),
                format!(
                    "divisors of the {per_node} GPUs of a node that split seq_len {} evenly",
                    self.train.seq_len
                ),
            );
        }
        let mut layouts = Vec::new();
        for &t in &tensor {
            for &p in &pipeline {
                for &c in &context {
                    let mp = t * p * c;
                    if mp == 0 || !gpus.is_multiple_of(mp) {
                        continue;
                    }
                    let d = match self.parallel.data {
                        Choice::Fixed(d) => d,
                        Choice::Auto => gpus / mp,
                    };
                    if d * mp != gpus || d == 0 || !self.train.global_batch.is_multiple_of(d) {
                        continue;
                    }
                    layouts.push(Layout {
                        data: d,
                        tensor: t,
                        pipeline: p,
                        context: c,
                    });
                }
            }
        }
        if layouts.is_empty() {
            return Err(CompileError::Inconsistent {
                what: format!(
                    "no data × tensor × pipeline × context layout uses the {gpus} GPUs with global_batch = {}",
                    self.train.global_batch
                ),
                help: format!(
                    "the degrees' product must be {gpus} and data must divide global_batch; tried tensor {{{}}}, pipeline {{{}}}, context {{{}}}",
                    list(&tensor),
                    list(&pipeline),
                    list(&context)
                ),
            });
        }
        if self.parallel.data.is_auto() {
            let mut ds: Vec<u64> = layouts.iter().map(|l| l.data).collect();
            ds.sort_unstable();
            ds.dedup();
            decide(
                log,
                self,
                format!("data ∈ {{{}}}", list(&ds)),
                format!(
                    "the GPUs left after tensor × pipeline × context, dividing global_batch {}",
                    self.train.global_batch
                ),
            );
        }
        plan.space.layouts = layouts;
        plan.space.zero = match self.parallel.zero {
            Choice::Fixed(z) if z > 2 && self.data_parallel_only() && !burn_zero3 => {
                return Err(CompileError::Inconsistent {
                    what: format!("zero = {z} is not executed by the Burn executor (`target burn`)"),
                    help: "`rcoa run` runs ZeRO 0, 1 and 2 (optimizer state, and gradients, sharded; every rank holds the whole model) \
                           and offloads the optimizer to the host: write `zero = 2` (or `auto`), or `target pytorch` for DeepSpeed's ZeRO-3 (`rcoa emit`)".into(),
                });
            }
            Choice::Fixed(z) => {
                crate::profile::engines::check_zero(self.target, z)?;
                vec![z]
            }
            Choice::Auto if crate::profile::engines::zero_stages(self.target).is_some() => {
                let (stages, why) =
                    crate::profile::engines::zero_stages(self.target).unwrap_or((&[], ""));
                decide(log, self, format!("zero ∈ {stages:?}"), why);
                stages.to_vec()
            }
            Choice::Auto if self.data_parallel_only() && !burn_zero3 => vec![0, 1, 2],
            Choice::Auto if self.data_parallel_only() => vec![0, 1, 2, 3],
            Choice::Auto => {
                decide(log, self, "zero ∈ {0, 1, 2, 3}",
                    "each stage shards more (optimizer state, + gradients, + parameters) for more traffic; the search weighs memory against time");
                vec![0, 1, 2, 3]
            }
        };
        plan.space.sequence = match self.parallel.sequence {
            Choice::Fixed(s) => vec![s],
            Choice::Auto => {
                decide(log, self, "sequence = true where tensor > 1",
                    "sequence parallelism swaps each tensor-parallel all-reduce for a reduce-scatter and an all-gather (the same bytes) and divides the activations between them");
                vec![true]
            }
        };
        if self.parallel.expert.is_auto() {
            decide(
                log,
                self,
                "expert = 1",
                format!(
                    "a dense model ({} expert per layer): nothing to distribute",
                    m.experts
                ),
            );
        }
        Ok(())
    }
}
