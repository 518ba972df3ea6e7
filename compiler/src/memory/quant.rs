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
//!
//! Using the weight dequantizes it. bitsandbytes dequantizes the whole weight per use
//! (`Nf4Dequant::WholeWeight`); rcoa's Burn executor dequantizes
//! [`QLORA_CHUNK_VALUES`] values at a time ([`qlora_chunk_rows`]), so its transient is
//! bounded by the chunk (`Nf4Dequant::Chunked`, [`qlora_dequant_transient`]).

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

/// Weight values rcoa's Burn executor dequantizes at once: `CHUNK_VALUES` in
/// `backend/src/quant/qlora.rs` (change both together).
pub const QLORA_CHUNK_VALUES: u64 = 1 << 22;

/// Rows of a `[d_in, d_out]` NF4 weight (Burn's layout: rows are input features) per
/// chunk of at most `limit` values, as `chunk_rows` in `backend/src/quant/qlora.rs`
/// picks them: a multiple of `64 / gcd(d_out, 64)` rows so every chunk starts on an NF4
/// block, as many as fit, at least one such multiple, at most `d_in`.
pub fn qlora_chunk_rows([d_in, d_out]: [u64; 2], limit: u64) -> u64 {
    let d_out = d_out.max(1);
    let align = NF4_BLOCK / gcd(d_out, NF4_BLOCK);
    let fit = limit / d_out / align * align;
    fit.max(align).min(d_in.max(1))
}

/// Chunks one use of a `[d_in, d_out]` NF4 weight takes.
pub fn qlora_chunks(shape: [u64; 2]) -> u64 {
    shape[0]
        .max(1)
        .div_ceil(qlora_chunk_rows(shape, QLORA_CHUNK_VALUES))
}

/// Bytes the Burn executor's chunked dequantization of a `[d_in, d_out]` NF4 weight
/// allocates at its highest, in one use (the forward's `x · W`, or the backward's
/// `dy · Wᵀ`): `bytes_per_value` per dequantized value of the largest chunk plus
/// `fixed_bytes` (see `Profile::nf4_dequant`).
pub fn qlora_dequant_transient(shape: [u64; 2], bytes_per_value: f64, fixed_bytes: u64) -> u64 {
    let values = qlora_chunk_rows(shape, QLORA_CHUNK_VALUES) * shape[1];
    (values as f64 * bytes_per_value).ceil() as u64 + fixed_bytes
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
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

    /// The chunk arithmetic of `backend/src/quant/qlora.rs` and the measured transient
    /// `201/16 · C + 1184` bytes, worked by hand for each shape (Burn's `[d_in, d_out]`).
    #[test]
    fn qlora_transient_is_bounded_by_the_chunk() {
        let per_use = |shape| qlora_dequant_transient(shape, 201.0 / 16.0, 1184);
        // 4096 × 4096: 4 Mi / 4096 = 1024 rows a chunk, C = 4 Mi values, 4 chunks;
        // 201 · 4 Mi / 16 = 52,690,944, + 1184.
        assert_eq!(qlora_chunk_rows([4096, 4096], QLORA_CHUNK_VALUES), 1024);
        assert_eq!(qlora_chunks([4096, 4096]), 4);
        assert_eq!(per_use([4096, 4096]), 52_692_128);
        // [14336, 4096] (Mistral's down_proj): the same 1024-row chunk of 4 Mi values, 14 of them.
        assert_eq!(qlora_chunks([14336, 4096]), 14);
        assert_eq!(per_use([14336, 4096]), 52_692_128);
        // [4096, 14336] (gate/up): 14336 = 64 · 224, so rows align to 1: ⌊4 Mi / 14336⌋ = 292
        // rows, C = 292 · 14336 = 4,186,112, ⌈4096 / 292⌉ = 15 chunks;
        // 201 · 4,186,112 / 16 = 52,588,032, + 1184.
        assert_eq!(qlora_chunk_rows([4096, 14336], QLORA_CHUNK_VALUES), 292);
        assert_eq!(qlora_chunks([4096, 14336]), 15);
        assert_eq!(per_use([4096, 14336]), 52_589_216);
        // A tiny [64, 48] weight: gcd(48, 64) = 16 aligns rows to 4, all 64 rows fit: one
        // chunk of C = 3072 values, 201 · 3072 / 16 = 38,592, + 1184.
        assert_eq!(qlora_chunk_rows([64, 48], QLORA_CHUNK_VALUES), 64);
        assert_eq!(qlora_chunks([64, 48]), 1);
        assert_eq!(per_use([64, 48]), 39_776);
        // Against the whole weight in fp32 (bitsandbytes' copy would be 2 or 4 bytes a value,
        // the executor's old whole-weight path 12.6): a fifteenth for the 58.7 M projection.
        assert!(per_use([4096, 14336]) * 14 < 4096 * 14336 * 201 / 16);
        // Rows wider than a chunk still take one aligned row group (more than the limit).
        assert_eq!(qlora_chunk_rows([8, 1 << 23], QLORA_CHUNK_VALUES), 1);
        assert_eq!(
            qlora_chunk_rows([128, (1 << 22) + 1], QLORA_CHUNK_VALUES),
            64
        );
    }

    /// `QLORA_CHUNK_VALUES` mirrors the executor's `CHUNK_VALUES`, read from its source so
    /// that changing one without the other fails here.
    #[test]
    fn chunk_values_mirror_the_executor() {
        let src = include_str!("../../../backend/src/quant/qlora.rs");
        let rhs = src
            .lines()
            .find_map(|l| l.trim().strip_prefix("pub const CHUNK_VALUES: usize = "))
            .expect("backend/src/quant/qlora.rs defines CHUNK_VALUES")
            .trim_end_matches(';');
        let value = match rhs.split_once("<<") {
            Some((a, b)) => a.trim().parse::<u64>().unwrap() << b.trim().parse::<u32>().unwrap(),
            None => rhs.trim().replace('_', "").parse::<u64>().unwrap(),
        };
        assert_eq!(value, QLORA_CHUNK_VALUES);
    }
}
