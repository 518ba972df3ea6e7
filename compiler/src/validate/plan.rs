//! A measured configuration as `.plan` text: the plan whose prediction is
//! compared with the measurement. Every key is spelled out (no `auto`), so
//! the plan describes exactly the run that was measured.

use super::row::{
    AttnImpl, Autocast, Engine, Family, LossName, MasterWeights, OptimizerName, RunConfig,
    WeightDtype,
};

/// The `target` whose profile predicts what `engine` holds. The FSDP2 and
/// DeepSpeed profiles are named here before the compiler has them: until it
/// does, their rows fail to resolve and the scorer says so, rather than being
/// judged by another engine's profile.
pub fn engine_target(engine: Engine) -> &'static str {
    match engine {
        Engine::Eager | Engine::Ddp | Engine::Tp => "pytorch",
        Engine::Fsdp2 => "fsdp",
        Engine::Deepspeed => "deepspeed",
    }
}

/// `(gpus_per_node, nodes)` for a world of `n` ranks: eight to a node, the
/// way H100 machines come, so a tensor-parallel group stays inside one.
fn node_shape(n: u64) -> (u64, u64) {
    if n > 8 && n.is_multiple_of(8) {
        (8, n / 8)
    } else {
        (n, 1)
    }
}

/// The `parallel` section for the row's engine; `None` for one eager rank.
fn parallel_line(c: &RunConfig) -> Option<String> {
    let data = c.data_parallel();
    let zero = match c.engine {
        Engine::Eager => return None,
        Engine::Ddp | Engine::Tp => 0,
        Engine::Fsdp2 => 3,
        Engine::Deepspeed => c.zero_stage.unwrap_or(0),
    };
    Some(format!(
        "parallel {{ data = {data}  zero = {zero}  tensor = {}  pipeline = 1  sequence = {} }}",
        c.tensor_parallel, c.sequence_parallel
    ))
}

/// The `.plan` projection name for a Hugging Face module name (Llama's and
/// XLM-R's); `None` for a name the plan language has no projection for.
pub fn lora_target(module: &str) -> Option<&'static str> {
    Some(match module {
        "q_proj" | "query" | "q" => "q",
        "k_proj" | "key" | "k" => "k",
        "v_proj" | "value" | "v" => "v",
        "o_proj" | "dense" | "attention.output.dense" | "o" => "o",
        "gate_proj" | "gate" => "gate",
        "up_proj" | "intermediate.dense" | "up" => "up",
        "down_proj" | "output.dense" | "down" => "down",
        _ => return None,
    })
}

/// The plan text for `c`. A LoRA target with no `.plan` projection is passed
/// through as written, so the compiler's diagnostic names it.
pub fn plan_text(c: &RunConfig) -> String {
    let decoder = c.family == Family::Llama;
    let mut s = String::new();
    let mut line = |l: String| {
        s.push_str(&l);
        s.push('\n');
    };
    line(format!("# ground-truth configuration {}", c.name));
    line("model {".into());
    line(format!(
        "  arch = {}",
        if decoder { "decoder" } else { "encoder" }
    ));
    line(format!("  layers = {}", c.layers));
    line(format!("  hidden = {}", c.hidden));
    line(format!("  heads = {}", c.heads));
    line(format!("  kv_heads = {}", c.kv_heads));
    line(format!("  ffn = {}", c.intermediate));
    line(format!(
        "  mlp = {}",
        if decoder { "swiglu" } else { "gelu" }
    ));
    line(format!(
        "  norm = {}",
        if decoder { "rmsnorm" } else { "layernorm" }
    ));
    line(format!("  vocab = {}", c.vocab));
    line(format!("  max_positions = {}", c.max_pos));
    line(format!("  tie_embeddings = {}", c.tie_embeddings));
    line(format!("  dropout = {}", c.dropout));
    line("}".into());
    if let Some(lora) = &c.lora {
        let mut targets: Vec<&str> = Vec::new();
        for t in &lora.targets {
            let short = lora_target(t).unwrap_or(t.as_str());
            if !targets.contains(&short) {
                targets.push(short);
            }
        }
        line(format!(
            "adapter lora {{ rank = {}  alpha = {}  targets = [{}]  dropout = {} }}",
            lora.r,
            lora.alpha,
            targets.join(", "),
            lora.dropout
        ));
    }
    if c.world_size() == 1 {
        line("hardware { gpu = h100-80gb }".into());
    } else {
        let (per_node, nodes) = node_shape(c.world_size());
        line(format!(
            "hardware {{ gpu = h100-80gb  gpus_per_node = {per_node}  nodes = {nodes} }}"
        ));
    }
    let dtype = |d: WeightDtype| match d {
        WeightDtype::Fp32 => "fp32",
        WeightDtype::Bf16 => "bf16",
    };
    let params = dtype(c.weight_dtype);
    // FSDP2's policy computes in its param_dtype from sharded weights kept in
    // their own dtype; the nearest the language says is autocast's
    // `compute` over `params` (issue 14, point 5).
    let compute = match (c.fsdp_mp, c.autocast) {
        (Some(mp), _) => dtype(mp.param_dtype),
        (None, Autocast::Bf16) => "bf16",
        (None, Autocast::None) => params,
    };
    let master = match c.master_weights {
        MasterWeights::None => "none",
        MasterWeights::Fp32 => "fp32",
    };
    // 16-bit weights trained under autocast all the same (`bf16=True` on a bf16 model).
    let autocast = if c.fsdp_mp.is_none() && params == compute && c.autocast == Autocast::Bf16 {
        "  autocast = true"
    } else {
        ""
    };
    line(format!(
        "precision {{ params = {params}  compute = {compute}  master = {master}{autocast} }}"
    ));
    line(
        match c.optimizer {
            OptimizerName::Adamw => "optimizer adamw { impl = foreach }",
            OptimizerName::AdamwFused => "optimizer adamw { impl = fused }",
            OptimizerName::SgdMomentum => "optimizer sgd { momentum = 0.9 }",
            OptimizerName::Sgd => "optimizer sgd { momentum = 0 }",
            OptimizerName::Adafactor => "optimizer adafactor",
        }
        .into(),
    );
    let loss = match c.loss {
        LossName::Lm => "causal_lm",
        LossName::Mlm => "masked_lm",
        LossName::Contrastive => "contrastive",
    };
    let attention = match c.attn {
        AttnImpl::Sdpa => "sdpa",
        AttnImpl::Eager => "eager",
    };
    line(format!(
        "train {{ seq_len = {}  micro_batch = {}  grad_accum = {}  global_batch = {}  attention = {attention}  loss = {loss} }}",
        c.seq,
        c.batch,
        c.grad_accum,
        c.batch
            .saturating_mul(c.grad_accum)
            .saturating_mul(c.data_parallel())
    ));
    if let Some(parallel) = parallel_line(c) {
        line(parallel);
    }
    let checkpoint = match (c.grad_ckpt, c.ckpt_every) {
        (false, _) => "none".to_string(),
        (true, 1) => "full".to_string(),
        (true, n) => format!("every {n}"),
    };
    line(format!("fit {{ checkpoint = {checkpoint}  offload = [] }}"));
    line(format!("target {}", engine_target(c.engine)));
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::validate::row::{self, tests_support::ROW};

    #[test]
    fn a_row_becomes_a_fully_spelled_pytorch_plan() {
        let run = &row::parse("t.jsonl", ROW).unwrap().runs[0];
        let text = plan_text(&run.config);
        for line in [
            "  arch = decoder",
            "  kv_heads = 2",
            "  mlp = swiglu",
            "  dropout = 0.0",
            "precision { params = fp32  compute = bf16  master = none }",
            "optimizer adamw { impl = foreach }",
            "train { seq_len = 128  micro_batch = 2  grad_accum = 1  global_batch = 2  attention = sdpa  loss = causal_lm }",
            "fit { checkpoint = none  offload = [] }",
            "target pytorch",
        ] {
            assert!(text.lines().any(|l| l == line), "no {line:?} in\n{text}");
        }
    }

    #[test]
    fn lora_targets_map_hugging_face_names_once_each() {
        let text = ROW.replace(
            "\"lora\": null",
            r#""lora": {"r": 8, "alpha": 16, "targets": ["query", "key", "value", "dense", "o_proj"], "dropout": 0.05}"#,
        );
        let mut run = row::parse("t.jsonl", &text).unwrap().runs.remove(0);
        run.config.grad_ckpt = true;
        run.config.ckpt_every = 2;
        let plan = plan_text(&run.config);
        assert!(
            plan.contains(
                "adapter lora { rank = 8  alpha = 16  targets = [q, k, v, o]  dropout = 0.05 }"
            ),
            "{plan}"
        );
        assert!(plan.contains("checkpoint = every 2"), "{plan}");
        assert_eq!(lora_target("intermediate.dense"), Some("up"));
        assert_eq!(lora_target("lm_head"), None);
    }

    fn plan_of(text: &str) -> String {
        plan_text(&row::parse("t.jsonl", text).unwrap().runs[0].config)
    }

    fn has(plan: &str, line: &str) {
        assert!(plan.lines().any(|l| l == line), "no {line:?} in\n{plan}");
    }

    #[test]
    fn a_single_gpu_plan_has_no_parallel_section() {
        let plan = plan_of(ROW);
        has(&plan, "hardware { gpu = h100-80gb }");
        assert!(!plan.contains("parallel"), "{plan}");
    }

    #[test]
    fn a_ddp_row_is_data_parallel_without_zero_on_pytorch() {
        let plan = plan_of(&row::tests_support::ddp());
        has(
            &plan,
            "hardware { gpu = h100-80gb  gpus_per_node = 8  nodes = 1 }",
        );
        has(
            &plan,
            "parallel { data = 8  zero = 0  tensor = 1  pipeline = 1  sequence = false }",
        );
        // The batch per rank is the row's; the global batch counts every rank.
        has(&plan, "train { seq_len = 128  micro_batch = 2  grad_accum = 1  global_batch = 16  attention = sdpa  loss = causal_lm }");
        has(&plan, "target pytorch");
    }

    #[test]
    fn a_tp_row_splits_the_layers_over_the_whole_world() {
        let plan = plan_of(&row::tests_support::tp());
        has(
            &plan,
            "hardware { gpu = h100-80gb  gpus_per_node = 2  nodes = 1 }",
        );
        has(
            &plan,
            "parallel { data = 1  zero = 0  tensor = 2  pipeline = 1  sequence = true }",
        );
        assert!(plan.contains("global_batch = 2 "), "{plan}");
        has(&plan, "target pytorch");
    }

    #[test]
    fn an_fsdp2_row_is_zero_3_computing_in_its_param_dtype() {
        let plan = plan_of(&row::tests_support::fsdp2());
        // Sixteen ranks come as two nodes of eight.
        has(
            &plan,
            "hardware { gpu = h100-80gb  gpus_per_node = 8  nodes = 2 }",
        );
        has(
            &plan,
            "precision { params = fp32  compute = bf16  master = none }",
        );
        has(
            &plan,
            "parallel { data = 16  zero = 3  tensor = 1  pipeline = 1  sequence = false }",
        );
        has(&plan, "target fsdp");
    }

    #[test]
    fn a_deepspeed_row_keeps_its_stage_and_fp32_master_weights() {
        let plan = plan_of(&row::tests_support::deepspeed());
        has(
            &plan,
            "precision { params = bf16  compute = bf16  master = fp32 }",
        );
        has(
            &plan,
            "parallel { data = 4  zero = 2  tensor = 1  pipeline = 1  sequence = false }",
        );
        has(&plan, "target deepspeed");
    }

    #[test]
    fn every_engine_names_a_target() {
        assert_eq!(engine_target(Engine::Eager), "pytorch");
        assert_eq!(engine_target(Engine::Ddp), "pytorch");
        assert_eq!(engine_target(Engine::Tp), "pytorch");
        assert_eq!(engine_target(Engine::Fsdp2), "fsdp");
        assert_eq!(engine_target(Engine::Deepspeed), "deepspeed");
        assert_eq!(node_shape(2), (2, 1));
        assert_eq!(node_shape(8), (8, 1));
        assert_eq!(node_shape(64), (8, 8));
        assert_eq!(node_shape(12), (12, 1));
    }
}
