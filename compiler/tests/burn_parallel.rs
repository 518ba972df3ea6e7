//! Multi-GPU plans for rcoa's Burn executor: it trains data-parallel only (one
//! process per rank, ZeRO 0-2 exchanging gradients as one flat fp32 vector)
//! with ZeRO 0, 1, 2 and — behind `profile::BURN_RUNS_ZERO3` — 3, the optimizer
//! (and with ZeRO-3 the parameters) optionally on the host, so the search keeps
//! `auto` model-parallel degrees at 1 and ZeRO and offload within what the
//! executor runs, and the memory model counts the exchange's flat vectors.

use rcoa_compiler::profile::BURN_RUNS_ZERO3;

use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::spec::Spec;
use rcoa_compiler::Compilation;

fn spec(gpus: u64, target: &str, parallel: &str) -> Spec {
    let src = format!(
        "model \"llama-3.2-1b\"\nhardware {{ gpu = h100-80gb  gpus_per_node = {gpus} }}\n\
         train {{ seq_len = 1024  global_batch = 16 }}\nparallel {{ {parallel} }}\ntarget {target}\n"
    );
    resolved(&src)
}

/// `src` parsed and resolved.
fn resolved(src: &str) -> Spec {
    let file = rcoa_grammar::parse("t.plan", src).unwrap();
    resolve(&file, &ResolveContext::new("t.plan", src, ".")).unwrap()
}

/// `src` compiled.
fn compiled(src: &str) -> Result<Compilation, rcoa_compiler::CompileError> {
    rcoa_compiler::compile(&resolved(src))
}

/// `c` offloads nothing, and its decisions say why with `decision`.
fn kept_on_device(c: &Compilation, decision: &str) {
    let r = &c.lowered.resolved;
    assert!(r.offload.is_empty(), "{:?}", r.offload);
    assert!(
        c.explain.decisions.iter().any(|d| d.what == decision),
        "no decision `{decision}`"
    );
}

#[test]
fn burn_plans_stay_data_parallel_with_the_zero_stages_the_executor_runs() {
    let c = rcoa_compiler::compile(&spec(
        4,
        "burn",
        "zero = auto  tensor = auto  pipeline = auto",
    ))
    .unwrap();
    let r = &c.lowered.resolved;
    assert_eq!((r.data, r.tensor, r.pipeline, r.context), (4, 1, 1, 1));
    let stages = if BURN_RUNS_ZERO3 {
        "zero ∈ {0, 1, 2, 3}"
    } else {
        assert!(r.zero <= 2, "zero {}", r.zero);
        "zero ∈ {0, 1, 2}"
    };
    assert!(c.explain.decisions.iter().any(|d| d.what.contains(stages)));
    // The same plan for PyTorch engines may use any of them.
    let p = rcoa_compiler::compile(&spec(
        4,
        "pytorch",
        "zero = auto  tensor = auto  pipeline = auto",
    ))
    .unwrap();
    assert!(p.lowered.prediction.fits);
}

/// An 8B full fine-tune (`plans/llama-3.1-8b-full-4xa100-40gb.plan` for the
/// Burn executor): its fixed ZeRO-3 fits (or, without ZeRO-3 in the executor, is refused);
/// with `zero = auto` the search shards or moves the optimizer to the host.
#[test]
fn burn_search_shards_or_offloads_what_does_not_fit_replicated() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../plans/llama-3.1-8b-full-4xa100-40gb.plan"
    );
    let text = std::fs::read_to_string(path)
        .unwrap()
        .replace("target pytorch", "target burn");
    if BURN_RUNS_ZERO3 {
        let c = compiled(&text).unwrap();
        assert!(c.lowered.prediction.fits);
        assert_eq!(c.lowered.resolved.zero, 3);
        // Built one unit at a time, each sharded before the next is made: the start-up
        // holds a quarter of the model and one layer in fp32, not the 30 GiB model.
        let setup = c.report.phase_peaks["setup"];
        assert!(setup < c.report.peak_bytes, "{:?}", c.report.phase_peaks);
        assert!(setup < 8 << 30, "{setup}");
    } else {
        let e = compiled(&text).map(|_| ()).unwrap_err().to_string();
        assert!(
            e.contains("zero = 3 is not executed by the Burn executor"),
            "{e}"
        );
    }
    let c = compiled(&text.replace("zero = 3", "zero = auto")).unwrap();
    assert!(c.lowered.prediction.fits);
    let r = &c.lowered.resolved;
    assert!(BURN_RUNS_ZERO3 || r.zero <= 2, "zero {}", r.zero);
    assert!(r
        .offload
        .iter()
        .all(|o| o.what == rcoa_compiler::spec::OffloadWhat::Optimizer));
    assert!(r.zero > 0 || !r.offload.is_empty(), "{r:?}");
}

/// ZeRO-2 on the Burn executor: the flat gradient and this rank's reduced shard, made
/// after the backward from the gradients as they leave (`backend/src/shard`): a point of
/// the timeline between the backward and the step, not a buffer of the whole step. The
/// default precision is bf16 with an fp32 master: a rank keeps the master of its shard
/// only, charged with the optimizer state it is sharded with (not the whole fp32 model);
/// fp32 weights keep an fp32 copy of the shard beside them for the whole step.
#[test]
fn burn_zero2_counts_the_flat_vector_and_the_shards() {
    let two = rcoa_compiler::compile(&spec(2, "burn", "zero = 2")).unwrap();
    assert_eq!(two.lowered.resolved.zero, 2);
    let trainable = two.report.params_trainable;
    let flat = trainable * 4;
    let shard = trainable.div_ceil(2) * 4;
    let breakdown = &two.lowered.prediction.breakdown;
    assert_eq!(breakdown.get("communication").copied().unwrap_or(0), 0);
    // At the exchange the gradients are the flat vector and the ring's received block.
    assert_eq!(exchange_grads(&two), flat + shard);
    // The peak is the forward's; the exchange has no activations beside it.
    assert!(two.report.peak_bytes > exchange_bytes(&two));
    // AdamW's two fp32 moments and the fp32 master, each a shard: 3 x 1/2 of 4 bytes
    // per value (within the allocator's rounding per tensor).
    let opt = breakdown["optimizer"] as f64;
    let want = (3 * shard) as f64;
    assert!((opt / want - 1.0).abs() < 1e-3, "{opt} vs {want}");
    // ZeRO-1 reduce-scatters like ZeRO-2 (it reads only its shard of the mean): the flat
    // vector and the ring's received block, not a second full vector.
    let zero1 = rcoa_compiler::compile(&spec(2, "burn", "zero = 1")).unwrap();
    assert_eq!(exchange_grads(&zero1), flat + shard);
    // The setup keeps the 16-bit weights, the master shard and one unit in fp32, never
    // the whole fp32 model beside its 16-bit copy (1.5 x `flat`).
    let setup = two.report.phase_peaks["setup"];
    let weights = flat / 2;
    assert!(setup >= weights + shard, "setup {setup}");
    assert!(
        setup < flat + weights,
        "setup {setup} vs the fp32 model and its 16-bit copy"
    );
    let fp32 = {
        let src = "model \"llama-3.2-1b\"\nhardware { gpu = h100-80gb  gpus_per_node = 2 }\n\
                   precision fp32\ntrain { seq_len = 1024  global_batch = 16 }\n\
                   parallel { zero = 2 }\ntarget burn\n";
        compiled(src).unwrap()
    };
    assert_eq!(fp32.lowered.prediction.breakdown["communication"], shard);
    assert_eq!(exchange_grads(&fp32), flat + shard);
    // The pool keeps the exchange's pages: the reserve holds them beside the peak.
    assert!(two.report.reserve_bytes >= flat + shard);
}

/// The timeline sample of the Burn executor's gradient exchange.
fn exchange(c: &Compilation) -> &rcoa_compiler::memory::Sample {
    c.report
        .timeline
        .iter()
        .find(|s| s.op == rcoa_compiler::memory::EXCHANGE_OP)
        .expect("a gradient exchange in the timeline")
}

fn exchange_bytes(c: &Compilation) -> u64 {
    exchange(c).bytes
}

fn exchange_grads(c: &Compilation) -> u64 {
    exchange(c).by_category[rcoa_compiler::memory::Category::Grads as usize]
}

/// Data parallelism without ZeRO on the Burn executor: every gradient concatenated into
/// one flat fp32 vector and all-reduced after the backward, the vector and its reduced
/// copy beside the gradients; one rank exchanges nothing.
#[test]
fn burn_data_parallel_counts_the_flat_gradient_exchange() {
    let one = rcoa_compiler::compile(&spec(1, "burn", "")).unwrap();
    let two = rcoa_compiler::compile(&spec(2, "burn", "")).unwrap();
    assert_eq!(two.lowered.resolved.data, 2);
    let trainable = two.report.params_trainable;
    let grads = exchange_grads(&two);
    // The gradients (fp32: the master's, `MergeGrads`) stay beside the two fp32 vectors.
    assert_eq!(grads, 2 * trainable * 4 + 4 * trainable, "{grads}");
    assert!(two.lowered.prediction.peak_bytes >= exchange_bytes(&two));
    assert!(!one
        .report
        .timeline
        .iter()
        .any(|s| s.op == rcoa_compiler::memory::EXCHANGE_OP));
}

/// The start-up of an unsharded 16-bit plan on the Burn executor, from the shapes alone:
/// each unit is made directly in bf16 (one tensor's fp32 draw before its cast on top),
/// or, with an fp32 master, in fp32, the bf16 working copy cast from it at the end.
/// (The CPU runs 16-bit plans in fp32, so `backend/src/setup.rs` measures the fp32 case.)
#[test]
fn burn_setup_of_an_unsharded_16_bit_model_is_its_storage_plus_one_tensor() {
    let src = |precision: &str| {
        format!(
            "model {{\n  arch = decoder\n  layers = 2\n  hidden = 256\n  heads = 4\n  ffn = 1024\n  \
             mlp = swiglu\n  norm = rmsnorm\n  tie_embeddings = false\n  vocab = 4096\n  max_positions = 64\n}}\n\
             hardware {{ gpu = h100-80gb }}\n{precision}\n\
             train {{ seq_len = 16  global_batch = 2  micro_batch = 2 }}\nfit {{ checkpoint = none }}\ntarget burn\n"
        )
    };
    let setup = |text: &str| compiled(text).unwrap().report.phase_peaks["setup"];
    // Every tensor is a multiple of the 512-byte allocation unit here.
    let (d, f, v) = (256u64, 1024u64, 4096u64);
    let layer = 4 * d * d + 3 * d * f + 2 * d;
    let values = 2 * layer + 2 * v * d + d;
    let largest = v * d;
    assert_eq!(
        setup(&src(
            "precision { params = bf16  compute = bf16  master = none }"
        )),
        2 * values + 4 * largest
    );
    assert_eq!(setup(&src("precision bf16")), 4 * values + 2 * values);
}

/// QLoRA's NF4 base is sharded by the Burn executor's ZeRO-3 (FSDP-QLoRA) but never put
/// in host memory: a search for `target burn` may pick ZeRO-3, which then charges each
/// rank a shard of the base at rest and the gathered layer's base while it runs; it
/// never offloads the parameters, and a plan that fixes parameter offload is refused.
#[test]
fn burn_qlora_shards_its_base_but_never_offloads_it() {
    let qlora = |parallel: &str, fit: &str| {
        let src = format!(
            "model \"llama-3.2-1b\"\nadapter qlora {{ rank = 16  alpha = 32  targets = [q, v] }}\n\
             hardware {{ gpu = rtx4090-24gb  gpus_per_node = 2 }}\nprecision bf16\n\
             train {{ seq_len = 1024  global_batch = 16 }}\nparallel {{ {parallel} }}\n\
             fit {{ {fit} }}\ntarget burn\n"
        );
        compiled(&src)
    };
    let c = qlora(
        "zero = auto",
        "offload = [optimizer, params]  checkpoint = auto",
    )
    .unwrap();
    assert!(
        !c.lowered
            .resolved
            .offload
            .iter()
            .any(|o| o.what == rcoa_compiler::spec::OffloadWhat::Params),
        "{:?}",
        c.lowered.resolved.offload
    );
    // `auto` does not pick ZeRO-3 for QLoRA while its charge is unchecked on a GPU.
    assert!(c.lowered.resolved.zero <= 2);
    assert!(c
        .explain
        .decisions
        .iter()
        .any(|d| d.what == "zero = 3 not chosen for QLoRA"));
    // A plan that writes ZeRO-3 gets it over the two ranks (it was refused while the
    // executor kept the base whole on every rank), with the caveat in --explain.
    let c = qlora("data = 2  zero = 3", "checkpoint = auto").unwrap();
    assert_eq!(c.lowered.resolved.zero, 3);
    assert!(c
        .explain
        .decisions
        .iter()
        .any(|d| d.what == "zero = 3 with QLoRA (unchecked)"));
    let e = qlora("zero = auto", "must_offload = [params]  checkpoint = auto")
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not execute QLoRA"), "{e}");
}

/// 8-bit Adam, Adafactor and Adam-mini are stepped per parameter by the Burn executor (8-bit
/// moments quantized within each parameter, a second moment factored per matrix or kept per
/// head and neuron), never by ZeRO's
/// flat optimizer: a search for `target burn` keeps to `zero = 0` and offloads nothing but
/// activations, and a plan that fixes more is refused, as `rcoa run` would refuse it. The
/// same plan for PyTorch engines may shard them.
#[test]
fn burn_per_parameter_optimizers_stay_unsharded_and_on_the_device() {
    for optimizer in ["adam8bit", "adafactor", "adam-mini"] {
        let plan = |target: &str, parallel: &str, fit: &str| {
            let src = format!(
            "model \"llama-3.2-1b\"\nhardware {{ gpu = a100-40gb  gpus_per_node = 4 }}\nprecision bf16\n\
             optimizer {optimizer}\ntrain {{ seq_len = 1024  global_batch = 16 }}\nparallel {{ {parallel} }}\n\
             fit {{ {fit} }}\ntarget {target}\n"
        );
            compiled(&src)
        };
        let c = plan(
            "burn",
            "zero = auto",
            "offload = [optimizer, params, grads]  checkpoint = auto",
        )
        .unwrap();
        assert_eq!(c.lowered.resolved.zero, 0);
        kept_on_device(&c, &format!("zero = 0 for {optimizer}"));
        let e = plan("burn", "zero = 2", "checkpoint = auto")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains(&format!("`optimizer {optimizer}` with zero = [2]")),
            "{e}"
        );
        let e = plan(
            "burn",
            "zero = auto",
            "must_offload = [optimizer]  checkpoint = auto",
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(&format!("`optimizer {optimizer}` with the optimizer")),
            "{e}"
        );
        // Activations may still go to the host.
        assert!(plan(
            "burn",
            "zero = auto",
            "must_offload = [activations]  checkpoint = full"
        )
        .is_ok());
        // The executor's flat optimizer runs the others under ZeRO; PyTorch engines shard these.
        let c = plan("pytorch", "zero = 2", "checkpoint = auto").unwrap();
        assert_eq!(c.lowered.resolved.zero, 2);
    }
}

/// The optimizer step in the backward under `target burn` (`backend/src/in_backward.rs`):
/// the optimizer on the device (the search drops optimizer, parameter and gradient offload;
/// a plan that requires them is refused), ZeRO 0 over data-parallel ranks, no fp16; and it
/// holds less than the step after the backward, which holds every gradient at once.
#[test]
fn burn_steps_in_the_backward_with_the_optimizer_on_the_device() {
    let plan = |gpus: u64, precision: &str, fit: &str, in_backward: bool| {
        compiled(&format!(
            "model \"llama-3.2-1b\"\nhardware {{ gpu = h100-80gb  gpus_per_node = {gpus} }}\n\
             precision {precision}\noptimizer adamw {{ in_backward = {in_backward} }}\n\
             train {{ seq_len = 1024  global_batch = 8 }}\nfit {{ {fit} }}\ntarget burn\n"
        ))
    };
    let c = plan(
        1,
        "bf16",
        "offload = [optimizer, params, grads]  checkpoint = auto",
        true,
    )
    .unwrap();
    assert!(c.lowered.resolved.optimizer_in_backward);
    assert_eq!(c.lowered.resolved.grad_accum, 1);
    kept_on_device(
        &c,
        "optimizer, params and grads offload not used for the step in the backward",
    );
    let after = plan(1, "bf16", "checkpoint = full", false).unwrap();
    let during = plan(1, "bf16", "checkpoint = full", true).unwrap();
    let (a, d) = (
        after.lowered.prediction.peak_bytes,
        during.lowered.prediction.peak_bytes,
    );
    // The bf16 gradients of 1.24 B values (2.47 GB), less what a unit keeps. (The fp32
    // casts the step makes of them, one parameter at a time, are gone when the executor
    // samples after the step: 2026-11-30h on an H200, `burn_h100.rs`.)
    assert!(a > d + (2 << 30), "{a} vs {d}");

    let e = |r: Result<_, rcoa_compiler::CompileError>| match r {
        Err(e) => e.to_string(),
        Ok(_) => panic!("not refused"),
    };
    // Data parallelism: each unit's gradients are all-reduced before it steps, ZeRO stays 0
    // (`memory::tests_setups` checks where the unit's exchange is charged).
    let two = plan(2, "bf16", "checkpoint = full", true).unwrap();
    let r = &two.lowered.resolved;
    assert_eq!((r.data, r.zero, r.micro_batch), (2, 0, 4));
    assert!(two.lowered.prediction.fits);
    // Between the units' exchanges nothing of them lives on: between segments a rank holds
    // what one GPU with its batch holds (no DDP bucket, which was 2.30 GiB here).
    let one_rank = compiled(
        "model \"llama-3.2-1b\"\nhardware { gpu = h100-80gb }\nprecision bf16\n\
         optimizer adamw { in_backward = true }\ntrain { seq_len = 1024  global_batch = 4 }\n\
         fit { checkpoint = full }\ntarget burn\n",
    )
    .unwrap();
    let (a, b) = (
        two.lowered.prediction.peak_bytes,
        one_rank.lowered.prediction.peak_bytes,
    );
    assert!(a <= b + (64 << 20), "{a} vs {b}");
    let fp16 = e(plan(1, "fp16", "checkpoint = auto", true));
    assert!(fp16.contains("with fp16"), "{fp16}");
    let host = e(plan(
        1,
        "bf16",
        "must_offload = [optimizer]  checkpoint = auto",
        true,
    ));
    assert!(
        host.contains("the optimizer step in the backward (`optimizer.in_backward = true`) with the optimizer"),
        "{host}"
    );
    // Checkpointed activations may still go to the host.
    assert!(plan(
        1,
        "bf16",
        "must_offload = [activations]  checkpoint = full",
        true
    )
    .is_ok());
}

/// 16-bit weights without `master = fp32` under the Burn executor's flat optimizer: its
/// moments are fp32 whatever the weights' dtype, and ZeRO 1/2 keeps an fp32 master shard
/// (16-bit weights cannot give it back), where ZeRO-3's weight shard is the master itself.
/// Charged as bf16 moments (torch's `zeros_like(p)`), the prediction was 8 bytes a value
/// per rank short under ZeRO 1/2.
#[test]
fn burn_flat_optimizer_keeps_fp32_moments_and_a_master_shard_of_16_bit_weights() {
    let optimizer = |zero: u8| {
        let c = compiled(&format!(
            "model \"llama-3.2-1b\"\nhardware {{ gpu = h100-80gb  gpus_per_node = 2 }}\n\
             precision {{ params = bf16  compute = bf16  master = none }}\n\
             train {{ seq_len = 1024  global_batch = 8  micro_batch = 4 }}\nparallel {{ zero = {zero} }}\n\
             fit {{ checkpoint = full }}\ntarget burn\n"
        ))
        .unwrap();
        c.lowered.prediction.breakdown["optimizer"] as f64
    };
    // Zero 0: Burn's AdamW over each bf16 parameter, two bf16 moments (4 bytes a value).
    let whole = optimizer(0);
    // ZeRO 1/2 over two ranks: (2 × 4 + 4) bytes a value, halved.
    for zero in [1, 2] {
        let r = optimizer(zero) / whole;
        assert!((r - 1.5).abs() < 1e-3, "zero {zero}: {r}");
    }
    // ZeRO-3: two fp32 moments, halved; no master beside the weight shard.
    let r = optimizer(3) / whole;
    assert!((r - 1.0).abs() < 1e-3, "zero 3: {r}");
}
