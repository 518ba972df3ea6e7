//! `rcoa check FILE...`: parse and resolve each plan and report every
//! problem in each one.
//!
//! A directory argument checks the `*.plan` files in it (sorted). Prints
//! `PATH: ok` per good plan on stdout, the diagnostics of bad ones on stderr,
//! then a summary line. Exit status: 0 when every plan is good, 2 when any
//! is not (or no plan was given).

use super::common::{report, try_load, BAD_PLAN};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Plan files (or directories of `*.plan` files) to check.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Print only problems and the summary.
    #[arg(long, short)]
    pub quiet: bool,
}

pub fn run(args: Args) -> ExitCode {
    let mut paths = Vec::new();
    for f in &args.files {
        match expand(f) {
            Ok(mut ps) => paths.append(&mut ps),
            Err(msg) => {
                eprintln!("error: {msg}");
                return ExitCode::from(BAD_PLAN);
            }
        }
    }
    let mut bad = 0usize;
    for p in &paths {
        match try_load(p) {
            Ok(_) => {
                if !args.quiet {
                    println!("{}: ok", p.display());
                }
            }
            Err(e) => {
                report(&e);
                bad += 1;
            }
        }
    }
    let n = paths.len();
    let plans = if n == 1 { "plan" } else { "plans" };
    if bad == 0 {
        println!("checked {n} {plans}: all ok");
        ExitCode::SUCCESS
    } else {
        println!("checked {n} {plans}: {} ok, {bad} with problems", n - bad);
        ExitCode::from(BAD_PLAN)
    }
}

/// A file as itself; a directory as its `*.plan` files, sorted.
fn expand(path: &Path) -> Result<Vec<PathBuf>, String> {
    if !path.is_dir() {
        return Ok(vec![path.to_path_buf()]);
    }
    let entries =
        std::fs::read_dir(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let mut out: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "plan") && p.is_file())
        .collect();
    out.sort();
    if out.is_empty() {
        return Err(format!("{} has no .plan files", path.display()));
    }
    Ok(out)
}
