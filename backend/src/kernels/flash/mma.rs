//! The block product of the tensor-core kernels: `C = A · B` (or `A · Bᵀ`)
//! over shared-memory tiles, computed by the whole cube.
//!
//! Three ways to compute it, chosen at compile time ([`Products`]):
//! - `TensorCores`: each plane (warp) takes 16 × 16 tiles of C in turn and
//!   accumulates them with `cmma` (16 × 16 × 16 fragments, fp32 accumulator),
//!   storing each finished tile to shared memory. A and B must be f16 or
//!   bf16, and `m`, `n`, `k` multiples of 16.
//! - `TiledScalar`: the same planes, tiles, operand slices and strides, each
//!   tile multiplied by its plane's units with scalar FMAs, reading the
//!   slices as `cmma` reads them. Only the `cmma` calls differ, so a device
//!   without tensor cores (lavapipe, in the tests) checks every index of the
//!   tensor-core path.
//! - `Scalar`: each unit computes elements of C with scalar fp32 FMAs, any
//!   sizes. With it a kernel built on [`block_product`] runs its whole data
//!   flow (staging, masks, online softmax) on any device and shape.
//!
//! Every unit of the cube must call it (it synchronizes nothing itself; the
//! callers put a `sync_cube` between writing an operand and the product, and
//! between the product and reading C).

use cubecl::prelude::*;

/// The side of a `cmma` fragment.
pub const TILE: usize = 16;

/// How [`block_product`] multiplies (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Products {
    Scalar,
    TensorCores,
    TiledScalar,
}

/// Row padding, in elements, of the tiles that units read or write one row
/// each (S, dP, P, dS and the products' outputs): 16 bytes, 4 fp32 or 8
/// 16-bit values. A plane's 32 units then reach one column of 32 rows
/// through 8 of shared memory's 32 banks (4-way conflicts) instead of one
/// (32-way, with rows of 64 or 128 elements), and every 16-row tile still
/// starts 32-byte aligned with a stride wmma takes.
pub const PAD_F32: usize = 4;
/// [`PAD_F32`] for tiles of the input type (P, dS).
pub const PAD_HALF: usize = 8;

/// `C[m × n] = A[m × k] · B[k × n]`: A row-major `[m × k]` with row stride
/// `lda` or, with `a_transposed`, given as its transpose (row-major
/// `[k × m]`: the one-pass backward's `dQ = dS K` from the `dSᵀ` it holds);
/// B row-major `[k × n]` with row stride `ldb` or, with `b_transposed`,
/// given as its transpose (row-major `[n × k]`, so `C = A · Bᵀ` of the
/// stored rows); C fp32, row-major from element `c_offset` of `c` with row stride
/// `ldc`. Sizes are run-time arguments, but the kernels pass their
/// compile-time block and head dim (not the tensors' run-time extent): with
/// a constant `k` the compiler unrolls the loop over `k` and issues a tile's
/// fragment loads ahead of its `mma`s, where a run-time `k` left one load,
/// wait and `mma` per 16 columns (the H100 machine code showed both). With
/// `Products::TensorCores`, every 16-row tile must start
/// 32-byte aligned and the strides be multiples of 16 bytes (wmma's rules),
/// as rows of multiples of 16 elements padded by [`PAD_F32`] or
/// [`PAD_HALF`] are. With `pairs` (tiled forms only; callers pass
/// [`pairs_fit`] of the product's sides), each plane takes 2 × 2 tiles at a
/// time and `m`, `n` must be multiples of 32.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn block_product<F: Float>(
    a: &SharedMemory<F>,
    lda: usize,
    #[comptime] a_transposed: bool,
    b: &SharedMemory<F>,
    ldb: usize,
    #[comptime] b_transposed: bool,
    c: &mut SharedMemory<f32>,
    c_offset: usize,
    ldc: usize,
    m: usize,
    n: usize,
    k: usize,
    #[comptime] products: Products,
    #[comptime] pairs: bool,
) {
    if comptime![products == Products::Scalar] {
        let units = CUBE_DIM as usize;
        let mut e = UNIT_POS as usize;
        while e < m * n {
            let i = e / n;
            let j = e % n;
            let mut sum = f32::new(0.0);
            for l in 0..k {
                let av = if a_transposed {
                    a[l * lda + i]
                } else {
                    a[i * lda + l]
                };
                let bv = if b_transposed {
                    b[j * ldb + l]
                } else {
                    b[l * ldb + j]
                };
                sum += f32::cast_from(av) * f32::cast_from(bv);
            }
            c[c_offset + i * ldc + j] = sum;
            e += units;
        }
    } else if comptime![pairs] {
        // Planes take 2 × 2 groups of 16 × 16 tiles of C in turn. On tensor
        // cores each step of k loads two A and two B fragments for four
        // products (one shared-memory fragment load per product instead of
        // two). The tiled scalar form computes the same four tiles in the
        // same order from the same slices.
        let plane_dim = PLANE_DIM as usize;
        let planes = (CUBE_DIM as usize).div_ceil(plane_dim);
        let plane = UNIT_POS as usize / plane_dim;
        let groups_per_row = n / (2 * TILE);
        let groups = (m / (2 * TILE)) * groups_per_row;
        let mut t = plane;
        while t < groups {
            let ti = (t / groups_per_row) * 2;
            let tj = (t % groups_per_row) * 2;
            if comptime![products == Products::TensorCores] {
                let acc00 = zero_accumulator();
                let acc01 = zero_accumulator();
                let acc10 = zero_accumulator();
                let acc11 = zero_accumulator();
                let mut kk = 0;
                while kk < k {
                    let a0 = fragment_a::<F>(a, lda, a_transposed, ti, kk);
                    let a1 = fragment_a::<F>(a, lda, a_transposed, ti + 1, kk);
                    let b0 = fragment_b::<F>(b, ldb, b_transposed, tj, kk);
                    let b1 = fragment_b::<F>(b, ldb, b_transposed, tj + 1, kk);
                    cmma::execute::<F, F, f32, f32>(&a0, &b0, &acc00, &acc00);
                    cmma::execute::<F, F, f32, f32>(&a0, &b1, &acc01, &acc01);
                    cmma::execute::<F, F, f32, f32>(&a1, &b0, &acc10, &acc10);
                    cmma::execute::<F, F, f32, f32>(&a1, &b1, &acc11, &acc11);
                    kk += TILE;
                }
                store_tile(c, c_offset, ldc, ti, tj, &acc00);
                store_tile(c, c_offset, ldc, ti, tj + 1, &acc01);
                store_tile(c, c_offset, ldc, ti + 1, tj, &acc10);
                store_tile(c, c_offset, ldc, ti + 1, tj + 1, &acc11);
            } else {
                for g in 0..4usize {
                    scalar_tile::<F>(
                        a,
                        lda,
                        a_transposed,
                        b,
                        ldb,
                        b_transposed,
                        c,
                        c_offset,
                        ldc,
                        ti + g / 2,
                        tj + g % 2,
                        k,
                    );
                }
            }
            t += planes;
        }
    } else {
        // Planes take 16 × 16 tiles of C in turn; every unit of a plane takes
        // the same tiles (a `cmma` is the whole plane's). Both tiled forms
        // share these loops and the operand slices; only the multiply differs.
        let plane_dim = PLANE_DIM as usize;
        let planes = (CUBE_DIM as usize).div_ceil(plane_dim);
        let cols = n / TILE;
        let tiles = (m / TILE) * cols;
        let plane = UNIT_POS as usize / plane_dim;
        let mut t = plane;
        while t < tiles {
            let ti = t / cols;
            let tj = t % cols;
            if comptime![products == Products::TensorCores] {
                let acc = zero_accumulator();
                let mut kk = 0;
                while kk < k {
                    let fa = fragment_a::<F>(a, lda, a_transposed, ti, kk);
                    let fb = fragment_b::<F>(b, ldb, b_transposed, tj, kk);
                    cmma::execute::<F, F, f32, f32>(&fa, &fb, &acc, &acc);
                    kk += TILE;
                }
                store_tile(c, c_offset, ldc, ti, tj, &acc);
            } else {
                scalar_tile::<F>(
                    a,
                    lda,
                    a_transposed,
                    b,
                    ldb,
                    b_transposed,
                    c,
                    c_offset,
                    ldc,
                    ti,
                    tj,
                    k,
                );
            }
            t += planes;
        }
    }
}

/// Whether a `block_product` of `m × n` takes 2 × 2 tiles per plane (its
/// `pairs`), with `planes` planes in the cube: both sides multiples of 32,
/// and at least one group of four tiles per plane (fewer would leave planes
/// idle, which costs more than the loads it saves).
pub const fn pairs_fit(m: usize, n: usize, planes: usize) -> bool {
    let side = 2 * TILE;
    m.is_multiple_of(side) && n.is_multiple_of(side) && (m / side) * (n / side) >= planes
}

/// A zeroed 16 × 16 fp32 accumulator fragment.
#[cube]
fn zero_accumulator() -> cmma::Matrix<f32> {
    cmma::Matrix::<f32>::from_value(
        cmma::MatrixIdent::Accumulator,
        TILE,
        TILE,
        TILE,
        cmma::MatrixLayout::Undefined,
        f32::new(0.0),
    )
}

/// The A fragment of tile row `ti`, columns `kk ..` ([`a_tile`]).
#[cube]
fn fragment_a<F: Float>(
    a: &SharedMemory<F>,
    lda: usize,
    #[comptime] a_transposed: bool,
    ti: usize,
    kk: usize,
) -> cmma::Matrix<F> {
    let tile = a_tile::<F>(a, lda, ti, kk, a_transposed);
    fragment::<F>(&tile, lda, cmma::MatrixIdent::A, a_transposed)
}

/// The B fragment of rows `kk ..`, tile column `tj` ([`b_tile`]).
#[cube]
fn fragment_b<F: Float>(
    b: &SharedMemory<F>,
    ldb: usize,
    #[comptime] b_transposed: bool,
    tj: usize,
    kk: usize,
) -> cmma::Matrix<F> {
    let tile = b_tile::<F>(b, ldb, tj, kk, b_transposed);
    fragment::<F>(&tile, ldb, cmma::MatrixIdent::B, b_transposed)
}

/// The `ident` fragment of the 16 × 16 tile from `tile`'s first element,
/// row stride `ld`; with `transposed` the stored rows are the operand's
/// columns (its transpose stored row-major is it stored column-major).
#[cube]
fn fragment<F: Float>(
    tile: &Slice<F>,
    ld: usize,
    #[comptime] ident: cmma::MatrixIdent,
    #[comptime] transposed: bool,
) -> cmma::Matrix<F> {
    let layout = if transposed {
        cmma::MatrixLayout::ColMajor
    } else {
        cmma::MatrixLayout::RowMajor
    };
    cmma::Matrix::<F>::from_slice(ident, TILE, TILE, TILE, layout, tile, ld as u32)
}

/// Stores the accumulator of tile `(ti, tj)` of C.
#[cube]
fn store_tile(
    c: &mut SharedMemory<f32>,
    c_offset: usize,
    ldc: usize,
    ti: usize,
    tj: usize,
    acc: &cmma::Matrix<f32>,
) {
    let start = c_offset + ti * TILE * ldc + tj * TILE;
    cmma::store(
        &mut c.slice_mut(start, start + (TILE - 1) * ldc + TILE),
        acc,
        ldc as u32,
        cmma::MatrixLayout::RowMajor,
    );
}

/// Tile `(ti, tj)` of C on scalar FMAs by the plane's lanes, reading the
/// operand slices as `cmma` reads them with those layouts (`TiledScalar`).
#[cube]
#[allow(clippy::too_many_arguments)]
fn scalar_tile<F: Float>(
    a: &SharedMemory<F>,
    lda: usize,
    #[comptime] a_transposed: bool,
    b: &SharedMemory<F>,
    ldb: usize,
    #[comptime] b_transposed: bool,
    c: &mut SharedMemory<f32>,
    c_offset: usize,
    ldc: usize,
    ti: usize,
    tj: usize,
    k: usize,
) {
    let plane_dim = PLANE_DIM as usize;
    let plane = UNIT_POS as usize / plane_dim;
    let lane = UNIT_POS as usize % plane_dim;
    let lanes = min(plane_dim, CUBE_DIM as usize - plane * plane_dim);
    let c_start = c_offset + ti * TILE * ldc + tj * TILE;
    let mut idx = lane;
    while idx < TILE * TILE {
        let r = idx / TILE;
        let cc = idx % TILE;
        let mut sum = f32::new(0.0);
        let mut kk = 0;
        while kk < k {
            let fa = a_tile::<F>(a, lda, ti, kk, a_transposed);
            let fb = b_tile::<F>(b, ldb, tj, kk, b_transposed);
            for l in 0..TILE {
                let av = if a_transposed {
                    fa[l * lda + r]
                } else {
                    fa[r * lda + l]
                };
                let bv = if b_transposed {
                    fb[cc * ldb + l]
                } else {
                    fb[l * ldb + cc]
                };
                sum += f32::cast_from(av) * f32::cast_from(bv);
            }
            kk += TILE;
        }
        let mut fc = c.slice_mut(c_start, c_start + (TILE - 1) * ldc + TILE);
        fc[r * ldc + cc] = sum;
        idx += lanes;
    }
}

/// The 16 × 16 tile of A at tile row `ti`, columns `kk ..`: a slice from its
/// first element, row stride `lda`; with `a_transposed` from the stored
/// rows `kk ..`, columns `ti · 16 ..` (A column-major).
#[cube]
fn a_tile<F: Float>(
    a: &SharedMemory<F>,
    lda: usize,
    ti: usize,
    kk: usize,
    #[comptime] a_transposed: bool,
) -> Slice<F> {
    operand_tile::<F>(a, lda, ti, kk, a_transposed)
}

/// The 16 × 16 tile of B at rows `kk ..`, tile column `tj`: with
/// `b_transposed` from the stored rows `tj · 16 ..` (B column-major),
/// otherwise from row `kk`; row stride `ldb`.
#[cube]
fn b_tile<F: Float>(
    b: &SharedMemory<F>,
    ldb: usize,
    tj: usize,
    kk: usize,
    #[comptime] b_transposed: bool,
) -> Slice<F> {
    // B's tile column `tj` is Bᵀ's tile row `tj`.
    operand_tile::<F>(b, ldb, tj, kk, comptime![!b_transposed])
}

/// The 16 × 16 tile at tile row `outer`, reduction columns `kk ..` of an
/// operand stored with rows `ld` apart: from stored row `outer · 16`,
/// column `kk`; or, with `k_rows` (the reduction runs down the stored
/// rows), from stored row `kk`, column `outer · 16`.
#[cube]
fn operand_tile<F: Float>(
    x: &SharedMemory<F>,
    ld: usize,
    outer: usize,
    kk: usize,
    #[comptime] k_rows: bool,
) -> Slice<F> {
    let start = if k_rows {
        kk * ld + outer * TILE
    } else {
        outer * TILE * ld + kk
    };
    x.slice(start, start + (TILE - 1) * ld + TILE)
}
