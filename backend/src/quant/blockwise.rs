//! 8-bit block-wise quantization (bitsandbytes' `quantize_blockwise` /
//! `dequantize_blockwise`): each block of `block` values is scaled by its
//! absmax into [-1, 1] and mapped to the nearest of the 256 map entries.

use super::{absmax, check_finite, check_len, inv_scale, midpoints, nearest, QuantError};

/// Block size of bitsandbytes' block-wise 8-bit optimizers (`Optimizer8bit`,
/// `blocksize = 256`) and of the double-quantized NF4 scales.
pub const BLOCK: usize = 256;

/// A block-wise 8-bit quantized vector: one code per value, one fp32 absmax
/// per block (the last block may be short).
#[derive(Clone, Debug, PartialEq)]
pub struct Blockwise8 {
    pub codes: Vec<u8>,
    pub absmax: Vec<f32>,
    pub block: usize,
}

/// A map with its midpoints, ready to quantize against.
pub struct Codebook<'a> {
    pub values: &'a [f32; 256],
    mid: Vec<f32>,
}

impl<'a> Codebook<'a> {
    pub fn new(values: &'a [f32; 256]) -> Self {
        Codebook {
            values,
            mid: midpoints(values),
        }
    }

    /// Quantizes one block into `codes`; returns its absmax.
    pub fn quantize_block(&self, x: &[f32], codes: &mut [u8]) -> f32 {
        let a = absmax(x);
        let inv = inv_scale(a);
        for (c, v) in codes.iter_mut().zip(x) {
            *c = nearest(&self.mid, (v * inv).clamp(-1.0, 1.0));
        }
        a
    }

    /// Dequantizes one block into `out`.
    pub fn dequantize_block(&self, codes: &[u8], absmax: f32, out: &mut [f32]) {
        for (o, c) in out.iter_mut().zip(codes) {
            *o = self.values[*c as usize] * absmax;
        }
    }
}

impl Blockwise8 {
    /// Quantizes `x` with `map` in blocks of `block`.
    pub fn quantize(x: &[f32], map: &[f32; 256], block: usize) -> Result<Self, QuantError> {
        if block == 0 {
            return Err(QuantError::BlockSize(block));
        }
        check_finite("the input", x)?;
        let book = Codebook::new(map);
        let mut codes = vec![0u8; x.len()];
        let absmax = x
            .chunks(block)
            .zip(codes.chunks_mut(block))
            .map(|(xs, cs)| book.quantize_block(xs, cs))
            .collect();
        Ok(Blockwise8 {
            codes,
            absmax,
            block,
        })
    }

    /// The values back: `map[code] * absmax[block]`.
    pub fn dequantize(&self, map: &[f32; 256]) -> Result<Vec<f32>, QuantError> {
        if self.block == 0 {
            return Err(QuantError::BlockSize(self.block));
        }
        check_len(
            "absmax (one per block)",
            self.codes.len().div_ceil(self.block),
            self.absmax.len(),
        )?;
        let book = Codebook::new(map);
        let mut out = vec![0.0f32; self.codes.len()];
        for ((cs, os), a) in self
            .codes
            .chunks(self.block)
            .zip(out.chunks_mut(self.block))
            .zip(&self.absmax)
        {
            book.dequantize_block(cs, *a, os);
        }
        Ok(out)
    }

    /// Bytes held: one per code, four per block scale.
    pub fn bytes(&self) -> usize {
        self.codes.len() + 4 * self.absmax.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::bnb_ref as r;
    use crate::quant::maps::{DYNAMIC_SIGNED, DYNAMIC_UNSIGNED};
    use crate::quant::tests::det_weights;

    #[test]
    fn maps_equal_bitsandbytes() {
        assert_eq!(DYNAMIC_SIGNED, r::DYNAMIC_SIGNED);
        assert_eq!(DYNAMIC_UNSIGNED, r::DYNAMIC_UNSIGNED);
        assert_eq!(crate::quant::maps::NF4, r::NF4_CODE);
    }

    /// Codes, scales and dequantized values equal bitsandbytes'
    /// `quantize_blockwise(x, blocksize=256)` (two full blocks and a tail).
    #[test]
    fn quantize_blockwise_matches_bitsandbytes() {
        let x = det_weights(700, 0.05);
        let q = Blockwise8::quantize(&x, &DYNAMIC_SIGNED, BLOCK).unwrap();
        assert_eq!(q.absmax, r::BW_ABSMAX);
        assert_eq!(q.codes, r::BW_Q);
        assert_eq!(q.dequantize(&DYNAMIC_SIGNED).unwrap(), r::BW_DEQUANT);
    }

    #[test]
    fn zero_block_quantizes_to_zero() {
        let q = Blockwise8::quantize(&[0.0; 10], &DYNAMIC_SIGNED, BLOCK).unwrap();
        assert_eq!(q.dequantize(&DYNAMIC_SIGNED).unwrap(), vec![0.0; 10]);
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert_eq!(
            Blockwise8::quantize(&[1.0, f32::NAN], &DYNAMIC_SIGNED, BLOCK),
            Err(QuantError::NonFinite {
                what: "the input",
                index: 1
            })
        );
        assert_eq!(
            Blockwise8::quantize(&[1.0], &DYNAMIC_SIGNED, 0),
            Err(QuantError::BlockSize(0))
        );
        let mut q = Blockwise8::quantize(&[1.0; 300], &DYNAMIC_SIGNED, BLOCK).unwrap();
        q.absmax.pop();
        assert!(matches!(
            q.dequantize(&DYNAMIC_SIGNED),
            Err(QuantError::Length {
                expected: 2,
                got: 1,
                ..
            })
        ));
    }
}
