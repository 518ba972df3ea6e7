//! Property test: mutated versions of the example plans never make parse +
//! resolve panic; every rejection renders as a coded diagnostic; and every
//! plan the resolver accepts satisfies the invariants the `Spec` promises
//! (so later stages need not re-check them).
//!
//! The mutations are what people get wrong: deleted text, stray braces and
//! quotes, section/key/value tokens dropped in anywhere, numbers replaced by
//! extreme ones, lines duplicated.

use proptest::prelude::*;
use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::spec::{Budget, Choice, Spec};
use std::path::Path;

const PLANS: &[&str] = &[
    include_str!("../../plans/tiny-cpu.plan"),
    include_str!("../../plans/llama-3.1-8b-full-4xa100-40gb.plan"),
    include_str!("../../plans/llama-3.1-405b-128xh100.plan"),
    include_str!("../../plans/mistral-7b-qlora-1x24gb.plan"),
    include_str!("../../plans/xlm-roberta-large-lora-contrastive.plan"),
    include_str!("../../plans/embedder-contrastive-rtx6000-24gb.plan"),
    include_str!("../../plans/llama-3.1-70b-zero3-8x80gb.plan"),
];

const TOKENS: &[&str] = &[
    "{",
    "}",
    "=",
    "\"",
    "[",
    "]",
    "(",
    ")",
    ",",
    "\n",
    " ",
    "auto",
    "true",
    "0",
    "-1",
    "1.5",
    "1e308",
    "99999999999999999999",
    "8B",
    "1T",
    "40 GiB",
    "0 B",
    "90%",
    "0%",
    "400 Gbps",
    "900 GB/s",
    "every 0",
    "every 1000",
    "hf \"nowhere.json\"",
    "model",
    "adapter",
    "hardware",
    "precision",
    "optimizer",
    "train",
    "parallel",
    "fit",
    "target",
    "layers",
    "heads",
    "kv_heads",
    "hidden",
    "tensor = 3",
    "tensor = 7",
    "pipeline = 1000",
    "data = 3",
    "zero = 9",
    "sequence = true",
    "context = 5",
    "expert = 2",
    "experts = 4",
    "experts_per_token = 9",
    "global_batch = 7",
    "micro_batch = 3",
    "grad_accum = 0",
    "seq_len = 100000",
    "gpus_per_node = 3",
    "nodes = 0",
    "budget = 200 GiB",
    "reserve = 1 TiB",
    "offload = [optimizer:nvme]",
    "checkpoint = every 3",
    "dropout = 1",
    "model \"tiny-decoder\"",
    "model { arch = encoder }",
    "precision fp8",
    "precision { compute = tf32 }",
    "optimizer sgd { betas = (0.1, 0.2) }",
    "optimizer adamw { momentum = 0.5 }",
    "adapter qlora { rank = 1 alpha = 1 targets = [gate] base = fp16 }",
    "adapter lora { targets = [] }",
    "loss = contrastive",
    "positives = 3",
    "target pytorch",
    "gpu { memory = 1 KiB }",
    "bf16",
    "nf4",
    "a100-40g",
    "h100-80gb",
    "llama-3.1-8",
    "xlm-roberta-large",
    "gpt2-small",
];

#[derive(Clone, Debug)]
enum Mutation {
    Delete { at: f64, len: usize },
    Insert { at: f64, token: usize },
    Number { nth: usize, value: u64 },
    DuplicateLine { nth: usize },
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        (0.0..1.0f64, 1usize..12).prop_map(|(at, len)| Mutation::Delete { at, len }),
        (0.0..1.0f64, 0..TOKENS.len()).prop_map(|(at, token)| Mutation::Insert { at, token }),
        (
            0usize..40,
            prop_oneof![
                Just(0u64),
                Just(1),
                Just(3),
                Just(7),
                0u64..5000,
                Just(u64::MAX)
            ]
        )
            .prop_map(|(nth, value)| Mutation::Number { nth, value }),
        (0usize..40).prop_map(|nth| Mutation::DuplicateLine { nth }),
    ]
}

/// The char boundary at or before `i`.
fn boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn apply(s: &str, m: &Mutation) -> String {
    match m {
        Mutation::Delete { at, len } => {
            let a = boundary(s, (s.len() as f64 * at) as usize);
            let b = boundary(s, a + len);
            format!("{}{}", &s[..a], &s[b..])
        }
        Mutation::Insert { at, token } => {
            let a = boundary(s, (s.len() as f64 * at) as usize);
            format!("{} {} {}", &s[..a], TOKENS[*token], &s[a..])
        }
        Mutation::Number { nth, value } => {
            // Replace the nth run of ASCII digits.
            let bytes = s.as_bytes();
            let mut runs = Vec::new();
            let mut i = 0;
            while i < bytes.len() {
                if bytes[i].is_ascii_digit() {
                    let start = i;
                    while i < bytes.len() && bytes[i].is_ascii_digit() {
                        i += 1;
                    }
                    runs.push((start, i));
                } else {
                    i += 1;
                }
            }
            match runs.get(nth % runs.len().max(1)) {
                Some(&(a, b)) => format!("{}{}{}", &s[..a], value, &s[b..]),
                None => s.to_string(),
            }
        }
        Mutation::DuplicateLine { nth } => {
            let lines: Vec<&str> = s.lines().collect();
            if lines.is_empty() {
                return s.to_string();
            }
            let k = nth % lines.len();
            let mut out: Vec<&str> = lines[..=k].to_vec();
            out.extend_from_slice(&lines[k..]);
            out.join("\n")
        }
    }
}

/// What every accepted plan promises.
fn check_invariants(s: &Spec) -> Result<(), String> {
    let m = &s.model;
    let ensure = |ok: bool, what: &str| {
        if ok {
            Ok(())
        } else {
            Err(format!("{what}: {s:#?}"))
        }
    };
    ensure(
        m.layers > 0 && m.hidden > 0 && m.heads > 0 && m.ffn > 0 && m.vocab > 0,
        "positive dims",
    )?;
    ensure(
        m.kv_heads > 0 && m.heads.is_multiple_of(m.kv_heads),
        "kv_heads divides heads",
    )?;
    ensure(m.head_dim > 0, "head_dim")?;
    ensure(
        m.experts_per_token >= 1 && m.experts_per_token <= m.experts,
        "experts",
    )?;
    ensure((0.0..1.0).contains(&m.dropout), "dropout")?;
    ensure(s.gpu_count() >= 1, "gpus")?;
    ensure(s.train.seq_len >= 1 && s.train.global_batch >= 1, "train")?;
    if let Budget::Fraction(f) = s.fit.budget {
        ensure(f > 0.0 && f <= 1.0, "budget fraction")?;
    }
    if let Budget::Bytes(b) = s.fit.budget {
        ensure(b <= s.hardware.gpu.memory_bytes, "budget within memory")?;
    }
    let p = &s.parallel;
    if let Choice::Fixed(t) = p.tensor {
        ensure(
            m.heads.is_multiple_of(t) && m.kv_heads.is_multiple_of(t) && m.vocab.is_multiple_of(t),
            "tensor divides",
        )?;
    }
    if let (Choice::Fixed(d), Choice::Fixed(t), Choice::Fixed(pp), Choice::Fixed(c)) =
        (p.data, p.tensor, p.pipeline, p.context)
    {
        ensure(
            d as u128 * t as u128 * pp as u128 * c as u128 == s.gpu_count() as u128,
            "parallel product",
        )?;
        if let (Choice::Fixed(mb), Choice::Fixed(ga)) = (s.train.micro_batch, s.train.grad_accum) {
            ensure(
                mb as u128 * ga as u128 * d as u128 == s.train.global_batch as u128,
                "batch product",
            )?;
        }
    }
    if let Some(a) = &s.adapter {
        ensure(!a.targets.is_empty() && a.rank >= 1, "adapter")?;
    }
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn mutated_plans_never_panic(plan in 0..PLANS.len(), muts in prop::collection::vec(mutation(), 1..5)) {
        let mut src = PLANS[plan].to_string();
        for m in &muts {
            src = apply(&src, m);
        }
        let Ok(file) = rcoa_grammar::parse("mutant.plan", &src) else { return Ok(()) };
        let ctx = ResolveContext::new("mutant.plan", src.clone(), Path::new(env!("CARGO_MANIFEST_DIR")));
        match resolve(&file, &ctx) {
            Ok(spec) => {
                if let Err(e) = check_invariants(&spec) {
                    prop_assert!(false, "accepted a plan breaking an invariant ({e})\n{src}");
                }
            }
            Err(errs) => {
                prop_assert!(!errs.is_empty());
                let text = rcoa_grammar::render::render_plain(&errs);
                prop_assert!(text.contains("rcoa::"), "{text}");
                for e in errs.errors() {
                    if let Some(sp) = e.span() {
                        prop_assert!(sp.end <= src.len() && src.is_char_boundary(sp.start), "bad span {sp:?}");
                    }
                }
            }
        }
    }
}

#[test]
fn every_example_plan_resolves_and_keeps_the_invariants() {
    for (i, src) in PLANS.iter().enumerate() {
        let file = rcoa_grammar::parse("p.plan", src).unwrap();
        let ctx = ResolveContext::new("p.plan", *src, Path::new("."));
        let spec = resolve(&file, &ctx).unwrap_or_else(|e| panic!("plan {i}: {:?}", e.errors()));
        check_invariants(&spec).unwrap();
    }
}
