//! `cargo bench -p rcoa-compiler --bench search`: how fast the fit search is.
//!
//! Reports, for every plan in `plans/` (the 405B all-`auto` plan on 2,048 ×
//! 8 H100s is the stress case): the time of `compile` (passes, search, the
//! chosen candidate's full walk with its timeline), the candidates in the
//! space, the tapes the search walked, candidates per second, and — as the
//! baseline measured in the same run — the exhaustive search that walks
//! every candidate's tape, with the ratio between the two. Wall-clock
//! numbers go to stdout only; nothing here is a golden file.

use rcoa_compiler::passes;
use rcoa_compiler::profile::Profile;
use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::search::{exhaustive, search};
use rcoa_compiler::spec::Spec;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

fn load(path: &Path) -> Option<Spec> {
    let src = std::fs::read_to_string(path).ok()?;
    let name = path.display().to_string();
    let file = rcoa_grammar::parse(&name, &src).ok()?;
    let dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    resolve(&file, &ResolveContext::new(name, src.clone(), dir)).ok()
}

/// Median wall time of `runs` calls of `f`.
fn median(runs: usize, mut f: impl FnMut()) -> Duration {
    let mut t: Vec<Duration> = (0..runs)
        .map(|_| {
            let s = Instant::now();
            f();
            s.elapsed()
        })
        .collect();
    t.sort();
    t[t.len() / 2]
}

fn main() {
    let plans = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../plans");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&plans)
        .map(|d| d.filter_map(|e| e.ok()).map(|e| e.path()).collect())
        .unwrap_or_default();
    files.retain(|p| p.extension().is_some_and(|e| e == "plan"));
    files.sort();
    // `cargo bench -- --quick` skips the exhaustive baselines of the large plans.
    let quick = std::env::args().any(|a| a == "--quick");
    println!(
        "{:<44} {:>10} {:>9} {:>7} {:>12} {:>11} {:>8}",
        "plan", "compile", "space", "walked", "cand/s", "exhaustive", "ratio"
    );
    for path in files {
        let Some(spec) = load(&path) else {
            println!("{:<44} (does not resolve)", path.display());
            continue;
        };
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        let profile = Profile::for_target(spec.target);
        let Ok(plan) = passes::run(&spec, &profile, &mut Vec::new()) else {
            println!("{name:<44} (refused by the passes)");
            continue;
        };
        let compile_t = median(3, || {
            let _ = rcoa_compiler::compile(&spec);
        });
        let mut walked = 0;
        let mut space = 0;
        let search_t = median(3, || {
            let (_, _, stats) = search(&spec, &profile, &plan.space);
            walked = stats.evaluated;
            space = stats.space;
        });
        let per_s = space as f64 / search_t.as_secs_f64();
        let (ex, ratio) = if quick && space > 2000 {
            ("skipped".to_string(), String::new())
        } else {
            let s = Instant::now();
            let (best, _) = exhaustive(&spec, &profile, &plan.space);
            let e = s.elapsed();
            let (fast, _, _) = search(&spec, &profile, &plan.space);
            let same = match (&best, &fast) {
                (Some((a, ea)), Some((b, eb))) => (!ea.fits && !eb.fits) || a == b,
                _ => false,
            };
            (
                format!("{:.3} s", e.as_secs_f64()),
                format!(
                    "{:.1}×{}",
                    e.as_secs_f64() / search_t.as_secs_f64(),
                    if same { "" } else { " DIFFERENT PLAN" }
                ),
            )
        };
        println!(
            "{name:<44} {:>8.1}ms {space:>9} {walked:>7} {per_s:>12.0} {ex:>11} {ratio:>8}",
            compile_t.as_secs_f64() * 1e3
        );
    }
}
