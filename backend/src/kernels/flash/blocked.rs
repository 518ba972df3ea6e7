//! Flash attention in plain Burn tensor ops, blocked over queries: the
//! forward keeps the output and the per-row log-sum-exp, the backward
//! recomputes the probabilities block by block from them. At most one
//! `[b, h, block, t]` score block (and its few element-wise derivatives)
//! exists at once, never `[b, h, s, t]`. Grouped-query attention folds the
//! query heads sharing a kv head into the row dimension
//! (`[b, kv_heads, group · block, d]`), so k and v are never repeated.
//!
//! This is `ExecBackend::flash_attention`'s default (the CPU path) and
//! follows the kernels' semantics (`super`).

use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use std::ops::Range;

use super::dropout::{self, FlashDropout};

/// Query rows per block. The transient is `4 · b · h · QUERY_BLOCK · t`
/// values at most (scores, probabilities, their gradient and one product).
/// `compiler/src/memory/build.rs` charges the CUDA kernels, which make none:
/// `tests_blocked` bounds this difference.
pub const QUERY_BLOCK: usize = 64;

/// The masks of one attention call.
#[derive(Clone, Debug)]
pub struct FlashMask<B: Backend> {
    /// Key `j` is kept for query `i` only when `j ≤ i` (needs `s == t`).
    pub causal: bool,
    /// A sliding window (with `causal`): key `j` is kept for query `i` only when
    /// `i − window < j` as well; 0 for none.
    pub window: usize,
    /// `[b, t]` additive bias of each key (0, or -1e9 for a pad), fp32 or
    /// the compute dtype.
    pub key_bias: Option<Tensor<B, 2>>,
    /// Packed rows (with `causal`): `[b, s, 2]` each token's document as `[start, end)`;
    /// a query sees only the keys of its own (`model::Ctx::with_documents`).
    pub documents: Option<Tensor<B, 3, Int>>,
    /// Dropout of the probabilities (training only), its mask a hash of the
    /// seed and the score's place (`super::dropout`).
    pub dropout: Option<FlashDropout<B>>,
}

/// The dropout of one call as the host hashes it: seed, threshold, scale.
#[derive(Clone, Copy)]
struct HostDropout {
    seed: u32,
    threshold: u32,
    scale: f64,
}

impl HostDropout {
    fn of<B: Backend>(mask: &FlashMask<B>) -> Option<Self> {
        mask.dropout.as_ref().map(|d| HostDropout {
            seed: d.seed_on_host(),
            threshold: dropout::threshold(d.p),
            scale: dropout::keep_scale(d.p),
        })
    }

    /// The keep factors (0, or `1 / (1 − p)`) of query rows `i0 .. i0 + n`
    /// over keys `keys`, in the blocked layout `[b, kvh, g · n, keys.len()]` and
    /// `of`'s dtype, built on the host from the hash the kernels use.
    fn factors<B: Backend>(
        &self,
        sh: &Shape,
        i0: usize,
        n: usize,
        keys: Range<usize>,
        of: &Tensor<B, 4>,
    ) -> Tensor<B, 4> {
        let h = sh.kvh * sh.g;
        let tv = keys.len();
        let mut f = Vec::with_capacity(sh.b * h * n * tv);
        for bi in 0..sh.b {
            for head in 0..h {
                for il in 0..n {
                    let row = dropout::row_key(self.seed, bi * h + head, i0 + il);
                    f.extend(keys.clone().map(|j| {
                        if dropout::keeps(row, j, self.threshold) {
                            self.scale as f32
                        } else {
                            0.0
                        }
                    }));
                }
            }
        }
        // [b, h, n, tv] is [b, kvh, g, n, tv]: the query heads of a kv head
        // are consecutive.
        let t = Tensor::<B, 4>::from_data(
            TensorData::new(f, [sh.b, sh.kvh, sh.g * n, tv]),
            &of.device(),
        );
        like(t, of)
    }
}

/// The additive score bias of the executor's masks (`model::MASK_VALUE`).
const MASK: f64 = -1.0e9;

/// `x` in `like`'s float dtype.
fn like<B: Backend, const D: usize, const E: usize>(
    x: Tensor<B, D>,
    like: &Tensor<B, E>,
) -> Tensor<B, D> {
    crate::model::to_dtype(x, FloatDType::from(like.dtype()))
}

struct Shape {
    b: usize,
    kvh: usize,
    g: usize,
    s: usize,
    t: usize,
    d: usize,
}

fn shape<B: Backend>(q: &Tensor<B, 4>, k: &Tensor<B, 4>) -> Shape {
    let [b, h, s, d] = q.dims();
    let [_, kvh, t, _] = k.dims();
    Shape {
        b,
        kvh,
        g: h / kvh,
        s,
        t,
        d,
    }
}

/// Query rows `i0 .. i0 + n` of every head, grouped under their kv head:
/// `[b, h, s, w]` → `[b, kvh, g · n, w]`.
fn rows<B: Backend>(x: &Tensor<B, 4>, sh: &Shape, i0: usize, n: usize) -> Tensor<B, 4> {
    let w = x.dims()[3];
    x.clone()
        .reshape([sh.b, sh.kvh, sh.g, sh.s, w])
        .narrow(3, i0, n)
        .reshape([sh.b, sh.kvh, sh.g * n, w])
}

/// Keys the block of queries `i0 .. i0 + n` can see: all, or causal `.. i0 + n`,
/// and under a window from its first query's oldest key, `i0 + 1 − window`.
fn visible(sh: &Shape, mask: &FlashMask<impl Backend>, i0: usize, n: usize) -> Range<usize> {
    if !mask.causal {
        return 0..sh.t;
    }
    let end = (i0 + n).min(sh.t);
    let start = if mask.window > 0 {
        (i0 + 1).saturating_sub(mask.window)
    } else {
        0
    };
    start..end
}

/// `scale · q kᵀ + masks` for one query block over its visible `keys`:
/// `[b, kvh, g · n, keys.len()]`.
#[allow(clippy::too_many_arguments)]
fn scores<B: Backend>(
    qb: Tensor<B, 4>,
    k: &Tensor<B, 4>,
    sh: &Shape,
    mask: &FlashMask<B>,
    i0: usize,
    n: usize,
    keys: &Range<usize>,
    scale: f64,
) -> Tensor<B, 4> {
    let (k0, tv) = (keys.start, keys.len());
    let kb = k.clone().narrow(2, k0, tv);
    let mut sc = qb.mul_scalar(scale).matmul(kb.swap_dims(2, 3));
    let device = sc.device();
    if mask.causal {
        // Key k0 + c against query i0 + r, as the eager bias masks it.
        let masked =
            crate::model::causal_mask::<B>([n, tv], (i0 - k0) as i64, mask.window, &device);
        let future = like(masked.float().mul_scalar(MASK), &sc);
        let future = future
            .reshape([1, 1, 1, n, tv])
            .expand([1, 1, sh.g, n, tv])
            .reshape([1, 1, sh.g * n, tv]);
        sc = sc + future;
    }
    if let Some(bias) = &mask.key_bias {
        let bias = like(bias.clone().narrow(1, k0, tv), &sc);
        sc = sc + bias.reshape([sh.b, 1, 1, tv]);
    }
    if let Some(spans) = &mask.documents {
        // Packed rows: key k0 + c is masked for query i0 + r before the start of the
        // query's document (with `causal`, the keys after it are masked already).
        let starts = spans
            .clone()
            .narrow(1, i0, n)
            .narrow(2, 0, 1)
            .reshape([sh.b, n, 1])
            .expand([sh.b, n, tv]);
        let keys = Tensor::<B, 1, Int>::arange(k0 as i64..(k0 + tv) as i64, &device)
            .reshape([1, 1, tv])
            .expand([sh.b, n, tv]);
        let other = like(keys.lower(starts).float().mul_scalar(MASK), &sc)
            .reshape([sh.b, 1, 1, n, tv])
            .expand([sh.b, 1, sh.g, n, tv])
            .reshape([sh.b, 1, sh.g * n, tv]);
        sc = sc + other;
    }
    sc
}

/// Output `[b, h, s, d]` and log-sum-exp `[b, h, s]` (in the scores' dtype).
pub fn forward<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &FlashMask<B>,
    scale: f64,
) -> (Tensor<B, 4>, Tensor<B, 3>) {
    let sh = shape(&q, &k);
    let drop = HostDropout::of(mask);
    let mut outs = Vec::new();
    let mut lses = Vec::new();
    for i0 in (0..sh.s).step_by(QUERY_BLOCK) {
        let n = QUERY_BLOCK.min(sh.s - i0);
        let keys = visible(&sh, mask, i0, n);
        let sc = scores(rows(&q, &sh, i0, n), &k, &sh, mask, i0, n, &keys, scale);
        let m = sc.clone().max_dim(3);
        let e = (sc - m.clone()).exp();
        let l = e.clone().sum_dim(3);
        // Dropout after the softmax: the sum (and the LSE) are undropped.
        let kept = match &drop {
            Some(d) => e * d.factors(&sh, i0, n, keys.clone(), &m),
            None => e,
        };
        let o = kept.matmul(v.clone().narrow(2, keys.start, keys.len())) / l.clone();
        let lse = m + l.log();
        outs.push(o.reshape([sh.b, sh.kvh, sh.g, n, sh.d]));
        lses.push(lse.reshape([sh.b, sh.kvh, sh.g, n]));
    }
    let h = sh.kvh * sh.g;
    (
        Tensor::cat(outs, 3).reshape([sh.b, h, sh.s, sh.d]),
        Tensor::cat(lses, 3).reshape([sh.b, h, sh.s]),
    )
}

/// dQ, dK, dV from the forward's inputs, output and log-sum-exp and the
/// output's gradient `d_o`.
#[allow(clippy::too_many_arguments)]
pub fn backward<B: Backend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    o: Tensor<B, 4>,
    lse: Tensor<B, 3>,
    d_o: Tensor<B, 4>,
    mask: &FlashMask<B>,
    scale: f64,
) -> (Tensor<B, 4>, Tensor<B, 4>, Tensor<B, 4>) {
    let sh = shape(&q, &k);
    let h = sh.kvh * sh.g;
    let drop = HostDropout::of(mask);
    // The softmax backward's row term D = rowsum(dO ∘ O), [b, h, s, 1]: with
    // dropout Z, O = (P ∘ Z) V and D = rowsum(P ∘ Z ∘ dO Vᵀ), the same sum.
    let big_d = (d_o.clone() * o).sum_dim(3);
    let lse = lse.reshape([sh.b, h, sh.s, 1]);
    let mut d_k = like(Tensor::<B, 4>::zeros(k.dims(), &k.device()), &k);
    let mut d_v = like(Tensor::<B, 4>::zeros(v.dims(), &v.device()), &v);
    let mut d_qs = Vec::new();
    for i0 in (0..sh.s).step_by(QUERY_BLOCK) {
        let n = QUERY_BLOCK.min(sh.s - i0);
        let keys = visible(&sh, mask, i0, n);
        let (k0, tv) = (keys.start, keys.len());
        let qb = rows(&q, &sh, i0, n);
        let dob = rows(&d_o, &sh, i0, n);
        let group_rows = |x: &Tensor<B, 4>| rows(x, &sh, i0, n);
        let sc = scores(qb.clone(), &k, &sh, mask, i0, n, &keys, scale);
        let p = (sc - group_rows(&lse)).exp();
        let (kb, vb) = (k.clone().narrow(2, k0, tv), v.clone().narrow(2, k0, tv));
        let dp = dob.clone().matmul(vb.swap_dims(2, 3));
        // With dropout, V's gradient takes the dropped probabilities, and
        // the probabilities' gradient is dP ∘ Z.
        let (dv, dp) = match &drop {
            Some(d) => {
                let z = d.factors(&sh, i0, n, keys.clone(), &p);
                let dv = (p.clone() * z.clone()).swap_dims(2, 3).matmul(dob);
                (dv, dp * z)
            }
            None => (p.clone().swap_dims(2, 3).matmul(dob), dp),
        };
        let ds = (p * (dp - group_rows(&big_d))).mul_scalar(scale);
        d_qs.push(ds.clone().matmul(kb).reshape([sh.b, sh.kvh, sh.g, n, sh.d]));
        let dk = ds.swap_dims(2, 3).matmul(qb);
        let r = [0..sh.b, 0..sh.kvh, keys.clone(), 0..sh.d];
        d_k = d_k
            .clone()
            .slice_assign(r.clone(), d_k.slice(r.clone()) + dk);
        d_v = d_v.clone().slice_assign(r.clone(), d_v.slice(r) + dv);
    }
    let d_q = Tensor::cat(d_qs, 3).reshape([sh.b, h, sh.s, sh.d]);
    (d_q, d_k, d_v)
}
