//! `rcoa run`: train with a lowered plan on Burn (CPU or CUDA) and report the
//! measured step time and peak memory beside the compiler's prediction.
//!
//! The plan comes from a `.plan` file (parsed, resolved and compiled here) or
//! from `--lowered FILE.json` (a serialized `LoweredPlan`, e.g. written by
//! another tool). Text mode shows a progress bar (on CUDA, before the first
//! pass of each shape the kernel cache lacks, a line saying it compiles and a
//! spinner: `compile_notice`); JSON mode prints one object per step and a
//! final summary, one per line, on stdout. Exit status: 0 done,
//! 1 the run failed while training (divergence, backend failure), 2 bad plan,
//! bad usage, or an unavailable device.
//!
//! Data parallelism: `--devices N` trains N ranks in one process, one thread
//! and one device each (GPUs 0..N; on the CPU all on the one CPU device), no
//! orchestrator needed. Over processes (`--nodes M --node-rank R
//! --orchestrator HOST:PORT --node-address HOST:PORT`, after `rcoa
//! orchestrate`) each process contributes its `--devices` ranks; global rank
//! = R × N + local index, and the plan's `data` must equal M × N. Process 0
//! alone shows the progress and writes the report and checkpoints (its local
//! rank 0 does); in JSON mode every process prints the lines of its local
//! rank 0 with `"rank"` (its global rank), so a launcher can gather them.
//! A collective call that waits longer than `--collective-timeout` ends the
//! run with an error instead of hanging (burn-collective has no timeout).

use rcoa_backend::distributed::{Distributed, Network, Timeouts};
use rcoa_backend::{Event, RunError, RunOptions, Summary};
use rcoa_compiler::lowered::LoweredPlan;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Device {
    Cpu,
    Cuda,
}

pub use super::common::Format;

/// CubeCL's autotune level (`docs/cold-start.md`): how coarsely shapes are
/// bucketed into tuning keys, so how many tunings a run does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Autotune {
    Minimal,
    Balanced,
    Extensive,
    Full,
}

impl Autotune {
    pub fn level(self) -> rcoa_backend::kernel_cache::AutotuneLevel {
        use rcoa_backend::kernel_cache::AutotuneLevel as L;
        match self {
            Autotune::Minimal => L::Minimal,
            Autotune::Balanced => L::Balanced,
            Autotune::Extensive => L::Extensive,
            Autotune::Full => L::Full,
        }
    }
}

#[derive(clap::Args)]
pub struct Args {
    /// The `.plan` file to compile and run.
    #[arg(required_unless_present = "lowered")]
    plan: Option<PathBuf>,
    /// Run a serialized LoweredPlan (JSON) instead of compiling a `.plan`.
    #[arg(long, value_name = "FILE.json", conflicts_with = "plan")]
    lowered: Option<PathBuf>,
    /// Optimizer steps to train (in total, counting those before `--resume`).
    #[arg(long)]
    steps: u64,
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// CubeCL's memory pools on CUDA: `compact` (the default: pages that do not grow with
    /// the card; what `target burn`'s `fits` assumes), `expandable` (one heap of address
    /// space, backed by device memory as it is used: the least measured, one device per
    /// process) or `cubecl` (CubeCL's own, which reserve more; docs/memory-pool.md).
    #[arg(long, value_name = "POOL")]
    memory_pool: Option<rcoa_backend::pool::PoolChoice>,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
    /// Train on this file instead of synthetic tokens: JSONL `{"text": …}` documents,
    /// JSONL pairs `{"query": …, "positive": …}` (contrastive), or plain text (docs/data.md).
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// Held-out data: its loss (`eval_loss`) before the first step, every --eval-every
    /// steps and after the last (as `rcoa eval` computes it).
    #[arg(long, value_name = "FILE")]
    eval: Option<PathBuf>,
    #[arg(long, value_name = "N", requires = "eval")]
    eval_every: Option<u64>,
    /// Save model and optimizer state here (atomically) at the end, and every `--save-every` steps.
    #[arg(long, value_name = "DIR")]
    save: Option<PathBuf>,
    #[arg(long, value_name = "N", requires = "save")]
    save_every: Option<u64>,
    /// With `adapter lora`: --save writes the LoRA merged into full Hugging Face weights
    /// (config, model.safetensors, tokenizer) instead of a PEFT adapter.
    #[arg(long, requires = "save")]
    merge_lora: bool,
    /// Shard the Hugging Face weights --save writes above this size, as `transformers`
    /// does (`5GB`, `200MB`, `64KB`: decimal units, or bytes). [default: 5GB]
    #[arg(long, value_name = "SIZE", requires = "save", value_parser = shard_size)]
    max_shard_size: Option<u64>,
    /// Continue from a checkpoint written by `--save`.
    #[arg(long, value_name = "DIR")]
    resume: Option<PathBuf>,
    /// Seed of the initialisation, the data and dropout.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Also write a self-contained HTML report of the run (measured beside predicted).
    #[arg(long, value_name = "FILE")]
    report: Option<PathBuf>,
    /// Data parallel within this process: train N ranks, one thread and one device each
    /// (CUDA: GPUs 0..N; CPU: all on the CPU). Without --nodes it must equal the plan's `data`.
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    devices: u32,
    /// Data parallel over processes: the number of processes, each with --devices ranks;
    /// processes × devices must equal the plan's `data`.
    #[arg(long, value_name = "N", requires_all = ["node_rank", "orchestrator", "node_address"])]
    nodes: Option<u32>,
    /// This process's index, 0..N (its ranks are R × devices + 0..devices).
    #[arg(long, value_name = "R", requires = "nodes")]
    node_rank: Option<u32>,
    /// The `rcoa orchestrate` server every rank joins.
    #[arg(long, value_name = "HOST:PORT", requires = "nodes")]
    orchestrator: Option<String>,
    /// How the other ranks reach this one (its tensor data service).
    #[arg(long, value_name = "HOST:PORT", requires = "nodes")]
    node_address: Option<String>,
    /// Port the data service listens on (default: the port of --node-address).
    #[arg(long, value_name = "P", requires = "nodes")]
    data_port: Option<u16>,
    /// Stop with an error when joining the run or one all-reduce waits longer than this
    /// for the other ranks (a rank died or hung). [default: 1800 to join and for the first
    /// step, which may compile kernels; 600 afterwards]
    #[arg(long, value_name = "SECONDS")]
    collective_timeout: Option<u64>,
    /// CUDA: CubeCL's autotune level; coarser shape buckets tune fewer times
    /// (docs/cold-start.md). [default: CUBECL_AUTOTUNE_LEVEL, else balanced]
    #[arg(long, value_enum)]
    autotune: Option<Autotune>,
    /// CUDA: when the kernel cache holds nothing for this plan, first record the kernels the
    /// steps launch (running none) and compile them all, N at a time (a process each), instead
    /// of one at a time in the first step (docs/cold-start.md). 1: don't. [default: this
    /// machine's cores]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    compile_jobs: Option<u32>,
    /// CUDA: time every kernel on the GPU (CUDA events around each launch) and report where
    /// the steps' time goes: per family (matmul, attention, fused element-wise, ...) and the
    /// longest kernels, beside the plan's FLOPs. One rank only.
    #[arg(long)]
    profile_kernels: bool,
}

/// `--max-shard-size`: bytes, or a decimal size as `transformers` writes
/// `max_shard_size` (`5GB`, `200MB`, `64KB`).
fn shard_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (n, unit) = t.split_at(split);
    let n: u64 = n
        .parse()
        .map_err(|_| format!("`{s}` is not a size such as 5GB, 200MB or 65536"))?;
    let scale = match unit.trim().to_ascii_uppercase().as_str() {
        "" | "B" => 1,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        _ => return Err(format!("`{s}`: the unit must be B, KB, MB or GB")),
    };
    match n.checked_mul(scale) {
        Some(0) | None => Err(format!("`{s}` must be a positive size")),
        Some(b) => Ok(b),
    }
}

/// The data-parallel settings, when this run has more than one rank (or
/// joins an orchestrator).
fn distributed(args: &Args) -> Result<Option<Distributed>, RunError> {
    let timeouts = match args.collective_timeout {
        None => Timeouts::DEFAULT,
        Some(0) => {
            return Err(RunError::Distributed(
                "--collective-timeout must be at least 1 second".into(),
            ))
        }
        Some(s) => Timeouts::uniform(Duration::from_secs(s)),
    };
    let mut d = Distributed {
        nodes: 1,
        node_rank: 0,
        devices: args.devices,
        local: 0,
        network: None,
        timeouts,
    };
    if let (Some(nodes), Some(rank), Some(orchestrator), Some(node_address)) = (
        args.nodes,
        args.node_rank,
        args.orchestrator.clone(),
        args.node_address.clone(),
    ) {
        let port = node_address
            .rsplit_once(':')
            .and_then(|(_, p)| p.parse::<u16>().ok());
        let data_port = args.data_port.or(port).ok_or_else(|| {
            RunError::Distributed(format!("--node-address `{node_address}` has no port"))
        })?;
        d.nodes = nodes;
        d.node_rank = rank;
        d.network = Some(Network {
            orchestrator,
            node_address,
            data_port,
        });
    } else if args.devices == 1 {
        return Ok(None);
    }
    d.validate()?;
    Ok(Some(d))
}

/// The plan to run and, when it was compiled here, the compiler's count of
/// its matmul and attention FLOPs per optimizer step (every micro-batch).
fn load(args: &Args) -> Result<(LoweredPlan, Option<f64>), ExitCode> {
    if let Some(path) = &args.lowered {
        let text = std::fs::read_to_string(path).map_err(|e| {
            eprintln!("error: cannot read `{}`: {e}", path.display());
            ExitCode::from(2)
        })?;
        let plan: LoweredPlan = serde_json::from_str(&text).map_err(|e| {
            eprintln!("error: `{}` is not a lowered plan: {e}", path.display());
            ExitCode::from(2)
        })?;
        // A plan compiled for another engine may name what the executor does not build.
        rcoa_compiler::executed::check_lowered(&plan).map_err(|e| {
            eprintln!("error: {e}");
            ExitCode::from(2)
        })?;
        return Ok((plan, None));
    }
    let path = args.plan.as_ref().ok_or(ExitCode::from(2))?;
    let c = compile_plan(path)?;
    let flops = c.report.step_flops * c.lowered.resolved.grad_accum.max(1) as f64;
    Ok((c.lowered, Some(flops)))
}

/// Parse, resolve and compile a `.plan` file; diagnostics go to stderr (exit 2).
pub(crate) fn lower_plan(path: &std::path::Path) -> Result<LoweredPlan, ExitCode> {
    compile_plan(path).map(|c| c.lowered)
}

/// [`lower_plan`], keeping what the compiler found on the way.
fn compile_plan(path: &std::path::Path) -> Result<rcoa_compiler::compile::Compilation, ExitCode> {
    let mut loaded = super::common::load_spec(path)?;
    // `rcoa run` is the Burn executor: its decisions and prediction are `target burn`'s.
    let written = std::mem::replace(&mut loaded.spec.target, rcoa_compiler::spec::Target::Burn);
    if written != rcoa_compiler::spec::Target::Burn {
        eprintln!(
            "note: {} is compiled under the `burn` profile for rcoa's executor (its `target` is {})",
            path.display(),
            written.as_str()
        );
    }
    match rcoa_compiler::compile(&loaded.spec) {
        Ok(c) => Ok(c),
        Err(e) => {
            eprint!("{}", super::common::render(&e));
            Err(ExitCode::from(2))
        }
    }
}

/// The plan's file name (no directories: the report stays reproducible).
fn plan_name(args: &Args) -> String {
    let path = args.plan.as_ref().or(args.lowered.as_ref());
    path.and_then(|p| p.file_name())
        .map_or_else(|| "plan".to_string(), |n| n.to_string_lossy().into_owned())
}

/// burn-communication panics on its own threads (tokio workers) when a
/// peer's connection breaks (`Failed to receive message from websocket`),
/// and burn-collective's client then panics on a closed channel, which
/// `distributed::bounded` catches on its `rcoa-collective` threads; a
/// rank's thread (`rcoa-rank-N`) that panics is caught too. In each case
/// the run ends with an error that says what failed; the panic itself gets
/// one line on stderr instead of a panic report and a backtrace. Panics on
/// the main thread keep the default report.
pub(crate) fn quiet_collective_panics() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let thread = std::thread::current();
        let name = thread.name().unwrap_or("");
        if name == "main" || name.is_empty() {
            return default(info);
        }
        if name == "rcoa-collective" {
            return; // reported by the collective call's error
        }
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| payload.downcast_ref::<&str>().copied())
            .unwrap_or("unknown failure");
        let at = info
            .location()
            .map(|l| format!(" ({}:{})", l.file(), l.line()))
            .unwrap_or_default();
        eprintln!("rcoa run: failure on thread {name}{at}: {msg}");
    }));
}

pub(crate) fn print_diagnostic(e: &RunError) {
    eprintln!("{}", rcoa_grammar::render::render_plain(e));
}

fn mib(b: u64) -> String {
    format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64)
}

pub fn run(args: Args) -> ExitCode {
    let (plan, plan_flops) = match load(&args) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let dist = match distributed(&args) {
        Ok(d) => d,
        Err(e) => {
            print_diagnostic(&e);
            return ExitCode::from(2);
        }
    };
    if dist.is_some() {
        quiet_collective_panics();
    }
    if args.memory_pool.is_some() && args.device != Device::Cuda {
        eprintln!(
            "rcoa run: --memory-pool configures CubeCL's pools on CUDA; use it with --device cuda"
        );
        return ExitCode::from(2);
    }
    let memory_pool = args.memory_pool.unwrap_or_default();
    if memory_pool == rcoa_backend::pool::PoolChoice::Expandable && args.devices > 1 {
        // Its memory is mapped for its own device only: a copy between two devices of
        // one process (how their ranks meet) could not read it.
        eprintln!(
            "rcoa run: --memory-pool expandable maps memory for one device per process; with \
             --devices {} use `compact`, or one process per device (--nodes)",
            args.devices
        );
        return ExitCode::from(2);
    }
    if memory_pool == rcoa_backend::pool::PoolChoice::Cubecl {
        // `fits` assumed `compact`'s pages; CubeCL's own grow with the card.
        eprintln!(
            "note: --memory-pool cubecl reserves more than the plan's `fits` assumed (1.2-1.7 x \
             the bytes in use on an H100, up to 2.1 x on an H200, against compact's 1.15-1.30): \
             near the budget it can run out where the default pools would not"
        );
    }
    rcoa_backend::pool::select(memory_pool);
    if args.profile_kernels {
        let refused = if args.device != Device::Cuda {
            Err("--profile-kernels times CUDA kernels; use it with --device cuda".to_string())
        } else {
            rcoa_backend::kernel_profile::one_rank(args.devices)
        };
        if let Err(why) = refused {
            eprintln!("rcoa run: {why}");
            return ExitCode::from(2);
        }
        rcoa_backend::kernel_profile::select(true);
    }
    let ranks = dist.as_ref().map_or(1, |d| d.ranks());
    if let Err(e) = rcoa_backend::check_plan_ranks(&plan, ranks) {
        print_diagnostic(&e);
        return ExitCode::from(2);
    }
    let (nodes, devices) = dist.as_ref().map_or((1, 1), |d| (d.nodes, d.devices));
    // Process 0 (or the only one) talks to the user; the others are quiet in
    // text mode. Each process reports its local rank 0, whose JSON lines
    // carry its global rank.
    let rank = dist.as_ref().map(|d| d.rank());
    let lead = rank.is_none_or(|r| r == 0);
    let tag = |mut v: serde_json::Value| {
        if let Some(r) = rank {
            v["rank"] = r.into();
        }
        v
    };
    let opts = RunOptions {
        steps: args.steps,
        seed: args.seed,
        data: args.data.clone(),
        tokenizer: args
            .plan
            .as_ref()
            .and_then(|p| super::eval::hf_config_dir(p, &plan)),
        eval: args.eval.clone(),
        eval_every: args.eval_every,
        save: args.save.clone(),
        save_every: args.save_every,
        hf_save: rcoa_backend::weights::SaveOptions {
            merge_lora: args.merge_lora,
            max_shard_bytes: args
                .max_shard_size
                .unwrap_or(rcoa_backend::weights::DEFAULT_MAX_SHARD_BYTES),
        },
        resume: args.resume.clone(),
        distributed: dist,
    };
    let json = args.format == Format::Json;
    let text = !json && lead;
    rcoa_backend::kernel_cache::set_autotune(args.autotune.map(Autotune::level));
    let mut bar: Option<indicatif::ProgressBar> = None;
    let steps = args.steps;
    let mut device = String::new();
    let mut steps_seen: Vec<rcoa_compiler::report::StepRecord> = Vec::new();
    let mut notice = super::compile_notice::CompileNotice::new(&plan, ranks, text);
    let mut first_step_done = false;
    let mut on_event = |e: Event| match e {
        Event::Compiling { cold, dir, entries } => {
            notice.compiling(dir, entries);
            if json {
                println!(
                    "{}",
                    tag(serde_json::json!({ "event": "cuda_cache", "cold": cold }))
                );
            }
        }
        Event::Started(s) => {
            device = s.device.clone();
            if json {
                println!(
                    "{}",
                    tag(serde_json::json!({
                        "event": "start", "device": s.device, "params": s.params, "trainable_params": s.trainable,
                        "precision": s.precision, "precision_note": s.precision_note,
                        "checkpointed_layers": s.checkpointed_layers, "layers": s.layers,
                        "micro_batch": s.micro_batch, "grad_accum": s.grad_accum, "data": s.data,
                        "first_step": s.first_step, "memory_measure": s.memory_measure,
                        "ranks": ranks, "zero": s.zero, "offload": s.offload, "optimizer_in_backward": s.in_backward,
                        "weights": plan.model.weights,
                        "memory_pool": (args.device == Device::Cuda).then(|| memory_pool.as_str()),
                    }))
                );
            } else if text {
                eprintln!("device     {}", s.device);
                match &plan.model.weights {
                    Some(dir) => eprintln!("weights    from the Hugging Face checkpoint {dir}"),
                    None => eprintln!("weights    random initialisation"),
                }
                if ranks > 1 {
                    eprintln!(
                        "ranks      {ranks} data-parallel ranks: {nodes} process(es) × {devices} device(s) (gradients averaged by all-reduce each step; this is rank 0)"
                    );
                }
                eprintln!(
                    "model      {} parameters, {} trainable",
                    s.params, s.trainable
                );
                eprintln!("precision  {}", s.precision);
                if s.zero > 0 {
                    eprintln!("sharding   ZeRO stage {} over {ranks} rank(s)", s.zero);
                }
                if !s.offload.is_empty() {
                    eprintln!("offload    [{}] in host memory", s.offload.join(", "));
                }
                if s.in_backward {
                    eprintln!("optimizer  steps in the backward: each unit's parameters as the backward leaves it, so no whole set of gradients exists");
                }
                if let Some(n) = &s.precision_note {
                    eprintln!("note       {n}");
                }
                eprintln!(
                    "step       micro-batch {} × grad_accum {}; {} of {} layers recomputed in backward (segment recomputation)",
                    s.micro_batch, s.grad_accum, s.checkpointed_layers, s.layers
                );
                eprintln!("data       {}", s.data);
                eprintln!("memory     {}", s.memory_measure);
                let b = indicatif::ProgressBar::new(steps);
                b.set_style(super::compile_notice::step_bar_style());
                b.set_position(s.first_step.saturating_sub(1));
                b.set_message(if s.first_step == 1 {
                    "first step (warm-up)".to_string()
                } else {
                    String::new()
                });
                bar = Some(b);
            }
            notice.started(&s.shapes, bar.as_ref());
        }
        Event::Step(r) => {
            if !first_step_done {
                first_step_done = true;
                notice.finished(rcoa_backend::shapes::Pass::Train, bar.as_ref());
            }
            steps_seen.push(rcoa_compiler::report::StepRecord {
                step: r.step,
                loss: r.loss,
                step_seconds: r.step_seconds,
                peak_bytes: r.peak_bytes,
            });
            let tps = r.tokens as f64 / r.step_seconds.max(1e-9);
            if json {
                let mut v = serde_json::json!({
                    "step": r.step, "loss": r.loss, "step_seconds": r.step_seconds,
                    "tokens_per_second": tps, "peak_bytes": r.peak_bytes,
                });
                if let Some(s) = r.loss_scale {
                    v["loss_scale"] = s.into();
                    v["skipped"] = r.skipped.is_some().into();
                }
                println!("{}", tag(v));
                let _ = std::io::stdout().flush();
            } else if let Some(b) = &bar {
                if let (Some(from), Some(to)) = (r.loss_scale, r.skipped) {
                    b.println(skipped_line(r.step, from, to));
                }
                b.set_position(r.step);
                let scale = r
                    .loss_scale
                    .map(|s| format!("  loss scale {s}"))
                    .unwrap_or_default();
                b.set_message(format!(
                    "loss {:.4}  {:.3} s/step  {:.0} tok/s  peak {}{scale}",
                    r.loss,
                    r.step_seconds,
                    tps,
                    mib(r.peak_bytes)
                ));
            }
        }
        Event::Eval(r) => {
            notice.finished(rcoa_backend::shapes::Pass::Eval, bar.as_ref());
            if json {
                println!(
                    "{}",
                    tag(serde_json::json!({
                        "event": "eval", "step": r.step, "eval_loss": r.eval_loss,
                        "examples": r.examples, "batches": r.batches,
                    }))
                );
                let _ = std::io::stdout().flush();
            } else if let Some(b) = &bar {
                b.println(format!(
                    "eval after step {}: loss {:.4}",
                    r.step, r.eval_loss
                ));
            } else if text {
                eprintln!("eval after step {}: loss {:.4}", r.step, r.eval_loss);
            }
        }
        Event::Saved { step, dir } => {
            if json {
                println!(
                    "{}",
                    tag(
                        serde_json::json!({ "event": "saved", "step": step, "dir": dir.display().to_string() })
                    )
                );
            } else if let Some(b) = &bar {
                b.println(format!("saved step {step} to {}", dir.display()));
            }
        }
    };
    // A process of a multi-process run would record a plan it cannot run
    // alone; a lowered plan has no file for the recording pass to read.
    let recording = args
        .plan
        .clone()
        .filter(|_| args.device == Device::Cuda && args.nodes.is_none());
    if let Some(plan_file) = recording {
        let jobs = super::compile_ahead::jobs(args.compile_jobs);
        if jobs > 1 && rcoa_backend::prebuild::cold_for(&plan, ranks) {
            let prebuilt = super::compile_ahead::Recording {
                plan: plan_file,
                devices: args.devices,
                data: args.data.clone(),
                eval: args.eval.clone(),
                autotune: args.autotune,
            }
            .compile(jobs);
            if let Some(p) = prebuilt {
                if json {
                    println!("{}", tag(p.json()));
                } else if text {
                    eprintln!("compiled   {}", p.summary());
                }
                p.notes();
            }
        }
    }
    let result = match args.device {
        Device::Cpu => rcoa_backend::run_cpu(&plan, &opts, &mut on_event),
        Device::Cuda => rcoa_backend::run_cuda(&plan, &opts, &mut on_event),
    };
    if let Some(b) = bar.take() {
        b.finish();
    }
    match result {
        Ok(s) => {
            let at_launch =
                super::compile_ahead::AtLaunch::now().filter(|_| args.device == Device::Cuda);
            if json {
                let mut v = serde_json::to_value(&s).unwrap_or_default();
                v["event"] = "summary".into();
                if let Some(a) = &at_launch {
                    a.add_to(&mut v);
                }
                println!("{}", tag(v));
            } else if lead {
                report(&s, ranks, devices, args.device);
                if let Some(a) = &at_launch {
                    println!("kernels          {}", a.line());
                }
            }
            if let Some(timed) = s.kernel_steps.as_ref().filter(|_| json || lead) {
                if let Some(v) = kernel_report(timed, plan_flops, &plan, json) {
                    println!("{}", tag(v));
                }
            }
            if let Some(path) = args.report.as_ref().filter(|_| lead) {
                let record = rcoa_compiler::report::RunRecord {
                    plan_name: plan_name(&args),
                    device,
                    memory_measure: s.memory_measure.clone(),
                    steps: steps_seen,
                    measured_peak_bytes: s.measured_peak_bytes,
                    measured_reserved_bytes: s.measured_reserved_bytes,
                    steady_step_seconds: s.steady_step_seconds,
                    tokens_per_second: s.tokens_per_second,
                };
                let html = rcoa_compiler::report::run_html(&plan, &record);
                if let Err(e) = super::common::write_atomic(path, html.as_bytes(), |_| Ok(())) {
                    eprintln!(
                        "rcoa run: cannot write the report `{}`: {e}",
                        path.display()
                    );
                    return ExitCode::from(2);
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => failed(&e),
    }
}

/// `--profile-kernels`' report: with `json`, the `kernel_profile` line to
/// print; otherwise the text table, printed after the summary.
fn kernel_report(
    timed: &Result<Vec<rcoa_backend::kernel_profile::StepKernels>, String>,
    plan_flops: Option<f64>,
    plan: &LoweredPlan,
    json: bool,
) -> Option<serde_json::Value> {
    use rcoa_backend::kernel_profile::KernelProfile;
    let profile = match timed {
        Ok(steps) => KernelProfile::new(steps, plan_flops),
        Err(e) => {
            eprintln!(
                "rcoa run: --profile-kernels: the kernels could not be timed: {e}. CubeCL's own \
                 profiler times them with a device sync around each: set \
                 CUBECL_DEBUG_OPTION=profile CUBECL_DEBUG_LOG=FILE instead"
            );
            return None;
        }
    };
    let Some(p) = profile else {
        eprintln!("rcoa run: --profile-kernels: no step ran, so no kernel was timed");
        return None;
    };
    if json {
        let mut v = serde_json::to_value(&p).unwrap_or_default();
        v["event"] = "kernel_profile".into();
        return Some(v);
    }
    print!(
        "{}",
        p.render(Some(plan.hardware.gpu.dense_tflops(plan.precision.compute)))
    );
    None
}

/// What a step skipped for fp16 overflow says (`rcoa_backend::loss_scale`).
fn skipped_line(step: u64, from: f64, to: f64) -> String {
    format!(
        "step {step} skipped: the fp16 gradients overflowed at loss scale {from}; the weights are unchanged and the scale is now {to}"
    )
}

/// Prints `e` and gives its exit status: 1 when the backend failed or
/// training diverged, 2 for what the user can fix before starting (the
/// plan, the files, the flags, no CUDA).
pub(crate) fn failed(e: &RunError) -> ExitCode {
    print_diagnostic(e);
    match e {
        RunError::Diverged { .. }
        | RunError::GradientsNotFinite { .. }
        | RunError::Backend(_)
        | RunError::Collective(_) => ExitCode::from(1),
        _ => ExitCode::from(2),
    }
}

/// The text summary; `ranks` > 1: throughput per rank and in all.
fn report(s: &Summary, ranks: u64, devices: u32, device: Device) {
    println!("steps            {}", s.steps);
    println!("loss             {:.4} -> {:.4}", s.first_loss, s.last_loss);
    if let Some(scale) = s.loss_scale {
        println!(
            "loss scale       {scale} at the last step; {} step(s) skipped for fp16 overflow",
            s.skipped_steps
        );
    }
    if let Some(e) = s.eval_loss {
        println!("eval loss        {e:.4}");
    }
    println!("first step       {:.3} s", s.first_step_seconds);
    if ranks > 1 {
        println!(
            "steady step      {:.4} s  ({:.0} tokens/s per rank, {:.0} in all)",
            s.steady_step_seconds,
            s.tokens_per_second,
            s.tokens_per_second * ranks as f64
        );
        if device == Device::Cpu && devices > 1 {
            println!("measured peak is this process's live heap: it holds its {devices} ranks");
        } else {
            println!("measured peak is this rank's (rank 0's device)");
        }
    } else {
        println!(
            "steady step      {:.4} s  ({:.0} tokens/s)",
            s.steady_step_seconds, s.tokens_per_second
        );
    }
    println!(
        "measured peak    {}  ({})",
        mib(s.measured_peak_bytes),
        s.memory_measure
    );
    if let Some(r) = s.measured_reserved_bytes {
        println!("reserved peak    {}", mib(r));
    }
    println!("predicted peak   {}", mib(s.predicted_peak_bytes));
    if s.peak_error.is_finite() {
        println!("error            {:+.1}%", s.peak_error * 100.0);
    }
    if device == Device::Cpu {
        // The prediction is calibrated on CUDA (CubeCL's in-place element-wise
        // ops, fusion); ndarray keeps some copies CUDA does not, and the heap
        // also holds the autodiff graph's bookkeeping.
        println!(
            "note             on the CPU the measure is live heap bytes (tensors and the executor's own \
             buffers); the prediction models Burn on CUDA, where it is checked (docs/burn-h100.md)"
        );
    }
}
