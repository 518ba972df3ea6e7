//! The token embedding's gradient, `d_table[id, :] += dy[t, :]` for every token `t`
//! (`ExecBackend::embedding_grad`).
//!
//! Burn computes it with `select_assign`, whose kernel gives each column one unit that walks
//! every token in turn: `hidden` units in all (1,024 on the 350M) for 8,192 tokens, so one
//! launch took 2.95 ms of the 350M's step on an H200 (2026-11-28f profile, call 2), where a
//! kernel that reads and writes the same bytes in parallel takes tens of microseconds.
//!
//! - [`autodiff`]: Burn's embedding node, with its backward through `embedding_grad`.
//! - `fused`: the kernel on the fused CubeCL backends (`Cuda<f32>`, `Wgpu<f32>`).

pub mod autodiff;

#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub mod fused;
