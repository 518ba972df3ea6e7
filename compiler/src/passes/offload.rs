//! The offload pass: which sets of tensors the search may move off the GPU.
//!
//! Only what `fit.offload` allows is tried, and never required: every
//! subset of the allowed items is a candidate (the empty one first).
//! `fit.must_offload` items are in every subset; one the plan's engine or the
//! memory model cannot carry out is an error, never dropped.
//! Parameters move only with ZeRO-3 on DeepSpeed (`offload_param`; the Burn
//! executor under any stage); the search skips other stages there. FSDP2 moves
//! parameters, gradients and the optimizer step to the host together
//! (`CPUOffloadPolicy`): its only sets are none or all three
//! (`profile::engines::offload_set_refusal`).
//! Activations (checkpointed layers' inputs, held on the host between the
//! forward and the recompute) are offered for `target burn` only, whose
//! executor moves them and whose tape models the move (`memory::build`,
//! `LayerSpan::offloaded`); for the PyTorch engines the memory model does not
//! model DeepSpeed's `cpu_checkpointing`, and a move it cannot price is not
//! one the compiler may choose. Host and NVMe capacity are checked per
//! candidate by the search. The Burn executor offloads the optimizer (state
//! and update in host memory), the parameters (fp32 shards in host memory,
//! which are the optimizer's master, each unit uploaded before its gather;
//! under any ZeRO stage, sharded only by ZeRO-3;
//! [`crate::profile::BURN_RUNS_ZERO3`]), the gradients (the accumulator
//! beside the host optimizer, each unit's gradient sent down as the backward
//! leaves it: only with the optimizer) and checkpointed activations; nothing
//! else: a plan that needs more runs on an engine that has it (DeepSpeed, via
//! `rcoa emit`) and says `target pytorch`, so its memory is predicted for
//! that runtime.

use super::{decide, Pass, Plan};
use crate::compile::CompileError;
use crate::explain::Decision;
use crate::spec::{HardwareSpec, Offload as Item, OffloadTo, OffloadWhat, Target};

pub struct Offload<'a> {
    allowed: &'a [Item],
    /// `fit.must_offload`: in every set.
    required: &'a [Item],
    hardware: &'a HardwareSpec,
    target: Target,
}

impl<'a> Offload<'a> {
    pub fn new(allowed: &'a [Item], hardware: &'a HardwareSpec, target: Target) -> Self {
        Offload {
            allowed,
            required: &[],
            hardware,
            target,
        }
    }

    /// What must be offloaded (`fit.must_offload`): every candidate has it.
    pub fn required(mut self, required: &'a [Item]) -> Self {
        self.required = required;
        self
    }

    /// A required item the plan's engine cannot carry out, or the memory model cannot
    /// price, is an error: dropping it would not be the plan.
    fn check_required(&self, plan: &Plan) -> Result<(), CompileError> {
        for o in self.required {
            if self.target == Target::Burn && !burn_executes(o) {
                return Err(CompileError::NotExecuted {
                    what: format!("`rcoa run` does not execute `must_offload = [{o}]` (the plan is `target burn`)"),
                    help: "it offloads the optimizer state and update, the parameters, the gradients and checkpointed activations, to host \
                           memory only: require them `:cpu`; or write `target pytorch` for DeepSpeed's NVMe offload (`rcoa emit`)".into(),
                });
            }
            if self.target == Target::Burn && o.what == OffloadWhat::Activations {
                if let Some(why) = moves_no_activation(plan) {
                    return Err(CompileError::Inconsistent {
                        what: format!("`must_offload = [{o}]` moves checkpointed layers' inputs, but {why}"),
                        help: "write `checkpoint = full`, `every N` or `auto` (the first layer's input, the embedding's \
                               output, stays on the device)"
                            .into(),
                    });
                }
                continue;
            }
            if o.what == OffloadWhat::Activations {
                return Err(CompileError::Unsupported {
                    feature: format!("`must_offload = [{o}]`"),
                    help: "moving activations to the host is not modelled; `checkpoint` covers the same memory".into(),
                });
            }
            if o.what == OffloadWhat::Params
                && self.target != Target::Burn
                && !plan.space.zero.contains(&3)
            {
                return Err(CompileError::Inconsistent {
                    what: format!("`must_offload = [{o}]` needs ZeRO-3, but the plan's `zero` excludes it"),
                    help: if self.target == Target::Fsdp {
                        "rcoa prices FSDP2's CPUOffloadPolicy with reshard_after_forward=True: write `zero = 3` or `auto`"
                    } else {
                        "DeepSpeed offloads parameters only under ZeRO-3 (`offload_param`): write `zero = 3` or `auto`"
                    }
                    .into(),
                });
            }
        }
        Ok(())
    }
}

/// Does the Burn executor carry out `o`? The optimizer, the parameters (when it runs
/// ZeRO-3), the gradients (beside the optimizer: [`crate::profile::engines::offload_set_refusal`]) and
/// checkpointed activations, each to host memory.
fn burn_executes(o: &Item) -> bool {
    o.to == OffloadTo::Cpu
        && match o.what {
            OffloadWhat::Optimizer | OffloadWhat::Activations | OffloadWhat::Grads => true,
            OffloadWhat::Params => crate::profile::BURN_RUNS_ZERO3,
        }
}

/// Why `offload = [activations]` would move nothing on the Burn executor, if it would
/// not: it moves the inputs of checkpointed layers past the first (the first's input is
/// the embedding's output, which the embedding's backward keeps on the device).
fn moves_no_activation(plan: &Plan) -> Option<&'static str> {
    use super::{CheckpointDomain, Recompute};
    match plan.space.checkpoint {
        CheckpointDomain::Fixed(Recompute::Block(k)) if k <= 1 => {
            Some("the plan recomputes no layer past the first")
        }
        CheckpointDomain::Fixed(Recompute::Selective) => {
            Some("`checkpoint = selective` recomputes no layer whole")
        }
        _ => None,
    }
}

impl Pass for Offload<'_> {
    fn name(&self) -> &'static str {
        "offload"
    }

    fn run(&self, plan: &mut Plan, log: &mut Vec<Decision>) -> Result<(), CompileError> {
        self.check_required(plan)?;
        let mut items: Vec<Item> = self.required.to_vec();
        let burn = self.target == Target::Burn;
        for o in self.allowed {
            if self.required.contains(o) {
                continue;
            }
            // The Burn executor moves the optimizer state and its update to host
            // memory (`backend/src/shard`), the parameters when it runs ZeRO-3, and
            // checkpointed layers' inputs (`backend/src/train.rs`).
            if burn && !burn_executes(o) {
                let why = if crate::profile::BURN_RUNS_ZERO3 {
                    "the Burn executor offloads the optimizer state and update, the parameters, the gradients and \
                     checkpointed activations, to host memory only; NVMe offload runs on DeepSpeed (`rcoa emit`, `target pytorch`)"
                } else {
                    "the Burn executor offloads the optimizer state and update, and checkpointed activations, to host \
                     memory only; parameter, gradient and NVMe offload run on DeepSpeed (`rcoa emit`, `target pytorch`)"
                };
                decide(log, self, format!("{o} not used"), why);
                continue;
            }
            if let Some(why) = crate::profile::engines::offload_refusal(self.target, o) {
                decide(log, self, format!("{o} not used"), why);
                continue;
            }
            if burn && o.what == OffloadWhat::Activations {
                if let Some(why) = moves_no_activation(plan) {
                    decide(
                        log,
                        self,
                        format!("{o} not used"),
                        format!("nothing to move: {why}"),
                    );
                    continue;
                }
            } else if o.what == OffloadWhat::Activations {
                decide(log, self, format!("{o} not used"),
                    "moving activations to the host is not modelled by the memory model; checkpointing covers the same memory");
                continue;
            }
            items.push(*o);
        }
        let mut sets: Vec<Vec<Item>> = Vec::new();
        for mask in 0u32..(1 << items.len()) {
            let set: Vec<Item> = items
                .iter()
                .enumerate()
                .filter(|(i, _)| mask & (1 << i) != 0)
                .map(|(_, o)| *o)
                .collect();
            // One place per tensor kind; every required item.
            let mut whats: Vec<OffloadWhat> = set.iter().map(|o| o.what).collect();
            whats.sort();
            whats.dedup();
            if whats.len() == set.len()
                && self.required.iter().all(|r| set.contains(r))
                && crate::profile::engines::offload_set_refusal(self.target, &set).is_none()
            {
                let mut set = set;
                set.sort();
                sets.push(set);
            }
        }
        if !items.is_empty() && sets.iter().all(|s| s.is_empty()) {
            if let Some(why) = crate::profile::engines::offload_set_refusal(self.target, &items) {
                if !self.required.is_empty() {
                    return Err(CompileError::Inconsistent {
                        what: format!(
                            "`must_offload` cannot be carried out by `target {}`: {why}",
                            self.target.as_str()
                        ),
                        help: if self.target == Target::Burn {
                            "write `must_offload = [optimizer, grads]` (each to cpu)"
                        } else {
                            "write `must_offload = [optimizer, params, grads]` (each to cpu)"
                        }
                        .into(),
                    });
                }
                decide(log, self, "offload = []", why);
            }
        }
        sets.sort_by_key(|s| s.len());
        if !self.required.is_empty() {
            decide(
                log,
                self,
                format!(
                    "offload ⊇ [{}]",
                    self.required
                        .iter()
                        .map(|o| o.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                "required by the plan (`must_offload`): every candidate moves it off the GPU, whether or not the plan would fit without",
            );
        }
        // What the search may add to the required items.
        let optional: Vec<&Item> = items
            .iter()
            .filter(|o| !self.required.contains(o))
            .collect();
        if !optional.is_empty() {
            let host = match self.hardware.host_memory_bytes {
                Some(b) => format!(
                    "{:.0} GiB of host memory per node",
                    b as f64 / (1u64 << 30) as f64
                ),
                None => "host memory not given: capacity not checked".to_string(),
            };
            decide(
                log,
                self,
                format!(
                    "offload ⊆ [{}]",
                    items
                        .iter()
                        .map(|o| o.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
                format!(
                    "allowed by the plan, used only when it pays: {} subsets; {host}",
                    sets.len()
                ),
            );
        }
        plan.space.offload = sets;
        Ok(())
    }
}
