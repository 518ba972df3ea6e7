//! Packed rows (`train.packing`): a row of several examples gives each example the hidden
//! states and the gradients it gives alone, under RoPE (whole heads and part of each),
//! learned positions, a sliding window, and the eager, selective and fused attention (the
//! last on the CPU's blocked path; its kernels are tested in `kernels::flash`).

use super::serial;
use crate::model::{Ctx, Model, ModelInit};
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use rcoa_compiler::spec::{ModelSpec, Positions};

type Ad = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

fn tokens(ids: &[i64], rows: usize) -> Tensor<Ad, 2, Int> {
    let s = ids.len() / rows;
    Tensor::from_data(
        TensorData::new(ids.to_vec(), [rows, s]),
        &Default::default(),
    )
}

/// The hidden states of `docs` packed into one row of `seq` (then padding), and of each
/// alone, with the gradient of the token table from the sum of the real tokens' states
/// squared, as `(packed states, alone states, packed grad, alone grad)`.
fn packed_and_alone(
    spec: &ModelSpec,
    docs: &[&[i64]],
    seq: usize,
    attention: Attention,
) -> (Vec<f32>, Vec<f32>, Vec<f32>, Vec<f32>) {
    let (selective, flash) = (
        attention == Attention::Selective,
        attention == Attention::Flash,
    );
    let device = Default::default();
    let init = ModelInit::f32(spec, None, true);
    let model = Model::<Ad>::new(&init, &device);
    let d = spec.hidden as usize;
    let real: usize = docs.iter().map(|d| d.len()).sum();
    let (mut ids, mut positions) = (Vec::new(), Vec::new());
    for doc in docs {
        ids.extend_from_slice(doc);
        positions.extend(0..doc.len() as i64);
    }
    ids.extend(std::iter::repeat_n(1, seq - real));
    positions.extend(0..(seq - real) as i64);

    let grad_of = |states: Tensor<Ad, 3>, keep: usize| {
        let kept = states.narrow(1, 0, keep);
        let grads = kept.clone().powi_scalar(2).sum().backward();
        let g = model.embed.table().grad(&grads).expect("the table trains");
        let v: Vec<f32> = kept.inner().into_data().to_vec().unwrap();
        (v, g.into_data().to_vec::<f32>().unwrap())
    };

    let mut ctx = Ctx::<Ad>::new(spec, None, seq, FloatDType::F32, flash, &device);
    ctx.selective = selective;
    let packed_ctx = ctx.with_documents(&positions, 1, seq, &device);
    let (packed, packed_grad) = grad_of(model.hidden(tokens(&ids, 1), &packed_ctx), real);

    let (mut alone, mut alone_grad) = (Vec::new(), vec![0f32; packed_grad.len()]);
    for doc in docs {
        let mut ctx = Ctx::<Ad>::new(spec, None, doc.len(), FloatDType::F32, flash, &device);
        ctx.selective = selective;
        let (v, g) = grad_of(model.hidden(tokens(doc, 1), &ctx), doc.len());
        alone.extend(v);
        for (a, g) in alone_grad.iter_mut().zip(g) {
            *a += g;
        }
    }
    assert_eq!(packed.len(), real * d);
    (packed, alone, packed_grad, alone_grad)
}

fn assert_close(a: &[f32], b: &[f32], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= 2e-5 * scale,
            "{what}: [{i}] packed {x} vs alone {y} (scale {scale})"
        );
    }
}

const DOCS: [&[i64]; 3] = [&[5, 9, 2, 7, 3], &[11, 4, 8, 6], &[13, 12]];

#[derive(Clone, Copy, Debug, PartialEq)]
enum Attention {
    Eager,
    Selective,
    Flash,
}

fn check(spec: &ModelSpec, what: &str) {
    let _g = serial();
    for attention in [Attention::Eager, Attention::Selective, Attention::Flash] {
        let (p, a, pg, ag) = packed_and_alone(spec, &DOCS, 14, attention);
        let what = format!("{what}, {attention:?}");
        assert_close(&p, &a, &format!("{what}: states"));
        assert_close(&pg, &ag, &format!("{what}: token table gradient"));
    }
}

#[test]
fn packed_examples_see_only_themselves_under_rope() {
    let spec = crate::testing::tiny_plan().model;
    assert_eq!(spec.positions, Positions::Rope);
    check(&spec, "rope");
    let mut partial = spec.clone();
    partial.numerics.rotary_dims = Some(spec.head_dim / 2);
    check(&partial, "rope over half of each head");
}

#[test]
fn packed_examples_see_only_themselves_with_learned_positions() {
    let mut spec = crate::testing::tiny_plan().model;
    spec.positions = Positions::Learned;
    check(&spec, "learned positions");
}

/// A sliding window shorter than the examples: each example's window is its own.
#[test]
fn packed_examples_keep_their_own_sliding_window() {
    let mut spec = crate::testing::tiny_plan().model;
    spec.numerics.sliding_window = Some(3);
    check(&spec, "window 3");
}

/// The test has teeth: the same row without its documents (positions 0..seq, one causal
/// mask) gives the later examples other states.
#[test]
fn a_row_read_as_one_sequence_differs() {
    let _g = serial();
    let spec = crate::testing::tiny_plan().model;
    let device = Default::default();
    let init = ModelInit::f32(&spec, None, true);
    let model = Model::<Ad>::new(&init, &device);
    let ids: Vec<i64> = DOCS.concat();
    let s = ids.len();
    let ctx = Ctx::<Ad>::new(&spec, None, s, FloatDType::F32, false, &device);
    let positions: Vec<i64> = DOCS.iter().flat_map(|d| 0..d.len() as i64).collect();
    let one: Vec<f32> = model
        .hidden(tokens(&ids, 1), &ctx)
        .into_data()
        .to_vec()
        .unwrap();
    let packed: Vec<f32> = model
        .hidden(
            tokens(&ids, 1),
            &ctx.with_documents(&positions, 1, s, &device),
        )
        .into_data()
        .to_vec()
        .unwrap();
    let d = spec.hidden as usize;
    let first = DOCS[0].len() * d;
    assert_close(&packed[..first], &one[..first], "the first example");
    let diff = packed[first..]
        .iter()
        .zip(&one[first..])
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    assert!(diff > 1e-2, "later examples changed by only {diff}");
}

const CHILD: &str = "RCOA_PACKING_MEASURE_CHILD";

/// A decoder whose step peaks in its activations (eager attention's `[b, h, s, s]`
/// probabilities), byte tokens, 256-token rows of 4.
fn measured_plan(packing: bool) -> String {
    format!(
        "model {{\n  arch = decoder\n  layers = 2\n  hidden = 128\n  heads = 4\n  ffn = 256\n  \
         mlp = swiglu\n  norm = rmsnorm\n  vocab = 512\n  max_positions = 256\n}}\n\
         precision fp32\noptimizer adamw {{ lr = 1e-3 }}\n\
         train {{ seq_len = 256  global_batch = 4  micro_batch = 4  grad_accum = 1  \
         attention = eager  packing = {packing} }}\n\
         fit {{ checkpoint = none }}\nhardware {{ gpu = h100-80gb }}\ntarget burn\n"
    )
}

/// The highest live bytes of a steady-state step on `data` (`in_backward::measured_peak`).
fn measured_peak(plan: &rcoa_compiler::lowered::LoweredPlan, data: &std::path::Path) -> u64 {
    let opts = crate::RunOptions {
        data: Some(data.to_path_buf()),
        ..super::opts(2)
    };
    super::in_backward::measured_peak_with(plan, &opts)
}

#[test]
fn packing_keeps_what_the_burn_profile_charges() {
    crate::testing::run_ignored_in_child("tests::packing::packing_measured_in_child", CHILD);
}

/// Each micro-batch's `[b, 1, s, s]` document mask, the token positions and the gathered
/// RoPE rows are what packing adds to a step; the `burn` profile charges them
/// (`engines::burn_context_tensors`), so the prediction's error is the same packed or not.
#[test]
#[ignore = "run in its own process by packing_keeps_what_the_burn_profile_charges"]
fn packing_measured_in_child() {
    use super::in_backward::predicted_peak;
    assert!(std::env::var_os(CHILD).is_some(), "run by its parent test");
    let _g = serial();
    let dir = std::env::temp_dir().join(format!("rcoa-packing-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("sft.jsonl");
    let lines: Vec<String> = (0..48)
        .map(|i| {
            let n = 20 + (i * 37) % 100;
            let text: String = (0..n)
                .map(|j| (b'a' + ((i + j) % 26) as u8) as char)
                .collect();
            serde_json::json!({"prompt": &text[..n / 2], "completion": &text[n / 2..]}).to_string()
        })
        .collect();
    std::fs::write(&data, lines.join("\n")).unwrap();
    // Thread pools and first-use buffers before the measurement.
    measured_peak(&predicted_peak(&measured_plan(false)).0, &data);
    let mut got = Vec::new();
    for packing in [false, true] {
        let (lowered, predicted) = predicted_peak(&measured_plan(packing));
        assert_eq!(lowered.train.packing, packing);
        let m = measured_peak(&lowered, &data);
        let err = m as f64 / predicted as f64 - 1.0;
        println!("packing {packing}: measured {m} predicted {predicted} ({err:+.4})");
        got.push((m as f64, predicted as f64, err));
    }
    let (m, p) = (got[1].0 - got[0].0, got[1].1 - got[0].1);
    println!("packing adds: measured {m} predicted {p}");
    assert!(
        (got[1].2 - got[0].2).abs() < 0.01,
        "packed error {:+.4} strays from unpacked {:+.4}",
        got[1].2,
        got[0].2
    );
    // The mask alone is 1 MiB: the peak moves by about what is charged.
    assert!(
        p >= 1.0 * 1024.0 * 1024.0 && (m - p).abs() < 0.25 * p,
        "measured {m} predicted {p}"
    );
    std::fs::remove_dir_all(&dir).ok();
}
