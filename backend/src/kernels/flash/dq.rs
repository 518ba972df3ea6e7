//! The one-pass backward's fp32 dQ accumulator (`backward_blocks.rs`,
//! `one_pass`): zeroed before the key-block kernel adds to it, cast to the
//! gradient's type after. Two element-wise kernels over contiguous tensors,
//! each unit striding over the elements so that a fixed grid covers any
//! size (wgpu takes at most 65535 cubes along a dimension).

use cubecl::prelude::*;

/// Units per cube, and the most cubes, of the two kernels.
const UNITS: u32 = 256;
const MAX_CUBES: usize = 4096;

#[cube(launch)]
fn zero_f32(acc: &mut Tensor<f32>) {
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < acc.len() {
        acc[i] = f32::new(0.0);
        i += stride;
    }
}

#[cube(launch)]
fn cast_f32<F: Float>(acc: &Tensor<f32>, out: &mut Tensor<F>, #[define(F)] _dtype: StorageType) {
    let stride = CUBE_COUNT * CUBE_DIM as usize;
    let mut i = ABSOLUTE_POS;
    while i < out.len() {
        out[i] = F::cast_from(acc[i]);
        i += stride;
    }
}

fn grid(len: usize) -> (CubeCount, CubeDim) {
    let cubes = len.div_ceil(UNITS as usize).clamp(1, MAX_CUBES);
    (
        CubeCount::Static(cubes as u32, 1, 1),
        CubeDim::new_1d(UNITS),
    )
}

/// Sets the `len` fp32 values of the contiguous `acc` to 0.
pub fn zero<R: Runtime>(client: &ComputeClient<R>, acc: TensorArg<R>, len: usize) {
    let (count, dim) = grid(len);
    zero_f32::launch::<R>(client, count, dim, acc);
}

/// Writes the `len` fp32 values of the contiguous `acc` to the contiguous
/// `out` as `dtype`.
pub fn cast<R: Runtime>(
    client: &ComputeClient<R>,
    acc: TensorArg<R>,
    out: TensorArg<R>,
    len: usize,
    dtype: StorageType,
) {
    let (count, dim) = grid(len);
    cast_f32::launch::<R>(client, count, dim, acc, out, dtype);
}
