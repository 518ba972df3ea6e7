//! `rcoa run --save` end to end: a LoRA run from a Hugging Face checkpoint
//! writes a PEFT adapter (or merged weights with `--merge-lora`), and
//! `--resume` refuses that checkpoint under another adapter, with exit 2
//! and a diagnostic naming what differs.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn temp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rcoa-cli-save-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A plan training the tiny Llama fixture, with `adapter` (a `.plan` line).
fn plan(dir: &Path, name: &str, adapter: &str) -> PathBuf {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama");
    let p = dir.join(format!("{name}.plan"));
    std::fs::write(
        &p,
        format!(
            "model hf \"{}\"\n{adapter}\nhardware {{ gpu = h100-80gb }}\nprecision fp32\n\
             optimizer adamw {{ lr = 1e-2 }}\ntrain {{ seq_len = 16 global_batch = 2 micro_batch = 2 }}\ntarget burn\n",
            fixture.display()
        ),
    )
    .unwrap();
    p
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rcoa"))
        .arg("run")
        .args(args)
        .args(["--format", "json"])
        .output()
        .unwrap()
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

#[test]
fn a_lora_run_saves_peft_files_and_refuses_to_resume_under_another_adapter() {
    let dir = temp("lora");
    let r4 = plan(
        &dir,
        "r4",
        "adapter lora { rank = 4 alpha = 8 targets = [q, v] }",
    );
    let ckpt = dir.join("ckpt");
    let out = run(&[s(&r4), "--steps", "2", "--save", s(&ckpt)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        // The fixture's chat template goes with the tokenizer.
        "chat_template.jinja",
        "state.json",
    ] {
        assert!(ckpt.join(f).is_file(), "{f} missing");
    }
    let r8 = plan(
        &dir,
        "r8",
        "adapter lora { rank = 8 alpha = 8 targets = [q, v] }",
    );
    let out = run(&[s(&r8), "--steps", "3", "--resume", s(&ckpt)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("rcoa::run_checkpoint"), "{err}");
    assert!(
        err.contains("adapter: rank 4 in the checkpoint, 8 in this plan"),
        "{err}"
    );
    // The same plan resumes.
    let out = run(&[s(&r4), "--steps", "3", "--resume", s(&ckpt)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let merged = dir.join("merged");
    let out = run(&[s(&r4), "--steps", "1", "--save", s(&merged), "--merge-lora"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(merged.join("model.safetensors").is_file() && merged.join("config.json").is_file());
    assert!(!merged.join("adapter_config.json").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn merge_lora_without_an_adapter_and_a_bad_shard_size_are_refused_before_training() {
    let dir = temp("refused");
    let full = plan(&dir, "full", "");
    let ckpt = dir.join("ckpt");
    let out = run(&[s(&full), "--steps", "1", "--save", s(&ckpt), "--merge-lora"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("this plan has no `adapter lora`"), "{err}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("\"step\""));
    let out = run(&[
        s(&full),
        "--steps",
        "1",
        "--save",
        s(&ckpt),
        "--max-shard-size",
        "5XB",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("the unit must be B, KB, MB or GB"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
