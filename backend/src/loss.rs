//! The training objectives of `DSL.md` (`train.loss`), computed in fp32
//! whatever the compute dtype (as Hugging Face upcasts logits).
//!
//! - causal LM: mean next-token cross-entropy over every position;
//! - masked LM: cross-entropy over the masked positions only;
//! - contrastive: InfoNCE on L2-normalised mean-pooled embeddings, either
//!   in-batch pairs (rows 2i and 2i+1 are a pair, the other pairs are the
//!   negatives) or explicit groups `[anchor, positives.., negatives..]` with
//!   the multi-positive loss `-log(sum_pos e^s / sum_all e^s)`.

use burn::tensor::activation;
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor};

/// Temperature of the contrastive softmax (sentence-transformers uses 0.05;
/// the plan language has no key for another).
pub const TAU: f64 = 0.05;

/// How a contrastive batch is laid out.
#[derive(Clone, Copy, Debug)]
pub struct ContrastiveLayout {
    /// Rows per anchor (1 + positives + negatives); 2 for in-batch pairs.
    pub group: usize,
    pub positives: usize,
    /// True when `group` rows belong to each anchor (explicit positives/negatives).
    pub grouped: bool,
}

/// Cross-entropy of `logits [b, s, v]` against `targets [b, s]`; with
/// `weights [b, s]`, only weighted positions count (masked LM).
pub fn lm_loss<B: Backend>(
    logits: Tensor<B, 3>,
    targets: Tensor<B, 2, Int>,
    weights: Option<Tensor<B, 2>>,
) -> Tensor<B, 1> {
    let logp = activation::log_softmax(logits.cast(FloatDType::F32), 2);
    let nll = logp
        .gather(2, targets.unsqueeze_dim::<3>(2))
        .squeeze_dim::<2>(2)
        .neg();
    match weights {
        None => nll.mean(),
        Some(w) => {
            let count = w.clone().sum().clamp_min(1.0);
            (nll * w).sum() / count
        }
    }
}

/// `log(sum(exp(x)))` along dim 1 of `[n, k]`, stable.
fn logsumexp<B: Backend>(x: Tensor<B, 2>) -> Tensor<B, 1> {
    let m = x.clone().max_dim(1).detach();
    let s = (x - m.clone()).exp().sum_dim(1).log() + m;
    s.squeeze_dim::<1>(1)
}

/// InfoNCE on mean-pooled embeddings of `hidden [rows, s, d]` at
/// temperature `tau`; with `mask [rows, s]` (1 for real tokens, 0 for
/// padding) the mean runs over real tokens only, as sentence-transformers
/// pools with the attention mask.
pub fn contrastive_loss<B: Backend>(
    hidden: Tensor<B, 3>,
    layout: ContrastiveLayout,
    mask: Option<Tensor<B, 2>>,
    tau: f64,
) -> Tensor<B, 1> {
    let [rows, _, d] = hidden.dims();
    let hidden = hidden.cast(FloatDType::F32);
    let emb = match mask {
        None => hidden.mean_dim(1).squeeze_dim::<2>(1),
        Some(m) => {
            // A row with no real token (shape padding) divides by 1, not 0:
            // its zero embedding is scored by nothing.
            let count = m.clone().sum_dim(1).clamp_min(1.0);
            let m = m.cast(FloatDType::F32).unsqueeze_dim::<3>(2);
            (hidden * m).sum_dim(1).squeeze_dim::<2>(1) / count
        }
    };
    let norm = emb.clone().powi_scalar(2).sum_dim(1).sqrt().clamp_min(1e-6);
    let emb = emb / norm;
    if layout.grouped {
        let g = layout.group;
        let n = rows / g;
        let e = emb.reshape([n, g, d]);
        let anchor = e.clone().narrow(1, 0, 1);
        let cands = e.narrow(1, 1, g - 1);
        let sims = (cands * anchor)
            .sum_dim(2)
            .squeeze_dim::<2>(2)
            .div_scalar(tau);
        let all = logsumexp(sims.clone());
        let pos = logsumexp(sims.narrow(1, 0, layout.positives.max(1)));
        (all - pos).mean()
    } else {
        let n = rows / 2;
        let e = emb.narrow(0, 0, 2 * n).reshape([n, 2, d]);
        let a = e.clone().narrow(1, 0, 1).reshape([n, d]);
        let p = e.narrow(1, 1, 1).reshape([n, d]);
        let sims = a.clone().matmul(p.clone().transpose()).div_scalar(tau);
        let diag = (a * p).sum_dim(1).squeeze_dim::<1>(1).div_scalar(tau);
        (logsumexp(sims) - diag).mean()
    }
}
