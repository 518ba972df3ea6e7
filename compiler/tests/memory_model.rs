//! Properties of the memory model, the step graph and `compile` that hold for any plan:
//! sharding and checkpointing never add memory, the optimizer's implementation only
//! changes its temporaries, unsupported features are errors, the JSON contract is complete.

use rcoa_compiler::explain::to_json;
use rcoa_compiler::graph::{Node, TrainGraph};
use rcoa_compiler::memory::{evaluate, Candidate, Category};
use rcoa_compiler::profile::Profile;
use rcoa_compiler::spec::*;
use rcoa_compiler::testing::{one_gpu, SpecBuilder};
use rcoa_compiler::{compile, CompileError};

fn spec(layers: u64, gpus: u64) -> Spec {
    SpecBuilder::new()
        .layers(layers)
        .nodes(1, gpus)
        .global_batch(8 * gpus)
        .data(Choice::Fixed(gpus))
        .build()
}

fn cand(data: u64) -> Candidate {
    Candidate { data, ..one_gpu(8) }
}

fn bytes(r: &rcoa_compiler::memory::MemoryReport, c: Category) -> u64 {
    r.breakdown[c.as_str()]
}

#[test]
fn zero_stages_never_add_memory_and_shard_state() {
    let s = spec(8, 8);
    let p = Profile::pytorch();
    let mut last = u64::MAX;
    let mut peaks = Vec::new();
    for zero in 0..=3u8 {
        let mut c = cand(8);
        c.zero = zero;
        let r = evaluate(&s, &c, &p, false);
        assert!(
            r.peak_bytes <= last,
            "zero {zero}: {} > {last}",
            r.peak_bytes
        );
        last = r.peak_bytes;
        peaks.push(r);
    }
    // At the optimizer step, ZeRO-1 holds an eighth of the state.
    let c0 = cand(8);
    let mut c1 = cand(8);
    c1.zero = 1;
    let s0 = rcoa_compiler::memory::evaluate(&s, &c0, &p, true);
    let s1 = rcoa_compiler::memory::evaluate(&s, &c1, &p, true);
    let opt0 = s0.phase_peaks["optimizer"];
    let opt1 = s1.phase_peaks["optimizer"];
    assert!(opt1 < opt0);
    assert!(peaks[3].peak_bytes < peaks[0].peak_bytes);
}

#[test]
fn checkpointing_trades_activations_for_recompute() {
    let s = spec(8, 1);
    let p = Profile::pytorch();
    let none = evaluate(&s, &cand(1), &p, true);
    let mut every2 = cand(1);
    every2.checkpoint_layers = vec![0, 2, 4, 6];
    let half = evaluate(&s, &every2, &p, true);
    let mut full = cand(1);
    full.checkpoint_layers = (0..8).collect();
    let all = evaluate(&s, &full, &p, true);
    let fwd_end = |r: &rcoa_compiler::memory::MemoryReport| {
        r.timeline
            .iter()
            .find(|x| x.op == "forward end")
            .unwrap()
            .bytes
    };
    assert!(fwd_end(&all) < fwd_end(&half) && fwd_end(&half) < fwd_end(&none));
    assert!(all.step_flops > none.step_flops, "recompute costs FLOPs");
}

#[test]
fn optimizer_implementation_changes_only_temporaries() {
    let mut s = spec(4, 1);
    let p = Profile::pytorch();
    let foreach = evaluate(&s, &cand(1), &p, true);
    s.optimizer.implementation = OptImpl::Fused;
    let fused = evaluate(&s, &cand(1), &p, true);
    assert!(fused.phase_peaks["optimizer"] < foreach.phase_peaks["optimizer"]);
    assert_eq!(fused.phase_peaks["forward"], foreach.phase_peaks["forward"]);
    s.optimizer.kind = OptimizerKind::Adafactor;
    let ada = evaluate(&s, &cand(1), &p, true);
    assert!(
        ada.phase_peaks["forward"] < foreach.phase_peaks["forward"],
        "factored state is smaller"
    );
}

/// transformers' Adafactor with `beta1` keeps an fp32 `exp_avg` of every trainable value (of
/// the upcast gradient, so fp32 over bf16 weights too) and rebinds `update` to it, so the
/// previous parameter's update no longer outlives its step.
#[test]
fn adafactor_first_moment_is_fp32_state() {
    let mut s = spec(4, 1);
    s.precision = PrecisionSpec {
        params: Dtype::Bf16,
        compute: Dtype::Bf16,
        master: None,
        grads: Dtype::Bf16,
        autocast: false,
    };
    s.optimizer.kind = OptimizerKind::Adafactor;
    s.optimizer.betas = (0.0, 0.999);
    let p = Profile::pytorch();
    let none = evaluate(&s, &cand(1), &p, true);
    s.optimizer.betas = (0.9, 0.999);
    let first = evaluate(&s, &cand(1), &p, true);
    let values = first.params_trainable;
    let grown = bytes(&first, Category::Optimizer) - bytes(&none, Category::Optimizer);
    // Each parameter's moment is one allocation: 4 bytes a value and the allocator's rounding.
    assert!(grown >= 4 * values, "{grown} < 4 x {values}");
    let tensors = TrainGraph::build(&s, &cand(1), &p)
        .summary()
        .trainable_params as u64;
    assert!(
        grown <= 4 * values + tensors * (2 << 20),
        "{grown} vs 4 x {values}"
    );
}

#[test]
fn gradient_accumulation_keeps_gradients_through_later_micro_batches() {
    let s = spec(4, 1);
    let p = Profile::pytorch();
    let one = evaluate(&s, &cand(1), &p, false);
    let mut c = cand(1);
    c.grad_accum = 4;
    let four = evaluate(&s, &c, &p, false);
    assert!(four.peak_bytes > one.peak_bytes);
    assert!(bytes(&four, Category::Grads) > 0);
}

#[test]
fn tensor_parallelism_divides_layer_weights() {
    let s = spec(8, 2);
    let p = Profile::pytorch();
    let mut c = cand(1);
    c.tensor = 2;
    let tp = evaluate(&s, &c, &p, false);
    let single = evaluate(&s, &cand(1), &p, false);
    assert!(tp.peak_bytes < single.peak_bytes);
}

#[test]
fn burn_profile_keeps_attention_scores() {
    let s = SpecBuilder::new()
        .layers(4)
        .target(Target::Burn)
        .precision(Dtype::Bf16, Dtype::Bf16, None)
        .build();
    let burn = TrainGraph::build(&s, &cand(1), &Profile::burn()).summary();
    let torch = TrainGraph::build(&s, &cand(1), &Profile::pytorch()).summary();
    // 8 x 16 heads x 1024 x 1024 bf16 scores: 268 MB a layer that SDPA never keeps.
    assert!(
        burn.saved_bytes_per_layer > torch.saved_bytes_per_layer + 200_000_000,
        "{burn:?} {torch:?}"
    );
    assert!(burn.op_counts.contains_key("softmax") && !torch.op_counts.contains_key("softmax"));
}

#[test]
fn unsupported_features_are_errors_not_guesses() {
    let mut s = spec(4, 1);
    s.model.experts = 8;
    assert!(matches!(compile(&s), Err(CompileError::Unsupported { .. })));
    let mut s = spec(4, 1);
    s.precision.compute = Dtype::Fp8;
    let e = compile(&s).unwrap_err();
    assert!(e.to_string().contains("fp8"), "{e}");
    let code = miette::Diagnostic::code(&e).map(|c| c.to_string());
    assert_eq!(code.as_deref(), Some("rcoa::unsupported"));
}

#[test]
fn json_has_the_contract_fields() {
    let s = spec(4, 1);
    let c = compile(&s).unwrap();
    let v = to_json(&c);
    for k in ["peak_bytes", "budget_bytes", "fits", "breakdown"] {
        assert!(v["memory"].get(k).is_some(), "memory.{k}");
    }
    for k in [
        "weights",
        "grads",
        "optimizer",
        "activations",
        "workspace",
        "reserved",
    ] {
        assert!(v["memory"]["breakdown"][k].is_u64(), "breakdown.{k}");
    }
    for k in [
        "micro_batch",
        "grad_accum",
        "data",
        "zero",
        "tensor",
        "pipeline",
        "context",
    ] {
        assert!(v["resolved"][k].is_u64(), "resolved.{k}");
    }
    assert_eq!(v["resolved"]["checkpoint"], "none");
    assert!(v["resolved"]["offload"].is_array());
    assert!(v["time"]["step_seconds"].as_f64().unwrap() > 0.0);
    assert!(v["time"]["tokens_per_second"].as_f64().unwrap() > 0.0);
    assert!(v["decisions"]
        .as_array()
        .unwrap()
        .iter()
        .all(|d| d["pass"].is_string() && d["what"].is_string() && d["why"].is_string()));
    let sum: u64 = c.report.breakdown.values().sum();
    assert_eq!(
        sum, c.report.peak_bytes,
        "the breakdown adds up to the peak"
    );
}

#[test]
fn autos_get_defaults_and_a_decision() {
    let mut s = spec(4, 1);
    s.train.micro_batch = Choice::Auto;
    s.train.grad_accum = Choice::Auto;
    s.train.global_batch = 64;
    s.fit.checkpoint = CheckpointChoice::Auto;
    let c = compile(&s).unwrap();
    let r = &c.lowered.resolved;
    assert_eq!(r.micro_batch * r.grad_accum, 64);
    assert!(c
        .explain
        .decisions
        .iter()
        .any(|d| d.what.starts_with("micro_batch")));
    assert!(c
        .explain
        .decisions
        .iter()
        .any(|d| d.what.starts_with("checkpoint")));
    assert!(c.lowered.prediction.fits);
}

#[test]
fn graph_has_a_node_per_op_and_an_update_sink() {
    let s = spec(2, 1);
    let g = TrainGraph::build(&s, &cand(1), &Profile::pytorch());
    let ops = g
        .graph
        .node_weights()
        .filter(|n| matches!(n, Node::Op { .. }))
        .count();
    assert_eq!(ops, g.tape.ops.len());
    assert_eq!(
        g.graph
            .node_weights()
            .filter(|n| matches!(n, Node::OptimizerUpdate))
            .count(),
        1
    );
    let sum = g.summary();
    assert!(sum.ops_per_layer > 10);
    assert!(sum.saved_bytes_per_layer > 0);
    for name in [
        "embedding",
        "q_proj",
        "attention",
        "silu",
        "lm_head",
        "nll_loss",
    ] {
        assert!(sum.op_counts.contains_key(name), "{name}");
    }
    assert!(g.graph.edge_weights().all(|e| e.bytes > 0));
}

#[test]
fn evaluation_is_cheap_enough_to_search() {
    let s = spec(32, 1);
    let p = Profile::pytorch();
    let start = std::time::Instant::now();
    let n = 20;
    for mb in 1..=n {
        let mut c = cand(1);
        c.micro_batch = mb;
        evaluate(&s, &c, &p, false);
    }
    let per = start.elapsed().as_secs_f64() / n as f64;
    // Debug builds are ~20x slower than release; still well under the bar.
    assert!(per < 0.25, "{per} s per evaluation");
}

mod props {
    use super::*;
    use proptest::prelude::*;

    fn arb_spec() -> impl Strategy<Value = Spec> {
        (
            (
                1u64..6,
                prop::sample::select(vec![256u64, 512, 768]),
                prop::sample::select(vec![4u64, 8]),
            ),
            (
                any::<bool>(),
                any::<bool>(),
                any::<bool>(),
                prop::sample::select(vec![0.0, 0.1]),
            ),
            (0usize..7, 0usize..3, 0usize..3, 0usize..3),
            (
                any::<bool>(),
                any::<bool>(),
                prop::sample::select(vec![64u64, 256]),
            ),
        )
            .prop_map(
                |(
                    (layers, hidden, heads),
                    (encoder, tie, lora, dropout),
                    (opt, prec, attn, loss),
                    (burn, qlora, seq),
                )| {
                    let mut s = spec(layers, 8);
                    s.model.hidden = hidden;
                    s.model.heads = heads;
                    s.model.kv_heads = if encoder { heads } else { heads / 2 };
                    s.model.head_dim = hidden / heads;
                    s.model.ffn = hidden * 3;
                    s.model.vocab = 1000;
                    s.model.dropout = dropout;
                    s.model.tie_embeddings = tie;
                    if encoder {
                        s.model.arch = Arch::Encoder;
                        s.model.mlp = Mlp::Gelu;
                        s.model.norm = Norm::Layernorm;
                        s.model.positions = Positions::Learned;
                    }
                    s.train.seq_len = seq;
                    s.train.attention = [Attention::Sdpa, Attention::Flash, Attention::Eager][attn];
                    s.train.loss = match (encoder, loss) {
                        (_, 0) => Loss::Contrastive,
                        (true, _) => Loss::MaskedLm,
                        (false, _) => Loss::CausalLm,
                    };
                    let (kind, implementation) = [
                        (OptimizerKind::Adamw, OptImpl::Foreach),
                        (OptimizerKind::Adam, OptImpl::Fused),
                        (OptimizerKind::Adam8bit, OptImpl::Plain),
                        (OptimizerKind::Adafactor, OptImpl::Foreach),
                        (OptimizerKind::Lion, OptImpl::Plain),
                        (OptimizerKind::Sgd, OptImpl::Foreach),
                        (OptimizerKind::AdamMini, OptImpl::Foreach),
                    ][opt];
                    s.optimizer.kind = kind;
                    s.optimizer.implementation = implementation;
                    s.optimizer.momentum = 0.9;
                    s.precision = [
                        PrecisionSpec {
                            params: Dtype::Fp32,
                            compute: Dtype::Bf16,
                            master: None,
                            grads: Dtype::Fp32,
                            autocast: false,
                        },
                        PrecisionSpec {
                            params: Dtype::Bf16,
                            compute: Dtype::Bf16,
                            master: Some(Dtype::Fp32),
                            grads: Dtype::Bf16,
                            autocast: false,
                        },
                        PrecisionSpec {
                            params: Dtype::Fp32,
                            compute: Dtype::Tf32,
                            master: None,
                            grads: Dtype::Fp32,
                            autocast: false,
                        },
                    ][prec];
                    if lora {
                        s.adapter = Some(AdapterSpec {
                            kind: if qlora {
                                AdapterKind::Qlora
                            } else {
                                AdapterKind::Lora
                            },
                            rank: 8,
                            alpha: 16.0,
                            targets: vec![Proj::Q, Proj::V, Proj::Down],
                            dropout,
                            base: if qlora {
                                Dtype::Nf4
                            } else {
                                s.precision.params
                            },
                        });
                    }
                    s.target = if burn { Target::Burn } else { Target::Pytorch };
                    s
                },
            )
    }

    fn arb_cand() -> impl Strategy<Value = Candidate> {
        (
            1u64..6,
            1u64..4,
            0u8..4,
            prop::sample::select(vec![1u64, 2, 4]),
            1u64..4,
            1u64..3,
            any::<u8>(),
            0usize..6,
        )
            .prop_map(
                |(mb, ga, zero, tensor, pipeline, context, ckpt_mask, off)| {
                    let offload = match off {
                        0 => vec![],
                        1 => vec![Offload {
                            what: OffloadWhat::Optimizer,
                            to: OffloadTo::Cpu,
                        }],
                        2 => vec![Offload {
                            what: OffloadWhat::Params,
                            to: OffloadTo::Cpu,
                        }],
                        3 => vec![Offload {
                            what: OffloadWhat::Grads,
                            to: OffloadTo::Nvme,
                        }],
                        4 => [OffloadWhat::Optimizer, OffloadWhat::Grads]
                            .map(|what| Offload {
                                what,
                                to: OffloadTo::Cpu,
                            })
                            .to_vec(),
                        _ => vec![Offload {
                            what: OffloadWhat::Activations,
                            to: OffloadTo::Cpu,
                        }],
                    };
                    Candidate {
                        micro_batch: mb,
                        grad_accum: ga,
                        data: (8 / (tensor * pipeline)).max(1),
                        zero,
                        tensor,
                        pipeline,
                        context,
                        sequence: false,
                        checkpoint_layers: (0..6).filter(|i| ckpt_mask & (1 << i) != 0).collect(),
                        selective: false,
                        offload,
                    }
                },
            )
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        /// Any plan the model accepts evaluates without panicking, its breakdown adds up to
        /// its peak, and the peak is at least the resident weights.
        #[test]
        fn evaluation_is_total_and_consistent(s in arb_spec(), c in arb_cand()) {
            let p = Profile::for_target(s.target);
            let r = evaluate(&s, &c, &p, true);
            let sum: u64 = r.breakdown.values().sum();
            prop_assert_eq!(sum, r.peak_bytes);
            prop_assert!(r.peak_bytes >= bytes(&r, Category::Weights));
            prop_assert!(r.timeline.iter().all(|x| x.bytes <= r.peak_bytes));
            prop_assert!(r.step_flops > 0.0);
        }
    }
}
