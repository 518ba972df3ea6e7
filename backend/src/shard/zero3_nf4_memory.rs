//! QLoRA under ZeRO-3 on two ranks (threads of one process) against ZeRO-2
//! and the compiler's `burn` profile, measured with the counting allocator
//! in a process of its own: each rank's start-up peak and the two ranks'
//! highest live bytes together through a steady-state step.
//!
//! What it shows on the CPU (printed): a ZeRO-3 rank's start-up holds less
//! than a ZeRO-2 rank's (the base is cut a layer at a time, so no rank keeps
//! all of it), which is asserted. Neither stage's QLoRA peaks are within a
//! few percent of the profile on the CPU (ZeRO-2's, unchanged by the
//! sharding, were already about +50% at the step): the profile models
//! CubeCL, and burn-ndarray's dequantization and copies hold more; the
//! ZeRO-3 step also holds the gathered words beside their read-back while a
//! layer's bases are rebuilt. Not asserted; see the report in `docs/`.

use crate::memory::{AllocProbe, MemoryProbe};
use crate::train::{Trainer, TrainerConfig};
use crate::RunOptions;
use std::sync::{Arc, Barrier, Mutex};

type Cpu = burn::backend::Autodiff<burn::backend::NdArray<f32>>;
type Inner = burn::backend::NdArray<f32>;

const CHILD: &str = "RCOA_ZERO3_NF4_MEASURE_CHILD";

/// Layers whose NF4 bases (1 M values, about 0.5 MiB each) outweigh the
/// embedding and the head (0.25 MiB each in fp32).
fn plan(zero: u8) -> String {
    format!(
        "model {{\n  arch = decoder\n  layers = 2\n  hidden = 256\n  heads = 4\n  ffn = 1024\n  \
         mlp = swiglu\n  norm = rmsnorm\n  tie_embeddings = false\n  vocab = 256\n  max_positions = 64\n}}\n\
         adapter qlora {{ rank = 8  alpha = 16  targets = [q, k, v, o, gate, up, down] }}\n\
         precision fp32\noptimizer adamw {{ lr = 1e-3 }}\n\
         train {{ seq_len = 16  global_batch = 4  micro_batch = 2  grad_accum = 1 }}\n\
         fit {{ checkpoint = none }}\n\
         hardware {{ gpu = h100-80gb  gpus_per_node = 2 }}\nparallel {{ data = 2  zero = {zero} }}\n\
         target burn\n"
    )
}

fn compile(text: &str) -> (rcoa_compiler::lowered::LoweredPlan, u64, u64) {
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

struct Quiet;

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

/// Each rank's start-up peak (one build at a time) and both ranks' highest
/// live bytes together through the second step.
fn measure(plan: &rcoa_compiler::lowered::LoweredPlan) -> (Vec<u64>, u64) {
    let turn = Arc::new(Mutex::new(()));
    let (built, warm, measured) = (
        Arc::new(Barrier::new(2)),
        Arc::new(Barrier::new(2)),
        Arc::new(Barrier::new(2)),
    );
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
                    use crate::distributed::{Collective, Distributed, Timeouts};
                    let d = Distributed {
                        nodes: 1,
                        node_rank: 0,
                        devices: 2,
                        local,
                        network: None,
                        timeouts: Timeouts::uniform(std::time::Duration::from_secs(120)),
                    };
                    let c = Collective::<Inner>::register(&d, &Default::default()).unwrap();
                    let progress = c.progress();
                    let opts = RunOptions {
                        steps: 2,
                        seed: 5,
                        distributed: Some(d),
                        ..Default::default()
                    };
                    let batcher = crate::batcher(&plan, &opts).unwrap();
                    let (mut trainer, setup) = {
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
    let mut peak = 0;
    for r in ranks {
        let (s, p) = r.join().unwrap();
        setups.push(s);
        peak = peak.max(p);
    }
    (setups, peak)
}

#[test]
fn zero3_qlora_holds_what_the_burn_profile_charges() {
    crate::testing::run_ignored_in_child(
        "shard::zero3::nf4_memory::zero3_qlora_measured_in_child",
        CHILD,
    );
}

#[test]
#[ignore = "run in its own process by zero3_qlora_holds_what_the_burn_profile_charges"]
fn zero3_qlora_measured_in_child() {
    assert!(std::env::var_os(CHILD).is_some(), "run by its parent test");
    let (plan3, setup3, step3) = compile(&plan(3));
    assert_eq!(plan3.resolved.zero, 3);
    measure(&plan3);
    let (setups, peak) = measure(&plan3);
    for (i, s) in setups.iter().enumerate() {
        let err = *s as f64 / setup3 as f64 - 1.0;
        println!("ZeRO-3 QLoRA rank {i} setup: measured {s} predicted {setup3} ({err:+.4})");
    }
    let err = peak as f64 / (2 * step3) as f64 - 1.0;
    println!("ZeRO-3 QLoRA two ranks' step: measured {peak} predicted 2 x {step3} ({err:+.4})");
    let (plan2, setup2, step2) = compile(&plan(2));
    let (s2, p2) = measure(&plan2);
    println!("ZeRO-2 QLoRA: setup {s2:?} predicted {setup2}; step {p2} predicted 2 x {step2}");
    for (a, b) in setups.iter().zip(&s2) {
        assert!(a < b, "a ZeRO-3 rank's start-up {a} vs ZeRO-2's {b}");
    }
    assert!(setup3 < setup2, "predicted {setup3} vs {setup2}");
}
