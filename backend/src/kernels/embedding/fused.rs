//! The embedding gradient's kernel on the fused CubeCL backends.
//!
//! Unit `(c, k)` owns column `c` of the table rows whose id is `k` modulo `buckets`: it walks
//! the tokens in order and adds the gradient of each token whose id it owns into that row.
//! No two units write one element, so there are no atomics, and each element sums its
//! tokens in token order, as Burn's kernel does: the result is Burn's to the bit where the
//! additions round alike (f32). The `buckets` units of a column multiply the parallelism of
//! Burn's one unit per column; a warp is 32 neighbouring columns of one bucket, so its reads
//! of a token's gradient are coalesced and its branches agree. Every unit reads every id
//! (the whole warp the same one), which is cheap next to the rows it adds.

use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::Shape;
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::{BoolElement, CubeRuntime};
use cubecl::prelude::*;

use crate::kernels::fusion::{register, resolve, Fused, Inner};

/// Units along a cube's columns.
const COLUMNS_PER_CUBE: usize = 256;
/// About how many units the launch aims for: enough warps to hide the adds' memory latency
/// on a large GPU (32 per SM on 132 SMs is 135,168).
const TARGET_UNITS: usize = 1 << 17;
/// The most buckets: each unit still reads every id, so more buckets cost reads of ids
/// for fewer rows.
const MAX_BUCKETS: usize = 256;

#[cube(launch)]
fn embedding_grad_kernel<F: Float, I: Int>(
    grad: &mut Tensor<F>,
    ids: &Tensor<I>,
    dy: &Tensor<F>,
    #[comptime] buckets: usize,
    #[define(F, I)] _dtypes: [StorageType; 2],
) {
    let rows = grad.shape(0);
    let cols = grad.shape(1);
    let c = CUBE_POS_X as usize * CUBE_DIM_X as usize + UNIT_POS_X as usize;
    let bucket = CUBE_POS_Y as usize;
    if c < cols {
        // Read once: the loop's stores could alias the metadata for all the compiler knows.
        let tokens = ids.shape(0);
        let id_stride = ids.stride(0);
        let (row_stride, dy_stride) = (grad.stride(0), dy.stride(0));
        let (grad_c, dy_c) = (c * grad.stride(1), c * dy.stride(1));
        let mut t = 0;
        while t < tokens {
            // A negative id casts to a huge one, which no row owns.
            let id = usize::cast_from(ids[t * id_stride]);
            if id % buckets == bucket && id < rows {
                let at = id * row_stride + grad_c;
                let add = dy[t * dy_stride + dy_c];
                grad[at] = F::cast_from(f32::cast_from(grad[at]) + f32::cast_from(add));
            }
            t += 1;
        }
    }
}

/// Units per column: a power of two near `TARGET_UNITS / cols`, at most one per row.
fn buckets(rows: usize, cols: usize) -> usize {
    (TARGET_UNITS / cols.max(1))
        .next_power_of_two()
        .min(rows.next_power_of_two())
        .clamp(1, MAX_BUCKETS)
}

/// `ExecBackend::embedding_grad` on a fused CubeCL backend.
pub fn embedding_grad<R: CubeRuntime, BT: BoolElement>(
    table: FloatTensor<Fused<R, BT>>,
    dy: FloatTensor<Fused<R, BT>>,
    ids: IntTensor<Fused<R, BT>>,
) -> FloatTensor<Fused<R, BT>> {
    let [rows, cols] = table.shape.dims::<2>();
    let tokens = ids.shape.num_elements();
    let dtype = dy.dtype;
    let dy = resolve::<R, BT>(dy);
    let ids = {
        let client = ids.client.clone();
        client.resolve_tensor_int::<Inner<R, BT>>(ids)
    };
    let device = dy.device.clone();
    let dy = burn_cubecl::ops::reshape(dy, Shape::new([tokens, cols]));
    let ids = into_contiguous(burn_cubecl::ops::reshape(ids, Shape::new([tokens])));
    let grad = burn_cubecl::ops::numeric::zeros::<R>(device, Shape::new([rows, cols]), dtype);
    let k = buckets(rows, cols);
    let per_cube = COLUMNS_PER_CUBE.min(cols.next_power_of_two()).max(32);
    let count = CubeCount::Static(cols.div_ceil(per_cube) as u32, k as u32, 1);
    let client = grad.client.clone();
    embedding_grad_kernel::launch::<R>(
        &client,
        count,
        CubeDim::new_2d(per_cube as u32, 1),
        grad.clone().into_tensor_arg(),
        ids.clone().into_tensor_arg(),
        dy.into_tensor_arg(),
        k,
        [dtype.into(), ids.dtype.into()],
    );
    register::<R, BT>(grad)
}

#[cfg(test)]
mod tests {
    use super::buckets;

    /// Columns × buckets near the target, a power of two, never more buckets than rows
    /// (rounded up) or the cap.
    #[test]
    fn buckets_fill_the_gpu_without_idle_units() {
        assert_eq!(buckets(32_000, 1024), 128);
        assert_eq!(buckets(32_000, 4096), 32);
        assert_eq!(buckets(32_000, 16), 256);
        assert_eq!(buckets(5, 8), 8);
        assert_eq!(buckets(1, 1 << 20), 1);
    }
}

/// The kernel against Burn's `select_assign`, on any backend whose `embedding_grad` it is.
#[cfg(test)]
mod checks {
    use burn::backend::Autodiff;
    use burn::tensor::{FloatDType, Int, Tensor, TensorData, TensorPrimitive};

    use crate::ops::ExecBackend;

    /// Ids with repeats, skewed to small ids as text is, and every row of a small table.
    fn ids(batch: usize, seq: usize, rows: usize) -> Vec<i32> {
        (0..batch * seq)
            .map(|t| {
                let r = (t * 7919 + 13) % 1009;
                (if r % 3 == 0 { r % 4 } else { r % rows }) as i32
            })
            .collect()
    }

    /// Through the model's autodiff path (`ops::embedding`), against Burn's embedding node:
    /// equal to the bit in f32, where both add each element's tokens in token order.
    pub fn gradient_equals_burns<B: ExecBackend>(dev: &B::Device) {
        type A<B> = Autodiff<B>;
        for (batch, seq, rows, cols) in [(2, 16, 11, 8), (3, 50, 300, 96), (1, 7, 2, 300)] {
            let ids = Tensor::<A<B>, 2, Int>::from_data(
                TensorData::new(ids(batch, seq, rows), [batch, seq]),
                dev,
            );
            let values: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 31 % 97) as f32 - 48.0) / 17.0)
                .collect();
            let table = || {
                Tensor::<A<B>, 2>::from_data(TensorData::new(values.clone(), [rows, cols]), dev)
                    .require_grad()
            };
            let up: Vec<f32> = (0..batch * seq * cols)
                .map(|i| ((i * 53 % 101) as f32 - 50.0) / 7.0)
                .collect();
            let up = Tensor::<A<B>, 3>::from_data(TensorData::new(up, [batch, seq, cols]), dev);
            let (ours, theirs) = (table(), table());
            let y = crate::ops::embedding(ours.clone(), ids.clone());
            let y0 = burn::tensor::module::embedding(theirs.clone(), ids.clone());
            let g = (y * up.clone()).sum().backward();
            let g0 = (y0 * up).sum().backward();
            let a = ours.grad(&g).expect("the table trains").into_data();
            let b = theirs.grad(&g0).expect("the table trains").into_data();
            assert_eq!(a, b, "{batch} × {seq} tokens, {rows} × {cols} table");
        }
    }

    /// In 16 bits each addition rounds to the table's type, as Burn's does; the two differ
    /// by at most a rounding of the sum.
    pub fn half_precision_is_burns_within_rounding<B: ExecBackend>(
        dev: &B::Device,
        dtype: FloatDType,
    ) {
        let (batch, seq, rows, cols) = (2, 64, 40, 64);
        let ids = Tensor::<B, 2, Int>::from_data(
            TensorData::new(ids(batch, seq, rows), [batch, seq]),
            dev,
        );
        let dy: Vec<f32> = (0..batch * seq * cols)
            .map(|i| ((i * 53 % 101) as f32 - 50.0) / 64.0)
            .collect();
        let dy =
            Tensor::<B, 3>::from_data(TensorData::new(dy, [batch, seq, cols]), dev).cast(dtype);
        let table = Tensor::<B, 2>::zeros([rows, cols], dev).cast(dtype);
        let prim = |t: Tensor<B, 2>| t.into_primitive().tensor();
        let ours = B::embedding_grad(
            prim(table.clone()),
            dy.clone().into_primitive().tensor(),
            ids.clone().into_primitive(),
        );
        let theirs = B::embedding_backward(
            prim(table),
            dy.into_primitive().tensor(),
            ids.into_primitive(),
        );
        let read = |t| {
            Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(t))
                .cast(FloatDType::F32)
                .into_data()
                .to_vec::<f32>()
                .unwrap()
        };
        let (a, b) = (read(ours), read(theirs));
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 8e-3 * (1.0 + y.abs()),
                "{dtype:?} [{i}]: {x} against {y}"
            );
        }
    }
}

#[cfg(all(test, feature = "wgpu-kernels"))]
mod tests_wgpu {
    use burn::backend::wgpu::{Wgpu, WgpuDevice};
    use burn::tensor::FloatDType;
    use cubecl::wgpu::WgpuRuntime;

    use super::checks;
    use crate::testing::client_or_skip;

    type B = Wgpu<f32>;

    fn device() -> Option<WgpuDevice> {
        let dev = || WgpuDevice::DefaultDevice;
        client_or_skip::<WgpuRuntime>(dev, "vulkan", "the embedding kernel tests").map(|_| dev())
    }

    #[test]
    fn gradient_equals_burns_select_assign() {
        let Some(dev) = device() else { return };
        checks::gradient_equals_burns::<B>(&dev);
    }

    #[test]
    fn half_precision_gradient_is_burns_within_rounding() {
        let Some(dev) = device() else { return };
        checks::half_precision_is_burns_within_rounding::<B>(&dev, FloatDType::F16);
    }
}

/// The same checks on a CUDA device (`RCOA_REQUIRE=cuda` makes a missing one a failure).
#[cfg(all(test, feature = "cuda"))]
mod tests_cuda {
    use burn::backend::cuda::CudaDevice;
    use burn::tensor::FloatDType;
    use cubecl::cuda::CudaRuntime;

    use super::checks;
    use crate::testing::client_or_skip;

    type B = burn::backend::Cuda<f32>;

    fn device() -> Option<CudaDevice> {
        let dev = || CudaDevice::new(0);
        client_or_skip::<CudaRuntime>(dev, "cuda", "the embedding kernel tests").map(|_| dev())
    }

    #[test]
    fn gradient_equals_burns_select_assign() {
        let Some(dev) = device() else { return };
        checks::gradient_equals_burns::<B>(&dev);
    }

    #[test]
    fn sixteen_bit_gradients_are_burns_within_rounding() {
        let Some(dev) = device() else { return };
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            checks::half_precision_is_burns_within_rounding::<B>(&dev, dtype);
        }
    }
}

/// The kernel as CubeCL lowers it for an H100 and NVRTC compiles it, without a GPU (the flash
/// kernels' harness, `flash::tests_cuda_source`).
#[cfg(all(test, feature = "cuda", feature = "wgpu-kernels"))]
mod tests_cuda_source {
    use cubecl::ir::{ElemType, FloatKind, IntKind};
    use cubecl::prelude::*;
    use cubecl::wgpu::WgpuRuntime;

    use super::embedding_grad_kernel::EmbeddingGradKernel;
    use crate::kernels::flash::tests_cuda_source::{client, compiles, float, tensor};

    #[test]
    fn the_kernel_compiles_for_an_h100_without_spilling() {
        let Some(client) = client() else { return };
        for kind in [FloatKind::F32, FloatKind::BF16, FloatKind::F16] {
            let what = format!("embedding_grad {kind:?}");
            let kernel = EmbeddingGradKernel::<WgpuRuntime>::new(
                KernelSettings::default()
                    .cube_dim(CubeDim::new_2d(256, 1))
                    .address_type(AddressType::U32),
                client.clone(),
                tensor(),
                tensor(),
                tensor(),
                128,
                [
                    float(kind),
                    StorageType::Scalar(ElemType::Int(IntKind::I32)),
                ],
            );
            let compiled = compiles(kernel, &what);
            assert!(
                compiled.ptxas.contains(" 0 bytes spill stores"),
                "{what}: {}",
                compiled.ptxas
            );
        }
    }
}
