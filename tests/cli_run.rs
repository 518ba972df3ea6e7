//! End-to-end tests of `rcoa run` on the CPU: JSON lines per step and the
//! summary, falling loss, save/resume continuing the same loss curve, and
//! clean errors (exit 2) for an unavailable device or a bad plan.

use std::path::{Path, PathBuf};
use std::process::Command;

fn rcoa() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rcoa"))
}

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rcoa-cli-run-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn tiny_plan_file(dir: &Path) -> PathBuf {
    let p = dir.join("tiny.json");
    std::fs::write(
        &p,
        serde_json::to_string(&rcoa_backend::testing::tiny_plan()).unwrap(),
    )
    .unwrap();
    p
}

/// `plans/tiny-cpu.plan` with `from` replaced by `to`, written to `dir/name.plan`.
fn tiny_variant(dir: &Path, name: &str, from: &str, to: &str) -> PathBuf {
    variant_of("plans/tiny-cpu.plan", dir, name, from, to)
}

/// `plan` with `from` replaced by `to`, written to `dir/name.plan`.
fn variant_of(plan: &str, dir: &Path, name: &str, from: &str, to: &str) -> PathBuf {
    let source = std::fs::read_to_string(plan).unwrap();
    assert!(source.contains(from), "{plan} has no `{from}`");
    let path = dir.join(format!("{name}.plan"));
    std::fs::write(&path, source.replace(from, to)).unwrap();
    path
}

/// Run and parse every JSON line (the start event, the steps, the summary).
fn run_lines(args: &[&str]) -> Vec<serde_json::Value> {
    let out = rcoa()
        .arg("run")
        .args(args)
        .args(["--format", "json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "rcoa run failed: {}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    stdout
        .lines()
        .map(|l| serde_json::from_str(l).expect("every line is JSON"))
        .collect()
}

/// Run and parse the JSON lines; returns (per-step objects, summary).
fn run_json(args: &[&str]) -> (Vec<serde_json::Value>, serde_json::Value) {
    let lines = run_lines(args);
    let steps = lines
        .iter()
        .filter(|v| v.get("step").is_some() && v.get("event").is_none())
        .cloned()
        .collect();
    let summary = lines
        .iter()
        .find(|v| v["event"] == "summary")
        .cloned()
        .expect("a summary line");
    (steps, summary)
}

fn losses(steps: &[serde_json::Value]) -> Vec<f64> {
    steps.iter().map(|s| s["loss"].as_f64().unwrap()).collect()
}

#[test]
fn json_lines_report_every_step_and_the_peaks() {
    let dir = temp("json");
    let plan = tiny_plan_file(&dir);
    let (steps, summary) = run_json(&["--lowered", plan.to_str().unwrap(), "--steps", "8"]);
    assert_eq!(steps.len(), 8);
    for (i, s) in steps.iter().enumerate() {
        assert_eq!(s["step"].as_u64(), Some(i as u64 + 1));
        for key in ["loss", "step_seconds", "tokens_per_second", "peak_bytes"] {
            assert!(s[key].is_number(), "step line lacks {key}: {s}");
        }
    }
    let l = losses(&steps);
    assert!(l[7] < l[0], "loss should fall: {l:?}");
    assert!(summary["measured_peak_bytes"].as_u64().unwrap() > 0);
    assert!(summary.get("predicted_peak_bytes").is_some());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn resume_continues_the_loss_curve() {
    let dir = temp("resume");
    let plan = tiny_plan_file(&dir);
    let plan = plan.to_str().unwrap();
    let ckpt = dir.join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let (full, _) = run_json(&["--lowered", plan, "--steps", "6"]);
    let (first, _) = run_json(&["--lowered", plan, "--steps", "3", "--save", ckpt]);
    let (rest, _) = run_json(&["--lowered", plan, "--steps", "6", "--resume", ckpt]);
    assert_eq!(rest.first().and_then(|s| s["step"].as_u64()), Some(4));
    let joined: Vec<f64> = losses(&first).into_iter().chain(losses(&rest)).collect();
    let full = losses(&full);
    assert_eq!(joined.len(), full.len());
    for (a, b) in joined.iter().zip(&full) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "resumed {joined:?} vs uninterrupted {full:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn trains_on_a_text_file() {
    let dir = temp("data");
    let plan = tiny_plan_file(&dir);
    let text = dir.join("text.txt");
    // Few distinct characters: the tiny model's 64 ids hold them.
    std::fs::write(&text, "the cat sat on the mat. ".repeat(40)).unwrap();
    let (steps, _) = run_json(&[
        "--lowered",
        plan.to_str().unwrap(),
        "--steps",
        "6",
        "--data",
        text.to_str().unwrap(),
    ]);
    let l = losses(&steps);
    assert!(l[5] < l[0], "loss on text should fall: {l:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unavailable_cuda_is_a_clean_error() {
    // Either this build has no CUDA, or (with the feature) CI has no GPU:
    // both must exit 2 with a message, not a panic. On a GPU machine with a
    // CUDA build the run may succeed, which is fine too.
    let dir = temp("cuda");
    let plan = tiny_plan_file(&dir);
    let out = rcoa()
        .args([
            "run",
            "--lowered",
            plan.to_str().unwrap(),
            "--steps",
            "1",
            "--device",
            "cuda",
        ])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    if !out.status.success() {
        assert_eq!(out.status.code(), Some(2), "{stderr}");
        assert!(
            stderr.contains("cuda") || stderr.contains("CUDA"),
            "{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn compile_jobs_is_at_least_one_and_changes_nothing_on_the_cpu() {
    // One step of the tiny plan with `extra` flags: exit code and stderr.
    let tiny = |extra: &[&str]| {
        let out = rcoa()
            .args(["run", "plans/tiny-cpu.plan", "--steps", "1"])
            .args(extra)
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        (out.status.code(), stderr)
    };
    let (code, stderr) = tiny(&["--compile-jobs", "0"]);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(stderr.contains("--compile-jobs"), "{stderr}");
    let (code, stderr) = tiny(&["--compile-jobs", "4"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(!stderr.contains("compiling kernels ahead"), "{stderr}");
    // A CUDA run this build cannot do records nothing first.
    if !rcoa_backend::CUDA_BUILT {
        let (code, stderr) = tiny(&["--device", "cuda"]);
        assert_eq!(code, Some(2), "{stderr}");
        assert!(stderr.contains("without CUDA support"), "{stderr}");
        assert!(!stderr.contains("recording"), "{stderr}");
    }
}

#[test]
fn a_bad_lowered_file_exits_2() {
    let dir = temp("bad");
    let p = dir.join("bad.json");
    std::fs::write(&p, "{\"version\": 1}").unwrap();
    let out = rcoa()
        .args(["run", "--lowered", p.to_str().unwrap(), "--steps", "1"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("not a lowered plan"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tiny_cpu_plan_trains_20_steps() {
    let plan = Path::new(env!("CARGO_MANIFEST_DIR")).join("plans/tiny-cpu.plan");
    if !plan.exists() {
        eprintln!("plans/tiny-cpu.plan is absent; skipped");
        return;
    }
    let (steps, summary) = run_json(&[plan.to_str().unwrap(), "--steps", "20"]);
    assert_eq!(steps.len(), 20);
    let l = losses(&steps);
    assert!(l[19] < l[0], "loss should fall: {l:?}");
    assert!(summary["measured_peak_bytes"].as_u64().unwrap() > 0);
    assert!(summary["predicted_peak_bytes"].as_u64().unwrap() > 0);
}

#[test]
fn run_report_shows_measured_beside_predicted() {
    let dir = temp("report");
    let plan = tiny_plan_file(&dir);
    let html = dir.join("run.html");
    let (steps, summary) = run_json(&[
        "--lowered",
        plan.to_str().unwrap(),
        "--steps",
        "3",
        "--report",
        html.to_str().unwrap(),
    ]);
    assert_eq!(steps.len(), 3);
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.starts_with("<!DOCTYPE html>"),
        "{}",
        &page[..60.min(page.len())]
    );
    assert!(page.contains("tiny.json"), "titled by the plan's file name");
    assert!(page.contains("measured") && page.contains("predicted"));
    // One row per step, and no scripts: the page is self-contained.
    assert!(page.matches("<tr").count() >= 3);
    assert!(!page.contains("<script"));
    assert!(summary["measured_peak_bytes"].as_u64().unwrap() > 0);
    let _ = std::fs::remove_dir_all(&dir);
}

/// On the CPU the measured peak counts live heap bytes, a figure comparable
/// to the prediction (RSS growth was +118% on this plan), and says so.
#[test]
fn cpu_measure_is_live_heap_bytes_near_the_prediction() {
    let (_, summary) = run_json(&["plans/tiny-cpu.plan", "--steps", "3"]);
    assert!(
        summary["memory_measure"]
            .as_str()
            .unwrap()
            .contains("live heap bytes"),
        "{summary}"
    );
    let err = summary["peak_error"].as_f64().unwrap();
    assert!(
        err.abs() < 0.5,
        "measured vs predicted: {err:+.2} ({summary})"
    );
}

/// `checkpoint = selective` runs, and its predicted peak lies strictly
/// between keeping everything and recomputing every layer.
#[test]
fn selective_checkpointing_runs_and_is_predicted_between_none_and_full() {
    let dir = temp("selective");
    let peak = |checkpoint: &str| {
        let path = tiny_variant(
            &dir,
            &checkpoint.replace(' ', "-"),
            "checkpoint = none",
            &format!("checkpoint = {checkpoint}"),
        );
        let out = rcoa()
            .args(["compile", path.to_str().unwrap(), "--format", "json"])
            .output()
            .unwrap();
        let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(json["resolved"]["checkpoint"], checkpoint, "{json}");
        (path, json["memory"]["peak_bytes"].as_u64().unwrap())
    };
    let (_, none) = peak("none");
    let (_, full) = peak("full");
    let (selective, between) = peak("selective");
    assert!(
        full < between && between < none,
        "full {full} < selective {between} < none {none}"
    );
    let (steps, summary) = run_json(&[selective.to_str().unwrap(), "--steps", "3"]);
    assert_eq!(steps.len(), 3);
    assert!(summary["last_loss"].as_f64().unwrap().is_finite());
    let _ = std::fs::remove_dir_all(&dir);
}

/// `must_offload = [activations]` with every layer recomputed: the
/// compiler moves the second layer's input to the host (the first's is the
/// embedding's output) and predicts a lower peak; `rcoa run` does it, says
/// so in its start line, and trains bit for bit as without the move. Without
/// a layer to move the plan is refused with the reason.
#[test]
fn offloaded_checkpoint_inputs_are_predicted_and_run() {
    let dir = temp("activations");
    let write = |name: &str, fit: &str| {
        let path = tiny_variant(&dir, name, "fit { checkpoint = none }", fit);
        path.to_str().unwrap().to_string()
    };
    let kept = write("kept", "fit { checkpoint = full }");
    let moved = write(
        "moved",
        "fit { checkpoint = full  must_offload = [activations] }",
    );
    let compile = |plan: &str| {
        let out = rcoa()
            .args(["compile", plan, "--format", "json"])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let (k, m) = (compile(&kept), compile(&moved));
    assert_eq!(
        m["resolved"]["offload"],
        serde_json::json!(["activations:cpu"]),
        "{m}"
    );
    assert_eq!(
        m["residency"]["inputs_on_host"],
        serde_json::json!([1]),
        "{m}"
    );
    assert!(k["residency"].get("inputs_on_host").is_none(), "{k}");
    // tiny-decoder: 4 sequences × 32 tokens × hidden 64, fp32.
    assert_eq!(
        m["memory"]["host_activation_bytes"].as_u64(),
        Some(4 * 32 * 64 * 4)
    );
    // The forward ends with the second layer's input on the host; nothing
    // later holds more than without the move.
    let bytes =
        |j: &serde_json::Value, at: &str| j["memory"].pointer(at).unwrap().as_u64().unwrap();
    let forward = "/phase_peaks/forward";
    assert_eq!(
        bytes(&k, forward) - bytes(&m, forward),
        4 * 32 * 64 * 4,
        "{m}"
    );
    assert!(bytes(&m, "/peak_bytes") <= bytes(&k, "/peak_bytes"));

    let run = |plan: &str| {
        let lines = run_lines(&[plan, "--steps", "3"]);
        let start = lines.iter().find(|v| v["event"] == "start").cloned();
        let steps: Vec<serde_json::Value> = lines
            .into_iter()
            .filter(|v| v.get("step").is_some() && v.get("event").is_none())
            .collect();
        (start.expect("a start line"), losses(&steps))
    };
    let (start_k, losses_k) = run(&kept);
    let (start_m, losses_m) = run(&moved);
    assert_eq!(
        start_m["offload"],
        serde_json::json!(["activations:cpu"]),
        "{start_m}"
    );
    assert_eq!(start_k["offload"], serde_json::json!([]), "{start_k}");
    assert_eq!(losses_m.len(), 3);
    assert_eq!(losses_m, losses_k, "the inputs come back bit for bit");

    let nothing = write(
        "nothing",
        "fit { checkpoint = none  must_offload = [activations] }",
    );
    let out = rcoa().args(["compile", &nothing]).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("rcoa::inconsistent_plan"), "{err}");
    assert!(
        err.contains("`must_offload = [activations:cpu]` moves checkpointed"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `plans/tiny-cpu-qlora.plan`: NF4 bases, LoRA adapters and 8-bit AdamW
/// train on the CPU: the loss falls over 30 steps, the base is counted but
/// not trained, and a resumed run continues the same loss curve (the
/// checkpoint holds the NF4 bases and the 8-bit moments).
#[test]
fn tiny_cpu_qlora_plan_trains_with_adam8bit_and_resumes() {
    let plan = Path::new(env!("CARGO_MANIFEST_DIR")).join("plans/tiny-cpu-qlora.plan");
    let plan = plan.to_str().unwrap();
    let out = rcoa()
        .args(["run", plan, "--steps", "30", "--format", "json"])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}\n{stdout}",
        String::from_utf8_lossy(&out.stderr)
    );
    let start: serde_json::Value = stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["event"] == "start")
        .expect("a start line");
    // tiny-decoder: 2 layers of 4 × 64² attention and 3 × 64 × 256 MLP
    // weights in NF4; rank-16 adapters on all 7 projections.
    let base = 2 * (4 * 64 * 64 + 3 * 64 * 256);
    let lora = 2 * 16 * (4 * (64 + 64) + 3 * (64 + 256));
    assert_eq!(start["trainable_params"].as_u64(), Some(lora));
    assert!(start["params"].as_u64().unwrap() > base + lora);
    let steps: Vec<serde_json::Value> = stdout
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|v| v.get("step").is_some() && v.get("event").is_none())
        .collect();
    let l = losses(&steps);
    assert_eq!(l.len(), 30);
    let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len() as f64;
    assert!(
        mean(&l[25..]) < mean(&l[..5]) - 0.1,
        "the loss should fall: {l:?}"
    );

    let dir = temp("qlora-resume");
    let ckpt = dir.join("ckpt");
    let ckpt = ckpt.to_str().unwrap();
    let (first, _) = run_json(&[plan, "--steps", "3", "--save", ckpt]);
    let (rest, _) = run_json(&[plan, "--steps", "6", "--resume", ckpt]);
    assert_eq!(rest.first().and_then(|s| s["step"].as_u64()), Some(4));
    let joined: Vec<f64> = losses(&first).into_iter().chain(losses(&rest)).collect();
    for (a, b) in joined.iter().zip(&l[..6]) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "resumed {joined:?} vs uninterrupted {:?}",
            &l[..6]
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// `train { attention = flash }` under `target burn` runs the fused
/// attention op (`rcoa_backend::kernels::flash`) on the CPU: the tiny
/// decoder trains with falling loss.
#[test]
fn flash_attention_plan_trains_on_the_cpu() {
    let dir = temp("flash");
    let path = tiny_variant(
        &dir,
        "flash",
        "steps = 20",
        "steps = 20\n  attention = flash",
    );
    let (steps, summary) = run_json(&[path.to_str().unwrap(), "--steps", "12"]);
    assert_eq!(steps.len(), 12);
    let l = losses(&steps);
    assert!(l[11] < l[0], "loss should fall: {l:?}");
    assert!(summary["measured_peak_bytes"].as_u64().unwrap() > 0);
    // With dropout, the attention probabilities' included: it trains too.
    let dropped = variant_of(
        path.to_str().unwrap(),
        &dir,
        "flash-dropout",
        "model \"tiny-decoder\"",
        "model \"tiny-decoder\" { dropout = 0.1 }",
    );
    let (steps, _) = run_json(&[dropped.to_str().unwrap(), "--steps", "12"]);
    let l = losses(&steps);
    assert!(l[11] < l[0], "loss should fall with dropout: {l:?}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// With every layer recomputed, the last layer's output exists only as the head's input:
/// once the head's backward has made its gradient, that input is gone, so the live bytes
/// after the head's backward (the gradient in its place) are those after the last layer's
/// forward, not one `[batch, seq, hidden]` tensor more (read from the second step's
/// `RCOA_MEMORY_TRACE=1` samples; the counting allocator's live bytes on the CPU).
/// The memory samples of a 2-step CPU run of `plan` (`RCOA_MEMORY_TRACE=1`
/// prints the second step's: the first has no optimizer state yet), each at
/// its point's last micro-batch.
fn second_step_samples(plan: &Path) -> impl Fn(&str) -> u64 {
    let out = rcoa()
        .args([
            "run",
            plan.to_str().unwrap(),
            "--steps",
            "2",
            "--device",
            "cpu",
        ])
        .env("RCOA_MEMORY_TRACE", "1")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{err}");
    let samples: Vec<(String, u64)> = err
        .lines()
        .filter_map(|l| {
            let mut w = l.strip_prefix("memory ")?.split_whitespace();
            Some((w.next()?.to_string(), w.next()?.parse().ok()?))
        })
        .collect();
    move |what: &str| {
        samples
            .iter()
            .rfind(|(w, _)| w == what)
            .unwrap_or_else(|| panic!("no `{what}` sample in:\n{err}"))
            .1
    }
}

#[test]
fn the_head_input_is_freed_after_its_backward() {
    let dir = temp("head-input");
    let plan = tiny_variant(
        &dir,
        "full",
        "fit { checkpoint = none }",
        "fit { checkpoint = full }",
    );
    let at = second_step_samples(&plan);
    let (last, head) = (at("forward:layer1"), at("backward:head"));
    // tiny-decoder: 4 sequences × 32 tokens × hidden 64, fp32.
    let hidden_state = 4 * 32 * 64 * 4;
    assert!(
        head < last + hidden_state / 2,
        "after the head's backward {head} B, after the last layer {last} B"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// An adapter freezes the embedding: the first layer's input takes no
/// gradient, so its backward makes none (the memory model never had one).
#[test]
fn a_frozen_embedding_takes_no_gradient_from_the_first_layer() {
    let dir = temp("frozen-embedding");
    let plan = variant_of(
        "plans/tiny-cpu-qlora.plan",
        &dir,
        "qlora-full",
        "fit { checkpoint = none }",
        "fit { checkpoint = full }",
    );
    let at = second_step_samples(&plan);
    // tiny-cpu-qlora: 8 sequences × 32 tokens × hidden 64, fp32. After layer 1's backward
    // its input's gradient is alive (layer 0's output gradient); after layer 0's, none is.
    let hidden_grad = 8 * 32 * 64 * 4;
    let (first, second) = (at("backward:layer0"), at("backward:layer1"));
    assert!(
        first + hidden_grad / 2 < second,
        "after layer 0's backward {first} B, after layer 1's {second} B"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `optimizer adam-mini` from a `.plan`: compiled for `target burn`, its loss falls;
/// over LoRA adapters (whose factors have no heads or neurons) the plan is refused
/// before anything runs, saying why and what to write instead.
#[test]
fn adam_mini_trains_a_full_fine_tune_and_refuses_adapters() {
    let dir = temp("adam-mini");
    let plan = tiny_variant(
        &dir,
        "adam-mini",
        "optimizer adamw { lr = 1e-3  weight_decay = 0.0 }",
        "optimizer adam-mini { lr = 3e-3  weight_decay = 0.1 }",
    );
    let plan_s = plan.to_str().unwrap();
    let (steps, _) = run_json(&[plan_s, "--steps", "8", "--device", "cpu"]);
    let l = losses(&steps);
    assert!(l[7] < l[0] - 0.3, "loss should fall: {l:?}");
    let lora = variant_of(
        plan_s,
        &dir,
        "adam-mini-lora",
        "target burn",
        "adapter lora {\n  rank = 4\n  alpha = 8\n  targets = [q, v]\n}\n\ntarget burn",
    );
    let out = rcoa()
        .args([
            "run",
            lora.to_str().unwrap(),
            "--steps",
            "1",
            "--device",
            "cpu",
        ])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("`optimizer adam-mini` over LoRA adapters"),
        "{err}"
    );
    assert!(err.contains("write `optimizer adamw`"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
