//! Resolver tests of the setups only some engines run (`docs/language.md`):
//! what each key reads to, and the diagnostic of each bad value.

use super::*;
use crate::spec::*;
use std::path::Path;

const BASE: &str = r#"
model "llama-3.1-8b"
hardware { gpu = h100-80gb gpus_per_node = 8 }
train { seq_len = 2048 global_batch = 64 }
"#;

/// `config` written as `c.json` into `dir`, read through `model hf "c.json"`.
fn resolve_config(dir: &Path, config: &str) -> Result<Spec, ResolveErrors> {
    std::fs::write(dir.join("c.json"), config).unwrap();
    let plan = "model hf \"c.json\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 32 global_batch = 4 }\n";
    let file = rcoa_grammar::parse("t.plan", plan).unwrap();
    resolve(&file, &ResolveContext::new("t.plan", plan, dir))
}

fn run(src: &str) -> Result<Spec, ResolveErrors> {
    let file = rcoa_grammar::parse("test.plan", src)
        .unwrap_or_else(|e| panic!("parse failed: {e:?}\n{src}"));
    resolve(
        &file,
        &ResolveContext::new("test.plan", src, Path::new(".")),
    )
}

fn ok(extra: &str) -> Spec {
    let src = format!("{BASE}{extra}\n");
    run(&src).unwrap_or_else(|e| panic!("expected ok, got {:?}\n{src}", e.errors()))
}

/// The single error of `BASE + extra`: its code, the text it points at, its message and help.
fn one(extra: &str) -> (String, String, String, String) {
    let src = format!("{BASE}{extra}\n");
    let e = run(&src).expect_err(&src);
    assert_eq!(e.errors().len(), 1, "{:#?}", e.errors());
    let e = &e.errors()[0];
    let at = e
        .span()
        .map_or(String::new(), |s| src[s.start..s.end].to_string());
    (
        e.code().to_string(),
        at,
        e.message().to_string(),
        e.help().unwrap_or_default().to_string(),
    )
}

#[test]
fn model_bias_and_squared_relu() {
    let s = ok("");
    assert_eq!(
        (s.model.numerics.linear_bias, s.model.biases()),
        (None, Biases::None)
    );
    // The override is written into the preset.
    let s = BASE.replace(
        "model \"llama-3.1-8b\"",
        "model \"llama-3.1-8b\" { bias = true mlp = squared_relu }",
    );
    let s = run(&s).unwrap();
    assert_eq!(s.model.numerics.linear_bias, Some(Biases::All));
    assert!(s.model.bias_on(Proj::Down));
    assert_eq!(s.model.mlp, Mlp::SquaredRelu);
    // Qwen3's norm over each head of q and k.
    let s = run(&BASE.replace(
        "model \"llama-3.1-8b\"",
        "model \"llama-3.1-8b\" { qk_norm = true }",
    ))
    .unwrap();
    assert!(s.model.numerics.qk_norm);
    assert!(!ok("").model.numerics.qk_norm);
    let e = run(&BASE.replace(
        "model \"llama-3.1-8b\"",
        "model \"llama-3.1-8b\" { qk_norm = yes }",
    ))
    .unwrap_err();
    assert_eq!(e.codes(), vec!["rcoa::wrong_kind"]);
    // Qwen2's: the query, key and value projections only.
    let s = run(&BASE.replace(
        "model \"llama-3.1-8b\"",
        "model \"llama-3.1-8b\" { bias = qkv }",
    ))
    .unwrap();
    assert_eq!(s.model.biases(), Biases::Qkv);
    assert!(s.model.bias_on(Proj::V) && !s.model.bias_on(Proj::O));
    // An explicit GPT block: LayerNorm has biases unless told otherwise.
    let gpt = "model { arch = decoder layers = 2 hidden = 64 heads = 4 ffn = 256 vocab = 100 \
               norm = layernorm mlp = squared_relu bias = false }\n\
               hardware { gpu = h100-80gb }\ntrain { seq_len = 32 global_batch = 4 }\n";
    let s = run(gpt).unwrap();
    assert_eq!(s.model.biases(), Biases::None);
    assert_eq!(
        run(&gpt.replace(" bias = false", ""))
            .unwrap()
            .model
            .biases(),
        Biases::All
    );

    let bad = BASE.replace(
        "model \"llama-3.1-8b\"",
        "model \"llama-3.1-8b\" { bias = 1 }",
    );
    let e = run(&bad).unwrap_err();
    assert_eq!(e.codes(), vec!["rcoa::wrong_kind"]);
    assert!(
        format!("{:?}", e.errors()[0]).contains("`qkv`"),
        "{:?}",
        e.errors()[0]
    );
    let bad = BASE.replace(
        "model \"llama-3.1-8b\"",
        "model \"llama-3.1-8b\" { bias = qk }",
    );
    let e = run(&bad).unwrap_err();
    assert_eq!(e.codes(), vec!["rcoa::unknown_value"]);
    assert!(
        format!("{:?}", e.errors()[0]).contains("qkv"),
        "{:?}",
        e.errors()[0]
    );
    let bad = BASE.replace(
        "model \"llama-3.1-8b\"",
        "model \"llama-3.1-8b\" { mlp = squared_rellu }",
    );
    let e = run(&bad).unwrap_err();
    assert_eq!(e.codes(), vec!["rcoa::unknown_value"]);
    assert!(
        format!("{:?}", e.errors()[0]).contains("squared_relu"),
        "did you mean: {:?}",
        e.errors()[0]
    );
    // No gate to adapt.
    let lora = BASE.replace(
        "model \"llama-3.1-8b\"",
        "model \"llama-3.1-8b\" { mlp = squared_relu }\nadapter lora { rank = 8 alpha = 16 targets = [q, gate] }",
    );
    let e = run(&lora).unwrap_err();
    assert_eq!(e.codes(), vec!["rcoa::conflict"], "{:?}", e.errors());
}

#[test]
fn virtual_stages() {
    assert_eq!(ok("").parallel.virtual_stages, 1);
    let s = ok("parallel { pipeline = 4 virtual_stages = 2 }");
    assert_eq!(
        (s.parallel.pipeline, s.parallel.virtual_stages),
        (Choice::Fixed(4), 2)
    );
    let (code, at, msg, help) = one("parallel { virtual_stages = 2 }");
    assert_eq!((code.as_str(), at.as_str()), ("rcoa::not_applicable", "2"));
    assert!(msg.contains("fixed `pipeline` of 2 or more"), "{msg}");
    assert!(help.contains("pipeline = 4"), "{help}");
    let (code, ..) = one("parallel { pipeline = auto virtual_stages = 2 }");
    assert_eq!(code, "rcoa::not_applicable");
    let (code, ..) = one("parallel { pipeline = 4 virtual_stages = auto }");
    assert_eq!(code, "rcoa::wrong_kind");
    let (code, ..) = one("parallel { pipeline = 4 virtual_stages = 0 }");
    assert_eq!(code, "rcoa::out_of_range");
    // 32 layers do not cut into 4 × 3 equal chunks.
    let (code, at, msg, _) = one("parallel { pipeline = 4 virtual_stages = 3 }");
    assert_eq!((code.as_str(), at.as_str()), ("rcoa::not_divisible", "3"));
    assert!(msg.contains("pipeline × virtual_stages"), "{msg}");
    // Megatron groups micro-batches by the pipeline size (data = 8 / 4 = 2).
    let plan = |ga: u64| {
        let train = format!(
            "global_batch = {} micro_batch = 2 grad_accum = {ga}",
            4 * ga
        );
        format!(
            "{}parallel {{ pipeline = 4 virtual_stages = 2 }}\n",
            BASE.replace("global_batch = 64", &train)
        )
    };
    assert!(run(&plan(16)).is_ok());
    let e = run(&plan(15)).unwrap_err();
    assert_eq!(e.codes(), vec!["rcoa::not_divisible"], "{:?}", e.errors());
    assert!(e.errors()[0].message().contains("grad_accum"));
}

#[test]
fn optimizer_in_backward_and_paged() {
    let s = ok("");
    assert!(!s.optimizer_in_backward);
    let s = ok("optimizer adamw { in_backward = true impl = fused }");
    assert!(s.optimizer_in_backward);
    assert_eq!(s.optimizer.implementation, OptImpl::Fused);
    for kind in ["adamw", "adam", "adam8bit", "lion"] {
        let s = ok(&format!("optimizer {kind} {{ impl = paged }}"));
        assert_eq!(s.optimizer.implementation, OptImpl::Paged, "{kind}");
    }
    let (code, at, msg, help) = one("optimizer sgd { impl = paged }");
    assert_eq!(
        (code.as_str(), at.as_str()),
        ("rcoa::not_applicable", "paged")
    );
    assert!(msg.contains("adam, adamw, adam8bit and lion"), "{msg}");
    assert!(help.contains("bitsandbytes"), "{help}");
    let (code, ..) = one("optimizer adamw { in_backward = yes }");
    assert_eq!(code, "rcoa::wrong_kind");
    // No gradient accumulation with the step in the backward.
    let plan = BASE.replace("global_batch = 64", "global_batch = 64 grad_accum = 4");
    let src = format!("{plan}optimizer adamw {{ in_backward = true }}\n");
    let e = run(&src).unwrap_err();
    assert_eq!(e.codes(), vec!["rcoa::not_applicable"], "{:?}", e.errors());
    let err = &e.errors()[0];
    assert!(
        err.message().contains("cannot accumulate"),
        "{}",
        err.message()
    );
    assert_eq!(
        &src[err.span().unwrap().start..err.span().unwrap().end],
        "true"
    );
    assert!(run(&src.replace("grad_accum = 4", "grad_accum = 1")).is_ok());
}

#[test]
fn checkpoint_selective_op() {
    let s = ok("fit { checkpoint = selective_op }");
    assert_eq!(s.fit.checkpoint, CheckpointChoice::SelectiveOp);
    let (code, at, msg, help) = one("fit { checkpoint = selective_ops }");
    assert_eq!(
        (code.as_str(), at.as_str()),
        ("rcoa::unknown_value", "selective_ops")
    );
    assert!(
        format!("{msg} {help}").contains("selective_op"),
        "{msg} / {help}"
    );
}

#[test]
fn must_offload() {
    assert!(ok("").fit.must_offload.is_empty());
    let s = ok("fit { must_offload = [optimizer]  offload = [params:cpu] }");
    assert_eq!(
        s.fit.must_offload,
        vec![Offload {
            what: OffloadWhat::Optimizer,
            to: OffloadTo::Cpu
        }]
    );
    assert_eq!(s.fit.offload.len(), 1);
    // The same tensors required in one place and allowed or required in another.
    let nvme = BASE.replace("gpus_per_node = 8", "gpus_per_node = 8  nvme = 4 TB");
    let src =
        format!("{nvme}fit {{ must_offload = [optimizer:cpu]  offload = [optimizer:nvme] }}\n");
    let e = run(&src).unwrap_err();
    assert_eq!(e.codes(), vec!["rcoa::conflict"], "{:?}", e.errors());
    let e = &e.errors()[0];
    let at = e.span().unwrap();
    assert_eq!(&src[at.start..at.end], "optimizer:cpu");
    assert!(e.message().contains("`optimizer:nvme`"), "{}", e.message());
    assert!(e.help().unwrap().contains("one place"));
    let src = format!("{nvme}fit {{ must_offload = [grads:cpu, grads:nvme] }}\n");
    assert_eq!(run(&src).unwrap_err().codes(), vec!["rcoa::conflict"]);
    // Required NVMe offload needs an NVMe size.
    let (code, at, ..) = one("fit { must_offload = [params:nvme] }");
    assert_eq!(
        (code.as_str(), at.as_str()),
        ("rcoa::missing_key", "params:nvme")
    );
    let (code, at, ..) = one("fit { must_offload = [weights] }");
    assert_eq!(
        (code.as_str(), at.as_str()),
        ("rcoa::unknown_value", "weights")
    );
}

/// A Llama `config.json` with `attention_bias` and `mlp_bias` reads as `bias = true`; one
/// without the other is refused (the plan's `bias` says both at once).
#[test]
fn hf_llama_biases() {
    let dir = std::env::temp_dir().join(format!("rcoa-setups-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = |extra: &str| {
        format!(
            r#"{{"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                "intermediate_size": 128, "vocab_size": 100, "max_position_embeddings": 256{extra}}}"#
        )
    };
    let resolve_with = |extra: &str| resolve_config(&dir, &config(extra));
    let s = resolve_with("").unwrap();
    assert_eq!(s.model.numerics.linear_bias, None);
    let s = resolve_with(r#", "attention_bias": true, "mlp_bias": true"#).unwrap();
    assert_eq!(s.model.numerics.linear_bias, Some(Biases::All));
    let e = resolve_with(r#", "attention_bias": true"#).unwrap_err();
    assert_eq!(e.codes(), vec!["rcoa::hf_config"]);
    assert!(
        e.errors()[0].message().contains("attention_bias"),
        "{:?}",
        e.errors()
    );
    // LlamaAttention drops its probabilities at `attention_dropout`; no other module of
    // the class drops anything.
    let m = resolve_with(r#", "attention_dropout": 0.1"#).unwrap().model;
    assert_eq!(
        (
            m.embedding_dropout(),
            m.residual_dropout(),
            m.attention_dropout()
        ),
        (0.0, 0.0, 0.1)
    );
    std::fs::remove_dir_all(&dir).ok();
}

/// A `qwen2` config reads as Llama's shape with `bias = qkv`, a `qwen3` one with
/// `qk_norm = true`; sliding-window attention is refused. RoPE's rescaling is read from transformers 4's `rope_scaling` and 5's
/// `rope_parameters`: `llama3` and `linear` by value, another type by name.
#[test]
fn hf_qwen2_and_rope_scaling() {
    let dir = std::env::temp_dir().join(format!("rcoa-setups-qwen-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = |model_type: &str, extra: &str| {
        format!(
            r#"{{"model_type": "{model_type}", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
                "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 100,
                "max_position_embeddings": 256{extra}}}"#
        )
    };
    let resolve_with =
        |model_type: &str, extra: &str| resolve_config(&dir, &config(model_type, extra));
    let s = resolve_with(
        "qwen2",
        r#", "rope_theta": 1000000.0, "tie_word_embeddings": true, "use_sliding_window": false, "sliding_window": 4096"#,
    )
    .unwrap();
    assert_eq!(s.model.biases(), Biases::Qkv);
    assert_eq!((s.model.kv_heads, s.model.norm), (2, Norm::Rmsnorm));
    assert!(s.model.tie_embeddings);
    assert_eq!(s.model.numerics.rope_theta, 1e6);
    assert_eq!(s.model.numerics.norm_eps, 1e-6);
    // Qwen3: a norm over each head of q and k, `head_dim` 128 unless written, no biases.
    let s = resolve_with("qwen3", r#", "rope_theta": 1000000.0"#).unwrap();
    assert!(s.model.numerics.qk_norm);
    assert_eq!((s.model.head_dim, s.model.biases()), (128, Biases::None));
    let s = resolve_with("qwen3", r#", "head_dim": 16"#).unwrap();
    assert_eq!(s.model.head_dim, 16);
    let e = resolve_with("qwen3", r#", "attention_bias": true"#).unwrap_err();
    assert!(
        e.errors()[0].message().contains("attention_bias"),
        "{:?}",
        e.errors()
    );
    let e = resolve_with("qwen3", r#", "use_sliding_window": true"#).unwrap_err();
    assert!(
        e.errors()[0].message().contains("use_sliding_window"),
        "{:?}",
        e.errors()
    );
    let e = resolve_with("qwen2", r#", "use_sliding_window": true"#).unwrap_err();
    assert!(
        e.errors()[0].message().contains("use_sliding_window"),
        "{:?}",
        e.errors()
    );

    let llama3 = RopeScaling::Llama3 {
        factor: 32.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_positions: 8192,
    };
    // transformers 4 (Llama 3.2's config as published).
    let s = resolve_with(
        "llama",
        r#", "rope_theta": 500000.0, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#,
    )
    .unwrap();
    assert_eq!(s.model.numerics.rope_scaling, Some(llama3.clone()));
    assert_eq!(s.model.numerics.rope_theta, 500000.0);
    // transformers 5; without `original_max_position_embeddings`, `max_position_embeddings`.
    let s = resolve_with(
        "llama",
        r#", "rope_parameters": {"rope_theta": 500000.0, "factor": 32.0, "high_freq_factor": 4.0,
            "low_freq_factor": 1.0, "rope_type": "llama3"}"#,
    )
    .unwrap();
    let RopeScaling::Llama3 {
        original_max_positions,
        ..
    } = s.model.numerics.rope_scaling.clone().unwrap()
    else {
        panic!("{:?}", s.model.numerics.rope_scaling)
    };
    assert_eq!(original_max_positions, 256);
    assert_eq!(s.model.numerics.rope_theta, 500000.0);
    // The length beside the other keys wins, as in transformers; an empty `rope_scaling`
    // is absent.
    let s = resolve_with(
        "llama",
        r#", "original_max_position_embeddings": 4096, "rope_scaling": {}, "rope_parameters":
            {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
             "original_max_position_embeddings": 8192}"#,
    )
    .unwrap();
    let Some(RopeScaling::Llama3 {
        original_max_positions,
        ..
    }) = s.model.numerics.rope_scaling
    else {
        panic!("{:?}", s.model.numerics.rope_scaling)
    };
    assert_eq!(original_max_positions, 4096);
    // The old `type` key.
    let s = resolve_with(
        "qwen2",
        r#", "rope_scaling": {"type": "linear", "factor": 2.0}"#,
    )
    .unwrap();
    assert_eq!(
        s.model.numerics.rope_scaling,
        Some(RopeScaling::Linear { factor: 2.0 })
    );
    // Mistral v0.1's window is kept (`executed` compares it with `seq_len`); Qwen2's unused
    // one is not.
    let s = resolve_with("mistral", r#", "sliding_window": 4096"#).unwrap();
    assert_eq!(s.model.numerics.sliding_window, Some(4096));
    let s = resolve_with("mistral", r#", "sliding_window": null"#).unwrap();
    assert_eq!(s.model.numerics.sliding_window, None);
    // Missing keys mean the config classes' defaults.
    let bare = |model_type: &str| {
        resolve_config(
            &dir,
            &format!(
                r#"{{"model_type": "{model_type}", "num_hidden_layers": 2, "hidden_size": 512,
                    "num_attention_heads": 64, "intermediate_size": 128, "vocab_size": 100,
                    "max_position_embeddings": 256}}"#
            ),
        )
        .unwrap()
    };
    let m = bare("mistral").model;
    assert_eq!((m.kv_heads, m.numerics.sliding_window), (8, Some(4096)));
    assert_eq!(bare("qwen2").model.kv_heads, 32);
    assert_eq!(bare("llama").model.kv_heads, 64);
    let s = resolve_with("mistral", r#", "num_key_value_heads": null"#).unwrap();
    assert_eq!(s.model.kv_heads, 4);
    let s = resolve_with("qwen2", r#", "sliding_window": 4096"#).unwrap();
    assert_eq!(s.model.numerics.sliding_window, None);
    // Kept by name: a PyTorch target predicts it (`executed` refuses it for `rcoa run`).
    let s = resolve_with(
        "mistral",
        r#", "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#,
    )
    .unwrap();
    assert_eq!(
        s.model.numerics.rope_scaling,
        Some(RopeScaling::Other {
            name: "yarn".into()
        })
    );
    // Each bad value one diagnostic naming the key.
    for (extra, key) in [
        (
            r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0}"#,
            "low_freq_factor",
        ),
        (r#", "rope_scaling": {"rope_type": "linear"}"#, "factor"),
        (
            r#", "rope_scaling": {"rope_type": "linear", "factor": -1}"#,
            "factor",
        ),
        (r#", "rope_scaling": {"rope_type": 3}"#, "rope_type"),
        (r#", "rope_scaling": "llama3""#, "rope_scaling"),
        (
            r#", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0}"#,
            "low_freq_factor",
        ),
        (
            r#", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.5}"#,
            "partial_rotary_factor",
        ),
    ] {
        let e = resolve_with("llama", extra).unwrap_err();
        assert_eq!(e.codes(), vec!["rcoa::hf_config"], "{extra}");
        let text = format!("{} {:?}", e.errors()[0].message(), e.errors()[0].help());
        assert!(text.contains(key), "{extra}: {text}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// A `phi3` config reads as Llama's shape whose checkpoint fuses q, k, v and gate, up
/// (`fused_projections`), with its window, eps default and one dropout; a partial
/// rotary factor (Phi-4-mini's 0.75, beside the keys or in `rope_parameters`) is the
/// share of each head RoPE turns; LongRoPE keeps its factors and attention factor;
/// unequal dropouts, factor lists that do not fit the rotated pairs and odd shares are
/// refused.
#[test]
fn hf_phi3() {
    let dir = std::env::temp_dir().join(format!("rcoa-setups-phi3-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let resolve_with = |extra: &str| {
        resolve_config(
            &dir,
            &format!(
                r#"{{"model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 64,
                    "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 100,
                    "max_position_embeddings": 4096{extra}}}"#
            ),
        )
    };
    let m = resolve_with("").unwrap().model;
    assert!(m.numerics.fused_projections);
    assert_eq!((m.kv_heads, m.head_dim, m.biases()), (4, 16, Biases::None));
    assert_eq!(
        (m.numerics.norm_eps, m.numerics.sliding_window, m.dropout),
        (1e-5, None, 0.0)
    );
    let m = resolve_with(
        r#", "sliding_window": 2047, "resid_pdrop": 0.1, "attention_dropout": 0.1, "embd_pdrop": 0.2"#,
    )
    .unwrap()
    .model;
    assert_eq!((m.numerics.sliding_window, m.dropout), (Some(2047), 0.1));
    // Phi3DecoderLayer drops its residual branches and the attention its probabilities;
    // nothing drops the embeddings (`embd_pdrop` is read by no module).
    assert_eq!(
        (
            m.embedding_dropout(),
            m.residual_dropout(),
            m.attention_dropout()
        ),
        (0.0, 0.1, 0.1)
    );
    // Phi-3.5-mini's layout: the pretraining length beside the keys, 4096 → 131072
    // positions, so the attention factor is sqrt(1 + ln 32 / ln 4096).
    let list = |v: f64, n: usize| format!("[{}]", vec![v.to_string(); n].join(", "));
    let longrope = |extra: &str, pairs: usize| {
        resolve_with(&format!(
            r#", "original_max_position_embeddings": 4096, "max_position_embeddings": 131072,
               "rope_scaling": {{"type": "longrope", "short_factor": {}, "long_factor": {}}}{extra}"#,
            list(1.0, pairs),
            list(2.5, pairs)
        ))
    };
    let m = longrope("", 8).unwrap().model;
    assert_eq!(m.numerics.rotary_dims, None);
    let Some(RopeScaling::LongRope {
        short_factor,
        long_factor,
        original_max_positions,
        attention_factor,
    }) = &m.numerics.rope_scaling
    else {
        panic!("{:?}", m.numerics.rope_scaling)
    };
    assert_eq!((short_factor.len(), long_factor[7]), (8, 2.5));
    assert_eq!(*original_max_positions, 4096);
    assert!((attention_factor - 1.1902380714238083).abs() < 1e-12);
    // Phi-4-mini's 0.75 of 16 values: 12 rotated, 6 pairs; its config's own factor wins.
    let m = longrope(
        r#", "partial_rotary_factor": 0.75, "rope_parameters": {"attention_factor": 1.0}"#,
        6,
    )
    .unwrap()
    .model;
    assert_eq!(m.numerics.rotary_dims, Some(12));
    // transformers 5 writes both inside `rope_parameters`.
    let m = resolve_with(&format!(
        r#", "rope_parameters": {{"rope_type": "longrope", "rope_theta": 250000.0,
            "partial_rotary_factor": 0.5, "original_max_position_embeddings": 1024,
            "short_factor": {}, "long_factor": {}, "attention_factor": 1.25}}"#,
        list(1.0, 4),
        list(2.0, 4)
    ))
    .unwrap()
    .model;
    assert_eq!(
        (m.numerics.rotary_dims, m.numerics.rope_theta),
        (Some(8), 250000.0)
    );
    assert!(matches!(
        m.numerics.rope_scaling,
        Some(RopeScaling::LongRope {
            original_max_positions: 1024,
            attention_factor: 1.25,
            ..
        })
    ));
    // transformers 4's `su` is LongRoPE.
    let m = resolve_with(&format!(
        r#", "rope_scaling": {{"type": "su", "short_factor": {}, "long_factor": {}}}"#,
        list(1.0, 8),
        list(1.0, 8)
    ))
    .unwrap()
    .model;
    assert_eq!(m.numerics.rope_scaling.as_ref().unwrap().name(), "longrope");
    for (e, key) in [
        (longrope("", 7).unwrap_err(), "7 factors (one per rotated pair of each head: 8)"),
        (
            longrope(r#", "partial_rotary_factor": 0.75"#, 8).unwrap_err(),
            "short_factor",
        ),
        (
            resolve_with(r#", "rope_scaling": {"type": "longrope", "short_factor": [1.0]}"#)
                .unwrap_err(),
            "short_factor",
        ),
        (
            resolve_with(&format!(
                r#", "original_max_position_embeddings": 1,
                   "rope_scaling": {{"type": "longrope", "short_factor": {}, "long_factor": {}}}"#,
                list(1.0, 8),
                list(1.0, 8)
            ))
            .unwrap_err(),
            "divides by its logarithm",
        ),
        (
            resolve_with(&format!(
                r#", "rope_scaling": {{"type": "longrope", "short_factor": {}, "long_factor": [1, "x", 1, 1, 1, 1, 1, 1]}}"#,
                list(1.0, 8)
            ))
            .unwrap_err(),
            "a list of positive numbers",
        ),
    ] {
        let text = format!("{} {:?}", e.errors()[0].message(), e.errors()[0].help());
        assert!(text.contains(key), "{key}: {text}");
    }
    for (extra, key) in [
        (
            r#", "rope_scaling": {"rope_type": "linear", "factor": 2.0}"#,
            "rope_type",
        ),
        // 0.3 of 16 values: 4.8, cut to 4 by transformers, is fine; 0.2 is 3, odd.
        (r#", "partial_rotary_factor": 0.2"#, "partial_rotary_factor"),
        (
            r#", "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.5}"#,
            "partial_rotary_factor",
        ),
        (r#", "resid_pdrop": 0.1"#, "resid_pdrop"),
    ] {
        let e = resolve_with(extra).unwrap_err();
        assert_eq!(e.codes(), vec!["rcoa::hf_config"], "{extra}");
        assert!(
            e.errors()[0].message().contains(key),
            "{extra}: {:?}",
            e.errors()
        );
    }
    // `pad_token_id` is the embedding's `padding_idx` (Phi-3's 32000 in its 32,064
    // tokens); outside the vocabulary transformers cannot build the model.
    // Many Llama fine-tunes write 0; the first Llama conversions -1, which PyTorch's
    // `nn.Embedding` counts from the end (the last of the 100 rows).
    for (pad, row) in [("7", 7), ("0", 0), ("-1", 99), ("-100", 0)] {
        let m = resolve_with(&format!(r#", "pad_token_id": {pad}"#))
            .unwrap()
            .model;
        assert_eq!(m.numerics.padding_idx, Some(row), "{pad}");
    }
    for pad in ["32000", "100", "-101", "18446744073709551615", "1.5"] {
        let e = resolve_with(&format!(r#", "pad_token_id": {pad}"#)).unwrap_err();
        assert!(
            e.errors()[0].message().contains("pad_token_id"),
            "{pad}: {:?}",
            e.errors()
        );
    }
    // Phi-3's 1.0 rotates whole heads.
    assert!(resolve_with(r#", "partial_rotary_factor": 1.0"#).is_ok());
    std::fs::remove_dir_all(&dir).ok();
}

/// The published Phi-4-mini-instruct config (`plans/phi-4-mini-instruct`): 96 of each
/// head's 128 values rotated, LongRoPE over 48 pairs with the attention factor of its
/// 4096 → 131072 positions, tied embeddings, its pad token's row.
#[test]
fn published_phi4_mini_config() {
    let dir = std::env::temp_dir().join(format!("rcoa-setups-phi4-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let published =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../plans/phi-4-mini-instruct/config.json");
    let m = resolve_config(&dir, &std::fs::read_to_string(published).unwrap())
        .unwrap()
        .model;
    assert_eq!((m.head_dim, m.numerics.rotary_dims), (128, Some(96)));
    assert_eq!((m.kv_heads, m.vocab, m.tie_embeddings), (8, 200064, true));
    assert_eq!(m.numerics.padding_idx, Some(199999));
    let Some(RopeScaling::LongRope {
        short_factor,
        long_factor,
        original_max_positions: 4096,
        attention_factor,
    }) = &m.numerics.rope_scaling
    else {
        panic!("{:?}", m.numerics.rope_scaling)
    };
    assert!(short_factor.iter().all(|&f| f == 1.0) && short_factor.len() == 48);
    assert_eq!((long_factor[0], long_factor[47]), (1.0, 47.77));
    assert!((attention_factor - 1.1902380714238083).abs() < 1e-12);
    std::fs::remove_dir_all(&dir).ok();
}
