//! Dynamic loss scaling for fp16, as PyTorch's `GradScaler` does it.
//!
//! fp16 holds magnitudes from 6e-8 (subnormal) to 65,504. The gradients of a
//! language model's activations are often smaller than the first: in fp16
//! they flush to zero and the weights stop learning. So the loss is
//! multiplied by a scale `S` (a power of two, 2^16 at the start) before the
//! backward, every gradient carries the factor, and it is divided out
//! before the optimizer reads them. Powers of two make both exact in fp32
//! and fp16 alike, short of overflow: a step trained with scaling equals one
//! without wherever neither underflows nor overflows (`tests/loss_scale.rs`).
//!
//! Where `S` is too large a gradient overflows to infinity. Then the step is
//! skipped (no weight or optimizer state changes, the step still counts, as
//! in PyTorch's loops) and `S` halves. After `GROWTH_INTERVAL` steps in a
//! row without an overflow `S` doubles, to find the largest scale that does
//! not overflow. Every rank decides alike: each checks its gradients after
//! the reduction (whole vectors are equal on every rank; a sharded step's
//! flags ride the loss's all-reduce), so ranks skip together and their
//! weights stay equal.
//!
//! bf16 has fp32's exponent range and needs none of this; fp32 neither.

use crate::train::Precision;
use crate::RunError;
use burn::module::{Module, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, FloatDType, Tensor};

/// PyTorch's `GradScaler` defaults (`init_scale`, `growth_factor`,
/// `backoff_factor`, `growth_interval`): runs compare with PyTorch's fp16.
pub const INITIAL_SCALE: f64 = 65536.0;
const GROWTH: f64 = 2.0;
const BACKOFF: f64 = 0.5;
pub const GROWTH_INTERVAL: u32 = 2000;
/// Below 1 the scale would shrink gradients that already overflow: the
/// overflow is the model's, not the scale's (DeepSpeed's `min_loss_scale`).
pub const MIN_SCALE: f64 = 1.0;

/// The scale and how many steps in a row stepped under it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LossScaler {
    scale: f64,
    /// Steps in a row without an overflow since the scale last changed.
    good_steps: u32,
    interval: u32,
}

/// What `LossScaler::update` decided for a step.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Outcome {
    /// The gradients were finite: the optimizer stepped.
    Stepped,
    /// A gradient overflowed: the step was skipped and the scale went from
    /// `from` to `to`.
    Skipped { from: f64, to: f64 },
}

impl Default for LossScaler {
    fn default() -> Self {
        LossScaler::new(INITIAL_SCALE, GROWTH_INTERVAL)
    }
}

impl LossScaler {
    pub fn new(scale: f64, interval: u32) -> Self {
        LossScaler {
            scale,
            good_steps: 0,
            interval: interval.max(1),
        }
    }

    /// A scaler where the run computes or stores anything in fp16.
    pub fn for_precision(p: &Precision) -> Option<Self> {
        (p.params == FloatDType::F16 || p.compute == FloatDType::F16).then(LossScaler::default)
    }

    /// The factor the loss is multiplied by before the backward.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Record whether this step's gradients were finite (`finite`, the same
    /// on every rank) and move the scale. An overflow at `MIN_SCALE` is an
    /// error: the gradients are not finite however small the scale.
    pub fn update(&mut self, finite: bool, step: u64) -> Result<Outcome, RunError> {
        if finite {
            self.good_steps += 1;
            if self.good_steps >= self.interval {
                self.scale *= GROWTH;
                self.good_steps = 0;
            }
            return Ok(Outcome::Stepped);
        }
        if self.scale <= MIN_SCALE {
            return Err(RunError::GradientsNotFinite {
                step,
                scale: self.scale,
            });
        }
        let from = self.scale;
        self.scale = (self.scale * BACKOFF).max(MIN_SCALE);
        self.good_steps = 0;
        Ok(Outcome::Skipped {
            from,
            to: self.scale,
        })
    }

    /// The state a checkpoint keeps, so that a resumed run scales as the
    /// uninterrupted one would.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "scale": self.scale, "good_steps": self.good_steps })
    }

    /// Restore `to_json`'s state; a checkpoint without one (written by a run
    /// without fp16, or before loss scaling) leaves the scaler as it is.
    pub fn load_json(&mut self, v: &serde_json::Value) -> Result<(), RunError> {
        if v.is_null() {
            return Ok(());
        }
        let bad = || RunError::Checkpoint(format!("state.json: bad loss_scale {v}"));
        let scale = v["scale"].as_f64().ok_or_else(bad)?;
        let good = v["good_steps"].as_u64().ok_or_else(bad)?;
        if !(scale.is_finite() && scale > 0.0) {
            return Err(bad());
        }
        self.scale = scale;
        self.good_steps = u32::try_from(good).map_err(|_| bad())?;
        Ok(())
    }
}

/// A one-element fp32 tensor that is finite exactly where every value of
/// `t` is. An fp32 `t` is summed: any infinity or NaN makes the sum
/// infinite or NaN, and a sum of finite values cannot overflow here, since
/// each came out of fp16 (at most 65,504, times the micro-batches and ranks
/// added into it): one reduction, and no tensor of `t`'s size beside it.
/// Other dtypes (an fp16 gradient, whose own sum could overflow) are
/// multiplied by 0 first: 0 for a finite value, NaN for any other.
pub fn finite_check<I: Backend, const D: usize>(t: &Tensor<I, D>) -> Tensor<I, 1> {
    if t.dtype() == burn::tensor::DType::F32 {
        t.clone().sum()
    } else {
        t.clone().mul_scalar(0.0).sum().cast(FloatDType::F32)
    }
}

/// Whether a `finite_check` (or a sum or mean of them) says finite: one read
/// of one value.
pub fn flag_finite<I: Backend>(flag: Tensor<I, 1>) -> bool {
    flag.into_scalar().elem::<f64>().is_finite()
}

/// `t`'s `finite_check` while fp16's loss is scaled (`unscale`, 1 / the scale);
/// nothing to check without.
pub fn scaled_check<I: Backend, const D: usize>(
    t: &Tensor<I, D>,
    unscale: Option<f64>,
) -> Option<Tensor<I, 1>> {
    unscale.map(|_| finite_check(t))
}

/// Whether the optimizer may step on a `scaled_check` (after any exchange of it
/// between the ranks): no check, or a finite one.
pub fn may_step<I: Backend>(check: Option<Tensor<I, 1>>) -> bool {
    check.is_none_or(flag_finite)
}

/// A host flag in `finite_check`'s terms: 0 or NaN.
pub fn host_flag<I: Backend>(finite: bool, device: &I::Device) -> Tensor<I, 1> {
    let v = if finite { 0.0 } else { f32::NAN };
    Tensor::from_data(burn::tensor::TensorData::new(vec![v], [1]), device)
}

/// One rank's gradients: whether every gradient of `model`'s parameters in `grads` is finite and,
/// where they all are, each divided by the scale (`inverse` = 1 / scale).
/// Where one is not, the optimizer skips the step and they are left as they
/// are.
pub fn unscale_grads<B: AutodiffBackend, M: Module<B>>(
    model: &M,
    grads: &mut GradientsParams,
    inverse: f64,
) -> bool {
    let mut check = Check::<B::InnerBackend> { grads, flag: None };
    model.visit(&mut check);
    if !may_step(check.flag) {
        return false;
    }
    model.visit(&mut Unscale { grads, inverse });
    true
}

struct Check<'a, I: Backend> {
    grads: &'a GradientsParams,
    flag: Option<Tensor<I, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Check<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            let f = finite_check(&g);
            self.flag = Some(match self.flag.take() {
                Some(acc) => acc + f,
                None => f,
            });
        }
    }
}

struct Unscale<'a> {
    grads: &'a mut GradientsParams,
    inverse: f64,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Unscale<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // Taken out and put back: on one rank (data parallelism unscales the
        // all-reduced vector instead, `Collective::mean_step`) the gradient is
        // the backward's own tensor, the only handle, so the multiply may reuse
        // its buffer rather than hold a second gradient-sized one.
        if let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) {
            self.grads
                .register::<B::InnerBackend, D>(param.id, g.mul_scalar(self.inverse));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::NdArray;
    use burn::tensor::TensorData;

    #[test]
    fn the_scale_halves_on_an_overflow_and_doubles_after_the_interval() {
        let mut s = LossScaler::new(1024.0, 3);
        assert_eq!(
            s.update(false, 1).unwrap(),
            Outcome::Skipped {
                from: 1024.0,
                to: 512.0
            }
        );
        assert_eq!(s.update(true, 2).unwrap(), Outcome::Stepped);
        assert_eq!(s.update(true, 3).unwrap(), Outcome::Stepped);
        assert_eq!(s.scale(), 512.0);
        s.update(true, 4).unwrap();
        assert_eq!(s.scale(), 1024.0, "three good steps in a row double it");
        // An overflow resets the count: two good, one bad, two good: no growth.
        s.update(true, 5).unwrap();
        s.update(true, 6).unwrap();
        s.update(false, 7).unwrap();
        s.update(true, 8).unwrap();
        s.update(true, 9).unwrap();
        assert_eq!(s.scale(), 512.0);
    }

    #[test]
    fn an_overflow_at_the_smallest_scale_is_an_error() {
        let mut s = LossScaler::new(2.0, 10);
        assert!(matches!(s.update(false, 1), Ok(Outcome::Skipped { to, .. }) if to == 1.0));
        let e = s.update(false, 2).unwrap_err();
        assert!(
            matches!(e, RunError::GradientsNotFinite { step: 2, .. }),
            "{e:?}"
        );
        assert!(e.to_string().contains("step 2"), "{e}");
    }

    #[test]
    fn only_fp16_is_scaled() {
        let p = |params, compute| Precision {
            params,
            compute,
            master: false,
        };
        assert!(LossScaler::for_precision(&p(FloatDType::F32, FloatDType::F16)).is_some());
        assert!(LossScaler::for_precision(&p(FloatDType::F16, FloatDType::F16)).is_some());
        assert!(LossScaler::for_precision(&p(FloatDType::BF16, FloatDType::BF16)).is_none());
        assert!(LossScaler::for_precision(&p(FloatDType::F32, FloatDType::F32)).is_none());
    }

    #[test]
    fn the_state_survives_a_checkpoint() {
        let mut s = LossScaler::new(4096.0, 5);
        s.update(true, 1).unwrap();
        s.update(true, 2).unwrap();
        let mut back = LossScaler::new(INITIAL_SCALE, 5);
        back.load_json(&s.to_json()).unwrap();
        assert_eq!(back, s);
        // A checkpoint without the field keeps the fresh state.
        let mut fresh = LossScaler::default();
        fresh.load_json(&serde_json::Value::Null).unwrap();
        assert_eq!(fresh, LossScaler::default());
        let bad = serde_json::json!({ "scale": -1.0, "good_steps": 0 });
        assert!(matches!(
            fresh.load_json(&bad),
            Err(RunError::Checkpoint(_))
        ));
        let bad = serde_json::json!({ "scale": 8.0 });
        assert!(matches!(
            fresh.load_json(&bad),
            Err(RunError::Checkpoint(_))
        ));
    }

    #[test]
    fn the_check_finds_infinities_and_nans() {
        let dev = Default::default();
        let t = |v: Vec<f32>| {
            let n = v.len();
            Tensor::<NdArray, 1>::from_data(TensorData::new(v, [n]), &dev)
        };
        assert!(flag_finite(finite_check(&t(vec![65504.0, -65504.0, 1e-8]))));
        assert!(!flag_finite(finite_check(&t(vec![1.0, f32::INFINITY]))));
        assert!(!flag_finite(finite_check(&t(vec![f32::NEG_INFINITY, 0.0]))));
        assert!(!flag_finite(finite_check(&t(vec![
            f32::INFINITY,
            f32::NEG_INFINITY
        ]))));
        assert!(!flag_finite(finite_check(&t(vec![f32::NAN]))));
        // fp64 takes the other branch, as fp16 does on CUDA (ndarray has no fp16).
        let d = |v: Vec<f64>| {
            let n = v.len();
            let t = Tensor::<NdArray, 1>::from_data(
                TensorData::new(v, [n]),
                (&dev, burn::tensor::DType::F64),
            );
            assert_eq!(t.dtype(), burn::tensor::DType::F64);
            t
        };
        assert!(flag_finite(finite_check(&d(vec![1e300, 1e300]))));
        assert!(!flag_finite(finite_check(&d(vec![1.0, f64::INFINITY]))));
        assert!(!flag_finite(finite_check(&d(vec![f64::NAN, 2.0]))));
        assert!(flag_finite(host_flag::<NdArray>(true, &dev)));
        assert!(!flag_finite(host_flag::<NdArray>(false, &dev)));
    }
}
