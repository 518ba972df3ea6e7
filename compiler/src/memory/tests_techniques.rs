//! The memory model of selective recomputation, 8-bit Adam, chunked loss, NF4 bases
//! and offloaded checkpoint inputs.

use super::{evaluate, Candidate};
use crate::profile::Profile;
use crate::spec::{CheckpointChoice, OptimizerKind, Target};
use crate::testing::{one_gpu, SpecBuilder};

fn cand(layers: &[u64]) -> Candidate {
    Candidate {
        checkpoint_layers: layers.to_vec(),
        ..one_gpu(4)
    }
}

/// (peak bytes, step FLOPs) of the default decoder under `choice`; `full`
/// recomputes every layer, as the checkpoint pass fixes it.
fn run(target: Target, choice: CheckpointChoice) -> (u64, f64) {
    let spec = SpecBuilder::new().target(target).checkpoint(choice).build();
    let layers: Vec<u64> = if choice == CheckpointChoice::Full {
        (0..spec.model.layers).collect()
    } else {
        vec![]
    };
    let mut c = cand(&layers);
    c.selective = choice == CheckpointChoice::Selective;
    let r = evaluate(&spec, &c, &Profile::for_target(target), false);
    (r.peak_bytes, r.step_flops)
}

/// On `target burn` (eager attention, one saved `[b, h, s, s]` per layer)
/// selective lies strictly between none and full in memory, and costs the
/// attention core's recompute: more FLOPs than none, fewer than full.
#[test]
fn selective_lies_between_none_and_full_on_burn() {
    let (none, f_none) = run(Target::Burn, CheckpointChoice::None);
    let (sel, f_sel) = run(Target::Burn, CheckpointChoice::Selective);
    let (full, f_full) = run(Target::Burn, CheckpointChoice::Full);
    assert!(
        full < sel && sel < none,
        "full {full} < selective {sel} < none {none}"
    );
    assert!(
        f_none < f_sel && f_sel < f_full,
        "{f_none} < {f_sel} < {f_full}"
    );
}

/// PyTorch with fused SDPA saves nothing quadratic: selective changes nothing.
#[test]
fn selective_changes_nothing_under_fused_attention() {
    assert_eq!(
        run(Target::Pytorch, CheckpointChoice::Selective),
        run(Target::Pytorch, CheckpointChoice::None)
    );
}

/// 8-bit Adam's state: a byte per value and an fp32 absmax per 256 values
/// for each moment, fp32 below 4096 values (bitsandbytes).
#[test]
fn adam8bit_state_is_two_bytes_per_value_and_block_scales() {
    use super::optimizer::adam8bit_state_bytes;
    assert_eq!(adam8bit_state_bytes(4095), 8 * 4095);
    assert_eq!(adam8bit_state_bytes(4096), 2 * 4096 + 2 * 4 * 16);
    assert_eq!(adam8bit_state_bytes(1 << 20), 2 * (1 << 20) + 2 * 4 * 4096);
    let spec = SpecBuilder::new()
        .optimizer(OptimizerKind::Adam8bit)
        .build();
    let adamw = SpecBuilder::new().build();
    let p = Profile::for_target(Target::Pytorch);
    let r8 = evaluate(&spec, &cand(&[]), &p, false);
    let r32 = evaluate(&adamw, &cand(&[]), &p, false);
    assert!(r8.peak_bytes < r32.peak_bytes);
}

fn with_loss(target: Target, vocab: u64, chunked: Option<bool>) -> super::MemoryReport {
    let mut spec = SpecBuilder::new().target(target).vocab(vocab).build();
    spec.train.chunked_loss = chunked;
    evaluate(&spec, &cand(&[]), &Profile::for_target(target), false)
}

/// Burn above a 32k vocabulary: chunked by default, which lowers the peak
/// (no `[tokens, vocab]` fp32 logits) and costs the head's matmul once more;
/// `chunked_loss = false` restores the full logits. Small vocabularies and
/// PyTorch are unchanged.
#[test]
fn chunked_loss_on_burn_only_and_above_32k() {
    let default = with_loss(Target::Burn, 50_304, None);
    let off = with_loss(Target::Burn, 50_304, Some(false));
    let on = with_loss(Target::Burn, 50_304, Some(true));
    assert_eq!(default.peak_bytes, on.peak_bytes);
    assert!(
        on.peak_bytes < off.peak_bytes,
        "{} < {}",
        on.peak_bytes,
        off.peak_bytes
    );
    assert!(on.step_flops > off.step_flops);
    assert_eq!(
        with_loss(Target::Burn, 32_000, None).peak_bytes,
        with_loss(Target::Burn, 32_000, Some(false)).peak_bytes
    );
    assert_eq!(
        with_loss(Target::Pytorch, 50_304, Some(true)).peak_bytes,
        with_loss(Target::Pytorch, 50_304, Some(false)).peak_bytes
    );
}

/// QLoRA's NF4 base: the weights the device keeps are exactly the packed codes and
/// block scales of every projection (each part one allocation, rounded to 512 bytes),
/// fp32 absmax per 64 values or double-quantized as the profile says; the embedding and
/// head keep the params dtype.
#[test]
fn nf4_base_weights_are_codes_plus_block_scales_fp32_or_double_quantized() {
    use crate::spec::{AdapterKind, AdapterSpec, Dtype, Proj};
    let spec = SpecBuilder::new()
        .target(Target::Burn)
        .adapter(Some(AdapterSpec {
            kind: AdapterKind::Qlora,
            rank: 8,
            alpha: 16.0,
            targets: vec![Proj::Q, Proj::V],
            dropout: 0.0,
            base: Dtype::Nf4,
        }))
        .build();
    let m = &spec.model;
    let round = |b: u64| b.div_ceil(512) * 512;
    // Independent of `memory::quant`: 4 bits a value (odd counts pad a code), then either
    // 4 bytes per 64-value block, or a byte per block and 4 bytes per 256 blocks.
    let nf4 = |n: u64, double: bool| {
        let blocks = n.div_ceil(64);
        let scales = if double {
            round(blocks) + round(4 * blocks.div_ceil(256))
        } else {
            round(4 * blocks)
        };
        round(n.div_ceil(2)) + scales
    };
    let (q, kv) = (m.heads * m.head_dim, m.kv_heads * m.head_dim);
    let shapes = [
        m.hidden * q,
        m.hidden * kv,
        m.hidden * kv,
        q * m.hidden,
        m.hidden * m.ffn,
        m.hidden * m.ffn,
        m.ffn * m.hidden,
    ];
    let base = |double: bool| m.layers * shapes.iter().map(|&n| nf4(n, double)).sum::<u64>();
    let weights = |double: bool| {
        let mut p = Profile::burn();
        p.nf4_double_quant = double;
        evaluate(&spec, &cand(&[]), &p, false).resident_param_bytes
    };
    assert!(Profile::burn().nf4_double_quant);
    assert!(Profile::pytorch().nf4_double_quant);
    assert_eq!(weights(false) - weights(true), base(false) - base(true));
    assert!(weights(false) > base(false));
    // Everything else (embedding, head, norms, adapters) is the same in both.
    let rest = weights(false) - base(false);
    assert_eq!(weights(true) - base(true), rest);
}

/// 8-bit Adam as `backend/src/quant/adam8bit.rs` holds it: per parameter of n ≥ 4096
/// values two u8 moments and, per moment, an fp32 absmax per 256-value block; fp32
/// moments below 4096. The burn profile charges exactly that (fp32 weights: no master).
#[test]
fn adam8bit_state_on_burn_is_what_the_executor_holds() {
    use crate::spec::Dtype;
    let spec = SpecBuilder::new()
        .target(Target::Burn)
        .optimizer(OptimizerKind::Adam8bit)
        .precision(Dtype::Fp32, Dtype::Fp32, None)
        .build();
    let r = evaluate(&spec, &cand(&[]), &Profile::burn(), false);
    let m = &spec.model;
    let round = |b: u64| b.div_ceil(512) * 512;
    let moment = |n: u64| {
        if n < 4096 {
            round(4 * n)
        } else {
            round(n) + round(4 * n.div_ceil(256))
        }
    };
    let (q, kv) = (m.heads * m.head_dim, m.kv_heads * m.head_dim);
    let layer = [
        m.hidden * q,
        m.hidden * kv,
        m.hidden * kv,
        q * m.hidden,
        m.hidden * m.ffn,
        m.hidden * m.ffn,
        m.ffn * m.hidden,
        m.hidden,
        m.hidden,
    ];
    let mut expected = m.layers * layer.iter().map(|&n| 2 * moment(n)).sum::<u64>();
    let head = if m.tie_embeddings { 0 } else { 1 };
    expected += (1 + head) * 2 * moment(m.vocab * m.hidden) + 2 * moment(m.hidden);
    assert_eq!(r.breakdown["optimizer"], expected);
}

/// Where the burn profile charges QLoRA's chunked dequantization
/// (`backend/src/quant/qlora.rs`): scratch of the projection's forward and of its input
/// gradient, never a tensor saved for the backward; the pytorch profile keeps
/// bitsandbytes' whole-weight copy. Hidden 2048 and ffn 8192 give both kinds of weight:
/// q_proj [2048, 1024] is one chunk, gate_proj [2048, 8192] four of 4 Mi values.
#[test]
fn qlora_dequant_chunk_is_scratch_of_forward_and_input_gradient() {
    use crate::memory::build::Builder;
    use crate::spec::{AdapterKind, AdapterSpec, Dtype, Proj};
    let spec = SpecBuilder::new()
        .target(Target::Burn)
        .layers(2)
        .hidden(2048)
        .ffn(8192)
        .precision(Dtype::Bf16, Dtype::Bf16, None)
        .adapter(Some(AdapterSpec {
            kind: AdapterKind::Qlora,
            rank: 8,
            alpha: 16.0,
            targets: vec![Proj::Q, Proj::Gate],
            dropout: 0.0,
            base: Dtype::Nf4,
        }))
        .build();
    let tokens = 4 * spec.train.seq_len;
    let ws = |profile: &Profile, name: &str| {
        let c = cand(&[]);
        let tape = Builder::new(&spec, profile, &c)
            .build(0..2, true, true)
            .tape;
        let ops: Vec<_> = tape.ops.iter().filter(|o| o.name == name).collect();
        assert_eq!(ops.len(), 2, "{name}: one per layer");
        for o in &ops {
            // The packed weight is all the op keeps of W: no dequantized copy is saved.
            assert!(o
                .saved
                .iter()
                .all(|t| tape.tensor(*t).role != super::tape::Role::WeightCopy));
        }
        (ops[1].fwd_workspace, ops[1].bwd_workspace)
    };
    // By hand: 201/16 bytes a value + 1184. gate_proj: 512 rows × 8192 = 4 Mi values, four
    // chunks, so y (and dx) are live beside it: 52,690,944 + 1184.
    let burn = Profile::burn();
    assert_eq!(ws(&burn, "gate_proj"), (52_692_128, 52_692_128));
    // q_proj: one chunk of 2048 × 1024 = 2 Mi values: 26,345,472 + 1184 = 26,346,656, and
    // its output is allocated after it is freed: only what it exceeds the output by is
    // charged on top of it. y is 4096 tokens × 1024 bf16 = 8 MiB, dx 4096 × 2048 bf16 = 16 MiB.
    assert_eq!(tokens, 4096);
    assert_eq!(
        ws(&burn, "q_proj"),
        (26_346_656 - 8_388_608, 26_346_656 - 16_777_216)
    );
    // bitsandbytes: the whole weight in bf16, forward and backward.
    let pt = Profile::pytorch();
    let pt_ws = |name: &str, elems: u64| {
        let (f, b) = ws(&pt, name);
        assert_eq!(
            (f, b),
            (pt.allocated(2 * elems), pt.allocated(2 * elems)),
            "{name}"
        );
    };
    pt_ws("gate_proj", 2048 * 8192);
    pt_ws("q_proj", 2048 * 1024);
}

/// `attention = flash` on `target burn` (the executor's fused op) keeps q,
/// k, v, the output and the log-sum-exp, nothing `[b, h, s, s]`: its peak is
/// below eager attention's, and doubling the sequence (at the same tokens
/// per micro-batch) grows eager's attention bytes but not flash's beyond the
/// score blocks.
#[test]
fn flash_on_burn_keeps_nothing_quadratic() {
    use crate::spec::Attention;
    let peak = |attention: Attention, seq: u64, micro: u64| {
        let mut spec = SpecBuilder::new().target(Target::Burn).build();
        spec.train.attention = attention;
        spec.train.seq_len = seq;
        let mut c = cand(&[]);
        c.micro_batch = micro;
        evaluate(&spec, &c, &Profile::for_target(Target::Burn), false).peak_bytes
    };
    let (seq, micro) = (2048, 4);
    let flash = peak(Attention::Flash, seq, micro);
    let eager = peak(Attention::Eager, seq, micro);
    assert!(flash < eager, "flash {flash} < eager {eager}");
    let flash_long = peak(Attention::Flash, 2 * seq, micro / 2);
    let eager_long = peak(Attention::Eager, 2 * seq, micro / 2);
    let grew = |a: u64, b: u64| b as f64 / a as f64;
    assert!(
        grew(flash, flash_long) < 1.05 && grew(eager, eager_long) > 1.2,
        "flash {flash} -> {flash_long}, eager {eager} -> {eager_long}"
    );
}

/// The executor's flash backward on tensor cores (16-bit compute, head dims in 16s up to
/// 128, a block of the kernels within the GPU's shared memory) runs in one pass, adding dQ
/// up in an fp32 `[b, h, s, d]` accumulator and reading the rows' fp32 D `[b, h, s]` while
/// it runs (`backend/src/kernels/flash/scratch.rs`): backward scratch, 5 block products
/// (2.5 x the forward's). Otherwise (fp32; head dim 128 on an L40S's 99 KiB; bf16 on a
/// V100) the `Rows` kernels run two atomics-free passes: no scratch, 7 products, under
/// their own op name.
#[test]
fn flash_on_burn_charges_the_one_pass_dq_accumulator_where_it_runs() {
    use crate::memory::build::{Builder, FUSED_ATTENTION_OP, FUSED_ATTENTION_ROWS_OP};
    use crate::spec::{Attention, Dtype};
    let op = |compute: Dtype, gpu: &str, head_dim: u64| {
        let mut spec = SpecBuilder::new()
            .target(Target::Burn)
            .layers(2)
            .head_dim(head_dim)
            .precision(Dtype::Fp32, compute, None)
            .build();
        spec.hardware.gpu = crate::catalog::gpu(gpu).expect("a catalog GPU").spec();
        spec.train.attention = Attention::Flash;
        let c = cand(&[]);
        let tape = Builder::new(&spec, &Profile::burn(), &c)
            .build(0..2, true, true)
            .tape;
        let o = tape
            .ops
            .iter()
            .find(|o| o.name == FUSED_ATTENTION_OP || o.name == FUSED_ATTENTION_ROWS_OP)
            .expect("a flash op")
            .clone();
        let m = &spec.model;
        let rows = c.micro_batch * m.heads * spec.train.seq_len;
        (o, rows * m.head_dim, rows)
    };
    for (compute, gpu, d) in [
        (Dtype::Bf16, "h100-80gb", 64),
        (Dtype::Bf16, "h100-80gb", 128),
        (Dtype::Bf16, "l40s-48gb", 64),
        (Dtype::Fp16, "v100-32gb", 64),
    ] {
        let (tc, q_elems, rows) = op(compute, gpu, d);
        assert_eq!(tc.name, FUSED_ATTENTION_OP, "{gpu} d{d}");
        assert_eq!(tc.bwd_workspace, 4 * q_elems + 4 * rows, "{gpu} d{d}");
        assert_eq!(tc.bwd_flops, 2.5 * tc.flops);
    }
    for (compute, gpu, d) in [
        (Dtype::Fp32, "h100-80gb", 64),
        (Dtype::Bf16, "l40s-48gb", 128),
        (Dtype::Fp16, "rtx6000-24gb", 64),
        // A V100's 96 KiB take head dim 64, but it has no bf16 tensor cores.
        (Dtype::Bf16, "v100-32gb", 64),
    ] {
        let (rows, _, _) = op(compute, gpu, d);
        assert_eq!(rows.name, FUSED_ATTENTION_ROWS_OP, "{compute:?} {gpu} d{d}");
        assert_eq!(rows.bwd_workspace, 0);
        assert_eq!(rows.bwd_flops, 3.5 * rows.flops);
    }
}

/// Attention dropout on Burn: the selective core saves its 1-byte mask per score in
/// every layer (Burn cannot replay a draw), flash saves only a seed. Both also drop
/// the residual branches, which costs them alike; the difference between the two
/// costs is the masks.
#[test]
fn attention_dropout_on_burn_keeps_a_byte_a_score_under_selective_only() {
    use crate::spec::Attention;
    let peak = |attention: Attention, selective: bool, dropout: f64| {
        let mut spec = SpecBuilder::new().target(Target::Burn).build();
        spec.train.attention = attention;
        spec.model.dropout = dropout;
        let mut c = cand(&[]);
        c.selective = selective;
        evaluate(&spec, &c, &Profile::for_target(Target::Burn), false).peak_bytes as f64
    };
    let spec = SpecBuilder::new().target(Target::Burn).build();
    let c = cand(&[]);
    let scores =
        (c.micro_batch * spec.model.heads * spec.train.seq_len * spec.train.seq_len) as f64;
    let selective = peak(Attention::Eager, true, 0.1) - peak(Attention::Eager, true, 0.0);
    let flash = peak(Attention::Flash, false, 0.1) - peak(Attention::Flash, false, 0.0);
    let masks = spec.model.layers as f64 * scores;
    let extra = selective - flash;
    assert!(
        (extra / masks - 1.0).abs() < 0.1,
        "selective's dropout costs {selective} B, flash's {flash} B: {extra} B more, \
         {masks} B of masks"
    );
}

/// A family that drops only the attention probabilities (Llama, Mistral, Qwen:
/// `Numerics::dropout_sites`) keeps one mask a layer, of the scores; dropping everywhere
/// (the DSL's models, GPT-2) adds a mask on each residual branch and the embeddings'.
#[test]
fn dropout_masks_follow_the_familys_sites() {
    use crate::spec::{Attention, DropoutSites};
    let masks = |sites: DropoutSites| {
        let mut spec = SpecBuilder::new().target(Target::Burn).layers(2).build();
        spec.train.attention = Attention::Eager;
        spec.model.dropout = 0.1;
        spec.model.numerics.dropout_sites = sites;
        let c = cand(&[]);
        let tape = super::build::Builder::new(&spec, &Profile::burn(), &c)
            .build(0..2, true, true)
            .tape;
        let mut shapes: Vec<Vec<u64>> = tape
            .tensors
            .iter()
            .filter(|t| t.name == "dropout_mask")
            .map(|t| t.shape.clone())
            .collect();
        shapes.sort();
        (spec, shapes)
    };
    let (spec, attention_only) = masks(DropoutSites {
        embedding: false,
        residual: false,
        attention: true,
    });
    let c = cand(&[]);
    let (m, t) = (&spec.model, &spec.train);
    let scores = vec![c.micro_batch, m.heads, t.seq_len, t.seq_len];
    assert_eq!(attention_only, vec![scores.clone(); 2]);
    let (_, everywhere) = masks(DropoutSites::ALL);
    // Two residual branches a layer and the embeddings: [tokens, hidden] each.
    assert_eq!(everywhere.len(), 2 + 2 * 2 + 1, "{everywhere:?}");
    assert_eq!(everywhere.iter().filter(|s| **s == scores).count(), 2);
    let (_, none) = masks(DropoutSites {
        embedding: false,
        residual: false,
        attention: false,
    });
    assert!(none.is_empty(), "{none:?}");
}

/// Beside an fp32 master the executor keeps frozen weights (LoRA's dense base, the
/// embedding, norms and head) once, in the storage dtype: the setup point holds the
/// 16-bit weights, the fp32 master of the trainable ones and one frozen tensor's fp32
/// draw, never an fp32 copy of the frozen model (`backend/src/setup.rs`).
#[test]
fn frozen_weights_have_no_fp32_master_at_setup_on_burn() {
    use crate::spec::{AdapterKind, AdapterSpec, Dtype, Proj};
    let spec = SpecBuilder::new()
        .target(Target::Burn)
        .precision(Dtype::Bf16, Dtype::Bf16, Some(Dtype::Fp32))
        .adapter(Some(AdapterSpec {
            kind: AdapterKind::Lora,
            rank: 8,
            alpha: 16.0,
            targets: Proj::ALL.to_vec(),
            dropout: 0.0,
            base: Dtype::Bf16,
        }))
        .build();
    let r = evaluate(&spec, &cand(&[]), &Profile::burn(), false);
    let m = &spec.model;
    let largest = (m.vocab * m.hidden).max(m.hidden * m.ffn);
    let frozen = r.params_total - r.params_trainable;
    let setup = r.phase_peaks["setup"];
    let slack = 1 << 20;
    let bound = r.resident_param_bytes + 4 * r.params_trainable + 4 * largest + slack;
    assert!(setup <= bound, "setup {setup} > {bound}");
    // An fp32 frozen master would add 4 bytes a frozen value on top of the weights.
    assert!(setup < r.resident_param_bytes + 4 * frozen, "{setup}");
    assert!(setup >= r.resident_param_bytes + 4 * r.params_trainable);
}

/// `offload = [activations]` on `target burn`: with every layer recomputed, the inputs
/// of every layer but the first wait in host memory (the first's is the embedding's
/// output, which stays), so at the loss the device holds exactly those inputs fewer, and
/// no point of the step holds more; with no layer recomputed past the first, nothing
/// moves and nothing changes.
#[test]
fn offloaded_checkpoint_inputs_leave_the_device_on_burn() {
    use crate::spec::{Offload, OffloadTo, OffloadWhat};
    let spec = SpecBuilder::new().target(Target::Burn).build();
    let layers = spec.model.layers;
    let p = Profile::for_target(Target::Burn);
    let with = |ckpt: &[u64], offload: bool| {
        let mut c = cand(ckpt);
        if offload {
            c.offload = vec![Offload {
                what: OffloadWhat::Activations,
                to: OffloadTo::Cpu,
            }];
        }
        evaluate(&spec, &c, &p, true)
    };
    let all: Vec<u64> = (0..layers).collect();
    let (kept, moved) = (with(&all, false), with(&all, true));
    let tokens = 4 * spec.train.seq_len;
    let input = tokens * spec.model.hidden * spec.precision.compute.bytes() as u64;
    assert_eq!(moved.host_activation_bytes, (layers - 1) * input);
    assert_eq!(kept.host_activation_bytes, 0);
    let at_loss = |r: &super::MemoryReport| {
        r.timeline
            .iter()
            .find(|s| s.op == "loss")
            .expect("a sample at the loss")
            .bytes
    };
    assert_eq!(at_loss(&kept) - at_loss(&moved), (layers - 1) * input);
    for (a, b) in kept.timeline.iter().zip(&moved.timeline) {
        assert!(b.bytes <= a.bytes, "{:?} {} {:?}", b.phase, b.op, b.layer);
    }
    assert!(moved.peak_bytes <= kept.peak_bytes);
    for ckpt in [&[][..], &[0][..]] {
        let (a, b) = (with(ckpt, false), with(ckpt, true));
        assert_eq!(a.phase_peaks, b.phase_peaks, "checkpointed {ckpt:?}");
        assert_eq!(a.peak_bytes, b.peak_bytes, "checkpointed {ckpt:?}");
        assert_eq!(b.host_activation_bytes, 0);
    }
}
