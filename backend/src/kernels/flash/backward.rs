//! The backward kernels (FlashAttention-2's, split so that no two cubes
//! write the same gradient and no atomics are needed):
//!
//! - [`flash_backward_kv`]: one cube per key block of one `(batch, kv head)`
//!   accumulates dK and dV over every query (of every query head sharing
//!   the kv head, so grouped-query attention needs no reduction afterwards);
//! - [`flash_backward_q`]: one cube per query block of one `(batch, head)`
//!   accumulates dQ over every key.
//!
//! Both recompute `P = exp(scale · q kᵀ + mask − LSE)` block by block from
//! the forward's log-sum-exp, and `D_i = Σ_c dO[i, c] · O[i, c]` (the
//! softmax backward's row term) on the fly from O and dO rows, so no
//! separate pass and no `[s, t]` tensor exists. The price is computing the
//! scores twice (once per kernel) where FA2 computes them once and adds dQ
//! with atomics.

use cubecl::prelude::*;

use super::tile::{
    document_first, document_last, dropout_row, excluded, first_key_block, first_query_block,
    keep_factor, key_blocks, pad_bias, query_blocks, row_dot, stage_rows, unroll_rows, MASKED,
};

/// dK and dV for `block` key rows of one `(batch, kv head)`; unit `u` owns
/// key row `CUBE_POS_X · block + u`. Per query block (of each of the `group`
/// query heads on this kv head) the cube stages q, dO, the LSE and D in
/// shared memory; each unit then adds `dV_j += p_ij dO_i` and
/// `dK_j += scale · p_ij (dO_i · v_j − D_i) q_i` for the block's queries.
///
/// `q, o, d_o [b, h, s, d]`, `k, v [b, h / group, t, d]`, `lse [b, h, s]`,
/// `d_k, d_v [b, h / group, t, d]` (written), `key_bias` and the dropout as
/// in the forward: with dropout `Z`, `dV_j += p_ij z_ij dO_i` and `dP` is
/// `(dO_i · v_j) z_ij`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_kv<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    o: &Tensor<F>,
    d_o: &Tensor<F>,
    lse: &Tensor<f32>,
    key_bias: &Tensor<f32>,
    dropout_seed: &Tensor<u32>,
    spans: &Tensor<u32>,
    d_k: &mut Tensor<F>,
    d_v: &mut Tensor<F>,
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
    let kv_heads = k.shape(1);
    let heads = q.shape(1);
    let s = q.shape(2);
    let t = k.shape(2);
    let bkv = CUBE_POS_Y as usize;
    let bi = bkv / kv_heads;
    let kvh = bkv % kv_heads;
    let unit = UNIT_POS_X as usize;
    let first = CUBE_POS_X as usize * block;
    let j = first + unit;
    let live = j < t;
    let jr = min(j, t - 1);

    // K, V, dK and dV rows: unrolled up to head dim 64.
    let unroll = comptime![unroll_rows(unroll, 4, head_dim)];
    let mut kr = Array::<f32>::new(head_dim);
    let mut vr = Array::<f32>::new(head_dim);
    let mut dk = Array::<f32>::new(head_dim);
    let mut dv = Array::<f32>::new(head_dim);
    let kb = bi * k.stride(0) + kvh * k.stride(1) + jr * k.stride(2);
    let vb = bi * v.stride(0) + kvh * v.stride(1) + jr * v.stride(2);
    #[unroll(unroll)]
    for c in 0..head_dim {
        kr[c] = f32::cast_from(k[kb + c * k.stride(3)]);
        vr[c] = f32::cast_from(v[vb + c * v.stride(3)]);
        dk[c] = f32::new(0.0);
        dv[c] = f32::new(0.0);
    }
    let mut bias = f32::new(0.0);
    if padding {
        bias = pad_bias(key_bias, bi, jr);
    }

    let mut qs = SharedMemory::<f32>::new(block * head_dim);
    let mut dos = SharedMemory::<f32>::new(block * head_dim);
    let mut ls = SharedMemory::<f32>::new(block);
    let mut ds_row = SharedMemory::<f32>::new(block);
    // The block's query rows' dropout keys, hashed once per row, not per score.
    let mut keys = SharedMemory::<u32>::new(block);

    // The last query of this key's document, and of the block's last key's.
    let doc_hi = document_last(spans, bi, jr, s, documents);
    let hi_last = document_last(spans, bi, min(first + block, t) - 1, s, documents);
    let blocks = query_blocks(first, block, s, window, hi_last);
    let start = first_query_block(first, block, s, causal);
    let group = group as usize;
    for g in 0..group {
        let hi = kvh * group + g;
        let qbase = bi * q.stride(0) + hi * q.stride(1);
        let dobase = bi * d_o.stride(0) + hi * d_o.stride(1);
        for qb in start..blocks {
            let i0 = qb * block;
            stage_rows::<F>(q, &mut qs, qbase, i0, s, block, head_dim);
            stage_rows::<F>(d_o, &mut dos, dobase, i0, s, block, head_dim);
            // Staged by other units: D below reads this unit's row of dO.
            sync_cube();
            // This unit's query row's LSE and D = rowsum(dO ∘ O).
            let ir = min(i0 + unit, s - 1);
            ls[unit] = lse[bi * lse.stride(0) + hi * lse.stride(1) + ir * lse.stride(2)];
            let ob = bi * o.stride(0) + hi * o.stride(1) + ir * o.stride(2);
            // Each unit starts at its own column, so that a plane's reads of
            // its rows of dO (`head_dim` apart) fall in different banks.
            let mut dsum = f32::new(0.0);
            for c in 0..head_dim {
                let cc = (c + unit) % head_dim;
                dsum += dos[unit * head_dim + cc] * f32::cast_from(o[ob + cc * o.stride(3)]);
            }
            ds_row[unit] = dsum;
            if dropout {
                keys[unit] = dropout_row(dropout_seed, bi * heads + hi, ir, dropout);
            }
            sync_cube();

            for il in 0..min(block, s - i0) {
                let i = i0 + il;
                // A query past the end, (causal) before this key, (window) too
                // far after it, or (packed rows) past its document: no term.
                let skip = i >= s || excluded(jr, i, t, causal, window, 0, doc_hi, documents);
                if !skip {
                    let x = row_dot(&kr, &qs, il * head_dim, head_dim, unroll) * scale + bias;
                    let p = select(x > f32::new(MASKED), (x - ls[il]).exp(), f32::new(0.0));
                    let z = keep_factor(keys[il], jr, drop_threshold, drop_scale, dropout);
                    let dp = row_dot(&vr, &dos, il * head_dim, head_dim, unroll) * z;
                    let dsc = p * (dp - ds_row[il]) * scale;
                    let pz = p * z;
                    #[unroll(unroll)]
                    for c in 0..head_dim {
                        dv[c] += pz * dos[il * head_dim + c];
                        dk[c] += dsc * qs[il * head_dim + c];
                    }
                }
            }
            sync_cube();
        }
    }

    if live {
        let kb = bi * d_k.stride(0) + kvh * d_k.stride(1) + j * d_k.stride(2);
        let vb = bi * d_v.stride(0) + kvh * d_v.stride(1) + j * d_v.stride(2);
        #[unroll(unroll)]
        for c in 0..head_dim {
            d_k[kb + c * d_k.stride(3)] = F::cast_from(dk[c]);
            d_v[vb + c * d_v.stride(3)] = F::cast_from(dv[c]);
        }
    }
}

/// dQ for `block` query rows of one `(batch, head)`; unit `u` owns query
/// row `CUBE_POS_X · block + u`, stages K and V blocks in shared memory and
/// adds `dQ_i += scale · p_ij (dO_i · v_j − D_i) k_j`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_q<F: Float>(
    q: &Tensor<F>,
    k: &Tensor<F>,
    v: &Tensor<F>,
    o: &Tensor<F>,
    d_o: &Tensor<F>,
    lse: &Tensor<f32>,
    key_bias: &Tensor<f32>,
    dropout_seed: &Tensor<u32>,
    spans: &Tensor<u32>,
    d_q: &mut Tensor<F>,
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

    // Q, dO and dQ rows: unrolled up to head dim 85.
    let unroll = comptime![unroll_rows(unroll, 3, head_dim)];
    let mut qr = Array::<f32>::new(head_dim);
    let mut dor = Array::<f32>::new(head_dim);
    let mut dq = Array::<f32>::new(head_dim);
    let qb = bi * q.stride(0) + hi * q.stride(1) + r * q.stride(2);
    let dob = bi * d_o.stride(0) + hi * d_o.stride(1) + r * d_o.stride(2);
    let ob = bi * o.stride(0) + hi * o.stride(1) + r * o.stride(2);
    let mut dsum = f32::new(0.0);
    #[unroll(unroll)]
    for c in 0..head_dim {
        qr[c] = f32::cast_from(q[qb + c * q.stride(3)]) * scale;
        dor[c] = f32::cast_from(d_o[dob + c * d_o.stride(3)]);
        dsum += dor[c] * f32::cast_from(o[ob + c * o.stride(3)]);
        dq[c] = f32::new(0.0);
    }
    let lse_r = lse[bi * lse.stride(0) + hi * lse.stride(1) + r * lse.stride(2)];
    let dkey = dropout_row(dropout_seed, bh, r, dropout);

    let mut ks = SharedMemory::<f32>::new(block * head_dim);
    let mut vs = SharedMemory::<f32>::new(block * head_dim);
    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);
    let doc_lo = document_first(spans, bi, r, documents);
    let lo_first = document_first(spans, bi, min(first, s - 1), documents);
    for kb in
        first_key_block(first, block, window, lo_first)..key_blocks(first, block, s, t, causal)
    {
        let j0 = kb * block;
        stage_rows::<F>(k, &mut ks, kbase, j0, t, block, head_dim);
        stage_rows::<F>(v, &mut vs, vbase, j0, t, block, head_dim);
        sync_cube();
        for jl in 0..min(block, t - j0) {
            let j = j0 + jl;
            if !excluded(j, r, t, causal, window, doc_lo, r, documents) {
                let mut x = row_dot(&qr, &ks, jl * head_dim, head_dim, unroll);
                if padding {
                    x += pad_bias(key_bias, bi, j);
                }
                let p = (x - lse_r).exp();
                let z = keep_factor(dkey, j, drop_threshold, drop_scale, dropout);
                let dp = row_dot(&dor, &vs, jl * head_dim, head_dim, unroll) * z;
                let dsc = p * (dp - dsum) * scale;
                #[unroll(unroll)]
                for c in 0..head_dim {
                    dq[c] += dsc * ks[jl * head_dim + c];
                }
            }
        }
        sync_cube();
    }

    if live {
        let qb = bi * d_q.stride(0) + hi * d_q.stride(1) + row * d_q.stride(2);
        #[unroll(unroll)]
        for c in 0..head_dim {
            d_q[qb + c * d_q.stride(3)] = F::cast_from(dq[c]);
        }
    }
}
