//! The fit search's verdicts on the example plans, end to end through the
//! built binary: which plans fit as given, which settings the search picks
//! for their `auto`s, and the `rcoa::does_not_fit` diagnostic (exit 1) with
//! the smallest plan and what would make it fit.
//!
//! Variants of a plan are written to a temporary folder by replacing one
//! setting in the plan's text, so each test states exactly what it changes.

use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn compile(path: &Path) -> (Output, Value) {
    let out = Command::new(env!("CARGO_BIN_EXE_rcoa"))
        .args(["compile", path.to_str().unwrap(), "--format", "json"])
        .current_dir(root())
        .output()
        .expect("run rcoa");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!err.contains("panicked"), "rcoa panicked:\n{err}");
    let json = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{}: no JSON ({e}); stderr:\n{err}", path.display()));
    (out, json)
}

fn plan(name: &str) -> PathBuf {
    root().join("plans").join(name)
}

/// `name` with each `(from, to)` replaced once, written to a temporary file.
fn variant(name: &str, edits: &[(&str, &str)]) -> PathBuf {
    let mut text = std::fs::read_to_string(plan(name)).unwrap();
    for (from, to) in edits {
        assert!(text.contains(from), "{name} has no `{from}`");
        text = text.replacen(from, to, 1);
    }
    let dir = std::env::temp_dir().join(format!("rcoa-cli-fit-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let tag: String = edits
        .iter()
        .flat_map(|(_, to)| to.chars())
        .filter(|c| c.is_ascii_alphanumeric())
        .collect();
    let path = dir.join(format!("{tag}-{name}"));
    std::fs::write(&path, text).unwrap();
    path
}

fn fits(v: &Value) -> bool {
    v["memory"]["fits"].as_bool().unwrap()
}

#[test]
fn fitting_plans_fit_within_their_budget_and_resolve_every_auto() {
    for name in [
        "llama-3.1-8b-full-1xh100.plan",
        "llama-3.1-8b-full-4xa100-40gb.plan",
        "llama-3.1-70b-zero3-8x80gb.plan",
        "llama-3.1-405b-auto-2048x8xh100.plan",
        "mistral-7b-qlora-1x24gb.plan",
        "xlm-roberta-xxl-lora-contrastive.plan",
    ] {
        let (out, v) = compile(&plan(name));
        assert!(fits(&v), "{name} should fit");
        assert_eq!(out.status.code(), Some(0), "{name}");
        let m = &v["memory"];
        let peak = m["peak_bytes"].as_u64().unwrap();
        let reserve = m["reserve_bytes"].as_u64().unwrap();
        assert!(
            peak + reserve <= m["budget_bytes"].as_u64().unwrap(),
            "{name}"
        );
        let r = &v["resolved"];
        let n = |k: &str| r[k].as_u64().unwrap();
        let text = std::fs::read_to_string(plan(name)).unwrap();
        assert_eq!(
            n("data") * n("tensor") * n("pipeline") * n("context"),
            gpus(&text),
            "{name}: the layout uses every GPU"
        );
    }
}

/// GPUs of a plan's hardware section (gpus_per_node × nodes, defaults 1).
fn gpus(text: &str) -> u64 {
    let get = |key: &str| {
        text.lines()
            .filter_map(|l| l.split('#').next())
            .flat_map(|l| {
                let words: Vec<&str> = l.split_whitespace().collect();
                words
                    .windows(3)
                    .filter(|w| w[0] == key && w[1] == "=")
                    .map(|w| w[2].trim_matches('}').parse::<u64>().unwrap_or(1))
                    .collect::<Vec<_>>()
            })
            .next()
            .unwrap_or(1)
    };
    get("gpus_per_node") * get("nodes")
}

#[test]
fn llama_8b_with_an_fp32_master_copy_needs_offload_on_one_h100() {
    let name = "llama-3.1-8b-full-1xh100.plan";
    let without = variant(
        name,
        &[
            ("master = none", "master = fp32"),
            ("offload = [optimizer]", "offload = []"),
        ],
    );
    let (out, v) = compile(&without);
    assert!(!fits(&v));
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rcoa::does_not_fit"), "{err}");
    assert!(err.contains("smallest plan"), "{err}");
    assert!(
        err.contains("with `offload = [optimizer, params]`"),
        "{err}"
    );
    // Allowed to move the optimizer, the search does and it fits.
    let with = variant(name, &[("master = none", "master = fp32")]);
    let (out, v) = compile(&with);
    assert!(fits(&v), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(v["resolved"]["offload"][0], "optimizer:cpu");
}

#[test]
fn llama_8b_on_four_a100_40gb_needs_zero_3() {
    let name = "llama-3.1-8b-full-4xa100-40gb.plan";
    // Kept on the GPUs, only ZeRO-3 fits.
    let auto = variant(
        name,
        &[
            ("zero = 3", "zero = auto"),
            ("offload = [optimizer]", "offload = []"),
        ],
    );
    let (_, v) = compile(&auto);
    assert!(fits(&v));
    assert_eq!(
        v["resolved"]["zero"], 3,
        "the search shards the weights too"
    );
    // The rejected alternatives say why the lower stages lost.
    let rejected = v["rejected"].as_array().unwrap();
    assert!(rejected
        .iter()
        .any(|r| r["what"] == "zero = 2" || r["what"] == "zero = 1"));
    // Allowed to move the optimizer to the host, a lower stage with ZeRO-Offload may win
    // on time; whatever the search picks fits and moves the optimizer.
    let offload = variant(name, &[("zero = 3", "zero = auto")]);
    let (_, v) = compile(&offload);
    assert!(fits(&v));
    if v["resolved"]["zero"] != 3 {
        assert_eq!(v["resolved"]["offload"][0], "optimizer:cpu");
    }
    // Without the optimizer offload no lower stage fits.
    for zero in ["0", "1", "2"] {
        let fixed = variant(
            name,
            &[
                ("zero = 3", &format!("zero = {zero}")),
                ("offload = [optimizer]", "offload = []"),
            ],
        );
        let (out, v) = compile(&fixed);
        assert!(!fits(&v), "zero = {zero} should not fit");
        assert_eq!(out.status.code(), Some(1));
    }
}

#[test]
fn llama_70b_fits_eight_80gb_gpus_with_zero_3_and_checkpointing() {
    let (_, v) = compile(&plan("llama-3.1-70b-zero3-8x80gb.plan"));
    assert!(fits(&v));
    let r = &v["resolved"];
    assert_eq!(r["zero"], 3);
    assert_ne!(r["checkpoint"], "none", "activations must be recomputed");
    assert!(!r["checkpoint_layers"].as_array().unwrap().is_empty());
    // Without offload the model state alone (16 B per parameter / 8) is over 80 GB.
    let kept = variant(
        "llama-3.1-70b-zero3-8x80gb.plan",
        &[("offload = [optimizer, params]", "offload = []")],
    );
    let (_, v) = compile(&kept);
    assert!(!fits(&v));
}

#[test]
fn the_405b_all_auto_plan_uses_model_parallelism_and_fits() {
    let (_, v) = compile(&plan("llama-3.1-405b-auto-2048x8xh100.plan"));
    assert!(fits(&v));
    let r = &v["resolved"];
    let n = |k: &str| r[k].as_u64().unwrap();
    assert_eq!(
        n("data") * n("tensor") * n("pipeline") * n("context"),
        16384
    );
    assert!(
        n("tensor") * n("pipeline") >= 8,
        "2,048 sequences cannot feed 16,384 data ranks"
    );
    assert_eq!(n("micro_batch") * n("grad_accum") * n("data"), 2048);
}

#[test]
fn the_405b_3d_plan_with_zero_1_is_over_budget_and_says_what_fits() {
    // TP 8 × PP 4 leaves 12.7 B parameters per GPU: bf16 weights and gradients (2 × 25 GB)
    // and ZeRO-1's quarter of the fp32 master and Adam state (39 GB) exceed 95% of 80 GB
    // before any activation.
    let (out, v) = compile(&plan("llama-3.1-405b-128xh100.plan"));
    assert!(!fits(&v));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("rcoa::does_not_fit"), "{err}");
    assert!(
        err.contains("it fits"),
        "a relaxation that fits is named: {err}"
    );
    let z3 = variant("llama-3.1-405b-128xh100.plan", &[("zero = 1", "zero = 3")]);
    let (_, v) = compile(&z3);
    assert!(fits(&v), "sharding gradients and weights too makes it fit");
}

/// A setting's rejected alternatives in `--format json`: `(what, why)`.
fn rejected(v: &Value) -> Vec<(String, String)> {
    v["rejected"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| {
            (
                r["what"].as_str().unwrap().to_string(),
                r["why"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

fn rejected_over_budget(v: &Value, what: &str) -> bool {
    rejected(v)
        .iter()
        .any(|(w, why)| w == what && why.contains("budget"))
}

/// The Burn executor builds the model one unit at a time at start-up, so its setup is
/// never what refuses a plan that shards or offloads its weights: the peak is in the step,
/// and the setup phase's highest point is below it.
fn setup_below_the_step(v: &Value) {
    let m = &v["memory"];
    assert_ne!(m["peak_at"]["phase"], "setup", "{}", m["peak_at"]);
    let setup = m["phase_peaks"]["setup"]
        .as_u64()
        .unwrap_or_else(|| panic!("no setup phase: {}", m["phase_peaks"]));
    assert!(
        setup < m["peak_bytes"].as_u64().unwrap(),
        "{}",
        m["phase_peaks"]
    );
}

/// Issue #11, the Burn executor: the 4 × A100-40GB 8B setup fits through ZeRO-3
/// sharding (each rank holding a quarter of every unit and gathering units for
/// their use); kept replicated it does not. Without ZeRO-3 in the executor it is refused.
#[test]
fn burn_llama_8b_on_four_a100_40gb_fits_through_sharding() {
    let name = "llama-3.1-8b-full-4xa100-40gb.plan";
    let burn = variant(name, &[("\ntarget pytorch", "\ntarget burn")]);
    let (out, v) = compile(&burn);
    if !rcoa_compiler::profile::BURN_RUNS_ZERO3 {
        assert_eq!(out.status.code(), Some(2));
        return;
    }
    setup_below_the_step(&v);
    assert!(fits(&v), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(out.status.code(), Some(0));
    assert_eq!(v["target"], "burn");
    assert_eq!(v["resolved"]["zero"], 3);
    assert_eq!(v["resolved"]["data"], 4);
    assert!(
        rejected_over_budget(&v, "offload = []"),
        "{:?}",
        rejected(&v)
    );
    let holds = v["parallel"]["ranks"][0]["holds"].as_array().unwrap();
    let share = |what: &str| {
        holds
            .iter()
            .find(|h| h["what"] == what)
            .unwrap_or_else(|| panic!("no {what} in {holds:?}"))["share"]
            .as_str()
            .unwrap()
            .to_string()
    };
    assert!(share("weights").starts_with("1/4 of every unit's weights"));
    assert!(share("gathered").contains("checkpointed layers"));
    // The lowered plan's residency says the same to the executor.
    let res = &v["residency"];
    assert_eq!(res["weight_shards"], 4);
    assert_eq!(res["units"].as_array().unwrap().len(), 32 + 2);
    let layers = v["resolved"]["checkpoint_layers"].as_array().unwrap();
    let regathered = res["units"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|u| u["regathered_for_backward"] == true)
        .count();
    assert_eq!(regathered, layers.len());
    // With the stage left to the search: replicated stages are rejected over budget or
    // slower, and what it picks fits.
    let auto = variant(
        name,
        &[
            ("\ntarget pytorch", "\ntarget burn"),
            ("zero = 3", "zero = auto"),
        ],
    );
    let (_, v) = compile(&auto);
    assert!(fits(&v));
    assert!(
        rejected(&v).iter().any(|(w, _)| w.starts_with("zero = ")),
        "{:?}",
        rejected(&v)
    );
}

/// Issue #11: a 7B full fine-tune on one 24 GB GPU, the weights and the optimizer in host
/// memory. It fits because the executor keeps the fp32 gradient accumulator (29 GB) on the
/// host too; keeping less there is over budget.
#[test]
fn burn_7b_full_fine_tune_on_one_24gb_gpu_fits_through_host_offload() {
    if !rcoa_compiler::profile::BURN_RUNS_ZERO3 {
        return;
    }
    let (out, v) = compile(&plan("mistral-7b-full-offload-1x24gb.plan"));
    assert!(v["params"]["trainable"].as_u64().unwrap() > 7_000_000_000);
    setup_below_the_step(&v);
    assert!(fits(&v), "{}", String::from_utf8_lossy(&out.stderr));
    let offload: Vec<&str> = v["resolved"]["offload"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_str().unwrap())
        .collect();
    assert_eq!(offload, ["optimizer:cpu", "params:cpu"]);
    for alt in [
        "offload = []",
        "offload = [optimizer:cpu]",
        "offload = [params:cpu]",
    ] {
        assert!(rejected_over_budget(&v, alt), "{alt}: {:?}", rejected(&v));
    }
    assert_eq!(v["residency"]["weights"], "host");
    assert_eq!(v["residency"]["grad_accumulator"], "host");
}

/// Issue #11: 70B on 8 × 80 GB with ZeRO-3 and the optimizer on the host (the weight
/// shards may follow). It fits because the executor keeps the fp32 gradient-shard
/// accumulator (35 GB a rank) on the host beside the optimizer.
#[test]
fn burn_70b_on_eight_80gb_gpus_with_zero_3_and_optimizer_offload() {
    if !rcoa_compiler::profile::BURN_RUNS_ZERO3 {
        return;
    }
    let (out, v) = compile(&plan("llama-3.1-70b-zero3-offload-8x80gb-burn.plan"));
    setup_below_the_step(&v);
    assert!(fits(&v), "{}", String::from_utf8_lossy(&out.stderr));
    assert_eq!(v["resolved"]["zero"], 3);
    assert_eq!(v["resolved"]["offload"][0], "optimizer:cpu");
    // The optimizer's state and the gradient accumulator must leave the GPU; the weight
    // shards may stay (they do under `compact`'s pool factors since 2026-11-28f).
    for alt in ["offload = []", "offload = [params:cpu]"] {
        assert!(rejected_over_budget(&v, alt), "{alt}: {:?}", rejected(&v));
    }
    assert!(rejected(&v)
        .iter()
        .any(|(w, _)| w == "checkpoint = selective"));
}
