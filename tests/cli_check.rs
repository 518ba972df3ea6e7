//! `rcoa check` and `rcoa catalog`, end to end through the built binary.
//!
//! - every plan in `plans/` passes `rcoa check`;
//! - golden diagnostics: each `tests/diagnostics/*.plan` is a bad plan whose
//!   rendered diagnostic (exit status + stderr of `rcoa check`) is an insta
//!   snapshot in `tests/snapshots/` — adding a file adds a case. Re-bless
//!   after an intended wording change with
//!   `INSTA_UPDATE=always cargo test --test cli_check` (or
//!   `cargo insta test --accept --test cli_check`), then review the diff;
//! - bad input exits 2 with a diagnostic and never panics (empty file,
//!   invalid UTF-8, a missing file, a directory without plans).

use std::path::{Path, PathBuf};

mod common;
use common::{assert_no_panic, rcoa, root, text};

/// A fresh scratch directory for one test.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("cli_check")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn plan_files(dir: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "plan"))
        .collect();
    v.sort();
    v
}

#[test]
fn every_example_plan_passes() {
    let plans = plan_files(&root().join("plans"));
    assert!(
        plans.len() >= 11,
        "expected the example plans, found {}",
        plans.len()
    );
    let rel: Vec<String> = plans
        .iter()
        .map(|p| p.strip_prefix(root()).unwrap().display().to_string())
        .collect();
    let args: Vec<&str> = std::iter::once("check")
        .chain(rel.iter().map(String::as_str))
        .collect();
    let out = rcoa(&args);
    assert_no_panic(&out);
    assert!(
        out.status.success(),
        "rcoa check failed:\n{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let stdout = text(&out.stdout);
    for r in &rel {
        assert!(
            stdout.contains(&format!("{r}: ok")),
            "{r} not reported ok:\n{stdout}"
        );
    }
    assert!(
        stdout.contains(&format!("checked {} plans: all ok", rel.len())),
        "{stdout}"
    );
}

#[test]
fn a_directory_checks_its_plans() {
    let out = rcoa(&["check", "--quiet", "plans"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        !text(&out.stdout).contains(": ok"),
        "--quiet prints only the summary"
    );
    assert!(text(&out.stdout).contains("all ok"));
}

/// Every golden input, rendered; all mismatches are listed together.
#[test]
fn golden_diagnostics() {
    let dir = root().join("tests/diagnostics");
    let inputs = plan_files(&dir);
    assert!(inputs.len() >= 25, "only {} golden inputs", inputs.len());
    let mut failures = Vec::new();
    for path in inputs {
        let stem = path.file_stem().unwrap().to_string_lossy().into_owned();
        let rel = path.strip_prefix(root()).unwrap().display().to_string();
        let out = rcoa(&["check", &rel]);
        let stderr = text(&out.stderr);
        let result = std::panic::catch_unwind(|| {
            assert!(
                !stderr.contains("panicked"),
                "{rel}: rcoa panicked:\n{stderr}"
            );
            assert_eq!(
                out.status.code(),
                Some(2),
                "{rel}: a bad plan exits 2:\n{stderr}"
            );
            assert!(
                stderr.contains("rcoa::"),
                "{rel}: no diagnostic code:\n{stderr}"
            );
            let snapshot = format!("exit: {}\n{}", out.status.code().unwrap_or(-1), stderr);
            let mut settings = insta::Settings::clone_current();
            settings.set_prepend_module_to_snapshot(false);
            settings.set_snapshot_path(root().join("tests/snapshots"));
            settings.set_input_file(&path);
            settings.set_description(format!("rcoa check {rel}"));
            settings.bind(|| insta::assert_snapshot!(format!("diagnostics__{stem}"), snapshot));
        });
        if result.is_err() {
            failures.push(rel);
        }
    }
    assert!(
        failures.is_empty(),
        "golden diagnostics differ: {failures:?}"
    );
}

#[test]
fn empty_file_reports_the_missing_sections() {
    let dir = scratch("empty");
    let p = dir.join("empty.plan");
    std::fs::write(&p, "").unwrap();
    let out = rcoa(&["check", p.to_str().unwrap()]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    for s in ["model", "hardware", "train"] {
        assert!(
            err.contains(&format!("the plan has no `{s}` section")),
            "{err}"
        );
    }
}

#[test]
fn invalid_utf8_is_a_located_diagnostic() {
    let dir = scratch("utf8");
    let p = dir.join("latin1.plan");
    std::fs::write(&p, b"model \"caf\xe9\"\n").unwrap();
    let out = rcoa(&["check", p.to_str().unwrap()]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("rcoa::invalid_utf8"),
        "{}",
        text(&out.stderr)
    );
}

#[test]
fn missing_file_is_a_clear_error() {
    let out = rcoa(&["check", "plans/no-such-plan.plan"]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("cannot read plans/no-such-plan.plan: no such file"),
        "{err}"
    );
    assert!(text(&out.stdout).contains("0 ok, 1 with problems"));
}

#[test]
fn one_bad_plan_among_good_ones_fails_the_run() {
    let out = rcoa(&[
        "check",
        "plans/tiny-cpu.plan",
        "tests/diagnostics/unknown-gpu.plan",
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stdout).contains("plans/tiny-cpu.plan: ok"));
    assert!(text(&out.stdout).contains("checked 2 plans: 1 ok, 1 with problems"));
    assert!(text(&out.stderr).contains("did you mean `a100-40gb`?"));
}

#[test]
fn a_directory_without_plans_is_an_error() {
    let dir = scratch("noplans");
    let out = rcoa(&["check", dir.to_str().unwrap()]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("has no .plan files"));
}

#[test]
fn hf_config_next_to_the_plan() {
    let dir = scratch("hf");
    std::fs::write(
        dir.join("config.json"),
        r#"{"model_type": "mistral", "num_hidden_layers": 32, "hidden_size": 4096,
            "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
            "vocab_size": 32000, "max_position_embeddings": 32768, "tie_word_embeddings": false}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("job.plan"),
        "model hf \"config.json\" { layers = 2 }\nhardware { gpu = l40s-48gb }\ntrain { seq_len = 4096 global_batch = 8 }\n",
    )
    .unwrap();
    // Run from elsewhere: the path is relative to the plan, not the working directory.
    let out = rcoa(&["check", dir.join("job.plan").to_str().unwrap()]);
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn catalog_gpus_table_and_json() {
    let out = rcoa(&["catalog", "gpus"]);
    assert!(out.status.success());
    let t = text(&out.stdout);
    let first = t.lines().next().unwrap();
    assert!(first.starts_with("NAME"), "{t}");
    for g in [
        "h100-80gb",
        "h200-141gb",
        "a100-80gb",
        "a100-40gb",
        "v100-32gb",
        "rtx6000-24gb",
        "l40s-48gb",
        "rtx4090-24gb",
        "t4-16gb",
    ] {
        assert!(t.lines().any(|l| l.starts_with(g)), "{g} missing:\n{t}");
    }
    assert!(t.contains("85017493504"), "{t}");
    // Aligned: the right-aligned BYTES column ends at the same offset in every row.
    let end = first.find("BYTES").unwrap() + "BYTES".len();
    for l in t.lines().skip(1) {
        assert!(
            l.as_bytes()[end - 1].is_ascii_digit() && &l[end..end + 2] == "  ",
            "misaligned:\n{t}"
        );
    }

    let out = rcoa(&["catalog", "gpus", "--format", "json"]);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let h100 = v
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == "h100-80gb")
        .unwrap();
    assert_eq!(h100["memory_bytes"], 85_017_493_504u64);
}

#[test]
fn catalog_models_json_has_the_real_shapes() {
    let out = rcoa(&["catalog", "models", "--format", "json"]);
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let m = v
        .as_array()
        .unwrap()
        .iter()
        .find(|m| m["name"] == "llama-3.1-8b")
        .unwrap();
    assert_eq!(m["spec"]["layers"], 32);
    assert_eq!(m["spec"]["kv_heads"], 8);
    assert_eq!(m["spec"]["ffn"], 14336);
    assert_eq!(m["params"], 8_030_261_248u64);
    let out = rcoa(&["catalog", "models"]);
    assert!(text(&out.stdout).contains("xlm-roberta-xxl"));
}
