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
//! ZeRO is not mapped to FSDP: ZeRO-1 has no FSDP strategy and FSDP's CPU
//! offload moves parameters, gradients and optimizer together, so the memory
//! the plan predicted would not be the memory FSDP uses.
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

/// `accelerate_config.yaml` (and `ds_config.json` when the plan needs DeepSpeed).
pub fn accelerate(plan: &LoweredPlan) -> Result<Emission, EmitError> {
    check_consistent(plan)?;
    let r = &plan.resolved;
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
    let processes = h.nodes * h.gpus_per_node;
    let multi_node = h.nodes > 1;
    let mut items = vec![item("compute_environment", s("LOCAL_MACHINE"))];
    let mut notes = Vec::new();
    let mut ds_file = None;

    if needs_deepspeed(plan) {
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
    fn quoting_doubles_single_quotes() {
        assert_eq!(quote("it's"), "'it''s'");
    }
}
