//! The checkpoint pass: which layers may be recomputed in the backward.
//!
//! `none`, `full` and `every N` are fixed; `auto` lets the search pick, per
//! layout, how many layers of each pipeline stage to recompute (the first
//! `k` of each stage, Megatron's "block" method): memory falls and time
//! rises with `k`, so the search takes the smallest `k` that fits.
//! `selective` recomputes the attention core only (Megatron's selective
//! recomputation): no whole layer is recomputed here; the memory model drops
//! the core's quadratic saved tensors and charges their recompute
//! (`memory::build`, `selective_attention`).

use super::{decide, CheckpointDomain, Pass, Plan, Recompute};
use crate::compile::CompileError;
use crate::explain::Decision;
use crate::profile::Profile;
use crate::spec::CheckpointChoice;

pub struct Checkpoint {
    choice: CheckpointChoice,
    layers: u64,
    mechanism: &'static str,
}

impl Checkpoint {
    pub fn new(choice: CheckpointChoice, layers: u64, profile: &Profile) -> Self {
        let mechanism = match profile.name {
            "pytorch" => "per-layer non-reentrant torch.utils.checkpoint",
            _ => "rcoa's per-layer segment recomputation",
        };
        Checkpoint {
            choice,
            layers,
            mechanism,
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
                CheckpointDomain::Fixed(Recompute::Block(0))
            }
            CheckpointChoice::Auto => {
                decide(log, self, "checkpoint ∈ first k layers of each stage, k = 0 … all",
                    format!("recomputing a layer frees its saved activations for one more forward of it ({}); the search takes the fewest that fit", self.mechanism));
                CheckpointDomain::AnyBlock
            }
        };
        Ok(())
    }
}
