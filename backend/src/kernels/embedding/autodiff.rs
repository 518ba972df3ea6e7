//! `ExecBackend::embedding_lookup` as one autodiff node: Burn's own embedding node (it keeps the
//! same state: the table, which is a parameter and alive anyway, and the token ids), whose
//! backward is the inner backend's `embedding_grad`.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::tensor::ops::{FloatTensor, IntTensor};

use crate::ops::ExecBackend;

#[derive(Debug)]
struct Embedding;

impl<B: ExecBackend> Backward<B, 1> for Embedding {
    /// The table (for its shape, type and device) and the token ids.
    type State = (FloatTensor<B>, IntTensor<B>);

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let (table, ids) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |dy| {
            B::embedding_grad(table, dy, ids)
        });
    }
}

/// [`ExecBackend::embedding_lookup`] on `Autodiff<B, C>`.
pub fn embedding<B: ExecBackend, C: CheckpointStrategy>(
    table: FloatTensor<Autodiff<B, C>>,
    ids: IntTensor<B>,
) -> FloatTensor<Autodiff<B, C>> {
    match Embedding
        .prepare::<C>([table.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (table.primitive.clone(), ids.clone()),
            B::embedding(table.primitive, ids),
        ),
        OpsKind::UnTracked(prep) => prep.finish(B::embedding(table.primitive, ids)),
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::{Autodiff, NdArray};
    use burn::tensor::{Int, Tensor, TensorData};

    type A = Autodiff<NdArray<f32>>;

    /// The table's gradient through `ops::embedding` equals Burn's, repeated ids summed;
    /// a frozen table gets none.
    #[test]
    fn gradients_equal_burns_embedding() {
        let device = Default::default();
        let ids = Tensor::<A, 2, Int>::from_data(
            TensorData::new(vec![3i64, 0, 3, 5, 3, 1], [2, 3]),
            &device,
        );
        let table = |trains: bool| {
            let v: Vec<f32> = (0..6 * 4).map(|i| (i % 7) as f32 - 3.0).collect();
            Tensor::<A, 2>::from_data(TensorData::new(v, [6, 4]), &device).set_require_grad(trains)
        };
        let up = Tensor::<A, 3>::from_data(
            TensorData::new(
                (0..24).map(|i| i as f32 * 0.25).collect::<Vec<_>>(),
                [2, 3, 4],
            ),
            &device,
        );
        for trains in [true, false] {
            let (ours, theirs) = (table(trains), table(trains));
            let y = crate::ops::embedding(ours.clone(), ids.clone());
            let y0 = burn::tensor::module::embedding(theirs.clone(), ids.clone());
            assert_eq!(y.clone().into_data(), y0.clone().into_data());
            let g = (y * up.clone()).sum().backward();
            let g0 = (y0 * up.clone()).sum().backward();
            match (ours.grad(&g), theirs.grad(&g0)) {
                (Some(a), Some(b)) => {
                    assert!(trains);
                    assert_eq!(a.into_data(), b.into_data());
                }
                (None, None) => assert!(!trains),
                _ => panic!("one table got a gradient and the other did not"),
            }
        }
    }
}
