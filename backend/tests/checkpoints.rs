//! Resume safety: a checkpoint resumes only into the run it belongs to
//! (model shape, adapter, optimizer, parameter storage); what the saved
//! state does not depend on (learning rate, steps, ...) may change.

use burn::backend::{Autodiff, NdArray};
use rcoa_backend::testing::tiny_plan;
use rcoa_backend::train::{Trainer, TrainerConfig};
use rcoa_backend::RunError;
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::{AdapterKind, AdapterSpec, Dtype, OptimizerKind, Proj};
use std::path::{Path, PathBuf};

type Cpu = Autodiff<NdArray<f32>>;

fn trainer(plan: &LoweredPlan) -> Trainer<Cpu> {
    let opts = rcoa_backend::RunOptions {
        steps: 1,
        seed: 3,
        data: None,
        ..Default::default()
    };
    Trainer::new(
        plan,
        TrainerConfig {
            seed: 3,
            batcher: rcoa_backend::batcher(plan, &opts).unwrap(),
            sixteen_bit: false,
            collective: None,
        },
        Default::default(),
    )
    .unwrap()
}

/// A checkpoint of `plan` after one step, in a fresh folder.
fn saved(plan: &LoweredPlan, tag: &str) -> (PathBuf, f64) {
    let dir = std::env::temp_dir().join(format!("rcoa-ckpt-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut t = trainer(plan);
    let mut probe = rcoa_backend::memory::cpu_probe();
    t.train_step(probe.as_mut()).unwrap();
    t.save(&dir).unwrap();
    (dir, t.param_checksum().unwrap())
}

fn refused(plan: &LoweredPlan, dir: &Path) -> String {
    match trainer(plan).resume(dir) {
        Err(e @ RunError::Checkpoint(_)) => e.to_string(),
        Err(e) => panic!("not a checkpoint error: {e}"),
        Ok(()) => panic!("resumed a checkpoint of another run"),
    }
}

fn lora(rank: u64) -> AdapterSpec {
    AdapterSpec {
        kind: AdapterKind::Lora,
        rank,
        alpha: 16.0,
        targets: vec![Proj::Q, Proj::V],
        dropout: 0.0,
        base: Dtype::Fp32,
    }
}

#[test]
fn a_changed_learning_rate_or_step_count_resumes() {
    let plan = tiny_plan();
    let (dir, sum) = saved(&plan, "legit");
    let mut later = plan.clone();
    later.optimizer.lr *= 0.1;
    later.optimizer.weight_decay = 0.01;
    later.optimizer.betas = (0.8, 0.9);
    later.train.steps = Some(100);
    let mut t = trainer(&later);
    t.resume(&dir).unwrap();
    assert_eq!(t.step, 1);
    assert_eq!(
        t.param_checksum().unwrap(),
        sum,
        "the saved weights are loaded"
    );
    let mut probe = rcoa_backend::memory::cpu_probe();
    t.train_step(probe.as_mut()).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn another_model_is_refused_naming_what_differs() {
    let plan = tiny_plan();
    let (dir, _) = saved(&plan, "model");
    let mut other = plan.clone();
    other.model.layers = 3;
    other.model.ffn = 96;
    let e = refused(&other, &dir);
    assert!(
        e.contains("belongs to another run")
            && e.contains("model: ffn 64 in the checkpoint, 96 in this plan, layers 2 in the checkpoint, 3 in this plan"),
        "{e}"
    );
    assert!(!e.contains("optimizer:") && !e.contains("adapter:"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn another_adapter_is_refused() {
    let plan = tiny_plan();
    let (full, _) = saved(&plan, "adapter-full");
    let mut with = plan.clone();
    with.adapter = Some(lora(4));
    let e = refused(&with, &full);
    assert!(
        e.contains("adapter: kind none in the checkpoint; alpha 16, kind lora, rank 4, targets q,v in this plan"),
        "{e}"
    );
    assert!(!e.contains("(none)"), "{e}");
    let (adapted, _) = saved(&with, "adapter-r4");
    let mut rank8 = with.clone();
    rank8.adapter = Some(lora(8));
    let e = refused(&rank8, &adapted);
    assert!(
        e.contains("adapter: rank 4 in the checkpoint, 8 in this plan"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&full);
    let _ = std::fs::remove_dir_all(&adapted);
}

#[test]
fn another_optimizer_is_refused() {
    let plan = tiny_plan();
    let (dir, _) = saved(&plan, "optim");
    let mut sgd = plan.clone();
    sgd.optimizer.kind = OptimizerKind::Sgd;
    sgd.optimizer.momentum = 0.9;
    let e = refused(&sgd, &dir);
    assert!(
        e.contains("optimizer: kind adamw in the checkpoint; kind sgd, momentum true in this plan"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_checkpoint_without_identity_or_with_an_edited_one_is_refused() {
    let plan = tiny_plan();
    let (dir, _) = saved(&plan, "edited");
    let path = dir.join("state.json");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut state: serde_json::Value = serde_json::from_str(&text).unwrap();
    // Edited to claim another model: the fingerprint no longer agrees.
    state["belongs_to"]["model.layers"] = "3".into();
    std::fs::write(&path, state.to_string()).unwrap();
    let mut three = plan.clone();
    three.model.layers = 3;
    let e = refused(&three, &dir);
    assert!(e.contains("inconsistent"), "{e}");
    // What rcoa wrote before checkpoints recorded what they belong to.
    std::fs::write(&path, r#"{"step":1,"seed":3,"format":1}"#).unwrap();
    let e = refused(&plan, &dir);
    assert!(
        e.contains("does not record which model, adapter and optimizer it belongs to"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Burn loads a record of other shapes without a word: weights of another
/// model under a matching state.json are caught by their shapes.
#[test]
fn weights_of_another_shape_under_a_matching_state_are_refused() {
    let plan = tiny_plan();
    let (dir, _) = saved(&plan, "swap-a");
    let mut wide = plan.clone();
    wide.model.ffn = 96;
    let (other, _) = saved(&wide, "swap-b");
    std::fs::copy(other.join("model.bin"), dir.join("model.bin")).unwrap();
    let e = refused(&plan, &dir);
    assert!(e.contains("holds weights of another shape"), "{e}");
    assert!(
        e.contains("[64, 32] in this plan") || e.contains("[32, 64] in this plan"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&other);
}
