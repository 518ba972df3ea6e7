//! The backward kernels in the register structure of `forward_registers`: each warp owns
//! 16 rows and keeps its gradient rows in registers, as PTX `m16n8k16` accumulator
//! fragments, from the first block of the other side to the last. Two kernels, as
//! `backward_blocks`: the key kernel alone in one pass (`one_pass`: dQ added atomically
//! to an fp32 accumulator, five products per pair of blocks), or both (no atomics; dQ's
//! sums in a fixed order):
//!
//! - [`flash_backward_kv_registers`]: a warp owns 16 keys and holds K's and V's rows as
//!   `A` fragments. Per staged block of 64 queries (q, dO, their LSE and D), 16 queries at
//!   a time: `Sᵀ = K Qᵀ` and `dPᵀ = V dOᵀ` on the tensor cores, `Pᵀ` and
//!   `dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale` in place, then `dV += Pᵀ dO` and `dK += dSᵀ Q` with
//!   `Pᵀ` and `dSᵀ` as the `A` fragments, straight from the accumulators
//!   (`fragments::scores`). With `one_pass`, each block's `dS` also goes to shared memory,
//!   transposed, and each warp adds `dS K` for 16 of its queries to dQ's accumulator
//!   (`add_dq`).
//! - [`flash_backward_q_registers`] (two passes): a warp owns 16 queries and holds q's and
//!   dO's rows. Per staged block of 64 keys (K, V), 16 keys at a time: `S = Q Kᵀ`,
//!   `dP = dO Vᵀ`, `dS`, then `dQ += dS K`.
//!
//! The other side's blocks stream through shared memory one at a time, or the next one
//! copied ahead while this one is read (`stream`). Nothing goes through shared memory but
//! the staged tiles, (key kernel) the LSE and D of the staged queries and, in one pass,
//! `dS`: the block-product kernels store every product's result to shared memory and
//! reload it for the next (docs/flash-attention.md), and that is where 145 of the 350M
//! step's 180 attention milliseconds went.
//!
//! `D = rowsum(dO ∘ O)` comes from `scratch::row_dots`, as for the block kernels. Takes
//! what the register forward takes: 16-bit inputs on CUDA, head dims of 16 to 128 in 16s,
//! causal or not, key padding, grouped-query attention; not dropout.
//! [`Fragments::Emulated`] runs both on any device, which is how lavapipe checks them.

use cubecl::prelude::*;

use super::fragments::{a_fragments, accumulate, scores, zeros, Fragments, Pair};
use super::launch::{BackwardInputs, BackwardOutputs, FlashLaunch};
use super::stream::{check_shared, commit, ready_barrier, stage_block, stage_value, tile_of, wait};
pub use super::stream::{Staging, BLOCK, UNITS};
use super::tile::{
    document_first, document_last, excluded, first_key_block, first_query_block, key_blocks,
    pad_bias, pad_bias_index, query_blocks, stage_tile, stage_tile_at, staged_ld, unmasked,
};

/// The largest head dim at which the key kernel holds K's and V's rows in registers beside
/// dK and dV, and the query kernel q's and dO's beside dQ: at 128, ptxas (sm_90a) needed
/// 255 registers and spilled (76 bytes in the key kernel, 8 in the query kernel).
const RESIDENT_HEAD_DIM: usize = 64;

/// The `A` fragment of the 16 × 16 block whose 4 fp32 pairs `fragments::scores` returned
/// (turned into `Pᵀ`, `dSᵀ` or `dS`), rounded to the input type.
#[cube]
fn as_a<F: Float>(c: &Array<Pair<f32>>) -> Array<Pair<F>> {
    let mut a = Array::<Pair<F>>::new(4usize);
    #[unroll]
    for p in 0..4usize {
        a[p] = Pair::<F>::cast_from(c[p]);
    }
    a
}

/// `p` and `ds = p (dp − d) · scale` of one score: `p = exp(x − lse)` where the score `x`
/// (scaled, with its key's bias) takes part, 0 where `masked`.
#[cube]
fn probability_and_gradient(
    x: f32,
    dp: f32,
    lse: f32,
    d: f32,
    scale: f32,
    masked: bool,
) -> (f32, f32) {
    let p = select(masked, f32::new(0.0), (x - lse).exp());
    (p, p * (dp - d) * scale)
}

/// The one-pass key kernel's `dQ += dS K` for the calling warp's 16 queries of a block (rows
/// `i0 ..+ 16` of head `hi`; those from `s` on are not added): `dS` over the block's keys
/// from element `at` of `dss` (row stride `staged_ld(BLOCK)`), K from `ks`, added to the fp32
/// `acc` atomically. 16 columns at a time, so that 8 accumulators are live beside dK's and
/// dV's, not `head_dim / 2`.
#[cube]
#[allow(clippy::too_many_arguments)]
fn add_dq<F: Float>(
    dss: &SharedMemory<F>,
    ks: &SharedMemory<F>,
    acc: &mut Tensor<Atomic<f32>>,
    bi: usize,
    hi: usize,
    i0: usize,
    at: usize,
    s: usize,
    lane: usize,
    scratch: &mut SharedMemory<f32>,
    #[comptime] head_dim: usize,
    #[comptime] hd_ld: usize,
    #[comptime] frags: Fragments,
) {
    let unroll = comptime![frags == Fragments::Registers];
    let ds_ld = comptime![staged_ld(BLOCK)];
    let key_steps = comptime![BLOCK / 16];
    let dsf = a_fragments::<F>(dss, at, ds_ld, lane, key_steps, frags);
    let base = bi * acc.stride(0) + hi * acc.stride(1);
    let quad = lane % 4;
    // A loop on the GPU too, as the key kernel's over a block's rows: only offsets depend on
    // `c16`.
    for c16 in 0..comptime![head_dim / 16] {
        let mut part = zeros(2usize, unroll);
        #[unroll(unroll)]
        for kk in 0..key_steps {
            let mut a = Array::<Pair<F>>::new(4usize);
            #[unroll]
            for p in 0..4usize {
                a[p] = dsf[kk * 4 + p];
            }
            let from = kk * 16 * hd_ld + c16 * 16;
            accumulate::<F>(&a, ks, from, hd_ld, &mut part, lane, scratch, 2usize, frags);
        }
        #[unroll]
        for half in 0..2usize {
            let row = i0 + lane / 4 + half * 8;
            if row < s {
                let rb = base + row * acc.stride(2);
                #[unroll]
                for n in 0..2usize {
                    let pair = part[n * 2 + half];
                    #[unroll]
                    for e in 0..2usize {
                        let col = c16 * 16 + n * 8 + quad * 2 + e;
                        acc[rb + col * acc.stride(3)].fetch_add(pair[e]);
                    }
                }
            }
        }
    }
}

/// Stages the query block from `i0` of head `hi` for [`flash_backward_kv_registers`] into
/// tile `tile`: q's and dO's rows, and their LSE and D (rows past the end read the last
/// one's).
#[cube]
#[allow(clippy::too_many_arguments)]
fn stage_queries<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    d_rows: &Tensor<f32>,
    qs: &mut SharedMemory<F>,
    dos: &mut SharedMemory<F>,
    ls: &mut SharedMemory<f32>,
    drow: &mut SharedMemory<f32>,
    tile: usize,
    bi: usize,
    hi: usize,
    i0: usize,
    #[comptime] head_dim: usize,
    #[comptime] hd_ld: usize,
    #[comptime] staging: Staging,
) {
    let s = q.shape(2);
    let qbase = bi * q.stride(0) + hi * q.stride(1);
    let dobase = bi * d_o.stride(0) + hi * d_o.stride(1);
    stage_block::<F, N>(q, qs, tile, qbase, i0, s, head_dim, hd_ld, staging);
    stage_block::<F, N>(d_o, dos, tile, dobase, i0, s, head_dim, hd_ld, staging);
    let unit = UNIT_POS as usize;
    if unit < BLOCK {
        let ir = min(i0 + unit, s - 1);
        let at = tile * BLOCK + unit;
        let li = bi * lse.stride(0) + hi * lse.stride(1) + ir * lse.stride(2);
        let di = bi * d_rows.stride(0) + hi * d_rows.stride(1) + ir * d_rows.stride(2);
        stage_value(lse, li, ls, at, staging);
        stage_value(d_rows, di, drow, at, staging);
    }
}

/// dK and dV for [`BLOCK`] keys of one `(batch, kv head)`; cubes of [`UNITS`] over
/// (`t / BLOCK`, `b · kv_heads`). Inputs as `flash_backward_kv_blocks`'s (`d_rows` from
/// `scratch::row_dots`; with `one_pass` dQ's share added to `d_q_acc`, otherwise a
/// placeholder never touched), without dropout; `head_dim` as `flash_forward_registers`'s. The
/// query blocks of every query head on the kv head stream through as `staging` says, one
/// sequence of blocks (`stream`): q, dO, their LSE and D.
#[cube(launch, fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
// `collapsible_if`: as in the query kernel below.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_kv_registers<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    d_rows: &Tensor<f32>,
    key_bias: &Tensor<f32>,
    spans: &Tensor<u32>,
    d_k: &mut Tensor<F>,
    d_v: &mut Tensor<F>,
    d_q_acc: &mut Tensor<Atomic<f32>>,
    scale: f32,
    group: u32,
    window_len: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] windowed: bool,
    #[comptime] padding: bool,
    #[comptime] documents: bool,
    #[comptime] one_pass: bool,
    #[comptime] frags: Fragments,
    #[comptime] staging: Staging,
    #[define(F)] _dtype: StorageType,
) {
    // Without a window its bound is the constant 0, which the compiler folds away: at head
    // dim 128 the kernels have no register to spare.
    let mut window = 0u32;
    if windowed {
        window = window_len;
    }
    let unroll = comptime![frags == Fragments::Registers];
    let kv_heads = k.shape(1);
    let s = q.shape(2);
    let t = k.shape(2);
    let bkv = CUBE_POS_Y as usize;
    let bi = bkv / kv_heads;
    let kvh = bkv % kv_heads;
    let unit = UNIT_POS as usize;
    let lane = unit % 32;
    let warp = unit / 32;
    let quad = lane % 4;
    let first = CUBE_POS_X as usize * BLOCK;
    // This lane's two keys: `key0` and 8 past it.
    let key0 = first + warp * 16 + lane / 4;

    let hd_ld = comptime![staged_ld(head_dim)];
    let tiles = comptime![staging.tiles()];
    let mut qs = SharedMemory::<F>::new_aligned(tiles * BLOCK * hd_ld, 128usize);
    let mut dos = SharedMemory::<F>::new_aligned(tiles * BLOCK * hd_ld, 128usize);
    let mut ls = SharedMemory::<f32>::new_aligned(tiles * BLOCK, 128usize);
    let mut drow = SharedMemory::<f32>::new_aligned(tiles * BLOCK, 128usize);
    let mut scratch = SharedMemory::<f32>::new(comptime![frags.scratch_len()]);
    // K's and V's rows stay in registers up to `RESIDENT_HEAD_DIM`, passing through q's and
    // dO's last tiles on their way (the first query block goes to the first); past it they
    // stay in tiles of their own. With `one_pass`, K stays in its tile either way: `dS K`
    // reads it there.
    let resident = comptime![head_dim <= RESIDENT_HEAD_DIM];
    let k_tiled = comptime![!resident || one_pass];
    let k_len = comptime![if k_tiled { BLOCK * hd_ld } else { 1 }];
    let v_len = comptime![if resident { 1 } else { BLOCK * hd_ld }];
    let mut ks = SharedMemory::<F>::new_aligned(k_len, 128usize);
    let mut vs = SharedMemory::<F>::new_aligned(v_len, 128usize);
    // With `one_pass`, the block's `dS` (query rows by this cube's keys) for `dQ += dS K`.
    let ds_ld = comptime![staged_ld(BLOCK)];
    let ds_len = comptime![if one_pass { BLOCK * ds_ld } else { 1 }];
    let mut dss = SharedMemory::<F>::new_aligned(ds_len, 128usize);

    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);
    let through = comptime![(tiles - 1) * BLOCK * hd_ld];
    if k_tiled {
        stage_tile::<F, N>(k, &mut ks, kbase, first, t, BLOCK, head_dim, hd_ld, UNITS);
    } else {
        stage_tile_at::<F, N>(
            k, &mut qs, through, kbase, first, t, BLOCK, head_dim, hd_ld, UNITS,
        );
    }
    if resident {
        stage_tile_at::<F, N>(
            v, &mut dos, through, vbase, first, t, BLOCK, head_dim, hd_ld, UNITS,
        );
    } else {
        stage_tile::<F, N>(v, &mut vs, vbase, first, t, BLOCK, head_dim, hd_ld, UNITS);
    }
    sync_cube();
    let steps = comptime![head_dim / 16];
    // (Not resident: one fragment's loads, never read; on CUDA one `ldmatrix` a cube, which
    // ptxas keeps, being `asm volatile`.)
    let held = comptime![if resident { steps } else { 1 }];
    let own = warp * 16 * hd_ld;
    let kf = if k_tiled {
        a_fragments::<F>(&ks, own, hd_ld, lane, held, frags)
    } else {
        a_fragments::<F>(&qs, through + own, hd_ld, lane, held, frags)
    };
    let vf = a_fragments::<F>(&dos, through + own, hd_ld, lane, held, frags);
    let from_tile = comptime![!resident];

    let out_tiles = comptime![head_dim / 8];
    let mut dk = zeros(out_tiles, unroll);
    let mut dv = zeros(out_tiles, unroll);
    // The two keys' padding biases (a key past the end reads the last one's; it is
    // masked anyway).
    let mut bias = Array::<f32>::new(2usize);
    // Packed rows: the last query of each key's document (s − 1 otherwise).
    let mut doc_hi = Array::<usize>::new(2usize);
    #[unroll]
    for half in 0..2usize {
        bias[half] = f32::new(0.0);
        if padding {
            bias[half] = pad_bias(key_bias, bi, min(key0 + half * 8, t - 1));
        }
        doc_hi[half] = document_last(spans, bi, min(key0 + half * 8, t - 1), s, documents);
    }

    // The query blocks of every query head on this kv head, in one stream (`n` of them
    // read so far): after block `qb` of head `g` comes the next block of the head, or the
    // next head's first.
    let group = group as usize;
    let hi_last = document_last(spans, bi, min(first + BLOCK, t) - 1, s, documents);
    let blocks = query_blocks(first, BLOCK, s, window, hi_last);
    let start = first_query_block(first, BLOCK, s, causal);
    let ready = ready_barrier(staging);
    if comptime![staging.ahead()] {
        if start < blocks {
            stage_queries::<F, N>(
                q,
                d_o,
                lse,
                d_rows,
                &mut qs,
                &mut dos,
                &mut ls,
                &mut drow,
                0,
                bi,
                kvh * group,
                start * BLOCK,
                head_dim,
                hd_ld,
                staging,
            );
            commit(&ready, staging);
        }
    }
    let mut n = 0usize;
    for g in 0..group {
        let hi = kvh * group + g;
        for qb in start..blocks {
            let i0 = qb * BLOCK;
            let tile = tile_of(n, staging);
            n += 1;
            if comptime![!staging.ahead()] {
                // Every warp is past the last block's reads (and the first fragments' loads).
                sync_cube();
                stage_queries::<F, N>(
                    q, d_o, lse, d_rows, &mut qs, &mut dos, &mut ls, &mut drow, 0, bi, hi, i0,
                    head_dim, hd_ld, staging,
                );
            }
            wait(&ready, staging);
            if comptime![staging.ahead()] {
                let last_here = qb + 1 == blocks;
                let next_g = select(last_here, g + 1, g);
                if next_g < group {
                    let next_i0 = select(last_here, start * BLOCK, i0 + BLOCK);
                    stage_queries::<F, N>(
                        q,
                        d_o,
                        lse,
                        d_rows,
                        &mut qs,
                        &mut dos,
                        &mut ls,
                        &mut drow,
                        1 - tile,
                        bi,
                        kvh * group + next_g,
                        next_i0,
                        head_dim,
                        hd_ld,
                        staging,
                    );
                    commit(&ready, staging);
                }
            }
            // This block's rows of the tiles.
            let at = tile * BLOCK;
            let lo_last = document_first(spans, bi, min(i0 + BLOCK, s) - 1, documents);
            let open = unmasked(i0, first, BLOCK, s, t, causal, padding, window, lo_last);
            // A loop on the GPU too: only shared-memory offsets depend on `sub`, and unrolled
            // ptxas hoisted the next 16 rows' loads into registers dK and dV need.
            for sub in 0..comptime![BLOCK / 16] {
                let (row, sc) = (at + sub * 16, &mut scratch);
                let st = scores::<F>(
                    &kf, &ks, own, &qs, row, hd_ld, lane, sc, steps, from_tile, frags,
                );
                let dpt = scores::<F>(
                    &vf, &vs, own, &dos, row, hd_ld, lane, sc, steps, from_tile, frags,
                );
                let mut pt = Array::<Pair<f32>>::new(4usize);
                let mut dst = Array::<Pair<f32>>::new(4usize);
                #[unroll]
                for c in 0..4usize {
                    // Tile `c / 2` of 8 queries, key `key0 + 8 (c % 2)`.
                    let half = c % 2;
                    let key = key0 + half * 8;
                    let mut p2 = Pair::<f32>::empty();
                    let mut ds2 = Pair::<f32>::empty();
                    #[unroll]
                    for e in 0..2usize {
                        let ql = sub * 16 + (c / 2) * 8 + quad * 2 + e;
                        let i = i0 + ql;
                        let mut x = st[c][e] * scale;
                        let mut masked = false;
                        if !open {
                            masked = i >= s
                                || excluded(key, i, t, causal, window, 0, doc_hi[half], documents);
                            x += bias[half];
                        }
                        let (lse_i, d_i) = (ls[at + ql], drow[at + ql]);
                        let (p, ds) =
                            probability_and_gradient(x, dpt[c][e], lse_i, d_i, scale, masked);
                        p2[e] = p;
                        ds2[e] = ds;
                    }
                    pt[c] = p2;
                    dst[c] = ds2;
                }
                if one_pass {
                    // Transposed into `dss`: query `ql`'s row, this lane's two keys.
                    #[unroll]
                    for c in 0..4usize {
                        let key = warp * 16 + lane / 4 + (c % 2) * 8;
                        #[unroll]
                        for e in 0..2usize {
                            let ql = sub * 16 + (c / 2) * 8 + quad * 2 + e;
                            dss[ql * ds_ld + key] = F::cast_from(dst[c][e]);
                        }
                    }
                }
                let pa = as_a::<F>(&pt);
                let dsa = as_a::<F>(&dst);
                accumulate::<F>(
                    &pa,
                    &dos,
                    row * hd_ld,
                    hd_ld,
                    &mut dv,
                    lane,
                    &mut scratch,
                    out_tiles,
                    frags,
                );
                accumulate::<F>(
                    &dsa,
                    &qs,
                    row * hd_ld,
                    hd_ld,
                    &mut dk,
                    lane,
                    &mut scratch,
                    out_tiles,
                    frags,
                );
            }
            if one_pass {
                // Every warp's `dS` of the block is in `dss`. Nothing else guards `dss`:
                // the next block's writes come after the next `wait`, which every unit
                // reaches and arrives at in each staging (`stream.rs`). A schedule that
                // skips a query block inside this loop, or a wait that not every unit
                // arrives at (one elected arrival, TMA), needs a `sync_cube` after
                // `add_dq` instead.
                sync_cube();
                add_dq::<F>(
                    &dss,
                    &ks,
                    d_q_acc,
                    bi,
                    hi,
                    i0 + warp * 16,
                    warp * 16 * ds_ld,
                    s,
                    lane,
                    &mut scratch,
                    head_dim,
                    hd_ld,
                    frags,
                );
            }
        }
    }

    #[unroll]
    for half in 0..2usize {
        let key = key0 + half * 8;
        if key < t {
            let kb = bi * d_k.stride(0) + kvh * d_k.stride(1) + key * d_k.stride(2);
            let vb = bi * d_v.stride(0) + kvh * d_v.stride(1) + key * d_v.stride(2);
            #[unroll(unroll)]
            for n in 0..out_tiles {
                let gk = dk[n * 2 + half];
                let gv = dv[n * 2 + half];
                #[unroll]
                for e in 0..2usize {
                    let col = n * 8 + quad * 2 + e;
                    d_k[kb + col * d_k.stride(3)] = F::cast_from(gk[e]);
                    d_v[vb + col * d_v.stride(3)] = F::cast_from(gv[e]);
                }
            }
        }
    }
}

/// Stages the key block from `j0` of [`flash_backward_q_registers`] into tile `tile`: K's
/// and V's rows and, with `padding`, the keys' biases (keys past the end read the last
/// one's).
#[cube]
// `collapsible_if`: as in the kernels.
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
fn stage_keys<F: Float, N: Size>(
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    key_bias: &Tensor<f32>,
    ks: &mut SharedMemory<F>,
    vs: &mut SharedMemory<F>,
    kbias: &mut SharedMemory<f32>,
    tile: usize,
    bi: usize,
    kbase: usize,
    vbase: usize,
    j0: usize,
    #[comptime] head_dim: usize,
    #[comptime] hd_ld: usize,
    #[comptime] padding: bool,
    #[comptime] staging: Staging,
) {
    let t = k.shape(2);
    stage_block::<F, N>(k, ks, tile, kbase, j0, t, head_dim, hd_ld, staging);
    stage_block::<F, N>(v, vs, tile, vbase, j0, t, head_dim, hd_ld, staging);
    let unit = UNIT_POS as usize;
    if padding {
        if unit < BLOCK {
            let j = min(j0 + unit, t - 1);
            let from = pad_bias_index(key_bias, bi, j);
            stage_value(key_bias, from, kbias, tile * BLOCK + unit, staging);
        }
    }
}

/// dQ for [`BLOCK`] queries of one `(batch, head)`, in two passes; cubes of [`UNITS`] over
/// (`s / BLOCK`, `b · h`). Arguments as [`flash_backward_kv_registers`]'s, with `d_q`; the
/// key blocks (K, V and, with padding, their biases) stream through as `staging` says.
#[cube(launch, fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
// `collapsible_if`: the nested tests keep the compile-time one apart (joined, the body
// would be expanded without padding, or without staging ahead, too).
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_q_registers<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    d_rows: &Tensor<f32>,
    key_bias: &Tensor<f32>,
    spans: &Tensor<u32>,
    d_q: &mut Tensor<F>,
    scale: f32,
    group: u32,
    window_len: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] windowed: bool,
    #[comptime] padding: bool,
    #[comptime] documents: bool,
    #[comptime] frags: Fragments,
    #[comptime] staging: Staging,
    #[define(F)] _dtype: StorageType,
) {
    // Without a window its bound is the constant 0, which the compiler folds away: at head
    // dim 128 the kernels have no register to spare.
    let mut window = 0u32;
    if windowed {
        window = window_len;
    }
    let unroll = comptime![frags == Fragments::Registers];
    let heads = q.shape(1);
    let s = q.shape(2);
    let t = k.shape(2);
    let bh = CUBE_POS_Y as usize;
    let bi = bh / heads;
    let hi = bh % heads;
    let kvh = hi / group as usize;
    let unit = UNIT_POS as usize;
    let lane = unit % 32;
    let warp = unit / 32;
    let quad = lane % 4;
    let first = CUBE_POS_X as usize * BLOCK;
    // This lane's two queries: `row0` and 8 below it.
    let row0 = first + warp * 16 + lane / 4;

    let hd_ld = comptime![staged_ld(head_dim)];
    let tiles = comptime![staging.tiles()];
    let mut ks = SharedMemory::<F>::new_aligned(tiles * BLOCK * hd_ld, 128usize);
    let mut vs = SharedMemory::<F>::new_aligned(tiles * BLOCK * hd_ld, 128usize);
    let mut scratch = SharedMemory::<f32>::new(comptime![frags.scratch_len()]);
    // As K and V in the key kernel: q's and dO's rows in registers up to
    // `RESIDENT_HEAD_DIM` (through K's and V's last tiles), past it in tiles of their own.
    let resident = comptime![head_dim <= RESIDENT_HEAD_DIM];
    let own_tile = comptime![if resident { 1 } else { BLOCK * hd_ld }];
    let mut qs = SharedMemory::<F>::new_aligned(own_tile, 128usize);
    let mut dos = SharedMemory::<F>::new_aligned(own_tile, 128usize);

    let qbase = bi * q.stride(0) + hi * q.stride(1);
    let dobase = bi * d_o.stride(0) + hi * d_o.stride(1);
    let through = comptime![(tiles - 1) * BLOCK * hd_ld];
    if resident {
        stage_tile_at::<F, N>(
            q, &mut ks, through, qbase, first, s, BLOCK, head_dim, hd_ld, UNITS,
        );
        stage_tile_at::<F, N>(
            d_o, &mut vs, through, dobase, first, s, BLOCK, head_dim, hd_ld, UNITS,
        );
    } else {
        stage_tile::<F, N>(q, &mut qs, qbase, first, s, BLOCK, head_dim, hd_ld, UNITS);
        stage_tile::<F, N>(
            d_o, &mut dos, dobase, first, s, BLOCK, head_dim, hd_ld, UNITS,
        );
    }
    sync_cube();
    let steps = comptime![head_dim / 16];
    let held = comptime![if resident { steps } else { 1 }];
    let own = warp * 16 * hd_ld;
    let qf = a_fragments::<F>(&ks, through + own, hd_ld, lane, held, frags);
    let dof = a_fragments::<F>(&vs, through + own, hd_ld, lane, held, frags);
    let from_tile = comptime![!resident];
    // The staged keys' padding biases: one load per key, not one per score (loads from
    // global memory the unrolled loop would hold registers for).
    let bias_len = comptime![if padding { tiles * BLOCK } else { 1 }];
    let mut kbias = SharedMemory::<f32>::new_aligned(bias_len, 128usize);

    let out_tiles = comptime![head_dim / 8];
    let mut dq = zeros(out_tiles, unroll);
    // Per query of the two: the row the masks read (clamped), its LSE and D.
    let mut rows = Array::<usize>::new(2usize);
    let mut row_lse = Array::<f32>::new(2usize);
    let mut row_d = Array::<f32>::new(2usize);
    // Packed rows: where each query's document starts (0 otherwise, folded away).
    let mut doc_lo = Array::<usize>::new(2usize);
    #[unroll]
    for half in 0..2usize {
        let r = min(row0 + half * 8, s - 1);
        rows[half] = r;
        doc_lo[half] = document_first(spans, bi, r, documents);
        row_lse[half] = lse[bi * lse.stride(0) + hi * lse.stride(1) + r * lse.stride(2)];
        row_d[half] = d_rows[bi * d_rows.stride(0) + hi * d_rows.stride(1) + r * d_rows.stride(2)];
    }

    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);
    let lo_first = document_first(spans, bi, min(first, s - 1), documents);
    let lo_last = document_first(spans, bi, min(first + BLOCK, s) - 1, documents);
    let start = first_key_block(first, BLOCK, window, lo_first);
    let blocks = key_blocks(first, BLOCK, s, t, causal);
    let ready = ready_barrier(staging);
    if comptime![staging.ahead()] {
        if start < blocks {
            stage_keys::<F, N>(
                k,
                v,
                key_bias,
                &mut ks,
                &mut vs,
                &mut kbias,
                0,
                bi,
                kbase,
                vbase,
                start * BLOCK,
                head_dim,
                hd_ld,
                padding,
                staging,
            );
            commit(&ready, staging);
        }
    }
    for kb in start..blocks {
        let j0 = kb * BLOCK;
        let tile = tile_of(kb - start, staging);
        if comptime![!staging.ahead()] {
            // Every warp is past the last block's reads (and the first fragments' loads).
            sync_cube();
            stage_keys::<F, N>(
                k, v, key_bias, &mut ks, &mut vs, &mut kbias, 0, bi, kbase, vbase, j0, head_dim,
                hd_ld, padding, staging,
            );
        }
        wait(&ready, staging);
        if comptime![staging.ahead()] {
            if kb + 1 < blocks {
                stage_keys::<F, N>(
                    k,
                    v,
                    key_bias,
                    &mut ks,
                    &mut vs,
                    &mut kbias,
                    1 - tile,
                    bi,
                    kbase,
                    vbase,
                    j0 + BLOCK,
                    head_dim,
                    hd_ld,
                    padding,
                    staging,
                );
                commit(&ready, staging);
            }
        }
        // This block's rows of the tiles.
        let at = tile * BLOCK;

        let open = unmasked(first, j0, BLOCK, s, t, causal, padding, window, lo_last);
        // Unrolled where q and dO are resident; past that ptxas hoisted the next 16 keys'
        // loads into registers dQ needs, as in the key kernel.
        #[unroll(unroll && resident)]
        for sub in 0..comptime![BLOCK / 16] {
            let (row, scr) = (at + sub * 16, &mut scratch);
            let sc = scores::<F>(
                &qf, &qs, own, &ks, row, hd_ld, lane, scr, steps, from_tile, frags,
            );
            let dp = scores::<F>(
                &dof, &dos, own, &vs, row, hd_ld, lane, scr, steps, from_tile, frags,
            );
            let mut ds = Array::<Pair<f32>>::new(4usize);
            #[unroll]
            for c in 0..4usize {
                // Tile `c / 2` of 8 keys, query `row0 + 8 (c % 2)`.
                let half = c % 2;
                let mut ds2 = Pair::<f32>::empty();
                #[unroll]
                for e in 0..2usize {
                    let key = j0 + sub * 16 + (c / 2) * 8 + quad * 2 + e;
                    let mut x = sc[c][e] * scale;
                    let mut masked = false;
                    if !open {
                        let r = rows[half];
                        masked = excluded(key, r, t, causal, window, doc_lo[half], r, documents);
                        if padding {
                            x += kbias[at + key - j0];
                        }
                    }
                    let (_, g) = probability_and_gradient(
                        x,
                        dp[c][e],
                        row_lse[half],
                        row_d[half],
                        scale,
                        masked,
                    );
                    ds2[e] = g;
                }
                ds[c] = ds2;
            }
            let dsa = as_a::<F>(&ds);
            accumulate::<F>(
                &dsa,
                &ks,
                row * hd_ld,
                hd_ld,
                &mut dq,
                lane,
                &mut scratch,
                out_tiles,
                frags,
            );
        }
    }

    #[unroll]
    for half in 0..2usize {
        let row = row0 + half * 8;
        if row < s {
            let base = bi * d_q.stride(0) + hi * d_q.stride(1) + row * d_q.stride(2);
            #[unroll(unroll)]
            for n in 0..out_tiles {
                let gq = dq[n * 2 + half];
                #[unroll]
                for e in 0..2usize {
                    d_q[base + (n * 8 + quad * 2 + e) * d_q.stride(3)] = F::cast_from(gq[e]);
                }
            }
        }
    }
}

/// The shared memory a cube of the key kernel and of the query kernel takes: the streamed
/// tiles (`staging.tiles()` each) and their rows' fp32 values, the tiles of the side that
/// stays (one element each where it is held in registers), the emulation's scratch; with
/// `one_pass`, the key kernel's K tile and block of `dS`.
pub fn shared_bytes(
    head_dim: usize,
    elem: usize,
    padding: bool,
    one_pass: bool,
    frags: Fragments,
    staging: Staging,
) -> (usize, usize) {
    let streamed = staging.tiles() * BLOCK * staged_ld(head_dim);
    let tile = BLOCK * staged_ld(head_dim);
    let resident = head_dim <= RESIDENT_HEAD_DIM;
    let stays = if resident { 1 } else { tile };
    let k_tile = if resident && !one_pass { 1 } else { tile };
    let ds = if one_pass {
        BLOCK * staged_ld(BLOCK)
    } else {
        1
    };
    let values = staging.tiles() * BLOCK;
    let scratch = (frags.scratch_len(), 4);
    let key_kernel = super::stream::shared_bytes(&[
        (streamed, elem),
        (streamed, elem),
        (values, 4),
        (values, 4),
        scratch,
        (k_tile, elem),
        (stays, elem),
        (ds, elem),
    ]);
    let query_kernel = super::stream::shared_bytes(&[
        (streamed, elem),
        (streamed, elem),
        scratch,
        (stays, elem),
        (stays, elem),
        (if padding { values } else { 1 }, 4),
    ]);
    (key_kernel, query_kernel)
}

/// Writes dQ, dK and dV as `launch::backward` does, from `D` in `out.d_rows` (written
/// before): with `one_pass`, the key kernel alone, adding dQ up in `out.d_q_acc` (which this
/// zeroes before and casts into `out.d_q` after, as `launch::backward` describes);
/// otherwise the key kernel and the query kernel, and `out.d_q_acc` is not touched.
/// `cfg.dropout` must be `None` and `cfg.dims.head_dim` a multiple of 16 up to 128; the
/// other side's blocks stream as `staging` says.
pub fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: &FlashLaunch,
    frags: Fragments,
    staging: Staging,
    one_pass: bool,
    x: BackwardInputs<R>,
    out: BackwardOutputs<R>,
) {
    let d = &cfg.dims;
    assert!(
        cfg.dropout.is_none(),
        "the register backward has no dropout"
    );
    assert!(
        d.head_dim.is_multiple_of(16) && d.head_dim <= super::forward_registers::MAX_HEAD_DIM,
        "head dim {}",
        d.head_dim
    );
    let width =
        super::launch::vector_width(client, cfg.dtype, d.head_dim, &[&x.q, &x.k, &x.v, &x.d_o]);
    let elem = cfg.dtype.size();
    let (kv_bytes, q_bytes) = shared_bytes(d.head_dim, elem, cfg.padding, one_pass, frags, staging);
    check_shared(client, kv_bytes, "the register backward's key kernel");
    if !one_pass {
        check_shared(client, q_bytes, "the register backward's query kernel");
    }
    let second = x.clone();
    let d_rows = super::launch::clone_arg(&out.d_rows);
    let d_q = super::launch::clone_arg(&out.d_q);
    let acc = super::launch::clone_arg(&out.d_q_acc);
    let key_kernel = || {
        flash_backward_kv_registers::launch::<R>(
            client,
            CubeCount::Static(
                d.kv_len.div_ceil(BLOCK) as u32,
                (d.batch * d.kv_heads) as u32,
                1,
            ),
            CubeDim::new_1d(UNITS as u32),
            width,
            x.q,
            x.k,
            x.v,
            x.d_o,
            x.lse,
            out.d_rows,
            x.key_bias,
            x.spans,
            out.d_k,
            out.d_v,
            out.d_q_acc,
            cfg.scale,
            d.group(),
            cfg.window as u32,
            d.head_dim,
            cfg.causal,
            cfg.window > 0,
            cfg.padding,
            cfg.documents,
            one_pass,
            frags,
            staging,
            cfg.dtype,
        )
    };
    if one_pass {
        super::scratch::accumulate_dq(client, cfg, acc, d_q, key_kernel);
        return;
    }
    key_kernel();
    let x = second;
    flash_backward_q_registers::launch::<R>(
        client,
        CubeCount::Static(
            d.q_len.div_ceil(BLOCK) as u32,
            (d.batch * d.heads) as u32,
            1,
        ),
        CubeDim::new_1d(UNITS as u32),
        width,
        x.q,
        x.k,
        x.v,
        x.d_o,
        x.lse,
        d_rows,
        x.key_bias,
        x.spans,
        d_q,
        cfg.scale,
        d.group(),
        cfg.window as u32,
        d.head_dim,
        cfg.causal,
        cfg.window > 0,
        cfg.padding,
        cfg.documents,
        frags,
        staging,
        cfg.dtype,
    );
}

#[cfg(test)]
mod tests {
    use super::super::device_tensor::Elem;
    use super::super::reference::{worst, Problem};
    use super::super::tests_kernels::register_forward_on;
    use super::*;

    /// How the tests run dQ: in the query kernel, or (`OnePass`) added up in the key kernel.
    #[derive(Clone, Copy, Debug, PartialEq)]
    enum Passes {
        Two,
        OnePass,
    }

    /// dQ, dK and dV against the f64 reference, on the inputs rounded to `E`, within `tol`;
    /// O and LSE from the register forward with the same `frags` and `staging`.
    fn check<R: Runtime, E: Elem>(
        client: &ComputeClient<R>,
        frags: Fragments,
        staging: Staging,
        passes: Passes,
        mut p: Problem,
        tol: f64,
    ) {
        let one_pass = passes == Passes::OnePass;
        if one_pass && !super::super::launch::has_atomic_add(client) {
            eprintln!("SKIPPED: no fp32 atomic adds; the one-pass register backward did not run");
            return;
        }
        let Some((what, cfg, t)) = register_forward_on::<R, E>(client, frags, staging, &mut p)
        else {
            return;
        };
        let what = format!("{what} {passes:?}");
        super::super::scratch::row_dots(client, &cfg, t.o.arg(), t.d_o.arg(), t.d_rows.arg());
        let (inputs, out) = t.backward_args();
        launch(client, &cfg, frags, staging, one_pass, inputs, out);
        let want = p.expected();
        for (name, got, want) in [
            ("dQ", &t.d_q, &want.d_q),
            ("dK", &t.d_k, &want.d_k),
            ("dV", &t.d_v, &want.d_v),
        ] {
            let err = worst(&got.read_as::<E>(client), want);
            assert!(err <= tol, "{what}: {name} differs by {err:e} (> {tol:e})");
        }
    }

    #[cfg(feature = "wgpu-kernels")]
    mod wgpu {
        use super::*;
        use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

        fn client() -> Option<ComputeClient<WgpuRuntime>> {
            crate::testing::client_or_skip::<WgpuRuntime>(
                || WgpuDevice::DefaultDevice,
                "vulkan",
                "the register backward's emulation",
            )
        }

        /// f32 through the same data flow: every index, to fp32 rounding. (Lavapipe gives a
        /// cube 32 KiB of shared memory: two f32 tiles of 64 rows fit up to head dim 32.)
        #[test]
        fn emulated_fragments_match_the_reference_in_f32() {
            let Some(client) = client() else { return };
            // Causal, four query heads per kv head; a second, partial block of 64 on both
            // sides.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Passes::Two,
                Problem::new(1, 8, 2, 70, 70, 32, true, &[], 31),
                1e-3,
            );
            // Bidirectional with padded keys.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Passes::Two,
                Problem::new(2, 2, 2, 33, 33, 32, false, &[0, 9], 32),
                1e-3,
            );
            // Causal with padding, grouped, d 16; three blocks on each side.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Passes::Two,
                Problem::new(2, 4, 2, 130, 130, 16, true, &[3, 9], 33),
                1e-3,
            );
            // Bidirectional, more keys than queries, and fewer.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Passes::Two,
                Problem::new(1, 2, 1, 20, 90, 16, false, &[], 34),
                1e-3,
            );
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Passes::Two,
                Problem::new(1, 2, 2, 90, 20, 16, false, &[2], 35),
                1e-3,
            );
        }

        /// Both sides' blocks staged a block ahead into second tiles (the schedule of the
        /// asynchronous copies, with plain loads), the key kernel's LSE and D with them, the
        /// query kernel's key biases too. (Four f32 tiles of 64 rows fit lavapipe's 32 KiB at
        /// head dim 16.)
        #[test]
        fn emulated_fragments_staged_ahead_match_the_reference() {
            let Some(client) = client() else { return };
            for p in [
                // Causal with padding, grouped: the key kernel's stream crosses from one
                // query head to the next; three blocks on each side.
                Problem::new(2, 4, 2, 130, 130, 16, true, &[3, 9], 33),
                // More keys than queries (one query block per head: every block of the key
                // kernel's stream is a new head), and fewer.
                Problem::new(1, 6, 2, 20, 200, 16, false, &[], 36),
                Problem::new(1, 2, 2, 200, 20, 16, false, &[4], 37),
            ] {
                check::<_, f32>(
                    &client,
                    Fragments::Emulated,
                    Staging::Double,
                    Passes::Two,
                    p,
                    1e-3,
                );
            }
            check::<_, burn::tensor::f16>(
                &client,
                Fragments::Emulated,
                Staging::Double,
                Passes::Two,
                Problem::new(2, 4, 2, 150, 150, 32, true, &[0, 5], 38),
                2e-2,
            );
        }

        /// dQ added up in the key kernel (atomically, into fp32), one block at a time and
        /// staged ahead: every query head of a kv head adding to its own rows, partial
        /// blocks on both sides (rows past the queries not added, keys past the keys adding
        /// nothing), both masks, padding. In f16, since the block of `dS` does not fit
        /// lavapipe's 32 KiB beside f32 tiles.
        #[test]
        fn emulated_fragments_in_one_pass_match_the_reference() {
            let Some(client) = client() else { return };
            let f16 = |staging, p| {
                check::<_, burn::tensor::f16>(
                    &client,
                    Fragments::Emulated,
                    staging,
                    Passes::OnePass,
                    p,
                    2e-2,
                )
            };
            for p in [
                Problem::new(1, 8, 2, 70, 70, 32, true, &[], 41),
                Problem::new(2, 2, 2, 33, 33, 32, false, &[0, 9], 42),
                Problem::new(1, 2, 1, 20, 90, 32, false, &[], 43),
                Problem::new(1, 2, 2, 90, 20, 32, false, &[2], 44),
            ] {
                f16(Staging::Single, p);
            }
            for p in [
                Problem::new(2, 4, 2, 130, 130, 16, true, &[3, 9], 45),
                Problem::new(1, 6, 2, 20, 200, 16, false, &[], 46),
            ] {
                f16(Staging::Double, p);
            }
        }

        /// Sliding windows shorter and longer than the 64-row blocks, both directions: one
        /// block at a time with two passes (f32), and staged ahead (whose first block is
        /// then the window's, not block 0) in one pass (f16). Two compiled variants, as
        /// lavapipe takes minutes for each.
        #[test]
        fn emulated_fragments_with_a_window_match_the_reference() {
            let Some(client) = client() else { return };
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Passes::Two,
                Problem::new(1, 4, 2, 200, 200, 16, true, &[], 51).with_window(50),
                1e-3,
            );
            for p in [
                Problem::new(2, 2, 2, 200, 200, 16, true, &[0, 7], 52).with_window(100),
                Problem::new(1, 2, 1, 150, 150, 16, true, &[], 53).with_window(64),
            ] {
                check::<_, burn::tensor::f16>(
                    &client,
                    Fragments::Emulated,
                    Staging::Double,
                    Passes::OnePass,
                    p,
                    2e-2,
                );
            }
        }

        /// Packed documents shorter and longer than the 64-row blocks, one starting inside
        /// a block, with grouped queries and a window: staged ahead (whose first block is
        /// then the first row's document's), both kernels of the two passes, and the
        /// register forward under them. One compiled variant (lavapipe takes minutes).
        #[test]
        fn emulated_fragments_with_documents_match_the_reference() {
            let Some(client) = client() else { return };
            for p in [
                Problem::new(2, 4, 2, 200, 200, 16, true, &[], 54)
                    .with_documents(&[&[30, 100, 1, 40], &[150, 20]]),
                Problem::new(1, 2, 1, 150, 150, 16, true, &[], 55)
                    .with_documents(&[&[70, 70]])
                    .with_window(40),
            ] {
                check::<_, burn::tensor::f16>(
                    &client,
                    Fragments::Emulated,
                    Staging::Double,
                    Passes::Two,
                    p,
                    2e-2,
                );
            }
        }

        /// 16-bit inputs: P and dS rounded to the input type before their products, as on
        /// the tensor cores.
        #[test]
        fn emulated_fragments_match_the_reference_in_f16() {
            let Some(client) = client() else { return };
            check::<_, burn::tensor::f16>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Passes::Two,
                Problem::new(2, 4, 2, 37, 37, 32, true, &[0, 5], 9),
                2e-2,
            );
        }
    }

    /// The register products themselves, at the head dims the executor runs.
    #[cfg(feature = "cuda")]
    mod cuda {
        use super::super::super::tests_kernels::register_cuda_problems;
        use super::*;
        use cubecl::cuda::{CudaDevice, CudaRuntime};

        /// At the head dims the executor runs, both masks, in bf16 and (`f16`) fp16, with
        /// `staging`; `None` where the device has no CUDA.
        fn on_cuda(staging: Staging, passes: Passes, f16: bool) -> Option<()> {
            let client = crate::testing::client_or_skip::<CudaRuntime>(
                || CudaDevice::new(0),
                "cuda",
                "the register backward",
            )?;
            let frags = Fragments::Registers;
            for p in register_cuda_problems(60) {
                check::<_, burn::tensor::bf16>(&client, frags, staging, passes, p.clone(), 5e-2);
                if f16 {
                    check::<_, burn::tensor::f16>(&client, frags, staging, passes, p, 2e-2);
                }
            }
            Some(())
        }

        #[test]
        fn register_fragments_match_the_reference() {
            on_cuda(Staging::Single, Passes::Two, true);
        }

        /// The other side's blocks copied a block ahead (`cp.async`, 16 bytes a copy, on a
        /// barrier), in bf16 (the staging does not depend on the type): a test of its own, so
        /// that `gpu_flash_call.sh` tells it apart.
        #[test]
        fn copied_ahead_match_the_reference() {
            on_cuda(Staging::Copies(8), Passes::Two, false);
        }

        /// dQ added up in the key kernel, one block at a time and copied ahead, in bf16.
        #[test]
        fn one_pass_match_the_reference() {
            on_cuda(Staging::Single, Passes::OnePass, false);
            on_cuda(Staging::Copies(8), Passes::OnePass, false);
        }
    }

    /// The CUDA source: register products, nothing on the stack (ptxas, `sm_90a`), at the
    /// head dims and types the executor runs. No GPU needed.
    #[cfg(all(feature = "cuda", feature = "wgpu-kernels"))]
    mod source {
        use super::super::super::tests_cuda_source::{
            atomically_adds, client, compiles, copies_async, float, on_register_mma_spilling,
            settings, shared_as_estimated, tensor, COPIES_SPILL,
        };
        use super::*;
        use cubecl::ir::FloatKind;
        use cubecl::wgpu::WgpuRuntime;

        /// One block at a time in both 16-bit types; copied ahead (`cp.async` into second
        /// tiles, completing on a barrier) in bf16; the key kernel in one pass too, in bf16.
        /// The stack a windowed register backward may take (`the_register_backward_compiles_without_spills`).
        const WINDOW_SPILL: usize = 8;

        #[test]
        fn the_register_backward_compiles_without_spills() {
            let Some(client) = client() else { return };
            let mut variants = Vec::new();
            for kind in [FloatKind::BF16, FloatKind::F16] {
                for head_dim in [64, 128] {
                    for (causal, padding) in [(true, false), (false, true)] {
                        variants.push((
                            kind,
                            Staging::Single,
                            head_dim,
                            causal,
                            padding,
                            false,
                            false,
                        ));
                        if kind == FloatKind::BF16 {
                            variants.push((
                                kind,
                                Staging::Copies(8),
                                head_dim,
                                causal,
                                padding,
                                false,
                                false,
                            ));
                        }
                    }
                }
            }
            // A sliding window's bounds and masks, and packed documents' (each its own
            // compile-time variant).
            for head_dim in [64, 128] {
                for (windowed, documents) in [(true, false), (false, true)] {
                    variants.push((
                        FloatKind::BF16,
                        Staging::Single,
                        head_dim,
                        true,
                        false,
                        windowed,
                        documents,
                    ));
                }
            }
            let frags = Fragments::Registers;
            for (kind, staging, head_dim, causal, padding, windowed, documents) in variants {
                // (`COPIES_SPILL` says why the copies may spill a little. A window's bounds
                // and masks push the key kernel at head dim 128, at 255 registers without
                // them, into 8 bytes of spill: NVRTC 12.9, sm_90; documents' likewise.)
                let spill = if staging.copies() {
                    COPIES_SPILL
                } else if windowed || documents {
                    WINDOW_SPILL
                } else {
                    0
                };
                let what = |kernel: &str| {
                    format!(
                        "register backward {kernel} {kind:?} {staging:?} d{head_dim} causal {causal} padding {padding} window {windowed} documents {documents}"
                    )
                };
                let passes: &[bool] = if kind == FloatKind::BF16 {
                    &[false, true]
                } else {
                    &[false]
                };
                for &one_pass in passes {
                    let what = what(if one_pass { "kv one pass" } else { "kv" });
                    let kv =
                        flash_backward_kv_registers::FlashBackwardKvRegisters::<WgpuRuntime>::new(
                            settings(UNITS as u32),
                            client.clone(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            (),
                            (),
                            (),
                            // Staged 2 16-bit values at a time, as launched.
                            2,
                            head_dim,
                            causal,
                            windowed,
                            padding,
                            documents,
                            one_pass,
                            frags,
                            staging,
                            float(kind),
                        );
                    let compiled = compiles(kv, &what);
                    on_register_mma_spilling(&compiled, spill, &what);
                    copies_async(&compiled, staging.copies(), &what);
                    atomically_adds(&compiled, one_pass, &what);
                    let (need, _) = shared_bytes(head_dim, 2, padding, one_pass, frags, staging);
                    shared_as_estimated(&compiled, need, &what);
                }
                let q = flash_backward_q_registers::FlashBackwardQRegisters::<WgpuRuntime>::new(
                    settings(UNITS as u32),
                    client.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    (),
                    (),
                    (),
                    2,
                    head_dim,
                    causal,
                    windowed,
                    padding,
                    documents,
                    frags,
                    staging,
                    float(kind),
                );
                let compiled = compiles(q, &what("q"));
                on_register_mma_spilling(&compiled, spill, &what("q"));
                copies_async(&compiled, staging.copies(), &what("q"));
                let (_, need) = shared_bytes(head_dim, 2, padding, false, frags, staging);
                shared_as_estimated(&compiled, need, &what("q"));
            }
        }
    }
}
