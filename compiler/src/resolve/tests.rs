//! Unit tests of the resolver, through the real parser: defaults, units and
//! one test per constraint (the code, where it points, and the help text).

use super::*;
use crate::catalog;
use crate::spec::*;
use std::path::Path;

const BASE: &str = r#"
model "llama-3.1-8b"
hardware { gpu = h100-80gb }
train { seq_len = 2048 global_batch = 8 }
"#;

fn ctx(src: &str, dir: &Path) -> ResolveContext {
    ResolveContext::new("test.plan", src, dir)
}

fn run_in(src: &str, dir: &Path) -> Result<(Spec, SpanTable), ResolveErrors> {
    let file = rcoa_grammar::parse("test.plan", src)
        .unwrap_or_else(|e| panic!("parse failed: {e:?}\n{src}"));
    resolve_with_spans(&file, &ctx(src, dir))
}

fn ok(src: &str) -> Spec {
    match run_in(src, Path::new(".")) {
        Ok((s, _)) => s,
        Err(e) => panic!("expected ok, got {:?}\n{src}", e.errors()),
    }
}

fn errs(src: &str) -> ResolveErrors {
    match run_in(src, Path::new(".")) {
        Ok(_) => panic!("expected errors\n{src}"),
        Err(e) => e,
    }
}

/// The single error of a plan, asserting its code.
fn one(src: &str, code: &str) -> ResolveError {
    let e = errs(src);
    assert_eq!(e.codes(), vec![code], "{:#?}", e.errors());
    e.errors()[0].clone()
}

fn text_at(src: &str, e: &ResolveError) -> String {
    let s = e.span().expect("a span");
    src[s.start..s.end].to_string()
}

fn with(extra: &str) -> String {
    format!("{BASE}{extra}\n")
}

// ------------------------------------------------------------------ defaults

#[test]
fn defaults_of_a_minimal_plan() {
    let s = ok(BASE);
    assert_eq!(s.model.name, "llama-3.1-8b");
    assert_eq!(s.model.head_dim, 128);
    assert_eq!(s.hardware.gpu.memory_bytes, 85_017_493_504);
    assert_eq!((s.hardware.gpus_per_node, s.hardware.nodes), (1, 1));
    assert_eq!(s.hardware.host_memory_bytes, Some(2048 << 30));
    assert_eq!(s.hardware.nvme_bytes, None);
    assert_eq!(s.hardware.intra_node_bytes_per_s, 900e9);
    assert_eq!(
        s.precision,
        PrecisionSpec {
            params: Dtype::Bf16,
            compute: Dtype::Bf16,
            master: Some(Dtype::Fp32),
            grads: Dtype::Bf16,
            autocast: false,
        }
    );
    assert_eq!(s.optimizer.kind, OptimizerKind::Adamw);
    assert_eq!(s.optimizer.implementation, OptImpl::Foreach);
    assert_eq!(s.optimizer.state, Dtype::Fp32);
    assert_eq!(s.optimizer.betas, (0.9, 0.999));
    assert_eq!(s.train.micro_batch, Choice::Auto);
    assert_eq!(s.train.grad_accum, Choice::Auto);
    assert_eq!(s.train.attention, Attention::Sdpa);
    assert_eq!(s.train.loss, Loss::CausalLm);
    assert_eq!(s.train.steps, None);
    assert_eq!(s.adapter, None);
    assert_eq!(
        s.parallel,
        ParallelSpec {
            data: Choice::Auto,
            zero: Choice::Fixed(0),
            tensor: Choice::Fixed(1),
            pipeline: Choice::Fixed(1),
            sequence: Choice::Fixed(false),
            context: Choice::Fixed(1),
            expert: Choice::Fixed(1),
            virtual_stages: 1,
        }
    );
    assert_eq!(s.fit.budget, Budget::Fraction(1.0));
    assert_eq!(s.fit.checkpoint, CheckpointChoice::Auto);
    assert!(s.fit.offload.is_empty());
    assert_eq!(s.fit.objective, Objective::Throughput);
    assert_eq!(s.fit.reserve, None);
    assert_eq!(s.target, Target::Burn);
}

#[test]
fn encoder_defaults_to_masked_lm_and_learned_positions() {
    let s = ok(r#"
model { arch = encoder layers = 2 hidden = 64 heads = 4 ffn = 256 mlp = gelu norm = layernorm
        vocab = 512 max_positions = 130 tie_embeddings = true }
hardware { gpu = a100-40gb }
train { seq_len = 128 global_batch = 4 }
"#);
    assert_eq!(s.train.loss, Loss::MaskedLm);
    assert_eq!(s.model.positions, Positions::Learned);
    assert_eq!(
        (
            s.model.kv_heads,
            s.model.head_dim,
            s.model.experts,
            s.model.experts_per_token
        ),
        (4, 16, 1, 1)
    );
    assert_eq!(s.model.dropout, 0.0);
    assert_eq!(s.model.name, "custom");
}

#[test]
fn preset_overrides_and_head_dim() {
    let s = ok(r#"
model "llama-3.1-8b" { layers = 4 dropout = 0.1 }
hardware { gpu = h100-80gb }
train { seq_len = 512 global_batch = 8 }
"#);
    assert_eq!(
        (s.model.layers, s.model.hidden, s.model.dropout),
        (4, 4096, 0.1)
    );
    let s = ok(r#"
model "llama-3.1-8b" { hidden = 2048 }
hardware { gpu = h100-80gb }
train { seq_len = 512 global_batch = 8 }
"#);
    assert_eq!(
        s.model.head_dim, 64,
        "head_dim follows an overridden hidden"
    );
}

#[test]
fn precision_forms() {
    let p = |extra: &str| ok(&with(extra)).precision;
    assert_eq!(p("precision bf16"), precision::default());
    let fp32 = p("precision fp32");
    assert_eq!(
        (fp32.params, fp32.compute, fp32.master, fp32.grads),
        (Dtype::Fp32, Dtype::Fp32, None, Dtype::Fp32)
    );
    let autocast = p("precision { params = fp32 compute = bf16 }");
    assert_eq!(
        (
            autocast.params,
            autocast.compute,
            autocast.master,
            autocast.grads
        ),
        (Dtype::Fp32, Dtype::Bf16, None, Dtype::Fp32)
    );
    assert!(autocast.is_autocast());
    let tf32 = p("precision tf32");
    assert_eq!((tf32.params, tf32.compute), (Dtype::Fp32, Dtype::Tf32));
    let pure = p("precision { params = bf16 compute = bf16 master = none }");
    assert_eq!(pure.master, None);
    let g = p("precision { params = bf16 grads = fp32 }");
    assert_eq!(
        (g.compute, g.master, g.grads),
        (Dtype::Bf16, Some(Dtype::Fp32), Dtype::Fp32)
    );
    let over = p("precision fp16 { master = none }");
    assert_eq!(
        (over.params, over.compute, over.master),
        (Dtype::Fp16, Dtype::Fp16, None)
    );
}

#[test]
fn optimizer_defaults_per_kind() {
    let o = |extra: &str| ok(&with(extra)).optimizer;
    assert_eq!(o("optimizer adam8bit").state, Dtype::Int8);
    let sgd = o("optimizer sgd");
    assert_eq!((sgd.momentum, sgd.weight_decay), (0.0, 0.0));
    assert_eq!(o("optimizer sgd { momentum = 0.9 }").momentum, 0.9);
    assert_eq!(o("optimizer adafactor").betas.0, 0.0);
    assert_eq!(o("optimizer lion").betas, (0.9, 0.99));
    let a = o("optimizer adamw { lr = 2e-5 betas = (0.9, 0.95) weight_decay = 0.1 impl = fused state = bf16 }");
    assert_eq!(
        (a.lr, a.betas, a.weight_decay, a.implementation, a.state),
        (2e-5, (0.9, 0.95), 0.1, OptImpl::Fused, Dtype::Bf16)
    );
    // What the ground-truth generator writes for plain SGD and for Adam.
    assert_eq!(o("optimizer sgd { momentum = 0 }").momentum, 0.0);
    assert_eq!(
        o("optimizer adamw { impl = foreach }").implementation,
        OptImpl::Foreach
    );
}

// ------------------------------------------------------------------ units

#[test]
fn sizes_counts_percentages_bandwidths() {
    let s = ok(r#"
model "llama-3.1-8b"
hardware { gpu = h100-80gb gpus_per_node = 8 nodes = 2 host_memory = 1 TiB nvme = 3.84 TB
           intra_node = 900 GB/s inter_node = 400 Gbps }
train { seq_len = 8K global_batch = 2K }
fit { budget = 70 GiB reserve = 512 MiB }
"#);
    assert_eq!(s.hardware.host_memory_bytes, Some(1 << 40));
    assert_eq!(s.hardware.nvme_bytes, Some(3_840_000_000_000));
    assert_eq!(s.hardware.intra_node_bytes_per_s, 900e9);
    assert_eq!(s.hardware.inter_node_bytes_per_s, 50e9);
    assert_eq!((s.train.seq_len, s.train.global_batch), (8_000, 2_000));
    assert_eq!(s.fit.budget, Budget::Bytes(70 << 30));
    assert_eq!(s.fit.reserve, Some(512 << 20));
    assert_eq!(s.gpu_count(), 16);

    let s = ok(&with("fit { budget = 80GB }"));
    assert_eq!(s.fit.budget, Budget::Bytes(80_000_000_000));
    let s = ok(&with("fit { budget = 90% }"));
    assert_eq!(s.fit.budget, Budget::Fraction(0.9));
    // A bare B is bytes in a size slot ...
    let s = ok(&with("fit { budget = 1_000_000_000 B }"));
    assert_eq!(s.fit.budget, Budget::Bytes(1_000_000_000));
    // ... and a billion in a count slot.
    let s = ok(r#"
model "tiny-decoder"
hardware { gpu = h100-80gb }
train { seq_len = 32 global_batch = 1B }
"#);
    assert_eq!(s.train.global_batch, 1_000_000_000);
}

#[test]
fn custom_gpu_block() {
    let s = ok(r#"
model "tiny-decoder"
hardware { gpu { memory = 48 GiB bf16_tflops = 362 bandwidth = 864 GB/s } }
train { seq_len = 32 global_batch = 4 }
"#);
    assert_eq!(s.hardware.gpu.name, "custom");
    assert_eq!(s.hardware.gpu.memory_bytes, 48 << 30);
    assert_eq!(s.hardware.gpu.bandwidth_bytes_per_s, 864e9);
    assert_eq!(s.hardware.host_memory_bytes, None);
    let e = errs("model \"tiny-decoder\"\nhardware { gpu = { memory = 48 GiB } }\ntrain { seq_len = 32 global_batch = 4 }\n");
    assert_eq!(e.codes(), vec!["rcoa::missing_key", "rcoa::missing_key"]);
    // Without the optional keys: fp16 at the bf16 rate, bf16 tensor cores, shared
    // memory unknown.
    assert_eq!(s.hardware.gpu.fp16_tflops, None);
    assert!(s.hardware.gpu.bf16_tensor_cores);
    assert_eq!(s.hardware.gpu.shared_memory_per_block_bytes, None);
}

/// A custom GPU may say what the catalog knows of its own: a T4-like card.
#[test]
fn custom_gpu_block_with_its_tensor_cores_and_shared_memory() {
    let s = ok(r#"
model "tiny-decoder"
hardware { gpu { memory = 15 GiB  bf16_tflops = 8.1  bandwidth = 320 GB/s
                 fp16_tflops = 65  bf16_tensor_cores = false  shared_memory = 64 KiB } }
train { seq_len = 32 global_batch = 4 }
"#);
    let g = &s.hardware.gpu;
    assert_eq!(g.fp16_tflops, Some(65.0));
    assert!(!g.bf16_tensor_cores);
    assert_eq!(g.shared_memory_per_block_bytes, Some(64 << 10));
    assert_eq!(g.dense_tflops(crate::spec::Dtype::Fp16), 65.0);
    assert_eq!(g.dense_tflops(crate::spec::Dtype::Fp32), 8.1);
    let src = "model \"tiny-decoder\"\nhardware { gpu { memory = 15 GiB  bf16_tflops = 8.1  bandwidth = 320 GB/s  bf16_tensor_cores = 1  shared_memory = 64 } }\ntrain { seq_len = 32 global_batch = 4 }\n";
    assert_eq!(
        errs(src).codes(),
        vec!["rcoa::wrong_kind", "rcoa::wrong_kind"]
    );
}

#[test]
fn wrong_units_and_kinds() {
    let src = with("fit { budget = 40 Gbps }");
    let e = one(&src, "rcoa::wrong_unit");
    assert_eq!(text_at(&src, &e), "40 Gbps");
    let src = with("fit { budget = 40 }");
    let e = one(&src, "rcoa::wrong_kind");
    assert!(e.help().unwrap().contains("GiB"), "{e:?}");
    let e = one(
        "model \"tiny-decoder\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 2 GiB global_batch = 4 }\n",
        "rcoa::wrong_unit",
    );
    assert!(e.message().contains("seq_len"));
    let e = one(
        "model \"tiny-decoder\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 32.5 global_batch = 4 }\n",
        "rcoa::wrong_kind",
    );
    assert!(e.message().contains("`32.5`"), "{e:?}");
    one(
        "model \"tiny-decoder\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = auto global_batch = 4 }\n",
        "rcoa::wrong_kind",
    );
    one(&with("hardware2 { }"), "rcoa::unknown_section");
    one(&with("parallel { sequence = 1 }"), "rcoa::wrong_kind");
    one(&with("fit { offload = \"optimizer\" }"), "rcoa::wrong_kind");
}

// ------------------------------------------------------------------ names

#[test]
fn unknown_gpu_suggests_the_nearest() {
    let src = "model \"llama-3.1-8b\"\nhardware { gpu = a100-40g }\ntrain { seq_len = 2048 global_batch = 8 }\n";
    let e = one(src, "rcoa::unknown_gpu");
    assert_eq!(text_at(src, &e), "a100-40g");
    assert!(
        e.help().unwrap().starts_with("did you mean `a100-40gb`?"),
        "{e:?}"
    );
}

#[test]
fn unknown_names() {
    let e = one(
        &BASE.replace("llama-3.1-8b", "llama-3.1-8"),
        "rcoa::unknown_model",
    );
    assert!(e.help().unwrap().contains("did you mean `llama-3.1-8b`?"));
    let e = one(&with("precision { params = bf61 }"), "rcoa::unknown_dtype");
    assert!(e.help().unwrap().contains("did you mean `bf16`?"));
    let e = one(&with("precision { params = tf32 }"), "rcoa::unknown_dtype");
    assert!(
        e.help().unwrap().contains("`fp32`, `bf16`, `fp16`, `fp8`"),
        "{e:?}"
    );
    one(&with("optimizer adamx"), "rcoa::unknown_optimizer");
    one(
        &with("adapter dora { rank = 8 alpha = 16 targets = [q] }"),
        "rcoa::unknown_adapter",
    );
    one(&with("target jax"), "rcoa::unknown_target");
    let e = one(
        &with("train { seq_len = 1 global_batch = 1 attention = flsh }")
            .replace("train { seq_len = 2048 global_batch = 8 }\n", ""),
        "rcoa::unknown_value",
    );
    assert!(e.help().unwrap().contains("did you mean `flash`?"));
    let e = one(&with("fit { checkpoint = evry }"), "rcoa::unknown_value");
    assert!(e
        .help()
        .unwrap()
        .contains("`none`, `full`, `selective`, `selective_op`, `auto`"));
}

#[test]
fn unknown_section_and_key_suggest() {
    let src = format!("{BASE}optimiser adamw\n");
    let e = one(&src, "rcoa::unknown_section");
    assert_eq!(e.help(), Some("did you mean `optimizer`?"));
    // A misspelt required section is not also reported as missing.
    let e = one(&BASE.replace("model ", "modle "), "rcoa::unknown_section");
    assert_eq!(e.help(), Some("did you mean `model`?"));
    let src = BASE.replace("seq_len", "sq_len");
    let e = errs(&src);
    // The typo is reported, not also the key it misspells as missing.
    assert_eq!(e.codes(), vec!["rcoa::unknown_key"]);
    assert_eq!(e.errors()[0].help(), Some("did you mean `seq_len`?"));
}

// ------------------------------------------------------------------ structure

#[test]
fn duplicate_section_points_at_both() {
    let src = format!("{BASE}train {{ seq_len = 1 global_batch = 1 }}\n");
    let e = one(&src, "rcoa::duplicate_section");
    let labels = e.labels();
    assert_eq!(labels.len(), 2);
    let first = src.find("train").unwrap();
    let again = src.rfind("train").unwrap();
    assert_eq!(labels[0].0.start, again);
    assert_eq!(labels[1].0.start, first);
}

#[test]
fn duplicate_key() {
    one(
        &with("optimizer adamw { lr = 1e-4 lr = 2e-4 }"),
        "rcoa::duplicate_key",
    );
}

#[test]
fn missing_sections_and_keys() {
    let e = errs("");
    assert_eq!(e.codes(), vec!["rcoa::missing_section"; 3]);
    // Located at the start of the file, so the message names FILE:1:1.
    assert!(e
        .errors()
        .iter()
        .all(|e| e.span() == Some(rcoa_grammar::Span::new(0, 0))));
    let e = one(
        "model \"tiny-decoder\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 32 }\n",
        "rcoa::missing_key",
    );
    assert!(e.message().contains("global_batch"));
    one("model \"tiny-decoder\"\nhardware { gpus_per_node = 2 }\ntrain { seq_len = 32 global_batch = 4 }\n", "rcoa::missing_key");
    let e = errs("model { arch = decoder layers = 2 }\nhardware { gpu = h100-80gb }\ntrain { seq_len = 32 global_batch = 4 }\n");
    assert!(e.codes().iter().all(|c| *c == "rcoa::missing_key"));
    // hidden, heads, ffn, vocab: the others default from `arch` and `seq_len`.
    assert_eq!(e.len(), 4, "{:?}", e.errors());
    one(&with("optimizer { lr = 1e-4 }"), "rcoa::missing_argument");
    one(&with("target"), "rcoa::missing_argument");
    one(
        "model \"tiny-decoder\"\nhardware\ntrain { seq_len = 32 global_batch = 4 }\n",
        "rcoa::missing_block",
    );
    one(&with("target burn { }"), "rcoa::unexpected_block");
    one("model \"tiny-decoder\"\nhardware h100 { gpu = h100-80gb }\ntrain { seq_len = 32 global_batch = 4 }\n", "rcoa::unexpected_argument");
}

/// A custom block names only the shape; the rest is its architecture's
/// usual choice, recorded for `--explain`.
#[test]
fn custom_models_default_from_their_arch() {
    let plan = |arch: &str| {
        format!(
            "model {{ arch = {arch} layers = 2 hidden = 64 heads = 4 ffn = 128 vocab = 100 }}\n\
             hardware {{ gpu = h100-80gb }}\ntrain {{ seq_len = 48 global_batch = 4 }}\n"
        )
    };
    let d = ok(&plan("decoder"));
    assert_eq!(
        (
            d.model.mlp,
            d.model.norm,
            d.model.positions,
            d.model.tie_embeddings
        ),
        (Mlp::Swiglu, Norm::Rmsnorm, Positions::Rope, false)
    );
    assert_eq!(d.model.max_positions, 48, "max_positions = seq_len");
    let keys: Vec<&str> = d.defaults.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(
        keys,
        vec![
            "model.mlp = swiglu",
            "model.norm = rmsnorm",
            "model.positions = rope",
            "model.tie_embeddings = false",
            "model.max_positions = 48"
        ]
    );
    assert!(d.defaults[0].1.contains("decoder"));
    let e = ok(&plan("encoder"));
    assert_eq!(
        (
            e.model.mlp,
            e.model.norm,
            e.model.positions,
            e.model.tie_embeddings
        ),
        (Mlp::Gelu, Norm::Layernorm, Positions::Learned, true)
    );
    assert!(e.defaults[0].1.contains("encoder"));
    // What the plan writes wins, and is not listed as a default.
    let w =
        ok(&plan("decoder").replace("vocab = 100", "vocab = 100 mlp = gelu max_positions = 512"));
    assert_eq!((w.model.mlp, w.model.max_positions), (Mlp::Gelu, 512));
    assert!(w
        .defaults
        .iter()
        .all(|(k, _)| !k.contains("mlp") && !k.contains("max_positions")));
    // Presets keep their own values and note nothing.
    assert!(ok("model \"tiny-decoder\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 32 global_batch = 4 }\n").defaults.is_empty());
}

#[test]
fn all_errors_are_collected_in_source_order() {
    let src = r#"
model "llama-3.1-8b" { dropout = 1.5 }
hardware { gpu = a100-40g }
train { seq_len = 2048 global_batch = 8 colour = red }
parallel { zero = 4 }
"#;
    let e = errs(src);
    assert_eq!(
        e.codes(),
        vec![
            "rcoa::out_of_range",
            "rcoa::unknown_gpu",
            "rcoa::unknown_key",
            "rcoa::out_of_range"
        ]
    );
    let starts: Vec<usize> = e.errors().iter().map(|e| e.span().unwrap().start).collect();
    assert!(starts.windows(2).all(|w| w[0] <= w[1]));
    assert_eq!(e.to_string(), "4 problems in test.plan");
}

// ------------------------------------------------------------------ ranges

#[test]
fn out_of_range_values() {
    let e = one(&with("fit { budget = 0% }"), "rcoa::out_of_range");
    assert!(e.help().unwrap().contains("above 0%"));
    one(&with("fit { budget = 150% }"), "rcoa::out_of_range");
    one(&with("optimizer adamw { lr = 0 }"), "rcoa::out_of_range");
    one(
        &with("optimizer adamw { weight_decay = -0.1 }"),
        "rcoa::out_of_range",
    );
    one(
        &with("optimizer adamw { betas = (0.9, 1.0) }"),
        "rcoa::out_of_range",
    );
    one(&with("parallel { zero = 4 }"), "rcoa::out_of_range");
    one(&with("parallel { tensor = 0 }"), "rcoa::out_of_range");
    one(
        &BASE.replace(
            "hardware { gpu = h100-80gb }",
            "hardware { gpu = h100-80gb nodes = -1 }",
        ),
        "rcoa::out_of_range",
    );
    one(
        &with("adapter lora { rank = 0 alpha = 16 targets = [q] }"),
        "rcoa::out_of_range",
    );
    one(
        &with("adapter lora { rank = 8 alpha = 16 targets = [] }"),
        "rcoa::out_of_range",
    );
    one(
        &BASE.replace("\"llama-3.1-8b\"", "\"llama-3.1-8b\" { dropout = 1 }"),
        "rcoa::out_of_range",
    );
    let s = ok(&BASE.replace("\"llama-3.1-8b\"", "\"llama-3.1-8b\" { dropout = 10% }"));
    assert_eq!(s.model.dropout, 0.1);
    // The DSL's dropout drops everywhere: the embeddings, each residual branch, attention.
    assert_eq!(
        (
            s.model.embedding_dropout(),
            s.model.residual_dropout(),
            s.model.attention_dropout()
        ),
        (0.1, 0.1, 0.1)
    );
}

#[test]
fn absurd_sizes_are_capped() {
    let e = one(
        &BASE.replace("gpu = h100-80gb", "gpu = h100-80gb nodes = 2000000"),
        "rcoa::out_of_range",
    );
    assert!(e.help().unwrap().contains("from 1 to 1048576"), "{e:?}");
    one(
        &BASE.replace("\"llama-3.1-8b\"", "\"llama-3.1-8b\" { hidden = 99999999 }"),
        "rcoa::out_of_range",
    );
    one(
        &BASE.replace("seq_len = 2048", "seq_len = 1T"),
        "rcoa::out_of_range",
    );
    one(
        &BASE.replace("global_batch = 8", "global_batch = 99999999999999999999"),
        "rcoa::out_of_range",
    );
}

#[test]
fn budget_within_gpu_memory() {
    let e = one(
        &(BASE.replace("h100-80gb", "a100-40gb") + "fit { budget = 45 GiB }\n"),
        "rcoa::out_of_range",
    );
    assert!(e.message().contains("39.59 GiB"), "{e:?}");
    one(
        &with("fit { budget = 10 GiB reserve = 10 GiB }"),
        "rcoa::out_of_range",
    );
}

// ------------------------------------------------------------------ constraints

#[test]
fn heads_not_divisible_by_tensor() {
    let src = "model \"llama-3.1-8b\"\nhardware { gpu = h100-80gb gpus_per_node = 6 }\ntrain { seq_len = 2048 global_batch = 12 }\nparallel { tensor = 3 }\n";
    let e = one(src, "rcoa::not_divisible");
    assert_eq!(text_at(src, &e), "3");
    let help = e.help().unwrap();
    assert!(
        help.starts_with("32 heads are not divisible by tensor = 3"),
        "{help}"
    );
}

#[test]
fn vocab_and_kv_heads_divisibility() {
    // gpt2's vocabulary (50257) is odd.
    let src = "model \"gpt2-small\"\nhardware { gpu = h100-80gb gpus_per_node = 2 }\ntrain { seq_len = 1024 global_batch = 8 }\nparallel { tensor = 2 }\n";
    let e = one(src, "rcoa::not_divisible");
    assert!(e.message().contains("vocab"), "{e:?}");
    // 8 kv heads and tensor 16.
    let src = "model \"llama-3.1-70b\"\nhardware { gpu = h100-80gb gpus_per_node = 16 }\ntrain { seq_len = 2048 global_batch = 16 }\nparallel { tensor = 16 }\n";
    let e = one(src, "rcoa::not_divisible");
    assert!(e.message().contains("kv_heads"), "{e:?}");
    // Model's own heads vs kv_heads.
    let e = one(
        &BASE.replace("\"llama-3.1-8b\"", "\"llama-3.1-8b\" { kv_heads = 5 }"),
        "rcoa::not_divisible",
    );
    assert!(e
        .help()
        .unwrap()
        .contains("32 heads are not divisible by kv_heads = 5"));
    one(
        &BASE.replace("\"llama-3.1-8b\"", "\"llama-3.1-8b\" { kv_heads = 64 }"),
        "rcoa::out_of_range",
    );
    one(
        &BASE.replace("\"llama-3.1-8b\"", "\"llama-3.1-8b\" { hidden = 4001 }"),
        "rcoa::not_divisible",
    );
    ok(&BASE.replace(
        "\"llama-3.1-8b\"",
        "\"llama-3.1-8b\" { hidden = 4001 head_dim = 128 }",
    ));
}

#[test]
fn batch_arithmetic() {
    let src = "model \"llama-3.1-8b\"\nhardware { gpu = h100-80gb gpus_per_node = 4 }\ntrain { seq_len = 2048 global_batch = 256 micro_batch = 4 grad_accum = 8 }\nparallel { data = 4 }\n";
    let e = one(src, "rcoa::batch_mismatch");
    assert_eq!(
        e.help(),
        Some("micro_batch 4 × grad_accum 8 × data 4 = 128, but global_batch = 256")
    );
    assert_eq!(text_at(src, &e), "256");
    // data derived from the GPUs left over.
    let src = "model \"llama-3.1-8b\"\nhardware { gpu = h100-80gb gpus_per_node = 8 }\ntrain { seq_len = 2048 global_batch = 64 micro_batch = 4 grad_accum = 8 }\nparallel { tensor = 2 }\n";
    let e = one(src, "rcoa::batch_mismatch");
    assert!(
        e.help().unwrap().contains("data 4 (the GPUs left over"),
        "{e:?}"
    );
    // Only data known: global_batch must be divisible by it.
    let src = "model \"llama-3.1-8b\"\nhardware { gpu = h100-80gb gpus_per_node = 4 }\ntrain { seq_len = 2048 global_batch = 250 }\nparallel { data = 4 }\n";
    let e = one(src, "rcoa::not_divisible");
    assert!(
        e.help()
            .unwrap()
            .starts_with("global_batch 250 is not divisible by data = 4"),
        "{e:?}"
    );
    // Partly fixed.
    let src = "model \"llama-3.1-8b\"\nhardware { gpu = h100-80gb gpus_per_node = 4 }\ntrain { seq_len = 2048 global_batch = 250 micro_batch = 4 }\n";
    let e = one(src, "rcoa::batch_mismatch");
    assert!(
        e.help().unwrap().starts_with("micro_batch 4 × data 4 = 16"),
        "{e:?}"
    );
    // What matches is fine.
    ok("model \"llama-3.1-8b\"\nhardware { gpu = h100-80gb gpus_per_node = 4 }\ntrain { seq_len = 2048 global_batch = 128 micro_batch = 4 grad_accum = 8 }\nparallel { data = 4 }\n");
    ok("model \"llama-3.1-8b\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 2048 global_batch = 8 micro_batch = 2 grad_accum = 4 }\n");
}

#[test]
fn parallel_product() {
    let src = "model \"llama-3.1-8b\"\nhardware { gpu = h100-80gb gpus_per_node = 8 }\ntrain { seq_len = 2048 global_batch = 64 }\nparallel { data = 2 tensor = 2 pipeline = 1 context = 1 }\n";
    let e = one(src, "rcoa::parallel_mismatch");
    assert!(
        e.help()
            .unwrap()
            .starts_with("data 2 × tensor 2 × pipeline 1 × context 1 = 4, but the plan has 8 GPUs"),
        "{e:?}"
    );
    let src = "model \"llama-3.1-70b\"\nhardware { gpu = h100-80gb gpus_per_node = 8 }\ntrain { seq_len = 2048 global_batch = 64 }\nparallel { pipeline = 3 }\n";
    let e = one(src, "rcoa::parallel_mismatch");
    assert!(
        e.help().unwrap().contains("does not divide the 8 GPUs"),
        "{e:?}"
    );
    // With every degree auto anything goes.
    ok("model \"llama-3.1-405b\"\nhardware { gpu = h100-80gb gpus_per_node = 8 nodes = 2048 }\ntrain { seq_len = 8192 global_batch = 2048 }\nparallel { data = auto tensor = auto pipeline = auto zero = auto }\n");
}

#[test]
fn other_constraints() {
    let e = one(&with("parallel { sequence = true }"), "rcoa::conflict");
    assert!(e.message().contains("tensor"));
    let e = one(
        &with("adapter qlora { rank = 8 alpha = 16 targets = [q] base = int8 }"),
        "rcoa::conflict",
    );
    assert!(e.message().contains("nf4"));
    assert_eq!(
        ok(&with("adapter qlora { rank = 8 alpha = 16 targets = [q] }"))
            .adapter
            .unwrap()
            .base,
        Dtype::Nf4
    );
    one(
        &with("adapter lora { rank = 8 alpha = 16 targets = [q] base = nf4 }"),
        "rcoa::not_applicable",
    );
    let lora = ok(&with(
        "adapter lora { rank = 8 alpha = 16 targets = [v, q, q, gate] }",
    ))
    .adapter
    .unwrap();
    assert_eq!(lora.targets, vec![Proj::Q, Proj::V, Proj::Gate]);
    assert_eq!(lora.base, Dtype::Bf16);
    let src = "model \"xlm-roberta-large\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 512 global_batch = 8 }\nadapter lora { rank = 8 alpha = 16 targets = [q, gate] }\n";
    let e = one(src, "rcoa::conflict");
    assert_eq!(text_at(src, &e), "gate");
    let e = one(
        &BASE.replace(
            "\"llama-3.1-8b\"",
            "\"llama-3.1-8b\" { experts = 8 experts_per_token = 9 }",
        ),
        "rcoa::out_of_range",
    );
    assert!(e.message().contains("experts_per_token"));
    one(&with("parallel { expert = 2 }"), "rcoa::not_divisible");
    let src = "model \"tiny-decoder\"\nhardware { gpu = h100-80gb gpus_per_node = 4 }\ntrain { seq_len = 32 global_batch = 4 }\nparallel { pipeline = 4 }\n";
    one(src, "rcoa::out_of_range");
    one("model \"tiny-decoder\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 32 global_batch = 4 }\nfit { checkpoint = every 3 }\n", "rcoa::out_of_range");
    assert_eq!(
        ok("model \"tiny-decoder\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 32 global_batch = 4 }\nfit { checkpoint = every 1 }\n").fit.checkpoint,
        CheckpointChoice::Full
    );
    let src = "model \"xlm-roberta-large\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 1024 global_batch = 8 }\n";
    let e = one(src, "rcoa::out_of_range");
    assert!(e.message().contains("514"));
    one(
        &with("optimizer adamw { momentum = 0.9 }"),
        "rcoa::not_applicable",
    );
    one(
        &with("optimizer sgd { betas = (0.9, 0.99) }"),
        "rcoa::not_applicable",
    );
    one(
        &BASE.replace("global_batch = 8", "global_batch = 8 positives = 1"),
        "rcoa::not_applicable",
    );
    let s = ok(&BASE.replace(
        "global_batch = 8",
        "global_batch = 8 loss = contrastive positives = 1 negatives = 3",
    ));
    assert_eq!(s.train.sequences_per_item(), 5);
    one(
        &with("fit { offload = [optimizer:nvme] }"),
        "rcoa::missing_key",
    );
    let s = ok(
        &(BASE.replace("gpu = h100-80gb", "gpu = h100-80gb nvme = 2 TB")
            + "fit { offload = [params:nvme, optimizer, optimizer] }\n"),
    );
    assert_eq!(
        s.fit.offload,
        vec![
            Offload {
                what: OffloadWhat::Optimizer,
                to: OffloadTo::Cpu
            },
            Offload {
                what: OffloadWhat::Params,
                to: OffloadTo::Nvme
            }
        ]
    );
    one(
        &with("precision { params = bf16 compute = tf32 }"),
        "rcoa::conflict",
    );
    one(
        &with("parallel { context = 3 }")
            .replace(
                "hardware { gpu = h100-80gb }",
                "hardware { gpu = h100-80gb gpus_per_node = 3 }",
            )
            .replace("global_batch = 8", "global_batch = 9"),
        "rcoa::not_divisible",
    );
}

// ------------------------------------------------------------------ hf config

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("rcoa-resolve-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn hf_plan(path: &str) -> String {
    format!("model hf \"{path}\"\nhardware {{ gpu = h100-80gb }}\ntrain {{ seq_len = 512 global_batch = 8 }}\n")
}

#[test]
fn hf_configs_of_each_family() {
    let dir = temp_dir("hf");
    std::fs::write(
        dir.join("llama.json"),
        r#"{"model_type": "llama", "num_hidden_layers": 32, "hidden_size": 4096, "num_attention_heads": 32,
            "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
            "max_position_embeddings": 131072, "tie_word_embeddings": false, "hidden_act": "silu"}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("gpt2.json"),
        r#"{"model_type": "gpt2", "n_layer": 12, "n_embd": 768, "n_head": 12, "n_inner": null,
            "vocab_size": 50257, "n_positions": 1024, "resid_pdrop": 0.1}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("xlmr.json"),
        r#"{"model_type": "xlm-roberta", "num_hidden_layers": 24, "hidden_size": 1024, "num_attention_heads": 16,
            "intermediate_size": 4096, "vocab_size": 250002, "max_position_embeddings": 514, "hidden_dropout_prob": 0.1}"#,
    )
    .unwrap();
    let run = |p: &str| run_in(&hf_plan(p), &dir).map(|(s, _)| s);
    let llama = run("llama.json").unwrap();
    let mut preset = catalog::model("llama-3.1-8b").unwrap().spec.clone();
    preset.name = "hf:llama.json".into();
    // The config's numerics: transformers' defaults for the keys it lacks.
    preset.numerics.norm_eps = 1e-6;
    assert_eq!(llama.model, preset);
    let gpt2 = run("gpt2.json").unwrap();
    let mut preset = catalog::model("gpt2-small").unwrap().spec.clone();
    preset.name = "hf:gpt2.json".into();
    preset.numerics.gelu_tanh = true;
    assert_eq!(gpt2.model, preset);
    let xlmr = run("xlmr.json").unwrap();
    let mut preset = catalog::model("xlm-roberta-large").unwrap().spec.clone();
    preset.name = "hf:xlmr.json".into();
    preset.numerics.norm_eps = 1e-12;
    preset.numerics.position_offset = 2;
    assert_eq!(xlmr.model, preset);
    assert_eq!(xlmr.train.loss, Loss::MaskedLm);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn hf_config_problems() {
    let dir = temp_dir("hfbad");
    std::fs::write(
        dir.join("t5.json"),
        r#"{"model_type": "t5", "d_model": 512}"#,
    )
    .unwrap();
    std::fs::write(
        dir.join("nolayers.json"),
        r#"{"model_type": "llama", "hidden_size": 64}"#,
    )
    .unwrap();
    std::fs::write(dir.join("broken.json"), r#"{"model_type": "#).unwrap();
    std::fs::write(dir.join("array.json"), "[]").unwrap();
    std::fs::write(
        dir.join("neg.json"),
        r#"{"model_type": "gpt2", "n_layer": -1}"#,
    )
    .unwrap();
    for (file, needle) in [
        ("t5.json", "unsupported Hugging Face `model_type` `t5`"),
        ("nolayers.json", "has no `num_hidden_layers`"),
        ("broken.json", "not valid JSON"),
        ("array.json", "not a JSON object"),
        ("neg.json", "`n_layer`"),
        ("missing.json", "no such file"),
    ] {
        let src = hf_plan(file);
        let e = match run_in(&src, &dir) {
            Err(e) => e,
            Ok(_) => panic!("{file} resolved"),
        };
        assert_eq!(e.codes(), vec!["rcoa::hf_config"], "{file}");
        let err = &e.errors()[0];
        assert!(err.message().contains(needle), "{file}: {}", err.message());
        assert_eq!(text_at(&src, err), format!("\"{file}\""));
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn span_table_records_values() {
    let src = "model \"llama-3.1-8b\"\nhardware { gpu = h100-80gb }\ntrain { seq_len = 2048 global_batch = 8 }\n";
    let (_, spans) = run_in(src, Path::new(".")).unwrap();
    let at = |p: &str| {
        let s = spans.get(p).unwrap();
        &src[s.start..s.end]
    };
    assert_eq!(at("train.seq_len"), "2048");
    assert_eq!(at("hardware.gpu"), "h100-80gb");
    assert_eq!(at("model.args"), "\"llama-3.1-8b\"");
    assert_eq!(at("train"), "train");
    assert!(spans.get("fit.budget").is_none());
}

#[test]
fn chunked_loss_key() {
    let plan = |v: &str| {
        format!("model \"llama-3.1-8b\"\nhardware {{ gpu = h100-80gb }}\ntrain {{ seq_len = 2048 global_batch = 8 chunked_loss = {v} }}\n")
    };
    assert_eq!(ok(BASE).train.chunked_loss, None);
    assert_eq!(ok(&plan("false")).train.chunked_loss, Some(false));
    assert_eq!(ok(&plan("true")).train.chunked_loss, Some(true));
    let src = plan("3");
    let e = one(&src, "rcoa::wrong_kind");
    assert_eq!(text_at(&src, &e), "3");
}

#[test]
fn assistant_only_loss_key_is_a_boolean_for_causal_lm_only() {
    let plan = |v: &str, loss: &str| {
        format!("model \"llama-3.1-8b\"\nhardware {{ gpu = h100-80gb }}\ntrain {{ seq_len = 2048 global_batch = 8 {loss} assistant_only_loss = {v} }}\n")
    };
    assert!(!ok(BASE).train.assistant_only_loss);
    assert!(ok(&plan("true", "")).train.assistant_only_loss);
    assert!(
        !ok(&plan("false", "loss = causal_lm"))
            .train
            .assistant_only_loss
    );
    let src = plan("yes", "");
    let e = one(&src, "rcoa::wrong_kind");
    assert_eq!(text_at(&src, &e), "yes");
    let src = plan("true", "loss = contrastive");
    let e = one(&src, "rcoa::not_applicable");
    assert_eq!(text_at(&src, &e), "true");
    assert!(e.to_string().contains("causal_lm"), "{e}");
}

#[test]
fn packing_key_is_a_boolean_for_causal_lm_only() {
    let plan = |v: &str, loss: &str| {
        format!("model \"llama-3.1-8b\"\nhardware {{ gpu = h100-80gb }}\ntrain {{ seq_len = 2048 global_batch = 8 {loss} packing = {v} }}\n")
    };
    assert!(!ok(BASE).train.packing);
    assert!(ok(&plan("true", "")).train.packing);
    assert!(!ok(&plan("false", "loss = causal_lm")).train.packing);
    let src = plan("1", "");
    let e = one(&src, "rcoa::wrong_kind");
    assert_eq!(text_at(&src, &e), "1");
    let src = plan("true", "loss = masked_lm");
    let e = one(&src, "rcoa::not_applicable");
    assert_eq!(text_at(&src, &e), "true");
    let help = format!("{:?}", miette::Report::new(e.clone()));
    assert!(help.contains("bins whole examples"), "{help}");
}

#[test]
fn target_names_every_engine_and_sets_its_optimizer_default() {
    use crate::spec::OptImpl;
    for t in Target::ALL {
        let s = ok(&with(&format!("target {}", t.as_str())));
        assert_eq!(s.target, t);
    }
    // DeepSpeed and Megatron build fused Adam unless the plan says otherwise; the default is
    // recorded for --explain.
    for engine in ["deepspeed", "megatron"] {
        let s = ok(&with(&format!(
            "optimizer adamw {{ lr = 1e-4 }}\ntarget {engine}"
        )));
        assert_eq!(s.optimizer.implementation, OptImpl::Fused, "{engine}");
        assert!(s
            .defaults
            .iter()
            .any(|(w, _)| w == "optimizer.impl = fused"));
        let s = ok(&with(&format!(
            "optimizer adamw {{ lr = 1e-4 impl = foreach }}\ntarget {engine}"
        )));
        assert_eq!(s.optimizer.implementation, OptImpl::Foreach, "written wins");
    }
    for other in ["pytorch", "fsdp", "burn"] {
        let s = ok(&with(&format!(
            "optimizer adamw {{ lr = 1e-4 }}\ntarget {other}"
        )));
        assert_eq!(s.optimizer.implementation, OptImpl::Foreach, "{other}");
    }
    let e = one(&with("target deepsped"), "rcoa::unknown_target");
    let help = e.help.clone().unwrap_or_default();
    for t in Target::ALL {
        assert!(help.contains(&format!("`{}`", t.as_str())), "{help}");
    }
}
