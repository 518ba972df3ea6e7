//! Builds the tape of one training micro-step from the resolved model.
//!
//! Each helper mirrors what the executor's code does for one module — which
//! tensors it creates, in which dtype, and which it saves for the backward —
//! following autograd's rules: `mm(x, w)` saves `w` when `x` needs a gradient
//! and `x` when `w` does; element-wise `mul` saves each operand for the other;
//! an op none of whose inputs needs a gradient saves nothing. So frozen base
//! weights (LoRA), the first layer of an adapter run and fp32 upcasts fall
//! out of the same code instead of being special cases. Shapes are per
//! device: tensor parallelism divides the projected widths, context and
//! sequence parallelism divide the tokens.

use crate::memory::quant::{qlora_chunks, qlora_dequant_transient};
use crate::memory::tape::{LayerSpan, OpInfo, Role, Tape, TensorId, TensorInfo, Unit};
use crate::memory::Candidate;
use crate::profile::{Nf4Dequant, Profile};
use crate::spec::{
    AdapterKind, Arch, Attention, Dtype, GpuSpec, Loss, Mlp, Norm, Positions, Proj, Spec,
};

/// Where a parameter's bytes live (its role in the step's breakdown).
#[derive(Clone, Copy)]
struct Param {
    id: TensorId,
    /// `[out, in]` of a matrix, `[n]` of a vector.
    rows: u64,
    cols: u64,
}

pub(crate) struct Builder<'a> {
    pub tape: Tape,
    spec: &'a Spec,
    profile: &'a Profile,
    cand: &'a Candidate,
    autocast: bool,
    /// dtype of matmul outputs and most activations.
    act: Dtype,
    /// dtype of the weights as the modules read them.
    param: Dtype,
    /// dtype the weights are kept in between uses: `param`'s, except under FSDP2's
    /// `MixedPrecisionPolicy`, whose shards keep the plan's `params` dtype while the modules
    /// read gathered copies in `param_dtype` (the plan's `compute`).
    stored: Dtype,
    layer: Option<u32>,
    /// Tokens per device flowing through the layers' projections.
    tokens: u64,
    /// Divisor of parameter bytes kept per device (ZeRO-3 / params offloaded).
    param_shard: u64,
    /// Parameters are gathered per use (ZeRO-3).
    gather: bool,
    /// The Burn executor's ZeRO-3 / parameter offload: parameters are gathered a whole unit
    /// (embedding, layer, head) at a time into one tensor of the tape ([`Unit`]).
    units: bool,
    /// The units are read in place, not gathered (gradient offload with whole weights on
    /// the device): their gathered tensors hold nothing and nothing is prefetched.
    views: bool,
    /// The unit being built (index into `tape.units`).
    open_unit: Option<usize>,
    /// Per unit of `tape.units`: bytes of its QLoRA NF4 bases gathered with it (ZeRO-3
    /// over several ranks; the executor keeps them whole otherwise), which the executor
    /// gathers after the unit's float values, never ahead (`backend/src/shard/zero3.rs`).
    unit_nf4: Vec<u64>,
    /// Parameters the optimizer updates: (id, elements).
    pub trainable: Vec<(TensorId, u64)>,
    /// Tensors a calling frame references until the current layer's last op.
    frame_holds: Vec<TensorId>,
    /// `checkpoint = selective_op`: the layer's matmuls so far (torchtitan keeps the
    /// outputs of the odd ones).
    op_sac: Option<u32>,
    /// The embedding output made a leaf that requires grad (`enable_input_require_grads`).
    embedding_leaf: Option<TensorId>,
    /// DeepSpeed ZeRO-3 keeps each matrix it gathers in the forward until that module's
    /// backward (`memory::engines::zero3_keeps_forward_gathers`): the gathered copy is a tensor
    /// the reading op makes and saves, not scratch.
    keep_gathers: bool,
    /// A gathered copy [`Self::weight`] made for the op about to read it ([`Self::linear`]).
    pending_gather: Option<TensorId>,
    /// Parameters with a kept gather already (a tied head reads the embedding's).
    kept_params: Vec<TensorId>,
    /// Phi-3's fused projections under PEFT (`fused_projections`, PyTorch profiles): one
    /// `lora.Linear` per fused module casts (and drops out) its input once, shared by the
    /// adapters of its projections: the input, and that copy.
    fused_lora_input: Option<(TensorId, TensorId)>,
}

/// The dtype a tensor of `d` is stored in (tf32 is an fp32 tensor computed in tf32).
pub(crate) fn storage(d: Dtype) -> Dtype {
    match d {
        Dtype::Tf32 => Dtype::Fp32,
        d => d,
    }
}

/// The wider of two dtypes (PyTorch's type promotion for float tensors).
fn promote(a: Dtype, b: Dtype) -> Dtype {
    if a.bytes() >= b.bytes() {
        a
    } else {
        b
    }
}

/// Tokens per chunk of the chunked LM loss; the executor's `DEFAULT_CHUNK` is this.
pub const CHUNKED_LOSS_TOKENS: u64 = 1024;

/// Query rows per block of the Burn executor's plain flash attention on the
/// CPU (`backend/src/kernels/flash/blocked.rs` `QUERY_BLOCK`; a backend test
/// checks they agree). The model charges the CUDA kernels, which have no such
/// blocks (`burn_flash_attention`); this names the CPU's difference.
pub const BURN_FLASH_QUERY_BLOCK: u64 = 64;

/// The largest head dim the executor's tensor-core flash kernels take
/// (`backend/src/kernels/flash/launch.rs` `MAX_TENSOR_CORE_HEAD_DIM`; a
/// backend test checks they agree).
pub const BURN_FLASH_TENSOR_CORE_HEAD_DIM: u64 = 128;

/// Shared memory a block of the executor's tensor-core flash kernels takes
/// at head dims 16, 32, .., [`BURN_FLASH_TENSOR_CORE_HEAD_DIM`], bytes: the
/// most of its forward and two backward kernels, at the default launch
/// (`FlashLaunch::shared_need`; a backend test checks every entry). Each
/// 16 more of head dim stage 8 KiB more.
pub const BURN_FLASH_TENSOR_CORE_SHARED_BYTES: [u64; 8] = [
    66_304, 74_496, 82_688, 90_880, 99_072, 107_264, 115_456, 123_648,
];

/// Whether the executor's flash attention on CUDA runs its block-product
/// kernels on tensor cores, whose backward is one pass with an fp32 dQ
/// accumulator (`FlashLaunch::kernels`): 16-bit inputs the GPU's tensor
/// cores take (bf16 from Ampere on), head dims in 16s up
/// to [`BURN_FLASH_TENSOR_CORE_HEAD_DIM`], and a block of the kernels
/// within `gpu`'s shared memory ([`BURN_FLASH_TENSOR_CORE_SHARED_BYTES`]:
/// head dim 128 needs an A100's or an H100's, 64 fits Ada and Volta, none
/// fits Turing's 64 KiB). Otherwise the `Rows` kernels run, in two passes,
/// on the CUDA cores.
pub fn burn_flash_one_pass(act: Dtype, head_dim: u64, gpu: &GpuSpec) -> bool {
    burn_flash_rows_why(act, head_dim, gpu).is_none()
}

/// Why the executor's flash attention runs its `Rows` kernels, not the tensor-core ones
/// ([`burn_flash_one_pass`]); `None` where the tensor-core kernels run.
pub fn burn_flash_rows_why(act: Dtype, head_dim: u64, gpu: &GpuSpec) -> Option<String> {
    if !matches!(act, Dtype::Bf16 | Dtype::Fp16) {
        return Some(format!(
            "the tensor-core kernels take 16-bit inputs, not {}",
            act.as_str()
        ));
    }
    if act == Dtype::Bf16 && !gpu.bf16_tensor_cores {
        return Some(format!("{} has no bf16 tensor cores", gpu.name));
    }
    if !head_dim.is_multiple_of(16) || !(16..=BURN_FLASH_TENSOR_CORE_HEAD_DIM).contains(&head_dim) {
        return Some(format!(
            "the tensor-core kernels take head dims in 16s up to \
             {BURN_FLASH_TENSOR_CORE_HEAD_DIM}, not {head_dim}"
        ));
    }
    let need = BURN_FLASH_TENSOR_CORE_SHARED_BYTES[(head_dim / 16 - 1) as usize];
    match gpu.shared_memory_per_block_bytes {
        Some(max) if need > max => Some(format!(
            "at head dim {head_dim} a block of the tensor-core kernels takes {} KiB of shared \
             memory, more than the {} KiB {} gives one",
            need.div_ceil(1024),
            max / 1024,
            gpu.name
        )),
        _ => None,
    }
}

/// The op name of the executor's fused attention kernels on tensor cores
/// (`burn_flash_attention`), whose FLOPs the time model prices at
/// `Profile::fused_attention_efficiency`.
pub const FUSED_ATTENTION_OP: &str = "flash_attention";

/// The op name of the executor's fused attention where its `Rows` kernels run, on the
/// CUDA cores ([`burn_flash_one_pass`] false), priced at
/// `Profile::fused_attention_rows_efficiency`.
pub const FUSED_ATTENTION_ROWS_OP: &str = "flash_attention_rows";

/// The op names of eager attention's two products, `q kᵀ` and `probs v` (unfused and
/// selective alike), which the time model prices at `Profile::attention_matmul_efficiency`.
pub const SCORES_OP: &str = "scores";
pub const PROBS_V_OP: &str = "probs_v";

impl<'a> Builder<'a> {
    pub fn new(spec: &'a Spec, profile: &'a Profile, cand: &'a Candidate) -> Self {
        let stored = storage(spec.precision.params);
        let compute = storage(spec.precision.compute);
        let fsdp = profile.engine == crate::profile::Engine::Fsdp2;
        let param = if fsdp && compute.bytes() < stored.bytes() {
            compute
        } else {
            stored
        };
        let autocast = profile.autocast && spec.precision.is_autocast();
        let act = if autocast || !profile.autocast {
            compute
        } else {
            param
        };
        let seqs = cand.micro_batch * spec.train.sequences_per_item();
        let tokens = (seqs * spec.train.seq_len).div_ceil(cand.context.max(1));
        // FSDP2 shards the weights at rest under `zero = 2` too (it only keeps each unit
        // gathered from its forward to its backward: `memory::fsdp`).
        let zero3 = (cand.zero >= 3 || (fsdp && cand.zero >= 2)) && cand.data > 1;
        let on_host = cand.offloads(crate::spec::OffloadWhat::Params);
        // Offloaded parameters live in host memory and are fetched per layer like ZeRO-3's
        // gathers; a shard of 2^40 rounds their resident bytes to nothing.
        let param_shard = if on_host {
            1 << 40
        } else if zero3 {
            cand.data
        } else {
            1
        };
        Builder {
            tape: Tape::default(),
            spec,
            profile,
            cand,
            autocast,
            act,
            param,
            stored,
            layer: None,
            tokens,
            param_shard,
            gather: zero3 || on_host,
            units: super::burn_units(profile, cand),
            views: super::burn_units(profile, cand) && !super::burn_units_gathered(profile, cand),
            open_unit: None,
            unit_nf4: Vec::new(),
            trainable: Vec::new(),
            frame_holds: Vec::new(),
            op_sac: (spec.fit.checkpoint == crate::spec::CheckpointChoice::SelectiveOp)
                .then_some(0),
            embedding_leaf: None,
            keep_gathers: zero3
                && !on_host
                && super::engines::zero3_keeps_forward_gathers(profile, cand),
            pending_gather: None,
            kept_params: Vec::new(),
            fused_lora_input: None,
        }
    }

    /// The whole copy of matrix `p` DeepSpeed ZeRO-3 gathers for its use and keeps until the
    /// use's backward, or `None` where the gather is per-use scratch. A matrix kept from an
    /// earlier use (a tied head reads the embedding's table) gets `None`, and its reader
    /// charges no scratch ([`Self::kept_already`]).
    fn kept_gather(&mut self, p: Param, dtype: Dtype) -> Option<TensorId> {
        if !self.keep_gathers || p.cols <= 1 || self.kept_already(p) {
            return None;
        }
        self.kept_params.push(p.id);
        let elems = p.rows * p.cols;
        let g = self.tape.add_tensor(TensorInfo {
            name: "gathered_weight",
            shape: vec![p.rows, p.cols],
            dtype,
            bytes: self.bytes(elems, dtype),
            requires_grad: false,
            role: Role::Gathered,
            grad_bytes: 0,
            producer: None,
            held_until_forward_end: false,
        });
        // The coordinator keeps it whatever autograd saves: a checkpointed layer's stays
        // from its forward through its recompute (which finds it gathered) to its backward.
        self.tape.kept.push(g);
        Some(g)
    }

    /// Is `p` gathered and kept from an earlier use in this micro-step?
    fn kept_already(&self, p: Param) -> bool {
        self.keep_gathers && self.kept_params.contains(&p.id)
    }

    /// torchtitan's op-level selective recomputation (`_op_sac_save_list`, "saves output of
    /// all compute ops, except every second mm"): inside a layer, `outs` of an op of the
    /// save list are kept from the forward for the recompute. `mm`: the op is a matmul,
    /// kept only when it is the layer's 1st, 3rd, 5th, … (the count restarts per layer).
    fn keep_for_recompute(&mut self, outs: &[TensorId], mm: bool) {
        let Some(count) = self.op_sac.as_mut() else {
            return;
        };
        if self.layer.is_none() {
            return;
        }
        if mm {
            *count += 1;
            if *count % 2 == 0 {
                return;
            }
        }
        self.tape.kept.extend_from_slice(outs);
    }

    fn bytes(&self, elems: u64, dtype: Dtype) -> u64 {
        if dtype == Dtype::Nf4 {
            // Packed codes and block scales, each its own allocation.
            return super::quant::nf4_parts(elems, self.profile.nf4_double_quant)
                .iter()
                .filter(|b| **b > 0)
                .map(|b| self.profile.allocated(*b))
                .sum();
        }
        let raw = (elems as f64 * dtype.bytes()).ceil() as u64;
        self.profile.allocated(raw)
    }

    /// Start a unit the Burn executor gathers whole (ZeRO-3 / parameter offload): an
    /// `all_gather` op makes its gathered tensor, whose bytes the unit's parameters add up
    /// as they are created. No-op otherwise.
    fn begin_unit(&mut self, name: &'static str) {
        if !self.units {
            return;
        }
        self.end_unit();
        let gathered = self.tape.add_tensor(TensorInfo {
            name: "gathered_weights",
            shape: vec![0],
            dtype: self.param,
            bytes: 0,
            requires_grad: false,
            role: Role::Gathered,
            grad_bytes: 0,
            producer: None,
            held_until_forward_end: false,
        });
        let first_op = self.tape.ops.len() as u32;
        self.op("all_gather", &[], &[gathered], &[]);
        self.tape.units.push(Unit {
            name,
            layer: self.layer,
            first_op,
            end_op: first_op + 1,
            gathered,
            bytes: 0,
            trainable_values: 0,
            regathered: false,
            prefetch_forward: 0,
            prefetch_backward: 0,
        });
        self.open_unit = Some(self.tape.units.len() - 1);
        self.unit_nf4.push(0);
    }

    /// Close the open unit: every op of it references the gathered tensor until it has run,
    /// and every op with a backward saves it (Burn's autodiff graph keeps the weights a
    /// matmul read until its backward, and the executor keeps the unit's module, whose
    /// parameters are views of the one gathered buffer, until the backward reduces its
    /// gradients: `shard::zero3`'s hooks, `layers[i]`; a checkpointed layer's graph exists
    /// only in its recompute, so its gathered weights die after its forward and are
    /// gathered again).
    fn end_unit(&mut self) {
        let Some(u) = self.open_unit.take() else {
            return;
        };
        let end = self.tape.ops.len() as u32;
        let (g, first, bytes) = {
            let unit = &mut self.tape.units[u];
            unit.end_op = end;
            (unit.gathered, unit.first_op, unit.bytes)
        };
        // The NF4 words arrive as one gathered f32 tensor, read back and rebuilt into
        // the packed bases: the words' bytes beside the rebuilt bases while they are
        // decoded.
        self.tape.ops[first as usize].fwd_workspace += self.unit_nf4[u];
        self.tape.tensors[g.0 as usize].bytes = if self.views { 0 } else { bytes };
        self.tape.tensors[g.0 as usize].shape = vec![bytes];
        for o in first as usize + 1..end as usize {
            let with_backward = self.tape.ops[o].has_backward(&self.tape);
            let op = &mut self.tape.ops[o];
            op.holds.push(g);
            if with_backward {
                op.saved.push(g);
            }
        }
    }

    /// Gathers in flight beside the running unit's (`ZERO3_PREFETCH_UNITS` ahead): in the
    /// forward the next units, in the backward the next checkpointed layers to recompute.
    /// Scratch of every op of the unit. A recomputed layer's forward charges the forward's
    /// prefetch (the next layer, as large as the previous one but at the stage's ends).
    fn charge_prefetch(&mut self) {
        let n = crate::profile::ZERO3_PREFETCH_UNITS;
        let units = self.tape.units.clone();
        for (i, u) in units.iter().enumerate() {
            // A unit's NF4 bases are never prefetched.
            let floats = |j: usize| units[j].bytes - self.unit_nf4[j];
            let ahead: u64 = (i + 1..units.len()).take(n).map(floats).sum();
            let behind: u64 = (0..i)
                .rev()
                .take(n)
                .filter(|&j| units[j].regathered)
                .map(floats)
                .sum();
            for o in u.first_op as usize..u.end_op as usize {
                let op = &mut self.tape.ops[o];
                op.fwd_workspace += ahead;
                op.bwd_workspace += behind;
            }
            self.tape.units[i].prefetch_forward = ahead;
            self.tape.units[i].prefetch_backward = behind;
        }
    }

    fn tensor(&mut self, name: &'static str, shape: &[u64], dtype: Dtype, rg: bool) -> TensorId {
        let elems: u64 = shape.iter().product();
        let bytes = self.bytes(elems, dtype);
        self.tape.add_tensor(TensorInfo {
            name,
            shape: shape.to_vec(),
            dtype,
            bytes,
            requires_grad: rg,
            role: Role::Activation,
            grad_bytes: 0,
            producer: None,
            held_until_forward_end: false,
        })
    }

    fn rg(&self, t: TensorId) -> bool {
        self.tape.tensor(t).requires_grad
    }
    fn dtype(&self, t: TensorId) -> Dtype {
        self.tape.tensor(t).dtype
    }
    fn shape(&self, t: TensorId) -> Vec<u64> {
        self.tape.tensor(t).shape.clone()
    }
    fn elems(&self, t: TensorId) -> u64 {
        self.tape.tensor(t).shape.iter().product()
    }

    fn op(
        &mut self,
        name: &'static str,
        inputs: &[TensorId],
        outputs: &[TensorId],
        saved: &[TensorId],
    ) -> usize {
        let any_rg = inputs.iter().any(|t| self.rg(*t));
        let moved: u64 = inputs
            .iter()
            .chain(outputs)
            .map(|t| self.tape.tensor(*t).bytes)
            .sum();
        let saved = if any_rg { saved.to_vec() } else { Vec::new() };
        self.tape.add_op(OpInfo {
            name,
            layer: self.layer,
            inputs: inputs.to_vec(),
            outputs: outputs.to_vec(),
            saved,
            fwd_workspace: 0,
            bwd_workspace: 0,
            workspace_buffers: Vec::new(),
            flops: 0.0,
            bwd_flops: 0.0,
            bytes_moved: moved as f64,
            holds: Vec::new(),
            inplace: false,
            engine: Default::default(),
        });
        self.tape.ops.len() - 1
    }

    /// An element-wise op the executor may run in place (`Profile::inplace_elementwise`).
    fn pointwise_inplace(
        &mut self,
        name: &'static str,
        inputs: &[TensorId],
        dtype: Dtype,
        saved: &[TensorId],
    ) -> TensorId {
        let out = self.pointwise(name, inputs, dtype, saved);
        let op = self.tape.ops.len() - 1;
        self.tape.ops[op].inplace = self.profile.inplace_elementwise;
        out
    }

    /// An element-wise op producing a tensor shaped like `x`.
    fn pointwise(
        &mut self,
        name: &'static str,
        inputs: &[TensorId],
        dtype: Dtype,
        saved: &[TensorId],
    ) -> TensorId {
        let shape = self.shape(inputs[0]);
        let rg = inputs.iter().any(|t| self.rg(*t));
        let out = self.tensor(name, &shape, dtype, rg);
        self.op(name, inputs, &[out], saved);
        out
    }

    /// Keep `t` referenced until the last op added so far has run.
    fn hold_to_last_op(&mut self, t: TensorId) {
        if let Some(op) = self.tape.ops.last_mut() {
            op.holds.push(t);
        }
    }

    /// `x.to(dtype)`: a copy when the dtype differs; saves nothing.
    fn cast(&mut self, x: TensorId, dtype: Dtype) -> TensorId {
        if self.dtype(x) == dtype {
            return x;
        }
        self.pointwise("cast", &[x], dtype, &[])
    }

    fn param(
        &mut self,
        name: &'static str,
        rows: u64,
        cols: u64,
        trainable: bool,
        dtype: Dtype,
    ) -> Param {
        let elems = rows * cols;
        let full = self.bytes(elems, dtype);
        let kept = if dtype == self.param {
            self.bytes(elems, self.stored)
        } else {
            full
        };
        let stored = kept.div_ceil(self.param_shard);
        if let Some(u) = self.open_unit {
            if trainable {
                self.tape.units[u].trainable_values += elems;
            }
            if dtype != Dtype::Nf4 {
                self.tape.units[u].bytes += full;
            } else if self.param_shard > 1 {
                // Gathered only where sharded: with one rank the layer keeps them.
                self.tape.units[u].bytes += full;
                self.unit_nf4[u] += full;
            }
        }
        let grad_dtype = if self.profile.burn_ops {
            // backend/src/train.rs: gradients come in the parameter's dtype and are cast to
            // the fp32 master's when there is one (`MergeGrads`), whatever `grads` says.
            match self.spec.precision.master {
                Some(m) if m.bytes() > dtype.bytes() => storage(m),
                _ => storage(dtype),
            }
        } else if dtype != self.param {
            // A parameter kept in another dtype than the weights (PEFT's fp32 adapters over
            // 16-bit weights): PyTorch's `.grad` takes the parameter's dtype.
            storage(dtype)
        } else {
            storage(self.spec.precision.grads)
        };
        let grad = if trainable {
            self.bytes(elems, grad_dtype)
        } else {
            0
        };
        let id = self.tape.add_tensor(TensorInfo {
            name,
            shape: if cols == 1 {
                vec![rows]
            } else {
                vec![rows, cols]
            },
            dtype,
            bytes: stored,
            requires_grad: trainable,
            role: Role::Param,
            grad_bytes: grad,
            producer: None,
            held_until_forward_end: false,
        });
        if trainable {
            self.trainable.push((id, elems));
        }
        Param { id, rows, cols }
    }

    fn base_trainable(&self) -> bool {
        self.spec.adapter.is_none()
    }

    /// The weight tensor a matmul reads: autocast's 16-bit copy (cached for the forward when
    /// trainable), a dequantized copy of 4-bit weights, or the parameter itself.
    fn weight(&mut self, p: Param) -> (TensorId, u64) {
        let t = self.tape.tensor(p.id).clone();
        let elems = p.rows * p.cols;
        // Gathered per use; the Burn executor's whole-unit gathers are tensors of the tape.
        let mut gathered = if self.gather && !self.units && self.profile.engine.gathers_per_op() {
            self.bytes(elems, t.dtype)
        } else {
            0
        };
        let kept = if gathered > 0 && t.dtype != Dtype::Nf4 {
            self.kept_gather(p, t.dtype)
        } else {
            None
        };
        if kept.is_some() || self.kept_already(p) {
            gathered = 0;
        }
        if t.dtype == Dtype::Nf4 {
            return match self.profile.nf4_dequant {
                // bitsandbytes dequantizes per use and again in the backward: a transient copy.
                Nf4Dequant::WholeWeight => (p.id, self.bytes(elems, self.act) + gathered),
                // Its chunks are charged by `linear`, which knows the output's bytes.
                Nf4Dequant::Chunked { .. } => (p.id, gathered),
            };
        }
        let casts = self.autocast || self.profile.weight_cast_per_use;
        if casts && t.dtype.bytes() > self.act.bytes() {
            let copy = self.tape.add_tensor(TensorInfo {
                name: "weight_copy",
                shape: t.shape.clone(),
                dtype: self.act,
                bytes: self.bytes(elems, self.act),
                requires_grad: t.requires_grad,
                role: Role::WeightCopy,
                grad_bytes: 0,
                producer: None,
                // torch.autocast caches casts of leaf tensors that require grad until the
                // autocast region (the forward) ends; a per-use cast is not cached.
                held_until_forward_end: self.autocast && t.requires_grad,
            });
            // A kept gather is cast from and held until the cast's backward.
            let outputs: Vec<TensorId> = std::iter::once(copy).chain(kept).collect();
            let saved: Vec<TensorId> = kept.into_iter().collect();
            let o = self.op("cast", &[p.id], &outputs, &saved);
            self.tape.ops[o].fwd_workspace = gathered;
            return (copy, 0);
        }
        self.pending_gather = kept;
        (p.id, gathered)
    }

    /// `F.linear(x, w, b)` with autocast's per-call input cast.
    fn linear(
        &mut self,
        name: &'static str,
        x: TensorId,
        p: Param,
        bias: Option<Param>,
    ) -> TensorId {
        let xc = if self.autocast {
            self.cast(x, self.act)
        } else {
            x
        };
        let (w, ws) = self.weight(p);
        let kept = self.pending_gather.take();
        let mut shape = self.shape(xc);
        let last = shape.len() - 1;
        let inf = shape[last];
        shape[last] = p.rows;
        let rg = self.rg(xc) || self.rg(w) || bias.is_some_and(|b| self.rg(b.id));
        let out_dtype = if self.autocast {
            self.act
        } else {
            // The weight read (a per-use cast copy when there is one): Burn multiplies the
            // compute-dtype copy, so the output is in the compute dtype.
            promote(self.dtype(xc), self.dtype(w))
        };
        let out = self.tensor(name, &shape, out_dtype, rg);
        let mut saved = Vec::new();
        if self.rg(xc) {
            saved.push(w);
        }
        if self.rg(w) {
            saved.push(xc);
        }
        let mut inputs = vec![xc, w];
        if let Some(b) = bias {
            inputs.push(b.id);
        }
        // A kept gather is made with the output and held until the backward.
        saved.extend(kept);
        let outputs: Vec<TensorId> = std::iter::once(out).chain(kept).collect();
        let o = self.op(name, &inputs, &outputs, &saved);
        if bias.is_none() {
            // `F.linear` with a bias dispatches `aten.addmm`, which torchtitan's save list
            // lacks: neither kept nor counted (`tools/saved_tensors.py`).
            self.keep_for_recompute(&[out], true);
        }
        let rows: u64 = shape[..last].iter().product();
        let f = 2.0 * rows as f64 * inf as f64 * p.rows as f64;
        let bwd = f * (self.rg(xc) as u8 as f64) + f * (self.rg(w) as u8 as f64);
        let (fwd_dq, bwd_dq) = self.nf4_chunk_scratch(p, xc, out);
        let info = &mut self.tape.ops[o];
        info.flops = f;
        info.bwd_flops = bwd;
        info.fwd_workspace = ws + fwd_dq;
        info.bwd_workspace = ws + bwd_dq;
        out
    }

    /// The chunked dequantization of an NF4 base weight (`Nf4Dequant::Chunked`,
    /// `backend/src/quant/qlora.rs`) as scratch of the projection's forward and of its
    /// backward, which computes only `dx` (the base is frozen; no backward runs at all when
    /// `x` needs no gradient). With more than one chunk the output (`y`, or the
    /// preallocated `dx`) is live beside the transient, as the tape counts any workspace.
    /// With one chunk the output is allocated after the transient is freed: the op's
    /// highest is the larger of the two, so only what the transient exceeds it by is
    /// charged on top of the output.
    fn nf4_chunk_scratch(&self, p: Param, x: TensorId, out: TensorId) -> (u64, u64) {
        let Nf4Dequant::Chunked {
            bytes_per_value,
            fixed_bytes,
        } = self.profile.nf4_dequant
        else {
            return (0, 0);
        };
        if self.dtype(p.id) != Dtype::Nf4 {
            return (0, 0);
        }
        // Burn's `[d_in, d_out]`: the param is `[out, in]` like PyTorch's.
        let shape = [p.cols, p.rows];
        let transient = qlora_dequant_transient(shape, bytes_per_value, fixed_bytes);
        if qlora_chunks(shape) > 1 {
            return (transient, transient);
        }
        let y = self.tape.tensor(out).bytes;
        let dx = self.tape.tensor(x).bytes;
        (transient.saturating_sub(y), transient.saturating_sub(dx))
    }

    fn dropout(&mut self, x: TensorId, p: f64) -> TensorId {
        if p <= 0.0 {
            return x;
        }
        let shape = self.shape(x);
        let rg = self.rg(x);
        let mask = self.tensor("dropout_mask", &shape, Dtype::Int8, false);
        let out = self.tensor("dropout", &shape, self.dtype(x), rg);
        let o = self.op("dropout", &[x], &[out, mask], &[mask]);
        self.tape.ops[o].fwd_workspace = self.dropout_draw(&shape);
        out
    }

    /// The transient of drawing a dropout mask of `shape`: on Burn
    /// (`backend/src/model.rs` `dropped`) a Bernoulli draw of fp32 values,
    /// which the fused kernel writing the 1-byte mask and the output reads (on
    /// the CPU, unfused, it is freed before the output is made); PyTorch's
    /// `native_dropout` draws inside its kernel.
    fn dropout_draw(&self, shape: &[u64]) -> u64 {
        if self.profile.burn_ops {
            self.bytes(shape.iter().product(), Dtype::Fp32)
        } else {
            0
        }
    }

    /// A projection, with its bias when the model has one there and a LoRA adapter when
    /// the plan targets it (PEFT's `lora.Linear`).
    fn proj(
        &mut self,
        which: Proj,
        name: &'static str,
        x: TensorId,
        inf: u64,
        outf: u64,
    ) -> TensorId {
        let bias = self.spec.model.bias_on(which);
        let base_dtype = match &self.spec.adapter {
            Some(a) if a.kind == AdapterKind::Qlora => Dtype::Nf4,
            _ => self.param,
        };
        let trainable = self.base_trainable();
        let w = self.param(name, outf, inf, trainable, base_dtype);
        let b = bias.then(|| self.param("bias", outf, 1, trainable, self.param));
        let base = self.linear(name, x, w, b);
        let Some(ad) = self.spec.adapter.clone() else {
            return base;
        };
        if !self.adapter_targets(&ad.targets, which) {
            return base;
        }
        let ad_dtype = if self.profile.adapters_fp32 {
            Dtype::Fp32
        } else {
            self.param
        };
        let a = self.param("lora_a", ad.rank, inf, true, ad_dtype);
        let bm = self.param("lora_b", outf, ad.rank, true, ad_dtype);
        let shared = self.spec.model.numerics.fused_projections && !self.profile.burn_ops;
        let (xa, xd) = match self.fused_lora_input {
            Some((input, xd)) if shared && input == x => (None, xd),
            _ => {
                let xa = self.cast(x, ad_dtype);
                let xd = self.dropout(xa, ad.dropout);
                if shared {
                    self.fused_lora_input = Some((x, xd));
                }
                (Some(xa), xd)
            }
        };
        let h = self.linear("lora_a", xd, a, None);
        let h = self.linear("lora_b", h, bm, None);
        let dt = self.dtype(h);
        let scaled = self.pointwise("lora_scale", &[h], dt, &[]);
        let sum_dtype = promote(self.dtype(base), dt);
        let y = self.pointwise("lora_add", &[base, scaled], sum_dtype, &[]);
        let out = self.dtype(base);
        let y = self.cast(y, out);
        // PEFT rebinds its local `x` to the fp32 copy: it lives until the forward returns.
        if let Some(xa) = xa {
            self.hold_to_last_op(xa);
        }
        y
    }

    /// Is projection `which` adapted? PEFT matches target names by suffix: on BERT-style
    /// encoders the attention output projection is `dense`, and so are the MLP's
    /// `intermediate.dense` and `output.dense`, so targeting `o` adapts all three.
    fn adapter_targets(&self, targets: &[Proj], which: Proj) -> bool {
        if targets.contains(&which) {
            return true;
        }
        self.profile.adapter_suffix_match
            && self.spec.model.arch == Arch::Encoder
            && matches!(which, Proj::Up | Proj::Down)
            && targets.contains(&Proj::O)
    }

    fn norm(&mut self, x: TensorId, h: u64) -> TensorId {
        if self.profile.burn_ops {
            return self.burn_norm(x, h);
        }
        let trainable = self.base_trainable();
        match self.spec.model.norm {
            Norm::Rmsnorm => {
                let w = self.param("norm", h, 1, trainable, self.param);
                // HF LlamaRMSNorm: x.float(); x * rsqrt(mean(x^2) + eps); w * x.to(dtype)
                let dt = if self.profile.norm_in_fp32 {
                    Dtype::Fp32
                } else {
                    self.dtype(x)
                };
                let x32 = self.cast(x, dt);
                let rows = self.elems(x32) / h;
                let rg = self.rg(x32);
                let r = self.tensor("rsqrt", &[rows], dt, rg);
                let o = self.op("rms", &[x32], &[r], &[x32, r]);
                self.tape.ops[o].fwd_workspace = self.tape.tensor(x32).bytes;
                let xn = self.pointwise("normalize", &[x32, r], dt, &[x32, r]);
                let back = self.dtype(x);
                let xc = self.cast(xn, back);
                let mut saved = Vec::new();
                if self.rg(xc) {
                    saved.push(w.id);
                }
                if trainable {
                    saved.push(xc);
                }
                self.pointwise("norm_scale", &[xc, w.id], back, &saved)
            }
            Norm::Layernorm => {
                let w = self.param("norm", h, 1, trainable, self.param);
                let b = self.param("norm_bias", h, 1, trainable, self.param);
                // F.layer_norm runs in fp32 under autocast; saves its input, mean and rstd.
                let xin = if self.autocast {
                    self.cast(x, Dtype::Fp32)
                } else {
                    x
                };
                let dt = self.dtype(xin);
                let rows = self.elems(xin) / h;
                let rg = self.rg(xin) || trainable;
                let stats = self.tensor("ln_stats", &[2 * rows], Dtype::Fp32, false);
                let shape = self.shape(xin);
                let out = self.tensor("layernorm", &shape, dt, rg);
                self.op(
                    "layernorm",
                    &[xin, w.id, b.id],
                    &[out, stats],
                    &[xin, stats],
                );
                out
            }
        }
    }

    fn rope(&mut self, x: TensorId) -> TensorId {
        // q*cos + rotate_half(q)*sin: cos/sin need no grad, so nothing large is saved.
        let dt = self.dtype(x);
        let o = self.pointwise("rope", &[x], dt, &[]);
        let b = self.tape.tensor(x).bytes;
        let op = self.tape.ops.len() - 1;
        self.tape.ops[op].fwd_workspace = 2 * b;
        self.tape.ops[op].bwd_workspace = 2 * b;
        o
    }

    fn attention(&mut self, x: TensorId) -> TensorId {
        let m = &self.spec.model;
        let t = self.cand.tensor.max(1);
        let (h, hd) = (m.hidden, m.head_dim);
        let heads = m.heads.div_ceil(t);
        let kv = m.kv_heads.div_ceil(t);
        let rope = m.positions == Positions::Rope;
        let q = self.proj(Proj::Q, "q_proj", x, h, heads * hd);
        let k = self.proj(Proj::K, "k_proj", x, h, kv * hd);
        let v = self.proj(Proj::V, "v_proj", x, h, kv * hd);
        // Phi-3's `qkv_proj` (PyTorch profiles; the executor computes three projections):
        // q, k and v are slices of one output, and an attention that saves `v` as given
        // (not repeated to every head) saves a view of it, so q's and k's parts stay for
        // the backward too, where Llama's q and k projections die once RoPE has read them
        // (`q * cos` saves `cos`): `tools/phi3_saved.py`.
        let fused_qk = (m.numerics.fused_projections && !self.profile.burn_ops).then_some([q, k]);
        // Qwen3's `q_norm` / `k_norm`: the model's norm over each head's `hd` values.
        let (q, k) = if m.numerics.qk_norm {
            (self.norm(q, hd), self.norm(k, hd))
        } else {
            (q, k)
        };
        let (q, k) = if rope {
            (self.rope(q), self.rope(k))
        } else {
            (q, k)
        };
        let seqs = self.tokens / self.spec.train.seq_len.max(1);
        let s = self.spec.train.seq_len.div_ceil(self.cand.context.max(1));
        let burn_flash = self.profile.burn_ops && self.spec.train.attention == Attention::Flash;
        // The share of the `s × s` scores computed: half for a causal decoder; under a
        // sliding window shorter than the sequence, rcoa's fused kernels skip the key
        // blocks outside each query's window (`Σ_i min(i + 1, w)` pairs), where the eager
        // paths compute every score and mask.
        let causal = match m.numerics.window_within(s) {
            Some(w) if burn_flash && m.arch == Arch::Decoder => {
                (w * (w + 1) / 2 + (s - w) * w) as f64 / (s * s) as f64
            }
            _ if m.arch == Arch::Decoder => 0.5,
            _ => 1.0,
        };
        let score_flops = 2.0 * 2.0 * (seqs * heads) as f64 * (s * s) as f64 * hd as f64 * causal;
        // SDPA picks a fused kernel when one takes the inputs: flash needs 16-bit inputs,
        // the memory-efficient kernel takes fp32 but not grouped-query attention; otherwise
        // it runs the math backend, which materialises the scores like eager attention.
        let sixteen_bit = self.act.bytes() <= 2.0;
        // A sliding window (Mistral v0.1) as long as the sequence or shorter: transformers
        // hands SDPA a `[b, 1, s, s]` boolean mask (it skips it only while the keys are
        // fewer than the window), which SDPA turns into an additive one that the
        // memory-efficient kernel keeps for its backward; with a mask, k and v are repeated
        // to every head (`use_gqa_in_sdpa` is false).
        // Packed sequences (`train.packing`) make the same kind of mask: transformers finds
        // the documents in the position ids and hands SDPA their block-diagonal causal mask
        // (flash-attention 2 takes them as variable-length sequences instead).
        let packed = self.spec.train.packing && self.spec.train.attention != Attention::Flash;
        let masked =
            !self.profile.burn_ops && (m.numerics.sliding_window.is_some_and(|w| s >= w) || packed);
        let gqa_without_repeat = self.profile.gqa_without_repeat && !masked;
        let fused = self.profile.fused_attention
            && self.spec.train.attention != Attention::Eager
            && (sixteen_bit || kv == heads || !gqa_without_repeat);
        let act = self.dtype(q);
        let out = if burn_flash {
            self.burn_flash_attention(q, k, v, heads * hd, score_flops)
        } else if fused {
            let (k, v) = if kv < heads && !gqa_without_repeat {
                (self.repeat_kv(k, heads * hd), self.repeat_kv(v, heads * hd))
            } else {
                (k, v)
            };
            let repeated = kv < heads && !gqa_without_repeat;
            let rg = self.rg(q) || self.rg(k) || self.rg(v);
            let out = self.tensor("attention", &[self.tokens, heads * hd], act, rg);
            let lse = self.tensor("lse", &[seqs * heads * s], Dtype::Fp32, false);
            let mut inputs = vec![q, k, v];
            let mut saved = vec![q, k, v, out, lse];
            if !repeated {
                saved.extend(fused_qk.into_iter().flatten());
            }
            if masked {
                let mask = self.tensor("window_mask", &[seqs, 1, s, s], act, false);
                self.op("window_mask", &[], &[mask], &[]);
                inputs.push(mask);
                saved.push(mask);
            }
            let o = self.op("attention", &inputs, &[out, lse], &saved);
            self.keep_for_recompute(&[out, lse], false);
            // Flash backward accumulates dq in fp32.
            let dq = self.bytes(self.tokens * heads * hd, Dtype::Fp32);
            let info = &mut self.tape.ops[o];
            info.flops = score_flops;
            info.bwd_flops = 2.5 * score_flops;
            info.bwd_workspace = dq;
            out
        } else if self.selective() {
            self.selective_attention(q, k, v, heads * hd, score_flops)
        } else if self.profile.burn_ops {
            self.burn_attention(q, k, v, heads * hd, score_flops)
        } else {
            let kr = if kv < heads {
                self.repeat_kv(k, heads * hd)
            } else {
                k
            };
            let vr = if kv < heads {
                self.repeat_kv(v, heads * hd)
            } else {
                v
            };
            let scores_shape = [seqs, heads, s, s];
            let rg = self.rg(q) || self.rg(kr);
            let sc = self.tensor("scores", &scores_shape, act, rg);
            let o = self.op(SCORES_OP, &[q, kr], &[sc], &[q, kr]);
            self.tape.ops[o].flops = score_flops / 2.0;
            self.tape.ops[o].bwd_flops = score_flops;
            let sc = self.pointwise("scale", &[sc], act, &[]);
            let sc = if m.arch == Arch::Decoder {
                self.pointwise("mask", &[sc], act, &[])
            } else {
                sc
            };
            // Llama's eager attention asks for `softmax(dtype=float32)` and casts back before
            // its dropout. BERT-style encoders call plain `softmax`: fp32 only because
            // autocast runs softmax in fp32, and then the dropout runs on the fp32
            // probabilities and `matmul(probs, v)` casts its input down (the copy it saves).
            let decoder = m.arch == Arch::Decoder;
            let sm_dtype = if self.profile.autocast && (decoder || self.autocast) {
                Dtype::Fp32
            } else {
                act
            };
            let p = self.pointwise("softmax", &[sc], sm_dtype, &[]);
            let op = self.tape.ops.len() - 1;
            self.tape.ops[op].saved = if self.rg(sc) { vec![p] } else { vec![] };
            let p = if decoder {
                let p = self.cast(p, act);
                self.dropout(p, m.attention_dropout())
            } else {
                let p = self.dropout(p, m.attention_dropout());
                self.cast(p, act)
            };
            let rg = self.rg(p) || self.rg(vr);
            let out = self.tensor("attn_out", &[seqs, heads, s, hd], act, rg);
            let mut saved = vec![p, vr];
            if kv == heads {
                saved.extend(fused_qk.into_iter().flatten());
            }
            let o = self.op(PROBS_V_OP, &[p, vr], &[out], &saved);
            self.tape.ops[o].flops = score_flops / 2.0;
            self.tape.ops[o].bwd_flops = score_flops;
            // transpose(1, 2).reshape(...) of a non-contiguous tensor copies, back to the
            // projections' `[tokens, heads * head_dim]` (a `[b, h, s, d]` shape here would
            // make o_proj's output, and an encoder's residual stream after it, `heads` times
            // too large).
            let rg = self.rg(out);
            let flat = self.tensor("transpose", &[self.tokens, heads * hd], act, rg);
            self.op("transpose", &[out], &[flat], &[]);
            flat
        };
        let out = self.proj(Proj::O, "o_proj", out, heads * hd, h);
        self.dropout(out, m.residual_dropout())
    }

    /// `checkpoint = selective`: Megatron's selective recomputation of the attention core.
    fn selective(&self) -> bool {
        self.cand.selective
    }

    /// The attention core recomputed in the backward (`checkpoint = selective`;
    /// `backend/src/ops.rs` `attention_core` on Burn): one node that saves q and the
    /// (repeated) k and v, nothing quadratic in the compute dtype. With dropout, Burn's
    /// node also saves the 1-byte mask it was given (Burn's global generator cannot
    /// replay a draw, as Megatron's RNG tracker does). Its `[b, h, s, s]` scores and probabilities
    /// exist only inside the op: two of them in the forward (scores, then the softmax
    /// output), three in the backward (the recomputed probabilities, their gradient, the
    /// scores' gradient). The recompute costs the scores and `probs v` again
    /// (`score_flops`). Fused SDPA/flash never reaches here: it saves nothing quadratic.
    fn selective_attention(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        width: u64,
        score_flops: f64,
    ) -> TensorId {
        let m = &self.spec.model;
        let t = self.cand.tensor.max(1);
        let (heads, kv, hd) = (m.heads.div_ceil(t), m.kv_heads.div_ceil(t), m.head_dim);
        let seqs = self.tokens / self.spec.train.seq_len.max(1);
        let s = self.spec.train.seq_len.div_ceil(self.cand.context.max(1));
        let (k, v) = if kv < heads {
            (self.repeat_kv(k, width), self.repeat_kv(v, width))
        } else {
            (k, v)
        };
        let act = self.dtype(q);
        // PyTorch's eager softmax runs in fp32 under autocast.
        let sm = if self.profile.autocast {
            Dtype::Fp32
        } else {
            act
        };
        let scores = self.bytes(seqs * heads * s * s, act);
        let probs = self.bytes(seqs * heads * s * s, sm);
        let rg = self.rg(q) || self.rg(k) || self.rg(v);
        let mut inputs = vec![q, k, v];
        if self.profile.burn_ops && m.attention_dropout() > 0.0 {
            let shape = [seqs, heads, s, s];
            let mask = self.tensor("attn_dropout_mask", &shape, Dtype::Int8, false);
            let o = self.op("attn_dropout_draw", &[], &[mask], &[]);
            self.tape.ops[o].fwd_workspace = self.dropout_draw(&shape);
            inputs.push(mask);
        }
        let out = self.tensor("attn_out", &[seqs, heads, s, hd], act, rg);
        let o = self.op("attention_core", &inputs, &[out], &inputs);
        let info = &mut self.tape.ops[o];
        info.flops = score_flops;
        info.bwd_flops = 2.0 * score_flops + score_flops;
        info.fwd_workspace = scores + probs;
        info.bwd_workspace = probs + 2 * scores;
        info.workspace_buffers = vec![probs, scores, scores];
        let rg = self.rg(out);
        let flat = self.tensor("transpose", &[self.tokens, width], act, rg);
        self.op("transpose", &[out], &[flat], &[]);
        flat
    }

    /// Burn's eager attention after the projections and RoPE (`backend/src/model.rs`
    /// `Attention::forward`): `q * 1/sqrt(d)` (in place), `q k^T` (saves q and k), the
    /// causal bias added in place, `softmax_last` (`backend/src/ops.rs`: saves only the
    /// probabilities), `probs v` (saves both) and the transposed copy. One `[b, h, s, s]`
    /// tensor stays saved per layer. (Burn's composite softmax kept three: the 350M trace's
    /// 1,229,800,000 B per layer had 3 x 268,435,456 B of them, docs/burn-h100.md.)
    fn burn_attention(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        width: u64,
        score_flops: f64,
    ) -> TensorId {
        let m = &self.spec.model;
        let t = self.cand.tensor.max(1);
        let (heads, kv, hd) = (m.heads.div_ceil(t), m.kv_heads.div_ceil(t), m.head_dim);
        let decoder = m.arch == Arch::Decoder;
        let dropout = m.attention_dropout();
        let seqs = self.tokens / self.spec.train.seq_len.max(1);
        let s = self.spec.train.seq_len.div_ceil(self.cand.context.max(1));
        // Grouped-query attention: `expand` + `reshape` copies k and v to all heads.
        let (k, v) = if kv < heads {
            (self.repeat_kv(k, width), self.repeat_kv(v, width))
        } else {
            (k, v)
        };
        let act = self.dtype(q);
        let qs = self.pointwise_inplace("scale_q", &[q], act, &[]);
        let shape = [seqs, heads, s, s];
        let rg = self.rg(qs) || self.rg(k);
        let sc = self.tensor("scores", &shape, act, rg);
        let o = self.op(SCORES_OP, &[qs, k], &[sc], &[qs, k]);
        self.tape.ops[o].flops = score_flops / 2.0;
        self.tape.ops[o].bwd_flops = score_flops;
        let sc = if decoder {
            self.pointwise_inplace("mask", &[sc], act, &[])
        } else {
            sc
        };
        // One autodiff node that saves only its output; its forward (max, sub, exp,
        // sum, div on the inner backend) runs in place on the scores' buffer.
        let p = self.pointwise_inplace("softmax", &[sc], act, &[]);
        if self.rg(p) {
            let op = self.tape.ops.len() - 1;
            self.tape.ops[op].saved.push(p);
        }
        let p = self.dropout(p, dropout);
        let rg = self.rg(p) || self.rg(v);
        let out = self.tensor("attn_out", &[seqs, heads, s, hd], act, rg);
        let o = self.op(PROBS_V_OP, &[p, v], &[out], &[p, v]);
        self.tape.ops[o].flops = score_flops / 2.0;
        self.tape.ops[o].bwd_flops = score_flops;
        // `swap_dims(1, 2).reshape([b, s, h * d])` of a non-contiguous tensor copies.
        let rg = self.rg(out);
        let flat = self.tensor("transpose", &[self.tokens, width], act, rg);
        self.op("transpose", &[out], &[flat], &[]);
        flat
    }

    /// `train { attention = flash }` on Burn (`backend/src/kernels/flash`,
    /// `ops::flash_attention`): one autodiff node that saves q, k and v (not repeated for
    /// grouped-query attention), the output `[b, h, s, d]` (stored `[b, s, h, d]`, which the
    /// output projection saves too) and the fp32 log-sum-exp `[b, h, s]`. On CUDA the tensor-core kernels' one-pass backward
    /// ([`burn_flash_one_pass`]) adds dQ up in an fp32 `[b, h, s, d]` accumulator and reads
    /// the rows' fp32 `D [b, h, s]`, both alive while it runs; otherwise the kernels make no
    /// transient beyond their outputs. The
    /// CPU's blocked plain path also makes `[b, h, BURN_FLASH_QUERY_BLOCK, s]` score blocks
    /// (2 forward, 4 backward) and keeps its LSE in the compute dtype: not charged here, since
    /// the prediction is for the plan's GPU. The backend's memory test bounds that
    /// difference. Time: the kernels' block products, with no separate softmax passes. The
    /// forward has two (`score_flops`). The one-pass backward has five (S, dP, dV, dK,
    /// dQ), so 2.5 x; the atomics-free two passes seven (S and dP in each), 3.5 x
    /// (`docs/flash-attention.md`).
    fn burn_flash_attention(
        &mut self,
        q: TensorId,
        k: TensorId,
        v: TensorId,
        width: u64,
        score_flops: f64,
    ) -> TensorId {
        let m = &self.spec.model;
        let t = self.cand.tensor.max(1);
        let (heads, hd) = (m.heads.div_ceil(t), m.head_dim);
        let seqs = self.tokens / self.spec.train.seq_len.max(1);
        let s = self.spec.train.seq_len.div_ceil(self.cand.context.max(1));
        let act = self.dtype(q);
        let rg = self.rg(q) || self.rg(k) || self.rg(v);
        // Written heads-last (`[b, s, h, d]` in memory), so the output projection's
        // `swap_dims(1, 2).reshape([b, s, h * d])` is a view: the backward's saved output
        // and the projection's saved input are one tensor.
        let out = self.tensor("attn_out", &[self.tokens, width], act, rg);
        let lse = self.tensor("lse", &[seqs * heads * s], Dtype::Fp32, false);
        let one_pass = burn_flash_one_pass(act, hd, &self.spec.hardware.gpu);
        let name = if one_pass {
            FUSED_ATTENTION_OP
        } else {
            FUSED_ATTENTION_ROWS_OP
        };
        let o = self.op(name, &[q, k, v], &[out, lse], &[q, k, v, out, lse]);
        let info = &mut self.tape.ops[o];
        info.flops = score_flops;
        if one_pass {
            info.bwd_flops = 2.5 * score_flops;
            // The fp32 dQ accumulator and the rows' fp32 D.
            info.bwd_workspace = seqs * heads * s * (hd + 1) * 4;
        } else {
            info.bwd_flops = 3.5 * score_flops;
        }
        out
    }

    /// `backend/src/model.rs` `NormLayer::forward` in the element type, with Burn's save
    /// rules: `powi` saves its input, `div` both operands, `mul` by the (cast) weight both.
    /// RMSNorm keeps `x / rms` and the output beside its input (2 x 16.8 MB per 350M norm).
    fn burn_norm(&mut self, x: TensorId, h: u64) -> TensorId {
        let trainable = self.base_trainable();
        let dt = self.dtype(x);
        let rows = self.elems(x) / h;
        let rg = self.rg(x);
        let wp = self.param("norm", h, 1, trainable, self.param);
        let (w, _) = self.weight(wp);
        let (centered, denom) = match self.spec.model.norm {
            Norm::Rmsnorm => {
                let sq = self.pointwise("pow2", &[x], dt, &[x]);
                let ms = self.tensor("mean_sq", &[rows], dt, rg);
                self.op("mean", &[sq], &[ms], &[]);
                let r = self.tensor("rms", &[rows], dt, rg);
                self.op("sqrt", &[ms], &[r], &[r]);
                (x, r)
            }
            Norm::Layernorm => {
                let mean = self.tensor("mean", &[rows], dt, rg);
                self.op("mean", &[x], &[mean], &[]);
                let c = self.pointwise_inplace("center", &[x, mean], dt, &[]);
                let sq = self.pointwise("pow2", &[c], dt, &[c]);
                let var = self.tensor("var", &[rows], dt, rg);
                self.op("var", &[sq], &[var], &[]);
                let d = self.tensor("std", &[rows], dt, rg);
                self.op("sqrt", &[var], &[d], &[d]);
                (c, d)
            }
        };
        let xn = self.pointwise("normalize", &[centered, denom], dt, &[centered, denom]);
        let mut saved = Vec::new();
        if self.rg(w) {
            saved.push(xn);
        }
        if self.rg(xn) {
            saved.push(w);
        }
        let y = self.pointwise("norm_scale", &[xn, w], dt, &saved);
        if self.spec.model.norm == Norm::Layernorm {
            let bp = self.param("norm_bias", h, 1, trainable, self.param);
            let (b, _) = self.weight(bp);
            return self.pointwise_inplace("norm_bias", &[y, b], dt, &[]);
        }
        y
    }

    /// `backend/src/loss.rs` `lm_loss`: `log_softmax(logits.cast(F32))` then `gather`.
    /// Burn's log-softmax is composite: `x - max` (in place on the fp32 copy), `exp` (saves
    /// its input, the shifted logits), `sum`, `log`, `shifted - lse`. The shifted fp32 logits
    /// stay saved until the backward: +1,148 MB over the last layer in the 350M trace
    /// (1,048,576,000 B of them, the rest the head's saves).
    fn burn_lm_loss(&mut self, logits: TensorId) -> TensorId {
        let c = self.cast(logits, Dtype::Fp32);
        let rows = self.elems(c) / self.shape(c).last().copied().unwrap_or(1).max(1);
        let rg = self.rg(c);
        let shifted = self.pointwise_inplace("logsoftmax_shift", &[c], Dtype::Fp32, &[]);
        let e = self.pointwise("logsoftmax_exp", &[shifted], Dtype::Fp32, &[shifted]);
        let sum = self.tensor("logsumexp", &[rows], Dtype::Fp32, rg);
        self.op("logsoftmax_sum", &[e], &[sum], &[]);
        let lse = self.tensor("lse", &[rows], Dtype::Fp32, rg);
        self.op("log", &[sum], &[lse], &[sum]);
        let logp = self.pointwise("log_softmax", &[shifted, lse], Dtype::Fp32, &[]);
        let nll = self.tensor("nll", &[rows], Dtype::Fp32, rg);
        self.op("gather", &[logp], &[nll], &[]);
        let loss = self.tensor("loss", &[1], Dtype::Fp32, rg);
        self.op("mean", &[nll], &[loss], &[]);
        loss
    }

    /// Is the LM loss computed a chunk of tokens at a time? Only the Burn executor does
    /// (`backend/src/loss_chunked.rs`); on by default above a 32,768-token vocabulary.
    pub fn chunked_loss(&self) -> bool {
        self.profile.burn_ops && self.spec.train.chunked_loss_for(self.spec.model.vocab)
    }

    /// Do checkpointed layers' inputs go to host memory between their forward and their
    /// recompute? Only the Burn executor runs `offload = [activations]`
    /// (`backend/src/train.rs`, `Saved::Host`). The first layer's input stays: it is the
    /// embedding's output, which the embedding's backward keeps on the device anyway, so
    /// moving it would free nothing.
    pub fn offloads_activations(&self) -> bool {
        self.profile.burn_ops && self.cand.offloads(crate::spec::OffloadWhat::Activations)
    }

    /// `backend/src/loss_chunked.rs` `chunked_lm_loss`: the head matmul and the
    /// cross-entropy as one node that saves its inputs (the final hidden states and the
    /// head weight, alive anyway) and recomputes each chunk's logits in the backward.
    /// Live at once: one `[chunk, vocab]` fp32 logits block and about two more of its
    /// size (the exponentials; in the backward the one-hot and the logits' gradient),
    /// instead of the whole `[tokens, vocab]` logits and the loss's saved copies. The
    /// price is the head's forward matmul once more.
    fn chunked_lm_loss(&mut self, x: TensorId, head: Param) -> TensorId {
        let (w, ws) = self.weight(head);
        let vocab = head.rows;
        let h = *self.shape(x).last().unwrap_or(&1);
        let rows = self.elems(x) / h.max(1);
        let chunk = rows.min(CHUNKED_LOSS_TOKENS);
        let block = self.bytes(chunk * vocab, Dtype::Fp32);
        let rg = self.rg(x) || self.rg(w);
        let loss = self.tensor("loss", &[1], Dtype::Fp32, rg);
        let o = self.op("chunked_lm_loss", &[x, w], &[loss], &[x, w]);
        let f = 2.0 * rows as f64 * h as f64 * vocab as f64;
        let grads = (self.rg(x) as u8 + self.rg(w) as u8) as f64;
        let info = &mut self.tape.ops[o];
        info.flops = f;
        info.bwd_flops = f * grads + if grads > 0.0 { f } else { 0.0 };
        info.fwd_workspace = ws + 3 * block;
        info.bwd_workspace = ws + 3 * block;
        // Three tensors the size of a chunk's logits, then the head's cast.
        info.workspace_buffers = vec![block; 3];
        loss
    }

    fn repeat_kv(&mut self, x: TensorId, width: u64) -> TensorId {
        let dt = self.dtype(x);
        let rg = self.rg(x);
        let out = self.tensor("repeat_kv", &[self.tokens, width], dt, rg);
        self.op("repeat_kv", &[x], &[out], &[]);
        out
    }

    fn mlp(&mut self, x: TensorId) -> TensorId {
        let m = &self.spec.model;
        let (h, ffn) = (m.hidden, m.ffn.div_ceil(self.cand.tensor.max(1)));
        // `F.linear` with a bias saves what it saves without one (its input and weight;
        // the bias' gradient is a sum of the output's): `tools/saved_tensors.py`.
        let out = match m.mlp {
            Mlp::Swiglu if self.profile.burn_ops => {
                // backend/src/model.rs: `silu(gate(x)) * up(x)`; Burn's silu is
                // `x * sigmoid(x)` and its sigmoid op saves its output: the MLP keeps five
                // `[tokens, ffn]` tensors (gate, sigmoid, silu, up, product) for the
                // backward — 5 x 46.1 MB per 350M layer in the trace.
                let g = self.proj(Proj::Gate, "gate_proj", x, h, ffn);
                let dt = self.dtype(g);
                let shape = self.shape(g);
                let rg = self.rg(g);
                let sg = self.tensor("sigmoid", &shape, dt, rg);
                let o = self.op("sigmoid", &[g], &[sg], &[sg]);
                // CubeCL's sigmoid runs in fp32 (`cast`, exp, log, ...): scratch while it runs.
                self.tape.ops[o].fwd_workspace = self.bytes(self.elems(g), Dtype::Fp32);
                let a = self.pointwise("silu", &[g, sg], dt, &[g, sg]);
                let u = self.proj(Proj::Up, "up_proj", x, h, ffn);
                let mdt = promote(dt, self.dtype(u));
                let p = self.pointwise("mul", &[a, u], mdt, &[a, u]);
                self.proj(Proj::Down, "down_proj", p, ffn, h)
            }
            Mlp::Swiglu => {
                let g = self.proj(Proj::Gate, "gate_proj", x, h, ffn);
                let u = self.proj(Proj::Up, "up_proj", x, h, ffn);
                let dt = self.dtype(g);
                let a = self.pointwise("silu", &[g], dt, &[g]);
                let mdt = promote(dt, self.dtype(u));
                let p = self.pointwise("mul", &[a, u], mdt, &[a, u]);
                self.proj(Proj::Down, "down_proj", p, ffn, h)
            }
            Mlp::SquaredRelu => {
                // Megatron's `squared_relu`: `torch.pow(F.relu(x), 2)`. relu saves its output,
                // pow its input (the same tensor), the down projection its input: two
                // `[tokens, ffn]` tensors, as GELU; the matmul's output is not kept.
                let i = self.proj(Proj::Up, "up_proj", x, h, ffn);
                let dt = self.dtype(i);
                let r = self.pointwise("relu", &[i], dt, &[]);
                let op = self.tape.ops.len() - 1;
                if self.rg(i) {
                    self.tape.ops[op].saved = vec![r];
                }
                let a = self.pointwise("square", &[r], dt, &[r]);
                self.proj(Proj::Down, "down_proj", a, ffn, h)
            }
            Mlp::Gelu => {
                let i = self.proj(Proj::Up, "up_proj", x, h, ffn);
                let dt = self.dtype(i);
                let a = self.pointwise("gelu", &[i], dt, &[i]);
                // BERT-style layers call `self.output(intermediate_output, ...)`: the caller's
                // frame keeps the activation until the output block (dense, dropout, residual,
                // norm) returns.
                self.frame_holds.push(a);
                self.proj(Proj::Down, "down_proj", a, ffn, h)
            }
        };
        self.dropout(out, m.residual_dropout())
    }

    fn residual(&mut self, x: TensorId, y: TensorId) -> TensorId {
        let dt = promote(self.dtype(x), self.dtype(y));
        if self.profile.burn_ops {
            // `x.clone() + f(x)`: the add writes into f(x)'s buffer (nothing else holds it).
            return self.pointwise_inplace("residual", &[y, x], dt, &[]);
        }
        self.pointwise("residual", &[x, y], dt, &[])
    }

    fn layer(&mut self, index: u32, x: TensorId) -> TensorId {
        let first_op = self.tape.ops.len() as u32;
        self.layer = Some(index);
        if let Some(c) = self.op_sac.as_mut() {
            *c = 0;
        }
        self.begin_unit("layer");
        let h = self.spec.model.hidden;
        let out = match self.spec.model.arch {
            // Pre-norm decoder (Llama): x + attn(norm(x)); h + mlp(norm(h)).
            Arch::Decoder => {
                let n = self.norm(x, h);
                let a = self.attention(n);
                let h1 = self.residual(x, a);
                let n2 = self.norm(h1, h);
                let f = self.mlp(n2);
                self.residual(h1, f)
            }
            // Post-norm encoder (BERT/RoBERTa): norm(x + attn(x)); norm(h + mlp(h)).
            Arch::Encoder => {
                let a = self.attention(x);
                let s = self.residual(a, x);
                let h1 = self.norm(s, h);
                let f = self.mlp(h1);
                let s2 = self.residual(f, h1);
                self.norm(s2, h)
            }
        };
        for t in std::mem::take(&mut self.frame_holds) {
            self.hold_to_last_op(t);
        }
        let end_op = self.tape.ops.len() as u32;
        let checkpointed = self
            .cand
            .checkpoint_layers
            .binary_search(&(index as u64))
            .is_ok();
        if let Some(u) = self.open_unit {
            self.tape.units[u].regathered = checkpointed;
        }
        self.end_unit();
        self.tape.layers.push(LayerSpan {
            index,
            first_op,
            end_op,
            input: x,
            checkpointed,
            offloaded: checkpointed && index > 0 && self.offloads_activations(),
        });
        self.layer = None;
        out
    }

    /// The whole micro-step: embeddings, `layers` (the stage's share), head and loss.
    pub fn build(
        mut self,
        layers: std::ops::Range<u64>,
        with_embedding: bool,
        with_head: bool,
    ) -> Self {
        let m = self.spec.model.clone();
        let h = m.hidden;
        let trainable = self.base_trainable();
        let ids = self.tensor("token_ids", &[self.tokens], Dtype::Fp32, false);
        self.tape.tensors[ids.0 as usize].role = Role::Input;
        self.begin_unit("embedding");
        let vocab_shard = m.vocab.div_ceil(self.cand.tensor.max(1));
        let embed = self.param("embed_tokens", vocab_shard, h, trainable, self.param);
        let mut x = if with_embedding {
            let rg = trainable;
            let e = if self.profile.burn_ops {
                // backend/src/model.rs `Embed::forward`: `embedding(to_dtype(table), ids)`;
                // Burn's embedding op saves the (cast) table and the ids for its backward.
                let (table, _) = self.weight(embed);
                let e = self.tensor("embedding", &[self.tokens, h], self.act, rg);
                self.op("embedding", &[ids, table], &[e], &[table, ids]);
                if m.arch == Arch::Decoder && m.numerics.padding_idx.is_some() {
                    // `padding_idx`: the pad positions taken from a detached copy
                    // (`mask_where`), which saves the `[tokens]` mask of them.
                    let pad = self.tensor("pad_mask", &[self.tokens], Dtype::Int8, false);
                    self.op("pad_mask", &[ids], &[pad], &[]);
                    self.pointwise("pad_where", &[e, pad], self.act, &[pad])
                } else {
                    e
                }
            } else {
                // `gradient_checkpointing_enable` (and PEFT over a checkpointed model) calls
                // `enable_input_require_grads`: a hook makes the embedding output require
                // grad. Over a frozen table that output is a leaf, which autograd's
                // AccumulateGrad node keeps (and gives a `.grad`) until the graph is freed at
                // the end of the backward; everything after it, the embedding's norm and
                // dropout included, now saves for the backward.
                let input_grads = !trainable && !self.cand.checkpoint_layers.is_empty();
                let e = self.tensor(
                    "embedding",
                    &[self.tokens, h],
                    self.param,
                    rg || input_grads,
                );
                let kept = self.kept_gather(embed, self.param);
                let outputs: Vec<TensorId> = std::iter::once(e).chain(kept).collect();
                let saved: Vec<TensorId> = std::iter::once(ids).chain(kept).collect();
                self.op("embedding", &[ids, embed.id], &outputs, &saved);
                if input_grads {
                    self.embedding_leaf = Some(e);
                }
                e
            };
            let mut e = e;
            if m.positions == Positions::Learned {
                let pos = self.param("embed_positions", m.max_positions, h, trainable, self.param);
                let pe = self.tensor("position_embedding", &[self.tokens, h], self.param, rg);
                self.op("position_embedding", &[ids, pos.id], &[pe], &[ids]);
                e = self.residual(e, pe);
            }
            if m.arch == Arch::Encoder {
                e = self.norm(e, h);
            }
            let e = self.dropout(e, m.embedding_dropout());
            self.end_unit();
            e
        } else {
            // A later pipeline stage receives the activations of the previous one.
            let dt = if self.autocast { self.param } else { self.act };
            let t = self.tensor("stage_input", &[self.tokens, h], dt, true);
            self.tape.tensors[t.0 as usize].role = Role::Input;
            t
        };
        if let Some(leaf) = self.embedding_leaf.take() {
            // Held like a saved tensor of its first consumer: released when the backward
            // reaches the embedding.
            if let Some(op) = self.tape.ops.iter_mut().find(|o| o.inputs.contains(&leaf)) {
                op.saved.push(leaf);
            }
        }
        for i in layers {
            x = self.layer(i as u32, x);
        }
        if !with_head {
            // The stage's output is sent on; its gradient comes back: model as the loss.
            self.tape.loss = Some(x);
            super::engines::backward_scratch(self.spec, self.profile, self.cand, &mut self.tape);
            return self;
        }
        self.begin_unit("head");
        if m.tie_embeddings && self.spec.train.loss != Loss::Contrastive {
            // A tied head gathers the embedding unit's table again.
            let table = self.bytes(vocab_shard * h, self.param);
            if let Some(u) = self.open_unit {
                self.tape.units[u].bytes += table;
            }
        }
        if m.arch == Arch::Decoder {
            x = self.norm(x, h);
        }
        let loss = match self.spec.train.loss {
            Loss::Contrastive => {
                // Mean-pooled embeddings scored against each other: tiny next to the layers.
                let seqs = self.tokens / self.spec.train.seq_len.max(1);
                let dt = self.dtype(x);
                let rg = self.rg(x);
                // Masked mean pooling: `(hidden * mask[..., None]).sum(1) / mask.sum(1)` makes a
                // hidden-sized product before the sum (the mask needs no grad: nothing saved).
                let masked = self.pointwise("pool_mask", &[x], dt, &[]);
                let pooled = self.tensor("pooled", &[seqs, h], dt, rg);
                self.op("mean_pool", &[masked], &[pooled], &[]);
                let sim = self.tensor("similarity", &[seqs, seqs], Dtype::Fp32, rg);
                self.op("similarity", &[pooled], &[sim], &[pooled]);
                let loss = self.tensor("loss", &[1], Dtype::Fp32, rg);
                self.op("cross_entropy", &[sim], &[loss], &[sim]);
                loss
            }
            _ if self.profile.burn_ops => {
                let head = if m.tie_embeddings {
                    embed
                } else {
                    self.param("lm_head", vocab_shard, h, trainable, self.param)
                };
                if self.chunked_loss() {
                    self.chunked_lm_loss(x, head)
                } else {
                    let logits = self.linear("lm_head", x, head, None);
                    self.burn_lm_loss(logits)
                }
            }
            loss => {
                if loss == Loss::MaskedLm {
                    // RobertaLMHead: dense + gelu + layer_norm before the decoder.
                    let d = self.param("lm_head_dense", h, h, trainable, self.param);
                    let db = self.param("lm_head_dense_bias", h, 1, trainable, self.param);
                    let y = self.linear("lm_head_dense", x, d, Some(db));
                    let dt = self.dtype(y);
                    let y = self.pointwise("gelu", &[y], dt, &[y]);
                    x = self.norm(y, h);
                }
                let head = if m.tie_embeddings {
                    embed
                } else {
                    self.param("lm_head", vocab_shard, h, trainable, self.param)
                };
                let bias = (loss == Loss::MaskedLm)
                    .then(|| self.param("lm_head_bias", vocab_shard, 1, trainable, self.param));
                let logits = self.linear("lm_head", x, head, bias);
                // The model returns the logits; the caller drops them after the forward.
                self.tape.tensors[logits.0 as usize].held_until_forward_end = true;
                // HF's causal-LM loss upcasts explicitly (`logits.float()`); the MLM loss
                // runs log_softmax in the logits' dtype and autocast runs nll_loss in fp32,
                // so it saves an fp32 copy of the log-probabilities.
                let upcast = self.profile.loss_upcasts_logits
                    && (loss == Loss::CausalLm || self.profile.mlm_upcasts_logits);
                let l = if upcast {
                    self.cast(logits, Dtype::Fp32)
                } else {
                    logits
                };
                let dt = self.dtype(l);
                let lsm = self.pointwise("log_softmax", &[l], dt, &[]);
                let op = self.tape.ops.len() - 1;
                if self.rg(l) {
                    self.tape.ops[op].saved = vec![lsm];
                }
                let nll_in = if self.autocast {
                    self.cast(lsm, Dtype::Fp32)
                } else {
                    lsm
                };
                let rg = self.rg(nll_in);
                let loss_t = self.tensor("loss", &[1], Dtype::Fp32, rg);
                let nll = self.op("nll_loss", &[nll_in], &[loss_t], &[nll_in]);
                if let Some((fwd, bwd)) = super::parallel::vocab_parallel_loss_scratch(
                    self.profile,
                    self.cand,
                    self.tape.tensor(lsm).bytes,
                ) {
                    self.tape.ops[op].fwd_workspace += fwd;
                    self.tape.ops[nll].bwd_workspace += bwd;
                }
                loss_t
            }
        };
        self.tape.loss = Some(loss);
        self.end_unit();
        if self.units && !self.views {
            self.charge_prefetch();
        }
        self.charge_fsdp();
        super::engines::backward_scratch(self.spec, self.profile, self.cand, &mut self.tape);
        self
    }

    /// FSDP2's gathered units and gradient buffers on every op (`memory::fsdp`), when its
    /// units are gathered (sharded over data ranks, or offloaded to the host).
    fn charge_fsdp(&mut self) {
        if self.profile.engine != crate::profile::Engine::Fsdp2 || !self.gather {
            return;
        }
        let profile = self.profile;
        let allocated = |b: u64| profile.allocated(b);
        super::fsdp::Schedule {
            data: self.cand.data.max(1),
            reshard: super::engines::fsdp_reshards_after_forward(self.cand.zero),
            // MixedPrecisionPolicy(reduce_dtype=fp32) over fp32 shards, or no policy: the
            // gradients are reduced in the shards' dtype either way.
            reduce_bytes: self.stored.bytes(),
            allocated: &allocated,
        }
        .apply(&mut self.tape);
    }
}
