//! `rcoa run --memory-pool`: the choice of CubeCL's pools on CUDA (docs/memory-pool.md).
//! Without a GPU only its refusals and the start event can be checked here.

use std::process::{Command, Output};

/// `rcoa run` of the tiny plan for one step with `args` after it, in a directory of its
/// own named after `name`.
fn run_tiny(name: &str, args: &[&str]) -> Output {
    let d = std::env::temp_dir().join(format!("rcoa-cli-pool-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    let plan = d.join("tiny.json");
    std::fs::write(
        &plan,
        serde_json::to_string(&rcoa_backend::testing::tiny_plan()).unwrap(),
    )
    .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_rcoa"))
        .args(["run", "--lowered", plan.to_str().unwrap(), "--steps", "1"])
        .args(args)
        .output()
        .unwrap();
    let _ = std::fs::remove_dir_all(&d);
    out
}

/// Exit status 2 with a stderr that says each of `says`, and no panic.
fn refused(out: &Output, says: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for s in says {
        assert!(stderr.contains(s), "`{s}` not in: {stderr}");
    }
    assert!(!stderr.contains("panicked"), "{stderr}");
}

fn start_event(out: &Output) -> serde_json::Value {
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "start")
        .expect("a start line")
}

#[test]
fn an_unknown_pool_is_a_usage_error() {
    let out = run_tiny("unknown", &["--memory-pool", "big"]);
    refused(&out, &["`compact`", "`expandable`"]);
}

#[test]
fn any_pool_on_the_cpu_is_refused() {
    for pool in ["compact", "expandable", "cubecl"] {
        let out = run_tiny(&format!("cpu-{pool}"), &["--memory-pool", pool]);
        refused(&out, &["--device cuda"]);
    }
}

#[test]
fn expandable_with_two_devices_in_a_process_is_refused() {
    let out = run_tiny(
        "devices",
        &[
            "--device",
            "cuda",
            "--devices",
            "2",
            "--memory-pool",
            "expandable",
        ],
    );
    refused(&out, &["expandable", "one device per process"]);
}

#[test]
fn a_pool_on_cuda_without_a_gpu_is_a_clean_error() {
    // Without the `cuda` feature, or without a GPU, exit 2 with a message; on a GPU machine
    // with a CUDA build the run may succeed, and its start event names the pool.
    // No flag: `compact`, the default.
    for pool in [None, Some("compact"), Some("expandable"), Some("cubecl")] {
        let mut args = vec!["--device", "cuda", "--format", "json"];
        args.extend(pool.iter().flat_map(|p| ["--memory-pool", *p]));
        let out = run_tiny(&format!("cuda-{}", pool.unwrap_or("none")), &args);
        let stderr = String::from_utf8_lossy(&out.stderr);
        // CubeCL's own pools are outside what `fits` assumed: the run says so first.
        assert_eq!(
            stderr.contains("reserves more than the plan's `fits` assumed"),
            pool == Some("cubecl"),
            "{stderr}"
        );
        if out.status.success() {
            assert_eq!(start_event(&out)["memory_pool"], pool.unwrap_or("compact"));
        } else {
            assert!(
                stderr.contains("CUDA") || stderr.contains("cuda"),
                "{stderr}"
            );
            refused(&out, &[]);
        }
    }
}

#[test]
fn the_cpu_start_event_names_no_pool() {
    let out = run_tiny("start", &["--format", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let start = start_event(&out);
    assert!(
        start.get("memory_pool").is_some_and(|v| v.is_null()),
        "{start}"
    );
}
