//! What each memory pool configuration costs per allocation, against CubeCL's own pools in
//! the same run: a run's allocations (the memory model's trace of three steps of a
//! `backend/bench/` plan) replayed through CubeCL's own memory management on the CPU, in
//! an optimised build. `expandable` puts every tensor above 1 MiB in one page, whose list
//! of slices CubeCL scans (and coalesces) on every allocation; this says what that costs.
//!
//! `cargo bench -p rcoa-backend --features pool-replay --bench pool`

use rcoa_backend::pool::replay::{plan_trace, replay_choice};
use rcoa_backend::pool::PoolChoice;
use rcoa_compiler::memory::trace::Event;
use std::path::PathBuf;
use std::time::{Duration, Instant};

const PLANS: &[&str] = &[
    "llama350m_eager.plan",
    "llama1b_pool.plan",
    "llama350m_gc.plan",
];

/// The fastest of at least three replays and at least `budget` of them in all.
fn fastest(budget: Duration, mut replay: impl FnMut()) -> Duration {
    let start = Instant::now();
    let mut best = Duration::MAX;
    let mut runs = 0;
    while runs < 3 || start.elapsed() < budget {
        let t = Instant::now();
        replay();
        best = best.min(t.elapsed());
        runs += 1;
    }
    best
}

fn main() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench");
    println!("| plan | allocations | pool | µs per allocation | × cubecl | reserved ÷ in use |");
    println!("| --- | ---: | --- | ---: | ---: | ---: |");
    for plan in PLANS {
        let source = std::fs::read_to_string(dir.join(plan)).expect("a bench plan");
        let trace = plan_trace(plan, &source, &dir, 3).expect("a trace");
        let allocations = trace
            .events
            .iter()
            .filter(|e| matches!(e, Event::Alloc { .. }))
            .count();
        let mut cubecl = None;
        // CubeCL's own pools first: the others' ratios are to them.
        let others = PoolChoice::ALL
            .into_iter()
            .filter(|&p| p != PoolChoice::Cubecl);
        for pool in std::iter::once(PoolChoice::Cubecl).chain(others) {
            let mut factor = 0.0;
            let t = fastest(Duration::from_secs(1), || {
                factor = replay_choice(&trace, pool, false).factor();
            });
            let per = t.as_secs_f64() * 1e6 / allocations as f64;
            let base = *cubecl.get_or_insert(per);
            println!(
                "| {plan} | {allocations} | {} | {per:.2} | {:.2} | {factor:.3} |",
                pool.as_str(),
                per / base
            );
        }
    }
}
