//! `ExecBackend::rope` as one autodiff node whose state is the two tables (constants the
//! context holds for the whole run anyway), not `x`: the backward is the inner backend's
//! rotation of `dy` by minus the angle. The composition it replaces kept the same: its
//! products saved only the (untracked) tables.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::tensor::ops::{FloatTensor, IntTensor};

use crate::ops::ExecBackend;

#[derive(Debug)]
struct Rope {
    inverse: bool,
}

impl<B: ExecBackend> Backward<B, 1> for Rope {
    /// The cosines, the signed sines, the partial rotation's swap and the positions' axis.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        Option<IntTensor<B>>,
        super::SeqAxis,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let (cos, sin, swap, seq_axis) = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |dy| {
            B::rope(dy, cos, sin, swap, seq_axis, !self.inverse)
        });
    }
}

/// [`ExecBackend::rope`] on `Autodiff<B, C>`. Only `x` gets a gradient: the tables must be
/// constants (untracked), as the model's are.
pub fn rope<B: ExecBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    cos: FloatTensor<Autodiff<B, C>>,
    sin: FloatTensor<Autodiff<B, C>>,
    swap: Option<IntTensor<B>>,
    seq_axis: super::SeqAxis,
    inverse: bool,
) -> FloatTensor<Autodiff<B, C>> {
    assert!(
        cos.node.requirement.is_none() && sin.node.requirement.is_none(),
        "RoPE's tables are constants: the rotation gives them no gradient"
    );
    let (cos, sin) = (cos.primitive, sin.primitive);
    match (Rope { inverse })
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => prep.finish(
            (cos.clone(), sin.clone(), swap.clone(), seq_axis),
            B::rope(x.primitive, cos, sin, swap, seq_axis, inverse),
        ),
        OpsKind::UnTracked(prep) => {
            prep.finish(B::rope(x.primitive, cos, sin, swap, seq_axis, inverse))
        }
    }
}

#[cfg(test)]
mod tests {
    use burn::backend::NdArray;

    /// On the CPU the node's forward and backward are the composition's (its default), so
    /// value and gradient equal Burn's autodiff through the flip, in both axes and both
    /// directions.
    #[test]
    fn gradients_equal_the_compositions() {
        super::super::checks::equals_composition::<NdArray<f32>>(&Default::default(), 0.0);
    }
}
