//! `ExecBackend::matmul_2d` as one autodiff node: Burn's own matmul node,
//! whose backward runs its two products (`dy · wᵀ`, `xᵀ · dy`) through the
//! inner backend's `matmul_2d` too, so on CUDA they reach cuBLAS with the
//! transposes as flags (`layout`). It saves what Burn's node saves (x only
//! when w is trainable, w only when x is), so the memory model is the same.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{binary, Backward, Ops, OpsKind};
use burn::backend::autodiff::{Autodiff, NodeId};
use burn::tensor::ops::FloatTensor;

use crate::ops::ExecBackend;

#[derive(Debug)]
struct Matmul2d;

impl<B: ExecBackend> Backward<B, 2> for Matmul2d {
    /// The saved x (for w's gradient) and w (for x's).
    type State = (Option<NodeId>, Option<NodeId>);

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        checkpointer: &mut Checkpointer,
    ) {
        let (x, w) = ops.state;
        let x: Option<FloatTensor<B>> = x.map(|x| checkpointer.retrieve_node_output(x));
        let w: Option<FloatTensor<B>> = w.map(|w| checkpointer.retrieve_node_output(w));
        binary::<B, _, _>(
            ops.parents,
            ops.node,
            grads,
            |dy| B::matmul_2d(dy, B::float_transpose(w.expect("w saved for x's gradient"))),
            |dy| B::matmul_2d(B::float_transpose(x.expect("x saved for w's gradient")), dy),
        );
    }
}

/// [`ExecBackend::matmul_2d`] on `Autodiff<B, C>`.
pub fn matmul_2d<B: ExecBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w: FloatTensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let (x_tracked, w_tracked) = (x.is_tracked(), w.is_tracked());
    match Matmul2d
        .prepare::<C>([x.node.clone(), w.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(mut prep) => {
            let x_state = w_tracked.then(|| prep.checkpoint(&x));
            let w_state = x_tracked.then(|| prep.checkpoint(&w));
            prep.finish((x_state, w_state), B::matmul_2d(x.primitive, w.primitive))
        }
        OpsKind::UnTracked(prep) => prep.finish(B::matmul_2d(x.primitive, w.primitive)),
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Tensor, TensorData};

    type A = Autodiff<NdArray<f32>>;

    fn matrix(rows: usize, cols: usize, seed: usize) -> Tensor<A, 2> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| (((i * 7 + seed * 13) % 17) as f32 - 8.0) / 8.0)
            .collect();
        Tensor::from_data(TensorData::new(v, [rows, cols]), &Default::default())
    }

    fn close(a: Tensor<A, 2>, b: Tensor<A, 2>, what: &str) {
        let (a, b) = (
            a.into_data().to_vec::<f32>().unwrap(),
            b.into_data().to_vec::<f32>().unwrap(),
        );
        for (i, (x, y)) in a.iter().zip(&b).enumerate() {
            assert!(
                (x - y).abs() <= 1e-5 * (1.0 + y.abs()),
                "{what}[{i}]: {x} against {y}"
            );
        }
    }

    /// Gradients of `Σ c ∘ (x · w)` through `matmul_2d` and through Burn's
    /// matmul, with each operand trainable or not.
    #[test]
    fn gradients_equal_burns_matmul_whichever_operand_trains() {
        for (x_trains, w_trains) in [(true, true), (true, false), (false, true)] {
            let run = |ours: bool| {
                let x = matrix(5, 3, 1).set_require_grad(x_trains);
                let w = matrix(3, 4, 2).set_require_grad(w_trains);
                let y = if ours {
                    crate::ops::matmul_2d(x.clone(), w.clone())
                } else {
                    x.clone().matmul(w.clone())
                };
                let grads = (y.clone() * matrix(5, 4, 3)).sum().backward();
                let grad = |t: &Tensor<A, 2>| t.grad(&grads).map(Tensor::<A, 2>::from_inner);
                (y, grad(&x), grad(&w))
            };
            let ((y, dx, dw), (y0, dx0, dw0)) = (run(true), run(false));
            close(y, y0, "y");
            assert_eq!(dx.is_some(), x_trains, "x's gradient");
            assert_eq!(dw.is_some(), w_trains, "w's gradient");
            if let (Some(a), Some(b)) = (dx, dx0) {
                close(a, b, "dx");
            }
            if let (Some(a), Some(b)) = (dw, dw0) {
                close(a, b, "dw");
            }
        }
    }
}
