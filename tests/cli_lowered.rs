//! `rcoa compile --lowered FILE` writes the lowered plan that `rcoa run --lowered`
//! and `rcoa emit` read: the compiler's decisions travel to executors as data.

use std::path::PathBuf;
use std::process::Command;

fn rcoa() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rcoa"))
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

#[test]
fn a_lowered_plan_round_trips_from_compile_to_run_and_emit() {
    let dir = std::env::temp_dir().join(format!("rcoa-lowered-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let lowered = dir.join("tiny.json");
    let out = rcoa()
        .args([
            "compile",
            "plans/tiny-cpu.plan",
            "--format",
            "json",
            "--lowered",
        ])
        .arg(&lowered)
        .current_dir(root())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&lowered).unwrap()).unwrap();
    // The file holds what the report resolved and predicted.
    assert_eq!(
        plan["resolved"]["micro_batch"],
        report["resolved"]["micro_batch"]
    );
    assert_eq!(
        plan["resolved"]["grad_accum"],
        report["resolved"]["grad_accum"]
    );
    assert_eq!(
        plan["prediction"]["peak_bytes"],
        report["memory"]["peak_bytes"]
    );

    let run = rcoa()
        .args(["run", "--steps", "2", "--format", "json", "--lowered"])
        .arg(&lowered)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let summary = String::from_utf8_lossy(&run.stdout);
    let last: serde_json::Value = serde_json::from_str(summary.lines().last().unwrap()).unwrap();
    assert_eq!(last["predicted_peak_bytes"], report["memory"]["peak_bytes"]);

    let emit = rcoa()
        .args(["emit", "--target", "deepspeed"])
        .arg(&lowered)
        .output()
        .unwrap();
    assert!(
        emit.status.success(),
        "{}",
        String::from_utf8_lossy(&emit.stderr)
    );
    let ds: serde_json::Value = serde_json::from_slice(&emit.stdout).unwrap();
    assert_eq!(
        ds["train_micro_batch_size_per_gpu"],
        report["resolved"]["micro_batch"]
    );
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn an_unwritable_lowered_path_is_a_clear_error() {
    let out = rcoa()
        .args([
            "compile",
            "plans/tiny-cpu.plan",
            "--lowered",
            "/nonexistent-dir/x/plan.json",
        ])
        .current_dir(root())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cannot write the lowered plan"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// The step's schedule travels in the lowered plan (`resolved.optimizer_in_backward`,
/// `resolved.virtual_stages`): `rcoa run --lowered` steps in the backward on one device and
/// refuses it under ZeRO, and a plan written before the fields existed still reads, as
/// the plain schedule.
#[test]
fn the_step_schedule_travels_in_the_lowered_plan() {
    let dir = std::env::temp_dir().join(format!("rcoa-lowered-sched-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = std::fs::read_to_string(root().join("plans/tiny-cpu.plan"))
        .unwrap()
        .replace(
            "micro_batch = 4\n  grad_accum = 2",
            "micro_batch = 8\n  grad_accum = 1",
        )
        .replace(
            "optimizer adamw { lr = 1e-3  weight_decay = 0.0 }",
            "optimizer adamw { lr = 1e-3  weight_decay = 0.0  in_backward = true }",
        )
        .replace("target burn", "target pytorch");
    let plan = dir.join("inbwd.plan");
    std::fs::write(&plan, src).unwrap();
    let lowered = dir.join("inbwd.json");
    let out = rcoa()
        .args(["compile", "--lowered"])
        .arg(&lowered)
        .arg(&plan)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&lowered).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(json["resolved"]["optimizer_in_backward"], true);
    assert_eq!(json["resolved"]["virtual_stages"], 1);

    // One device, the optimizer on it: `rcoa run` steps in the backward.
    let run = rcoa()
        .args(["run", "--steps", "1", "--format", "json", "--lowered"])
        .arg(&lowered)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let start = String::from_utf8_lossy(&run.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "start")
        .expect("a start event");
    assert_eq!(start["optimizer_in_backward"], true, "{start}");
    // Under ZeRO (a plan for another engine) it does not.
    let mut zero = json.clone();
    zero["resolved"]["zero"] = 1.into();
    let zero_file = dir.join("zero.json");
    std::fs::write(&zero_file, serde_json::to_string(&zero).unwrap()).unwrap();
    let run = rcoa()
        .args(["run", "--steps", "1", "--lowered"])
        .arg(&zero_file)
        .output()
        .unwrap();
    assert_eq!(run.status.code(), Some(2));
    let err = String::from_utf8_lossy(&run.stderr);
    assert!(
        err.contains("`optimizer.in_backward = true`) with ZeRO"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");

    // An older lowered plan, without the fields, reads as the plain schedule.
    let resolved = json["resolved"].as_object_mut().unwrap();
    resolved.remove("optimizer_in_backward");
    resolved.remove("virtual_stages");
    let old = dir.join("old.json");
    std::fs::write(&old, serde_json::to_string(&json).unwrap()).unwrap();
    let run = rcoa()
        .args(["run", "--steps", "1", "--lowered"])
        .arg(&old)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    std::fs::remove_dir_all(&dir).ok();
}
