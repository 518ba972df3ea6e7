//! `optimizer.in_backward` (`crate::in_backward`) against the step after the
//! backward: the same losses and the same weights, bit for bit, whatever the
//! model, the optimizer or the recomputation; and the plans it cannot run
//! refused before anything is built.

use super::{serial, sharded_matches_one_rank, trainer, two_rank_reference, Cpu, Off};
use crate::memory::RssProbe;
use crate::testing::{tiny_encoder_plan, tiny_plan};
use crate::train::Trainer;
use crate::RunError;
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::{Loss, Offload, OffloadTo, OffloadWhat, OptimizerKind};

/// Losses of three steps and the weights after them; `master`: an fp32
/// master beside an fp32 working copy (the control flow of 16-bit weights
/// with a master, which the CPU cannot compute in).
fn three_steps(plan: &LoweredPlan, master: bool) -> (Vec<f64>, Vec<f32>) {
    let mut t: Trainer<Cpu> = trainer(plan);
    assert_eq!(t.steps_in_backward(), plan.resolved.optimizer_in_backward);
    if master {
        t.with_fp32_master();
    }
    let losses = (0..3)
        .map(|_| t.train_step(&mut RssProbe::new()).unwrap().loss)
        .collect();
    (losses, t.flat_weights().unwrap())
}

fn in_backward(plan: &LoweredPlan) -> LoweredPlan {
    let mut p = plan.clone();
    p.resolved.optimizer_in_backward = true;
    p
}

#[test]
fn steps_in_the_backward_equal_the_step_after_it() {
    let _g = serial();
    let mut cases: Vec<(String, LoweredPlan)> = Vec::new();
    let mut tied = tiny_plan();
    tied.model.tie_embeddings = true;
    let mut recomputed = tied.clone();
    recomputed.resolved.checkpoint_layers = vec![0];
    cases.push(("untied".into(), tiny_plan()));
    cases.push(("tied".into(), tied.clone()));
    cases.push(("tied, layer 0 recomputed".into(), recomputed));
    cases.push(("LoRA".into(), super::lora_plan()));
    cases.push(("QLoRA".into(), super::qlora_plan()));
    cases.push(("encoder".into(), tiny_encoder_plan(Loss::MaskedLm)));
    for (kind, momentum, decay) in [
        (OptimizerKind::Sgd, 0.9, 0.01),
        (OptimizerKind::Adam, 0.0, 0.01),
        (OptimizerKind::Lion, 0.0, 0.1),
        (OptimizerKind::Adam8bit, 0.0, 0.01),
        (OptimizerKind::Adafactor, 0.0, 0.01),
        (OptimizerKind::AdamMini, 0.0, 0.1),
    ] {
        let mut p = tied.clone();
        p.optimizer.kind = kind;
        p.optimizer.momentum = momentum;
        p.optimizer.weight_decay = decay;
        cases.push((format!("tied, {}", kind.as_str()), p));
    }
    for (what, plan) in cases {
        for master in [false, true] {
            let after = three_steps(&plan, master);
            let during = three_steps(&in_backward(&plan), master);
            assert_eq!(during.0, after.0, "{what} (master {master}): losses differ");
            assert!(
                during.1 == after.1,
                "{what} (master {master}): weights differ"
            );
            // The steps moved the weights: equal weights are not untrained ones.
            let fresh = trainer(&plan).flat_weights().unwrap();
            assert!(during.1 != fresh, "{what}: nothing was trained");
        }
    }
}

/// Data parallelism: two ranks (threads), each averaging a unit's gradients over both
/// before the unit steps, end where one rank with both ranks' batch does (stepping in the
/// backward too), with tied embeddings (the matrix reduced once, after its two parts are
/// added), a recomputed layer, and LoRA (frozen units reduce nothing).
#[test]
fn two_ranks_stepping_in_the_backward_match_one_rank() {
    let _g = serial();
    let mut tied = tiny_plan();
    tied.model.tie_embeddings = true;
    // One rank takes both ranks' sequences in one micro-batch: every backward is a step.
    let one = |plan: LoweredPlan| {
        let mut p = in_backward(&two_rank_reference(plan));
        p.resolved.micro_batch = 4;
        p.resolved.grad_accum = 1;
        p
    };
    sharded_matches_one_rank(
        &one(tied),
        &[
            (0, Off::None, vec![true, false]),
            (0, Off::None, Vec::new()),
        ],
    );
    sharded_matches_one_rank(&one(super::lora_plan()), &[(0, Off::None, Vec::new())]);
}

#[test]
fn a_checkpoint_written_in_the_backward_resumes_after_it() {
    let _g = serial();
    let mut plan = tiny_plan();
    plan.model.tie_embeddings = true;
    let dir = std::env::temp_dir().join(format!("rcoa-in-backward-{}", std::process::id()));
    // QLoRA: the resumed model's NF4 bases replace those the skeleton was made beside.
    let plan = LoweredPlan {
        adapter: super::qlora_plan().adapter,
        ..plan
    };
    let mut t: Trainer<Cpu> = trainer(&in_backward(&plan));
    t.train_step(&mut RssProbe::new()).unwrap();
    t.save(&dir).unwrap();
    // The same optimizer records as the step after the backward keeps.
    let mut after: Trainer<Cpu> = trainer(&plan);
    after.resume(&dir).unwrap();
    let mut during: Trainer<Cpu> = trainer(&in_backward(&plan));
    during.resume(&dir).unwrap();
    let _ = std::fs::remove_dir_all(&dir);
    for t in [&mut after, &mut during] {
        t.train_step(&mut RssProbe::new()).unwrap();
    }
    assert!(after.flat_weights().unwrap() == during.flat_weights().unwrap());
}

#[test]
fn what_it_cannot_step_in_the_backward_is_refused() {
    let _g = serial();
    let refused = |p: LoweredPlan, words: &str| match trainer_result(&in_backward(&p)) {
        Err(RunError::Unsupported(e)) => {
            assert!(e.contains("in_backward") && e.contains(words), "{e}")
        }
        Err(e) => panic!("{words}: another error: {e}"),
        Ok(_) => panic!("{words}: not refused"),
    };
    let mut p = tiny_plan();
    p.resolved.grad_accum = 2;
    p.resolved.micro_batch = 1;
    refused(p, "grad_accum = 1");
    let mut p = tiny_plan();
    p.resolved.zero = 1;
    refused(p, "ZeRO");
    let mut p = tiny_plan();
    p.resolved.offload = vec![Offload {
        what: OffloadWhat::Optimizer,
        to: OffloadTo::Cpu,
    }];
    refused(p, "offload");
    let mut p = tiny_plan();
    p.precision.compute = rcoa_compiler::spec::Dtype::Fp16;
    refused(p, "fp16");
    // Activations on the host are the step's own business: accepted.
    let mut p = tiny_plan();
    p.resolved.checkpoint_layers = vec![0];
    p.resolved.offload = vec![Offload {
        what: OffloadWhat::Activations,
        to: OffloadTo::Cpu,
    }];
    assert!(trainer_result(&in_backward(&p)).is_ok());
}

fn trainer_result(plan: &LoweredPlan) -> Result<Trainer<Cpu>, RunError> {
    crate::testing::trainer(plan, &super::opts(1), 11)
}

const CHILD: &str = "RCOA_IN_BACKWARD_MEASURE_CHILD";

/// A decoder of megabyte parameters and tiny activations on one rank (so the step's
/// highest point is weights, gradients and optimizer state), fp32, nothing recomputed.
fn measured_plan(in_backward: bool, tied: bool) -> String {
    measured_plan_with("adamw", in_backward, tied)
}

fn measured_plan_with(optimizer: &str, in_backward: bool, tied: bool) -> String {
    format!(
        "model {{\n  arch = decoder\n  layers = 4\n  hidden = 256\n  heads = 4\n  ffn = 1024\n  \
         mlp = swiglu\n  norm = rmsnorm\n  tie_embeddings = {tied}\n  vocab = 4096\n  max_positions = 64\n}}\n\
         precision fp32\noptimizer {optimizer} {{ lr = 1e-3  in_backward = {in_backward} }}\n\
         train {{ seq_len = 16  global_batch = 2  micro_batch = 2  grad_accum = 1 }}\n\
         fit {{ checkpoint = none }}\nhardware {{ gpu = h100-80gb }}\ntarget burn\n"
    )
}

/// The highest live bytes of a steady-state step (the second: the first makes the
/// optimizer state) above those before the model was built: the weights, the optimizer
/// state and the step's tensors, transients included.
pub(super) fn measured_peak(plan: &LoweredPlan) -> u64 {
    measured_peak_with(plan, &super::opts(1))
}

/// [`measured_peak`] under `opts` (its data file, say).
pub(super) fn measured_peak_with(plan: &LoweredPlan, opts: &crate::RunOptions) -> u64 {
    use crate::memory::{AllocProbe, MemoryProbe};
    let mut probe = AllocProbe::new().expect("the test binary counts");
    let mut t: Trainer<Cpu> = crate::testing::trainer(plan, opts, 11).unwrap();
    let quiet = &mut crate::shard::tests_memory::Quiet;
    t.train_step(quiet).unwrap();
    probe.begin_step();
    t.train_step(quiet).unwrap();
    probe.sample();
    drop(t);
    probe.step_peak()
}

/// The lowered plan, and the `burn` profile's highest bytes in use with the transients
/// inside segments (which the executor's samples between segments do not see, and the
/// counting allocator does): an optimizer step in the backward is one.
pub(super) fn predicted_peak(text: &str) -> (LoweredPlan, u64) {
    let file = rcoa_grammar::parse("t.plan", text).expect("plan parses");
    let cx = rcoa_compiler::resolve::ResolveContext::new("t.plan", text, ".");
    let spec = rcoa_compiler::resolve::resolve(&file, &cx).expect("plan resolves");
    let c = rcoa_compiler::compile(&spec).expect("plan compiles");
    let mut profile = c.profile.clone();
    profile.peak_sampled_at_segments = false;
    let r = rcoa_compiler::memory::parallel::evaluate(&spec, &c.candidate, &profile, false);
    (c.lowered, r.peak_bytes)
}

#[test]
fn stepping_in_the_backward_saves_what_the_burn_profile_predicts() {
    crate::testing::run_ignored_in_child(
        "tests::in_backward::stepping_in_the_backward_measured_in_child",
        CHILD,
    );
}

#[test]
#[ignore = "run in its own process by stepping_in_the_backward_saves_what_the_burn_profile_predicts"]
fn stepping_in_the_backward_measured_in_child() {
    assert!(std::env::var_os(CHILD).is_some(), "run by its parent test");
    let _g = serial();
    // Thread pools and first-use buffers before the measurement.
    measured_peak(&predicted_peak(&measured_plan(false, false)).0);
    for tied in [false, true] {
        let mut got = Vec::new();
        for in_backward in [false, true] {
            let (plan, predicted) = predicted_peak(&measured_plan(in_backward, tied));
            assert_eq!(plan.resolved.optimizer_in_backward, in_backward);
            let measured = measured_peak(&plan);
            println!(
                "tied {tied}, in the backward {in_backward}: measured {measured} predicted {predicted} ({:+.4})",
                measured as f64 / predicted as f64 - 1.0
            );
            // Within 2 % above the prediction (a unit's old weights held through its step
            // would be 4 % here) and 5 % below it (the tied embedding's step is charged
            // beside the scratch of its sum, which the executor has freed by then).
            let err = measured as f64 / predicted as f64 - 1.0;
            assert!(
                (-0.05..0.02).contains(&err),
                "tied {tied}, in the backward {in_backward}: {err:+.4}"
            );
            got.push(measured);
        }
        // The gradients the step after the backward holds, less one unit's.
        assert!(got[1] + 12_000_000 < got[0], "{got:?}");
    }
}

/// `optimizer`'s peak after the backward and in it, against the `burn` profile's: the
/// error `measured / predicted − 1` within `bounds`. Run in a child process: the counting
/// allocator counts the whole process.
fn peaks_within(optimizer: &str, bounds: std::ops::Range<f64>) {
    let _g = serial();
    // Thread pools and first-use buffers before the measurement.
    measured_peak(&predicted_peak(&measured_plan_with(optimizer, false, false)).0);
    for in_backward in [false, true] {
        let (plan, predicted) = predicted_peak(&measured_plan_with(optimizer, in_backward, false));
        let measured = measured_peak(&plan);
        let err = measured as f64 / predicted as f64 - 1.0;
        println!("{optimizer}, in the backward {in_backward}: measured {measured} predicted {predicted} ({err:+.4})");
        assert!(
            bounds.contains(&err),
            "{optimizer}, in the backward {in_backward}: {err:+.4}"
        );
    }
}

const CHILD_ADAFACTOR: &str = "RCOA_ADAFACTOR_MEASURE_CHILD";

#[test]
fn adafactor_holds_what_the_burn_profile_predicts() {
    crate::testing::run_ignored_in_child(
        "tests::in_backward::adafactor_measured_in_child",
        CHILD_ADAFACTOR,
    );
}

/// Adafactor (`optim::adafactor`) after the backward and in it: its factored state (a
/// row and a column per matrix) and its step's two fp32 temporaries of the parameter.
#[test]
#[ignore = "run in its own process by adafactor_holds_what_the_burn_profile_predicts"]
fn adafactor_measured_in_child() {
    assert!(
        std::env::var_os(CHILD_ADAFACTOR).is_some(),
        "run by its parent test"
    );
    // In the backward the CPU holds 1.35 MB (+3.6 %) more than predicted at the head's
    // step, 0.6 MB more than AdamW's there: not yet explained (docs/gpu-session.md, call
    // 7, measures it on CUDA).
    peaks_within("adafactor", -0.05..0.04);
}

const CHILD_ADAM_MINI: &str = "RCOA_ADAM_MINI_MEASURE_CHILD";

#[test]
fn adam_mini_holds_what_the_burn_profile_predicts() {
    crate::testing::run_ignored_in_child(
        "tests::in_backward::adam_mini_measured_in_child",
        CHILD_ADAM_MINI,
    );
}

/// Adam-mini (`optim::adam_mini`) after the backward and in it: a first moment per
/// parameter, a second one per block, and its step's one temporary of the parameter.
/// Measured: +0.2 % after the backward, +2.1 % in it (AdamW's +0.8 % there, and 0.7 MB
/// more at the head's step, as Adafactor's).
#[test]
#[ignore = "run in its own process by adam_mini_holds_what_the_burn_profile_predicts"]
fn adam_mini_measured_in_child() {
    assert!(
        std::env::var_os(CHILD_ADAM_MINI).is_some(),
        "run by its parent test"
    );
    // Charging two temporaries of the largest parameter (the package's step) would put
    // the step after the backward at -4.7 %.
    peaks_within("adam-mini", -0.02..0.03);
}
