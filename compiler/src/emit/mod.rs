//! Emitters: a compiled [`LoweredPlan`] written as the configuration that a
//! cluster training engine reads (`rcoa emit --target ...`).
//!
//! Each target is one pure function from the lowered plan to the files it
//! needs — [`deepspeed`], [`torchrun`], [`slurm`], [`accelerate`] — and
//! [`emit`] dispatches on an [`Engine`]. The emitters read only the lowered
//! plan: every `auto` is already decided there, so an emitter never chooses a
//! micro-batch, a ZeRO stage or an offload; it only spells the decisions the
//! way the engine wants them.
//!
//! Invariants:
//! - **Nothing that does not fit is silently widened.** When an engine cannot
//!   express a decision (pipeline parallelism with ZeRO-2/3 in DeepSpeed, an
//!   optimizer state dtype DeepSpeed's Adam does not keep, pipeline stages in
//!   Accelerate, ...) the emitter returns [`EmitError::Unsupported`] naming the
//!   engine and the plan setting, rather than writing a configuration whose
//!   memory use differs from what was predicted.
//! - **Every key is one the engine knows.** The keys, flags and options the
//!   emitters write are checked against vendored copies of each engine's own
//!   option list ([`schema`]); the emitters run that check on their own output
//!   in debug builds, and the tests run it on every target.
//! - **Deterministic text.** Same plan, same bytes: JSON keys are sorted
//!   (serde_json's map is a BTreeMap), YAML and shell are written in a fixed
//!   order, nothing depends on time, paths or the environment.
//! - **What the engine's file cannot say is said in the file or as a note.**
//!   Which layers to recompute, the LoRA adapter, where the training script
//!   lives: comments in the scripts and YAML, and [`Emission::notes`] (JSON has
//!   no comments) that the CLI prints to stderr.
//!
//! Placeholders (the rendezvous host of a multi-node job, the NVMe mount
//! path, the training script) are written so that they fail loudly when left
//! unset: `${MASTER_ADDR:?...}` in shell, `MASTER_ADDR_PLACEHOLDER` in YAML,
//! DeepSpeed's documented default `/local_nvme` for NVMe paths (named in a note).

mod accelerate;
mod deepspeed;
mod launch;
pub mod schema;
mod script;
#[doc(hidden)]
pub mod testing;

pub use accelerate::{accelerate, accelerate_with, Sharding};
pub use deepspeed::deepspeed;
pub use launch::{slurm, torchrun};

use crate::lowered::LoweredPlan;
use crate::spec::{Dtype, OffloadWhat};
use std::fmt;

/// A cluster engine rcoa can write configuration for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Engine {
    /// A DeepSpeed configuration JSON (`ds_config.json`).
    Deepspeed,
    /// A `torchrun` launch script (plus `ds_config.json` when the plan needs DeepSpeed).
    Torchrun,
    /// A Slurm batch script running torchrun on every node (plus `ds_config.json` when needed).
    Slurm,
    /// An Accelerate launch configuration YAML (plus `ds_config.json` when needed).
    Accelerate,
}

impl Engine {
    pub const ALL: [Engine; 4] = [
        Engine::Deepspeed,
        Engine::Torchrun,
        Engine::Slurm,
        Engine::Accelerate,
    ];

    /// The name used on the command line (`--target deepspeed`).
    pub fn as_str(self) -> &'static str {
        match self {
            Engine::Deepspeed => "deepspeed",
            Engine::Torchrun => "torchrun",
            Engine::Slurm => "slurm",
            Engine::Accelerate => "accelerate",
        }
    }

    /// The engine's own name, for messages.
    pub fn display_name(self) -> &'static str {
        match self {
            Engine::Deepspeed => "DeepSpeed",
            Engine::Torchrun => "torchrun",
            Engine::Slurm => "Slurm",
            Engine::Accelerate => "Accelerate",
        }
    }
}

impl fmt::Display for Engine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.display_name())
    }
}

/// One file an emitter produced.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmittedFile {
    /// File name relative to the output directory, e.g. `ds_config.json`.
    pub name: String,
    /// The full text, ending with a newline.
    pub contents: String,
    /// Whether the file is meant to be executed (shell scripts): `-o DIR` marks it executable.
    pub executable: bool,
}

/// What one target emits: its files (in the order to print them) and notes.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct Emission {
    pub files: Vec<EmittedFile>,
    /// What the files cannot say and the person launching the job must know or do
    /// (which layers to recompute, placeholders to fill). One sentence each.
    pub notes: Vec<String>,
}

impl Emission {
    /// The file called `name`, if this emission has one.
    pub fn file(&self, name: &str) -> Option<&EmittedFile> {
        self.files.iter().find(|f| f.name == name)
    }
}

/// The plan setting an error is about, as the `.plan` file spells it
/// (`parallel.pipeline`, `fit.offload`, `precision.master`, ...), so the CLI can
/// point at it in the source.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Setting {
    pub section: &'static str,
    pub key: Option<&'static str>,
}

impl Setting {
    pub const fn new(section: &'static str, key: &'static str) -> Self {
        Setting {
            section,
            key: Some(key),
        }
    }
    pub const fn section(section: &'static str) -> Self {
        Setting { section, key: None }
    }
}

impl fmt::Display for Setting {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.key {
            Some(k) => write!(f, "{}.{}", self.section, k),
            None => f.write_str(self.section),
        }
    }
}

/// Why a plan cannot be written for an engine.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, miette::Diagnostic)]
pub enum EmitError {
    /// The engine has no way to express a decision of the plan.
    #[error("{engine} cannot express `{setting}` = {value}: {reason}")]
    #[diagnostic(code(rcoa::emit_unsupported), help("{help}"))]
    Unsupported {
        engine: Engine,
        setting: Setting,
        /// The plan's value, as written in messages (`2`, `optimizer:nvme`, `bf16`).
        value: String,
        reason: String,
        help: String,
    },
    /// The lowered plan breaks one of its own promises (a compiler bug, not a user error).
    #[error("the lowered plan is inconsistent: {what}")]
    #[diagnostic(
        code(rcoa::emit_inconsistent),
        help("this is a bug in rcoa's compiler; please report it with the plan file")
    )]
    Inconsistent { what: String },
}

impl EmitError {
    /// The plan setting the error is about, when there is one.
    pub fn setting(&self) -> Option<Setting> {
        match self {
            EmitError::Unsupported { setting, .. } => Some(*setting),
            EmitError::Inconsistent { .. } => None,
        }
    }
}

pub(crate) fn unsupported(
    engine: Engine,
    setting: Setting,
    value: impl fmt::Display,
    reason: impl Into<String>,
    help: impl Into<String>,
) -> EmitError {
    EmitError::Unsupported {
        engine,
        setting,
        value: value.to_string(),
        reason: reason.into(),
        help: help.into(),
    }
}

/// Write `plan` for `engine`.
pub fn emit(engine: Engine, plan: &LoweredPlan) -> Result<Emission, EmitError> {
    match engine {
        Engine::Deepspeed => deepspeed(plan),
        Engine::Torchrun => torchrun(plan),
        Engine::Slurm => slurm(plan),
        Engine::Accelerate => accelerate(plan),
    }
}

/// Does running this plan need DeepSpeed (rather than plain data parallelism)?
///
/// Yes when it shards state (ZeRO ≥ 1), moves anything off the GPU, or keeps an
/// fp32 master copy of 16-bit weights — plain DDP and Accelerate's MULTI_GPU
/// have no mechanism for any of these, DeepSpeed has one for each. The
/// launchers (torchrun, Slurm, Accelerate) then ship a `ds_config.json` too.
/// Never for a plan compiled for FSDP2 or Megatron-Core: their own engine does
/// each of these, as its profile predicted.
pub fn needs_deepspeed(plan: &LoweredPlan) -> bool {
    if matches!(
        plan.target,
        crate::spec::Target::Fsdp | crate::spec::Target::Megatron
    ) {
        return false;
    }
    let p = &plan.precision;
    let sixteen_bit_params = matches!(p.params, Dtype::Bf16 | Dtype::Fp16);
    plan.resolved.zero > 0
        || !plan.resolved.offload.is_empty()
        || (sixteen_bit_params && p.master.is_some_and(|m| m.bytes() > p.params.bytes()))
}

/// Checks every emitter relies on before writing anything.
pub(crate) fn check_consistent(plan: &LoweredPlan) -> Result<(), EmitError> {
    let r = &plan.resolved;
    let show = |v: Option<u64>| v.map_or("more than 2^64".to_string(), |v| v.to_string());
    let gpus = plan.hardware.gpus_per_node.checked_mul(plan.hardware.nodes);
    let inconsistent = |what: String| Err(EmitError::Inconsistent { what });
    if plan.hardware.gpus_per_node == 0 || plan.hardware.nodes == 0 {
        return inconsistent(format!(
            "{} nodes with {} GPUs each",
            plan.hardware.nodes, plan.hardware.gpus_per_node
        ));
    }
    if r.micro_batch == 0
        || r.grad_accum == 0
        || r.data == 0
        || r.tensor == 0
        || r.pipeline == 0
        || r.context == 0
    {
        return inconsistent(format!(
            "a zero degree or batch size (micro_batch {}, grad_accum {}, data {}, tensor {}, pipeline {}, context {})",
            r.micro_batch, r.grad_accum, r.data, r.tensor, r.pipeline, r.context
        ));
    }
    let product = [r.tensor, r.pipeline, r.context]
        .iter()
        .try_fold(r.data, |acc, d| acc.checked_mul(*d));
    if product.is_none() || product != gpus {
        return inconsistent(format!(
            "data {} x tensor {} x pipeline {} x context {} = {}, but the plan has {} GPUs",
            r.data,
            r.tensor,
            r.pipeline,
            r.context,
            show(product),
            show(gpus)
        ));
    }
    let batch = r
        .micro_batch
        .checked_mul(r.grad_accum)
        .and_then(|b| b.checked_mul(r.data));
    if batch != Some(plan.train.global_batch) {
        return inconsistent(format!(
            "micro_batch {} x grad_accum {} x data {} = {}, but global_batch is {}",
            r.micro_batch,
            r.grad_accum,
            r.data,
            show(batch),
            plan.train.global_batch
        ));
    }
    if r.zero > 3 {
        return inconsistent(format!("ZeRO stage {}", r.zero));
    }
    if r.checkpoint_layers.iter().any(|&l| l >= plan.model.layers) {
        return inconsistent(format!(
            "checkpoint_layers names a layer beyond the model's {} layers",
            plan.model.layers
        ));
    }
    Ok(())
}

/// `offload` entries of the plan for one kind of state.
pub(crate) fn offload_of(plan: &LoweredPlan, what: OffloadWhat) -> Option<crate::spec::OffloadTo> {
    plan.resolved
        .offload
        .iter()
        .find(|o| o.what == what)
        .map(|o| o.to)
}

/// A short description of the plan for file headers: `llama-3.1-8b on 2 x 8 h100-80gb`.
pub(crate) fn describe(plan: &LoweredPlan) -> String {
    format!(
        "{} on {} x {} {}",
        plan.model.name, plan.hardware.nodes, plan.hardware.gpus_per_node, plan.hardware.gpu.name
    )
}

/// The layer list as people read it: `0-31`, `0,2,4-7`.
pub(crate) fn layer_ranges(layers: &[u64]) -> String {
    let mut out: Vec<String> = Vec::new();
    let mut i = 0;
    while i < layers.len() {
        let start = layers[i];
        let mut end = start;
        while i + 1 < layers.len() && layers[i + 1] == end + 1 {
            end += 1;
            i += 1;
        }
        out.push(if start == end {
            start.to_string()
        } else {
            format!("{start}-{end}")
        });
        i += 1;
    }
    out.join(",")
}

/// The recompute decision in words, for notes and comments.
pub(crate) fn checkpoint_sentence(plan: &LoweredPlan) -> Option<String> {
    let r = &plan.resolved;
    if r.checkpoint_layers.is_empty() {
        return None;
    }
    let what = if r.checkpoint == "selective" {
        "recompute the attention internals (selective checkpointing)"
    } else if r.checkpoint == "selective_op" {
        "keep the matmul outputs and recompute the rest (torchtitan's op-level selective \
         activation checkpointing, `selective_ac_option = \"op\"`)"
    } else {
        "recompute the whole layer forward (activation checkpointing)"
    };
    Some(format!(
        "the plan checkpoints {} of {} layers ({}, layers {}): {what} of exactly these layers in the training script, \
         e.g. wrap each one in torch.utils.checkpoint / deepspeed.checkpointing.checkpoint",
        r.checkpoint_layers.len(),
        plan.model.layers,
        r.checkpoint,
        layer_ranges(&r.checkpoint_layers)
    ))
}

/// Which engine the plan's memory prediction is for: rcoa's Burn executor is flagged (the
/// files launch a PyTorch engine); a PyTorch engine's profile is named.
pub(crate) fn target_sentence(plan: &LoweredPlan) -> Option<String> {
    let t = plan.target;
    if !t.is_pytorch_engine() {
        return Some(
            "the plan's memory prediction is for rcoa's Burn executor (`target burn`), not for the PyTorch \
             engines these files launch: add `target pytorch` to the plan and compile again to predict them"
                .to_string(),
        );
    }
    Some(format!(
        "the memory prediction ({:.2} GiB peak per GPU of a {:.2} GiB budget) is for {} (the `{}` profile)",
        plan.prediction.peak_bytes as f64 / (1u64 << 30) as f64,
        plan.prediction.budget_bytes as f64 / (1u64 << 30) as f64,
        crate::profile::Profile::for_target(t).engine.display_name(),
        t.as_str()
    ))
}

/// The adapter in words, when the plan trains one.
pub(crate) fn adapter_sentence(plan: &LoweredPlan) -> Option<String> {
    let a = plan.adapter.as_ref()?;
    let kind = match a.kind {
        crate::spec::AdapterKind::Lora => "LoRA",
        crate::spec::AdapterKind::Qlora => "QLoRA",
    };
    let targets: Vec<&str> = a.targets.iter().map(|t| t.as_str()).collect();
    Some(format!(
        "the plan trains a {kind} adapter (rank {}, alpha {}, targets [{}], base weights {}): apply it in the \
         training script (e.g. PEFT) before handing the model to the engine",
        a.rank,
        a.alpha,
        targets.join(", "),
        a.base.as_str()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emit::testing::PlanBuilder;

    #[test]
    fn op_level_recomputation_is_not_told_as_whole_layers() {
        let mut plan = PlanBuilder::llama_8b().build();
        plan.resolved.checkpoint = "selective_op".into();
        plan.resolved.checkpoint_layers = (0..plan.model.layers).collect();
        let s = checkpoint_sentence(&plan).unwrap();
        assert!(s.contains("op-level") && !s.contains("whole layer"), "{s}");
    }

    #[test]
    fn a_burn_prediction_is_flagged_for_every_engine() {
        let mut plan = PlanBuilder::llama_8b().build();
        plan.target = crate::spec::Target::Burn;
        for engine in Engine::ALL {
            let notes = emit(engine, &plan).unwrap().notes;
            assert_eq!(
                notes
                    .iter()
                    .filter(|n| n.contains("target pytorch"))
                    .count(),
                1,
                "{engine}: {notes:?}"
            );
        }
        let pytorch = PlanBuilder::llama_8b().build();
        assert!(emit(Engine::Deepspeed, &pytorch)
            .unwrap()
            .notes
            .iter()
            .all(|n| !n.contains("target pytorch")));
    }

    #[test]
    fn layer_ranges_compress_runs() {
        assert_eq!(layer_ranges(&[]), "");
        assert_eq!(layer_ranges(&[3]), "3");
        assert_eq!(layer_ranges(&[0, 1, 2, 3]), "0-3");
        assert_eq!(layer_ranges(&[0, 2, 4, 5, 6, 9]), "0,2,4-6,9");
    }

    #[test]
    fn inconsistent_batch_is_refused_by_every_engine() {
        let mut plan = PlanBuilder::llama_8b().build();
        plan.train.global_batch += 1;
        for engine in Engine::ALL {
            let err = emit(engine, &plan).unwrap_err();
            assert!(
                matches!(err, EmitError::Inconsistent { .. }),
                "{engine}: {err}"
            );
        }
    }

    #[test]
    fn huge_numbers_are_refused_not_overflowed() {
        let mut plan = PlanBuilder::llama_8b().build();
        plan.resolved.data = u64::MAX;
        plan.resolved.tensor = 2;
        for engine in Engine::ALL {
            assert!(matches!(
                emit(engine, &plan),
                Err(EmitError::Inconsistent { .. })
            ));
        }
        let mut wide = PlanBuilder::llama_8b().build();
        wide.model.hidden = u64::MAX / 2;
        let c = deepspeed(&wide).unwrap();
        assert!(
            c.files[0].contents.contains(&u64::MAX.to_string()),
            "bucket sizes saturate"
        );
    }

    #[test]
    fn inconsistent_degrees_are_refused() {
        let mut plan = PlanBuilder::llama_8b().build();
        plan.resolved.tensor = 3;
        assert!(matches!(
            deepspeed(&plan),
            Err(EmitError::Inconsistent { .. })
        ));
    }

    #[test]
    fn needs_deepspeed_follows_sharding_offload_and_master() {
        let plain = PlanBuilder::llama_8b()
            .zero(0)
            .precision(Dtype::Fp32, Dtype::Bf16, None)
            .build();
        assert!(!needs_deepspeed(&plain));
        let master = PlanBuilder::llama_8b().zero(0).build();
        assert!(
            needs_deepspeed(&master),
            "bf16 params with an fp32 master copy need DeepSpeed"
        );
        assert!(needs_deepspeed(&PlanBuilder::llama_8b().zero(1).build()));
    }
}
