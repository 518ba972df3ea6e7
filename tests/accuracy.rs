//! The memory model's measured bar, and `rcoa validate`'s behaviour on bad input.
//!
//! `rcoa validate tests/groundtruth/h100-pytorch.jsonl` scores the predicted
//! peak of every ground-truth configuration against its H100 measurement.
//! The bar: median ≤ 3%, max ≤ 12%, every OOM row predicted not to fit, every
//! fitting row predicted to fit, no failures. The data is part of the
//! repository, so this never skips. Uses the test profile's binary (the
//! numbers do not depend on the build profile).

mod common;

use common::{assert_no_panic, rcoa, text};

fn field<'a>(line: &'a str, name: &str) -> &'a str {
    line.split_whitespace()
        .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
        .unwrap_or_else(|| panic!("no {name} in {line:?}"))
}

fn pct(line: &str, name: &str) -> f64 {
    field(line, name).trim_end_matches('%').parse().unwrap()
}

fn ratio(line: &str, name: &str) -> (u32, u32) {
    let (a, b) = field(line, name).split_once('/').unwrap();
    (a.parse().unwrap(), b.parse().unwrap())
}

/// Scores the measured runs in `path`: `rcoa validate` succeeds without a panic and
/// prints one line per configuration, then a summary with every fitting row predicted
/// to fit and no failures. Returns the output and its summary line.
fn scored(path: &std::path::Path) -> (String, String) {
    let out = rcoa(&["validate", path.to_str().unwrap()]);
    assert_no_panic(&out);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "validate failed:\n{stdout}\n{}",
        text(&out.stderr)
    );
    let configs = std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter(|l| l.contains("\"record\": \"config\""))
        .count();
    assert_eq!(stdout.lines().count(), configs + 1, "{stdout}");
    let last = stdout.lines().last().unwrap_or_default().to_string();
    assert!(last.starts_with("accuracy: "), "{last}");
    let n: u32 = field(&last, "n").parse().unwrap();
    assert_eq!(ratio(&last, "fit_correct"), (n, n), "{last}");
    assert_eq!(field(&last, "failures"), "0", "{last}");
    (stdout, last)
}

/// Scores `file` (under the repository root) and holds its summary to a bar: at least
/// `min_rows` configurations, the median and maximum absolute errors (percent), every OOM
/// row predicted not to fit (and at least one OOM row), and [`scored`]'s checks.
fn meets_bar(file: &str, min_rows: u32, median: f64, max: f64) {
    let (stdout, last) = scored(&common::root().join(file));
    let n: u32 = field(&last, "n").parse().unwrap();
    assert!(n >= min_rows, "{last}");
    assert!(pct(&last, "median_abs_err") <= median, "{stdout}");
    assert!(pct(&last, "max_abs_err") <= max, "{stdout}");
    let (ok, total) = ratio(&last, "oom_correct");
    assert!(total > 0 && ok == total, "{last}");
}

#[test]
fn memory_model_meets_the_accuracy_bar() {
    meets_bar("tests/groundtruth/h100-pytorch.jsonl", 40, 3.0, 12.0);
}

/// Issue 14's tails (encoders with eager attention, bf16 weights with Adafactor,
/// XLM-R-XL with LoRA), measured on an H100 after the model was fitted to CPU traces of
/// the same configurations: the measurement had no say in the model.
#[test]
fn the_single_gpu_tails_meet_the_bar() {
    meets_bar("tests/groundtruth/h100-pytorch-tails.jsonl", 21, 1.0, 5.0);
}

#[test]
fn json_format_prints_a_row_object_per_configuration_and_a_summary() {
    let out = rcoa(&[
        "validate",
        "tests/groundtruth/h100-pytorch.jsonl",
        "--format",
        "json",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let values: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect();
    let (summary, rows) = values.split_last().unwrap();
    assert_eq!(summary["record"], "summary");
    assert_eq!(summary["failures"], 0);
    assert_eq!(summary["n"], summary["fit_total"]);
    let median = summary["median_abs_err"].as_f64().unwrap();
    assert!(median <= 0.03, "{summary}");
    assert!(rows.iter().all(|r| r["record"] == "row"));
    let oom: Vec<_> = rows.iter().filter(|r| r["status"] == "oom").collect();
    assert_eq!(oom.len() as u64, summary["oom_total"].as_u64().unwrap());
    assert!(oom.iter().all(|r| r["fits"] == false));
    let scored = rows.iter().find(|r| r["status"] == "scored").unwrap();
    let (m, p) = (
        scored["measured_bytes"].as_f64().unwrap(),
        scored["predicted_bytes"].as_f64().unwrap(),
    );
    assert!((scored["rel_err"].as_f64().unwrap() - (p - m) / m).abs() < 1e-12);
}

fn scratch(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("rcoa-validate-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn first_rows(n: usize) -> String {
    std::fs::read_to_string(common::root().join("tests/groundtruth/h100-pytorch.jsonl"))
        .unwrap()
        .lines()
        .take(n)
        .map(|l| format!("{l}\n"))
        .collect()
}

#[test]
fn keep_writes_every_plan_and_each_one_compiles() {
    let dir = scratch("keep");
    let data = dir.join("two.jsonl");
    std::fs::write(&data, first_rows(3)).unwrap();
    let plans = dir.join("plans");
    let out = rcoa(&[
        "validate",
        data.to_str().unwrap(),
        "--keep",
        plans.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let mut names: Vec<_> = std::fs::read_dir(&plans)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    names.sort();
    assert_eq!(names, ["llama125m_base.plan", "llama125m_bf16.plan"]);
    let out = rcoa(&["check", plans.join("llama125m_bf16.plan").to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_malformed_line_is_named_by_file_and_line() {
    let dir = scratch("malformed");
    let data = dir.join("bad.jsonl");
    std::fs::write(
        &data,
        first_rows(2) + "{\"record\": \"config\", \"name\": 7\n",
    )
    .unwrap();
    let out = rcoa(&["validate", data.to_str().unwrap()]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("rcoa::validate::malformed"), "{err}");
    assert!(err.contains("bad.jsonl:3: not a measured run"), "{err}");
    assert!(out.stdout.is_empty(), "nothing is scored from a bad file");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_file_without_configurations_is_an_error() {
    let dir = scratch("empty");
    let data = dir.join("empty.jsonl");
    std::fs::write(&data, first_rows(1)).unwrap();
    let out = rcoa(&["validate", data.to_str().unwrap()]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("empty.jsonl: no configurations to score"));
    let out = rcoa(&["validate", dir.join("absent.jsonl").to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("no such file"),
        "{}",
        text(&out.stderr)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_row_that_does_not_compile_is_a_failure_with_exit_1() {
    let dir = scratch("failure");
    let data = dir.join("unknown-target.jsonl");
    // A LoRA target the plan language has no projection for fails to resolve.
    let rows = first_rows(2).replace(
        "\"lora\": null",
        "\"lora\": {\"r\": 8, \"alpha\": 16, \"targets\": [\"lm_head\"], \"dropout\": 0.0}",
    );
    std::fs::write(&data, rows).unwrap();
    let out = rcoa(&["validate", data.to_str().unwrap()]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("llama125m_base") && stdout.contains("FAILED at resolve"),
        "{stdout}"
    );
    assert!(
        stdout.lines().last().unwrap().ends_with("failures=1"),
        "{stdout}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The rows of `tests/groundtruth/h100-multigpu.jsonl` whose engine is one of `engines`
/// (the env record first) in a scratch file, scored; the summary line. Rank 0 under the fake
/// process group has no OOM rows, so [`meets_bar`]'s OOM check does not apply. Rows
/// measured while the script still held the unsharded parameters are scored without them
/// (`MeasuredRun::engine_peak_bytes`).
fn multigpu_summary(engines: &[&str]) -> String {
    let all = std::fs::read_to_string(common::root().join("tests/groundtruth/h100-multigpu.jsonl"))
        .unwrap();
    let tags: Vec<String> = engines
        .iter()
        .map(|e| format!("\"engine\": \"{e}\""))
        .collect();
    let rows: Vec<&str> = all
        .lines()
        .enumerate()
        .filter(|(i, l)| *i == 0 || tags.iter().any(|t| l.contains(t.as_str())))
        .map(|(_, l)| l)
        .collect();
    let file = scratch(&format!("multigpu-{}", engines.join("-"))).join("rows.jsonl");
    std::fs::write(&file, rows.join("\n") + "\n").unwrap();
    let (stdout, last) = scored(&file);
    let n: u32 = field(&last, "n").parse().unwrap();
    assert_eq!(n as usize, rows.len() - 1, "{stdout}");
    last
}

/// Issue 14's bar on the whole multi-GPU file: at least 30 configurations across FSDP2,
/// DDP, tensor parallelism and DeepSpeed, median ≤ 3%, max ≤ 10%.
#[test]
fn the_multi_gpu_rows_meet_the_bar() {
    let last = multigpu_summary(&["fsdp2", "ddp", "tp", "deepspeed"]);
    assert!(field(&last, "n").parse::<u32>().unwrap() >= 30, "{last}");
    assert!(pct(&last, "median_abs_err") <= 3.0, "{last}");
    assert!(pct(&last, "max_abs_err") <= 10.0, "{last}");
}

/// FSDP2 (`fully_shard` per layer and on the root; N from 2 to 64; bf16 / fp32 / mixed
/// precision; checkpointing, accumulation, fused AdamW) and DDP: tighter than the issue's
/// bar, since the model follows their code buffer by buffer.
#[test]
fn the_fsdp2_and_ddp_ranks_meet_the_bar() {
    let last = multigpu_summary(&["fsdp2", "ddp"]);
    assert_eq!(field(&last, "n"), "19", "{last}");
    assert!(pct(&last, "median_abs_err") <= 1.0, "{last}");
    assert!(pct(&last, "max_abs_err") <= 3.0, "{last}");
}

/// DeepSpeed ZeRO 0-3: rank 0 of 2, 8 and 32 ranks, bf16 weights with fp32 master,
/// DeepSpeed's default sizes (`docs/accuracy.md`, "DeepSpeed").
#[test]
fn deepspeed_rows_meet_the_multi_gpu_bar() {
    let last = multigpu_summary(&["deepspeed"]);
    assert!(field(&last, "n").parse::<u32>().unwrap() >= 7, "{last}");
    assert!(pct(&last, "median_abs_err") <= 1.0, "{last}");
    assert!(pct(&last, "max_abs_err") <= 3.0, "{last}");
}
