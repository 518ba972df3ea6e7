//! The memory model's measured bar and `rcoa validate`'s behaviour as a user
//! meets it. `rcoa validate tests/groundtruth/h100-pytorch.jsonl` scores the
//! predicted peak of every in-repo ground-truth configuration against its H100
//! measurement; the bar is median ≤ 3%, max ≤ 12%, every OOM row predicted
//! not to fit, every fitting row predicted to fit, no failures. Never skips:
//! the data is part of the repository.

mod common;

use common::{assert_no_panic, rcoa, text};

fn field(last: &str, name: &str) -> String {
    last.split_whitespace()
        .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
        .unwrap_or_else(|| panic!("no {name} in {last:?}"))
        .to_string()
}

fn ratio(last: &str, name: &str) -> (u32, u32) {
    let f = field(last, name);
    let (a, b) = f.split_once('/').unwrap();
    (a.parse().unwrap(), b.parse().unwrap())
}

#[test]
fn memory_model_meets_the_accuracy_bar() {
    let out = rcoa(&["validate", "tests/groundtruth/h100-pytorch.jsonl"]);
    let stdout = text(&out.stdout);
    assert!(
        out.status.success(),
        "validate failed:\n{stdout}\n{}",
        text(&out.stderr)
    );
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.starts_with("accuracy: "), "{last}");
    let pct = |name: &str| {
        field(last, name)
            .trim_end_matches('%')
            .parse::<f64>()
            .unwrap()
    };
    assert!(pct("median_abs_err") <= 3.0, "{last}");
    assert!(pct("max_abs_err") <= 12.0, "{last}");
    let (ok, n) = ratio(last, "oom_correct");
    assert!(n >= 3 && ok == n, "{last}");
    let (ok, n) = ratio(last, "fit_correct");
    assert!(n >= 45 && ok == n, "{last}");
    assert_eq!(field(last, "failures"), "0", "{last}");
    // One line per configuration before the summary.
    assert_eq!(stdout.lines().count(), 48 + 1, "{stdout}");
}

/// A scratch file under the target directory (tests run in parallel).
fn scratch(name: &str, content: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("rcoa-validate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, content).unwrap();
    p
}

fn first_rows(n: usize) -> Vec<String> {
    std::fs::read_to_string(common::root().join("tests/groundtruth/h100-pytorch.jsonl"))
        .unwrap()
        .lines()
        .take(n)
        .map(str::to_string)
        .collect()
}

#[test]
fn json_rows_and_oom_rows() {
    let all = std::fs::read_to_string(common::root().join("tests/groundtruth/h100-pytorch.jsonl"))
        .unwrap();
    let oom: Vec<&str> = all
        .lines()
        .filter(|l| l.contains("\"oom\": true"))
        .collect();
    let p = scratch("oom.jsonl", &oom.join("\n"));
    let out = rcoa(&["validate", p.to_str().unwrap(), "--format", "json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let lines: Vec<serde_json::Value> = text(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), oom.len() + 1);
    for row in &lines[..oom.len()] {
        assert_eq!(row["oom"], true);
        assert_eq!(row["fits"], false, "{row}");
    }
    let s = &lines[oom.len()]["summary"];
    assert_eq!(s["oom_correct"], oom.len());
    assert_eq!(s["n"], 0);
}

#[test]
fn a_malformed_line_is_an_error_with_its_line_number() {
    let mut rows = first_rows(3);
    rows.insert(2, "{\"record\": \"config\", \"name\": truncated".into());
    let p = scratch("bad.jsonl", &rows.join("\n"));
    let out = rcoa(&["validate", p.to_str().unwrap()]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("line 3: not JSON"), "{err}");
    assert!(err.contains("bad.jsonl"), "{err}");
}

#[test]
fn an_empty_or_missing_file_is_a_clear_error() {
    let p = scratch("empty.jsonl", "");
    let out = rcoa(&["validate", p.to_str().unwrap()]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("no measured configurations"));
    let out = rcoa(&["validate", "tests/groundtruth/missing.jsonl"]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("cannot read"));
}

#[test]
fn a_configuration_that_cannot_compile_is_a_failure_not_a_crash() {
    let rows = first_rows(3);
    let broken = rows[1].replace("\"optimizer\": \"adamw\"", "\"optimizer\": \"lamb\"");
    assert_ne!(broken, rows[1], "the first configuration uses adamw");
    let p = scratch(
        "fail.jsonl",
        &format!("{}\n{broken}\n{}\n", rows[0], rows[2]),
    );
    let dir = std::env::temp_dir().join(format!("rcoa-validate-keep-{}", std::process::id()));
    let out = rcoa(&[
        "validate",
        p.to_str().unwrap(),
        "--keep",
        dir.to_str().unwrap(),
    ]);
    assert_no_panic(&out);
    assert_eq!(out.status.code(), Some(1));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains("FAILED unknown optimizer `lamb`"),
        "{stdout}"
    );
    assert!(
        stdout.lines().last().unwrap().contains("failures=1"),
        "{stdout}"
    );
    // --keep writes the plans it could generate, for a user to read.
    let second: serde_json::Value = serde_json::from_str(&rows[2]).unwrap();
    let name = second["config"]["name"].as_str().unwrap();
    let kept = std::fs::read_to_string(dir.join(format!("{name}.plan"))).unwrap();
    assert!(kept.contains("target pytorch"), "{kept}");
}
