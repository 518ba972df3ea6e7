//! The backward kernels with their block products over shared-memory tiles
//! (`mma.rs`), so that on a GPU with tensor cores they run on them. Two
//! ways: the same split, arguments and results as `backward.rs` (no
//! atomics; dK and dV per key block, dQ per query block), or one pass over
//! key blocks that also adds dQ atomically (`one_pass`). Against
//! `backward.rs`, what changes is who computes what:
//!
//! - the products (`S`, `dP`, `Pᵀ dO`, `dSᵀ Q`, `dS K`) are cube-wide
//!   `block_product`s;
//! - the units of a row (`units_per_row` of them) share its columns: each
//!   turns its share of the score row into `P` and `dS = P ∘ (dP − D)`
//!   (rounded to the input type before the next product, as
//!   FlashAttention-2 does), and keeps its share of the gradient row in
//!   fp32 registers;
//! - with dropout `Z` (`tile::keep_factor`), `dV` takes `P ∘ Z` and `dS`
//!   takes `dP ∘ Z`, as in `backward.rs`.

use cubecl::prelude::*;

use super::mma::{block_product, pairs_fit, Products, PAD_F32, PAD_HALF};
use super::tile::{
    copy_barrier, document_first, document_last, dropout_row, excluded, first_key_block,
    first_query_block, keep_factor, key_blocks, pad_bias, query_blocks, stage_tile,
    stage_tile_async, staged_ld, unmasked, MASKED,
};

/// Adds rows `i0 ..` (those below `s`) of head `hi` of batch row `bi`
/// from the fp32 `[rows, head_dim]` tile `src` (row stride `ld`) to `acc`,
/// atomically. The whole cube adds, consecutive units taking consecutive
/// elements, so a plane's adds to one row are coalesced.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_rows(
    acc: &mut Tensor<Atomic<f32>>,
    src: &SharedMemory<f32>,
    bi: usize,
    hi: usize,
    i0: usize,
    s: usize,
    #[comptime] rows: usize,
    #[comptime] head_dim: usize,
    ld: usize,
) {
    let base = bi * acc.stride(0) + hi * acc.stride(1);
    let units = CUBE_DIM as usize;
    let mut e = UNIT_POS as usize;
    while e < rows * head_dim {
        let r = e / head_dim;
        let c = e % head_dim;
        if i0 + r < s {
            acc[base + (i0 + r) * acc.stride(2) + c * acc.stride(3)].fetch_add(src[r * ld + c]);
        }
        e += units;
    }
}

/// dK and dV for `block` key rows of one `(batch, kv head)`, with
/// `units_per_row` units per key row: unit `u` takes key row
/// `CUBE_POS_X · block + u % block` and the `u / block`-th share of its
/// columns. Per query block of each query head on this kv head: stage q
/// and dO, and the rows' LSE and D (`d_rows [b, h, s]`, from
/// `scratch::row_dots`); `Sᵀ = K Qᵀ` and `dPᵀ = V dOᵀ` (key rows by query columns, so each
/// unit's row is its key's); each unit forms its share of its row of `Pᵀ`
/// and `dSᵀ`; then `dV += Pᵀ dO` and `dK += dSᵀ Q`, each unit keeping its
/// share of the row's columns in registers.
///
/// With `one_pass` it also computes dQ, FlashAttention-2's way: per query
/// block, `dS K` (a fifth product, from the `dSᵀ` tile it already holds)
/// added to the fp32 `d_q_acc [b, h, s, d]` (zeroed before) with atomic
/// adds, since every key block adds to the same query rows. That saves
/// `flash_backward_q_blocks`, which computes S and dP again: 5 block
/// products instead of 7. Without it `d_q_acc` is a placeholder never
/// touched.
///
/// With `async_copy` (the trial `forward_blocks` describes), the tiles are
/// staged with `cp.async`, q's and dO's each under its own barrier, and the
/// next query block's are issued as soon as this one's are free: dO's after
/// the `dV` product, q's after the `dK` product. So dO's load runs under
/// `dK` (and `dQ`), and q's under `dQ` and its atomic adds.
///
/// Arguments as `flash_backward_kv`'s, with `d_rows` where it takes `o`,
/// and `units_per_row`, which divides
/// `block` and `head_dim` (`FlashLaunch::units_per_row`); the cube has
/// `block · units_per_row` units. With `Products::TensorCores`, F must be f16
/// or bf16 and `head_dim` and `block` multiples of 16.
#[cube(launch, fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
// `collapsible_if`: the nested tests keep the compile-time one apart.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_kv_blocks<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    d_rows: &Tensor<f32>,
    key_bias: &Tensor<f32>,
    dropout_seed: &Tensor<u32>,
    spans: &Tensor<u32>,
    d_k: &mut Tensor<F>,
    d_v: &mut Tensor<F>,
    d_q_acc: &mut Tensor<Atomic<f32>>,
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
    #[comptime] one_pass: bool,
    #[comptime] async_copy: bool,
    #[comptime] copy: usize,
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
    // This unit's key row, and its share of that row's columns: query
    // columns `c0s ..` of the score rows, head-dim columns `c0d ..` of dK, dV.
    let row = unit % block;
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
    let j = first + row;
    let live = j < t;
    let jr = min(j, t - 1);

    // The staged tiles' rows are padded (`staged_ld`).
    let hd_ld = comptime![staged_ld(head_dim)];
    let mut ks = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    let mut vs = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    let mut qs = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    let mut dos = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    // Row strides of the tiles units take one row each (`PAD_F32`).
    let s_ld = block + PAD_F32;
    let out_ld = head_dim + PAD_F32;
    let p_ld = block + PAD_HALF;
    let mut pt = SharedMemory::<F>::new_aligned(block * p_ld, 128usize);
    let mut dst = SharedMemory::<F>::new_aligned(block * p_ld, 128usize);
    // Sᵀ then dPᵀ side by side; later each product's [block, head_dim] out.
    let mut work =
        SharedMemory::<f32>::new_aligned(block * comptime![(2 * s_ld).max(out_ld)], 128usize);
    let mut ls = SharedMemory::<f32>::new(block);
    let mut drow = SharedMemory::<f32>::new(block);
    // The block's query rows' dropout keys, hashed once per row, not per score.
    let mut keys = SharedMemory::<u32>::new(block);

    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);
    // The last query of this unit's key's document, and of the block's last key's
    // (packed rows; s − 1 otherwise).
    let doc_hi = document_last(spans, bi, jr, s, documents);
    let hi_last = document_last(spans, bi, min(first + block, t) - 1, s, documents);
    let blocks = query_blocks(first, block, s, window, hi_last);
    let start = first_query_block(first, block, s, causal);
    let group = group as usize;
    // With `async_copy`: K's, V's and q's copies complete on `q_ready`,
    // dO's on `do_ready`; every unit arrives on each once per query block,
    // and once more at the end. Both start with the first query block's
    // copies in flight. (None elsewhere: wgpu has no barrier objects.)
    let q_ready = copy_barrier(async_copy);
    let do_ready = copy_barrier(async_copy);
    if async_copy {
        let hi0 = kvh * group;
        let qbase0 = bi * q.stride(0) + hi0 * q.stride(1);
        let dobase0 = bi * d_o.stride(0) + hi0 * d_o.stride(1);
        let i00 = start * block;
        stage_tile_async::<F, N>(
            k, &mut ks, kbase, first, t, block, head_dim, hd_ld, units, copy,
        );
        stage_tile_async::<F, N>(
            v, &mut vs, vbase, first, t, block, head_dim, hd_ld, units, copy,
        );
        stage_tile_async::<F, N>(
            q, &mut qs, qbase0, i00, s, block, head_dim, hd_ld, units, copy,
        );
        q_ready.unwrap().commit_copy_async();
        stage_tile_async::<F, N>(
            d_o, &mut dos, dobase0, i00, s, block, head_dim, hd_ld, units, copy,
        );
        do_ready.unwrap().commit_copy_async();
    } else {
        stage_tile::<F, N>(k, &mut ks, kbase, first, t, block, head_dim, hd_ld, units);
        stage_tile::<F, N>(v, &mut vs, vbase, first, t, block, head_dim, hd_ld, units);
    }
    let mut dk = Array::<f32>::new(part);
    let mut dv = Array::<f32>::new(part);
    #[unroll(unroll)]
    for c in 0..part {
        dk[c] = f32::new(0.0);
        dv[c] = f32::new(0.0);
    }
    let mut bias = f32::new(0.0);
    if padding {
        bias = pad_bias(key_bias, bi, jr);
    }

    for g in 0..group {
        let hi = kvh * group + g;
        let qbase = bi * q.stride(0) + hi * q.stride(1);
        let dobase = bi * d_o.stride(0) + hi * d_o.stride(1);
        for qb in start..blocks {
            let i0 = qb * block;
            // The query block after this one (this head's next, or the next
            // head's first), for the asynchronous copies.
            let last_here = qb + 1 == blocks;
            let next_g = select(last_here, g + 1, g);
            let next_i0 = select(last_here, start * block, i0 + block);
            let next_hi = kvh * group + next_g;
            let has_next = next_g < group;
            // The first `block` units load query row i0 + unit's LSE and D
            // (`scratch::row_dots`; whole planes: the others skip them
            // together) before staging q and dO, so that all those loads
            // are in flight together, and store them after.
            let ir = min(i0 + unit, s - 1);
            let mut lse_i = f32::new(0.0);
            let mut d_i = f32::new(0.0);
            if unit < block {
                lse_i = lse[bi * lse.stride(0) + hi * lse.stride(1) + ir * lse.stride(2)];
                d_i = d_rows[bi * d_rows.stride(0) + hi * d_rows.stride(1) + ir * d_rows.stride(2)];
            }
            if async_copy {
                // Also a barrier of the whole cube: every unit is past the
                // last block's reads of the score rows and the work tile.
                q_ready.unwrap().arrive_and_wait();
                do_ready.unwrap().arrive_and_wait();
            } else {
                stage_tile::<F, N>(q, &mut qs, qbase, i0, s, block, head_dim, hd_ld, units);
                stage_tile::<F, N>(d_o, &mut dos, dobase, i0, s, block, head_dim, hd_ld, units);
            }
            if unit < block {
                ls[unit] = lse_i;
                drow[unit] = d_i;
                if dropout {
                    keys[unit] = dropout_row(dropout_seed, bi * heads + hi, ir, dropout);
                }
            }
            sync_cube();

            block_product::<F>(
                &ks, hd_ld, false, &qs, hd_ld, true, &mut work, 0, s_ld, block, block, head_dim,
                products, pairs_bb,
            );
            block_product::<F>(
                &vs,
                hd_ld,
                false,
                &dos,
                hd_ld,
                true,
                &mut work,
                block * s_ld,
                s_ld,
                block,
                block,
                head_dim,
                products,
                pairs_bb,
            );
            sync_cube();

            let lo_last = document_first(spans, bi, min(i0 + block, s) - 1, documents);
            if unmasked(i0, first, block, s, t, causal, padding, window, lo_last) {
                for ic in 0..cols {
                    let il = c0s + ic;
                    let p = (work[row * s_ld + il] * scale - ls[il]).exp();
                    let z = keep_factor(keys[il], jr, drop_threshold, drop_scale, dropout);
                    let ds = p * (work[(block + row) * s_ld + il] * z - drow[il]) * scale;
                    pt[row * p_ld + il] = F::cast_from(p * z);
                    dst[row * p_ld + il] = F::cast_from(ds);
                }
            } else {
                for ic in 0..cols {
                    let il = c0s + ic;
                    let i = i0 + il;
                    // A query past the end, or (causal) before this key, or a
                    // key row past the end (it repeats key t − 1; one pass
                    // would add that key's term to dQ twice): no term.
                    let skip =
                        !live || i >= s || excluded(jr, i, t, causal, window, 0, doc_hi, documents);
                    let mut p = f32::new(0.0);
                    let mut ds = f32::new(0.0);
                    let mut z = f32::new(1.0);
                    if !skip {
                        let x = work[row * s_ld + il] * scale + bias;
                        p = select(x > f32::new(MASKED), (x - ls[il]).exp(), f32::new(0.0));
                        z = keep_factor(keys[il], jr, drop_threshold, drop_scale, dropout);
                        ds = p * (work[(block + row) * s_ld + il] * z - drow[il]) * scale;
                    }
                    pt[row * p_ld + il] = F::cast_from(p * z);
                    dst[row * p_ld + il] = F::cast_from(ds);
                }
            }
            sync_cube();

            block_product::<F>(
                &pt, p_ld, false, &dos, hd_ld, false, &mut work, 0, out_ld, block, head_dim, block,
                products, pairs_bd,
            );
            sync_cube();
            // (Nested: a compile-time test joined to a run-time one would
            // expand the body for the synchronous kernel too.)
            if async_copy {
                if has_next {
                    // dO's tile is free: the next block's dO loads under dK.
                    let base = bi * d_o.stride(0) + next_hi * d_o.stride(1);
                    stage_tile_async::<F, N>(
                        d_o, &mut dos, base, next_i0, s, block, head_dim, hd_ld, units, copy,
                    );
                    do_ready.unwrap().commit_copy_async();
                }
            }
            #[unroll(unroll)]
            for c in 0..part {
                dv[c] += work[row * out_ld + c0d + c];
            }
            sync_cube();
            block_product::<F>(
                &dst, p_ld, false, &qs, hd_ld, false, &mut work, 0, out_ld, block, head_dim, block,
                products, pairs_bd,
            );
            sync_cube();
            if async_copy {
                if has_next {
                    // q's tile is free: the next block's q loads under dQ.
                    let base = bi * q.stride(0) + next_hi * q.stride(1);
                    stage_tile_async::<F, N>(
                        q, &mut qs, base, next_i0, s, block, head_dim, hd_ld, units, copy,
                    );
                    q_ready.unwrap().commit_copy_async();
                }
            }
            #[unroll(unroll)]
            for c in 0..part {
                dk[c] += work[row * out_ld + c0d + c];
            }
            sync_cube();
            if one_pass {
                // dQ += dS K for these queries, from the dSᵀ the cube holds;
                // other key blocks add theirs to the same rows.
                block_product::<F>(
                    &dst, p_ld, true, &ks, hd_ld, false, &mut work, 0, out_ld, block, head_dim,
                    block, products, pairs_bd,
                );
                sync_cube();
                add_rows(d_q_acc, &work, bi, hi, i0, s, block, head_dim, out_ld);
                sync_cube();
            }
        }
    }
    if async_copy {
        // No copy is left in flight (a cube with no query block to read
        // still issued K's, V's and the first block's).
        q_ready.unwrap().arrive_and_wait();
        do_ready.unwrap().arrive_and_wait();
    }

    if live {
        let kb = bi * d_k.stride(0) + kvh * d_k.stride(1) + j * d_k.stride(2);
        let vb = bi * d_v.stride(0) + kvh * d_v.stride(1) + j * d_v.stride(2);
        #[unroll(unroll)]
        for c in 0..part {
            d_k[kb + (c0d + c) * d_k.stride(3)] = F::cast_from(dk[c]);
            d_v[vb + (c0d + c) * d_v.stride(3)] = F::cast_from(dv[c]);
        }
    }
}

/// dQ for `block` query rows of one `(batch, head)`, with `units_per_row`
/// units per query row: unit `u` takes query row `CUBE_POS_X · block + u %
/// block` and the `u / block`-th share of its columns. Per key block: stage
/// K and V; `S = Q Kᵀ` and `dP = dO Vᵀ`; each unit forms its share of its
/// row of `dS`, with its row's LSE and D (`d_rows`, from
/// `scratch::row_dots`, as the key-block kernel reads them); then
/// `dQ += dS K`, each unit keeping its share of the row's columns in
/// registers.
///
/// Arguments as `flash_backward_q`'s, with `d_rows` where it takes `o`, and
/// `units_per_row`, as above.
#[cube(launch, fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_q_blocks<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    d_rows: &Tensor<f32>,
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
    #[comptime] units_per_row: usize,
    #[comptime] causal: bool,
    #[comptime] padding: bool,
    #[comptime] documents: bool,
    #[comptime] dropout: bool,
    #[comptime] unroll: bool,
    #[comptime] products: Products,
    #[comptime] tile_pairs: bool,
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
    // This unit's query row in the block, and its share of that row's
    // columns: key columns `c0s ..` of the score rows, head-dim columns
    // `c0d ..` of dQ.
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

    // The staged tiles' rows are padded (`staged_ld`).
    let hd_ld = comptime![staged_ld(head_dim)];
    let mut qs = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    let mut dos = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    let mut ks = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    let mut vs = SharedMemory::<F>::new_aligned(block * hd_ld, 128usize);
    let s_ld = block + PAD_F32;
    let out_ld = head_dim + PAD_F32;
    let p_ld = block + PAD_HALF;
    let mut dss = SharedMemory::<F>::new_aligned(block * p_ld, 128usize);
    // S then dP side by side; later the [block, head_dim] product dS K.
    let mut work =
        SharedMemory::<f32>::new_aligned(block * comptime![(2 * s_ld).max(out_ld)], 128usize);

    // This row's LSE and D, loaded before the staging so that all those
    // loads are in flight together.
    let lse_r = lse[bi * lse.stride(0) + hi * lse.stride(1) + r * lse.stride(2)];
    let dsum = d_rows[bi * d_rows.stride(0) + hi * d_rows.stride(1) + r * d_rows.stride(2)];
    let qbase = bi * q.stride(0) + hi * q.stride(1);
    let dobase = bi * d_o.stride(0) + hi * d_o.stride(1);
    stage_tile::<F, N>(q, &mut qs, qbase, first, s, block, head_dim, hd_ld, units);
    stage_tile::<F, N>(
        d_o, &mut dos, dobase, first, s, block, head_dim, hd_ld, units,
    );
    let mut dq = Array::<f32>::new(part);
    #[unroll(unroll)]
    for c in 0..part {
        dq[c] = f32::new(0.0);
    }
    let dkey = dropout_row(dropout_seed, bh, r, dropout);

    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);
    let doc_lo = document_first(spans, bi, r, documents);
    let lo_first = document_first(spans, bi, min(first, s - 1), documents);
    let lo_last = document_first(spans, bi, min(first + block, s) - 1, documents);
    for kb in
        first_key_block(first, block, window, lo_first)..key_blocks(first, block, s, t, causal)
    {
        let j0 = kb * block;
        stage_tile::<F, N>(k, &mut ks, kbase, j0, t, block, head_dim, hd_ld, units);
        stage_tile::<F, N>(v, &mut vs, vbase, j0, t, block, head_dim, hd_ld, units);
        sync_cube();

        block_product::<F>(
            &qs, hd_ld, false, &ks, hd_ld, true, &mut work, 0, s_ld, block, block, head_dim,
            products, pairs_bb,
        );
        block_product::<F>(
            &dos,
            hd_ld,
            false,
            &vs,
            hd_ld,
            true,
            &mut work,
            block * s_ld,
            s_ld,
            block,
            block,
            head_dim,
            products,
            pairs_bb,
        );
        sync_cube();

        let n = min(block, t - j0);
        if unmasked(first, j0, block, s, t, causal, padding, window, lo_last) {
            for jc in 0..cols {
                let jl = c0s + jc;
                let p = (work[lr * s_ld + jl] * scale - lse_r).exp();
                let z = keep_factor(dkey, j0 + jl, drop_threshold, drop_scale, dropout);
                let ds = p * (work[(block + lr) * s_ld + jl] * z - dsum) * scale;
                dss[lr * p_ld + jl] = F::cast_from(ds);
            }
        } else {
            for jc in 0..cols {
                let jl = c0s + jc;
                let j = j0 + jl;
                let mut ds = f32::new(0.0);
                if jl < n && !excluded(j, r, t, causal, window, doc_lo, r, documents) {
                    let mut x = work[lr * s_ld + jl] * scale;
                    if padding {
                        x += pad_bias(key_bias, bi, j);
                    }
                    let p = (x - lse_r).exp();
                    let z = keep_factor(dkey, j, drop_threshold, drop_scale, dropout);
                    ds = p * (work[(block + lr) * s_ld + jl] * z - dsum) * scale;
                }
                dss[lr * p_ld + jl] = F::cast_from(ds);
            }
        }
        sync_cube();

        block_product::<F>(
            &dss, p_ld, false, &ks, hd_ld, false, &mut work, 0, out_ld, block, head_dim, block,
            products, pairs_bd,
        );
        sync_cube();
        #[unroll(unroll)]
        for c in 0..part {
            dq[c] += work[lr * out_ld + c0d + c];
        }
        sync_cube();
    }

    if live {
        let qb = bi * d_q.stride(0) + hi * d_q.stride(1) + row * d_q.stride(2);
        #[unroll(unroll)]
        for c in 0..part {
            d_q[qb + (c0d + c) * d_q.stride(3)] = F::cast_from(dq[c]);
        }
    }
}
