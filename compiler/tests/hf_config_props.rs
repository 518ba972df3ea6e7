//! Property test: mutated Hugging Face configs (the fixtures' and the example plans'
//! published ones) never make the config reader panic; every rejection is one coded
//! diagnostic; every accepted config keeps what the executor relies on (RoPE's rotated
//! share even and within the head, one LongRoPE factor per rotated pair), and the
//! `target burn` check of it returns rather than panics.
//!
//! The mutations are what configs in the wild hold: keys missing, `null`s, strings
//! where numbers go, negative, fractional and huge numbers, empty or odd lists, another
//! `model_type`, RoPE blocks of every type with missing or misshapen parts.

use proptest::prelude::*;
use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::spec::{RopeScaling, Spec, Target};
use serde_json::{json, Value};

const CONFIGS: &[&str] = &[
    include_str!("../../tests/fixtures/hf/llama/config.json"),
    include_str!("../../tests/fixtures/hf/llama3-rope/config.json"),
    include_str!("../../tests/fixtures/hf/mistral/config.json"),
    include_str!("../../tests/fixtures/hf/qwen2/config.json"),
    include_str!("../../tests/fixtures/hf/qwen3/config.json"),
    include_str!("../../tests/fixtures/hf/phi3/config.json"),
    include_str!("../../tests/fixtures/hf/phi3-longrope/config.json"),
    include_str!("../../tests/fixtures/hf/gpt2/config.json"),
    include_str!("../../tests/fixtures/hf/xlmr/config.json"),
    include_str!("../../plans/phi-3-mini-4k/config.json"),
    include_str!("../../plans/phi-4-mini-instruct/config.json"),
];

/// Keys the reader looks at, at the top and inside the RoPE blocks.
const KEYS: &[&str] = &[
    "model_type",
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "original_max_position_embeddings",
    "tie_word_embeddings",
    "attention_dropout",
    "resid_pdrop",
    "hidden_dropout_prob",
    "rms_norm_eps",
    "rope_theta",
    "partial_rotary_factor",
    "rope_scaling",
    "rope_parameters",
    "sliding_window",
    "use_sliding_window",
    "attention_bias",
    "mlp_bias",
    "pad_token_id",
    "hidden_act",
    "n_layer",
    "n_embd",
    "n_head",
    "n_inner",
];

const INNER_KEYS: &[&str] = &[
    "rope_type",
    "type",
    "factor",
    "rope_theta",
    "partial_rotary_factor",
    "short_factor",
    "long_factor",
    "attention_factor",
    "original_max_position_embeddings",
    "low_freq_factor",
    "high_freq_factor",
];

fn values() -> Vec<Value> {
    vec![
        Value::Null,
        json!(true),
        json!("x"),
        json!("longrope"),
        json!("phi3"),
        json!("gpt2"),
        json!("llama"),
        json!(-1),
        json!(0),
        json!(1),
        json!(2),
        json!(3),
        json!(7),
        json!(0.5),
        json!(0.75),
        json!(0.3),
        json!(1.0),
        json!(1.5),
        json!(2.5),
        json!(1e308),
        json!(u64::MAX),
        json!([]),
        json!([1.0]),
        json!([1.0, 2.0]),
        json!([1.0, 2.0, 3.0]),
        json!([1.0, 2.0, 3.0, 4.0]),
        json!([1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]),
        json!([0.0, -1.0]),
        json!(["a"]),
        json!({}),
        json!({"rope_type": "longrope"}),
        json!({"type": "su", "short_factor": [1.0, 1.0], "long_factor": [1.0, 2.0]}),
        json!({"rope_type": "longrope", "short_factor": [1.0, 1.0, 1.0, 1.0],
               "long_factor": [2.0, 2.0, 2.0, 2.0], "partial_rotary_factor": 0.5}),
        json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0}),
        json!({"rope_type": "linear", "factor": 0.0}),
        json!({"rope_type": "yarn", "factor": 4.0}),
        json!({"rope_type": 3}),
    ]
}

#[derive(Clone, Debug)]
enum Mutation {
    Remove(usize),
    Set(usize, usize),
    SetInner(usize, usize),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let n = values().len();
    // RoPE's blocks hold the most structure: most mutations go there.
    prop_oneof![
        1 => (0..KEYS.len()).prop_map(Mutation::Remove),
        2 => (0..KEYS.len(), 0..n).prop_map(|(k, v)| Mutation::Set(k, v)),
        4 => (0..INNER_KEYS.len(), 0..n).prop_map(|(k, v)| Mutation::SetInner(k, v)),
    ]
}

fn apply(config: &mut serde_json::Map<String, Value>, m: &Mutation) {
    let values = values();
    match m {
        Mutation::Remove(k) => {
            config.remove(KEYS[*k]);
        }
        Mutation::Set(k, v) => {
            config.insert(KEYS[*k].to_string(), values[*v].clone());
        }
        Mutation::SetInner(k, v) => {
            // Into whichever RoPE block the config has (a new `rope_scaling` if none).
            let block = ["rope_scaling", "rope_parameters"]
                .into_iter()
                .find(|b| config.get(*b).is_some_and(Value::is_object))
                .unwrap_or("rope_scaling");
            let entry = config.entry(block).or_insert_with(|| json!({}));
            if let Some(o) = entry.as_object_mut() {
                o.insert(INNER_KEYS[*k].to_string(), values[*v].clone());
            }
        }
    }
}

/// What the executor's RoPE tables rely on in an accepted config.
fn check_rope(s: &Spec) -> Result<(), String> {
    let m = &s.model;
    let rotated = m.numerics.rotary_dims.unwrap_or(m.head_dim);
    if m.numerics.rotary_dims.is_some()
        && (rotated < 2 || !rotated.is_multiple_of(2) || rotated > m.head_dim)
    {
        return Err(format!("rotary_dims {rotated} of head {}", m.head_dim));
    }
    if let Some(RopeScaling::LongRope {
        short_factor,
        long_factor,
        attention_factor,
        ..
    }) = &m.numerics.rope_scaling
    {
        let pairs = rotated as usize / 2;
        if short_factor.len() != pairs || long_factor.len() != pairs {
            return Err(format!(
                "{} and {} factors for {pairs} pairs",
                short_factor.len(),
                long_factor.len()
            ));
        }
        if !attention_factor.is_finite() {
            return Err(format!("attention factor {attention_factor}"));
        }
    }
    Ok(())
}

fn resolve_config(dir: &std::path::Path, config: &Value) -> Result<Spec, String> {
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let plan = "model hf \"config.json\"\nhardware { gpu = h100-80gb }\n\
                train { seq_len = 16 global_batch = 4 }\ntarget burn\n";
    let file = rcoa_grammar::parse("t.plan", plan).unwrap();
    resolve(&file, &ResolveContext::new("t.plan", plan, dir)).map_err(|errs| {
        assert!(!errs.is_empty());
        let text = rcoa_grammar::render::render_plain(&errs);
        assert!(text.contains("rcoa::"), "{text}");
        text
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2048, ..ProptestConfig::default() })]

    #[test]
    fn mutated_hf_configs_never_panic(
        config in 0..CONFIGS.len(),
        muts in prop::collection::vec(mutation(), 1..5),
    ) {
        let dir = std::env::temp_dir().join(format!("rcoa-hf-props-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let Value::Object(mut c) = serde_json::from_str(CONFIGS[config]).unwrap() else {
            unreachable!("configs are objects")
        };
        for m in &muts {
            apply(&mut c, m);
        }
        let c = Value::Object(c);
        if let Ok(spec) = resolve_config(&dir, &c) {
            if let Err(e) = check_rope(&spec) {
                prop_assert!(false, "accepted a config the executor cannot build ({e})\n{c}");
            }
            prop_assert_eq!(spec.target, Target::Burn);
            // Refused or not, the `target burn` check answers.
            let _ = rcoa_compiler::executed::check(&spec);
        }
    }
}

#[test]
fn every_config_resolves_unchanged() {
    let dir = std::env::temp_dir().join(format!("rcoa-hf-props-plain-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (i, c) in CONFIGS.iter().enumerate() {
        let spec = resolve_config(&dir, &serde_json::from_str(c).unwrap())
            .unwrap_or_else(|e| panic!("config {i}: {e}"));
        check_rope(&spec).unwrap();
    }
}
