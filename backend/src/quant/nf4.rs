//! NF4 (4-bit NormalFloat) weights as bitsandbytes stores them
//! (`quantize_4bit(quant_type="nf4")`): blocks of 64 values over the flat
//! row-major weight, each scaled by its absmax into [-1, 1] and mapped to the
//! nearest of the 16 [`NF4`] values; two codes per byte, the even-indexed
//! value in the high nibble. With double quantization (`compress_statistics`)
//! the per-block absmax are themselves stored as 8-bit codes: their mean is
//! subtracted and the rest quantized block-wise (256) with the signed dynamic
//! map, so a 64-block costs 8 + 32/256 bits instead of 32 for its scale.
//!
//! Dequantization runs on the CPU over slices ([`Nf4Weight::dequantize`],
//! threaded for large weights) or as Burn tensor ops on any backend
//! ([`Nf4Tensor::dequantize`]: a gather from the 16-entry table by nibble,
//! times the block's scale), which gives CUDA a device path without a custom
//! kernel. A fused CubeCL dequantize-matmul kernel is future work.

use super::blockwise::{Codebook, BLOCK as STATS_BLOCK};
use super::maps::{DYNAMIC_SIGNED, NF4};
use super::{
    absmax, check_finite, check_len, inv_scale, midpoints, nearest, threads_for, QuantError,
};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Element, Int, Tensor, TensorData};

/// bitsandbytes' default NF4 block size (`quantize_4bit(blocksize=64)`).
pub const BLOCK: usize = 64;

/// The per-block scales of an NF4 weight.
#[derive(Clone, Debug, PartialEq)]
pub enum Scales {
    /// One fp32 absmax per block.
    Fp32(Vec<f32>),
    /// Double quantization: `absmax = DYNAMIC_SIGNED[code] * absmax2[code / 256] + offset`.
    Double {
        codes: Vec<u8>,
        absmax2: Vec<f32>,
        offset: f32,
    },
}

/// A `[rows, cols]` fp32 weight quantized to NF4.
#[derive(Clone, Debug, PartialEq)]
pub struct Nf4Weight {
    /// `ceil(rows * cols / 2)` bytes.
    pub packed: Vec<u8>,
    pub scales: Scales,
    pub shape: [usize; 2],
}

impl Nf4Weight {
    /// Quantizes the row-major `w` of `shape`; `double` quantizes the scales too.
    pub fn quantize(w: &[f32], shape: [usize; 2], double: bool) -> Result<Self, QuantError> {
        check_len("the weight (rows x cols)", shape[0] * shape[1], w.len())?;
        check_finite("the weight", w)?;
        let mid = midpoints(&NF4);
        let n = w.len();
        let full = n - n % BLOCK;
        let mut absmaxes = Vec::with_capacity(n.div_ceil(BLOCK));
        let mut codes = Vec::with_capacity(n + 1);
        for block in w.chunks(BLOCK) {
            let a = absmax(block);
            absmaxes.push(a);
            // As bitsandbytes: full blocks multiply by the reciprocal, the
            // short tail block divides (the two can differ in the last bit).
            if block.len() == BLOCK {
                let inv = inv_scale(a);
                codes.extend(
                    block
                        .iter()
                        .map(|v| nearest(&mid, (v * inv).clamp(-1.0, 1.0))),
                );
            } else {
                let d = a.max(1e-38);
                codes.extend(
                    block
                        .iter()
                        .map(|v| nearest(&mid, (v / d).clamp(-1.0, 1.0))),
                );
            }
        }
        debug_assert!(full <= codes.len());
        if codes.len() % 2 == 1 {
            // An odd count is padded with a scaled 0.0 (code 7), as bitsandbytes pads.
            codes.push(nearest(&mid, 0.0));
        }
        let packed = codes.chunks(2).map(|p| (p[0] << 4) | p[1]).collect();
        let scales = if double {
            double_quantize(&absmaxes)
        } else {
            Scales::Fp32(absmaxes)
        };
        Ok(Nf4Weight {
            packed,
            scales,
            shape,
        })
    }

    /// What [`Nf4Weight::quantize`] gives for an all-zero weight, without its pass over
    /// every value: the stand-in a recording pass builds (`crate::prebuild`), whose
    /// values mean nothing.
    pub fn zeros(shape: [usize; 2], double: bool) -> Self {
        let n = shape[0] * shape[1];
        let zero = nearest(&midpoints(&NF4), 0.0);
        let absmaxes = vec![0.0; n.div_ceil(BLOCK)];
        Nf4Weight {
            packed: vec![(zero << 4) | zero; n.div_ceil(2)],
            scales: if double {
                double_quantize(&absmaxes)
            } else {
                Scales::Fp32(absmaxes)
            },
            shape,
        }
    }

    pub fn len(&self) -> usize {
        self.shape[0] * self.shape[1]
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    fn blocks(&self) -> usize {
        self.len().div_ceil(BLOCK)
    }

    /// Checks that the parts agree with the shape (a weight built by hand or
    /// read from a file may not).
    pub fn validate(&self) -> Result<(), QuantError> {
        check_len(
            "the packed codes (two per byte)",
            self.len().div_ceil(2),
            self.packed.len(),
        )?;
        match &self.scales {
            Scales::Fp32(a) => check_len("the scales (one per block)", self.blocks(), a.len()),
            Scales::Double { codes, absmax2, .. } => {
                check_len(
                    "the scale codes (one per block)",
                    self.blocks(),
                    codes.len(),
                )?;
                check_len(
                    "the second-level scales (one per 256 blocks)",
                    self.blocks().div_ceil(STATS_BLOCK),
                    absmax2.len(),
                )
            }
        }
    }

    /// The fp32 absmax of every block (undoing double quantization).
    pub fn block_absmax(&self) -> Result<Vec<f32>, QuantError> {
        self.validate()?;
        Ok(match &self.scales {
            Scales::Fp32(a) => a.clone(),
            Scales::Double {
                codes,
                absmax2,
                offset,
            } => {
                let book = Codebook::new(&DYNAMIC_SIGNED);
                let mut out = vec![0.0f32; codes.len()];
                for ((cs, os), a) in codes
                    .chunks(STATS_BLOCK)
                    .zip(out.chunks_mut(STATS_BLOCK))
                    .zip(absmax2)
                {
                    book.dequantize_block(cs, *a, os);
                }
                out.iter_mut().for_each(|v| *v += offset);
                out
            }
        })
    }

    /// The weight back in fp32, row-major; threaded for large weights.
    pub fn dequantize(&self) -> Result<Vec<f32>, QuantError> {
        let absmax = self.block_absmax()?;
        let n = self.len();
        let mut out = vec![0.0f32; n];
        let threads = threads_for(n);
        // Whole blocks per thread, so a block's bytes never straddle threads.
        let per = n.div_ceil(BLOCK).div_ceil(threads).max(1) * BLOCK;
        std::thread::scope(|s| {
            for (i, chunk) in out.chunks_mut(per).enumerate() {
                let start = i * per;
                let packed = &self.packed[start / 2..];
                let absmax = &absmax[start / BLOCK..];
                s.spawn(move || dequantize_into(packed, absmax, chunk));
            }
        });
        Ok(out)
    }

    /// Bytes held: packed codes plus scales.
    pub fn bytes(&self) -> usize {
        self.packed.len()
            + match &self.scales {
                Scales::Fp32(a) => 4 * a.len(),
                Scales::Double { codes, absmax2, .. } => codes.len() + 4 * absmax2.len() + 4,
            }
    }

    /// The packed weight on `device`, for [`Nf4Tensor::dequantize`].
    pub fn to_device<B: Backend>(&self, device: &B::Device) -> Result<Nf4Tensor<B>, QuantError> {
        self.clone().into_device(device)
    }

    /// [`Nf4Weight::to_device`], its buffers moved rather than copied (a
    /// gathered base is rebuilt without a second copy of its codes).
    pub fn into_device<B: Backend>(self, device: &B::Device) -> Result<Nf4Tensor<B>, QuantError> {
        self.validate()?;
        let blocks = self.blocks();
        // Padded to whole blocks so the device path reshapes without a tail.
        let mut packed = self.packed;
        packed.resize(blocks * BLOCK / 2, 0);
        let packed = Tensor::<B, 1, Int>::from_data(
            TensorData::new(packed, [blocks * BLOCK / 2]),
            (device, DType::U8),
        );
        let scales = match self.scales {
            Scales::Fp32(a) => DeviceScales::Fp32(Tensor::from_floats(a.as_slice(), device)),
            Scales::Double {
                codes,
                absmax2,
                offset,
            } => {
                // One code per block, as bitsandbytes stores them: the
                // dequantization pads the last 256-group for a moment.
                let n = codes.len();
                DeviceScales::Double {
                    codes: Tensor::from_data(TensorData::new(codes, [n]), (device, DType::U8)),
                    absmax2: Tensor::from_floats(absmax2.as_slice(), device),
                    offset,
                }
            }
        };
        Ok(Nf4Tensor {
            packed,
            scales,
            shape: self.shape,
        })
    }
}

/// `quantize_4bit(compress_statistics=True)`: the absmax minus their mean,
/// block-wise 8-bit (256) with the signed dynamic map.
fn double_quantize(absmax: &[f32]) -> Scales {
    // torch's `mean()` of an fp32 tensor: an fp32 result of a wider sum.
    let offset =
        (absmax.iter().map(|a| *a as f64).sum::<f64>() / absmax.len().max(1) as f64) as f32;
    let centred: Vec<f32> = absmax.iter().map(|a| a - offset).collect();
    let book = Codebook::new(&DYNAMIC_SIGNED);
    let mut codes = vec![0u8; centred.len()];
    let absmax2 = centred
        .chunks(STATS_BLOCK)
        .zip(codes.chunks_mut(STATS_BLOCK))
        .map(|(xs, cs)| book.quantize_block(xs, cs))
        .collect();
    Scales::Double {
        codes,
        absmax2,
        offset,
    }
}

/// Dequantizes `out.len()` values starting at a block boundary.
fn dequantize_into(packed: &[u8], absmax: &[f32], out: &mut [f32]) {
    for (bi, block) in out.chunks_mut(BLOCK).enumerate() {
        let a = absmax[bi];
        let bytes = &packed[bi * BLOCK / 2..];
        for (j, o) in block.iter_mut().enumerate() {
            let byte = bytes[j / 2];
            let code = if j % 2 == 0 { byte >> 4 } else { byte & 0x0f };
            *o = NF4[code as usize] * a;
        }
    }
}

/// Per-block scales on a device.
#[derive(Clone, Debug)]
pub enum DeviceScales<B: Backend> {
    Fp32(Tensor<B, 1>),
    Double {
        /// u8, padded to whole 256-blocks.
        codes: Tensor<B, 1, Int>,
        absmax2: Tensor<B, 1>,
        offset: f32,
    },
}

/// A packed NF4 weight on a device: u8 codes (two per byte) padded to whole
/// 64-blocks, and the scales.
#[derive(Clone, Debug)]
pub struct Nf4Tensor<B: Backend> {
    pub packed: Tensor<B, 1, Int>,
    pub scales: DeviceScales<B>,
    pub shape: [usize; 2],
}

impl<B: Backend> Nf4Tensor<B> {
    /// The weight back in host memory, without the device padding: the
    /// inverse of [`Nf4Weight::to_device`] (checkpoints hold this).
    pub fn to_host(&self) -> Result<Nf4Weight, QuantError> {
        let len = self.shape[0] * self.shape[1];
        let blocks = len.div_ceil(BLOCK);
        let bytes = |t: &Tensor<B, 1, Int>| -> Vec<u8> {
            t.clone()
                .into_data()
                .convert::<u8>()
                .into_vec::<u8>()
                .unwrap_or_default()
        };
        let floats = |t: &Tensor<B, 1>| -> Vec<f32> {
            t.clone()
                .into_data()
                .convert::<f32>()
                .into_vec::<f32>()
                .unwrap_or_default()
        };
        let mut packed = bytes(&self.packed);
        packed.truncate(len.div_ceil(2));
        let scales = match &self.scales {
            DeviceScales::Fp32(a) => {
                let mut a = floats(a);
                a.truncate(blocks);
                Scales::Fp32(a)
            }
            DeviceScales::Double {
                codes,
                absmax2,
                offset,
            } => {
                let mut codes = bytes(codes);
                codes.truncate(blocks);
                Scales::Double {
                    codes,
                    absmax2: floats(absmax2),
                    offset: *offset,
                }
            }
        };
        let w = Nf4Weight {
            packed,
            scales,
            shape: self.shape,
        };
        // A short read (a conversion that failed) shows as a length error.
        w.validate()?;
        Ok(w)
    }

    /// Bytes held on the device (codes and scales, with the padding).
    pub fn bytes(&self) -> usize {
        self.packed.dims()[0]
            + match &self.scales {
                DeviceScales::Fp32(a) => 4 * a.dims()[0],
                DeviceScales::Double { codes, absmax2, .. } => {
                    codes.dims()[0] + 4 * absmax2.dims()[0] + 4
                }
            }
    }

    /// The `[rows, cols]` fp32 weight, built with tensor ops on the device.
    ///
    /// Each byte indexes two 256-entry tables, of its high and of its low
    /// nibble's NF4 value, and the two halves are interleaved: the transient
    /// tensors are the byte indices widened to the backend's integer type,
    /// the two halves and the values, each scaled by its block in place.
    /// (A 1-D gather: Burn's ndarray backend gathers rows of a 2-D table
    /// with a buffer per row, 14 times the memory.)
    pub fn dequantize(&self) -> Tensor<B, 2> {
        let device = self.packed.device();
        let index = <B::IntElem as Element>::dtype();
        let nbytes = self.packed.dims()[0];
        let table = |nibble: fn(usize) -> usize| {
            let v: Vec<f32> = (0..256usize).map(|b| NF4[nibble(b)]).collect();
            Tensor::<B, 1>::from_floats(v.as_slice(), &device)
        };
        let bytes = self.packed.clone().cast(index);
        let hi = table(|b| b >> 4).select(0, bytes.clone());
        let lo = table(|b| b & 0x0f).select(0, bytes);
        let blocks = nbytes * 2 / BLOCK;
        let values = Tensor::stack::<2>(vec![hi, lo], 1).reshape([blocks, BLOCK]);
        let scales = self.block_absmax().reshape([blocks, 1]);
        let [rows, cols] = self.shape;
        (values * scales)
            .reshape([blocks * BLOCK])
            .narrow(0, 0, rows * cols)
            .reshape([rows, cols])
    }

    /// The fp32 absmax of every (padded) block.
    fn block_absmax(&self) -> Tensor<B, 1> {
        match &self.scales {
            DeviceScales::Fp32(a) => a.clone(),
            DeviceScales::Double { codes, .. } => self.block_absmax_range(0, codes.dims()[0]),
        }
    }

    /// The fp32 absmax of blocks `first..end`. Under double quantization
    /// block `b` is `DYNAMIC_SIGNED[code_b] * absmax2[b / 256] + offset`:
    /// each group's second-level scale is repeated over the group's blocks
    /// in the range, so only the range's blocks are materialized.
    fn block_absmax_range(&self, first: usize, end: usize) -> Tensor<B, 1> {
        let count = end - first;
        match &self.scales {
            DeviceScales::Fp32(a) => a.clone().narrow(0, first, count),
            DeviceScales::Double {
                codes,
                absmax2,
                offset,
            } => {
                let device = codes.device();
                let map = Tensor::<B, 1>::from_floats(DYNAMIC_SIGNED, &device);
                let index = <B::IntElem as Element>::dtype();
                let g0 = first / STATS_BLOCK;
                let groups = end.div_ceil(STATS_BLOCK) - g0;
                let second = absmax2
                    .clone()
                    .narrow(0, g0, groups)
                    .reshape([groups, 1])
                    .expand([groups, STATS_BLOCK])
                    .reshape([groups * STATS_BLOCK])
                    .narrow(0, first - g0 * STATS_BLOCK, count);
                let scales = map.select(0, codes.clone().narrow(0, first, count).cast(index));
                (scales * second).add_scalar(*offset)
            }
        }
    }

    /// Rows `start..start + len` of the weight as a packed weight of their
    /// own, with fp32 scales: the codes are a view (no copy); double
    /// quantized scales are decoded for these rows' blocks only.
    /// `start * cols` must fall on a block boundary (a [`BLOCK`] multiple),
    /// so the rows are whole blocks but perhaps the weight's padded last one.
    pub(crate) fn rows(&self, start: usize, len: usize) -> Nf4Tensor<B> {
        let [rows, cols] = self.shape;
        assert!(
            start + len <= rows && (start * cols).is_multiple_of(BLOCK),
            "rows {start}..{} of a [{rows}, {cols}] NF4 weight do not start on a block",
            start + len
        );
        let first = start * cols / BLOCK;
        let blocks = (len * cols).div_ceil(BLOCK);
        Nf4Tensor {
            packed: self
                .packed
                .clone()
                .narrow(0, first * BLOCK / 2, blocks * BLOCK / 2),
            scales: DeviceScales::Fp32(self.block_absmax_range(first, first + blocks)),
            shape: [len, cols],
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn zeros_is_what_quantize_gives_for_a_zero_weight() {
        for shape in [[64, 64], [3, 5], [256, 300], [7, 1]] {
            for double in [false, true] {
                let n = shape[0] * shape[1];
                assert_eq!(
                    super::Nf4Weight::zeros(shape, double),
                    super::Nf4Weight::quantize(&vec![0.0; n], shape, double).unwrap(),
                    "{shape:?}, double {double}"
                );
            }
        }
    }

    use super::*;
    use crate::quant::bnb_ref as r;
    use crate::quant::tests::det_weights;

    type Cpu = burn::backend::NdArray<f32>;

    /// Packed bytes, scales and dequantized values equal bitsandbytes'
    /// `quantize_4bit(blocksize=64, quant_type="nf4")` on two full blocks
    /// and a 40-value tail.
    #[test]
    fn nf4_matches_bitsandbytes() {
        let w = det_weights(168, 0.001);
        let q = Nf4Weight::quantize(&w, [8, 21], false).unwrap();
        assert_eq!(q.packed, r::NF4_PACKED);
        assert_eq!(q.scales, Scales::Fp32(r::NF4_ABSMAX.to_vec()));
        assert_eq!(q.dequantize().unwrap(), r::NF4_DEQUANT);
        assert_eq!(q.bytes(), 84 + 3 * 4);
    }

    /// Double quantization (`compress_statistics=True`) over 301 blocks
    /// (two 256-blocks of scales) equals bitsandbytes.
    #[test]
    fn double_quantization_matches_bitsandbytes() {
        let w = det_weights(r::DQ_LEN, 0.0003);
        let q = Nf4Weight::quantize(&w, [1, r::DQ_LEN], true).unwrap();
        assert_eq!(q.packed[..64], r::DQ_PACKED_HEAD);
        let Scales::Double {
            codes,
            absmax2,
            offset,
        } = &q.scales
        else {
            panic!("double quantized")
        };
        // torch's fp32 `mean()` sums in its own order: the offset may differ
        // in the last bit, and the values derived from it by as little.
        let ulp = |a: f32, b: f32| (a.to_bits() as i64 - b.to_bits() as i64).abs();
        assert!(
            ulp(*offset, r::DQ_OFFSET) <= 1,
            "{offset} vs {}",
            r::DQ_OFFSET
        );
        for (a, b) in absmax2.iter().zip(&r::DQ_ABSMAX2) {
            assert!(ulp(*a, *b) <= 1, "{a} vs {b}");
        }
        assert_eq!(*codes, r::DQ_QABSMAX);
        let d = q.dequantize().unwrap();
        // A block's scale is `offset + small`: one ulp of the offset (1.9e-9)
        // moves every value of the block by up to that much.
        let close = |a: &[f32], b: &[f32]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 1e-8);
        assert!(close(&d[..128], &r::DQ_DEQUANT_HEAD));
        assert!(close(&d[d.len() - 128..], &r::DQ_DEQUANT_TAIL));
    }

    /// The threaded CPU path (above a million values) equals one thread.
    #[test]
    fn threaded_dequantize_equals_serial() {
        let n = (1 << 20) + 100;
        let w = det_weights(n, 0.01);
        let q = Nf4Weight::quantize(&w, [1, n], false).unwrap();
        let par = q.dequantize().unwrap();
        let absmax = q.block_absmax().unwrap();
        let mut serial = vec![0.0; n];
        dequantize_into(&q.packed, &absmax, &mut serial);
        assert_eq!(par, serial);
    }

    /// The tensor path equals the CPU path, with and without double
    /// quantization, for an odd element count.
    #[test]
    fn tensor_dequantize_equals_cpu() {
        let device = Default::default();
        for double in [false, true] {
            let w = det_weights(301 * 64 + 7 * 3, 0.002);
            let shape = [w.len() / 7, 7];
            let q = Nf4Weight::quantize(&w, shape, double).unwrap();
            let cpu = q.dequantize().unwrap();
            let dev: Vec<f32> = q
                .to_device::<Cpu>(&device)
                .unwrap()
                .dequantize()
                .into_data()
                .to_vec()
                .unwrap();
            assert_eq!(dev.len(), cpu.len());
            for (a, b) in dev.iter().zip(&cpu) {
                assert!((a - b).abs() <= 1e-6 * b.abs().max(1e-3), "{a} vs {b}");
            }
        }
    }

    #[test]
    fn round_trip_error_is_within_half_a_code_step() {
        let w = det_weights(640, 0.01);
        let q = Nf4Weight::quantize(&w, [10, 64], false).unwrap();
        let d = q.dequantize().unwrap();
        let Scales::Fp32(absmax) = &q.scales else {
            unreachable!()
        };
        // The widest gap in the NF4 table is -0.6962 - -1: half of it, 0.152.
        for (i, (a, b)) in w.iter().zip(&d).enumerate() {
            assert!(
                (a - b).abs() <= 0.153 * absmax[i / BLOCK],
                "{i}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn bad_inputs_are_errors() {
        assert!(matches!(
            Nf4Weight::quantize(&[0.0; 10], [3, 3], false),
            Err(QuantError::Length {
                expected: 9,
                got: 10,
                ..
            })
        ));
        assert!(matches!(
            Nf4Weight::quantize(&[0.0, f32::INFINITY], [1, 2], true),
            Err(QuantError::NonFinite { index: 1, .. })
        ));
        let mut q = Nf4Weight::quantize(&[0.5; 130], [10, 13], false).unwrap();
        q.packed.pop();
        assert!(q.dequantize().is_err());
        assert!(q.to_device::<Cpu>(&Default::default()).is_err());
    }
}
