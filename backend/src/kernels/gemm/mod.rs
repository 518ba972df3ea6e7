//! The linear layers' matrix products (`ExecBackend::matmul_2d`) on cuBLAS
//! (issue #13's matmul item): CubeCL's autotuned kernels reached about
//! 175 TFLOP/s on the 350M's products on an H200 (`docs/burn-h100.md`),
//! where cuBLAS is what PyTorch runs. A trial, `RCOA_MATMUL=cublas`, until
//! it is timed on a GPU (`docs/gpu-session.md`).
//!
//! - [`layout`]: the row-major product as one column-major BLAS call, with
//!   transposed operands read in place (tested here against BLAS's own
//!   definition).
//! - [`autodiff`]: the autodiff node, Burn's matmul node with both backward
//!   products through `matmul_2d` as well.
//! - `glue`: a BLAS product under Burn's fusion layer, for any CubeCL
//!   runtime (tested on wgpu with a host BLAS over the tensors' memory).
//! - `cublas`: loading cuBLAS, per-thread handles on CubeCL's stream, and
//!   the call (`cuda` feature).
//! - `fused`: which library `Cuda<f32>` multiplies with, and cuBLAS as the
//!   glue's BLAS.

pub mod autodiff;
pub mod layout;

#[cfg(feature = "cuda")]
pub mod cublas;
#[cfg(feature = "cuda")]
pub mod fused;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub mod glue;
#[cfg(all(test, feature = "cuda"))]
mod tests_cuda;
