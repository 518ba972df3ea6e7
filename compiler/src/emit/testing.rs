//! A small builder of [`LoweredPlan`]s for emitter tests.
//!
//! The emitters read only a lowered plan, so their tests build one directly
//! instead of going through the resolver and the passes: the builder starts
//! from a realistic plan (Llama 3.1 8B on one node of eight H100s, bf16 with
//! an fp32 master copy, AdamW, ZeRO-3) and each setter changes one decision.
//! `build` keeps the plan's own promises — data × tensor × pipeline × context
//! equals the GPU count, micro_batch × grad_accum × data equals global_batch
//! — so a test changes exactly what it names. Not for production use.

use crate::lowered::{LoweredPlan, Prediction, Resolved};
use crate::spec::*;
use crate::testing::SpecBuilder;
use std::collections::BTreeMap;

/// Builds a [`LoweredPlan`] one decision at a time.
#[derive(Clone, Debug)]
pub struct PlanBuilder {
    spec: Spec,
    zero: u8,
    tensor: u64,
    pipeline: u64,
    context: u64,
    expert: u64,
    sequence: bool,
    micro_batch: u64,
    checkpoint: String,
    checkpoint_layers: Vec<u64>,
    offload: Vec<Offload>,
    virtual_stages: u64,
    step_seconds: f64,
}

impl PlanBuilder {
    /// Llama 3.1 8B, 1 node x 8 h100-80gb, bf16 (fp32 master), AdamW, seq 4096,
    /// global batch 256, micro-batch 4, ZeRO-3, no checkpointing, no offload.
    pub fn llama_8b() -> Self {
        let spec = SpecBuilder::new()
            .model_name("llama-3.1-8b")
            .layers(32)
            .hidden(4096)
            .heads(32, 8)
            .head_dim(128)
            .ffn(14336)
            .vocab(128_256)
            .max_positions(131_072)
            .gpu_memory(80 * 1_000_000_000)
            .gpu_tflops(989.0)
            .nodes(1, 8)
            .host_memory(Some(2_000_000_000_000))
            .precision(Dtype::Bf16, Dtype::Bf16, Some(Dtype::Fp32))
            .lr(2e-5)
            .weight_decay(0.1)
            .optimizer_impl(OptImpl::Fused)
            .seq_len(4096)
            .global_batch(256)
            .micro_batch(Choice::Auto)
            .grad_accum(Choice::Auto)
            .steps(Some(1000))
            .data(Choice::Auto)
            .zero(Choice::Auto)
            .budget(Budget::Fraction(0.95))
            .checkpoint(CheckpointChoice::Auto)
            .build();
        PlanBuilder {
            spec,
            zero: 3,
            tensor: 1,
            pipeline: 1,
            context: 1,
            expert: 1,
            sequence: false,
            micro_batch: 4,
            checkpoint: "none".into(),
            checkpoint_layers: vec![],
            offload: vec![],
            virtual_stages: 1,
            step_seconds: 2.5,
        }
    }

    /// `nodes` nodes of `gpus_per_node` GPUs.
    pub fn nodes(mut self, nodes: u64, gpus_per_node: u64) -> Self {
        self.spec.hardware.nodes = nodes;
        self.spec.hardware.gpus_per_node = gpus_per_node;
        self
    }
    pub fn zero(mut self, stage: u8) -> Self {
        self.zero = stage;
        self
    }
    pub fn tensor(mut self, degree: u64) -> Self {
        self.tensor = degree;
        self
    }
    pub fn pipeline(mut self, degree: u64) -> Self {
        self.pipeline = degree;
        self
    }
    /// Model chunks per pipeline rank (interleaved 1F1B).
    pub fn virtual_stages(mut self, v: u64) -> Self {
        self.virtual_stages = v;
        self
    }
    /// Each parameter's optimizer step in the backward.
    pub fn in_backward(mut self, on: bool) -> Self {
        self.spec.optimizer_in_backward = on;
        self
    }
    /// The engine the prediction is for.
    pub fn target(mut self, target: Target) -> Self {
        self.spec.target = target;
        self
    }
    pub fn context(mut self, degree: u64) -> Self {
        self.context = degree;
        self
    }
    pub fn expert(mut self, degree: u64) -> Self {
        self.expert = degree;
        self
    }
    pub fn sequence(mut self, on: bool) -> Self {
        self.sequence = on;
        self
    }
    pub fn micro_batch(mut self, m: u64) -> Self {
        self.micro_batch = m;
        self
    }
    pub fn global_batch(mut self, g: u64) -> Self {
        self.spec.train.global_batch = g;
        self
    }
    pub fn steps(mut self, steps: Option<u64>) -> Self {
        self.spec.train.steps = steps;
        self
    }
    pub fn step_seconds(mut self, s: f64) -> Self {
        self.step_seconds = s;
        self
    }
    /// Things the compiler decided to move off the GPU, e.g. `("optimizer", "cpu")`.
    pub fn offload(mut self, what: OffloadWhat, to: OffloadTo) -> Self {
        self.offload.push(Offload { what, to });
        self.offload.sort();
        self.offload.dedup();
        self
    }
    pub fn precision(mut self, params: Dtype, compute: Dtype, master: Option<Dtype>) -> Self {
        self.spec.precision = PrecisionSpec {
            params,
            compute,
            master,
            grads: params,
            autocast: false,
        };
        self
    }
    pub fn grads(mut self, dtype: Dtype) -> Self {
        self.spec.precision.grads = dtype;
        self
    }
    pub fn optimizer(mut self, kind: OptimizerKind) -> Self {
        self.spec.optimizer.kind = kind;
        self
    }
    pub fn optimizer_state(mut self, dtype: Dtype) -> Self {
        self.spec.optimizer.state = dtype;
        self
    }
    pub fn nvme(mut self, bytes: Option<u64>) -> Self {
        self.spec.hardware.nvme_bytes = bytes;
        self
    }
    pub fn experts(mut self, experts: u64, per_token: u64) -> Self {
        self.spec.model.experts = experts;
        self.spec.model.experts_per_token = per_token;
        self
    }
    pub fn lora(mut self, kind: AdapterKind, rank: u64) -> Self {
        self.spec.adapter = Some(AdapterSpec {
            kind,
            rank,
            alpha: 2.0 * rank as f64,
            targets: vec![Proj::Q, Proj::K, Proj::V, Proj::O],
            dropout: 0.05,
            base: if kind == AdapterKind::Qlora {
                Dtype::Nf4
            } else {
                self.spec.precision.params
            },
        });
        self
    }
    /// Recompute every layer.
    pub fn checkpoint_full(mut self) -> Self {
        self.checkpoint = "full".into();
        self.checkpoint_layers = (0..self.spec.model.layers).collect();
        self
    }
    /// Recompute every `n`th layer.
    pub fn checkpoint_every(mut self, n: u64) -> Self {
        self.checkpoint = format!("every {n}");
        self.checkpoint_layers = (0..self.spec.model.layers)
            .step_by(n.max(1) as usize)
            .collect();
        self
    }
    /// Recompute attention internals of every layer.
    pub fn checkpoint_selective(mut self) -> Self {
        self.checkpoint = "selective".into();
        self.checkpoint_layers = (0..self.spec.model.layers).collect();
        self
    }

    /// The lowered plan, with data = GPUs / (tensor x pipeline x context) and
    /// grad_accum = global_batch / (micro_batch x data) (global_batch rounded
    /// down to a multiple of micro_batch x data when it is not one).
    pub fn build(mut self) -> LoweredPlan {
        let gpus = self.spec.hardware.gpus_per_node * self.spec.hardware.nodes;
        let model_parallel = (self.tensor * self.pipeline * self.context).max(1);
        let data = (gpus / model_parallel).max(1);
        let per_accum = self.micro_batch.max(1) * data;
        let grad_accum = (self.spec.train.global_batch / per_accum).max(1);
        self.spec.train.global_batch = grad_accum * per_accum;
        let resolved = Resolved {
            micro_batch: self.micro_batch,
            grad_accum,
            data,
            zero: self.zero,
            tensor: self.tensor,
            pipeline: self.pipeline,
            context: self.context,
            expert: self.expert,
            sequence: self.sequence,
            checkpoint: self.checkpoint,
            checkpoint_layers: self.checkpoint_layers,
            offload: self.offload,
            virtual_stages: self.virtual_stages,
            optimizer_in_backward: self.spec.optimizer_in_backward,
        };
        let tokens = (self.spec.train.global_batch * self.spec.train.seq_len) as f64;
        let prediction = Prediction {
            peak_bytes: 60_000_000_000,
            budget_bytes: 76_000_000_000,
            fits: true,
            breakdown: BTreeMap::from([
                ("weights".to_string(), 2_000_000_000),
                ("activations".to_string(), 40_000_000_000),
            ]),
            peak_at: "backward: layer 0 attention".into(),
            step_seconds: self.step_seconds,
            tokens_per_second: tokens / self.step_seconds,
            in_use_max_bytes: 60_000_000_000,
        };
        LoweredPlan::from_parts(&self.spec, resolved, prediction)
    }
}
