//! `optimizer adam-mini` as a Burn [`SimpleOptimizer`]: Adam-mini (Zhang et
//! al., "Adam-mini: Use Fewer Learning Rates To Gain More", 2024) as the
//! authors' package (`adam-mini` 1.1.1, `Adam_mini`) steps it: Adam's first
//! moment, but one second moment per block of values that share a learning
//! rate, the mean of the squared gradient over the block.
//!
//! ```text
//! v ← β₂·v + (1−β₂)·mean_block(g²)             one value per block
//! p ← p · (1 − lr · wd)                         not for norms and biases
//! m ← β₁·m + (1−β₁)·g
//! p ← p − lr · m / (1 − β₁ᵗ) / (√v / √(1 − β₂ᵗ) + ε)
//! ```
//!
//! The blocks follow the parameter's role, as the paper partitions a
//! transformer (`blocks`): q and k one block per attention head (k per
//! key/value head); v, o, the MLP's matrices and the vocabulary head one per
//! output neuron; the embedding tables one per token (row); a norm's weight
//! one block; a bias one block per value (plain Adam). On Llama, Mistral and
//! Qwen names with `heads · head_dim = hidden` that is exactly what the
//! package does (tested on the `llama` fixture). Elsewhere rcoa keeps to the
//! roles where the package's name matching does not:
//! - a head is the model's `head_dim`: the package cuts q and k into
//!   `hidden²/heads` values, not a head when `heads · head_dim ≠ hidden`
//!   (Qwen3, Mistral-Nemo);
//! - GPT-2: the package gives `c_attn`, `attn.c_proj` and `wpe` one block
//!   each, and cuts `mlp.c_fc` / `mlp.c_proj` per input row (Conv1D keeps
//!   `[in, out]`); rcoa per head, per output neuron, per position;
//! - BERT: the package gives `intermediate.dense` one block and fails on the
//!   LayerNorm weights under `embeddings` and `output` (its per-row branch
//!   gets a vector); rcoa per output neuron, one block per norm.
//!
//! Burn's `OptimizerAdaptor` hands a step no parameter name, so each
//! parameter's blocks are written into its state before the first step
//! ([`initial_records`]); a checkpoint keeps them with the moments.
//! Weights are `[in, out]` here, `[out, in]` in torch: a neuron is a
//! column, and a head a run of `head_dim` columns.
//!
//! Memory: the first moment in the parameter's dtype (the package's
//! `zeros_like(p)`), and per block one value of the second moment. The step
//! holds one temporary of the parameter's size at a time (`g²` before its
//! block means, the new `m` beside the old, then `m` times the blocks' step
//! sizes), the gradient being consumed into `m`; the `burn` profile charges
//! that
//! (`memory::optimizer`). Only Burn's per-parameter path runs it: a flat
//! ZeRO shard would cut across blocks (`optim::Rule::for_plan` refuses it).

use crate::model::Model;
use burn::module::{Module, ModuleVisitor, Param, ParamId};
use burn::optim::record::AdaptorRecord;
use burn::optim::SimpleOptimizer;
use burn::record::Record;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::Tensor;
use rcoa_compiler::spec::ModelSpec;

/// How one parameter is cut into blocks: a `rows × cols` grid over its
/// `[rows·r, cols·c]` values (a vector is one column), each cell one block
/// of `r × c` values sharing a second moment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Blocks {
    pub rows: usize,
    pub cols: usize,
    /// Whether weight decay applies (not to norms and biases, as the package).
    pub decay: bool,
}

/// The blocks of the parameter at rcoa's module `path` (`layers.0.attn.q.weight`)
/// of shape `dims` in a model `m`; `Err` for one Adam-mini has no role for.
pub fn blocks(path: &[&str], dims: &[usize], m: &ModelSpec) -> Result<Blocks, String> {
    let name = path.join(".");
    let (d0, d1) = match *dims {
        [n] => (n, 1),
        [a, b] => (a, b),
        _ => return Err(format!("`{name}` has {} dimensions", dims.len())),
    };
    let per = |rows: usize, cols: usize, decay: bool| {
        if rows == 0 || cols == 0 || d0 % rows != 0 || d1 % cols != 0 {
            Err(format!(
                "`{name}` of shape {dims:?} does not split into {rows} × {cols} blocks"
            ))
        } else if rows > 1 && rows < d0 {
            // Runs of rows: no role has them (`spread` widens columns only).
            Err(format!("`{name}`: blocks of several rows"))
        } else {
            Ok(Blocks { rows, cols, decay })
        }
    };
    match path {
        [.., "lora", _] => Err(format!(
            "`{name}` is a LoRA factor, which has no heads or neurons to share a learning rate"
        )),
        [.., "bias"] => per(d0, d1, false),
        [.., norm, "weight"] if norm.contains("norm") => per(1, 1, false),
        ["layers", _, "attn", qk @ ("q" | "k"), "weight"] => {
            let heads = (if *qk == "q" { m.heads } else { m.kv_heads }) as usize;
            if d1 != heads * m.head_dim as usize {
                return Err(format!(
                    "`{name}` of shape {dims:?} is not {heads} heads of {}",
                    m.head_dim
                ));
            }
            per(1, heads, true)
        }
        ["layers", _, "attn", "v" | "o", "weight"]
        | ["layers", _, "mlp", _, "weight"]
        | ["head", "out"] => per(1, d1, true),
        ["embed", "tokens" | "positions"] => per(d0, 1, true),
        _ => Err(format!("Adam-mini has no block rule for `{name}`")),
    }
}

/// The hyper-parameters, and the first error a step met (a step cannot
/// return one through Burn's optimizer interface; the trainer asks
/// [`AdamMiniOptimizer::take_error`] after every step).
#[derive(Clone, Debug)]
pub struct AdamMiniOptimizer {
    pub beta_1: f64,
    pub beta_2: f64,
    pub epsilon: f64,
    /// Decoupled: `p *= 1 − lr · wd`, where the blocks allow it.
    pub weight_decay: f64,
    error: super::StepError,
}

/// One parameter's state.
#[derive(Record, Clone)]
pub struct AdamMiniState<B: Backend, const D: usize> {
    /// Steps taken.
    pub step: usize,
    /// The grid of blocks ([`Blocks`]).
    pub rows: usize,
    pub cols: usize,
    pub decay: bool,
    /// The first moment, in the parameter's layout and dtype.
    pub m: Option<Tensor<B, D>>,
    /// The second moment, one value per block: `[rows, cols]` (`[rows]` for a vector).
    pub v: Option<Tensor<B, D>>,
}

impl<B: Backend, const D: usize> AdamMiniState<B, D> {
    /// The state before the first step of a parameter cut into `b`.
    pub fn new(b: Blocks) -> Self {
        AdamMiniState {
            step: 0,
            rows: b.rows,
            cols: b.cols,
            decay: b.decay,
            m: None,
            v: None,
        }
    }
}

impl AdamMiniOptimizer {
    pub fn new(beta_1: f64, beta_2: f64, epsilon: f64, weight_decay: f64) -> Self {
        AdamMiniOptimizer {
            beta_1,
            beta_2,
            epsilon,
            weight_decay,
            error: super::StepError::default(),
        }
    }

    /// The error of a step since the last call, if any: that step left its
    /// parameter unchanged.
    pub fn take_error(&self) -> Option<String> {
        self.error.take()
    }

    fn fail(&self, why: String) {
        self.error.fail(why);
    }

    /// `param` after one step with `grad`, and the state after it.
    pub(crate) fn update<B: Backend, const D: usize>(
        &self,
        lr: f64,
        param: Tensor<B, D>,
        grad: Tensor<B, D>,
        s: AdamMiniState<B, D>,
    ) -> (Tensor<B, D>, AdamMiniState<B, D>) {
        let (b1, b2) = (self.beta_1, self.beta_2);
        let mean_sq = block_means(grad.clone().square(), s.rows, s.cols);
        let v = match s.v {
            Some(v) => v.mul_scalar(b2).add(mean_sq.mul_scalar(1.0 - b2)),
            None => mean_sq.mul_scalar(1.0 - b2),
        };
        let step = s.step + 1;
        let param = match lr * self.weight_decay {
            rate if s.decay && rate != 0.0 => param.mul_scalar(1.0 - rate),
            _ => param,
        };
        let m = match s.m {
            Some(m) => m.mul_scalar(b1).add(grad.mul_scalar(1.0 - b1)),
            None => grad.mul_scalar(1.0 - b1),
        };
        let bias_1 = 1.0 - b1.powi(step as i32);
        let bias_2 = 1.0 - b2.powi(step as i32);
        // Per block: lr / (1 − β₁ᵗ) / (√v / √(1 − β₂ᵗ) + ε).
        let size = v
            .clone()
            .sqrt()
            .div_scalar(bias_2.sqrt())
            .add_scalar(self.epsilon)
            .recip()
            .mul_scalar(lr / bias_1);
        let update = m.clone().mul(spread(size, &param.dims()));
        let state = AdamMiniState {
            step,
            m: Some(m),
            v: Some(v),
            ..s
        };
        (param.sub(update), state)
    }
}

// The step holds one temporary of the parameter's size at a time: every reshape below is
// of a tensor of one value per block (or per column), because a reshape of the parameter
// itself copies it on some backends (ndarray copies even to the same shape).

/// `[rows]` or `[rows, cols]` of D dimensions (a vector's blocks have no columns).
fn grid<const D: usize>(rows: usize, cols: usize) -> [usize; D] {
    let mut g = [1; D];
    g[0] = rows;
    if D > 1 {
        g[1] = cols;
    }
    g
}

/// The mean of `sq` over each block of a `rows × cols` grid, shaped [`grid`]. An
/// axis the blocks span whole is reduced first.
fn block_means<B: Backend, const D: usize>(
    sq: Tensor<B, D>,
    rows: usize,
    cols: usize,
) -> Tensor<B, D> {
    let sq = if rows == 1 { sq.mean_dim(0) } else { sq };
    let sq = if D > 1 && cols == 1 {
        sq.mean_dim(1)
    } else {
        sq
    };
    let dims = sq.dims();
    let c = if D > 1 { dims[1] } else { 1 };
    if dims[0] == rows && c == cols {
        return sq;
    }
    // Runs of columns (heads), `[1, heads·head_dim]` by now.
    sq.reshape([rows, dims[0] / rows, cols, c / cols])
        .mean_dim(1)
        .mean_dim(3)
        .reshape(grid::<D>(rows, cols))
}

/// Per-block values shaped [`grid`], widened to broadcast over a parameter of `dims`:
/// an axis of one block, or of one block per value, broadcasts as it is; a run of
/// columns (a head) repeats its block's value over the run.
fn spread<B: Backend, const D: usize>(x: Tensor<B, D>, dims: &[usize; D]) -> Tensor<B, D> {
    if D < 2 {
        return x;
    }
    let [rows, cols] = [x.dims()[0], x.dims()[1]];
    if cols == 1 || cols == dims[1] {
        return x;
    }
    x.reshape([rows, cols, 1])
        .repeat_dim(2, dims[1] / cols)
        .reshape(grid::<D>(rows, dims[1]))
}

impl<B: Backend> SimpleOptimizer<B> for AdamMiniOptimizer {
    type State<const D: usize> = AdamMiniState<B, D>;

    fn step<const D: usize>(
        &self,
        lr: f64,
        tensor: Tensor<B, D>,
        grad: Tensor<B, D>,
        state: Option<Self::State<D>>,
    ) -> (Tensor<B, D>, Option<Self::State<D>>) {
        match state {
            Some(s) => {
                let (p, s) = self.update(lr, tensor, grad, s);
                (p, Some(s))
            }
            None => {
                self.fail(format!(
                    "a parameter of shape {:?} has no Adam-mini blocks (its state was not made before the first step)",
                    tensor.dims()
                ));
                (tensor, None)
            }
        }
    }

    fn to_device<const D: usize>(state: Self::State<D>, device: &B::Device) -> Self::State<D> {
        AdamMiniState {
            m: state.m.map(|t| t.to_device(device)),
            v: state.v.map(|t| t.to_device(device)),
            ..state
        }
    }
}

/// The adaptor's records that carry every parameter's blocks into its first
/// step, by rcoa module path ([`blocks`]).
pub type Records<B> = Vec<(ParamId, AdaptorRecord<AdamMiniOptimizer, B>)>;

/// A fresh state for each of `model`'s parameters, cut by [`blocks`].
pub fn initial_records<B: AutodiffBackend>(
    model: &Model<B>,
    spec: &ModelSpec,
) -> Result<Records<B>, String> {
    struct Seed<'a, B: AutodiffBackend> {
        spec: &'a ModelSpec,
        path: Vec<String>,
        out: Records<B>,
        error: Option<String>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for Seed<'_, B> {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let path: Vec<&str> = self.path.iter().map(String::as_str).collect();
            match blocks(&path, &param.val().dims(), self.spec) {
                Ok(b) => {
                    let state = AdamMiniState::<B::InnerBackend, D>::new(b);
                    self.out.push((param.id, AdaptorRecord::from_state(state)));
                }
                Err(e) => {
                    self.error.get_or_insert(e);
                }
            }
        }
    }
    let mut seed = Seed {
        spec,
        path: Vec::new(),
        out: Vec::new(),
        error: None,
    };
    model.visit(&mut seed);
    match seed.error {
        Some(e) => Err(e),
        None => Ok(seed.out),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::TensorData;

    type B = burn::backend::NdArray<f32>;

    // tools/adam_mini_reference.py: the parameters, by rcoa path, torch shape, and
    // whether rcoa keeps them transposed (`[in, out]` linear weights).
    const PARAMS: &[(&str, &[usize], bool)] = &[
        ("embed.tokens", &[6, 4], false),
        ("layers.0.attn.q.weight", &[4, 4], true),
        ("layers.0.attn.k.weight", &[2, 4], true),
        ("layers.0.attn.v.weight", &[2, 4], true),
        ("layers.0.attn.q.bias", &[4], false),
        ("layers.0.norm1.weight", &[4], false),
        ("layers.0.mlp.down.weight", &[4, 3], true),
        ("head.out", &[6, 4], true),
    ];

    /// The script's `value`.
    fn value(k: usize, i: usize, t: usize) -> f32 {
        let (k, i, t) = (k as f64, i as f64, t as f64);
        ((0.7 * i + 1.3 * k + 0.5 * t).sin() * (1.0 + 0.1 * k)) as f32
    }

    /// Parameter `k`'s values at step `t` in torch's layout, and as rcoa holds them.
    fn tensor(k: usize, t: usize) -> Tensor<B, 2> {
        let (_, shape, transposed) = PARAMS[k];
        let n: usize = shape.iter().product();
        let v: Vec<f32> = (0..n).map(|i| value(k, i, t)).collect();
        let (r, c) = (shape[0], shape.get(1).copied().unwrap_or(1));
        let t = Tensor::<B, 2>::from_data(TensorData::new(v, [r, c]), &Default::default());
        if transposed {
            t.transpose()
        } else {
            t
        }
    }

    fn spec() -> ModelSpec {
        let mut m = crate::testing::tiny_plan().model;
        (m.hidden, m.heads, m.kv_heads, m.head_dim) = (4, 2, 1, 2);
        m
    }

    /// Three steps of parameter `k` at rank `D` (a vector as a vector), the values after
    /// them in rcoa's layout.
    fn three_steps<const D: usize>(o: &AdamMiniOptimizer, k: usize) -> Vec<f32> {
        let as_rank = |t: Tensor<B, 2>| -> Tensor<B, D> {
            let dims = t.dims();
            let mut shape = [dims[0]; D];
            if D == 2 {
                shape[1] = dims[1];
            }
            t.reshape(shape)
        };
        let parts: Vec<&str> = PARAMS[k].0.split('.').collect();
        let mut p = as_rank(tensor(k, 0));
        let b = blocks(&parts, &p.dims(), &spec()).unwrap();
        let mut s = AdamMiniState::<B, D>::new(b);
        for t in 1..=3 {
            (p, s) = o.update(1e-2, p, as_rank(tensor(k, t)), s);
        }
        p.into_data().to_vec().unwrap()
    }

    #[test]
    fn three_steps_match_the_reference() {
        let o = AdamMiniOptimizer::new(0.9, 0.95, 1e-8, 0.1);
        for (k, (path, shape, transposed)) in PARAMS.iter().enumerate() {
            let got = if shape.len() == 1 {
                three_steps::<1>(&o, k)
            } else {
                three_steps::<2>(&o, k)
            };
            // Back to torch's layout.
            let got: Vec<f32> = if *transposed {
                let (r, c) = (shape[0], shape[1]);
                (0..r * c).map(|i| got[(i % c) * r + i / c]).collect()
            } else {
                got
            };
            let want = REFERENCE[k];
            assert_eq!(got.len(), want.len(), "{path}");
            for (i, (g, w)) in got.iter().zip(want).enumerate() {
                assert!(
                    (g - w).abs() <= 2e-6,
                    "{path}[{i}]: {g} vs the reference's {w}"
                );
            }
        }
    }

    /// Every parameter of a Llama-like, a GPT-2-like and an encoder model has blocks
    /// (learned positions, the embedding's norm, LayerNorm and projection biases).
    #[test]
    fn every_parameter_of_each_layout_has_blocks() {
        // Models draw their weights from the backend's one generator.
        let _serial = crate::tests::serial();
        use crate::model::ModelInit;
        use burn::module::{Module, ModuleVisitor, Param};
        use rcoa_compiler::spec::{Loss, Norm, Positions};
        type A = burn::backend::Autodiff<B>;
        struct Paths(Vec<String>, Vec<String>);
        impl ModuleVisitor<A> for Paths {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.0.push(name.into());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.0.pop();
            }
            fn visit_float<const D: usize>(&mut self, _: &Param<Tensor<A, D>>) {
                self.1.push(self.0.join("."));
            }
        }
        let mut gpt2 = crate::testing::tiny_plan();
        gpt2.model.norm = Norm::Layernorm;
        gpt2.model.positions = Positions::Learned;
        gpt2.model.tie_embeddings = true;
        let encoder = crate::testing::tiny_encoder_plan(Loss::MaskedLm);
        let wanted: [&[&str]; 3] = [
            &["head.out", "layers.1.attn.k.weight", "head.norm.weight"],
            &[
                "embed.positions",
                "layers.0.attn.q.bias",
                "layers.0.norm2.bias",
            ],
            &[
                "embed.positions",
                "embed.norm.bias",
                "layers.1.mlp.down.bias",
            ],
        ];
        for (plan, wanted) in [crate::testing::tiny_plan(), gpt2, encoder]
            .iter()
            .zip(wanted)
        {
            let init = ModelInit::f32(&plan.model, None, true);
            let model = crate::model::Model::<A>::new(&init, &Default::default());
            let mut paths = Paths(Vec::new(), Vec::new());
            model.visit(&mut paths);
            for w in wanted {
                assert!(paths.1.iter().any(|p| p == w), "{w} not in {:?}", paths.1);
            }
            let records = initial_records(&model, &plan.model).unwrap();
            assert_eq!(records.len(), paths.1.len());
        }
    }

    #[test]
    fn blocks_follow_the_role() {
        // Qwen3-like: 16 heads of 128 over a hidden size of 1024, 8 kv heads.
        let mut m = spec();
        (m.hidden, m.heads, m.kv_heads, m.head_dim) = (1024, 16, 8, 128);
        let b = |p: &str, d: &[usize]| {
            let parts: Vec<&str> = p.split('.').collect();
            blocks(&parts, d, &m)
        };
        let grid = |rows, cols, decay| Ok(Blocks { rows, cols, decay });
        assert_eq!(
            b("layers.3.attn.q.weight", &[1024, 2048]),
            grid(1, 16, true)
        );
        assert_eq!(b("layers.3.attn.k.weight", &[1024, 1024]), grid(1, 8, true));
        assert_eq!(
            b("layers.3.attn.o.weight", &[2048, 1024]),
            grid(1, 1024, true)
        );
        assert_eq!(
            b("layers.3.mlp.gate.weight", &[1024, 3072]),
            grid(1, 3072, true)
        );
        assert_eq!(b("embed.tokens", &[151936, 1024]), grid(151936, 1, true));
        assert_eq!(b("head.out", &[1024, 151936]), grid(1, 151936, true));
        assert_eq!(b("layers.3.attn.q_norm.weight", &[128]), grid(1, 1, false));
        assert_eq!(b("head.norm.weight", &[1024]), grid(1, 1, false));
        assert_eq!(b("layers.0.norm2.bias", &[1024]), grid(1024, 1, false));
        assert_eq!(b("layers.0.attn.v.bias", &[1024]), grid(1024, 1, false));
        // What has no role is an error, not a guess.
        let lora = b("layers.0.attn.q.lora.a", &[1024, 8]).unwrap_err();
        assert!(lora.contains("LoRA"), "{lora}");
        let odd = b("layers.0.attn.k.weight", &[1024, 1000]).unwrap_err();
        assert!(odd.contains("is not 8 heads of 128"), "{odd}");
        let odd = b("embed.tokens", &[0, 1024]).unwrap_err();
        assert!(odd.contains("does not split"), "{odd}");
        assert!(b("layers.0.experts.0.weight", &[4, 4]).is_err());
    }

    /// A parameter whose state was never made is an error the trainer reports, and
    /// the parameter is left as it was.
    #[test]
    fn a_parameter_without_blocks_is_an_error() {
        let o = AdamMiniOptimizer::new(0.9, 0.95, 1e-8, 0.0);
        let p = tensor(0, 0);
        let (q, s) = SimpleOptimizer::<B>::step(&o, 1e-2, p.clone(), tensor(0, 1), None);
        assert!(s.is_none());
        let same: Vec<f32> = q.into_data().to_vec().unwrap();
        assert_eq!(same, p.into_data().to_vec::<f32>().unwrap());
        assert!(o.take_error().unwrap().contains("no Adam-mini blocks"));
        assert!(o.take_error().is_none());
    }

    // `python tools/adam_mini_reference.py`: the weights after three steps, torch's layout.
    const REFERENCE: &[&[f32]] = &[
        // model.embed_tokens.weight
        &[
            -0.02630511,
            0.60442823,
            0.9508895,
            0.8501326,
            0.34941235,
            -0.3155584,
            -0.83211714,
            -0.9573181,
            -0.6322098,
            -0.010287854,
            0.61647266,
            0.95329636,
            0.84133774,
            0.33480638,
            -0.32918978,
            -0.83836275,
            -0.9524699,
            -0.6199052,
            0.004210769,
            0.62634635,
            0.9534035,
            0.83274746,
            0.32043743,
            -0.3425794,
        ],
        // model.layers.0.self_attn.q_proj.weight
        &[
            1.0199624,
            0.98170614,
            0.48173794,
            -0.24479903,
            -0.8562032,
            -1.0649217,
            -0.7727907,
            -0.117204316,
            0.5957518,
            1.0271912,
            0.9755266,
            0.46505648,
            -0.26413688,
            -0.8691025,
            -1.0653156,
            -0.7604941,
        ],
        // model.layers.0.self_attn.k_proj.weight
        &[
            0.6250339,
            -0.15791896,
            -0.86660004,
            -1.1677057,
            -0.91962093,
            -0.2390242,
            0.55398935,
            1.0864531,
        ],
        // model.layers.0.self_attn.v_proj.weight
        &[
            -0.8509062,
            -1.2556572,
            -1.0698528,
            -0.38087994,
            0.48847136,
            1.1274934,
            1.2362374,
            0.76355994,
        ],
        // model.layers.0.self_attn.q_proj.bias
        &[-1.2179209, -0.550791, 0.40624768, 1.1609545],
        // model.layers.0.input_layernorm.weight
        &[0.29062897, 1.1521502, 1.4717971, 1.0992349],
        // model.layers.0.mlp.down_proj.weight
        &[
            1.5559852,
            1.2657908,
            0.38027507,
            -0.69635797,
            -1.4391353,
            -1.5050648,
            -0.86287075,
            0.18238477,
            1.1418618,
            1.5575919,
            1.2502044,
            0.35482648,
        ],
        // lm_head.weight
        &[
            0.55685025,
            -0.5867108,
            -1.4543326,
            -1.637959,
            -1.0511687,
            0.029507486,
            1.096306,
            1.6474946,
            1.4234313,
            0.53100306,
            -0.6111642,
            -1.4658915,
            -1.6304221,
            -1.0294389,
            0.0557053,
            1.1146506,
            1.6488291,
            1.4082692,
            0.5053782,
            -0.6352,
            -1.4773676,
            -1.6244905,
            -1.0075899,
            0.08319578,
        ],
    ];
}
