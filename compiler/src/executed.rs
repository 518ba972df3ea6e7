//! What `rcoa run` executes: setups the language says and the memory model
//! predicts for PyTorch engines, but rcoa's Burn executor (`backend/`) does
//! not carry out.
//!
//! A plan with `target burn` (the default) is a plan for `rcoa run`, so such a
//! setup is refused when the plan is compiled, before any pass: the search
//! never picks it and the executor never receives it. The error names the
//! setup and the `target` that predicts it. What the executor refuses at run
//! time for other reasons (a data-parallel degree against the ranks started,
//! host memory) stays in `rcoa_backend::check_plan_ranks`.

use crate::compile::CompileError;
use crate::lowered::LoweredPlan;
use crate::spec::{
    CheckpointChoice, Dtype, Mlp, ModelSpec, OffloadWhat, OptImpl, OptimizerKind, OptimizerSpec,
    Positions, PrecisionSpec, RopeScaling, Spec, Target,
};

/// `Err` naming the first setup of `spec` that `rcoa run` does not execute, when the plan
/// is for it (`target burn`).
pub fn check(spec: &Spec) -> Result<(), CompileError> {
    if spec.target != Target::Burn {
        return Ok(());
    }
    match refusal(spec) {
        None => Ok(()),
        Some((what, instead)) => Err(CompileError::NotExecuted {
            what: format!("`rcoa run` does not execute {what} (the plan is `target burn`)"),
            help: format!(
                "{instead}; or write `target pytorch` to predict it for PyTorch engines (`rcoa emit`)"
            ),
        }),
    }
}

/// (the setup, what the plan can say instead for `rcoa run`).
fn refusal(spec: &Spec) -> Option<(String, String)> {
    let selective_op = spec.fit.checkpoint == CheckpointChoice::SelectiveOp;
    if let Some(r) = carried(&spec.model, &spec.optimizer, &spec.precision, selective_op) {
        return Some(r);
    }
    if let Some(r) = partitioned(&spec.optimizer, spec.adapter.is_some()) {
        return Some(r);
    }
    if spec.optimizer_in_backward {
        if let Some(r) = in_backward(&spec.precision) {
            return Some(r);
        }
    }
    scheduled(spec.parallel.virtual_stages)
}

/// Adam-mini over LoRA's factors: its blocks are a model's heads, neurons and tokens
/// (`backend/src/optim/adam_mini.rs`), which an adapter's `[in, rank]` and `[rank, out]`
/// factors do not have (the authors' package cuts q's and k's factors into `hidden²/heads`
/// values, which fails unless the rank is a multiple of `head_dim`, and the others per row).
fn partitioned(o: &OptimizerSpec, adapted: bool) -> Option<(String, String)> {
    (o.kind == OptimizerKind::AdamMini && adapted).then(|| {
        (
            "`optimizer adam-mini` over LoRA adapters".into(),
            "its second moment is one value per attention head, neuron or token of the model's own weights, which \
             adapter factors do not have: write `optimizer adamw` (or `adam8bit`) for adapters, or adam-mini for a \
             full fine-tune"
                .into(),
        )
    })
}

/// The optimizer step in the backward (`backend/src/in_backward.rs`) where `rcoa run` cannot
/// take it: under fp16's loss scale, which checks every gradient before any step. (ZeRO and
/// offload of the optimizer, parameters or gradients are kept out of the search by
/// `passes::precision`; a plan that requires them is refused there.)
fn in_backward(p: &PrecisionSpec) -> Option<(String, String)> {
    (p.params == Dtype::Fp16 || p.compute == Dtype::Fp16).then(|| {
        (
            "the optimizer step in the backward (`optimizer.in_backward = true`) with fp16".into(),
            "fp16's loss scale is checked over every gradient before any step: remove `in_backward`, or use bf16".into(),
        )
    })
}

/// [`in_backward`] for a lowered plan, which may come from another target with ZeRO or
/// offload the search for `target burn` keeps out.
fn in_backward_lowered(plan: &LoweredPlan) -> Option<(String, String)> {
    let r = &plan.resolved;
    if !r.optimizer_in_backward {
        return None;
    }
    let flat = r.zero > 0 || r.offload.iter().any(|o| o.what != OffloadWhat::Activations);
    in_backward(&plan.precision)
        .or_else(|| {
            flat.then(|| {
                (
                    "the optimizer step in the backward (`optimizer.in_backward = true`) with ZeRO or offload".into(),
                    "it steps in the backward with the whole optimizer on the device: write `zero = 0` and offload nothing but activations".into(),
                )
            })
        })
        // The language's rule for a plan; a lowered one may have been edited.
        .or_else(|| {
            (r.grad_accum > 1).then(|| {
                (
                    format!("the optimizer step in the backward (`optimizer.in_backward = true`) with `grad_accum = {}`", r.grad_accum),
                    "every backward is a step: write `grad_accum = 1`".into(),
                )
            })
        })
}

/// A rotated share of each head (`partial_rotary_factor`) or LongRoPE factors that no longer
/// fit the head: a Hugging Face base whose `head_dim` the plan overrides.
fn rotary_mismatch(m: &ModelSpec) -> Option<(String, String)> {
    let rotated = m.numerics.rotary_dims.unwrap_or(m.head_dim);
    let factors = match &m.numerics.rope_scaling {
        Some(RopeScaling::LongRope { short_factor, .. }) => Some(short_factor.len() as u64),
        _ => None,
    };
    let fits = rotated >= 2
        && rotated.is_multiple_of(2)
        && rotated <= m.head_dim
        && factors.is_none_or(|f| f * 2 == rotated);
    (m.positions == Positions::Rope && !fits).then(|| {
        (
            format!(
                "RoPE over {rotated} of each head's {} values{}",
                m.head_dim,
                factors.map_or(String::new(), |f| format!(" with {f} LongRoPE factors"))
            ),
            "it rotates an even number of values no larger than the head, one LongRoPE factor per pair: keep the config's `head_dim`".into(),
        )
    })
}

/// The step's schedule: interleaved pipeline stages.
fn scheduled(virtual_stages: u64) -> Option<(String, String)> {
    if virtual_stages > 1 {
        return Some((
            format!("interleaved pipeline stages (`parallel.virtual_stages = {virtual_stages}`)"),
            "it trains data-parallel only: remove `virtual_stages` and `pipeline`".into(),
        ));
    }
    None
}

/// The setups a lowered plan carries (the executor's input): the model's MLP and biases,
/// the optimizer's implementation, op-level recomputation.
fn carried(
    m: &ModelSpec,
    o: &OptimizerSpec,
    p: &PrecisionSpec,
    selective_op: bool,
) -> Option<(String, String)> {
    if p.params == Dtype::Fp16 && p.master.is_none() {
        return Some((
            "fp16 weights without an fp32 master (`params = fp16`, `master = none`)".into(),
            "it divides fp16's loss scale out of fp32 gradients (as PyTorch's GradScaler, which refuses fp16 ones): write `master = fp32`, or `params = fp32` with `compute = fp16`".into(),
        ));
    }
    if p.autocast && p.params.bytes() <= p.compute.bytes() {
        return Some((
            "autocast over 16-bit weights (`precision.autocast = true`)".into(),
            "it computes in the weights' dtype, or autocasts fp32 weights: remove `autocast`, or write `params = fp32`".into(),
        ));
    }
    if m.mlp == Mlp::SquaredRelu {
        return Some((
            "a squared-ReLU MLP (`model.mlp = squared_relu`)".into(),
            "its MLPs are SwiGLU or GELU: write `mlp = swiglu` or `mlp = gelu`".into(),
        ));
    }
    if let Some(RopeScaling::Other { name }) = &m.numerics.rope_scaling {
        return Some((
            format!("RoPE scaling of type `{name}` (the config's `rope_scaling`)"),
            "it rescales RoPE by `linear`, `llama3` and `longrope` only: train from a config with one of them or none".into(),
        ));
    }
    if let Some(r) = rotary_mismatch(m) {
        return Some(r);
    }
    if selective_op {
        return Some((
            "op-level selective recomputation (`fit.checkpoint = selective_op`)".into(),
            "it recomputes whole layers: write `checkpoint = full`, `every N` or `auto`".into(),
        ));
    }
    if o.kind != OptimizerKind::Adam8bit && o.state != Dtype::Fp32 {
        return Some((
            format!("`optimizer.state = {}`", o.state.as_str()),
            "it keeps the moments in the gradients' dtype (fp32 with a master copy or under ZeRO and offload, the weights' \
             dtype without): remove `state`, or write `precision { ... master = none }` for 16-bit moments without ZeRO"
                .into(),
        ));
    }
    if o.implementation == OptImpl::Paged {
        return Some((
            "bitsandbytes' paged optimizers (`optimizer.impl = paged`)".into(),
            "its optimizer state is ordinary device (or, offloaded, host) memory: write `impl = fused`, or `fit.offload = [optimizer]` to let the state move to the host".into(),
        ));
    }
    None
}

/// For `rcoa run --lowered FILE.json`: `Err` naming a setup of the lowered plan that the
/// executor does not carry out (a plan compiled for another engine), as
/// [`check`] refuses it at compile time. Its pipeline degree is refused by the executor
/// itself.
pub fn check_lowered(plan: &LoweredPlan) -> Result<(), String> {
    let r = &plan.resolved;
    let selective_op = r.checkpoint == "selective_op";
    let refusal = carried(&plan.model, &plan.optimizer, &plan.precision, selective_op)
        .or_else(|| partitioned(&plan.optimizer, plan.adapter.is_some()))
        .or_else(|| in_backward_lowered(plan))
        .or_else(|| scheduled(r.virtual_stages));
    match refusal {
        None => Ok(()),
        Some((what, instead)) => Err(format!(
            "`rcoa run` does not execute {what}: {instead} (this lowered plan was compiled for `target {}`)",
            format!("{:?}", plan.target).to_lowercase()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Attention, Biases, Norm};
    use crate::testing::SpecBuilder;

    fn burn() -> Spec {
        let mut s = SpecBuilder::new().build();
        s.target = Target::Burn;
        s
    }

    fn refused(spec: &Spec) -> String {
        match check(spec) {
            Err(CompileError::NotExecuted { what, help }) => format!("{what} | {help}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn burn_refuses_what_the_executor_does_not_build() {
        let mut s = burn();
        assert_eq!(check(&s), Ok(()));
        s.model.mlp = Mlp::SquaredRelu;
        assert!(refused(&s).contains("squared-ReLU"), "{}", refused(&s));
        s.target = Target::Pytorch;
        assert_eq!(check(&s), Ok(()));

        // Any biases with either norm are built.
        for b in [Biases::None, Biases::Qkv, Biases::All] {
            for norm in [Norm::Rmsnorm, Norm::Layernorm] {
                let mut s = burn();
                s.model.numerics.linear_bias = Some(b);
                s.model.norm = norm;
                assert_eq!(check(&s), Ok(()));
            }
        }
        // A window shorter than the sequence is masked by the eager and selective
        // attentions' bias and by the fused kernels themselves.
        for attention in [Attention::Flash, Attention::Eager, Attention::Sdpa] {
            let mut s = burn();
            s.train.attention = attention;
            s.model.numerics.sliding_window = Some(s.train.seq_len - 1);
            assert_eq!(check(&s), Ok(()));
        }
        // RoPE rescaling the executor does not compute is refused, and predicted for PyTorch.
        let mut s = burn();
        s.model.numerics.rope_scaling = Some(RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_positions: 8192,
        });
        assert_eq!(check(&s), Ok(()));
        s.model.numerics.rope_scaling = Some(RopeScaling::Other {
            name: "yarn".into(),
        });
        assert!(refused(&s).contains("`yarn`"), "{}", refused(&s));
        s.target = Target::Pytorch;
        assert_eq!(check(&s), Ok(()));
        // LongRoPE and a rotated share of the head are computed while they fit the head.
        let mut s = burn();
        let hd = s.model.head_dim;
        s.model.numerics.rotary_dims = Some(hd / 2);
        s.model.numerics.rope_scaling = Some(RopeScaling::LongRope {
            short_factor: vec![1.0; hd as usize / 4],
            long_factor: vec![2.0; hd as usize / 4],
            original_max_positions: 4096,
            attention_factor: 1.2,
        });
        assert_eq!(check(&s), Ok(()));
        s.model.numerics.rotary_dims = None;
        assert!(
            refused(&s).contains(&format!(
                "RoPE over {hd} of each head's {hd} values with {} LongRoPE factors",
                hd / 4
            )),
            "{}",
            refused(&s)
        );
        s.model.numerics.rope_scaling = None;
        s.model.numerics.rotary_dims = Some(hd + 2);
        assert!(
            refused(&s).contains("keep the config's `head_dim`"),
            "{}",
            refused(&s)
        );
        s.target = Target::Pytorch;
        assert_eq!(check(&s), Ok(()));

        // Adam-mini partitions the model's own weights, not adapter factors.
        let mut s = burn();
        s.optimizer.kind = OptimizerKind::AdamMini;
        assert_eq!(check(&s), Ok(()));
        s.adapter = Some(crate::spec::AdapterSpec {
            kind: crate::spec::AdapterKind::Lora,
            rank: 8,
            alpha: 16.0,
            targets: vec![crate::spec::Proj::Q, crate::spec::Proj::V],
            dropout: 0.0,
            base: Dtype::Bf16,
        });
        assert!(refused(&s).contains("`optimizer adam-mini` over LoRA adapters"));
        s.target = Target::Pytorch;
        assert_eq!(check(&s), Ok(()));
        for kind in [OptimizerKind::Adafactor, OptimizerKind::Lion] {
            let mut s = burn();
            s.optimizer.kind = kind;
            assert_eq!(check(&s), Ok(()));
        }
        let mut s = burn();
        s.optimizer.kind = OptimizerKind::Lion;
        // A state dtype the executor does not keep: it would be predicted, not run.
        s.optimizer.state = Dtype::Bf16;
        assert!(
            refused(&s).contains("`optimizer.state = bf16`"),
            "{}",
            refused(&s)
        );
        s.target = Target::Pytorch;
        assert_eq!(check(&s), Ok(()));

        // fp16 weights need the fp32 master the loss scale is divided out in.
        let mut s = burn();
        s.precision.params = Dtype::Fp16;
        s.precision.compute = Dtype::Fp16;
        s.precision.master = None;
        assert!(refused(&s).contains("`master = none`"), "{}", refused(&s));
        s.precision.master = Some(Dtype::Fp32);
        assert_eq!(check(&s), Ok(()));
        s.precision.master = None;
        s.target = Target::Pytorch;
        assert_eq!(check(&s), Ok(()));

        let mut s = burn();
        s.precision.params = crate::spec::Dtype::Bf16;
        s.precision.compute = crate::spec::Dtype::Bf16;
        s.precision.autocast = true;
        assert!(
            refused(&s).contains("`precision.autocast = true`"),
            "{}",
            refused(&s)
        );
    }

    /// A lowered plan carries the step's schedule; `rcoa run --lowered` refuses what it
    /// does not run, as the compile-time check does.
    #[test]
    fn lowered_schedules_are_refused() {
        use crate::emit::testing::PlanBuilder;
        let plain = PlanBuilder::llama_8b().zero(0).build();
        assert_eq!(check_lowered(&plain), Ok(()));
        let inbwd = PlanBuilder::llama_8b().in_backward(true).build();
        let e = check_lowered(&inbwd).unwrap_err();
        assert!(e.contains("`optimizer.in_backward = true`"), "{e}");
        let interleaved = PlanBuilder::llama_8b()
            .pipeline(4)
            .virtual_stages(2)
            .build();
        let e = check_lowered(&interleaved).unwrap_err();
        assert!(e.contains("`parallel.virtual_stages = 2`"), "{e}");
    }
}
