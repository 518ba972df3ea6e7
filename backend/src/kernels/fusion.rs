//! Hand-written kernels under Burn's fused CubeCL backends (`Cuda<f32>`,
//! `Wgpu<f32>`): the fusion queue is drained into CubeCL tensors
//! ([`resolve`]), a kernel (or a library call) runs on them, and its outputs
//! are registered back with the fusion client as fresh tensors
//! ([`register`], what Burn's own `float_from_data` does).

use burn::backend::ir::{BackendIr, InitOperationIr, OperationIr};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape, TensorMetadata};
use burn_cubecl::ops::numeric::empty_device_contiguous_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeBackend, CubeRuntime};
use burn_fusion::stream::OperationStreams;
use burn_fusion::{get_client, Fusion, NoOp};

pub(crate) type Inner<R, BT> = CubeBackend<R, f32, i32, BT>;
pub(crate) type Fused<R, BT> = Fusion<Inner<R, BT>>;

/// The CubeCL tensor behind a fusion tensor (queued ops run first).
pub(crate) fn resolve<R: CubeRuntime, BT: BoolElement>(
    t: FloatTensor<Fused<R, BT>>,
) -> CubeTensor<R> {
    let client = t.client.clone();
    client.resolve_tensor_float::<Inner<R, BT>>(t)
}

/// A CubeCL tensor handed back to the fusion layer.
pub(crate) fn register<R: CubeRuntime, BT: BoolElement>(
    t: CubeTensor<R>,
) -> FloatTensor<Fused<R, BT>> {
    let client = get_client::<Inner<R, BT>>(&t.device);
    let (shape, dtype) = (t.shape(), t.dtype);
    let handle = <Inner<R, BT> as BackendIr>::float_tensor_handle(t);
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            OperationStreams::default(),
            OperationIr::Init(desc),
            NoOp::<Inner<R, BT>>::new(),
        )
        .remove(0)
}

/// An uninitialised contiguous tensor on `like`'s device. Contiguous, not
/// Burn's `empty_device_dtype`: on CUDA that pads each row to a multiple of
/// up to 512 bytes, so a `[b, s, h, 96]` bf16 output took a third more than
/// the `burn` profile charges, its `[b, s, h·d]` reshape copied it, and
/// kernels that walk a buffer in memory order (the flash backward's fp32
/// dQ and its cast) would read the padding.
pub(crate) fn empty<R: CubeRuntime>(
    like: &CubeTensor<R>,
    shape: Shape,
    dtype: DType,
) -> CubeTensor<R> {
    empty_device_contiguous_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}
