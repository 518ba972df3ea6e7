//! The `target burn` memory model against rcoa's Burn executor measured on one H100.
//!
//! Each plan of `backend/bench/` that `docs/burn-h100.md` reports is compiled here and its
//! predicted peak in use compared with the measured one (CubeCL `bytes_in_use`, sampled by
//! `rcoa run` after every layer's forward and backward, the loss and the optimizer; step 2
//! onwards). The raw outputs are in `backend/bench/h100-results/` (the `measured_peak_bytes`
//! and `measured_reserved_bytes` of each run's summary line). The goal of the calibration:
//! every row within 5%, and `fits` false whenever the budget is below what the pool reserved
//! (a plan predicted to fit must not OOM).

use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::{compile, Compilation};
use std::path::PathBuf;

/// (plan, measured peak in use, measured reserved peak), from docs/burn-h100.md's memory
/// table and its "Calibration" section; raw files named in the comments.
const MEASURED: &[(&str, u64, u64)] = &[
    // h100-results/llama350m_eager.plan-trace.jsonl (summary line)
    ("llama350m_eager.plan", 35_235_871_232, 47_988_452_352),
    // h100-results/llama350m_gc.plan-trace.jsonl
    ("llama350m_gc.plan", 7_149_564_416, 15_463_396_352),
    // h100-results/llama125m_base.plan-final.jsonl
    ("llama125m_base.plan", 13_742_513_152, 19_946_731_520),
    // h100-results/llama125m_bf16.plan-final.jsonl
    ("llama125m_bf16.plan", 13_742_513_152, 20_029_756_416),
    // h100-results/llama125m_fp32.plan-final.jsonl
    ("llama125m_fp32.plan", 24_290_657_792, 32_483_490_816),
    // Holdouts, measured after the calibration's shapes were chosen (not fitted on):
    // h100-results/llama350m_fp32.plan-holdout.jsonl
    ("llama350m_fp32.plan", 63_441_187_328, 75_614_925_824),
    // h100-results/llama125m_every2.plan-holdout.jsonl
    ("llama125m_every2.plan", 8_345_998_336, 14_218_013_696),
];

fn bench_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../backend/bench")
}

fn compile_with_budget(name: &str, budget: Option<u64>) -> Compilation {
    let path = bench_dir().join(name);
    let mut source = std::fs::read_to_string(&path).expect("bench plan");
    if let Some(b) = budget {
        source = source.replace(
            "fit { checkpoint",
            &format!("fit {{ budget = {} MiB  checkpoint", b >> 20),
        );
    }
    let file = rcoa_grammar::parse(name, &source).expect("parses");
    let ctx = ResolveContext {
        name: name.into(),
        source: source.clone(),
        base_dir: bench_dir(),
    };
    let spec = resolve(&file, &ctx).expect("resolves");
    compile(&spec).expect("compiles")
}

#[test]
fn burn_prediction_within_5_percent_of_h100() {
    let mut worst: f64 = 0.0;
    let mut lines = Vec::new();
    for &(name, measured, _) in MEASURED {
        let c = compile_with_budget(name, None);
        let predicted = c.lowered.prediction.peak_bytes;
        let err = (measured as f64 - predicted as f64) / predicted as f64;
        lines.push(format!(
            "{name}: predicted {predicted} measured {measured} error {:+.2}% at {}",
            100.0 * err,
            c.lowered.prediction.peak_at
        ));
        worst = worst.max(err.abs());
        // Every measured run ran on the 80 GB H100: the plan must be predicted to fit.
        assert!(
            c.lowered.prediction.fits,
            "{name}: ran on the H100 but predicted not to fit"
        );
    }
    let table = lines.join("\n");
    println!("{table}");
    assert!(worst <= 0.05, "a row is off by more than 5%:\n{table}");
}

#[test]
fn burn_does_not_fit_below_the_reserved_pool() {
    for &(name, _, reserved) in MEASURED {
        // A budget just under what CubeCL's pool reserved: that run would have run out.
        let c = compile_with_budget(name, Some(reserved - (256 << 20)));
        assert!(
            !c.lowered.prediction.fits,
            "{name}: predicted to fit in {} B although the pool reserved {reserved} B",
            reserved - (256 << 20)
        );
    }
}
