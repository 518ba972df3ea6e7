//! The transformer, built from the lowered plan's `ModelSpec` and `AdapterSpec`.
//!
//! One set of module types covers both families of `DSL.md`:
//! - decoder: pre-norm blocks, causal attention, RoPE or learned positions,
//!   grouped-query attention (`kv_heads < heads`), SwiGLU or GELU MLP;
//! - encoder: post-norm blocks (BERT / XLM-R), bidirectional attention,
//!   learned positions and an embedding norm.
//!
//! Linear layers have the biases `ModelSpec::biases` says: by default all of
//! them with LayerNorm (GPT-2, BERT style) and none with RMSNorm (LLaMA
//! style); Qwen2's only on q, k and v. Weights are stored
//! `[in, out]`. LoRA adapters sit on the targeted projections: the base weight
//! is a frozen parameter (`require_grad = false`, so no gradient and no
//! optimizer state exist for it), `A` is random and `B` is zero, so training
//! starts from the base model.
//!
//! With `adapter qlora` every projection's frozen base (q, k, v, o, gate, up,
//! down: what bitsandbytes' `load_in_4bit` quantizes, targeted or not) is
//! held as NF4 only (`quant::base::Nf4Base`: block 64, double-quantized
//! scales), quantized when the layer is built or its weights are loaded, and
//! multiplied by `quant::qlora`'s op, which dequantizes per use and keeps no
//! fp32 copy; embeddings, norms, biases and the head stay in the params
//! dtype, frozen, as the `burn` memory profile assumes.
//!
//! Every forward function is generic over `B: Backend` so the same code runs
//! with the autodiff graph (`Autodiff<_>`) and without it (the inner backend)
//! when a checkpointed layer is run forward without keeping its graph
//! (see `train.rs`). Parameter ids are assigned in construction order
//! (`ParamId::from(n)`), so a rebuilt model and a saved optimizer state agree.

use crate::kernels::flash::dropout::FlashDropout;
use crate::kernels::rope::SeqAxis;
use crate::ops::{matmul_2d, softmax_last, ExecBackend};
use crate::quant::base::{Nf4Base, Nf4Slot};
use crate::quant::nf4::DeviceScales;
use burn::module::{Module, Param, ParamId};
use burn::tensor::activation;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Distribution, FloatDType, Int, Shape, Tensor};
use rcoa_compiler::spec::{AdapterKind, AdapterSpec, Arch, Mlp, ModelSpec, Norm, Positions, Proj};

/// Standard deviation of the random initialisation (GPT-2 / LLaMA use 0.02).
const INIT_STD: f64 = 0.02;
/// QLoRA's base scales are double-quantized (8-bit codes of the block
/// absmax, bitsandbytes' `compress_statistics=True`): the default of
/// bitsandbytes' `Linear4bit` and of the QLoRA recipe. The DSL has no knob
/// for it (`adapter qlora { base = nf4 }` is the only choice).
pub const QLORA_DOUBLE_QUANT: bool = true;
/// Large negative score for masked attention positions; finite so it also
/// stays finite in bf16 and `softmax` never sees `-inf - -inf`.
const MASK_VALUE: f64 = -1.0e9;

/// Hands out parameter ids in construction order.
pub struct Ids(u64);

impl Ids {
    pub fn new() -> Self {
        Ids(1)
    }
    fn next(&mut self) -> ParamId {
        self.0 += 1;
        ParamId::from(self.0)
    }
}

impl Default for Ids {
    fn default() -> Self {
        Self::new()
    }
}

fn param<B: Backend, const D: usize>(
    ids: &mut Ids,
    t: Tensor<B, D>,
    trainable: bool,
) -> Param<Tensor<B, D>> {
    Param::initialized(ids.next(), t.set_require_grad(trainable))
}

fn normal<B: Backend, const D: usize>(
    shape: [usize; D],
    dtype: FloatDType,
    device: &B::Device,
) -> Tensor<B, D> {
    Tensor::<B, D>::random(shape, Distribution::Normal(0.0, INIT_STD), device).cast(dtype)
}

/// True where query `offset + r` may not see key `c` of a `[rows, keys]` block (Burn's
/// masks are true where they mask): `tril_mask(_, offset)` is true strictly above the
/// shifted diagonal, the future. Under a sliding `window` (0 for none: Mistral v0.1,
/// Phi-3) a query sees itself and the `window - 1` positions before it, as transformers'
/// `sliding_window_overlay` (`kv > q - w`): `triu_mask(_, offset + 1 - w)` is true where
/// `c - r < offset + 1 - w`. The eager bias (`Ctx::new`) and the blocked fused attention
/// (`kernels::flash::blocked`) both mask with it.
pub(crate) fn causal_mask<B: Backend>(
    shape: [usize; 2],
    offset: i64,
    window: usize,
    device: &B::Device,
) -> Tensor<B, 2, Bool> {
    let future = Tensor::<B, 2, Bool>::tril_mask(shape, offset, device);
    if window == 0 {
        return future;
    }
    let past = Tensor::<B, 2, Bool>::triu_mask(shape, offset + 1 - window as i64, device);
    future.bool_or(past)
}

/// Cast `t` to `dtype` unless it already is (a cast is a copy and an autodiff node).
pub fn to_dtype<B: Backend, const D: usize>(t: Tensor<B, D>, dtype: FloatDType) -> Tensor<B, D> {
    if t.dtype() == dtype.into() {
        t
    } else {
        t.cast(dtype)
    }
}

// ---------------------------------------------------------------- context

/// Run-time constants shared by every layer of one forward pass: shapes,
/// the compute dtype, and the RoPE tables and causal mask for this sequence
/// length (built once per run on each backend that needs them).
#[derive(Clone, Debug)]
pub struct Ctx<B: Backend> {
    pub compute: FloatDType,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub causal: bool,
    /// A causal sliding window shorter than the sequence (`sliding_window`): a query sees
    /// itself and the `window − 1` positions before it; 0 for none. The eager paths hold
    /// it in `bias`, the fused attention masks it itself.
    pub window: usize,
    /// Epsilon of every norm (from the config: `rms_norm_eps` etc.).
    pub norm_eps: f64,
    /// GELU with the tanh approximation (GPT-2) instead of the exact one.
    pub gelu_tanh: bool,
    /// First position id of learned positions (RoBERTa: `pad_token_id + 1`).
    pub position_offset: usize,
    pub lora_scale: f64,
    pub lora_dropout: f64,
    /// The model's dropout at the embeddings' output, on each residual branch and on
    /// the attention probabilities (0 where the family drops nothing there:
    /// `Numerics::dropout_sites`).
    pub embedding_dropout: f64,
    pub residual_dropout: f64,
    pub attention_dropout: f64,
    /// Dropout masks are drawn only while training (never in a gradient check).
    pub train: bool,
    /// A decoder's `padding_idx`: the token whose embedding row the lookup gives no
    /// gradient (a tied head's gradient still reaches it, as in PyTorch).
    pub padding_idx: Option<i64>,
    pub rope: Option<RopeTables<B>>,
    /// `[1, 1, seq, seq]` additive causal mask in the compute dtype: 0, or a
    /// large negative number above the diagonal (future positions). Added
    /// rather than `mask_fill`ed so the backward keeps no `[b, h, s, s]` mask.
    pub bias: Option<Tensor<B, 4>>,
    /// `[b, 1, 1, seq]` additive key-padding mask in the compute dtype for
    /// the current batch: 0 for real tokens, a large negative number for
    /// padding, so no query attends to a pad. `None`: every token is real
    /// (packed sequences). Set per batch with [`Ctx::with_padding`].
    pub padding: Option<Tensor<B, 4>>,
    /// Packed rows (`train.packing`, [`Ctx::with_documents`]): each token's position in
    /// its example, `[rows · seq]`, which learned positions read; RoPE's tables are then
    /// gathered at them (`RopeTables::tokens`) and `bias` (eager paths) or `spans` (the
    /// fused attention) keeps attention within each example. `None`: positions `0..seq`
    /// in every row.
    pub positions: Option<Tensor<B, 1, Int>>,
    /// Packed rows under the fused attention: `[rows, seq, 2]` each token's example as
    /// `[start, end)` in its row, which the kernels mask by (`FlashMask::documents`).
    pub spans: Option<Tensor<B, 3, Int>>,
    /// `checkpoint = selective`: the attention core is one node that keeps
    /// q, k, v and recomputes the scores and probabilities in the backward
    /// (`ops::attention_core`), instead of keeping the `[b, h, s, s]`
    /// probabilities.
    pub selective: bool,
    /// `attention = flash`: the fused attention op (`ops::flash_attention`),
    /// which keeps q, k, v, the output and the log-sum-exp and never repeats
    /// k and v for grouped-query attention. Takes precedence over `selective`.
    pub flash: bool,
}

impl<B: Backend> Ctx<B> {
    /// `flash`: the fused attention, which masks the future itself, so no `[seq, seq]` bias
    /// is built (at 80k tokens it would be 13 GB in bf16).
    pub fn new(
        model: &ModelSpec,
        adapter: Option<&AdapterSpec>,
        seq: usize,
        compute: FloatDType,
        flash: bool,
        device: &B::Device,
    ) -> Self {
        let head_dim = model.head_dim as usize;
        let rope = (model.positions == Positions::Rope)
            .then(|| RopeTables::new(&model.numerics, head_dim, seq, compute, device));
        let causal = model.arch == Arch::Decoder;
        let window = model
            .numerics
            .window_within(seq as u64)
            .filter(|_| causal)
            .map_or(0, |w| w as usize);
        let bias = (causal && !flash).then(|| {
            let masked = causal_mask::<B>([seq, seq], 0, window, device);
            to_dtype(masked.float().mul_scalar(MASK_VALUE), compute).unsqueeze::<4>()
        });
        Ctx {
            compute,
            heads: model.heads as usize,
            kv_heads: model.kv_heads as usize,
            head_dim,
            causal,
            window,
            norm_eps: model.numerics.norm_eps,
            gelu_tanh: model.numerics.gelu_tanh,
            position_offset: model.numerics.position_offset as usize,
            lora_scale: adapter.map(|a| a.alpha / a.rank as f64).unwrap_or(0.0),
            lora_dropout: adapter.map(|a| a.dropout).unwrap_or(0.0),
            embedding_dropout: model.embedding_dropout(),
            residual_dropout: model.residual_dropout(),
            attention_dropout: model.attention_dropout(),
            train: true,
            padding_idx: model
                .numerics
                .padding_idx
                .filter(|_| causal)
                .map(|p| p as i64),
            rope,
            bias,
            padding: None,
            positions: None,
            spans: None,
            selective: false,
            flash,
        }
    }

    /// The same context on the inner backend, its tensors shared, not copied (the
    /// graph-free forwards of checkpointed layers and evaluation read it).
    pub fn inner(&self) -> Ctx<B::InnerBackend>
    where
        B: AutodiffBackend,
    {
        Ctx {
            compute: self.compute,
            heads: self.heads,
            kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            causal: self.causal,
            window: self.window,
            norm_eps: self.norm_eps,
            gelu_tanh: self.gelu_tanh,
            position_offset: self.position_offset,
            lora_scale: self.lora_scale,
            lora_dropout: self.lora_dropout,
            embedding_dropout: self.embedding_dropout,
            residual_dropout: self.residual_dropout,
            attention_dropout: self.attention_dropout,
            train: self.train,
            padding_idx: self.padding_idx,
            rope: self.rope.as_ref().map(|r| RopeTables {
                cos: r.cos.clone().inner(),
                sin: r.sin.clone().inner(),
                swap: r.swap.clone().map(|i| i.inner()),
                tokens: r.tokens,
            }),
            bias: self.bias.clone().map(|b| b.inner()),
            padding: self.padding.clone().map(|p| p.inner()),
            positions: self.positions.clone().map(|p| p.inner()),
            spans: self.spans.clone().map(|p| p.inner()),
            selective: self.selective,
            flash: self.flash,
        }
    }

    /// This context for one batch of `rows` sequences of `seq` tokens whose
    /// real tokens are `keep[row * seq + pos]` (attention-mask order, as
    /// Hugging Face's `attention_mask`). All-true masks give no padding bias.
    pub fn with_padding(&self, keep: &[bool], rows: usize, seq: usize, device: &B::Device) -> Self {
        assert_eq!(keep.len(), rows * seq, "one mask entry per token");
        let mut ctx = self.clone();
        ctx.padding = keep.iter().any(|k| !k).then(|| {
            let bias: Vec<f32> = keep
                .iter()
                .map(|&k| if k { 0.0 } else { MASK_VALUE as f32 })
                .collect();
            let t = Tensor::<B, 1>::from_floats(bias.as_slice(), device).reshape([rows, 1, 1, seq]);
            to_dtype(t, self.compute)
        });
        ctx
    }
}

impl<B: Backend> Ctx<B> {
    /// This context for one batch of packed rows (`train.packing`): `positions[row · seq +
    /// p]` is token `p`'s position in its example, and an example starts where a position
    /// is not its predecessor's plus one (`data::packing::documents`). Learned positions
    /// and RoPE read each token's position, and each query sees only the keys of its own
    /// example (causal, and within a sliding window), so each example's outputs are those
    /// it has alone: the eager paths by a `[rows, 1, seq, seq]` bias, the fused attention
    /// by each token's `[start, end)` (`spans`), which its kernels mask by.
    pub fn with_documents(
        &self,
        positions: &[i64],
        rows: usize,
        seq: usize,
        device: &B::Device,
    ) -> Self {
        assert_eq!(positions.len(), rows * seq, "one position per token");
        let ints = |v: Vec<i64>| {
            let data = burn::tensor::TensorData::new(v, [rows * seq]).convert::<B::IntElem>();
            Tensor::<B, 1, Int>::from_data(data, device)
        };
        let pos = ints(positions.to_vec());
        let mut ctx = self.clone();
        ctx.rope = self.rope.as_ref().map(|t| RopeTables {
            cos: t.cos.clone().select(0, pos.clone()),
            sin: t.sin.clone().select(0, pos.clone()),
            swap: t.swap.clone(),
            tokens: true,
        });
        ctx.positions = Some(pos);
        if self.flash {
            let spans = crate::data::packing::spans(positions, seq);
            let data = burn::tensor::TensorData::new(spans, [rows, seq, 2]).convert::<B::IntElem>();
            ctx.spans = Some(Tensor::from_data(data, device));
            return ctx;
        }
        let shape = [rows, 1, seq, seq];
        let docs = ints(crate::data::packing::documents(positions, seq));
        let (q, k) = (
            docs.clone().reshape([rows, 1, seq, 1]).expand(shape),
            docs.reshape([rows, 1, 1, seq]).expand(shape),
        );
        let mut masked = q.not_equal(k);
        if self.causal {
            masked = masked.bool_or(
                causal_mask::<B>([seq, seq], 0, self.window, device)
                    .unsqueeze::<4>()
                    .expand(shape),
            );
        }
        let zeros = Tensor::<B, 4>::zeros(shape, (device, self.compute.into()));
        ctx.bias = Some(zeros.mask_fill(masked, MASK_VALUE));
        ctx
    }
}

fn dropout<B: Backend, const D: usize>(x: Tensor<B, D>, p: f64, ctx: &Ctx<B>) -> Tensor<B, D> {
    match dropped(x.shape(), p, ctx, &x.device()) {
        Some(mask) => crate::ops::apply_dropout(x, mask, p),
        None => x,
    }
}

/// Where dropout with probability `p` drops (true), while training; `None`
/// otherwise. The mask comes from the backend's RNG, which the trainer
/// re-seeds before every layer (and before its recomputation), so a
/// recomputed layer draws the same mask as its first forward.
fn dropped<B: Backend, const D: usize>(
    shape: Shape,
    p: f64,
    ctx: &Ctx<B>,
    device: &B::Device,
) -> Option<Tensor<B, D, Bool>> {
    (ctx.train && p > 0.0).then(|| {
        Tensor::<B, D>::random(shape, Distribution::Bernoulli(1.0 - p), device).lower_elem(0.5)
    })
}

// ---------------------------------------------------------------- linear

/// Low-rank adapter `x A B * alpha / rank`.
#[derive(Module, Debug)]
pub struct Lora<B: Backend> {
    a: Param<Tensor<B, 2>>,
    b: Param<Tensor<B, 2>>,
}

/// `y = x W (+ b) (+ LoRA)`, `W` stored `[in, out]`: in the params dtype
/// (`weight`) or, under QLoRA, as frozen NF4 (`nf4`); exactly one is set.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    weight: Option<Param<Tensor<B, 2>>>,
    nf4: Nf4Slot<B>,
    bias: Option<Param<Tensor<B, 1>>>,
    lora: Option<Lora<B>>,
}

/// How to build one linear layer.
struct LinearInit<'a> {
    d_in: usize,
    d_out: usize,
    bias: bool,
    proj: Option<Proj>,
    adapter: Option<&'a AdapterSpec>,
    /// The base weight's and bias's (frozen under an adapter).
    base_dtype: FloatDType,
    /// LoRA's A and B (trainable).
    lora_dtype: FloatDType,
}

impl<B: Backend> Linear<B> {
    fn new(ids: &mut Ids, c: LinearInit<'_>, device: &B::Device) -> Self {
        let lora_on = matches!((c.adapter, c.proj), (Some(a), Some(p)) if a.targets.contains(&p));
        // With an adapter every base weight is frozen, targeted or not.
        let base_trainable = c.adapter.is_none();
        let quantized = c.proj.is_some() && c.adapter.is_some_and(|a| a.kind == AdapterKind::Qlora);
        // The same draw either way, so ids and the generator's stream do not
        // depend on the base's storage; NF4 quantizes the fp32 draw whatever
        // the storage dtype, as when the model was built in fp32 and cast.
        let w = normal::<B, 2>([c.d_in, c.d_out], FloatDType::F32, device);
        let (weight, nf4) = if quantized {
            // The dense weight's id stays unused: the other parameters keep
            // the ids they have under LoRA.
            ids.next();
            let shape = [c.d_in, c.d_out];
            let q = if crate::prebuild::recording() {
                // A recording pass reads zeros back: skip the read and the quantization
                // (seconds at 7B), upload what they would give.
                let zeros = crate::quant::nf4::Nf4Weight::zeros(shape, QLORA_DOUBLE_QUANT);
                zeros.to_device(device).map(Nf4Base::new)
            } else {
                Nf4Base::quantize(&host_f32(w), shape, QLORA_DOUBLE_QUANT, device)
            }
            .expect("a random normal weight is finite and of its own shape");
            (None, Some(q))
        } else {
            (
                Some(param(ids, to_dtype(w, c.base_dtype), base_trainable)),
                None,
            )
        };
        let bias = c.bias.then(|| {
            param(
                ids,
                Tensor::<B, 1>::zeros([c.d_out], device).cast(c.base_dtype),
                base_trainable,
            )
        });
        let lora = if lora_on {
            let r = c.adapter.map(|a| a.rank as usize).unwrap_or(1);
            Some(Lora {
                a: param(ids, normal::<B, 2>([c.d_in, r], c.lora_dtype, device), true),
                b: param(
                    ids,
                    Tensor::<B, 2>::zeros([r, c.d_out], device).cast(c.lora_dtype),
                    true,
                ),
            })
        } else {
            None
        };
        Linear {
            weight,
            nf4: Nf4Slot(nf4),
            bias,
            lora,
        }
    }

    /// Why this projection (number `i` in layer order) has no usable base
    /// after a load: see [`Model::quantization_error`].
    fn quantization_error(&self, i: usize) -> Option<String> {
        if self.weight.is_none() && self.nf4.0.is_none() {
            return Some(format!(
                "projection {i} (in layer order) has no base weight after loading: \
                 the checkpoint was written for the other adapter kind (lora vs qlora)"
            ));
        }
        self.nf4().and_then(|q| q.load_error()).map(str::to_string)
    }

    /// Elements of the NF4 base (0 for a dense weight).
    pub fn quantized_params(&self) -> usize {
        self.nf4.0.as_ref().map_or(0, |q| q.params())
    }

    /// The NF4 base, if this layer has one.
    pub fn nf4(&self) -> Option<&Nf4Base<B>> {
        self.nf4.0.as_ref()
    }
}

/// A tensor's values as host f32, row-major.
fn host_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.cast(FloatDType::F32)
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .unwrap_or_default()
}

impl<B: ExecBackend> Linear<B> {
    pub fn forward(&self, x: Tensor<B, 3>, ctx: &Ctx<B>) -> Tensor<B, 3> {
        // One 2-D GEMM over all tokens: a batched matmul against a broadcast
        // weight would make the backward materialise one weight gradient per
        // batch row and sum them (memory and time).
        let [b, s, d_in] = x.dims();
        let x = x.reshape([b * s, d_in]);
        let mut y = match (&self.weight, &self.nf4.0) {
            (Some(w), _) => matmul_2d(x.clone(), to_dtype(w.val(), ctx.compute)),
            // Dequantized per use in x's (the compute) dtype, never kept.
            (None, Some(q)) => crate::quant::qlora::nf4_linear(x.clone(), &q.w),
            (None, None) => unreachable!("a linear layer has a dense or an NF4 base"),
        };
        if let Some(bias) = &self.bias {
            y = y + to_dtype(bias.val(), ctx.compute).unsqueeze();
        }
        if let Some(l) = &self.lora {
            let xa = matmul_2d(
                dropout(x, ctx.lora_dropout, ctx),
                to_dtype(l.a.val(), ctx.compute),
            );
            let xab = matmul_2d(xa, to_dtype(l.b.val(), ctx.compute));
            y = y + xab.mul_scalar(ctx.lora_scale);
        }
        let d_out = y.dims()[1];
        y.reshape([b, s, d_out])
    }
}

// ---------------------------------------------------------------- norm

/// RMSNorm (weight only) or LayerNorm (weight and bias).
#[derive(Module, Debug)]
pub struct NormLayer<B: Backend> {
    weight: Param<Tensor<B, 1>>,
    bias: Option<Param<Tensor<B, 1>>>,
}

impl<B: Backend> NormLayer<B> {
    fn new(
        ids: &mut Ids,
        kind: Norm,
        d: usize,
        dtype: FloatDType,
        trainable: bool,
        device: &B::Device,
    ) -> Self {
        let weight = param(
            ids,
            Tensor::<B, 1>::ones([d], device).cast(dtype),
            trainable,
        );
        let bias = (kind == Norm::Layernorm).then(|| {
            param(
                ids,
                Tensor::<B, 1>::zeros([d], device).cast(dtype),
                trainable,
            )
        });
        NormLayer { weight, bias }
    }

    pub fn forward(&self, x: Tensor<B, 3>, ctx: &Ctx<B>) -> Tensor<B, 3> {
        let w = to_dtype(self.weight.val(), ctx.compute).unsqueeze::<3>();
        match &self.bias {
            None => {
                let rms = x
                    .clone()
                    .powi_scalar(2)
                    .mean_dim(2)
                    .add_scalar(ctx.norm_eps)
                    .sqrt();
                x / rms * w
            }
            Some(b) => {
                let mean = x.clone().mean_dim(2);
                let centered = x - mean;
                let var = centered.clone().powi_scalar(2).mean_dim(2);
                centered / var.add_scalar(ctx.norm_eps).sqrt() * w
                    + to_dtype(b.val(), ctx.compute).unsqueeze::<3>()
            }
        }
    }
}

// ---------------------------------------------------------------- attention

#[derive(Module, Debug)]
pub struct Attention<B: Backend> {
    q: Linear<B>,
    k: Linear<B>,
    v: Linear<B>,
    o: Linear<B>,
    /// `qk_norm` (Qwen3): the model's norm over each head of q and k, before RoPE.
    q_norm: Option<NormLayer<B>>,
    k_norm: Option<NormLayer<B>>,
}

/// RoPE's tables in the compute dtype, laid out for [`rope`]. Whole heads rotated: the
/// cosines `[seq, head_dim / 2]` (both halves use them) and the signed sines `[seq,
/// head_dim]` (`[-s, s]`). Only the first `r` values of each head rotated (Phi-4-mini's
/// `partial_rotary_factor`): `[seq, head_dim]` each, `[c, c, 1, ..]` and `[-s, s, 0, ..]`,
/// and `swap`, the index that trades each rotated value for its partner (`i` and `i + r/2`)
/// and keeps the rest in place. LongRoPE's attention factor is in both.
#[derive(Clone, Debug)]
pub struct RopeTables<B: Backend> {
    pub cos: Tensor<B, 2>,
    pub sin: Tensor<B, 2>,
    pub swap: Option<Tensor<B, 1, Int>>,
    /// One row per token of the batch (`[rows · seq, ..]`, gathered at packed rows'
    /// positions: [`Ctx::with_documents`]) rather than per position.
    pub tokens: bool,
}

impl<B: Backend> RopeTables<B> {
    fn new(
        n: &rcoa_compiler::spec::Numerics,
        head_dim: usize,
        seq: usize,
        compute: FloatDType,
        device: &B::Device,
    ) -> Self {
        let rotated = n.rotary_dims.map_or(head_dim, |r| r as usize);
        let whole = rotated == head_dim;
        // angle[p, i] = p * theta_i (f32, as Hugging Face computes it), and cos and sin
        // scaled in f32 before the cast, as transformers' `attention_scaling`.
        let (inv, scale) = crate::rope::frequencies(n, rotated, seq);
        let inv: Vec<f32> = inv.into_iter().map(|f| f as f32).collect();
        let scale = scale as f32;
        let cols = if whole { head_dim / 2 } else { head_dim };
        let mut cos = Vec::with_capacity(seq * cols);
        let mut sin = Vec::with_capacity(seq * head_dim);
        for p in 0..seq {
            let angles = inv.iter().map(|f| p as f32 * f);
            let c: Vec<f32> = angles.clone().map(|a| a.cos() * scale).collect();
            let sn: Vec<f32> = angles.map(|a| a.sin() * scale).collect();
            cos.extend(&c);
            sin.extend(sn.iter().map(|v| -v));
            sin.extend(&sn);
            if !whole {
                cos.extend(&c);
                cos.extend(std::iter::repeat_n(1.0, head_dim - rotated));
                sin.extend(std::iter::repeat_n(0.0, head_dim - rotated));
            }
        }
        let mk = |v: Vec<f32>| {
            let cols = v.len() / seq;
            to_dtype(
                Tensor::<B, 1>::from_floats(v.as_slice(), device).reshape([seq, cols]),
                compute,
            )
        };
        let half = rotated / 2;
        let swap = (!whole).then(|| {
            let index: Vec<i64> = (half..rotated)
                .chain(0..half)
                .chain(rotated..head_dim)
                .map(|i| i as i64)
                .collect();
            Tensor::<B, 1, Int>::from_data(burn::tensor::TensorData::new(index, [head_dim]), device)
        });
        RopeTables {
            cos: mk(cos),
            sin: mk(sin),
            swap,
            tokens: false,
        }
    }
}

fn rope<B: ExecBackend>(x: Tensor<B, 4>, t: &RopeTables<B>, seq: SeqAxis) -> Tensor<B, 4> {
    // Rotate-half form (as in Hugging Face LLaMA), pairs (i, i + d/2):
    //   [x1, x2] -> [x1 c - x2 s, x2 c + x1 s] = [x1, x2] * c + [x2, x1] * [-s, s],
    // one kernel each way on the fused CubeCL backends for whole heads (`kernels::rope`);
    // part of each head (`swap`) by one gather, in the same autodiff node.
    if t.tokens {
        // A table row per token: the batch's `[b, s, ..]` read as one sequence of `b · s`
        // tokens (a view of the projections' contiguous layout).
        assert_eq!(
            seq,
            SeqAxis::Second,
            "per-token tables rotate `[b, s, h, d]`"
        );
        let [b, s, h, d] = x.dims();
        let y = crate::ops::rope(
            x.reshape([1, b * s, h, d]),
            &t.cos,
            &t.sin,
            t.swap.as_ref(),
            seq,
        );
        return y.reshape([b, s, h, d]);
    }
    crate::ops::rope(x, &t.cos, &t.sin, t.swap.as_ref(), seq)
}

impl<B: ExecBackend> Attention<B> {
    pub fn forward(&self, x: Tensor<B, 3>, ctx: &Ctx<B>) -> Tensor<B, 3> {
        let [b, s, _] = x.dims();
        let (h, kvh, hd) = (ctx.heads, ctx.kv_heads, ctx.head_dim);
        let heads = |t: Tensor<B, 3>, n: usize| t.reshape([b, s, n, hd]);
        let per_head = |t: Tensor<B, 4>, norm: &Option<NormLayer<B>>| match norm {
            Some(n) => {
                let dims = t.dims();
                n.forward(t.reshape([b, s * dims[2], hd]), ctx)
                    .reshape(dims)
            }
            None => t,
        };
        let (q, k) = (
            per_head(heads(self.q.forward(x.clone(), ctx), h), &self.q_norm),
            per_head(heads(self.k.forward(x.clone(), ctx), kvh), &self.k_norm),
        );
        let mut v = heads(self.v.forward(x, ctx), kvh).swap_dims(1, 2);
        if ctx.flash {
            // RoPE in the projections' order, before the swap: the kernels write dq and dk in
            // that order too (`flash::fused` `heads_last`), so their way back to the
            // projections, RoPE's backward included, copies nothing.
            let (q, k) = match &ctx.rope {
                Some(t) => (rope(q, t, SeqAxis::Second), rope(k, t, SeqAxis::Second)),
                None => (q, k),
            };
            let (q, k) = (q.swap_dims(1, 2), k.swap_dims(1, 2));
            let mask = crate::kernels::flash::blocked::FlashMask {
                causal: ctx.causal,
                window: ctx.window,
                key_bias: ctx.padding.as_ref().map(|p| p.clone().reshape([b, s])),
                documents: ctx.spans.clone(),
                // A seed, not a mask: the kernels hash it with each score's place.
                dropout: (ctx.train && ctx.attention_dropout > 0.0)
                    .then(|| FlashDropout::draw(ctx.attention_dropout, &q.device())),
            };
            let out = crate::ops::flash_attention(q, k, v, &mask, 1.0 / (hd as f64).sqrt());
            return self
                .o
                .forward(out.swap_dims(1, 2).reshape([b, s, h * hd]), ctx);
        }
        let (q, k) = match &ctx.rope {
            // Packed rows' tables hold a row per token, read in the projections' order.
            Some(t) if t.tokens => (rope(q, t, SeqAxis::Second), rope(k, t, SeqAxis::Second)),
            _ => (q, k),
        };
        let (mut q, mut k) = (q.swap_dims(1, 2), k.swap_dims(1, 2));
        if let Some(t) = ctx.rope.as_ref().filter(|t| !t.tokens) {
            q = rope(q, t, SeqAxis::Third);
            k = rope(k, t, SeqAxis::Third);
        }
        if kvh != h {
            // Grouped-query attention: each kv head serves h / kvh query heads.
            let g = h / kvh;
            let rep = |t: Tensor<B, 4>| {
                t.unsqueeze_dim::<5>(2)
                    .expand([b, kvh, g, s, hd])
                    .reshape([b, h, s, hd])
            };
            k = rep(k);
            v = rep(v);
        }
        if ctx.selective {
            let biases: Vec<Tensor<B, 4>> = ctx.bias.iter().chain(&ctx.padding).cloned().collect();
            let t = k.dims()[2];
            let drop = dropped(
                Shape::new([b, h, s, t]),
                ctx.attention_dropout,
                ctx,
                &q.device(),
            )
            .map(|mask| (mask, ctx.attention_dropout));
            let scale = 1.0 / (hd as f64).sqrt();
            let out = crate::ops::attention_core(q, k, v, &biases, drop, scale);
            return self
                .o
                .forward(out.swap_dims(1, 2).reshape([b, s, h * hd]), ctx);
        }
        // Eager attention (Burn 0.21 has no fused training attention): the
        // [b, h, s, s] probabilities are kept for the backward pass, once
        // (`softmax_last` saves only its output, which `probs · v` saves too).
        // The 1/sqrt(d) scale on q ([b, h, s, d]) rather than on the scores
        // ([b, h, s, s]): one pass over the small tensor instead of the big one.
        let mut scores = q
            .mul_scalar(1.0 / (hd as f64).sqrt())
            .matmul(k.swap_dims(2, 3));
        if let Some(bias) = &ctx.bias {
            scores = scores + bias.clone();
        }
        if let Some(pad) = &ctx.padding {
            scores = scores + pad.clone();
        }
        let probs = dropout(softmax_last(scores), ctx.attention_dropout, ctx);
        let out = probs.matmul(v).swap_dims(1, 2).reshape([b, s, h * hd]);
        self.o.forward(out, ctx)
    }
}

// ---------------------------------------------------------------- mlp

#[derive(Module, Debug)]
pub struct MlpLayer<B: Backend> {
    /// SwiGLU only.
    gate: Option<Linear<B>>,
    up: Linear<B>,
    down: Linear<B>,
}

impl<B: ExecBackend> MlpLayer<B> {
    pub fn forward(&self, x: Tensor<B, 3>, ctx: &Ctx<B>) -> Tensor<B, 3> {
        let hidden = match &self.gate {
            Some(gate) => activation::silu(gate.forward(x.clone(), ctx)) * self.up.forward(x, ctx),
            None if ctx.gelu_tanh => activation::gelu_approximate(self.up.forward(x, ctx)),
            None => activation::gelu(self.up.forward(x, ctx)),
        };
        self.down.forward(hidden, ctx)
    }
}

// ---------------------------------------------------------------- block

/// One transformer layer: the unit of activation checkpointing.
#[derive(Module, Debug)]
pub struct Layer<B: Backend> {
    norm1: NormLayer<B>,
    attn: Attention<B>,
    norm2: NormLayer<B>,
    mlp: MlpLayer<B>,
}

impl<B: ExecBackend> Layer<B> {
    pub fn forward(&self, x: Tensor<B, 3>, ctx: &Ctx<B>) -> Tensor<B, 3> {
        if ctx.causal {
            // Pre-norm (GPT-2, LLaMA).
            let h = x.clone()
                + dropout(
                    self.attn.forward(self.norm1.forward(x, ctx), ctx),
                    ctx.residual_dropout,
                    ctx,
                );
            h.clone()
                + dropout(
                    self.mlp.forward(self.norm2.forward(h, ctx), ctx),
                    ctx.residual_dropout,
                    ctx,
                )
        } else {
            // Post-norm (BERT, XLM-R).
            let h = self.norm1.forward(
                x.clone() + dropout(self.attn.forward(x, ctx), ctx.residual_dropout, ctx),
                ctx,
            );
            self.norm2.forward(
                h.clone() + dropout(self.mlp.forward(h, ctx), ctx.residual_dropout, ctx),
                ctx,
            )
        }
    }
}

// ---------------------------------------------------------------- embeddings and head

/// Token embeddings, learned positions (if any) and the encoder's embedding norm.
#[derive(Module, Debug)]
pub struct Embed<B: Backend> {
    tokens: Param<Tensor<B, 2>>,
    positions: Option<Param<Tensor<B, 2>>>,
    norm: Option<NormLayer<B>>,
}

impl<B: ExecBackend> Embed<B> {
    pub fn forward(&self, tokens: Tensor<B, 2, Int>, ctx: &Ctx<B>) -> Tensor<B, 3> {
        let [_, s] = tokens.dims();
        let table = to_dtype(self.tokens.val(), ctx.compute);
        let pad_at = ctx.padding_idx.map(|pad| tokens.clone().equal_elem(pad));
        let mut x = crate::ops::embedding(table, tokens);
        if let Some(pad_at) = pad_at {
            // `nn.Embedding(padding_idx)`: the pad token's positions pass no gradient to
            // its row (their values are the same, taken from a detached copy).
            let dims = x.dims();
            x = x
                .clone()
                .mask_where(pad_at.unsqueeze_dim::<3>(2).expand(dims), x.detach());
        }
        if let Some(p) = &self.positions {
            let table = to_dtype(p.val(), ctx.compute);
            let [b, _, d] = x.dims();
            x = x + match &ctx.positions {
                // Packed rows: each token's own position.
                Some(at) => table
                    .select(0, at.clone().add_scalar(ctx.position_offset as i64))
                    .reshape([b, s, d]),
                None => table.narrow(0, ctx.position_offset, s).unsqueeze::<3>(),
            };
        }
        if let Some(n) = &self.norm {
            x = n.forward(x, ctx);
        }
        dropout(x, ctx.embedding_dropout, ctx)
    }
}

impl<B: Backend> Embed<B> {
    /// The token table, for a tied head.
    pub fn table(&self) -> Tensor<B, 2> {
        self.tokens.val()
    }
}

/// The final norm (pre-norm models) and the vocabulary head (untied) — what
/// runs after the last layer.
#[derive(Module, Debug)]
pub struct Head<B: Backend> {
    norm: Option<NormLayer<B>>,
    /// `[hidden, vocab]`; `None` when tied to the embeddings or when no head runs.
    out: Option<Param<Tensor<B, 2>>>,
}

impl<B: Backend> Head<B> {
    /// Hidden states after the final norm.
    pub fn normed(&self, x: Tensor<B, 3>, ctx: &Ctx<B>) -> Tensor<B, 3> {
        match &self.norm {
            Some(n) => n.forward(x, ctx),
            None => x,
        }
    }

    /// The vocabulary head `[hidden, vocab]` in the compute dtype: its own
    /// weight, or the token table's transpose when tied.
    pub fn weight(&self, embed: &Embed<B>, ctx: &Ctx<B>) -> Tensor<B, 2> {
        match &self.out {
            Some(w) => to_dtype(w.val(), ctx.compute),
            None => to_dtype(embed.table(), ctx.compute).transpose(),
        }
    }

    /// Vocabulary logits `[b, s, vocab]` in the compute dtype.
    pub fn logits(&self, x: Tensor<B, 3>, embed: &Embed<B>, ctx: &Ctx<B>) -> Tensor<B, 3>
    where
        B: ExecBackend,
    {
        let w = self.weight(embed, ctx);
        let [b, s, d] = x.dims();
        let v = w.dims()[1];
        matmul_2d(x.reshape([b * s, d]), w).reshape([b, s, v])
    }
}

/// The whole model. Split into parts because the trainer runs each part as
/// its own autodiff segment (embedding, each layer, head + loss).
#[derive(Module, Debug)]
pub struct Model<B: Backend> {
    pub embed: Embed<B>,
    pub layers: Vec<Layer<B>>,
    pub head: Head<B>,
}

/// Everything `Model::new` needs to know.
pub struct ModelInit<'a> {
    pub model: &'a ModelSpec,
    pub adapter: Option<&'a AdapterSpec>,
    /// Whether a vocabulary head runs (not for contrastive training).
    pub lm_head: bool,
    /// Storage dtype of the trainable parameters (fp32 when the optimizer
    /// steps an fp32 master of 16-bit weights: the model built is the master).
    pub dtype: FloatDType,
    /// Storage dtype of the frozen ones (an adapter's base, its embeddings,
    /// norms and head): the run's params dtype even beside an fp32 master,
    /// because nothing steps them, so no master copy of them is kept.
    pub frozen: FloatDType,
}

impl<'a> ModelInit<'a> {
    /// Everything stored in fp32: the CPU's and the tests' model.
    pub fn f32(model: &'a ModelSpec, adapter: Option<&'a AdapterSpec>, lm_head: bool) -> Self {
        Self {
            model,
            adapter,
            lm_head,
            dtype: FloatDType::F32,
            frozen: FloatDType::F32,
        }
    }

    fn dtype_of(&self, trainable: bool) -> FloatDType {
        if trainable {
            self.dtype
        } else {
            self.frozen
        }
    }
}

/// A model's units in construction order: what [`Model::new`] builds, and
/// what the trainer builds one at a time (`crate::setup`).
pub enum Part<B: Backend> {
    Embed(Embed<B>),
    Layer(usize, Box<Layer<B>>),
    Head(Head<B>),
}

impl<B: ExecBackend> Embed<B> {
    /// The embedding unit; draws first from the generator.
    pub fn new(ids: &mut Ids, init: &ModelInit<'_>, device: &B::Device) -> Self {
        let m = init.model;
        let (d, v) = (m.hidden as usize, m.vocab as usize);
        let trainable = init.adapter.is_none();
        let dt = init.dtype_of(trainable);
        Embed {
            tokens: param(ids, normal::<B, 2>([v, d], dt, device), trainable),
            positions: (m.positions == Positions::Learned).then(|| {
                param(
                    ids,
                    normal::<B, 2>([m.max_positions as usize, d], dt, device),
                    trainable,
                )
            }),
            norm: (m.arch == Arch::Encoder)
                .then(|| NormLayer::new(ids, m.norm, d, dt, trainable, device)),
        }
    }
}

impl<B: ExecBackend> Layer<B> {
    /// One transformer layer, after the embedding and the layers before it.
    pub fn new(ids: &mut Ids, init: &ModelInit<'_>, device: &B::Device) -> Self {
        let m = init.model;
        let d = m.hidden as usize;
        let (h, kvh, hd, ffn) = (
            m.heads as usize,
            m.kv_heads as usize,
            m.head_dim as usize,
            m.ffn as usize,
        );
        let trainable = init.adapter.is_none();
        let dt = init.dtype_of(trainable);
        let lin = |ids: &mut Ids, d_in, d_out, proj: Option<Proj>| {
            Linear::new(
                ids,
                LinearInit {
                    d_in,
                    d_out,
                    bias: proj.is_some_and(|p| m.bias_on(p)),
                    proj,
                    adapter: init.adapter,
                    base_dtype: dt,
                    lora_dtype: init.dtype,
                },
                device,
            )
        };
        let qk_norm = |ids: &mut Ids| {
            m.numerics
                .qk_norm
                .then(|| NormLayer::new(ids, m.norm, hd, dt, trainable, device))
        };
        Layer {
            norm1: NormLayer::new(ids, m.norm, d, dt, trainable, device),
            attn: Attention {
                q: lin(ids, d, h * hd, Some(Proj::Q)),
                k: lin(ids, d, kvh * hd, Some(Proj::K)),
                v: lin(ids, d, kvh * hd, Some(Proj::V)),
                o: lin(ids, h * hd, d, Some(Proj::O)),
                q_norm: qk_norm(ids),
                k_norm: qk_norm(ids),
            },
            norm2: NormLayer::new(ids, m.norm, d, dt, trainable, device),
            mlp: MlpLayer {
                gate: (m.mlp == Mlp::Swiglu).then(|| lin(ids, d, ffn, Some(Proj::Gate))),
                up: lin(ids, d, ffn, Some(Proj::Up)),
                down: lin(ids, ffn, d, Some(Proj::Down)),
            },
        }
    }
}

impl<B: ExecBackend> Head<B> {
    /// The head unit, after the last layer.
    pub fn new(ids: &mut Ids, init: &ModelInit<'_>, device: &B::Device) -> Self {
        let m = init.model;
        let (d, v) = (m.hidden as usize, m.vocab as usize);
        let trainable = init.adapter.is_none();
        let dt = init.dtype_of(trainable);
        Head {
            norm: (m.arch == Arch::Decoder)
                .then(|| NormLayer::new(ids, m.norm, d, dt, trainable, device)),
            out: (init.lm_head && !m.tie_embeddings)
                .then(|| param(ids, normal::<B, 2>([d, v], dt, device), trainable)),
        }
    }
}

impl<B: ExecBackend> Model<B> {
    pub fn new(init: &ModelInit<'_>, device: &B::Device) -> Self {
        let mut parts = Vec::new();
        Self::build_parts(init, device, &mut |p| {
            parts.push(p);
            Ok::<_, std::convert::Infallible>(())
        })
        .unwrap_or_else(|never| match never {});
        Self::from_parts(parts)
    }

    /// Make the units one at a time, in the generator's order (the
    /// embedding, each layer, the head), and hand each to `unit` before the
    /// next is made: the one place units are constructed.
    pub fn build_parts<E>(
        init: &ModelInit<'_>,
        device: &B::Device,
        unit: &mut dyn FnMut(Part<B>) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut ids = Ids::new();
        unit(Part::Embed(Embed::new(&mut ids, init, device)))?;
        for i in 0..init.model.layers as usize {
            unit(Part::Layer(i, Box::new(Layer::new(&mut ids, init, device))))?;
        }
        unit(Part::Head(Head::new(&mut ids, init, device)))
    }
}

impl<B: Backend> Model<B> {
    /// The model of units handed out by [`Model::build_parts`] (in its order).
    pub fn from_parts(parts: Vec<Part<B>>) -> Self {
        let (mut embed, mut layers, mut head) = (None, Vec::new(), None);
        for p in parts {
            match p {
                Part::Embed(e) => embed = Some(e),
                Part::Layer(_, l) => layers.push(*l),
                Part::Head(h) => head = Some(h),
            }
        }
        Model {
            embed: embed.expect("build_parts makes the embedding"),
            layers,
            head: head.expect("build_parts makes the head"),
        }
    }
}

impl<B: ExecBackend> Model<B> {
    /// Every linear layer, in construction order.
    fn linears(&self) -> impl Iterator<Item = &Linear<B>> {
        self.layers.iter().flat_map(|l| l.linears())
    }

    /// Elements of the NF4 bases (QLoRA), which no parameter visitor sees.
    pub fn quantized_params(&self) -> u64 {
        self.linears().map(|l| l.quantized_params() as u64).sum()
    }

    /// Why a projection's base is unusable after a load, if one is: an NF4
    /// base could not take the weights it was loaded with (from a Hugging
    /// Face checkpoint or an rcoa checkpoint), or an rcoa checkpoint held the
    /// other kind of base (Burn drops an `Option` field whose record is
    /// `None`: a LoRA checkpoint has no NF4 bases, a QLoRA one no dense).
    pub fn quantization_error(&self) -> Option<String> {
        let mut i = 0;
        self.linears().find_map(|l| {
            i += 1;
            l.quantization_error(i)
        })
    }

    /// The whole forward to the last hidden state (after the final norm), with
    /// one graph: the reference the segmented trainer is tested against.
    pub fn hidden(&self, tokens: Tensor<B, 2, Int>, ctx: &Ctx<B>) -> Tensor<B, 3> {
        let mut x = self.embed.forward(tokens, ctx);
        for l in &self.layers {
            x = l.forward(x, ctx);
        }
        self.head.normed(x, ctx)
    }
}

// ---------------------------------------------------------------- loading

/// Where [`Model::load`] gets a parameter's values: called with rcoa's name
/// of the parameter (`layers.3.attn.q.weight`, `embed.tokens`, ...) and its
/// shape in rcoa's layout (`[in, out]` for linear weights); `None` when the
/// source has no such tensor (the source records why).
pub type Source<'a> = dyn FnMut(&str, &[usize]) -> Option<Vec<f32>> + 'a;

fn load_param<B: Backend, const D: usize>(
    p: &mut Param<Tensor<B, D>>,
    name: &str,
    src: &mut Source<'_>,
) {
    let old = p.val();
    let dims = old.dims();
    if let Some(values) = src(name, &dims) {
        let (dtype, grad, device) = (old.dtype(), old.is_require_grad(), old.device());
        let t = Tensor::<B, 1>::from_floats(values.as_slice(), &device)
            .reshape(dims)
            .cast(dtype);
        *p = Param::initialized(p.id, t.set_require_grad(grad));
    }
}

impl<B: Backend> Linear<B> {
    fn load(&mut self, name: &str, src: &mut Source<'_>) {
        let wname = format!("{name}.weight");
        if let Some(w) = &mut self.weight {
            load_param(w, &wname, src);
        }
        if let Some(q) = &mut self.nf4.0 {
            // QLoRA: the checkpoint's weight is quantized as it is loaded;
            // its fp32 values live only for this call.
            let shape = q.w.shape;
            if let Some(values) = src(&wname, &shape) {
                let double = matches!(q.w.scales, DeviceScales::Double { .. });
                let device = q.w.packed.device();
                *q = match Nf4Base::quantize(&values, shape, double, &device) {
                    Ok(n) => n,
                    Err(e) => q
                        .clone()
                        .refuse(format!("`{wname}` cannot be quantized to NF4: {e}")),
                };
            }
        }
        if let Some(b) = &mut self.bias {
            load_param(b, &format!("{name}.bias"), src);
        }
    }
}

impl<B: Backend> NormLayer<B> {
    fn load(&mut self, name: &str, src: &mut Source<'_>) {
        load_param(&mut self.weight, &format!("{name}.weight"), src);
        if let Some(b) = &mut self.bias {
            load_param(b, &format!("{name}.bias"), src);
        }
    }
}

impl<B: Backend> Embed<B> {
    /// Replace the embedding's base parameters with the source's values.
    pub fn load(&mut self, src: &mut Source<'_>) {
        load_param(&mut self.tokens, "embed.tokens", src);
        if let Some(p) = &mut self.positions {
            load_param(p, "embed.positions", src);
        }
        if let Some(n) = &mut self.norm {
            n.load("embed.norm", src);
        }
    }
}

impl<B: Backend> Layer<B> {
    /// Replace layer `i`'s base parameters (not LoRA's) with the source's values.
    pub fn load(&mut self, i: usize, src: &mut Source<'_>) {
        let n = format!("layers.{i}");
        self.norm1.load(&format!("{n}.norm1"), src);
        self.attn.q.load(&format!("{n}.attn.q"), src);
        self.attn.k.load(&format!("{n}.attn.k"), src);
        self.attn.v.load(&format!("{n}.attn.v"), src);
        self.attn.o.load(&format!("{n}.attn.o"), src);
        if let Some(q) = &mut self.attn.q_norm {
            q.load(&format!("{n}.attn.q_norm"), src);
        }
        if let Some(k) = &mut self.attn.k_norm {
            k.load(&format!("{n}.attn.k_norm"), src);
        }
        self.norm2.load(&format!("{n}.norm2"), src);
        if let Some(g) = &mut self.mlp.gate {
            g.load(&format!("{n}.mlp.gate"), src);
        }
        self.mlp.up.load(&format!("{n}.mlp.up"), src);
        self.mlp.down.load(&format!("{n}.mlp.down"), src);
    }

    /// Why a projection's base is unusable after a load (see
    /// [`Model::quantization_error`]); `first` numbers this layer's first
    /// projection.
    fn quantization_error(&self, first: usize) -> Option<String> {
        let mut i = first;
        self.linears().find_map(|l| {
            i += 1;
            l.quantization_error(i)
        })
    }

    /// The layer's NF4 bases (QLoRA), in construction order: ZeRO-3 cuts
    /// them into shards and puts the gathered ones back
    /// (`shard::zero3`).
    pub(crate) fn nf4_bases_mut(&mut self) -> impl Iterator<Item = &mut Nf4Base<B>> {
        [
            &mut self.attn.q,
            &mut self.attn.k,
            &mut self.attn.v,
            &mut self.attn.o,
        ]
        .into_iter()
        .chain(self.mlp.gate.as_mut())
        .chain([&mut self.mlp.up, &mut self.mlp.down])
        .filter_map(|l| l.nf4.0.as_mut())
    }

    pub(crate) fn linears(&self) -> impl Iterator<Item = &Linear<B>> {
        [&self.attn.q, &self.attn.k, &self.attn.v, &self.attn.o]
            .into_iter()
            .chain(&self.mlp.gate)
            .chain([&self.mlp.up, &self.mlp.down])
    }
}

impl<B: Backend> Head<B> {
    /// Replace the head's base parameters with the source's values.
    pub fn load(&mut self, src: &mut Source<'_>) {
        if let Some(n) = &mut self.norm {
            n.load("head.norm", src);
        }
        if let Some(p) = &mut self.out {
            load_param(p, "head.out", src);
        }
    }
}

impl<B: Backend> Part<B> {
    /// Replace the unit's base parameters with the source's values.
    pub fn load(&mut self, src: &mut Source<'_>) {
        match self {
            Part::Embed(e) => e.load(src),
            Part::Layer(i, l) => l.load(*i, src),
            Part::Head(h) => h.load(src),
        }
    }

    /// Why a projection's base is unusable after the unit's load (QLoRA),
    /// numbered as [`Model::quantization_error`] numbers it.
    pub fn quantization_error(&self) -> Option<String> {
        match self {
            Part::Layer(i, l) => l.quantization_error(i * l.linears().count()),
            _ => None,
        }
    }
}

impl<B: Backend> Model<B> {
    /// Replace every base parameter (not LoRA's) with the source's values,
    /// keeping ids, dtypes and trainability.
    pub fn load(&mut self, src: &mut Source<'_>) {
        self.embed.load(src);
        for (i, l) in self.layers.iter_mut().enumerate() {
            l.load(i, src);
        }
        self.head.load(src);
    }
}

// ---------------------------------------------------------------- export

/// Receives every base parameter (not LoRA's) by rcoa name, with its shape
/// and f32 values; the inverse of [`Source`].
pub type Sink<'a> = dyn FnMut(&str, Vec<usize>, Vec<f32>) + 'a;

fn export_param<B: Backend, const D: usize>(
    p: &Param<Tensor<B, D>>,
    name: &str,
    sink: &mut Sink<'_>,
) {
    let t = p.val().cast(FloatDType::F32);
    let dims = t.dims().to_vec();
    let values: Vec<f32> = t.into_data().convert::<f32>().to_vec().unwrap_or_default();
    sink(name, dims, values);
}

impl<B: Backend> Model<B> {
    /// Hand every base parameter to `sink`, in the names [`Model::load`] uses.
    pub fn export(&self, sink: &mut Sink<'_>) {
        let lin = |l: &Linear<B>, n: &str, sink: &mut Sink<'_>| {
            if let Some(w) = &l.weight {
                export_param(w, &format!("{n}.weight"), sink);
            }
            if let Some(q) = &l.nf4.0 {
                // The base as the model computes with it: dequantized.
                let t = q.w.dequantize();
                let dims = t.dims().to_vec();
                sink(&format!("{n}.weight"), dims, host_f32(t));
            }
            if let Some(b) = &l.bias {
                export_param(b, &format!("{n}.bias"), sink);
            }
        };
        let norm = |l: &NormLayer<B>, n: &str, sink: &mut Sink<'_>| {
            export_param(&l.weight, &format!("{n}.weight"), sink);
            if let Some(b) = &l.bias {
                export_param(b, &format!("{n}.bias"), sink);
            }
        };
        export_param(&self.embed.tokens, "embed.tokens", sink);
        if let Some(p) = &self.embed.positions {
            export_param(p, "embed.positions", sink);
        }
        if let Some(n) = &self.embed.norm {
            norm(n, "embed.norm", sink);
        }
        for (i, l) in self.layers.iter().enumerate() {
            let n = format!("layers.{i}");
            norm(&l.norm1, &format!("{n}.norm1"), sink);
            lin(&l.attn.q, &format!("{n}.attn.q"), sink);
            lin(&l.attn.k, &format!("{n}.attn.k"), sink);
            lin(&l.attn.v, &format!("{n}.attn.v"), sink);
            lin(&l.attn.o, &format!("{n}.attn.o"), sink);
            if let Some(q) = &l.attn.q_norm {
                norm(q, &format!("{n}.attn.q_norm"), sink);
            }
            if let Some(k) = &l.attn.k_norm {
                norm(k, &format!("{n}.attn.k_norm"), sink);
            }
            norm(&l.norm2, &format!("{n}.norm2"), sink);
            if let Some(g) = &l.mlp.gate {
                lin(g, &format!("{n}.mlp.gate"), sink);
            }
            lin(&l.mlp.up, &format!("{n}.mlp.up"), sink);
            lin(&l.mlp.down, &format!("{n}.mlp.down"), sink);
        }
        if let Some(n) = &self.head.norm {
            norm(n, "head.norm", sink);
        }
        if let Some(p) = &self.head.out {
            export_param(p, "head.out", sink);
        }
    }
}

#[cfg(test)]
mod qlora_tests {
    use super::*;
    use crate::testing::tiny_plan;
    use burn::module::{ModuleMapper, ModuleVisitor};
    use burn::optim::GradientsParams;
    use burn::tensor::{TensorData, Tolerance};
    use rcoa_compiler::spec::Dtype;
    use std::collections::HashMap;

    type Ad = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

    fn adapter(kind: AdapterKind) -> AdapterSpec {
        AdapterSpec {
            kind,
            rank: 4,
            alpha: 8.0,
            targets: Proj::ALL.to_vec(),
            dropout: 0.0,
            base: if kind == AdapterKind::Qlora {
                Dtype::Nf4
            } else {
                Dtype::Fp32
            },
        }
    }

    /// Gives every trainable parameter values fixed by its id (LoRA's B is
    /// zero at initialisation, which would hide the adapter path).
    struct Fill;
    impl<B: Backend> ModuleMapper<B> for Fill {
        fn map_float<const D: usize>(&mut self, p: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
            let (id, t, _) = p.consume();
            if !t.is_require_grad() {
                return Param::initialized(id, t);
            }
            let shape = t.shape();
            let seed = id.val();
            let v: Vec<f32> = (0..shape.num_elements() as u64)
                .map(|i| ((i * 7919 + seed * 104_729) % 1001) as f32 / 1000.0 - 0.5)
                .map(|x| x * 0.2)
                .collect();
            let t = Tensor::<B, 1>::from_floats(v.as_slice(), &t.device()).reshape(shape);
            Param::initialized(id, t.require_grad())
        }
    }

    /// Gradients of the trainable parameters by id, and how many parameters
    /// (trainable or not) got one.
    fn grads_by_id(m: &Model<Ad>, g: &GradientsParams) -> (HashMap<u64, Vec<f32>>, usize) {
        struct V<'a>(&'a GradientsParams, HashMap<u64, Vec<f32>>, usize);
        impl ModuleVisitor<Ad> for V<'_> {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Ad, D>>) {
                if let Some(g) = self.0.get::<burn::backend::NdArray<f32>, D>(p.id) {
                    self.2 += 1;
                    assert!(p.is_require_grad(), "a frozen parameter got a gradient");
                    self.1.insert(p.id.val(), g.into_data().to_vec().unwrap());
                }
            }
        }
        let mut v = V(g, HashMap::new(), 0);
        m.visit(&mut v);
        (v.1, v.2)
    }

    /// A QLoRA model's forward equals that of a LoRA model whose dense base
    /// holds the dequantized NF4 weights (fp32 tolerance), and so do the
    /// adapters' gradients; the NF4 base is no parameter, gets no gradient,
    /// and no projection keeps a dense weight.
    #[test]
    fn qlora_forward_and_gradients_equal_the_dequantized_model() {
        let _serial = crate::tests::serial();
        let device = Default::default();
        let spec = tiny_plan().model;
        let init = |a: &AdapterSpec, device: &_| {
            <Ad as Backend>::seed(device, 7);
            Model::<Ad>::new(&ModelInit::f32(&spec, Some(a), true), device).map(&mut Fill)
        };
        let qa = adapter(AdapterKind::Qlora);
        let q = init(&qa, &device);
        let mut dense: HashMap<String, Vec<f32>> = HashMap::new();
        q.export(&mut |n, _, v| {
            dense.insert(n.to_string(), v);
        });
        let mut d = init(&adapter(AdapterKind::Lora), &device);
        d.load(&mut |n, _| dense.get(n).cloned());

        let linears: Vec<&Linear<Ad>> = q.linears().collect();
        assert_eq!(linears.len(), 2 * 7);
        assert!(linears
            .iter()
            .all(|l| l.weight.is_none() && l.nf4.0.is_some()));
        let (h, f, kv) = (32, 64, 2 * 8);
        assert_eq!(
            q.quantized_params(),
            2 * (h * h * 2 + h * kv * 2 + 3 * h * f) as u64
        );
        // The base really is 4-bit: the dequantized weights differ from the
        // random draw, which the LoRA model built from the same seed holds.
        let fresh = init(&adapter(AdapterKind::Lora), &device);
        let w0 = fresh.layers[0].attn.q.weight.as_ref().unwrap().val();
        let wq = d.layers[0].attn.q.weight.as_ref().unwrap().val();
        assert!((w0 - wq).abs().max().into_scalar() > 1e-4);

        let ctx = Ctx::<Ad>::new(&spec, Some(&qa), 16, FloatDType::F32, false, &device);
        let ids: Vec<i64> = (0..32).map(|i| (i * 37 % 64) as i64).collect();
        let tokens = Tensor::<Ad, 2, Int>::from_data(TensorData::new(ids, [2, 16]), &device);
        let up = Tensor::<Ad, 3>::random([2, 16, 32], Distribution::Normal(0.0, 1.0), &device);
        let hq = q.hidden(tokens.clone(), &ctx);
        let hd = d.hidden(tokens, &ctx);
        hq.clone().inner().into_data().assert_approx_eq(
            &hd.clone().inner().into_data(),
            Tolerance::<f32>::absolute(2e-5),
        );

        let gq = GradientsParams::from_grads((hq * up.clone()).sum().backward(), &q);
        let gd = GradientsParams::from_grads((hd * up).sum().backward(), &d);
        let (gq, nq) = grads_by_id(&q, &gq);
        let (gd, _) = grads_by_id(&d, &gd);
        // Only LoRA's A and B: 2 per projection.
        assert_eq!(nq, 2 * 2 * 7);
        assert_eq!(gq.len(), gd.len());
        for (id, a) in &gq {
            let b = &gd[id];
            let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-4 * scale, "param {id}: {x} vs {y}");
            }
        }
    }

    /// A Hugging Face checkpoint loaded into a QLoRA model is quantized as
    /// it loads: every projection holds exactly NF4 (double-quantized) of the
    /// checkpoint's weight, and the unquantized tensors hold its values.
    #[test]
    fn hf_checkpoint_is_quantized_as_it_loads() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let text =
            "model hf \"tests/fixtures/hf/llama\"\nhardware { gpu = h100-80gb }\nprecision fp32\n\
                    train {\n  seq_len = 16\n  global_batch = 4\n}\ntarget burn\n";
        let file = rcoa_grammar::parse("fixture.plan", text).expect("plan parses");
        let cx = rcoa_compiler::resolve::ResolveContext::new("fixture.plan", text, root);
        let spec = rcoa_compiler::resolve::resolve(&file, &cx)
            .expect("plan resolves")
            .model;
        let dir = std::path::PathBuf::from(spec.weights.clone().unwrap());
        let device = Default::default();
        let build = |a: Option<&AdapterSpec>| {
            let mut m = Model::<Ad>::new(&ModelInit::f32(&spec, a, true), &device);
            crate::weights::load_into(&mut m, &spec, &dir).unwrap();
            m
        };
        let dense = build(None);
        let q = build(Some(&adapter(AdapterKind::Qlora)));
        assert!(q.quantization_error().is_none());
        let mut values: HashMap<String, (Vec<usize>, Vec<f32>)> = HashMap::new();
        dense.export(&mut |n, s, v| {
            values.insert(n.to_string(), (s, v));
        });
        let mut seen = 0;
        q.export(&mut |n, s, v| {
            let (ds, dv) = &values[n];
            assert_eq!(&s, ds, "{n}");
            let projection = n.contains(".attn.") || n.contains(".mlp.");
            if projection {
                let nf4 = crate::quant::nf4::Nf4Weight::quantize(dv, [s[0], s[1]], true).unwrap();
                assert_eq!(
                    v,
                    nf4.dequantize().unwrap(),
                    "{n}: NF4 of the checkpoint's weight"
                );
                assert_ne!(&v, dv, "{n} is quantized");
                seen += 1;
            } else {
                assert_eq!(&v, dv, "{n} keeps the checkpoint's values");
            }
        });
        assert_eq!(seen, 7 * spec.layers as usize);
    }

    /// A QLoRA model's record restores its NF4 bases into a model built
    /// from another seed; a LoRA model's record is refused by name.
    #[test]
    fn records_restore_the_nf4_bases() {
        let _serial = crate::tests::serial();
        let device = Default::default();
        let spec = tiny_plan().model;
        let build = |a: &AdapterSpec, seed: u64| {
            <Ad as Backend>::seed(&device, seed);
            Model::<Ad>::new(&ModelInit::f32(&spec, Some(a), true), &device)
        };
        let qa = adapter(AdapterKind::Qlora);
        let bases = |m: &Model<Ad>| -> Vec<crate::quant::nf4::Nf4Weight> {
            m.linears()
                .map(|l| l.nf4().unwrap().w.to_host().unwrap())
                .collect()
        };
        let saved = build(&qa, 1);
        let other = build(&qa, 2);
        assert_ne!(bases(&saved), bases(&other));
        let loaded = other.load_record(saved.clone().into_record());
        assert!(loaded.quantization_error().is_none());
        assert_eq!(bases(&loaded), bases(&saved));

        let lora = build(&adapter(AdapterKind::Lora), 1);
        let wrong = build(&qa, 2).load_record(lora.into_record());
        let e = wrong.quantization_error().expect("refused");
        assert!(e.contains("lora vs qlora"), "{e}");
    }

    /// With QLoRA the segmented step (checkpointed layers run on the inner
    /// backend through `valid()`, then recomputed) gives one graph's
    /// gradients, and the trainer counts the NF4 base as frozen parameters.
    #[test]
    fn qlora_checkpointed_gradients_equal_the_full_graph() {
        let _serial = crate::tests::serial();
        let mut plan = tiny_plan();
        plan.adapter = Some(adapter(AdapterKind::Qlora));
        let opts = crate::RunOptions {
            steps: 1,
            seed: 3,
            data: None,
            ..Default::default()
        };
        let mut t = crate::testing::trainer::<Ad>(&plan, &opts, 3).unwrap();
        let (all, trainable) = t.param_counts();
        let lora = 2 * 4 * (2 * (32 + 32) + 2 * (32 + 16) + 2 * (32 + 64) + (64 + 32));
        assert_eq!(trainable, lora);
        let dense = 64 * 32 * 2 + 2 * 2 * 32 + 32;
        assert_eq!(
            all,
            lora + dense + 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64)
        );
        let batch = t.batcher.batch(0, 0);
        let (_, reference) = t.reference_grads(&batch, 0, 0);
        let reference = t.flatten(&reference);
        t.set_checkpointed(vec![true, false]);
        let mut acc = GradientsParams::new();
        let mut probe = crate::memory::RssProbe::new();
        t.micro_step(&batch, 0, 0, 1.0, &mut acc, &mut probe);
        let got = t.flatten(&acc);
        assert_eq!(got.len(), reference.len());
        for (a, b) in got.iter().zip(&reference) {
            let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
            for (x, y) in a.iter().zip(b) {
                assert!((x - y).abs() <= 1e-4 * scale, "{x} vs {y}");
            }
        }
    }

    /// Beside an fp32 master the model is built with its trainable
    /// parameters in the master's dtype and its frozen ones (an adapter's
    /// base, embeddings, norms, head) in the storage dtype, since nothing
    /// steps them: under LoRA the base is no second copy. F64 stands in for
    /// the master and F32 for 16 bits (ndarray has no bf16).
    #[test]
    fn frozen_parameters_are_made_in_their_own_dtype() {
        let spec = tiny_plan().model;
        for kind in [None, Some(AdapterKind::Lora), Some(AdapterKind::Qlora)] {
            let a = kind.map(adapter);
            let m = Model::<Ad>::new(
                &ModelInit {
                    model: &spec,
                    adapter: a.as_ref(),
                    lm_head: true,
                    dtype: FloatDType::F64,
                    frozen: FloatDType::F32,
                },
                &Default::default(),
            );
            struct Count(HashMap<(bool, String), usize>);
            impl ModuleVisitor<Ad> for Count {
                fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<Ad, D>>) {
                    let key = (p.is_require_grad(), format!("{:?}", p.val().dtype()));
                    *self.0.entry(key).or_default() += 1;
                }
            }
            let mut c = Count(HashMap::new());
            m.visit(&mut c);
            let dtypes = |trainable: bool| -> Vec<&String> {
                c.0.keys()
                    .filter(|(t, _)| *t == trainable)
                    .map(|(_, d)| d)
                    .collect()
            };
            assert_eq!(dtypes(true), ["F64"], "{kind:?}: {:?}", c.0);
            if kind.is_some() {
                assert_eq!(dtypes(false), ["F32"], "{kind:?}: {:?}", c.0);
            } else {
                assert!(dtypes(false).is_empty(), "{:?}", c.0);
            }
        }
    }

    /// Set in the child process of [`dropout_keeps_a_byte_an_element`].
    const DROPOUT_CHILD: &str = "RCOA_DROPOUT_MEMORY_CHILD";

    /// Measures in a process of its own: other tests allocate meanwhile.
    #[test]
    fn dropout_keeps_a_byte_an_element() {
        crate::testing::run_ignored_in_child(
            "model::qlora_tests::dropout_memory_in_child",
            DROPOUT_CHILD,
        );
    }

    /// What dropout's autodiff node keeps for the backward is its 1-byte mask
    /// (the memory model's `dropout_mask`), not keep factors in x's dtype;
    /// and its gradient is the kept elements' scale, zero where dropped.
    #[test]
    #[ignore = "run in its own process by dropout_keeps_a_byte_an_element"]
    fn dropout_memory_in_child() {
        use crate::memory::{AllocProbe, MemoryProbe};
        assert!(
            std::env::var_os(DROPOUT_CHILD).is_some(),
            "run by its parent test"
        );
        let spec = tiny_plan().model;
        let device = Default::default();
        let ctx = Ctx::<Ad>::new(&spec, None, 8, FloatDType::F32, false, &device);
        let n = 1 << 18;
        let x = Tensor::<Ad, 2>::ones([64, n / 64], &device).require_grad();
        let held = |f: &dyn Fn() -> Tensor<Ad, 2>| {
            let mut probe = AllocProbe::new().expect("the test binary counts allocations");
            probe.begin_step();
            let y = f();
            let live = probe.sample();
            (y, live, probe.step_peak())
        };
        let _ = held(&|| dropout(x.clone(), 0.25, &ctx)); // first-use buffers
        let (y, live, peak) = held(&|| dropout(x.clone(), 0.25, &ctx));
        // The output (4 bytes an element) and the mask (1), plus small change.
        let out = 4 * n as u64;
        assert!(
            live >= out + n as u64 && live <= out + n as u64 + (64 << 10),
            "{live} bytes held for {n} elements"
        );
        // The fp32 draw (4 bytes an element) is freed once compared into the
        // mask, before the output is made, so on the CPU it adds nothing to
        // the peak. Under Burn's fusion on CUDA the comparison, `mask_fill`
        // and the scaling are one kernel that reads the draw while it writes
        // the output: the memory model charges the draw on top of the output
        // there (`compiler/src/memory/build.rs`, `dropout_draw`).
        assert!(
            peak <= out + n as u64 + (64 << 10),
            "peak {peak} for {n} elements"
        );
        let g = y.clone().sum().backward();
        let dx: Vec<f32> = x.grad(&g).unwrap().into_data().to_vec().unwrap();
        let yv: Vec<f32> = y.inner().into_data().to_vec().unwrap();
        let dropped = yv.iter().filter(|v| **v == 0.0).count() as f64 / n as f64;
        assert!((dropped - 0.25).abs() < 0.01, "dropped {dropped}");
        for (d, v) in dx.iter().zip(&yv) {
            assert_eq!(d, v, "the gradient of sum(y) is y's scale where kept");
        }
    }
}

#[cfg(test)]
mod ctx_tests {
    use super::*;

    type Ad = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

    /// RoPE rotates each pair (i, i + d/2) of a head by position · θ_i, θ_i = base^(-2i/d):
    /// the flip-based form against that definition computed on the host, forward and
    /// backward (the backward of a rotation is the rotation by the opposite angle), in
    /// both orders of the heads and positions.
    #[test]
    fn rope_rotates_each_pair_by_its_angle_forward_and_backward() {
        let mut spec = crate::testing::tiny_plan().model;
        spec.numerics.rope_theta = 500.0;
        let d = spec.head_dim as usize;
        // (rotated values, frequency divisor, factor on cos and sin): whole heads; the
        // first half of each (Phi-4-mini's layout) under LongRoPE's short factors.
        let half_rotated = spec.numerics.clone();
        let longrope = rcoa_compiler::spec::Numerics {
            rotary_dims: Some(d as u64 / 2),
            rope_scaling: Some(rcoa_compiler::spec::RopeScaling::LongRope {
                short_factor: vec![2.0; d / 4],
                long_factor: vec![3.0; d / 4],
                original_max_positions: 8,
                attention_factor: 1.5,
            }),
            ..half_rotated
        };
        for (numerics, r, divisor, scale) in [
            (spec.numerics.clone(), d, 1.0, 1.0),
            (longrope, d / 2, 2.0, 1.5),
        ] {
            let spec = ModelSpec {
                numerics,
                ..spec.clone()
            };
            rope_matches(&spec, r, divisor, scale);
        }
    }

    fn rope_matches(spec: &ModelSpec, r: usize, divisor: f64, scale: f64) {
        let (b, h, s, d) = (2, 3, 5, spec.head_dim as usize);
        let device = Default::default();
        let ctx = Ctx::<Ad>::new(spec, None, s, FloatDType::F32, false, &device);
        let tables = ctx.rope.clone().expect("a decoder has RoPE");
        let values: Vec<f32> = (0..b * h * s * d)
            .map(|i| ((i * 7919 % 1013) as f32 / 1013.0 - 0.5) * 3.0)
            .collect();
        let x = Tensor::<Ad, 1>::from_floats(values.as_slice(), &device)
            .reshape([b, h, s, d])
            .require_grad();
        let up: Vec<f32> = (0..b * h * s * d)
            .map(|i| (i * 104_729 % 997) as f32 / 997.0 - 0.5)
            .collect();
        let out = rope(x.clone(), &tables, SeqAxis::Third);
        // The flash path's order, `[b, seq, heads, d]`, rotates the same pairs by the same
        // angles.
        let second = rope(x.clone().swap_dims(1, 2), &tables, SeqAxis::Second).swap_dims(1, 2);
        assert_eq!(second.into_data(), out.clone().into_data());
        let grads = (out.clone()
            * Tensor::<Ad, 1>::from_floats(up.as_slice(), &device).reshape([b, h, s, d]))
        .sum()
        .backward();
        let out: Vec<f32> = out.into_data().to_vec().unwrap();
        let grad: Vec<f32> = x.grad(&grads).unwrap().into_data().to_vec().unwrap();

        let half = r / 2;
        let rotate = |v: &[f32], row: usize, sign: f64| -> Vec<f64> {
            let p = (row / d) % s;
            // The values past the rotated ones pass through, unscaled.
            let mut out: Vec<f64> = v[row..row + d].iter().map(|&x| x as f64).collect();
            for i in 0..half {
                let theta = 500f64.powf(-2.0 * i as f64 / r as f64) / divisor;
                let (sn, c) = (p as f64 * theta).sin_cos();
                let (x1, x2) = (v[row + i] as f64, v[row + half + i] as f64);
                out[i] = scale * (x1 * c - sign * x2 * sn);
                out[half + i] = scale * (x2 * c + sign * x1 * sn);
            }
            out
        };
        for row in (0..values.len()).step_by(d) {
            let want = rotate(&values, row, 1.0);
            let want_grad = rotate(&up, row, -1.0);
            for j in 0..d {
                assert!(
                    (out[row + j] as f64 - want[j]).abs() < 1e-5,
                    "rotating {r}: out[{}]",
                    row + j
                );
                assert!(
                    (grad[row + j] as f64 - want_grad[j]).abs() < 1e-5,
                    "rotating {r}: grad[{}]",
                    row + j
                );
            }
        }
    }

    /// With `attention = flash` the kernels mask the future themselves: no `[seq, seq]` bias
    /// exists. The inner backend's context is the autodiff one's, tables and all.
    #[test]
    fn flash_builds_no_causal_bias_and_the_inner_context_is_the_same() {
        let spec = crate::testing::tiny_plan().model;
        assert_eq!(spec.arch, Arch::Decoder);
        let device = Default::default();
        let eager = Ctx::<Ad>::new(&spec, None, 8, FloatDType::F32, false, &device);
        let flash = Ctx::<Ad>::new(&spec, None, 8, FloatDType::F32, true, &device);
        assert!(flash.flash && flash.bias.is_none());
        let bias = eager
            .bias
            .clone()
            .expect("a decoder's eager attention has its bias");
        assert_eq!(bias.dims(), [1, 1, 8, 8]);
        let inner = eager.inner();
        let values =
            |t: Tensor<burn::backend::NdArray<f32>, 4>| t.into_data().to_vec::<f32>().unwrap();
        assert_eq!(values(inner.bias.unwrap()), values(bias.inner()));
        let (t, it) = (eager.rope.unwrap(), inner.rope.unwrap());
        assert_eq!(t.cos.inner().into_data(), it.cos.into_data());
        assert_eq!(t.sin.inner().into_data(), it.sin.into_data());
        assert_eq!(
            (inner.flash, inner.selective, inner.causal),
            (false, false, true)
        );
    }
}

#[cfg(test)]
mod padding_tests {
    use super::*;

    type Ad = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

    /// The rows of the token table's gradient: `(pad row, every other row used)`, each
    /// as the largest magnitude in it, after one backward of a model whose lookup has
    /// `padding_idx` 3 and whose batch holds token 3.
    fn table_grad(tied: bool, padding: Option<u64>) -> (f32, f32) {
        // Models draw their weights from the backend's one generator.
        let _serial = crate::tests::serial();
        let mut spec = crate::testing::tiny_plan().model;
        spec.tie_embeddings = tied;
        spec.numerics.padding_idx = padding;
        let device = Default::default();
        let init = ModelInit::f32(&spec, None, true);
        let model = Model::<Ad>::new(&init, &device);
        let ids = [5i64, 3, 9, 3, 7, 11];
        let tokens = Tensor::<Ad, 2, Int>::from_data(
            burn::tensor::TensorData::new(ids.to_vec(), [1, 6]),
            &device,
        );
        let ctx = Ctx::<Ad>::new(&spec, None, 6, FloatDType::F32, false, &device);
        let logits = model
            .head
            .logits(model.hidden(tokens, &ctx), &model.embed, &ctx);
        let grads = logits.powi_scalar(2).mean().backward();
        let g = model
            .embed
            .tokens
            .val()
            .grad(&grads)
            .expect("the table has a gradient");
        let d = spec.hidden as usize;
        let g: Vec<f32> = g.into_data().to_vec().unwrap();
        let row = |r: usize| {
            g[r * d..(r + 1) * d]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()))
        };
        let others = [5, 9, 7, 11].into_iter().map(row).fold(f32::MAX, f32::min);
        (row(3), others)
    }

    /// `nn.Embedding(padding_idx)`: the pad token's row gets no gradient from the lookup
    /// (the rows of the other tokens in the batch do); a tied head still gives it one, as
    /// PyTorch's tied weight gets the head's.
    #[test]
    fn the_padding_row_gets_no_gradient_from_the_lookup() {
        let (pad, others) = table_grad(false, Some(3));
        assert_eq!(pad, 0.0);
        assert!(others > 0.0);
        let (pad, _) = table_grad(false, None);
        assert!(pad > 0.0, "without padding_idx the row trains");
        let (pad, _) = table_grad(true, Some(3));
        assert!(pad > 0.0, "a tied head's gradient reaches the row");
    }
}
