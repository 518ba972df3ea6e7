//! CubeCL 0.10's manual MMA (`cmma::MmaDefinition`: PTX's `mma.sync` on register
//! fragments), the building block of FlashAttention-2's structure: each warp keeps its rows'
//! scores and output in registers between key blocks, and the accumulator of two adjacent
//! `n8` tiles of `S` is, element for element, the `A` fragment of `P` for `P V`
//! (`docs/flash-attention.md`, "What remains"). Nothing in the executor uses it yet; these
//! tests pin what a kernel built on it would rely on:
//!
//! - `position_of_nth` is PTX's `m16n8k16` layout, as `PTX_LAYOUT` writes it (the CUDA
//!   compiler's `row_index` / `col_index`, read from cubecl-cpp 0.10);
//! - `execute` computes `a b + c` from fragments loaded where `position_of_nth` says;
//! - an accumulator pair read as an `A` fragment is the same matrix.
//!
//! The source compiles here (NVRTC, `sm_90a`: `mma.sync.aligned.m16n8k16` in it, no
//! stack); the products need a GPU (`cuda` below, in the flash tests a GPU call runs).

use cubecl::cmma::MmaDefinition;
use cubecl::ir::MatrixIdent;
use cubecl::prelude::*;

define_size!(VA);
define_size!(VB);
define_size!(VC);

#[cube]
#[allow(unused_variables)]
fn register_sizes<F: Float>(def: MmaDefinition<F, F, f32>) {
    let a = def.vector_size(MatrixIdent::A);
    let b = def.vector_size(MatrixIdent::B);
    let c = def.vector_size(MatrixIdent::Accumulator);
    intrinsic!(|scope| {
        scope.register_size::<VA>(a);
        scope.register_size::<VB>(b);
        scope.register_size::<VC>(c);
    });
}

/// One warp. `c [16, 16] = a [16, 16] · b [16, 16]` (row-major, contiguous) as two
/// `m16n8k16` products, one per 8 columns of `c`, from fragments loaded where
/// `position_of_nth` puts each (lane, element). Then `p [16, 16] = (a · b)` again, but
/// through the FlashAttention-2 reuse: the two accumulators, rounded to `F`, are read as
/// one `A` fragment (accumulator `j`'s element `e` is `A`'s element `4 j + e`) and
/// multiplied by the identity, so `p == c` (rounded) exactly where that reading is right.
/// `places [32, 3, 8]` gets each lane's (row · 16 + col) of every element of its `A`, `B`
/// and accumulator fragments.
#[cube(launch)]
fn mma_probe<F: Float>(
    a: &Tensor<F>,
    b: &Tensor<F>,
    c: &mut Tensor<f32>,
    p: &mut Tensor<f32>,
    places: &mut Tensor<f32>,
    #[define(F)] _dtype: StorageType,
) {
    let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
    register_sizes::<F>(def);
    let lane = UNIT_POS_PLANE;
    let (sa, sb, sc) = (VA::value(), VB::value(), VC::value());
    let (na, nb, nc) = (
        def.vectors_per_lane(MatrixIdent::A),
        def.vectors_per_lane(MatrixIdent::B),
        def.vectors_per_lane(MatrixIdent::Accumulator),
    );
    let base = lane as usize * 24usize;

    let mut ra = Array::<Vector<F, VA>>::new(na);
    #[unroll]
    for i in 0..na {
        let mut v = Vector::<F, VA>::empty();
        #[unroll]
        for j in 0..sa {
            let (r, col) = def.position_of_nth(lane, (i * sa + j) as u32, MatrixIdent::A);
            v[j] = a[(r * 16 + col) as usize];
            places[base + i * sa + j] = f32::cast_from(r * 16 + col);
        }
        ra[i] = v;
    }

    // The accumulator every product starts from.
    let mut zero = Array::<Vector<f32, VC>>::new(nc);
    #[unroll]
    for i in 0..nc {
        zero[i] = Vector::cast_from(0.0f32);
    }

    // Two n8 halves of c; the accumulators stay in registers for the reuse below.
    let mut acc0 = Array::<Vector<f32, VC>>::new(nc);
    let mut acc1 = Array::<Vector<f32, VC>>::new(nc);
    #[unroll]
    for half in 0usize..2usize {
        let mut rb = Array::<Vector<F, VB>>::new(nb);
        #[unroll]
        for i in 0..nb {
            let mut v = Vector::<F, VB>::empty();
            #[unroll]
            for j in 0..sb {
                let (r, col) = def.position_of_nth(lane, (i * sb + j) as u32, MatrixIdent::B);
                v[j] = b[(r * 16 + col + half as u32 * 8) as usize];
                if half == 0usize {
                    places[base + 8usize + i * sb + j] = f32::cast_from(r * 16 + col);
                }
            }
            rb[i] = v;
        }
        let out = def.execute(&ra, &rb, &zero);
        #[unroll]
        for i in 0..nc {
            if half == 0usize {
                acc0[i] = out[i];
            } else {
                acc1[i] = out[i];
            }
            #[unroll]
            for j in 0..sc {
                let (r, col) =
                    def.position_of_nth(lane, (i * sc + j) as u32, MatrixIdent::Accumulator);
                c[(r * 16 + col + half as u32 * 8) as usize] = out[i][j];
                if half == 0usize {
                    places[base + 16usize + i * sc + j] = f32::cast_from(r * 16 + col);
                }
            }
        }
    }

    // The accumulators as an A fragment: element 4 j + e of A is element e of accumulator j,
    // in A's vectors of `sa` elements.
    let mut rp = Array::<Vector<F, VA>>::new(na);
    #[unroll]
    for i in 0..na {
        let mut v = Vector::<F, VA>::empty();
        #[unroll]
        for j in 0..sa {
            let nth = i * sa + j;
            let e = nth % 4usize;
            let x = if nth < 4usize {
                acc0[e / sc][e % sc]
            } else {
                acc1[e / sc][e % sc]
            };
            v[j] = F::cast_from(x);
        }
        rp[i] = v;
    }
    // Times the identity, one n8 half at a time.
    #[unroll]
    for half in 0usize..2usize {
        let mut rb = Array::<Vector<F, VB>>::new(nb);
        #[unroll]
        for i in 0..nb {
            let mut v = Vector::<F, VB>::empty();
            #[unroll]
            for j in 0..sb {
                let (r, col) = def.position_of_nth(lane, (i * sb + j) as u32, MatrixIdent::B);
                v[j] = F::cast_from(u32::cast_from(r == col + half as u32 * 8));
            }
            rb[i] = v;
        }
        let out = def.execute(&rp, &rb, &zero);
        #[unroll]
        for i in 0..nc {
            #[unroll]
            for j in 0..sc {
                let (r, col) =
                    def.position_of_nth(lane, (i * sc + j) as u32, MatrixIdent::Accumulator);
                p[(r * 16 + col + half as u32 * 8) as usize] = out[i][j];
            }
        }
    }
}

/// PTX's `m16n8k16` fragment layouts for 16-bit inputs (PTX ISA, "Matrix fragments for
/// mma.m16n8k16"): (row, col) of a lane's element `i` of `A` (8 elements), `B` (4) and the
/// fp32 accumulator (4), each as row · 16 + col in the probe's `places`.
const fn ptx_place(lane: u32, i: u32, which: usize) -> u32 {
    let (group, thread) = (lane / 4, lane % 4);
    let (row, col) = match which {
        0 => (group + 8 * ((i / 2) % 2), thread * 2 + i % 2 + 8 * (i / 4)),
        1 => (thread * 2 + i % 2 + 8 * (i / 2), group),
        _ => (group + 8 * (i / 2), thread * 2 + i % 2),
    };
    row * 16 + col
}

/// How many elements of each fragment a lane holds: `A`, `B`, the accumulator.
const PER_LANE: [u32; 3] = [8, 4, 4];

#[cfg(all(feature = "cuda", feature = "wgpu-kernels"))]
mod source {
    use super::super::tests_cuda_source::{
        client, compiles, float, on_register_mma, settings, tensor,
    };
    use super::*;
    use cubecl::ir::FloatKind;
    use cubecl::wgpu::WgpuRuntime;

    #[test]
    fn the_probe_compiles_to_register_mma_for_the_h100() {
        let Some(client) = client() else { return };
        for kind in [FloatKind::BF16, FloatKind::F16] {
            let kernel = mma_probe::MmaProbe::<WgpuRuntime>::new(
                settings(32),
                client.clone(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                tensor(),
                float(kind),
            );
            let what = format!("manual mma probe {kind:?}");
            let compiled = compiles(kernel, &what);
            on_register_mma(&compiled, &what);
            // CubeCL writes the instruction once, in a helper, and calls it per product.
            let source = &compiled.lowered.source;
            let calls = source
                .matches("_float(reinterpret_cast<const uint32*>")
                .count();
            assert_eq!(calls, 4, "{what}: four register products\n{source}");
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::super::device_tensor::{DeviceTensor, Elem};
    use super::*;
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::features::MmaConfig;

    fn run<F: Elem>(client: &ComputeClient<CudaRuntime>) {
        // Small integers: exact in 16 bits, and so are the sums (|sum| <= 64).
        let a: Vec<f32> = (0..256).map(|i| ((i * 7) % 5) as f32 - 2.0).collect();
        let b: Vec<f32> = (0..256).map(|i| ((i * 3) % 5) as f32 - 2.0).collect();
        let da = DeviceTensor::new_as::<F>(client, &a, &[16, 16]);
        let db = DeviceTensor::new_as::<F>(client, &b, &[16, 16]);
        let (dc, dp) = (
            DeviceTensor::zeros(client, &[16, 16]),
            DeviceTensor::zeros(client, &[16, 16]),
        );
        let dplaces = DeviceTensor::zeros(client, &[32, 24]);
        mma_probe::launch::<CudaRuntime>(
            client,
            CubeCount::Static(1, 1, 1),
            CubeDim::new_1d(32),
            da.arg(),
            db.arg(),
            dc.arg(),
            dp.arg(),
            dplaces.arg(),
            F::as_type_native_unchecked().storage_type(),
        );
        let (c, p, places) = (dc.read(client), dp.read(client), dplaces.read(client));
        let what = std::any::type_name::<F>();
        for lane in 0..32u32 {
            for (which, &n) in PER_LANE.iter().enumerate() {
                for i in 0..n {
                    let got = places[(lane * 24) as usize + which * 8 + i as usize];
                    assert_eq!(
                        got,
                        ptx_place(lane, i, which) as f32,
                        "{what}: lane {lane}, fragment {which}, element {i}"
                    );
                }
            }
        }
        for r in 0..16 {
            for col in 0..16 {
                let want: f32 = (0..16).map(|k| a[r * 16 + k] * b[k * 16 + col]).sum();
                assert_eq!(c[r * 16 + col], want, "{what}: c[{r}][{col}]");
                assert_eq!(
                    p[r * 16 + col],
                    want,
                    "{what}: accumulators as A: p[{r}][{col}]"
                );
            }
        }
    }

    #[test]
    fn register_products_follow_ptx_layout_and_feed_the_next_product() {
        let Some(client) = crate::testing::client_or_skip::<CudaRuntime>(
            || CudaDevice::new(0),
            "cuda",
            "the manual MMA probe",
        ) else {
            return;
        };
        let mma = &client.properties().features.matmul.mma;
        let has = |t: StorageType| {
            mma.contains(&MmaConfig {
                a_type: t,
                b_type: t,
                cd_type: f32::as_type_native_unchecked().storage_type(),
                m: 16,
                n: 8,
                k: 16,
            })
        };
        let (bf16, f16) = (
            burn::tensor::bf16::as_type_native_unchecked().storage_type(),
            burn::tensor::f16::as_type_native_unchecked().storage_type(),
        );
        assert!(
            has(bf16) && has(f16),
            "no m16n8k16 for 16-bit inputs: {mma:?}"
        );
        run::<burn::tensor::bf16>(&client);
        run::<burn::tensor::f16>(&client);
    }
}
