//! `rcoa`: the command-line front of the training-plan compiler.
//!
//! Argument parsing and wiring only; every subcommand lives in its own
//! module under `cmd/` and returns the process exit code:
//! 0 ok (or fits), 1 does not fit, 2 bad plan or bad usage.

mod cmd;

/// Counts live heap bytes, so `rcoa run --device cpu` measures tensor bytes
/// (the quantity the compiler predicts) rather than RSS growth.
#[global_allocator]
static ALLOC: rcoa_backend::memory::TrackingAlloc = rcoa_backend::memory::TrackingAlloc;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "rcoa",
    version,
    about = "Compile a .plan training job into a plan that fits GPU memory, and run it."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Parse and resolve plans; report every problem.
    Check(cmd::check::Args),
    /// Format a plan canonically (comments kept).
    Fmt(cmd::fmt::Args),
    /// List the GPUs or model presets the compiler knows.
    Catalog(cmd::catalog::Args),
    /// Predict memory and time, decide every `auto`, and explain why.
    Compile(cmd::compile::Args),
    /// Train with the compiled plan on Burn (CPU or CUDA).
    Run(Box<cmd::run::Args>),
    /// Compile and tune a plan's CUDA kernels ahead of `rcoa run` (two steps on a throwaway model).
    Warmup(cmd::warmup::Args),
    /// The held-out loss of a plan's model on a data file (forward only, CPU).
    Eval(cmd::eval::Args),
    /// Serve the meeting point of a data-parallel `rcoa run` over several processes.
    Orchestrate(cmd::orchestrate::Args),
    /// Write the compiled plan as DeepSpeed, torchrun, Slurm or Accelerate configuration.
    Emit(cmd::emit::Args),
    /// Write a starting .plan for a model, a GPU, a GPU count and a global batch.
    Init(cmd::init::Args),
    /// Score the memory model against measured runs (JSON lines, as in tests/groundtruth/).
    Validate(cmd::validate::Args),
}

fn main() -> ExitCode {
    // A worker the compile phase started to run NVRTC on the kernels it is
    // sent (`rcoa_backend::prebuild::Workers`): that, and nothing else.
    if let Some(code) = rcoa_backend::prebuild::serve_compile_worker() {
        return code;
    }
    restore_sigpipe();
    let cli = Cli::parse();
    match cli.command {
        Command::Check(a) => cmd::check::run(a),
        Command::Fmt(a) => cmd::fmt::run(a),
        Command::Catalog(a) => cmd::catalog::run(a),
        Command::Compile(a) => cmd::compile::run(a),
        Command::Run(a) => cmd::run::run(*a),
        Command::Warmup(a) => cmd::warmup::run(a),
        Command::Eval(a) => cmd::eval::run(a),
        Command::Orchestrate(a) => cmd::orchestrate::run(a),
        Command::Emit(a) => cmd::emit::run(a),
        Command::Validate(a) => cmd::validate::run(a),
        Command::Init(a) => cmd::init::run(a),
    }
}

/// `rcoa check plans/*.plan | head -1` must end quietly, as `cat` or `grep`
/// do, not panic in `println!` with "Broken pipe". Rust ignores SIGPIPE so
/// that writes return an error; put back the default (end the process) for
/// the pipes. Sockets are unaffected: Rust's and tokio's socket writes pass
/// `MSG_NOSIGNAL`, so a dead peer of `rcoa run --nodes` is still an error.
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: called first thing in `main`, before any thread starts; only
    // resets one signal's disposition to its default.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}
