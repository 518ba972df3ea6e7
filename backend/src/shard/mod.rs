//! ZeRO stages 1 and 2, and the optimizer on the host, over the
//! data-parallel ranks that exist (`--devices` threads, `--nodes`
//! processes, or both).
//!
//! The trainable parameters' gradients are flattened into one fp32 vector in
//! the model's visit order (the same on every rank, as `mean_step`), padded
//! with fewer than `ranks` zeros to `ranks × shard`. Rank `r` owns shard
//! `index(r)` (burn-collective's numbering, `Collective::shard_index`):
//! - stages 1 and 2: the gradient is reduce-scattered (mean); each rank
//!   receives only its shard (the loss is averaged by a separate
//!   `ranks`-element all-reduce). The stages differ in what the compiler
//!   plans around them, not here: Burn's `GradientsParams` holds the whole
//!   accumulated gradient until the step under both, and stage 1's
//!   all-reduce would only add a full-size result nobody reads.
//!
//! Then each rank steps its shard of the fp32 weights (its own copy, the
//! master of its shard, cut from each unit's fp32 values as the start-up
//! builds it: `Builder`) with its shard of the optimizer state (`crate::optim::FlatOptim`), the updated
//! shards are all-gathered, and the full vector is written back into the
//! model's trainable parameters (cast to their dtype). With
//! `offload = [optimizer]` the state, the fp32 master shard and the update
//! live in host memory: the gradient shard comes down, the updated shard
//! goes up for the all-gather.
//! Stage 0 with the optimizer offloaded is the same with one shard: the mean
//! gradient is all-reduced and every rank steps all of it on the host.
//!
//! With 16-bit weights and an fp32 master (`precision { params = bf16,
//! master = fp32 }`) the rank keeps the 16-bit working weights the forward
//! reads, and of the fp32 master only this shard: the units are built in
//! fp32, the shard's values cut from each, and the unit cast to 16 bits
//! before the next is made. The gradients of the 16-bit weights are cast to
//! fp32 as they are accumulated; the updated shards are all-gathered in
//! fp32 and written into the 16-bit weights. A checkpoint keeps the master
//! shard beside the optimizer shard (the 16-bit weights do not give it
//! back): `checkpoint`.
//!
//! ZeRO-3 and parameter offload shard the weights themselves and stream
//! them per unit: `zero3`.

pub mod checkpoint;
pub mod layout;
#[cfg(test)]
pub(crate) mod tests_memory;
pub mod zero3;

use crate::distributed::Collective;
use crate::loss_scale::{may_step, scaled_check};
use crate::optim::{FlatOptim, Place, Rule};
use crate::RunError;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{FloatDType, Tensor};

/// What a rank's sharded optimizer step needs between steps.
pub struct Zero<I: Backend> {
    stage: u8,
    /// Ranks the state is sharded over (1 for stage 0).
    shards: usize,
    /// This rank's shard.
    index: usize,
    /// Trainable parameter values (before padding).
    len: usize,
    /// Values per shard.
    shard: usize,
    /// This rank's shard of the fp32 weights, after the last update: on the
    /// device, or in host memory beside the offloaded optimizer state.
    master: Option<Master<I>>,
    optim: FlatOptim<I>,
    /// The weights' dtype: 16-bit ones do not give the master back.
    storage: FloatDType,
}

enum Master<I: Backend> {
    Device(Tensor<I, 1>),
    Host(Vec<f32>),
}

/// This rank's place among the data-parallel ranks: (ranks, its shard index, ranks in
/// this process); one rank of one without a collective.
pub(crate) fn rank_place<I: Backend>(
    collective: Option<&Collective<I>>,
) -> Result<(usize, usize, usize), RunError> {
    Ok(match collective {
        Some(c) => (
            c.ranks() as usize,
            c.shard_index()?,
            c.local_ranks() as usize,
        ),
        None => (1, 0, 1),
    })
}

/// Host threads for the offloaded update: the machine's cores shared by the
/// ranks of this process.
pub fn host_threads(local_ranks: usize) -> usize {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    (cores / local_ranks.max(1)).max(1)
}

impl<I: Backend> Zero<I> {
    /// `ranks`: data-parallel ranks of the run; `index`: this rank's shard;
    /// `len`: trainable parameter values; `host`: the optimizer is
    /// offloaded, its update over this many host threads.
    pub fn new(
        stage: u8,
        rule: Rule,
        ranks: usize,
        index: usize,
        len: usize,
        host: Option<usize>,
        storage: FloatDType,
    ) -> Result<Self, RunError> {
        if stage > 2 {
            return Err(RunError::Unsupported(format!(
                "ZeRO stage {stage} is not executed (stages 0, 1 and 2 are)"
            )));
        }
        let shards = if stage == 0 { 1 } else { ranks.max(1) };
        let index = if stage == 0 { 0 } else { index };
        if index >= shards {
            return Err(RunError::Collective(format!(
                "shard {index} of {shards}: burn-collective numbered this rank outside the run"
            )));
        }
        let shard = len.div_ceil(shards);
        let place = match host {
            Some(threads) => Place::Host { threads },
            None => Place::Device,
        };
        Ok(Zero {
            stage,
            shards,
            index,
            len,
            shard,
            master: None,
            optim: FlatOptim::new(rule, place, shard),
            storage,
        })
    }

    pub fn stage(&self) -> u8 {
        self.stage
    }

    /// Host bytes this rank's offloaded step holds at its peak: the
    /// optimizer state, and the weight and gradient shards brought down for
    /// the update (0 without offload).
    pub fn host_bytes(&self) -> u64 {
        match self.optim.place() {
            Place::Host { .. } => flat_host_bytes(self.optim.rule().state_per_param(), self.shard),
            Place::Device => 0,
        }
    }

    /// Values in this rank's shard.
    pub fn shard_len(&self) -> usize {
        self.shard
    }

    pub fn index(&self) -> usize {
        self.index
    }

    /// Ranks the optimizer state is sharded over (1 for stage 0).
    pub fn shards(&self) -> usize {
        self.shards
    }

    pub fn optimizer(&self) -> &FlatOptim<I> {
        &self.optim
    }

    pub fn optimizer_mut(&mut self) -> &mut FlatOptim<I> {
        &mut self.optim
    }

    /// Forget the master shard (after the model was replaced, e.g. by a
    /// resume): the next step takes it from fp32 weights again; 16-bit ones
    /// need `load_master_state`.
    pub fn reset_master(&mut self) {
        self.master = None;
    }

    /// Whether the master shard holds more than the weights give back
    /// (16-bit weights): a checkpoint then keeps it (`checkpoint`).
    pub fn master_kept(&self) -> bool {
        self.storage != FloatDType::F32
    }

    /// The fp32 master shard when `master_kept`.
    pub fn master_state(&self) -> Result<Option<Vec<f32>>, RunError> {
        if !self.master_kept() {
            return Ok(None);
        }
        match &self.master {
            Some(Master::Device(t)) => Ok(Some(crate::optim::to_host(t.clone())?)),
            Some(Master::Host(v)) => Ok(Some(v.clone())),
            None => Err(RunError::Checkpoint(
                "the fp32 master shard is missing (16-bit weights cannot give it back)".into(),
            )),
        }
    }

    /// Restore the master shard written by `master_state`.
    pub fn load_master_state(
        &mut self,
        values: Vec<f32>,
        device: &burn::tensor::Device<I>,
    ) -> Result<(), RunError> {
        if values.len() != self.shard {
            return Err(RunError::Checkpoint(format!(
                "the fp32 master shard holds {} values, this rank's shard {}: \
                 resume with the plan, ZeRO stage and rank count it was saved with",
                values.len(),
                self.shard
            )));
        }
        self.master = Some(match self.optim.place() {
            Place::Device => Master::Device(Tensor::from_data(
                burn::tensor::TensorData::new(values, [self.shard]),
                device,
            )),
            Place::Host { .. } => Master::Host(values),
        });
        Ok(())
    }

    /// One optimizer step of `model` with the gradients in `grads` (this
    /// rank's, summed over its micro-batches) and this rank's `loss`;
    /// returns the updated model and the loss averaged over the ranks.
    /// `probe` is sampled where the exchange holds the most: a probe that
    /// reads the bytes in use at sample points (CUDA) would miss those
    /// transients between the backward's last sample and the optimizer's.
    /// With `unscale` (fp16's 1 / loss scale) the optimizer multiplies the
    /// reduced gradient by it, and where any rank's shard is not finite no
    /// rank steps: the model comes back as it went in, and `false` says so.
    #[allow(clippy::too_many_arguments)]
    pub fn step<B, M>(
        &mut self,
        collective: Option<&Collective<I>>,
        lr: f64,
        model: M,
        grads: &mut GradientsParams,
        loss: Tensor<I, 1>,
        unscale: Option<f64>,
        probe: &mut dyn crate::memory::MemoryProbe,
    ) -> Result<(M, Tensor<I, 1>, bool), RunError>
    where
        B: AutodiffBackend<InnerBackend = I>,
        M: Module<B>,
    {
        let device = loss.device();
        let padded = self.shard * self.shards;
        let range = self.index * self.shard..(self.index + 1) * self.shard;
        let loss = loss.cast(FloatDType::F32);
        // One concatenation builds the whole exchanged vector: the gradients,
        // the padding to `shards × shard`, and (stage 0's all-reduce, as
        // `mean_step`) the loss slot. Concatenating again would copy the
        // full vector once more while the first one is alive.
        let loss_rides = collective.is_some() && self.shards == 1;
        let mut tail = Vec::new();
        if padded > self.len {
            tail.push(Tensor::zeros([padded - self.len], &device));
        }
        if loss_rides {
            tail.push(loss.clone());
        }
        let flat = flat_grads_then::<B, M>(&model, grads, tail, &device);
        let extra = padded - self.len + usize::from(loss_rides);
        if flat.dims()[0] != self.len + extra {
            return Err(RunError::Backend(format!(
                "the model has {} trainable values, the sharded optimizer was built for {}",
                flat.dims()[0].saturating_sub(extra),
                self.len
            )));
        }
        sample(probe, "exchange: flat gradients");
        let (grad, loss, finite) = match collective {
            None => {
                let grad = flat.slice(range.clone());
                let finite = may_step(scaled_check(&grad, unscale));
                (grad, loss, finite)
            }
            Some(c) if loss_rides => {
                // The whole mean gradient is on every rank: each rank's check
                // agrees with the others' without an exchange.
                let all = c.mean(flat)?;
                let grad = all.clone().slice(range.clone());
                let finite = may_step(scaled_check(&grad, unscale));
                (grad, all.slice(padded..padded + 1), finite)
            }
            Some(c) => {
                // Stages 1 and 2 both reduce-scatter: the gradients are
                // summed over the micro-batches in Burn's `GradientsParams`
                // either way, and each rank steps only its shard, so the
                // all-reduce's full result (and its ring's second phase and
                // final concatenation) would be a full-size copy for nothing.
                let (grad, at) = c.reduce_scatter_mean(flat)?;
                if at != self.index {
                    return Err(RunError::Collective(format!(
                        "the reduce-scatter gave this rank shard {at}, it owns {}",
                        self.index
                    )));
                }
                // Each rank holds only its shard: whether all are finite
                // rides the loss's all-reduce (a NaN flag makes the mean NaN).
                let (loss, flag) = mean_loss_and_flag(c, loss, scaled_check(&grad, unscale))?;
                (grad, loss, may_step(flag))
            }
        };
        sample(probe, "exchange: reduced");
        if !finite {
            return Ok((model, loss, false));
        }
        let master = match self.master.take() {
            Some(m) => m,
            None if self.master_kept() => {
                return Err(RunError::Backend(
                    "the fp32 master shard is missing: 16-bit weights cannot give it back".into(),
                ))
            }
            None => {
                let mut all = flat_params::<B, M>(&model, &device);
                if padded > self.len {
                    all = Tensor::cat(vec![all, Tensor::zeros([padded - self.len], &device)], 0);
                }
                let shard = all.slice(range);
                match self.optim.place() {
                    Place::Device => Master::Device(shard),
                    Place::Host { .. } => Master::Host(crate::optim::to_host(shard)?),
                }
            }
        };
        let updated = match master {
            Master::Device(m) => {
                let updated = self.optim.step(lr, m, grad, unscale)?;
                self.master = Some(Master::Device(updated.clone()));
                updated
            }
            Master::Host(mut m) => {
                // Gradients down, the update on the host, the weights up.
                let updated = self.optim.step_host_master(lr, &mut m, grad, unscale)?;
                self.master = Some(Master::Host(m));
                updated
            }
        };
        let full = match collective {
            Some(c) if self.shards > 1 => c.all_gather(updated)?,
            _ => updated,
        };
        sample(probe, "exchange: gathered");
        let model = model.map(&mut WriteParams::<I> {
            flat: full.slice(0..self.len),
            at: 0,
        });
        Ok((model, loss, true))
    }
}

/// The loss averaged over the ranks and, with `flag`, the ranks' flags
/// summed in the same all-reduce: NaN on every rank where one rank's is.
pub(crate) fn mean_loss_and_flag<I: Backend>(
    c: &Collective<I>,
    loss: Tensor<I, 1>,
    flag: Option<Tensor<I, 1>>,
) -> Result<(Tensor<I, 1>, Option<Tensor<I, 1>>), RunError> {
    // A `ranks`-element vector at least: burn-collective's ring cannot reduce
    // a single value over several nodes.
    let ranks = c.ranks() as usize;
    let with_flag = flag.is_some();
    let one = match flag {
        Some(f) => Tensor::cat(vec![loss, f], 0),
        None => loss,
    };
    let mean = c.mean(one.repeat_dim(0, ranks))?;
    Ok((
        mean.clone().slice(0..1),
        with_flag.then(|| mean.slice(1..2)),
    ))
}

/// One memory sample at `at`, printed with `RCOA_MEMORY_TRACE=1` (every
/// step's: the trainer prints the second step's layer samples).
fn sample(probe: &mut dyn crate::memory::MemoryProbe, at: &'static str) {
    probe.at(&|| at.to_string());
    let v = probe.sample();
    if crate::memory::trace_on() {
        eprintln!("memory {at} {v}");
    }
}

/// The ZeRO stage a rank executes (0: Burn's optimizer on every rank).
pub fn executed_stage<I: Backend>(zero: Option<&Zero<I>>, zero3: Option<&zero3::Zero3<I>>) -> u8 {
    zero3
        .map(|z| z.stage())
        .or(zero.map(|z| z.stage()))
        .unwrap_or(0)
}

/// What a rank keeps in host memory, as a plan writes it (`optimizer:cpu`).
pub fn executed_offload<I: Backend>(
    zero: Option<&Zero<I>>,
    zero3: Option<&zero3::Zero3<I>>,
) -> Vec<String> {
    let mut out = Vec::new();
    let optim = zero3
        .map(|z| z.optimizer().place())
        .or(zero.map(|z| z.optimizer().place()));
    if let Some(Place::Host { .. }) = optim {
        out.push("optimizer:cpu".to_string());
    }
    if zero3.is_some_and(|z| z.params_on_host()) {
        out.push("params:cpu".to_string());
    }
    out
}

/// Host bytes of the flat sharded step with the optimizer on the host: the
/// state, the fp32 master shard and the gradient shard brought down for the
/// update (`shard` values each).
pub(crate) fn flat_host_bytes(state_per_param: usize, shard: usize) -> u64 {
    ((state_per_param + 2) * shard * 4) as u64
}

/// Builds a rank's `Zero` during the start-up (`crate::setup`): the fp32
/// master of its flat shard is cut from each unit as it is made (fp32 with
/// an fp32 master; the caller casts the unit to 16 bits afterwards), one
/// parameter at a time, into one buffer of the shard's size made at the
/// first unit. So neither the whole fp32 model nor a concatenation of
/// pieces exists. The shard's bounds come from the plan's parameter counts
/// (`layout::unit_values`), checked against the units at `finish`.
pub struct Builder<I: Backend> {
    zero: Zero<I>,
    /// This rank's range of the flat trainable vector (before padding).
    lo: usize,
    hi: usize,
    /// Trainable values of the units cut so far.
    at: usize,
    master: Option<Master<I>>,
    error: Option<RunError>,
}

impl<I: Backend> Builder<I> {
    /// `None` unless `plan` steps the flat sharded optimizer
    /// (`layout::flat_zero`).
    pub fn new(
        plan: &rcoa_compiler::lowered::LoweredPlan,
        storage: FloatDType,
        collective: Option<&Collective<I>>,
    ) -> Result<Option<Self>, RunError> {
        use rcoa_compiler::spec::{OffloadTo, OffloadWhat};
        if !layout::flat_zero(plan) {
            return Ok(None);
        }
        let host = plan
            .resolved
            .offload
            .iter()
            .any(|o| o.what == OffloadWhat::Optimizer && o.to == OffloadTo::Cpu);
        let (ranks, index, local) = rank_place(collective)?;
        let len = layout::unit_values(plan).iter().map(|u| u.trainable).sum();
        let zero = Zero::new(
            plan.resolved.zero,
            Rule::for_plan(plan)?,
            ranks,
            index,
            len,
            host.then(|| host_threads(local)),
            storage,
        )?;
        let lo = (zero.index * zero.shard).min(len);
        let hi = ((zero.index + 1) * zero.shard).min(len);
        Ok(Some(Builder {
            zero,
            lo,
            hi,
            at: 0,
            master: None,
            error: None,
        }))
    }

    /// The next unit (embedding, each layer, head), its values those the
    /// master starts from: this rank's part of its trainable values.
    pub fn add<B: AutodiffBackend<InnerBackend = I>, M: Module<B>>(
        &mut self,
        unit: &M,
    ) -> Result<(), RunError> {
        struct Cut<'a, I: Backend> {
            b: &'a mut Builder<I>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Cut<'_, B::InnerBackend> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let b = &mut *self.b;
                if b.error.is_some() {
                    return;
                }
                let t = param.val().inner();
                let device = t.device();
                let shard = b.zero.shard;
                // Made at the first parameter, also when none falls in this
                // rank's range: the step finds the master there.
                let master = b.master.get_or_insert_with(|| match b.zero.optim.place() {
                    Place::Device => Master::Device(Tensor::zeros([shard], &device)),
                    Place::Host { .. } => Master::Host(vec![0.0; shard]),
                });
                if !param.is_require_grad() {
                    return;
                }
                let n = param.shape().num_elements();
                let (at, lo, hi) = (b.at, b.lo, b.hi);
                b.at += n;
                let (from, to) = (lo.max(at), hi.min(at + n));
                if from >= to {
                    return;
                }
                let part = crate::model::to_dtype(t, FloatDType::F32)
                    .flatten::<1>(0, D - 1)
                    .slice(from - at..to - at);
                match master {
                    Master::Device(m) => {
                        // In place: the buffer is this builder's alone.
                        let whole = std::mem::replace(m, Tensor::zeros([0], &device));
                        *m = whole.slice_assign(from - lo..to - lo, part);
                    }
                    Master::Host(v) => match crate::optim::to_host(part) {
                        Ok(h) => v[from - lo..to - lo].copy_from_slice(&h),
                        Err(e) => b.error = Some(e),
                    },
                }
            }
        }
        unit.visit(&mut Cut { b: self });
        match self.error.take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// The rank's sharded optimizer once every unit was added.
    pub fn finish(mut self) -> Result<Zero<I>, RunError> {
        if self.at != self.zero.len {
            return Err(RunError::Backend(format!(
                "the model's units have {} trainable values, the plan's shapes give {}: \
                 the flat shards would be cut at the wrong places",
                self.at, self.zero.len
            )));
        }
        self.zero.master = self.master.take();
        Ok(self.zero)
    }
}

/// The trainable parameters' values, fp32, in visit order.
pub fn flat_params<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Tensor<B::InnerBackend, 1> {
    struct Values<I: Backend>(Vec<Tensor<I, 1>>);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Values<B::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.is_require_grad() {
                let t = param.val().inner().cast(FloatDType::F32);
                self.0.push(t.flatten(0, D - 1));
            }
        }
    }
    let mut v = Values(Vec::new());
    model.visit(&mut v);
    cat_or_empty(v.0, device)
}

/// The trainable parameters' gradients, fp32, in visit order, taken out of
/// `grads` (zeros for a parameter without one).
pub(crate) fn flat_grads<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    grads: &mut GradientsParams,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Tensor<B::InnerBackend, 1> {
    flat_grads_then::<B, M>(model, grads, Vec::new(), device)
}

/// `flat_grads` with `tail` appended: one buffer of the whole length, each
/// gradient written into it (in place: the buffer is this call's alone) and
/// dropped before the next is taken out of `grads`. A concatenation would
/// hold every part and the result at once, and ndarray's makes one more
/// full-size copy besides.
pub(crate) fn flat_grads_then<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    grads: &mut GradientsParams,
    tail: Vec<Tensor<B::InnerBackend, 1>>,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Tensor<B::InnerBackend, 1> {
    struct Count(usize);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.is_require_grad() {
                self.0 += param.shape().num_elements();
            }
        }
    }
    struct Write<'a, I: Backend> {
        grads: &'a mut GradientsParams,
        flat: Tensor<I, 1>,
        at: usize,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Write<'_, B::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !param.is_require_grad() {
                return;
            }
            let n = param.shape().num_elements();
            // A parameter without a gradient keeps the buffer's zeros.
            if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
                let part = g.cast(FloatDType::F32).flatten::<1>(0, D - 1);
                let whole = std::mem::replace(&mut self.flat, Tensor::empty([0], &part.device()));
                self.flat = whole.slice_assign(self.at..self.at + n, part);
            }
            self.at += n;
        }
    }
    let mut count = Count(0);
    model.visit(&mut count);
    let len = count.0;
    let total = len + tail.iter().map(|t| t.dims()[0]).sum::<usize>();
    let mut w = Write {
        grads,
        flat: Tensor::zeros([total], device),
        at: 0,
    };
    model.visit(&mut w);
    let mut flat = w.flat;
    let mut at = len;
    for t in tail {
        let n = t.dims()[0];
        flat = flat.slice_assign(at..at + n, t);
        at += n;
    }
    flat
}

/// `parts` end to end. One part is returned as it is: Burn's `cat` of a
/// single tensor still allocates the output and copies into it, and on
/// CUDA that copy of a unit's weights, kept from its forward to its
/// backward, was 7 % of a ZeRO-2 gradient-offload rank's peak (H200,
/// 2026-11-27: the model's whole bf16 weights a second time).
pub(crate) fn cat_or_empty<I: Backend>(
    mut parts: Vec<Tensor<I, 1>>,
    device: &burn::tensor::Device<I>,
) -> Tensor<I, 1> {
    match parts.len() {
        0 => Tensor::zeros([0], device),
        1 => parts.pop().expect("one part"),
        _ => Tensor::cat(parts, 0),
    }
}

/// Writes `flat` back into the trainable parameters, in visit order, in
/// each parameter's shape and dtype (ids and trainability kept).
struct WriteParams<I: Backend> {
    flat: Tensor<I, 1>,
    at: usize,
}

impl<B: AutodiffBackend> ModuleMapper<B> for WriteParams<B::InnerBackend> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if !param.is_require_grad() {
            return param;
        }
        let (id, t, _) = param.consume();
        let shape = t.shape();
        let dtype = t.dtype();
        let n = shape.num_elements();
        let part = self.flat.clone().slice(self.at..self.at + n).reshape(shape);
        self.at += n;
        let part = crate::model::to_dtype(part, dtype.into());
        Param::initialized(id, Tensor::from_inner(part).set_require_grad(true))
    }
}
