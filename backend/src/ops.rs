//! Operations the executor needs with a cheaper backward than Burn's composite
//! versions.
//!
//! Burn 0.21's `softmax` is composite (max, sub, exp, sum, div), so under
//! autodiff its backward walks five nodes and the tape keeps the shifted scores
//! and the `exp` output besides the probabilities: three `[b, h, s, s]`
//! tensors per attention layer. [`ExecBackend::softmax_last`] is one autodiff
//! node whose backward needs only its output,
//! `dx = y * (dy - sum(y * dy))`, so attention keeps one such tensor (the
//! probabilities, which `probs · v` saves anyway) and the backward is four
//! element-wise/reduce kernels instead of about eight.
//!
//! The memory model mirrors this (`compiler/src/memory/build.rs`,
//! `burn_attention`); change both together.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::{ActivationOps, FloatTensor};
use burn::tensor::{Tensor, TensorPrimitive};

/// A backend the executor runs on: Burn's ops plus the ones above.
pub trait ExecBackend: Backend {
    /// Softmax over the last dimension of a `rank`-dimensional tensor. On a
    /// backend without autodiff this is Burn's softmax.
    fn softmax_last(x: FloatTensor<Self>, rank: usize) -> FloatTensor<Self> {
        Self::softmax(x, rank - 1)
    }
}

/// An autodiff backend whose inner backend is an [`ExecBackend`] too (the
/// trainer runs checkpointed layers on the inner backend).
pub trait ExecAutodiff: AutodiffBackend<InnerBackend: ExecBackend> + ExecBackend {}

impl<B> ExecAutodiff for B where B: AutodiffBackend<InnerBackend: ExecBackend> + ExecBackend {}

impl ExecBackend for burn::backend::NdArray<f32> {}

#[cfg(feature = "cuda")]
impl ExecBackend for burn::backend::Cuda<f32> {}

/// Benchmarks only: `RCOA_COMPOSITE_SOFTMAX=1` runs Burn's composite softmax
/// under autodiff instead, so one binary can time both (docs/burn-h100.md).
fn composite_softmax() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("RCOA_COMPOSITE_SOFTMAX").is_some_and(|v| v == "1"))
}

impl<B: ExecBackend, C: CheckpointStrategy> ExecBackend for Autodiff<B, C> {
    fn softmax_last(x: FloatTensor<Self>, rank: usize) -> FloatTensor<Self> {
        #[derive(Debug)]
        struct SoftmaxLast;

        impl<B: Backend> Backward<B, 1> for SoftmaxLast {
            /// The output and the reduced dimension.
            type State = (FloatTensor<B>, usize);

            fn backward(
                self,
                ops: Ops<Self::State, 1>,
                grads: &mut Gradients,
                _checkpointer: &mut Checkpointer,
            ) {
                let (y, dim) = ops.state;
                unary::<B, _>(ops.parents, ops.node, grads, |dy| {
                    let y_dy = B::float_mul(y.clone(), dy);
                    let sum = B::float_sum_dim(y_dy.clone(), dim);
                    B::float_sub(y_dy, B::float_mul(y, sum))
                });
            }
        }

        let dim = rank - 1;
        if composite_softmax() {
            return Self::softmax(x, dim);
        }
        match SoftmaxLast
            .prepare::<C>([x.node.clone()])
            .compute_bound()
            .stateful()
        {
            OpsKind::Tracked(prep) => {
                let y = B::softmax_last(x.primitive, rank);
                prep.finish((y.clone(), dim), y)
            }
            OpsKind::UnTracked(prep) => prep.finish(B::softmax_last(x.primitive, rank)),
        }
    }
}

/// Softmax over the last dimension ([`ExecBackend::softmax_last`]).
pub fn softmax_last<B: ExecBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let y = B::softmax_last(x.into_primitive().tensor(), D);
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::{activation, Distribution, Tolerance};

    type Cpu = Autodiff<burn::backend::NdArray<f32>>;

    /// Value and gradient equal Burn's composite softmax, for an upstream
    /// gradient that is not all ones (a sum of the outputs has zero gradient).
    #[test]
    fn softmax_last_matches_composite_value_and_gradient() {
        let device = Default::default();
        let x0 = Tensor::<Cpu, 4>::random([2, 3, 5, 7], Distribution::Normal(0.0, 3.0), &device);
        let w = Tensor::<Cpu, 4>::random([2, 3, 5, 7], Distribution::Normal(0.0, 1.0), &device);
        let run = |custom: bool| {
            let x = x0.clone().detach().require_grad();
            let y = if custom {
                softmax_last(x.clone())
            } else {
                activation::softmax(x.clone(), 3)
            };
            let grads = (y.clone() * w.clone()).sum().backward();
            (y.inner(), x.grad(&grads).expect("x has a gradient"))
        };
        let (y_custom, g_custom) = run(true);
        let (y_ref, g_ref) = run(false);
        let tol = Tolerance::<f32>::absolute(1e-6);
        y_custom
            .into_data()
            .assert_approx_eq(&y_ref.into_data(), tol);
        g_custom
            .into_data()
            .assert_approx_eq(&g_ref.into_data(), tol);
    }

    /// Rows sum to one and a row of equal scores is uniform: the stable shift
    /// keeps large scores finite.
    #[test]
    fn softmax_last_is_stable_for_large_scores() {
        let device = Default::default();
        let x = Tensor::<Cpu, 2>::from_floats([[1.0e4, 1.0e4], [-1.0e9, 0.0]], &device);
        let y: Vec<f32> = softmax_last(x).into_data().to_vec().unwrap();
        assert_eq!(y, vec![0.5, 0.5, 0.0, 1.0]);
    }
}
