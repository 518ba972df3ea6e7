//! The LM head and cross-entropy, a chunk of tokens at a time, so the
//! `[tokens, vocab]` fp32 logits never exist whole: forward and backward
//! each hold one `[chunk, vocab]` block of logits (and its softmax and
//! gradient) at a time. Under autodiff it is one node that saves only its
//! inputs (hidden states, head weight, targets, weights) and recomputes each
//! chunk's logits in the backward, giving the gradients of the hidden states
//! and of the head weight. For a 128k vocabulary and 8k tokens that is a
//! 4 GiB fp32 logits tensor (plus its log-softmax and gradient) replaced by
//! `chunk × vocab`.
//!
//! Same objective as `loss::lm_loss` on full logits (the logits cast to fp32):
//! mean cross-entropy, or with weights `Σ w·nll / max(Σ w, 1)` (masked LM).

use crate::ops::{matmul_2d, ExecBackend};
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{FloatTensor, IntTensor};
use burn::tensor::{FloatDType, Int, Tensor, TensorPrimitive};

/// Tokens per chunk by default: 1024 × 128k vocabulary × 4 bytes = 512 MiB.
/// The `burn` profile's figure, so what runs is what was predicted.
pub const DEFAULT_CHUNK: usize = rcoa_compiler::memory::build::CHUNKED_LOSS_TOKENS as usize;

/// Why the chunked loss could not be computed.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum ChunkedLossError {
    #[error("chunked loss: {0}")]
    #[diagnostic(code(rcoa::chunked_loss))]
    Shape(String),
}

/// Cross-entropy of `hidden [b, s, d] · head [d, vocab]` against
/// `targets [b, s]` (with `weights [b, s]`, only weighted positions count),
/// `chunk` tokens of logits at a time.
pub fn chunked_lm_loss<B: ExecBackend>(
    hidden: Tensor<B, 3>,
    head: Tensor<B, 2>,
    targets: Tensor<B, 2, Int>,
    weights: Option<Tensor<B, 2>>,
    chunk: usize,
) -> Result<Tensor<B, 1>, ChunkedLossError> {
    let [b, s, d] = hidden.dims();
    let [hd, _] = head.dims();
    let bad = |m: String| Err(ChunkedLossError::Shape(m));
    if chunk == 0 {
        return bad("the chunk size must be at least one token".into());
    }
    if b * s == 0 {
        return bad("no tokens".into());
    }
    if hd != d {
        return bad(format!(
            "the head has {hd} input features, the hidden states {d}"
        ));
    }
    if targets.dims() != [b, s] {
        return bad(format!(
            "targets are {:?}, the hidden states [{b}, {s}, ..]",
            targets.dims()
        ));
    }
    if let Some(w) = &weights {
        if w.dims() != [b, s] {
            return bad(format!(
                "weights are {:?}, the hidden states [{b}, {s}, ..]",
                w.dims()
            ));
        }
    }
    let n = b * s;
    let y = B::chunked_lm_loss(
        hidden.reshape([n, d]).into_primitive().tensor(),
        head.into_primitive().tensor(),
        targets.reshape([n]).into_primitive(),
        weights.map(|w| w.reshape([n]).into_primitive().tensor()),
        chunk,
    );
    Ok(Tensor::from_primitive(TensorPrimitive::Float(y)))
}

fn float<B: Backend, const D: usize>(x: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// One chunk's fp32 logits and their row-wise log-sum-exp.
fn chunk_logits<B: ExecBackend>(
    h: &Tensor<B, 2>,
    w: &Tensor<B, 2>,
    start: usize,
    len: usize,
) -> (Tensor<B, 2>, Tensor<B, 2>) {
    let logits = matmul_2d(h.clone().narrow(0, start, len), w.clone()).cast(FloatDType::F32);
    let m = logits.clone().max_dim(1);
    let lse = (logits.clone() - m.clone()).exp().sum_dim(1).log() + m;
    (logits, lse)
}

/// The divisor: the token count, or `max(Σ w, 1)`.
fn count<B: Backend>(n: usize, weights: &Option<Tensor<B, 1>>, device: &B::Device) -> Tensor<B, 1> {
    match weights {
        None => Tensor::from_floats([n as f32], device),
        Some(w) => w.clone().cast(FloatDType::F32).sum().clamp_min(1.0),
    }
}

/// The loss, computed chunk by chunk; the second value is unused state kept
/// for symmetry with the backward.
pub(crate) fn forward<B: ExecBackend>(
    hidden: FloatTensor<B>,
    head: FloatTensor<B>,
    targets: IntTensor<B>,
    weights: Option<FloatTensor<B>>,
    chunk: usize,
) -> (FloatTensor<B>, ()) {
    let h: Tensor<B, 2> = float(hidden);
    let w: Tensor<B, 2> = float(head);
    let t = Tensor::<B, 1, Int>::from_primitive(targets);
    let wt: Option<Tensor<B, 1>> = weights.map(float);
    let n = h.dims()[0];
    let device = h.device();
    let mut total = Tensor::<B, 1>::zeros([1], &device);
    for start in (0..n).step_by(chunk) {
        let len = chunk.min(n - start);
        let (logits, lse) = chunk_logits(&h, &w, start, len);
        let picked = logits.gather(1, t.clone().narrow(0, start, len).reshape([len, 1]));
        let nll = (lse - picked).reshape([len]);
        total = total
            + match &wt {
                None => nll.sum(),
                Some(wt) => (nll * wt.clone().narrow(0, start, len).cast(FloatDType::F32)).sum(),
            };
    }
    let loss = total / count(n, &wt, &device);
    (loss.into_primitive().tensor(), ())
}

#[derive(Debug)]
struct ChunkedLmLoss;

impl<B: ExecBackend> Backward<B, 2> for ChunkedLmLoss {
    /// Hidden states, head weight, targets, weights, chunk.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        IntTensor<B>,
        Option<FloatTensor<B>>,
        usize,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 2>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_h, node_w] = ops.parents;
        let g: Tensor<B, 1> = float(grads.consume::<B>(&ops.node));
        let (hidden, head, targets, weights, chunk) = ops.state;
        let h: Tensor<B, 2> = float(hidden);
        let w: Tensor<B, 2> = float(head);
        let t = Tensor::<B, 1, Int>::from_primitive(targets);
        let wt: Option<Tensor<B, 1>> = weights.map(float);
        let [n, _] = h.dims();
        let vocab = w.dims()[1];
        let device = h.device();
        let factor = (g.cast(FloatDType::F32) / count(n, &wt, &device)).reshape([1, 1]);
        let classes = Tensor::<B, 1, Int>::arange(0..vocab as i64, &device).reshape([1, vocab]);
        let mut dh = Vec::new();
        let mut dw: Option<Tensor<B, 2>> = None;
        for start in (0..n).step_by(chunk) {
            let len = chunk.min(n - start);
            let (logits, lse) = chunk_logits(&h, &w, start, len);
            // d nll / d logits = softmax - onehot(target), times the row's weight.
            let onehot = t
                .clone()
                .narrow(0, start, len)
                .reshape([len, 1])
                .expand([len, vocab])
                .equal(classes.clone().expand([len, vocab]))
                .float();
            let mut row = factor.clone().expand([len, 1]);
            if let Some(wt) = &wt {
                row = row
                    * wt.clone()
                        .narrow(0, start, len)
                        .cast(FloatDType::F32)
                        .reshape([len, 1]);
            }
            let dlogits = (((logits - lse).exp() - onehot) * row).cast(h.dtype());
            if node_h.is_some() {
                dh.push(matmul_2d(dlogits.clone(), w.clone().transpose()));
            }
            if node_w.is_some() {
                let part = matmul_2d(h.clone().narrow(0, start, len).transpose(), dlogits);
                dw = Some(match dw {
                    None => part,
                    Some(acc) => acc + part,
                });
            }
        }
        if let Some(node) = node_h {
            grads.register::<B>(node.id, Tensor::cat(dh, 0).into_primitive().tensor());
        }
        if let (Some(node), Some(dw)) = (node_w, dw) {
            grads.register::<B>(node.id, dw.into_primitive().tensor());
        }
    }
}

/// [`ExecBackend::chunked_lm_loss`] under autodiff.
pub(crate) fn autodiff<B: ExecBackend, C: CheckpointStrategy>(
    hidden: FloatTensor<Autodiff<B, C>>,
    head: FloatTensor<Autodiff<B, C>>,
    targets: IntTensor<Autodiff<B, C>>,
    weights: Option<FloatTensor<Autodiff<B, C>>>,
    chunk: usize,
) -> FloatTensor<Autodiff<B, C>> {
    let weights: Option<FloatTensor<B>> = weights.map(|w| w.primitive);
    match ChunkedLmLoss
        .prepare::<C>([hidden.node.clone(), head.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let (y, ()) = forward::<B>(
                hidden.primitive.clone(),
                head.primitive.clone(),
                targets.clone(),
                weights.clone(),
                chunk,
            );
            prep.finish(
                (hidden.primitive, head.primitive, targets, weights, chunk),
                y,
            )
        }
        OpsKind::UnTracked(prep) => {
            prep.finish(forward::<B>(hidden.primitive, head.primitive, targets, weights, chunk).0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loss::lm_loss;
    use burn::tensor::{Distribution, Tolerance};

    type Cpu = Autodiff<burn::backend::NdArray<f32>>;

    /// Loss and the gradients of hidden states and head weight equal
    /// `lm_loss` on the full logits, for chunks that do and do not divide
    /// the token count, with and without masked-LM weights.
    #[test]
    fn chunked_loss_matches_full_logits() {
        // Burn's CPU generator is global: hold the trainers' lock while drawing.
        let _serial = crate::tests::serial();
        let device = Default::default();
        let (b, s, d, v) = (2, 7, 16, 50);
        let h0 = Tensor::<Cpu, 3>::random([b, s, d], Distribution::Normal(0.0, 1.0), &device);
        let w0 = Tensor::<Cpu, 2>::random([d, v], Distribution::Normal(0.0, 0.3), &device);
        let t =
            Tensor::<Cpu, 2, Int>::random([b, s], Distribution::Uniform(0.0, v as f64), &device);
        let mask = Tensor::<Cpu, 2>::random([b, s], Distribution::Bernoulli(0.4), &device);
        for weights in [None, Some(mask), Some(Tensor::zeros([b, s], &device))] {
            for chunk in [1, 3, 5, 14, 100] {
                let run = |chunked: bool| {
                    let h = h0.clone().require_grad();
                    let w = w0.clone().require_grad();
                    let loss = if chunked {
                        chunked_lm_loss(h.clone(), w.clone(), t.clone(), weights.clone(), chunk)
                            .unwrap()
                    } else {
                        lm_loss(
                            h.clone().matmul(w.clone().unsqueeze()),
                            t.clone(),
                            weights.clone(),
                        )
                    };
                    let g = loss.clone().mul_scalar(3.0).backward();
                    (
                        loss.inner().into_data(),
                        h.grad(&g).unwrap().into_data(),
                        w.grad(&g).unwrap().into_data(),
                    )
                };
                let (l1, dh1, dw1) = run(true);
                let (l2, dh2, dw2) = run(false);
                let tol = Tolerance::<f32>::absolute(1e-5);
                l1.assert_approx_eq(&l2, tol);
                dh1.assert_approx_eq(&dh2, tol);
                dw1.assert_approx_eq(&dw2, tol);
            }
        }
    }

    #[test]
    fn bad_shapes_are_errors() {
        let device = Default::default();
        let h = Tensor::<Cpu, 3>::zeros([1, 4, 8], &device);
        let w = Tensor::<Cpu, 2>::zeros([8, 10], &device);
        let t = Tensor::<Cpu, 2, Int>::zeros([1, 4], &device);
        let err = |r: Result<Tensor<Cpu, 1>, ChunkedLossError>| r.unwrap_err().to_string();
        assert!(
            err(chunked_lm_loss(h.clone(), w.clone(), t.clone(), None, 0)).contains("at least one")
        );
        assert!(err(chunked_lm_loss(
            h.clone(),
            Tensor::zeros([9, 10], &device),
            t.clone(),
            None,
            2
        ))
        .contains("9 input features"));
        assert!(err(chunked_lm_loss(
            h.clone(),
            w.clone(),
            Tensor::zeros([1, 3], &device),
            None,
            2
        ))
        .contains("targets"));
        assert!(err(chunked_lm_loss(
            h,
            w,
            t,
            Some(Tensor::zeros([2, 4], &device)),
            2
        ))
        .contains("weights"));
    }
}
