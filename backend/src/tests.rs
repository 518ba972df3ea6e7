//! Executor tests on the CPU backend, with tiny models so CI stays fast.

use super::*;
use crate::memory::RssProbe;
use crate::testing::{tiny_encoder_plan, tiny_plan};
use burn::optim::GradientsParams;
use burn::tensor::ElementConversion;
use rcoa_compiler::spec::{AdapterKind, AdapterSpec, Dtype, OptimizerKind, Proj};

mod in_backward;
mod loss_scale;
mod packing;
mod partial_rope;
mod qk_norm;

type Cpu = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

/// The ndarray backend's RNG is global to the process: tests running in
/// parallel would draw from it between a reseed and a dropout mask. Every
/// test that trains holds this lock.
static RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// As in the `rcoa` binary: the CPU probe counts live heap bytes.
#[global_allocator]
static ALLOC: crate::memory::TrackingAlloc = crate::memory::TrackingAlloc;

pub(crate) fn serial() -> std::sync::MutexGuard<'static, ()> {
    RNG.lock().unwrap_or_else(|e| e.into_inner())
}

fn opts(steps: u64) -> RunOptions {
    RunOptions {
        steps,
        seed: 11,
        data: None,
        tokenizer: None,
        eval: None,
        eval_every: None,
        save: None,
        save_every: None,
        hf_save: Default::default(),
        resume: None,
        distributed: None,
    }
}

fn trainer(plan: &LoweredPlan) -> Trainer<Cpu> {
    crate::testing::trainer(plan, &opts(1), 11).unwrap()
}

fn max_rel_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "same number of parameter gradients");
    let mut worst = 0f32;
    for (x, y) in a.iter().zip(b) {
        assert_eq!(x.len(), y.len());
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        for (p, q) in x.iter().zip(y) {
            worst = worst.max((p - q).abs() / scale);
        }
    }
    worst
}

/// Segmented gradients (with the given layers recomputed) equal one graph's.
fn check_gradients(plan: &LoweredPlan) {
    let mut t = trainer(plan);
    let batch = t.batcher.batch(0, 0);
    let (ref_loss, ref_grads) = t.reference_grads(&batch, 0, 0);
    let reference = t.flatten(&ref_grads);
    assert!(!reference.is_empty());
    let n = plan.model.layers as usize;
    for pattern in [
        vec![false; n],
        vec![true; n],
        (0..n).map(|i| i % 2 == 0).collect(),
    ] {
        t.set_checkpointed(pattern.clone());
        let mut acc = GradientsParams::new();
        let mut probe = RssProbe::new();
        let loss = t
            .micro_step(&batch, 0, 0, 1.0, &mut acc, &mut probe)
            .into_scalar()
            .elem::<f64>();
        assert!((loss - ref_loss).abs() < 1e-5, "loss {loss} vs {ref_loss}");
        let got = t.flatten(&acc);
        let d = max_rel_diff(&got, &reference);
        assert!(
            d < 1e-4,
            "checkpoint pattern {pattern:?}: gradients differ by {d}"
        );
        // The checkpointed inputs through host memory (every one, the first
        // layer's too): the same bits come back, so the same gradients.
        t.set_inputs_on_host(vec![true; n]);
        let mut host = GradientsParams::new();
        let l = t
            .micro_step(&batch, 0, 0, 1.0, &mut host, &mut RssProbe::new())
            .into_scalar()
            .elem::<f64>();
        t.set_inputs_on_host(vec![false; n]);
        assert_eq!(l.to_bits(), loss.to_bits(), "pattern {pattern:?}");
        assert_eq!(
            t.flatten(&host),
            got,
            "pattern {pattern:?}: inputs on the host"
        );
    }
}

#[test]
fn checkpointed_gradients_equal_the_full_graph_decoder() {
    let _serial = serial();
    check_gradients(&tiny_plan());
}

#[test]
fn checkpointed_gradients_equal_with_lora_and_dropout() {
    let _serial = serial();
    let mut plan = tiny_plan();
    plan.model.layers = 3;
    plan.model.dropout = 0.1;
    plan.adapter = Some(AdapterSpec {
        kind: AdapterKind::Lora,
        rank: 4,
        alpha: 8.0,
        targets: vec![Proj::Q, Proj::V, Proj::Down],
        dropout: 0.05,
        base: Dtype::Fp32,
    });
    let t = trainer(&plan);
    let (all, trainable) = t.param_counts();
    // Only the adapters train: 3 layers × (q 32·4+4·32, v 32·4+4·16, down 64·4+4·32).
    assert_eq!(
        trainable,
        3 * ((32 * 4 + 4 * 32) + (32 * 4 + 4 * 16) + (64 * 4 + 4 * 32))
    );
    assert!(all > trainable);
    check_gradients(&plan);
}

#[test]
fn checkpointed_gradients_equal_the_full_graph_encoder() {
    let _serial = serial();
    check_gradients(&tiny_encoder_plan(Loss::MaskedLm));
    let mut p = tiny_encoder_plan(Loss::Contrastive);
    p.resolved.micro_batch = 4;
    check_gradients(&p);
}

fn losses(plan: &LoweredPlan, o: &RunOptions) -> Vec<f64> {
    let mut out = Vec::new();
    run_cpu(plan, o, &mut |e| {
        if let Event::Step(r) = e {
            out.push(r.loss)
        }
    })
    .unwrap();
    out
}

#[test]
fn loss_falls_and_memory_is_measured() {
    let _serial = serial();
    let mut plan = tiny_plan();
    plan.resolved.checkpoint_layers = vec![1];
    let mut seen = Vec::new();
    let s = run_cpu(&plan, &opts(12), &mut |e| {
        if let Event::Step(r) = e {
            seen.push(r.loss)
        }
    })
    .unwrap();
    assert_eq!(s.steps, 12);
    assert!(
        s.last_loss < s.first_loss * 0.9,
        "loss {} -> {}",
        s.first_loss,
        s.last_loss
    );
    assert!(seen.iter().all(|l| l.is_finite()));
    assert!(s.tokens_per_second > 0.0);
}

#[test]
fn resume_continues_the_same_loss_curve() {
    let _serial = serial();
    let mut lion = tiny_plan();
    lion.optimizer.kind = OptimizerKind::Lion;
    lion.optimizer.lr = 3e-4;
    lion.optimizer.weight_decay = 0.1;
    // Adafactor with a first moment: every part of its state (factors, vectors' second
    // moments, the first moment, the step count in ρ) goes through the checkpoint.
    let mut adafactor = tiny_plan();
    adafactor.optimizer.kind = OptimizerKind::Adafactor;
    adafactor.optimizer.betas = (0.9, 0.999);
    adafactor.optimizer.lr = 1e-2;
    // Adam-mini: the blocks written before the first step come back with the moments.
    let mut adam_mini = tiny_plan();
    adam_mini.optimizer.kind = OptimizerKind::AdamMini;
    adam_mini.optimizer.weight_decay = 0.1;
    for plan in [tiny_plan(), lion, adafactor, adam_mini] {
        resumes_the_same_loss_curve(&plan);
    }
}

fn resumes_the_same_loss_curve(plan: &LoweredPlan) {
    let full = losses(plan, &opts(6));
    let dir = std::env::temp_dir().join(format!("rcoa-resume-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let first = losses(
        plan,
        &RunOptions {
            save: Some(dir.clone()),
            ..opts(3)
        },
    );
    assert!(dir.join("state.json").exists());
    let rest = losses(
        plan,
        &RunOptions {
            resume: Some(dir.clone()),
            ..opts(6)
        },
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(rest.len(), 3);
    for (a, b) in first.iter().chain(&rest).zip(&full) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "resumed {a} vs uninterrupted {b}"
        );
    }
}

#[test]
fn optimizers_and_accumulation_run() {
    let _serial = serial();
    for (kind, momentum) in [
        (OptimizerKind::Sgd, 0.9),
        (OptimizerKind::Adam, 0.0),
        (OptimizerKind::Lion, 0.0),
        (OptimizerKind::Adafactor, 0.0),
        (OptimizerKind::AdamMini, 0.0),
    ] {
        let mut plan = tiny_plan();
        plan.optimizer.kind = kind;
        plan.optimizer.momentum = momentum;
        plan.optimizer.lr = 0.05;
        plan.resolved.grad_accum = 2;
        plan.resolved.micro_batch = 1;
        let l = losses(&plan, &opts(2));
        assert_eq!(l.len(), 2);
        assert!(l.iter().all(|v| v.is_finite()));
    }
}

#[test]
fn unsupported_plans_are_errors() {
    let _serial = serial();
    // Adam-mini's blocks are the model's heads and neurons, not LoRA's factors.
    let mut plan = lora_plan();
    plan.optimizer.kind = OptimizerKind::AdamMini;
    let e = run_cpu(&plan, &opts(1), &mut |_| {}).unwrap_err();
    assert!(e.to_string().contains("adam-mini` over LoRA"), "{e}");
    // Data parallelism needs one process per rank (`--nodes`).
    let mut plan = tiny_plan();
    plan.resolved.data = 2;
    assert!(matches!(
        run_cpu(&plan, &opts(1), &mut |_| {}),
        Err(RunError::Distributed(_))
    ));
    let mut plan = tiny_plan();
    plan.resolved.tensor = 2;
    assert!(matches!(
        run_cpu(&plan, &opts(1), &mut |_| {}),
        Err(RunError::Unsupported(_))
    ));
    let mut plan = tiny_plan();
    plan.precision.params = Dtype::Fp8;
    assert!(matches!(
        run_cpu(&plan, &opts(1), &mut |_| {}),
        Err(RunError::Unsupported(_))
    ));
}

#[test]
fn bf16_plans_run_in_fp32_on_the_cpu_with_a_note() {
    let _serial = serial();
    let mut plan = tiny_plan();
    plan.precision = rcoa_compiler::spec::PrecisionSpec {
        params: Dtype::Bf16,
        compute: Dtype::Bf16,
        master: Some(Dtype::Fp32),
        grads: Dtype::Bf16,
        autocast: false,
    };
    let mut note = None;
    run_cpu(&plan, &opts(1), &mut |e| {
        if let Event::Started(s) = e {
            note = s.precision_note
        }
    })
    .unwrap();
    assert!(note.unwrap().contains("fp32"));
}

/// fp16 runs with dynamic loss scaling, and the run says so before it starts; bf16 needs
/// none.
#[test]
fn fp16_is_noted_for_its_loss_scaling() {
    let note = |params, compute| {
        let mut plan = tiny_plan();
        plan.precision = rcoa_compiler::spec::PrecisionSpec {
            params,
            compute,
            master: Some(Dtype::Fp32),
            grads: params,
            autocast: false,
        };
        crate::train::Precision::for_plan(&plan, true).unwrap().1
    };
    for (params, compute) in [(Dtype::Fp16, Dtype::Fp16), (Dtype::Fp32, Dtype::Fp16)] {
        let n = note(params, compute).expect("a note");
        assert!(
            n.contains("dynamic loss scaling") && n.contains("65536"),
            "{n}"
        );
    }
    assert_eq!(note(Dtype::Bf16, Dtype::Bf16), None);
    assert_eq!(note(Dtype::Fp32, Dtype::Fp32), None);
    // fp16 weights without a master would be unscaled in fp16: refused where fp16 runs,
    // trained in fp32 where it does not.
    let mut plan = tiny_plan();
    plan.precision.params = Dtype::Fp16;
    plan.precision.compute = Dtype::Fp16;
    plan.precision.master = None;
    let e = crate::train::Precision::for_plan(&plan, true).unwrap_err();
    assert!(e.to_string().contains("`master = none`"), "{e}");
    assert!(crate::train::Precision::for_plan(&plan, false).is_ok());
}

#[test]
fn lowered_plans_round_trip_through_json() {
    let p = tiny_plan();
    let text = serde_json::to_string_pretty(&p).unwrap();
    if let Ok(path) = std::env::var("RCOA_DUMP_TINY_PLAN") {
        std::fs::write(path, &text).unwrap();
    }
    let back: LoweredPlan = serde_json::from_str(&text).unwrap();
    assert_eq!(back, p);
}

/// A padded sequence's real tokens see exactly what they see unpadded: the
/// key-padding bias hides the pads (whatever their ids) from every query.
#[test]
fn padding_hides_pad_tokens_from_real_tokens() {
    use crate::model::{Ctx, Model, ModelInit};
    use burn::tensor::{Int, Tensor, TensorData};
    type Inner = burn::backend::NdArray<f32>;
    let _serial = serial();
    let plan = tiny_encoder_plan(rcoa_compiler::spec::Loss::Contrastive);
    let device = Default::default();
    let init = ModelInit::f32(&plan.model, None, false);
    let model = Model::<Inner>::new(&init, &device);
    let mut ctx = Ctx::<Inner>::new(
        &plan.model,
        None,
        5,
        burn::tensor::FloatDType::F32,
        false,
        &device,
    );
    ctx.train = false;
    let real = [3i64, 7, 9];
    let tokens = |ids: &[i64]| {
        Tensor::<Inner, 2, Int>::from_data(TensorData::new(ids.to_vec(), [1, ids.len()]), &device)
    };
    let alone = model
        .hidden(tokens(&real), &ctx)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let keep = [true, true, true, false, false];
    let padded_ctx = ctx.with_padding(&keep, 1, 5, &device);
    let padded = model
        .hidden(tokens(&[3, 7, 9, 1, 30]), &padded_ctx)
        .narrow(1, 0, 3)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    let worst = alone
        .iter()
        .zip(&padded)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(worst < 1e-5, "padded real tokens differ by {worst}");
    // Without the mask the pads leak into the real tokens.
    let leaked = model
        .hidden(tokens(&[3, 7, 9, 1, 30]), &ctx)
        .narrow(1, 0, 3)
        .into_data()
        .to_vec::<f32>()
        .unwrap();
    assert!(alone.iter().zip(&leaked).any(|(a, b)| (a - b).abs() > 1e-4));
}

/// A truncated or missing checkpoint file is named in a sentence that says
/// what to do, never Burn's debug text.
#[test]
fn broken_checkpoints_are_explained() {
    let _serial = serial();
    let plan = tiny_plan();
    let dir = std::env::temp_dir().join(format!("rcoa-broken-ckpt-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    losses(
        &plan,
        &RunOptions {
            save: Some(dir.clone()),
            ..opts(1)
        },
    );
    let resume = |dir: &std::path::Path| {
        let o = RunOptions {
            resume: Some(dir.to_path_buf()),
            ..opts(2)
        };
        run_cpu(&plan, &o, &mut |_| {}).unwrap_err().to_string()
    };
    let model = dir.join("model.bin");
    let bytes = std::fs::read(&model).unwrap();
    std::fs::write(&model, &bytes[..bytes.len() / 3]).unwrap();
    let e = resume(&dir);
    assert!(
        e.contains("model.bin") && e.contains("truncated or corrupt"),
        "{e}"
    );
    assert!(!e.contains("Unknown(") && !e.contains("Io {"), "{e}");
    std::fs::write(&model, &bytes).unwrap();
    std::fs::remove_file(dir.join("optimizer.bin")).unwrap();
    let e = resume(&dir);
    assert!(
        e.contains("optimizer.bin") && e.contains("is missing"),
        "{e}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// An offloaded run needs host memory: refused with both figures where the
/// machine has less free than the executor would put there.
#[test]
fn offload_needs_the_host_memory_it_uses() {
    let plan = crate::testing::tiny_plan();
    let e = crate::check_host_memory(&plan, 3 << 30, Some(1 << 30))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("needs 3.00 GiB") && e.contains("1.00 GiB available"),
        "{e}"
    );
    assert!(crate::check_host_memory(&plan, 1 << 30, Some(3 << 30)).is_ok());
    assert!(crate::check_host_memory(&plan, 1 << 30, None).is_ok());
    assert!(crate::host_memory_available().is_some_and(|b| b > 0));
}

/// What the executor does not run is refused by `check_plan_ranks` with the
/// reason, also for a lowered plan the compiler did not make.
#[test]
fn unexecuted_zero_and_offload_are_refused() {
    use rcoa_compiler::spec::{Offload, OffloadTo, OffloadWhat};
    let mut plan = crate::testing::tiny_plan();
    plan.resolved.data = 2;
    for zero in [1, 2, 3] {
        plan.resolved.zero = zero;
        assert!(crate::check_plan_ranks(&plan, 2).is_ok(), "zero {zero}");
    }
    plan.resolved.zero = 4;
    let e = crate::check_plan_ranks(&plan, 2).unwrap_err().to_string();
    assert!(e.contains("ZeRO stage 4"), "{e}");
    plan.resolved.zero = 3;
    let refused = [
        (OffloadWhat::Params, OffloadTo::Nvme, "params:nvme to NVMe"),
        (OffloadWhat::Optimizer, OffloadTo::Nvme, "to NVMe"),
        (OffloadWhat::Grads, OffloadTo::Cpu, "grads:cpu"),
        (
            OffloadWhat::Activations,
            OffloadTo::Nvme,
            "activations:nvme to NVMe",
        ),
    ];
    for (what, to, want) in refused {
        plan.resolved.offload = vec![Offload { what, to }];
        let e = crate::check_plan_ranks(&plan, 2).unwrap_err().to_string();
        assert!(e.contains(want), "{e}");
    }
    plan.resolved.offload = [
        OffloadWhat::Optimizer,
        OffloadWhat::Params,
        OffloadWhat::Activations,
    ]
    .map(|what| Offload {
        what,
        to: OffloadTo::Cpu,
    })
    .to_vec();
    assert!(crate::check_plan_ranks(&plan, 2).is_ok());
}

/// What a sharded configuration offloads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Off {
    None,
    Optimizer,
    Params,
    Both,
    /// The optimizer and its gradient accumulator.
    OptGrads,
    /// Checkpointed layers' inputs only.
    Activations,
    /// The optimizer, the parameters and checkpointed layers' inputs.
    All,
}

impl Off {
    fn list(self) -> Vec<rcoa_compiler::spec::Offload> {
        use rcoa_compiler::spec::{Offload, OffloadTo, OffloadWhat};
        let what = match self {
            Off::None => vec![],
            Off::Optimizer => vec![OffloadWhat::Optimizer],
            Off::Params => vec![OffloadWhat::Params],
            Off::Both => vec![OffloadWhat::Optimizer, OffloadWhat::Params],
            Off::OptGrads => vec![OffloadWhat::Optimizer, OffloadWhat::Grads],
            Off::Activations => vec![OffloadWhat::Activations],
            Off::All => vec![
                OffloadWhat::Optimizer,
                OffloadWhat::Params,
                OffloadWhat::Activations,
            ],
        };
        what.into_iter()
            .map(|what| Offload {
                what,
                to: OffloadTo::Cpu,
            })
            .collect()
    }
}

/// Local rank `local` of two thread ranks of `plan` (seed 11, `steps` steps): its
/// trainer, joined to the ranks' collective, and the collective's progress.
fn rank_trainer(
    plan: &LoweredPlan,
    local: u32,
    steps: u64,
) -> Result<(Trainer<Cpu>, std::sync::Arc<crate::distributed::Progress>), RunError> {
    use crate::distributed::Collective;
    let d = crate::testing::thread_rank(local, 60);
    let device = Default::default();
    let c = Collective::<burn::backend::NdArray<f32>>::register(&d, &device)?;
    let progress = c.progress();
    let mut o = opts(steps);
    o.distributed = Some(d);
    // Seeding and initialising use the backend's global RNG.
    let _init = INIT.lock().unwrap_or_else(|e| e.into_inner());
    let t = Trainer::<Cpu>::new(
        plan,
        TrainerConfig {
            seed: 11,
            batcher: batcher(plan, &o)?,
            sixteen_bit: false,
            collective: Some(c),
        },
        device,
    )?;
    Ok((t, progress))
}

/// `one` (micro-batch 4 × grad_accum 2 on one rank, Burn's optimizer) and
/// each of `configs` (ZeRO stage, offload, checkpointed layers) on two ranks
/// (threads of this process, micro-batch 2): after 10 steps every weight is
/// within 1e-5 of one rank's, and the two ranks hold the same weights.
pub(crate) fn sharded_matches_one_rank(one: &LoweredPlan, configs: &[(u8, Off, Vec<bool>)]) {
    let steps = 10;
    let mut t = trainer(one);
    for _ in 0..steps {
        t.train_step(&mut RssProbe::new()).unwrap();
    }
    let want = t.flat_weights().unwrap();
    let initial = trainer(one).flat_weights().unwrap();
    for (zero, offload, checkpointed) in configs.iter().cloned() {
        let what = format!("zero {zero}, offload {offload:?}, checkpointed {checkpointed:?}");
        let mut plan = one.clone();
        plan.resolved.micro_batch = 2;
        plan.resolved.data = 2;
        plan.resolved.zero = zero;
        plan.resolved.offload = offload.list();
        if matches!(offload, Off::Activations | Off::All) {
            // What goes to the host follows the plan's checkpointed layers
            // (`Residency::inputs_on_host`).
            plan.resolved.checkpoint_layers = (0..checkpointed.len() as u64)
                .filter(|&i| checkpointed[i as usize])
                .collect();
        }
        let built = std::sync::Arc::new(std::sync::Barrier::new(2));
        let ranks: Vec<_> = (0..2u32)
            .map(|local| {
                let plan = plan.clone();
                let built = built.clone();
                let checkpointed = checkpointed.clone();
                std::thread::spawn(move || {
                    let (mut t, progress) = rank_trainer(&plan, local, steps)?;
                    built.wait();
                    if !checkpointed.is_empty() {
                        t.set_checkpointed(checkpointed);
                    }
                    let stage = shard::executed_stage(t.zero(), t.zero3());
                    assert_eq!(stage, zero);
                    assert_eq!(t.steps_in_backward(), plan.resolved.optimizer_in_backward);
                    let off = t.executed_offload();
                    assert_eq!(off.len(), plan.resolved.offload.len(), "{off:?}");
                    if let Some(z) = t.zero3() {
                        // The optimizer on the host with per-unit gathers
                        // keeps the gradient accumulator there too (the
                        // compiler's `burn_host_grad_accumulator`).
                        let host_opt = matches!(
                            offload,
                            Off::Optimizer | Off::Both | Off::All | Off::OptGrads
                        );
                        let units = zero == 3
                            || matches!(
                                offload,
                                Off::Params | Off::Both | Off::All | Off::OptGrads
                            );
                        assert_eq!(z.grads_on_host(), host_opt && units, "{zero} {offload:?}");
                        // At rest a rank holds half of every unit (ZeRO-3;
                        // padded to even halves), or all of it.
                        let (all, _) = z.param_counts();
                        let units = plan.model.layers as usize + 2;
                        let held = z.weight_shard_len();
                        if zero == 3 {
                            assert!(held <= all as usize / 2 + 2 * units, "{held} of {all}");
                        } else {
                            assert_eq!(held, all as usize);
                        }
                    }
                    let mut losses = Vec::new();
                    for step in 1..=steps {
                        progress.set_step(step);
                        losses.push(t.train_step(&mut RssProbe::new())?.loss);
                    }
                    let w = t.flat_weights()?;
                    let checksum = t.param_checksum()?;
                    progress.set_done();
                    Ok::<_, RunError>((w, checksum, losses))
                })
            })
            .collect();
        let got: Vec<_> = ranks
            .into_iter()
            .map(|r| r.join().unwrap().unwrap_or_else(|e| panic!("{what}: {e}")))
            .collect();
        assert_eq!(got[0].0, got[1].0, "{what}: the ranks differ");
        assert_eq!(got[0].1.to_bits(), got[1].1.to_bits(), "{what}: checksums");
        assert_eq!(got[0].2, got[1].2, "{what}: losses");
        assert_eq!(got[0].0.len(), want.len(), "{what}");
        let worst = got[0]
            .0
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(worst <= 1e-5, "{what}: max |Δw| = {worst}");
        // The runs trained: the weights moved from their initial values.
        assert!(got[0].0 != initial, "{what}");
    }
}

pub(crate) fn two_rank_reference(mut one: LoweredPlan) -> LoweredPlan {
    one.resolved.micro_batch = 4;
    one.resolved.grad_accum = 2;
    one.optimizer.weight_decay = 0.1;
    one
}

/// ZeRO 0-3 × nothing, the optimizer, the parameters (and both) offloaded,
/// on two ranks: one rank's weights after 10 steps.
#[test]
fn zero_on_two_ranks_matches_one_rank_weight_for_weight() {
    let _g = serial();
    let one = two_rank_reference(tiny_plan());
    let none = Vec::new;
    let mut configs = Vec::new();
    for zero in 0..=3u8 {
        for off in [Off::None, Off::Optimizer, Off::Params] {
            if (zero, off) != (0, Off::None) {
                configs.push((zero, off, none()));
            }
        }
    }
    // ZeRO-3 also with checkpointed layers (gathered again for their
    // recomputation), and with everything on the host.
    configs.push((3, Off::None, vec![true, false]));
    configs.push((3, Off::Both, vec![true, true]));
    // Everything on the host without ZeRO-3: the host gradient accumulator
    // of the whole model (ZeRO 0) and of a ZeRO-2 shard.
    configs.push((0, Off::Both, none()));
    configs.push((2, Off::Both, none()));
    // Checkpointed layers' inputs on the host (the second layer's: the
    // first's is the embedding's output), alone and with everything else.
    configs.push((1, Off::Activations, vec![true, true]));
    configs.push((3, Off::All, vec![true, true]));
    // The gradient accumulator on the host beside the optimizer, the weights
    // whole on the device (read in place per unit): every stage.
    for zero in 0..=3u8 {
        configs.push((zero, Off::OptGrads, none()));
    }
    configs.push((2, Off::OptGrads, vec![true, false]));
    sharded_matches_one_rank(&one, &configs);
}

/// Lion through the flat optimizer (ZeRO 2, the optimizer on the host,
/// ZeRO-3) ends where Burn's adaptor on one rank does.
#[test]
fn lion_on_two_ranks_matches_one_rank() {
    let _g = serial();
    let mut one = two_rank_reference(tiny_plan());
    one.optimizer.kind = OptimizerKind::Lion;
    one.optimizer.lr = 3e-4;
    one.optimizer.betas = (0.9, 0.99);
    sharded_matches_one_rank(
        &one,
        &[
            (2, Off::None, Vec::new()),
            (2, Off::Optimizer, Vec::new()),
            (3, Off::Both, vec![true, false]),
        ],
    );
}

/// ZeRO-3 with tied embeddings (the head gathers the embedding again) and
/// with LoRA (frozen base weights sharded beside the trainable adapters).
#[test]
fn zero3_with_tied_embeddings_and_frozen_weights_matches_one_rank() {
    let _g = serial();
    let mut tied = tiny_plan();
    tied.model.tie_embeddings = true;
    sharded_matches_one_rank(
        &two_rank_reference(tied),
        &[
            (3, Off::None, vec![false, true]),
            (3, Off::Params, Vec::new()),
            // The 1B decoder's setup whose loss was NaN at step 1 on the H100
            // (docs/burn-h100.md, 2026-11-25b): the optimizer on the host and
            // every layer recomputed.
            (3, Off::Optimizer, vec![true, true]),
        ],
    );
    sharded_matches_one_rank(
        &two_rank_reference(lora_plan()),
        &[
            (3, Off::None, vec![true, false]),
            (2, Off::Params, Vec::new()),
        ],
    );
}

/// The chunked LM loss trains as the full one does: same losses and weights
/// after a few steps (the vocabulary is 64, so chunks of 1024 tokens would be
/// one chunk of 32 tokens here; `loss_chunked` tests the splitting).
#[test]
fn chunked_loss_trains_like_the_full_loss() {
    let _serial = serial();
    let mut plan = tiny_plan();
    plan.train.chunked_loss = Some(false);
    let full = losses(&plan, &opts(3));
    plan.train.chunked_loss = Some(true);
    let mut t = trainer(&plan);
    assert!(t.chunked_loss_on());
    let chunked = losses(&plan, &opts(3));
    for (a, b) in chunked.iter().zip(&full) {
        assert!(
            (a - b).abs() <= 1e-5 * b.abs().max(1.0),
            "chunked {a} vs full {b}"
        );
    }
    // And the gradients of one micro-batch agree with one graph's.
    let batch = t.batcher.batch(0, 0);
    let (_, reference) = t.reference_grads(&batch, 0, 0);
    let mut acc = GradientsParams::new();
    let mut probe = RssProbe::new();
    t.set_checkpointed(vec![true; plan.model.layers as usize]);
    t.micro_step(&batch, 0, 0, 1.0, &mut acc, &mut probe);
    let worst = max_rel_diff(&t.flatten(&acc), &t.flatten(&reference));
    assert!(worst < 1e-4, "gradients differ by {worst}");
}

/// `checkpoint = selective` (the attention core recomputed in the backward)
/// gives the gradients of keeping everything, decoder and encoder.
#[test]
fn selective_recomputation_gives_the_same_gradients() {
    let _serial = serial();
    for plan in [
        tiny_plan(),
        tiny_encoder_plan(rcoa_compiler::spec::Loss::MaskedLm),
    ] {
        let grads = |selective: bool| {
            let mut p = plan.clone();
            p.resolved.checkpoint = if selective { "selective" } else { "none" }.into();
            p.resolved.checkpoint_layers.clear();
            let mut t = trainer(&p);
            t.set_train_mode(false);
            let batch = t.batcher.batch(0, 0);
            let mut acc = GradientsParams::new();
            let mut probe = RssProbe::new();
            let loss = t
                .micro_step(&batch, 0, 0, 1.0, &mut acc, &mut probe)
                .into_scalar()
                .elem::<f64>();
            (loss, t.flatten(&acc))
        };
        let (l0, g0) = grads(false);
        let (l1, g1) = grads(true);
        assert!((l0 - l1).abs() < 1e-6, "loss {l0} vs {l1}");
        let worst = max_rel_diff(&g1, &g0);
        assert!(worst < 1e-4, "selective gradients differ by {worst}");
    }
}

/// Dropout drops where the model's family does (`Numerics::dropout_sites`): with no site
/// the step is the step without dropout, to the bit, and each site alone changes it.
#[test]
fn dropout_drops_only_at_the_familys_sites() {
    use rcoa_compiler::spec::DropoutSites;
    let _serial = serial();
    let loss = |p: f64, embedding: bool, residual: bool, attention: bool| {
        let mut plan = tiny_plan();
        plan.model.dropout = p;
        plan.model.numerics.dropout_sites = DropoutSites {
            embedding,
            residual,
            attention,
        };
        let t = trainer(&plan);
        let batch = t.batcher.batch(0, 0);
        let mut acc = GradientsParams::new();
        t.micro_step(&batch, 0, 0, 1.0, &mut acc, &mut RssProbe::new())
            .into_scalar()
            .elem::<f64>()
    };
    let plain = loss(0.0, true, true, true);
    assert_eq!(loss(0.3, false, false, false), plain);
    for (e, r, a) in [
        (true, false, false),
        (false, true, false),
        (false, false, true),
    ] {
        let dropped = loss(0.3, e, r, a);
        assert!(
            (dropped - plain).abs() > 1e-6,
            "embedding {e}, residual {r}, attention {a}: {dropped} against {plain}"
        );
    }
}

/// Attention dropout while training: the selective core draws its mask
/// where eager attention draws its own (the same draw of the generator), so
/// the two give the same loss and gradients only if both drop the
/// probabilities, and drop them alike; and with every layer recomputed, the
/// recomputation drops what the first forward dropped, in each of the
/// three attention paths (flash by its seed).
#[test]
fn attention_dropout_is_drawn_alike_and_recomputed_alike() {
    let _serial = serial();
    let mut plan = tiny_plan();
    plan.model.dropout = 0.3;
    let step = |selective: bool| {
        let mut p = plan.clone();
        p.resolved.checkpoint = if selective { "selective" } else { "none" }.into();
        p.resolved.checkpoint_layers.clear();
        let t = trainer(&p);
        let batch = t.batcher.batch(0, 0);
        let mut acc = GradientsParams::new();
        let loss = t
            .micro_step(&batch, 0, 0, 1.0, &mut acc, &mut RssProbe::new())
            .into_scalar()
            .elem::<f64>();
        (loss, t.flatten(&acc))
    };
    let (l0, g0) = step(false);
    let (l1, g1) = step(true);
    assert!((l0 - l1).abs() < 1e-6, "loss {l0} vs {l1}");
    let worst = max_rel_diff(&g1, &g0);
    assert!(
        worst < 1e-4,
        "selective gradients with dropout differ by {worst}"
    );

    let mut selective = plan.clone();
    selective.resolved.checkpoint = "selective".into();
    check_gradients(&selective);
    let mut flash = plan.clone();
    flash.train.attention = rcoa_compiler::spec::Attention::Flash;
    check_gradients(&flash);
}

/// `attention = flash` (the fused op: no repeated k/v, LSE saved) gives the
/// loss and gradients of eager attention: a grouped-query decoder and an
/// encoder.
#[test]
fn flash_attention_gives_the_same_gradients() {
    let _serial = serial();
    for plan in [
        tiny_plan(),
        tiny_encoder_plan(rcoa_compiler::spec::Loss::MaskedLm),
    ] {
        let grads = |attention: rcoa_compiler::spec::Attention| {
            let mut p = plan.clone();
            p.train.attention = attention;
            let mut t = trainer(&p);
            t.set_train_mode(false);
            let batch = t.batcher.batch(0, 0);
            let mut acc = GradientsParams::new();
            let mut probe = RssProbe::new();
            let loss = t
                .micro_step(&batch, 0, 0, 1.0, &mut acc, &mut probe)
                .into_scalar()
                .elem::<f64>();
            (loss, t.flatten(&acc))
        };
        let (l0, g0) = grads(rcoa_compiler::spec::Attention::Eager);
        let (l1, g1) = grads(rcoa_compiler::spec::Attention::Flash);
        assert!((l0 - l1).abs() < 1e-5, "loss {l0} vs {l1}");
        let worst = max_rel_diff(&g1, &g0);
        assert!(worst < 1e-4, "flash gradients differ by {worst}");
    }
}

/// QLoRA's NF4 bases of `model`'s layers, host form, in order.
fn nf4_bases(model: &crate::model::Model<Cpu>) -> Vec<crate::quant::nf4::Nf4Weight> {
    model
        .layers
        .iter()
        .flat_map(|l| l.linears().filter_map(|x| x.nf4()).collect::<Vec<_>>())
        .map(|b| b.w.to_host().unwrap())
        .collect()
}

/// The tiny plan with LoRA adapters (rank 4) on Q, V and the down projection.
pub(crate) fn lora_plan() -> LoweredPlan {
    adapted(AdapterKind::Lora, Dtype::Fp32)
}

/// [`lora_plan`] over an NF4 base.
pub(crate) fn qlora_plan() -> LoweredPlan {
    adapted(AdapterKind::Qlora, Dtype::Nf4)
}

fn adapted(kind: AdapterKind, base: Dtype) -> LoweredPlan {
    let mut plan = tiny_plan();
    plan.adapter = Some(AdapterSpec {
        kind,
        rank: 4,
        alpha: 8.0,
        targets: vec![Proj::Q, Proj::V, Proj::Down],
        dropout: 0.0,
        base,
    });
    plan
}

/// ZeRO-3 shards QLoRA's NF4 base (FSDP-QLoRA): on two ranks each holds
/// about half of the encoded bases at rest, the gathered bases are the
/// unsharded ones bit for bit (and stay so: frozen), and 10 steps give one
/// rank's adapters and losses (with a recomputed layer, gathered again, and
/// with the optimizer on the host).
#[test]
fn zero3_shards_the_qlora_base_and_matches_one_rank() {
    let _g = serial();
    let one = two_rank_reference(qlora_plan());
    let want = nf4_bases(&trainer(&one).whole_model().unwrap());
    assert!(!want.is_empty());
    let encoded: usize = want.iter().map(|w| w.bytes()).sum();
    let mut plan = one.clone();
    plan.resolved.micro_batch = 2;
    plan.resolved.data = 2;
    plan.resolved.zero = 3;
    let ranks: Vec<_> = (0..2u32)
        .map(|local| {
            let (plan, want) = (plan.clone(), want.clone());
            std::thread::spawn(move || {
                let (mut t, progress) = rank_trainer(&plan, local, 2)?;
                let held = 4 * t.zero3().unwrap().nf4_shard_words();
                assert!(
                    held > 0 && held <= encoded / 2 + 4 * 4,
                    "{held} bytes of {encoded}"
                );
                assert!(
                    nf4_bases(&t.whole_model()?) == want,
                    "gathered bases differ"
                );
                progress.set_step(1);
                t.train_step(&mut RssProbe::new())?;
                assert!(nf4_bases(&t.whole_model()?) == want, "the base moved");
                progress.set_done();
                Ok::<_, RunError>(())
            })
        })
        .collect();
    for r in ranks {
        r.join().unwrap().unwrap();
    }
    sharded_matches_one_rank(
        &one,
        &[
            (3, Off::None, vec![true, false]),
            (3, Off::Optimizer, Vec::new()),
        ],
    );
}

/// Prompt-completion training: a step over two examples whose completions score 9 and 3
/// tokens is the same step whether they come as one micro-batch of two or as two of one
/// (the step's loss is the mean over all its completion tokens, as transformers counts
/// `num_items_in_batch`); a mean per micro-batch would weigh the short one 3 times as
/// much per token. SGD, so the update follows the gradient's size.
#[test]
fn prompt_completion_steps_do_not_depend_on_the_micro_batch_split() {
    let _serial = serial();
    let dir = std::env::temp_dir().join(format!("rcoa-sft-split-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("sft.jsonl");
    std::fs::write(
        &data,
        "{\"prompt\": \"Q: a cat? A:\", \"completion\": \" it sat.\"}\n\
         {\"prompt\": \"Q: the dog ran? A:\", \"completion\": \" a\"}\n",
    )
    .unwrap();
    let run = |micro: u64, accum: u64| {
        let mut plan = tiny_plan();
        plan.optimizer.kind = OptimizerKind::Sgd;
        plan.optimizer.lr = 0.5;
        plan.optimizer.weight_decay = 0.0;
        plan.train.seq_len = 24;
        plan.train.global_batch = 2;
        plan.resolved.micro_batch = micro;
        plan.resolved.grad_accum = accum;
        let mut o = opts(1);
        o.data = Some(data.clone());
        let mut t = crate::testing::trainer::<Cpu>(&plan, &o, 11).unwrap();
        let loss = t.train_step(&mut RssProbe::new()).unwrap().loss;
        (loss, t.param_checksum().unwrap())
    };
    let (one, one_sum) = run(2, 1);
    let (two, two_sum) = run(1, 2);
    assert!((one - two).abs() < 1e-5, "loss {one} vs {two}");
    assert!(
        (one_sum - two_sum).abs() <= 1e-6 * one_sum.abs().max(1.0),
        "weights {one_sum} vs {two_sum}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
