//! The DeepSpeed configuration JSON (`ds_config.json`) for a lowered plan.
//!
//! Mapping, decision by decision (key names as in DeepSpeed's config-json reference):
//! - batch: `train_batch_size` = global_batch, `train_micro_batch_size_per_gpu`,
//!   `gradient_accumulation_steps` — all three, so DeepSpeed checks their product
//!   against its data-parallel world size at start-up.
//! - precision: `bf16` / `fp16` (16-bit weights with DeepSpeed's fp32 master copy),
//!   `torch_autocast` (fp32 weights, 16-bit compute), `data_types.grad_accum_dtype`
//!   when gradients differ from weights, `bf16_master_weights_and_grads` /
//!   `bf16_optimizer_states` when the plan keeps no fp32 master copy.
//! - optimizer: DeepSpeed's own names (`AdamW`, `Adam` with `adam_w_mode: false` —
//!   DeepSpeed's `Adam` is AdamW unless told otherwise —, `Lion`, torch's `SGD`).
//!   Optimizers DeepSpeed has no name for (8-bit Adam, Adafactor, Adam-mini) get no
//!   block; the script passes its own (a note says so).
//! - ZeRO: the stage; bucket sizes from the hidden size the way Hugging Face's `auto`
//!   does (reduce bucket = hidden², stage-3 prefetch = 0.9 hidden², persistence
//!   threshold = 10 hidden), so communication buffers stay small next to the reserve
//!   the memory model keeps, instead of DeepSpeed's 5e8-element defaults.
//! - offload: `offload_optimizer` / `offload_param` with `device`, `pin_memory`, and
//!   for NVMe `nvme_path` plus the documented buffer defaults and an `aio` block.
//! - parallelism: `tensor_parallel.autotp_size` (AutoTP), `expert_parallel`
//!   (AutoEP), `pipeline.stages` (with a note: the stages are built by
//!   `PipelineModule` in code).
//! - recompute: `activation_checkpointing` with `number_checkpoints` and
//!   `cpu_checkpointing` for activation offload; which layers is a note.
//!
//! Refused (with `rcoa::emit_unsupported`): fp8; the optimizer step in the backward
//! (`optimizer.in_backward`: DeepSpeed steps once after the backward); interleaved
//! pipeline stages (`parallel.virtual_stages`: its PipelineEngine runs plain 1F1B);
//! pipeline > 1 with ZeRO-2/3 (DeepSpeed's PipelineEngine asserts stage < 2); pipeline with tensor parallelism
//! (needs Megatron-DeepSpeed); context parallelism and Megatron-style sequence
//! parallelism (set up in model code, not the config); AutoEP with AutoTP; offloads
//! outside what ZeRO-Offload/Infinity do (params without ZeRO-3, NVMe without
//! ZeRO-3 or without NVMe capacity, gradients on their own or to NVMe, activations
//! to NVMe or without checkpointing); optimizer-state dtypes DeepSpeed's optimizers
//! do not keep.

use super::{
    adapter_sentence, check_consistent, checkpoint_sentence, describe, offload_of, target_sentence,
    unsupported, Emission, EmitError, EmittedFile, Engine, Setting,
};
use crate::lowered::LoweredPlan;
use crate::spec::{Dtype, OffloadTo, OffloadWhat, OptImpl, OptimizerKind};
use serde_json::{json, Map, Value};

/// The file name every target uses for the DeepSpeed configuration.
pub const DS_CONFIG: &str = "ds_config.json";

/// DeepSpeed's documented default NVMe mount; written for NVMe offload and named in a note.
pub const NVME_PATH: &str = "/local_nvme";

const E: Engine = Engine::Deepspeed;

/// `ds_config.json` for `plan`.
pub fn deepspeed(plan: &LoweredPlan) -> Result<Emission, EmitError> {
    check_consistent(plan)?;
    let (config, mut notes) = config(plan)?;
    let problems = super::schema::deepspeed_keys().check(&config);
    if !problems.is_empty() {
        return Err(EmitError::Inconsistent {
            what: format!(
                "the DeepSpeed emitter wrote keys DeepSpeed does not know: {}",
                problems.join("; ")
            ),
        });
    }
    let mut contents =
        serde_json::to_string_pretty(&config).map_err(|e| EmitError::Inconsistent {
            what: format!("the DeepSpeed configuration does not serialize: {e}"),
        })?;
    contents.push('\n');
    notes.insert(0, format!("{DS_CONFIG} is for {}", describe(plan)));
    Ok(Emission {
        files: vec![EmittedFile {
            name: DS_CONFIG.into(),
            contents,
            executable: false,
        }],
        notes,
    })
}

/// The configuration as JSON, and the notes that go with it.
pub(crate) fn config(plan: &LoweredPlan) -> Result<(Value, Vec<String>), EmitError> {
    let mut notes = Vec::new();
    let mut root = Map::new();
    let r = &plan.resolved;

    root.insert("train_batch_size".into(), json!(plan.train.global_batch));
    root.insert(
        "train_micro_batch_size_per_gpu".into(),
        json!(r.micro_batch),
    );
    root.insert("gradient_accumulation_steps".into(), json!(r.grad_accum));

    schedule(plan)?;
    let master16 = precision(plan, &mut root, &mut notes)?;
    optimizer(plan, master16, &mut root, &mut notes)?;
    parallelism(plan, &mut root, &mut notes)?;
    zero(plan, &mut root, &mut notes)?;
    activation_checkpointing(plan, &mut root, &mut notes)?;

    notes.extend(
        [adapter_sentence(plan), target_sentence(plan)]
            .into_iter()
            .flatten(),
    );
    Ok((Value::Object(root), notes))
}

/// The step's schedule: DeepSpeed's engine steps its optimizer once after the backward
/// (`engine.step()` over the flat partitions), and its `PipelineEngine` runs plain 1F1B
/// (`TrainSchedule`) with one stage per rank; neither an optimizer step in the backward
/// nor interleaved stages is a setting of it, and either would hold more than predicted.
fn schedule(plan: &LoweredPlan) -> Result<(), EmitError> {
    let r = &plan.resolved;
    if r.optimizer_in_backward {
        return Err(super::script::in_backward_refusal(E, "DeepSpeed"));
    }
    if r.virtual_stages > 1 {
        return Err(unsupported(
            E,
            Setting::new("parallel", "virtual_stages"),
            r.virtual_stages,
            "DeepSpeed's PipelineEngine runs one model chunk per stage (TrainSchedule, plain 1F1B); \
             interleaved virtual stages are Megatron-Core's",
            "remove `virtual_stages`, or launch with --target torchrun for a Megatron-LM script (`target megatron`)",
        ));
    }
    Ok(())
}

fn dtype_value(d: Dtype) -> String {
    d.as_str().to_string()
}

/// Writes the precision blocks; returns whether the plan keeps 16-bit master weights.
fn precision(
    plan: &LoweredPlan,
    root: &mut Map<String, Value>,
    notes: &mut Vec<String>,
) -> Result<bool, EmitError> {
    let p = &plan.precision;
    for (setting, d) in [
        ("params", p.params),
        ("compute", p.compute),
        ("grads", p.grads),
    ] {
        if matches!(d, Dtype::Fp8 | Dtype::Int8 | Dtype::Nf4) {
            return Err(unsupported(
                E,
                Setting::new("precision", setting),
                d.as_str(),
                "DeepSpeed's configuration has no switch for this dtype (fp8 matmuls come from Transformer Engine \
                 in the model code, 4-bit and int8 weights from the adapter's quantization)",
                "use bf16 or fp16 for the engine's precision; quantized base weights belong in `adapter qlora`",
            ));
        }
    }
    let mut master16 = false;
    match p.params {
        Dtype::Bf16 | Dtype::Fp16 => {
            if p.compute != p.params {
                return Err(unsupported(
                    E,
                    Setting::new("precision", "compute"),
                    p.compute.as_str(),
                    format!(
                        "DeepSpeed computes in the dtype of its 16-bit weights; {} weights with {} compute is \
                         not a mode it has",
                        p.params.as_str(),
                        p.compute.as_str()
                    ),
                    format!("set compute = {} (or params = fp32 for autocast)", p.params.as_str()),
                ));
            }
            let block_name = if p.params == Dtype::Bf16 { "bf16" } else { "fp16" };
            let mut block = Map::new();
            block.insert("enabled".into(), json!(true));
            if p.params == Dtype::Fp16 {
                // Dynamic loss scaling with DeepSpeed's documented defaults.
                block.insert("loss_scale".into(), json!(0));
                block.insert("initial_scale_power".into(), json!(16));
                block.insert("loss_scale_window".into(), json!(1000));
                block.insert("hysteresis".into(), json!(2));
                block.insert("min_loss_scale".into(), json!(1));
            }
            match p.master {
                Some(m) if m.bytes() > p.params.bytes() => {
                    if m != Dtype::Fp32 {
                        return Err(unsupported(
                            E,
                            Setting::new("precision", "master"),
                            m.as_str(),
                            "DeepSpeed's master copy of 16-bit weights is fp32",
                            "set master = fp32",
                        ));
                    }
                }
                _ => {
                    // No wider master copy: DeepSpeed keeps ZeRO's master weights in 16 bits.
                    master16 = true;
                    if plan.resolved.zero == 0 {
                        return Err(unsupported(
                            E,
                            Setting::new("precision", "master"),
                            "none",
                            "DeepSpeed drops the fp32 master copy only for ZeRO-partitioned optimizers \
                             (stages 1-3); at stage 0 it always keeps one",
                            "set parallel.zero to 1, 2 or 3, or precision.master = fp32",
                        ));
                    }
                    let key = format!("{block_name}_master_weights_and_grads");
                    block.insert(key, json!(true));
                    let state16 = plan.optimizer.state == p.params && p.params == Dtype::Bf16;
                    if state16 {
                        block.insert("bf16_optimizer_states".into(), json!(true));
                    } else if offload_of(plan, OffloadWhat::Optimizer).is_none() {
                        return Err(unsupported(
                            E,
                            Setting::new("precision", "master"),
                            "none",
                            format!(
                                "DeepSpeed keeps 16-bit master weights with {} optimizer state only when the \
                                 optimizer runs on the CPU (ZeRO-Offload with DeepSpeedCPUAdam)",
                                plan.optimizer.state.as_str()
                            ),
                            "allow `fit.offload = [optimizer]`, keep master = fp32, or (bf16) set optimizer.state = bf16",
                        ));
                    }
                    notes.push(format!(
                        "`{block_name}.{block_name}_master_weights_and_grads` (no fp32 master copy) needs a recent \
                         DeepSpeed release; older ones reject the key"
                    ));
                }
            }
            root.insert(block_name.into(), Value::Object(block));
        }
        Dtype::Fp32 | Dtype::Tf32 => match p.compute {
            Dtype::Bf16 | Dtype::Fp16 => {
                let dtype = if p.compute == Dtype::Bf16 { "bfloat16" } else { "float16" };
                root.insert("torch_autocast".into(), json!({ "enabled": true, "dtype": dtype }));
                notes.push(format!(
                    "fp32 weights with {} compute is autocast: `torch_autocast` needs a DeepSpeed release that \
                     has it; with an older one, leave the key out and run forward under torch.autocast({dtype})",
                    p.compute.as_str()
                ));
            }
            Dtype::Tf32 => notes.push(
                "the plan computes in tf32: set torch.backends.cuda.matmul.allow_tf32 = True in the training script"
                    .into(),
            ),
            _ => {}
        },
        _ => {}
    }
    if p.grads != p.params {
        match p.grads {
            Dtype::Fp32 | Dtype::Bf16 | Dtype::Fp16 => {
                root.insert(
                    "data_types".into(),
                    json!({ "grad_accum_dtype": dtype_value(p.grads) }),
                );
            }
            other => {
                return Err(unsupported(
                    E,
                    Setting::new("precision", "grads"),
                    other.as_str(),
                    "DeepSpeed accumulates gradients in fp32, fp16 or bf16 only",
                    "set grads to fp32, bf16 or fp16",
                ))
            }
        }
    }
    Ok(master16)
}

fn optimizer(
    plan: &LoweredPlan,
    master16: bool,
    root: &mut Map<String, Value>,
    notes: &mut Vec<String>,
) -> Result<(), EmitError> {
    let o = &plan.optimizer;
    let offloaded = offload_of(plan, OffloadWhat::Optimizer).is_some();
    // bitsandbytes' paged optimizers are client optimizers to DeepSpeed, whatever the kind.
    let paged = o.implementation == OptImpl::Paged;
    let what = if paged {
        format!(
            "paged {} (bitsandbytes' `bnb.optim.Paged*`, state in CUDA unified memory)",
            o.kind.as_str()
        )
    } else {
        o.kind.as_str().to_string()
    };
    let native = match o.kind {
        _ if paged => None,
        OptimizerKind::Adamw => Some("AdamW"),
        OptimizerKind::Adam => Some("Adam"),
        OptimizerKind::Lion => Some("Lion"),
        // Not a DeepSpeed optimizer: DeepSpeed builds it from torch.optim by name.
        OptimizerKind::Sgd => Some("SGD"),
        OptimizerKind::Adam8bit | OptimizerKind::Adafactor | OptimizerKind::AdamMini => None,
    };
    // DeepSpeed's optimizers keep fp32 state, bf16 only in the bf16-master mode above.
    let state_ok = match o.state {
        Dtype::Fp32 => true,
        Dtype::Bf16 => master16,
        _ => false,
    };
    if native.is_some() && !state_ok {
        return Err(unsupported(
            E,
            Setting::new("optimizer", "state"),
            o.state.as_str(),
            format!(
                "DeepSpeed's {} keeps its state in fp32 (bf16 state only with bf16 master weights, \
                 `bf16_optimizer_states`); the plan's prediction assumed {} state",
                o.kind.as_str(),
                o.state.as_str()
            ),
            "set optimizer.state = fp32, or use `optimizer adam8bit` for 8-bit state",
        ));
    }
    let Some(name) = native else {
        if offloaded {
            return Err(unsupported(
                E,
                Setting::new("fit", "offload"),
                "optimizer",
                format!(
                    "DeepSpeed's optimizer offload runs its own CPU optimizers (Adam, AdamW, Adagrad, Lion); \
                     it cannot run {what} on the CPU"
                ),
                "use optimizer adamw/adam/lion with optimizer offload, or drop `optimizer` from fit.offload",
            ));
        }
        if plan.resolved.zero > 0 {
            root.insert("zero_allow_untested_optimizer".into(), json!(true));
        }
        notes.push(format!(
            "DeepSpeed has no built-in {what}: construct it in the training script (lr {}, weight decay {}) and pass \
             it as deepspeed.initialize(optimizer=...)",
            o.lr,
            o.weight_decay
        ));
        return Ok(());
    };
    let mut params = Map::new();
    params.insert("lr".into(), json!(o.lr));
    match o.kind {
        OptimizerKind::Sgd => {
            params.insert("momentum".into(), json!(o.momentum));
        }
        _ => {
            params.insert("betas".into(), json!([o.betas.0, o.betas.1]));
        }
    }
    params.insert("weight_decay".into(), json!(o.weight_decay));
    if o.kind == OptimizerKind::Adam {
        // DeepSpeed's Adam applies decoupled weight decay (AdamW) unless told not to.
        params.insert("adam_w_mode".into(), json!(false));
    }
    if matches!(o.kind, OptimizerKind::Adam | OptimizerKind::Adamw)
        && matches!(o.implementation, OptImpl::Foreach | OptImpl::Plain)
        && !offloaded
    {
        // torch's implementation instead of DeepSpeed's fused kernel, as the plan says.
        params.insert("torch_adam".into(), json!(true));
    }
    if o.kind == OptimizerKind::Sgd {
        if offloaded {
            return Err(unsupported(
                E,
                Setting::new("fit", "offload"),
                "optimizer",
                "DeepSpeed's optimizer offload runs its own CPU optimizers (Adam, AdamW, Adagrad, Lion), not SGD",
                "drop `optimizer` from fit.offload, or use an Adam-family optimizer",
            ));
        }
        if plan.resolved.zero > 0 {
            root.insert("zero_allow_untested_optimizer".into(), json!(true));
        }
    }
    root.insert(
        "optimizer".into(),
        json!({ "type": name, "params": Value::Object(params) }),
    );
    Ok(())
}

fn parallelism(
    plan: &LoweredPlan,
    root: &mut Map<String, Value>,
    notes: &mut Vec<String>,
) -> Result<(), EmitError> {
    let r = &plan.resolved;
    if r.context > 1 {
        return Err(unsupported(
            E,
            Setting::new("parallel", "context"),
            r.context,
            "DeepSpeed's configuration has no context-parallel degree: Ulysses sequence parallelism is set up in \
             the model code (a sequence-parallel attention and process groups), not in ds_config.json",
            "set parallel.context = 1 for DeepSpeed, or launch with --target torchrun and shard the sequence in \
             the training script",
        ));
    }
    if r.sequence {
        return Err(unsupported(
            E,
            Setting::new("parallel", "sequence"),
            "true",
            "Megatron-style sequence parallelism is not part of DeepSpeed's AutoTP; it needs Megatron-DeepSpeed",
            "set parallel.sequence = false",
        ));
    }
    if r.pipeline > 1 {
        if r.zero >= 2 {
            return Err(unsupported(
                E,
                Setting::new("parallel", "pipeline"),
                format!("{} with zero = {}", r.pipeline, r.zero),
                "DeepSpeed's pipeline engine supports only ZeRO stages 0 and 1 (PipelineEngine asserts \
                 zero_optimization_stage < 2)",
                "set parallel.zero to 0 or 1, or parallel.pipeline = 1",
            ));
        }
        if r.tensor > 1 {
            return Err(unsupported(
                E,
                Setting::new("parallel", "pipeline"),
                format!("{} with tensor = {}", r.pipeline, r.tensor),
                "DeepSpeed's configuration cannot combine pipeline stages with AutoTP tensor parallelism; \
                 3D parallelism needs Megatron-DeepSpeed",
                "use parallel.tensor = 1 or parallel.pipeline = 1 with DeepSpeed",
            ));
        }
        root.insert("pipeline".into(), json!({ "stages": r.pipeline }));
        notes.push(format!(
            "the plan runs {} pipeline stages: build the model as deepspeed.pipe.PipelineModule(num_stages={}); \
             ds_config.json's `pipeline` block cannot split the model by itself",
            r.pipeline, r.pipeline
        ));
    }
    if r.tensor > 1 {
        root.insert("tensor_parallel".into(), json!({ "autotp_size": r.tensor }));
        notes.push(format!(
            "tensor parallelism of degree {} is DeepSpeed AutoTP (`tensor_parallel.autotp_size`): it needs a \
             DeepSpeed release with AutoTP training, a model AutoTP can partition, and tensor- and data-parallel \
             groups handed to deepspeed.initialize (an mpu) so that DeepSpeed counts {} data-parallel ranks in \
             train_batch_size",
            r.tensor, r.data
        ));
    }
    if r.expert > 1 {
        if r.tensor > 1 {
            return Err(unsupported(
                E,
                Setting::new("parallel", "expert"),
                format!("{} with tensor = {}", r.expert, r.tensor),
                "DeepSpeed's AutoEP cannot be combined with AutoTP (tensor_parallel.autotp_size > 1)",
                "use parallel.tensor = 1 with expert parallelism",
            ));
        }
        root.insert(
            "expert_parallel".into(),
            json!({ "enabled": true, "autoep_size": r.expert }),
        );
        notes.push(format!(
            "expert parallelism of degree {} is DeepSpeed AutoEP (`expert_parallel`): it needs a DeepSpeed \
             release with AutoEP and a mixture-of-experts model it recognizes",
            r.expert
        ));
    }
    Ok(())
}

fn zero(
    plan: &LoweredPlan,
    root: &mut Map<String, Value>,
    notes: &mut Vec<String>,
) -> Result<(), EmitError> {
    let r = &plan.resolved;
    let stage = r.zero;
    let hidden = plan.model.hidden;
    // The sizes the `deepspeed` profile predicts with (saturating: a custom model's hidden
    // size is the user's number, not a bounded one).
    use crate::profile::engines::deepspeed as ds;
    let bucket = ds::reduce_bucket_elements(hidden);
    let mut z = Map::new();
    z.insert("stage".into(), json!(stage));
    match stage {
        1 | 2 => {
            z.insert("allgather_partitions".into(), json!(true));
            z.insert("allgather_bucket_size".into(), json!(bucket));
            z.insert("reduce_scatter".into(), json!(true));
            z.insert("reduce_bucket_size".into(), json!(bucket));
            z.insert("overlap_comm".into(), json!(true));
            z.insert("contiguous_gradients".into(), json!(true));
        }
        3 => {
            z.insert("overlap_comm".into(), json!(true));
            z.insert("contiguous_gradients".into(), json!(true));
            z.insert("reduce_bucket_size".into(), json!(bucket));
            z.insert(
                "stage3_prefetch_bucket_size".into(),
                json!(ds::prefetch_bucket_elements(hidden)),
            );
            z.insert(
                "stage3_param_persistence_threshold".into(),
                json!(ds::persistence_threshold(hidden)),
            );
            z.insert(
                "stage3_max_live_parameters".into(),
                json!(ds::MAX_LIVE_PARAMETERS),
            );
            z.insert(
                "stage3_max_reuse_distance".into(),
                json!(ds::MAX_REUSE_DISTANCE),
            );
            z.insert("sub_group_size".into(), json!(ds::SUB_GROUP_SIZE));
            // Without it a ZeRO-3 model saves only its shards.
            z.insert(
                "stage3_gather_16bit_weights_on_model_save".into(),
                json!(true),
            );
        }
        _ => {}
    }

    let mut nvme = false;
    let offload_label = |what: &str, to: OffloadTo| match to {
        OffloadTo::Cpu => format!("{what}:cpu"),
        OffloadTo::Nvme => format!("{what}:nvme"),
    };
    let need_nvme = |what: &str| -> Result<(), EmitError> {
        match plan.hardware.nvme_bytes {
            Some(b) if b > 0 => Ok(()),
            _ => Err(unsupported(
                E,
                Setting::new("hardware", "nvme"),
                "none",
                format!("the plan offloads {what} to NVMe, but the hardware has no NVMe capacity"),
                "give the per-node capacity (`hardware { nvme = 3.5 TB }`) or offload to cpu",
            )),
        }
    };

    let opt = offload_of(plan, OffloadWhat::Optimizer);
    if let Some(to) = opt {
        if stage == 0 || (to == OffloadTo::Nvme && stage < 3) {
            return Err(unsupported(
                E,
                Setting::new("fit", "offload"),
                format!("{} with zero = {stage}", offload_label("optimizer", to)),
                if to == OffloadTo::Cpu {
                    "DeepSpeed offloads optimizer state only from a ZeRO-partitioned optimizer (stages 1-3)"
                } else {
                    "DeepSpeed offloads optimizer state to NVMe (ZeRO-Infinity) only at ZeRO stage 3"
                },
                "raise parallel.zero, or offload the optimizer to cpu",
            ));
        }
        let mut block = Map::new();
        block.insert(
            "device".into(),
            json!(if to == OffloadTo::Cpu { "cpu" } else { "nvme" }),
        );
        block.insert("pin_memory".into(), json!(true));
        if to == OffloadTo::Nvme {
            need_nvme("optimizer state")?;
            nvme = true;
            block.insert("nvme_path".into(), json!(NVME_PATH));
            // At least the number of states per parameter (Adam: 4), per DeepSpeed's docs.
            block.insert("buffer_count".into(), json!(4));
            block.insert("fast_init".into(), json!(false));
        }
        z.insert("offload_optimizer".into(), Value::Object(block));
    }
    if let Some(to) = offload_of(plan, OffloadWhat::Params) {
        if stage < 3 {
            return Err(unsupported(
                E,
                Setting::new("fit", "offload"),
                format!("{} with zero = {stage}", offload_label("params", to)),
                "DeepSpeed offloads parameters only at ZeRO stage 3",
                "set parallel.zero = 3, or drop `params` from fit.offload",
            ));
        }
        let mut block = Map::new();
        block.insert(
            "device".into(),
            json!(if to == OffloadTo::Cpu { "cpu" } else { "nvme" }),
        );
        block.insert("pin_memory".into(), json!(true));
        if to == OffloadTo::Nvme {
            need_nvme("parameters")?;
            nvme = true;
            block.insert("nvme_path".into(), json!(NVME_PATH));
            // DeepSpeed's documented defaults.
            block.insert("buffer_count".into(), json!(5));
            block.insert("buffer_size".into(), json!(100_000_000u64));
            block.insert("max_in_cpu".into(), json!(1_000_000_000u64));
        }
        z.insert("offload_param".into(), Value::Object(block));
    }
    if let Some(to) = offload_of(plan, OffloadWhat::Grads) {
        if to == OffloadTo::Nvme || opt.is_none() {
            return Err(unsupported(
                E,
                Setting::new("fit", "offload"),
                offload_label("grads", to),
                "DeepSpeed moves gradients off the GPU only as part of optimizer offload (ZeRO-Offload keeps them \
                 in host memory for the CPU optimizer step), never on their own and never to NVMe",
                "offload `optimizer` as well, and gradients to cpu",
            ));
        }
    }
    if nvme {
        // DeepSpeed's documented asynchronous-I/O defaults.
        root.insert(
            "aio".into(),
            json!({
                "block_size": 1_048_576,
                "queue_depth": 8,
                "thread_count": 1,
                "single_submit": false,
                "overlap_events": true,
            }),
        );
        notes.push(format!(
            "NVMe offload writes to nvme_path \"{NVME_PATH}\" (DeepSpeed's default): change it to the NVMe mount \
             on your nodes"
        ));
    }
    root.insert("zero_optimization".into(), Value::Object(z));
    Ok(())
}

fn activation_checkpointing(
    plan: &LoweredPlan,
    root: &mut Map<String, Value>,
    notes: &mut Vec<String>,
) -> Result<(), EmitError> {
    let r = &plan.resolved;
    let act = offload_of(plan, OffloadWhat::Activations);
    if let Some(to) = act {
        if to == OffloadTo::Nvme || r.checkpoint_layers.is_empty() {
            return Err(unsupported(
                E,
                Setting::new("fit", "offload"),
                if to == OffloadTo::Nvme { "activations:nvme" } else { "activations:cpu" },
                "DeepSpeed offloads only activation-checkpoint inputs, and only to CPU memory (cpu_checkpointing)",
                "offload activations to cpu together with checkpointing, or drop `activations` from fit.offload",
            ));
        }
    }
    if r.checkpoint_layers.is_empty() {
        return Ok(());
    }
    root.insert(
        "activation_checkpointing".into(),
        json!({
            "partition_activations": false,
            "cpu_checkpointing": act == Some(OffloadTo::Cpu),
            "contiguous_memory_optimization": false,
            "number_checkpoints": r.checkpoint_layers.len(),
            "synchronize_checkpoint_boundary": false,
            "profile": false,
        }),
    );
    if let Some(s) = checkpoint_sentence(plan) {
        notes.push(s);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emit::testing::PlanBuilder;
    use crate::spec::AdapterKind;

    fn cfg(plan: &LoweredPlan) -> Value {
        let e = deepspeed(plan).unwrap_or_else(|e| panic!("{e}"));
        serde_json::from_str(&e.files[0].contents).unwrap()
    }

    fn unsupported_setting(plan: &LoweredPlan) -> String {
        match deepspeed(plan) {
            Err(EmitError::Unsupported {
                engine, setting, ..
            }) => {
                assert_eq!(engine, Engine::Deepspeed);
                setting.to_string()
            }
            other => panic!("expected an unsupported error, got {other:?}"),
        }
    }

    #[test]
    fn zero3_bf16_adamw_maps_every_decision() {
        let c = cfg(&PlanBuilder::llama_8b().checkpoint_every(2).build());
        assert_eq!(c["train_batch_size"], 256);
        assert_eq!(c["train_micro_batch_size_per_gpu"], 4);
        assert_eq!(c["gradient_accumulation_steps"], 8);
        assert_eq!(c["bf16"]["enabled"], true);
        assert!(c.get("fp16").is_none());
        assert_eq!(c["optimizer"]["type"], "AdamW");
        assert_eq!(c["optimizer"]["params"]["betas"], json!([0.9, 0.95]));
        assert_eq!(c["optimizer"]["params"]["lr"], 2e-5);
        let z = &c["zero_optimization"];
        assert_eq!(z["stage"], 3);
        assert_eq!(z["reduce_bucket_size"], 4096 * 4096);
        assert_eq!(z["stage3_prefetch_bucket_size"], 4096 * 4096 * 9 / 10);
        assert_eq!(z["stage3_param_persistence_threshold"], 40960);
        assert_eq!(c["activation_checkpointing"]["number_checkpoints"], 16);
        assert_eq!(c["activation_checkpointing"]["cpu_checkpointing"], false);
    }

    #[test]
    fn batch_product_matches_data_parallel_world() {
        let plan = PlanBuilder::llama_8b()
            .nodes(2, 8)
            .tensor(2)
            .micro_batch(2)
            .global_batch(512)
            .build();
        let c = cfg(&plan);
        let product = c["train_micro_batch_size_per_gpu"].as_u64().unwrap()
            * c["gradient_accumulation_steps"].as_u64().unwrap()
            * plan.resolved.data;
        assert_eq!(c["train_batch_size"].as_u64().unwrap(), product);
        assert_eq!(c["tensor_parallel"]["autotp_size"], 2);
    }

    #[test]
    fn offload_blocks_follow_the_plan() {
        let plan = PlanBuilder::llama_8b()
            .offload(OffloadWhat::Optimizer, OffloadTo::Nvme)
            .offload(OffloadWhat::Params, OffloadTo::Cpu)
            .nvme(Some(3_500_000_000_000))
            .build();
        let c = cfg(&plan);
        let z = &c["zero_optimization"];
        assert_eq!(z["offload_optimizer"]["device"], "nvme");
        assert_eq!(z["offload_optimizer"]["nvme_path"], NVME_PATH);
        assert_eq!(z["offload_param"]["device"], "cpu");
        assert!(z["offload_param"].get("nvme_path").is_none());
        assert_eq!(c["aio"]["block_size"], 1_048_576);
        let notes = deepspeed(&plan).unwrap().notes;
        assert!(notes.iter().any(|n| n.contains(NVME_PATH)));
    }

    #[test]
    fn pipeline_with_zero_2_or_3_is_refused_naming_the_engine() {
        for z in [2, 3] {
            let plan = PlanBuilder::llama_8b().pipeline(2).zero(z).build();
            assert_eq!(unsupported_setting(&plan), "parallel.pipeline");
            let msg = deepspeed(&plan).unwrap_err().to_string();
            assert!(
                msg.starts_with("DeepSpeed cannot express `parallel.pipeline`"),
                "{msg}"
            );
        }
        let c = cfg(&PlanBuilder::llama_8b().pipeline(2).zero(1).build());
        assert_eq!(c["pipeline"]["stages"], 2);
    }

    #[test]
    fn offloads_deepspeed_cannot_do_are_refused() {
        let b = PlanBuilder::llama_8b;
        assert_eq!(
            unsupported_setting(
                &b().nvme(None)
                    .offload(OffloadWhat::Optimizer, OffloadTo::Nvme)
                    .build()
            ),
            "hardware.nvme"
        );
        assert_eq!(
            unsupported_setting(
                &b().zero(2)
                    .offload(OffloadWhat::Params, OffloadTo::Cpu)
                    .build()
            ),
            "fit.offload"
        );
        assert_eq!(
            unsupported_setting(
                &b().zero(0)
                    .offload(OffloadWhat::Optimizer, OffloadTo::Cpu)
                    .build()
            ),
            "fit.offload"
        );
        assert_eq!(
            unsupported_setting(
                &b().zero(2)
                    .nvme(Some(1 << 40))
                    .offload(OffloadWhat::Optimizer, OffloadTo::Nvme)
                    .build()
            ),
            "fit.offload"
        );
        assert_eq!(
            unsupported_setting(&b().offload(OffloadWhat::Grads, OffloadTo::Cpu).build()),
            "fit.offload"
        );
        assert_eq!(
            unsupported_setting(
                &b().offload(OffloadWhat::Activations, OffloadTo::Cpu)
                    .build()
            ),
            "fit.offload"
        );
        // Gradients ride along with the optimizer; activations with checkpointing.
        let ok = b()
            .offload(OffloadWhat::Optimizer, OffloadTo::Cpu)
            .offload(OffloadWhat::Grads, OffloadTo::Cpu)
            .offload(OffloadWhat::Activations, OffloadTo::Cpu)
            .checkpoint_full()
            .build();
        assert_eq!(
            cfg(&ok)["activation_checkpointing"]["cpu_checkpointing"],
            true
        );
    }

    #[test]
    fn parallelism_deepspeed_cannot_do_is_refused() {
        let b = PlanBuilder::llama_8b;
        assert_eq!(
            unsupported_setting(&b().context(2).build()),
            "parallel.context"
        );
        assert_eq!(
            unsupported_setting(&b().tensor(2).sequence(true).build()),
            "parallel.sequence"
        );
        assert_eq!(
            unsupported_setting(&b().zero(1).pipeline(2).tensor(2).build()),
            "parallel.pipeline"
        );
        assert_eq!(
            unsupported_setting(&b().experts(8, 2).expert(2).tensor(2).build()),
            "parallel.expert"
        );
        assert_eq!(
            cfg(&b().experts(8, 2).expert(4).build())["expert_parallel"]["autoep_size"],
            4
        );
    }

    #[test]
    fn precision_modes() {
        let b = PlanBuilder::llama_8b;
        let fp16 = cfg(&b()
            .precision(Dtype::Fp16, Dtype::Fp16, Some(Dtype::Fp32))
            .build());
        assert_eq!(fp16["fp16"]["loss_scale"], 0);
        let autocast = cfg(&b().precision(Dtype::Fp32, Dtype::Bf16, None).build());
        assert_eq!(autocast["torch_autocast"]["dtype"], "bfloat16");
        assert!(autocast.get("bf16").is_none());
        let grads = cfg(&b().grads(Dtype::Fp32).build());
        assert_eq!(grads["data_types"]["grad_accum_dtype"], "fp32");
        let pure = cfg(&b()
            .precision(Dtype::Bf16, Dtype::Bf16, None)
            .optimizer_state(Dtype::Bf16)
            .build());
        assert_eq!(pure["bf16"]["bf16_master_weights_and_grads"], true);
        assert_eq!(pure["bf16"]["bf16_optimizer_states"], true);
        assert_eq!(
            unsupported_setting(
                &b().precision(Dtype::Fp8, Dtype::Fp8, Some(Dtype::Fp32))
                    .build()
            ),
            "precision.params"
        );
        assert_eq!(
            unsupported_setting(&b().precision(Dtype::Bf16, Dtype::Bf16, None).build()),
            "precision.master"
        );
        assert_eq!(
            unsupported_setting(&b().optimizer_state(Dtype::Bf16).build()),
            "optimizer.state"
        );
    }

    #[test]
    fn optimizers_use_deepspeed_names() {
        let b = PlanBuilder::llama_8b;
        let adam = cfg(&b().optimizer(OptimizerKind::Adam).build());
        assert_eq!(adam["optimizer"]["type"], "Adam");
        assert_eq!(adam["optimizer"]["params"]["adam_w_mode"], false);
        let sgd = cfg(&b().optimizer(OptimizerKind::Sgd).build());
        assert_eq!(sgd["optimizer"]["type"], "SGD");
        assert_eq!(sgd["zero_allow_untested_optimizer"], true);
        let bnb = deepspeed(
            &b().optimizer(OptimizerKind::Adam8bit)
                .optimizer_state(Dtype::Int8)
                .build(),
        )
        .unwrap();
        let c: Value = serde_json::from_str(&bnb.files[0].contents).unwrap();
        assert!(c.get("optimizer").is_none());
        assert!(bnb.notes.iter().any(|n| n.contains("adam8bit")));
        // A paged AdamW is no DeepSpeed AdamW (whose fused kernel the config would pick).
        let mut paged = b().build();
        paged.optimizer.implementation = OptImpl::Paged;
        let e = deepspeed(&paged).unwrap();
        let c: Value = serde_json::from_str(&e.files[0].contents).unwrap();
        assert!(c.get("optimizer").is_none(), "{c}");
        assert!(
            e.notes.iter().any(|n| n.contains("paged adamw")),
            "{:?}",
            e.notes
        );
        let off = b()
            .optimizer(OptimizerKind::Adafactor)
            .offload(OffloadWhat::Optimizer, OffloadTo::Cpu)
            .build();
        assert_eq!(unsupported_setting(&off), "fit.offload");
    }

    #[test]
    fn adapter_and_checkpoint_layers_become_notes() {
        let e = deepspeed(
            &PlanBuilder::llama_8b()
                .lora(AdapterKind::Lora, 16)
                .checkpoint_every(4)
                .build(),
        )
        .unwrap();
        assert!(
            e.notes.iter().any(|n| n.contains("LoRA adapter (rank 16")),
            "{:?}",
            e.notes
        );
        assert!(
            e.notes
                .iter()
                .any(|n| n.contains("layers 0,4,8,12,16,20,24,28")),
            "{:?}",
            e.notes
        );
    }

    #[test]
    fn output_is_deterministic() {
        let plan = PlanBuilder::llama_8b().checkpoint_full().build();
        assert_eq!(deepspeed(&plan).unwrap(), deepspeed(&plan).unwrap());
    }

    /// DeepSpeed has no optimizer step in the backward and no interleaved pipeline: the
    /// emitter names the setting rather than write a config that holds more than predicted.
    #[test]
    fn schedules_deepspeed_does_not_run_are_refused() {
        let inbwd = PlanBuilder::llama_8b().in_backward(true).build();
        assert_eq!(unsupported_setting(&inbwd), "optimizer.in_backward");
        let interleaved = PlanBuilder::llama_8b()
            .zero(1)
            .pipeline(4)
            .virtual_stages(2)
            .build();
        assert_eq!(unsupported_setting(&interleaved), "parallel.virtual_stages");
        // The launchers ship DeepSpeed's config, so they refuse it too.
        assert!(super::super::torchrun(&inbwd).is_err());
    }
}
