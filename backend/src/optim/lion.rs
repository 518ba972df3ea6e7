//! `optimizer lion` as a Burn [`SimpleOptimizer`]: the update of Chen et
//! al., "Symbolic Discovery of Optimization Algorithms" (2023), as
//! lion-pytorch's `Lion` (the reference the compiler's `pytorch` profile
//! models) writes it:
//!
//! ```text
//! p ← p · (1 − lr · wd)                       decoupled weight decay
//! p ← p − lr · sign(β₁ · m + (1 − β₁) · g)    the update: ±lr per value
//! m ← β₂ · m + (1 − β₂) · g                   one moment, zero at the start
//! ```
//!
//! Unlike lion-pytorch, a NaN or infinite `β₁ · m + (1 − β₁) · g` makes the
//! updated value NaN (`sign(d) + d · 0`): a step that went non-finite shows
//! in the loss and stops the run, where `sign` alone would hide it.
//!
//! One state tensor per parameter, in the parameter's dtype, half of
//! Adam's. The flat optimizer of ZeRO and the host (`Rule::Lion`) runs the
//! same operations in the same order, so a sharded run ends with the same
//! weights as one rank (tested as for Adam).
//!
//! Memory: the step holds `β₁ · m` and `(1 − β₁) · g` at once before it adds
//! them, two temporaries of the parameter's size, as Burn's Adam does when it
//! updates a moment; the `burn` profile charges two (`memory::optimizer`).

use burn::optim::SimpleOptimizer;
use burn::record::Record;
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;

/// The hyper-parameters.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LionOptimizer {
    pub beta_1: f32,
    pub beta_2: f32,
    /// Decoupled: `p *= 1 − lr · wd` (in f64, as Burn's AdamW computes it).
    pub weight_decay: f32,
}

/// One parameter's momentum.
#[derive(Record, Clone)]
pub struct LionState<B: Backend, const D: usize> {
    pub momentum: Tensor<B, D>,
}

impl LionOptimizer {
    /// `decayed` with `lr`'s step of `grad` taken and the momentum `m`
    /// (`None`: zero) moved: what `SimpleOptimizer::step` and the flat
    /// optimizer's device step both compute, in this order.
    pub(crate) fn update<B: Backend, const D: usize>(
        &self,
        lr: f64,
        param: Tensor<B, D>,
        grad: Tensor<B, D>,
        m: Option<Tensor<B, D>>,
    ) -> (Tensor<B, D>, Tensor<B, D>) {
        let (b1, b2) = (self.beta_1, self.beta_2);
        let decay_rate = lr * (self.weight_decay as f64);
        let decayed = if decay_rate == 0.0 {
            param
        } else {
            param.mul_scalar(1.0 - decay_rate)
        };
        let direction = match &m {
            Some(m) => m
                .clone()
                .mul_scalar(b1)
                .add(grad.clone().mul_scalar(1.0 - b1)),
            None => grad.clone().mul_scalar(1.0 - b1),
        };
        // `+ d·0` carries a NaN or infinite direction into the weights, where the next loss
        // shows it and the run stops: `sign` alone gives 0 for NaN in CubeCL and ±1 in
        // ndarray, so a NaN gradient would stall (or drift) those values silently.
        // `d·0` is taken before `sign` consumes `d`, so the step still holds two
        // temporaries of the parameter's size.
        let poison = direction.clone().mul_scalar(0.0);
        let param = decayed - direction.sign().add(poison).mul_scalar(lr);
        let m = match m {
            Some(m) => m.mul_scalar(b2).add(grad.mul_scalar(1.0 - b2)),
            None => grad.mul_scalar(1.0 - b2),
        };
        (param, m)
    }
}

impl<B: Backend> SimpleOptimizer<B> for LionOptimizer {
    type State<const D: usize> = LionState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        let (param, momentum) = self.update(lr, tensor, grad, state.map(|s| s.momentum));
        (param, Some(LionState { momentum }))
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        LionState {
            momentum: state.momentum.to_device(device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    type B = burn::backend::NdArray<f32>;

    fn t(v: &[f32]) -> Tensor<B, 1> {
        Tensor::from_data(TensorData::new(v.to_vec(), [v.len()]), &Default::default())
    }

    fn v(t: Tensor<B, 1>) -> Vec<f32> {
        t.into_data().to_vec().unwrap()
    }

    /// lion-pytorch's `update_fn`, element by element in f64: the reference.
    fn reference(o: &LionOptimizer, lr: f64, p: &mut [f64], g: &[f64], m: &mut [f64]) {
        let (b1, b2, wd) = (o.beta_1 as f64, o.beta_2 as f64, o.weight_decay as f64);
        for i in 0..p.len() {
            p[i] *= 1.0 - lr * wd;
            let c = b1 * m[i] + (1.0 - b1) * g[i];
            let s = if c > 0.0 {
                1.0
            } else if c < 0.0 {
                -1.0
            } else {
                0.0
            };
            p[i] -= lr * s;
            m[i] = b2 * m[i] + (1.0 - b2) * g[i];
        }
    }

    #[test]
    fn three_steps_follow_lion_pytorch() {
        let o = LionOptimizer {
            beta_1: 0.9,
            beta_2: 0.99,
            weight_decay: 0.1,
        };
        let lr = 1e-2;
        let grads = [
            vec![0.5f32, -0.25, 0.0, 1e-6],
            vec![-0.5, -0.25, 0.125, 2.0],
            vec![0.1, 0.3, -0.2, -4.0],
        ];
        let mut p = t(&[1.0, -2.0, 0.5, 0.0]);
        let mut state: Option<LionState<B, 1>> = None;
        let mut pr = vec![1.0f64, -2.0, 0.5, 0.0];
        let mut mr = vec![0.0f64; 4];
        for g in &grads {
            let (np, ns) = SimpleOptimizer::<B>::step(&o, lr, p, t(g), state);
            p = np;
            state = ns;
            let g64: Vec<f64> = g.iter().map(|&x| x as f64).collect();
            reference(&o, lr, &mut pr, &g64, &mut mr);
            let got = v(p.clone());
            for (a, b) in got.iter().zip(&pr) {
                assert!((*a as f64 - b).abs() < 1e-6, "{got:?} vs {pr:?}");
            }
            let m = v(state.clone().unwrap().momentum);
            for (a, b) in m.iter().zip(&mr) {
                assert!((*a as f64 - b).abs() < 1e-6, "{m:?} vs {mr:?}");
            }
        }
        // A zero gradient at the start moves nothing but the decay: sign(0) = 0.
        let (p0, _) = SimpleOptimizer::<B>::step(&o, lr, t(&[1.0]), t(&[0.0]), None);
        assert_eq!(v(p0), vec![(1.0 - lr * 0.1) as f32]);
    }

    #[test]
    fn a_non_finite_direction_poisons_its_value_and_no_other() {
        let o = LionOptimizer {
            beta_1: 0.9,
            beta_2: 0.99,
            weight_decay: 0.0,
        };
        let g = t(&[f32::NAN, f32::INFINITY, -0.5, f32::NEG_INFINITY]);
        let (p, s) = SimpleOptimizer::<B>::step(&o, 0.1, t(&[1.0; 4]), g, None);
        let p = v(p);
        assert!(p[0].is_nan() && p[1].is_nan() && p[3].is_nan(), "{p:?}");
        assert_eq!(p[2], 1.1);
        // A NaN momentum from an earlier step poisons the next one's value, even under a
        // finite gradient (ndarray's `sign(NaN)` is ±1, CubeCL's 0).
        let mut s = s.unwrap();
        s.momentum = t(&[f32::NAN, 0.0, 0.0, 0.0]);
        let (p, _) = SimpleOptimizer::<B>::step(&o, 0.1, t(&[1.0; 4]), t(&[1.0; 4]), Some(s));
        let p = v(p);
        assert!(p[0].is_nan(), "{p:?}");
        assert!(p[1..].iter().all(|x| (x - 0.9).abs() < 1e-7), "{p:?}");
    }
}
