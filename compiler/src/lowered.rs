//! The lowered plan: what `rcoa compile` hands to executors (`rcoa run`, the
//! cluster emitters). Every `auto` is decided; nothing here is optional
//! guesswork. Serialized as JSON or TOML with serde.

use crate::spec::{
    AdapterSpec, HardwareSpec, ModelSpec, Offload, OptimizerSpec, PrecisionSpec, Spec, Target,
    TrainSpec,
};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Bump when a field changes meaning.
pub const LOWERED_PLAN_VERSION: u32 = 1;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LoweredPlan {
    pub version: u32,
    pub model: ModelSpec,
    pub adapter: Option<AdapterSpec>,
    pub hardware: HardwareSpec,
    pub precision: PrecisionSpec,
    pub optimizer: OptimizerSpec,
    /// `micro_batch` and `grad_accum` here are always `Fixed`; `resolved` repeats them as integers.
    pub train: TrainSpec,
    pub target: Target,
    pub resolved: Resolved,
    pub prediction: Prediction,
}

/// Every value after the passes (the `resolved` object of the JSON contract).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Resolved {
    pub micro_batch: u64,
    pub grad_accum: u64,
    pub data: u64,
    pub zero: u8,
    pub tensor: u64,
    pub pipeline: u64,
    pub context: u64,
    pub expert: u64,
    pub sequence: bool,
    /// `"none"`, `"full"`, `"selective"`, `"every 2"`.
    pub checkpoint: String,
    /// Indices of the layers whose forward is recomputed in the backward pass.
    pub checkpoint_layers: Vec<u64>,
    pub offload: Vec<Offload>,
}

/// What the memory and time models predict for one GPU (the worst rank).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Prediction {
    pub peak_bytes: u64,
    pub budget_bytes: u64,
    pub fits: bool,
    /// Named byte counts at the peak: weights, grads, optimizer, activations, workspace, reserved, ...
    pub breakdown: BTreeMap<String, u64>,
    /// Where the peak happens, e.g. `backward: layer 0 attention`.
    pub peak_at: String,
    pub step_seconds: f64,
    pub tokens_per_second: f64,
}

impl LoweredPlan {
    /// Is layer `i` recomputed in the backward pass?
    pub fn layer_checkpointed(&self, i: u64) -> bool {
        self.resolved.checkpoint_layers.binary_search(&i).is_ok()
    }

    /// The parts of a `Spec` the lowered plan keeps verbatim.
    pub fn from_parts(spec: &Spec, resolved: Resolved, prediction: Prediction) -> Self {
        let mut train = spec.train.clone();
        train.micro_batch = crate::spec::Choice::Fixed(resolved.micro_batch);
        train.grad_accum = crate::spec::Choice::Fixed(resolved.grad_accum);
        LoweredPlan {
            version: LOWERED_PLAN_VERSION,
            model: spec.model.clone(),
            adapter: spec.adapter.clone(),
            hardware: spec.hardware.clone(),
            precision: spec.precision,
            optimizer: spec.optimizer.clone(),
            train,
            target: spec.target,
            resolved,
            prediction,
        }
    }
}
