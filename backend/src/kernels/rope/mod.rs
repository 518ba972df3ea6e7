//! RoPE on whole heads (`ExecBackend::rope`): each pair `(i, i + d/2)` of a head rotated by
//! its position's angle, `[x1, x2] -> [x1 c - x2 s, x2 c + x1 s]`, with the model's tables
//! (`model::RopeTables`: cosines `[seq, d/2]`, signed sines `[seq, d]` = `[-s, s]`).
//!
//! Burn's ops compute it as `x · c + flip(x) · [-s, s]` on a `[.., 2, d/2]` view
//! ([`rotate_plain`]): the flip is a gather kernel of its own, which fusion cannot join, and
//! it runs once forward and once backward for each of q and k in every layer. On the 350M
//! plan that was 96 `FlipKernel` launches a step, 4.6 ms of the 168 ms step on an H200
//! (2026-11-30h profile), besides the element-wise kernel around each. On the fused CubeCL
//! backends one kernel reads each pair once and writes the rotated pair (`fused`).
//!
//! The backward needs no saved activation: with the signed sines,
//! `dx = dy · c + swap(dy · [-s, s])`, the rotation of `dy` by minus the angle, which is the
//! same kernel reading the other half's sine (`inverse`). The autodiff node ([`autodiff`])
//! keeps only the two tables, which are constants of the run.
//!
//! - [`autodiff`]: the node, whose backward is the inner backend's inverse rotation.
//! - `fused`: the kernel on the fused CubeCL backends (`Cuda<f32>`, `Wgpu<f32>`).

pub mod autodiff;

#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub mod fused;

#[cfg(test)]
mod checks;

#[cfg(all(test, feature = "cuda"))]
mod tests_cuda;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{Int, Tensor, TensorPrimitive};

/// Where a `[b, .., .., d]` tensor has its positions, along which RoPE's tables run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SeqAxis {
    /// `[b, seq, heads, d]`: the projections' order.
    Second,
    /// `[b, heads, seq, d]`: the attention's order.
    Third,
}

impl SeqAxis {
    /// The axis's index in `[b, .., .., d]`.
    pub const fn index(self) -> usize {
        match self {
            SeqAxis::Second => 1,
            SeqAxis::Third => 2,
        }
    }
}

/// `ExecBackend::rope` composed of Burn's ops: the default on backends without the kernel
/// (ndarray), the partial rotation everywhere, and the reference the kernel's tests compare
/// with. Under autodiff its backward is Burn's, through the flip or the gather.
///
/// With `swap` (part of each head rotated, `model::RopeTables`), the tables are `[seq, d]`
/// each and `swap` trades each rotated value for its partner and keeps the rest in place: one
/// gather, and the tables' ones and zeros pass the rest through exactly. The gather is its
/// own inverse, so the backward is `dy · c + swap(dy · s)`.
pub fn rotate_plain<B: Backend>(
    x: FloatTensor<B>,
    cos: FloatTensor<B>,
    sin: FloatTensor<B>,
    swap: Option<IntTensor<B>>,
    seq_axis: SeqAxis,
    inverse: bool,
) -> FloatTensor<B> {
    let x = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(x));
    let (cos, sin) = (table::<B>(cos), table::<B>(sin));
    let dims = x.dims();
    let [a, b, c, d] = dims;
    // The tables broadcast over every axis of x but the positions'.
    let rows = cos.dims()[0];
    let (p1, p2) = match seq_axis {
        SeqAxis::Second => (rows, 1),
        SeqAxis::Third => (1, rows),
    };
    if let Some(swap) = swap {
        let swap = Tensor::<B, 1, Int>::from_primitive(swap);
        let (cos, sin) = (cos.reshape([1, p1, p2, d]), sin.reshape([1, p1, p2, d]));
        let y = if inverse {
            x.clone() * cos + (x * sin).select(3, swap)
        } else {
            x.clone() * cos + x.select(3, swap) * sin
        };
        return y.into_primitive().tensor();
    }
    // Swapping the halves is a flip of the size-2 axis of a `[.., 2, d/2]` view: one gather
    // each way. `narrow` + `cat` launched two slices forward and, backward, two slices, two
    // slice-assigns and their zero fills.
    let halves = x.reshape([a, b, c, 2, d / 2]);
    let (cos, sin) = (
        cos.reshape([1, p1, p2, 1, d / 2]),
        sin.reshape([1, p1, p2, 2, d / 2]),
    );
    let y = if inverse {
        // What Burn's backward of the forward below computes: the sines multiply before the
        // swap.
        halves.clone() * cos + (halves * sin).flip([3])
    } else {
        // The flip first, so the products and the sum after it can fuse into one kernel.
        let swapped = halves.clone().flip([3]);
        halves * cos + swapped * sin
    };
    y.reshape(dims).into_primitive().tensor()
}

/// `RCOA_ROPE=composite`: Burn's ops (`rotate_plain`) on the fused backends too, so a GPU
/// call whose kernel tests fail can still time the rest (`backend/bench/gpu_call_common.sh`).
pub fn composite_asked() -> bool {
    static ASKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| std::env::var("RCOA_ROPE").is_ok_and(|v| v.trim() == "composite"))
}

fn table<B: Backend>(t: FloatTensor<B>) -> Tensor<B, 2> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}
