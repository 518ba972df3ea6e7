//! The adapter pass: with LoRA/QLoRA the base stays frozen and only the
//! adapters train, so gradients and optimizer state shrink to the adapters'
//! parameters. Records the trainable count and the bytes it saves; narrows
//! nothing (ZeRO and offload still apply, to far fewer bytes).

use super::{decide, gib, Pass, Plan};
use crate::compile::CompileError;
use crate::explain::Decision;
use crate::memory::parallel::model_params;
use crate::spec::{AdapterKind, AdapterSpec, Arch, ModelSpec, OffloadWhat, Proj, Target};

pub struct Adapter<'a> {
    adapter: Option<&'a AdapterSpec>,
    model: &'a ModelSpec,
}

/// Trainable parameters of `a` on `m`: rank × (in + out) per adapted projection per layer.
pub fn adapter_params(m: &ModelSpec, a: &AdapterSpec) -> u64 {
    let (h, q, kv, ffn) = (
        m.hidden,
        m.heads * m.head_dim,
        m.kv_heads * m.head_dim,
        m.ffn,
    );
    let per_layer: u64 = a
        .targets
        .iter()
        .map(|p| match p {
            Proj::Q => h + q,
            Proj::K | Proj::V => h + kv,
            Proj::O => q + h,
            Proj::Gate | Proj::Up | Proj::Down => h + ffn,
        })
        .sum();
    // Encoders' `dense` suffix also adapts the MLP (see the memory model's profile).
    let extra = if m.arch == Arch::Encoder && a.targets.contains(&Proj::O) {
        2 * (h + ffn)
    } else {
        0
    };
    m.layers * a.rank * (per_layer + extra)
}

impl<'a> Adapter<'a> {
    pub fn new(adapter: Option<&'a AdapterSpec>, model: &'a ModelSpec) -> Self {
        Adapter { adapter, model }
    }
}

impl Adapter<'_> {
    /// The Burn executor shards a QLoRA base (packed NF4, no float parameter) under ZeRO-3
    /// but never moves it to host memory (`backend/src/shard/zero3.rs`,
    /// `refuse_quantized_base`). Run after offload has set its domain: drops the candidates
    /// that would charge the base on the host, and refuses a plan that leaves no other.
    pub fn narrow_executed(
        &self,
        target: Target,
        plan: &mut Plan,
        log: &mut Vec<Decision>,
    ) -> Result<(), CompileError> {
        if target != Target::Burn || !self.adapter.is_some_and(|a| a.kind == AdapterKind::Qlora) {
            return Ok(());
        }
        let space = &mut plan.space;
        // The executor shards the NF4 base under ZeRO-3, but the charge for it is unchecked
        // on a GPU and the CPU measured the step above it (docs/distributed.md): `auto`
        // does not pick it; a plan that writes `zero = 3` gets it, told so.
        let several_ranks = space.layouts.iter().all(|l| l.data > 1);
        if several_ranks && space.zero.contains(&3) {
            if space.zero.len() > 1 {
                space.zero.retain(|z| *z != 3);
                decide(log, self, "zero = 3 not chosen for QLoRA",
                    "the Burn executor shards the NF4 base under ZeRO-3, but that memory is not yet checked on a GPU \
                     (on the CPU the step measured above the prediction): write `zero = 3` to use it");
            } else {
                decide(log, self, "zero = 3 with QLoRA (unchecked)",
                    "the NF4 base is sharded and gathered per layer; this prediction is not yet checked on a GPU \
                     and the CPU measured the step above it: leave headroom");
            }
        }
        if space.drop_offload_sets(|o| o.what == OffloadWhat::Params) {
            if space.offload.is_empty() {
                return Err(CompileError::NotExecuted {
                    what: "`rcoa run` does not execute QLoRA with the parameters offloaded (the plan is `target burn`)".into(),
                    help: "the Burn executor keeps the NF4 base on the device (sharded with ZeRO-3); offload the \
                           optimizer only (`offload = [optimizer]`), or write `target pytorch` to predict it for \
                           PyTorch engines (`rcoa emit`)"
                        .into(),
                });
            }
            decide(
                log,
                self,
                "params:cpu not used",
                "the Burn executor does not offload QLoRA's NF4 base: it stays on the device",
            );
        }
        Ok(())
    }
}

impl Pass for Adapter<'_> {
    fn name(&self) -> &'static str {
        "adapter"
    }

    fn run(&self, _plan: &mut Plan, log: &mut Vec<Decision>) -> Result<(), CompileError> {
        let total = model_params(self.model) as f64;
        match self.adapter {
            None => decide(
                log,
                self,
                "full fine-tuning",
                format!(
                    "all {:.3} B parameters train: each has a gradient and optimizer state",
                    total / 1e9
                ),
            ),
            Some(a) => {
                let n = adapter_params(self.model, a) as f64;
                decide(
                    log,
                    self,
                    format!(
                        "{:?} rank {} on [{}]: {:.1} M trainable of {:.3} B",
                        a.kind,
                        a.rank,
                        a.targets
                            .iter()
                            .map(|p| p.as_str())
                            .collect::<Vec<_>>()
                            .join(", "),
                        n / 1e6,
                        total / 1e9
                    )
                    .to_lowercase(),
                    format!(
                        "frozen base in {}: no gradients or optimizer state for {} of weights",
                        a.base.as_str(),
                        gib((total - n).max(0.0) * a.base.bytes())
                    ),
                );
            }
        }
        Ok(())
    }
}
