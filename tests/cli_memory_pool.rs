//! `rcoa run --memory-pool`: the choice of CubeCL's pools on CUDA (docs/memory-pool.md).
//! Without a GPU only its refusals and the start event can be checked here.

use std::process::Command;

fn rcoa() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rcoa"))
}

fn tiny_plan_file(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
    let d = std::env::temp_dir().join(format!("rcoa-cli-pool-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join("tiny.json");
    std::fs::write(
        &p,
        serde_json::to_string(&rcoa_backend::testing::tiny_plan()).unwrap(),
    )
    .unwrap();
    (d, p)
}

fn run(args: &[&str]) -> std::process::Output {
    rcoa().arg("run").args(args).output().unwrap()
}

#[test]
fn an_unknown_pool_is_a_usage_error() {
    let (d, plan) = tiny_plan_file("unknown");
    let out = run(&[
        "--lowered",
        plan.to_str().unwrap(),
        "--steps",
        "1",
        "--memory-pool",
        "big",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("`compact`"), "{stderr}");
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn compact_or_expandable_on_the_cpu_is_refused() {
    let (d, plan) = tiny_plan_file("cpu");
    for pool in ["compact", "expandable"] {
        let out = run(&[
            "--lowered",
            plan.to_str().unwrap(),
            "--steps",
            "1",
            "--memory-pool",
            pool,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{pool}: {stderr}");
        assert!(stderr.contains("--device cuda"), "{pool}: {stderr}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn expandable_with_two_devices_in_a_process_is_refused() {
    let (d, plan) = tiny_plan_file("devices");
    let out = run(&[
        "--lowered",
        plan.to_str().unwrap(),
        "--steps",
        "1",
        "--device",
        "cuda",
        "--devices",
        "2",
        "--memory-pool",
        "expandable",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(
        stderr.contains("expandable") && stderr.contains("one device per process"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn compact_on_cuda_without_a_gpu_is_a_clean_error() {
    // Without the `cuda` feature, or without a GPU, exit 2 with a message; on a GPU machine
    // with a CUDA build the run may succeed, and its start event names the pool.
    let (d, plan) = tiny_plan_file("cuda");
    let out = run(&[
        "--lowered",
        plan.to_str().unwrap(),
        "--steps",
        "1",
        "--device",
        "cuda",
        "--memory-pool",
        "compact",
        "--format",
        "json",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        let start = String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .find(|v| v["event"] == "start")
            .expect("a start line");
        assert_eq!(start["memory_pool"], "compact");
    } else {
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("CUDA") || stderr.contains("cuda"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn the_cpu_start_event_names_no_pool() {
    let (d, plan) = tiny_plan_file("start");
    let out = run(&[
        "--lowered",
        plan.to_str().unwrap(),
        "--steps",
        "1",
        "--format",
        "json",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let start = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "start")
        .expect("a start line");
    assert!(
        start.get("memory_pool").is_some_and(|v| v.is_null()),
        "{start}"
    );
    let _ = std::fs::remove_dir_all(&d);
}
