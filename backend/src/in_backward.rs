//! `optimizer { in_backward = true }` on one rank (torchtune's
//! `optimizer_in_bwd`): no whole set of gradients exists. The step's
//! backward leaves the units (the head, the layers last first, the
//! embedding) one at a time (`train::UnitHooks`); as it leaves a unit, every
//! trainable parameter of the unit is stepped, one parameter at a time, and
//! its gradient dropped. At any moment the device holds the gradients of the
//! unit whose backward runs and one parameter's step temporaries, where the
//! step after the backward holds every gradient at once.
//!
//! Each parameter is stepped by the run's own optimizer (Burn's adaptor over
//! the whole model, handed that parameter's gradient alone): the update is
//! the one the step after the backward makes, bit for bit (tested), and
//! checkpoints are the same records.
//!
//! **Tied embeddings.** The head's backward gives the embedding matrix a
//! gradient that is not complete until the embedding's own backward, the
//! last of the step: it waits there in its own dtype, and the embedding
//! steps on the sum of both parts, each cast to fp32 first for a master, as
//! the step after the backward adds them.
//!
//! **16-bit weights with an fp32 master.** The master is stepped, each
//! gradient cast to fp32 right before its parameter's step. The unit's
//! 16-bit working copy is freed before the master steps and cast again from
//! it after, so the next forward reads the new weights and no unit is held
//! twice.
//!
//! **Data parallelism** (DDP's `_apply_optimizer_in_backward`): each unit's
//! gradients are averaged over the ranks, one all-reduce of the unit's flat
//! vector, before the unit steps; every rank then makes the same update.
//! The loss is averaged once the backward is done.
//!
//! What it does not do, refused by `rcoa_compiler::executed` where the plan
//! is compiled, and by its `check_lowered` in `Trainer::new` for any lowered
//! plan: ZeRO and the host optimizer (their shards step after the
//! backward), fp16 (its loss scale is checked over every gradient before
//! any step), and gradient accumulation (every backward is a step).

use crate::distributed::Collective;
use crate::model::{Embed, Model};
use crate::ops::ExecAutodiff;
use crate::shard::zero3::Placeholders;
use crate::train::{CastParams, MergeGrads, Optim, Unit, UnitHooks};
use crate::RunError;
use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{FloatDType, Tensor};

/// The hooks of one micro-batch that steps in its backward. They own the
/// model and the optimizer for the micro-batch (`Trainer` lends them and
/// takes them back).
pub(crate) struct InBackward<'a, B: ExecAutodiff> {
    /// The parameters the optimizer steps (the fp32 master with one); `None`
    /// only while a step has it.
    pub model: Option<Model<B>>,
    /// The 16-bit working copy the forward reads, with an fp32 master.
    pub work: Option<Model<B>>,
    pub optim: &'a mut Optim<B>,
    pub lr: f64,
    /// The working copy's storage dtype (its gradients are cast to fp32 for
    /// the master).
    pub params: FloatDType,
    /// The tied embedding's gradient from the head, until the embedding's own.
    pub pending: GradientsParams,
    /// Data parallelism: each unit's gradients are averaged over the ranks
    /// (one all-reduce of the unit's flat vector) before it steps.
    pub collective: Option<&'a Collective<B::InnerBackend>>,
    pub device: B::Device,
}

impl<B: ExecAutodiff> InBackward<'_, B> {
    fn reads(&self) -> &Model<B> {
        match &self.work {
            Some(w) => w,
            None => self
                .model
                .as_ref()
                .expect("the model is back after each step"),
        }
    }

    /// `grads` of the parameters of `unit` (a clone of a part of the working
    /// copy) as the steps that take them: with a master one [`Single`] per
    /// parameter, in the unit's visit order, each cast to fp32 only when its
    /// step runs. The clone is dropped here: held through the steps, it would
    /// keep every old weight of the unit beside its update.
    fn singles<M: AutodiffModule<B>>(&self, unit: M, mut grads: GradientsParams) -> Vec<Single> {
        if self.work.is_none() {
            // Nothing to cast: one step over the unit, whose update Burn's optimizer makes
            // a parameter at a time anyway, so it holds no more than one at a time would,
            // and the model is mapped once per unit, not once per parameter.
            drop(unit);
            return vec![Box::new(move || grads)];
        }
        let mut one_by_one = Singles {
            from: &mut grads,
            out: Vec::new(),
        };
        unit.visit(&mut one_by_one);
        one_by_one.out
    }

    /// `grads` of `unit`, averaged over the ranks with data parallelism: every
    /// rank reduces the same units in the same order (the backward's), and a
    /// unit without a trainable parameter on any rank reduces nothing.
    fn mean<M: AutodiffModule<B>>(
        &self,
        unit: &M,
        mut grads: GradientsParams,
    ) -> Result<GradientsParams, RunError> {
        let Some(c) = self.collective.filter(|_| !grads.is_empty()) else {
            return Ok(grads);
        };
        // `mean_step` carries a loss beside the gradients: a zero stands in (the
        // step's loss is averaged once, after the backward).
        let zero = Tensor::<B::InnerBackend, 1>::zeros([1], &self.device);
        c.mean_step::<B, M>(unit, &mut grads, zero, None)?;
        Ok(grads)
    }

    /// Steps each of `singles`, one parameter at a time.
    fn step(&mut self, singles: Vec<Single>) -> Result<(), RunError> {
        for single in singles {
            let model = self
                .model
                .take()
                .expect("the model is back after each step");
            let (model, stepped) = self.optim.step(self.lr, model, single());
            self.model = Some(model);
            stepped?;
        }
        Ok(())
    }

    /// With a master: the unit's working copy, whose gradients are out,
    /// gives its memory back before the master steps (placeholders take its
    /// place), and is cast again from the stepped master after.
    fn with_working_unit_released(
        &mut self,
        unit: Unit,
        step: impl FnOnce(&mut Self) -> Result<(), RunError>,
    ) -> Result<(), RunError> {
        if let Some(work) = &mut self.work {
            replace_unit(work, unit, None, self.params);
        }
        step(self)?;
        if let (Some(work), Some(master)) = (&mut self.work, &self.model) {
            replace_unit(work, unit, Some(master), self.params);
        }
        Ok(())
    }
}

/// `unit` of the working copy `work` cast again from the `master`'s, or
/// (`None`) made of placeholders.
fn replace_unit<B: ExecAutodiff>(
    work: &mut Model<B>,
    unit: Unit,
    master: Option<&Model<B>>,
    params: FloatDType,
) {
    fn put<B: ExecAutodiff, M: Module<B>>(part: &mut M, from: Option<&M>, params: FloatDType) {
        *part = match from {
            Some(m) => m.clone().map(&mut CastParams(params)),
            None => part.clone().map(&mut Placeholders),
        };
    }
    match unit {
        Unit::Embed => put(&mut work.embed, master.map(|m| &m.embed), params),
        Unit::Layer(i) => put(&mut work.layers[i], master.map(|m| &m.layers[i]), params),
        Unit::Head => put(&mut work.head, master.map(|m| &m.head), params),
    }
}

impl<B: ExecAutodiff> UnitHooks<B> for InBackward<'_, B> {
    type Error = RunError;

    fn embed(&mut self) -> Result<Embed<B>, RunError> {
        Ok(self.reads().embed.clone())
    }

    fn layer(&mut self, i: usize, _keep: bool) -> Result<crate::model::Layer<B>, RunError> {
        Ok(self.reads().layers[i].clone())
    }

    fn head(&mut self) -> Result<(crate::model::Head<B>, Embed<B>), RunError> {
        let m = self.reads();
        Ok((m.head.clone(), m.embed.clone()))
    }

    fn backward(&mut self, unit: Unit, mut grads: B::Gradients) -> Result<(), RunError> {
        let singles = match unit {
            Unit::Layer(i) => {
                let layer = self.reads().layers[i].clone();
                let g = GradientsParams::from_module(&mut grads, &layer);
                drop(grads);
                let g = self.mean(&layer, g)?;
                self.singles(layer, g)
            }
            Unit::Head => {
                let (head, embed) = {
                    let m = self.reads();
                    (m.head.clone(), m.embed.clone())
                };
                // Tied: the embedding matrix's part waits for the embedding's own.
                self.pending = GradientsParams::from_module(&mut grads, &embed);
                drop(embed);
                let g = GradientsParams::from_module(&mut grads, &head);
                drop(grads);
                let g = self.mean(&head, g)?;
                self.singles(head, g)
            }
            Unit::Embed => {
                let embed = self.reads().embed.clone();
                let mut own = GradientsParams::from_module(&mut grads, &embed);
                drop(grads);
                // The head's part, then the embedding's, each cast for a master first: as
                // the step after the backward adds them (`train::Whole`), bit for bit.
                let cast = self.work.is_some().then_some(FloatDType::F32);
                let mut g = GradientsParams::new();
                for from in [&mut self.pending, &mut own] {
                    embed.visit(&mut MergeGrads {
                        into: &mut g,
                        from,
                        cast,
                    });
                }
                let g = self.mean(&embed, g)?;
                self.singles(embed, g)
            }
        };
        self.with_working_unit_released(unit, |s| s.step(singles))
    }
}

/// One step's gradients, made into the `GradientsParams` it takes (a
/// parameter's cast to fp32 for the master) only when that step runs.
type Single = Box<dyn FnOnce() -> GradientsParams>;

/// Moves each gradient of `from` into its own [`Single`], cast to fp32 for
/// the master, in visit order.
struct Singles<'a> {
    from: &'a mut GradientsParams,
    out: Vec<Single>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Singles<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(g) = self.from.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        let id = param.id;
        self.out.push(Box::new(move || {
            let mut one = GradientsParams::new();
            one.register::<B::InnerBackend, D>(id, crate::model::to_dtype(g, FloatDType::F32));
            one
        }));
    }
}
