//! The Accelerate launch configuration (`accelerate_config.yaml`).
//!
//! Accelerate launches data-parallel jobs; which engine shards state is its
//! `distributed_type`:
//! - `DEEPSPEED` when the plan needs DeepSpeed ([`super::needs_deepspeed`]: ZeRO,
//!   offload, or an fp32 master copy of 16-bit weights), with `ds_config.json`
//!   emitted beside it and named by `deepspeed_config.deepspeed_config_file`.
//!   Precision, batch sizes, ZeRO stage and offload then live only in that file:
//!   Accelerate raises an error when `mixed_precision` or the `deepspeed_config`
//!   fields it would duplicate (zero_stage, offload devices, gradient
//!   accumulation, ...) appear next to a config file (DeepSpeedPlugin's
//!   `_deepspeed_config_checks`), so they are left out.
//! - `MULTI_GPU` (DDP) for plain data parallelism on several GPUs, `NO` on one,
//!   with `mixed_precision` from the compute dtype (Accelerate autocasts).
//!
//! - `FSDP` on request ([`accelerate_with`] and [`Sharding::Fsdp`], `rcoa emit
//!   --fsdp`): ZeRO-3 as FULL_SHARD, ZeRO-2 as SHARD_GRAD_OP. It is not the
//!   default because it fits fewer plans exactly: FSDP has no ZeRO-1, and its
//!   CPU offload moves parameters, gradients and the optimizer step together,
//!   so any other offload set is refused rather than approximated.
//!
//! Refused: pipeline, tensor, context, expert or sequence parallelism (an
//! Accelerate launch config has no degree for them; Megatron-LM or
//! `parallelism_config` set them in code).
//!
//! YAML is written by hand, keys in the order `accelerate config` writes its
//! questions, with comments; every string is single-quoted so that YAML 1.1
//! readers (PyYAML, which Accelerate uses) never read `no` as a boolean.

use super::deepspeed::{deepspeed, DS_CONFIG};
use super::{
    adapter_sentence, check_consistent, checkpoint_sentence, describe, needs_deepspeed,
    target_sentence, unsupported, Emission, EmitError, EmittedFile, Engine, Setting,
};
use crate::lowered::LoweredPlan;
use crate::spec::Dtype;
use serde_json::{json, Map, Value};

pub const ACCELERATE_CONFIG: &str = "accelerate_config.yaml";

const E: Engine = Engine::Accelerate;

/// A YAML value as this emitter writes it.
enum Y {
    Str(String),
    Int(u64),
    Bool(bool),
    Map(Vec<Item>),
}

/// `key: value`, with comment lines above it.
struct Item {
    comments: Vec<String>,
    key: &'static str,
    value: Y,
}

fn item(key: &'static str, value: Y) -> Item {
    Item {
        comments: vec![],
        key,
        value,
    }
}

fn commented(comments: &[&str], key: &'static str, value: Y) -> Item {
    Item {
        comments: comments.iter().map(|c| c.to_string()).collect(),
        key,
        value,
    }
}

fn s(v: &str) -> Y {
    Y::Str(v.to_string())
}

/// Which engine Accelerate hands sharding to.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Sharding {
    /// DeepSpeed, when the plan needs it (ZeRO, offload, fp32 master copy); DDP otherwise.
    #[default]
    Deepspeed,
    /// PyTorch FSDP: ZeRO-3 as FULL_SHARD, ZeRO-2 as SHARD_GRAD_OP.
    Fsdp,
}

/// `accelerate_config.yaml` (and `ds_config.json` when the plan needs DeepSpeed).
pub fn accelerate(plan: &LoweredPlan) -> Result<Emission, EmitError> {
    accelerate_with(plan, Sharding::Deepspeed)
}

/// `accelerate_config.yaml` with the given sharding engine.
pub fn accelerate_with(plan: &LoweredPlan, sharding: Sharding) -> Result<Emission, EmitError> {
    check_consistent(plan)?;
    let r = &plan.resolved;
    // A plan compiled for FSDP2 was predicted with FSDP's sharding, never DeepSpeed's.
    let sharding = match plan.target {
        crate::spec::Target::Fsdp => Sharding::Fsdp,
        crate::spec::Target::Megatron => {
            return Err(unsupported(
                E,
                Setting::section("target"),
                "megatron",
                "the plan's memory was predicted for Megatron-Core (its gradient buffer and distributed \
                 optimizer), which an Accelerate launch configuration does not set up",
                "launch with --target torchrun (its script lists Megatron-LM's arguments), or compile for \
                 `target pytorch` / `target deepspeed`",
            ))
        }
        _ => sharding,
    };
    // The step in the backward lives in the script (DeepSpeed refuses it on its own).
    let in_backward = super::script::in_backward_note(plan);
    let refuse = |key: &'static str, value: String| {
        Err(unsupported(
            E,
            Setting::new("parallel", key),
            value,
            format!(
                "an Accelerate launch configuration describes data-parallel processes only; {key} parallelism \
                 is set up in code (Megatron-LM, or Accelerate's parallelism_config), not by this file"
            ),
            format!("use parallel.{key} = 1 with Accelerate, or launch with --target torchrun"),
        ))
    };
    if r.pipeline > 1 {
        return refuse("pipeline", r.pipeline.to_string());
    }
    if r.tensor > 1 {
        return refuse("tensor", r.tensor.to_string());
    }
    if r.context > 1 {
        return refuse("context", r.context.to_string());
    }
    if r.expert > 1 {
        return refuse("expert", r.expert.to_string());
    }
    if r.sequence {
        return refuse("sequence", "true".into());
    }

    let h = &plan.hardware;
    let processes = h.nodes.saturating_mul(h.gpus_per_node);
    let multi_node = h.nodes > 1;
    let mut items = vec![item("compute_environment", s("LOCAL_MACHINE"))];
    let mut notes: Vec<String> = in_backward.into_iter().collect();
    let mut ds_file = None;

    if sharding == Sharding::Fsdp {
        fsdp(plan, &mut items, &mut notes)?;
    } else if needs_deepspeed(plan) {
        let mut ds = deepspeed(plan)?;
        ds_file = Some(ds.files.remove(0));
        notes.append(&mut ds.notes);
        items.push(item("distributed_type", s("DEEPSPEED")));
        let mut dsc = vec![item("deepspeed_config_file", s(DS_CONFIG))];
        if r.zero == 3 {
            dsc.push(commented(
                &["Build the model shard by shard (deepspeed.zero.Init) instead of whole on every GPU."],
                "zero3_init_flag",
                Y::Bool(true),
            ));
        }
        if multi_node {
            dsc.push(commented(
                &["Each node starts its own processes (torchrun-style), as `accelerate launch` on every node does."],
                "deepspeed_multinode_launcher",
                s("standard"),
            ));
        }
        items.push(Item {
            comments: vec![
                format!("ZeRO stage, offload, precision and batch sizes are in {DS_CONFIG}: Accelerate refuses"),
                "mixed_precision and the deepspeed_config fields it would duplicate when a config file is given."
                    .into(),
            ],
            key: "deepspeed_config",
            value: Y::Map(dsc),
        });
    } else {
        items.push(item(
            "distributed_type",
            s(if processes > 1 { "MULTI_GPU" } else { "NO" }),
        ));
        let mp = match plan.precision.compute {
            Dtype::Bf16 => "bf16",
            Dtype::Fp16 => "fp16",
            Dtype::Fp8 => "fp8",
            _ => "no",
        };
        items.push(commented(
            &["Accelerate autocasts the forward pass to this dtype."],
            "mixed_precision",
            s(mp),
        ));
        if plan.precision.params != Dtype::Fp32 && plan.precision.params != Dtype::Tf32 {
            notes.push(format!(
                "the plan keeps {} weights with no fp32 master copy: load the model in {} in the training \
                 script (mixed_precision only autocasts)",
                plan.precision.params.as_str(),
                plan.precision.params.as_str()
            ));
        }
        notes.extend(
            [
                checkpoint_sentence(plan),
                adapter_sentence(plan),
                target_sentence(plan),
            ]
            .into_iter()
            .flatten(),
        );
        notes.push(format!(
            "Accelerate does not read batch sizes from its config: use micro_batch {} per GPU and \
             gradient_accumulation_steps {} in the training script",
            r.micro_batch, r.grad_accum
        ));
    }

    items.push(item("num_machines", Y::Int(h.nodes)));
    items.push(commented(
        &["All processes of the job, one per GPU."],
        "num_processes",
        Y::Int(processes),
    ));
    if multi_node {
        let rank_comment = format!(
            "PLACEHOLDER: this node's rank (0 to {}); pass --machine_rank on each node.",
            h.nodes - 1
        );
        items.push(commented(
            &[rank_comment.as_str()],
            "machine_rank",
            Y::Int(0),
        ));
        items.push(commented(
            &["PLACEHOLDER: the first node's address; pass --main_process_ip \"$MASTER_ADDR\"."],
            "main_process_ip",
            s("MASTER_ADDR_PLACEHOLDER"),
        ));
        items.push(commented(
            &["A free port on the first node."],
            "main_process_port",
            Y::Int(29500),
        ));
        items.push(item("rdzv_backend", s("static")));
        items.push(item("same_network", Y::Bool(true)));
        notes.push(format!(
            "{ACCELERATE_CONFIG} has placeholders: run `accelerate launch` on every node with --machine_rank \
             and --main_process_ip \"$MASTER_ADDR\""
        ));
    } else {
        items.push(item("machine_rank", Y::Int(0)));
    }
    items.push(item("main_training_function", s("main")));
    items.push(item("use_cpu", Y::Bool(false)));
    items.push(item("debug", Y::Bool(false)));

    let header = [
        format!(
            "Accelerate launch configuration for {}, generated by `rcoa emit --target accelerate`.",
            describe(plan)
        ),
        if multi_node {
            format!(
                "On every node: accelerate launch --config_file {ACCELERATE_CONFIG} --machine_rank \"$NODE_RANK\" \
                 --main_process_ip \"$MASTER_ADDR\" train.py"
            )
        } else {
            format!("Run: accelerate launch --config_file {ACCELERATE_CONFIG} train.py")
        },
    ];
    let mut text = String::new();
    for h in header {
        text.push_str("# ");
        text.push_str(&h);
        text.push('\n');
    }
    render(&items, 0, &mut text);

    let problems = super::schema::accelerate_keys().check(&to_json(&items));
    if !problems.is_empty() {
        return Err(EmitError::Inconsistent {
            what: format!(
                "the Accelerate emitter wrote keys Accelerate does not know: {}",
                problems.join("; ")
            ),
        });
    }
    let mut files = vec![EmittedFile {
        name: ACCELERATE_CONFIG.into(),
        contents: text,
        executable: false,
    }];
    files.extend(ds_file);
    Ok(Emission { files, notes })
}

/// The FSDP items: sharding strategy from the ZeRO stage, CPU offload, mixed
/// precision, activation checkpointing. Refuses what FSDP cannot do the plan's way.
fn fsdp(
    plan: &LoweredPlan,
    items: &mut Vec<Item>,
    notes: &mut Vec<String>,
) -> Result<(), EmitError> {
    let r = &plan.resolved;
    let p = &plan.precision;
    let strategy = match r.zero {
        3 => "FULL_SHARD",
        2 => "SHARD_GRAD_OP",
        z => return Err(unsupported(
            E,
            Setting::new("parallel", "zero"),
            z,
            "FSDP shards gradients and optimizer state (SHARD_GRAD_OP, as ZeRO-2) or everything \
                 (FULL_SHARD, as ZeRO-3); it has no mode for ZeRO stages 0 and 1",
            "set parallel.zero = 2 or 3 for FSDP, or emit without --fsdp (DeepSpeed or DDP)",
        )),
    };
    // FSDP's CPU offload moves parameters and gradients and runs the optimizer
    // step on the CPU, all three together: only that exact set maps onto it.
    let offload_params = super::script::fsdp_cpu_offload(plan, E)?;
    let sixteen = |d: Dtype| matches!(d, Dtype::Bf16 | Dtype::Fp16);
    if p.compute == Dtype::Fp8 || (sixteen(p.params) && p.compute != p.params) {
        return Err(unsupported(
            E,
            Setting::new("precision", "compute"),
            p.compute.as_str(),
            format!(
                "FSDP's mixed precision computes in bf16 or fp16 from fp32 or same-dtype weights, not in {} \
                 from {} weights",
                p.compute.as_str(),
                p.params.as_str()
            ),
            "use bf16 or fp16 compute",
        ));
    }
    let mp = match p.compute {
        Dtype::Bf16 => "bf16",
        Dtype::Fp16 => "fp16",
        _ => "no",
    };
    let load = if !sixteen(p.params) {
        format!(
            "load the model in fp32: FSDP shards the fp32 weights and computes in {}",
            p.compute.as_str()
        )
    } else if p.master.is_some_and(|m| m.bytes() > p.params.bytes()) {
        format!(
            "load the model in fp32: FSDP's sharded fp32 weights are the plan's fp32 master copy, and \
             mixed_precision computes in {}",
            p.compute.as_str()
        )
    } else {
        format!(
            "load the model in {}: the plan keeps no fp32 master copy",
            p.params.as_str()
        )
    };
    notes.push(load);
    let layers = plan.model.layers;
    let full = r.checkpoint_layers.len() as u64 == layers;
    if !full {
        notes.extend(checkpoint_sentence(plan));
    }
    notes.extend(
        [adapter_sentence(plan), target_sentence(plan)]
            .into_iter()
            .flatten(),
    );
    notes.push(format!(
        "Accelerate does not read batch sizes from its config: use micro_batch {} per GPU and \
         gradient_accumulation_steps {} in the training script",
        r.micro_batch, r.grad_accum
    ));

    items.push(item("distributed_type", s("FSDP")));
    items.push(commented(
        &["FSDP casts the gathered weights to this dtype for compute."],
        "mixed_precision",
        s(mp),
    ));
    let sharded = if strategy == "FULL_SHARD" {
        "ZeRO-3"
    } else {
        "ZeRO-2"
    };
    let strategy_comment = format!("The plan's {sharded}.");
    let offload_comment = if offload_params {
        "Parameters, gradients and the optimizer step on the CPU, as the plan offloads them."
    } else {
        "Nothing leaves the GPU."
    };
    let ckpt_comment = if full {
        "Every layer is recomputed in the backward pass, as the plan decided."
    } else {
        "The plan recomputes no layer, or only some: the training script applies it."
    };
    let fsdp = vec![
        commented(&[strategy_comment.as_str()], "fsdp_sharding_strategy", s(strategy)),
        commented(&[offload_comment], "fsdp_offload_params", Y::Bool(offload_params)),
        commented(
            &["Wrap each decoder layer (a Transformers model's `_no_split_modules`); other models name their",
              "layer class in fsdp_transformer_layer_cls_to_wrap."],
            "fsdp_auto_wrap_policy",
            s("TRANSFORMER_BASED_WRAP"),
        ),
        item("fsdp_backward_prefetch", s("BACKWARD_PRE")),
        item("fsdp_forward_prefetch", Y::Bool(false)),
        item("fsdp_state_dict_type", s("SHARDED_STATE_DICT")),
        item("fsdp_use_orig_params", Y::Bool(true)),
        item("fsdp_cpu_ram_efficient_loading", Y::Bool(true)),
        item("fsdp_sync_module_states", Y::Bool(true)),
        commented(&[ckpt_comment], "fsdp_activation_checkpointing", Y::Bool(full)),
    ];
    items.push(Item {
        comments: vec![],
        key: "fsdp_config",
        value: Y::Map(fsdp),
    });
    Ok(())
}

/// YAML single-quoted scalar: `'` doubled, nothing else escaped.
fn quote(v: &str) -> String {
    format!("'{}'", v.replace('\'', "''"))
}

fn render(items: &[Item], depth: usize, out: &mut String) {
    let pad = "  ".repeat(depth);
    for it in items {
        for c in &it.comments {
            out.push_str(&format!("{pad}# {c}\n"));
        }
        match &it.value {
            Y::Str(v) => out.push_str(&format!("{pad}{}: {}\n", it.key, quote(v))),
            Y::Int(v) => out.push_str(&format!("{pad}{}: {v}\n", it.key)),
            Y::Bool(v) => out.push_str(&format!("{pad}{}: {v}\n", it.key)),
            Y::Map(children) => {
                out.push_str(&format!("{pad}{}:\n", it.key));
                render(children, depth + 1, out);
            }
        }
    }
}

fn to_json(items: &[Item]) -> Value {
    let mut map = Map::new();
    for it in items {
        let v = match &it.value {
            Y::Str(v) => json!(v),
            Y::Int(v) => json!(v),
            Y::Bool(v) => json!(v),
            Y::Map(children) => to_json(children),
        };
        map.insert(it.key.to_string(), v);
    }
    Value::Object(map)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emit::testing::PlanBuilder;
    use crate::spec::{OffloadTo, OffloadWhat};

    #[test]
    fn zero_plans_use_deepspeed_without_duplicated_fields() {
        let e = accelerate(&PlanBuilder::llama_8b().nodes(2, 8).build()).unwrap();
        let y = &e.files[0].contents;
        assert!(y.contains("distributed_type: 'DEEPSPEED'\n"));
        assert!(y.contains("  deepspeed_config_file: 'ds_config.json'\n"));
        assert!(y.contains("num_processes: 16\n"));
        assert!(y.contains("main_process_ip: 'MASTER_ADDR_PLACEHOLDER'\n"));
        // Accelerate raises when these appear next to deepspeed_config_file.
        for refused in [
            "mixed_precision",
            "zero_stage",
            "offload_optimizer_device",
            "gradient_accumulation_steps",
        ] {
            let key = format!("{refused}:");
            assert!(
                !y.contains(&key),
                "{refused} must not be written with a config file:\n{y}"
            );
        }
        assert_eq!(e.files[1].name, DS_CONFIG);
    }

    #[test]
    fn plain_data_parallel_is_multi_gpu_with_mixed_precision() {
        let plan = PlanBuilder::llama_8b()
            .zero(0)
            .precision(Dtype::Fp32, Dtype::Bf16, None)
            .build();
        let e = accelerate(&plan).unwrap();
        let y = &e.files[0].contents;
        assert!(y.contains("distributed_type: 'MULTI_GPU'\n"));
        assert!(y.contains("mixed_precision: 'bf16'\n"));
        assert!(
            !y.contains("main_process_ip"),
            "single node needs no rendezvous address"
        );
        assert_eq!(e.files.len(), 1);
        let one = PlanBuilder::llama_8b()
            .nodes(1, 1)
            .zero(0)
            .precision(Dtype::Fp32, Dtype::Fp32, None)
            .build();
        let y = accelerate(&one).unwrap().files.remove(0).contents;
        assert!(y.contains("distributed_type: 'NO'\n"));
        assert!(
            y.contains("mixed_precision: 'no'\n"),
            "`no` stays a string for PyYAML"
        );
    }

    #[test]
    fn offload_on_one_gpu_still_uses_deepspeed() {
        let plan = PlanBuilder::llama_8b()
            .nodes(1, 1)
            .zero(1)
            .offload(OffloadWhat::Optimizer, OffloadTo::Cpu)
            .build();
        let y = accelerate(&plan).unwrap().files.remove(0).contents;
        assert!(y.contains("distributed_type: 'DEEPSPEED'\n"));
    }

    #[test]
    fn model_parallelism_is_refused() {
        let b = PlanBuilder::llama_8b;
        for (plan, key) in [
            (b().zero(1).pipeline(2).build(), "parallel.pipeline"),
            (b().tensor(2).build(), "parallel.tensor"),
            (b().context(2).build(), "parallel.context"),
            (b().experts(8, 2).expert(2).build(), "parallel.expert"),
        ] {
            match accelerate(&plan) {
                Err(EmitError::Unsupported {
                    engine, setting, ..
                }) => {
                    assert_eq!(engine, Engine::Accelerate);
                    assert_eq!(setting.to_string(), key);
                }
                other => panic!("{key}: {other:?}"),
            }
        }
    }

    #[test]
    fn fsdp_maps_zero_stages_offload_and_checkpointing() {
        let plan = PlanBuilder::llama_8b()
            .nodes(2, 8)
            .checkpoint_full()
            .build();
        let e = accelerate_with(&plan, Sharding::Fsdp).unwrap();
        assert_eq!(e.files.len(), 1, "FSDP ships no DeepSpeed config");
        let y = &e.files[0].contents;
        assert!(y.contains("distributed_type: 'FSDP'\n"));
        assert!(y.contains("  fsdp_sharding_strategy: 'FULL_SHARD'\n"));
        assert!(y.contains("  fsdp_activation_checkpointing: true\n"));
        assert!(y.contains("mixed_precision: 'bf16'\n"));
        assert!(e.notes.iter().any(|n| n.contains("fp32 master copy")));

        let zero2 = PlanBuilder::llama_8b().zero(2).build();
        let y = accelerate_with(&zero2, Sharding::Fsdp)
            .unwrap()
            .files
            .remove(0)
            .contents;
        assert!(y.contains("'SHARD_GRAD_OP'"));
        assert!(y.contains("  fsdp_activation_checkpointing: false\n"));

        let offload = PlanBuilder::llama_8b()
            .offload(OffloadWhat::Optimizer, OffloadTo::Cpu)
            .offload(OffloadWhat::Params, OffloadTo::Cpu)
            .offload(OffloadWhat::Grads, OffloadTo::Cpu)
            .build();
        let y = accelerate_with(&offload, Sharding::Fsdp)
            .unwrap()
            .files
            .remove(0)
            .contents;
        assert!(y.contains("  fsdp_offload_params: true\n"));
    }

    #[test]
    fn fsdp_refuses_what_it_cannot_do_exactly() {
        let b = PlanBuilder::llama_8b;
        for (plan, key) in [
            (b().zero(1).build(), "parallel.zero"),
            (
                b().offload(OffloadWhat::Optimizer, OffloadTo::Cpu).build(),
                "fit.offload",
            ),
            (
                b().precision(Dtype::Bf16, Dtype::Fp16, Some(Dtype::Fp32))
                    .build(),
                "precision.compute",
            ),
        ] {
            match accelerate_with(&plan, Sharding::Fsdp) {
                Err(EmitError::Unsupported {
                    engine, setting, ..
                }) => {
                    assert_eq!(engine, Engine::Accelerate);
                    assert_eq!(setting.to_string(), key);
                }
                other => panic!("{key}: {other:?}"),
            }
        }
    }

    /// The plan's engine decides the sharding: an FSDP2 plan gets FSDP without `--fsdp`
    /// (its step in the backward as a note), a Megatron-Core plan is refused.
    #[test]
    fn the_plans_engine_decides_the_sharding() {
        use crate::spec::Target;
        let fsdp = PlanBuilder::llama_8b()
            .target(Target::Fsdp)
            .precision(Dtype::Fp32, Dtype::Bf16, None)
            .in_backward(true)
            .build();
        let e = accelerate(&fsdp).unwrap();
        assert_eq!(e.files.len(), 1, "no DeepSpeed config");
        assert!(e.files[0].contents.contains("distributed_type: 'FSDP'\n"));
        assert!(
            e.notes
                .iter()
                .any(|n| n.contains("register_post_accumulate_grad_hook")),
            "{:?}",
            e.notes
        );
        let megatron = PlanBuilder::llama_8b()
            .target(Target::Megatron)
            .zero(1)
            .build();
        assert!(matches!(
            accelerate(&megatron),
            Err(EmitError::Unsupported { .. })
        ));
    }

    #[test]
    fn quoting_doubles_single_quotes() {
        assert_eq!(quote("it's"), "'it''s'");
    }
}
