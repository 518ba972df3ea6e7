//! The memory model of the setups Megatron, torchtitan and torchtune runs need
//! (`docs/language.md`): linear biases, squared-ReLU MLPs.
//! Expected bytes are worked out from what PyTorch keeps (`tools/saved_tensors.py`),
//! not read back from the builder.

use super::build::Builder;
use super::tape::{self, Persistent};
use super::{evaluate, Candidate, Category};
use crate::profile::Profile;
use crate::spec::{Biases, Dtype, Mlp, Spec, Target};
use crate::testing::{one_gpu, SpecBuilder};

/// The setups' candidate: two sequences on one GPU.
fn cand() -> Candidate {
    one_gpu(2)
}

/// Activation bytes saved for the backward when the forward ends (PyTorch profile).
fn saved_at_forward_end(spec: &Spec, c: &Candidate) -> u64 {
    let profile = Profile::for_target(Target::Pytorch);
    let b = Builder::new(spec, &profile, c).build(0..spec.model.layers, true, true);
    let w = tape::walk(&b.tape, &Persistent::default(), false);
    w.forward_end[Category::Activations as usize]
}

/// `bias = true` adds one vector per projection (q, k, v, o; gate, up, down) to the
/// parameters, `bias = qkv` one per query, key and value projection, and neither adds
/// anything to what is saved: `F.linear` saves its input and weight with or without a
/// bias.
#[test]
fn linear_biases_add_parameters_and_save_nothing_more() {
    let plain = SpecBuilder::new().build();
    let m = &plain.model;
    let (q, kv) = (m.heads * m.head_dim, m.kv_heads * m.head_dim);
    let qkv = q + 2 * kv;
    for (biases, per_layer) in [
        (Biases::All, qkv + m.hidden + 2 * m.ffn + m.hidden),
        (Biases::Qkv, qkv),
    ] {
        let mut biased = plain.clone();
        biased.model.numerics.linear_bias = Some(biases);
        let p = Profile::for_target(Target::Pytorch);
        let r0 = evaluate(&plain, &cand(), &p, false);
        let r1 = evaluate(&biased, &cand(), &p, false);
        assert_eq!(r1.params_total - r0.params_total, m.layers * per_layer);
        assert_eq!(
            r1.params_trainable - r0.params_trainable,
            m.layers * per_layer
        );
        assert_eq!(
            saved_at_forward_end(&biased, &cand()),
            saved_at_forward_end(&plain, &cand())
        );
    }
}

/// Qwen3's RMSNorm over each head of q and k adds a weight of `head_dim` values to each and
/// keeps what HF's RMSNorm keeps, measured with `saved_tensors_hooks` (`tools/qk_norm_saved.py`) on a Qwen3 layer
/// against a Llama layer of the same shape (transformers 5.23, bf16: 148,992 more bytes at
/// 64 tokens, 4 heads of 64, 2 kv heads): per norm the fp32 upcast of its input, the
/// per-row `rsqrt` (fp32) and the normalized values cast back to bf16.
#[test]
fn qk_norm_keeps_what_hf_rmsnorm_keeps() {
    let plain = SpecBuilder::new()
        .precision(Dtype::Bf16, Dtype::Bf16, Some(Dtype::Fp32))
        .build();
    let mut normed = plain.clone();
    normed.model.numerics.qk_norm = true;
    let m = &plain.model;
    let p = Profile::for_target(Target::Pytorch);
    let r0 = evaluate(&plain, &cand(), &p, false);
    let r1 = evaluate(&normed, &cand(), &p, false);
    assert_eq!(r1.params_total - r0.params_total, m.layers * 2 * m.head_dim);
    let tokens = cand().micro_batch * plain.train.seq_len;
    let per_norm = |heads: u64| {
        let values = tokens * heads * m.head_dim;
        p.allocated(4 * values) + p.allocated(4 * tokens * heads) + p.allocated(2 * values)
    };
    assert_eq!(
        saved_at_forward_end(&normed, &cand()) - saved_at_forward_end(&plain, &cand()),
        m.layers * (per_norm(m.heads) + per_norm(m.kv_heads))
    );
}

/// Phi-3's fused `qkv_proj` (`fused_projections`): its whole output stays for the
/// backward through the saved view `v`, where a Llama layer keeps only its v projection:
/// q's and k's outputs more per layer in the PyTorch profile (`tools/phi3_saved.py`,
/// transformers 5.23: the same on the CPU, where SDPA's output is also copied once more
/// for `o_proj`; on CUDA the fused kernels' output needs no copy). The executor computes
/// three projections: nothing changes in the `burn` profile.
#[test]
fn phi3_keeps_the_fused_projection_output() {
    let plain = SpecBuilder::new()
        .precision(Dtype::Bf16, Dtype::Bf16, Some(Dtype::Fp32))
        .build();
    let mut fused = plain.clone();
    fused.model.numerics.fused_projections = true;
    let m = &plain.model;
    let tokens = cand().micro_batch * plain.train.seq_len;
    let p = Profile::for_target(Target::Pytorch);
    let qk = p.allocated(2 * tokens * m.heads * m.head_dim)
        + p.allocated(2 * tokens * m.kv_heads * m.head_dim);
    assert_eq!(
        saved_at_forward_end(&fused, &cand()) - saved_at_forward_end(&plain, &cand()),
        m.layers * qk
    );
    // Under LoRA on q, k and v, PEFT's one `lora.Linear` over `qkv_proj` casts its input
    // to fp32 once for the three adapters, where Llama's three modules keep a copy each.
    let lora = |mut s: Spec| {
        s.adapter = Some(crate::spec::AdapterSpec {
            kind: crate::spec::AdapterKind::Lora,
            rank: 8,
            alpha: 16.0,
            targets: vec![
                crate::spec::Proj::Q,
                crate::spec::Proj::K,
                crate::spec::Proj::V,
            ],
            dropout: 0.0,
            base: Dtype::Bf16,
        });
        s
    };
    let x_fp32 = p.allocated(4 * tokens * m.hidden);
    assert_eq!(
        saved_at_forward_end(&lora(fused.clone()), &cand()) as i64
            - saved_at_forward_end(&lora(plain.clone()), &cand()) as i64,
        (m.layers * qk) as i64 - (m.layers * 2 * x_fp32) as i64
    );
    let burn = Profile::for_target(Target::Burn);
    let c = cand();
    let saved = |s: &Spec| {
        let b = Builder::new(s, &burn, &c).build(0..s.model.layers, true, true);
        tape::walk(&b.tape, &Persistent::default(), false).forward_end
            [Category::Activations as usize]
    };
    assert_eq!(saved(&fused), saved(&plain));
}

/// A squared-ReLU MLP keeps relu's output and its square, two `[tokens, ffn]` tensors
/// in the compute dtype per layer (not the matmul's output): doubling `ffn` adds exactly
/// two such tensors of the added width per layer.
#[test]
fn squared_relu_saves_two_ffn_wide_tensors_per_layer() {
    let base = |ffn: u64| {
        let mut s = SpecBuilder::new().ffn(ffn).build();
        s.model.mlp = Mlp::SquaredRelu;
        s
    };
    let c = cand();
    let (f, tokens) = (2048u64, c.micro_batch * 1024);
    let s1 = saved_at_forward_end(&base(f), &c);
    let s2 = saved_at_forward_end(&base(2 * f), &c);
    let layers = base(f).model.layers;
    // bf16 activations under autocast: 2 bytes a value.
    assert_eq!(s2 - s1, layers * 2 * tokens * f * 2);
    // GELU keeps its input and output instead: the same bytes.
    let mut gelu = base(f);
    gelu.model.mlp = Mlp::Gelu;
    assert_eq!(saved_at_forward_end(&gelu, &c), s1);
    // SwiGLU keeps gate, silu, up and their product: more.
    let mut swiglu = base(f);
    swiglu.model.mlp = Mlp::Swiglu;
    assert!(saved_at_forward_end(&swiglu, &c) > s1);
}

/// Megatron's warm-up counts (`schedules.py`): 1F1B rank r of p runs `p - r - 1` warm-up
/// forwards, interleaved `(p - r - 1) * 2 + (v - 1) * p`; each then runs one more forward
/// before its first backward.
#[test]
fn chunks_in_flight_follow_megatrons_warmup() {
    use super::chunks_in_flight;
    assert_eq!(chunks_in_flight(4, 0, 8, 1), 4);
    assert_eq!(chunks_in_flight(4, 3, 8, 1), 1);
    assert_eq!(
        chunks_in_flight(4, 0, 2, 1),
        2,
        "fewer micro-batches than stages"
    );
    assert_eq!(chunks_in_flight(4, 0, 8, 2), 3 * 2 + 4 + 1);
    assert_eq!(chunks_in_flight(4, 3, 8, 2), 4 + 1);
    assert_eq!(chunks_in_flight(4, 0, 8, 4), 3 * 2 + 3 * 4 + 1);
    assert_eq!(
        chunks_in_flight(2, 0, 2, 8),
        2 * 8,
        "every chunk forward of the step"
    );
}

/// Rank 0 of an interleaved pipeline holds `1 + (p - 1) / (p v)` times the activations of
/// the model's layers for one micro-batch, against `1` under plain 1F1B (Narayanan et al.
/// 2021): with p = 4, v = 2 that is 3/8 of the model, 1.5 micro-batches of its stage more.
#[test]
fn interleaving_holds_more_activations_on_the_first_rank() {
    use super::{evaluate_on, stages};
    let spec = |v: u64| {
        let mut s = SpecBuilder::new().layers(16).build();
        s.parallel.pipeline = crate::spec::Choice::Fixed(4);
        s.parallel.virtual_stages = v;
        s
    };
    let p = Profile::for_target(Target::Pytorch);
    let peak0 = |v: u64, m: u64| {
        let s = spec(v);
        let c = Candidate {
            pipeline: 4,
            grad_accum: m,
            ..cand()
        };
        let st = &stages(&s, &c)[0];
        evaluate_on(&s, &c, &p, st, false).peak_bytes
    };
    // One more micro-batch of the whole stage in flight (plain 1F1B, m < p).
    let stage_microbatch = peak0(1, 3) - peak0(1, 2);
    assert!(stage_microbatch > 0);
    assert_eq!(peak0(1, 4) - peak0(1, 3), stage_microbatch);
    let extra = peak0(2, 8) - peak0(1, 8);
    assert_eq!(extra, stage_microbatch * 3 / 2);
}

/// The bubble of an interleaved schedule is `(p - 1) / v` micro-steps, and every boundary
/// is crossed `v` times a micro-batch.
#[test]
fn interleaving_divides_the_bubble_and_multiplies_the_sends() {
    use crate::cost::parallel::{estimate, Group};
    let p = Profile::for_target(Target::Pytorch);
    let run = |v: u64| {
        let mut s = SpecBuilder::new().layers(16).build();
        s.parallel.pipeline = crate::spec::Choice::Fixed(4);
        s.parallel.virtual_stages = v;
        let c = Candidate {
            pipeline: 4,
            grad_accum: 8,
            ..cand()
        };
        let r = crate::memory::parallel::evaluate(&s, &c, &p, false);
        estimate(&s, &c, &p, &r)
    };
    let (one, two) = (run(1), run(2));
    // The micro-step time of the rank priced (the worst; interleaving may change which).
    let micro = |st: &crate::cost::parallel::StepTime| {
        (st.base.step_seconds
            - st.base.optimizer_seconds
            - p.step_overhead_s
            - st.base.communication_seconds)
            / 8.0
    };
    assert!(one.bubble_s > 0.0);
    assert!((one.bubble_s - 3.0 * micro(&one)).abs() < 1e-12);
    assert!((two.bubble_s - 1.5 * micro(&two)).abs() < 1e-12);
    let sends = |st: &crate::cost::parallel::StepTime| -> f64 {
        st.traffic
            .iter()
            .filter(|t| t.group == Group::Pipeline)
            .map(|t| t.calls_per_step)
            .sum()
    };
    assert_eq!(sends(&two), 2.0 * sends(&one));
}

/// With the step in the backward no set of gradients persists: the optimizer step holds
/// the weights and the state but no gradients and no foreach temporaries of all the
/// parameters; the backward's peak carries at most one parameter's gradient and step.
#[test]
fn optimizer_in_backward_keeps_no_gradient_set() {
    let p = Profile::for_target(Target::Pytorch);
    let plain = SpecBuilder::new().build();
    let mut inbwd = plain.clone();
    inbwd.optimizer_in_backward = true;
    let (r0, r1) = (
        evaluate(&plain, &cand(), &p, true),
        evaluate(&inbwd, &cand(), &p, true),
    );
    assert_eq!(r1.breakdown["grads"], 0);
    // fp32 gradients of every trainable value (and foreach's one temporary each).
    let grads = 4 * r0.params_trainable;
    let opt0 = r0.phase_peaks["optimizer"];
    let opt1 = r1.phase_peaks["optimizer"];
    assert!(opt0 - opt1 >= 2 * grads, "{opt0} - {opt1} < 2 × {grads}");
    // One parameter's gradient and its step at a time: the largest is the LM head.
    let head = 4 * plain.model.vocab * plain.model.hidden;
    let b0 = r0.phase_peaks["backward"];
    let b1 = r1.phase_peaks["backward"];
    assert!(b1 <= b0 + 2 * head, "{b1} > {b0} + 2 × {head}");
    // Where the optimizer step was the highest point (short sequences), the peak falls.
    let short = |s: &crate::spec::Spec| {
        let mut s = s.clone();
        s.train.seq_len = 64;
        evaluate(&s, &cand(), &p, false)
    };
    let (s0, s1) = (short(&plain), short(&inbwd));
    assert_eq!(s0.peak.phase, crate::memory::Phase::Optimizer);
    assert!(
        s1.peak_bytes + grads <= s0.peak_bytes,
        "{} {}",
        s1.peak_bytes,
        s0.peak_bytes
    );
}

/// With the step in the backward a gradient lives until its parameter steps. A tied
/// embedding matrix's first part comes with the head's backward and waits, whole, for the
/// embedding's (PyTorch's `AccumulateGrad` sums both before the hook; `rcoa run` steps the
/// matrix with the embedding unit): every backward point between them holds it. Untied,
/// the head's matrix has stepped before any layer's backward.
#[test]
fn a_tied_matrix_gradient_waits_for_its_step_in_the_backward() {
    for target in [Target::Pytorch, Target::Burn] {
        let p = Profile::for_target(target);
        let mut s = SpecBuilder::new().build();
        s.target = target;
        s.optimizer_in_backward = true;
        let matrix = (s.model.vocab * s.model.hidden) as f64 * s.precision.grads.bytes();
        let grads_in_layers = |tied: bool| -> Vec<u64> {
            let mut s = s.clone();
            s.model.tie_embeddings = tied;
            let r = evaluate(&s, &cand(), &p, true);
            // Once the embedding has stepped nothing waits: the step after holds no gradient.
            let last = r.timeline.last().expect("a timeline");
            assert_eq!(last.phase, crate::memory::Phase::Optimizer, "{target:?}");
            assert_eq!(last.by_category[Category::Grads as usize], 0, "{target:?}");
            r.timeline
                .iter()
                .filter(|x| x.phase == crate::memory::Phase::Backward && x.layer.is_some())
                .map(|x| x.by_category[Category::Grads as usize])
                .collect()
        };
        let tied = grads_in_layers(true);
        assert!(!tied.is_empty(), "{target:?}");
        assert!(
            tied.iter().all(|&g| g as f64 >= matrix),
            "{target:?}: {tied:?} < {matrix}"
        );
        let untied = grads_in_layers(false);
        assert!(
            untied.iter().any(|&g| (g as f64) < matrix),
            "{target:?}: {untied:?}"
        );
    }
}

/// Data parallelism under Burn with the step in the backward: each unit's all-reduce (its
/// gradients as one flat fp32 vector, and their mean) is charged where the unit steps, one
/// op per unit, and nowhere else; one rank charges none.
#[test]
fn a_burn_unit_all_reduces_where_it_steps_in_the_backward() {
    let p = Profile::for_target(Target::Burn);
    let mut s = SpecBuilder::new().build();
    s.target = Target::Burn;
    s.optimizer_in_backward = true;
    let charges = |data: u64| -> (Vec<u64>, u64) {
        let mut c = cand();
        c.data = data;
        let b = Builder::new(&s, &p, &c).build(0..s.model.layers, true, true);
        let values = b.trainable.iter().map(|(_, n)| n).sum();
        let mut tape = b.tape;
        super::steps_in_backward(&s, &p, &c, &mut tape, &b.trainable);
        (tape.ops.iter().map(|o| o.bwd_workspace).collect(), values)
    };
    let ((one, values), (two, _)) = (charges(1), charges(2));
    let extra: Vec<u64> = one.iter().zip(&two).map(|(a, b)| b - a).collect();
    let at: Vec<usize> = (0..extra.len()).filter(|&o| extra[o] > 0).collect();
    // The embedding, each layer, the head (untied: the embedding steps on its own).
    assert_eq!(at.len() as u64, s.model.layers + 2, "{at:?}");
    let total: u64 = extra.iter().sum();
    // Every trainable value's fp32 twice, each unit's vectors their own allocations.
    assert!(total >= 8 * values, "{total} < 8 × {values}");
    assert!(
        total <= 8 * values + 2 * at.len() as u64 * (2 << 20),
        "{total} vs 8 × {values}"
    );
}

/// Adafactor under Burn: its step holds one fp32 tensor of the parameter net (the update and
/// its square, in place of the consumed gradient), one more where the gradients are views
/// of the all-reduced flat vector (data parallelism), which consuming frees nothing of.
#[test]
fn burn_adafactor_step_holds_one_more_tensor_where_gradients_are_views() {
    let p = Profile::for_target(Target::Burn);
    let mut s = SpecBuilder::new().build();
    s.target = Target::Burn;
    s.optimizer.kind = crate::spec::OptimizerKind::Adafactor;
    let temp = |data: u64| {
        let mut c = cand();
        c.data = data;
        let b = Builder::new(&s, &p, &c).build(0..s.model.layers, true, true);
        let largest = b.trainable.iter().map(|(_, n)| *n).max().unwrap();
        let t = super::optimizer::model(&s, &p, &b.tape, &b.trainable, &c).temp_bytes;
        (t, p.allocated(4 * largest))
    };
    let ((one, fp32), (two, _)) = (temp(1), temp(2));
    // fp32 weights (no upcast) and no master: the step's own temporaries alone.
    assert_eq!(one, fp32);
    assert_eq!(two, 2 * fp32);
}

/// Paged state counts on the device only while the budget has room: what the budget
/// lacks is evicted (up to the whole state), then moves out and back over PCIe each step.
#[test]
fn paged_state_is_evicted_down_to_the_budget() {
    use crate::cost::parallel::{estimate, Group};
    use crate::spec::{Budget, OptImpl};
    let p = Profile::for_target(Target::Pytorch);
    let mut s = SpecBuilder::new().build();
    s.optimizer.implementation = OptImpl::Paged;
    let roomy = crate::memory::parallel::evaluate(&s, &cand(), &p, false);
    assert_eq!(roomy.paged_evicted_bytes, 0);
    // AdamW's two fp32 moments of every trainable value.
    let state = roomy.paged_bytes;
    assert!(state >= 8 * roomy.params_trainable && state < 9 * roomy.params_trainable);
    let need = roomy.peak_bytes + roomy.reserve_bytes;
    // A budget a third of the state short: that third is evicted and the plan fits.
    s.fit.budget = Budget::Bytes(need - state / 3);
    let r = crate::memory::parallel::evaluate(&s, &cand(), &p, false);
    assert_eq!(r.paged_evicted_bytes, state / 3);
    assert_eq!(r.peak_bytes + r.reserve_bytes, need - state / 3);
    assert_eq!(
        r.breakdown["optimizer"],
        roomy.breakdown["optimizer"] - state / 3
    );
    let st = estimate(&s, &cand(), &p, &r);
    let paging: Vec<_> = st
        .traffic
        .iter()
        .filter(|t| t.group == Group::Host)
        .collect();
    assert_eq!(paging.len(), 1);
    assert_eq!(paging[0].bytes_per_call, 2.0 * (state / 3) as f64);
    // Short by more than the state: all of it is evicted and the rest still does not fit.
    s.fit.budget = Budget::Bytes(need - state - (1 << 30));
    let r = crate::memory::parallel::evaluate(&s, &cand(), &p, false);
    assert_eq!(r.paged_evicted_bytes, state);
    assert!(r.peak_bytes + r.reserve_bytes > need - state - (1 << 30));
}

/// torchtitan's op-level recomputation keeps, per layer, the fused attention kernel's
/// output and log-sum-exp and the outputs of the 1st, 3rd, 5th and 7th matmuls (q, v,
/// gate and down of a SwiGLU layer), bf16 under autocast: between full recomputation and
/// none in memory, and cheaper than full in FLOPs (the kept ops do not run again).
#[test]
fn selective_op_keeps_attention_and_every_other_matmul() {
    use crate::spec::CheckpointChoice;
    let p = Profile::for_target(Target::Pytorch);
    let spec = |choice: CheckpointChoice| {
        let mut s = SpecBuilder::new().build();
        s.fit.checkpoint = choice;
        s
    };
    let run = |choice: CheckpointChoice, all: bool| {
        let s = spec(choice);
        // Enough tokens that activations, not the optimizer step, make the peak.
        let c = Candidate {
            checkpoint_layers: if all {
                (0..s.model.layers).collect()
            } else {
                vec![]
            },
            micro_batch: 8,
            ..cand()
        };
        let profile = &p;
        let b = Builder::new(&s, profile, &c).build(0..s.model.layers, true, true);
        let w = tape::walk(&b.tape, &Persistent::default(), false);
        let r = evaluate(&s, &c, profile, false);
        (
            w.forward_end[Category::Activations as usize],
            r.peak_bytes,
            r.step_flops,
        )
    };
    let (a_full, p_full, f_full) = run(CheckpointChoice::Full, true);
    let (a_op, p_op, f_op) = run(CheckpointChoice::SelectiveOp, true);
    let (_, p_none, f_none) = run(CheckpointChoice::None, false);
    let s = spec(CheckpointChoice::SelectiveOp);
    let m = &s.model;
    let c = Candidate {
        micro_batch: 8,
        ..cand()
    };
    let tokens = c.micro_batch * s.train.seq_len;
    let (q, kv) = (m.heads * m.head_dim, m.kv_heads * m.head_dim);
    // Each an allocation of PyTorch's caching allocator (large ones rounded to 2 MiB).
    let bf16 = |n: u64| p.allocated(2 * n);
    let per_layer = bf16(tokens * q) // q_proj
        + bf16(tokens * kv) // v_proj
        + bf16(tokens * q) // attention output
        + p.allocated(4 * c.micro_batch * m.heads * s.train.seq_len) // log-sum-exp, fp32
        + bf16(tokens * m.ffn) // gate_proj
        + bf16(tokens * m.hidden); // down_proj
    assert_eq!(a_op - a_full, m.layers * per_layer);
    assert!(
        p_full < p_op && p_op < p_none,
        "{p_full} < {p_op} < {p_none}"
    );
    assert!(
        f_none < f_op && f_op < f_full,
        "{f_none} < {f_op} < {f_full}"
    );

    // Biased projections dispatch `aten.addmm`, not on the list: only the attention
    // kernel's outputs are kept.
    let kept_with_bias = |choice: CheckpointChoice| {
        let mut s = spec(choice);
        s.model.numerics.linear_bias = Some(Biases::All);
        let c = Candidate {
            checkpoint_layers: (0..s.model.layers).collect(),
            ..c.clone()
        };
        let b = Builder::new(&s, &p, &c).build(0..s.model.layers, true, true);
        let w = tape::walk(&b.tape, &Persistent::default(), false);
        w.forward_end[Category::Activations as usize]
    };
    let attention = bf16(tokens * q) + p.allocated(4 * c.micro_batch * m.heads * s.train.seq_len);
    assert_eq!(
        kept_with_bias(CheckpointChoice::SelectiveOp) - kept_with_bias(CheckpointChoice::Full),
        m.layers * attention
    );
}

/// The layer's parameter count (FSDP units, ZeRO-3 buckets, `--explain`) holds the
/// projections' biases and Qwen3's q/k norms: q, k and v's biases are split over tensor
/// ranks with their heads, o's and the norms are whole on each.
#[test]
fn layer_params_count_biases_and_qk_norms() {
    use super::parallel::layer_params;
    let plain = SpecBuilder::new().build().model;
    let (hd, heads, kv) = (plain.head_dim, plain.heads, plain.kv_heads);
    let mut qkv = plain.clone();
    qkv.numerics.linear_bias = Some(Biases::Qkv);
    let mut all = plain.clone();
    all.numerics.linear_bias = Some(Biases::All);
    let mut qk = plain.clone();
    qk.numerics.qk_norm = true;
    for t in [1, 2] {
        let base = layer_params(&plain, t);
        let qkv_bias = (heads / t + 2 * kv / t) * hd;
        assert_eq!(layer_params(&qkv, t) - base, qkv_bias, "tensor {t}");
        assert_eq!(
            layer_params(&all, t) - base,
            qkv_bias + plain.hidden + 2 * plain.ffn / t + plain.hidden,
            "tensor {t}"
        );
        assert_eq!(layer_params(&qk, t) - base, 2 * hd, "tensor {t}");
    }
}

/// Packed sequences under SDPA: transformers gives it the documents' `[b, 1, s, s]` mask,
/// as a sliding window within the sequence does (the mask kept, k and v repeated);
/// flash-attention 2 takes them as variable-length sequences and keeps nothing more.
#[test]
fn packing_under_sdpa_keeps_the_documents_mask_and_flash_does_not() {
    let base = SpecBuilder::new()
        .precision(Dtype::Bf16, Dtype::Bf16, Some(Dtype::Fp32))
        .build();
    let mut window = base.clone();
    window.model.numerics.sliding_window = Some(base.train.seq_len);
    let mut packed = base.clone();
    packed.train.packing = true;
    assert!(saved_at_forward_end(&packed, &cand()) > saved_at_forward_end(&base, &cand()));
    assert_eq!(
        saved_at_forward_end(&packed, &cand()),
        saved_at_forward_end(&window, &cand())
    );
    let mut flash = base.clone();
    flash.train.attention = crate::spec::Attention::Flash;
    let mut packed_flash = flash.clone();
    packed_flash.train.packing = true;
    assert_eq!(
        saved_at_forward_end(&packed_flash, &cand()),
        saved_at_forward_end(&flash, &cand())
    );
}

/// Mistral v0.1's sliding window as long as the sequence: SDPA gets a `[b, 1, s, s]`
/// mask, keeps its additive copy for the backward and repeats k and v to every head; a
/// longer window changes nothing.
#[test]
fn a_sliding_window_within_the_sequence_keeps_a_mask_and_repeated_kv() {
    let base = SpecBuilder::new()
        .precision(Dtype::Bf16, Dtype::Bf16, Some(Dtype::Fp32))
        .build();
    let m = &base.model;
    assert!(
        m.kv_heads < m.heads,
        "the test needs grouped-query attention"
    );
    let seq = base.train.seq_len;
    let with = |w: u64| {
        let mut s = base.clone();
        s.model.numerics.sliding_window = Some(w);
        saved_at_forward_end(&s, &cand())
    };
    let plain = saved_at_forward_end(&base, &cand());
    assert_eq!(with(seq + 1), plain);
    let p = Profile::for_target(Target::Pytorch);
    let b = cand().micro_batch;
    let tokens = b * seq;
    let repeated = p.allocated(2 * tokens * m.heads * m.head_dim)
        - p.allocated(2 * tokens * m.kv_heads * m.head_dim);
    let mask = p.allocated(2 * b * seq * seq);
    assert_eq!(with(seq) - plain, m.layers * (mask + 2 * repeated));
    // Burn's executor refuses a window shorter than the sequence and equals full
    // attention within it.
    let burn = Profile::for_target(Target::Burn);
    let c = cand();
    let walk = |s: &Spec| {
        let bld = Builder::new(s, &burn, &c).build(0..s.model.layers, true, true);
        tape::walk(&bld.tape, &Persistent::default(), false).forward_end
            [Category::Activations as usize]
    };
    let mut windowed = base.clone();
    windowed.model.numerics.sliding_window = Some(seq);
    assert_eq!(walk(&windowed), walk(&base));
}
