//! `rcoa init`: a starting plan that always checks and compiles, from a
//! preset or a Hugging Face config; bad names get a did-you-mean.

mod common;

use common::{assert_no_panic, rcoa, text};
use std::path::PathBuf;

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rcoa-init-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn presets_give_plans_that_check_and_compile() {
    let dir = temp("presets");
    for (model, gpu, gpus, batch) in [
        ("llama-3.2-1b", "h100-80gb", "1", "32"),
        ("xlm-roberta-large", "rtx6000-24gb", "1", "64"),
        ("llama-3.1-8b", "a100-40gb", "4", "256"),
        // `precision fp16` where bf16 has no tensor cores.
        ("llama-3.2-1b", "t4-16gb", "1", "8"),
    ] {
        let plan = dir.join(format!("{model}-{gpu}.plan"));
        let out = rcoa(&[
            "init",
            "--model",
            model,
            "--gpu",
            gpu,
            "--gpus",
            gpus,
            "--global-batch",
            batch,
            "-o",
            plan.to_str().unwrap(),
        ]);
        assert_no_panic(&out);
        let err = text(&out.stderr);
        assert!(out.status.success(), "{model}: {err}");
        assert!(err.contains("next:"), "{err}");
        let written = std::fs::read_to_string(&plan).unwrap();
        assert!(written.contains("micro_batch  = auto"), "{written}");
        assert!(
            written.contains(&format!("global_batch = {batch}")),
            "{written}"
        );
        let check = rcoa(&["check", plan.to_str().unwrap()]);
        assert!(check.status.success(), "{}", text(&check.stderr));
        let compiled = rcoa(&["compile", plan.to_str().unwrap(), "--format", "json"]);
        assert_ne!(
            compiled.status.code(),
            Some(2),
            "{}",
            text(&compiled.stderr)
        );
    }
    // Without -o the plan goes to stdout.
    let out = rcoa(&[
        "init",
        "--model",
        "gpt2-small",
        "--gpu",
        "l40s-48gb",
        "--global-batch",
        "8",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(text(&out.stdout).starts_with("# Written by `rcoa init`"));
    assert!(
        text(&out.stdout).contains("seq_len      = 1024"),
        "gpt2 has 1024 positions"
    );
    assert!(!text(&out.stdout).contains("no bf16 tensor cores"));
    // A GPU without bf16 tensor cores: the plan says what its fp16 ones take.
    let out = rcoa(&[
        "init",
        "--model",
        "gpt2-small",
        "--gpu",
        "t4-16gb",
        "--global-batch",
        "8",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let plan = text(&out.stdout);
    assert!(
        plan.contains(
            "# t4-16gb has no bf16 tensor cores: bf16 runs on its CUDA cores (8.1 TFLOP/s).\n\
             # Its fp16 tensor cores (65.0 TFLOP/s) take fp16"
        ) && plan.contains("\nprecision fp16\n"),
        "{plan}"
    );
}

#[test]
fn a_hugging_face_config_is_referenced_relative_to_the_plan() {
    let dir = temp("hf");
    std::fs::create_dir_all(dir.join("ckpt")).unwrap();
    std::fs::write(
        dir.join("ckpt/config.json"),
        r#"{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
            "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256}"#,
    )
    .unwrap();
    let plan = dir.join("plans/tiny.plan");
    let out = rcoa(&[
        "init",
        "--model",
        dir.join("ckpt").to_str().unwrap(),
        "--gpu",
        "h100-80gb",
        "--global-batch",
        "4",
        "--seq-len",
        "128",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let written = std::fs::read_to_string(&plan).unwrap();
    let canonical = std::fs::canonicalize(dir.join("ckpt/config.json")).unwrap();
    assert!(
        written.contains(&format!("model hf \"{}\"", canonical.display())),
        "outside the plan's folder the path is absolute: {written}"
    );
    let check = rcoa(&["check", plan.to_str().unwrap()]);
    assert!(check.status.success(), "{}", text(&check.stderr));
    // Beside the plan: a relative path.
    let plan2 = dir.join("beside.plan");
    let out = rcoa(&[
        "init",
        "--model",
        dir.join("ckpt/config.json").to_str().unwrap(),
        "--gpu",
        "h100-80gb",
        "--global-batch",
        "4",
        "-o",
        plan2.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(std::fs::read_to_string(&plan2)
        .unwrap()
        .contains("model hf \"ckpt/config.json\""));
}

#[test]
fn bad_names_and_values_are_clear_errors() {
    let dir = temp("bad");
    for (args, says) in [
        (
            vec![
                "--model",
                "llama-3.1-8bb",
                "--gpu",
                "h100-80gb",
                "--global-batch",
                "8",
            ],
            "did you mean `llama-3.1-8b`?",
        ),
        (
            vec![
                "--model",
                "llama-3.1-8b",
                "--gpu",
                "h100",
                "--global-batch",
                "8",
            ],
            "did you mean `h100-80gb`?",
        ),
        (
            vec![
                "--model",
                "llama-3.1-8b",
                "--gpu",
                "h100-80gb",
                "--global-batch",
                "0",
            ],
            "--global-batch must be at least 1",
        ),
        (
            vec![
                "--model",
                "no/such/config.json",
                "--gpu",
                "h100-80gb",
                "--global-batch",
                "8",
            ],
            "no Hugging Face config",
        ),
    ] {
        let mut all = vec!["init"];
        all.extend(args);
        let out = rcoa(&all);
        assert_no_panic(&out);
        assert_eq!(out.status.code(), Some(2), "{all:?}");
        assert!(
            text(&out.stderr).contains(says),
            "{all:?}: {}",
            text(&out.stderr)
        );
    }
    // An existing plan is never overwritten.
    let plan = dir.join("mine.plan");
    std::fs::write(&plan, "# mine\n").unwrap();
    let out = rcoa(&[
        "init",
        "--model",
        "llama-3.2-1b",
        "--gpu",
        "h100-80gb",
        "--global-batch",
        "8",
        "-o",
        plan.to_str().unwrap(),
    ]);
    assert_eq!(out.status.code(), Some(2));
    assert!(text(&out.stderr).contains("does not overwrite"));
    assert_eq!(std::fs::read_to_string(&plan).unwrap(), "# mine\n");
}
