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
//! - `cublas`: loading cuBLAS, per-thread handles on CubeCL's stream, and
//!   the call (`cuda` feature).
//! - `fused`: the glue under Burn's fusion layer on `Cuda<f32>`.

pub mod autodiff;
pub mod layout;

#[cfg(feature = "cuda")]
pub mod cublas;
#[cfg(feature = "cuda")]
pub mod fused;
#[cfg(all(test, feature = "cuda"))]
mod tests_cuda;
