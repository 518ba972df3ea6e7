//! ZeRO stages 1 and 2, and the optimizer on the host, over the
//! data-parallel ranks that exist (`--devices` threads, `--nodes`
//! processes, or both).
//!
//! The trainable parameters' gradients are flattened into one fp32 vector in
//! the model's visit order (the same on every rank, as `mean_step`), padded
//! with fewer than `ranks` zeros to `ranks × shard`. Rank `r` owns shard
//! `index(r)` (burn-collective's numbering, `Collective::shard_index`):
//! - stage 1: the gradient is all-reduced (mean) whole; each rank keeps its
//!   shard of it;
//! - stage 2: the gradient is reduce-scattered (mean); each rank receives
//!   only its shard (the loss is averaged by a separate `ranks`-element
//!   all-reduce).
//!
//! Then each rank steps its shard of the fp32 weights (its own copy, the
//! master of its shard, taken from the model at the first step) with its
//! shard of the optimizer state (`crate::optim::FlatOptim`), the updated
//! shards are all-gathered, and the full vector is written back into the
//! model's trainable parameters (cast to their dtype). With
//! `offload = [optimizer]` the state, the fp32 master shard and the update
//! live in host memory: the gradient shard comes down, the updated shard
//! goes up for the all-gather.
//! Stage 0 with the optimizer offloaded is the same with one shard: the mean
//! gradient is all-reduced and every rank steps all of it on the host.
//!
//! ZeRO-3 and parameter offload shard the weights themselves and stream
//! them per unit: `zero3`. Here, with 16-bit weights and an fp32 master the
//! trainer still holds the whole fp32 model (its master); the optimizer
//! state is what is sharded.

pub mod checkpoint;
pub mod zero3;

use crate::distributed::Collective;
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
            Place::Host { .. } => {
                // State, the fp32 master shard and the gradient shard.
                let per = self.optim_rule_state() + 2;
                (per * self.shard * 4) as u64
            }
            Place::Device => 0,
        }
    }

    fn optim_rule_state(&self) -> usize {
        self.optim.rule().state_per_param()
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
    /// resume): the next step takes it from the model again.
    pub fn reset_master(&mut self) {
        self.master = None;
    }

    /// One optimizer step of `model` with the gradients in `grads` (this
    /// rank's, summed over its micro-batches) and this rank's `loss`;
    /// returns the updated model and the loss averaged over the ranks.
    pub fn step<B, M>(
        &mut self,
        collective: Option<&Collective<I>>,
        lr: f64,
        model: M,
        grads: &mut GradientsParams,
        loss: Tensor<I, 1>,
    ) -> Result<(M, Tensor<I, 1>), RunError>
    where
        B: AutodiffBackend<InnerBackend = I>,
        M: Module<B>,
    {
        let device = loss.device();
        let padded = self.shard * self.shards;
        let mut flat = flat_grads::<B, M>(&model, grads, &device);
        if flat.dims()[0] != self.len {
            return Err(RunError::Backend(format!(
                "the model has {} trainable values, the sharded optimizer was built for {}",
                flat.dims()[0],
                self.len
            )));
        }
        if padded > self.len {
            flat = Tensor::cat(vec![flat, Tensor::zeros([padded - self.len], &device)], 0);
        }
        let range = self.index * self.shard..(self.index + 1) * self.shard;
        let loss = loss.cast(FloatDType::F32);
        let (grad, loss) = match (collective, self.stage) {
            (None, _) => (flat.slice(range.clone()), loss),
            (Some(c), 0 | 1) => {
                // The loss rides along, as in `mean_step`.
                let all = c.mean(Tensor::cat(vec![flat, loss], 0))?;
                (
                    all.clone().slice(range.clone()),
                    all.slice(padded..padded + 1),
                )
            }
            (Some(c), _) => {
                let (grad, at) = c.reduce_scatter_mean(flat)?;
                if at != self.index {
                    return Err(RunError::Collective(format!(
                        "the reduce-scatter gave this rank shard {at}, it owns {}",
                        self.index
                    )));
                }
                // A `ranks`-element vector: burn-collective's ring cannot
                // reduce a single value over several nodes.
                let ranks = c.ranks() as usize;
                let losses = c.mean(loss.repeat_dim(0, ranks))?;
                (grad, losses.slice(0..1))
            }
        };
        let master = match self.master.take() {
            Some(m) => m,
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
                let updated = self.optim.step(lr, m, grad)?;
                self.master = Some(Master::Device(updated.clone()));
                updated
            }
            Master::Host(mut m) => {
                // Gradients down, the update on the host, the weights up.
                let updated = self.optim.step_host_master(lr, &mut m, grad)?;
                self.master = Some(Master::Host(m));
                updated
            }
        };
        let full = match collective {
            Some(c) if self.shards > 1 => c.all_gather(updated)?,
            _ => updated,
        };
        let model = model.map(&mut WriteParams::<I> {
            flat: full.slice(0..self.len),
            at: 0,
        });
        Ok((model, loss))
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

/// The sharded step `plan` asks for, or `None` for Burn's own optimizer
/// (ZeRO 0, nothing offloaded).
pub fn for_plan<B: AutodiffBackend, M: Module<B>>(
    plan: &rcoa_compiler::lowered::LoweredPlan,
    model: &M,
    collective: Option<&Collective<B::InnerBackend>>,
) -> Result<Option<Zero<B::InnerBackend>>, RunError> {
    use rcoa_compiler::spec::{OffloadTo, OffloadWhat};
    let r = &plan.resolved;
    let host = r
        .offload
        .iter()
        .any(|o| o.what == OffloadWhat::Optimizer && o.to == OffloadTo::Cpu);
    if (r.zero == 0 && !host) || zero3::wanted(plan) {
        // Whole weights on Burn's optimizer, or per-unit shards (`zero3`).
        return Ok(None);
    }
    let (ranks, index, local) = rank_place(collective)?;
    let rule = Rule::for_plan(plan)?;
    let threads = host.then(|| host_threads(local));
    let zero = Zero::new(
        r.zero,
        rule,
        ranks,
        index,
        trainable_len::<B, M>(model),
        threads,
    )?;
    if host {
        let need = zero.host_bytes() * local as u64;
        crate::check_host_memory(plan, need, crate::host_memory_available())?;
    }
    Ok(Some(zero))
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

/// Trainable parameter values of `model`.
pub fn trainable_len<B: AutodiffBackend, M: Module<B>>(model: &M) -> usize {
    struct Count(usize);
    impl<B: AutodiffBackend> ModuleVisitor<B> for Count {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.is_require_grad() {
                self.0 += param.shape().num_elements();
            }
        }
    }
    let mut c = Count(0);
    model.visit(&mut c);
    c.0
}

/// The trainable parameters' gradients, fp32, in visit order, taken out of
/// `grads` (zeros for a parameter without one).
pub(crate) fn flat_grads<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    grads: &mut GradientsParams,
    device: &burn::tensor::Device<B::InnerBackend>,
) -> Tensor<B::InnerBackend, 1> {
    struct Take<'a, I: Backend> {
        grads: &'a mut GradientsParams,
        parts: Vec<Tensor<I, 1>>,
        device: burn::tensor::Device<I>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Take<'_, B::InnerBackend> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !param.is_require_grad() {
                return;
            }
            let part = match self.grads.remove::<B::InnerBackend, D>(param.id) {
                Some(g) => g.cast(FloatDType::F32).flatten(0, D - 1),
                None => Tensor::zeros([param.shape().num_elements()], &self.device),
            };
            self.parts.push(part);
        }
    }
    let mut t = Take {
        grads,
        parts: Vec::new(),
        device: device.clone(),
    };
    model.visit(&mut t);
    cat_or_empty(t.parts, device)
}

pub(crate) fn cat_or_empty<I: Backend>(
    parts: Vec<Tensor<I, 1>>,
    device: &burn::tensor::Device<I>,
) -> Tensor<I, 1> {
    if parts.is_empty() {
        Tensor::zeros([0], device)
    } else {
        Tensor::cat(parts, 0)
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
