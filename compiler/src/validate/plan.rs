//! A measured configuration as `.plan` text: the plan whose prediction is
//! compared with the measurement. Every key is spelled out (no `auto`), so
//! the plan describes exactly the run that was measured.

use super::row::{AttnImpl, Autocast, Family, LossName, OptimizerName, RunConfig, WeightDtype};

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
    line("hardware { gpu = h100-80gb }".into());
    let params = match c.weight_dtype {
        WeightDtype::Fp32 => "fp32",
        WeightDtype::Bf16 => "bf16",
    };
    let compute = match c.autocast {
        Autocast::Bf16 => "bf16",
        Autocast::None => params,
    };
    line(format!(
        "precision {{ params = {params}  compute = {compute}  master = none }}"
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
        c.batch.saturating_mul(c.grad_accum)
    ));
    let checkpoint = match (c.grad_ckpt, c.ckpt_every) {
        (false, _) => "none".to_string(),
        (true, 1) => "full".to_string(),
        (true, n) => format!("every {n}"),
    };
    line(format!("fit {{ checkpoint = {checkpoint}  offload = [] }}"));
    line("target pytorch".into());
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
}
