//! Multi-GPU plans for rcoa's Burn executor: it trains data-parallel only (one
//! process per rank, gradients all-reduced as one flat fp32 vector), so the
//! search keeps `auto` model-parallel degrees at 1 and ZeRO at 0, and the
//! memory model counts the exchange's flat vectors.

use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::spec::Spec;

fn spec(gpus: u64, target: &str, parallel: &str) -> Spec {
    let src = format!(
        "model \"llama-3.2-1b\"\nhardware {{ gpu = h100-80gb  gpus_per_node = {gpus} }}\n\
         train {{ seq_len = 1024  global_batch = 16 }}\nparallel {{ {parallel} }}\ntarget {target}\n"
    );
    let file = rcoa_grammar::parse("t.plan", &src).unwrap();
    resolve(&file, &ResolveContext::new("t.plan", src.as_str(), ".")).unwrap()
}

#[test]
fn burn_plans_stay_data_parallel_without_zero() {
    let c = rcoa_compiler::compile(&spec(
        4,
        "burn",
        "zero = auto  tensor = auto  pipeline = auto",
    ))
    .unwrap();
    let r = &c.lowered.resolved;
    assert_eq!(
        (r.data, r.tensor, r.pipeline, r.context, r.zero),
        (4, 1, 1, 1, 0)
    );
    assert!(c
        .explain
        .decisions
        .iter()
        .any(|d| d.what.contains("zero = 0")));
    // The same plan for PyTorch engines may use any of them.
    let p = rcoa_compiler::compile(&spec(
        4,
        "pytorch",
        "zero = auto  tensor = auto  pipeline = auto",
    ))
    .unwrap();
    assert!(p.lowered.prediction.fits);
}

#[test]
fn burn_data_parallel_counts_the_flat_gradient_exchange() {
    let one = rcoa_compiler::compile(&spec(1, "burn", "")).unwrap();
    let two = rcoa_compiler::compile(&spec(2, "burn", "")).unwrap();
    assert_eq!(two.lowered.resolved.data, 2);
    let trainable = two.report.params_trainable;
    let comm = two
        .lowered
        .prediction
        .breakdown
        .get("communication")
        .copied()
        .unwrap_or(0);
    assert_eq!(
        comm,
        2 * trainable * 4,
        "the flat fp32 vector and its reduced copy"
    );
    // Half the micro-batch per rank can lower activations, but never below the exchange.
    assert!(two.lowered.prediction.peak_bytes >= comm);
    assert!(
        one.lowered
            .prediction
            .breakdown
            .get("communication")
            .copied()
            .unwrap_or(0)
            == 0
    );
}
