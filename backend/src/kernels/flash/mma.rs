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
/// `ldc`. Sizes are run-time values so that shader compilers do not unroll
/// the scalar loops. With `Products::TensorCores`, every 16-row tile must start
/// 32-byte aligned and the strides be multiples of 16 bytes (wmma's rules),
/// as rows of multiples of 16 elements padded by [`PAD_F32`] or
/// [`PAD_HALF`] are.
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
            let c_start = c_offset + ti * TILE * ldc + tj * TILE;
            if comptime![products == Products::TensorCores] {
                let acc = cmma::Matrix::<f32>::from_value(
                    cmma::MatrixIdent::Accumulator,
                    TILE,
                    TILE,
                    TILE,
                    cmma::MatrixLayout::Undefined,
                    f32::new(0.0),
                );
                let mut kk = 0;
                while kk < k {
                    // Aᵀ stored row-major is A stored column-major.
                    let a_layout = if a_transposed {
                        cmma::MatrixLayout::ColMajor
                    } else {
                        cmma::MatrixLayout::RowMajor
                    };
                    let fa = cmma::Matrix::<F>::from_slice(
                        cmma::MatrixIdent::A,
                        TILE,
                        TILE,
                        TILE,
                        a_layout,
                        &a_tile::<F>(a, lda, ti, kk, a_transposed),
                        lda as u32,
                    );
                    let layout = if b_transposed {
                        // Bᵀ stored row-major is B stored column-major.
                        cmma::MatrixLayout::ColMajor
                    } else {
                        cmma::MatrixLayout::RowMajor
                    };
                    let fb = cmma::Matrix::<F>::from_slice(
                        cmma::MatrixIdent::B,
                        TILE,
                        TILE,
                        TILE,
                        layout,
                        &b_tile::<F>(b, ldb, tj, kk, b_transposed),
                        ldb as u32,
                    );
                    cmma::execute::<F, F, f32, f32>(&fa, &fb, &acc, &acc);
                    kk += TILE;
                }
                cmma::store(
                    &mut c.slice_mut(c_start, c_start + (TILE - 1) * ldc + TILE),
                    &acc,
                    ldc as u32,
                    cmma::MatrixLayout::RowMajor,
                );
            } else {
                // TiledScalar: the plane's lanes share the tile's elements,
                // reading the slices as `cmma` reads them with those layouts.
                let lane = UNIT_POS as usize % plane_dim;
                let lanes = min(plane_dim, CUBE_DIM as usize - plane * plane_dim);
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
            t += planes;
        }
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
    let start = if a_transposed {
        kk * lda + ti * TILE
    } else {
        ti * TILE * lda + kk
    };
    a.slice(start, start + (TILE - 1) * lda + TILE)
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
    let start = if b_transposed {
        tj * TILE * ldb + kk
    } else {
        kk * ldb + tj * TILE
    };
    b.slice(start, start + (TILE - 1) * ldb + TILE)
}
