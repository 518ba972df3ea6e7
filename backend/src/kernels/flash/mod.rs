//! Fused ("flash") attention for training: `softmax(scale · q kᵀ + mask) v`
//! and its gradients without a `[batch, heads, s, t]` tensor in either
//! direction (issue #13; `docs/flash-attention.md`).
//!
//! - [`blocked`]: the algorithm in plain Burn tensor ops, blocked over
//!   queries so only `[b, h, block, t]` exists at once: the default of
//!   `ExecBackend::flash_attention_forward` / `_backward` (the CPU path).
//! - [`autodiff`]: the one autodiff node (saves q, k, v, O, LSE).
//! - `fused`: the kernels under Burn's fused CubeCL backends (`Cuda<f32>`,
//!   and `Wgpu<f32>` in the tests).
//! - `forward`, `backward`, `tile`, `launch`: the CubeCL kernels
//!   (FlashAttention-2: online softmax forward saving the log-sum-exp; dK/dV
//!   over key blocks and dQ over query blocks, atomics-free, or, for the
//!   block-product and register kernels, all three in one pass over key
//!   blocks with dQ added atomically; `scratch` holds the backward's small kernels;
//!   `forward_registers` and `backward_registers` are both directions in
//!   FlashAttention-2's register structure, on `fragments`, streaming the other side's
//!   blocks as `stream` says, trials behind `RCOA_FLASH_REGISTERS`). Built with the
//!   `cuda` or `wgpu-kernels` feature; runtime-generic, so the tests run
//!   them on wgpu (lavapipe on a machine without a GPU).
//!
//! Semantics shared by both: causal keeps key `j` for query `i` when
//! `j ≤ i` (needs `s == t`); a padded key gets the eager path's additive
//! `-1e9`, so a row whose visible keys are all padding stays finite (never
//! NaN); grouped-query attention reads kv head `h / (heads / kv_heads)`
//! without repeating k and v.

pub mod autodiff;
pub mod blocked;
pub mod dropout;

#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
mod backward;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
mod backward_blocks;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub mod backward_registers;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub mod device_tensor;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
mod forward;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
mod forward_blocks;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub mod forward_registers;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
mod fragments;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub mod launch;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub mod mma;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
mod scratch;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub mod stream;
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
mod tile;

#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
pub mod fused;
#[cfg(test)]
pub(crate) mod reference;
#[cfg(test)]
mod tests_blocked;
#[cfg(all(test, feature = "cuda", feature = "wgpu-kernels"))]
pub(crate) mod tests_cuda_source;
#[cfg(all(test, any(feature = "cuda", feature = "wgpu-kernels")))]
mod tests_kernels;
#[cfg(all(test, feature = "cuda"))]
mod tests_manual_mma;
#[cfg(all(test, any(feature = "cuda", feature = "wgpu-kernels")))]
mod tests_mma;
