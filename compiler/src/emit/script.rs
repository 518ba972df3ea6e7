//! What the training script itself sets up for the plan's engine, which no launcher or
//! configuration file holds: FSDP2's `fully_shard` calls (mixed precision, resharding, CPU
//! offload), Megatron-LM's arguments (interleaved pipeline stages among them), and the
//! optimizer step in the backward (`optimizer.in_backward`).
//!
//! The launch scripts carry these lines in their decisions comment, the Accelerate
//! emitter as notes. Each line follows what the memory model charged for the engine
//! (`crate::memory::engines`), so the script that copies them runs what was predicted.
//!
//! Sources: PyTorch `torch/distributed/fsdp/_fully_shard/` (`fully_shard`'s
//! `mp_policy`, `reshard_after_forward`, `offload_policy`; `_fsdp_collectives.py`
//! `foreach_reduce` runs a parameter's post-accumulate-grad hooks once its sharded
//! gradient is set, offloaded or not); torchtune's `optimizer_in_bwd`
//! (`register_post_accumulate_grad_hook`, one optimizer per parameter); Megatron-LM
//! `megatron/training/arguments.py`.

use super::{unsupported, EmitError, Engine, Setting};
use crate::lowered::LoweredPlan;
use crate::spec::{Dtype, OffloadTo, OffloadWhat, OptimizerKind, Target};

/// Does the plan run FSDP2's `CPUOffloadPolicy` (parameters, gradients and the optimizer
/// step on the host)? `Ok(false)` without offload; an error for any other offload set,
/// which the `fsdp` profile never decides (`profile::engines::offload_set_refusal`).
pub fn fsdp_cpu_offload(plan: &LoweredPlan, engine: Engine) -> Result<bool, EmitError> {
    let o = &plan.resolved.offload;
    if o.is_empty() {
        return Ok(false);
    }
    let all = [
        OffloadWhat::Optimizer,
        OffloadWhat::Params,
        OffloadWhat::Grads,
    ];
    let exact = o.len() == all.len()
        && all
            .iter()
            .all(|w| o.iter().any(|x| x.what == *w && x.to == OffloadTo::Cpu));
    if exact {
        return Ok(true);
    }
    let list: Vec<String> = o.iter().map(|x| x.to_string()).collect();
    Err(unsupported(
        engine,
        Setting::new("fit", "offload"),
        format!("[{}]", list.join(", ")),
        "FSDP2's CPUOffloadPolicy moves the sharded parameters, their gradients and the optimizer step \
         to the host together, and nothing to NVMe; it cannot move a part of them",
        "offload optimizer, params and grads to cpu together (`offload = [optimizer, params, grads]`), \
         or compile for `target deepspeed`",
    ))
}

/// The torch dtype name of a compute dtype.
fn torch_dtype(d: Dtype) -> &'static str {
    match d {
        Dtype::Bf16 => "torch.bfloat16",
        Dtype::Fp16 => "torch.float16",
        _ => "torch.float32",
    }
}

/// The `fully_shard` calls for a plan compiled for FSDP2 (`target fsdp`).
fn fsdp_lines(plan: &LoweredPlan, engine: Engine) -> Result<Vec<String>, EmitError> {
    let p = &plan.precision;
    let r = &plan.resolved;
    let offload = fsdp_cpu_offload(plan, engine)?;
    let mut args = Vec::new();
    let mut lines = vec![
        "FSDP2 (the `fsdp` profile predicted it): shard every transformer layer, then the root:"
            .to_string(),
    ];
    if p.compute.bytes() < p.params.bytes() {
        lines.push(format!(
            "  mp = MixedPrecisionPolicy(param_dtype={}, reduce_dtype=torch.float32)",
            torch_dtype(p.compute)
        ));
        args.push("mp_policy=mp".to_string());
    }
    if offload {
        args.push("offload_policy=CPUOffloadPolicy()".to_string());
    }
    let common = if args.is_empty() {
        String::new()
    } else {
        format!(", {}", args.join(", "))
    };
    lines.push(format!(
        "  for layer in model.layers: fully_shard(layer{common}, reshard_after_forward={})",
        if r.zero >= 3 { "True" } else { "False" }
    ));
    // `reshard_after_forward=None` (the default) keeps the root gathered after its forward;
    // under `zero = 3` the model frees it and gathers it again for the backward, as it does
    // every layer (`memory::fsdp`, measured: tests/groundtruth/h100-multigpu.jsonl).
    lines.push(if r.zero >= 3 {
        format!("  fully_shard(model{common}, reshard_after_forward=True)")
    } else {
        format!("  fully_shard(model{common})")
    });
    lines.push(format!(
        "  load the model in {} (the sharded weights FSDP2 keeps{})",
        p.params.as_str(),
        if offload {
            ", pinned in host memory"
        } else {
            ""
        }
    ));
    if offload {
        lines.push(
            "  CPUOffloadPolicy: the optimizer steps on the host, over the sharded fp32 parameters and gradients"
                .to_string(),
        );
    }
    Ok(lines)
}

/// Megatron-LM's arguments for the plan's layout (`target megatron`).
fn megatron_lines(plan: &LoweredPlan) -> Vec<String> {
    let r = &plan.resolved;
    let mut a = vec![
        format!("--tensor-model-parallel-size {}", r.tensor),
        format!("--pipeline-model-parallel-size {}", r.pipeline),
    ];
    let v = r.virtual_stages.max(1);
    if v > 1 && r.pipeline > 1 {
        a.push(format!(
            "--num-layers-per-virtual-pipeline-stage {}",
            plan.model.layers / (r.pipeline * v)
        ));
    }
    if r.sequence {
        a.push("--sequence-parallel".into());
    }
    if r.context > 1 {
        a.push(format!("--context-parallel-size {}", r.context));
    }
    if r.zero >= 1 {
        a.push("--use-distributed-optimizer".into());
    }
    a.push(format!("--micro-batch-size {}", r.micro_batch));
    a.push(format!("--global-batch-size {}", plan.train.global_batch));
    match plan.precision.compute {
        Dtype::Bf16 => a.push("--bf16".into()),
        Dtype::Fp16 => a.push("--fp16".into()),
        _ => {}
    }
    if r.offload.iter().any(|o| o.what == OffloadWhat::Optimizer) {
        a.push("--optimizer-cpu-offload".into());
    }
    let mut lines = vec![
        "Megatron-LM (the `megatron` profile predicted it), arguments of pretrain_gpt.py:"
            .to_string(),
    ];
    lines.push(format!("  {}", a.join(" ")));
    if v > 1 && r.pipeline > 1 {
        lines.push(format!(
            "  interleaved 1F1B: {v} model chunks of {} layers per pipeline rank (Megatron-Core's \
             virtual_pipeline_model_parallel_size = {v}; newer Megatron-LM also takes \
             --num-virtual-stages-per-pipeline-rank {v})",
            plan.model.layers / (r.pipeline * v)
        ));
    }
    lines
}

/// The torch optimizer a step in the backward builds per parameter.
fn torch_optimizer(plan: &LoweredPlan) -> String {
    let o = &plan.optimizer;
    let (b1, b2) = o.betas;
    match o.kind {
        OptimizerKind::Adamw => format!(
            "torch.optim.AdamW([p], lr={}, betas=({b1}, {b2}), weight_decay={})",
            o.lr, o.weight_decay
        ),
        OptimizerKind::Adam => format!(
            "torch.optim.Adam([p], lr={}, betas=({b1}, {b2}), weight_decay={})",
            o.lr, o.weight_decay
        ),
        OptimizerKind::Sgd => format!(
            "torch.optim.SGD([p], lr={}, momentum={}, weight_decay={})",
            o.lr, o.momentum, o.weight_decay
        ),
        k => format!("your {} optimizer over [p] (lr={})", k.as_str(), o.lr),
    }
}

/// The optimizer step in the backward, as torchtune's `optimizer_in_bwd` runs it: one
/// optimizer per trainable parameter, stepped and its gradient freed by a
/// post-accumulate-grad hook. Under FSDP2 the hook fires on the sharded parameter once
/// its reduced shard is set (`foreach_reduce`); under DDP the parameters' optimizers are
/// registered with `_apply_optimizer_in_backward` so DDP steps them after each bucket's
/// all-reduce.
fn in_backward_lines(plan: &LoweredPlan) -> Vec<String> {
    let ddp = plan.target == Target::Pytorch && plan.resolved.data > 1;
    let mut lines = vec![
        "Optimizer step in the backward (optimizer.in_backward; torchtune's optimizer_in_bwd): no optimizer.step()"
            .to_string(),
        "after loss.backward(), one backward per step (grad_accum 1); each parameter steps as its gradient completes:"
            .to_string(),
    ];
    if ddp {
        lines.push(format!(
            "  before wrapping in DDP: torch.distributed.optim._apply_optimizer_in_backward({}, \
             [p for p in model.parameters() if p.requires_grad], optimizer_kwargs) (DDP steps each bucket after its all-reduce)",
            match plan.optimizer.kind {
                OptimizerKind::Adamw => "torch.optim.AdamW",
                OptimizerKind::Adam => "torch.optim.Adam",
                OptimizerKind::Sgd => "torch.optim.SGD",
                _ => "your optimizer class",
            }
        ));
    } else {
        let after = if plan.target == Target::Fsdp {
            " (after fully_shard: the hooks go on the sharded parameters)"
        } else {
            ""
        };
        lines.push(format!(
            "  opt = {{p: {} for p in model.parameters() if p.requires_grad}}{after}",
            torch_optimizer(plan)
        ));
        lines.push("  def step(p): opt[p].step(); opt[p].zero_grad(set_to_none=True)".to_string());
        lines.push("  for p in opt: p.register_post_accumulate_grad_hook(step)".to_string());
    }
    lines
}

/// The step in the backward as one note (Accelerate's config has no key for it), or `None`.
pub fn in_backward_note(plan: &LoweredPlan) -> Option<String> {
    plan.resolved
        .optimizer_in_backward
        .then(|| in_backward_lines(plan).join(" "))
}

/// The engine lines of the plan for the training script's author (empty when the plan
/// needs none), or an error when the plan's engine cannot run what it decided.
pub fn engine_lines(plan: &LoweredPlan, engine: Engine) -> Result<Vec<String>, EmitError> {
    let mut lines = match plan.target {
        Target::Fsdp => fsdp_lines(plan, engine)?,
        Target::Megatron => megatron_lines(plan),
        _ => Vec::new(),
    };
    if plan.resolved.optimizer_in_backward {
        if matches!(plan.target, Target::Deepspeed | Target::Megatron) {
            return Err(in_backward_refusal(
                engine,
                crate::profile::Profile::for_target(plan.target)
                    .engine
                    .display_name(),
            ));
        }
        lines.extend(in_backward_lines(plan));
    }
    Ok(lines)
}

/// A step in the backward an engine does not run.
pub(crate) fn in_backward_refusal(engine: Engine, runs: &str) -> EmitError {
    unsupported(
        engine,
        Setting::new("optimizer", "in_backward"),
        "true",
        format!(
            "{runs} steps its optimizer once after the backward, over all gradients; \
             a per-parameter step in the backward is not one of its settings, and the gradients it keeps \
             would exceed the prediction"
        ),
        "remove `in_backward`, or compile for `target fsdp` or `target pytorch` (torchtune's optimizer_in_bwd)",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emit::testing::PlanBuilder;

    fn fsdp() -> PlanBuilder {
        PlanBuilder::llama_8b()
            .target(Target::Fsdp)
            .precision(Dtype::Fp32, Dtype::Bf16, None)
    }

    #[test]
    fn fsdp2_lines_follow_precision_resharding_and_offload() {
        let lines = engine_lines(&fsdp().build(), Engine::Torchrun).unwrap();
        let text = lines.join("\n");
        assert!(
            text.contains(
                "MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)"
            ),
            "{text}"
        );
        assert!(
            text.contains("fully_shard(layer, mp_policy=mp, reshard_after_forward=True)"),
            "{text}"
        );
        assert!(!text.contains("CPUOffloadPolicy"), "{text}");
        let z2 = engine_lines(&fsdp().zero(2).build(), Engine::Torchrun)
            .unwrap()
            .join("\n");
        assert!(z2.contains("reshard_after_forward=False"), "{z2}");
        // The root: resharded under zero = 3 like the layers, FSDP2's default (gathered
        // until its backward) under zero = 2.
        assert!(
            text.contains("fully_shard(model, mp_policy=mp, reshard_after_forward=True)"),
            "{text}"
        );
        assert!(z2.contains("fully_shard(model, mp_policy=mp)\n"), "{z2}");

        let offloaded = fsdp()
            .offload(OffloadWhat::Optimizer, OffloadTo::Cpu)
            .offload(OffloadWhat::Params, OffloadTo::Cpu)
            .offload(OffloadWhat::Grads, OffloadTo::Cpu)
            .build();
        let text = engine_lines(&offloaded, Engine::Torchrun)
            .unwrap()
            .join("\n");
        assert!(
            text.contains("fully_shard(model, mp_policy=mp, offload_policy=CPUOffloadPolicy(), reshard_after_forward=True)"),
            "{text}"
        );
        // A part of the set is not an FSDP2 setting.
        let part = fsdp()
            .offload(OffloadWhat::Optimizer, OffloadTo::Cpu)
            .build();
        assert!(matches!(
            engine_lines(&part, Engine::Torchrun),
            Err(EmitError::Unsupported { .. })
        ));
    }

    #[test]
    fn megatron_lines_carry_the_interleaved_schedule() {
        let plan = PlanBuilder::llama_8b()
            .target(Target::Megatron)
            .zero(1)
            .tensor(2)
            .pipeline(4)
            .virtual_stages(2)
            .build();
        let text = engine_lines(&plan, Engine::Torchrun).unwrap().join("\n");
        // 32 layers over 4 stages of 2 chunks: 4 layers a chunk.
        assert!(
            text.contains(
                "--pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 4"
            ),
            "{text}"
        );
        assert!(text.contains("--tensor-model-parallel-size 2"), "{text}");
        assert!(text.contains("--use-distributed-optimizer"), "{text}");
        assert!(
            text.contains("virtual_pipeline_model_parallel_size = 2"),
            "{text}"
        );
        let plain = PlanBuilder::llama_8b()
            .target(Target::Megatron)
            .zero(1)
            .pipeline(4)
            .build();
        let text = engine_lines(&plain, Engine::Torchrun).unwrap().join("\n");
        assert!(!text.contains("virtual"), "{text}");
    }

    #[test]
    fn the_step_in_the_backward_is_hooks_or_a_refusal() {
        let text = engine_lines(&fsdp().in_backward(true).build(), Engine::Torchrun)
            .unwrap()
            .join("\n");
        assert!(
            text.contains("p.register_post_accumulate_grad_hook(step)"),
            "{text}"
        );
        assert!(text.contains("torch.optim.AdamW([p], lr=0.00002"), "{text}");
        let ddp = PlanBuilder::llama_8b().zero(0).in_backward(true).build();
        let text = engine_lines(&ddp, Engine::Torchrun).unwrap().join("\n");
        assert!(
            text.contains("_apply_optimizer_in_backward(torch.optim.AdamW"),
            "{text}"
        );
        for t in [Target::Deepspeed, Target::Megatron] {
            let plan = PlanBuilder::llama_8b()
                .target(t)
                .zero(1)
                .in_backward(true)
                .build();
            let err = engine_lines(&plan, Engine::Torchrun).unwrap_err();
            assert_eq!(
                err.setting(),
                Some(Setting::new("optimizer", "in_backward")),
                "{err}"
            );
        }
    }
}
