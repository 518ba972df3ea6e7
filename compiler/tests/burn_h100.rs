//! The `target burn` memory model against rcoa's Burn executor measured on one H100 (and one H200).
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

/// (plan, raw output of `rcoa run --format json` on the H100 under
/// `backend/bench/h100-results/`): the fused CUDA executor of docs/burn-h100.md. The
/// measured peak in use and reserved peak are read from each file's summary line.
const MEASURED: &[(&str, &str)] = &[
    ("llama350m_eager.plan", "fused-llama350m_eager.jsonl"),
    ("llama350m_gc.plan", "fused-llama350m_gc.jsonl"),
    ("llama125m_base.plan", "fused-llama125m_base-gpusync.jsonl"),
    ("llama125m_bf16.plan", "fused-llama125m_bf16-gpusync.jsonl"),
    ("llama125m_fp32.plan", "fused-llama125m_fp32.jsonl"),
    ("llama350m_fp32.plan", "fused-llama350m_fp32.jsonl"),
    (
        "llama125m_every2.plan",
        "fused-llama125m_every2-gpusync.jsonl",
    ),
    // Holdout: measured after the profile above was set (grouped-query attention, tied
    // embeddings, two accumulated micro-batches).
    ("llama_gqa.plan", "fused-llama_gqa-holdout.jsonl"),
    // ZeRO-2 over two processes, bf16 weights, rank 0 (docs/burn-h100.md, "2026-11-25c"):
    // everything alive at its forward peak was in the rank's own stream. Its default pool
    // reserved 11.58 GB: the flat exchange vector's 4.95 GiB page on top of the rest.
    (
        "llama125m_zero2_bf16.plan",
        "2026-11-25/call3/llama125m_zero2_bf16-rank0.jsonl",
    ),
];

/// (plan, raw output under `backend/bench/h100-results/`) measured on an H200
/// (docs/burn-h100.md, "2026-11-27"), compact pool, several processes at once. The
/// bytes in use are the executor's live tensors, the same on either card; what the
/// pool reserves is not (CubeCL sizes its pages from the device's memory, and these
/// cold runs autotuned in the measured process), so these rows are held to the 5%
/// bar only. Two-process runs: each rank against the plan's per-rank prediction. Runs
/// the call's time limit stopped after their steps have no summary line: their
/// highest step `peak_bytes` is read (`measured_in_use`).
const MEASURED_H200: &[(&str, &str)] = &[
    // ZeRO-3, optimizer on the host: the streams fix of 2026-11-25c (was −11.6%).
    (
        "llama125m_zero3_offload.plan",
        "2026-11-27/call1/llama125m_zero3_offload-rank0.jsonl",
    ),
    (
        "llama125m_zero3_offload.plan",
        "2026-11-27/call1/llama125m_zero3_offload-rank1.jsonl",
    ),
    // Issue 11's bar: a 1.24B decoder, ZeRO-3 + optimizer offload, two processes.
    (
        "llama1b_zero3_offload.plan",
        "2026-11-27/call2/llama1b_zero3_offload-rank0.jsonl",
    ),
    (
        "llama1b_zero3_offload.plan",
        "2026-11-27/call2/llama1b_zero3_offload-rank1.jsonl",
    ),
    // Checkpointed layer inputs in host memory, and the same plan without.
    (
        "llama125m_activation_offload.plan",
        "2026-11-27/call1/llama125m_activation_offload.jsonl",
    ),
    (
        "llama125m_full_recompute.plan",
        "2026-11-27/call1/llama125m_full_recompute.jsonl",
    ),
    // Issue 12's techniques: selective recomputation, the chunked loss (128k vocabulary),
    // QLoRA + adam8bit at Mistral-7B's shape (8 layers, and all 32 on a 24 GB card).
    (
        "llama125m_selective.plan",
        "2026-11-27/call1/llama125m_selective.jsonl",
    ),
    (
        "llama125m_chunked_loss.plan",
        "2026-11-27/call1/llama125m_chunked_loss.jsonl",
    ),
    (
        "h100-results/2026-11-25b/mistral7b_qlora_8l.plan",
        "2026-11-27/call2/mistral7b_qlora_8l.jsonl",
    ),
    (
        "mistral7b_qlora_burn.plan",
        "2026-11-27/call2/mistral7b_qlora_burn.jsonl",
    ),
    // The techniques of 2026-11-30h's second call (`gpu_techniques_call.sh`), ten processes
    // at once, cold: fp16 with loss scaling beside its bf16 plan, Qwen's layers, the 1B step
    // in the backward and after it, Adafactor and Adam-mini over bf16 weights with an fp32
    // master. The last four peak after the optimizer step, which the executor samples once
    // its temporaries are gone (`memory::evaluate`).
    ("llama125m_fp16.plan", "2026-11-30h/techniques/fp16.jsonl"),
    (
        "llama125m_base.plan",
        "2026-11-30h/techniques/bf16-base.jsonl",
    ),
    (
        "llama125m_qk_norm_qkv_bias.plan",
        "2026-11-30h/techniques/qwen-layers.jsonl",
    ),
    (
        "llama1b_in_backward.plan",
        "2026-11-30h/techniques/in-backward.jsonl",
    ),
    (
        "h100-results/2026-11-30h/llama1b_after_backward.plan",
        "2026-11-30h/techniques/after-backward.jsonl",
    ),
    (
        "llama125m_adafactor.plan",
        "2026-11-30h/techniques/adafactor.jsonl",
    ),
    (
        "llama125m_adam_mini.plan",
        "2026-11-30h/techniques/adam-mini.jsonl",
    ),
];

fn json_lines(file: &str) -> Vec<serde_json::Value> {
    let path = bench_dir().join("h100-results").join(file);
    let text = std::fs::read_to_string(&path).expect("raw GPU output");
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .collect()
}

/// (measured peak in use, measured reserved peak) of a run's summary: its summary line, or
/// for a `.txt` of `gpu_jobs.sh`, its line `NAME: measured PEAK predicted P error E reserved
/// RESERVED ...` (the same two fields of the summary). `None`: the run has no summary.
fn summary(file: &str) -> Option<(u64, u64)> {
    if file.ends_with(".txt") {
        let path = bench_dir().join("h100-results").join(file);
        let text = std::fs::read_to_string(&path).expect("raw GPU output");
        let line = text.lines().find(|l| l.contains(": measured "))?;
        let after = |key: &str| -> u64 {
            let mut words = line.split_whitespace();
            words.find(|w| *w == key);
            words
                .next()
                .and_then(|w| w.parse().ok())
                .unwrap_or_else(|| panic!("{file}: no `{key} N` in {line}"))
        };
        return Some((after("measured"), after("reserved")));
    }
    let s = summary_line(file)?;
    let field = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{file}: no {k}"));
    Some((
        field("measured_peak_bytes"),
        field("measured_reserved_bytes"),
    ))
}

/// A `rcoa run --format json` output's summary line, if the run reached it.
fn summary_line(file: &str) -> Option<serde_json::Value> {
    json_lines(file)
        .into_iter()
        .find(|v| v["event"] == "summary")
}

/// The measured peak in use: the summary's, or the highest of the step lines' when the
/// run was stopped before its summary, provided two steps ran (the optimizer state
/// exists from the first update on).
fn measured_in_use(file: &str) -> u64 {
    if let Some((peak, _)) = summary(file) {
        return peak;
    }
    let lines = json_lines(file);
    let steps: Vec<u64> = lines
        .iter()
        .filter(|v| v["step"].is_u64())
        .filter_map(|v| v["peak_bytes"].as_u64())
        .collect();
    assert!(
        steps.len() >= 2,
        "{file}: no summary and fewer than two steps"
    );
    steps.into_iter().max().unwrap()
}

fn bench_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../backend/bench")
}

fn compile_with_budget(name: &str, budget: Option<u64>) -> Compilation {
    compile_on(name, budget, None)
}

/// `name` compiled with its budget, and its GPU, replaced where given.
fn compile_on(name: &str, budget: Option<u64>, gpu: Option<&str>) -> Compilation {
    let path = bench_dir().join(name);
    let mut source = std::fs::read_to_string(&path).expect("bench plan");
    if let Some(gpu) = gpu {
        assert!(
            source.contains("gpu = h100-80gb"),
            "{name}: no `gpu = h100-80gb` to replace"
        );
        source = source.replacen("gpu = h100-80gb", &format!("gpu = {gpu}"), 1);
    }
    if let Some(b) = budget {
        // The plan's own budget goes; the fit block's other settings stay.
        let kept: Vec<&str> = source
            .lines()
            .filter(|l| !l.trim_start().starts_with("budget ="))
            .collect();
        let edited =
            kept.join("\n")
                .replacen("fit {", &format!("fit {{ budget = {} MiB ", b >> 20), 1);
        assert_ne!(
            edited,
            kept.join("\n"),
            "{name}: no fit block to set a budget in"
        );
        source = edited;
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
    for &(name, file) in MEASURED.iter().chain(MEASURED_H200).chain(MEASURED_COMPACT) {
        let measured = measured_in_use(file);
        let c = compile_with_budget(name, None);
        let predicted = c.lowered.prediction.peak_bytes;
        let err = (measured as f64 - predicted as f64) / predicted as f64;
        lines.push(format!(
            "{file}: predicted {predicted} measured {measured} error {:+.2}% at {}",
            100.0 * err,
            c.lowered.prediction.peak_at
        ));
        worst = worst.max(err.abs());
        // Every measured run ran: the plan must be predicted to fit its own card.
        assert!(
            c.lowered.prediction.fits,
            "{name}: ran on the H100 but predicted not to fit"
        );
    }
    let table = lines.join("\n");
    println!("{table}");
    assert!(worst <= 0.05, "a row is off by more than 5%:\n{table}");
}

/// (plan, GPU it ran on, raw output under `backend/bench/h100-results/`) of the steps the
/// `burn` profile's time model is fitted to: every run with a summary line that sampled
/// memory without a GPU sync (the `-gpusync` rows carry per-layer syncs, 22 % of the 350M
/// step) and was not cold (autotune).
const TIMED: &[(&str, &str, &str)] = &[
    (
        "llama350m_eager.plan",
        "h100-80gb",
        "fused-llama350m_eager.jsonl",
    ),
    ("llama350m_gc.plan", "h100-80gb", "fused-llama350m_gc.jsonl"),
    (
        "llama350m_fp32.plan",
        "h100-80gb",
        "fused-llama350m_fp32.jsonl",
    ),
    (
        "llama125m_fp32.plan",
        "h100-80gb",
        "fused-llama125m_fp32.jsonl",
    ),
    (
        "llama_gqa.plan",
        "h100-80gb",
        "fused-llama_gqa-holdout.jsonl",
    ),
    // The register flash kernels (2026-11-30h), the executor as it runs by default.
    (
        "h100-results/2026-11-30h/speed-registers/speed-350m.plan",
        "h200-141gb",
        "2026-11-30h/speed-registers/speed-350m-rcoa.jsonl",
    ),
    (
        "h100-results/2026-11-30h/speed-1b/speed-1b.plan",
        "h200-141gb",
        "2026-11-30h/speed-1b/speed-1b-rcoa.jsonl",
    ),
];

/// The predicted step time of `target burn` against the measured steady step (the
/// summary's `steady_step_seconds`, the median of steps 2 onwards): every row within 5 %
/// (the fit holds them within 2.5 %), the eager and the flash rows alike.
#[test]
fn burn_step_time_within_5_percent() {
    let mut worst: f64 = 0.0;
    let mut lines = Vec::new();
    for &(name, gpu, file) in TIMED {
        let measured = summary_line(file)
            .and_then(|s| s["steady_step_seconds"].as_f64())
            .unwrap_or_else(|| panic!("{file}: no steady_step_seconds"));
        let c = compile_on(name, None, Some(gpu));
        let predicted = c.lowered.prediction.step_seconds;
        let err = predicted / measured - 1.0;
        lines.push(format!(
            "{name} on {gpu}: predicted {predicted:.4} s measured {measured:.4} s error {:+.1}%",
            100.0 * err
        ));
        worst = worst.max(err.abs());
    }
    let table = lines.join("\n");
    println!("{table}");
    assert!(worst <= 0.05, "a step is off by more than 5%:\n{table}");
}

/// (plan, raw output under `backend/bench/h100-results/`) of runs under `--memory-pool
/// compact`, the pools `rcoa run` uses by default and `fits` assumes, beyond
/// [`MEASURED_H200`]'s (which all were): their reserved bytes are what `fits` must cover.
const MEASURED_COMPACT: &[(&str, &str)] = &[
    // H100, from an empty kernel cache (autotune's buffers in the measured process).
    (
        "speed350m.plan",
        "2026-11-25/call2/speed350-compact-rcoa.jsonl",
    ),
    // H200, warm cache, then cold with compact as the default (docs/burn-h100.md,
    // "2026-11-28f"): the same bytes reserved.
    ("speed350m_flash.plan", "2026-11-28f/pool-compact.jsonl"),
    // H200, 2026-11-30h: cold (the block kernels), then warm with the register kernels
    // (`RCOA_FLASH_REGISTERS`), and the 1.24B decoder at seq 2048 (speed.py's `1b`), warm
    // but for its 83 new kernels. (2026-11-28f's cold row, measured while the executor kept
    // a copy of the flash output, read +2.5 %: this run measured the prediction within 0.01 %.)
    (
        "speed350m_flash.plan",
        "2026-11-30h/call0/speed-cold/speed-350m-rcoa.jsonl",
    ),
    (
        "speed350m_flash.plan",
        "2026-11-30h/speed-registers/speed-350m-rcoa.jsonl",
    ),
    (
        "h100-results/2026-11-30h/speed-1b/speed-1b.plan",
        "2026-11-30h/speed-1b/speed-1b-rcoa.jsonl",
    ),
    // H200, cold, beside the flash tests (issue 12's 8-bit Adam on its own): gpu_jobs.sh's
    // line for it, which is all of that run that came back (its summary's fields).
    ("llama125m_adam8bit.plan", "2026-11-28f/adam8bit.txt"),
];

/// A budget just under what the compact pool reserved must not be predicted to fit: the
/// run would have run out there. Every compact-pool run with a summary line. (The runs of
/// [`MEASURED`] used CubeCL's own pools, which reserve more and which `fits` does not
/// model: `--memory-pool cubecl`.)
#[test]
fn burn_does_not_fit_below_the_reserved_pool() {
    let compact = MEASURED_H200
        .iter()
        .chain(MEASURED_COMPACT)
        .filter_map(|&(name, file)| summary(file).map(|(_, reserved)| (name, file, reserved)));
    let mut checked = 0;
    for (name, file, reserved) in compact {
        checked += 1;
        let free = compile_with_budget(name, None);
        let needs = free.report.peak_bytes + free.report.reserve_bytes;
        println!(
            "{file}: reserved {reserved}, predicted to need {needs} ({:+.1}%)",
            100.0 * (needs as f64 / reserved as f64 - 1.0)
        );
        let c = compile_with_budget(name, Some(reserved - (256 << 20)));
        assert!(
            !c.lowered.prediction.fits,
            "{file}: predicted to fit in {} B although the pool reserved {reserved} B",
            reserved - (256 << 20)
        );
    }
    assert!(checked >= 11, "{checked} compact-pool runs");
}
