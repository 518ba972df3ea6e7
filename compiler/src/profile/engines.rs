//! The PyTorch engines a plan can target besides eager PyTorch: FSDP2, DeepSpeed and
//! Megatron-Core. Each is PyTorch underneath (the same caching allocator, autograd, cuBLAS
//! and attention kernels), so each profile is [`Profile::pytorch`]'s calibrated facts plus
//! what the engine itself allocates, read from its code. The facts here are the engine's
//! settings (bucket sizes, dtypes, prefetch depth); `crate::memory::engines` turns them into
//! bytes on a rank. Sources, pinned where they were read:
//! - DeepSpeed `deepspeedai/DeepSpeed@edaa7221` (`deepspeed/runtime/zero/stage_1_and_2.py`,
//!   `stage3.py`, `runtime/engine.py`, `ops/adam/fused_adam.py`);
//! - PyTorch `torch/distributed/fsdp/_fully_shard/` (`_fsdp_collectives.py`,
//!   `_fsdp_param_group.py`, `_fsdp_state.py`; torch 2.11);
//! - Megatron-LM `megatron/core/distributed/param_and_grad_buffer.py`,
//!   `megatron/core/optimizer/distrib_optimizer.py`, `megatron/training/arguments.py`;
//!   Transformer Engine `transformer_engine/pytorch/module/base.py` (`get_workspace`).

use super::Profile;
use crate::spec::{OptImpl, OptimizerKind, OptimizerSpec, Target};
use serde::Serialize;

/// Which engine's own allocations a profile adds to the tape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Engine {
    /// rcoa's Burn executor (`memory::build`'s `burn_*` ops, `backend/src/shard`).
    Burn,
    /// Eager PyTorch; data parallelism as DDP (`bucket_cap_mb` buckets), ZeRO as the generic
    /// formulas of `memory::parallel`.
    Eager,
    /// FSDP2 `fully_shard` per transformer layer and on the root, `MixedPrecisionPolicy(
    /// param_dtype = compute, reduce_dtype = fp32)`.
    Fsdp2,
    /// DeepSpeed's engine with the `ds_config.json` rcoa emits.
    DeepSpeed,
    /// Megatron-Core's `DistributedDataParallel` and (with `zero >= 1`) distributed optimizer.
    Megatron,
}

impl Engine {
    /// The engine's name in messages.
    pub fn display_name(self) -> &'static str {
        match self {
            Engine::Burn => "Burn",
            Engine::Eager => "PyTorch",
            Engine::Fsdp2 => "FSDP2",
            Engine::DeepSpeed => "DeepSpeed",
            Engine::Megatron => "Megatron-Core",
        }
    }

    /// Does ZeRO-3 gather each weight at the op that reads it (scratch of that op)? DeepSpeed
    /// hooks leaf modules (`partitioned_param_coordinator.py` fetches a submodule's params in
    /// its pre-forward hook), which the generic per-op gather stands for; FSDP2 gathers a
    /// whole `fully_shard` unit (`memory::engines` charges those).
    pub fn gathers_per_op(self) -> bool {
        self != Engine::Fsdp2
    }
}

/// DeepSpeed's ZeRO sizes as rcoa writes them into `ds_config.json`
/// (`crate::emit::deepspeed` calls these, so the prediction and the emitted file agree).
/// They follow Hugging Face's `auto` values rather than DeepSpeed's 5e8-element defaults.
pub mod deepspeed {
    /// `reduce_bucket_size` and `allgather_bucket_size` (elements): hidden².
    pub fn reduce_bucket_elements(hidden: u64) -> u64 {
        hidden.saturating_mul(hidden)
    }
    /// `stage3_prefetch_bucket_size` (elements): 0.9 hidden².
    pub fn prefetch_bucket_elements(hidden: u64) -> u64 {
        reduce_bucket_elements(hidden).saturating_mul(9) / 10
    }
    /// `stage3_param_persistence_threshold` (elements): parameters smaller than this stay
    /// whole on every rank (`partition_parameters.py`: `ds_persist`).
    pub fn persistence_threshold(hidden: u64) -> u64 {
        hidden.saturating_mul(10)
    }
    /// `stage3_max_live_parameters`: the gathered parameters' cap, above any layer rcoa
    /// plans, so the per-module gather of the memory model is what stays live.
    pub const MAX_LIVE_PARAMETERS: u64 = 1_000_000_000;
    /// `stage3_max_reuse_distance`.
    pub const MAX_REUSE_DISTANCE: u64 = 1_000_000_000;
    /// `sub_group_size` (elements): ZeRO-3 steps the optimizer one sub-group of the flat
    /// fp32 partition at a time (`stage3.py` `_prepare_fp32_grad_for_sub_group`).
    pub const SUB_GROUP_SIZE: u64 = 1_000_000_000;
    /// The engine's data-parallel all-reduce bucket without ZeRO (`runtime/engine.py`
    /// `allreduce_gradients` → `buffered_allreduce_fallback(elements_per_buffer=500000000)`),
    /// which rcoa's config does not change.
    pub const ALLREDUCE_BUCKET_ELEMENTS: u64 = 500_000_000;

    /// The ZeRO sizes a DeepSpeed run uses: rcoa's (what [`crate::emit::deepspeed`] writes,
    /// [`ZeroSettings::rcoa`]) unless the run was configured otherwise. `rcoa validate`
    /// scores runs of `tools/measure_multigpu.py`, whose `ds_config` leaves every size to
    /// DeepSpeed ([`ZeroSettings::library_defaults`]).
    #[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
    pub struct ZeroSettings {
        /// `reduce_bucket_size` (elements).
        pub reduce_bucket: u64,
        /// `stage3_prefetch_bucket_size` (elements).
        pub prefetch_bucket: u64,
        /// `stage3_param_persistence_threshold` (elements).
        pub persistence_threshold: u64,
        /// `overlap_comm`: ZeRO-1/2 double their reduce bucket (`stage_1_and_2.py`
        /// `setup_buckets`).
        pub overlap_comm: bool,
    }

    impl ZeroSettings {
        /// What rcoa writes into `ds_config.json` for a model of `hidden` width (`overlap_comm`
        /// and `contiguous_gradients` on at every stage).
        pub fn rcoa(hidden: u64) -> ZeroSettings {
            ZeroSettings {
                reduce_bucket: reduce_bucket_elements(hidden),
                prefetch_bucket: prefetch_bucket_elements(hidden),
                persistence_threshold: persistence_threshold(hidden),
                overlap_comm: true,
            }
        }
        /// DeepSpeed's own defaults for ZeRO `stage` (`runtime/zero/config.py`): 5e8-element
        /// reduce bucket, 5e7 prefetch, 1e5 persistence threshold, `overlap_comm` on for
        /// stage 3 only, `contiguous_gradients` on.
        pub fn library_defaults(stage: u8) -> ZeroSettings {
            ZeroSettings {
                reduce_bucket: 500_000_000,
                prefetch_bucket: 50_000_000,
                persistence_threshold: 100_000,
                overlap_comm: stage >= 3,
            }
        }
    }
}

/// Megatron-Core's buffers.
pub mod megatron {
    /// `megatron/training/arguments.py`: with `--bf16` Megatron-LM sets
    /// `accumulate_allreduce_grads_in_fp32` (unless `--grad-reduce-in-bf16`), so the
    /// contiguous gradient buffer is fp32 (`param_and_grad_buffer.py`: `grad_dtype =
    /// torch.float if grad_reduce_in_fp32`). rcoa assumes that default.
    pub const GRAD_REDUCE_IN_FP32: bool = true;
    /// Transformer Engine's cuBLAS workspace (`get_cublas_workspace_size_bytes`: 32 MiB on
    /// Hopper, 4 MiB before): one more kept workspace beside PyTorch's own. The Hopper size
    /// is charged everywhere (the safe side; 28 MiB on older GPUs).
    pub const TE_WORKSPACE_BYTES: u64 = 32 << 20;
}

impl Profile {
    /// FSDP2: PyTorch underneath (allocator, kernels, Hugging Face modules), no autocast:
    /// `MixedPrecisionPolicy(param_dtype=bf16)` casts each unit's gathered parameters to bf16
    /// once, and the modules compute in that dtype (`_fsdp_param.py` `init_all_gather_outputs`
    /// in `param_dtype`). `precision { params = fp32 compute = bf16 }` under `target fsdp`
    /// means exactly that policy, with `reduce_dtype = fp32`.
    pub fn fsdp() -> Profile {
        Profile {
            name: "fsdp",
            engine: Engine::Fsdp2,
            autocast: false,
            ..Profile::pytorch()
        }
    }

    /// DeepSpeed: PyTorch underneath. `bf16.enabled` keeps 16-bit weights with ZeRO's fp32
    /// partition; `torch_autocast` (fp32 weights, 16-bit compute) is autocast as in eager
    /// PyTorch. The optimizer is FusedAdam unless the plan asks for torch's.
    pub fn deepspeed() -> Profile {
        Profile {
            name: "deepspeed",
            engine: Engine::DeepSpeed,
            ..Profile::pytorch()
        }
    }

    /// Megatron-Core: PyTorch underneath, plus Transformer Engine's GEMM workspace.
    pub fn megatron() -> Profile {
        let eager = Profile::pytorch();
        Profile {
            name: "megatron",
            engine: Engine::Megatron,
            workspace_bytes: eager.workspace_bytes + megatron::TE_WORKSPACE_BYTES,
            ..eager
        }
    }
}

/// The optimizer implementation a plan gets when it does not write `impl`: DeepSpeed's
/// `AdamW`/`Adam`/`Lion` are its fused kernels (`ops/adam/fused_adam.py`: one multi-tensor
/// kernel over the flat fp32 partition, no temporaries) unless `torch_adam`, and
/// Megatron-Core builds TE's or Apex's `FusedAdam` (`megatron/core/optimizer/__init__.py`).
/// Other targets keep `torch.optim`'s foreach default. Recorded as a default for `--explain`.
pub fn default_optimizer_impl(
    mut o: OptimizerSpec,
    target: Target,
    written: bool,
    defaults: &mut Vec<(String, String)>,
) -> OptimizerSpec {
    let adam = matches!(o.kind, OptimizerKind::Adamw | OptimizerKind::Adam);
    let (engine, fused_kind) = match target {
        Target::Deepspeed => (
            "DeepSpeed's fused optimizer (FusedAdam / FusedLion)",
            adam || o.kind == OptimizerKind::Lion,
        ),
        Target::Megatron => ("Megatron-Core's FusedAdam", adam),
        _ => return o,
    };
    if !written && fused_kind && o.implementation != OptImpl::Fused {
        o.implementation = OptImpl::Fused;
        defaults.push((
            "optimizer.impl = fused".to_string(),
            format!("target {}: {engine}", target.as_str()),
        ));
    }
    o
}

/// The ZeRO stages an engine runs, with why, when it runs fewer than all four (`None`: the
/// sharding pass's own domain). FSDP2 always shards parameters, gradients and optimizer
/// state: `zero = 3` is `reshard_after_forward=True`, `zero = 2` False (FULL_SHARD /
/// SHARD_GRAD_OP). Megatron-Core's `DistributedDataParallel` shards the optimizer state
/// only (`use_distributed_optimizer`, `zero = 1`).
pub fn zero_stages(target: Target) -> Option<(&'static [u8], &'static str)> {
    match target {
        Target::Fsdp => Some((
            &[2, 3],
            "FSDP2 shards weights, gradients and optimizer state over the data ranks: zero = 3 reshards each layer after its forward (reshard_after_forward=True), zero = 2 keeps it gathered until its backward",
        )),
        Target::Megatron => Some((
            &[0, 1],
            "Megatron-Core's DistributedDataParallel keeps the weights and its gradient buffer whole on every data rank; zero = 1 is its distributed optimizer (fp32 main weights and Adam state sharded)",
        )),
        _ => None,
    }
}

/// A fixed `zero` the target's engine cannot run: a clear refusal naming what it can.
pub fn check_zero(target: Target, zero: u8) -> Result<(), crate::compile::CompileError> {
    let Some((stages, why)) = zero_stages(target) else {
        return Ok(());
    };
    if stages.contains(&zero) {
        return Ok(());
    }
    let help = match target {
        Target::Fsdp => "write zero = 3 (or 2, or auto) for FSDP2, or `target pytorch` (DDP) / `target deepspeed` for ZeRO 0 and 1",
        _ => "write zero = 1 (distributed optimizer), 0 or auto for Megatron-Core, or `target deepspeed` / `target fsdp` to shard weights and gradients",
    };
    Err(crate::compile::CompileError::Inconsistent {
        what: format!(
            "zero = {zero} is not what `target {}` runs: {why}",
            target.as_str()
        ),
        help: help.to_string(),
    })
}

/// Why `target`'s engine cannot move `o` off the GPU the way the memory model prices it,
/// or `None` when it can (the offload pass leaves such items out of the search).
pub fn offload_refusal(target: Target, o: &crate::spec::Offload) -> Option<&'static str> {
    use crate::spec::{OffloadTo, OffloadWhat};
    match target {
        // `CPUOffloadPolicy` keeps the sharded parameters and their gradients in (pinned)
        // host memory and steps the optimizer there; nothing goes to NVMe, and activations
        // stay (`_fsdp_param.py`: `offload_to_cpu`). Which sets it runs: [`offload_set_refusal`].
        Target::Fsdp if o.to == OffloadTo::Nvme || o.what == OffloadWhat::Activations => Some(
            "FSDP2's CPUOffloadPolicy moves parameters, gradients and the optimizer step to host memory, \
             never to NVMe and never activations: use `target deepspeed` (ZeRO-Infinity) for NVMe",
        ),
        // Megatron-Core's `optimizer_cpu_offload` (HybridDeviceOptimizer) is its one offload.
        Target::Megatron if !(o.what == OffloadWhat::Optimizer && o.to == OffloadTo::Cpu) => Some(
            "Megatron-Core offloads the optimizer to the CPU only (optimizer_cpu_offload); \
             parameter, gradient and NVMe offload run on DeepSpeed (`target deepspeed`)",
        ),
        _ => None,
    }
}

/// FSDP2's one offload: `CPUOffloadPolicy`, the sharded parameters, their gradients and
/// the optimizer step on the host, all three.
pub const FSDP_CPU_OFFLOAD: [crate::spec::OffloadWhat; 3] = [
    crate::spec::OffloadWhat::Optimizer,
    crate::spec::OffloadWhat::Params,
    crate::spec::OffloadWhat::Grads,
];

/// Why `target`'s engine cannot run the offload set `set` as a whole, or `None` when it
/// can: FSDP2 runs nothing offloaded, or exactly [`FSDP_CPU_OFFLOAD`] to the CPU
/// (`fully_shard(offload_policy=CPUOffloadPolicy())` moves the three together); the Burn
/// executor moves the gradients only beside the optimizer (its host accumulator is what
/// the host optimizer steps from, `backend/src/shard/zero3.rs`).
pub fn offload_set_refusal(target: Target, set: &[crate::spec::Offload]) -> Option<&'static str> {
    use crate::spec::{OffloadTo, OffloadWhat};
    let has = |w: OffloadWhat| set.iter().any(|o| o.what == w);
    if target == Target::Burn && has(OffloadWhat::Grads) && !has(OffloadWhat::Optimizer) {
        return Some(
            "the Burn executor keeps offloaded gradients in the host optimizer's accumulator: offload the \
             optimizer with them (`offload = [optimizer, grads]`)",
        );
    }
    if target != Target::Fsdp || set.is_empty() {
        return None;
    }
    let exact = set.len() == FSDP_CPU_OFFLOAD.len()
        && FSDP_CPU_OFFLOAD
            .iter()
            .all(|w| set.iter().any(|o| o.what == *w && o.to == OffloadTo::Cpu));
    (!exact).then_some(
        "FSDP2's CPUOffloadPolicy moves the sharded parameters, their gradients and the optimizer step to \
         the host together: offload all three (`offload = [optimizer, params, grads]`) or none",
    )
}

/// A schedule of the step the target's engine does not run: the optimizer step in the
/// backward (torchtune's `optimizer_in_bwd`, per-parameter hooks) is eager PyTorch's and
/// FSDP2's; DeepSpeed and Megatron-Core step once after the backward over their flat
/// buffers. Interleaved pipeline stages are Megatron-Core's (and `torch.distributed.pipelining`'s
/// `ScheduleInterleaved1F1B`); DeepSpeed's `PipelineEngine` runs plain 1F1B.
pub fn check_schedule(spec: &crate::spec::Spec) -> Result<(), crate::compile::CompileError> {
    let engine = Profile::for_target(spec.target).engine.display_name();
    let t = spec.target.as_str();
    if spec.optimizer_in_backward && matches!(spec.target, Target::Deepspeed | Target::Megatron) {
        return Err(crate::compile::CompileError::Inconsistent {
            what: format!(
                "`optimizer.in_backward = true` is not what `target {t}` runs: {engine} steps its optimizer once after \
                 the backward, over every gradient"
            ),
            help: "remove `in_backward`, or write `target fsdp` or `target pytorch` (torchtune's optimizer_in_bwd)"
                .into(),
        });
    }
    if spec.parallel.virtual_stages > 1 && spec.target == Target::Deepspeed {
        return Err(crate::compile::CompileError::Inconsistent {
            what: format!(
                "`parallel.virtual_stages = {}` is not what `target {t}` runs: DeepSpeed's PipelineEngine holds one \
                 model chunk per stage (plain 1F1B)",
                spec.parallel.virtual_stages
            ),
            help: "remove `virtual_stages`, or write `target megatron` for Megatron-Core's interleaved schedule".into(),
        });
    }
    Ok(())
}

/// A precision the target's engine has no setting for. FSDP2's mixed precision is fp32
/// sharded weights with 16-bit gathered copies (`precision { params = fp32 compute = bf16 }`);
/// it keeps no master copy beside 16-bit weights, so `master` above `params` names nothing
/// FSDP2 runs.
pub fn check_precision(spec: &crate::spec::Spec) -> Result<(), crate::compile::CompileError> {
    let p = &spec.precision;
    if spec.target == Target::Fsdp && p.master.is_some_and(|m| m.bytes() > p.params.bytes()) {
        return Err(crate::compile::CompileError::Inconsistent {
            what: format!(
                "`target fsdp` has no fp32 master copy of {} weights: FSDP2's MixedPrecisionPolicy keeps the sharded weights \
                 themselves in fp32 and gathers 16-bit copies only while a layer runs",
                p.params.as_str()
            ),
            help: format!(
                "write `precision {{ params = fp32 compute = {} }}` (MixedPrecisionPolicy(param_dtype={}, reduce_dtype=fp32)), \
                 or `target deepspeed` for 16-bit weights with an fp32 master",
                p.compute.as_str(),
                p.compute.as_str()
            ),
        });
    }
    Ok(())
}

impl Profile {
    /// How the engine recomputes a checkpointed layer, for `--explain`.
    pub fn recompute_mechanism(&self) -> &'static str {
        match self.engine {
            Engine::Burn => "rcoa's per-layer segment recomputation",
            Engine::Eager | Engine::Fsdp2 => "per-layer non-reentrant torch.utils.checkpoint",
            Engine::DeepSpeed => {
                "per-layer deepspeed.checkpointing.checkpoint (torch.utils.checkpoint semantics)"
            }
            Engine::Megatron => {
                "Megatron-Core's full per-layer recompute (recompute_granularity=full)"
            }
        }
    }
}
