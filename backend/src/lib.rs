//! `rcoa-backend`: executes a `LoweredPlan` with Burn 0.21.
//!
//! The transformer is built from the plan (`model`), trained by one generic
//! step (`train`, over `B: ExecAutodiff`, `ops.rs`) that carries out the plan's
//! decisions: per-layer activation checkpointing by segment recomputation,
//! precision (fp32, autocast, 16-bit weights with an fp32 master), the
//! optimizer, gradient accumulation and the micro-batch. Memory is measured
//! (`memory`) and reported beside the prediction.
//!
//! The executor is instantiated twice, no more (each instantiation costs
//! minutes of compile time): `Autodiff<NdArray>` on the CPU, always built, and
//! `Autodiff<Cuda>` behind the `cuda` feature (`cuda` module: preflight of the
//! driver, NVRTC and headers; CubeCL's persistent kernel cache). `warmup`
//! runs a plan's first steps to fill that cache ahead of a run
//! (`kernel_cache`, `shapes`; docs/cold-start.md).
//!
//! Data parallelism runs over processes and, within a process, over its
//! devices, one thread each (`distributed`: burn-collective's all-reduce of
//! the gradients before every optimizer step; `execute_ranks`); the plan's
//! `data` must equal processes × devices.
//!
//! What this executor does not do is an error before anything runs
//! (`check_plan`): tensor, pipeline or context parallelism, offload of
//! gradients or activations, offload to NVMe, mixture of experts, optimizers
//! Burn lacks (8-bit Adam is rcoa's own: `optim::adam8bit`).

pub mod chat;
pub mod checkpoint;
pub mod data;
pub mod device_check;
pub mod distributed;
pub mod eval;
mod in_backward;
pub mod kernel_cache;
pub mod kernel_profile;
pub mod kernels;
pub mod loss;
pub mod loss_chunked;
pub mod loss_scale;
pub mod memory;
pub mod model;
pub mod ops;
pub mod optim;
pub mod pool;
pub mod prebuild;
pub mod quant;
pub mod rope;
pub mod setup;
pub mod shapes;
pub mod shard;
pub mod testing;
pub mod tokenizer;
pub mod train;
pub mod warmup;
pub mod weights;

#[cfg(feature = "cuda")]
pub mod cuda;

use data::{Batcher, Source};
use memory::MemoryProbe;
use ops::ExecAutodiff;
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::{AdapterKind, Arch, Loss, Positions};
use std::path::PathBuf;
use train::{StepReport, Trainer, TrainerConfig};

/// Why a run could not start or stopped.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum RunError {
    #[error("{0}")]
    #[diagnostic(code(rcoa::run_unsupported), help("change the plan, or run it on an engine that supports this (`target pytorch` plans are for PyTorch engines)"))]
    Unsupported(String),
    #[error("{0}")]
    #[diagnostic(code(rcoa::run_data))]
    Data(String),
    #[error("{0}")]
    #[diagnostic(code(rcoa::run_checkpoint))]
    Checkpoint(String),
    #[error("{0}")]
    #[diagnostic(
        code(rcoa::weights),
        help("the Hugging Face checkpoint beside the config must be the model the config describes (same family, sizes and tying)")
    )]
    Weights(String),
    #[error("{0}")]
    #[diagnostic(code(rcoa::cuda_unavailable), help("install the NVIDIA driver and the CUDA toolkit (NVRTC and headers), set CUDA_PATH, or use `--device cpu`"))]
    CudaUnavailable(String),
    #[error("this rcoa was built without CUDA support")]
    #[diagnostic(
        code(rcoa::cuda_not_built),
        help("rebuild with `cargo build --release --features cuda`, or use `--device cpu`")
    )]
    CudaNotBuilt,
    #[error("the backend failed: {0}")]
    #[diagnostic(code(rcoa::backend_failed))]
    Backend(String),
    #[error("{0}")]
    #[diagnostic(
        code(rcoa::collective),
        help("look at the other ranks' output: one may have died or hung; if they were only slow (a cold kernel cache compiles for minutes in the first step), raise --collective-timeout")
    )]
    Collective(String),
    #[error("{0}")]
    #[diagnostic(
        code(rcoa::distributed),
        help("the plan's `data` must equal --nodes × --devices; one process with --devices N needs no orchestrator; over processes, start `rcoa orchestrate --port P` first, give every process the same --nodes, --devices and --orchestrator, distinct --node-rank and --node-address")
    )]
    Distributed(String),
    #[error("{0}")]
    #[diagnostic(
        code(rcoa::prebuild),
        help("`--compile-jobs 1` compiles the kernels in the steps themselves, without compiling ahead")
    )]
    Prebuild(String),
    #[error("the loss is {loss} at step {step}: training diverged")]
    #[diagnostic(
        code(rcoa::diverged),
        help("lower optimizer.lr, or use fp32/bf16 rather than fp16")
    )]
    Diverged { step: u64, loss: f64 },
    #[error("the fp16 gradients are not finite at step {step} even at loss scale {scale}: training diverged")]
    #[diagnostic(
        code(rcoa::diverged),
        help("an fp16 activation or gradient overflows whatever the scale: lower optimizer.lr, or use bf16 (fp32's range) where the GPU has it")
    )]
    GradientsNotFinite { step: u64, scale: f64 },
}

/// Refuse what this executor cannot carry out faithfully, run as one process.
pub fn check_plan(plan: &LoweredPlan) -> Result<(), RunError> {
    check_plan_ranks(plan, 1)
}

/// This machine's free memory: `MemAvailable` of `/proc/meminfo` (Linux);
/// `None` where it cannot be read.
pub fn host_memory_available() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Refuse to start an offloaded run on a host with less free memory
/// (`available`, see `host_memory_available`) than the executor will put
/// there (`need`, this process's ranks together: `shard::Zero::host_bytes`,
/// `shard::zero3::Zero3::host_bytes`).
/// The plan's `hardware.host_memory` (what the compiler assumed per node) is
/// named in the error.
pub fn check_host_memory(
    plan: &LoweredPlan,
    need: u64,
    available: Option<u64>,
) -> Result<(), RunError> {
    let Some(free) = available else {
        return Ok(());
    };
    if need <= free {
        return Ok(());
    }
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let assumed = plan
        .hardware
        .host_memory_bytes
        .map(|b| {
            format!(
                "; the plan assumed {:.1} GiB per node (hardware.host_memory)",
                gib(b)
            )
        })
        .unwrap_or_default();
    Err(RunError::Unsupported(format!(
        "the offloaded state (optimizer, parameters, checkpointed activations) needs {:.2} GiB of host memory on this machine, which has {:.2} GiB available \
         (MemAvailable){assumed}: free memory, or run fewer ranks per process",
        gib(need),
        gib(free)
    )))
}

/// Refuse what this executor cannot carry out faithfully with `ranks`
/// data-parallel ranks (one device each: processes × devices per process).
pub fn check_plan_ranks(plan: &LoweredPlan, ranks: u64) -> Result<(), RunError> {
    let r = &plan.resolved;
    let u = |s: String| Err(RunError::Unsupported(s));
    let model_parallel = r.tensor * r.pipeline * r.context;
    if model_parallel > 1 {
        return u(format!(
            "the plan splits the model over {model_parallel} GPUs (tensor {} × pipeline {} × context {}); `rcoa run` executes data parallelism only",
            r.tensor, r.pipeline, r.context
        ));
    }
    if r.data != ranks {
        return Err(RunError::Distributed(if ranks == 1 {
            format!(
                "the plan is data-parallel over {} GPUs; run its ranks as devices of one process (`rcoa run PLAN --devices {}`), \
                 or as processes: `rcoa orchestrate --port P`, then `rcoa run PLAN --nodes M --node-rank R --devices N \
                 --orchestrator HOST:P --node-address HOST:PORT` for R in 0..M, with M × N = {}",
                r.data, r.data, r.data
            )
        } else {
            format!(
                "the plan's data parallelism is {} but the run has {ranks} data-parallel ranks \
                 (--nodes × --devices): every device is one rank",
                r.data
            )
        }));
    }
    if r.zero > 3 {
        return u(format!(
            "ZeRO stage {} does not exist: the stages are 0, 1, 2 and 3",
            r.zero
        ));
    }
    let optimizer_on_host =
        shard::layout::offloads(plan, rcoa_compiler::spec::OffloadWhat::Optimizer);
    for o in &r.offload {
        use rcoa_compiler::spec::{OffloadTo, OffloadWhat};
        match (o.what, o.to) {
            (OffloadWhat::Grads, OffloadTo::Cpu) if optimizer_on_host => {}
            (OffloadWhat::Optimizer | OffloadWhat::Params | OffloadWhat::Activations, OffloadTo::Cpu) => {}
            (OffloadWhat::Optimizer | OffloadWhat::Params | OffloadWhat::Activations, OffloadTo::Nvme) => {
                return u(format!(
                    "the plan offloads {o} to NVMe; the Burn executor offloads the optimizer, the parameters and checkpointed \
                     activations to host memory only (`offload = [optimizer, params, activations]`)"
                ))
            }
            (OffloadWhat::Grads, OffloadTo::Cpu) => {
                return u(format!(
                    "the plan offloads {o} without the optimizer; the Burn executor keeps the gradient accumulator in host \
                     memory for the host optimizer to step from, so it offloads gradients only beside the optimizer \
                     (`offload = [optimizer, grads]`)"
                ))
            }
            (OffloadWhat::Grads, OffloadTo::Nvme) => {
                return u(format!(
                    "the plan offloads {o} to NVMe; the Burn executor offloads the optimizer, the parameters, the gradients \
                     and checkpointed activations to host memory only (`offload = [optimizer, grads]`)"
                ))
            }
        }
    }
    if let Some(a) = &plan.adapter {
        // QLoRA runs (`model`: NF4 bases); its base is nf4 or the plan does
        // not resolve, so this guards a hand-written lowered plan.
        if a.kind == AdapterKind::Qlora && a.base != rcoa_compiler::spec::Dtype::Nf4 {
            return u(format!(
                "QLoRA with a `{}` base: the Burn executor stores QLoRA's frozen base as nf4 only",
                a.base.as_str()
            ));
        }
    }
    let m = &plan.model;
    if m.experts > 1 {
        return u(format!(
            "mixture of experts ({} experts) is not executed by the Burn executor",
            m.experts
        ));
    }
    if m.heads == 0 || m.kv_heads == 0 || !m.heads.is_multiple_of(m.kv_heads) || m.head_dim == 0 {
        return u(format!(
            "heads {} must be a positive multiple of kv_heads {}",
            m.heads, m.kv_heads
        ));
    }
    if m.positions == Positions::Rope && !m.head_dim.is_multiple_of(2) {
        return u(format!("RoPE needs an even head_dim, not {}", m.head_dim));
    }
    if m.positions == Positions::Learned && plan.train.seq_len > m.max_positions {
        return u(format!(
            "seq_len {} exceeds the learned positions ({})",
            plan.train.seq_len, m.max_positions
        ));
    }
    if plan.train.loss == Loss::CausalLm && m.arch == Arch::Encoder {
        return u(
            "a causal LM loss on an encoder (bidirectional attention) would see the answer".into(),
        );
    }
    if plan.train.loss == Loss::Contrastive {
        let grouped = plan.train.positives + plan.train.negatives > 0;
        if grouped && plan.train.positives == 0 {
            return u(
                "contrastive training with negatives needs at least one positive per anchor".into(),
            );
        }
        if !grouped && r.micro_batch < 2 {
            return u("contrastive training with in-batch pairs needs micro_batch >= 2".into());
        }
    }
    if r.micro_batch == 0 || plan.train.seq_len == 0 {
        return u("micro_batch and seq_len must be positive".into());
    }
    Ok(())
}

/// How to run, besides the plan.
#[derive(Clone, Debug, Default)]
pub struct RunOptions {
    pub steps: u64,
    pub seed: u64,
    /// Train on this file instead of synthetic tokens: plain text, or JSONL
    /// documents / pairs (`data::files`).
    pub data: Option<PathBuf>,
    /// The folder whose `tokenizer.json` encodes text (a Hugging Face
    /// config's folder); `None`: the folder of the plan's weights, if any.
    pub tokenizer: Option<PathBuf>,
    /// Held-out data (`eval`): its loss before the first step, every
    /// `eval_every` steps and after the last.
    pub eval: Option<PathBuf>,
    pub eval_every: Option<u64>,
    /// Save a checkpoint here every `save_every` steps and at the end.
    pub save: Option<PathBuf>,
    pub save_every: Option<u64>,
    /// How `save` writes Hugging Face weights (merged LoRA, shard size).
    pub hf_save: weights::SaveOptions,
    pub resume: Option<PathBuf>,
    /// Data parallel: this process's place among the processes, its devices
    /// (one rank each) and the collective's timeouts. `None`: one rank.
    pub distributed: Option<distributed::Distributed>,
}

/// What the run tells its caller as it goes.
#[derive(Clone, Debug)]
pub enum Event {
    /// Built and about to train.
    Started(Started),
    /// The first step may compile kernels (CUDA): `cold`, the kernel cache
    /// `dir` was empty; it holds `entries` (`kernel_cache::count_entries`).
    Compiling {
        cold: bool,
        dir: PathBuf,
        entries: u64,
    },
    Step(StepReport),
    Saved {
        step: u64,
        dir: PathBuf,
    },
    /// The held-out loss (`RunOptions::eval`) after `step` optimizer steps.
    Eval(eval::EvalReport),
}

#[derive(Clone, Debug)]
pub struct Started {
    pub device: String,
    pub params: u64,
    pub trainable: u64,
    pub precision: String,
    pub precision_note: Option<String>,
    pub checkpointed_layers: usize,
    pub layers: usize,
    pub micro_batch: u64,
    pub grad_accum: u64,
    pub data: String,
    /// First step to run (1-based): > 1 after `--resume`.
    pub first_step: u64,
    pub memory_measure: String,
    /// The ZeRO stage executed (0: Burn's optimizer on every rank).
    pub zero: u8,
    /// What is offloaded, as the plan writes it (`optimizer:cpu`).
    pub offload: Vec<String>,
    /// The optimizer steps each unit as the backward leaves it (`optimizer.in_backward`).
    pub in_backward: bool,
    /// The batch shapes this rank will compute, in the order they first
    /// run (`shapes::of_run`): each compiles kernels on CUDA the first time.
    pub shapes: Vec<shapes::Shape>,
}

/// The end of a run.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Summary {
    pub steps: u64,
    pub first_loss: f64,
    pub last_loss: f64,
    pub first_step_seconds: f64,
    /// Median step time excluding the first step (compilation, warm-up).
    pub steady_step_seconds: f64,
    pub tokens_per_second: f64,
    pub measured_peak_bytes: u64,
    pub measured_reserved_bytes: Option<u64>,
    pub predicted_peak_bytes: u64,
    /// The plan's highest bytes in use, transients inside the sampled segments included
    /// (`Prediction::in_use_max_bytes`): what `measured_reserved_bytes` is held to, since
    /// the sampled peak misses those transients. 0 where the plan does not say.
    pub predicted_in_use_max_bytes: u64,
    /// (measured - predicted) / predicted.
    pub peak_error: f64,
    pub memory_measure: String,
    /// `Trainer::param_checksum` after the last step (equal on every
    /// data-parallel rank).
    pub param_checksum: f64,
    /// `param_checksum` of every rank this process drove (`--devices`), in
    /// local order; `execute_ranks` refuses to finish unless they are equal.
    pub local_param_checksums: Vec<f64>,
    /// fp16's loss scale at the last step (`loss_scale`); `None` without fp16.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Steps of this process whose fp16 gradients overflowed, so the optimizer
    /// skipped them (a resumed run counts from its resume).
    pub skipped_steps: u64,
    /// The held-out loss after the last step (`RunOptions::eval`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// With `kernel_profile::select(true)` on CUDA: each step's kernels and
    /// their GPU times, or why they could not be timed.
    #[serde(skip)]
    pub kernel_steps: Option<Result<Vec<kernel_profile::StepKernels>, String>>,
}

/// The tokenizer of a plan: `tokenizer.json` in `opts.tokenizer`, else
/// beside the plan's weights; byte tokens without one.
pub fn tokenizer(
    plan: &LoweredPlan,
    opts: &RunOptions,
) -> Result<tokenizer::TextTokenizer, RunError> {
    let dir = opts
        .tokenizer
        .clone()
        .or_else(|| plan.model.weights.as_ref().map(PathBuf::from));
    tokenizer::TextTokenizer::from_dir(dir.as_deref(), plan.model.vocab)
}

/// Build the batcher for a plan.
pub fn batcher(plan: &LoweredPlan, opts: &RunOptions) -> Result<Batcher, RunError> {
    let seq = plan.train.seq_len as usize;
    let grouped =
        plan.train.loss == Loss::Contrastive && plan.train.positives + plan.train.negatives > 0;
    let group = if grouped {
        (1 + plan.train.positives + plan.train.negatives) as usize
    } else {
        2
    };
    let ranks = opts.distributed.as_ref().map_or(1, |d| d.ranks());
    let micro_batch = plan.resolved.micro_batch as usize;
    let mut mask_id = None;
    let source = match &opts.data {
        Some(p) => {
            let tok = tokenizer(plan, opts)?;
            if let tokenizer::TextTokenizer::Hf(t) = &tok {
                mask_id = t.mask;
            }
            let per_rank = match plan.train.loss {
                Loss::Contrastive if grouped => micro_batch,
                Loss::Contrastive => micro_batch / 2,
                _ => micro_batch,
            };
            let spec = data::files::FileSpec {
                loss: plan.train.loss,
                seq,
                vocab: plan.model.vocab,
                positives: plan.train.positives as usize,
                negatives: plan.train.negatives as usize,
                batch_examples: per_rank * ranks as usize,
                assistant_only: plan.train.assistant_only_loss,
                packing: plan.train.packing,
            };
            Source::from_file(p, &spec, &tok)?
        }
        None => Source::Synthetic {
            vocab: plan.model.vocab,
        },
    };
    Ok(Batcher {
        source,
        seed: opts.seed,
        loss: plan.train.loss,
        micro_batch,
        seq,
        vocab: plan.model.vocab,
        group,
        positives: plan.train.positives as usize,
        grouped,
        rank: opts.distributed.as_ref().map_or(0, |d| d.rank()),
        ranks,
        grad_accum: plan.resolved.grad_accum.max(1),
        mask_id,
    })
}

/// Held while a rank seeds the backend and builds its model: Burn's random
/// number generators (ndarray's, CubeCL's) are one per process, not per
/// device, so ranks in threads that initialised at the same time would draw
/// from one stream and start with different weights.
static INIT: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// Train `plan` for `opts.steps` steps on backend `B`: the body of one
/// data-parallel rank (`opts.distributed`'s `local` device of this process),
/// or of the only one. `execute_ranks` runs it once per device; with `built`
/// the threads of one process wait there after building their models, so that
/// no rank starts training (which reseeds the shared generator when dropout is
/// on) while another still initialises.
#[allow(clippy::too_many_arguments)]
fn execute<B: ExecAutodiff>(
    plan: &LoweredPlan,
    opts: &RunOptions,
    device: B::Device,
    device_name: String,
    sixteen_bit: bool,
    probe: &mut dyn MemoryProbe,
    on_event: &mut dyn FnMut(Event),
    built: Option<&std::sync::Barrier>,
) -> Result<Summary, RunError> {
    let ranks = opts.distributed.as_ref().map_or(1, |d| d.ranks());
    check_plan_ranks(plan, ranks)?;
    let batcher = batcher(plan, opts)?;
    let data = batcher.source.describe();
    let eval_set = match &opts.eval {
        Some(p) => Some(eval::EvalSet::load(plan, p, &tokenizer(plan, opts)?)?),
        None => None,
    };
    // Join before building the model: a rank that cannot join fails fast.
    let collective = match &opts.distributed {
        Some(d) => Some(distributed::Collective::<B::InnerBackend>::register(
            d, &device,
        )?),
        None => None,
    };
    // The collective moves into the trainer; this handle names the step in
    // timeout errors and says when the run is complete.
    let progress = collective.as_ref().map(|c| c.progress());
    let mut trainer = {
        let _init = INIT.lock().unwrap_or_else(|e| e.into_inner());
        Trainer::<B>::new(
            plan,
            TrainerConfig {
                seed: opts.seed,
                batcher,
                sixteen_bit,
                collective,
            },
            device,
        )?
    };
    if let Some(b) = built {
        b.wait();
    }
    if eval_set.is_some() && trainer.zero3().is_some() {
        // Rank 0 alone evaluates, and with the weights sharded at rest it
        // would need every rank's gather: refused rather than hung.
        return Err(RunError::Unsupported(
            "--eval with ZeRO-3 or parameter offload: the weights are sharded at rest and rank 0 evaluates alone; evaluate a saved checkpoint with `rcoa eval`, or train with zero = 2 and nothing offloaded but the optimizer"
                .into(),
        ));
    }
    trainer.set_hf_save(opts.hf_save)?;
    if let Some(dir) = &opts.resume {
        trainer.resume(dir)?;
        // ZeRO 1/2/3, offloads: this rank's shards beside it.
        shard::checkpoint::load_shard(&mut trainer, dir)?;
    }
    let (params, trainable) = trainer.param_counts();
    // The ranks hold equal weights: global rank 0 alone writes checkpoints
    // and evaluates.
    let writer = opts.distributed.as_ref().is_none_or(|d| d.rank() == 0);
    on_event(Event::Started(Started {
        device: device_name,
        params,
        trainable,
        precision: trainer.precision.describe(),
        precision_note: trainer.precision_note.clone(),
        checkpointed_layers: trainer.checkpointed.iter().filter(|&&c| c).count(),
        layers: trainer.checkpointed.len(),
        micro_batch: plan.resolved.micro_batch,
        grad_accum: trainer.grad_accum,
        data,
        first_step: trainer.step + 1,
        memory_measure: distributed::Distributed::describe_measure(
            opts.distributed.as_ref(),
            probe.what(),
            probe.peak_reserved().is_none(),
        ),
        zero: shard::executed_stage(trainer.zero(), trainer.zero3()),
        offload: trainer.executed_offload(),
        in_backward: trainer.steps_in_backward(),
        shapes: shapes::of_run(&trainer.batcher, eval_set.as_ref().filter(|_| writer)),
    }));
    let mut reports = Vec::new();
    let eval_set = eval_set.filter(|_| writer);
    let mut eval_loss = None;
    if let Some(set) = &eval_set {
        let r = eval::report(&trainer, set)?;
        eval_loss = Some(r.eval_loss);
        on_event(Event::Eval(r));
    }
    while trainer.step < opts.steps {
        if let Some(p) = &progress {
            p.set_step(trainer.step + 1);
        }
        let r = trainer.train_step(probe)?;
        on_event(Event::Step(r.clone()));
        reports.push(r);
        if let Some(dir) = opts.save.as_ref() {
            let due = opts
                .save_every
                .is_some_and(|n| n > 0 && trainer.step % n == 0)
                || trainer.step == opts.steps;
            if due {
                // Rank 0 writes the model (gathered by every rank with
                // ZeRO-3), every rank its optimizer shard beside it.
                shard::checkpoint::save(&mut trainer, dir, writer)?;
                if writer {
                    on_event(Event::Saved {
                        step: trainer.step,
                        dir: dir.clone(),
                    });
                }
            }
        }
        if let Some(set) = &eval_set {
            let due = trainer.step == opts.steps
                || opts
                    .eval_every
                    .is_some_and(|n| n > 0 && trainer.step % n == 0);
            if due {
                let r = eval::report(&trainer, set)?;
                eval_loss = Some(r.eval_loss);
                on_event(Event::Eval(r));
            }
        }
    }
    let mut summary = summarize(plan, &reports, probe);
    summary.memory_measure = distributed::Distributed::describe_measure(
        opts.distributed.as_ref(),
        probe.what(),
        probe.peak_reserved().is_none(),
    );
    summary.param_checksum = trainer.param_checksum()?;
    summary.local_param_checksums = vec![summary.param_checksum];
    summary.eval_loss = eval_loss;
    if let Some(p) = &progress {
        p.set_done();
    }
    Ok(summary)
}

/// One device of this process: where its rank trains and how it is named.
pub struct LocalDevice<D> {
    pub device: D,
    pub name: String,
}

/// Makes a rank's memory probe on its device, in the rank's thread, before
/// the model (its baseline excludes the weights).
pub type ProbeFactory<D> = fn(&D) -> Box<dyn MemoryProbe>;

enum RankMessage {
    Event(Box<Event>),
    Done(u32, Box<Result<Summary, RunError>>),
}

/// Train with every data-parallel rank this process drives: `devices[i]` is
/// local rank `i` (`opts.distributed.devices` of them; one without
/// `opts.distributed`). Each rank runs `execute` (the same body as a
/// one-device process) in its own thread with its own trainer and model.
///
/// Local rank 0 reports the events; its summary is the run's (its device's
/// measured peak). The ranks must end with equal weights (checked). The
/// first rank to fail ends the run with its error, also when the others are
/// blocked in an all-reduce waiting for it: their threads are left behind
/// (not joined), and end with the process. A panic in a rank becomes an
/// error.
pub fn execute_ranks<B: ExecAutodiff>(
    plan: &LoweredPlan,
    opts: &RunOptions,
    mut devices: Vec<LocalDevice<B::Device>>,
    sixteen_bit: bool,
    probe: ProbeFactory<B::Device>,
    on_event: &mut dyn FnMut(Event),
) -> Result<Summary, RunError> {
    let n = opts.distributed.as_ref().map_or(1, |d| d.devices);
    if devices.len() != n as usize {
        return Err(RunError::Backend(format!(
            "{} devices for {n} local ranks",
            devices.len()
        )));
    }
    if n == 1 {
        // One rank: on this thread, as a single-device process always ran.
        let Some(LocalDevice { device, name }) = devices.pop() else {
            return Err(RunError::Backend("no device".into()));
        };
        let mut probe = probe(&device);
        return execute::<B>(
            plan,
            opts,
            device,
            name,
            sixteen_bit,
            probe.as_mut(),
            on_event,
            None,
        );
    }
    // Refuse a bad plan once, before any thread starts.
    check_plan_ranks(plan, opts.distributed.as_ref().map_or(1, |d| d.ranks()))?;
    let plan = std::sync::Arc::new(plan.clone());
    let built = std::sync::Arc::new(std::sync::Barrier::new(n as usize));
    let (tx, rx) = std::sync::mpsc::channel::<RankMessage>();
    for (local, LocalDevice { device, name }) in (0u32..).zip(devices) {
        let mut opts = opts.clone();
        let global = match opts.distributed.as_mut() {
            Some(d) => {
                d.local = local;
                d.rank()
            }
            None => 0,
        };
        let (plan, tx, built) = (plan.clone(), tx.clone(), built.clone());
        let body = move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut probe = probe(&device);
                let mut report = |e: Event| {
                    if local == 0 {
                        let _ = tx.send(RankMessage::Event(Box::new(e)));
                    }
                };
                execute::<B>(
                    &plan,
                    &opts,
                    device,
                    name,
                    sixteen_bit,
                    probe.as_mut(),
                    &mut report,
                    Some(&built),
                )
            }))
            .unwrap_or_else(|p| {
                Err(RunError::Backend(format!(
                    "rank {global} panicked: {}",
                    distributed::panic_text(p.as_ref())
                )))
            });
            let _ = tx.send(RankMessage::Done(local, Box::new(result)));
        };
        std::thread::Builder::new()
            .name(format!("rcoa-rank-{global}"))
            // As much stack as the main thread gets, and more: the backward
            // pass of a deep model recurses.
            .stack_size(64 << 20)
            .spawn(body)
            .map_err(|e| RunError::Backend(format!("cannot start rank {global}'s thread: {e}")))?;
    }
    drop(tx);
    let mut summaries: Vec<Option<Summary>> = (0..n).map(|_| None).collect();
    let mut left = n;
    while left > 0 {
        match rx.recv() {
            Ok(RankMessage::Event(e)) => on_event(*e),
            Ok(RankMessage::Done(local, result)) => {
                // The first failure ends the run; ranks blocked in a
                // collective waiting for the failed one are not waited for.
                summaries[local as usize] = Some((*result)?);
                left -= 1;
            }
            Err(_) => {
                return Err(RunError::Backend(
                    "a rank's thread ended without a result".into(),
                ))
            }
        }
    }
    let summaries: Vec<Summary> = summaries.into_iter().flatten().collect();
    let checksums: Vec<f64> = summaries.iter().map(|s| s.param_checksum).collect();
    if checksums
        .iter()
        .any(|c| c.to_bits() != checksums[0].to_bits())
    {
        return Err(RunError::Backend(format!(
            "the ranks of this process ended with different weights (parameter checksums {checksums:?}): \
             the all-reduce did not keep them equal"
        )));
    }
    let mut lead = summaries
        .into_iter()
        .next()
        .ok_or_else(|| RunError::Backend("no rank reported".into()))?;
    lead.local_param_checksums = checksums;
    Ok(lead)
}

fn summarize(plan: &LoweredPlan, reports: &[StepReport], probe: &dyn MemoryProbe) -> Summary {
    let first = reports.first();
    let mut steady: Vec<&StepReport> = reports.iter().skip(1).collect();
    if steady.is_empty() {
        steady = reports.iter().collect();
    }
    let mut times: Vec<f64> = steady.iter().map(|r| r.step_seconds).collect();
    times.sort_by(|a, b| a.total_cmp(b));
    let median = times.get(times.len() / 2).copied().unwrap_or(0.0);
    let tokens = first.map(|r| r.tokens).unwrap_or(0);
    let predicted = plan.prediction.peak_bytes;
    let measured = probe.peak();
    Summary {
        steps: reports.len() as u64,
        first_loss: first.map(|r| r.loss).unwrap_or(f64::NAN),
        last_loss: reports.last().map(|r| r.loss).unwrap_or(f64::NAN),
        first_step_seconds: first.map(|r| r.step_seconds).unwrap_or(0.0),
        steady_step_seconds: median,
        tokens_per_second: if median > 0.0 {
            tokens as f64 / median
        } else {
            0.0
        },
        measured_peak_bytes: measured,
        measured_reserved_bytes: probe.peak_reserved(),
        predicted_peak_bytes: predicted,
        predicted_in_use_max_bytes: plan.prediction.in_use_max_bytes,
        peak_error: if predicted > 0 {
            (measured as f64 - predicted as f64) / predicted as f64
        } else {
            f64::NAN
        },
        memory_measure: probe.what().to_string(),
        loss_scale: reports.last().and_then(|r| r.loss_scale),
        skipped_steps: reports.iter().filter(|r| r.skipped.is_some()).count() as u64,
        param_checksum: f64::NAN,
        local_param_checksums: Vec::new(),
        eval_loss: None,
        kernel_steps: None,
    }
}

/// The CPU executor: `Autodiff<NdArray<f32>>`. The probe is created before
/// the model so its baseline excludes the weights. With several local ranks
/// (`--devices N`) every rank trains on the one CPU device, in its own
/// thread; the RSS measured is the process's, holding all of them.
pub fn run_cpu(
    plan: &LoweredPlan,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<Summary, RunError> {
    run_cpu_probed(plan, opts, |_| memory::cpu_probe(), on_event)
}

/// The CPU executor's instantiation.
pub(crate) type Cpu = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

/// `run_cpu` with each rank's probe from `probe` (`warmup` reports progress
/// through it).
pub(crate) fn run_cpu_probed(
    plan: &LoweredPlan,
    opts: &RunOptions,
    probe: ProbeFactory<burn::backend::ndarray::NdArrayDevice>,
    on_event: &mut dyn FnMut(Event),
) -> Result<Summary, RunError> {
    let n = opts.distributed.as_ref().map_or(1, |d| d.devices);
    let devices = (0..n)
        .map(|i| LocalDevice {
            device: Default::default(),
            name: if n == 1 {
                "cpu (ndarray)".into()
            } else {
                format!("cpu (ndarray), {n} ranks in threads, this is local rank {i}")
            },
        })
        .collect();
    execute_ranks::<Cpu>(plan, opts, devices, false, probe, on_event)
}

/// The CUDA executor, or an error saying this build has none.
pub fn run_cuda(
    plan: &LoweredPlan,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<Summary, RunError> {
    #[cfg(feature = "cuda")]
    {
        cuda::run(plan, opts, on_event)
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (plan, opts, on_event);
        Err(RunError::CudaNotBuilt)
    }
}

/// Whether this build can run on CUDA.
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

#[cfg(test)]
mod tests;
