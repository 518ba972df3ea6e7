//! `block_product` alone, in the operand layouts the flash kernels give it,
//! against an f64 product of the same (rounded) inputs. Where the flash
//! tests on tensor cores fail, this says whether the `cmma` products
//! themselves are wrong (fragment layouts, strides, the alignment of a
//! tile) or the data flow around them.
//!
//! On wgpu (lavapipe here) the scalar and tiled-scalar products run at
//! sizes that fit its 32 KiB of shared memory; on CUDA the tensor-core
//! products run at the flash kernels' own sizes (blocks of 64, head dims 64
//! and 128).

use cubecl::prelude::*;

use super::device_tensor::{DeviceTensor, Elem};
use super::mma::{block_product, Products, PAD_F32, PAD_HALF};
use super::reference::fill;
use crate::testing::client_or_skip;

/// Stages `a` (`[m, lda]`) and `b` (`[k, ldb]`, or `[n, ldb]` with
/// `b_transposed`) in shared memory as the flash kernels do (aligned to 128
/// bytes), multiplies them with the whole cube into an fp32 tile at
/// `c_offset` with row stride `ldc`, and writes the `m × n` product to `c`.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn product<F: Float>(
    a: &Tensor<F>,
    b: &Tensor<F>,
    c: &mut Tensor<f32>,
    #[comptime] m: usize,
    #[comptime] n: usize,
    #[comptime] k: usize,
    #[comptime] lda: usize,
    #[comptime] ldb: usize,
    #[comptime] ldc: usize,
    #[comptime] c_offset: usize,
    #[comptime] a_transposed: bool,
    #[comptime] b_transposed: bool,
    #[comptime] products: Products,
    #[comptime] pairs: bool,
    #[define(F)] _dtype: StorageType,
) {
    let units = CUBE_DIM as usize;
    let a_len = comptime![if a_transposed { k * lda } else { m * lda }];
    let b_len = comptime![if b_transposed { n * ldb } else { k * ldb }];
    let mut sa = SharedMemory::<F>::new_aligned(a_len, 128usize);
    let mut sb = SharedMemory::<F>::new_aligned(b_len, 128usize);
    let mut sc = SharedMemory::<f32>::new_aligned(comptime![c_offset + m * ldc], 128usize);
    let mut e = UNIT_POS as usize;
    while e < a_len {
        sa[e] = a[e];
        e += units;
    }
    e = UNIT_POS as usize;
    while e < b_len {
        sb[e] = b[e];
        e += units;
    }
    sync_cube();
    block_product::<F>(
        &sa,
        lda,
        a_transposed,
        &sb,
        ldb,
        b_transposed,
        &mut sc,
        c_offset,
        ldc,
        m,
        n,
        k,
        products,
        pairs,
    );
    sync_cube();
    e = UNIT_POS as usize;
    while e < m * n {
        c[e] = sc[c_offset + (e / n) * ldc + e % n];
        e += units;
    }
}

/// One product: `C[m × n] = A[m × k] · B` in the layouts above.
#[derive(Clone, Copy, Debug)]
struct Case {
    what: &'static str,
    m: usize,
    n: usize,
    k: usize,
    lda: usize,
    ldb: usize,
    ldc: usize,
    c_offset: usize,
    a_transposed: bool,
    b_transposed: bool,
}

impl Case {
    /// The flash kernels' four kinds of product at block `block` and head
    /// dim `d`: `S = Q Kᵀ` (B given as its transpose, C rows padded), the
    /// second of two such products (dP beside S, into the tile's second
    /// half), `P V` (A padded P, B row-major V), and the one-pass
    /// backward's `dS K` (A given as the padded `dSᵀ`).
    fn flash(block: usize, d: usize) -> [Case; 4] {
        let s_ld = block + PAD_F32;
        let qk = Case {
            what: "S = Q Kᵀ",
            m: block,
            n: block,
            k: d,
            lda: d,
            ldb: d,
            ldc: s_ld,
            c_offset: 0,
            a_transposed: false,
            b_transposed: true,
        };
        [
            qk,
            Case {
                what: "dP = dO Vᵀ beside S",
                c_offset: block * s_ld,
                ..qk
            },
            Case {
                what: "P V",
                m: block,
                n: d,
                k: block,
                lda: block + PAD_HALF,
                ldb: d,
                ldc: d + PAD_F32,
                c_offset: 0,
                a_transposed: false,
                b_transposed: false,
            },
            Case {
                what: "dS K from dSᵀ",
                m: block,
                n: d,
                k: block,
                lda: block + PAD_HALF,
                ldb: d,
                ldc: d + PAD_F32,
                c_offset: 0,
                a_transposed: true,
                b_transposed: false,
            },
        ]
    }

    /// The same product with twice the rows of A and C (64 at block 32),
    /// A's rows twice as many (or, transposed, its columns). Only the wgpu tests use it.
    #[cfg_attr(not(feature = "wgpu-kernels"), allow(dead_code))]
    fn taller(case: Case) -> Case {
        Case {
            what: "taller",
            m: 2 * case.m,
            lda: if case.a_transposed {
                2 * case.m + PAD_HALF
            } else {
                case.lda
            },
            ..case
        }
    }

    fn a_len(&self) -> usize {
        if self.a_transposed {
            self.k * self.lda
        } else {
            self.m * self.lda
        }
    }

    fn b_len(&self) -> usize {
        if self.b_transposed {
            self.n * self.ldb
        } else {
            self.k * self.ldb
        }
    }

    /// The product in f64 of the inputs as stored (padding columns unread).
    fn expected(&self, a: &[f32], b: &[f32]) -> Vec<f64> {
        let mut out = vec![0.0; self.m * self.n];
        for i in 0..self.m {
            for j in 0..self.n {
                out[i * self.n + j] = (0..self.k)
                    .map(|l| {
                        let bv = if self.b_transposed {
                            b[j * self.ldb + l]
                        } else {
                            b[l * self.ldb + j]
                        };
                        let av = if self.a_transposed {
                            a[l * self.lda + i]
                        } else {
                            a[i * self.lda + l]
                        };
                        av as f64 * bv as f64
                    })
                    .sum();
            }
        }
        out
    }
}

/// The reference's fill (values in [-1, 1)), rounded to `E`.
fn values<E: Elem>(n: usize, seed: u64) -> Vec<f32> {
    fill(n, seed)
        .into_iter()
        .map(|v| E::from_f32(v).to_f32())
        .collect()
}

/// Runs `case` with inputs of type `E` and `products` (with `pairs`: 2 × 2
/// tiles per plane) on a cube of 128 units (four planes, as the flash
/// kernels' blocks of 64 rows with two units each), and checks every
/// element within `1e-3 · (1 + |x|)`.
fn check<R: Runtime, E: Elem>(
    client: &ComputeClient<R>,
    case: Case,
    products: Products,
    pairs: bool,
) {
    let ty = E::as_type_native_unchecked();
    if !client.properties().supports_type(ty) {
        eprintln!("SKIPPED: no {ty:?} on {}", std::any::type_name::<R>());
        return;
    }
    let a = values::<E>(case.a_len(), 1);
    let b = values::<E>(case.b_len(), 2);
    let da = DeviceTensor::<R>::new_as::<E>(client, &a, &[a.len()]);
    let db = DeviceTensor::<R>::new_as::<E>(client, &b, &[b.len()]);
    let dc = DeviceTensor::<R>::zeros(client, &[case.m * case.n]);
    product::launch::<R>(
        client,
        CubeCount::Static(1, 1, 1),
        CubeDim::new_1d(128),
        da.arg(),
        db.arg(),
        dc.arg(),
        case.m,
        case.n,
        case.k,
        case.lda,
        case.ldb,
        case.ldc,
        case.c_offset,
        case.a_transposed,
        case.b_transposed,
        products,
        pairs,
        ty.storage_type(),
    );
    let got = dc.read(client);
    let want = case.expected(&a, &b);
    let (worst, at) = got
        .iter()
        .zip(&want)
        .enumerate()
        .map(|(i, (&g, &w))| ((g as f64 - w).abs() / (1.0 + w.abs()), i))
        .fold((0.0, 0), |acc, x| if x.0 > acc.0 { x } else { acc });
    assert!(
        worst <= 1e-3,
        "{} ({case:?}, {products:?}, pairs {pairs}, {ty:?}): element {} (row {}, column {}) is {} where {} was expected",
        case.what,
        at,
        at / case.n,
        at % case.n,
        got[at],
        want[at]
    );
}

#[cfg(feature = "wgpu-kernels")]
mod wgpu {
    use super::*;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

    fn client() -> Option<ComputeClient<WgpuRuntime>> {
        client_or_skip::<WgpuRuntime>(|| WgpuDevice::DefaultDevice, "vulkan", "block_product")
    }

    /// Blocks of 32 at head dim 32: the same layouts within lavapipe's
    /// 32 KiB of shared memory.
    #[test]
    fn scalar_and_tiled_products_in_the_flash_layouts() {
        let Some(client) = client() else { return };
        for case in Case::flash(32, 32) {
            for products in [Products::Scalar, Products::TiledScalar] {
                check::<_, f32>(&client, case, products, false);
                check::<_, burn::tensor::f16>(&client, case, products, false);
            }
        }
    }

    /// 2 × 2 tiles per plane, in the tiled form: the flash layouts at 32
    /// rows and head dim 32 (one group of four tiles), and with 64 rows or
    /// a head dim of 64 (two groups, down and across).
    #[test]
    fn tiled_products_two_by_two() {
        let Some(client) = client() else { return };
        let mut cases: Vec<Case> = Case::flash(32, 32).to_vec();
        for case in Case::flash(32, 32) {
            cases.push(Case::taller(case));
        }
        cases.push(Case::flash(32, 64)[2]);
        cases.push(Case::flash(32, 64)[3]);
        for case in cases {
            check::<_, f32>(&client, case, Products::TiledScalar, true);
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cubecl::cuda::{CudaDevice, CudaRuntime};

    fn client() -> Option<ComputeClient<CudaRuntime>> {
        client_or_skip::<CudaRuntime>(|| CudaDevice::new(0), "cuda", "block_product")
    }

    /// The tensor-core products at the flash kernels' sizes, both 16-bit
    /// types.
    #[test]
    fn tensor_core_products_in_the_flash_layouts() {
        let Some(client) = client() else { return };
        for d in [64, 128] {
            for case in Case::flash(64, d) {
                check::<_, burn::tensor::bf16>(&client, case, Products::TensorCores, false);
                check::<_, burn::tensor::f16>(&client, case, Products::TensorCores, false);
            }
        }
    }

    /// The same layouts on scalar FMAs: if these pass where the tensor-core
    /// ones fail, the fault is in the `cmma` calls.
    #[test]
    fn scalar_products_in_the_flash_layouts() {
        let Some(client) = client() else { return };
        for d in [64, 128] {
            for case in Case::flash(64, d) {
                check::<_, burn::tensor::bf16>(&client, case, Products::TiledScalar, false);
            }
        }
    }
}

/// The tensor-core products with 2 × 2 tiles per plane (a trial setting:
/// `FlashLaunch::tile_pairs`), apart from `cuda`, whose tests decide whether
/// a GPU call's speed run takes the tensor cores (`gpu_flash_call.sh`).
#[cfg(feature = "cuda")]
mod trials_cuda {
    use super::*;
    use cubecl::cuda::{CudaDevice, CudaRuntime};

    #[test]
    fn tensor_core_products_two_by_two() {
        let Some(client) =
            client_or_skip::<CudaRuntime>(|| CudaDevice::new(0), "cuda", "block_product")
        else {
            return;
        };
        for d in [64, 128] {
            for case in Case::flash(64, d) {
                check::<_, burn::tensor::bf16>(&client, case, Products::TensorCores, true);
                check::<_, burn::tensor::f16>(&client, case, Products::TensorCores, true);
            }
        }
    }
}
