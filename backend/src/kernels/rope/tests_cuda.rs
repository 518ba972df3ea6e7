//! The RoPE kernel on a CUDA device against Burn's composition on the same device: values and
//! gradients in f32, both 16-bit types within rounding, strided `[b, h, s, d]` inputs (the
//! eager path's) and contiguous outputs, whose rows CubeCL's own allocator would pad. Skips
//! without a device unless `RCOA_REQUIRE` names `cuda`.

use burn::backend::cuda::CudaDevice;
use burn::tensor::FloatDType;
use cubecl::cuda::CudaRuntime;

use super::checks;
use crate::testing::client_or_skip;

type B = burn::backend::Cuda<f32>;

fn device() -> Option<CudaDevice> {
    let dev = || CudaDevice::new(0);
    client_or_skip::<CudaRuntime>(dev, "cuda", "the RoPE kernel tests").map(|_| dev())
}

#[test]
fn equals_the_composition_forward_and_backward() {
    let Some(dev) = device() else { return };
    checks::equals_composition::<B>(&dev, 1e-6);
}

#[test]
fn sixteen_bit_is_the_composition_within_rounding() {
    let Some(dev) = device() else { return };
    for dtype in [FloatDType::BF16, FloatDType::F16] {
        checks::sixteen_bit_within_rounding::<B>(&dev, dtype);
    }
}

#[test]
fn reads_strided_inputs_and_writes_contiguous_outputs() {
    let Some(dev) = device() else { return };
    checks::output_is_contiguous::<B>(&dev, |t| {
        crate::kernels::fusion::resolve::<CudaRuntime, u8>(t)
            .meta
            .strides()
            .to_vec()
    });
}
