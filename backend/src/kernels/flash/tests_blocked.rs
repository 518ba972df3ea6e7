//! The blocked plain path (the CPU's `flash_attention`) and its autodiff
//! node against the f64 reference: output, log-sum-exp and the three
//! gradients, over causal / bidirectional, grouped-query, padding and
//! lengths that span several query blocks.

use burn::backend::autodiff::Autodiff;
use burn::tensor::{Tensor, TensorData, TensorPrimitive};

use super::blocked::{FlashMask, QUERY_BLOCK};
use super::dropout::FlashDropout;
use super::reference::{worst, Problem};
use crate::ops::{flash_attention, ExecBackend};

type Inner = burn::backend::NdArray<f32>;
type Cpu = Autodiff<Inner>;

fn tensor<B: burn::tensor::backend::Backend, const D: usize>(
    data: &[f32],
    shape: [usize; D],
) -> Tensor<B, D> {
    Tensor::from_data(TensorData::new(data.to_vec(), shape), &Default::default())
}

fn values<B: burn::tensor::backend::Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().convert::<f32>().to_vec().unwrap()
}

fn mask<B: burn::tensor::backend::Backend>(p: &Problem) -> FlashMask<B> {
    FlashMask {
        causal: p.causal,
        window: p.window,
        key_bias: p.key_bias().map(|b| tensor::<B, 2>(&b, [p.b, p.t])),
        documents: p.spans.as_ref().map(|sp| {
            let sp: Vec<i64> = sp.iter().map(|&x| x as i64).collect();
            Tensor::from_data(TensorData::new(sp, [p.b, p.s, 2]), &Default::default())
        }),
        dropout: p.dropout.map(|(prob, [w0, w1])| FlashDropout {
            p: prob,
            seed: Tensor::from_data(
                TensorData::new(vec![w0 as i64, w1 as i64], [2]),
                &Default::default(),
            ),
        }),
    }
}

fn check(p: Problem, what: &str) {
    check_on::<Inner>(p, what);
}

/// `ops::flash_attention` on `B` and on `Autodiff<B>` (the LSE from `B`'s
/// forward, the rest through the autodiff node) against the reference.
pub(super) fn check_on<B: ExecBackend>(p: Problem, what: &str) {
    let want = p.expected();
    let qs = [p.b, p.h, p.s, p.d];
    let ks = [p.b, p.kvh, p.t, p.d];

    // The log-sum-exp, from the inner backend's forward.
    let (_, lse) = B::flash_attention_forward(
        tensor::<B, 4>(&p.q, qs).into_primitive().tensor(),
        tensor::<B, 4>(&p.k, ks).into_primitive().tensor(),
        tensor::<B, 4>(&p.v, ks).into_primitive().tensor(),
        &mask::<B>(&p),
        p.scale,
    );
    let lse = Tensor::<B, 3>::from_primitive(TensorPrimitive::Float(lse));

    type Ad<B> = Autodiff<B>;
    let q = tensor::<Ad<B>, 4>(&p.q, qs).require_grad();
    let k = tensor::<Ad<B>, 4>(&p.k, ks).require_grad();
    let v = tensor::<Ad<B>, 4>(&p.v, ks).require_grad();
    let y = flash_attention(q.clone(), k.clone(), v.clone(), &mask::<Ad<B>>(&p), p.scale);
    let grads = (y.clone() * tensor::<Ad<B>, 4>(&p.d_o, qs))
        .sum()
        .backward();
    let grad = |t: &Tensor<Ad<B>, 4>| values(t.grad(&grads).expect("a gradient"));
    let errs = [
        ("O", worst(&values(y), &want.o), 1e-4),
        ("LSE", worst(&values(lse), &want.lse), 1e-4),
        ("dQ", worst(&grad(&q), &want.d_q), 1e-3),
        ("dK", worst(&grad(&k), &want.d_k), 1e-3),
        ("dV", worst(&grad(&v), &want.d_v), 1e-3),
    ];
    for (name, err, tol) in errs {
        assert!(err <= tol, "{what}: {name} differs by {err:e} (> {tol:e})");
    }
}

#[test]
fn flash_blocked_matches_reference() {
    let s = QUERY_BLOCK * 2 + 5;
    check(
        Problem::new(2, 4, 4, 9, 9, 8, false, &[], 11),
        "bidirectional",
    );
    check(
        Problem::new(1, 2, 2, s, s, 8, true, &[], 12),
        "causal, 3 blocks",
    );
    check(
        Problem::new(1, 4, 1, s, s, 8, false, &[0], 13),
        "gqa 4:1, 3 blocks",
    );
    check(
        Problem::new(2, 4, 2, 21, 21, 16, true, &[3, 8], 14),
        "padding causal gqa",
    );
    check(
        Problem::new(2, 2, 2, 13, 30, 8, false, &[0, 7], 15),
        "cross lengths",
    );
}

/// A sliding window: shorter than a query block, longer than one (the first block's
/// keys seen by some rows of the next), of one key; with grouped queries, padding and
/// dropout.
#[test]
fn flash_blocked_with_a_window_matches_reference() {
    let s = QUERY_BLOCK * 2 + 5;
    check(
        Problem::new(1, 2, 2, s, s, 8, true, &[], 30).with_window(10),
        "window 10, 3 blocks",
    );
    check(
        Problem::new(2, 4, 2, s, s, 8, true, &[0, 9], 31).with_window(QUERY_BLOCK + 6),
        "window past a block, gqa, padding",
    );
    check(
        Problem::new(1, 2, 1, 20, 20, 8, true, &[], 32).with_window(1),
        "window 1",
    );
    check(
        Problem::new(1, 2, 2, s, s, 8, true, &[2], 33)
            .with_window(40)
            .with_dropout(0.2, [9, 4]),
        "window 40 with dropout",
    );
}

/// Packed rows: each query sees only its own document's keys, with documents shorter
/// and longer than a query block and one that crosses a block's edge, under grouped
/// queries, a sliding window and dropout.
#[test]
fn flash_blocked_with_documents_matches_reference() {
    let s = QUERY_BLOCK * 2 + 5;
    check(
        Problem::new(2, 4, 2, s, s, 8, true, &[], 40)
            .with_documents(&[&[5, QUERY_BLOCK + 7, 1, 30], &[QUERY_BLOCK - 1, 2]]),
        "documents, gqa",
    );
    check(
        Problem::new(1, 2, 2, s, s, 8, true, &[], 41)
            .with_documents(&[&[20, 50, 40]])
            .with_window(12)
            .with_dropout(0.2, [3, 8]),
        "documents under a window, with dropout",
    );
}

/// Dropout: the blocked path drops what the reference drops (the same
/// hash), and differentiates through it, over blocks, grouped queries,
/// padding and cross lengths.
#[test]
fn flash_blocked_with_dropout_matches_reference() {
    let s = QUERY_BLOCK + 9;
    check(
        Problem::new(1, 4, 2, s, s, 8, true, &[3], 17).with_dropout(0.3, [5, 77]),
        "dropout causal gqa padding, 2 blocks",
    );
    check(
        Problem::new(2, 2, 2, 13, 30, 8, false, &[0, 7], 18).with_dropout(0.1, [1 << 23, 0]),
        "dropout cross lengths",
    );
}

/// Dropout changes the output (it is applied), and another seed changes it
/// again: a mask the seed does not reach would pass the reference test.
#[test]
fn flash_blocked_dropout_depends_on_the_seed() {
    let base = || Problem::new(1, 2, 2, 20, 20, 8, true, &[], 19);
    let out = |p: Problem| {
        values(flash_attention(
            tensor::<Inner, 4>(&p.q, [p.b, p.h, p.s, p.d]),
            tensor::<Inner, 4>(&p.k, [p.b, p.kvh, p.t, p.d]),
            tensor::<Inner, 4>(&p.v, [p.b, p.kvh, p.t, p.d]),
            &mask::<Inner>(&p),
            p.scale,
        ))
    };
    let plain = out(base());
    let a = out(base().with_dropout(0.5, [1, 2]));
    let b = out(base().with_dropout(0.5, [1, 3]));
    assert!(
        worst(&a, &plain) > 1e-2,
        "dropout left the output as it was"
    );
    assert!(worst(&a, &b) > 1e-2, "two seeds dropped the same scores");
}

/// Frozen q and k: only v gets a gradient, and it is still right.
#[test]
fn flash_blocked_with_frozen_q_k() {
    let p = Problem::new(1, 2, 2, 6, 6, 4, true, &[], 16);
    let want = p.expected();
    let qs = [p.b, p.h, p.s, p.d];
    let v = tensor::<Cpu, 4>(&p.v, qs).require_grad();
    let q = tensor::<Cpu, 4>(&p.q, qs);
    let k = tensor::<Cpu, 4>(&p.k, qs);
    let y = flash_attention(q.clone(), k.clone(), v.clone(), &mask::<Cpu>(&p), p.scale);
    let grads = (y * tensor::<Cpu, 4>(&p.d_o, qs)).sum().backward();
    assert!(q.grad(&grads).is_none());
    let err = worst(&values(v.grad(&grads).unwrap()), &want.d_v);
    assert!(err <= 1e-4, "dV differs by {err:e}");
}

/// The memory model's block is this path's block.
#[test]
fn flash_blocked_query_block_is_the_modelled_one() {
    assert_eq!(
        QUERY_BLOCK as u64,
        rcoa_compiler::memory::build::BURN_FLASH_QUERY_BLOCK
    );
}

/// Set in the child process of [`blocked_transient_is_linear_in_s`].
const CHILD: &str = "RCOA_FLASH_BLOCKED_TRANSIENT_CHILD";

/// Peak heap bytes above those live before `f`, counted by the test
/// binary's allocator (process-wide, hence a child process).
fn peak_of(f: impl FnOnce()) -> u64 {
    use crate::memory::{AllocProbe, MemoryProbe};
    let mut probe = AllocProbe::new().expect("the test binary counts allocations");
    f();
    probe.sample();
    probe.step_peak()
}

/// Measures in a process of its own: other tests allocate meanwhile.
#[test]
fn blocked_transient_is_linear_in_s() {
    crate::testing::run_ignored_in_child(
        "kernels::flash::tests_blocked::blocked_transient_in_child",
        CHILD,
    );
}

/// 1 x 4 heads x 1024 queries (16 blocks), d 32: the forward and the
/// backward stay within 2 and 4 score blocks of `[b, h, QUERY_BLOCK, s]`
/// plus their outputs, far below one `[b, h, s, s]` score tensor. The
/// blocks are the CPU's excess over `compiler/src/memory/build.rs`
/// (`burn_flash_attention`), which charges the CUDA kernels (no blocks).
#[test]
#[ignore = "run in its own process by blocked_transient_is_linear_in_s"]
fn blocked_transient_in_child() {
    assert!(std::env::var_os(CHILD).is_some(), "run by its parent test");
    let p = Problem::new(1, 4, 2, 1024, 1024, 32, true, &[100], 21);
    let qs = [p.b, p.h, p.s, p.d];
    let ks = [p.b, p.kvh, p.t, p.d];
    let q = tensor::<Inner, 4>(&p.q, qs);
    let k = tensor::<Inner, 4>(&p.k, ks);
    let v = tensor::<Inner, 4>(&p.v, ks);
    let d_o = tensor::<Inner, 4>(&p.d_o, qs);
    let m = mask::<Inner>(&p);
    let run = || {
        let mut saved = None;
        let fwd = peak_of(|| {
            saved = Some(super::blocked::forward(
                q.clone(),
                k.clone(),
                v.clone(),
                &m,
                p.scale,
            ));
        });
        let (o, lse) = saved.unwrap();
        let bwd = peak_of(|| {
            let g = super::blocked::backward(
                q.clone(),
                k.clone(),
                v.clone(),
                o,
                lse,
                d_o.clone(),
                &m,
                p.scale,
            );
            drop(g);
        });
        (fwd, bwd)
    };
    run(); // thread pools and first-use buffers
    let (fwd, bwd) = run();
    let f32s = |n: usize| (n * 4) as u64;
    let block = f32s(p.b * p.h * QUERY_BLOCK * p.t);
    let (out, lse) = (f32s(p.b * p.h * p.s * p.d), f32s(p.b * p.h * p.s));
    let kv = f32s(p.b * p.kvh * p.t * p.d);
    let scores = f32s(p.b * p.h * p.s * p.t);
    println!("forward {fwd} backward {bwd} bytes; block {block}, full scores {scores}");
    // Forward: the model's 2 blocks, the output and LSE (and their per-block
    // pieces before the concatenation).
    let fwd_bound = 2 * block + 2 * (out + lse) + (64 << 10);
    // Backward: 4 blocks, dQ twice (blocks, then their concatenation), dK,
    // dV, and D = rowsum(dO ∘ O).
    let bwd_bound = 4 * block + 2 * out + 2 * kv + lse + (64 << 10);
    assert!(fwd <= fwd_bound, "forward {fwd} > {fwd_bound}");
    assert!(bwd <= bwd_bound, "backward {bwd} > {bwd_bound}");
    assert!(bwd < scores, "backward {bwd} ≥ one score tensor {scores}");
}
