//! Adam / AdamW with 8-bit block-wise moments, as bitsandbytes' `Adam8bit` /
//! `AdamW8bit` (`optimizer_update_8bit_blockwise`): per block of 256 values
//! the moments are dequantized (first moment: signed dynamic map, second:
//! unsigned), updated in fp32, used for the parameter update, and requantized
//! with a fresh absmax. Parameters smaller than [`MIN_8BIT_SIZE`] keep fp32
//! moments, as bitsandbytes does (`min_8bit_size = 4096`). bitsandbytes
//! applies weight decay decoupled (`p *= 1 - lr * wd`) for both classes;
//! they differ only in the default decay.

use super::blockwise::{Blockwise8, Codebook, BLOCK};
use super::maps::{DYNAMIC_SIGNED, DYNAMIC_UNSIGNED};
use super::{check_finite, check_len, QuantError};

/// bitsandbytes' `min_8bit_size`: smaller parameters keep fp32 state.
pub const MIN_8BIT_SIZE: usize = 4096;

/// Hyperparameters (bitsandbytes' names and defaults).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam8bit {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub weight_decay: f32,
}

/// One parameter's moments.
#[derive(Clone, Debug)]
pub enum Moments {
    Fp32 { m: Vec<f32>, v: Vec<f32> },
    Int8 { m: Blockwise8, v: Blockwise8 },
}

/// One parameter's optimizer state.
#[derive(Clone, Debug)]
pub struct ParamState {
    pub step: u32,
    pub moments: Moments,
}

impl ParamState {
    pub fn len(&self) -> usize {
        match &self.moments {
            Moments::Fp32 { m, .. } => m.len(),
            Moments::Int8 { m, .. } => m.codes.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Bytes of state: `2 n` codes and two fp32 scales per 256-block, or `8 n`
    /// below [`MIN_8BIT_SIZE`] (`rcoa_compiler::memory::optimizer::adam8bit_state_bytes`).
    pub fn bytes(&self) -> usize {
        match &self.moments {
            Moments::Fp32 { m, v } => 4 * (m.len() + v.len()),
            Moments::Int8 { m, v } => m.bytes() + v.bytes(),
        }
    }
}

impl Adam8bit {
    /// `bnb.optim.Adam8bit(lr)`: betas (0.9, 0.999), eps 1e-8, no decay.
    pub fn adam(lr: f32) -> Self {
        Adam8bit {
            lr,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        }
    }

    /// `bnb.optim.AdamW8bit(lr, weight_decay=wd)`.
    pub fn adamw(lr: f32, weight_decay: f32) -> Self {
        Adam8bit {
            weight_decay,
            ..Self::adam(lr)
        }
    }

    /// Zero state for a parameter of `len` values.
    pub fn init(&self, len: usize) -> ParamState {
        let moments = if len < MIN_8BIT_SIZE {
            Moments::Fp32 {
                m: vec![0.0; len],
                v: vec![0.0; len],
            }
        } else {
            let zero = || Blockwise8 {
                codes: vec![0; len],
                absmax: vec![0.0; len.div_ceil(BLOCK)],
                block: BLOCK,
            };
            Moments::Int8 {
                m: zero(),
                v: zero(),
            }
        };
        ParamState { step: 0, moments }
    }

    /// One step on `p` with gradient `g`. A non-finite gradient is an error
    /// and leaves `p` and the state untouched.
    pub fn step(&self, state: &mut ParamState, p: &mut [f32], g: &[f32]) -> Result<(), QuantError> {
        check_len("the gradient", p.len(), g.len())?;
        check_len("the optimizer state", p.len(), state.len())?;
        check_finite("the gradient", g)?;
        state.step += 1;
        let t = state.step as i32;
        let c1 = 1.0 - self.beta1.powi(t);
        let c2 = (1.0 - self.beta2.powi(t)).sqrt();
        let update = |p: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32]| {
            for i in 0..p.len() {
                m[i] = m[i] * self.beta1 + (1.0 - self.beta1) * g[i];
                v[i] = v[i] * self.beta2 + (1.0 - self.beta2) * g[i] * g[i];
                if self.weight_decay > 0.0 {
                    p[i] *= 1.0 - self.lr * self.weight_decay;
                }
                p[i] -= self.lr / c1 * m[i] / (v[i].sqrt() / c2 + self.eps);
            }
        };
        match &mut state.moments {
            Moments::Fp32 { m, v } => update(p, g, m, v),
            Moments::Int8 { m, v } => {
                let (b1, b2) = (
                    Codebook::new(&DYNAMIC_SIGNED),
                    Codebook::new(&DYNAMIC_UNSIGNED),
                );
                let (mut mf, mut vf) = ([0.0f32; BLOCK], [0.0f32; BLOCK]);
                for (bi, (ps, gs)) in p.chunks_mut(BLOCK).zip(g.chunks(BLOCK)).enumerate() {
                    let r = bi * BLOCK..bi * BLOCK + ps.len();
                    let (mb, vb) = (&mut mf[..ps.len()], &mut vf[..ps.len()]);
                    b1.dequantize_block(&m.codes[r.clone()], m.absmax[bi], mb);
                    b2.dequantize_block(&v.codes[r.clone()], v.absmax[bi], vb);
                    update(ps, gs, mb, vb);
                    m.absmax[bi] = b1.quantize_block(mb, &mut m.codes[r.clone()]);
                    v.absmax[bi] = b2.quantize_block(vb, &mut v.codes[r]);
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Least squares `0.5 / m · |A x - b|²` with a dense pseudo-random
    /// `A [m, n]` (an LCG, uniform in [-1, 1)), `b = A x*`; `n` odd so the last
    /// block is short.
    struct Problem {
        a: Vec<f32>,
        b: Vec<f32>,
        m: usize,
    }

    impl Problem {
        fn new(m: usize, n: usize) -> Self {
            let mut seed = 0x2545_f491_u64;
            let mut rnd = move || {
                seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            };
            let a: Vec<f32> = (0..m * n).map(|_| rnd()).collect();
            let xs: Vec<f32> = (0..n).map(|_| rnd()).collect();
            let b = (0..m)
                .map(|r| (0..n).map(|c| a[r * n + c] * xs[c]).sum())
                .collect();
            Problem { a, b, m }
        }
        fn loss_grad(&self, x: &[f32]) -> (f64, Vec<f32>) {
            let n = x.len();
            let mut g = vec![0.0f32; n];
            let mut loss = 0.0f64;
            for r in 0..self.m {
                let row = &self.a[r * n..(r + 1) * n];
                let res: f32 = row.iter().zip(x).map(|(a, x)| a * x).sum::<f32>() - self.b[r];
                loss += 0.5 * (res * res) as f64 / self.m as f64;
                for (gi, ai) in g.iter_mut().zip(row) {
                    *gi += ai * res / self.m as f32;
                }
            }
            (loss, g)
        }
    }

    /// Plain fp32 Adam, written independently of the code under test.
    fn fp32_adam(o: &Adam8bit, x: &mut [f32], m: &mut [f32], v: &mut [f32], g: &[f32], t: i32) {
        for i in 0..x.len() {
            m[i] = o.beta1 * m[i] + (1.0 - o.beta1) * g[i];
            v[i] = o.beta2 * v[i] + (1.0 - o.beta2) * g[i] * g[i];
            let mh = m[i] / (1.0 - o.beta1.powi(t));
            let vh = v[i] / (1.0 - o.beta2.powi(t));
            x[i] *= 1.0 - o.lr * o.weight_decay;
            x[i] -= o.lr * mh / (vh.sqrt() + o.eps);
        }
    }

    /// 8-bit AdamW tracks fp32 AdamW: at each of 50 steps the two losses
    /// differ by less than 0.5% of the initial loss, and both fall more than
    /// 100x (measured: largest gap about 0.1 of an initial 293).
    #[test]
    fn adam8bit_tracks_fp32_adam() {
        let n = 4096 + 300;
        let pb = Problem::new(64, n);
        let o = Adam8bit::adamw(0.02, 0.01);
        let mut x8 = vec![0.0f32; n];
        let mut x32 = x8.clone();
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        let mut st = o.init(n);
        assert!(matches!(st.moments, Moments::Int8 { .. }));
        let (l0, _) = pb.loss_grad(&x8);
        let mut worst = 0.0f64;
        for t in 1..=50 {
            let (l8, g8) = pb.loss_grad(&x8);
            let (l32, g32) = pb.loss_grad(&x32);
            worst = worst.max((l8 - l32).abs() / l0);
            o.step(&mut st, &mut x8, &g8).unwrap();
            fp32_adam(&o, &mut x32, &mut m, &mut v, &g32, t);
        }
        let (l8, _) = pb.loss_grad(&x8);
        let (l32, _) = pb.loss_grad(&x32);
        assert!(worst < 0.005, "worst loss gap {worst} of the initial loss");
        assert!((l8 - l32).abs() / l0 < 0.005, "{l8} vs {l32}");
        assert!(l8 < l0 / 100.0 && l32 < l0 / 100.0, "{l0} -> {l8}, {l32}");
    }

    /// Below 4096 values the state is fp32 and the step is exactly fp32 Adam.
    #[test]
    fn small_parameters_keep_fp32_state() {
        let n = MIN_8BIT_SIZE - 1;
        let pb = Problem::new(8, n);
        let o = Adam8bit::adam(0.01);
        let mut st = o.init(n);
        assert!(matches!(st.moments, Moments::Fp32 { .. }));
        assert_eq!(st.bytes(), 8 * n);
        let (mut x, mut y) = (vec![0.0f32; n], vec![0.0f32; n]);
        let (mut m, mut v) = (vec![0.0; n], vec![0.0; n]);
        for t in 1..=5 {
            let (_, g) = pb.loss_grad(&x);
            o.step(&mut st, &mut x, &g).unwrap();
            let (_, g) = pb.loss_grad(&y);
            fp32_adam(&o, &mut y, &mut m, &mut v, &g, t);
        }
        for (a, b) in x.iter().zip(&y) {
            assert!((a - b).abs() <= 1e-6 * b.abs().max(1.0), "{a} vs {b}");
        }
    }

    /// State bytes are what the compiler's memory model charges.
    #[test]
    fn state_bytes_match_the_memory_model() {
        let o = Adam8bit::adam(1e-3);
        for n in [1, 4095, 4096, 4097, 10_000, 1 << 20] {
            assert_eq!(
                o.init(n).bytes() as u64,
                rcoa_compiler::memory::optimizer::adam8bit_state_bytes(n as u64),
                "n = {n}"
            );
        }
        assert_eq!(o.init(4096).bytes(), 2 * 4096 + 2 * 4 * 16);
    }

    #[test]
    fn bad_inputs_are_errors_and_change_nothing() {
        let o = Adam8bit::adam(0.1);
        let mut st = o.init(5000);
        let mut p = vec![1.0f32; 5000];
        let mut g = vec![0.5f32; 5000];
        g[4999] = f32::NAN;
        assert!(matches!(
            o.step(&mut st, &mut p, &g),
            Err(QuantError::NonFinite { index: 4999, .. })
        ));
        assert_eq!(st.step, 0);
        assert!(p.iter().all(|v| *v == 1.0));
        assert!(matches!(
            o.step(&mut st, &mut p, &g[..10]),
            Err(QuantError::Length { .. })
        ));
        assert!(matches!(
            o.step(&mut st, &mut p[..10], &g[..10]),
            Err(QuantError::Length { .. })
        ));
    }
}
