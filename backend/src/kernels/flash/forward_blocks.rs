//! The forward kernel with both block products over shared-memory tiles
//! (`mma.rs`), so that on a GPU with tensor cores they run on them:
//! FlashAttention-2's forward as `flash_forward` computes it, with
//! `S = Q Kᵀ` and `P V` as cube-wide products instead of per-row FMA loops.

use cubecl::prelude::*;

use super::mma::{block_product, pairs_fit, Products, PAD_F32, PAD_HALF};
use super::tile::{
    copy_barrier, document_first, dropout_row, excluded, first_key_block, keep_factor, key_blocks,
    pad_bias, stage_tile, stage_tile_async, staged_ld, unmasked, MASKED,
};

/// One cube computes `block` query rows of one `(batch, head)` with
/// `units_per_row` units per row (`FlashLaunch::units_per_row`): unit `u`
/// takes row `CUBE_POS_X · block + u % block`, the `u / block`-th share of
/// its score columns and of its output row. The row's running maximum is
/// shared through shared memory; each unit keeps its own partial sum and its
/// share of the fp32 output in registers. Per key block:
///
/// 1. the cube stages K and V (Q was staged once);
/// 2. `S = Q Kᵀ` into an fp32 tile (`block_product`);
/// 3. each unit scales and masks its share of its row of S; the row's
///    units agree on its new maximum, take the online softmax step and
///    write their shares of its row of `P` (dropped where `dropout` says,
///    as `flash_forward` does) in the input type (FlashAttention-2 rounds P
///    the same way before its second product);
/// 4. `P V` into the same fp32 tile, which each unit adds to its share of
///    the output.
///
/// `exp` and `ln` may use the GPU's approximate intrinsics (`fast_math`;
/// CUDA's `__expf`, `__logf`: a few ulp, two instructions instead of a
/// range-reduced series), as FlashAttention's `exp2f` does. Their inputs are
/// finite (masked scores are `MASKED`), as `NotNaN` and `NotInf` promise.
/// wgpu has no fast math and ignores it. The backward kernels do the same.
///
/// With `async_copy` (a trial on CUDA: `FlashLaunch::async_copy`), the
/// tiles are staged with `cp.async` (`tile::stage_tile_async`, `copy`
/// elements a copy), each under its own barrier, and the next block's
/// copies are issued as soon as this block's tile is free: K's after the
/// `S` product, V's after the `P V` product. So V's load runs under the
/// `S` product and the softmax, and K's under the softmax and `P V`,
/// where a synchronous stage waits for both before any product.
///
/// Same arguments and outputs as `flash_forward`, and `units_per_row`,
/// which divides `block` and `head_dim`; the cube has `block ·
/// units_per_row` units. `head_dim` must equal the tensors' last extent;
/// with `Products::TensorCores`, F must be f16 or bf16 and `head_dim` and
/// `block` multiples of 16 (the host checks).
#[cube(launch, fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
// `collapsible_if`: the nested tests below keep the compile-time one apart.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_forward_blocks<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
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
    #[comptime] units_per_row: usize,
    #[comptime] causal: bool,
    #[comptime] padding: bool,
    #[comptime] documents: bool,
    #[comptime] dropout: bool,
    #[comptime] unroll: bool,
    #[comptime] products: Products,
    #[comptime] tile_pairs: bool,
    #[comptime] async_copy: bool,
    #[comptime] copy: usize,
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
    // This unit's row in the block, and its share of that row: key columns
    // `c0s ..` of S and P, head-dim columns `c0d ..` of the output.
    let lr = unit % block;
    let share = unit / block;
    let cols = comptime![block / units_per_row];
    let part = comptime![head_dim / units_per_row];
    // Whether the block products take 2 × 2 tiles per plane (`tile_pairs`,
    // where `pairs_fit`, counting planes of 32 units as on CUDA): those of
    // block × block, and those of block × head dim.
    let planes = comptime![block * units_per_row / 32];
    let pairs_bb = comptime![tile_pairs && pairs_fit(block, block, planes)];
    let pairs_bd = comptime![tile_pairs && pairs_fit(block, head_dim, planes)];
    let c0s = share * cols;
    // The cube's units, as the launch sets them (`tile::stage_tile`).
    let units = comptime![block * units_per_row];
    let c0d = share * part;
    let first = CUBE_POS_X as usize * block;
    let row = first + lr;
    let live = row < s;
    let r = min(row, s - 1);

    // Q, K and V with padded rows (`staged_ld`).
    let hd_ld = comptime![staged_ld(head_dim)];
    let mut qs = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    let mut ks = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    let mut vs = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    // Row strides of the tiles units take one row each (`PAD_F32`).
    let s_ld = block + PAD_F32;
    let out_ld = head_dim + PAD_F32;
    let p_ld = block + PAD_HALF;
    let mut ps = SharedMemory::<F>::new_aligned(block * p_ld, 128usize);
    // S, then P V: never alive at once.
    let mut s32 = SharedMemory::<f32>::new_aligned(block * comptime![s_ld.max(out_ld)], 128usize);
    // Each unit's partial maximum of its row (then, at the end, its sum):
    // `[units_per_row, block]`.
    let mut shared = SharedMemory::<f32>::new(block * units_per_row);

    let qbase = bi * q.stride(0) + hi * q.stride(1);
    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);
    let blocks = key_blocks(first, block, s, t, causal);
    // The first key of this unit's row's document, and of the block's first and
    // last rows' (packed rows; 0 otherwise).
    let doc_lo = document_first(spans, bi, r, documents);
    let lo_first = document_first(spans, bi, min(first, s - 1), documents);
    let lo_last = document_first(spans, bi, min(first + block, s) - 1, documents);
    let start = first_key_block(first, block, window, lo_first);
    // With `async_copy`: K's copies (and Q's, the first time) complete on
    // `k_ready`, V's on `v_ready`; every unit arrives on each once per key
    // block. Both start with block 0's copies in flight.
    // (None elsewhere: wgpu has no barrier objects.)
    let k_ready = copy_barrier(async_copy);
    let v_ready = copy_barrier(async_copy);
    if async_copy {
        stage_tile_async::<F, N>(
            q, &mut qs, qbase, first, s, block, head_dim, hd_ld, units, copy,
        );
        let j0 = start * block;
        stage_tile_async::<F, N>(
            k, &mut ks, kbase, j0, t, block, head_dim, hd_ld, units, copy,
        );
        k_ready.unwrap().commit_copy_async();
        stage_tile_async::<F, N>(
            v, &mut vs, vbase, j0, t, block, head_dim, hd_ld, units, copy,
        );
        v_ready.unwrap().commit_copy_async();
    } else {
        stage_tile::<F, N>(q, &mut qs, qbase, first, s, block, head_dim, hd_ld, units);
    }

    let mut acc = Array::<f32>::new(part);
    #[unroll(unroll)]
    for c in 0..part {
        acc[c] = f32::new(0.0);
    }
    // The row's running maximum (the same in all its units) and this
    // unit's sum over its columns.
    let mut m = f32::new(MASKED);
    let mut l = f32::new(0.0);
    let dkey = dropout_row(dropout_seed, bh, r, dropout);

    for kb in start..blocks {
        let j0 = kb * block;
        let next = j0 + block;
        if async_copy {
            // Also a barrier of the whole cube: every unit is past the last
            // block's reads of S's tile.
            k_ready.unwrap().arrive_and_wait();
        } else {
            stage_tile::<F, N>(k, &mut ks, kbase, j0, t, block, head_dim, hd_ld, units);
            stage_tile::<F, N>(v, &mut vs, vbase, j0, t, block, head_dim, hd_ld, units);
            sync_cube();
        }

        block_product::<F>(
            &qs, hd_ld, false, &ks, hd_ld, true, &mut s32, 0, s_ld, block, block, head_dim,
            products, pairs_bb,
        );
        sync_cube();
        // (Nested: a compile-time test joined to a run-time one would
        // expand the body for the synchronous kernel too.)
        if async_copy {
            if kb + 1 < blocks {
                // K's tile is free: the next block's K loads under the softmax.
                stage_tile_async::<F, N>(
                    k, &mut ks, kbase, next, t, block, head_dim, hd_ld, units, copy,
                );
                k_ready.unwrap().commit_copy_async();
            }
        }

        // This unit's share of its row of S: scaled, masked, its maximum.
        let n = min(block, t - j0);
        let mut mine = f32::new(MASKED);
        if unmasked(first, j0, block, s, t, causal, padding, window, lo_last) {
            for jc in 0..cols {
                let jl = c0s + jc;
                let x = s32[lr * s_ld + jl] * scale;
                s32[lr * s_ld + jl] = x;
                mine = max(mine, x);
            }
        } else {
            for jc in 0..cols {
                let jl = c0s + jc;
                let j = j0 + jl;
                let mut x = f32::new(MASKED);
                if jl < n && !excluded(j, r, t, causal, window, doc_lo, r, documents) {
                    x = s32[lr * s_ld + jl] * scale;
                    if padding {
                        x += pad_bias(key_bias, bi, j);
                    }
                }
                s32[lr * s_ld + jl] = x;
                mine = max(mine, x);
            }
        }
        // The row's maximum over its units' shares.
        shared[share * block + lr] = mine;
        sync_cube();
        let mut mb = m;
        for u in 0..units_per_row {
            mb = max(mb, shared[u * block + lr]);
        }
        let alpha = (m - mb).exp();
        l *= alpha;
        #[unroll(unroll)]
        for c in 0..part {
            acc[c] *= alpha;
        }
        for jc in 0..cols {
            let jl = c0s + jc;
            let x = s32[lr * s_ld + jl];
            let p = select(x > f32::new(MASKED), (x - mb).exp(), f32::new(0.0));
            l += p;
            // Dropout after the softmax: l sums every probability.
            let z = keep_factor(dkey, j0 + jl, drop_threshold, drop_scale, dropout);
            ps[lr * p_ld + jl] = F::cast_from(p * z);
        }
        m = mb;
        if async_copy {
            // Also the barrier after P's tile is written.
            v_ready.unwrap().arrive_and_wait();
        } else {
            sync_cube();
        }

        block_product::<F>(
            &ps, p_ld, false, &vs, hd_ld, false, &mut s32, 0, out_ld, block, head_dim, block,
            products, pairs_bd,
        );
        sync_cube();
        if async_copy {
            if kb + 1 < blocks {
                // V's tile is free: the next block's V loads under S and the softmax.
                stage_tile_async::<F, N>(
                    v, &mut vs, vbase, next, t, block, head_dim, hd_ld, units, copy,
                );
                v_ready.unwrap().commit_copy_async();
            }
        }
        #[unroll(unroll)]
        for c in 0..part {
            acc[c] += s32[lr * out_ld + c0d + c];
        }
    }

    // The row's sum over its units' shares (every unit has read the last
    // maxima: a barrier came after).
    shared[share * block + lr] = l;
    sync_cube();
    let mut total = f32::new(0.0);
    for u in 0..units_per_row {
        total += shared[u * block + lr];
    }
    if live {
        let ob = bi * out.stride(0) + hi * out.stride(1) + row * out.stride(2);
        let inv = f32::new(1.0) / total;
        #[unroll(unroll)]
        for c in 0..part {
            out[ob + (c0d + c) * out.stride(3)] = F::cast_from(acc[c] * inv);
        }
        if share == 0 {
            lse[bi * lse.stride(0) + hi * lse.stride(1) + row * lse.stride(2)] = m + total.ln();
        }
    }
}
