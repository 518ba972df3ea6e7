//! What FSDP2, DeepSpeed and Megatron-Core allocate on a rank beyond the tape of eager
//! PyTorch, from each engine's code (the settings are `crate::profile::engines`).
//!
//! Three kinds of term, each where it lives in time:
//! - [`buffers`]: held for the whole step (communication buckets, flat partitions, FSDP2's
//!   offload upload), added to every sample like `memory::parallel`'s generic buckets, which
//!   they replace for these engines (FSDP2's gathered units and gradient buffers live op by
//!   op: `memory::fsdp` puts them on the tape);
//! - [`step_temporaries`]: what the optimizer step allocates (the flat fp32 gradient
//!   partition DeepSpeed makes for its fused kernel), replacing the per-parameter
//!   temporaries `memory::optimizer` models for `torch.optim`;
//! - [`contiguous_grad_bytes`]: Megatron's gradient buffer, which exists from the model's
//!   wrapping on, instead of gradients the backward allocates one by one.
//!
//! FSDP2 always shards parameters, gradients and optimizer state: `zero` only says whether
//! a unit is resharded after its forward (`memory::build` shards the weights of `zero = 2`
//! too).

use super::optimizer::OptimizerModel;
use super::parallel::layer_params;
use super::{Candidate, MemoryReport, Stage};
use crate::profile::engines::{deepspeed, megatron};
use crate::profile::{Engine, Profile};
use crate::spec::{OffloadWhat, OptImpl, OptimizerKind, Spec};

/// A buffer an engine keeps beside the tape, named as `--explain` shows it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineBuffer {
    pub what: String,
    pub bytes: u64,
}

/// FSDP2 reshards a unit after its forward (`reshard_after_forward=True`) when the plan
/// says ZeRO-3; ZeRO-2 keeps every unit gathered from its forward to its backward (the
/// `SHARD_GRAD_OP` the Accelerate emitter writes for `zero = 2`).
pub fn fsdp_reshards_after_forward(plan_zero: u8) -> bool {
    plan_zero >= 3
}

/// The largest parameter (elements, per tensor-parallel rank) of `stage`'s units: a layer's
/// largest projection, or the embedding / head table on the stages that hold it.
fn largest_param(m: &crate::spec::ModelSpec, t: u64, stage: &Stage) -> u64 {
    let q = m.hidden * m.heads.div_ceil(t) * m.head_dim;
    let mlp = m.hidden * m.ffn.div_ceil(t);
    let table = if stage.embedding || stage.head {
        m.vocab.div_ceil(t) * m.hidden
    } else {
        0
    };
    q.max(mlp).max(table)
}

fn bytes(elems: u64, b: f64) -> u64 {
    (elems as f64 * b).ceil() as u64
}

/// The whole-step buffers of `profile`'s engine on `stage`'s rank, or `None` for the engines
/// `memory::parallel` models itself (eager PyTorch, Burn). `cand` is the plan's candidate
/// `report` the stage's tape.
pub fn buffers(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    stage: &Stage,
    report: &MemoryReport,
) -> Option<Vec<EngineBuffer>> {
    let m = &spec.model;
    let d = cand.data.max(1);
    let t = cand.tensor.max(1);
    let trainable = report.params_trainable;
    let param_b = spec.precision.params.bytes();
    let gib = |b: u64| format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64);
    let mut out = Vec::new();
    let mut add = |what: String, bytes: u64| {
        if bytes > 0 {
            out.push(EngineBuffer { what, bytes });
        }
    };
    match profile.engine {
        Engine::Burn | Engine::Eager => return None,
        Engine::Fsdp2 => {
            // The gathered units, the backward's prefetch, the unsharded gradients and the
            // reduce-scatter inputs live and die with the ops that use them: `memory::fsdp`
            // places them on the tape. What stays here is the offload's upload.
            let cb = spec.precision.compute.bytes().min(param_b);
            let unit = layer_params(m, t);
            let table = m.vocab.div_ceil(t) * m.hidden;
            let root = if stage.embedding || stage.head {
                let tied = m.tie_embeddings;
                let embed = if stage.embedding || (stage.head && tied) {
                    table
                } else {
                    0
                };
                let head = if stage.head && !tied { table } else { 0 };
                embed + head + m.hidden
            } else {
                0
            };
            if cand.offloads(OffloadWhat::Params) {
                // `_fsdp_param.py` `all_gather_inputs` under `CPUOffloadPolicy` (the foreach
                // fast path of `_get_param_all_gather_inputs` is skipped): each parameter's
                // padded shard is copied up from pinned host memory in its own dtype
                // (`.to(device)`), then cast to `param_dtype` (`_to_dtype_if_needed`); the
                // unit's cast shards are held until `all_gather_copy_in` writes them into the
                // all-gather output, the uploaded copy of one parameter at a time. Without a
                // cast the uploaded shards are the inputs themselves.
                let largest_unit = unit.max(root);
                let b = if cb < param_b {
                    bytes(largest_unit.div_ceil(d), cb)
                        + bytes(largest_param(m, t, stage).div_ceil(d), param_b)
                } else {
                    bytes(largest_unit.div_ceil(d), param_b)
                };
                add(
                    format!(
                        "FSDP2 CPU offload copy-in {} (this rank's shards of the largest unit uploaded from host memory before its all-gather)",
                        gib(b)
                    ),
                    b,
                );
            }
        }
        Engine::DeepSpeed => {
            let hidden = m.hidden;
            let zs = spec.deepspeed_zero();
            let flat = |n: u64| n.div_ceil(if cand.zero >= 1 { d } else { 1 });
            // ZeRO 0-2's buffers are allocated inside the backward (`backward_scratch`): the
            // all-reduce's flat copy at its end, the reduce buckets at its first gradient.
            if cand.zero >= 3 {
                // `stage3.py` `__init__`: with `contiguous_gradients` the IPG bucket,
                // `reduce_bucket_size` elements in the gradients' (the weights') dtype, is
                // allocated with the optimizer and kept.
                let b = bytes(zs.reduce_bucket, param_b);
                add(
                    format!("DeepSpeed reduce bucket {} (reduce_bucket_size)", gib(b)),
                    b,
                );
                let kept = zero3_keeps_forward_gathers(profile, cand);
                if d > 1 && !cand.offloads(OffloadWhat::Params) && !kept {
                    let next = layer_params(m, t).min(zs.prefetch_bucket);
                    let b = bytes(next, param_b);
                    add(
                        format!(
                            "DeepSpeed ZeRO-3 prefetch {} (stage3_prefetch_bucket_size)",
                            gib(b)
                        ),
                        b,
                    );
                }
                // `partition_parameters.py`: parameters under
                // `stage3_param_persistence_threshold` elements (norms' scales, biases,
                // Qwen3's q/k norms) are never partitioned: every rank keeps them whole.
                let small = |n: &u64| *n < zs.persistence_threshold;
                let per_layer: u64 = super::parallel::layer_vectors(m, t)
                    .iter()
                    .map(|(_, n)| *n)
                    .filter(small)
                    .sum();
                let layers = stage.end_layer.saturating_sub(stage.first_layer);
                let head_norm = if stage.head && small(&hidden) {
                    hidden
                } else {
                    0
                };
                let persistent = layers * per_layer + head_norm;
                if d > 1 && !cand.offloads(OffloadWhat::Params) && persistent > 0 {
                    let b = bytes(persistent - persistent.div_ceil(d), param_b);
                    add(
                        format!(
                            "DeepSpeed ZeRO-3 persistent parameters {} (under stage3_param_persistence_threshold, whole on every rank)",
                            gib(b)
                        ),
                        b,
                    );
                }
            }
            // ZeRO 1-3 keep their own fp32 partition even of fp32 weights
            // (`stage_1_and_2.py`: `single_partition_of_fp32_groups` is a `.clone().float()` of
            // the partition; `stage3.py` `_create_fp32_partitions`): the memory model's master
            // copy covers 16-bit weights only.
            let no_master = spec.precision.master.is_none_or(|x| x.bytes() <= param_b);
            if cand.zero >= 1 && param_b >= 4.0 && no_master && trainable > 0 {
                let b = bytes(flat(trainable), 4.0);
                if !cand.offloads(OffloadWhat::Optimizer) {
                    add(
                        format!("DeepSpeed fp32 partition of fp32 weights {}", gib(b)),
                        b,
                    );
                }
            }
        }
        Engine::Megatron => {
            // The parameter buffer holds the 16-bit weights themselves and the buckets are
            // views of the parameter and gradient buffers (`param_and_grad_buffer.py`): no
            // bytes beyond the tape and [`contiguous_grad_bytes`].
        }
    }
    Some(out)
}

/// The parts one trainable parameter's step temporaries are cut into on the device when it
/// steps in the backward (`Spec::optimizer_in_backward`), or `None` when the step runs on
/// the host (the optimizer offloaded: FSDP2's `CPUOffloadPolicy` hands the hook the sharded
/// gradient already copied to the CPU, `_fsdp_collectives.py` `foreach_reduce`). FSDP2's
/// hook fires on the sharded parameter: the step's temporaries are a shard's.
pub fn in_backward_step_shards(profile: &Profile, cand: &Candidate) -> Option<u64> {
    if cand.offloads(OffloadWhat::Optimizer) {
        return None;
    }
    Some(if profile.engine == Engine::Fsdp2 {
        cand.data.max(1)
    } else {
        1
    })
}

/// The Burn executor's per-run constants on the device (`backend/src/model.rs` `Ctx`), in the
/// compute dtype, from the model's build to the end of the run: the RoPE cosines (`[seq,
/// head_dim / 2]`) and signed sines (`[seq, head_dim]`, both halves of each head, as
/// `kernels::rope` reads them) and, for a decoder's attention unless it is fused (`flash`
/// masks the future itself), the additive causal bias `[seq, seq]`. Measured on CUDA: the 17
/// MiB (two sets, before the executor shared one) by which QLoRA at 2,048 tokens was over
/// its prediction through the whole step (docs/burn-h100.md, "2026-11-27").
///
/// With `train.packing` each micro-batch has the position of each token (`[micro_batch ·
/// seq]` ids, 4 bytes on CUDA) and the RoPE rows gathered at them (`[micro_batch · seq,
/// ..]`), and its documents' mask (`Ctx::with_documents`): for the eager paths its own
/// bias, `[micro_batch, 1, seq, seq]`, every document causal within itself; for the fused
/// attention each token's document as `[start, end)` (`[micro_batch, seq, 2]` ids), which
/// its kernels mask by. All alive through the micro-batch's forward and backward.
pub fn burn_context_bytes(spec: &Spec, profile: &Profile, micro_batch: u64) -> u64 {
    burn_context_tensors(spec, profile, micro_batch)
        .iter()
        .sum()
}

/// The tensors of [`burn_context_bytes`], each its own allocation (cosines, sines, bias).
pub fn burn_context_tensors(spec: &Spec, profile: &Profile, micro_batch: u64) -> Vec<u64> {
    use crate::spec::{Arch, Attention, Positions};
    if !profile.burn_ops {
        return Vec::new();
    }
    let m = &spec.model;
    let seq = spec.train.seq_len;
    let bytes = |elems: u64| {
        let b = super::build::storage(spec.precision.compute)
            .bytes()
            .min(4.0);
        profile.allocated((elems as f64 * b).ceil() as u64)
    };
    let packed = spec.train.packing && m.arch == Arch::Decoder;
    let tokens = micro_batch.max(1) * seq;
    let mut out = Vec::new();
    if m.positions == Positions::Rope {
        // Part of each head rotated: whole-head cosines too, and the swap index (i32).
        let partial = m.numerics.rotary_dims.is_some_and(|r| r != m.head_dim);
        let cos_cols = if partial { m.head_dim } else { m.head_dim / 2 };
        let rows: &[u64] = if packed { &[seq, tokens] } else { &[seq] };
        for &n in rows {
            out.extend([bytes(n * cos_cols), bytes(n * m.head_dim)]);
        }
        if partial {
            out.push(profile.allocated(m.head_dim * 4));
        }
    }
    let flash = spec.train.attention == Attention::Flash;
    if packed {
        out.push(profile.allocated(tokens * 4));
        if flash {
            out.push(profile.allocated(tokens * 2 * 4));
        }
    }
    if m.arch == Arch::Decoder && !flash {
        out.push(bytes(seq * seq));
        if packed {
            out.push(bytes(tokens * seq));
        }
    }
    out
}

/// Does the engine keep the reduced gradient partition in host memory because the optimizer
/// is there? DeepSpeed does from ZeRO-2 on: `stage_1_and_2.py` `copy_grads_in_partition`
/// copies each reduced gradient into the host fp32 partition under `cpu_offload` instead of
/// `grads_in_partition`, and `stage3.py` allocates `grad_partitions_flat_buffer` on
/// `self.device`, the CPU with `offload_optimizer`. The device keeps the reduce buckets only.
pub fn grads_follow_host_optimizer(profile: &Profile, cand: &Candidate) -> bool {
    profile.engine == Engine::DeepSpeed && cand.zero >= 2 && cand.offloads(OffloadWhat::Optimizer)
}

/// Megatron-Core's contiguous gradient buffer on this rank (bytes), or `None` for engines
/// whose gradients the backward allocates. It is allocated when the model is wrapped and
/// never freed (`param_and_grad_buffer.py` `_ParamAndGradBuffer`), whole on every
/// data-parallel rank even with the distributed optimizer (the reduce-scatter writes into it).
pub fn contiguous_grad_bytes(spec: &Spec, profile: &Profile, trainable_values: u64) -> Option<u64> {
    if profile.engine != Engine::Megatron || trainable_values == 0 {
        return None;
    }
    let b = if megatron::GRAD_REDUCE_IN_FP32 {
        4.0
    } else {
        spec.precision.grads.bytes()
    };
    Some(profile.allocated(bytes(trainable_values, b)))
}

/// DeepSpeed ZeRO-3's flat gradient partition on this rank (bytes), or `None` where the
/// backward allocates the gradients (every other engine and stage, or the partition on the
/// host with the optimizer, [`grads_follow_host_optimizer`]). `stage3.py` `__init__`
/// allocates `grad_partitions_flat_buffer` (`torch.zeros`, this rank's share of every
/// trainable value in the gradient accumulation dtype, the weights' by default) with the
/// optimizer and keeps it: the backward's reduce-scatter writes each shard into it. Seen on an
/// H100 (`deepspeed_z3_n*`): 16 bytes a parameter over the ranks between steps (bf16 weight,
/// fp32 master, Adam's two moments, bf16 gradient), 8 before the first step (no moments yet).
pub fn zero3_grad_partition_bytes(
    spec: &Spec,
    profile: &Profile,
    cand: &Candidate,
    trainable_values: u64,
) -> Option<u64> {
    let sharded = cand.zero >= 3 && cand.data > 1;
    if profile.engine != Engine::DeepSpeed
        || !sharded
        || trainable_values == 0
        || grads_follow_host_optimizer(profile, cand)
    {
        return None;
    }
    let share = trainable_values.div_ceil(cand.data);
    Some(profile.allocated(bytes(share, spec.precision.grads.bytes())))
}

/// The gradients DeepSpeed ZeRO-1 holds when its step runs (bytes), or `None` where they are
/// what the backward left. Stage 1 keeps whole gradients through the backward and at the
/// accumulation boundary reduces them into this rank's contiguous partition, clearing each
/// `param.grad` (`stage_1_and_2.py` `reduce_gradients` → `reduce_ready_partitions_and_remove_grads`
/// → `copy_grads_in_partition`): the step starts with the partition only, as ZeRO-2's. Seen
/// on the H100: `deepspeed_z1_n8` and `deepspeed_z2_n8` agree in every phase.
pub fn zero1_step_gradient_bytes(
    spec: &Spec,
    profile: &Profile,
    cand: &Candidate,
    trainable_values: u64,
) -> Option<u64> {
    let d = cand.data.max(1);
    if profile.engine != Engine::DeepSpeed
        || cand.zero != 1
        || d <= 1
        || trainable_values == 0
        || cand.offloads(OffloadWhat::Optimizer)
    {
        return None;
    }
    Some(profile.allocated(bytes(
        trainable_values.div_ceil(d),
        spec.precision.grads.bytes(),
    )))
}

/// Does DeepSpeed ZeRO-3 keep every parameter it gathers in the forward until that
/// parameter's module has run backward? It does from the second step on, with DeepSpeed's
/// defaults and with what rcoa writes (`partitioned_param_coordinator.py`): the first step
/// records the module trace; from then on `fetch_sub_module` walks the recorded parameter
/// trace, and its prefetch loop pops every entry whose parameter is already gathered or in
/// flight without counting it against `stage3_prefetch_bucket_size`, so the walk runs through
/// the rest of the forward into the backward entries, setting each parameter's
/// `__most_recent_step_id_param_fetched_for` to its backward use; `__params_to_release` then
/// keeps it (a reuse within `stage3_max_reuse_distance` keeps it too). Read on DeepSpeed
/// 0.19.8 by listing the gathered parameters after each forward of this Llama (16 layers,
/// 0.89 B parameters, 8 ranks, CPU, fake process group): none after the first step's
/// forward, all of them after the second's and third's, with DeepSpeed's sizes, with rcoa's
/// (prefetch 0.9 hidden²), with no prefetch, and with a reuse distance of 1,000 (with no
/// prefetch and a reuse distance of 1,000 together, only the head: both mechanisms keep
/// them, and rcoa writes neither off); and on the
/// H100 rows: each step after the first holds one whole bf16 copy of the model more at the
/// forward's end (1,660 MiB + 32 MiB, `deepspeed_z3_n2/8/32`).
pub fn zero3_keeps_forward_gathers(profile: &Profile, cand: &Candidate) -> bool {
    profile.engine == Engine::DeepSpeed && cand.zero >= 3 && cand.data > 1
}

/// Buffers DeepSpeed allocates inside the backward, as scratch of the ops whose backward runs
/// while they exist (`tape` is the stage's micro-step):
/// - ZeRO-1/2 (`stage_1_and_2.py` `setup_buckets`, from the first gradient hook until
///   `independent_gradient_partition_epilogue` releases them): with `contiguous_gradients`
///   one `reduce_bucket_size` buffer in the weights' dtype, two with `overlap_comm`;
/// - ZeRO-0 (`runtime/engine.py` `allreduce_gradients` → `buffered_allreduce_fallback`): a
///   flat copy of up to 5e8 gradient elements, made after the backward for the all-reduce.
pub fn backward_scratch(
    spec: &Spec,
    profile: &Profile,
    cand: &Candidate,
    tape: &mut super::tape::Tape,
) {
    use super::tape::Role;
    if profile.engine != Engine::DeepSpeed || cand.data.max(1) <= 1 {
        return;
    }
    let zs = spec.deepspeed_zero();
    let reads_trainable = |op: &super::tape::OpInfo| {
        op.inputs.iter().any(|x| {
            let t = &tape.tensors[x.0 as usize];
            t.role == Role::Param && t.grad_bytes > 0
        })
    };
    // The last op of the forward that reads a trainable weight runs backward first: its
    // gradient is the first the hooks see.
    let Some(first_grad) = tape.ops.iter().rposition(reads_trainable) else {
        return;
    };
    let trainable: u64 = tape
        .tensors
        .iter()
        .filter(|t| t.role == Role::Param && t.grad_bytes > 0)
        .map(|t| t.grad_bytes)
        .sum();
    match cand.zero {
        1 | 2 => {
            let buffers = if zs.overlap_comm { 2 } else { 1 };
            let b = buffers * bytes(zs.reduce_bucket, spec.precision.params.bytes());
            for op in &mut tape.ops[..first_grad] {
                op.bwd_workspace += b;
            }
        }
        0 => {
            // `grad_bytes` is each gradient's allocation; the flat copy holds their values.
            let elems = (trainable as f64 / spec.precision.grads.bytes()) as u64;
            let b = bytes(
                elems.min(deepspeed::ALLREDUCE_BUCKET_ELEMENTS),
                spec.precision.grads.bytes(),
            );
            // The backward's last op (the first of the forward that has one) runs last.
            if let Some(i) = tape.ops.iter().position(|o| o.has_backward(tape)) {
                tape.ops[i].bwd_workspace += b;
            }
        }
        _ => {}
    }
}

/// The optimizer step's temporaries on the device, or `None` to keep `memory::optimizer`'s
/// (eager PyTorch's `torch.optim` over separate parameters). `trainable` holds each
/// trainable tensor's values on this rank.
pub fn step_temporaries(
    spec: &Spec,
    profile: &Profile,
    cand: &Candidate,
    opt: &OptimizerModel,
    trainable: &[u64],
) -> Option<u64> {
    let d = cand.data.max(1);
    let shards = if cand.zero >= 1 { d } else { 1 };
    let largest = trainable.iter().copied().max().unwrap_or(0);
    // `memory::optimizer` adds an fp32 cast of the largest gradient for a master copy;
    // both engines below keep fp32 gradients of their own instead.
    let master_cast = if opt.master_bytes > 0 {
        profile.allocated(bytes(largest, 4.0))
    } else {
        0
    };
    let generic = opt.temp_bytes.saturating_sub(master_cast).div_ceil(shards);
    match profile.engine {
        Engine::Burn | Engine::Eager | Engine::Fsdp2 => None,
        // Megatron's main gradients are views of the fp32 gradient buffer: nothing is cast.
        Engine::Megatron => Some(generic),
        Engine::DeepSpeed => {
            let values: u64 = trainable.iter().sum();
            let partition = values.div_ceil(shards);
            // ZeRO-3 steps one `sub_group_size` piece of the partition at a time.
            let piece = if cand.zero >= 3 {
                partition.min(deepspeed::SUB_GROUP_SIZE)
            } else {
                partition
            };
            let grad_b = spec.precision.grads.bytes();
            let fused = spec.optimizer.implementation == OptImpl::Fused;
            if cand.zero == 0 && spec.precision.params.bytes() >= 4.0 {
                // fp32 weights without ZeRO: DeepSpeed wraps nothing, torch's optimizer steps
                // the parameters themselves.
                return None;
            }
            let mut temp = if cand.zero == 0 && !fused {
                // 16-bit weights without ZeRO and torch's optimizer: `FP16_UnfusedOptimizer`
                // (`fp16/unfused_optimizer.py` `step`) casts every 16-bit gradient to an fp32
                // `.grad` of its master parameter, all of them before the step.
                trainable
                    .iter()
                    .map(|&n| profile.allocated(bytes(n, 4.0)))
                    .sum()
            } else if cand.zero >= 3 {
                // `stage3.py` `_prepare_fp32_grad_for_sub_group`: the sub-group's piece of the
                // flat gradient partition (`zero3_grad_partition_bytes`) cast to fp32.
                if grad_b < 4.0 {
                    profile.allocated(bytes(piece, 4.0))
                } else {
                    0
                }
            } else {
                // `stage_1_and_2.py` `step` (and `FP16_Optimizer` over a fused optimizer):
                // `flatten(averaged_gradients)` in the gradients' dtype, then `.to(fp32)` for
                // `single_partition_of_fp32_groups[i].grad`.
                let mut t = profile.allocated(bytes(piece, grad_b));
                if grad_b < 4.0 {
                    t += profile.allocated(bytes(piece, 4.0));
                }
                t
            };
            // ZeRO-1/2 free the flat copy and the gradient partition itself
            // (`averaged_gradients[i] = None`) before `_optimizer_step`: the optimizer's own
            // temporaries stand beside the fp32 gradient only. The partition is in the step's
            // gradients; its bytes come off here.
            let flat_and_cast = temp;
            let partition = ((1..=2).contains(&cand.zero) && grad_b < 4.0)
                .then(|| profile.allocated(bytes(piece, grad_b)));
            // The optimizer runs over the one flat fp32 partition: FusedAdam allocates
            // nothing; torch's foreach makes one partition-sized temporary, a per-parameter
            // loop two (the partition is its one parameter).
            let adam_like = matches!(
                spec.optimizer.kind,
                OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Lion
            );
            temp += if cand.zero == 0 && !fused {
                // ... over the separate fp32 master parameters: torch.optim's own temporaries.
                generic
            } else if adam_like {
                match spec.optimizer.implementation {
                    OptImpl::Fused | OptImpl::Paged => 0,
                    OptImpl::Foreach => profile.allocated(bytes(piece, 4.0)),
                    OptImpl::Plain => 2 * profile.allocated(bytes(piece, 4.0)),
                }
            } else {
                generic
            };
            if let Some(partition) = partition {
                // The cast, then the fp32 gradient and the optimizer's temporaries without the
                // flat copy and the partition (counted with the step's gradients).
                let optimizer = temp - flat_and_cast;
                let fp32 = flat_and_cast - partition;
                temp = flat_and_cast.max((fp32 + optimizer).saturating_sub(partition));
            }
            Some(temp)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::parallel;
    use crate::spec::Offload;

    // A 2-layer decoder small enough to count by hand: hidden 256, 4 heads of 64, SwiGLU
    // ffn 1024, vocab 1000, untied head, RMSNorm.
    const H: u64 = 256;
    const F: u64 = 1024;
    const V: u64 = 1000;
    /// One layer: q, k, v, o (4 H²), gate, up, down (3 H F), two RMSNorm scales (2 H).
    const LAYER: u64 = 4 * H * H + 3 * H * F + 2 * H;
    /// The whole model: two layers, the embedding and the head (V H each), the final norm.
    const MODEL: u64 = 2 * LAYER + 2 * V * H + H;

    fn spec(target: &str, precision: &str, zero: u8) -> Spec {
        let src = format!(
            "model {{ arch = decoder layers = 2 hidden = {H} heads = 4 kv_heads = 4 ffn = {F} vocab = {V} tie_embeddings = false }}\n\
             hardware {{ gpu = h100-80gb gpus_per_node = 4 }}\nprecision {precision}\n\
             optimizer adamw {{ lr = 1e-4 }}\ntrain {{ seq_len = 128 global_batch = 16 }}\n\
             parallel {{ zero = {zero} }}\ntarget {target}\n"
        );
        let file = rcoa_grammar::parse("t.plan", &src).unwrap();
        let ctx =
            crate::resolve::ResolveContext::new("t.plan", &src, std::path::PathBuf::from("."));
        crate::resolve::resolve(&file, &ctx).unwrap()
    }

    fn cand(zero: u8, data: u64) -> Candidate {
        Candidate {
            data,
            zero,
            ..crate::testing::one_gpu(1)
        }
    }

    fn evaluate(s: &Spec, c: &Candidate) -> MemoryReport {
        parallel::evaluate(s, c, &Profile::for_target(s.target), false)
    }

    fn engine_bytes(s: &Spec, c: &Candidate) -> Vec<(String, u64)> {
        let p = Profile::for_target(s.target);
        let stages = super::super::stages(s, c);
        let r = super::super::evaluate_on(s, c, &p, &stages[0], false);
        buffers(s, c, &p, &stages[0], &r)
            .unwrap()
            .into_iter()
            .map(|b| (b.what, b.bytes))
            .collect()
    }

    #[test]
    fn the_hand_count_is_the_model_the_tape_builds() {
        let s = spec("fsdp", "{ params = fp32 compute = bf16 }", 3);
        assert_eq!(parallel::layer_params(&s.model, 1), LAYER);
        assert_eq!(evaluate(&s, &cand(3, 1)).params_total, MODEL);
    }

    /// The FSDP2 tape of a plan: its ops' engine scratch by unit, its peak report.
    fn fsdp_tape(s: &Spec, c: &Candidate) -> (crate::memory::tape::Tape, MemoryReport) {
        let p = Profile::for_target(s.target);
        let b = crate::memory::build::Builder::new(s, &p, c).build(0..2, true, true);
        (b.tape, evaluate(s, c))
    }

    /// The engine scratch of the first op of layer `layer` (`None`: the head's last op).
    fn scratch_at(
        tape: &crate::memory::tape::Tape,
        layer: Option<usize>,
    ) -> crate::memory::tape::EngineScratch {
        match layer {
            Some(l) => tape.ops[tape.layers[l].first_op as usize].engine,
            None => tape.ops.last().unwrap().engine,
        }
    }

    /// FSDP2 at N = 4 under `MixedPrecisionPolicy(bf16, fp32)` (`_fsdp_param_group.py`,
    /// `_fsdp_collectives.py`): fp32 shards of weights, gradients and Adam state at rest;
    /// while a layer runs forward the root unit (embedding, head, final norm), the layer's
    /// unsharded bf16 copies and its flat all-gather output (kept until the next unit's
    /// copy-out); in a layer's backward the root, the layer, the previous layer's prefetched
    /// flat output, the next layer's fp32 reduce-scatter input and the unsharded bf16
    /// gradients already made (the head's and norm's, the layer's later ops'). Every
    /// parameter of this model is a multiple of 512 bytes in bf16: sums are exact.
    #[test]
    fn fsdp2_two_layer_model_at_four_ranks() {
        let s = spec("fsdp", "{ params = fp32 compute = bf16 }", 3);
        let c = cand(3, 4);
        assert!(
            engine_bytes(&s, &c).is_empty(),
            "{:?}",
            engine_bytes(&s, &c)
        );
        let (tape, r) = fsdp_tape(&s, &c);
        let root = (2 * V * H + H) * 2;
        let layer = LAYER * 2;
        let root_grads = (V * H + H) * 2;
        assert_eq!(scratch_at(&tape, Some(0)).forward, [root + 2 * layer, 0]);
        // Layer 1's first op (the input norm's upcast, no parameter) runs backward last in
        // the layer: every gradient of the layer exists.
        let l1 = scratch_at(&tape, Some(1));
        assert_eq!(l1.backward, [root + layer + layer, root_grads + layer]);
        assert_eq!(l1.recompute, [root + layer + layer, root_grads]);
        // Layer 0 waits for layer 1's fp32 reduce-scatter input; nothing is prefetched.
        let l0 = scratch_at(&tape, Some(0));
        assert_eq!(l0.backward, [root + layer, LAYER * 4 + root_grads + layer]);
        // The loss: the root and layer 1's flat output (forward: kept for the next unit's
        // copy-out; backward: prefetched).
        let loss = scratch_at(&tape, None);
        assert_eq!(loss.forward, [root + layer, 0]);
        assert_eq!(loss.backward, [root + layer, 0]);
        // The modules compute in bf16: every activation is the one of bf16 weights.
        let acts = |t: &crate::memory::tape::Tape| -> Vec<(crate::spec::Dtype, u64)> {
            t.tensors
                .iter()
                .filter(|t| t.role == crate::memory::tape::Role::Activation)
                .map(|t| (t.dtype, t.bytes))
                .collect()
        };
        let bf16 = fsdp_tape(&spec("fsdp", "{ params = bf16 compute = bf16 }", 3), &c).0;
        assert_eq!(acts(&tape), acts(&bf16));
        // At rest: fp32 shards of the weights and both Adam moments.
        let slack = 23 * 512;
        assert!(r.resident_param_bytes.abs_diff((MODEL * 4).div_ceil(4)) <= slack);
        assert!(r.breakdown["optimizer"].abs_diff((MODEL * 8).div_ceil(4)) <= 2 * slack);
        // reshard_after_forward=False (zero = 2): layer 0 stays gathered through layer 1.
        let two = fsdp_tape(
            &spec("fsdp", "{ params = fp32 compute = bf16 }", 2),
            &cand(2, 4),
        )
        .0;
        assert_eq!(scratch_at(&two, Some(1)).forward, [root + 3 * layer, 0]);
        assert_eq!(scratch_at(&two, Some(1)).backward[0], root + 2 * layer);
    }

    /// The micro-step's tape of `s` under `c` (the first stage), as `memory::evaluate_on`
    /// builds it.
    fn tape_of(s: &Spec, c: &Candidate) -> crate::memory::tape::Tape {
        let p = Profile::for_target(s.target);
        let stage = &super::super::stages(s, c)[0];
        crate::memory::build::Builder::new(s, &p, c)
            .build(
                stage.first_layer..stage.end_layer,
                stage.embedding,
                stage.head,
            )
            .tape
    }

    /// Each op's backward scratch in `with` beyond `without` (the same model).
    fn bwd_scratch_added(with: &Spec, without: &Spec, c: &Candidate) -> Vec<u64> {
        let (a, b) = (tape_of(with, c), tape_of(without, c));
        assert_eq!(a.ops.len(), b.ops.len());
        a.ops
            .iter()
            .zip(&b.ops)
            .map(|(x, y)| x.bwd_workspace - y.bwd_workspace)
            .collect()
    }

    /// DeepSpeed ZeRO-2 (`stage_1_and_2.py`): the bf16 `reduce_bucket_size` buffers (two with
    /// `overlap_comm`, which rcoa writes; one under DeepSpeed's defaults) exist from the
    /// first gradient (the head's) to the end of the backward, and nothing for the whole step;
    /// at the step the flat bf16 gradient partition and its fp32 cast, FusedAdam allocating
    /// nothing.
    #[test]
    fn deepspeed_zero2_buckets_and_flat_partition() {
        use crate::profile::engines::deepspeed::ZeroSettings;
        let s = spec(
            "deepspeed",
            "{ params = bf16 compute = bf16 master = fp32 }",
            2,
        );
        assert_eq!(
            s.optimizer.implementation,
            OptImpl::Fused,
            "DeepSpeed's default"
        );
        let c = cand(2, 4);
        assert!(engine_bytes(&s, &c).is_empty());
        let mut none = s.clone();
        none.deepspeed_zero = Some(ZeroSettings {
            reduce_bucket: 0,
            ..ZeroSettings::rcoa(H)
        });
        let head = tape_of(&s, &c)
            .ops
            .iter()
            .position(|o| o.name == "lm_head")
            .unwrap();
        let added = bwd_scratch_added(&s, &none, &c);
        assert!(
            added[..head].iter().all(|&b| b == 2 * H * H * 2),
            "{added:?}"
        );
        assert!(added[head..].iter().all(|&b| b == 0), "{added:?}");
        let mut library = s.clone();
        library.deepspeed_zero = Some(ZeroSettings::library_defaults(2));
        let added = bwd_scratch_added(&library, &none, &c);
        assert_eq!(added[0], 500_000_000 * 2, "one bucket without overlap_comm");
        let p = Profile::for_target(s.target);
        let opt = OptimizerModel {
            name: "adamw",
            state_bytes: 0,
            master_bytes: 4 * MODEL,
            temp_bytes: 4 * LAYER,
        };
        let values = [MODEL - 3, 1, 1, 1];
        let partition = MODEL.div_ceil(4);
        let round = |b: u64| b.div_ceil(512) * 512;
        assert_eq!(
            step_temporaries(&s, &p, &c, &opt, &values),
            Some(p.allocated(partition * 2) + p.allocated(partition * 4))
        );
        assert_eq!(p.allocated(partition * 2), round(partition * 2));
        // torch's foreach AdamW (`torch_adam`) over the one flat partition: one fp32
        // partition more, after the bf16 partition and its flat copy are freed (no higher
        // than the cast); a per-parameter loop two, which is.
        let mut foreach = s.clone();
        foreach.optimizer.implementation = OptImpl::Foreach;
        let (bf16, fp32) = (p.allocated(partition * 2), p.allocated(partition * 4));
        assert_eq!(
            step_temporaries(&foreach, &p, &c, &opt, &values),
            Some(bf16 + fp32)
        );
        foreach.optimizer.implementation = OptImpl::Plain;
        assert_eq!(
            step_temporaries(&foreach, &p, &c, &opt, &values),
            Some(3 * fp32 - bf16)
        );
        // ZeRO-1 steps from the same partition: the whole gradients are reduced into it.
        assert_eq!(
            zero1_step_gradient_bytes(&s, &p, &cand(1, 4), MODEL),
            Some(bf16)
        );
        assert_eq!(zero1_step_gradient_bytes(&s, &p, &c, MODEL), None);
        // Eager PyTorch keeps `memory::optimizer`'s temporaries.
        let eager = Profile::pytorch();
        assert_eq!(step_temporaries(&s, &eager, &c, &opt, &values), None);
    }

    /// DeepSpeed without ZeRO, bf16 weights and torch's AdamW (`FP16_UnfusedOptimizer`): the
    /// all-reduce's flat copy of the gradients at the backward's end only, and at the step an
    /// fp32 `.grad` of every parameter besides torch's own temporaries; fp32 weights are
    /// stepped by torch alone.
    #[test]
    fn deepspeed_zero0_casts_each_gradient_and_flattens_after_the_backward() {
        let mut s = spec(
            "deepspeed",
            "{ params = bf16 compute = bf16 master = fp32 }",
            0,
        );
        s.optimizer.implementation = OptImpl::Foreach;
        let c = cand(0, 4);
        assert!(engine_bytes(&s, &c).is_empty());
        let tape = tape_of(&s, &c);
        let last = tape.ops.iter().position(|o| o.has_backward(&tape)).unwrap();
        let mut eager = s.clone();
        eager.target = crate::spec::Target::Pytorch;
        let added = bwd_scratch_added(&s, &eager, &c);
        for (i, b) in added.iter().enumerate() {
            assert_eq!(*b, if i == last { MODEL * 2 } else { 0 }, "op {i}");
        }
        let p = Profile::for_target(s.target);
        let opt = OptimizerModel {
            name: "adamw",
            state_bytes: 0,
            master_bytes: 4 * MODEL,
            temp_bytes: 4 * MODEL + 4 * LAYER,
        };
        let values = [MODEL - 3, 1, 1, 1];
        let fp32_grads: u64 = values.iter().map(|&n| p.allocated(n * 4)).sum();
        let generic = 4 * MODEL + 4 * LAYER - p.allocated((MODEL - 3) * 4);
        assert_eq!(
            step_temporaries(&s, &p, &c, &opt, &values),
            Some(fp32_grads + generic)
        );
        let fp32 = spec("deepspeed", "{ params = fp32 compute = fp32 }", 0);
        assert_eq!(step_temporaries(&fp32, &p, &c, &opt, &values), None);
    }

    /// DeepSpeed ZeRO-3 (`stage3.py`, `partition_parameters.py`,
    /// `partitioned_param_coordinator.py`): one reduce bucket for the whole step, the norms
    /// (under the persistence threshold) whole on every rank, the flat bf16 gradient partition
    /// from the start, and every matrix gathered in the forward kept until its backward (no
    /// separate prefetch).
    #[test]
    fn deepspeed_zero3_keeps_its_gathers_bucket_and_gradient_partition() {
        use crate::profile::engines::deepspeed::ZeroSettings;
        let s = spec(
            "deepspeed",
            "{ params = bf16 compute = bf16 master = fp32 }",
            3,
        );
        let c = cand(3, 4);
        let bufs = engine_bytes(&s, &c);
        let bytes: Vec<u64> = bufs.iter().map(|b| b.1).collect();
        let norms = (2 * 2 + 1) * H;
        assert_eq!(bytes, vec![H * H * 2, (norms - norms / 4) * 2], "{bufs:?}");
        let mut library = s.clone();
        library.deepspeed_zero = Some(ZeroSettings::library_defaults(3));
        assert_eq!(engine_bytes(&library, &c)[0].1, 500_000_000 * 2);
        // Every matrix (7 a layer, the embedding and the head) gathered whole, made by the op
        // that reads it and saved by it for its backward.
        let tape = tape_of(&s, &c);
        let kept: Vec<usize> = (0..tape.tensors.len())
            .filter(|&i| tape.tensors[i].name == "gathered_weight")
            .collect();
        assert_eq!(kept.len(), 2 * 7 + 2);
        let total: u64 = kept.iter().map(|&i| tape.tensors[i].bytes).sum();
        assert_eq!(total, (MODEL - norms) * 2);
        for &i in &kept {
            let op = &tape.ops[tape.tensors[i].producer.unwrap().0 as usize];
            assert!(op.saved.iter().any(|t| t.0 as usize == i), "{}", op.name);
        }
        // A tied head reads the embedding's gathered table: no second copy, no scratch.
        let mut tied = s.clone();
        tied.model.tie_embeddings = true;
        let tape = tape_of(&tied, &c);
        let gathered = |name: &str| tape.tensors.iter().filter(|t| t.name == name).count();
        assert_eq!(gathered("gathered_weight"), 2 * 7 + 1);
        let head = tape.ops.iter().find(|o| o.name == "lm_head").unwrap();
        assert_eq!((head.fwd_workspace, head.bwd_workspace), (0, 0));
        let p = Profile::for_target(s.target);
        let partition = p.allocated(MODEL.div_ceil(4) * 2);
        assert_eq!(
            zero3_grad_partition_bytes(&s, &p, &c, MODEL),
            Some(partition)
        );
        // At the backward's start: the weight shards, every matrix gathered, the gradient
        // partition.
        let r = evaluate(&s, &c);
        assert_eq!(r.peak.phase, crate::memory::Phase::Backward, "{:?}", r.peak);
        assert_eq!(r.breakdown["grads"], partition);
        let shards = r.breakdown["weights"] - total;
        assert!(
            shards.abs_diff(MODEL.div_ceil(4) * 2) <= 23 * 512,
            "{shards}"
        );
        // Checkpointed layers keep theirs too, from the forward through the recompute (which
        // finds them gathered), and are still recomputed (more FLOPs).
        let ckpt = Candidate {
            checkpoint_layers: vec![0, 1],
            ..c.clone()
        };
        let at_forward_end = |c: &Candidate| {
            let r = parallel::evaluate(&s, c, &p, true);
            let end = r.timeline.iter().find(|x| x.op == "forward end").unwrap();
            end.by_category[crate::memory::Category::Weights as usize]
        };
        assert_eq!(at_forward_end(&c), at_forward_end(&ckpt));
        assert_eq!(at_forward_end(&ckpt) - shards, total);
        let work = |c: &Candidate| super::super::tape_work(&tape_of(&s, c)).flops;
        assert!(work(&ckpt) > work(&c));
        // fp32 weights: ZeRO keeps its own fp32 partition besides them.
        let fp32 = spec("deepspeed", "{ params = fp32 compute = fp32 }", 1);
        let bufs = engine_bytes(&fp32, &cand(1, 4));
        assert_eq!(bufs[0].1, MODEL.div_ceil(4) * 4, "{bufs:?}");
    }

    /// Megatron-Core (`param_and_grad_buffer.py`, `distrib_optimizer.py`): bf16 weights whole,
    /// an fp32 gradient buffer whole on every rank, fp32 main weights and Adam state over the
    /// data ranks: 2 + 4 + 12 / d bytes a parameter.
    #[test]
    fn megatron_distributed_optimizer_holds_6_plus_12_over_d() {
        let s = spec(
            "megatron",
            "{ params = bf16 compute = bf16 master = fp32 }",
            1,
        );
        assert_eq!(s.optimizer.implementation, OptImpl::Fused);
        let r = evaluate(&s, &cand(1, 4));
        let at = |k: &str| r.breakdown[k];
        let slack = 23 * 512 * 3;
        assert!(
            at("weights").abs_diff(2 * MODEL) <= slack,
            "{}",
            at("weights")
        );
        assert_eq!(at("grads"), Profile::megatron().allocated(4 * MODEL));
        assert!(
            at("optimizer").abs_diff((12 * MODEL).div_ceil(4)) <= slack,
            "{}",
            at("optimizer")
        );
        assert!(engine_bytes(&s, &cand(1, 4)).is_empty());
        assert_eq!(
            at("workspace"),
            Profile::pytorch().workspace_bytes + megatron::TE_WORKSPACE_BYTES
        );
    }

    /// ZeRO-3 with `offload_optimizer`: the gradient partition lives on the host
    /// (`stage3.py`: `grad_partitions_flat_buffer` on `self.device`, the CPU), eager
    /// PyTorch's generic ZeRO keeps it on the device.
    #[test]
    fn deepspeed_offload_keeps_the_gradient_partition_on_the_host() {
        // Two micro-batches: the second starts with every gradient shard allocated.
        let mut c = cand(3, 4);
        c.grad_accum = 2;
        c.offload = vec![Offload {
            what: OffloadWhat::Optimizer,
            to: crate::spec::OffloadTo::Cpu,
        }];
        let precision = "{ params = bf16 compute = bf16 master = fp32 }";
        let ds = evaluate(&spec("deepspeed", precision, 3), &c);
        let eager = evaluate(&spec("pytorch", precision, 3), &c);
        assert!(ds.breakdown["grads"] < 1 << 20, "{}", ds.breakdown["grads"]);
        let shard = (2 * MODEL).div_ceil(4);
        let eager_grads = eager.breakdown["grads"];
        assert!(
            eager_grads.abs_diff(shard) <= 23 * 512,
            "{eager_grads} vs {shard}"
        );
    }

    #[test]
    fn engines_refuse_what_they_do_not_run() {
        use crate::profile::engines::{check_zero, offload_refusal};
        use crate::spec::{OffloadTo, Target};
        assert!(check_zero(Target::Fsdp, 1).is_err());
        assert!(check_zero(Target::Fsdp, 3).is_ok());
        assert!(check_zero(Target::Megatron, 3).is_err());
        assert!(check_zero(Target::Deepspeed, 3).is_ok());
        let opt = Offload {
            what: OffloadWhat::Optimizer,
            to: OffloadTo::Cpu,
        };
        assert!(offload_refusal(Target::Megatron, &opt).is_none());
        assert!(offload_refusal(Target::Fsdp, &opt).is_none());
        assert!(offload_refusal(Target::Deepspeed, &opt).is_none());
        let nvme = Offload {
            what: OffloadWhat::Params,
            to: OffloadTo::Nvme,
        };
        assert!(offload_refusal(Target::Fsdp, &nvme).is_some());
        // FSDP2's CPUOffloadPolicy is all three or nothing.
        use crate::profile::engines::offload_set_refusal;
        let all: Vec<Offload> = crate::profile::engines::FSDP_CPU_OFFLOAD
            .iter()
            .map(|&what| Offload {
                what,
                to: OffloadTo::Cpu,
            })
            .collect();
        assert!(offload_set_refusal(Target::Fsdp, &all).is_none());
        assert!(offload_set_refusal(Target::Fsdp, &[]).is_none());
        assert!(offload_set_refusal(Target::Fsdp, &all[..2]).is_some());
        assert!(offload_set_refusal(Target::Deepspeed, &all[..1]).is_none());
    }

    /// The step's schedule each engine runs: DeepSpeed and Megatron-Core step after the
    /// backward; DeepSpeed's pipeline is plain 1F1B.
    #[test]
    fn engines_refuse_schedules_they_do_not_run() {
        use crate::profile::engines::check_schedule;
        let precision = "{ params = bf16 compute = bf16 master = fp32 }";
        for (target, zero) in [("deepspeed", 1), ("megatron", 1)] {
            let mut s = spec(target, precision, zero);
            assert!(check_schedule(&s).is_ok());
            s.optimizer_in_backward = true;
            let e = check_schedule(&s).unwrap_err().to_string();
            assert!(e.contains("in_backward") && e.contains(target), "{e}");
        }
        let mut fsdp = spec("fsdp", "{ params = fp32 compute = bf16 }", 3);
        fsdp.optimizer_in_backward = true;
        fsdp.parallel.virtual_stages = 2;
        assert!(check_schedule(&fsdp).is_ok());
        let mut ds = spec("deepspeed", precision, 1);
        ds.parallel.virtual_stages = 2;
        let e = check_schedule(&ds).unwrap_err().to_string();
        assert!(e.contains("virtual_stages"), "{e}");
    }

    fn cpu_offload(c: Candidate) -> Candidate {
        let offload = crate::profile::engines::FSDP_CPU_OFFLOAD
            .iter()
            .map(|&what| Offload {
                what,
                to: crate::spec::OffloadTo::Cpu,
            })
            .collect();
        Candidate { offload, ..c }
    }

    /// FSDP2's `CPUOffloadPolicy` at N = 4 (`_fsdp_param.py`, `_fsdp_collectives.py`): the
    /// fp32 shards of weights, gradients and Adam state are in host memory; the device keeps
    /// what is gathered (two bf16 layers plus the all-gather output, the root unit), one
    /// layer's reduce-scatter, and the copy-in of a layer's shards: each parameter's fp32
    /// shard uploaded and cast to bf16, the layer's bf16 shards held until the all-gather,
    /// one fp32 parameter shard at a time (the largest, an MLP projection: H × F).
    #[test]
    fn fsdp2_cpu_offload_keeps_only_gathered_units_on_the_device() {
        let s = spec("fsdp", "{ params = fp32 compute = bf16 }", 3);
        let c = cpu_offload(cand(3, 4));
        let bufs = engine_bytes(&s, &c);
        let bytes: Vec<u64> = bufs.iter().map(|b| b.1).collect();
        let copy_in = LAYER.div_ceil(4) * 2 + (H * F).div_ceil(4) * 4;
        assert_eq!(copy_in, 786_688);
        assert_eq!(bytes, vec![copy_in], "{bufs:?}");
        assert!(bufs[0].0.contains("CPU offload copy-in"), "{}", bufs[0].0);
        let r = evaluate(&s, &c);
        let at = |k: &str| r.breakdown[k];
        // One byte a tensor rounded to 512: 23 tensors. The weights at the peak are the
        // gathered units only.
        assert!(
            r.resident_param_bytes <= 23 * 512,
            "{}",
            r.resident_param_bytes
        );
        assert_eq!(at("optimizer"), 0);
        assert_eq!(at("communication"), bytes.iter().sum::<u64>());
        // The same plan on the device holds the fp32 weight and Adam shards (4 + 8 bytes over
        // 4 ranks) through the step, far more than the copy-in.
        let on_device = evaluate(&s, &cand(3, 4));
        let held = on_device.resident_param_bytes + on_device.breakdown["optimizer"];
        assert!(
            held.abs_diff((MODEL * 12).div_ceil(4)) <= 3 * 23 * 512,
            "{held}"
        );
        assert!(r.peak_bytes + held - copy_in <= on_device.peak_bytes + 3 * 23 * 512);
        // fp32 compute casts nothing: the uploaded fp32 shards are the all-gather inputs.
        let fp32 = spec("fsdp", "{ params = fp32 compute = fp32 }", 3);
        let b = engine_bytes(&fp32, &c);
        assert_eq!(b[0].1, LAYER.div_ceil(4) * 4, "{b:?}");
    }

    /// The step in the backward under FSDP2 runs on the sharded parameter: its temporaries
    /// are a shard's (1/data), and none on the device when the optimizer is on the host.
    #[test]
    fn fsdp2_steps_in_the_backward_on_shards() {
        let p = Profile::fsdp();
        assert_eq!(in_backward_step_shards(&p, &cand(3, 4)), Some(4));
        assert_eq!(in_backward_step_shards(&p, &cpu_offload(cand(3, 4))), None);
        assert_eq!(
            in_backward_step_shards(&Profile::pytorch(), &cand(0, 4)),
            Some(1)
        );
    }

    /// The search under `target fsdp` offloads all three (CPUOffloadPolicy) or nothing: a
    /// part of the set is never a candidate, and a required part is a clear error.
    #[test]
    fn fsdp2_offload_is_searched_as_one_policy() {
        let plan = |fit: &str| {
            let src = format!(
                "model {{ arch = decoder layers = 2 hidden = {H} heads = 4 kv_heads = 4 ffn = {F} vocab = {V} tie_embeddings = false }}\n\
                 hardware {{ gpu = h100-80gb gpus_per_node = 4 }}\nprecision {{ params = fp32 compute = bf16 }}\n\
                 optimizer adamw {{ lr = 1e-4 }}\ntrain {{ seq_len = 128 global_batch = 16 }}\n\
                 parallel {{ zero = 3 }}\nfit {{ {fit} }}\ntarget fsdp\n"
            );
            let file = rcoa_grammar::parse("t.plan", &src).unwrap();
            let ctx =
                crate::resolve::ResolveContext::new("t.plan", &src, std::path::PathBuf::from("."));
            crate::compile(&crate::resolve::resolve(&file, &ctx).unwrap())
        };
        let all = plan("must_offload = [optimizer, params, grads]").unwrap();
        assert_eq!(
            all.lowered.resolved.offload_names(),
            ["optimizer:cpu", "params:cpu", "grads:cpu"]
        );
        assert_eq!(all.lowered.residency().weights, crate::lowered::Place::Host);
        // Allowed in part: never used, and the decision says why.
        let part = plan("offload = [optimizer, params]").unwrap();
        assert!(part.lowered.resolved.offload.is_empty());
        assert!(
            part.explain
                .decisions
                .iter()
                .any(|d| format!("{d:?}").contains("CPUOffloadPolicy")),
            "{:?}",
            part.explain.decisions
        );
        match plan("must_offload = [optimizer]") {
            Err(crate::compile::CompileError::Inconsistent { what, help }) => {
                assert!(what.contains("CPUOffloadPolicy"), "{what}");
                assert!(help.contains("[optimizer, params, grads]"), "{help}");
            }
            other => panic!("{:?}", other.map(|c| c.lowered.resolved)),
        }
    }

    /// The Burn executor's run constants: one `[seq, seq]` causal bias and the two RoPE
    /// tables in the compute dtype; no bias with fused attention; nothing for PyTorch.
    #[test]
    fn burn_charges_one_causal_bias_and_the_rope_tables_unless_flash() {
        use crate::spec::{Attention, Target};
        let burn = Profile::for_target(Target::Burn);
        let mut s = spec("burn", "bf16", 0);
        s.train.attention = Attention::Eager;
        let rope = burn.allocated(128 * 32 * 2) + burn.allocated(128 * 64 * 2);
        assert_eq!(
            burn_context_bytes(&s, &burn, 1),
            burn.allocated(128 * 128 * 2) + rope
        );
        s.train.attention = Attention::Flash;
        assert_eq!(burn_context_bytes(&s, &burn, 1), rope);
        // Phi-4-mini's partial rotation: whole-head cosines too, and the swap index.
        let mut partial = s.clone();
        partial.model.numerics.rotary_dims = Some(48);
        assert_eq!(
            burn_context_bytes(&partial, &burn, 1),
            2 * burn.allocated(128 * 64 * 2) + burn.allocated(64 * 4)
        );
        let pytorch = Profile::for_target(Target::Pytorch);
        assert_eq!(burn_context_bytes(&s, &pytorch, 1), 0);
    }

    /// Packed sequences: each micro-batch's `[b, 1, seq, seq]` mask beside the run's causal
    /// bias, with the token positions and the RoPE rows gathered at them.
    #[test]
    fn packing_charges_a_mask_per_sequence_of_the_micro_batch() {
        use crate::spec::{Attention, Target};
        let burn = Profile::for_target(Target::Burn);
        let mut s = spec("burn", "bf16", 0);
        s.train.attention = Attention::Eager;
        s.train.packing = true;
        let rope = |n: u64| burn.allocated(n * 32 * 2) + burn.allocated(n * 64 * 2);
        let b = 3;
        assert_eq!(
            burn_context_bytes(&s, &burn, b),
            burn.allocated(b * 128 * 128 * 2)
                + burn.allocated(128 * 128 * 2)
                + rope(128)
                + rope(b * 128)
                + burn.allocated(b * 128 * 4)
        );
        assert!(burn_context_bytes(&s, &burn, 4) > burn_context_bytes(&s, &burn, 3));
        // The fused attention: each token's document span instead of a mask.
        s.train.attention = Attention::Flash;
        assert_eq!(
            burn_context_bytes(&s, &burn, b),
            rope(128) + rope(b * 128) + burn.allocated(b * 128 * 4) + burn.allocated(b * 128 * 8)
        );
    }
}
