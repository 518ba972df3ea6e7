//! RoPE's kernel on the fused CubeCL backends: unit `(row, i)` reads `x[row, i]` and
//! `x[row, i + d/2]` through the input's strides (the eager path hands over a swapped view),
//! one cosine and the two signed sines of its position, and writes the rotated pair into a
//! contiguous output of x's shape, in x's element type, computing in f32. Neighbouring units
//! take neighbouring `i`, so a warp's reads and writes of a head are coalesced.

use burn::tensor::ops::FloatTensor;
use burn::tensor::TensorMetadata;
use burn_cubecl::{BoolElement, CubeRuntime};
use cubecl::calculate_cube_count_elemwise;
use cubecl::prelude::*;
use cubecl::std::FastDivmod;

use crate::kernels::fusion::{empty, register, resolve, Fused};

/// Units per cube: eight warps, enough to keep a large GPU's memory busy with one pair each.
const UNITS_PER_CUBE: u32 = 256;

/// `out [a, b, c, d]` (contiguous) from `x [a, b, c, d]` (any strides), the positions on
/// axis `seq_axis` (1 or 2). `half`, `dim2`, `dim1`: `d / 2`, `c` and `b`, divided by
/// multiplication. `inverse` rotates by minus the angle: each half takes the other half's
/// signed sine.
#[cube(launch)]
#[allow(clippy::too_many_arguments)]
fn rope_kernel<F: Float, T: Float>(
    out: &mut Tensor<F>,
    x: &Tensor<F>,
    cos: &Tensor<T>,
    sin: &Tensor<T>,
    half: FastDivmod<usize>,
    dim2: FastDivmod<usize>,
    dim1: FastDivmod<usize>,
    #[comptime] seq_axis: usize,
    #[comptime] inverse: bool,
    #[define(F, T)] _dtypes: [StorageType; 2],
) {
    let pair = ABSOLUTE_POS;
    if pair * 2 >= out.len() {
        terminate!();
    }
    let (row, i) = half.div_mod(pair);
    let (rest, p2) = dim2.div_mod(row);
    let (p0, p1) = dim1.div_mod(rest);
    let mut pos = p2;
    if seq_axis == 1 {
        pos = p1;
    }
    let h = x.shape(3) / 2;
    let at = p0 * x.stride(0) + p1 * x.stride(1) + p2 * x.stride(2);
    let x_lo = f32::cast_from(x[at + i * x.stride(3)]);
    let x_hi = f32::cast_from(x[at + (i + h) * x.stride(3)]);
    let c = f32::cast_from(cos[pos * cos.stride(0) + i * cos.stride(1)]);
    let s_first = f32::cast_from(sin[pos * sin.stride(0) + i * sin.stride(1)]);
    let s_second = f32::cast_from(sin[pos * sin.stride(0) + (i + h) * sin.stride(1)]);
    let mut s_lo = s_first;
    let mut s_hi = s_second;
    if inverse {
        s_lo = s_second;
        s_hi = s_first;
    }
    let o = row * 2 * h + i;
    out[o] = F::cast_from(x_lo * c + x_hi * s_lo);
    out[o + h] = F::cast_from(x_hi * c + x_lo * s_hi);
}

/// `ExecBackend::rope` on a fused CubeCL backend.
pub fn rope<R: CubeRuntime, BT: BoolElement>(
    x: FloatTensor<Fused<R, BT>>,
    cos: FloatTensor<Fused<R, BT>>,
    sin: FloatTensor<Fused<R, BT>>,
    seq_axis: super::SeqAxis,
    inverse: bool,
) -> FloatTensor<Fused<R, BT>> {
    let (x, cos, sin) = (
        resolve::<R, BT>(x),
        resolve::<R, BT>(cos),
        resolve::<R, BT>(sin),
    );
    let dims = x.shape().dims::<4>();
    let d = dims[3];
    assert!(d % 2 == 0, "RoPE rotates pairs: head dim {d} is odd");
    let seq = dims[seq_axis.index()];
    assert_eq!(
        cos.shape().dims::<2>(),
        [seq, d / 2],
        "RoPE's cosines for x {dims:?}"
    );
    assert_eq!(
        sin.shape().dims::<2>(),
        [seq, d],
        "RoPE's signed sines for x {dims:?}"
    );
    assert_eq!(cos.dtype, sin.dtype, "RoPE's two tables in one type");
    let out = empty(&x, x.shape(), x.dtype);
    let pairs = out.shape().num_elements() / 2;
    if pairs == 0 {
        return register::<R, BT>(out);
    }
    let client = out.client.clone();
    let cube_dim = CubeDim::new_1d(UNITS_PER_CUBE);
    let count = calculate_cube_count_elemwise(&client, pairs, cube_dim);
    let dtypes = [x.dtype.into(), cos.dtype.into()];
    rope_kernel::launch::<R>(
        &client,
        count,
        cube_dim,
        out.clone().into_tensor_arg(),
        x.into_tensor_arg(),
        cos.into_tensor_arg(),
        sin.into_tensor_arg(),
        d / 2,
        dims[2],
        dims[1],
        seq_axis.index(),
        inverse,
        dtypes,
    );
    register::<R, BT>(out)
}

#[cfg(all(test, feature = "wgpu-kernels"))]
mod tests_wgpu {
    use burn::backend::wgpu::{Wgpu, WgpuDevice};
    use burn::tensor::FloatDType;
    use cubecl::prelude::CubePrimitive;
    use cubecl::wgpu::WgpuRuntime;

    use crate::kernels::rope::checks;
    use crate::testing::client_or_skip;

    type B = Wgpu<f32>;

    fn device() -> Option<(WgpuDevice, cubecl::prelude::ComputeClient<WgpuRuntime>)> {
        let dev = || WgpuDevice::DefaultDevice;
        client_or_skip::<WgpuRuntime>(dev, "vulkan", "the RoPE kernel tests").map(|c| (dev(), c))
    }

    #[test]
    fn equals_the_composition_forward_and_backward() {
        let Some((dev, _)) = device() else { return };
        checks::equals_composition::<B>(&dev, 1e-6);
    }

    #[test]
    fn sixteen_bit_is_the_composition_within_rounding() {
        let Some((dev, client)) = device() else {
            return;
        };
        let ty = <burn::tensor::f16 as CubePrimitive>::as_type_native_unchecked();
        if !client.properties().supports_type(ty) {
            eprintln!("SKIPPED: lavapipe has no f16; the 16-bit RoPE test did not run");
            return;
        }
        checks::sixteen_bit_within_rounding::<B>(&dev, FloatDType::F16);
    }

    #[test]
    fn reads_strided_inputs_and_writes_contiguous_outputs() {
        let Some((dev, _)) = device() else { return };
        checks::output_is_contiguous::<B>(&dev, |t| {
            crate::kernels::fusion::resolve::<WgpuRuntime, u32>(t)
                .meta
                .strides()
                .to_vec()
        });
    }
}

/// The kernel as CubeCL lowers it for an H100 and NVRTC compiles it, without a GPU (the flash
/// kernels' harness, `flash::tests_cuda_source`).
#[cfg(all(test, feature = "cuda", feature = "wgpu-kernels"))]
mod tests_cuda_source {
    use cubecl::ir::FloatKind;
    use cubecl::prelude::*;
    use cubecl::std::FastDivmod;
    use cubecl::wgpu::WgpuRuntime;

    use super::rope_kernel::RopeKernel;
    use super::UNITS_PER_CUBE;
    use crate::kernels::flash::tests_cuda_source::{client, compiles, float, settings, tensor};

    type Divisor = <FastDivmod<usize> as LaunchArg>::CompilationArg;

    #[test]
    fn the_kernel_compiles_for_an_h100_without_spilling() {
        let Some(client) = client() else { return };
        for (kind, table) in [
            (FloatKind::F32, FloatKind::F32),
            (FloatKind::BF16, FloatKind::BF16),
            (FloatKind::F16, FloatKind::F16),
            (FloatKind::BF16, FloatKind::F32),
        ] {
            for (seq_axis, inverse) in [(1, false), (2, true)] {
                let what = format!("rope {kind:?} tables {table:?} axis {seq_axis} {inverse}");
                let kernel = RopeKernel::<WgpuRuntime>::new(
                    settings(UNITS_PER_CUBE),
                    client.clone(),
                    tensor(),
                    tensor(),
                    tensor(),
                    tensor(),
                    Divisor::Fast,
                    Divisor::Fast,
                    Divisor::Fast,
                    seq_axis,
                    inverse,
                    [float(kind), float(table)],
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
}
