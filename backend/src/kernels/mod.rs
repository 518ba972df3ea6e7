//! Hand-written CubeCL kernels and their plain-tensor counterparts, and the
//! library calls that stand in for Burn's own kernels.

pub mod embedding;
pub mod flash;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub(crate) mod fusion;
pub mod gemm;
pub mod rope;
