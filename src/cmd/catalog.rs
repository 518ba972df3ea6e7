//! `rcoa catalog` (being built).

use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {}

pub fn run(_args: Args) -> ExitCode {
    eprintln!("rcoa catalog: not built yet");
    ExitCode::from(2)
}
