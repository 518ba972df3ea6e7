//! `rcoa run --profile-kernels`: where a CUDA step's time goes. Without a GPU only
//! its refusals can be checked here; on a GPU machine with a CUDA build the last
//! test checks the report itself.

mod common;
use common::{assert_no_panic, rcoa, text};

/// `rcoa run ARGS…`.
fn run(args: &[&str]) -> std::process::Output {
    rcoa(&[&["run"], args].concat())
}

const PLAN: &str = "plans/tiny-cpu.plan";

#[test]
fn on_the_cpu_it_is_refused() {
    let out = run(&[PLAN, "--steps", "1", "--profile-kernels"]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--profile-kernels"), "{stderr}");
    assert!(stderr.contains("--device cuda"), "{stderr}");
}

#[test]
fn more_than_one_rank_in_the_process_is_refused() {
    let out = run(&[
        PLAN,
        "--steps",
        "1",
        "--device",
        "cuda",
        "--devices",
        "2",
        "--profile-kernels",
    ]);
    let stderr = text(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--devices 1"), "{stderr}");
}

#[test]
fn on_cuda_it_reports_the_steps_kernels_or_a_clean_error() {
    let out = run(&[
        PLAN,
        "--steps",
        "3",
        "--device",
        "cuda",
        "--profile-kernels",
        "--format",
        "json",
    ]);
    let stderr = text(&out.stderr);
    if !out.status.success() {
        // No CUDA build, or no GPU.
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("CUDA") || stderr.contains("cuda"),
            "{stderr}"
        );
        assert_no_panic(&out);
        return;
    }
    let profile = text(&out.stdout)
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .find(|v| v["event"] == "kernel_profile")
        .unwrap_or_else(|| panic!("a kernel_profile line; stderr: {stderr}"));
    assert_eq!(profile["steps"], serde_json::json!([2, 3]), "{profile}");
    assert!(
        profile["kernel_seconds"].as_f64().unwrap() > 0.0,
        "{profile}"
    );
    assert!(
        profile["plan_flops_per_step"].as_f64().unwrap() > 0.0,
        "{profile}"
    );
    let families = profile["families"].as_array().unwrap();
    assert!(
        families.iter().any(|f| f["family"] == "matmul"),
        "a training step multiplies matrices: {profile}"
    );
}
