//! `optimizer adafactor` as a Burn [`SimpleOptimizer`]: transformers'
//! `Adafactor` (Shazeer & Stern, 2018) as Hugging Face's Trainer builds it
//! for `optim="adafactor"` (`scale_parameter=False, relative_step=False`):
//! the plan's `lr` is the step size, the second moment of a matrix is kept
//! factored (a mean per row and per column), and the update is clipped to
//! an RMS of `CLIP_THRESHOLD`.
//!
//! ```text
//! ρ  = 1 − t^DECAY_RATE                            t: the parameter's steps, from 1
//! u  = g² + EPS                                    EPS = 1e-30
//! R ← ρ·R + (1−ρ)·mean_cols(u)   C ← ρ·C + (1−ρ)·mean_rows(u)      a matrix
//! u  = g / √(R·C / mean(R))                         (vectors: V ← ρ·V + (1−ρ)·u, u = g / √V)
//! u /= max(1, rms(u) / CLIP_THRESHOLD);  u *= lr
//! m ← β₁·m + (1−β₁)·u;  u = m                       only with betas.0 > 0
//! p ← p − p·wd·lr − u
//! ```
//!
//! The plan's `betas.1` plays no part: the second moment's decay is
//! `DECAY_RATE`'s schedule, as transformers' (its `beta2` does not exist).
//! The factors are symmetric in rows and columns, so Burn's `[in, out]`
//! weights (transposed from torch's `[out, in]`) step alike.
//!
//! State and arithmetic are fp32 whatever the parameter's dtype: a 16-bit
//! parameter and its gradient are cast up first and the result cast back,
//! as transformers' `p.float()`, `p.copy_(p_data_fp32)`. The factors are
//! kept as `[.., rows, 1]` and `[.., 1, cols]`, so a parameter of any rank
//! broadcasts against them.
//!
//! Memory (the `burn` profile charges this: `memory::optimizer`): beside
//! the state, the step holds `u` and its square (for the RMS) at once, two
//! fp32 tensors of the parameter's size, when the gradient it was handed is
//! already consumed (`u = r ⊗ c · g`): one fp32 tensor net; and a 16-bit
//! parameter and gradient cast up in place of themselves.
//!
//! Only Burn's per-parameter path runs it: the factors are per matrix, which
//! a flat ZeRO shard would cut across, so `adafactor` runs with `zero = 0`
//! and nothing offloaded (`optim::Rule::for_plan` refuses the rest).

use burn::optim::SimpleOptimizer;
use burn::record::Record;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};

/// transformers' `eps[0]`, added to the squared gradient.
pub const EPS: f64 = 1e-30;
/// transformers' `clip_threshold`.
pub const CLIP_THRESHOLD: f64 = 1.0;
/// transformers' `decay_rate`: ρ_t = 1 − t^−0.8.
pub const DECAY_RATE: f64 = -0.8;

/// The hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdafactorOptimizer {
    /// `None`: no first moment (transformers' `beta1=None`).
    pub beta_1: Option<f64>,
    /// Decoupled: `p -= p · wd · lr`.
    pub weight_decay: f64,
}

/// One parameter's state, fp32.
#[derive(Record, Clone)]
pub struct AdafactorState<B: Backend, const D: usize> {
    /// Steps taken.
    pub step: usize,
    /// A matrix's factors: the mean of `u` over its columns (`[.., rows, 1]`)
    /// and over its rows (`[.., 1, cols]`).
    pub row: Option<Tensor<B, D>>,
    pub col: Option<Tensor<B, D>>,
    /// A vector's second moment, whole.
    pub full: Option<Tensor<B, D>>,
    /// The first moment, with `beta_1`.
    pub first: Option<Tensor<B, D>>,
}

impl<B: Backend> SimpleOptimizer<B> for AdafactorOptimizer {
    type State<const D: usize> = AdafactorState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let dtype = tensor.dtype();
        let p = tensor.cast(FloatDType::F32);
        let g = grad.cast(FloatDType::F32);
        let dims = p.dims();
        let device = p.device();
        let t = state.as_ref().map_or(0, |s| s.step) + 1;
        let rho = 1.0 - (t as f64).powf(DECAY_RATE);
        let zeros = |dims: [usize; D]| Tensor::<B, D>::zeros(dims, &device);
        let u = g.clone().powf_scalar(2.0).add_scalar(EPS);
        let (row, col, full, update) = if D >= 2 {
            let (rows, cols) = (D - 2, D - 1);
            let mut dims_r = dims;
            dims_r[cols] = 1;
            let mut dims_c = dims;
            dims_c[rows] = 1;
            let row0 = state.as_ref().and_then(|s| s.row.clone());
            let col0 = state.as_ref().and_then(|s| s.col.clone());
            let row = row0
                .unwrap_or_else(|| zeros(dims_r))
                .mul_scalar(rho)
                .add(u.clone().mean_dim(cols).mul_scalar(1.0 - rho));
            let col = col0
                .unwrap_or_else(|| zeros(dims_c))
                .mul_scalar(rho)
                .add(u.mean_dim(rows).mul_scalar(1.0 - rho));
            // transformers' `_approx_sq_grad`: (R / mean(R))^-½ ⊗ C^-½.
            let r = row.clone().div(row.clone().mean_dim(rows)).sqrt().recip();
            let c = col.clone().sqrt().recip();
            let update = r.mul(c).mul(g);
            (Some(row), Some(col), None, update)
        } else {
            let full0 = state.as_ref().and_then(|s| s.full.clone());
            let full = full0
                .unwrap_or_else(|| zeros(dims))
                .mul_scalar(rho)
                .add(u.mul_scalar(1.0 - rho));
            let update = full.clone().sqrt().recip().mul(g);
            (None, None, Some(full), update)
        };
        // u /= max(1, rms(u) / clip), on the device: no read-back per parameter.
        let rms = update
            .clone()
            .powf_scalar(2.0)
            .mean()
            .sqrt()
            .div_scalar(CLIP_THRESHOLD)
            .clamp_min(1.0)
            .reshape([1; D]);
        let update = update.div(rms).mul_scalar(lr);
        let (update, first) = match self.beta_1 {
            Some(b1) => {
                let m = match state.as_ref().and_then(|s| s.first.clone()) {
                    Some(m) => m.mul_scalar(b1).add(update.mul_scalar(1.0 - b1)),
                    None => update.mul_scalar(1.0 - b1),
                };
                (m.clone(), Some(m))
            }
            None => (update, None),
        };
        // p − p·wd·lr as one scaling: no second copy of the parameter.
        let p = if self.weight_decay == 0.0 {
            p
        } else {
            p.mul_scalar(1.0 - self.weight_decay * lr)
        };
        let p = p.sub(update).cast(dtype);
        let state = AdafactorState {
            step: t,
            row,
            col,
            full,
            first,
        };
        (p, Some(state))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        let to = |t: Option<Tensor<B, D>>| t.map(|t| t.to_device(device));
        AdafactorState {
            step: state.step,
            row: to(state.row),
            col: to(state.col),
            full: to(state.full),
            first: to(state.first),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    type B = burn::backend::NdArray<f32>;

    fn t2(v: &[f64], rows: usize, cols: usize) -> Tensor<B, 2> {
        let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
        Tensor::from_data(TensorData::new(v, [rows, cols]), &Default::default())
    }

    fn t1(v: &[f64]) -> Tensor<B, 1> {
        let v: Vec<f32> = v.iter().map(|&x| x as f32).collect();
        Tensor::from_data(TensorData::new(v.clone(), [v.len()]), &Default::default())
    }

    fn values<const D: usize>(t: Tensor<B, D>) -> Vec<f64> {
        t.into_data()
            .to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f64::from)
            .collect()
    }

    /// transformers' `Adafactor.step` for one parameter (`scale_parameter=False,
    /// relative_step=False`), in f64, on a `rows × cols` matrix (torch's layout) or,
    /// with `rows = 0`, a vector: the reference.
    struct Reference {
        rows: usize,
        cols: usize,
        beta_1: Option<f64>,
        wd: f64,
        t: u32,
        r: Vec<f64>,
        c: Vec<f64>,
        v: Vec<f64>,
        m: Vec<f64>,
    }

    impl Reference {
        fn new(rows: usize, cols: usize, beta_1: Option<f64>, wd: f64) -> Self {
            let n = rows.max(1) * cols;
            Reference {
                rows,
                cols,
                beta_1,
                wd,
                t: 0,
                r: vec![0.0; rows],
                c: vec![0.0; cols],
                v: vec![0.0; n],
                m: vec![0.0; n],
            }
        }

        fn step(&mut self, lr: f64, p: &mut [f64], g: &[f64]) {
            self.t += 1;
            let rho = 1.0 - (self.t as f64).powf(DECAY_RATE);
            let u: Vec<f64> = g.iter().map(|x| x * x + EPS).collect();
            let mut upd = vec![0.0; p.len()];
            if self.rows > 0 {
                let (rows, cols) = (self.rows, self.cols);
                for i in 0..rows {
                    let mean = (0..cols).map(|j| u[i * cols + j]).sum::<f64>() / cols as f64;
                    self.r[i] = rho * self.r[i] + (1.0 - rho) * mean;
                }
                for j in 0..cols {
                    let mean = (0..rows).map(|i| u[i * cols + j]).sum::<f64>() / rows as f64;
                    self.c[j] = rho * self.c[j] + (1.0 - rho) * mean;
                }
                let r_mean = self.r.iter().sum::<f64>() / rows as f64;
                for i in 0..rows {
                    for j in 0..cols {
                        let rf = (self.r[i] / r_mean).sqrt().recip();
                        let cf = self.c[j].sqrt().recip();
                        upd[i * cols + j] = rf * cf * g[i * cols + j];
                    }
                }
            } else {
                for k in 0..p.len() {
                    self.v[k] = rho * self.v[k] + (1.0 - rho) * u[k];
                    upd[k] = g[k] / self.v[k].sqrt();
                }
            }
            let rms = (upd.iter().map(|x| x * x).sum::<f64>() / upd.len() as f64).sqrt();
            let div = (rms / CLIP_THRESHOLD).max(1.0);
            for x in upd.iter_mut() {
                *x = *x / div * lr;
            }
            if let Some(b1) = self.beta_1 {
                for (m, u) in self.m.iter_mut().zip(upd.iter_mut()) {
                    *m = b1 * *m + (1.0 - b1) * *u;
                    *u = *m;
                }
            }
            for (x, u) in p.iter_mut().zip(&upd) {
                *x -= *x * self.wd * lr;
                *x -= u;
            }
        }
    }

    fn close(got: &[f64], want: &[f64], what: &str) {
        for (a, b) in got.iter().zip(want) {
            assert!(
                (a - b).abs() <= 1e-5 * b.abs().max(1e-3),
                "{what}: {got:?} vs {want:?}"
            );
        }
    }

    #[test]
    fn steps_follow_transformers_adafactor() {
        let grads = [
            vec![0.5, -0.25, 0.0, 1e-3, 2.0, -1.5],
            vec![-0.5, 0.25, 0.125, 3.0, -0.1, 0.7],
            vec![0.1, 0.3, -0.2, -4.0, 0.05, 0.9],
        ];
        let p0 = [1.0, -2.0, 0.5, 0.0, 0.25, -0.75];
        for (beta_1, wd) in [(None, 0.0), (Some(0.9), 0.01)] {
            let o = AdafactorOptimizer {
                beta_1,
                weight_decay: wd,
            };
            let lr = 1e-2;
            // A matrix, factored: Burn holds torch's [2, 3] as its transpose [3, 2].
            let mut reference = Reference::new(2, 3, beta_1, wd);
            let mut pr = p0.to_vec();
            let transpose = |v: &[f64]| -> Vec<f64> {
                (0..3)
                    .flat_map(|j| (0..2).map(move |i| v[i * 3 + j]))
                    .collect()
            };
            let mut p = t2(&transpose(&p0), 3, 2);
            let mut state = None;
            for g in &grads {
                let (np, ns) =
                    SimpleOptimizer::<B>::step(&o, lr, p, t2(&transpose(g), 3, 2), state);
                p = np;
                state = ns;
                reference.step(lr, &mut pr, g);
                close(&values(p.clone()), &transpose(&pr), "matrix");
            }
            let s = state.unwrap();
            assert_eq!(s.step, 3);
            assert_eq!(s.row.unwrap().dims(), [3, 1]);
            assert_eq!(s.col.unwrap().dims(), [1, 2]);
            assert!(s.full.is_none());
            assert_eq!(s.first.is_some(), beta_1.is_some());

            // A vector: the second moment whole.
            let mut reference = Reference::new(0, 6, beta_1, wd);
            let mut pr = p0.to_vec();
            let mut p = t1(&p0);
            let mut state = None;
            for g in &grads {
                let (np, ns) = SimpleOptimizer::<B>::step(&o, lr, p, t1(g), state);
                p = np;
                state = ns;
                reference.step(lr, &mut pr, g);
                close(&values(p.clone()), &pr, "vector");
            }
            assert!(state.unwrap().full.is_some());
        }
    }

    /// A large gradient moves each value by about `lr` at most: the update is clipped to an
    /// RMS of 1 (the first step's, ρ₁ = 0, is ±1 · lr per value before the clip).
    #[test]
    fn the_update_is_clipped_to_an_rms_of_one() {
        let o = AdafactorOptimizer {
            beta_1: None,
            weight_decay: 0.0,
        };
        let g = [1e6, -3e5, 7e4, 1.0];
        let (p, _) = SimpleOptimizer::<B>::step(&o, 0.1, t1(&[0.0; 4]), t1(&g), None);
        let p = values(p);
        let rms = (p.iter().map(|x| x * x).sum::<f64>() / 4.0).sqrt();
        assert!((rms - 0.1).abs() < 1e-6, "{p:?}");
    }
}
