//! The checkpoint pass: which layers may be recomputed in the backward.
//!
//! `none`, `full` and `every N` are fixed; `auto` lets the search pick, per
//! layout, how many layers of each pipeline stage to recompute (the first
//! `k` of each stage, Megatron's "block" method): memory falls and time
//! rises with `k`, so the search takes the smallest `k` that fits. Where
//! attention keeps its quadratic tensors (no fused kernel), `auto` also
//! tries `selective` as a choice of its own: it lies between none and full
//! in memory but is not one of the block counts (it touches every layer).
//! `selective` recomputes the attention core only (Megatron's selective
//! recomputation): no whole layer is recomputed here; the memory model drops
//! the core's quadratic saved tensors and charges their recompute
//! (`memory::build`, `selective_attention`). `selective_op` is torchtitan's
//! op-level recomputation: every layer recomputed except the outputs of its
//! attention kernel and of every other matmul (`memory::build` marks them
//! [`crate::memory::tape::Tape::kept`]). `auto` never picks it: it is what an
//! engine that runs it is told to do.

use super::{decide, CheckpointDomain, Pass, Plan, Recompute};
use crate::compile::CompileError;
use crate::explain::Decision;
use crate::profile::Profile;
use crate::spec::{CheckpointChoice, Spec};

pub struct Checkpoint {
    choice: CheckpointChoice,
    layers: u64,
    mechanism: &'static str,
    /// Attention saves a `[batch, heads, seq, seq]` tensor per layer: selective recomputation
    /// has something to drop.
    quadratic_attention: bool,
}

impl Checkpoint {
    pub fn new(spec: &Spec, profile: &Profile) -> Self {
        let mechanism = profile.recompute_mechanism();
        Checkpoint {
            choice: spec.fit.checkpoint,
            layers: spec.model.layers,
            mechanism,
            quadratic_attention: !profile.fused(spec.train.attention),
        }
    }
}

impl Pass for Checkpoint {
    fn name(&self) -> &'static str {
        "checkpoint"
    }

    fn run(&self, plan: &mut Plan, log: &mut Vec<Decision>) -> Result<(), CompileError> {
        plan.space.checkpoint = match self.choice {
            CheckpointChoice::None => CheckpointDomain::Fixed(Recompute::Block(0)),
            CheckpointChoice::Full => CheckpointDomain::Fixed(Recompute::Block(self.layers)),
            CheckpointChoice::Every(n) => CheckpointDomain::Fixed(Recompute::Every(n.max(1))),
            CheckpointChoice::Selective => {
                decide(log, self, "checkpoint = selective (attention core recomputed)",
                    "every layer keeps its projections' and MLP's activations but not the attention scores and probabilities, which the backward recomputes (one more q·kᵀ and probs·v per layer)");
                CheckpointDomain::Fixed(Recompute::Selective)
            }
            CheckpointChoice::SelectiveOp => {
                decide(log, self, "checkpoint = selective_op (every layer, keeping its attention kernel's and every other matmul's outputs)",
                    "torchtitan's op-level selective recomputation (`selective_ac_option = \"op\"`): each layer keeps its input and the outputs of the ops in torchtitan's save list — the fused attention kernel (output and log-sum-exp) and the 1st, 3rd, 5th, … `aten.mm` of the layer (a projection with a bias runs `aten.addmm`, not on the list) — and recomputes the rest in its backward; the kept ops are not run again");
                CheckpointDomain::Fixed(Recompute::SelectiveOp)
            }
            CheckpointChoice::Auto if self.quadratic_attention => {
                decide(log, self, "checkpoint ∈ {first k layers of each stage, k = 0 … all; selective}",
                    format!("recomputing a layer frees its saved activations for one more forward of it ({}); selective recomputation drops only the attention scores and probabilities of every layer for one more q·kᵀ and probs·v each; the search takes the fastest that fits", self.mechanism));
                CheckpointDomain::AnyBlock { selective: true }
            }
            CheckpointChoice::Auto => {
                decide(log, self, "checkpoint ∈ first k layers of each stage, k = 0 … all",
                    format!("recomputing a layer frees its saved activations for one more forward of it ({}); the search takes the fewest that fit (selective recomputation is not tried: fused attention saves no scores)", self.mechanism));
                CheckpointDomain::AnyBlock { selective: false }
            }
        };
        Ok(())
    }
}
