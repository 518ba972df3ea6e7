//! Pieces the forward and backward kernels share: staging rows of a
//! `[b, h, n, d]` tensor in shared memory, the masks and the blocks causal
//! attention skips, a row dot product.
//!
//! The `Rows` kernels run `block` units per cube, one per row of their
//! block; the block-product kernels `units_per_row` per row. Both stage
//! tiles with the whole cube: the `Rows` kernels in fp32 ([`stage_rows`]),
//! the block-product kernels in the input type ([`stage_tile`]).
//!
//! A unit's own rows (its query, output or gradient row, in fp32) are
//! arrays of the compile-time head dim, and every loop over them runs to
//! it, unrolled where the kernel's `unroll` says (CUDA: `launch::unrolls`),
//! so that no element is addressed by a run-time index, which puts the
//! whole array in local memory. Loops over the rows of a block stay
//! run-time loops.

use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;

use super::mma::PAD_HALF;

/// The score of an excluded (future or out-of-range) key: below any real
/// score, so `exp(x − max)` is 0 and a max over a block ignores it. Finite:
/// WGSL has no infinity literal.
pub const MASKED: f32 = -1.0e30;

/// Copies rows `r0 .. r0 + rows` of one `(batch, head)` slice of `src`
/// (from element `base`) into `dst`, row-major `[rows, dim]`, as fp32.
/// The whole cube copies, consecutive units taking consecutive elements, so
/// a plane's reads of a contiguous row are coalesced; a unit may not read
/// what it staged before the next `sync_cube`. Rows past `n` repeat row
/// `n − 1` (finite; the callers mask them). `rows` and `dim` (the tensors'
/// last extent) are compile-time values, so an element's row and column are
/// a shift and a mask, not a division, for sizes in powers of two.
#[cube]
pub fn stage_rows<F: Float>(
    src: &Tensor<F>,
    dst: &mut SharedMemory<f32>,
    base: usize,
    r0: usize,
    n: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
) {
    let units = CUBE_DIM as usize;
    let mut e = UNIT_POS as usize;
    while e < rows * dim {
        let r = min(r0 + e / dim, n - 1);
        dst[e] = f32::cast_from(src[base + r * src.stride(2) + (e % dim) * src.stride(3)]);
        e += units;
    }
}

/// The row stride, in elements, of a staged `[rows, head_dim]` tile of the
/// block-product kernels: each row padded by [`PAD_HALF`] (16 bytes). The
/// tiles are the operands of the block products, read 16 rows at a time;
/// rows 128 or 256 bytes apart all start in the same shared-memory bank, so
/// a plane's fragment load took 4 times the cycles it needs (rows 144 bytes
/// apart start 4 banks on). A multiple of 16 bytes, as wmma wants.
pub const fn staged_ld(head_dim: usize) -> usize {
    head_dim + PAD_HALF
}

/// [`stage_rows`] for the block-product kernels, which stage the input type
/// as it is: rows `r0 .. r0 + rows` of one `(batch, head)` slice of `src`
/// (from element `base`) into `dst`, row `i` from element `i · ld`
/// ([`staged_ld`]). Rows past `n` repeat row `n − 1` (finite; the callers
/// mask them). A unit may not read what the others staged before the next
/// `sync_cube`.
///
/// Each unit first loads its whole share of the tile into registers, every
/// load issued before any value is used, then stores it. A loop that
/// stored each value before loading the next waited out global memory's
/// latency once per load: the H100 machine code showed 8 such waits per
/// 64 × 64 tile and unit (ptxas unrolled it twice), 16 per key block
/// against 8 tensor-core instructions of products, most likely what set
/// the kernels' pace. (Fetching the next block during this one's products
/// as well did not overlap: ptxas unpacks 16-bit pairs as they arrive, so
/// the warp waited there anyway, in twice the registers, and spilled at
/// head dim 128.)
///
/// `src` is read `N` consecutive elements at a time (two 16-bit values;
/// the launch picks `N` and says why no more: `launch::vector_width`). With
/// `N > 1` the last dim must be contiguous and `base`, the row stride and
/// `dim` multiples of `N` (the launch checks); shapes, strides and `base`
/// are in elements, indices in vectors. The cube has `units` units (a
/// compile-time value, as the launch sets it); consecutive units take
/// consecutive vectors, so a plane's reads of a row are coalesced.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_tile<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut SharedMemory<F>,
    base: usize,
    r0: usize,
    n: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] ld: usize,
    #[comptime] units: usize,
) {
    stage_tile_at::<F, N>(src, dst, 0, base, r0, n, rows, dim, ld, units);
}

/// [`stage_tile`] into `dst` from element `at` on: one of several tiles in one shared
/// array (the register kernels' double buffers, `stream`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_tile_at<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut SharedMemory<F>,
    at: usize,
    base: usize,
    r0: usize,
    n: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] ld: usize,
    #[comptime] units: usize,
) {
    let width = N::value().comptime();
    let per_row = comptime![dim / width];
    let total = comptime![rows * per_row];
    let unit = UNIT_POS as usize;
    if comptime![units.is_multiple_of(per_row) && total.is_multiple_of(units)] {
        // The cube covers whole rows at a time and the tile evenly (at
        // every size the kernels run on CUDA): a unit's vectors share one
        // column and lie `step` rows apart, each one's place in `dst` a
        // constant offset from the first, and every one inside the tile.
        // (Per-vector divisions had ptxas keep their results across the
        // kernels' loops, a register each; per-vector bounds tests became
        // branches with the loads sunk into them, in series again.)
        let per_unit = comptime![total / units];
        let batch = comptime![per_unit.min(STAGE_BATCH)];
        let batches = comptime![per_unit.div_ceil(batch)];
        let step = comptime![units / per_row];
        let row0 = unit / per_row;
        let col0 = unit % per_row;
        let mut regs = Array::<Vector<F, N>>::new(batch);
        #[unroll(batches <= 2)]
        for b in 0..batches {
            #[unroll]
            for i in 0..batch {
                let r = min(r0 + row0 + (b * batch + i) * step, n - 1);
                let at = vector_at::<F, N>(src, base, r, col0);
                // In bounds by construction (the row clamped to `n − 1`,
                // the column below the row's vectors), so unchecked: a
                // checked read selects 0 past the end, and that select,
                // waiting for the load, put the loads back in series.
                regs[i] = src.read_unchecked(at);
            }
            #[unroll]
            for i in 0..batch {
                let to = at + (row0 + (b * batch + i) * step) * ld + col0 * width;
                put_vector::<F, N>(dst, to, regs[i]);
            }
        }
    } else {
        // Other sizes (odd head dims, the scalar products' small blocks on
        // lavapipe): one vector at a time, any shape.
        let mut e = unit;
        while e < total {
            let r = min(r0 + e / per_row, n - 1);
            let col = e % per_row;
            let x = src[vector_at::<F, N>(src, base, r, col)];
            put_vector::<F, N>(dst, at + (e / per_row) * ld + col * width, x);
            e += units;
        }
    }
}

/// [`stage_tile`] with CUDA's asynchronous copies (`cp.async`, 16 bytes
/// each, `copy` elements): global memory to shared memory without passing
/// through registers, so nothing waits for them here. The caller commits
/// them to a barrier and waits on it before the tile is read
/// (`commit_copy_async`, then `arrive_and_wait`), and may compute between
/// the two. Rows past `n` repeat row `n − 1`, as [`stage_tile`]'s.
///
/// Trial setting (`launch::FlashLaunch::async_copy`): the launch checks
/// that `dim`, `base` and the row stride are multiples of `copy` elements
/// and that the buffer starts 16-byte aligned (`launch::async_copy_fits`);
/// `ld` must be a multiple of `copy` too (16-bit [`staged_ld`] is). `src`
/// is read as vectors of `N`, which divides `copy`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_tile_async<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut SharedMemory<F>,
    base: usize,
    r0: usize,
    n: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] ld: usize,
    #[comptime] units: usize,
    #[comptime] copy: usize,
) {
    stage_tile_async_at::<F, N>(src, dst, 0, base, r0, n, rows, dim, ld, units, copy);
}

/// [`stage_tile_async`] into `dst` from element `at` on (as [`stage_tile_at`]); `at` a
/// multiple of `copy`.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_tile_async_at<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut SharedMemory<F>,
    at: usize,
    base: usize,
    r0: usize,
    n: usize,
    #[comptime] rows: usize,
    #[comptime] dim: usize,
    #[comptime] ld: usize,
    #[comptime] units: usize,
    #[comptime] copy: usize,
) {
    let width = N::value().comptime();
    let vectors = comptime![copy / width];
    let per_row = comptime![dim / copy];
    let total = comptime![rows * per_row];
    let mut e = UNIT_POS as usize;
    #[unroll(total <= 4 * units)]
    for _ in 0..comptime![total.div_ceil(units)] {
        if e < total {
            let r = min(r0 + e / per_row, n - 1);
            let col = e % per_row;
            let from_at = vector_at::<F, N>(src, base, r, col * vectors);
            let from = src.slice(from_at, from_at + vectors);
            let to = at + (e / per_row) * ld + col * copy;
            let mut into = dst.slice_mut(to, to + copy);
            // SAFETY: the copy's bytes are `vectors` of `src`'s vectors,
            // whose start the launch checked is 16-byte aligned; only the
            // Rust types of the two slices differ.
            let from = unsafe { from.downcast_unchecked::<F>() };
            copy_async::<F>(&from, &mut into, comptime![copy as u32]);
        }
        e += units;
    }
}

/// A barrier of the whole cube for [`stage_tile_async`]'s copies (every
/// unit arrives on it) where `async_copy`; none elsewhere, since wgpu has no
/// barrier objects.
#[cube]
pub fn copy_barrier(#[comptime] async_copy: bool) -> ComptimeOption<Shared<Barrier>> {
    if async_copy {
        ComptimeOption::new_Some(Barrier::shared(CUBE_DIM, UNIT_POS == 0))
    } else {
        ComptimeOption::new_None()
    }
}

/// The index, in vectors of `N`, of row `r`'s `col`-th vector in the slice
/// of `src` from element `base` ([`stage_tile`]'s layout rules).
#[cube]
fn vector_at<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    base: usize,
    r: usize,
    col: usize,
) -> usize {
    let width = N::value().comptime();
    if comptime![width == 1] {
        base + r * src.stride(2) + col * src.stride(3)
    } else {
        (base + r * src.stride(2)) / width + col
    }
}

/// Stores the `N` elements of `x` at `dst[to ..]`, one at a time (why not
/// as a vector: `launch::vector_width`).
#[cube]
fn put_vector<F: Float, N: Size>(dst: &mut SharedMemory<F>, to: usize, x: Vector<F, N>) {
    #[unroll]
    for c in 0..N::value().comptime() {
        dst[to + c] = x[c];
    }
}

/// The most vectors a unit of [`stage_tile`] loads before it stores them:
/// each is a register (and its address two, for a while), so a 64 × 128
/// tile takes two rounds where one pushed the head-dim-128 kernels past
/// 255 registers.
const STAGE_BATCH: usize = 16;

/// Key blocks (of `block` keys, `t` in all) that the query block starting
/// at row `first` (of `s`) reads: all of them, or with `causal` those up to
/// its last row's block, since later ones are all in its future.
#[cube]
pub fn key_blocks(
    first: usize,
    #[comptime] block: usize,
    s: usize,
    t: usize,
    #[comptime] causal: bool,
) -> usize {
    let blocks = t.div_ceil(block);
    let mut end = blocks;
    if causal {
        let last = min(first + block, s) - 1;
        end = min(last / block + 1, blocks);
    }
    end
}

/// The first key block the query block starting at row `first` reads: 0, or
/// under a sliding `window` (causal; 0 for none) the block holding its first
/// row's oldest key, `first + 1 − window`, since older keys are outside every
/// row's window; and not before the block holding `lo`, the first token of the
/// first row's document (packed rows; 0 otherwise), since a document's rows see
/// no earlier one.
#[cube]
pub fn first_key_block(first: usize, #[comptime] block: usize, window: u32, lo: usize) -> usize {
    let w = window as usize;
    let mut start = lo / block;
    if w > 0 && first >= w {
        start = max(start, (first + 1 - w) / block);
    }
    start
}

/// Packed rows (`documents`): `spans [b, s, 2]` holds each token's document as
/// `[start, end)` (32-bit integers), and a query sees only the keys of its own.
/// The first token of the document of row `i` of batch row `bi`: 0 without
/// `documents`.
#[cube]
pub fn document_first(
    spans: &Tensor<u32>,
    bi: usize,
    i: usize,
    #[comptime] documents: bool,
) -> usize {
    let mut lo = 0;
    if documents {
        lo = spans[bi * spans.stride(0) + i * spans.stride(1)] as usize;
    }
    lo
}

/// The last token of the document of key `j` of batch row `bi` (the newest query
/// that may see it): `s − 1` without `documents`.
#[cube]
pub fn document_last(
    spans: &Tensor<u32>,
    bi: usize,
    j: usize,
    s: usize,
    #[comptime] documents: bool,
) -> usize {
    let mut hi = s - 1;
    if documents {
        hi = spans[bi * spans.stride(0) + j * spans.stride(1) + spans.stride(2)] as usize - 1;
    }
    hi
}

/// The first query block (of `block` queries, `s` in all) that sees the key
/// block starting at key `first`: 0, or with `causal` the block holding
/// query `first`, since queries before a key never see it.
#[cube]
pub fn first_query_block(
    first: usize,
    #[comptime] block: usize,
    s: usize,
    #[comptime] causal: bool,
) -> usize {
    let mut start = 0;
    if causal {
        start = min(first / block, s.div_ceil(block));
    }
    start
}

/// The query blocks (of `block` queries, `s` in all) up to which the key
/// block starting at key `first` is seen: all of them, or under a sliding
/// `window` (0 for none) those up to the block holding its last key's
/// newest query, `first + block − 2 + window`, since later queries' windows
/// start past it; and no later than the block holding `hi`, the last token of
/// the document of the block's last key (packed rows; `s − 1` otherwise).
#[cube]
pub fn query_blocks(
    first: usize,
    #[comptime] block: usize,
    s: usize,
    window: u32,
    hi: usize,
) -> usize {
    let blocks = s.div_ceil(block);
    let w = window as usize;
    let mut end = min(hi / block + 1, blocks);
    if w > 0 {
        end = min((first + block + w - 2) / block + 1, end);
    }
    end
}

/// Every query of the block of `block` from `q0` sees every key of the
/// block from `k0`, with no mask and no bias: both blocks are whole (`q0 +
/// block ≤ s`, `k0 + block ≤ t`), no padding, (causal) the last key
/// comes no later than the first query, (a sliding `window`, 0 for
/// none) the first key is within the last query's window, and (packed rows)
/// the document of the last query, which starts at `lo`, holds the first
/// key. The same for the whole cube, so a kernel can branch on it and skip the
/// per-score masks: in causal attention every block but those on the diagonal.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn unmasked(
    q0: usize,
    k0: usize,
    #[comptime] block: usize,
    s: usize,
    t: usize,
    #[comptime] causal: bool,
    #[comptime] padding: bool,
    window: u32,
    lo: usize,
) -> bool {
    let mut open = q0 + block <= s && k0 + block <= t && lo <= k0;
    if causal {
        open = open && k0 + block <= q0 + 1;
    }
    let w = window as usize;
    if w > 0 {
        open = open && q0 + block <= k0 + w;
    }
    if padding {
        open = false;
    }
    open
}

/// Key `j` takes no part in query `i`'s softmax: past the keys, in the
/// future of a causal query, (a sliding `window`, 0 for none) `window`
/// or more positions before it, or (packed rows, `documents`) in another
/// document: before `lo`, the first token of `i`'s, or with `i` past `hi`,
/// the last token of `j`'s. A kernel passes the bound its loop holds fixed and
/// a bound that excludes nothing for the other (`lo = 0`, `hi = i`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn excluded(
    j: usize,
    i: usize,
    t: usize,
    #[comptime] causal: bool,
    window: u32,
    lo: usize,
    hi: usize,
    #[comptime] documents: bool,
) -> bool {
    let mut out = j >= t;
    if causal {
        out = out || j > i;
    }
    let w = window as usize;
    if w > 0 {
        out = out || i >= j + w;
    }
    if documents {
        out = out || j < lo || i > hi;
    }
    out
}

/// The additive padding bias of key `j` of batch row `bi` (0 for a real
/// token, the executor's `-1e9` for a pad).
#[cube]
pub fn pad_bias(bias: &Tensor<f32>, bi: usize, j: usize) -> f32 {
    bias[pad_bias_index(bias, bi, j)]
}

/// Where [`pad_bias`] reads key `j`'s bias of batch row `bi`.
#[cube]
pub fn pad_bias_index(bias: &Tensor<f32>, bi: usize, j: usize) -> usize {
    bi * bias.stride(0) + j * bias.stride(1)
}

/// The most fp32 values a unit of a `Rows` kernel keeps in registers: its
/// rows are unrolled into registers only up to this many values (`rows ·
/// head_dim`). Past it they spill from a thread's 255 registers worse than
/// the loops keep them in local memory (ptxas, bf16, head dim 128: the
/// key-block backward's four rows gave a 2384-byte stack frame and 4.8 KB
/// of spill stores unrolled, against 2048 bytes of arrays as loops).
pub const MAX_REGISTER_VALUES: usize = 256;

/// Whether a `Rows` kernel whose units keep `rows` fp32 rows of `head_dim`
/// unrolls its loops over them: where asked (`unroll`) and where they fit
/// ([`MAX_REGISTER_VALUES`]).
pub fn unroll_rows(unroll: bool, rows: usize, head_dim: usize) -> bool {
    unroll && rows * head_dim <= MAX_REGISTER_VALUES
}

/// `Σ_c a[c] · rows[offset + c]`: one row of a register tile against one
/// row of a shared-memory tile (`unroll`: `a` stays in registers).
#[cube]
pub fn row_dot(
    a: &Array<f32>,
    rows: &SharedMemory<f32>,
    offset: usize,
    #[comptime] dim: usize,
    #[comptime] unroll: bool,
) -> f32 {
    let mut sum = f32::new(0.0);
    #[unroll(unroll)]
    for c in 0..dim {
        sum += a[c] * rows[offset + c];
    }
    sum
}

/// murmur3's 32-bit finalizer: `super::dropout::mix32` in a kernel.
#[cube]
fn mix32(x: u32) -> u32 {
    let x = x ^ (x >> 16u32);
    let x = x * 0x85EB_CA6Bu32;
    let x = x ^ (x >> 13u32);
    let x = x * 0xC2B2_AE35u32;
    x ^ (x >> 16u32)
}

/// The dropout key of query row `i` of head slice `bh` (`batch · heads +
/// head`), from the call's two seed words (`super::dropout::seed32` and
/// `row_key`); 0, and no read, without `dropout`.
#[cube]
pub fn dropout_row(seed: &Tensor<u32>, bh: usize, i: usize, #[comptime] dropout: bool) -> u32 {
    let mut key = 0u32;
    if dropout {
        let s = mix32(seed[0]) ^ seed[1];
        key = mix32(mix32(s + u32::cast_from(bh) * 0x9E37_79B9u32) ^ u32::cast_from(i));
    }
    key
}

/// What dropout multiplies probability `(i, j)` by, `row` being row `i`'s
/// key ([`dropout_row`]): 0 where its hash falls below `threshold`
/// (`p · 2^32`), `scale` (`1 / (1 − p)`) elsewhere, as
/// `super::dropout::keeps` decides; 1 without `dropout`.
#[cube]
pub fn keep_factor(
    row: u32,
    j: usize,
    threshold: u32,
    scale: f32,
    #[comptime] dropout: bool,
) -> f32 {
    let mut z = f32::new(1.0);
    if dropout {
        let h = mix32(row ^ (u32::cast_from(j) * 0x27D4_EB2Fu32));
        z = select(h >= threshold, scale, f32::new(0.0));
    }
    z
}
