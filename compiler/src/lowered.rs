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
    /// Model chunks per pipeline rank (`parallel.virtual_stages`, Megatron's interleaved
    /// 1F1B); 1: the plain schedule. The memory model held `in_flight` chunk forwards of
    /// activations per rank by it, and the bubble it priced is `(pipeline − 1) / v`: an
    /// executor that runs plain 1F1B instead holds more.
    #[serde(default = "one")]
    pub virtual_stages: u64,
    /// Each parameter's optimizer step runs in the backward, as soon as its gradient is
    /// complete, and the gradient is freed (`optimizer.in_backward`, torchtune's
    /// `optimizer_in_bwd`); `grad_accum` is then 1. The prediction holds no full set of
    /// gradients: an executor that steps after the backward holds them all.
    #[serde(default)]
    pub optimizer_in_backward: bool,
}

fn one() -> u64 {
    1
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
    /// The highest bytes in use at any op, the transients inside the segments the executor
    /// samples at included (`MemoryReport::in_use_max_bytes`): what the allocator's pages
    /// grow to cover, beside `peak_bytes`, which `rcoa run` measures. 0 in a plan lowered
    /// before it was recorded.
    #[serde(default)]
    pub in_use_max_bytes: u64,
}

/// Where a kind of persistent state lives between its uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Place {
    Device,
    Host,
}

/// Which tensors each rank holds, sharded, gathered or offloaded, and when: what the
/// memory model charged for the resolved plan, for the executor to follow. Derived from
/// `resolved` and the profile's constants (so it needs no field of its own in the JSON an
/// older executor reads): [`LoweredPlan::residency`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Residency {
    /// Weights at rest: every rank keeps `1/weight_shards` of every unit (ZeRO-3), in the
    /// storage dtype, at `weights` (`host`: parameter offload).
    pub weight_shards: u64,
    pub weights: Place,
    /// The fp32 master copy of 16-bit weights (None without one): `1/optimizer_shards`
    /// of it per rank.
    pub master: Option<Place>,
    /// Optimizer state: `1/optimizer_shards` per rank.
    pub optimizer_shards: u64,
    pub optimizer_state: Place,
    /// The fp32 gradient accumulator between micro-steps: `1/grad_shards` per rank.
    pub grad_shards: u64,
    pub grad_accumulator: Place,
    /// Units gathered whole for their use (ZeRO-3 or parameter offload), forward order;
    /// empty when every rank keeps the whole model on the device.
    pub units: Vec<UnitResidency>,
    /// Units gathered ahead of the running one (`profile::ZERO3_PREFETCH_UNITS`).
    pub prefetch_units: u64,
    /// Offloaded shards are uploaded through one device buffer of the largest unit's size.
    pub staging_buffer: bool,
    /// Layers whose input goes to host memory after their forward and comes back right
    /// before their recompute (`offload = [activations]`): the checkpointed layers but the
    /// first, whose input is the embedding's output, kept on the device by its backward.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub inputs_on_host: Vec<u64>,
}

/// One unit of [`Residency::units`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitResidency {
    /// `embedding`, `layer` (with `layer`) or `head` (a tied head gathers the embedding's
    /// table again).
    pub name: String,
    pub layer: Option<u64>,
    /// Gathered right before its forward; `true`: freed right after it (a checkpointed
    /// layer, whose forward runs without a graph) and gathered again before its
    /// recompute in the backward; `false`: kept (by its autodiff graph) until its backward.
    pub regathered_for_backward: bool,
}

impl Resolved {
    /// The `offload` entries as the plan writes them (`optimizer:cpu`), in order.
    pub fn offload_names(&self) -> Vec<String> {
        self.offload.iter().map(|o| o.to_string()).collect()
    }
}

impl LoweredPlan {
    /// Is layer `i` recomputed in the backward pass?
    pub fn layer_checkpointed(&self, i: u64) -> bool {
        self.resolved.checkpoint_layers.binary_search(&i).is_ok()
    }

    /// Where every kind of persistent state lives, and which units are gathered when.
    pub fn residency(&self) -> Residency {
        use crate::spec::OffloadWhat;
        let r = &self.resolved;
        let d = r.data.max(1);
        let has = |w: OffloadWhat| r.offload.iter().any(|o| o.what == w);
        let burn = self.target == Target::Burn;
        // FSDP2 shards weights and gradients under `zero = 2` too (it only keeps each unit
        // gathered until its backward: `memory::fsdp`).
        let fsdp = self.target == Target::Fsdp;
        let zero3 = (r.zero >= 3 || fsdp) && d > 1;
        // `backend/src/shard/zero3.rs` runs units for ZeRO-3 on any number of ranks, and
        // for parameter or gradient offload.
        let units = burn && (r.zero >= 3 || has(OffloadWhat::Params) || has(OffloadWhat::Grads));
        let place = |host: bool| if host { Place::Host } else { Place::Device };
        // `memory::burn_host_grad_accumulator`: ZeRO-3 on one rank without parameter
        // offload keeps the accumulator on the device (so does the executor).
        let host_acc = burn
            && ((zero3 || has(OffloadWhat::Params)) && crate::profile::ZERO3_HOST_GRAD_ACCUMULATOR
                || has(OffloadWhat::Grads))
            && has(OffloadWhat::Optimizer);
        let master = self
            .precision
            .master
            .filter(|m| m.bytes() > self.precision.params.bytes())
            .map(|_| place(has(OffloadWhat::Optimizer) || (units && has(OffloadWhat::Params))));
        let mut list = Vec::new();
        if units {
            list.push(UnitResidency {
                name: "embedding".into(),
                layer: None,
                regathered_for_backward: false,
            });
            for i in 0..self.model.layers {
                list.push(UnitResidency {
                    name: "layer".into(),
                    layer: Some(i),
                    regathered_for_backward: self.layer_checkpointed(i),
                });
            }
            list.push(UnitResidency {
                name: "head".into(),
                layer: None,
                regathered_for_backward: false,
            });
        }
        Residency {
            weight_shards: if zero3 { d } else { 1 },
            weights: place(has(OffloadWhat::Params)),
            master,
            optimizer_shards: if r.zero >= 1 { d } else { 1 },
            optimizer_state: place(has(OffloadWhat::Optimizer)),
            grad_shards: if (units && r.zero >= 1) || (!burn && (r.zero >= 2 || fsdp)) {
                d
            } else {
                1
            },
            grad_accumulator: place(host_acc || has(OffloadWhat::Grads)),
            units: list,
            // Units read in place (gradient offload alone) have nothing to prefetch.
            prefetch_units: if units && (r.zero >= 3 || has(OffloadWhat::Params)) {
                crate::profile::ZERO3_PREFETCH_UNITS as u64
            } else {
                0
            },
            staging_buffer: units && has(OffloadWhat::Params),
            inputs_on_host: if burn && has(OffloadWhat::Activations) {
                r.checkpoint_layers
                    .iter()
                    .copied()
                    .filter(|&l| l > 0)
                    .collect()
            } else {
                Vec::new()
            },
        }
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
