//! `rcoa compile FILE [--explain] [--format text|json] [--report FILE.html] [--lowered FILE.json]`:
//! predict memory and time, decide every `auto`, and say why.
//!
//! Exit status: 0 the plan fits, 1 it does not (the report is still
//! printed), 2 a bad plan (diagnostics on stderr) or a plan the memory model
//! cannot express.

use super::common::load_spec;
use rcoa_compiler::explain;
use std::path::PathBuf;
use std::process::ExitCode;

pub use super::common::Format;

#[derive(clap::Args)]
pub struct Args {
    /// The `.plan` file to compile.
    pub file: PathBuf,
    /// Show the memory breakdown, where the peak happens, the timeline and every decision.
    #[arg(long)]
    pub explain: bool,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Text)]
    pub format: Format,
    /// Also write a self-contained HTML memory report (charts, decisions, settings) to FILE.
    #[arg(long, value_name = "FILE")]
    pub report: Option<PathBuf>,
    /// Also write the lowered plan (every `auto` decided) as JSON to FILE, for
    /// `rcoa run --lowered` and `rcoa emit`.
    #[arg(long, value_name = "FILE")]
    pub lowered: Option<PathBuf>,
}

pub fn run(args: Args) -> ExitCode {
    let loaded = match load_spec(&args.file) {
        Ok(l) => l,
        Err(code) => return code,
    };
    let compilation = match rcoa_compiler::compile(&loaded.spec) {
        Ok(c) => c,
        Err(e) => {
            eprint!("{}", super::common::render(&e));
            return ExitCode::from(2);
        }
    };
    let fits = compilation.lowered.prediction.fits;
    if let Some(path) = &args.report {
        // The plan's file name titles the page (no absolute path: the page stays reproducible).
        let name = args.file.file_name().map_or_else(
            || args.file.display().to_string(),
            |n| n.to_string_lossy().into_owned(),
        );
        let html = rcoa_compiler::report::compile_html(&compilation, &name);
        if let Err(e) = super::common::write_atomic(path, html.as_bytes(), |_| Ok(())) {
            eprintln!(
                "rcoa compile: cannot write the report `{}`: {e}",
                path.display()
            );
            return ExitCode::from(2);
        }
    }
    if let Some(path) = &args.lowered {
        let written = serde_json::to_string_pretty(&compilation.lowered)
            .map_err(|e| e.to_string())
            .and_then(|json| {
                super::common::write_atomic(path, (json + "\n").as_bytes(), |_| Ok(()))
                    .map_err(|e| e.to_string())
            });
        if let Err(e) = written {
            eprintln!(
                "rcoa compile: cannot write the lowered plan `{}`: {e}",
                path.display()
            );
            return ExitCode::from(2);
        }
    }
    match args.format {
        Format::Json => {
            let value = explain::to_json(&compilation);
            match serde_json::to_string_pretty(&value) {
                Ok(s) => println!("{s}"),
                Err(e) => {
                    eprintln!("rcoa compile: cannot serialize the report: {e}");
                    return ExitCode::from(2);
                }
            }
        }
        Format::Text if args.explain => print!("{}", explain::render_text(&compilation)),
        Format::Text => {
            let p = &compilation.lowered.prediction;
            let r = &compilation.lowered.resolved;
            let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
            // What moved off the GPU is part of the plan that fits.
            let offload = if r.offload.is_empty() {
                String::new()
            } else {
                format!(", offload [{}]", r.offload_names().join(", "))
            };
            // The budget holds the peak and the reserve (the allocator's pages and the
            // context): both are shown, so the sum says why it fits or not.
            let reserve = p.breakdown.get("reserved").copied().unwrap_or(0);
            println!(
                "{}: peak {:.2} GiB + reserve {:.2} GiB of {:.2} GiB budget ({}) at {}; {:.3} s/step, {:.0} tokens/s; micro_batch {} × grad_accum {}, checkpoint {}{offload}",
                if fits { "fits" } else { "does not fit" },
                gib(p.peak_bytes),
                gib(reserve),
                gib(p.budget_bytes),
                compilation.profile.name,
                p.peak_at,
                p.step_seconds,
                p.tokens_per_second,
                r.micro_batch,
                r.grad_accum,
                r.checkpoint
            );
        }
    }
    if fits {
        ExitCode::SUCCESS
    } else {
        // The report went to stdout; the diagnostic says what would make the plan fit.
        if let Some(d) = &compilation.does_not_fit {
            eprint!("{}", super::common::render(d));
        }
        ExitCode::from(1)
    }
}
