//! The forward kernel: `O = softmax(scale · Q Kᵀ + mask) V` and the per-row
//! log-sum-exp, one query block per cube, streaming key/value blocks through
//! shared memory with an online softmax (FlashAttention-2's forward).

use cubecl::prelude::*;

use super::tile::{
    document_first, dropout_row, excluded, first_key_block, keep_factor, key_blocks, pad_bias,
    row_dot, stage_rows, unroll_rows, MASKED,
};

/// One cube computes `block` query rows of one `(batch, head)`: unit `u` owns
/// row `CUBE_POS_X · block + u` (rows past the end compute on the last row
/// and write nothing, so every unit reaches every barrier). Per key block the
/// cube stages K and V in shared memory as fp32 (coalesced: consecutive
/// units take consecutive elements); each unit scores its row
/// against the block (the `S = Q Kᵀ` block product), rescales its running
/// output by `exp(m_old − m_new)` and adds `P V` (the second block product).
/// Nothing `[s, t]`-sized exists: the scores of one row against one block
/// live in the unit's own (local) memory; its query and output rows in
/// registers (`head_dim` must be the tensors' last extent).
///
/// Shapes: `q [b, h, s, d]`, `k, v [b, h / group, t, d]` (any strides),
/// `key_bias [b, t]` (fp32, added to every query's score of key `j`: 0 or
/// the executor's `-1e9` for a pad; read only when `padding`),
/// `out [b, h, s, d]` and `lse [b, h, s]` (fp32). `causal` keeps key `j`
/// for query `i` when `j ≤ i` (the host checks `s == t`), and a sliding
/// `window` (0 for none) only the `window` keys up to `i`; with `documents`
/// (packed rows) only those of `i`'s own document, `spans [b, s, 2]`
/// (`tile::document_first`; a placeholder otherwise). `dropout`
/// multiplies each probability by `keep_factor` before `P V`: 0 or
/// `drop_scale`, as the hash of `dropout_seed [2]` and its place falls
/// against `drop_threshold` (`super::dropout`).
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_forward<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    key_bias: &Tensor<f32>,
    dropout_seed: &Tensor<u32>,
    spans: &Tensor<u32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    group: u32,
    drop_threshold: u32,
    drop_scale: f32,
    window: u32,
    #[comptime] head_dim: usize,
    #[comptime] block: usize,
    #[comptime] causal: bool,
    #[comptime] padding: bool,
    #[comptime] documents: bool,
    #[comptime] dropout: bool,
    #[comptime] unroll: bool,
    #[define(F)] _dtype: StorageType,
) {
    let heads = q.shape(1);
    let s = q.shape(2);
    let t = k.shape(2);
    let bh = CUBE_POS_Y as usize;
    let bi = bh / heads;
    let hi = bh % heads;
    let kvh = hi / group as usize;
    let unit = UNIT_POS_X as usize;
    let first = CUBE_POS_X as usize * block;
    let row = first + unit;
    let live = row < s;
    let r = min(row, s - 1);

    // The query row, scaled once, and the running output, in fp32.
    let unroll = comptime![unroll_rows(unroll, 2, head_dim)];
    let mut qr = Array::<f32>::new(head_dim);
    let mut acc = Array::<f32>::new(head_dim);
    let qb = bi * q.stride(0) + hi * q.stride(1) + r * q.stride(2);
    #[unroll(unroll)]
    for c in 0..head_dim {
        qr[c] = f32::cast_from(q[qb + c * q.stride(3)]) * scale;
        acc[c] = f32::new(0.0);
    }
    let mut m = f32::new(MASKED);
    let mut l = f32::new(0.0);
    let dkey = dropout_row(dropout_seed, bh, r, dropout);

    let mut ks = SharedMemory::<f32>::new(block * head_dim);
    let mut vs = SharedMemory::<f32>::new(block * head_dim);
    let mut sc = Array::<f32>::new(block);
    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);

    // The first key of this row's document, and of the block's first row's.
    let doc_lo = document_first(spans, bi, r, documents);
    let lo_first = document_first(spans, bi, min(first, s - 1), documents);
    for kb in
        first_key_block(first, block, window, lo_first)..key_blocks(first, block, s, t, causal)
    {
        let j0 = kb * block;
        stage_rows::<F>(k, &mut ks, kbase, j0, t, block, head_dim);
        stage_rows::<F>(v, &mut vs, vbase, j0, t, block, head_dim);
        sync_cube();

        // S = (scale · q) Kᵀ for this row and block, and its maximum. The
        // bound is a run-time value (the keys in this block), so shader
        // compilers do not unroll it.
        let n = min(block, t - j0);
        let mut mb = m;
        for jl in 0..n {
            let j = j0 + jl;
            let mut x = f32::new(MASKED);
            if !excluded(j, r, t, causal, window, doc_lo, r, documents) {
                x = row_dot(&qr, &ks, jl * head_dim, head_dim, unroll);
                if padding {
                    x += pad_bias(key_bias, bi, j);
                }
            }
            sc[jl] = x;
            mb = max(mb, x);
        }
        // Online softmax: rescale what was summed under the old maximum.
        let alpha = (m - mb).exp();
        l *= alpha;
        #[unroll(unroll)]
        for c in 0..head_dim {
            acc[c] *= alpha;
        }
        // O += P V.
        for jl in 0..n {
            let p = select(
                sc[jl] > f32::new(MASKED),
                (sc[jl] - mb).exp(),
                f32::new(0.0),
            );
            l += p;
            // Dropout after the softmax: l sums every probability.
            let pv = p * keep_factor(dkey, j0 + jl, drop_threshold, drop_scale, dropout);
            #[unroll(unroll)]
            for c in 0..head_dim {
                acc[c] += pv * vs[jl * head_dim + c];
            }
        }
        m = mb;
        sync_cube();
    }

    if live {
        let ob = bi * out.stride(0) + hi * out.stride(1) + row * out.stride(2);
        let inv = f32::new(1.0) / l;
        #[unroll(unroll)]
        for c in 0..head_dim {
            out[ob + c * out.stride(3)] = F::cast_from(acc[c] * inv);
        }
        lse[bi * lse.stride(0) + hi * lse.stride(1) + row * lse.stride(2)] = m + l.ln();
    }
}
