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
use burn::tensor::ops::{ActivationOps, BoolTensor, FloatTensor, IntTensor};
use burn::tensor::{Bool, Int, Tensor, TensorPrimitive};

use crate::kernels::flash::{self, blocked::FlashMask};
use crate::quant::nf4::Nf4Tensor;

/// A backend the executor runs on: Burn's ops plus the ones above.
pub trait ExecBackend: Backend {
    /// Softmax over the last dimension of a `rank`-dimensional tensor. On a
    /// backend without autodiff this is Burn's softmax.
    fn softmax_last(x: FloatTensor<Self>, rank: usize) -> FloatTensor<Self> {
        Self::softmax(x, rank - 1)
    }

    /// `x [n, d_in] · dequant(W)` for a packed NF4 `W [d_in, d_out]`
    /// (`quant::qlora`); under autodiff it saves only the packed weight.
    fn nf4_matmul(x: FloatTensor<Self>, w: &Nf4Tensor<Self>) -> FloatTensor<Self> {
        crate::quant::qlora::nf4_matmul_plain::<Self>(x, w)
    }

    /// `dropout(softmax(q kᵀ · scale + Σ bias)) · v` for `q [b, h, s, d]`,
    /// `k, v [b, h, t, d]` and biases broadcastable to `[b, h, s, t]`
    /// ([`attention_core`]); under autodiff it saves q, k, v, the biases and
    /// the dropout mask, and recomputes the scores in its backward.
    fn attention_core(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: Vec<FloatTensor<Self>>,
        dropout: Option<AttentionDropout<Self>>,
        scale: f64,
    ) -> FloatTensor<Self> {
        attention_plain::<Self>(q, k, v, &bias, dropout.as_ref(), scale)
    }

    /// Fused attention's forward ([`flash_attention`]): the output
    /// `[b, h, s, d]` and the per-row log-sum-exp `[b, h, s]` of
    /// `softmax(q kᵀ · scale + masks) v`, for `q [b, h, s, d]` and `k, v
    /// [b, kv_heads, t, d]` (grouped-query without repeating k, v), never
    /// materialising `[b, h, s, t]`. The default is the query-blocked plain
    /// path (`kernels::flash::blocked`); a backend with a kernel overrides it.
    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: &FlashMask<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        let (o, lse) = flash::blocked::forward(float4(q), float4(k), float4(v), mask, scale);
        (o.into_primitive().tensor(), lse.into_primitive().tensor())
    }

    /// Fused attention's backward: dq, dk, dv from the forward's inputs,
    /// output `o`, log-sum-exp `lse` and the output's gradient `d_o`
    /// (FlashAttention-2: the probabilities are recomputed block by block).
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        o: FloatTensor<Self>,
        lse: FloatTensor<Self>,
        d_o: FloatTensor<Self>,
        mask: &FlashMask<Self>,
        scale: f64,
    ) -> [FloatTensor<Self>; 3] {
        let lse = Tensor::<Self, 3>::from_primitive(TensorPrimitive::Float(lse));
        let (dq, dk, dv) = flash::blocked::backward(
            float4(q),
            float4(k),
            float4(v),
            float4(o),
            lse,
            float4(d_o),
            mask,
            scale,
        );
        [dq, dk, dv].map(|t| t.into_primitive().tensor())
    }

    /// `x [n, k] · w [k, m]`: the linear layers' and the head's products.
    /// Burn's matmul; on CUDA, cuBLAS when `RCOA_MATMUL=cublas`
    /// (`kernels::gemm`). Under autodiff the backward's two products run
    /// through it too.
    fn matmul_2d(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        Self::float_matmul(x, w)
    }

    /// `table [vocab, d]`'s rows for `ids [b, s]`: `[b, s, d]` (Burn's embedding). Under
    /// autodiff its backward is [`ExecBackend::embedding_grad`] (`kernels::embedding`).
    fn embedding_lookup(table: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        Self::embedding(table, ids)
    }

    /// The table's gradient: each token's `dy [b, s, d]` row added into row `ids [b, s]` of
    /// a zero `[vocab, d]` (the shape, type and device of `table`). Burn's `select_assign`;
    /// on the fused CubeCL backends a kernel parallel over buckets of ids as well as columns.
    fn embedding_grad(
        table: FloatTensor<Self>,
        dy: FloatTensor<Self>,
        ids: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        Self::embedding_backward(table, dy, ids)
    }

    /// RoPE on the heads of `x [b, .., .., d]` whose positions are on axis `seq_axis`
    /// (`[b, s, h, d]` or `[b, h, s, d]`): each pair `(i, i + d/2)` rotated by its position's
    /// angle, with the cosines `cos [s, d/2]` and signed sines `sin [s, d]` (`[-s, s]`) of
    /// `model::RopeTables`, or part of each head with `swap` (tables `[s, d]` each);
    /// `inverse` rotates by minus the angle (the backward). Burn's ops
    /// (`kernels::rope::rotate_plain`); on the fused CubeCL backends one kernel for whole
    /// heads, whose output is contiguous in `x`'s shape. Under autodiff it saves only the
    /// tables (and `swap`), which get no gradient.
    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        swap: Option<IntTensor<Self>>,
        seq_axis: crate::kernels::rope::SeqAxis,
        inverse: bool,
    ) -> FloatTensor<Self> {
        crate::kernels::rope::rotate_plain::<Self>(x, cos, sin, swap, seq_axis, inverse)
    }

    /// Mean (or `weights`-weighted) cross-entropy of `hidden [n, d] · head
    /// [d, vocab]` against `targets [n]`, `chunk` rows of logits at a time
    /// (`loss_chunked`); under autodiff it saves the inputs only.
    fn chunked_lm_loss(
        hidden: FloatTensor<Self>,
        head: FloatTensor<Self>,
        targets: IntTensor<Self>,
        weights: Option<FloatTensor<Self>>,
        chunk: usize,
    ) -> FloatTensor<Self> {
        crate::loss_chunked::forward::<Self>(hidden, head, targets, weights, chunk).0
    }
}

/// An autodiff backend whose inner backend is an [`ExecBackend`] too (the
/// trainer runs checkpointed layers on the inner backend).
pub trait ExecAutodiff: AutodiffBackend<InnerBackend: ExecBackend> + ExecBackend {}

impl<B> ExecAutodiff for B where B: AutodiffBackend<InnerBackend: ExecBackend> + ExecBackend {}

impl ExecBackend for burn::backend::NdArray<f32> {}

/// The fused CubeCL backends (each with its runtime and bool element) run the flash kernels
/// (`kernels::flash::fused`), the embedding gradient's (`kernels::embedding::fused`) and
/// RoPE's (`kernels::rope::fused`); the rest is Burn's. CUDA for `rcoa run`; Wgpu so the
/// tests run the same glue on lavapipe.
#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
macro_rules! fused_cube_exec_backend {
    ($backend:ty, $runtime:ty, $bool:ty $(, $more:item)*) => {
        impl ExecBackend for $backend {
            $($more)*

            fn flash_attention_forward(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                mask: &FlashMask<Self>,
                scale: f64,
            ) -> (FloatTensor<Self>, FloatTensor<Self>) {
                flash::fused::forward(q, k, v, mask, scale)
            }

            fn embedding_grad(
                table: FloatTensor<Self>,
                dy: FloatTensor<Self>,
                ids: IntTensor<Self>,
            ) -> FloatTensor<Self> {
                crate::kernels::embedding::fused::embedding_grad::<$runtime, $bool>(table, dy, ids)
            }

            fn rope(
                x: FloatTensor<Self>,
                cos: FloatTensor<Self>,
                sin: FloatTensor<Self>,
                swap: Option<IntTensor<Self>>,
                seq_axis: crate::kernels::rope::SeqAxis,
                inverse: bool,
            ) -> FloatTensor<Self> {
                if swap.is_some() || crate::kernels::rope::composite_asked() {
                    return crate::kernels::rope::rotate_plain::<Self>(
                        x, cos, sin, swap, seq_axis, inverse,
                    );
                }
                crate::kernels::rope::fused::rope::<$runtime, $bool>(x, cos, sin, seq_axis, inverse)
            }

            fn flash_attention_backward(
                q: FloatTensor<Self>,
                k: FloatTensor<Self>,
                v: FloatTensor<Self>,
                o: FloatTensor<Self>,
                lse: FloatTensor<Self>,
                d_o: FloatTensor<Self>,
                mask: &FlashMask<Self>,
                scale: f64,
            ) -> [FloatTensor<Self>; 3] {
                flash::fused::backward(q, k, v, o, lse, d_o, mask, scale)
            }
        }
    };
}

#[cfg(feature = "cuda")]
fused_cube_exec_backend!(
    burn::backend::Cuda<f32>,
    cubecl::cuda::CudaRuntime,
    u8,
    fn matmul_2d(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::kernels::gemm::fused::matmul_2d(x, w)
    }
);
#[cfg(feature = "wgpu-kernels")]
fused_cube_exec_backend!(burn::backend::Wgpu<f32>, cubecl::wgpu::WgpuRuntime, u32);

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

    fn nf4_matmul(x: FloatTensor<Self>, w: &Nf4Tensor<Self>) -> FloatTensor<Self> {
        crate::quant::qlora::nf4_matmul_autodiff::<B, C>(x, w)
    }

    fn attention_core(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        bias: Vec<FloatTensor<Self>>,
        dropout: Option<AttentionDropout<Self>>,
        scale: f64,
    ) -> FloatTensor<Self> {
        attention_autodiff::<B, C>(q, k, v, bias, dropout, scale)
    }

    fn flash_attention_forward(
        q: FloatTensor<Self>,
        k: FloatTensor<Self>,
        v: FloatTensor<Self>,
        mask: &FlashMask<Self>,
        scale: f64,
    ) -> (FloatTensor<Self>, FloatTensor<Self>) {
        crate::kernels::flash::autodiff::forward::<B, C>(q, k, v, mask, scale)
    }

    fn matmul_2d(x: FloatTensor<Self>, w: FloatTensor<Self>) -> FloatTensor<Self> {
        crate::kernels::gemm::autodiff::matmul_2d::<B, C>(x, w)
    }

    fn embedding_lookup(table: FloatTensor<Self>, ids: IntTensor<Self>) -> FloatTensor<Self> {
        crate::kernels::embedding::autodiff::embedding::<B, C>(table, ids)
    }

    fn rope(
        x: FloatTensor<Self>,
        cos: FloatTensor<Self>,
        sin: FloatTensor<Self>,
        swap: Option<IntTensor<Self>>,
        seq_axis: crate::kernels::rope::SeqAxis,
        inverse: bool,
    ) -> FloatTensor<Self> {
        crate::kernels::rope::autodiff::rope::<B, C>(x, cos, sin, swap, seq_axis, inverse)
    }

    fn chunked_lm_loss(
        hidden: FloatTensor<Self>,
        head: FloatTensor<Self>,
        targets: IntTensor<Self>,
        weights: Option<FloatTensor<Self>>,
        chunk: usize,
    ) -> FloatTensor<Self> {
        crate::loss_chunked::autodiff::<B, C>(hidden, head, targets, weights, chunk)
    }
}

/// `x [n, k] · w [k, m]` ([`ExecBackend::matmul_2d`]).
pub fn matmul_2d<B: ExecBackend>(x: Tensor<B, 2>, w: Tensor<B, 2>) -> Tensor<B, 2> {
    let y = B::matmul_2d(x.into_primitive().tensor(), w.into_primitive().tensor());
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// `table [vocab, d]`'s rows for `ids [b, s]` ([`ExecBackend::embedding_lookup`]).
pub fn embedding<B: ExecBackend>(table: Tensor<B, 2>, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
    let y = B::embedding_lookup(table.into_primitive().tensor(), ids.into_primitive());
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// `x` with each head rotated by RoPE's tables ([`ExecBackend::rope`]; `swap` for part of
/// each head), its positions on axis `seq_axis`.
pub fn rope<B: ExecBackend>(
    x: Tensor<B, 4>,
    cos: &Tensor<B, 2>,
    sin: &Tensor<B, 2>,
    swap: Option<&Tensor<B, 1, Int>>,
    seq_axis: crate::kernels::rope::SeqAxis,
) -> Tensor<B, 4> {
    let prim = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
    let y = B::rope(
        x.into_primitive().tensor(),
        prim(cos),
        prim(sin),
        swap.map(|s| s.clone().into_primitive()),
        seq_axis,
        false,
    );
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// Softmax over the last dimension ([`ExecBackend::softmax_last`]).
pub fn softmax_last<B: ExecBackend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let y = B::softmax_last(x.into_primitive().tensor(), D);
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// Fused attention, `softmax(q kᵀ · scale + masks) · v` with `q [b, h, s,
/// d]`, `k, v [b, kv_heads, t, d]`: no `[b, h, s, t]` tensor is kept or
/// (on a kernel backend) made, and k, v are not repeated for grouped-query
/// attention. Under autodiff it saves q, k, v, the output and the
/// log-sum-exp (`kernels::flash`, `docs/flash-attention.md`).
pub fn flash_attention<B: ExecBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    mask: &FlashMask<B>,
    scale: f64,
) -> Tensor<B, 4> {
    let prim = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let (o, _lse) = B::flash_attention_forward(prim(q), prim(k), prim(v), mask, scale);
    float4::<B>(o)
}

// ------------------------------------------------- selective recomputation

/// The attention core, `dropout(softmax(q kᵀ · scale + Σ bias)) · v`, as one
/// autodiff node: Megatron's selective recomputation. It saves q, k, v, the
/// biases (which the surrounding projections' backward holds anyway) and
/// the dropout mask (1 byte a score; Megatron keeps the generator's state
/// instead, which Burn's global generator cannot give back), and recomputes
/// the `[b, h, s, t]` scores and probabilities in its backward, so a layer
/// keeps no quadratic tensor in the compute dtype between its forward and
/// backward. The biases (causal and key-padding masks) get no gradient.
/// Grouped-query callers repeat k and v to `h` heads first, as the model
/// does today.
pub fn attention_core<B: ExecBackend>(
    q: Tensor<B, 4>,
    k: Tensor<B, 4>,
    v: Tensor<B, 4>,
    bias: &[Tensor<B, 4>],
    dropout: Option<(Tensor<B, 4, Bool>, f64)>,
    scale: f64,
) -> Tensor<B, 4> {
    let prim = |t: Tensor<B, 4>| t.into_primitive().tensor();
    let bias = bias.iter().map(|b| prim(b.clone())).collect();
    let dropout = dropout.map(|(dropped, p)| AttentionDropout {
        dropped: dropped.into_primitive(),
        p,
    });
    let y = B::attention_core(prim(q), prim(k), prim(v), bias, dropout, scale);
    Tensor::from_primitive(TensorPrimitive::Float(y))
}

/// Dropout of the attention core's probabilities: `dropped [b, h, s, t]`
/// is true where a probability is dropped; the others are scaled by
/// `1 / (1 − p)`.
#[derive(Clone, Debug)]
pub struct AttentionDropout<B: Backend> {
    pub dropped: BoolTensor<B>,
    pub p: f64,
}

impl<B: Backend> AttentionDropout<B> {
    fn apply(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let dropped = Tensor::<B, 4, Bool>::from_primitive(self.dropped.clone());
        apply_dropout(x, dropped, self.p)
    }
}

/// `x` with the entries `dropped` marks zeroed and the rest scaled by
/// `1 / (1 − p)`: every dropout of the executor. Under autodiff `mask_fill`
/// saves only its 1-byte mask; `x * keep` would save the keep factors in x's
/// dtype (2 or 4 bytes an element), where the memory model charges the
/// mask's byte as PyTorch keeps it.
pub fn apply_dropout<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    dropped: Tensor<B, D, Bool>,
    p: f64,
) -> Tensor<B, D> {
    x.mask_fill(dropped, 0.0).mul_scalar(1.0 / (1.0 - p))
}

fn float4<B: Backend>(x: FloatTensor<B>) -> Tensor<B, 4> {
    Tensor::from_primitive(TensorPrimitive::Float(x))
}

/// The probabilities `softmax(q kᵀ · scale + Σ bias)`.
fn attention_probs<B: ExecBackend>(
    q: &FloatTensor<B>,
    k: &FloatTensor<B>,
    bias: &[FloatTensor<B>],
    scale: f64,
) -> Tensor<B, 4> {
    let mut s = float4::<B>(q.clone())
        .mul_scalar(scale)
        .matmul(float4::<B>(k.clone()).swap_dims(2, 3));
    for b in bias {
        s = s + float4::<B>(b.clone());
    }
    softmax_last(s)
}

fn attention_plain<B: ExecBackend>(
    q: FloatTensor<B>,
    k: FloatTensor<B>,
    v: FloatTensor<B>,
    bias: &[FloatTensor<B>],
    dropout: Option<&AttentionDropout<B>>,
    scale: f64,
) -> FloatTensor<B> {
    let p = attention_probs::<B>(&q, &k, bias, scale);
    let p = match dropout {
        Some(d) => d.apply(p),
        None => p,
    };
    p.matmul(float4::<B>(v)).into_primitive().tensor()
}

#[derive(Debug)]
struct AttentionCore;

impl<B: ExecBackend> Backward<B, 3> for AttentionCore {
    /// q, k, v, the biases, the dropout and the scale.
    type State = (
        FloatTensor<B>,
        FloatTensor<B>,
        FloatTensor<B>,
        Vec<FloatTensor<B>>,
        Option<AttentionDropout<B>>,
        f64,
    );

    fn backward(
        self,
        ops: Ops<Self::State, 3>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let [node_q, node_k, node_v] = ops.parents;
        let dy = float4::<B>(grads.consume::<B>(&ops.node));
        let (q, k, v, bias, dropout, scale) = ops.state;
        let p = attention_probs::<B>(&q, &k, &bias, scale);
        let drop = |x: Tensor<B, 4>| match &dropout {
            Some(d) => d.apply(x),
            None => x,
        };
        if let Some(node) = node_v {
            let dv = drop(p.clone()).swap_dims(2, 3).matmul(dy.clone());
            grads.register::<B>(node.id, dv.into_primitive().tensor());
        }
        if node_q.is_none() && node_k.is_none() {
            return;
        }
        // Dropout's backward, then the softmax's on the recomputed
        // probabilities, then the scores'.
        let dp = drop(dy.matmul(float4::<B>(v).swap_dims(2, 3)));
        let ds = p.clone() * (dp.clone() - (p.clone() * dp).sum_dim(3));
        let ds = ds.mul_scalar(scale);
        if let Some(node) = node_q {
            let dq = ds.clone().matmul(float4::<B>(k));
            grads.register::<B>(node.id, dq.into_primitive().tensor());
        }
        if let Some(node) = node_k {
            let dk = ds.swap_dims(2, 3).matmul(float4::<B>(q));
            grads.register::<B>(node.id, dk.into_primitive().tensor());
        }
    }
}

fn attention_autodiff<B: ExecBackend, C: CheckpointStrategy>(
    q: FloatTensor<Autodiff<B, C>>,
    k: FloatTensor<Autodiff<B, C>>,
    v: FloatTensor<Autodiff<B, C>>,
    bias: Vec<FloatTensor<Autodiff<B, C>>>,
    dropout: Option<AttentionDropout<Autodiff<B, C>>>,
    scale: f64,
) -> FloatTensor<Autodiff<B, C>> {
    let bias: Vec<FloatTensor<B>> = bias.into_iter().map(|b| b.primitive).collect();
    // Autodiff's bool tensors are its inner backend's.
    let dropout = dropout.map(|d| AttentionDropout::<B> {
        dropped: d.dropped,
        p: d.p,
    });
    match AttentionCore
        .prepare::<C>([q.node.clone(), k.node.clone(), v.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = B::attention_core(
                q.primitive.clone(),
                k.primitive.clone(),
                v.primitive.clone(),
                bias.clone(),
                dropout.clone(),
                scale,
            );
            let state = (q.primitive, k.primitive, v.primitive, bias, dropout, scale);
            prep.finish(state, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::attention_core(
            q.primitive,
            k.primitive,
            v.primitive,
            bias,
            dropout,
            scale,
        )),
    }
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
        // Burn's CPU generator is global: hold the trainers' lock while drawing.
        let _serial = crate::tests::serial();
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

    /// The selective attention core equals the plain composition (scaled
    /// q·kᵀ, biases, `softmax_last`, ·v) in value and in the gradients of
    /// q, k and v: causal bias, key-padding bias, grouped-query shapes (k, v
    /// repeated from fewer heads, as the model does), cross lengths.
    #[test]
    fn attention_core_matches_composition() {
        // Burn's CPU generator is global: hold the trainers' lock while drawing.
        let _serial = crate::tests::serial();
        let device = Default::default();
        let (b, h, s, d) = (2, 4, 6, 8);
        let causal = Tensor::<Cpu, 2, burn::tensor::Bool>::triu_mask([s, s], 1, &device)
            .float()
            .mul_scalar(-1.0e9)
            .reshape([1, 1, s, s]);
        let padding = Tensor::<Cpu, 1>::from_floats(
            [
                0.0, 0.0, 0.0, 0.0, -1.0e9, -1.0e9, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0,
            ],
            &device,
        )
        .reshape([b, 1, 1, s]);
        for (kvh, bias) in [
            (h, vec![]),
            (h, vec![causal.clone()]),
            (2, vec![causal.clone(), padding.clone()]),
            (1, vec![padding.clone()]),
        ] {
            let q0 =
                Tensor::<Cpu, 4>::random([b, h, s, d], Distribution::Normal(0.0, 1.0), &device);
            let k0 =
                Tensor::<Cpu, 4>::random([b, kvh, s, d], Distribution::Normal(0.0, 1.0), &device);
            let v0 =
                Tensor::<Cpu, 4>::random([b, kvh, s, d], Distribution::Normal(0.0, 1.0), &device);
            let up =
                Tensor::<Cpu, 4>::random([b, h, s, d], Distribution::Normal(0.0, 1.0), &device);
            let scale = 1.0 / (d as f64).sqrt();
            let rep = |t: Tensor<Cpu, 4>| {
                t.unsqueeze_dim::<5>(2)
                    .expand([b, kvh, h / kvh, s, d])
                    .reshape([b, h, s, d])
            };
            let run = |selective: bool| {
                let (q, k, v) = (
                    q0.clone().require_grad(),
                    k0.clone().require_grad(),
                    v0.clone().require_grad(),
                );
                let (kr, vr) = (rep(k.clone()), rep(v.clone()));
                let y = if selective {
                    attention_core(q.clone(), kr, vr, &bias, None, scale)
                } else {
                    let mut sc = q.clone().mul_scalar(scale).matmul(kr.swap_dims(2, 3));
                    for bb in &bias {
                        sc = sc + bb.clone();
                    }
                    softmax_last(sc).matmul(vr)
                };
                let g = (y.clone() * up.clone()).sum().backward();
                let grad = |t: &Tensor<Cpu, 4>| t.grad(&g).expect("a gradient").into_data();
                (y.inner().into_data(), grad(&q), grad(&k), grad(&v))
            };
            let sel = run(true);
            let reference = run(false);
            let tol = Tolerance::<f32>::absolute(1e-5);
            sel.0.assert_approx_eq(&reference.0, tol);
            sel.1.assert_approx_eq(&reference.1, tol);
            sel.2.assert_approx_eq(&reference.2, tol);
            sel.3.assert_approx_eq(&reference.3, tol);
        }
    }

    /// With dropout, the core equals `softmax`, `mask_fill`, scale, `· v`
    /// composed, in value and in all three gradients: the backward applies
    /// the saved mask to the recomputed probabilities and to their gradient.
    #[test]
    fn attention_core_with_dropout_matches_composition() {
        let _serial = crate::tests::serial();
        let device = Default::default();
        let (b, h, s, t, d) = (2, 3, 5, 7, 4);
        let normal = |shape: [usize; 4]| {
            Tensor::<Cpu, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device)
        };
        let (q0, k0, v0, up) = (
            normal([b, h, s, d]),
            normal([b, h, t, d]),
            normal([b, h, t, d]),
            normal([b, h, s, d]),
        );
        let dropped =
            Tensor::<Cpu, 4>::random([b, h, s, t], Distribution::Default, &device).lower_elem(0.3);
        let p = 0.3;
        let run = |core: bool| {
            let (q, k, v) = (
                q0.clone().require_grad(),
                k0.clone().require_grad(),
                v0.clone().require_grad(),
            );
            let y = if core {
                attention_core(
                    q.clone(),
                    k.clone(),
                    v.clone(),
                    &[],
                    Some((dropped.clone(), p)),
                    0.5,
                )
            } else {
                softmax_last(q.clone().mul_scalar(0.5).matmul(k.clone().swap_dims(2, 3)))
                    .mask_fill(dropped.clone(), 0.0)
                    .mul_scalar(1.0 / (1.0 - p))
                    .matmul(v.clone())
            };
            let g = (y.clone() * up.clone()).sum().backward();
            let grad = |t: &Tensor<Cpu, 4>| t.grad(&g).expect("a gradient").into_data();
            (y.inner().into_data(), grad(&q), grad(&k), grad(&v))
        };
        let (core, reference) = (run(true), run(false));
        let tol = Tolerance::<f32>::absolute(1e-5);
        core.0.assert_approx_eq(&reference.0, tol);
        core.1.assert_approx_eq(&reference.1, tol);
        core.2.assert_approx_eq(&reference.2, tol);
        core.3.assert_approx_eq(&reference.3, tol);
        // The mask did something: without it the output differs.
        let plain: Vec<f32> = attention_core(q0, k0, v0, &[], None, 0.5)
            .into_data()
            .to_vec()
            .unwrap();
        let dropped_out: Vec<f32> = core.0.to_vec().unwrap();
        let diff = plain
            .iter()
            .zip(&dropped_out)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(diff > 1e-2, "dropout left the output as it was ({diff})");
    }

    /// Only v tracked: q and k get nothing, v's gradient is still right.
    #[test]
    fn attention_core_with_frozen_q_k() {
        // Burn's CPU generator is global: hold the trainers' lock while drawing.
        let _serial = crate::tests::serial();
        let device = Default::default();
        let q = Tensor::<Cpu, 4>::random([1, 2, 3, 4], Distribution::Default, &device);
        let k = Tensor::<Cpu, 4>::random([1, 2, 5, 4], Distribution::Default, &device);
        let v0 = Tensor::<Cpu, 4>::random([1, 2, 5, 4], Distribution::Default, &device);
        let v = v0.clone().require_grad();
        let g = attention_core(q.clone(), k.clone(), v.clone(), &[], None, 0.5)
            .sum()
            .backward();
        let v2 = v0.require_grad();
        let p = softmax_last(q.mul_scalar(0.5).matmul(k.swap_dims(2, 3)));
        let g2 = p.matmul(v2.clone()).sum().backward();
        v.grad(&g).unwrap().into_data().assert_approx_eq(
            &v2.grad(&g2).unwrap().into_data(),
            Tolerance::<f32>::absolute(1e-6),
        );
    }
}
