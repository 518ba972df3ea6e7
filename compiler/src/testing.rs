//! A builder of resolved [`Spec`]s for tests.
//!
//! Tests of the memory model, the search and the emitters need a `Spec`
//! without going through the front end. The builder starts from a realistic
//! plan — a small Llama-style decoder (8 layers, hidden 1024, 16 heads, 8 KV
//! heads) on one `h100-80gb` as the catalog describes it, fp32 weights with
//! bf16 autocast, foreach AdamW, sequences of 1024, micro-batch 8 without
//! accumulation, every parallel degree fixed at 1, ZeRO 0, no checkpointing,
//! the whole GPU as budget, for PyTorch — and each setter changes one thing,
//! so a test states only what differs. `build` checks nothing: tests may
//! build plans the compiler rejects. Not for production use.

use crate::spec::*;

/// `name: Type => path.in.spec;` becomes a setter `name(value)` of that one field.
macro_rules! setters {
    ($($name:ident: $ty:ty => $($field:ident).+;)*) => {
        $(
            #[doc = concat!("Sets `spec.", stringify!($($field).+), "`.")]
            pub fn $name(mut self, value: $ty) -> Self {
                self.spec.$($field).+ = value;
                self
            }
        )*
    };
}

/// Builds a [`Spec`] one field at a time.
#[derive(Clone, Debug)]
pub struct SpecBuilder {
    spec: Spec,
}

impl Default for SpecBuilder {
    fn default() -> Self {
        Self::new()
    }
}

impl SpecBuilder {
    /// The default plan (see the module documentation).
    pub fn new() -> Self {
        let spec = Spec {
            model: ModelSpec {
                name: "custom".into(),
                arch: Arch::Decoder,
                layers: 8,
                hidden: 1024,
                heads: 16,
                kv_heads: 8,
                head_dim: 64,
                ffn: 2816,
                mlp: Mlp::Swiglu,
                norm: Norm::Rmsnorm,
                positions: Positions::Rope,
                vocab: 32000,
                max_positions: 2048,
                tie_embeddings: false,
                experts: 1,
                experts_per_token: 1,
                dropout: 0.0,
                numerics: Default::default(),
                weights: None,
            },
            adapter: None,
            hardware: HardwareSpec {
                gpu: crate::catalog::gpu("h100-80gb")
                    .expect("the catalog has the H100")
                    .spec(),
                gpus_per_node: 1,
                nodes: 1,
                host_memory_bytes: None,
                nvme_bytes: None,
                intra_node_bytes_per_s: 900e9,
                inter_node_bytes_per_s: 50e9,
            },
            precision: PrecisionSpec {
                params: Dtype::Fp32,
                compute: Dtype::Bf16,
                master: None,
                grads: Dtype::Fp32,
                autocast: false,
            },
            optimizer: OptimizerSpec {
                kind: OptimizerKind::Adamw,
                lr: 1e-4,
                betas: (0.9, 0.95),
                momentum: 0.0,
                weight_decay: 0.0,
                state: Dtype::Fp32,
                implementation: OptImpl::Foreach,
            },
            train: TrainSpec {
                seq_len: 1024,
                global_batch: 8,
                micro_batch: Choice::Fixed(8),
                grad_accum: Choice::Fixed(1),
                steps: None,
                attention: Attention::Sdpa,
                loss: Loss::CausalLm,
                positives: 0,
                negatives: 0,
                chunked_loss: None,
                assistant_only_loss: false,
                packing: false,
            },
            parallel: ParallelSpec {
                data: Choice::Fixed(1),
                zero: Choice::Fixed(0),
                tensor: Choice::Fixed(1),
                pipeline: Choice::Fixed(1),
                sequence: Choice::Fixed(false),
                context: Choice::Fixed(1),
                expert: Choice::Fixed(1),
                virtual_stages: 1,
            },
            fit: FitSpec {
                budget: Budget::Fraction(1.0),
                reserve: None,
                checkpoint: CheckpointChoice::None,
                offload: vec![],
                must_offload: vec![],
                objective: Objective::Throughput,
            },
            target: Target::Pytorch,
            optimizer_in_backward: false,
            defaults: Vec::new(),
            deepspeed_zero: None,
        };
        SpecBuilder { spec }
    }

    pub fn build(self) -> Spec {
        self.spec
    }

    /// A BERT-style encoder: GELU MLP, LayerNorm, learned positions.
    pub fn encoder(mut self) -> Self {
        let m = &mut self.spec.model;
        m.arch = Arch::Encoder;
        m.mlp = Mlp::Gelu;
        m.norm = Norm::Layernorm;
        m.positions = Positions::Learned;
        self
    }
    pub fn model_name(mut self, name: &str) -> Self {
        self.spec.model.name = name.into();
        self
    }
    /// Attention heads and key/value heads.
    pub fn heads(mut self, heads: u64, kv_heads: u64) -> Self {
        self.spec.model.heads = heads;
        self.spec.model.kv_heads = kv_heads;
        self
    }
    pub fn gpu_name(mut self, name: &str) -> Self {
        self.spec.hardware.gpu.name = name.into();
        self
    }
    /// `nodes` nodes of `gpus_per_node` GPUs.
    pub fn nodes(mut self, nodes: u64, gpus_per_node: u64) -> Self {
        self.spec.hardware.nodes = nodes;
        self.spec.hardware.gpus_per_node = gpus_per_node;
        self
    }
    /// Weights, compute and master dtypes; gradients take the weights' dtype.
    pub fn precision(mut self, params: Dtype, compute: Dtype, master: Option<Dtype>) -> Self {
        self.spec.precision = PrecisionSpec {
            params,
            compute,
            master,
            grads: params,
            autocast: false,
        };
        self
    }
    pub fn betas(mut self, beta1: f64, beta2: f64) -> Self {
        self.spec.optimizer.betas = (beta1, beta2);
        self
    }

    setters! {
        layers: u64 => model.layers;
        hidden: u64 => model.hidden;
        head_dim: u64 => model.head_dim;
        ffn: u64 => model.ffn;
        vocab: u64 => model.vocab;
        max_positions: u64 => model.max_positions;
        tie_embeddings: bool => model.tie_embeddings;
        dropout: f64 => model.dropout;
        adapter: Option<AdapterSpec> => adapter;
        gpu_memory: u64 => hardware.gpu.memory_bytes;
        gpu_tflops: f64 => hardware.gpu.bf16_tflops;
        host_memory: Option<u64> => hardware.host_memory_bytes;
        optimizer: OptimizerKind => optimizer.kind;
        optimizer_impl: OptImpl => optimizer.implementation;
        lr: f64 => optimizer.lr;
        momentum: f64 => optimizer.momentum;
        weight_decay: f64 => optimizer.weight_decay;
        seq_len: u64 => train.seq_len;
        global_batch: u64 => train.global_batch;
        micro_batch: Choice<u64> => train.micro_batch;
        grad_accum: Choice<u64> => train.grad_accum;
        steps: Option<u64> => train.steps;
        attention: Attention => train.attention;
        loss: Loss => train.loss;
        data: Choice<u64> => parallel.data;
        zero: Choice<u8> => parallel.zero;
        tensor: Choice<u64> => parallel.tensor;
        pipeline: Choice<u64> => parallel.pipeline;
        sequence: Choice<bool> => parallel.sequence;
        budget: Budget => fit.budget;
        reserve: Option<u64> => fit.reserve;
        checkpoint: CheckpointChoice => fit.checkpoint;
        target: Target => target;
    }
}

/// A candidate on one GPU: `micro_batch` sequences, no accumulation, every parallel degree
/// 1, ZeRO 0, nothing recomputed or offloaded. A test changes what it names with struct
/// update syntax: `Candidate { data: 4, zero: 3, ..one_gpu(1) }`.
pub fn one_gpu(micro_batch: u64) -> crate::memory::Candidate {
    crate::memory::Candidate {
        micro_batch,
        grad_accum: 1,
        data: 1,
        zero: 0,
        tensor: 1,
        pipeline: 1,
        context: 1,
        sequence: false,
        checkpoint_layers: vec![],
        selective: false,
        offload: vec![],
    }
}
