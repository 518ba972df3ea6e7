//! Quantized building blocks for QLoRA and 8-bit optimizers, bit-compatible
//! with bitsandbytes (`bitsandbytes/functional.py`, its CPU backend and
//! kernels):
//!
//! - [`nf4`]: 4-bit NormalFloat weights (block size 64, fp32 absmax per block,
//!   two codes per byte, the first in the high nibble) and the double
//!   quantization of the absmax (`compress_statistics`: minus their mean,
//!   8-bit blockwise with the dynamic map, block size 256); dequantization on
//!   the CPU and as Burn tensor ops on any backend;
//! - [`blockwise`]: 8-bit block-wise quantization with a 256-entry map
//!   (`quantize_blockwise`), nearest code by the maps' midpoints;
//! - [`adam8bit`]: Adam / AdamW with block-wise 8-bit moments (bitsandbytes'
//!   `Adam8bit` / `AdamW8bit`, block 256, fp32 state below 4096 elements);
//! - [`qlora`]: `y = x · dequant(W)` as one autodiff node that keeps only the
//!   packed weight and dequantizes a bounded chunk of its rows at a time;
//! - [`base`]: that packed weight as a field of a Burn module (recorded for
//!   checkpoints, invisible to parameter visitors), QLoRA's frozen base in
//!   `model::Linear`.
//!
//! `bnb_ref.rs` holds outputs of bitsandbytes 0.50.2 itself
//! (`gen_bnb_ref.py`), against which the tests compare.

pub mod adam8bit;
pub mod base;
pub mod blockwise;
pub mod maps;
pub mod nf4;
pub mod qlora;

#[cfg(test)]
mod bnb_ref;

/// Why a quantization could not be done.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum QuantError {
    #[error("{what} holds a non-finite value at index {index}; quantization needs finite values")]
    #[diagnostic(code(rcoa::quant_non_finite), help("look for an overflow or a division by zero upstream (lower the learning rate, enable gradient clipping)"))]
    NonFinite { what: &'static str, index: usize },
    #[error("{what}: expected {expected} elements, got {got}")]
    #[diagnostic(code(rcoa::quant_shape))]
    Length {
        what: &'static str,
        expected: usize,
        got: usize,
    },
    #[error("block size {0} is not a positive even number")]
    #[diagnostic(code(rcoa::quant_block))]
    BlockSize(usize),
}

/// The first non-finite element of `x`, as an error.
fn check_finite(what: &'static str, x: &[f32]) -> Result<(), QuantError> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(QuantError::NonFinite { what, index }),
        None => Ok(()),
    }
}

fn check_len(what: &'static str, expected: usize, got: usize) -> Result<(), QuantError> {
    if expected == got {
        Ok(())
    } else {
        Err(QuantError::Length {
            what,
            expected,
            got,
        })
    }
}

/// Midpoints between consecutive entries of a sorted map: code `i` is chosen
/// for `mid[i - 1] < x <= mid[i]`, as `torch.bucketize(x, mid)` in
/// bitsandbytes' reference backend (ties go to the lower code).
fn midpoints<const N: usize>(map: &[f32; N]) -> Vec<f32> {
    map.windows(2).map(|w| (w[0] + w[1]) / 2.0).collect()
}

/// The code of the map entry nearest to `x` (`mid` from [`midpoints`]).
#[inline]
fn nearest(mid: &[f32], x: f32) -> u8 {
    mid.partition_point(|m| *m < x) as u8
}

/// `1 / absmax` as bitsandbytes scales a block (`absmax.clamp(min=1e-38)`), so
/// an all-zero block quantizes to the code of zero instead of NaN.
#[inline]
fn inv_scale(absmax: f32) -> f32 {
    1.0 / absmax.max(1e-38)
}

/// Largest magnitude in a block.
#[inline]
fn absmax(x: &[f32]) -> f32 {
    x.iter().fold(0.0f32, |m, v| m.max(v.abs()))
}

/// Threads for a CPU pass over `n` elements: one below a million elements
/// (spawning costs more than it saves), else every core.
fn threads_for(n: usize) -> usize {
    if n < 1 << 20 {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |t| t.get())
    }
}

#[cfg(test)]
pub(crate) mod tests {
    /// The test inputs of `gen_bnb_ref.py`, bit for bit: integer arithmetic,
    /// then one fp32 division and two fp32 multiplications.
    pub fn det_weights(n: usize, scale: f32) -> Vec<f32> {
        (0..n as i64)
            .map(|i| {
                let num = ((i * 7919) % 2003 - 1001) as f32;
                let block = (((i / 64) * 37) % 101 + 1) as f32;
                num / 1001.0 * (block * scale)
            })
            .collect()
    }
}
