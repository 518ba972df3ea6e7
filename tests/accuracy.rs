//! The memory model's measured bar: `../shared/tools/accuracy.py` scores the
//! predicted peak of every ground-truth configuration against the H100
//! measurement. Asserts median ≤ 3%, max ≤ 12%, every OOM row predicted not
//! to fit, every fitting row predicted to fit, no failures. Skips cleanly when
//! `../shared` or `python3` is absent. Uses the test profile's binary (the
//! scorer's numbers do not depend on the build profile; docs/accuracy.md
//! records the release run).

use std::path::PathBuf;
use std::process::Command;

#[test]
fn memory_model_meets_the_accuracy_bar() {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let script = root.join("../shared/tools/accuracy.py");
    let data = root.join("../shared/groundtruth/h100-pytorch.jsonl");
    if !script.exists() || !data.exists() {
        eprintln!("skipping: ../shared is not present");
        return;
    }
    let Ok(out) = Command::new("python3")
        .arg(&script)
        .arg("--rcoa")
        .arg(env!("CARGO_BIN_EXE_rcoa"))
        .arg("--data")
        .arg(&data)
        .output()
    else {
        eprintln!("skipping: python3 is not available");
        return;
    };
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default().to_string();
    assert!(
        out.status.success(),
        "scorer failed:\n{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let field = |name: &str| -> String {
        last.split_whitespace()
            .find_map(|kv| kv.strip_prefix(&format!("{name}=")))
            .unwrap_or_else(|| panic!("no {name} in {last:?}"))
            .to_string()
    };
    let pct = |name: &str| field(name).trim_end_matches('%').parse::<f64>().unwrap();
    let ratio = |name: &str| {
        let f = field(name);
        let (a, b) = f.split_once('/').unwrap();
        (a.parse::<u32>().unwrap(), b.parse::<u32>().unwrap())
    };
    assert!(pct("median_abs_err") <= 3.0, "{last}");
    assert!(pct("max_abs_err") <= 12.0, "{last}");
    let (ok, n) = ratio("oom_correct");
    assert_eq!(ok, n, "{last}");
    let (ok, n) = ratio("fit_correct");
    assert_eq!(ok, n, "{last}");
    assert_eq!(field("failures"), "0", "{last}");
}
