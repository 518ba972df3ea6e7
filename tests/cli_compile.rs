//! `rcoa compile`, end to end through the built binary.
//!
//! - golden `--explain` output: each `tests/compile/*.plan` is compiled and its
//!   exit status + stdout is an insta snapshot in `tests/snapshots/` (adding a
//!   file adds a case). The text has no paths, colours or wall-clock timings.
//!   Re-bless after an intended change with
//!   `INSTA_UPDATE=always cargo test --test cli_compile`, then review the diff;
//! - the JSON contract of DESIGN.md (`memory.*`, `decisions`, `time.*`, `resolved.*`);
//! - exit status 0 fits, 1 does not fit (JSON still printed), 2 bad or unsupported plan.

use std::path::{Path, PathBuf};

mod common;
use common::{assert_no_panic, rcoa, root, text};

fn plans() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(root().join("tests/compile"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "plan"))
        .collect();
    v.sort();
    v
}

fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("cli_compile")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn explain_goldens() {
    for plan in plans() {
        let rel = plan
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let out = rcoa(&["compile", &rel, "--explain"]);
        assert_no_panic(&out);
        let name = plan.file_stem().unwrap().to_string_lossy().into_owned();
        let shown = format!(
            "exit: {}\n{}",
            out.status.code().unwrap_or(-1),
            text(&out.stdout)
        );
        insta::assert_snapshot!(format!("explain__{name}"), shown);
    }
}

#[test]
fn json_contract_for_every_example_plan() {
    let mut all = plans();
    let mut examples: Vec<PathBuf> = std::fs::read_dir(root().join("plans"))
        .map(|d| {
            d.map(|e| e.unwrap().path())
                .filter(|p| p.extension().is_some_and(|e| e == "plan"))
                .collect()
        })
        .unwrap_or_default();
    examples.sort();
    all.extend(examples);
    for plan in all {
        let rel = plan
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let out = rcoa(&["compile", &rel, "--format", "json"]);
        assert_no_panic(&out);
        let code = out.status.code().unwrap();
        assert!(
            code == 0 || code == 1,
            "{rel}: exit {code}\n{}",
            text(&out.stderr)
        );
        let v: serde_json::Value =
            serde_json::from_slice(&out.stdout).unwrap_or_else(|e| panic!("{rel}: {e}"));
        let m = &v["memory"];
        let fits = m["fits"].as_bool().unwrap();
        assert_eq!(code == 0, fits, "{rel}: exit status follows memory.fits");
        assert!(m["peak_bytes"].as_u64().unwrap() > 0, "{rel}");
        assert!(m["budget_bytes"].as_u64().unwrap() > 0, "{rel}");
        for k in [
            "weights",
            "grads",
            "optimizer",
            "activations",
            "workspace",
            "reserved",
        ] {
            assert!(m["breakdown"][k].is_u64(), "{rel}: breakdown.{k}");
        }
        for d in v["decisions"].as_array().unwrap() {
            assert!(
                d["pass"].is_string() && d["what"].is_string() && d["why"].is_string(),
                "{rel}: {d}"
            );
        }
        assert!(v["time"]["step_seconds"].as_f64().unwrap() > 0.0, "{rel}");
        assert!(
            v["time"]["tokens_per_second"].as_f64().unwrap() > 0.0,
            "{rel}"
        );
        let r = &v["resolved"];
        for k in [
            "micro_batch",
            "grad_accum",
            "data",
            "zero",
            "tensor",
            "pipeline",
            "context",
        ] {
            assert!(r[k].is_u64(), "{rel}: resolved.{k}");
        }
        // The per-rank view: exactly one worst rank, whose peak is the reported one, and
        // traffic rows whose network seconds are the step time's communication term.
        let ranks = v["parallel"]["ranks"].as_array().unwrap();
        let worst: Vec<_> = ranks.iter().filter(|r| r["worst"] == true).collect();
        assert_eq!(worst.len(), 1, "{rel}");
        assert_eq!(worst[0]["peak_bytes"], m["peak_bytes"], "{rel}");
        let network: f64 = v["parallel"]["traffic"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|t| t["group"] != "host")
            .map(|t| t["seconds_per_step"].as_f64().unwrap())
            .sum();
        let comm = v["time"]["communication_seconds"].as_f64().unwrap();
        assert!(
            (network - comm).abs() <= 1e-9 * comm.max(1e-9),
            "{rel}: {network} vs {comm}"
        );
        assert!(r["checkpoint"].is_string(), "{rel}");
        assert!(r["checkpoint_layers"].is_array(), "{rel}");
        assert!(
            r["offload"]
                .as_array()
                .unwrap()
                .iter()
                .all(|o| o.is_string()),
            "{rel}"
        );
    }
}

/// The README quotes `rcoa compile PLAN`'s summary line: it must be what the binary
/// prints (it went stale once, when the line began naming the offload list).
#[test]
fn the_readme_quotes_the_compile_line_it_gets() {
    let readme = std::fs::read_to_string(root().join("README.md")).unwrap();
    let mut lines = readme.lines();
    let mut quoted = 0;
    while let Some(line) = lines.next() {
        let Some(plan) = line.strip_prefix("$ rcoa compile ") else {
            continue;
        };
        let out = rcoa(&["compile", plan.trim()]);
        assert_no_panic(&out);
        let expected = lines.next().unwrap_or_default();
        assert_eq!(text(&out.stdout).trim_end(), expected, "README: {line}");
        quoted += 1;
    }
    assert!(quoted > 0, "the README quotes no `$ rcoa compile` line");
}

#[test]
fn does_not_fit_exits_1_and_still_prints_json() {
    let out = rcoa(&[
        "compile",
        "tests/compile/llama-8b-full-does-not-fit.plan",
        "--format",
        "json",
    ]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["memory"]["fits"], false);
    assert!(
        v["memory"]["peak_bytes"].as_u64().unwrap() > v["memory"]["budget_bytes"].as_u64().unwrap()
    );
}

#[test]
fn unsupported_features_exit_2_with_a_diagnostic() {
    let dir = scratch("unsupported");
    let plan = dir.join("moe.plan");
    std::fs::write(
        &plan,
        "model {\n  arch = decoder\n  layers = 4\n  hidden = 512\n  heads = 8\n  ffn = 1408\n  mlp = swiglu\n  norm = rmsnorm\n  vocab = 32000\n  max_positions = 1024\n  tie_embeddings = false\n  experts = 8\n  experts_per_token = 2\n}\nhardware { gpu = h100-80gb }\ntrain { seq_len = 1024  global_batch = 8  micro_batch = 8 }\n",
    )
    .unwrap();
    let out = rcoa(&["compile", plan.to_str().unwrap(), "--format", "json"]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(
        err.contains("rcoa::unsupported") && err.contains("mixture of experts"),
        "{err}"
    );
    assert!(out.stdout.is_empty(), "no guessed prediction on stdout");
}

#[test]
fn bad_plans_exit_2() {
    let dir = scratch("bad");
    let plan = dir.join("bad.plan");
    std::fs::write(
        &plan,
        "model \"llama-3.2-1b\"\nhardware { gpu = h100-80gb }\n",
    )
    .unwrap();
    let out = rcoa(&["compile", plan.to_str().unwrap()]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
    let out = rcoa(&["compile", dir.join("missing.plan").to_str().unwrap()]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
}
