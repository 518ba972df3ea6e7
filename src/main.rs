//! `rcoa`: the command-line front of the training-plan compiler.
//!
//! Argument parsing and wiring only; every subcommand lives in its own
//! module under `cmd/` and returns the process exit code:
//! 0 ok (or fits), 1 does not fit, 2 bad plan or bad usage.

mod cmd;

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
    Run(cmd::run::Args),
    /// Serve the meeting point of a data-parallel `rcoa run` over several processes.
    Orchestrate(cmd::orchestrate::Args),
    /// Write the compiled plan as DeepSpeed, torchrun, Slurm or Accelerate configuration.
    Emit(cmd::emit::Args),
    /// Score the memory model against measured runs (JSON lines, as in tests/groundtruth/).
    Validate(cmd::validate::Args),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Check(a) => cmd::check::run(a),
        Command::Fmt(a) => cmd::fmt::run(a),
        Command::Catalog(a) => cmd::catalog::run(a),
        Command::Compile(a) => cmd::compile::run(a),
        Command::Run(a) => cmd::run::run(a),
        Command::Orchestrate(a) => cmd::orchestrate::run(a),
        Command::Emit(a) => cmd::emit::run(a),
        Command::Validate(a) => cmd::validate::run(a),
    }
}
