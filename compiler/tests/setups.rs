//! The setups of `docs/language.md` that only some engines run, compiled from plan
//! text: what the compiler decides with them, and that `target burn` refuses each
//! before any search (`rcoa_compiler::executed`).

use rcoa_compiler::compile::CompileError;
use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::spec::{OffloadWhat, Spec};
use std::path::PathBuf;

const BASE: &str = "model \"tiny-decoder\"\nhardware { gpu = h100-80gb  gpus_per_node = 4 }\n\
                    train { seq_len = 64  global_batch = 16 }\n";

fn spec(extra: &str) -> Spec {
    spec_of(&format!("{BASE}{extra}\n"))
}

fn spec_of(src: &str) -> Spec {
    let src = src.to_string();
    let file = rcoa_grammar::parse("t.plan", &src).unwrap();
    let ctx = ResolveContext::new("t.plan", src.clone(), PathBuf::new());
    resolve(&file, &ctx).unwrap_or_else(|e| panic!("{:?}\n{src}", e.errors()))
}

#[test]
fn burn_refuses_every_setup_rcoa_run_does_not_execute() {
    let cases = [
        (
            "model \"tiny-decoder\" { mlp = squared_relu }",
            "squared-ReLU",
        ),
        (
            "model \"tiny-decoder\" { layers = 4 }\nparallel { pipeline = 2  virtual_stages = 2 }",
            "virtual_stages = 2",
        ),
        (
            "precision fp16\noptimizer adamw { in_backward = true }",
            "in_backward = true`) with fp16",
        ),
        ("optimizer adamw { impl = paged }", "impl = paged"),
        ("fit { checkpoint = selective_op }", "selective_op"),
    ];
    for (extra, names) in cases {
        // A model override replaces the preset line.
        let plan = if extra.starts_with("model") {
            BASE.replace("model \"tiny-decoder\"", extra)
        } else {
            format!("{BASE}{extra}\n")
        };
        let file = rcoa_grammar::parse("t.plan", &plan).unwrap();
        let ctx = ResolveContext::new("t.plan", plan.clone(), PathBuf::new());
        let s = resolve(&file, &ctx).unwrap_or_else(|e| panic!("{:?}\n{plan}", e.errors()));
        match rcoa_compiler::compile(&s) {
            Err(CompileError::NotExecuted { what, help }) => {
                assert!(what.contains("`rcoa run` does not execute"), "{what}");
                assert!(what.contains(names), "{what} should name {names}");
                assert!(help.contains("target pytorch"), "{help}");
            }
            other => panic!("{extra}: expected a refusal, got {:?}", other.map(|_| ())),
        }
        // The same plan for PyTorch engines compiles.
        let mut p = s.clone();
        p.target = rcoa_compiler::spec::Target::Pytorch;
        if let Err(e) = rcoa_compiler::compile(&p) {
            panic!("{extra} with target pytorch: {e}");
        }
    }
}

/// `target burn` offloads the gradients beside the optimizer only (its host
/// accumulator is what the host optimizer steps from): alone they are an
/// inconsistency that names the fix; with the optimizer they are planned.
#[test]
fn burn_offloads_gradients_beside_the_optimizer_only() {
    match rcoa_compiler::compile(&spec("fit { must_offload = [grads] }")) {
        Err(CompileError::Inconsistent { what, help }) => {
            assert!(what.contains("offload the optimizer with them"), "{what}");
            assert!(help.contains("[optimizer, grads]"), "{help}");
        }
        other => panic!("expected an inconsistency, got {:?}", other.map(|_| ())),
    }
    let c = rcoa_compiler::compile(&spec("fit { must_offload = [optimizer, grads] }")).unwrap();
    assert_eq!(
        c.lowered.resolved.offload_names(),
        ["optimizer:cpu", "grads:cpu"]
    );
    let r = c.lowered.residency();
    assert_eq!(r.grad_accumulator, rcoa_compiler::lowered::Place::Host);
    assert_eq!(r.prefetch_units, 0, "read in place: nothing to prefetch");
    // Allowed rather than required: the search never takes the gradients alone.
    let c = rcoa_compiler::compile(&spec("fit { offload = [grads] }")).unwrap();
    assert!(c.lowered.resolved.offload.is_empty());
}

#[test]
fn a_required_offload_is_in_the_chosen_plan() {
    let may =
        rcoa_compiler::compile(&spec("fit { offload = [optimizer] }\ntarget pytorch")).unwrap();
    assert!(
        may.lowered.resolved.offload.is_empty(),
        "fits without: not used"
    );
    let must = rcoa_compiler::compile(&spec("fit { must_offload = [optimizer] }\ntarget pytorch"))
        .unwrap();
    let whats: Vec<OffloadWhat> = must
        .lowered
        .resolved
        .offload
        .iter()
        .map(|o| o.what)
        .collect();
    assert_eq!(whats, vec![OffloadWhat::Optimizer]);
    assert!(must
        .explain
        .decisions
        .iter()
        .any(|d| d.what.contains("offload ⊇ [optimizer:cpu]")));
    // The Burn executor runs an offloaded optimizer: required, it is used there too.
    let burn = rcoa_compiler::compile(&spec("fit { must_offload = [optimizer] }")).unwrap();
    assert_eq!(burn.lowered.resolved.offload.len(), 1);
    // DeepSpeed offloads parameters under ZeRO-3 only.
    let e = rcoa_compiler::compile(&spec(
        "parallel { zero = 2 }\nfit { must_offload = [params] }\ntarget pytorch",
    ))
    .unwrap_err();
    assert!(e.to_string().contains("needs ZeRO-3"), "{e}");
    let z3 = rcoa_compiler::compile(&spec(
        "parallel { zero = 3 }\nfit { must_offload = [params] }\ntarget pytorch",
    ))
    .unwrap();
    assert!(z3
        .lowered
        .resolved
        .offload
        .iter()
        .any(|o| o.what == OffloadWhat::Params));
}

/// `--explain` names each setup with what the memory model does with it.
#[test]
fn explain_names_each_setup() {
    let src = BASE.replace(
        "model \"tiny-decoder\"",
        "model \"tiny-decoder\" { layers = 4 }",
    )
        + "parallel { pipeline = 2  virtual_stages = 2 }\noptimizer adamw { impl = paged }\n\
           fit { checkpoint = selective_op }\ntarget pytorch\n";
    let c = rcoa_compiler::compile(&spec_of(&src)).unwrap();
    let text = rcoa_compiler::explain::render_text(&c);
    for needle in [
        "virtual_stages = 2: Megatron's interleaved 1F1B",
        "2 model chunks of 1 layers",
        "optimizer.impl = paged",
        "checkpoint = selective_op",
        "paged  ",
    ] {
        assert!(text.contains(needle), "--explain lacks {needle:?}:\n{text}");
    }
    let json = rcoa_compiler::explain::to_json(&c);
    assert!(json["memory"]["paged_bytes"].as_u64().unwrap() > 0);
    assert_eq!(json["resolved"]["checkpoint"], "selective_op");
}

/// `rcoa run --lowered` takes plans compiled for any engine: what the executor does not
/// build is refused from the lowered plan too.
#[test]
fn lowered_plans_for_other_engines_are_checked() {
    use rcoa_compiler::executed::check_lowered;
    let plain = rcoa_compiler::compile(&spec("")).unwrap();
    assert_eq!(check_lowered(&plain.lowered), Ok(()));
    // Biases on any projections are built, for either norm.
    for model in [
        "model \"tiny-decoder\" { bias = true }",
        "model \"tiny-decoder\" { bias = qkv }",
        "model \"tiny-decoder\" { norm = layernorm bias = false }",
    ] {
        let src = BASE.replace("model \"tiny-decoder\"", model);
        let c = rcoa_compiler::compile(&spec_of(&src)).unwrap_or_else(|e| panic!("{model}: {e}"));
        assert_eq!(check_lowered(&c.lowered), Ok(()), "{model}");
    }
    for (extra, names) in [
        (
            "model \"tiny-decoder\" { mlp = squared_relu }",
            "squared-ReLU",
        ),
        (
            "model \"tiny-decoder\"\noptimizer adamw { impl = paged }",
            "paged",
        ),
        (
            "model \"tiny-decoder\"\nfit { checkpoint = selective_op }",
            "selective_op",
        ),
    ] {
        let src = BASE.replace("model \"tiny-decoder\"", extra) + "target pytorch\n";
        let c = rcoa_compiler::compile(&spec_of(&src)).unwrap();
        let e = check_lowered(&c.lowered).unwrap_err();
        assert!(e.contains(names) && e.contains("`target pytorch`"), "{e}");
    }
}

/// The step in the backward: one backward per step, and `--explain` prices the saving.
#[test]
fn optimizer_in_backward_compiles_without_accumulation() {
    let src = BASE.replace(
        "train { seq_len = 64  global_batch = 16 }",
        "train { seq_len = 64  global_batch = 16 }\noptimizer adamw { in_backward = true }\ntarget pytorch",
    );
    let c = rcoa_compiler::compile(&spec_of(&src)).unwrap();
    assert_eq!(c.lowered.resolved.grad_accum, 1);
    let d = c
        .explain
        .decisions
        .iter()
        .find(|d| d.what == "optimizer step in the backward")
        .expect("priced in --explain");
    assert!(d.why.contains("peak −"), "{}", d.why);
}
