//! `rcoa fmt` (being built).

use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> ExitCode {
    eprintln!("rcoa fmt: not built yet");
    ExitCode::from(2)
}
