//! The step's schedule as a tape of operations, and the liveness walk over it.
//!
//! A [`Tape`] lists the operations of one forward pass in execution order,
//! each with the tensors it reads, the tensors it creates and the tensors it
//! saves for its backward — the same bookkeeping PyTorch's autograd does. The
//! walk ([`walk`]) replays the schedule: forward (tensors freed after their
//! last use unless saved or held), backward in reverse (gradients created,
//! saved tensors released as each op's backward finishes, checkpointed layers
//! recomputed from their saved input first), then the optimizer. It tracks
//! live bytes per category and records the peak and a timeline.
//!
//! Invariants: tensor and op ids are indices into the tape and never
//! change (the tape only grows); every byte count already includes the
//! allocator's rounding; the walk never frees a parameter.

use crate::memory::Category;
use serde::Serialize;
use std::fmt;

/// A tensor of the tape (prints as `t3`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct TensorId(pub u32);

/// An operation of the tape (prints as `op3`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct OpId(pub u32);

impl fmt::Display for TensorId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "t{}", self.0)
    }
}
impl fmt::Display for OpId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "op{}", self.0)
    }
}

/// What a tensor is, for the breakdown.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// A parameter (trainable or frozen); lives for the whole run.
    Param,
    /// A 16-bit copy of a weight made by autocast (cached for the forward when trainable).
    WeightCopy,
    /// An activation, a mask or any other forward tensor.
    Activation,
    /// Token ids, labels, positions: inputs of the step.
    Input,
    /// A whole unit's parameters gathered for its use (the Burn executor's ZeRO-3 /
    /// parameter offload): weights, but freed like an activation.
    Gathered,
}

#[derive(Clone, Debug, Serialize)]
pub struct TensorInfo {
    pub name: &'static str,
    pub shape: Vec<u64>,
    pub dtype: crate::spec::Dtype,
    /// Allocated bytes (rounded to the allocator granularity).
    pub bytes: u64,
    pub requires_grad: bool,
    pub role: Role,
    /// Bytes of this parameter's gradient (params only; 0 when frozen).
    pub grad_bytes: u64,
    pub producer: Option<OpId>,
    /// Held from creation until the end of the forward (autocast's weight cache, the logits
    /// the model returns).
    pub held_until_forward_end: bool,
}

#[derive(Clone, Debug, Serialize)]
pub struct OpInfo {
    pub name: &'static str,
    pub layer: Option<u32>,
    pub inputs: Vec<TensorId>,
    pub outputs: Vec<TensorId>,
    /// Tensors kept for the backward (only when some input requires grad).
    pub saved: Vec<TensorId>,
    /// Scratch bytes alive only while the forward kernel runs.
    pub fwd_workspace: u64,
    /// Scratch bytes alive only while the backward kernel runs (beyond the gradients).
    pub bwd_workspace: u64,
    /// The buffers an allocator sees a workspace as: these sizes first, the rest of it one
    /// more buffer (empty: one buffer). Only the traced walk reads it: a pool that takes
    /// three 390 MiB blocks from shared pages would give one 1.2 GiB buffer a page of its
    /// own (`memory::trace`).
    pub workspace_buffers: Vec<u64>,
    /// Forward FLOPs (multiply-adds count 2).
    pub flops: f64,
    /// Backward FLOPs.
    pub bwd_flops: f64,
    /// Bytes read and written by the forward (memory-bound ops).
    pub bytes_moved: f64,
    /// Tensors the executor's code still references until this op has run (a Python local
    /// or the caller's argument), beyond their last use as an input. Forward only.
    pub holds: Vec<TensorId>,
    /// The output may take the buffer of an input that dies at this op (an element-wise
    /// kernel writing in place; `Profile::inplace_elementwise`).
    pub inplace: bool,
    /// An engine's buffers alive while the op runs, beyond the tape's tensors (FSDP2's
    /// gathered units and gradient buffers: `memory::fsdp`).
    pub engine: EngineScratch,
}

/// Bytes an engine holds while an op runs, per pass of the op, as `[weights, grads]`: what
/// is gathered and what gradients wait for their reduction differ between the forward, a
/// checkpointed layer's recompute (inside the backward) and the op's backward.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct EngineScratch {
    pub forward: [u64; 2],
    pub recompute: [u64; 2],
    pub backward: [u64; 2],
}

impl EngineScratch {
    /// `bytes` as extra live bytes by category (weights, grads).
    fn add_to(bytes: [u64; 2], extra: &mut [u64; Category::COUNT]) {
        extra[Category::Weights as usize] += bytes[0];
        extra[Category::Grads as usize] += bytes[1];
    }
}

impl OpInfo {
    /// Autograd records the op only when some input requires grad.
    pub fn has_backward(&self, tape: &Tape) -> bool {
        self.inputs.iter().any(|t| tape.tensor(*t).requires_grad)
    }
}

/// One transformer layer's span of ops on the tape.
#[derive(Clone, Debug, Serialize)]
pub struct LayerSpan {
    pub index: u32,
    pub first_op: u32,
    /// One past the last op.
    pub end_op: u32,
    pub input: TensorId,
    pub checkpointed: bool,
    /// A checkpointed layer whose input goes to host memory after its forward and comes
    /// back right before its recompute (`offload = [activations]`, the Burn executor).
    pub offloaded: bool,
}

/// A unit the Burn executor's ZeRO-3 gathers whole (the embedding, a layer, the head and
/// the loss): its ops and the tensor its parameters are gathered into.
#[derive(Clone, Debug, Serialize)]
pub struct Unit {
    /// `embedding`, `layer` or `head`.
    pub name: &'static str,
    pub layer: Option<u32>,
    /// Ops `first_op..end_op`; the first is the `all_gather` that makes `gathered`.
    pub first_op: u32,
    pub end_op: u32,
    pub gathered: TensorId,
    /// Bytes of the unit's parameters gathered whole (storage dtype).
    pub bytes: u64,
    /// Its trainable values (what the optimizer steps and `Zero3::finish_step` writes back).
    pub trainable_values: u64,
    /// A checkpointed layer: gathered again before its recompute in the backward.
    pub regathered: bool,
    /// Gathers in flight while this unit runs: the next units' in the forward, the next
    /// checkpointed layers' in the backward (`ZERO3_PREFETCH_UNITS` ahead). Scratch of its
    /// ops, and live at the segment boundary after it.
    pub prefetch_forward: u64,
    pub prefetch_backward: u64,
}

/// The forward schedule of one training micro-step.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Tape {
    pub tensors: Vec<TensorInfo>,
    pub ops: Vec<OpInfo>,
    pub layers: Vec<LayerSpan>,
    /// Units gathered whole, in forward order (empty unless the Burn executor's ZeRO-3 or
    /// parameter offload).
    pub units: Vec<Unit>,
    /// The scalar the backward starts from.
    pub loss: Option<TensorId>,
    /// Outputs a checkpointed layer keeps from its forward for its recompute, which
    /// takes them instead of running their ops again (op-level selective recomputation,
    /// `checkpoint = selective_op`).
    pub kept: Vec<TensorId>,
}

impl Tape {
    /// [`Tape::kept`] as a mask over tensor ids.
    pub fn kept_mask(&self) -> Vec<bool> {
        let mut m = vec![false; self.tensors.len()];
        for t in &self.kept {
            m[t.0 as usize] = true;
        }
        m
    }
}

impl Tape {
    pub fn tensor(&self, t: TensorId) -> &TensorInfo {
        &self.tensors[t.0 as usize]
    }
    pub fn op(&self, o: OpId) -> &OpInfo {
        &self.ops[o.0 as usize]
    }
    pub fn add_tensor(&mut self, info: TensorInfo) -> TensorId {
        self.tensors.push(info);
        TensorId(self.tensors.len() as u32 - 1)
    }
    pub fn add_op(&mut self, info: OpInfo) -> OpId {
        let id = OpId(self.ops.len() as u32);
        for out in &info.outputs {
            self.tensors[out.0 as usize].producer = Some(id);
        }
        self.ops.push(info);
        id
    }
    /// The span of the layer `op` belongs to (layer indices are the model's, so a later
    /// pipeline stage's tape starts at its first layer).
    pub fn layer_of_op(&self, op: usize) -> Option<&LayerSpan> {
        let l = self.ops[op].layer?;
        let first = self.layers.first()?.index;
        self.layers.get(l.checked_sub(first)? as usize)
    }
}

/// The phase of the step an event belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Before the first step: the executor building and loading the model.
    Setup,
    Forward,
    Backward,
    Optimizer,
}

impl Phase {
    pub fn as_str(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::Forward => "forward",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// Live bytes per category.
pub type Bytes = [u64; Category::COUNT];

/// One point of the memory timeline: the live bytes while `op` runs.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Sample {
    pub phase: Phase,
    pub op: String,
    pub layer: Option<u64>,
    pub bytes: u64,
    /// Live bytes per category (sums to `bytes`); for the HTML report's stacked timeline.
    /// Not serialized: the JSON timeline stays one number per sample.
    #[serde(skip_serializing)]
    pub by_category: Bytes,
}

/// Where the walk saw the most bytes live.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Peak {
    pub bytes: u64,
    pub phase: Phase,
    pub op: String,
    pub layer: Option<u64>,
    /// Live bytes per category at the peak.
    pub by_category: Bytes,
}

/// The persistent state around the micro-step being walked.
#[derive(Clone, Debug, Default)]
pub struct Persistent {
    /// Bytes that live through the whole step and are not tensors of the tape, per category
    /// (optimizer state, workspaces, ...).
    pub fixed: Bytes,
    /// Gradients already exist when the micro-step starts (gradient accumulation after the
    /// first micro-batch): new gradients are temporaries added in place.
    pub grads_exist: bool,
    /// Divide parameter gradient bytes by this (ZeRO-2/3 keeps a shard of each gradient).
    pub grad_divisor: u64,
    /// The executor samples its memory at segment boundaries only
    /// (`Profile::peak_sampled_at_segments`): the timeline holds those samples.
    pub sampled: bool,
    /// Gradients per unit (the Burn executor's ZeRO-3): a unit's full gradients exist from
    /// their op's backward until the backward leaves the unit (reduce-scattered into the
    /// accumulator, [`Persistent::unit_grad_acc`]); `grads_exist` and `grad_divisor` do not
    /// apply.
    pub unit_grads: bool,
    /// The bytes of that accumulator on the device. The executor makes it from the first
    /// reduce-scatter of a step's backward and frees it in the optimizer step: charged from
    /// the first micro-batch's backward on (whole, as it is when the backward ends), and
    /// through every later micro-batch (`grads_exist`).
    pub unit_grad_acc: u64,
    /// `Profile::recompute_holds_output`: a recomputed layer's output lives from its recompute
    /// to the start of the layer's backward.
    pub recompute_holds_output: bool,
    /// The optimizer steps in the backward (`Spec::optimizer_in_backward`): per tensor id,
    /// the op after whose backward a trainable parameter steps and its gradient is freed
    /// (`u32::MAX`: none; empty: the step runs after the backward). A gradient that
    /// arrives before that op (a tied matrix's first part, a Burn unit's parameters read
    /// after its first op) lives whole until then.
    pub step_at: Vec<u32>,
}

/// One allocation or release of the walk, in order ([`walk_traced`]): what an allocator
/// would see (`memory::trace` replays it through CubeCL's pools).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    Alloc { buffer: Buffer, bytes: u64 },
    Free { buffer: Buffer },
}

/// A buffer of [`Event`]s.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Buffer {
    Tensor(TensorId),
    /// The gradient of a tensor (a parameter's lives until the optimizer step).
    Grad(TensorId),
    /// Scratch alive while one op runs (workspaces, gradients added in place).
    Scratch(u32),
}

/// The liveness walk's state.
struct Walk<'a> {
    tape: &'a Tape,
    refs: Vec<u32>,
    alive: Vec<bool>,
    grad_alive: Vec<bool>,
    param_grad: Vec<bool>,
    live: Bytes,
    peak: Option<Peak>,
    samples: Vec<Sample>,
    record: bool,
    persistent: &'a Persistent,
    /// Inputs of checkpointed layers: held until that layer's backward.
    ckpt_input: Vec<bool>,
    /// The highest live bytes at segment boundaries (see [`Walk::boundary`]).
    boundary_peak: Option<Peak>,
    /// `unit_grads`: gradients of the unit whose backward runs, and their bytes.
    unit_grad: Vec<bool>,
    unit_grad_bytes: u64,
    /// The unit of each op (`usize::MAX` outside units).
    unit_of: Vec<usize>,
    /// `step_at`: gradients waiting for their parameter's step, as (op, tensor).
    waiting: Vec<(u32, u32)>,
    /// [`walk_traced`]: the events so far, and the scratch of the op running.
    events: Option<Vec<Event>>,
    scratch: Vec<Buffer>,
    scratch_count: u32,
}

impl<'a> Walk<'a> {
    fn category(&self, t: TensorId) -> Category {
        match self.tape.tensor(t).role {
            Role::Param | Role::Gathered => Category::Weights,
            Role::WeightCopy => Category::WeightCopies,
            Role::Activation | Role::Input => Category::Activations,
        }
    }
    fn alloc(&mut self, t: TensorId, refs: u32) {
        let i = t.0 as usize;
        if self.alive[i] {
            self.refs[i] += refs;
            return;
        }
        self.alive[i] = true;
        self.refs[i] = refs;
        let c = self.category(t) as usize;
        self.live[c] += self.tape.tensor(t).bytes;
        self.event_alloc(Buffer::Tensor(t), self.tape.tensor(t).bytes);
    }
    fn event_alloc(&mut self, buffer: Buffer, bytes: u64) {
        if let Some(e) = self.events.as_mut() {
            e.push(Event::Alloc { buffer, bytes });
        }
    }
    fn event_free(&mut self, buffer: Buffer) {
        if let Some(e) = self.events.as_mut() {
            e.push(Event::Free { buffer });
        }
    }
    /// An op's workspace of `bytes` as scratch, in the buffers `buffers` says
    /// ([`OpInfo::workspace_buffers`]).
    fn add_workspace(&mut self, bytes: u64, buffers: &[u64]) {
        let mut rest = bytes;
        for &b in buffers {
            if b > rest {
                break;
            }
            self.add_scratch(b);
            rest -= b;
        }
        self.add_scratch(rest);
    }

    /// Scratch of the running op, freed by [`Walk::end_scratch`] (traced walks only).
    fn add_scratch(&mut self, bytes: u64) {
        if self.events.is_none() || bytes == 0 {
            return;
        }
        let b = Buffer::Scratch(self.scratch_count);
        self.scratch_count += 1;
        self.event_alloc(b, bytes);
        self.scratch.push(b);
    }
    fn end_scratch(&mut self) {
        for b in std::mem::take(&mut self.scratch) {
            self.event_free(b);
        }
    }
    fn release(&mut self, t: TensorId) {
        let i = t.0 as usize;
        if !self.alive[i] || self.tape.tensor(t).role == Role::Param {
            return;
        }
        self.refs[i] = self.refs[i].saturating_sub(1);
        if self.refs[i] == 0 {
            self.alive[i] = false;
            let c = self.category(t) as usize;
            self.live[c] -= self.tape.tensor(t).bytes;
            self.event_free(Buffer::Tensor(t));
        }
    }
    fn observe(&mut self, phase: Phase, op: &str, layer: Option<u32>, extra: Bytes) {
        self.observe_at(phase, false, op, layer, extra);
    }

    fn observe_at(
        &mut self,
        phase: Phase,
        recompute: bool,
        op: &str,
        layer: Option<u32>,
        extra: Bytes,
    ) {
        let mut now = self.live;
        for (n, e) in now.iter_mut().zip(extra.iter()) {
            *n += e;
        }
        let total: u64 = now.iter().sum();
        if self.record && !self.persistent.sampled {
            self.samples.push(Sample {
                phase,
                op: op.to_string(),
                layer: layer.map(u64::from),
                bytes: total,
                by_category: now,
            });
        }
        if self.peak.as_ref().is_none_or(|p| total > p.bytes) {
            let (phase, op) = if recompute {
                (Phase::Backward, format!("recompute {op}"))
            } else {
                (phase, op.to_string())
            };
            self.peak = Some(Peak {
                bytes: total,
                phase,
                op,
                layer: layer.map(u64::from),
                by_category: now,
            });
        }
    }

    /// A segment boundary: where an executor that samples its memory between segments
    /// (rcoa's Burn executor: after each layer's forward and backward, the loss) sees it.
    fn boundary(&mut self, phase: Phase, op: &str, layer: Option<u32>) {
        self.boundary_with(phase, op, layer, 0);
    }

    /// The prefetched gathers in flight at the boundary after `op`'s unit.
    fn prefetch_after(&self, op: usize, backward: bool) -> u64 {
        let Some(u) = self.unit_of.get(op).and_then(|&u| self.tape.units.get(u)) else {
            return 0;
        };
        if backward {
            u.prefetch_backward
        } else {
            u.prefetch_forward
        }
    }

    /// A boundary with `prefetched` bytes of gathered weights in flight besides the live ones.
    fn boundary_with(&mut self, phase: Phase, op: &str, layer: Option<u32>, prefetched: u64) {
        let mut live = self.live;
        live[Category::Weights as usize] += prefetched;
        let total: u64 = live.iter().sum();
        if self.record && self.persistent.sampled {
            self.samples.push(Sample {
                phase,
                op: op.to_string(),
                layer: layer.map(u64::from),
                bytes: total,
                by_category: live,
            });
        }
        if self.boundary_peak.as_ref().is_none_or(|p| total > p.bytes) {
            self.boundary_peak = Some(Peak {
                bytes: total,
                phase,
                op: op.to_string(),
                layer: layer.map(u64::from),
                by_category: live,
            });
        }
    }

    /// Run ops `range` forward. `recompute`: a checkpointed layer replayed in the backward,
    /// so uses outside the layer do not count and its saves do; with `hold_output` its last
    /// op's outputs stay alive for the caller to release.
    fn forward_ops(&mut self, range: std::ops::Range<usize>, recompute: bool, hold_output: bool) {
        let tape = self.tape;
        let counts_saves = |op: usize| -> bool {
            recompute || !tape.layer_of_op(op).is_some_and(|l| l.checkpointed)
        };
        // References a tensor starts with: forward uses within the range, saves that count,
        // holds. Counted once per range (indexed by tensor id).
        let mut refs_of: Vec<u32> = vec![0; tape.tensors.len()];
        let kept = tape.kept_mask();
        for op in range.clone() {
            let l = &tape.ops[op];
            for &x in l.inputs.iter().chain(&l.holds) {
                refs_of[x.0 as usize] += 1;
            }
            if counts_saves(op) && l.has_backward(tape) {
                for &x in &l.saved {
                    refs_of[x.0 as usize] += 1;
                }
            }
        }
        for op in range.clone() {
            let info = &tape.ops[op];
            if info.inplace {
                // An input whose last reference is this op, of the output's size, lends
                // its buffer: free it before the output is counted.
                let out_bytes = info.outputs.first().map(|o| tape.tensor(*o).bytes);
                let outside = |t: TensorId| {
                    recompute
                        && tape
                            .tensor(t)
                            .producer
                            .is_none_or(|p| (p.0 as usize) < range.start)
                };
                let donor = info.inputs.iter().copied().find(|&t| {
                    let i = t.0 as usize;
                    self.alive[i]
                        && self.refs[i] == 1
                        && !outside(t)
                        && tape.tensor(t).role == Role::Activation
                        && Some(tape.tensor(t).bytes) == out_bytes
                });
                if let Some(d) = donor {
                    self.release(d);
                }
            }
            for &out in &info.outputs {
                let mut refs = refs_of[out.0 as usize];
                if recompute && hold_output && op + 1 == range.end {
                    // Released by the caller when the layer's backward starts.
                    refs += 1;
                }
                if !recompute {
                    let t = tape.tensor(out);
                    if t.held_until_forward_end {
                        refs += 1;
                    }
                    if tape.loss == Some(out) {
                        refs += 1;
                    }
                    if self.ckpt_input[out.0 as usize] {
                        refs += 1;
                    }
                    // Kept by a checkpointed layer's forward for its recompute.
                    if kept[out.0 as usize] && !counts_saves(op) {
                        refs += 1;
                    }
                }
                self.alloc(out, refs);
                if recompute && kept[out.0 as usize] {
                    // The recompute takes the kept tensor (alive: `alloc` added its uses),
                    // and the forward's reference ends.
                    self.release(out);
                }
            }
            let ws = info.fwd_workspace;
            let mut extra = [0u64; Category::COUNT];
            extra[Category::Workspace as usize] = ws;
            self.add_workspace(ws, &info.workspace_buffers);
            let engine = if recompute {
                info.engine.recompute
            } else {
                info.engine.forward
            };
            EngineScratch::add_to(engine, &mut extra);
            self.add_scratch(engine[0] + engine[1]);
            // A recomputed layer's ops are forward ops (so the timeline shows them as such,
            // inside the backward); a peak there is reported as the backward's.
            self.observe_at(Phase::Forward, recompute, info.name, info.layer, extra);
            self.end_scratch();
            for &inp in info.inputs.iter().chain(&info.holds) {
                if tape
                    .tensor(inp)
                    .producer
                    .is_some_and(|p| (p.0 as usize) < range.start)
                    && recompute
                {
                    // Produced outside the recomputed layer: its uses there were not counted.
                    continue;
                }
                self.release(inp);
            }
            for &out in &info.outputs {
                let i = out.0 as usize;
                if self.alive[i] && self.refs[i] == 0 {
                    self.alive[i] = false;
                    let c = self.category(out) as usize;
                    self.live[c] -= tape.tensor(out).bytes;
                    self.event_free(Buffer::Tensor(out));
                }
            }
            let layer_end = tape
                .layer_of_op(op)
                .is_some_and(|l| op + 1 == l.end_op as usize);
            if layer_end {
                let (phase, name) = if recompute {
                    (Phase::Backward, "recompute")
                } else {
                    (Phase::Forward, "output")
                };
                let prefetched = self.prefetch_after(op, recompute);
                self.boundary_with(phase, name, info.layer, prefetched);
            }
        }
    }

    fn backward_op(&mut self, op: usize) {
        let tape = self.tape;
        let info = &tape.ops[op];
        if !info.has_backward(tape) {
            return;
        }
        let mut extra = [0u64; Category::COUNT];
        let mut new_bufs: Vec<TensorId> = Vec::new();
        let mut seen: Vec<TensorId> = Vec::new();
        for &inp in &info.inputs {
            let t = tape.tensor(inp);
            if !t.requires_grad || seen.contains(&inp) {
                continue;
            }
            seen.push(inp);
            let i = inp.0 as usize;
            if t.role == Role::Param && self.persistent.unit_grads {
                if self.unit_grad[i] {
                    extra[Category::ActivationGrads as usize] += t.grad_bytes;
                    self.add_scratch(t.grad_bytes);
                } else {
                    self.unit_grad[i] = true;
                    self.unit_grad_bytes += t.grad_bytes;
                    self.live[Category::Grads as usize] += t.grad_bytes;
                    self.event_alloc(Buffer::Grad(inp), t.grad_bytes);
                }
            } else if let Some(at) = self.steps_later(i, op) {
                // The step in the backward comes at a later op: the gradient waits whole.
                self.param_grad[i] = true;
                self.live[Category::Grads as usize] += t.grad_bytes;
                self.event_alloc(Buffer::Grad(inp), t.grad_bytes);
                self.waiting.push((at, i as u32));
            } else if t.role == Role::Param {
                let g = t.grad_bytes / self.persistent.grad_divisor.max(1);
                if self.param_grad[i] || self.persistent.grads_exist {
                    // A new gradient added in place into the existing `.grad`.
                    extra[Category::ActivationGrads as usize] += t.grad_bytes;
                    self.add_scratch(t.grad_bytes);
                } else {
                    self.param_grad[i] = true;
                    self.live[Category::Grads as usize] += g;
                    self.event_alloc(Buffer::Grad(inp), g);
                    if g < t.grad_bytes {
                        // Full gradient exists until reduce-scattered.
                        extra[Category::ActivationGrads as usize] += t.grad_bytes - g;
                        self.add_scratch(t.grad_bytes - g);
                    }
                }
            } else if self.grad_alive[i] {
                extra[Category::ActivationGrads as usize] += t.bytes;
                self.add_scratch(t.bytes);
            } else {
                new_bufs.push(inp);
            }
        }
        for &b in &new_bufs {
            self.grad_alive[b.0 as usize] = true;
            self.live[Category::ActivationGrads as usize] += tape.tensor(b).bytes;
            self.event_alloc(Buffer::Grad(b), tape.tensor(b).bytes);
        }
        extra[Category::Workspace as usize] += info.bwd_workspace;
        self.add_workspace(info.bwd_workspace, &info.workspace_buffers);
        EngineScratch::add_to(info.engine.backward, &mut extra);
        self.add_scratch(info.engine.backward[0] + info.engine.backward[1]);
        self.observe(Phase::Backward, info.name, info.layer, extra);
        self.end_scratch();
        self.step_waiting(op);
        // The op's output gradients are consumed; its saved tensors released.
        for &out in &info.outputs {
            let i = out.0 as usize;
            if self.grad_alive[i] {
                self.grad_alive[i] = false;
                self.live[Category::ActivationGrads as usize] -= tape.tensor(out).bytes;
                self.event_free(Buffer::Grad(out));
            }
        }
        for &s in &info.saved {
            self.release(s);
        }
    }

    /// `step_at`: the op at which parameter `i`, whose first gradient comes at `op`, steps,
    /// when that is a later op of the backward (a lower index).
    fn steps_later(&self, i: usize, op: usize) -> Option<u32> {
        let at = *self.persistent.step_at.get(i)?;
        (at != u32::MAX && (at as usize) < op && !self.param_grad[i]).then_some(at)
    }

    /// The parameters that step after `op`'s backward: their waiting gradients are freed.
    fn step_waiting(&mut self, op: usize) {
        let tape = self.tape;
        let mut i = 0;
        while i < self.waiting.len() {
            let (at, t) = self.waiting[i];
            if at as usize == op {
                self.waiting.swap_remove(i);
                self.live[Category::Grads as usize] -= tape.tensors[t as usize].grad_bytes;
                self.event_free(Buffer::Grad(TensorId(t)));
            } else {
                i += 1;
            }
        }
    }

    /// The backward leaves a unit (`unit_grads`): its gradients are reduce-scattered into
    /// the accumulator and freed.
    fn leave_unit(&mut self) {
        if self.unit_grad_bytes == 0 {
            return;
        }
        self.live[Category::Grads as usize] -= self.unit_grad_bytes;
        self.unit_grad_bytes = 0;
        for i in 0..self.unit_grad.len() {
            if std::mem::take(&mut self.unit_grad[i]) {
                self.event_free(Buffer::Grad(TensorId(i as u32)));
            }
        }
    }
}

/// The result of walking one micro-step (forward + backward) of a tape.
pub struct WalkResult {
    pub peak: Peak,
    /// Live bytes per category when the forward has returned.
    pub forward_end: Bytes,
    pub samples: Vec<Sample>,
    /// Live bytes per category after the backward.
    pub end: Bytes,
    /// The highest live bytes at segment boundaries (after each layer's forward, the loss,
    /// each layer's backward): what an executor sampling between segments measures.
    pub boundary_peak: Peak,
}

/// Walk one micro-step of `tape` on top of `persistent` bytes.
pub fn walk(tape: &Tape, persistent: &Persistent, record: bool) -> WalkResult {
    walk_inner(tape, persistent, record, None)
}

/// [`walk`], and every allocation and release it makes, in order. The parameters and step
/// inputs come first (they exist before the forward); the parameters are never freed, nor
/// are the parameters' gradients (the optimizer step consumes them).
pub fn walk_traced(tape: &Tape, persistent: &Persistent) -> (WalkResult, Vec<Event>) {
    let mut events = Vec::new();
    let r = walk_inner(tape, persistent, false, Some(&mut events));
    (r, events)
}

fn walk_inner(
    tape: &Tape,
    persistent: &Persistent,
    record: bool,
    trace: Option<&mut Vec<Event>>,
) -> WalkResult {
    let n = tape.tensors.len();
    let mut w = Walk {
        tape,
        refs: vec![0; n],
        alive: vec![false; n],
        grad_alive: vec![false; n],
        param_grad: vec![false; n],
        live: persistent.fixed,
        peak: None,
        samples: Vec::new(),
        record,
        persistent,
        ckpt_input: vec![false; n],
        boundary_peak: None,
        unit_grad: vec![false; n],
        unit_grad_bytes: 0,
        unit_of: vec![usize::MAX; tape.ops.len()],
        waiting: Vec::new(),
        events: trace.as_ref().map(|_| Vec::new()),
        scratch: Vec::new(),
        scratch_count: 0,
    };
    // The unit each op belongs to (units cover the tape when there are any).
    for (u, span) in tape.units.iter().enumerate() {
        for o in span.first_op as usize..(span.end_op as usize).min(tape.ops.len()) {
            w.unit_of[o] = u;
        }
    }
    let mut unit_now = usize::MAX;
    for l in &tape.layers {
        if l.checkpointed && !l.offloaded {
            w.ckpt_input[l.input.0 as usize] = true;
        }
    }
    // Parameters and step inputs exist before the forward.
    for (i, t) in tape.tensors.iter().enumerate() {
        if t.producer.is_none() {
            w.alloc(TensorId(i as u32), 1);
        }
    }
    if persistent.grads_exist {
        w.live[Category::Grads as usize] += persistent.unit_grad_acc;
    }
    if persistent.grads_exist && !persistent.unit_grads {
        for (i, t) in tape.tensors.iter().enumerate() {
            if t.role == Role::Param && t.grad_bytes > 0 {
                w.param_grad[i] = true;
                w.live[Category::Grads as usize] += t.grad_bytes / persistent.grad_divisor.max(1);
            }
        }
    }
    w.forward_ops(0..tape.ops.len(), false, false);
    w.boundary(Phase::Forward, "loss", None);
    // The forward returns: autocast's cache is cleared, the model outputs are dropped.
    for (i, t) in tape.tensors.iter().enumerate() {
        if t.held_until_forward_end && w.alive[i] {
            w.release(TensorId(i as u32));
        }
    }
    w.observe(Phase::Forward, "forward end", None, [0; Category::COUNT]);
    let forward_end = w.live;
    if !persistent.grads_exist {
        w.live[Category::Grads as usize] += persistent.unit_grad_acc;
    }
    // Backward: the loss gradient is a scalar; ops in reverse.
    let mut op = tape.ops.len();
    while op > 0 {
        op -= 1;
        if w.unit_of[op] != unit_now {
            w.leave_unit();
            unit_now = w.unit_of[op];
        }
        if tape
            .layer_of_op(op)
            .is_some_and(|l| op + 1 == l.end_op as usize)
        {
            // The ops after this layer (the head, or the next layer) have run backward.
            let prefetched = w.prefetch_after(op + 1, true);
            w.boundary_with(
                Phase::Backward,
                "backward",
                tape.ops[op].layer.map(|l| l + 1),
                prefetched,
            );
        }
        if let Some(span) = tape
            .layer_of_op(op)
            .filter(|l| l.checkpointed && op + 1 == l.end_op as usize)
        {
            let span = span.clone();
            if span.offloaded {
                // Uploaded from the host right before the recompute that reads it.
                w.alloc(span.input, 1);
            }
            // Non-reentrant checkpoint: the layer's saved tensors are recomputed from its input
            // (and the saves of tensors made before the layer count again).
            for o in span.first_op as usize..span.end_op as usize {
                let info = &tape.ops[o];
                if !info.has_backward(tape) {
                    continue;
                }
                for &s in &info.saved {
                    let p = tape.tensor(s).producer.map_or(0, |p| p.0);
                    if p < span.first_op && w.alive[s.0 as usize] {
                        w.refs[s.0 as usize] += 1;
                    }
                }
            }
            let hold = persistent.recompute_holds_output;
            w.forward_ops(span.first_op as usize..span.end_op as usize, true, hold);
            if hold {
                for &out in &tape.ops[span.end_op as usize - 1].outputs {
                    w.release(out);
                }
            }
            for o in (span.first_op as usize..span.end_op as usize).rev() {
                w.backward_op(o);
            }
            w.release(span.input);
            op = span.first_op as usize;
            continue;
        }
        w.backward_op(op);
    }
    if let Some(l) = tape.loss {
        w.release(l);
    }
    w.leave_unit();
    w.observe(Phase::Backward, "backward end", None, [0; Category::COUNT]);
    w.boundary(Phase::Backward, "backward end", None);
    let end = w.live;
    let peak = w.peak.unwrap_or(Peak {
        bytes: 0,
        phase: Phase::Forward,
        op: String::new(),
        layer: None,
        by_category: [0; Category::COUNT],
    });
    let boundary_peak = w.boundary_peak.clone().unwrap_or_else(|| peak.clone());
    if let (Some(out), Some(events)) = (trace, w.events.take()) {
        *out = events;
    }
    WalkResult {
        peak,
        forward_end,
        samples: w.samples,
        end,
        boundary_peak,
    }
}
