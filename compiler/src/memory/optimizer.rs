//! Optimizer state and the temporaries of one optimizer step.
//!
//! State is created at the first step (step 1 has none), so the steady-state
//! step carries it for its whole length. Temporaries depend on the
//! implementation: `torch.optim` foreach kernels allocate a list of tensors
//! as large as all trainable parameters (AdamW's `sqrt(v)`), fused kernels
//! allocate nothing, a per-parameter loop only the largest parameter's
//! temporaries; Adafactor keeps factored row/column statistics for matrices
//! and allocates fp32 temporaries of the parameter being updated (and fp32
//! copies of a 16-bit one: [`adafactor_step_peak`]).

use crate::memory::tape::{Tape, TensorId};
use crate::memory::Candidate;
use crate::profile::Profile;
use crate::spec::{Dtype, OptImpl, OptimizerKind, Spec};

/// bitsandbytes' `min_8bit_size`: smaller parameters keep fp32 moments.
pub const ADAM8BIT_MIN_SIZE: u64 = 4096;
/// Block of bitsandbytes' block-wise 8-bit optimizers (one fp32 absmax each).
pub const ADAM8BIT_BLOCK: u64 = 256;

/// One 8-bit Adam moment of a parameter of `n` values: (value bytes, scale
/// bytes). fp32 below [`ADAM8BIT_MIN_SIZE`], else a byte per value and an fp32
/// absmax per block (`rcoa_backend::quant::adam8bit` holds exactly this).
pub fn adam8bit_moment_bytes(n: u64) -> (u64, u64) {
    if n < ADAM8BIT_MIN_SIZE {
        (4 * n, 0)
    } else {
        (n, 4 * n.div_ceil(ADAM8BIT_BLOCK))
    }
}

/// Both 8-bit Adam moments of a parameter of `n` values, in bytes.
pub fn adam8bit_state_bytes(n: u64) -> u64 {
    let (codes, scales) = adam8bit_moment_bytes(n);
    2 * (codes + scales)
}

/// The highest temporaries of transformers' `Adafactor.step` (`transformers/optimization.py`),
/// which updates one parameter at a time. For a 16-bit parameter without a master copy it
/// upcasts first (`grad = grad.float()`, `p_data_fp32 = p.float()`: two fp32 copies), then
/// `update = grad**2 + eps` allocates the square and the sum; `_approx_sq_grad`'s outer
/// product (a factored matrix) or `exp_avg_sq.rsqrt()` (a vector) is made while that update
/// lives, and `p_data_fp32.add_(-update)` negates into one more. All fp32, each as large as
/// the parameter: 8 bytes per value beside the two copies. And the loop's local `update`
/// still holds the previous parameter's update (4 bytes per value of it) until `grad**2 +
/// eps` rebinds it (unless `beta1` rebound it to the first moment, which is state).
/// groundtruth llama1b_adafactor (fp32: no copies): optimizer peak - end
/// = 2 x the 1.05 GB embedding; the bf16 rows of the tail trace
/// (`docs/accuracy.md`): 4 fp32 copies of the embedding and the previous update.
///
/// `burn`: the Burn executor's step (`backend/src/optim/adafactor.rs`) holds the update and
/// its square (for the RMS) at once, but the parameter's own gradient, which Burn's
/// optimizer hands over and the update consumes, is gone by then: one fp32 tensor net
/// beside the gradients. A 16-bit parameter and gradient without a master are cast up in
/// place of their 16-bit selves: 4 bytes a value more. Nothing of the parameter before
/// lives on. Measured on the CPU (`backend/src/tests/in_backward.rs`, the counting
/// allocator): the step peak within 1 % of this. `Some(true)`: the gradients are views of
/// the all-reduced flat vector (data parallelism), which consuming one frees nothing of:
/// one fp32 tensor more.
fn adafactor_step_peak(
    trainable: &[(TensorId, u64)],
    param_dtype: Dtype,
    master: Option<Dtype>,
    first_moment: bool,
    burn: Option<bool>,
    alloc: impl Fn(f64) -> u64,
) -> u64 {
    let upcast = param_dtype.bytes() < 4.0 && master.is_none();
    let mut prev_update = 0;
    let mut peak = 0;
    for (_, n) in trainable {
        let fp32 = alloc(*n as f64 * 4.0);
        if let Some(views) = burn {
            let copies = if upcast { fp32 } else { 0 };
            let view = if views { fp32 } else { 0 };
            peak = peak.max(fp32 + copies + view);
            continue;
        }
        let copies = if upcast { 2 * fp32 } else { 0 };
        // `grad**2` and `+ eps` beside the previous update: at least as high as the update
        // beside its successor (the outer product, then the negation).
        peak = peak.max(copies + 2 * fp32 + prev_update);
        // With a first moment `update` ends bound to the state (`update = exp_avg`).
        prev_update = if first_moment { 0 } else { fp32 };
    }
    peak
}

pub struct OptimizerModel {
    pub name: &'static str,
    /// Everything the optimizer keeps between steps, the master copy included.
    pub state_bytes: u64,
    /// Of `state_bytes`, the master copy of 16-bit weights (0 without one).
    pub master_bytes: u64,
    pub temp_bytes: u64,
}

pub fn model(
    spec: &Spec,
    profile: &Profile,
    tape: &Tape,
    trainable: &[(TensorId, u64)],
    c: &Candidate,
) -> OptimizerModel {
    let o = &spec.optimizer;
    let p = &spec.precision;
    // The Burn executor's flat optimizer (ZeRO, offload: `backend/src/optim`) keeps fp32
    // moments whatever the weights' dtype; under ZeRO 1/2 with whole weights it also keeps
    // an fp32 master shard of 16-bit weights without `master = fp32` (16-bit weights cannot
    // give it back), where ZeRO-3's shard of the weights is the master itself.
    let flat_zero = !o.kind.per_parameter_only() && super::burn_flat_zero(profile, c);
    let burn_flat = flat_zero || !o.kind.per_parameter_only() && super::burn_units(profile, c);
    let master = match p.master {
        None if flat_zero && p.params.bytes() < 4.0 => Some(Dtype::Fp32),
        m => m,
    };
    // torch.optim keeps state like the parameter (`zeros_like(p)`) unless a master copy is
    // kept; an explicitly smaller state dtype (bf16, int8) wins.
    let param_dtype = if p.params == Dtype::Tf32 {
        Dtype::Fp32
    } else {
        p.params
    };
    let state_dtype = match (o.kind, master) {
        (OptimizerKind::Adam8bit, _) => Dtype::Int8,
        _ if burn_flat => Dtype::Fp32,
        (_, Some(m)) => {
            if o.state.bytes() < m.bytes() {
                o.state
            } else {
                m
            }
        }
        (_, None) => {
            if o.state.bytes() < param_dtype.bytes() {
                o.state
            } else {
                param_dtype
            }
        }
    };
    let sb = state_dtype.bytes();
    // Burn's optimizers (`OptimizerAdaptor`) step one parameter at a time whatever the plan
    // says: temporaries of the parameter being updated, never of all of them.
    let implementation = if profile.burn_ops {
        OptImpl::Plain
    } else {
        o.implementation
    };
    // Every state tensor and temporary is one allocation of the executor's allocator.
    let alloc = |b: f64| profile.allocated(b.ceil() as u64);
    // Without a master copy torch.optim's state is `zeros_like(p)`: each parameter's own dtype,
    // so PEFT's fp32 adapters over bf16 weights keep fp32 moments (groundtruth
    // llama8b_lora16_*: 2 x 4 bytes per adapter value).
    let own_dtype = master.is_none() && o.kind != OptimizerKind::Adam8bit && !burn_flat;
    let sb_of = |id: TensorId| -> f64 {
        if !own_dtype {
            return sb;
        }
        let mut d = super::build::storage(tape.tensor(id).dtype);
        if profile.engine == crate::profile::Engine::Fsdp2 && param_dtype.bytes() > d.bytes() {
            // FSDP2's MixedPrecisionPolicy: the tape holds the modules' bf16 view, the
            // optimizer steps the sharded parameters in the plan's `params` dtype.
            d = param_dtype;
        }
        o.state.bytes().min(d.bytes())
    };
    // One state tensor of parameter `id` (`n` values).
    let full = |id: TensorId, n: u64| alloc(n as f64 * sb_of(id));
    let total_elems: u64 = trainable.iter().map(|(_, n)| n).sum();
    let largest: u64 = trainable.iter().map(|(_, n)| *n).max().unwrap_or(0);
    // The largest parameter's state tensor, in bytes.
    let largest_full: u64 = trainable
        .iter()
        .map(|(id, n)| full(*id, *n))
        .max()
        .unwrap_or(0);
    let mut state: u64 = 0;
    let mut temp: u64 = 0;
    let mut master_bytes = 0;
    let name;
    match o.kind {
        OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Adam8bit => {
            name = if o.kind == OptimizerKind::Adam {
                "adam"
            } else {
                "adamw"
            };
            if o.kind == OptimizerKind::Adam8bit {
                // bitsandbytes' blockwise kernels are fused: no temporaries.
                for (_, n) in trainable {
                    let (codes, scales) = adam8bit_moment_bytes(*n);
                    state += 2 * (alloc(codes as f64) + alloc(scales as f64));
                }
            } else {
                for (id, n) in trainable {
                    state += 2 * full(*id, *n);
                }
                temp = match implementation {
                    OptImpl::Foreach => trainable.iter().map(|(id, n)| full(*id, *n)).sum(),
                    // bitsandbytes' paged kernels are fused too.
                    OptImpl::Fused | OptImpl::Paged => 0,
                    OptImpl::Plain => 2 * largest_full,
                };
            }
        }
        OptimizerKind::Lion => {
            name = "lion";
            state = trainable.iter().map(|(id, n)| full(*id, *n)).sum();
            temp = match implementation {
                OptImpl::Foreach => state,
                OptImpl::Fused | OptImpl::Paged => 0,
                // The Burn executor's step (`optim::lion`) holds `β₁·m` and `(1−β₁)·g`
                // at once, as Burn's Adam does for a moment; lion-pytorch's loop one
                // clone of the moment.
                OptImpl::Plain if profile.burn_ops => 2 * largest_full,
                OptImpl::Plain => largest_full,
            };
        }
        OptimizerKind::Sgd => {
            name = "sgd";
            if o.momentum > 0.0 {
                state = trainable.iter().map(|(id, n)| full(*id, *n)).sum();
            }
        }
        OptimizerKind::Adafactor => {
            name = "adafactor";
            // Factored second moment for matrices (row + column, fp32), full for vectors.
            for (id, n) in trainable {
                let shape = &tape.tensor(*id).shape;
                state += if shape.len() >= 2 {
                    alloc((shape[0] + shape[1]) as f64 * 4.0)
                } else {
                    alloc(*n as f64 * 4.0)
                };
            }
            // `beta1` set: an fp32 first moment per parameter (`zeros_like(grad)` of the
            // upcast gradient), and `update` is rebound to it.
            let first_moment = o.betas.0 > 0.0;
            if first_moment {
                state += trainable
                    .iter()
                    .map(|(_, n)| alloc(*n as f64 * 4.0))
                    .sum::<u64>();
            }
            temp = adafactor_step_peak(
                trainable,
                param_dtype,
                p.master,
                first_moment,
                profile.burn_ops.then_some(c.data > 1),
                alloc,
            );
        }
        OptimizerKind::AdamMini => {
            name = "adam-mini";
            // First moment in full; the second moment one value per block, each
            // parameter's its own allocation.
            let m = &spec.model;
            state = trainable
                .iter()
                .map(|(id, n)| {
                    let blocks = adam_mini_blocks(tape.tensor(*id), m.heads, m.kv_heads);
                    full(*id, *n) + alloc(blocks as f64 * sb_of(*id))
                })
                .sum();
            temp = if profile.burn_ops {
                // The Burn executor's step (`optim::adam_mini`) holds one temporary of
                // the parameter at a time (`g²` before its block means, the moment's
                // update, then `m` times the blocks' step sizes), the gradient consumed
                // into `m`: measured on the CPU (`backend/src/tests/in_backward.rs`).
                largest_full
            } else {
                // The package's step: `update = m * stepsize` beside `-update`.
                2 * largest_full
            };
        }
    }
    if let Some(m) = master {
        if m.bytes() > param_dtype.bytes() {
            // fp32 master copy of 16-bit weights, and the fp32 gradient cast for the update.
            master_bytes = alloc(total_elems as f64 * m.bytes());
            state += master_bytes;
            temp += alloc(largest as f64 * m.bytes());
        }
    }
    OptimizerModel {
        name,
        state_bytes: state,
        master_bytes,
        temp_bytes: temp,
    }
}

/// Adam-mini's blocks of one parameter (`backend/src/optim/adam_mini.rs`): one per
/// attention head of q and k, one value each of a bias, one for a norm's weight, one per
/// row of the others (`[out, in]`: an output neuron, a token).
fn adam_mini_blocks(t: &super::tape::TensorInfo, heads: u64, kv_heads: u64) -> u64 {
    let rows = t.shape.first().copied().unwrap_or(1);
    match t.name {
        "q_proj" => heads,
        "k_proj" => kv_heads,
        "norm" => 1,
        n if n.ends_with("bias") => t.shape.iter().product(),
        _ => rows,
    }
}

/// With the step in the backward (`Spec::optimizer_in_backward`, torchtune's
/// `optimizer_in_bwd`: one optimizer per parameter, stepped by a post-accumulate-grad
/// hook), the temporaries of one parameter's step: [`model`] over that parameter alone
/// (foreach over a one-tensor list allocates one tensor like it; fused and paged kernels
/// none; the per-parameter loop two; plus the fp32 gradient cast for a master copy), cut as
/// the engine steps it ([`super::engines::in_backward_step_shards`]).
pub fn in_backward_step_temp(
    spec: &Spec,
    profile: &Profile,
    tape: &Tape,
    param: (TensorId, u64),
    c: &Candidate,
) -> u64 {
    match super::engines::in_backward_step_shards(profile, c) {
        Some(shards) => model(spec, profile, tape, &[param], c)
            .temp_bytes
            .div_ceil(shards),
        None => 0,
    }
}
