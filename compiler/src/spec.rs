//! The resolved plan: every name looked up, every unit turned into bytes or
//! counts, every default applied and every constraint of `DSL.md` checked.
//!
//! A `Spec` is what the resolver promises the rest of the compiler: numbers
//! are consistent (heads divisible by kv_heads, dimensions positive, ...), so
//! later stages do not re-validate. Values the user left to the compiler are
//! [`Choice::Auto`]; the passes turn them into [`Choice::Fixed`] and the
//! lowered plan ([`crate::lowered`]) holds only concrete values.

use serde::{Deserialize, Serialize};

/// A value the user fixed, or left to the compiler (`auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Choice<T> {
    Auto,
    Fixed(T),
}

impl<T: Copy> Choice<T> {
    pub fn fixed(self) -> Option<T> {
        match self {
            Choice::Auto => None,
            Choice::Fixed(v) => Some(v),
        }
    }
    pub fn is_auto(&self) -> bool {
        matches!(self, Choice::Auto)
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spec {
    pub model: ModelSpec,
    pub adapter: Option<AdapterSpec>,
    pub hardware: HardwareSpec,
    pub precision: PrecisionSpec,
    pub optimizer: OptimizerSpec,
    pub train: TrainSpec,
    pub parallel: ParallelSpec,
    pub fit: FitSpec,
    pub target: Target,
    /// `optimizer { in_backward = true }` (torchtune's `optimizer_in_bwd`): each
    /// parameter's step runs as soon as its gradient is produced, which is then freed.
    /// Kept out of [`OptimizerSpec`] (the executors' lowered plan): no executor that reads
    /// it runs this (`crate::executed`).
    #[serde(default, skip_serializing_if = "is_false")]
    pub optimizer_in_backward: bool,
    /// Values the plan left out that resolve filled in from other values
    /// (`model.mlp = swiglu`, why), for `--explain`.
    pub defaults: Vec<(String, String)>,
    /// DeepSpeed's ZeRO sizes where the run sets them otherwise than rcoa writes them
    /// (`rcoa validate`, for runs left to DeepSpeed's defaults); no plan text sets it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deepspeed_zero: Option<crate::profile::engines::deepspeed::ZeroSettings>,
}

impl Spec {
    pub fn gpu_count(&self) -> u64 {
        self.hardware.gpus_per_node * self.hardware.nodes
    }

    /// The ZeRO sizes a `target deepspeed` run of this plan uses.
    pub fn deepspeed_zero(&self) -> crate::profile::engines::deepspeed::ZeroSettings {
        self.deepspeed_zero.unwrap_or_else(|| {
            crate::profile::engines::deepspeed::ZeroSettings::rcoa(self.model.hidden)
        })
    }
}

// ---------------------------------------------------------------- model

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arch {
    Decoder,
    Encoder,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Mlp {
    Swiglu,
    Gelu,
    /// Megatron's `squared_relu`: `relu(x) ** 2` between two matmuls (no gate).
    SquaredRelu,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Norm {
    Rmsnorm,
    Layernorm,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Positions {
    Rope,
    Learned,
}

/// The architecture of the model being trained.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelSpec {
    /// Preset name, `hf:<path>`, or `custom`.
    pub name: String,
    pub arch: Arch,
    pub layers: u64,
    pub hidden: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    /// Intermediate size of the MLP.
    pub ffn: u64,
    pub mlp: Mlp,
    pub norm: Norm,
    pub positions: Positions,
    pub vocab: u64,
    pub max_positions: u64,
    pub tie_embeddings: bool,
    /// Mixture of experts: experts per layer (1 = dense).
    pub experts: u64,
    pub experts_per_token: u64,
    /// Dropout probability (0 = no dropout masks are kept).
    pub dropout: f64,
    /// The numerics a Hugging Face config fixes; presets and custom models
    /// keep the defaults (and old lowered plans without them still read).
    #[serde(default, skip_serializing_if = "Numerics::is_default")]
    pub numerics: Numerics,
    /// Absolute folder of a Hugging Face checkpoint (`model.safetensors` or a
    /// sharded index) to start from; `None`: random initialisation.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<String>,
}

impl ModelSpec {
    /// The dropout probability at the embeddings' output (0 where the family has none).
    pub fn embedding_dropout(&self) -> f64 {
        self.dropout_where(self.numerics.dropout_sites.embedding)
    }

    /// The dropout probability on each residual branch.
    pub fn residual_dropout(&self) -> f64 {
        self.dropout_where(self.numerics.dropout_sites.residual)
    }

    /// The dropout probability on the attention probabilities.
    pub fn attention_dropout(&self) -> f64 {
        self.dropout_where(self.numerics.dropout_sites.attention)
    }

    fn dropout_where(&self, site: bool) -> f64 {
        if site {
            self.dropout
        } else {
            0.0
        }
    }

    /// Which projections have biases: as the plan says, else as the families rcoa knows:
    /// LayerNorm models (GPT-2, BERT, XLM-R) have them all, RMSNorm models (Llama,
    /// Mistral) none.
    pub fn biases(&self) -> Biases {
        self.numerics.linear_bias.unwrap_or(self.family_biases())
    }

    /// The biases of the families rcoa knows by their norm: all with LayerNorm, none with
    /// RMSNorm (what `bias` means when the plan and the config leave it out).
    pub fn family_biases(&self) -> Biases {
        if self.norm == Norm::Layernorm {
            Biases::All
        } else {
            Biases::None
        }
    }

    /// Does projection `p` have a bias?
    pub fn bias_on(&self, p: Proj) -> bool {
        match self.biases() {
            Biases::None => false,
            Biases::Qkv => matches!(p, Proj::Q | Proj::K | Proj::V),
            Biases::All => true,
        }
    }
}

/// The linear projections that have a bias (`model { bias = .. }`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", from = "BiasesRead")]
pub enum Biases {
    /// `bias = false`: none (Llama, Mistral).
    None,
    /// `bias = qkv`: the query, key and value projections only (Qwen2).
    Qkv,
    /// `bias = true`: every attention and MLP projection (GPT-2, BERT; Megatron's
    /// `add_bias_linear`).
    All,
}

/// What a lowered plan's `linear_bias` reads from: a name, or the boolean of plans lowered
/// before `qkv` existed.
#[derive(Deserialize)]
#[serde(untagged)]
enum BiasesRead {
    Bool(bool),
    Name(BiasesName),
}

#[derive(Deserialize)]
#[serde(rename_all = "snake_case")]
enum BiasesName {
    None,
    Qkv,
    All,
}

impl From<BiasesRead> for Biases {
    fn from(r: BiasesRead) -> Biases {
        match r {
            BiasesRead::Bool(true) | BiasesRead::Name(BiasesName::All) => Biases::All,
            BiasesRead::Bool(false) | BiasesRead::Name(BiasesName::None) => Biases::None,
            BiasesRead::Name(BiasesName::Qkv) => Biases::Qkv,
        }
    }
}

impl Biases {
    /// As the plan writes it.
    pub fn as_str(self) -> &'static str {
        match self {
            Biases::None => "false",
            Biases::Qkv => "qkv",
            Biases::All => "true",
        }
    }
}

/// A rescaling of RoPE's frequencies for longer contexts, as Hugging Face configs say it
/// (`rope_scaling`, or `rope_parameters` in transformers 5). It changes no tensor's size,
/// so the memory model ignores it; `rcoa run` computes the types it knows.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum RopeScaling {
    /// `linear`: every frequency divided by `factor` (positions interpolated).
    Linear { factor: f64 },
    /// `llama3` (Llama 3.1 and later): wavelengths longer than
    /// `original_max_positions / low_freq_factor` divided by `factor`, those shorter than
    /// `original_max_positions / high_freq_factor` kept, and a blend of the two between.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_positions: u64,
    },
    /// `longrope` (Phi-3-128k, Phi-3.5, Phi-4-mini): each frequency divided by its own
    /// factor, from `short_factor` while the sequence is no longer than
    /// `original_max_positions` and from `long_factor` beyond, and cos and sin multiplied
    /// by `attention_factor` (the config's, or `sqrt(1 + ln s / ln original)` with `s` the
    /// ratio of `max_position_embeddings` to `original_max_positions`, as transformers'
    /// `_compute_longrope_parameters`). One factor per rotated pair.
    #[serde(rename = "longrope")]
    LongRope {
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        original_max_positions: u64,
        attention_factor: f64,
    },
    /// A type `rcoa run` does not compute (`dynamic`, `yarn`, ...), by name:
    /// PyTorch targets predict the plan, `target burn` refuses it.
    Other { name: String },
}

impl RopeScaling {
    /// The `rope_type` name.
    pub fn name(&self) -> &str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::LongRope { .. } => "longrope",
            RopeScaling::Other { name } => name,
        }
    }
}

/// Per-family numerical details of the forward pass.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct Numerics {
    /// Epsilon of every norm (`rms_norm_eps`, `layer_norm_epsilon`, `layer_norm_eps`).
    pub norm_eps: f64,
    /// RoPE base (`rope_theta`).
    pub rope_theta: f64,
    /// GELU with the tanh approximation (GPT-2's `gelu_new`) instead of the exact one.
    pub gelu_tanh: bool,
    /// First position id (XLM-R / RoBERTa: `pad_token_id + 1`).
    pub position_offset: u64,
    /// The projections with a bias (`model { bias = .. }`); `None`: the family's, see
    /// [`ModelSpec::biases`].
    #[serde(skip_serializing_if = "Option::is_none")]
    pub linear_bias: Option<Biases>,
    /// RoPE's frequencies rescaled (`rope_scaling`); `None`: as trained.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rope_scaling: Option<RopeScaling>,
    /// RoPE rotates the first this many values of each head and passes the rest through
    /// (`partial_rotary_factor` × head size: Phi-4-mini's 96 of 128); `None`: all of them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rotary_dims: Option<u64>,
    /// The model's norm over each head of the queries and keys, before RoPE
    /// (`model { qk_norm = true }`; Qwen3's `q_norm` and `k_norm`).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub qk_norm: bool,
    /// Each token attends to at most this many positions back (Mistral v0.1's
    /// `sliding_window`); `None`: to every earlier one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sliding_window: Option<u64>,
    /// The checkpoint keeps q, k and v as one `qkv_proj` and the MLP's gate and up as one
    /// `gate_up_proj` (Phi-3): how its tensors are named and cut, not what is computed.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub fused_projections: bool,
    /// The token whose embedding row the lookup gives no gradient (`nn.Embedding`'s
    /// `padding_idx`: a decoder config's `pad_token_id`, Phi-3's `<|endoftext|>`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub padding_idx: Option<u64>,
    /// Where the model's dropout applies (`ModelSpec::dropout`): transformers' Llama,
    /// Mistral and Qwen drop only the attention probabilities (`attention_dropout`), Phi-3
    /// the residual branches as well (`resid_pdrop`); GPT-2, BERT and the DSL's models
    /// everywhere.
    #[serde(skip_serializing_if = "DropoutSites::everywhere")]
    pub dropout_sites: DropoutSites,
}

/// The places dropout drops, each at the model's one probability.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct DropoutSites {
    /// The embeddings' output.
    pub embedding: bool,
    /// Each residual branch (the attention's and the MLP's output) before it is added.
    pub residual: bool,
    /// The attention probabilities.
    pub attention: bool,
}

impl DropoutSites {
    pub const ALL: DropoutSites = DropoutSites {
        embedding: true,
        residual: true,
        attention: true,
    };

    fn everywhere(&self) -> bool {
        *self == DropoutSites::ALL
    }
}

impl Default for DropoutSites {
    fn default() -> Self {
        DropoutSites::ALL
    }
}

impl Default for Numerics {
    fn default() -> Self {
        Numerics {
            norm_eps: 1e-5,
            rope_theta: 10000.0,
            gelu_tanh: false,
            position_offset: 0,
            linear_bias: None,
            rope_scaling: None,
            rotary_dims: None,
            qk_norm: false,
            sliding_window: None,
            fused_projections: false,
            padding_idx: None,
            dropout_sites: DropoutSites::ALL,
        }
    }
}

impl Numerics {
    pub fn is_default(&self) -> bool {
        *self == Numerics::default()
    }

    /// The sliding window where it masks anything at `seq` tokens: one as long as the
    /// sequence or longer is full attention.
    pub fn window_within(&self, seq: u64) -> Option<u64> {
        self.sliding_window.filter(|&w| w < seq)
    }
}

// ---------------------------------------------------------------- adapter

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdapterKind {
    Lora,
    Qlora,
}

/// A projection an adapter can be attached to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Proj {
    Q,
    K,
    V,
    O,
    Gate,
    Up,
    Down,
}

impl Proj {
    pub const ALL: [Proj; 7] = [
        Proj::Q,
        Proj::K,
        Proj::V,
        Proj::O,
        Proj::Gate,
        Proj::Up,
        Proj::Down,
    ];
    pub fn as_str(self) -> &'static str {
        match self {
            Proj::Q => "q",
            Proj::K => "k",
            Proj::V => "v",
            Proj::O => "o",
            Proj::Gate => "gate",
            Proj::Up => "up",
            Proj::Down => "down",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct AdapterSpec {
    pub kind: AdapterKind,
    pub rank: u64,
    pub alpha: f64,
    /// Sorted, without duplicates.
    pub targets: Vec<Proj>,
    pub dropout: f64,
    /// Storage dtype of the frozen base weights (`nf4` for QLoRA, else the params dtype).
    pub base: Dtype,
}

// ---------------------------------------------------------------- hardware

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuSpec {
    /// Catalog name, or `custom`.
    pub name: String,
    pub memory_bytes: u64,
    /// Dense bf16 tensor-core throughput, TFLOP/s (the fp32 CUDA-core rate where
    /// `bf16_tensor_cores` is false).
    pub bf16_tflops: f64,
    /// Memory bandwidth, bytes/s.
    pub bandwidth_bytes_per_s: f64,
    /// Dense fp16 tensor-core throughput with fp32 accumulation, TFLOP/s; `None` (a custom
    /// GPU, or a lowered plan from before this field): `bf16_tflops`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp16_tflops: Option<f64>,
    /// fp32 throughput of the CUDA cores (no tensor cores), TFLOP/s: what kernels of scalar
    /// FMAs reach a fraction of. `None`: see [`GpuSpec::cuda_core_tflops`].
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp32_tflops: Option<f64>,
    /// Whether bf16 (and so TF32) matmuls run on tensor cores. Volta and Turing have fp16
    /// tensor cores only: there bf16 and fp32 run on the CUDA cores at `bf16_tflops`.
    #[serde(default = "yes")]
    pub bf16_tensor_cores: bool,
    /// The most shared memory one block may take (CUDA's opt-in limit,
    /// `cudaDevAttrMaxSharedMemoryPerBlockOptin`), bytes: whether the executor's
    /// tensor-core flash kernels fit ([`crate::memory::build::burn_flash_one_pass`]).
    /// `None` (a custom GPU): assumed to fit, the memory model's safe side.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_memory_per_block_bytes: Option<u64>,
}

fn yes() -> bool {
    true
}

impl GpuSpec {
    /// A GPU known by its memory, bf16 rate and bandwidth only (a `gpu { .. }` block):
    /// fp16 at the bf16 rate, bf16 on tensor cores, its shared memory unknown.
    pub fn custom(name: &str, memory_bytes: u64, bf16_tflops: f64, bandwidth: f64) -> Self {
        GpuSpec {
            name: name.into(),
            memory_bytes,
            bf16_tflops,
            bandwidth_bytes_per_s: bandwidth,
            fp16_tflops: None,
            fp32_tflops: None,
            bf16_tensor_cores: true,
            shared_memory_per_block_bytes: None,
        }
    }

    /// Dense matmul throughput in TFLOP/s when a step computes in `compute`: fp16 at its
    /// own tensor-core rate (8 x bf16's on a V100, which has no bf16 tensor cores); fp32
    /// as TF32 at half the bf16 rate where bf16 runs on tensor cores, else at the CUDA
    /// cores' rate; fp8 at twice bf16's.
    pub fn dense_tflops(&self, compute: Dtype) -> f64 {
        match compute {
            Dtype::Fp16 => self.fp16_tflops.unwrap_or(self.bf16_tflops),
            Dtype::Fp32 | Dtype::Tf32 if self.bf16_tensor_cores => 0.5 * self.bf16_tflops,
            Dtype::Fp8 => 2.0 * self.bf16_tflops,
            _ => self.bf16_tflops,
        }
    }

    /// The CUDA cores' fp32 rate, TFLOP/s. Where it is not given: `bf16_tflops` on a GPU
    /// without bf16 tensor cores (there it is that rate), else an H100's ratio of the two
    /// (66.9 to 989.4).
    pub fn cuda_core_tflops(&self) -> f64 {
        match self.fp32_tflops {
            Some(t) => t,
            None if !self.bf16_tensor_cores => self.bf16_tflops,
            None => self.bf16_tflops * (66.9 / 989.4),
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct HardwareSpec {
    pub gpu: GpuSpec,
    pub gpus_per_node: u64,
    pub nodes: u64,
    /// Host memory per node available for offload.
    pub host_memory_bytes: Option<u64>,
    /// NVMe capacity per node available for offload.
    pub nvme_bytes: Option<u64>,
    /// GPU-to-GPU bandwidth inside a node, bytes/s.
    pub intra_node_bytes_per_s: f64,
    /// Node-to-node bandwidth per node, bytes/s.
    pub inter_node_bytes_per_s: f64,
}

// ---------------------------------------------------------------- precision

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Dtype {
    Fp32,
    /// fp32 storage, tf32 tensor-core matmuls.
    Tf32,
    Bf16,
    Fp16,
    Fp8,
    Int8,
    /// 4-bit NormalFloat (QLoRA base weights).
    Nf4,
}

impl Dtype {
    /// Storage bytes per element (nf4: half a byte, plus its block scales counted elsewhere).
    pub fn bytes(self) -> f64 {
        match self {
            Dtype::Fp32 | Dtype::Tf32 => 4.0,
            Dtype::Bf16 | Dtype::Fp16 => 2.0,
            Dtype::Fp8 | Dtype::Int8 => 1.0,
            Dtype::Nf4 => 0.5,
        }
    }
    pub fn as_str(self) -> &'static str {
        match self {
            Dtype::Fp32 => "fp32",
            Dtype::Tf32 => "tf32",
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8 => "fp8",
            Dtype::Int8 => "int8",
            Dtype::Nf4 => "nf4",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct PrecisionSpec {
    /// Weights the forward pass reads.
    pub params: Dtype,
    /// Matmuls and activations. `params = fp32, compute = bf16` is autocast.
    pub compute: Dtype,
    /// Master copy kept by the optimizer (`None`: the params are updated in place).
    pub master: Option<Dtype>,
    pub grads: Dtype,
    /// `autocast = true`: 16-bit weights trained under `torch.autocast` all the same (a
    /// model loaded in bf16 and trained with `bf16=True`): no weight copies, but the ops
    /// autocast runs in fp32 (LayerNorm, softmax, the loss) return fp32, so an encoder's
    /// residual stream and every checkpointed layer input is fp32.
    #[serde(default)]
    pub autocast: bool,
}

impl PrecisionSpec {
    /// Ops run under autocast: fp32 weights with 16-bit compute (weight copies cast per
    /// op), or 16-bit weights with `autocast = true`.
    pub fn is_autocast(&self) -> bool {
        self.params.bytes() > self.compute.bytes() || self.autocast
    }
}

// ---------------------------------------------------------------- optimizer

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerKind {
    Adamw,
    Adam,
    Adam8bit,
    Adafactor,
    Lion,
    Sgd,
    AdamMini,
}

impl OptimizerKind {
    /// Whether the Burn executor steps it only with Burn's optimizer, a parameter at a
    /// time, never over the flat shards of ZeRO and of the host optimizer: 8-bit Adam
    /// quantizes each parameter's moments on their own, Adafactor factors each matrix's
    /// second moment, Adam-mini keeps one per block of a parameter (a head, a neuron).
    pub fn per_parameter_only(self) -> bool {
        matches!(
            self,
            OptimizerKind::Adam8bit | OptimizerKind::Adafactor | OptimizerKind::AdamMini
        )
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OptimizerKind::Adamw => "adamw",
            OptimizerKind::Adam => "adam",
            OptimizerKind::Adam8bit => "adam8bit",
            OptimizerKind::Adafactor => "adafactor",
            OptimizerKind::Lion => "lion",
            OptimizerKind::Sgd => "sgd",
            OptimizerKind::AdamMini => "adam-mini",
        }
    }
}

/// How the optimizer step is implemented (as in `torch.optim`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptImpl {
    Foreach,
    Fused,
    Plain,
    /// bitsandbytes' paged optimizers (`PagedAdamW`, `PagedAdamW8bit`, `PagedLion`): their
    /// fused kernel, the state in CUDA unified memory that the driver evicts to the host
    /// when the device runs out (`memory::paged`).
    Paged,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct OptimizerSpec {
    pub kind: OptimizerKind,
    pub lr: f64,
    pub betas: (f64, f64),
    pub momentum: f64,
    pub weight_decay: f64,
    /// Dtype of the optimizer state.
    pub state: Dtype,
    pub implementation: OptImpl,
}

// ---------------------------------------------------------------- train

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Attention {
    Sdpa,
    Flash,
    Eager,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Loss {
    CausalLm,
    MaskedLm,
    Contrastive,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TrainSpec {
    pub seq_len: u64,
    /// Sequences (anchors, for contrastive with positives/negatives) per optimizer step, all GPUs.
    pub global_batch: u64,
    /// Per GPU per forward.
    pub micro_batch: Choice<u64>,
    pub grad_accum: Choice<u64>,
    pub steps: Option<u64>,
    pub attention: Attention,
    pub loss: Loss,
    /// Contrastive: positives and negatives per anchor (0, 0 = micro_batch counts sequences).
    pub positives: u64,
    pub negatives: u64,
    /// The LM loss a chunk of tokens at a time (`train { chunked_loss = .. }`); `None`:
    /// the engine's default (on for `target burn` above a 32,768-token vocabulary).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunked_loss: Option<bool>,
    /// Supervised fine-tuning on conversations: the loss only on the tokens the chat
    /// template marks as the assistant's (`{% generation %}`), as TRL's
    /// `assistant_only_loss` (`train { assistant_only_loss = true }`). It changes which
    /// tokens are scored, not the step's shapes, so the memory model ignores it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub assistant_only_loss: bool,
    /// Supervised fine-tuning and JSONL documents: whole examples binned into each
    /// sequence (best-fit decreasing, as TRL's `packing = True`), each attending only to
    /// itself, with positions restarting at each (`train { packing = true }`). The Burn
    /// executor's eager attention then adds a `[micro_batch, 1, seq, seq]` mask per
    /// micro-batch, which the memory model charges.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub packing: bool,
}

/// Vocabularies above this get the chunked LM loss by default in rcoa's executor.
pub const CHUNKED_LOSS_MIN_VOCAB: u64 = 32_768;

impl TrainSpec {
    /// Whether rcoa's executor computes the LM loss a chunk of tokens at a
    /// time for a model with `vocab` ids: as `chunked_loss` says, by default
    /// above [`CHUNKED_LOSS_MIN_VOCAB`]; never for the contrastive loss (no
    /// vocabulary head). The executor and the `burn` profile both ask here.
    pub fn chunked_loss_for(&self, vocab: u64) -> bool {
        self.loss != Loss::Contrastive
            && self.chunked_loss.unwrap_or(vocab > CHUNKED_LOSS_MIN_VOCAB)
    }

    /// Sequences encoded per counted batch item.
    pub fn sequences_per_item(&self) -> u64 {
        if self.loss == Loss::Contrastive && self.positives + self.negatives > 0 {
            1 + self.positives + self.negatives
        } else {
            1
        }
    }
}

// ---------------------------------------------------------------- parallel

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ParallelSpec {
    pub data: Choice<u64>,
    pub zero: Choice<u8>,
    pub tensor: Choice<u64>,
    pub pipeline: Choice<u64>,
    pub sequence: Choice<bool>,
    pub context: Choice<u64>,
    pub expert: Choice<u64>,
    /// Model chunks per pipeline rank (Megatron's interleaved 1F1B,
    /// `--virtual-pipeline-model-parallel-size`); 1: the plain 1F1B schedule.
    #[serde(default = "one", skip_serializing_if = "is_one")]
    pub virtual_stages: u64,
}

fn one() -> u64 {
    1
}

fn is_one(v: &u64) -> bool {
    *v == 1
}

fn is_false(v: &bool) -> bool {
    !*v
}

// ---------------------------------------------------------------- fit

#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Budget {
    Bytes(u64),
    /// Share of GPU memory, 0 < f <= 1.
    Fraction(f64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointChoice {
    None,
    Full,
    /// Recompute attention internals only.
    Selective,
    /// torchtitan's op-level selective recomputation (`selective_ac_option = "op"`): every
    /// layer recomputed, except the outputs of its attention kernel and of every other
    /// matmul, which are kept from the forward.
    SelectiveOp,
    Auto,
    /// Every Nth layer is recomputed.
    Every(u64),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OffloadWhat {
    Optimizer,
    Params,
    Grads,
    Activations,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OffloadTo {
    Cpu,
    Nvme,
}

/// One thing the compiler may move off the GPU, and where.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Offload {
    pub what: OffloadWhat,
    pub to: OffloadTo,
}

impl std::fmt::Display for Offload {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.what {
            OffloadWhat::Optimizer => "optimizer",
            OffloadWhat::Params => "params",
            OffloadWhat::Grads => "grads",
            OffloadWhat::Activations => "activations",
        };
        let to = match self.to {
            OffloadTo::Cpu => "cpu",
            OffloadTo::Nvme => "nvme",
        };
        write!(f, "{what}:{to}")
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    Throughput,
    Memory,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct FitSpec {
    pub budget: Budget,
    /// Bytes kept out of the budget; `None`: the runtime profile decides.
    pub reserve: Option<u64>,
    pub checkpoint: CheckpointChoice,
    /// What may move off the GPU (allowed, not required). Sorted.
    pub offload: Vec<Offload>,
    /// What must move off the GPU (`must_offload`): every candidate has it. Sorted, one
    /// place per kind.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub must_offload: Vec<Offload>,
    pub objective: Objective,
}

impl FitSpec {
    /// The budget in bytes for a GPU with `gpu_memory` bytes.
    pub fn budget_bytes(&self, gpu_memory: u64) -> u64 {
        match self.budget {
            Budget::Bytes(b) => b,
            Budget::Fraction(f) => (gpu_memory as f64 * f).floor() as u64,
        }
    }
}

/// The engine the prediction is for (`docs/engines.md`): each holds different bytes for
/// the same plan, so each has its own profile (`crate::profile::Profile::for_target`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Target {
    /// rcoa's own Burn executor (`rcoa run`).
    Burn,
    /// PyTorch eager (Hugging Face modules, PEFT), data parallelism as DDP.
    Pytorch,
    /// PyTorch FSDP2 (`fully_shard`) with `MixedPrecisionPolicy`.
    Fsdp,
    /// DeepSpeed's engine: ZeRO 0-3, offload, its FusedAdam and buckets.
    Deepspeed,
    /// Megatron-Core: distributed optimizer, contiguous gradient and parameter buffers.
    Megatron,
}

impl Target {
    /// Every target, in the order the language lists them.
    pub const ALL: [Target; 5] = [
        Target::Burn,
        Target::Pytorch,
        Target::Fsdp,
        Target::Deepspeed,
        Target::Megatron,
    ];

    /// The name a plan writes after `target`.
    pub fn as_str(self) -> &'static str {
        match self {
            Target::Burn => "burn",
            Target::Pytorch => "pytorch",
            Target::Fsdp => "fsdp",
            Target::Deepspeed => "deepspeed",
            Target::Megatron => "megatron",
        }
    }

    /// A PyTorch engine (every target but rcoa's Burn executor).
    pub fn is_pytorch_engine(self) -> bool {
        self != Target::Burn
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lowered plans written before `bias = qkv` said `"linear_bias": true`; they still read.
    #[test]
    fn biases_read_names_and_the_old_booleans() {
        let read = |s: &str| serde_json::from_str::<Biases>(s).unwrap();
        assert_eq!(read("true"), Biases::All);
        assert_eq!(read("false"), Biases::None);
        for b in [Biases::None, Biases::Qkv, Biases::All] {
            assert_eq!(read(&serde_json::to_string(&b).unwrap()), b);
        }
        assert!(serde_json::from_str::<Biases>("\"qk\"").is_err());
    }
}
