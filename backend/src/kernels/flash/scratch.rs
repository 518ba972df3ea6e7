//! The block-product backward's small kernels (`backward_blocks.rs`):
//!
//! - the rows' `D = rowsum(dO ∘ O)`, the softmax backward's row term, once
//!   per query row before the key-block kernel, which read and staged O for
//!   it again in every key block (FlashAttention-2's preprocessing);
//! - the one-pass backward's fp32 dQ accumulator (`one_pass`): zeroed
//!   before the key-block kernel adds to it, cast to the gradient's type
//!   after.
//!
//! The accumulator's kernels run over contiguous tensors, each unit
//! striding over the elements so that a fixed grid covers any size (wgpu
//! takes at most 65535 cubes along a dimension).

use cubecl::prelude::*;

use super::launch::{clone_arg, FlashLaunch};

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

/// A one-pass backward's dQ (`cfg`'s shapes): zeroes the fp32 accumulator `acc`, runs
/// `add` (the key kernel, adding dQ's shares to it), and casts it into `d_q`.
pub fn accumulate_dq<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: &FlashLaunch,
    acc: TensorArg<R>,
    d_q: TensorArg<R>,
    add: impl FnOnce(),
) {
    let d = &cfg.dims;
    let len = d.batch * d.heads * d.q_len * d.head_dim;
    zero(client, clone_arg(&acc), len);
    add();
    cast(client, acc, d_q, len, cfg.dtype);
}

/// `d[b, h, i] = Σ_c o[b, h, i, c] · d_o[b, h, i, c]` in fp32, one unit per
/// query row: cube `(x, y)` takes rows `x · CUBE_DIM ..` of slice `y`
/// (`batch · heads + head`).
#[cube(launch)]
fn row_dots_kernel<F: Float>(
    o: &Tensor<F>,
    d_o: &Tensor<F>,
    d: &mut Tensor<f32>,
    #[comptime] head_dim: usize,
    #[define(F)] _dtype: StorageType,
) {
    let heads = o.shape(1);
    let s = o.shape(2);
    let bh = CUBE_POS_Y as usize;
    let bi = bh / heads;
    let hi = bh % heads;
    let i = CUBE_POS_X as usize * CUBE_DIM as usize + UNIT_POS as usize;
    if i < s {
        let ob = bi * o.stride(0) + hi * o.stride(1) + i * o.stride(2);
        let db = bi * d_o.stride(0) + hi * d_o.stride(1) + i * d_o.stride(2);
        let mut sum = f32::new(0.0);
        for c in 0..head_dim {
            sum += f32::cast_from(o[ob + c * o.stride(3)])
                * f32::cast_from(d_o[db + c * d_o.stride(3)]);
        }
        d[bi * d.stride(0) + hi * d.stride(1) + i * d.stride(2)] = sum;
    }
}

/// Writes `d [b, h, s]` (fp32) from `o` and `d_o [b, h, s, head_dim]`
/// (`cfg.dtype`).
pub fn row_dots<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: &FlashLaunch,
    o: TensorArg<R>,
    d_o: TensorArg<R>,
    d: TensorArg<R>,
) {
    let dims = &cfg.dims;
    let count = CubeCount::Static(
        dims.q_len.div_ceil(UNITS as usize) as u32,
        (dims.batch * dims.heads) as u32,
        1,
    );
    row_dots_kernel::launch::<R>(
        client,
        count,
        CubeDim::new_1d(UNITS),
        o,
        d_o,
        d,
        dims.head_dim,
        cfg.dtype,
    );
}
