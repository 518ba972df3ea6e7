//! The precision pass: the dtypes of weights, gradients, master copy and
//! optimizer state, and what each costs per GPU before any sharding.
//!
//! Precision is never `auto` in the DSL, so this pass narrows nothing; it
//! records the bytes per parameter the later passes and the search trade
//! against (e.g. "fp32 master copy: +29.92 GiB"), counted arithmetically
//! from the architecture (the memory model's tape counts the same tensors).

use super::{decide, gib, Pass, Plan};
use crate::compile::CompileError;
use crate::explain::Decision;
use crate::memory::parallel::model_params;
use crate::spec::{
    AdapterSpec, Dtype, ModelSpec, OptimizerKind, OptimizerSpec, PrecisionSpec, Target,
};

pub struct Precision<'a> {
    precision: &'a PrecisionSpec,
    optimizer: &'a OptimizerSpec,
    model: &'a ModelSpec,
    adapter: Option<&'a AdapterSpec>,
}

impl<'a> Precision<'a> {
    pub fn new(
        precision: &'a PrecisionSpec,
        optimizer: &'a OptimizerSpec,
        model: &'a ModelSpec,
        adapter: Option<&'a AdapterSpec>,
    ) -> Self {
        Precision {
            precision,
            optimizer,
            model,
            adapter,
        }
    }

    /// What the Burn executor steps per parameter with Burn's optimizer on the device, not
    /// with the flat optimizer of ZeRO and of the host (`target burn`): 8-bit Adam
    /// (`backend/src/optim/adam8bit.rs`: bitsandbytes quantizes each parameter's moments on
    /// their own, in blocks of 256 from its first value, which a flat shard would cut
    /// across), Adafactor and Adam-mini (a second moment per matrix row and column, per head
    /// or neuron), and the step in the backward (`backend/src/in_backward.rs`: each unit steps
    /// as the backward leaves it, where the flat shards step after the backward). So `zero =
    /// 0` and nothing offloaded but checkpointed activations; a plan that requires more is
    /// refused, as `rcoa run` would refuse it.
    pub fn narrow_executed(
        &self,
        target: Target,
        in_backward: bool,
        plan: &mut Plan,
        log: &mut Vec<Decision>,
    ) -> Result<(), CompileError> {
        if target != Target::Burn {
            return Ok(());
        }
        // (what the error names, what the decisions name, why, what the plan may say instead)
        let (subject, label, why, instead) = if self.optimizer.kind == OptimizerKind::Adam8bit {
            (
                "`optimizer adam8bit`",
                "adam8bit",
                "the Burn executor steps 8-bit Adam per parameter (its moments quantized in blocks of 256 within \
                 each parameter, as bitsandbytes), which ZeRO's flat shards would cut across",
                "`optimizer adamw` with ZeRO and offload",
            )
        } else if self.optimizer.kind == OptimizerKind::Adafactor {
            (
                "`optimizer adafactor`",
                "adafactor",
                "the Burn executor steps Adafactor per parameter (each matrix's second moment factored into a mean \
                 per row and per column), which ZeRO's flat shards would cut across",
                "`optimizer adamw` with ZeRO and offload",
            )
        } else if self.optimizer.kind == OptimizerKind::AdamMini {
            (
                "`optimizer adam-mini`",
                "adam-mini",
                "the Burn executor steps Adam-mini per parameter (one second moment per attention head, neuron or \
                 token), which ZeRO's flat shards would cut across",
                "`optimizer adamw` with ZeRO and offload",
            )
        } else if in_backward {
            (
                "the optimizer step in the backward (`optimizer.in_backward = true`)",
                "the step in the backward",
                "the Burn executor steps each unit as the backward leaves it with the optimizer on the device; \
                 ZeRO's and the host optimizer's flat shards step after the backward",
                "no `in_backward` with ZeRO and offload",
            )
        } else {
            return Ok(());
        };
        let refused = |what: String| {
            CompileError::NotExecuted {
            what: format!("`rcoa run` does not execute {subject} with {what} (the plan is `target burn`)"),
            help: format!(
                "{why}: write `zero = 0` and offload nothing but activations, or {instead}; or `target pytorch` (`rcoa emit`)"
            ),
        }
        };
        let space = &mut plan.space;
        if space.zero.iter().any(|z| *z > 0) {
            if !space.zero.contains(&0) {
                return Err(refused(format!("zero = {:?}", space.zero)));
            }
            space.zero.retain(|z| *z == 0);
            decide(log, self, format!("zero = 0 for {label}"), why);
        }
        if space.drop_offload_sets(|o| o.what != crate::spec::OffloadWhat::Activations) {
            if space.offload.is_empty() {
                return Err(refused(
                    "the optimizer, parameters or gradients offloaded".into(),
                ));
            }
            decide(
                log,
                self,
                format!("optimizer, params and grads offload not used for {label}"),
                format!("{why}; the optimizer stays on the device"),
            );
        }
        Ok(())
    }

    /// Optimizer state tensors per trainable parameter, and their dtype.
    fn state(&self) -> (f64, Dtype) {
        let o = self.optimizer;
        let p = self.precision;
        let dtype = match (o.kind, p.master) {
            (OptimizerKind::Adam8bit, _) => Dtype::Int8,
            (_, Some(m)) if o.state.bytes() >= m.bytes() => m,
            (_, None) if o.state.bytes() >= p.params.bytes() => p.params,
            _ => o.state,
        };
        let copies = match o.kind {
            OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Adam8bit => 2.0,
            OptimizerKind::Lion | OptimizerKind::AdamMini => 1.0,
            OptimizerKind::Sgd if o.momentum > 0.0 => 1.0,
            OptimizerKind::Sgd => 0.0,
            // Factored second moment: rows + columns, negligible next to the weights.
            OptimizerKind::Adafactor => 0.0,
        };
        (copies, dtype)
    }
}

impl Pass for Precision<'_> {
    fn name(&self) -> &'static str {
        "precision"
    }

    fn run(&self, _plan: &mut Plan, log: &mut Vec<Decision>) -> Result<(), CompileError> {
        let p = self.precision;
        let total = model_params(self.model) as f64;
        let trainable = match self.adapter {
            None => total,
            Some(a) => super::adapter::adapter_params(self.model, a) as f64,
        };
        let weight_dtype = match self.adapter {
            Some(a) if a.base == Dtype::Nf4 => Dtype::Nf4,
            _ => p.params,
        };
        decide(
            log,
            self,
            format!(
                "weights {}: {}",
                weight_dtype.as_str(),
                gib(total * weight_dtype.bytes())
            ),
            format!(
                "{:.3} B parameters × {} B, before sharding",
                total / 1e9,
                weight_dtype.bytes()
            ),
        );
        decide(
            log,
            self,
            format!(
                "gradients {}: +{}",
                p.grads.as_str(),
                gib(trainable * p.grads.bytes())
            ),
            format!(
                "{:.3} B trainable parameters × {} B",
                trainable / 1e9,
                p.grads.bytes()
            ),
        );
        match p.master {
            Some(m) if m.bytes() > p.params.bytes() => decide(
                log,
                self,
                format!("{} master copy: +{}", m.as_str(), gib(trainable * m.bytes())),
                format!(
                    "the optimizer updates {} copies of the {} weights ({} B per trainable parameter)",
                    m.as_str(),
                    p.params.as_str(),
                    m.bytes()
                ),
            ),
            _ => decide(
                log,
                self,
                "no master copy: +0 GiB",
                format!("the optimizer updates the {} weights in place", p.params.as_str()),
            ),
        }
        let (copies, dtype) = self.state();
        decide(
            log,
            self,
            format!(
                "{} state {} × {}: +{}",
                self.optimizer.kind.as_str(),
                copies,
                dtype.as_str(),
                gib(trainable * copies * dtype.bytes())
            ),
            "per trainable parameter; ZeRO ≥ 1 divides it by the data-parallel degree, offload moves it to the host",
        );
        Ok(())
    }
}
