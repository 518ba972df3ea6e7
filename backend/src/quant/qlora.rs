//! The QLoRA base projection `y = x · dequant(W)` as one autodiff node whose
//! only saved state is the packed NF4 weight (codes and scales, which the
//! layer holds anyway): the backward dequantizes again for
//! `dx = dy · dequant(W)ᵀ`, and `W` is frozen, so it gets no gradient and no
//! fp32 copy of it outlives the forward or the backward.
//!
//! The executor calls [`nf4_linear`]; the LoRA path (`x · A · B`) is ordinary
//! Burn ops beside it. `W` is `[d_in, d_out]`, Burn's `Linear` layout
//! (bitsandbytes quantizes PyTorch's `[d_out, d_in]`: the blocks run along the
//! other axis, which changes nothing but the bytes' order).

use super::nf4::{DeviceScales, Nf4Tensor};
use crate::ops::ExecBackend;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

/// `x · dequant(W)` for `x [.., d_in]`.
pub fn nf4_linear<B: ExecBackend, const D: usize>(
    x: Tensor<B, D>,
    w: &Nf4Tensor<B>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let rows: usize = dims[..D - 1].iter().product();
    let x2 = x.reshape([rows, dims[D - 1]]);
    let y = B::nf4_matmul(x2.into_primitive().tensor(), w);
    let mut out = dims;
    out[D - 1] = w.shape[1];
    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).reshape(out)
}

/// The plain computation: dequantize in the input's dtype, multiply.
pub(crate) fn nf4_matmul_plain<B: Backend>(x: FloatTensor<B>, w: &Nf4Tensor<B>) -> FloatTensor<B> {
    let x = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let wt = w.dequantize().cast(x.dtype());
    x.matmul(wt).into_primitive().tensor()
}

impl<B: AutodiffBackend> Nf4Tensor<B> {
    /// The same packed weight on the inner backend (no copy).
    pub fn inner(&self) -> Nf4Tensor<B::InnerBackend> {
        let scales = match &self.scales {
            DeviceScales::Fp32(a) => DeviceScales::Fp32(a.clone().inner()),
            DeviceScales::Double {
                codes,
                absmax2,
                offset,
            } => DeviceScales::Double {
                codes: codes.clone().inner(),
                absmax2: absmax2.clone().inner(),
                offset: *offset,
            },
        };
        Nf4Tensor {
            packed: self.packed.clone().inner(),
            scales,
            shape: self.shape,
        }
    }

    /// The packed weight of the inner backend on this one (no copy).
    pub fn from_inner(w: Nf4Tensor<B::InnerBackend>) -> Self {
        let scales = match w.scales {
            DeviceScales::Fp32(a) => DeviceScales::Fp32(Tensor::from_inner(a)),
            DeviceScales::Double {
                codes,
                absmax2,
                offset,
            } => DeviceScales::Double {
                codes: Tensor::from_inner(codes),
                absmax2: Tensor::from_inner(absmax2),
                offset,
            },
        };
        Nf4Tensor {
            packed: Tensor::from_inner(w.packed),
            scales,
            shape: w.shape,
        }
    }
}

#[derive(Debug)]
struct Nf4Matmul;

impl<B: Backend> Backward<B, 1> for Nf4Matmul {
    /// The packed weight: dequantized again in the backward.
    type State = Nf4Tensor<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let w = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |dy| {
            let dy = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(dy));
            let wt = w.dequantize().cast(dy.dtype()).transpose();
            dy.matmul(wt).into_primitive().tensor()
        });
    }
}

/// [`ExecBackend::nf4_matmul`] under autodiff.
pub(crate) fn nf4_matmul_autodiff<B: ExecBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w: &Nf4Tensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let w = w.inner();
    match Nf4Matmul
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = B::nf4_matmul(x.primitive, &w);
            prep.finish(w, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::nf4_matmul(x.primitive, &w)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::nf4::Nf4Weight;
    use crate::quant::tests::det_weights;
    use burn::tensor::{Distribution, Tolerance};

    type Cpu = Autodiff<burn::backend::NdArray<f32>>;

    /// Forward equals `x · dequant(W)` with the dequantized weight as a plain
    /// tensor; dx equals that matmul's gradient; nothing of W is trainable.
    #[test]
    fn nf4_linear_matches_dequantized_matmul() {
        // Burn's CPU generator is global: hold the trainers' lock while drawing.
        let _serial = crate::tests::serial();
        let device = Default::default();
        for double in [false, true] {
            let (din, dout) = (96, 40);
            let w =
                Nf4Weight::quantize(&det_weights(din * dout, 0.002), [din, dout], double).unwrap();
            let wd = w.to_device::<Cpu>(&device).unwrap();
            let dense = Tensor::<Cpu, 1>::from_floats(w.dequantize().unwrap().as_slice(), &device)
                .reshape([din, dout]);
            let x0 = Tensor::<Cpu, 3>::random([2, 5, din], Distribution::Normal(0.0, 1.0), &device);
            let up =
                Tensor::<Cpu, 3>::random([2, 5, dout], Distribution::Normal(0.0, 1.0), &device);

            let x = x0.clone().require_grad();
            let y = nf4_linear(x.clone(), &wd);
            let grads = (y.clone() * up.clone()).sum().backward();
            let dx = x.grad(&grads).expect("x has a gradient");
            if let crate::quant::nf4::DeviceScales::Fp32(a) = &wd.scales {
                assert!(a.grad(&grads).is_none(), "the scales are frozen");
            }

            let xr = x0.require_grad();
            let dense = dense.require_grad();
            let yr = xr.clone().matmul(dense.clone().unsqueeze::<3>());
            let gr = (yr.clone() * up).sum().backward();
            let tol = Tolerance::<f32>::absolute(1e-5);
            y.inner()
                .into_data()
                .assert_approx_eq(&yr.inner().into_data(), tol);
            dx.into_data()
                .assert_approx_eq(&xr.grad(&gr).unwrap().into_data(), tol);
        }
    }

    /// Without a tracked input nothing is recorded and the value is the same.
    #[test]
    fn untracked_input_gives_the_same_value() {
        // Burn's CPU generator is global: hold the trainers' lock while drawing.
        let _serial = crate::tests::serial();
        let device = Default::default();
        let w = Nf4Weight::quantize(&det_weights(64 * 8, 0.01), [64, 8], false).unwrap();
        let wd = w.to_device::<Cpu>(&device).unwrap();
        let x = Tensor::<Cpu, 2>::random([3, 64], Distribution::Default, &device);
        let a = nf4_linear(x.clone(), &wd);
        let b = nf4_linear(x.require_grad(), &wd);
        a.into_data()
            .assert_approx_eq(&b.inner().into_data(), Tolerance::<f32>::absolute(0.0));
    }
}
