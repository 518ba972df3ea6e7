//! The block product of the tensor-core kernels: `C = A · B` (or `A · Bᵀ`)
//! over shared-memory tiles, computed by the whole cube.
//!
//! Two ways to compute it, chosen at compile time:
//! - `tensor_cores`: each plane (warp) takes 16 × 16 tiles of C in turn and
//!   accumulates them with `cmma` (16 × 16 × 16 fragments, fp32 accumulator),
//!   storing each finished tile to shared memory. A and B must be f16 or
//!   bf16, and `m`, `n`, `k` multiples of 16.
//! - otherwise each unit computes elements of C with scalar fp32 FMAs. This
//!   is the same product with the same inputs and outputs, so a kernel built
//!   on [`block_product`] runs its whole data flow (staging, masks, online
//!   softmax) on a device without tensor cores: lavapipe in the tests.
//!
//! Every unit of the cube must call it (it synchronizes nothing itself; the
//! callers put a `sync_cube` between writing an operand and the product, and
//! between the product and reading C).

use cubecl::prelude::*;

/// The side of a `cmma` fragment.
pub const TILE: usize = 16;

/// Row padding, in elements, of the tiles that units read or write one row
/// each (S, dP, P, dS and the products' outputs): 16 bytes, 4 fp32 or 8
/// 16-bit values. A plane's 32 units then reach one column of 32 rows
/// through 8 of shared memory's 32 banks (4-way conflicts) instead of one
/// (32-way, with rows of 64 or 128 elements), and every 16-row tile still
/// starts 32-byte aligned with a stride wmma takes.
pub const PAD_F32: usize = 4;
/// [`PAD_F32`] for tiles of the input type (P, dS).
pub const PAD_HALF: usize = 8;

/// `C[m × n] = A[m × k] · B[k × n]`: A row-major with row stride `lda`; B
/// row-major `[k × n]` with row stride `ldb` or, with `b_transposed`, given
/// as its transpose (row-major `[n × k]`, so `C = A · Bᵀ` of the stored
/// rows); C fp32, row-major from element `c_offset` of `c` with row stride
/// `ldc`. Sizes are run-time values so that shader compilers do not unroll
/// the scalar loops. With `tensor_cores`, every 16-row tile must start
/// 32-byte aligned and the strides be multiples of 16 bytes (wmma's rules),
/// as rows of multiples of 16 elements padded by [`PAD_F32`] or
/// [`PAD_HALF`] are.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn block_product<F: Float>(
    a: &SharedMemory<F>,
    lda: usize,
    b: &SharedMemory<F>,
    ldb: usize,
    #[comptime] b_transposed: bool,
    c: &mut SharedMemory<f32>,
    c_offset: usize,
    ldc: usize,
    m: usize,
    n: usize,
    k: usize,
    #[comptime] tensor_cores: bool,
) {
    if tensor_cores {
        let planes = CUBE_DIM as usize / PLANE_DIM as usize;
        let cols = n / TILE;
        let tiles = (m / TILE) * cols;
        let mut t = UNIT_POS as usize / PLANE_DIM as usize;
        // Every unit of a plane takes the same tiles: the fragments are
        // loaded, multiplied and stored by the whole plane together.
        while t < tiles {
            let ti = t / cols;
            let tj = t % cols;
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
                let a_start = ti * TILE * lda + kk;
                let fa = cmma::Matrix::<F>::from_slice(
                    cmma::MatrixIdent::A,
                    TILE,
                    TILE,
                    TILE,
                    cmma::MatrixLayout::RowMajor,
                    &a.slice(a_start, a_start + (TILE - 1) * lda + TILE),
                    lda as u32,
                );
                let fb = if b_transposed {
                    // Bᵀ stored row-major is B stored column-major.
                    let b_start = tj * TILE * ldb + kk;
                    cmma::Matrix::<F>::from_slice(
                        cmma::MatrixIdent::B,
                        TILE,
                        TILE,
                        TILE,
                        cmma::MatrixLayout::ColMajor,
                        &b.slice(b_start, b_start + (TILE - 1) * ldb + TILE),
                        ldb as u32,
                    )
                } else {
                    let b_start = kk * ldb + tj * TILE;
                    cmma::Matrix::<F>::from_slice(
                        cmma::MatrixIdent::B,
                        TILE,
                        TILE,
                        TILE,
                        cmma::MatrixLayout::RowMajor,
                        &b.slice(b_start, b_start + (TILE - 1) * ldb + TILE),
                        ldb as u32,
                    )
                };
                cmma::execute::<F, F, f32, f32>(&fa, &fb, &acc, &acc);
                kk += TILE;
            }
            let c_start = c_offset + ti * TILE * ldc + tj * TILE;
            cmma::store(
                &mut c.slice_mut(c_start, c_start + (TILE - 1) * ldc + TILE),
                &acc,
                ldc as u32,
                cmma::MatrixLayout::RowMajor,
            );
            t += planes;
        }
    } else {
        let units = CUBE_DIM as usize;
        let mut e = UNIT_POS as usize;
        while e < m * n {
            let i = e / n;
            let j = e % n;
            let mut sum = f32::new(0.0);
            for l in 0..k {
                let bv = if b_transposed {
                    b[j * ldb + l]
                } else {
                    b[l * ldb + j]
                };
                sum += f32::cast_from(a[i * lda + l]) * f32::cast_from(bv);
            }
            c[c_offset + i * ldc + j] = sum;
            e += units;
        }
    }
}
