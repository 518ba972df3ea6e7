//! The training step, generic over one `B: ExecAutodiff` (`ops.rs`).
//!
//! **Per-layer activation checkpointing by segment recomputation.** Burn 0.21
//! only offers one checkpointing strategy for the whole autodiff backend, but
//! the plan says per layer (`resolved.checkpoint_layers`). So the step cuts
//! the autodiff graph at every layer boundary:
//! - forward: the embedding runs with its graph; each layer's input becomes a
//!   fresh leaf. A non-checkpointed layer runs with its graph (kept until its
//!   backward). A checkpointed layer runs on the inner backend (no graph at
//!   all) and only its input is kept.
//! - the head and loss run with their graph from the last leaf, and
//!   `loss.backward()` yields the head's parameter gradients and the gradient
//!   `g` of the last hidden state.
//! - backward, last layer first: a checkpointed layer is recomputed from its
//!   kept input with the graph on; then `(y * g).sum().backward()` gives the
//!   layer's parameter gradients and the gradient of its input, the next `g`.
//!
//! The gradients equal those of one graph over the whole model (tested below
//! for none / all / alternate layers checkpointed).
//!
//! **Per-unit hooks** (`UnitHooks`): the step takes each unit's weights (the
//! embedding, each layer, the head) from its hooks right before the unit's
//! forward and recomputation, and hands them each unit's gradients as the
//! backward leaves it. `micro_step` uses the trainer's own model;
//! ZeRO-3 and parameter offload (`crate::shard::zero3`) gather and reduce
//! there.
//!
//! **Precision** (`Precision`): fp32; autocast (fp32 weights, 16-bit
//! compute: weights are cast per use, activations are 16-bit); 16-bit weights
//! with an fp32 master copy (the optimizer steps the fp32 master; the 16-bit
//! working copy is re-cast from it after every step and its 16-bit gradients
//! are cast to fp32 first); 16-bit weights without a master.
//!
//! **Dropout** masks are drawn from the backend RNG, re-seeded from (seed,
//! step, micro-batch, layer) before each layer and its recomputation, so a
//! recomputed layer sees the masks of its first forward.

use crate::data::{Batch, Batcher};
use crate::loss::{contrastive_loss, lm_loss, ContrastiveLayout, TAU};
use crate::loss_chunked::{chunked_lm_loss, DEFAULT_CHUNK};
use crate::loss_scale::{LossScaler, Outcome};
use crate::memory::MemoryProbe;
use crate::model::{Ctx, Embed, Head, Layer, Model};
use crate::ops::{ExecAutodiff, ExecBackend};
use crate::optim::adafactor::AdafactorOptimizer;
use crate::optim::adam8bit::Adam8bitOptimizer;
use crate::optim::adam_mini::AdamMiniOptimizer;
use crate::optim::lion::LionOptimizer;
use crate::RunError;
use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{
    Adam, AdamConfig, AdamW, AdamWConfig, GradientsParams, Optimizer, Sgd, SgdConfig,
};
use burn::record::{BinFileRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, FloatDType, Int, Tensor, TensorData};
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::{Dtype, Loss, OptimizerKind};
use std::path::Path;

// ---------------------------------------------------------------- precision

/// How parameters are stored and activations computed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Precision {
    /// Storage dtype of the parameters the forward reads.
    pub params: FloatDType,
    /// Dtype of matmuls and activations.
    pub compute: FloatDType,
    /// An fp32 master copy is stepped by the optimizer (only with 16-bit params).
    pub master: bool,
}

impl Precision {
    pub fn describe(&self) -> String {
        let n = |d: FloatDType| match d {
            FloatDType::BF16 => "bf16",
            FloatDType::F16 => "fp16",
            FloatDType::F64 => "fp64",
            _ => "fp32",
        };
        let mode = if self.master {
            "16-bit weights, fp32 master copy"
        } else if self.params == self.compute {
            "uniform"
        } else {
            "autocast: fp32 weights cast per use"
        };
        format!(
            "params {} compute {} ({mode})",
            n(self.params),
            n(self.compute)
        )
    }

    /// The precision this executor runs for `plan`. `sixteen_bit` says whether
    /// the backend computes in bf16/fp16 (the ndarray CPU backend does not:
    /// then everything runs in fp32 and `note` says so).
    pub fn for_plan(
        plan: &LoweredPlan,
        sixteen_bit: bool,
    ) -> Result<(Precision, Option<String>), RunError> {
        let p = &plan.precision;
        let map = |d: Dtype, what: &str| -> Result<FloatDType, RunError> {
            match d {
                Dtype::Fp32 | Dtype::Tf32 => Ok(FloatDType::F32),
                Dtype::Bf16 => Ok(FloatDType::BF16),
                Dtype::Fp16 => Ok(FloatDType::F16),
                other => Err(RunError::Unsupported(format!(
                    "precision {what} = {} is not executed by the Burn executor (fp32, tf32, bf16 and fp16 are)",
                    other.as_str()
                ))),
            }
        };
        let params = map(p.params, "params")?;
        let compute = map(p.compute, "compute")?;
        let wanted = Precision {
            params,
            compute,
            master: params != FloatDType::F32 && p.master == Some(Dtype::Fp32),
        };
        if !sixteen_bit && (params != FloatDType::F32 || compute != FloatDType::F32) {
            let note = format!(
                "this backend has no 16-bit floats: the plan's {} runs in fp32 here (memory and speed differ from the prediction)",
                wanted.describe()
            );
            return Ok((
                Precision {
                    params: FloatDType::F32,
                    compute: FloatDType::F32,
                    master: false,
                },
                Some(note),
            ));
        }
        if params == FloatDType::F16 && !wanted.master {
            // Their gradients would be fp16 when divided by the scale: what the scale kept
            // from flushing would flush there (PyTorch's GradScaler refuses to unscale them).
            return Err(RunError::Unsupported(FP16_WITHOUT_MASTER.into()));
        }
        let note = LossScaler::for_precision(&wanted).map(|s| {
            format!(
                "fp16 with dynamic loss scaling, as PyTorch's GradScaler: the loss is scaled by {} \
                 before the backward; a step whose gradients overflow is skipped and the scale halved, \
                 and it doubles after {} steps without one",
                s.scale(),
                crate::loss_scale::GROWTH_INTERVAL
            )
        });
        Ok((wanted, note))
    }
}

/// Why fp16 weights need an fp32 master here (`rcoa_compiler::executed` refuses such
/// plans for `target burn` with the same words).
pub const FP16_WITHOUT_MASTER: &str =
    "fp16 weights without an fp32 master (`params = fp16`, `master = none`): their \
     gradients would be fp16 when the loss scale is divided out, and flush to zero there; write \
     `master = fp32`, or `params = fp32` with `compute = fp16`";

/// Casts every float parameter to `dtype`, keeping ids and trainability.
pub(crate) struct CastParams(pub(crate) FloatDType);

impl<B: AutodiffBackend> ModuleMapper<B> for CastParams {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        cast_param(param, self.0, true)
    }
}

/// Casts the frozen parameters only: beside an fp32 master they are kept in
/// the 16-bit storage dtype, which the working copy shares (`crate::setup`).
struct CastFrozen(FloatDType);

impl<B: AutodiffBackend> ModuleMapper<B> for CastFrozen {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        cast_param(param, self.0, false)
    }
}

fn cast_param<B: AutodiffBackend, const D: usize>(
    param: Param<Tensor<B, D>>,
    dtype: FloatDType,
    trainable_too: bool,
) -> Param<Tensor<B, D>> {
    let (id, t, _) = param.consume();
    let trainable = t.is_require_grad();
    if trainable && !trainable_too {
        return Param::initialized(id, t);
    }
    let inner = crate::model::to_dtype(t.inner(), dtype);
    Param::initialized(id, Tensor::from_inner(inner).set_require_grad(trainable))
}

/// The micro-batches' summed loss, taken for a step's reduction.
fn summed_loss<I: Backend>(total: &mut Option<Tensor<I, 1>>) -> Result<Tensor<I, 1>, RunError> {
    total
        .take()
        .ok_or_else(|| RunError::Backend("a training step needs at least one micro-batch".into()))
}

/// Moves the gradients of `from` into `into`, adding where both have one,
/// and casting to `cast` (fp32 master gradients) when given.
pub(crate) struct MergeGrads<'a> {
    pub(crate) into: &'a mut GradientsParams,
    pub(crate) from: &'a mut GradientsParams,
    pub(crate) cast: Option<FloatDType>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for MergeGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(mut g) = self.from.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        if let Some(dt) = self.cast {
            g = crate::model::to_dtype(g, dt);
        }
        let g = match self.into.remove::<B::InnerBackend, D>(param.id) {
            Some(acc) => acc + g,
            None => g,
        };
        self.into.register::<B::InnerBackend, D>(param.id, g);
    }
}

// ---------------------------------------------------------------- optimizer

/// The optimizers Burn provides that the DSL names, and 8-bit Adam
/// (`optim::adam8bit`) through Burn's adaptor.
pub enum Optim<B: ExecAutodiff> {
    AdamW(OptimizerAdaptor<AdamW, Model<B>, B>),
    Adam(OptimizerAdaptor<Adam, Model<B>, B>),
    Sgd(OptimizerAdaptor<Sgd<B::InnerBackend>, Model<B>, B>),
    Adam8bit(OptimizerAdaptor<Adam8bitOptimizer, Model<B>, B>),
    Lion(OptimizerAdaptor<LionOptimizer, Model<B>, B>),
    Adafactor(OptimizerAdaptor<AdafactorOptimizer, Model<B>, B>),
    /// Each parameter's blocks are in its records before the first step
    /// ([`Optim::for_plan`]).
    AdamMini(OptimizerAdaptor<AdamMiniOptimizer, Model<B>, B>),
}

impl<B: ExecAutodiff> Optim<B> {
    /// An optimizer without state that holds `self`'s place while it is
    /// lent out (`std::mem::replace`).
    fn placeholder() -> Self {
        Optim::Sgd(SgdConfig::new().init())
    }

    /// The optimizer of `plan`, ready to step `model`: Adam-mini learns each
    /// parameter's blocks from its module path (`optim::adam_mini::blocks`), which
    /// Burn's adaptor does not hand a step.
    pub fn for_plan(plan: &LoweredPlan, model: &Model<B>) -> Result<Self, RunError> {
        let o = &plan.optimizer;
        let (b1, b2) = (o.betas.0 as f32, o.betas.1 as f32);
        // PyTorch's default epsilon, so runs compare with the ground truth.
        let eps = 1e-8;
        let decay = (o.weight_decay > 0.0).then_some(WeightDecayConfig {
            penalty: o.weight_decay as f32,
        });
        Ok(match o.kind {
            OptimizerKind::Adamw => Optim::AdamW(
                AdamWConfig::new()
                    .with_beta_1(b1)
                    .with_beta_2(b2)
                    .with_epsilon(eps)
                    .with_weight_decay(o.weight_decay as f32)
                    .init(),
            ),
            OptimizerKind::Adam => Optim::Adam(
                AdamConfig::new()
                    .with_beta_1(b1)
                    .with_beta_2(b2)
                    .with_epsilon(eps)
                    .with_weight_decay(decay)
                    .init(),
            ),
            OptimizerKind::Sgd => {
                let momentum = (o.momentum > 0.0).then_some(MomentumConfig {
                    momentum: o.momentum,
                    dampening: 0.0,
                    nesterov: false,
                });
                Optim::Sgd(
                    SgdConfig::new()
                        .with_momentum(momentum)
                        .with_weight_decay(decay)
                        .init(),
                )
            }
            OptimizerKind::Adam8bit => Optim::Adam8bit(OptimizerAdaptor::from(
                Adam8bitOptimizer::new(b1, b2, eps, o.weight_decay as f32),
            )),
            OptimizerKind::Lion => Optim::Lion(OptimizerAdaptor::from(LionOptimizer {
                beta_1: b1,
                beta_2: b2,
                weight_decay: o.weight_decay as f32,
            })),
            OptimizerKind::Adafactor => {
                Optim::Adafactor(OptimizerAdaptor::from(AdafactorOptimizer {
                    beta_1: (o.betas.0 > 0.0).then_some(o.betas.0),
                    weight_decay: o.weight_decay,
                }))
            }
            OptimizerKind::AdamMini => {
                let records = crate::optim::adam_mini::initial_records(model, &plan.model)
                    .map_err(|e| RunError::Unsupported(format!("optimizer adam-mini: {e}")))?;
                let rule = AdamMiniOptimizer::new(o.betas.0, o.betas.1, 1e-8, o.weight_decay);
                Optim::AdamMini(
                    OptimizerAdaptor::from(rule).load_record(records.into_iter().collect()),
                )
            }
        })
    }

    /// The stepped model, and what went wrong in the step (8-bit Adam's
    /// errors come after its update): the model comes back either way.
    pub(crate) fn step(
        &mut self,
        lr: f64,
        model: Model<B>,
        grads: GradientsParams,
    ) -> (Model<B>, Result<(), RunError>) {
        let model = match self {
            Optim::AdamW(o) => o.step(lr, model, grads),
            Optim::Adam(o) => o.step(lr, model, grads),
            Optim::Sgd(o) => o.step(lr, model, grads),
            Optim::Lion(o) => o.step(lr, model, grads),
            Optim::Adafactor(o) => o.step(lr, model, grads),
            Optim::Adam8bit(o) => {
                let model = o.step(lr, model, grads);
                if let Some(e) = o.optim().take_error() {
                    return (model, Err(RunError::Backend(format!("8-bit Adam: {e}"))));
                }
                model
            }
            Optim::AdamMini(o) => {
                let model = o.step(lr, model, grads);
                if let Some(e) = o.optim().take_error() {
                    return (model, Err(RunError::Backend(format!("Adam-mini: {e}"))));
                }
                model
            }
        };
        (model, Ok(()))
    }

    fn save(
        &self,
        rec: &BinFileRecorder<FullPrecisionSettings>,
        path: std::path::PathBuf,
    ) -> Result<(), RunError> {
        let r = match self {
            Optim::AdamW(o) => Recorder::<B>::record(rec, o.to_record(), path),
            Optim::Adam(o) => Recorder::<B>::record(rec, o.to_record(), path),
            Optim::Sgd(o) => Recorder::<B>::record(rec, o.to_record(), path),
            Optim::Adam8bit(o) => Recorder::<B>::record(rec, o.to_record(), path),
            Optim::Lion(o) => Recorder::<B>::record(rec, o.to_record(), path),
            Optim::Adafactor(o) => Recorder::<B>::record(rec, o.to_record(), path),
            Optim::AdamMini(o) => Recorder::<B>::record(rec, o.to_record(), path),
        };
        r.map_err(|e| RunError::Checkpoint(format!("cannot write the optimizer state: {e}")))
    }

    fn load(
        self,
        rec: &BinFileRecorder<FullPrecisionSettings>,
        path: std::path::PathBuf,
        device: &B::Device,
    ) -> Result<Self, RunError> {
        let file = path.with_extension("bin");
        let err =
            |e: burn::record::RecorderError| unreadable_record(&file, "the optimizer state", &e);
        Ok(match self {
            Optim::AdamW(o) => {
                Optim::AdamW(o.load_record(Recorder::<B>::load(rec, path, device).map_err(err)?))
            }
            Optim::Adam(o) => {
                Optim::Adam(o.load_record(Recorder::<B>::load(rec, path, device).map_err(err)?))
            }
            Optim::Sgd(o) => {
                Optim::Sgd(o.load_record(Recorder::<B>::load(rec, path, device).map_err(err)?))
            }
            Optim::Adam8bit(o) => {
                Optim::Adam8bit(o.load_record(Recorder::<B>::load(rec, path, device).map_err(err)?))
            }
            Optim::Lion(o) => {
                Optim::Lion(o.load_record(Recorder::<B>::load(rec, path, device).map_err(err)?))
            }
            Optim::Adafactor(o) => Optim::Adafactor(
                o.load_record(Recorder::<B>::load(rec, path, device).map_err(err)?),
            ),
            Optim::AdamMini(o) => {
                Optim::AdamMini(o.load_record(Recorder::<B>::load(rec, path, device).map_err(err)?))
            }
        })
    }
}

/// A checkpoint file Burn's recorder could not read, in words: which file,
/// what it held, and what to do (Burn's own text is a debug dump such as
/// `Unknown("Io { inner: ... }")`).
pub(crate) fn unreadable_record(
    file: &Path,
    holds: &str,
    e: &burn::record::RecorderError,
) -> RunError {
    let what = match e {
        burn::record::RecorderError::FileNotFound(_) => "is missing",
        _ => "is truncated or corrupt (it could not be decoded)",
    };
    RunError::Checkpoint(format!(
        "the checkpoint file `{}` ({holds}) {what}: it was probably written by a run that was \
         interrupted, or belongs to another version of rcoa; resume from another checkpoint, or \
         start again without --resume",
        file.display()
    ))
}

// ---------------------------------------------------------------- units

/// A unit of the model for the per-unit work around the segmented step
/// (ZeRO-3 gathers and reduces unit by unit).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Embed,
    Layer(usize),
    Head,
}

/// Whether any of `m`'s parameters is trained.
fn trains<B: Backend, M: Module<B>>(m: &M) -> bool {
    struct Any(bool);
    impl<B: Backend> ModuleVisitor<B> for Any {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0 |= param.is_require_grad();
        }
    }
    let mut any = Any(false);
    m.visit(&mut any);
    any.0
}

/// A layer's input as the leaf of its segment's graph: tracked when its
/// gradient goes on down (every layer's but a frozen embedding's first).
fn leaf_of<B: ExecAutodiff>(x: Tensor<B::InnerBackend, 3>, input_grad: bool) -> Tensor<B, 3> {
    let leaf = Tensor::<B, 3>::from_inner(x);
    if input_grad {
        leaf.require_grad()
    } else {
        leaf
    }
}

/// What `Trainer::micro_step_with` asks for around each unit: its weights
/// before its forward (and a checkpointed layer's recomputation), and what
/// to do with its gradients after its backward. `Whole` hands out the
/// trainer's model and merges gradients into a `GradientsParams`;
/// `shard::zero3::Zero3Hooks` gathers and reduce-scatters.
pub trait UnitHooks<B: ExecAutodiff> {
    type Error;
    fn embed(&mut self) -> Result<Embed<B>, Self::Error>;
    /// Layer `i`; `keep`: its backward will come with this copy's graph
    /// (not for a checkpointed layer's graph-free forward).
    fn layer(&mut self, i: usize, keep: bool) -> Result<Layer<B>, Self::Error>;
    /// The head, and the embedding its LM head is tied to (untied: any
    /// embedding, it is not read).
    fn head(&mut self) -> Result<(Head<B>, Embed<B>), Self::Error>;
    /// The gradients of `unit`'s segment (for the head: with the tied
    /// embedding's).
    fn backward(&mut self, unit: Unit, grads: B::Gradients) -> Result<(), Self::Error>;
}

/// The whole model on every rank: units are its own parts, gradients merge
/// into `acc` (cast to fp32 for the master when `cast`).
struct Whole<'a, B: ExecAutodiff> {
    m: &'a Model<B>,
    master: &'a Model<B>,
    acc: &'a mut GradientsParams,
    cast: Option<FloatDType>,
}

impl<B: ExecAutodiff> UnitHooks<B> for Whole<'_, B> {
    type Error = std::convert::Infallible;

    fn embed(&mut self) -> Result<Embed<B>, Self::Error> {
        Ok(self.m.embed.clone())
    }

    fn layer(&mut self, i: usize, _keep: bool) -> Result<Layer<B>, Self::Error> {
        Ok(self.m.layers[i].clone())
    }

    fn head(&mut self) -> Result<(Head<B>, Embed<B>), Self::Error> {
        Ok((self.m.head.clone(), self.m.embed.clone()))
    }

    fn backward(&mut self, _unit: Unit, grads: B::Gradients) -> Result<(), Self::Error> {
        let mut from = GradientsParams::from_grads(grads, self.m);
        // Visit the master (same ids) so casts land on its parameters.
        self.master.visit(&mut MergeGrads {
            into: self.acc,
            from: &mut from,
            cast: self.cast,
        });
        Ok(())
    }
}

// ---------------------------------------------------------------- trainer

/// What one optimizer step measured.
#[derive(Clone, Debug)]
pub struct StepReport {
    /// 1-based.
    pub step: u64,
    pub loss: f64,
    pub step_seconds: f64,
    pub tokens: u64,
    /// Highest memory sample during this step (see `MemoryProbe`).
    pub peak_bytes: u64,
    /// fp16's loss scale this step ran with (`crate::loss_scale`).
    pub loss_scale: Option<f64>,
    /// The gradients overflowed at `loss_scale`: the optimizer did not step,
    /// and the next step runs at this scale.
    pub skipped: Option<f64>,
}

/// What the trainer needs besides the plan.
pub struct TrainerConfig<B: ExecAutodiff> {
    pub seed: u64,
    pub batcher: Batcher,
    /// Whether the backend computes in 16-bit floats.
    pub sixteen_bit: bool,
    /// Data-parallel rank: gradients and the loss are averaged over the
    /// ranks before every optimizer step.
    pub collective: Option<crate::distributed::Collective<B::InnerBackend>>,
}

/// A kept segment of the forward pass.
enum Saved<B: ExecAutodiff> {
    /// Checkpointed layer: only its input.
    Input(Tensor<B::InnerBackend, 3>),
    /// Checkpointed layer whose input waits in host memory for the recompute
    /// (`offload = [activations]`).
    Host(TensorData),
    /// Graph kept: the leaf input and the output.
    Graph(Tensor<B, 3>, Tensor<B, 3>),
}

pub struct Trainer<B: ExecAutodiff> {
    pub device: B::Device,
    /// The parameters the optimizer steps (the fp32 master in master mode).
    model: Model<B>,
    /// The 16-bit working copy in master mode.
    work: Option<Model<B>>,
    optim: Optim<B>,
    pub precision: Precision,
    pub precision_note: Option<String>,
    ctx: Ctx<B>,
    ictx: Ctx<B::InnerBackend>,
    /// Per layer: recomputed in the backward pass?
    pub checkpointed: Vec<bool>,
    /// Per layer: its input goes to host memory between its forward and its
    /// recompute (`Residency::inputs_on_host`)?
    inputs_on_host: Vec<bool>,
    /// The plan offloads the gradients (`offload = [grads]`).
    grads_offloaded: bool,
    pub batcher: Batcher,
    loss: Loss,
    /// The LM head and cross-entropy a chunk of tokens at a time, so the
    /// `[tokens, vocab]` fp32 logits never exist at once (the plan's
    /// `train.chunked_loss`; by default above a 32,768-token vocabulary, as
    /// the `burn` profile predicts).
    chunked_loss: bool,
    layout: ContrastiveLayout,
    lr: f64,
    pub grad_accum: u64,
    seed: u64,
    /// Optimizer steps completed.
    pub step: u64,
    reseed: bool,
    /// Sample memory after every layer (default); `RCOA_MEMORY_SAMPLES=step`
    /// samples only after the loss, the backward and the optimizer (to
    /// measure what the per-layer samples cost).
    per_layer_samples: bool,
    /// `RCOA_MEMORY_TRACE=1`: print every sample of the second step to
    /// stderr (`memory <where> <bytes>`), the timeline that calibrates the
    /// compiler's `burn` profile.
    trace: bool,
    /// Data-parallel membership (`None`: a single process).
    collective: Option<crate::distributed::Collective<B::InnerBackend>>,
    /// ZeRO 1/2 or the optimizer on the host (`crate::shard`): steps the
    /// model instead of `optim`.
    zero: Option<crate::shard::Zero<B::InnerBackend>>,
    /// ZeRO-3 or the parameters on the host (`crate::shard::zero3`): the
    /// weights are its shards and `model` is a skeleton of placeholders.
    zero3: Option<crate::shard::zero3::Zero3<B::InnerBackend>>,
    /// What `save` writes in the Hugging Face layout beside rcoa's record
    /// (full weights, a PEFT adapter, or merged weights); `None` for a model
    /// no Hugging Face class holds.
    export: Option<crate::weights::Export>,
    /// What a checkpoint of this run belongs to (`crate::checkpoint`).
    identity: crate::checkpoint::Identity,
    /// fp16's dynamic loss scale (`None` without fp16).
    scaler: Option<LossScaler>,
    /// `optimizer.in_backward` (`crate::in_backward`): placeholders of the
    /// model's parameters, which stand in for `model` while a micro-batch's
    /// hooks own it and step it.
    skeleton: Option<Model<B>>,
}

impl<B: ExecAutodiff> Trainer<B> {
    pub fn new(
        plan: &LoweredPlan,
        cfg: TrainerConfig<B>,
        device: B::Device,
    ) -> Result<Self, RunError> {
        // What the executor does not build, for a plan compiled for any engine (the
        // compiler refuses it for `target burn` before lowering).
        rcoa_compiler::executed::check_lowered(plan).map_err(RunError::Unsupported)?;
        let ranks = cfg.collective.as_ref().map_or(1, |c| c.ranks() as u64);
        crate::check_plan_ranks(plan, ranks)?;
        let (precision, precision_note) = Precision::for_plan(plan, cfg.sixteen_bit)?;
        let scaler = LossScaler::for_precision(&precision);
        B::seed(&device, cfg.seed);
        let lm_head = plan.train.loss != Loss::Contrastive;
        // One unit at a time, each loaded, cast or sharded before the next
        // is made (`crate::setup`).
        let built =
            crate::setup::build::<B>(plan, precision, lm_head, cfg.collective.as_ref(), &device)?;
        let (zero3, zero, model) = (built.zero3, built.zero, built.model);
        let optim = Optim::for_plan(plan, &model)?;
        // The 16-bit working copy of the fp32 master (with ZeRO the model is
        // the 16-bit weights, the master a shard of `zero`'s).
        let work = (zero3.is_none() && zero.is_none() && precision.master)
            .then(|| model.clone().map(&mut CastParams(precision.params)));
        let skeleton = plan
            .resolved
            .optimizer_in_backward
            .then(|| model.clone().map(&mut crate::shard::zero3::Placeholders));
        let seq = plan.train.seq_len as usize;
        let flash = plan.train.attention == rcoa_compiler::spec::Attention::Flash;
        let mut ctx = Ctx::new(
            &plan.model,
            plan.adapter.as_ref(),
            seq,
            precision.compute,
            flash,
            &device,
        );
        // Selective recomputation is inside every layer's attention; no layer
        // is recomputed whole (the plan lists none).
        ctx.selective = plan.resolved.checkpoint == "selective";
        // One set of the RoPE tables and the causal bias on the device: measured on
        // CUDA, a second context built alike held them twice (17 MiB at 2,048 tokens
        // in bf16, the constant part of QLoRA's +2.8 %, docs/burn-h100.md).
        let ictx = ctx.inner();
        let checkpointed = (0..plan.model.layers)
            .map(|i| plan.layer_checkpointed(i))
            .collect();
        let on_host = plan.residency().inputs_on_host;
        let inputs_on_host = (0..plan.model.layers)
            .map(|i| on_host.contains(&i))
            .collect();
        let layout = ContrastiveLayout {
            group: cfg.batcher.group,
            positives: cfg.batcher.positives,
            grouped: cfg.batcher.grouped,
        };
        let reseed =
            plan.model.dropout > 0.0 || plan.adapter.as_ref().is_some_and(|a| a.dropout > 0.0);
        Ok(Trainer {
            export: crate::weights::Export::for_plan(plan, &model),
            identity: crate::checkpoint::Identity::of(plan, &precision),
            device,
            model,
            work,
            optim,
            precision,
            precision_note,
            ctx,
            ictx,
            checkpointed,
            inputs_on_host,
            grads_offloaded: crate::shard::layout::offloads(
                plan,
                rcoa_compiler::spec::OffloadWhat::Grads,
            ),
            loss: plan.train.loss,
            chunked_loss: plan.train.chunked_loss_for(plan.model.vocab),
            layout,
            batcher: cfg.batcher,
            lr: plan.optimizer.lr,
            grad_accum: plan.resolved.grad_accum.max(1),
            seed: cfg.seed,
            step: 0,
            reseed,
            per_layer_samples: std::env::var("RCOA_MEMORY_SAMPLES")
                .map(|v| v != "step")
                .unwrap_or(true),
            trace: crate::memory::trace_on(),
            collective: cfg.collective,
            zero,
            zero3,
            scaler,
            skeleton,
        })
    }

    /// Scale the loss as `scaler` says whatever the precision (tests: fp32
    /// on the CPU shows what the scaling does to a step), or not at all.
    pub fn set_loss_scaler(&mut self, scaler: Option<LossScaler>) {
        self.scaler = scaler;
    }

    pub fn loss_scaler(&self) -> Option<&LossScaler> {
        self.scaler.as_ref()
    }

    /// An fp32 master beside an fp32 working copy: on the CPU, which has no
    /// 16-bit floats, the steps that 16-bit weights with a master take.
    #[cfg(test)]
    pub(crate) fn with_fp32_master(&mut self) {
        self.precision.master = true;
        self.work = Some(self.model.clone().map(&mut CastParams(FloatDType::F32)));
    }

    /// Whether each unit steps as the backward leaves it (`optimizer.in_backward`).
    pub fn steps_in_backward(&self) -> bool {
        self.skeleton.is_some()
    }

    /// The sharded optimizer, when the plan asks for ZeRO 1/2 or offload.
    pub fn zero(&self) -> Option<&crate::shard::Zero<B::InnerBackend>> {
        self.zero.as_ref()
    }

    /// This rank's membership in the data-parallel run.
    pub fn collective(&self) -> Option<&crate::distributed::Collective<B::InnerBackend>> {
        self.collective.as_ref()
    }

    /// The per-unit sharded weights, when the plan asks for ZeRO-3 or
    /// parameter offload.
    pub fn zero3(&self) -> Option<&crate::shard::zero3::Zero3<B::InnerBackend>> {
        self.zero3.as_ref()
    }

    pub(crate) fn zero3_mut(&mut self) -> Option<&mut crate::shard::zero3::Zero3<B::InnerBackend>> {
        self.zero3.as_mut()
    }

    pub(crate) fn zero_mut(&mut self) -> Option<&mut crate::shard::Zero<B::InnerBackend>> {
        self.zero.as_mut()
    }

    /// This rank's optimizer state shard as bytes (`FlatOptim::save_state`)
    /// and its shard index; `None` with Burn's optimizer.
    pub fn optimizer_shard_state(&self) -> Option<Result<(usize, Vec<u8>), RunError>> {
        self.zero
            .as_ref()
            .map(|z| Ok((z.index(), z.optimizer().save_state()?)))
    }

    /// Restore this rank's shard written by `optimizer_shard_state` (after the
    /// model was loaded: the master shard is taken from it again).
    pub fn load_optimizer_shard_state(&mut self, bytes: &[u8]) -> Result<(), RunError> {
        let device = self.device.clone();
        if let Some(z) = &mut self.zero3 {
            // The master shard was rebuilt from the resumed weights (or is
            // restored beside: `shard::checkpoint::load_shard`).
            return z.optimizer_mut().load_state(bytes, &device);
        }
        let z = self.zero.as_mut().ok_or_else(|| {
            RunError::Checkpoint("this run has no sharded optimizer state to load".into())
        })?;
        z.optimizer_mut().load_state(bytes, &device)?;
        z.reset_master();
        Ok(())
    }

    /// How `save` writes Hugging Face weights: `--merge-lora` (refused
    /// without an adapter or a Hugging Face layout) and the shard size.
    pub fn set_hf_save(&mut self, o: crate::weights::SaveOptions) -> Result<(), RunError> {
        let Some(e) = self.export.as_mut() else {
            if o.merge_lora {
                return Err(RunError::Unsupported(
                    "--merge-lora writes Hugging Face weights, and this model's shape has no Hugging Face layout \
                     (Llama/Mistral, GPT-2 and XLM-R shapes have)"
                        .into(),
                ));
            }
            return Ok(());
        };
        if o.merge_lora {
            e.set_merge_lora().map_err(RunError::Unsupported)?;
        }
        e.max_shard_bytes = o.max_shard_bytes;
        Ok(())
    }

    /// The Hugging Face export of `save` (tests lower the shard size).
    pub fn export_mut(&mut self) -> Option<&mut crate::weights::Export> {
        self.export.as_mut()
    }

    /// Override which layers are recomputed (tests compare the variants).
    pub fn set_checkpointed(&mut self, layers: Vec<bool>) {
        self.checkpointed = layers;
    }

    /// What this run moves to host memory, as `offload` lists it: the
    /// optimizer and the parameters as the sharded state holds them, and
    /// checkpointed layers' inputs.
    pub fn executed_offload(&self) -> Vec<String> {
        let mut out = crate::shard::executed_offload(self.zero(), self.zero3());
        // The accumulator is on the host beside the host optimizer with
        // per-unit gathers too; the plan's `grads` is what this reports.
        if self.grads_offloaded && self.zero3().is_some_and(|z| z.grads_on_host()) {
            out.push("grads:cpu".to_string());
        }
        let on_host = |i: usize| self.checkpointed[i] && self.inputs_on_host[i];
        if (0..self.checkpointed.len().min(self.inputs_on_host.len())).any(on_host) {
            out.push("activations:cpu".to_string());
        }
        out
    }

    /// Override which checkpointed layers keep their input in host memory
    /// (tests compare the variants).
    pub fn set_inputs_on_host(&mut self, layers: Vec<bool>) {
        self.inputs_on_host = layers;
    }

    /// Whether the LM loss runs a chunk of tokens at a time.
    pub fn chunked_loss_on(&self) -> bool {
        self.chunked_loss
    }

    /// Turn dropout off (gradient checks).
    pub fn set_train_mode(&mut self, train: bool) {
        self.ctx.train = train;
        self.ictx.train = train;
    }

    /// Take a memory sample; `per_layer` samples can be turned off.
    fn mark(&self, probe: &mut dyn MemoryProbe, per_layer: bool, at: &dyn Fn() -> String) {
        probe.at(at);
        if per_layer && !self.per_layer_samples {
            return;
        }
        let v = probe.sample();
        if self.trace && self.step == 1 {
            eprintln!("memory {} {v}", at());
        }
    }

    fn working(&self) -> &Model<B> {
        self.work.as_ref().unwrap_or(&self.model)
    }

    fn reseed_for(&self, step: u64, micro: u64, segment: u64) {
        if self.reseed {
            let mut r = crate::data::Rng::keyed(self.seed, step, micro, 1_000_000 + segment);
            B::seed(&self.device, r.next_u64());
        }
    }

    /// The contexts (autodiff, inner) for `batch`: with its key-padding
    /// mask when its rows are right-padded, its documents when they are packed.
    #[allow(clippy::type_complexity)]
    fn contexts(
        &self,
        batch: &Batch,
    ) -> (
        std::borrow::Cow<'_, Ctx<B>>,
        std::borrow::Cow<'_, Ctx<B::InnerBackend>>,
    ) {
        use std::borrow::Cow;
        if let Some(p) = &batch.positions {
            // Packed rows: one set of tensors, shared by both contexts.
            let c = self
                .ctx
                .with_documents(p, batch.rows, batch.seq, &self.device);
            let ic = c.inner();
            return (Cow::Owned(c), Cow::Owned(ic));
        }
        match &batch.keep {
            None => (Cow::Borrowed(&self.ctx), Cow::Borrowed(&self.ictx)),
            Some(k) => (
                Cow::Owned(
                    self.ctx
                        .with_padding(k, batch.rows, batch.seq, &self.device),
                ),
                Cow::Owned(
                    self.ictx
                        .with_padding(k, batch.rows, batch.seq, &self.device),
                ),
            ),
        }
    }

    /// The held-out loss of the weights the forward reads (`crate::eval`),
    /// forward only on the inner backend.
    pub fn evaluate(&self, set: &crate::eval::EvalSet) -> Result<(f64, usize), RunError> {
        let model = self.working().valid();
        let mut ctx = self.ictx.clone();
        ctx.selective = false;
        crate::eval::evaluate(&model, &ctx, set, &self.device)
    }

    fn tokens(&self, batch: &Batch) -> Tensor<B, 2, Int> {
        let data =
            TensorData::new(batch.inputs.clone(), [batch.rows, batch.seq]).convert::<B::IntElem>();
        Tensor::from_data(data, &self.device)
    }

    /// The objective on the last layer's output `x`.
    fn objective<X: ExecBackend>(
        &self,
        head: &Head<X>,
        embed: &Embed<X>,
        x: Tensor<X, 3>,
        batch: &Batch,
        ctx: &Ctx<X>,
        device: &X::Device,
    ) -> Tensor<X, 1> {
        let h = head.normed(x, ctx);
        match self.loss {
            Loss::CausalLm | Loss::MaskedLm => {
                let targets = TensorData::new(batch.targets.clone(), [batch.rows, batch.seq])
                    .convert::<X::IntElem>();
                let targets = Tensor::<X, 2, Int>::from_data(targets, device);
                // Masked LM's masked positions; prompt-completion rows' completion tokens.
                let weights = (!batch.weights.is_empty()).then(|| {
                    Tensor::<X, 2>::from_data(
                        TensorData::new(batch.weights.clone(), [batch.rows, batch.seq]),
                        device,
                    )
                });
                let loss = if self.chunked_loss {
                    // The shapes are the model's own: a mismatch is a bug here.
                    chunked_lm_loss(h, head.weight(embed, ctx), targets, weights, DEFAULT_CHUNK)
                        .unwrap_or_else(|e| panic!("chunked loss: {e}"))
                } else {
                    lm_loss(head.logits(h, embed, ctx), targets, weights)
                };
                if batch.loss_weight == 1.0 {
                    loss
                } else {
                    loss.mul_scalar(batch.loss_weight)
                }
            }
            Loss::Contrastive => {
                // Padded rows (pairs files) pool over their real tokens only.
                let mask = batch.keep.as_ref().map(|k| {
                    let m: Vec<f32> = k.iter().map(|&k| if k { 1.0 } else { 0.0 }).collect();
                    Tensor::<X, 2>::from_data(TensorData::new(m, [batch.rows, batch.seq]), device)
                });
                contrastive_loss(h, self.layout, mask, TAU)
            }
        }
    }

    /// Forward and backward of one micro-batch with segment recomputation;
    /// gradients (of `loss * scale`) are added into `acc`. Returns the loss.
    pub fn micro_step(
        &self,
        batch: &Batch,
        step: u64,
        micro: u64,
        scale: f64,
        acc: &mut GradientsParams,
        probe: &mut dyn MemoryProbe,
    ) -> Tensor<B::InnerBackend, 1> {
        let mut whole = Whole {
            m: self.working(),
            master: &self.model,
            acc,
            cast: self.precision.master.then_some(FloatDType::F32),
        };
        match self.micro_step_with(batch, step, micro, scale, &mut whole, probe) {
            Ok(loss) => loss,
            Err(never) => match never {},
        }
    }

    /// `micro_step` that steps each unit as the backward leaves it
    /// (`crate::in_backward`): the hooks hold the model, its working copy and
    /// the optimizer meanwhile, and the skeleton stands in for the model.
    fn micro_step_in_backward(
        &mut self,
        batch: &Batch,
        step: u64,
        micro: u64,
        scale: f64,
        probe: &mut dyn MemoryProbe,
    ) -> Result<Tensor<B::InnerBackend, 1>, RunError> {
        let skeleton = self.skeleton.take().expect("only with a skeleton");
        let model = std::mem::replace(&mut self.model, skeleton);
        let mut optim = std::mem::replace(&mut self.optim, Optim::placeholder());
        let mut hooks = crate::in_backward::InBackward {
            model: Some(model),
            work: self.work.take(),
            optim: &mut optim,
            lr: self.lr,
            params: self.precision.params,
            pending: GradientsParams::new(),
            collective: self.collective.as_ref(),
            device: self.device.clone(),
        };
        let loss = self.micro_step_with(batch, step, micro, scale, &mut hooks, probe);
        let (model, work) = (hooks.model.take(), hooks.work.take());
        self.optim = optim;
        self.work = work;
        // Every step hands the model back, failed or not (`Optim::step`).
        let model = model.expect("the hooks hand the model back");
        self.skeleton = Some(std::mem::replace(&mut self.model, model));
        loss
    }

    /// `micro_step` with each unit's weights from `hooks`, and its gradients
    /// to them as the backward leaves it.
    pub fn micro_step_with<H: UnitHooks<B>>(
        &self,
        batch: &Batch,
        step: u64,
        micro: u64,
        scale: f64,
        hooks: &mut H,
        probe: &mut dyn MemoryProbe,
    ) -> Result<Tensor<B::InnerBackend, 1>, H::Error> {
        let layers = self.model.layers.len();
        let (ctx, ictx) = self.contexts(batch);
        self.reseed_for(step, micro, 0);
        let embed = hooks.embed()?;
        // A frozen embedding (an adapter's) takes no gradient: the first layer's input is then
        // a constant, and that layer saves and computes only what its own parameters need,
        // as autograd does (and the memory model walks).
        let first_input_grad = trains(&embed);
        let emb = embed.forward(self.tokens(batch), &ctx);
        // Its lookup's backward needs the token ids only: a copy held on would
        // keep the old matrix beside the new one where the embedding steps in
        // the backward.
        drop(embed);
        let input_grad = |i: usize| i > 0 || first_input_grad;
        let mut x = emb.clone().inner();
        // Kept for the embedding's backward only; frozen, its buffer lives on as the first
        // layer's input alone, and goes with it.
        let emb = first_input_grad.then_some(emb);
        let mut saved: Vec<Saved<B>> = Vec::with_capacity(layers);
        for i in 0..layers {
            self.reseed_for(step, micro, i as u64 + 1);
            if self.checkpointed.get(i).copied().unwrap_or(false) {
                let y = hooks.layer(i, false)?.valid().forward(x.clone(), &ictx);
                // The read waits for the layer's forward; the device buffer
                // is freed once its bytes are on the host.
                saved.push(if self.inputs_on_host.get(i).copied().unwrap_or(false) {
                    Saved::Host(x.into_data())
                } else {
                    Saved::Input(x)
                });
                x = y;
            } else {
                let leaf = leaf_of(x, input_grad(i));
                let y = hooks.layer(i, true)?.forward(leaf.clone(), &ctx);
                x = y.clone().inner();
                saved.push(Saved::Graph(leaf, y));
            }
            self.mark(probe, true, &|| format!("forward:layer{i}"));
        }
        let leaf = Tensor::<B, 3>::from_inner(x).require_grad();
        let (head, tied) = hooks.head()?;
        let loss = self.objective(&head, &tied, leaf.clone(), batch, &ctx, &self.device);
        drop((head, tied));
        let value = loss.clone().inner();
        self.mark(probe, false, &|| "forward:loss".into());
        let grads = loss.mul_scalar(scale).backward();
        let mut g = Some(
            leaf.grad(&grads)
                .expect("the loss depends on the last hidden state"),
        );
        // The last layer's output: its graph keeps it where that layer is not recomputed,
        // its recompute makes it again where it is. Held here, it stayed through the whole
        // backward beside its gradient (QLoRA on CUDA: 64 MiB, docs/burn-h100.md
        // "2026-11-27").
        drop(leaf);
        hooks.backward(Unit::Head, grads)?;
        self.mark(probe, false, &|| "backward:head".into());

        for i in (0..layers).rev() {
            let (leaf, y) = match saved.pop().expect("one saved segment per layer") {
                Saved::Graph(leaf, y) => (leaf, y),
                Saved::Input(x) => {
                    self.recompute(i, x, input_grad(i), step, micro, &ctx, hooks, probe)?
                }
                Saved::Host(data) => {
                    let dtype = data.dtype;
                    let x = Tensor::from_data(data, (&self.device, dtype));
                    self.recompute(i, x, input_grad(i), step, micro, &ctx, hooks, probe)?
                }
            };
            let dy = g
                .take()
                .expect("the layer above passed its input's gradient");
            let grads = (y * Tensor::from_inner(dy)).sum().backward();
            g = input_grad(i).then(|| {
                leaf.grad(&grads)
                    .expect("a layer's output depends on its input")
            });
            hooks.backward(Unit::Layer(i), grads)?;
            self.mark(probe, true, &|| format!("backward:layer{i}"));
        }
        let grads = match (emb, g) {
            (Some(emb), Some(g)) => (emb * Tensor::from_inner(g)).sum().backward(),
            // A frozen embedding: no gradient came down, and none goes to it.
            _ => Tensor::<B, 1>::zeros([1], &self.device).sum().backward(),
        };
        hooks.backward(Unit::Embed, grads)?;
        self.mark(probe, false, &|| "backward:embedding".into());
        Ok(value)
    }

    /// Layer `i` again from its kept input `x`, with the graph on (the masks
    /// of its first forward): the leaf input (tracked when `input_grad`) and
    /// the output.
    #[allow(clippy::too_many_arguments)]
    fn recompute<H: UnitHooks<B>>(
        &self,
        i: usize,
        x: Tensor<B::InnerBackend, 3>,
        input_grad: bool,
        step: u64,
        micro: u64,
        ctx: &Ctx<B>,
        hooks: &mut H,
        probe: &mut dyn MemoryProbe,
    ) -> Result<(Tensor<B, 3>, Tensor<B, 3>), H::Error> {
        self.reseed_for(step, micro, i as u64 + 1);
        let leaf = leaf_of(x, input_grad);
        let y = hooks.layer(i, true)?.forward(leaf.clone(), ctx);
        self.mark(probe, true, &|| format!("recompute:layer{i}"));
        Ok((leaf, y))
    }

    /// The same gradients from one graph over the whole model (the reference
    /// the segmented step is tested against).
    pub fn reference_grads(&self, batch: &Batch, step: u64, micro: u64) -> (f64, GradientsParams) {
        let m = self.working();
        let (ctx, _) = self.contexts(batch);
        self.reseed_for(step, micro, 0);
        let mut x = m.embed.forward(self.tokens(batch), &ctx);
        for (i, layer) in m.layers.iter().enumerate() {
            self.reseed_for(step, micro, i as u64 + 1);
            x = layer.forward(x, &ctx);
        }
        let loss = self.objective(&m.head, &m.embed, x, batch, &ctx, &self.device);
        let value = loss.clone().into_scalar().elem::<f64>();
        let grads = loss.backward();
        let mut from = GradientsParams::from_grads(grads, m);
        let mut acc = GradientsParams::new();
        self.model.visit(&mut MergeGrads {
            into: &mut acc,
            from: &mut from,
            cast: None,
        });
        (value, acc)
    }

    /// Gradient of every trainable parameter, flattened in parameter order.
    pub fn flatten(&self, grads: &GradientsParams) -> Vec<Vec<f32>> {
        struct Flat<'a> {
            grads: &'a GradientsParams,
            out: Vec<Vec<f32>>,
        }
        impl<B: ExecAutodiff> ModuleVisitor<B> for Flat<'_> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
                    let v = g
                        .cast(FloatDType::F32)
                        .into_data()
                        .convert::<f32>()
                        .to_vec::<f32>()
                        .unwrap_or_default();
                    self.out.push(v);
                }
            }
        }
        let mut f = Flat {
            grads,
            out: Vec::new(),
        };
        self.model.visit(&mut f);
        f.out
    }

    /// One optimizer step: `grad_accum` micro-batches, then the update.
    pub fn train_step(&mut self, probe: &mut dyn MemoryProbe) -> Result<StepReport, RunError> {
        let start = std::time::Instant::now();
        probe.begin_step();
        let step = self.step;
        let loss_scale = self.scaler.map(|s| s.scale());
        let scale = loss_scale.unwrap_or(1.0) / self.grad_accum as f64;
        // Each path divides its reduced gradients by the loss scale and
        // checks them after the reduction, so every rank steps or skips alike.
        let unscale = loss_scale.map(|s| 1.0 / s);
        let mut acc = GradientsParams::new();
        let mut total: Option<Tensor<B::InnerBackend, 1>> = None;
        for micro in 0..self.grad_accum {
            let batch = self.batcher.batch(step, micro);
            let l = match self.zero3.take() {
                Some(mut z) => {
                    let mut hooks = crate::shard::zero3::Zero3Hooks::new(
                        &mut z,
                        &self.model,
                        self.collective.as_ref(),
                        &self.checkpointed,
                    );
                    let l = self.micro_step_with(&batch, step, micro, scale, &mut hooks, probe);
                    self.zero3 = Some(z);
                    l?
                }
                None if self.skeleton.is_some() => {
                    self.micro_step_in_backward(&batch, step, micro, scale, probe)?
                }
                None => self.micro_step(&batch, step, micro, scale, &mut acc, probe),
            };
            total = Some(match total {
                Some(t) => t + l,
                None => l,
            });
        }
        let stepped;
        if self.skeleton.is_some() {
            // Every unit stepped as the backward left it (`crate::in_backward`); with
            // data parallelism the loss reported is the mean over the ranks, as below.
            stepped = true;
            if let Some(c) = &self.collective {
                let loss = summed_loss(&mut total)?;
                total = Some(crate::shard::mean_loss_and_flag(c, loss, None)?.0);
            }
        } else if let Some(z) = &mut self.zero3 {
            // Each rank steps its shard; nothing is gathered afterwards.
            let loss = summed_loss(&mut total)?;
            let (loss, finite) = z.step(self.collective.as_ref(), self.lr, loss, unscale)?;
            stepped = finite;
            total = Some(loss);
        } else if let Some(z) = &mut self.zero {
            // ZeRO 1/2 or the optimizer on the host: the sharded step
            // reduces, updates its shard and gathers the weights back.
            let loss = summed_loss(&mut total)?;
            let model = self.model.clone();
            let (model, loss, finite) = z.step::<B, _>(
                self.collective.as_ref(),
                self.lr,
                model,
                &mut acc,
                loss,
                unscale,
                probe,
            )?;
            self.model = model;
            stepped = finite;
            total = Some(loss);
        } else {
            // Data parallel: every rank steps with the mean gradient (the
            // same on every rank), so the weights stay equal. The loss
            // reported is the mean over the ranks, the loss of the global
            // batch.
            if let Some(c) = &self.collective {
                let loss = total.take().ok_or_else(|| {
                    RunError::Backend("a data-parallel step needs at least one micro-batch".into())
                })?;
                // The mean is the same on every rank, and so is whether it is finite.
                let (loss, finite) = c.mean_step::<B, _>(&self.model, &mut acc, loss, unscale)?;
                total = Some(loss);
                stepped = finite;
                self.mark(probe, false, &|| "all-reduce".into());
            } else {
                stepped = unscale
                    .is_none_or(|inv| crate::loss_scale::unscale_grads(&self.model, &mut acc, inv));
            }
            if stepped {
                let model = self.model.clone();
                let (model, stepped) = self.optim.step(self.lr, model, acc);
                self.model = model;
                stepped?;
            }
        }
        if self.work.is_some() && stepped && self.skeleton.is_none() {
            self.work = Some(
                self.model
                    .clone()
                    .map(&mut CastParams(self.precision.params)),
            );
        }
        self.mark(probe, false, &|| "optimizer".into());
        let loss = total
            .map(|t| t.into_scalar().elem::<f64>())
            .unwrap_or(f64::NAN)
            / self.grad_accum as f64;
        B::sync(&self.device).map_err(|e| RunError::Backend(e.to_string()))?;
        self.mark(probe, false, &|| "end".into());
        if !loss.is_finite() {
            return Err(RunError::Diverged {
                step: step + 1,
                loss,
            });
        }
        let skipped = match &mut self.scaler {
            Some(s) => match s.update(stepped, step + 1)? {
                Outcome::Stepped => None,
                Outcome::Skipped { to, .. } => Some(to),
            },
            None => None,
        };
        self.step += 1;
        // Tokens this rank trained on (the throughput of one device).
        let tokens = self.grad_accum * (self.batcher.rows() * self.batcher.seq) as u64;
        Ok(StepReport {
            step: self.step,
            loss,
            step_seconds: start.elapsed().as_secs_f64(),
            tokens,
            peak_bytes: probe.step_peak(),
            loss_scale,
            skipped,
        })
    }

    // ------------------------------------------------------------ checkpoints

    /// Write model, optimizer state and the step counter to `dir` atomically:
    /// everything goes to a sibling temporary directory first, which then
    /// replaces `dir` by renames.
    pub fn save(&self, dir: &Path) -> Result<(), RunError> {
        self.save_model(&self.model, dir)
    }

    /// `save` with `model` as the weights: with ZeRO-3 the whole model
    /// gathered from the shards (`crate::shard::checkpoint::save`).
    pub(crate) fn save_model(&self, model: &Model<B>, dir: &Path) -> Result<(), RunError> {
        let err = |what: &str, e: &dyn std::fmt::Display| {
            RunError::Checkpoint(format!("{what} `{}`: {e}", dir.display()))
        };
        let name = dir
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "checkpoint".into());
        let parent = dir
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(parent).map_err(|e| err("cannot create the parent of", &e))?;
        let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp)
            .map_err(|e| err("cannot create a temporary directory beside", &e))?;
        let rec = BinFileRecorder::<FullPrecisionSettings>::new();
        Recorder::<B>::record(&rec, model.clone().into_record(), tmp.join("model"))
            .map_err(|e| RunError::Checkpoint(format!("cannot write the model: {e}")))?;
        self.optim.save(&rec, tmp.join("optimizer"))?;
        if let Some(export) = &self.export {
            // The Hugging Face files beside rcoa's own record (which
            // `resume` reads): what `transformers` and `peft` load.
            export.write(model, &tmp).map_err(|e| {
                RunError::Checkpoint(format!("cannot write the Hugging Face weights: {e}"))
            })?;
        }
        let mut state = self.identity.to_json();
        state["step"] = self.step.into();
        state["seed"] = self.seed.into();
        state["format"] = crate::checkpoint::FORMAT.into();
        if let Some(s) = &self.scaler {
            state["loss_scale"] = s.to_json();
        }
        std::fs::write(tmp.join("state.json"), state.to_string())
            .map_err(|e| err("cannot write the state of", &e))?;
        let old = parent.join(format!(".{name}.old-{}", std::process::id()));
        if dir.exists() {
            std::fs::rename(dir, &old).map_err(|e| err("cannot move aside", &e))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| err("cannot move the new checkpoint into", &e))?;
        let _ = std::fs::remove_dir_all(&old);
        Ok(())
    }

    /// Load a checkpoint written by `save`; training continues after its step.
    pub fn resume(&mut self, dir: &Path) -> Result<(), RunError> {
        let state = std::fs::read_to_string(dir.join("state.json")).map_err(|e| {
            RunError::Checkpoint(format!(
                "`{}` is not a checkpoint (state.json: {e})",
                dir.display()
            ))
        })?;
        let state: serde_json::Value = serde_json::from_str(&state)
            .map_err(|e| RunError::Checkpoint(format!("bad state.json: {e}")))?;
        let step = state["step"]
            .as_u64()
            .ok_or_else(|| RunError::Checkpoint("state.json has no step".into()))?;
        self.identity.check(&state, dir)?;
        let rec = BinFileRecorder::<FullPrecisionSettings>::new();
        let record = Recorder::<B>::load(&rec, dir.join("model"), &self.device)
            .map_err(|e| unreadable_record(&dir.join("model.bin"), "the model's weights", &e))?;
        // ZeRO-3: the skeleton takes the whole record, which then replaces
        // this rank's shards.
        let shapes = match &self.zero3 {
            Some(z) => z.param_shapes(),
            None => crate::checkpoint::param_shapes(&self.model),
        };
        let model = self.model.clone().load_record(record);
        if let Some(e) = model.quantization_error() {
            return Err(RunError::Checkpoint(format!("`{}`: {e}", dir.display())));
        }
        // Burn loads a record of other shapes without a word: the identity
        // above should have refused it; this catches a mismatched model.bin.
        let loaded = crate::checkpoint::param_shapes(&model);
        crate::checkpoint::same_shapes(&shapes, &loaded, &dir.join("model.bin"))?;
        if let Some(z) = &mut self.zero3 {
            z.load_whole(&model)?;
        } else {
            self.load_whole(model);
        }
        let optim = std::mem::replace(&mut self.optim, Optim::placeholder());
        self.optim = optim.load(&rec, dir.join("optimizer"), &self.device)?;
        if let Some(seed) = state["seed"].as_u64() {
            self.seed = seed;
            self.batcher.seed = seed;
        }
        if let Some(s) = &mut self.scaler {
            s.load_json(&state["loss_scale"])?;
        }
        self.step = step;
        Ok(())
    }

    /// The weights of a resumed whole model, in the run's storage dtype.
    fn load_whole(&mut self, mut model: Model<B>) {
        // Records hold fp32; restore the storage dtype (with a master the
        // model is the master, but under ZeRO the 16-bit weights).
        let master_whole = self.precision.master && self.zero.is_none();
        if !master_whole && self.precision.params != FloatDType::F32 {
            model = model.map(&mut CastParams(self.precision.params));
        }
        if master_whole {
            model = model.map(&mut CastFrozen(self.precision.params));
        }
        self.model = model;
        if self.skeleton.is_some() {
            // Placeholders of the resumed model: the old one's shared the NF4 bases
            // it was built with, which would stay on the device beside the new.
            self.skeleton = Some(
                self.model
                    .clone()
                    .map(&mut crate::shard::zero3::Placeholders),
            );
        }
        if master_whole {
            self.work = Some(
                self.model
                    .clone()
                    .map(&mut CastParams(self.precision.params)),
            );
        }
    }

    /// A checksum of the parameters the optimizer steps: the sum over
    /// parameters of (sum of elements + sum of squares), in fp64 on the host.
    /// Data-parallel ranks must agree on it exactly (the test of their sync).
    /// With ZeRO-3 every unit is gathered first (a collective call: every
    /// rank must ask).
    pub fn param_checksum(&mut self) -> Result<f64, RunError> {
        struct Sum(f64);
        impl<B: Backend> ModuleVisitor<B> for Sum {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let t = param.val().cast(FloatDType::F32);
                let s = t.clone().sum().into_scalar().elem::<f64>();
                let q = (t.clone() * t).sum().into_scalar().elem::<f64>();
                self.0 += s + q;
            }
        }
        let mut c = Sum(0.0);
        self.whole_model()?.visit(&mut c);
        Ok(c.0)
    }

    /// The model with its weights: gathered from the shards with ZeRO-3.
    pub(crate) fn whole_model(&mut self) -> Result<Model<B>, RunError> {
        match &mut self.zero3 {
            Some(z) => z.gather_model(&self.model, self.collective.as_ref()),
            None => Ok(self.model.clone()),
        }
    }

    /// The trainable parameters' values, fp32, in visit order (the flat
    /// vector ZeRO shards): for comparing runs element by element.
    pub fn flat_weights(&mut self) -> Result<Vec<f32>, RunError> {
        let device = self.device.clone();
        let model = self.whole_model()?;
        crate::optim::to_host(crate::shard::flat_params::<B, _>(&model, &device))
    }

    /// Number of parameters (all, trainable).
    pub fn param_counts(&self) -> (u64, u64) {
        if let Some(z) = &self.zero3 {
            // The skeleton's NF4 bases keep their shapes, sharded or not.
            let (all, trainable) = z.param_counts();
            return (all + self.model.quantized_params(), trainable);
        }
        struct Count(u64, u64);
        impl<B: Backend> ModuleVisitor<B> for Count {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let n = param.shape().num_elements() as u64;
                self.0 += n;
                if param.is_require_grad() {
                    self.1 += n;
                }
            }
        }
        let mut c = Count(0, 0);
        self.model.visit(&mut c);
        // QLoRA's NF4 bases are no float parameters: counted here.
        (c.0 + self.model.quantized_params(), c.1)
    }
}
