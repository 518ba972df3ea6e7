//! `--explain` lines for the setups of `docs/language.md` that only some engines
//! run (linear biases, squared-ReLU MLPs, ...): what the memory model does
//! with each, so a reader can check it against the engine's code.

use super::Decision;
use crate::spec::{Biases, Mlp, Spec};

pub(super) fn record(spec: &Spec, log: &mut Vec<Decision>) {
    let m = &spec.model;
    if let Some(b) = m.numerics.linear_bias {
        if b != m.family_biases() {
            log.push(Decision::new(
                "model",
                format!("bias = {}", b.as_str()),
                match b {
                    Biases::All => "every attention and MLP projection has a bias (Megatron's `add_bias_linear`): one vector per projection in the weights, gradients and optimizer state; `F.linear` saves its input and weight with or without one, so nothing more is saved",
                    Biases::Qkv => "the query, key and value projections have biases (Qwen2): one vector each in the weights, gradients and optimizer state; `F.linear` saves its input and weight with or without one, so nothing more is saved",
                    Biases::None => "no projection has a bias: the weights, gradients and optimizer state lose one vector per projection",
                },
            ));
        }
    }
    if m.numerics.qk_norm {
        log.push(Decision::new(
            "model",
            "qk_norm = true",
            "the model's norm over each head of the queries and keys before RoPE (Qwen3's `q_norm` / `k_norm`): a weight of head_dim values each, and per layer what the norm keeps for the backward over q and k (in PyTorch its fp32 upcast input, the per-row rsqrt and its output)",
        ));
    }
    if let Some(r) = &m.numerics.rope_scaling {
        log.push(Decision::new(
            "model",
            format!("rope_scaling = {}", r.name()),
            "RoPE's frequencies are rescaled as the config says: the same tensors, so no memory changes",
        ));
    }
    if let Some(r) = m.numerics.rotary_dims {
        log.push(Decision::new(
            "model",
            format!("rotary_dims = {r} of {}", m.head_dim),
            "RoPE turns the first values of each head and passes the rest through (the config's `partial_rotary_factor`): PyTorch's Phi-3 attention cuts q and k, rotates one part and concatenates, which keeps nothing more for the backward; `rcoa run` swaps the rotated halves with one gather, its tables each a whole head wide",
        ));
    }
    if spec.optimizer_in_backward {
        let why = if spec.target == crate::spec::Target::Burn {
            "`rcoa run` steps each unit (the head with the loss, each layer, the embedding) as the backward leaves it, its parameters one after another, and frees their gradients: no full set of gradients ever exists, the backward holds one unit's (and a tied embedding matrix's from the head until the embedding steps), the step's temporaries are one parameter's, charged where the unit's backward ends; with data parallelism the unit's gradients are all-reduced (one flat fp32 vector) before it steps; one backward per step (grad_accum = 1)".to_string()
        } else {
            let engine = match spec.target {
                crate::spec::Target::Fsdp => "; under FSDP2 the hooks sit on the sharded parameters and fire once a unit's reduced shard is set: the temporaries are a shard's (1/data), none on the device when CPUOffloadPolicy steps on the host",
                _ => "",
            };
            format!("torchtune's `optimizer_in_bwd`: each parameter's step runs in a post-accumulate-grad hook as soon as its gradient is complete, then the gradient is freed; no full set of gradients ever exists (each lives only until its last backward op: a tied matrix's from the head's to the embedding's), the step's temporaries are one parameter's, charged to that op's backward; one backward per step (grad_accum = 1){engine}")
        };
        log.push(Decision::new("given", "optimizer.in_backward = true", why));
    }
    if spec.optimizer.implementation == crate::spec::OptImpl::Paged {
        log.push(Decision::new(
            "given",
            "optimizer.impl = paged",
            "bitsandbytes' paged optimizer: a fused kernel (no temporaries); its state is CUDA unified memory, counted on the device while the budget has room and evicted to the host for what it has not (then moved out and back over PCIe each step, priced as host traffic); bytes other than the state must fit on their own",
        ));
    }
    let v = spec.parallel.virtual_stages;
    if v > 1 {
        let p = spec.parallel.pipeline.fixed().unwrap_or(1);
        log.push(Decision::new(
            "given",
            format!("virtual_stages = {v}"),
            format!(
                "Megatron's interleaved 1F1B: each of the {p} pipeline ranks holds {v} model chunks of {} layers; the bubble is (p−1)/v = {:.2} micro-steps instead of {}, every stage boundary is crossed {v} times a micro-batch, and the first rank keeps (p−1)·2 + (v−1)·p + 1 = {} chunk forwards in flight ({:.2} micro-batches of its stage; plain 1F1B: {p}); micro-batches per step are a multiple of {p}",
                m.layers / (p * v).max(1),
                (p - 1) as f64 / v as f64,
                p - 1,
                (p - 1) * 2 + (v - 1) * p + 1,
                ((p - 1) * 2 + (v - 1) * p + 1) as f64 / v as f64,
            ),
        ));
    }
    if m.mlp == Mlp::SquaredRelu {
        log.push(Decision::new(
            "model",
            "mlp = squared_relu",
            "Megatron's `squared_relu`: up projection, `relu(x) ** 2`, down projection; the backward keeps relu's output (pow's input, the same tensor) and the square (the down projection's input): two [tokens, ffn] tensors per layer, not the up projection's output",
        ));
    }
}
