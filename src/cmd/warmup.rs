//! `rcoa warmup PLAN`: compile and tune on CUDA, ahead of `rcoa run`, the
//! kernels a run of the plan needs, by running two steps of it on a
//! throwaway model (`rcoa_backend::warmup`). Saves nothing but the kernel
//! caches, which `rcoa run` then reads (the same directory). A progress line
//! on stderr names the shape, the pass and the point in the step, with the
//! elapsed time; the end says where the cache is, how many entries it gained
//! and how long it took. On CUDA the kernels are first compiled on every
//! core (`compile_ahead`); the steps then tune and find them cached. On the
//! CPU the same steps run and there is nothing to compile. Exit status: 0
//! done, 1 the backend failed, 2 bad plan, bad usage or no CUDA.

use super::compile_ahead::{self, Recording};
use super::run::{failed, lower_plan, print_diagnostic, Autotune, Device};
use rcoa_backend::distributed::{Distributed, Timeouts};
use rcoa_backend::{RunError, RunOptions};
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct Args {
    /// The `.plan` file whose run to prepare.
    plan: PathBuf,
    #[arg(long, value_enum, default_value = "cpu")]
    device: Device,
    /// The run's data-parallel ranks in this process, one device each: the plan's `data`
    /// (as `rcoa run --devices N`).
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..))]
    devices: u32,
    /// The run's training file (`rcoa run --data`): a pairs file's padding masks compile
    /// other kernels.
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    /// The run's held-out file (`rcoa run --eval`): its batch shapes are compiled too.
    #[arg(long, value_name = "FILE")]
    eval: Option<PathBuf>,
    /// CUDA: CubeCL's autotune level; give the run the same (tuning keys depend on it).
    /// [default: CUBECL_AUTOTUNE_LEVEL, else balanced]
    #[arg(long, value_enum)]
    autotune: Option<Autotune>,
    /// CUDA: compile the run's kernels N at a time before the steps: a first pass (a process
    /// of its own) records them without running them, NVRTC compiles them all N at a time (a
    /// process each), then the steps run on a full cache. 1: compile one at a time as CubeCL does.
    /// [default: this machine's cores]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    compile_jobs: Option<u32>,
    /// The recording pass of `--compile-jobs` (run by rcoa itself): record the kernels the
    /// steps launch to FILE, one JSON object per line, executing none of them.
    #[arg(long, value_name = "FILE", hide = true)]
    record_kernels: Option<PathBuf>,
}

pub fn run(args: Args) -> ExitCode {
    let plan = match lower_plan(&args.plan) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let data = plan.resolved.data;
    if data != args.devices as u64 {
        print_diagnostic(&RunError::Distributed(format!(
            "the plan is data-parallel over {data} rank(s) and `rcoa warmup` runs them as devices of one process, \
             as `rcoa run --devices` does: pass --devices {data}, not {}",
            args.devices
        )));
        return ExitCode::from(2);
    }
    let distributed = (args.devices > 1).then_some(Distributed {
        nodes: 1,
        node_rank: 0,
        devices: args.devices,
        local: 0,
        network: None,
        timeouts: Timeouts::DEFAULT,
    });
    if let Some(d) = &distributed {
        if let Err(e) = d.validate() {
            print_diagnostic(&e);
            return ExitCode::from(2);
        }
        super::run::quiet_collective_panics();
    }
    if let Err(e) = rcoa_backend::check_plan_ranks(&plan, args.devices as u64) {
        print_diagnostic(&e);
        return ExitCode::from(2);
    }
    rcoa_backend::kernel_cache::set_autotune(args.autotune.map(Autotune::level));
    let opts = RunOptions {
        data: args.data.clone(),
        eval: args.eval.clone(),
        tokenizer: super::eval::hf_config_dir(&args.plan, &plan),
        distributed,
        ..Default::default()
    };
    let cuda = args.device == Device::Cuda;
    if let Some(out) = &args.record_kernels {
        return record_pass(
            &plan,
            &opts,
            out,
            compile_ahead::jobs(args.compile_jobs),
            cuda,
        );
    }
    let prebuilt = cuda
        .then(|| {
            Recording {
                plan: args.plan.clone(),
                devices: args.devices,
                data: args.data.clone(),
                eval: args.eval.clone(),
                autotune: args.autotune,
            }
            .compile(compile_ahead::jobs(args.compile_jobs))
        })
        .flatten();
    eprintln!(
        "warming up {}: {} steps of {} micro-batch(es) on a throwaway model, nothing saved but the kernel caches",
        args.plan.display(),
        rcoa_backend::warmup::STEPS,
        plan.resolved
            .grad_accum
            .clamp(1, rcoa_backend::warmup::MAX_GRAD_ACCUM)
    );
    let (bar, progress) = spinner("");
    let result = rcoa_backend::warmup::run(&plan, &opts, cuda, progress);
    bar.finish_and_clear();
    let report = match result {
        Ok(r) => r,
        Err(e) => return failed(&e),
    };
    let shapes: Vec<String> = report.shapes.iter().map(|s| s.to_string()).collect();
    println!("device     {}", report.device);
    println!("shapes     {}", shapes.join(", "));
    println!("took       {:.1} s", report.seconds);
    match &report.cache {
        None => println!(
            "cache      nothing to compile on the CPU (ndarray has no kernel compiler); \
             on a GPU: `rcoa warmup PLAN --device cuda`, then `rcoa run PLAN --device cuda`"
        ),
        Some(c) => {
            println!(
                "cache      {}: {} entries, {} added (compiled kernels and tuning results)",
                c.dir.display(),
                c.entries_after,
                c.entries_after.saturating_sub(c.entries_before)
            );
            if let Some(jit) = std::env::var_os("CUDA_CACHE_PATH") {
                println!(
                    "driver     PTX→SASS JIT cache {}",
                    PathBuf::from(jit).display()
                );
            }
            if let Some(p) = &prebuilt {
                println!("prebuilt   {}", p.summary());
                p.notes();
            }
            if let Some(a) = super::compile_ahead::AtLaunch::now() {
                println!("at launch  {}", a.line());
            }
            if let Some(e) = &c.record_error {
                eprintln!(
                    "note: the warmed shapes could not be recorded ({e}); `rcoa run` will say it compiles them, \
                     and will find them cached"
                );
            }
        }
    }
    ExitCode::SUCCESS
}

/// A spinner on stderr with the elapsed time, and a progress sink that
/// sets its message (after `prefix`).
fn spinner(prefix: &'static str) -> (indicatif::ProgressBar, rcoa_backend::warmup::Progress) {
    let bar = indicatif::ProgressBar::new_spinner();
    bar.set_style(
        indicatif::ProgressStyle::with_template("{spinner} {elapsed:>4} {msg}")
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_spinner()),
    );
    bar.enable_steady_tick(Duration::from_millis(200));
    let sink = bar.clone();
    (
        bar,
        Arc::new(move |line: &str| sink.set_message(format!("{prefix}{line}"))),
    )
}

/// `--record-kernels FILE`: the first phase of compiling ahead
/// (`rcoa_backend::prebuild::record`), in the process
/// `compile_ahead::Recording::compile` started.
fn record_pass(
    plan: &rcoa_compiler::lowered::LoweredPlan,
    opts: &RunOptions,
    out: &std::path::Path,
    jobs: usize,
    cuda: bool,
) -> ExitCode {
    if !cuda {
        return failed(&RunError::Prebuild(
            "--record-kernels records the CUDA kernels a run launches: give --device cuda".into(),
        ));
    }
    let (bar, progress) = spinner("recording kernels · ");
    let result = rcoa_backend::prebuild::record(plan, opts, out, jobs, progress);
    bar.finish_and_clear();
    match result {
        Ok(r) => {
            eprintln!(
                "recorded {} kernel(s) the cache lacks in {:.1} s",
                r.kernels, r.seconds
            );
            if !r.refused.is_empty() {
                eprintln!(
                    "note: {} recorded launch(es) cannot be compiled, as a run's launch of them cannot: {}",
                    r.refused.len(),
                    r.refused.join("; ")
                );
            }
            if let Some(why) = r.stopped {
                eprintln!(
                    "note: the recording pass stopped early ({why}); the warm-up's steps compile what it did not reach"
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => failed(&e),
    }
}
