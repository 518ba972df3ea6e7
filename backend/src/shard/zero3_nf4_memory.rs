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

// The two-rank measurement of ZeRO 1/2 (`shard::tests_memory`), on QLoRA plans.
use crate::shard::tests_memory::{compile, measure};

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
