//! Fused attention as one autodiff node: the forward saves q, k, v, the
//! output and the log-sum-exp; the backward runs the backend's
//! `flash_attention_backward` (blocked plain ops, or the kernels). The
//! masks get no gradient.

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;

use super::blocked::FlashMask;
use super::dropout::FlashDropout;
use crate::ops::ExecBackend;

#[derive(Debug)]
struct FlashAttention;

impl<B: ExecBackend> Backward<B, 3> for FlashAttention {
    /// q, k, v, the output, the log-sum-exp, the masks and the scale.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        FlashMask<B>,
        f64,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let parents = ops.parents;
        let d_o = grads.consume::<B>(&ops.node);
        let (q, k, v, o, lse, mask, scale) = ops.state;
        let d = B::flash_attention_backward(q, k, v, o, lse, d_o, &mask, scale);
        for (node, grad) in parents.into_iter().zip(d) {
            if let Some(node) = node {
                grads.register::<B>(node.id, grad);
            }
        }
    }
}

/// An output and its log-sum-exp.
type OutLse<B> = (FloatTensor<B>, FloatTensor<B>);

/// `ExecBackend::flash_attention_forward` on `Autodiff<B, C>`: the output is
/// tracked, the log-sum-exp is returned as a constant.
pub fn forward<B: ExecBackend, C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    mask: &FlashMask<Autodiff<B, C>>,
    scale: f64,
) -> OutLse<Autodiff<B, C>> {
    let mask = FlashMask {
        causal: mask.causal,
        window: mask.window,
        key_bias: mask.key_bias.as_ref().map(|t| t.clone().inner()),
        documents: mask.documents.as_ref().map(|t| t.clone().inner()),
        dropout: mask.dropout.as_ref().map(|d| FlashDropout {
            p: d.p,
            seed: d.seed.clone().inner(),
        }),
    };
    let nodes = [q.node.clone(), k.node.clone(), v.node.clone()];
    match FlashAttention
        .prepare::<C>(nodes)
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (o, lse) = B::flash_attention_forward(
                q.primitive.clone(),
                k.primitive.clone(),
                v.primitive.clone(),
                &mask,
                scale,
            );
            let state = (
                q.primitive,
                k.primitive,
                v.primitive,
                o.clone(),
                lse.clone(),
                mask,
                scale,
            );
            (prep.finish(state, o), Autodiff::<B, C>::from_inner(lse))
        }
        OpsKind::UnTracked(prep) => {
            let (o, lse) =
                B::flash_attention_forward(q.primitive, k.primitive, v.primitive, &mask, scale);
            (prep.finish(o), Autodiff::<B, C>::from_inner(lse))
        }
    }
}
