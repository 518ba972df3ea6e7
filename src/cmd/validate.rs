//! `rcoa validate FILE.jsonl [--format text|json] [--keep DIR]`: score the
//! memory model against measured runs (the format of
//! `tests/groundtruth/h100-pytorch.jsonl`; `tools/measure_pytorch.py` writes
//! it for your own setups).
//!
//! Prints one line per configuration and, last, the summary line
//! `accuracy: n= median_abs_err= p90_abs_err= max_abs_err= oom_correct= fit_correct= failures=`.
//! Exit status: 0 every configuration was predicted, 1 some did not compile,
//! 2 the file cannot be read or a line is not a measurement.

use rcoa_compiler::validate::{parse_rows, plan_text, score, Outcome, Scored, Summary};
use std::path::PathBuf;
use std::process::ExitCode;

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

#[derive(clap::Args)]
pub struct Args {
    /// Measured runs, one JSON object per line.
    pub file: PathBuf,
    /// Output format: a line per configuration and the summary, or JSON lines.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Also write each configuration's generated `.plan` file into DIR.
    #[arg(long, value_name = "DIR")]
    pub keep: Option<PathBuf>,
}

const GIB: f64 = (1u64 << 30) as f64;

pub fn run(args: Args) -> ExitCode {
    let name = args.file.display().to_string();
    let text = match std::fs::read_to_string(&args.file) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("error: cannot read `{name}`: {e}");
            return ExitCode::from(2);
        }
    };
    let rows = match parse_rows(&text) {
        Ok(r) => r,
        Err(bad) => {
            eprintln!("error: `{name}` {bad}");
            eprintln!("  help: every line is a JSON object; `\"record\": \"config\"` lines are measured configurations (see tests/groundtruth/README.md)");
            return ExitCode::from(2);
        }
    };
    if rows.is_empty() {
        eprintln!(
            "error: `{name}` holds no measured configurations (no `\"record\": \"config\"` line)"
        );
        return ExitCode::from(2);
    }
    if let Some(dir) = &args.keep {
        if let Err(e) = keep_plans(dir, &rows) {
            eprintln!(
                "error: cannot write the plans into `{}`: {e}",
                dir.display()
            );
            return ExitCode::from(2);
        }
    }
    let mut scored = Vec::with_capacity(rows.len());
    for row in &rows {
        let s = score(row);
        let line = match args.format {
            Format::Text => text_line(&s),
            Format::Json => json_line(&s).to_string(),
        };
        println!("{line}");
        scored.push(s);
    }
    let summary = Summary::of(&scored);
    let last = match args.format {
        Format::Text => summary.to_string(),
        Format::Json => serde_json::json!({ "summary": summary }).to_string(),
    };
    println!("{last}");
    if summary.failures > 0 {
        ExitCode::from(1)
    } else {
        ExitCode::SUCCESS
    }
}

fn keep_plans(dir: &std::path::Path, rows: &[rcoa_compiler::validate::Row]) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    for r in rows {
        if let Ok(text) = plan_text(&r.config) {
            std::fs::write(dir.join(format!("{}.plan", r.config.name)), text)?;
        }
    }
    Ok(())
}

fn text_line(s: &Scored) -> String {
    match &s.outcome {
        Outcome::Measured {
            measured,
            predicted,
            rel_err,
            fits,
        } => format!(
            "{:34} measured {:7.2} GiB predicted {:7.2} GiB err {:+6.1}%{}",
            s.name,
            *measured as f64 / GIB,
            *predicted as f64 / GIB,
            100.0 * rel_err,
            if *fits { "" } else { "  (predicted no fit)" }
        ),
        Outcome::Oom { predicted, fits } => format!(
            "{:34} measured OOM      predicted {:7.2} GiB fits={fits}  {}",
            s.name,
            *predicted as f64 / GIB,
            if *fits { "WRONG (predicted fit)" } else { "ok" }
        ),
        Outcome::Failed(why) => format!("{:34} FAILED {why}", s.name),
    }
}

fn json_line(s: &Scored) -> serde_json::Value {
    match &s.outcome {
        Outcome::Measured {
            measured,
            predicted,
            rel_err,
            fits,
        } => serde_json::json!({
            "name": s.name, "measured_B": measured, "predicted_B": predicted,
            "rel_err": rel_err, "fits": fits,
        }),
        Outcome::Oom { predicted, fits } => serde_json::json!({
            "name": s.name, "oom": true, "predicted_B": predicted, "fits": fits, "correct": !fits,
        }),
        Outcome::Failed(why) => serde_json::json!({ "name": s.name, "failed": why }),
    }
}
