//! Bytes of QLoRA's NF4 base weights, as bitsandbytes (and rcoa's codec,
//! `backend/src/quant/nf4.rs`) store them.
//!
//! A weight of `n` values is quantized in blocks of [`NF4_BLOCK`] over its flat
//! row-major values: two 4-bit codes per byte (an odd count padded by one
//! code), and one scale per block. The scales are either one fp32 absmax per
//! block (bitsandbytes' `quantize_4bit` default) or double-quantized
//! (`compress_statistics`, QLoRA's `bnb_4bit_use_double_quant`): an 8-bit
//! code per block plus one fp32 scale per [`NF4_STATS_BLOCK`] blocks (their
//! mean, subtracted first, is one host-side float, not device memory). So a
//! 64-value block costs 32 bits of scale, or 8 + 32/256.
//! Which of the two a plan gets is the profile's `nf4_double_quant`.

/// bitsandbytes' NF4 block (`quantize_4bit(blocksize=64)`).
pub const NF4_BLOCK: u64 = 64;
/// Blocks per second-level scale of double quantization (bitsandbytes' 256).
pub const NF4_STATS_BLOCK: u64 = 256;

/// The device allocations of one NF4 weight of `n` values, in bytes before the
/// allocator's rounding: the packed codes, then each scale tensor.
pub fn nf4_parts(n: u64, double_quant: bool) -> [u64; 3] {
    let codes = n.div_ceil(2);
    let blocks = n.div_ceil(NF4_BLOCK);
    if double_quant {
        [codes, blocks, 4 * blocks.div_ceil(NF4_STATS_BLOCK)]
    } else {
        [codes, 4 * blocks, 0]
    }
}

/// Bytes of one NF4 weight of `n` values (codes and scales, no rounding).
pub fn nf4_bytes(n: u64, double_quant: bool) -> u64 {
    nf4_parts(n, double_quant).iter().sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Independent arithmetic: 4 bits a value, plus 32 bits of absmax per 64 values
    /// (4.5 bits), or 8 bits per 64 values and 32 per 64 × 256 (≈ 4.127 bits).
    #[test]
    fn nf4_costs_four_bits_plus_its_block_scales() {
        let n = 4096 * 4096u64;
        assert_eq!(nf4_bytes(n, false), n / 2 + 4 * n / 64);
        assert_eq!(nf4_bytes(n, false) * 8, n * 9 / 2);
        assert_eq!(nf4_bytes(n, true), n / 2 + n / 64 + 4 * n / (64 * 256));
        let bits = nf4_bytes(n, true) as f64 * 8.0 / n as f64;
        assert!((bits - (4.0 + 8.0 / 64.0 + 32.0 / (64.0 * 256.0))).abs() < 1e-12);
        // A short tail block still has its scale; an odd count pads one code.
        assert_eq!(nf4_parts(65, false), [33, 8, 0]);
        assert_eq!(nf4_parts(65, true), [33, 2, 4]);
        assert_eq!(nf4_parts(64 * 257, true), [64 * 257 / 2, 257, 8]);
    }
}
