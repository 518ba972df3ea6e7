//! `rcoa validate FILE.jsonl [--format text|json] [--keep DIR]`: score the
//! memory model's predicted peaks against measured training runs (the
//! repository's are in `tests/groundtruth/`).
//!
//! Exit status: 0 every configuration was scored, 1 at least one did not
//! compile, 2 the file cannot be read or is malformed, or `--keep` cannot be
//! written.

use rcoa_compiler::validate::{self, plan_text, row_line, RowScore, Summary};
use std::path::PathBuf;
use std::process::ExitCode;

pub use super::common::Format;

#[derive(clap::Args)]
pub struct Args {
    /// The measured runs: JSON lines, one `"record": "env"` or `"record": "config"` object each.
    pub file: PathBuf,
    /// Output format: one line (text) or one JSON object (json) per configuration, then the summary.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Also write each configuration's `.plan` file into DIR (created if missing).
    #[arg(long, value_name = "DIR")]
    pub keep: Option<PathBuf>,
}

pub fn run(args: Args) -> ExitCode {
    let measured = match validate::read(&args.file) {
        Ok(m) => m,
        Err(e) => {
            eprint!("{}", super::common::render(&e));
            return ExitCode::from(2);
        }
    };
    if let Some(dir) = &args.keep {
        if let Err(e) = std::fs::create_dir_all(dir) {
            eprintln!("rcoa validate: cannot create `{}`: {e}", dir.display());
            return ExitCode::from(2);
        }
    }
    let mut rows: Vec<RowScore> = Vec::with_capacity(measured.runs.len());
    for run in &measured.runs {
        let plan = plan_text(&run.config);
        if let Some(dir) = &args.keep {
            let path = dir.join(format!("{}.plan", run.name));
            if let Err(e) = super::common::write_atomic(&path, plan.as_bytes(), |_| Ok(())) {
                eprintln!("rcoa validate: cannot write `{}`: {e}", path.display());
                return ExitCode::from(2);
            }
        }
        let row = validate::score_plan(run, &plan);
        match args.format {
            Format::Text => println!("{}", row_line(&row)),
            Format::Json => println!("{}", json_line(&row)),
        }
        rows.push(row);
    }
    let summary = Summary::of(&rows);
    match args.format {
        Format::Text => println!("{}", summary.line()),
        Format::Json => {
            let mut v = serde_json::to_value(&summary).unwrap_or_default();
            if let Some(obj) = v.as_object_mut() {
                obj.insert("record".into(), "summary".into());
                obj.insert("line".into(), summary.line().into());
            }
            println!("{v}");
        }
    }
    if summary.failures > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn json_line(row: &RowScore) -> String {
    let mut v = serde_json::to_value(row).unwrap_or_default();
    if let Some(obj) = v.as_object_mut() {
        obj.insert("record".into(), "row".into());
    }
    v.to_string()
}
