//! `rcoa emit`: golden output per target, every emitted key/flag/option held
//! against the engine's own (vendored) list, and the command's behaviour
//! (-o DIR, refusals, exit codes).
//!
//! The plans are built in Rust (`rcoa_compiler::emit::testing::PlanBuilder`)
//! and handed to the CLI as lowered-plan JSON, so these tests do not depend on
//! the resolver or the passes. Goldens live in `tests/emit/snapshots`;
//! re-bless them with `INSTA_UPDATE=always cargo test --test cli_emit` (or
//! `cargo insta review`).

use rcoa_compiler::emit::testing::PlanBuilder;
use rcoa_compiler::emit::{self, schema, Engine};
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::{AdapterKind, Dtype, OffloadTo, OffloadWhat, OptimizerKind, Target};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn rcoa() -> Command {
    Command::new(env!("CARGO_BIN_EXE_rcoa"))
}

/// A fresh directory for one test under cargo's per-target temp dir.
fn scratch(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("cli_emit")
        .join(name);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn save(plan: &LoweredPlan, dir: &Path) -> PathBuf {
    let path = dir.join("plan.json");
    std::fs::write(&path, serde_json::to_string_pretty(plan).unwrap()).unwrap();
    path
}

fn run_emit(plan: &LoweredPlan, test: &str, extra: &[&str]) -> (Output, PathBuf) {
    let dir = scratch(test);
    let path = save(plan, &dir);
    let out = rcoa()
        .arg("emit")
        .arg(&path)
        .args(extra)
        .current_dir(&dir)
        .output()
        .unwrap();
    (out, dir)
}

fn text(b: &[u8]) -> String {
    String::from_utf8(b.to_vec()).unwrap()
}

/// Two nodes of eight H100s, ZeRO-3, every other layer recomputed, optimizer state on the CPU.
fn cluster_plan() -> LoweredPlan {
    PlanBuilder::llama_8b()
        .nodes(2, 8)
        .micro_batch(2)
        .global_batch(512)
        .checkpoint_every(2)
        .offload(OffloadWhat::Optimizer, OffloadTo::Cpu)
        .build()
}

/// One node, plain data parallelism with autocast: no DeepSpeed needed.
fn ddp_plan() -> LoweredPlan {
    PlanBuilder::llama_8b()
        .nodes(1, 4)
        .zero(0)
        .precision(Dtype::Fp32, Dtype::Bf16, None)
        .checkpoint_full()
        .build()
}

fn snapshot(name: &str, value: String) {
    insta::with_settings!({ snapshot_path => "emit/snapshots", prepend_module_to_snapshot => false }, {
        insta::assert_snapshot!(name, value);
    });
}

/// What a person sees: stdout, then the notes on stderr.
fn transcript(out: &Output) -> String {
    format!(
        "{}\n--- stderr ---\n{}",
        text(&out.stdout),
        text(&out.stderr)
    )
}

#[test]
fn golden_per_target() {
    for target in ["deepspeed", "torchrun", "slurm", "accelerate"] {
        let (out, _) = run_emit(
            &cluster_plan(),
            &format!("golden-{target}"),
            &["--target", target],
        );
        assert!(out.status.success(), "{target}: {}", text(&out.stderr));
        snapshot(&format!("cluster_{target}"), transcript(&out));
    }
    let fsdp = PlanBuilder::llama_8b()
        .nodes(2, 8)
        .checkpoint_full()
        .build();
    let (out, _) = run_emit(&fsdp, "golden-fsdp", &["--target", "accelerate", "--fsdp"]);
    assert!(out.status.success(), "fsdp: {}", text(&out.stderr));
    snapshot("cluster_accelerate_fsdp", transcript(&out));
    for target in ["torchrun", "accelerate"] {
        let (out, _) = run_emit(
            &ddp_plan(),
            &format!("golden-ddp-{target}"),
            &["--target", target],
        );
        assert!(out.status.success(), "{target}: {}", text(&out.stderr));
        snapshot(&format!("ddp_{target}"), transcript(&out));
    }
}

/// Plans covering the emitters' branches: every one must pass every schema check.
fn plan_matrix() -> Vec<(&'static str, LoweredPlan)> {
    let b = PlanBuilder::llama_8b;
    vec![
        ("cluster", cluster_plan()),
        ("ddp", ddp_plan()),
        (
            "single-gpu",
            b().nodes(1, 1)
                .zero(0)
                .precision(Dtype::Fp32, Dtype::Fp32, None)
                .build(),
        ),
        ("zero1-pipeline", b().zero(1).pipeline(2).build()),
        (
            "zero2-fp16",
            b().zero(2)
                .precision(Dtype::Fp16, Dtype::Fp16, Some(Dtype::Fp32))
                .build(),
        ),
        ("autotp", b().nodes(2, 8).tensor(4).build()),
        ("autoep", b().experts(8, 2).expert(2).build()),
        (
            "nvme",
            b().nvme(Some(3_500_000_000_000))
                .offload(OffloadWhat::Optimizer, OffloadTo::Nvme)
                .offload(OffloadWhat::Params, OffloadTo::Nvme)
                .offload(OffloadWhat::Grads, OffloadTo::Cpu)
                .build(),
        ),
        (
            "act-offload",
            b().checkpoint_selective()
                .offload(OffloadWhat::Activations, OffloadTo::Cpu)
                .grads(Dtype::Fp32)
                .build(),
        ),
        (
            "bf16-master",
            b().precision(Dtype::Bf16, Dtype::Bf16, None)
                .optimizer_state(Dtype::Bf16)
                .build(),
        ),
        ("adam", b().optimizer(OptimizerKind::Adam).build()),
        ("sgd", b().optimizer(OptimizerKind::Sgd).build()),
        ("lion", b().optimizer(OptimizerKind::Lion).build()),
        (
            "adam8bit",
            b().optimizer(OptimizerKind::Adam8bit)
                .optimizer_state(Dtype::Int8)
                .build(),
        ),
        (
            "qlora",
            b().zero(0)
                .precision(Dtype::Fp32, Dtype::Bf16, None)
                .lora(AdapterKind::Qlora, 16)
                .build(),
        ),
        ("no-steps", b().nodes(4, 8).steps(None).build()),
        ("fsdp2-offload-in-backward", fsdp2_offload_plan()),
        (
            "megatron-interleaved",
            b().target(Target::Megatron)
                .zero(1)
                .pipeline(4)
                .virtual_stages(2)
                .build(),
        ),
    ]
}

/// FSDP2 with `CPUOffloadPolicy` and the optimizer stepped in the backward.
fn fsdp2_offload_plan() -> LoweredPlan {
    PlanBuilder::llama_8b()
        .target(Target::Fsdp)
        .precision(Dtype::Fp32, Dtype::Bf16, None)
        .offload(OffloadWhat::Optimizer, OffloadTo::Cpu)
        .offload(OffloadWhat::Params, OffloadTo::Cpu)
        .offload(OffloadWhat::Grads, OffloadTo::Cpu)
        .in_backward(true)
        .build()
}

/// A lowered plan compiled for FSDP2 launches FSDP2: the torchrun script carries its
/// `fully_shard` calls with `CPUOffloadPolicy` and the step-in-backward hooks, and ships
/// no DeepSpeed config; DeepSpeed itself refuses the step in the backward by name.
#[test]
fn an_fsdp2_plan_launches_fsdp2_and_deepspeed_refuses_its_schedule() {
    let (out, _) = run_emit(
        &fsdp2_offload_plan(),
        "fsdp2-torchrun",
        &["--target", "torchrun"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let script = text(&out.stdout);
    assert!(!script.contains("==> ds_config.json"), "{script}");
    assert!(
        script.contains(
            "fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy(), reshard_after_forward=True)"
        ),
        "{script}"
    );
    assert!(
        script.contains("p.register_post_accumulate_grad_hook(step)"),
        "{script}"
    );

    let (out, _) = run_emit(
        &PlanBuilder::llama_8b().in_backward(true).build(),
        "inbwd-deepspeed",
        &["--target", "deepspeed"],
    );
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("rcoa::emit_unsupported"), "{err}");
    assert!(err.contains("`optimizer.in_backward`"), "{err}");
}

/// Every string scalar YAML 1.1 (PyYAML, which Accelerate uses) would read as a boolean.
const YAML11_BOOLS: &[&str] = &[
    "y", "Y", "yes", "Yes", "YES", "n", "N", "no", "No", "NO", "on", "On", "ON", "off", "Off",
    "OFF",
];

fn yaml_to_json(y: &yaml_rust2::Yaml) -> Value {
    use yaml_rust2::Yaml;
    match y {
        Yaml::String(s) => Value::String(s.clone()),
        Yaml::Integer(i) => Value::from(*i),
        Yaml::Real(r) => Value::from(r.parse::<f64>().unwrap()),
        Yaml::Boolean(b) => Value::Bool(*b),
        Yaml::Null => Value::Null,
        Yaml::Array(a) => Value::Array(a.iter().map(yaml_to_json).collect()),
        Yaml::Hash(h) => Value::Object(
            h.iter()
                .map(|(k, v)| {
                    (
                        k.as_str().expect("string keys").to_string(),
                        yaml_to_json(v),
                    )
                })
                .collect(),
        ),
        other => panic!("unexpected YAML node {other:?}"),
    }
}

fn bash_syntax_ok(name: &str, script: &str) {
    let Ok(out) = Command::new("bash")
        .arg("-n")
        .arg("-c")
        .arg(script)
        .output()
    else {
        return; // no bash on this machine: the schema checks still ran
    };
    assert!(
        out.status.success(),
        "{name} is not valid bash: {}",
        text(&out.stderr)
    );
}

#[test]
fn every_emitted_key_is_one_the_engine_knows() {
    let mut checked = 0;
    for (label, plan) in plan_matrix() {
        let fsdp = (Engine::Accelerate, true);
        for (engine, with_fsdp) in Engine::ALL.iter().map(|e| (*e, false)).chain([fsdp]) {
            let emitted = if with_fsdp {
                emit::accelerate_with(&plan, emit::Sharding::Fsdp)
            } else {
                emit::emit(engine, &plan)
            };
            let emission = match emitted {
                Ok(e) => e,
                // Refusals are tested below; a refusal must be the documented kind.
                Err(emit::EmitError::Unsupported { .. }) => continue,
                Err(e) => panic!("{label}/{engine}: {e}"),
            };
            for f in &emission.files {
                let ctx = format!("{label}/{engine}/{}", f.name);
                assert!(f.contents.ends_with('\n'), "{ctx}: no final newline");
                let problems = match f.name.as_str() {
                    "ds_config.json" => {
                        let v: Value = serde_json::from_str(&f.contents)
                            .unwrap_or_else(|e| panic!("{ctx}: {e}"));
                        schema::deepspeed_keys().check(&v)
                    }
                    "accelerate_config.yaml" => {
                        let docs = yaml_rust2::YamlLoader::load_from_str(&f.contents)
                            .unwrap_or_else(|e| panic!("{ctx}: not YAML: {e}"));
                        assert_eq!(docs.len(), 1, "{ctx}: one document");
                        for line in f
                            .contents
                            .lines()
                            .filter(|l| !l.trim_start().starts_with('#'))
                        {
                            if let Some((_, v)) = line.split_once(": ") {
                                assert!(
                                    !YAML11_BOOLS.contains(&v.trim()),
                                    "{ctx}: `{line}` is a boolean to PyYAML"
                                );
                            }
                        }
                        schema::accelerate_keys().check(&yaml_to_json(&docs[0]))
                    }
                    "torchrun.sh" => {
                        bash_syntax_ok(&ctx, &f.contents);
                        schema::check_torchrun_script(&f.contents)
                    }
                    "job.sbatch" => {
                        bash_syntax_ok(&ctx, &f.contents);
                        let mut p = schema::check_sbatch_script(&f.contents);
                        p.extend(schema::check_torchrun_script(&f.contents));
                        p
                    }
                    other => panic!("{ctx}: unexpected file {other}"),
                };
                assert!(problems.is_empty(), "{ctx}:\n{}", problems.join("\n"));
                checked += 1;
            }
        }
    }
    assert!(checked > 50, "only {checked} files checked");
}

#[test]
fn the_deepspeed_batch_product_holds() {
    for (label, plan) in plan_matrix() {
        let Ok(e) = emit::deepspeed(&plan) else {
            continue;
        };
        let v: Value = serde_json::from_str(&e.files[0].contents).unwrap();
        let micro = v["train_micro_batch_size_per_gpu"].as_u64().unwrap();
        let accum = v["gradient_accumulation_steps"].as_u64().unwrap();
        assert_eq!(
            v["train_batch_size"].as_u64().unwrap(),
            micro * accum * plan.resolved.data,
            "{label}"
        );
    }
}

#[test]
fn out_dir_writes_every_file_and_says_so() {
    let (out, dir) = run_emit(
        &cluster_plan(),
        "out-dir",
        &["--target", "slurm", "-o", "job"],
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.contains("wrote job/job.sbatch\n"), "{stdout}");
    assert!(stdout.contains("wrote job/ds_config.json\n"), "{stdout}");
    let script = std::fs::read_to_string(dir.join("job/job.sbatch")).unwrap();
    assert!(script.starts_with("#!/bin/bash\n#"));
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(dir.join("job/job.sbatch"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o111, 0o111, "the batch script is executable");
        let mode = std::fs::metadata(dir.join("job/ds_config.json"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o111, 0, "the JSON is not");
    }
    let leftovers: Vec<_> = std::fs::read_dir(dir.join("job"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("rcoa-tmp"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left: {leftovers:?}");
    // Writing again replaces the files in place.
    let again = rcoa()
        .args(["emit", "plan.json", "--target", "slurm", "-o", "job"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(again.status.success());
    assert_eq!(
        std::fs::read_to_string(dir.join("job/job.sbatch")).unwrap(),
        script
    );
}

#[test]
fn an_engine_that_cannot_express_the_plan_exits_2_with_a_coded_diagnostic() {
    let plan = PlanBuilder::llama_8b().pipeline(2).zero(3).build();
    let (out, dir) = run_emit(&plan, "refused", &["--target", "deepspeed", "-o", "never"]);
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("rcoa::emit_unsupported"), "{err}");
    assert!(
        err.contains("DeepSpeed cannot express `parallel.pipeline`"),
        "{err}"
    );
    assert!(err.contains("help:"), "{err}");
    assert!(
        !dir.join("never").exists(),
        "nothing is written on a refusal"
    );
    snapshot("refused_pipeline_zero3", err);

    let (out, _) = run_emit(
        &PlanBuilder::llama_8b().tensor(2).build(),
        "refused-acc",
        &["--target", "accelerate"],
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("Accelerate cannot express `parallel.tensor`"));
}

#[test]
fn a_plan_that_does_not_fit_is_not_emitted_without_force() {
    let mut plan = cluster_plan();
    plan.prediction.fits = false;
    let (out, dir) = run_emit(&plan, "no-fit", &["--target", "deepspeed", "-o", "out"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(text(&out.stderr).contains("rcoa::emit_does_not_fit"));
    assert!(!dir.join("out").exists());
    let forced = rcoa()
        .args(["emit", "plan.json", "--target", "deepspeed", "--force"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert!(forced.status.success());
    assert!(text(&forced.stdout).contains("\"train_batch_size\": 512"));
}

#[test]
fn bad_input_exits_2() {
    let dir = scratch("bad-input");
    std::fs::write(dir.join("broken.json"), "{ \"version\": 1 }").unwrap();
    let out = rcoa()
        .args(["emit", "broken.json", "--target", "slurm"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("is not a lowered plan"));
    let out = rcoa()
        .args(["emit", "missing.json", "--target", "slurm"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let out = rcoa()
        .args(["emit", "broken.json", "--target", "slurm", "--fsdp"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "--fsdp is for accelerate only");
    let out = rcoa()
        .args(["emit", "broken.json", "--target", "kubernetes"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "clap rejects an unknown target");
}

#[test]
fn stdout_puts_a_header_before_each_file_when_there_are_several() {
    let (out, _) = run_emit(&cluster_plan(), "headers", &["--target", "torchrun"]);
    let s = text(&out.stdout);
    assert!(
        s.starts_with("==> torchrun.sh <==\n#!/usr/bin/env bash\n"),
        "{s}"
    );
    assert!(s.contains("\n==> ds_config.json <==\n{\n"), "{s}");
    let (out, _) = run_emit(&cluster_plan(), "no-header", &["--target", "deepspeed"]);
    assert!(
        text(&out.stdout).starts_with("{\n"),
        "a single file is printed as is"
    );
}

/// The `.plan` fixtures under tests/emit/plans.
fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/emit/plans")
        .join(name)
}

#[test]
fn a_plan_file_is_compiled_and_emitted_for_every_target() {
    let plan = fixture("llama8b-2x8-zero3.plan");
    for target in ["deepspeed", "torchrun", "slurm", "accelerate"] {
        let dir = scratch(&format!("plan-file-{target}"));
        let out = rcoa()
            .arg("emit")
            .arg(&plan)
            .args(["--target", target, "-o", "out"])
            .current_dir(&dir)
            .output()
            .unwrap();
        assert!(out.status.success(), "{target}: {}", text(&out.stderr));
        // Every target that needs DeepSpeed ships the same, valid ds_config.json.
        let ds: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("out/ds_config.json")).unwrap())
                .unwrap();
        let problems = schema::deepspeed_keys().check(&ds);
        assert!(problems.is_empty(), "{target}: {problems:?}");
        assert_eq!(ds["train_batch_size"], 512, "the plan's global batch");
        assert_eq!(ds["zero_optimization"]["stage"], 3);
        assert_eq!(
            ds["activation_checkpointing"]["number_checkpoints"], 16,
            "checkpoint = every 2 of 32 layers"
        );
    }
}

/// A plan without a `target` line predicts rcoa's Burn executor; emitted for
/// a PyTorch engine it is judged by that engine's profile: the guide's 8B
/// ZeRO-3 setup on 4 × A100-40GB with fused AdamW fits and is written, for
/// DeepSpeed itself and for every launcher (which run it on DeepSpeed), and
/// the notes name the engine the numbers are for.
#[test]
fn a_plan_is_judged_by_the_profile_of_the_engine_it_is_emitted_for() {
    let dir = scratch("engine-profile");
    let source = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("plans/llama-3.1-8b-full-4xa100-40gb.plan"),
    )
    .unwrap();
    assert!(source.contains("target pytorch"));
    assert!(source.contains("impl = fused"));
    let burn = source.replace("target pytorch", "");
    std::fs::write(dir.join("burn.plan"), &burn).unwrap();
    for target in ["deepspeed", "torchrun", "slurm", "accelerate"] {
        let out = rcoa()
            .args(["emit", "burn.plan", "--target", target, "-o", target])
            .current_dir(&dir)
            .output()
            .unwrap();
        let err = text(&out.stderr);
        assert!(out.status.success(), "{target}: {err}");
        assert!(
            err.contains("compiled under the `deepspeed` profile (DeepSpeed)"),
            "{target}: {err}"
        );
        assert!(
            err.contains("is for DeepSpeed (the `deepspeed` profile)"),
            "{target}: {err}"
        );
        let ds: Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join(target).join("ds_config.json")).unwrap(),
        )
        .unwrap();
        let z = &ds["zero_optimization"];
        assert_eq!(z["stage"], 3, "{target}");
        // The bucket the `deepspeed` profile charges is the one the file sets.
        assert_eq!(
            z["reduce_bucket_size"],
            rcoa_compiler::profile::engines::deepspeed::reduce_bucket_elements(4096)
        );
        assert_eq!(ds["optimizer"]["type"], "AdamW");
        assert!(
            ds["optimizer"]["params"].get("torch_adam").is_none(),
            "FusedAdam"
        );
    }
}

/// `accelerate --fsdp` compiles under the FSDP2 profile (fp32 sharded weights with bf16
/// compute is its mixed precision); a plan DDP runs (no sharding, no master copy) is
/// compiled as eager PyTorch and ships no ds_config.json.
#[test]
fn fsdp_and_ddp_launches_are_compiled_for_their_engine() {
    let dir = scratch("engine-fsdp-ddp");
    let plan = |zero: u8| {
        format!(
            "model \"llama-3.2-1b\"\nhardware {{ gpu = h100-80gb gpus_per_node = 4 }}\n\
             precision {{ params = fp32 compute = bf16 }}\noptimizer adamw {{ lr = 1e-4 }}\n\
             train {{ seq_len = 2048 global_batch = 32 }}\nparallel {{ zero = {zero} tensor = 1 pipeline = 1 }}\n"
        )
    };
    std::fs::write(dir.join("fsdp.plan"), plan(3)).unwrap();
    std::fs::write(dir.join("ddp.plan"), plan(0)).unwrap();
    let out = rcoa()
        .args([
            "emit",
            "fsdp.plan",
            "--target",
            "accelerate",
            "--fsdp",
            "-o",
            "fsdp",
        ])
        .current_dir(&dir)
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("compiled under the `fsdp` profile (FSDP2)"),
        "{err}"
    );
    assert!(err.contains("is for FSDP2 (the `fsdp` profile)"), "{err}");
    let out = rcoa()
        .args(["emit", "ddp.plan", "--target", "torchrun", "-o", "ddp"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("compiled under the `pytorch` profile (PyTorch)"),
        "{err}"
    );
    assert!(!dir.join("ddp/ds_config.json").exists());
}

/// A plan written `target fsdp` keeps its engine under `--target torchrun`: it is compiled
/// under the FSDP2 profile (no note about another profile) and the script shards with
/// `fully_shard`, not DeepSpeed.
#[test]
fn a_plan_written_for_fsdp2_is_launched_as_fsdp2_by_torchrun() {
    let dir = scratch("engine-fsdp-torchrun");
    std::fs::write(
        dir.join("fsdp.plan"),
        "model \"llama-3.2-1b\"\nhardware { gpu = h100-80gb gpus_per_node = 4 }\n\
         precision { params = fp32 compute = bf16 }\noptimizer adamw { lr = 1e-4 }\n\
         train { seq_len = 2048 global_batch = 32 }\nparallel { zero = 3 tensor = 1 pipeline = 1 }\n\
         target fsdp\n",
    )
    .unwrap();
    let out = rcoa()
        .args(["emit", "fsdp.plan", "--target", "torchrun", "-o", "out"])
        .current_dir(&dir)
        .output()
        .unwrap();
    let err = text(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains("is compiled under the"), "{err}");
    let script = std::fs::read_to_string(dir.join("out/torchrun.sh")).unwrap();
    assert!(script.contains("fully_shard"), "{script}");
    assert!(!dir.join("out/ds_config.json").exists());
}

#[test]
fn a_refusal_points_at_the_setting_in_the_plan() {
    // Run from the repository with a relative path, so the diagnostic names the file as a user would.
    let out = rcoa()
        .args([
            "emit",
            "tests/emit/plans/pipeline-zero3.plan",
            "--target",
            "deepspeed",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = text(&out.stderr);
    assert!(err.contains("parallel.pipeline is set here"), "{err}");
    assert!(out.stdout.is_empty(), "nothing is printed on a refusal");
    snapshot("refused_pipeline_zero3_plan", err);
}

#[test]
fn a_bad_plan_file_exits_2_with_its_diagnostic() {
    let dir = scratch("bad-plan");
    std::fs::write(
        dir.join("bad.plan"),
        "model \"llama-3.1-8b\"\ntrain { seq_len 2048 }\n",
    )
    .unwrap();
    let out = rcoa()
        .args(["emit", "bad.plan", "--target", "deepspeed"])
        .current_dir(&dir)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(
        text(&out.stderr).contains("rcoa::"),
        "{}",
        text(&out.stderr)
    );
    assert!(out.stdout.is_empty());
}
