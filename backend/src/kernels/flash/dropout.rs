//! Attention dropout inside the fused op: which probabilities `P_ij` are
//! dropped, as a stateless hash of `(seed, batch · heads + head, i, j)`, so
//! that the backward draws the same mask as the forward without either
//! keeping it (FlashAttention keeps a Philox offset for the same reason).
//! A kept probability is scaled by `1 / (1 − p)`; the softmax's sum and the
//! log-sum-exp are of the undropped probabilities, as `dropout(softmax(S))`
//! has them.
//!
//! The hash is murmur3's 32-bit finalizer, twice per row and once per
//! score: a few integer instructions per score, not a random-number
//! generator's state. `tile::dropout_row` / `tile::dropout_factor` are its
//! kernel form; [`row_key`] and [`keeps`] the host's (the reference, the
//! blocked path). They must agree bit for bit: the kernel tests compare the
//! kernels with dropout against the reference.

use burn::tensor::backend::Backend;
use burn::tensor::{Distribution, Int, Tensor};

/// Dropout of the attention probabilities in one call.
#[derive(Clone, Debug)]
pub struct FlashDropout<B: Backend> {
    /// The probability of dropping, in (0, 1).
    pub p: f64,
    /// Two seed words in `0 .. 2^24` on the device (`[2]`), drawn from the
    /// backend's generator ([`FlashDropout::draw`]): the kernels read them
    /// there, so drawing needs no host round trip.
    pub seed: Tensor<B, 1, Int>,
}

/// Each seed word's range: exact in the f32 a uniform int draw goes through.
const SEED_WORD: f64 = (1u32 << 24) as f64;

impl<B: Backend> FlashDropout<B> {
    /// Dropout with probability `p`, its seed drawn from the backend's
    /// generator: the trainer re-seeds that before every layer and before
    /// its recomputation, so a recomputed layer drops what its first forward
    /// dropped.
    pub fn draw(p: f64, device: &B::Device) -> Self {
        FlashDropout {
            p,
            seed: Tensor::random([2], Distribution::Uniform(0.0, SEED_WORD), device),
        }
    }

    /// The seed as the hash takes it (a read from the device).
    pub fn seed_on_host(&self) -> u32 {
        let words: Vec<i64> = self
            .seed
            .clone()
            .into_data()
            .convert::<i64>()
            .to_vec()
            .unwrap();
        seed32(words[0] as u32, words[1] as u32)
    }
}

/// murmur3's 32-bit finalizer: every input bit flips each output bit with
/// probability about ½.
pub fn mix32(x: u32) -> u32 {
    let x = x ^ (x >> 16);
    let x = x.wrapping_mul(0x85EB_CA6B);
    let x = x ^ (x >> 13);
    let x = x.wrapping_mul(0xC2B2_AE35);
    x ^ (x >> 16)
}

/// The two seed words as one.
pub fn seed32(w0: u32, w1: u32) -> u32 {
    mix32(w0) ^ w1
}

/// The key of query row `i` of head slice `bh` (`batch · heads + head`).
pub fn row_key(seed: u32, bh: usize, i: usize) -> u32 {
    mix32(mix32(seed.wrapping_add((bh as u32).wrapping_mul(0x9E37_79B9))) ^ i as u32)
}

/// Whether score `(i, j)` of the row whose key is `row` is kept.
pub fn keeps(row: u32, j: usize, threshold: u32) -> bool {
    mix32(row ^ (j as u32).wrapping_mul(0x27D4_EB2F)) >= threshold
}

/// Hashes below this are dropped: `p · 2^32`.
pub fn threshold(p: f64) -> u32 {
    (p * 4_294_967_296.0).round().clamp(0.0, u32::MAX as f64) as u32
}

/// What a kept probability is multiplied by.
pub fn keep_scale(p: f64) -> f64 {
    1.0 / (1.0 - p)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The mask keeps `1 − p` of the scores, and neighbouring scores, rows
    /// and heads are not correlated: a hash with structure would show it in
    /// one of these.
    #[test]
    fn the_mask_keeps_one_minus_p_and_has_no_structure() {
        for (p, seed) in [(0.1, 7u32), (0.5, 12_345), (0.9, 99)] {
            let thr = threshold(p);
            let (rows, cols, heads) = (64, 256, 4);
            let mut mask = vec![false; heads * rows * cols];
            for bh in 0..heads {
                for i in 0..rows {
                    let r = row_key(seed, bh, i);
                    for j in 0..cols {
                        mask[(bh * rows + i) * cols + j] = keeps(r, j, thr);
                    }
                }
            }
            let n = mask.len() as f64;
            let kept = mask.iter().filter(|&&k| k).count() as f64 / n;
            let sd = (p * (1.0 - p) / n).sqrt();
            assert!((kept - (1.0 - p)).abs() < 5.0 * sd, "p {p}: kept {kept}");
            // Agreement of each score with its right neighbour, the one
            // below it and the same score one head on: 1 − 2p(1 − p) when
            // they are independent.
            let agree = |d: usize| {
                let pairs = mask.len() - d;
                (0..pairs).filter(|&x| mask[x] == mask[x + d]).count() as f64 / pairs as f64
            };
            let want = 1.0 - 2.0 * p * (1.0 - p);
            for (d, what) in [(1, "column"), (cols, "row"), (rows * cols, "head")] {
                let got = agree(d);
                assert!(
                    (got - want).abs() < 0.01,
                    "p {p}: next {what} agrees {got}, not {want}"
                );
            }
        }
    }

    #[test]
    fn another_seed_drops_other_scores() {
        let thr = threshold(0.5);
        let mask = |seed| (0..4096).map(move |j| keeps(row_key(seed, 0, 0), j, thr));
        let same = mask(1).zip(mask(2)).filter(|(a, b)| a == b).count();
        assert!((1800..2300).contains(&same), "{same} of 4096 agree");
    }

    #[test]
    fn threshold_and_scale() {
        assert_eq!(threshold(0.0), 0);
        assert_eq!(threshold(0.5), 1 << 31);
        // Saturates, where a cast of 2^32 would wrap to "keep everything".
        assert_eq!(threshold(0.999_999_999_999), u32::MAX);
        assert!((keep_scale(0.2) - 1.25).abs() < 1e-12);
    }
}
