//! The single-GPU tails of issue 14 against tensor-byte traces of the real training step.
//!
//! `tools/memtrace/traces/tails.jsonl` holds, for each configuration of
//! `tools/memtrace/tails-configs.jsonl` (encoders with eager attention, bf16 weights with
//! Adafactor and AdamW, XLM-R-XL-sized bf16 encoders), the peak of live tensor bytes that
//! `tools/memtrace/memtrace.py` traced through the Hugging Face/PEFT step on the `meta`
//! device (CUDA allocator rounding and cuBLAS workspaces included, `docs/accuracy.md`).
//! They are not H100 measurements; the tracker reproduces the H100 rows of the same kinds
//! it was checked on to 0.1%. A wrong mechanism shows here as tens of percent (the eager
//! encoders were predicted at up to 11 x their bytes, bf16 Adafactor 6-12% under).

use rcoa_compiler::validate::row;
use rcoa_compiler::validate::score::{score, Outcome, Summary};
use std::path::PathBuf;

fn traces() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tools/memtrace/traces/tails.jsonl")
}

#[test]
fn tails_match_their_traces() {
    let file = row::read(&traces()).expect("the committed trace file parses");
    // bf16 weights under autocast (`bf16=True` on a bf16 model) included: `rcoa validate`
    // writes them `autocast = true`, so autocast's fp32 LayerNorm outputs are modelled.
    let runs: Vec<_> = file.runs.iter().collect();
    assert!(runs.len() >= 15, "{} traced rows", runs.len());
    let scores: Vec<_> = runs.iter().map(|r| score(r)).collect();
    let mut report = String::new();
    for s in &scores {
        match &s.outcome {
            Outcome::Scored { rel_err, fits, .. } => {
                report += &format!("{} {:+.2}%\n", s.name, rel_err * 100.0);
                assert!(*fits, "{} is predicted not to fit", s.name);
            }
            // Traced above the H100's memory: the run would run out of it.
            Outcome::Oom { fits, .. } => assert!(!fits, "{} is predicted to fit", s.name),
            other => panic!("{}: {other:?}", s.name),
        }
    }
    let sum = Summary::of(&scores);
    let max = sum.max_abs_err.unwrap();
    assert!(max <= 0.04, "max error {:.2}%:\n{report}", max * 100.0);
    assert!(
        sum.median_abs_err.unwrap() <= 0.005,
        "median {:.2}%:\n{report}",
        sum.median_abs_err.unwrap() * 100.0
    );
}

/// The eager encoder's attention output goes back to `[tokens, hidden]` before the output
/// projection: one layer saves what the trace's saved-tensor hooks count for that layer.
#[test]
fn eager_encoder_layer_saves_what_autograd_saves() {
    let file = row::read(&traces()).unwrap();
    let text = std::fs::read_to_string(traces()).unwrap();
    for (run, line) in file.runs.iter().zip(
        text.lines()
            .filter(|l| l.contains("\"record\": \"config\"")),
    ) {
        if run.config.attn != row::AttnImpl::Eager || run.config.grad_ckpt {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let traced = v["saved_per_layer_B"]["1"].as_u64().unwrap();
        let plan = rcoa_compiler::validate::plan::plan_text(&run.config);
        let predicted = saved_per_layer(&run.name, &plan);
        let err = predicted as f64 / traced as f64 - 1.0;
        assert!(
            err.abs() <= 0.02,
            "{}: one layer saves {predicted} B predicted, {traced} B traced",
            run.name
        );
    }
}

fn saved_per_layer(name: &str, plan: &str) -> u64 {
    use rcoa_compiler::resolve::{resolve, ResolveContext};
    let file = format!("{name}.plan");
    let parsed = rcoa_grammar::parse(&file, plan).unwrap();
    let ctx = ResolveContext::new(file, plan, PathBuf::new());
    let spec = resolve(&parsed, &ctx).unwrap();
    rcoa_compiler::compile(&spec)
        .unwrap()
        .graph
        .saved_bytes_per_layer
}
