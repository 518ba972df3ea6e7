//! ZeRO 1/2 (`shard::Zero`) against the compiler's `burn` profile, measured
//! with the counting allocator in a process of its own (other tests
//! allocate meanwhile): each rank's start-up peak within 2% of the
//! prediction, and a steady-state step of both ranks (threads of one
//! process) not above twice one rank's predicted step peak.
//!
//! The CPU backend has no 16-bit floats: a `precision bf16` plan runs in
//! fp32 here (`Precision::for_plan`'s note). The plans below are fp32,
//! whose ZeRO 1/2 runs the same start-up as 16-bit weights with an fp32
//! master (the master shard cut from each unit as it is built, then the
//! unit kept whole) without the cast to 16 bits.

use crate::memory::{AllocProbe, MemoryProbe};
use crate::train::{Trainer, TrainerConfig};
use crate::RunOptions;
use std::sync::{Arc, Barrier, Mutex};

type Cpu = burn::backend::Autodiff<burn::backend::NdArray<f32>>;
type Inner = burn::backend::NdArray<f32>;

const CHILD: &str = "RCOA_ZERO_MEASURE_CHILD";

/// The decoder of `setup::tests` (megabyte units: bookkeeping is noise),
/// on two ranks with ZeRO `stage`, and tiny activations, so the step's
/// highest point is the persistent state and the flat buffers.
fn plan(stage: u8) -> String {
    plan_fit(stage, "checkpoint = none")
}

/// [`plan`] with its `fit` section's body.
fn plan_fit(stage: u8, fit: &str) -> String {
    format!(
        "model {{\n  arch = decoder\n  layers = 2\n  hidden = 256\n  heads = 4\n  ffn = 1024\n  \
         mlp = swiglu\n  norm = rmsnorm\n  tie_embeddings = false\n  vocab = 4096\n  max_positions = 64\n}}\n\
         precision fp32\noptimizer adamw {{ lr = 1e-3 }}\n\
         train {{ seq_len = 16  global_batch = 4  micro_batch = 2  grad_accum = 1 }}\n\
         fit {{ {fit} }}\n\
         hardware {{ gpu = h100-80gb  gpus_per_node = 2 }}\nparallel {{ data = 2  zero = {stage} }}\n\
         target burn\n"
    )
}

/// The lowered plan, the compiler's setup point and its highest step point.
pub(crate) fn compile(text: &str) -> (rcoa_compiler::lowered::LoweredPlan, u64, u64) {
    let file = rcoa_grammar::parse("t.plan", text).expect("plan parses");
    let cx = rcoa_compiler::resolve::ResolveContext::new("t.plan", text, ".");
    let spec = rcoa_compiler::resolve::resolve(&file, &cx).expect("plan resolves");
    let c = rcoa_compiler::compile(&spec).expect("plan compiles");
    let setup = c.report.phase_peaks["setup"];
    let step = c
        .report
        .phase_peaks
        .iter()
        .filter(|(k, _)| k.as_str() != "setup")
        .map(|(_, v)| *v)
        .max()
        .unwrap_or(0);
    (c.lowered, setup, step)
}

/// A probe that measures nothing: the ranks' own samples would reset the
/// process-wide peak the test reads.
pub(crate) struct Quiet;

impl MemoryProbe for Quiet {
    fn sample(&mut self) -> u64 {
        0
    }
    fn begin_step(&mut self) {}
    fn step_peak(&self) -> u64 {
        0
    }
    fn peak(&self) -> u64 {
        0
    }
    fn peak_reserved(&self) -> Option<u64> {
        None
    }
    fn what(&self) -> &'static str {
        "nothing"
    }
}

/// Prints the comparison; whether `measured` is within `tolerance` of `predicted`.
fn close(what: &str, measured: u64, predicted: u64, tolerance: f64) -> bool {
    let err = measured as f64 / predicted as f64 - 1.0;
    println!("{what}: measured {measured} predicted {predicted} ({err:+.4})");
    err.abs() < tolerance
}

/// Each rank's start-up peak (the builds one at a time) and the two ranks'
/// highest live bytes together through a steady-state step (the second).
pub(crate) fn measure(plan: &rcoa_compiler::lowered::LoweredPlan) -> (Vec<u64>, u64) {
    let turn = Arc::new(Mutex::new(()));
    let built = Arc::new(Barrier::new(2));
    let warm = Arc::new(Barrier::new(2));
    let measured = Arc::new(Barrier::new(2));
    let step: Arc<Mutex<Option<AllocProbe>>> = Arc::new(Mutex::new(None));
    let ranks: Vec<_> = (0..2u32)
        .map(|local| {
            let plan = plan.clone();
            let (turn, built, warm, measured, step) = (
                turn.clone(),
                built.clone(),
                warm.clone(),
                measured.clone(),
                step.clone(),
            );
            std::thread::Builder::new()
                .stack_size(64 << 20)
                .spawn(move || {
                    use crate::distributed::Collective;
                    let d = crate::testing::thread_rank(local, 120);
                    let c = Collective::<Inner>::register(&d, &Default::default()).unwrap();
                    // Done: dropping the trainer leaves the collective, so the
                    // next run in this process can join one.
                    let progress = c.progress();
                    let opts = RunOptions {
                        steps: 2,
                        seed: 5,
                        distributed: Some(d),
                        ..Default::default()
                    };
                    let batcher = crate::batcher(&plan, &opts).unwrap();
                    let (mut trainer, setup) = {
                        // One build at a time: the probe's peak is process-wide.
                        let _one = turn.lock().unwrap_or_else(|e| e.into_inner());
                        let mut probe = AllocProbe::new().expect("the test binary counts");
                        let t = Trainer::<Cpu>::new(
                            &plan,
                            TrainerConfig {
                                seed: 5,
                                batcher,
                                sixteen_bit: false,
                                collective: Some(c),
                            },
                            Default::default(),
                        )
                        .unwrap();
                        probe.sample();
                        (t, probe.step_peak())
                    };
                    built.wait();
                    if local == 0 {
                        *step.lock().unwrap() = Some(AllocProbe::new().unwrap());
                    }
                    // The first step makes the optimizer state.
                    trainer.train_step(&mut Quiet).unwrap();
                    warm.wait();
                    if local == 0 {
                        step.lock().unwrap().as_mut().unwrap().begin_step();
                    }
                    warm.wait();
                    trainer.train_step(&mut Quiet).unwrap();
                    measured.wait();
                    let peak = if local == 0 {
                        let mut p = step.lock().unwrap();
                        let p = p.as_mut().unwrap();
                        p.sample();
                        p.step_peak()
                    } else {
                        0
                    };
                    measured.wait();
                    progress.set_done();
                    drop(trainer);
                    (setup, peak)
                })
                .unwrap()
        })
        .collect();
    let mut setups = Vec::new();
    let mut step_peak = 0;
    for r in ranks {
        let (s, p) = r.join().unwrap();
        setups.push(s);
        step_peak = step_peak.max(p);
    }
    (setups, step_peak)
}

#[test]
fn zero_1_and_2_hold_what_the_burn_profile_charges() {
    crate::testing::run_ignored_in_child("shard::tests_memory::zero_measured_in_child", CHILD);
}

#[test]
#[ignore = "run in its own process by zero_1_and_2_hold_what_the_burn_profile_charges"]
fn zero_measured_in_child() {
    assert!(std::env::var_os(CHILD).is_some(), "run by its parent test");
    // Thread pools and first-use buffers before the measurement.
    measure(&compile(&plan(1)).0);
    // Rank 1 owns the tail of the flat vector: its highest start-up point is
    // the head's cut. The prediction is CubeCL's, where flattening and
    // slicing a parameter make views; burn-ndarray copies both
    // (`CowArray::into_shared`, `slice_move(..).to_shared()`), so on the CPU
    // the cut also holds the head's flattened weight and its slice (all of it
    // is rank 1's).
    let head = 4 * 256 * 4096u64;
    let ndarray = [0, 2 * head];
    let mut ok = true;
    for stage in [1u8, 2] {
        let text = plan(stage);
        let (lowered, setup, step) = compile(&text);
        let (setups, step_peak) = measure(&lowered);
        for (i, s) in setups.iter().enumerate() {
            ok &= close(
                &format!("ZeRO-{stage} rank {i} setup"),
                *s,
                setup + ndarray[i],
                0.02,
            );
        }
        // Both ranks' tensors live in this one process, and their highest
        // points need not coincide: the sum of two ranks' predicted step
        // peaks bounds what they hold together, no closer.
        let two = 2 * step;
        println!(
            "ZeRO-{stage} step (2 ranks together): measured {step_peak} predicted at most {two} ({:+.4})",
            step_peak as f64 / two as f64 - 1.0
        );
        ok &= step_peak <= two + two / 50;
    }
    assert!(ok, "measured and predicted differ (above)");
}

const CHILD_GRADS: &str = "RCOA_GRAD_OFFLOAD_MEASURE_CHILD";

#[test]
fn gradient_offload_holds_what_the_burn_profile_charges() {
    crate::testing::run_ignored_in_child(
        "shard::tests_memory::gradient_offload_measured_in_child",
        CHILD_GRADS,
    );
}

/// Gradient offload (`[optimizer, grads]`, the per-unit step with whole weights) at ZeRO 0
/// and 2 on two thread ranks. ZeRO 2 brings half the fp32 update up and replaces the
/// weights a unit at a time, all-gathering one unit's values at once
/// (`Zero3::finish_step`), so its steady step never holds more than ZeRO 0's, which brings
/// the whole update up; the former whole fp32 all-gather beside the old weights held 33 %
/// more than ZeRO 0 here. Against the profile (printed, not asserted): burn-ndarray copies
/// what CubeCL views (a unit's parameters cut from the resting weights, flattened
/// gradients), so the CPU holds more than the prediction.
#[test]
#[ignore = "run in its own process by gradient_offload_holds_what_the_burn_profile_charges"]
fn gradient_offload_measured_in_child() {
    assert!(
        std::env::var_os(CHILD_GRADS).is_some(),
        "run by its parent test"
    );
    measure(&compile(&plan(1)).0);
    let mut steps = Vec::new();
    for stage in [0u8, 2] {
        let text = plan_fit(
            stage,
            "checkpoint = none  must_offload = [optimizer, grads]",
        );
        let (lowered, _, step) = compile(&text);
        let (_, step_peak) = measure(&lowered);
        println!(
            "ZeRO-{stage} gradient offload step (2 ranks together): measured {step_peak} predicted at most {} ({:+.4})",
            2 * step,
            step_peak as f64 / (2 * step) as f64 - 1.0
        );
        steps.push(step_peak);
    }
    assert!(
        steps[1] <= steps[0],
        "ZeRO 2's step holds {} B, ZeRO 0's {} B",
        steps[1],
        steps[0]
    );
}
