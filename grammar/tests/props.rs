//! Property tests: no input panics the parser, and the formatter is a
//! faithful, idempotent printer of any tree the grammar can express.

use proptest::prelude::*;
use rcoa_grammar::format::without_spans;
use rcoa_grammar::*;

/// A valid plan exercising every construct (its own copy, so the test does
/// not depend on files outside the crate).
const SEED: &str = r#"# a plan
model "llama-3.1-8b" { layers = 2 }   # preset
model hf "conf\"ig.json"
hardware {
  gpu { memory = 48 GiB  bf16_tflops = 362  bandwidth = 864 GB/s }
  gpus_per_node = 4, nodes = 1
  intra_node = 900GB/s  inter_node = 400 Gbps
}
precision bf16
optimizer adamw { lr = 2e-5  betas = (0.9, 0.95)  weight_decay = 0.1 }
train { seq_len = 2_048  global_batch = 1B  micro_batch = auto  steps = 128K }
fit {
  budget = 95%
  checkpoint = every 2
  offload = [optimizer:cpu, params:nvme,
    grads]
  sequence = true
  x = -1
}
"#;

/// Parsing then formatting must hold the two formatter invariants whenever
/// the input parses.
fn check_round_trip(src: &str) -> Result<(), TestCaseError> {
    if let Ok(file) = parse("in.plan", src) {
        let out = format(&file, src);
        let again = parse("out.plan", &out).map_err(|e| {
            TestCaseError::fail(format!("formatted text does not parse: {e}\n{out}"))
        })?;
        prop_assert_eq!(
            without_spans(&file),
            without_spans(&again),
            "tree changed:\n{}",
            out
        );
        prop_assert_eq!(&format(&again, &out), &out, "not idempotent");
    }
    Ok(())
}

#[derive(Clone, Debug)]
enum Edit {
    Delete(usize),
    Insert(usize, char),
    Swap(usize, usize),
}

fn edit() -> impl Strategy<Value = Edit> {
    let ch = prop::sample::select(vec![
        '{', '}', '[', ']', '(', ')', '=', ',', ':', '"', '\\', '#', '\n', '\r', ' ', '%', '-',
        '.', 'e', '_', 'K', 'G', 'B', '0', '7', 'a', 'z', 'é', '\u{FEFF}', ';',
    ]);
    prop_oneof![
        any::<usize>().prop_map(Edit::Delete),
        (any::<usize>(), ch).prop_map(|(i, c)| Edit::Insert(i, c)),
        (any::<usize>(), any::<usize>()).prop_map(|(i, j)| Edit::Swap(i, j)),
    ]
}

fn apply(src: &str, edits: &[Edit]) -> String {
    let mut chars: Vec<char> = src.chars().collect();
    for e in edits {
        let n = chars.len();
        match *e {
            Edit::Delete(i) if n > 0 => {
                chars.remove(i % n);
            }
            Edit::Insert(i, c) => chars.insert(i % (n + 1), c),
            Edit::Swap(i, j) if n > 0 => chars.swap(i % n, j % n),
            _ => {}
        }
    }
    chars.into_iter().collect()
}

// ---- generated trees -------------------------------------------------------

const KEYWORDS: [&str; 4] = ["auto", "true", "false", "every"];

fn name() -> impl Strategy<Value = String> {
    "[a-z][a-z0-9_.-]{0,8}".prop_filter("keywords are not identifiers", |s| {
        !KEYWORDS.contains(&s.as_str())
    })
}

fn id() -> impl Strategy<Value = Ident> {
    name().prop_map(|name| Ident {
        name,
        span: Span::default(),
    })
}

fn v(kind: ValueKind) -> Value {
    Value {
        kind,
        span: Span::default(),
    }
}

fn number() -> impl Strategy<Value = Number> {
    let digits = "[0-9](_?[0-9]){0,3}";
    let text = (
        any::<bool>(),
        digits,
        prop::option::of("[0-9]{1,3}"),
        prop::option::of((
            prop::sample::select(vec!["e", "E"]),
            prop::sample::select(vec!["", "+", "-"]),
            "[0-9]{1,2}",
        )),
    )
        .prop_map(|(neg, int, frac, exp)| {
            let mut t = String::new();
            if neg {
                t.push('-');
            }
            t.push_str(&int);
            if let Some(f) = frac {
                t.push('.');
                t.push_str(&f);
            }
            if let Some((e, sign, d)) = exp {
                t.push_str(e);
                t.push_str(sign);
                t.push_str(&d);
            }
            t
        });
    let units = prop::sample::select(vec![
        None,
        Some(Unit::K),
        Some(Unit::M),
        Some(Unit::B),
        Some(Unit::T),
        Some(Unit::KB),
        Some(Unit::MB),
        Some(Unit::GB),
        Some(Unit::TB),
        Some(Unit::KiB),
        Some(Unit::MiB),
        Some(Unit::GiB),
        Some(Unit::TiB),
        Some(Unit::Percent),
        Some(Unit::Gbps),
        Some(Unit::Mbps),
        Some(Unit::Tbps),
        Some(Unit::MBps),
        Some(Unit::GBps),
        Some(Unit::TBps),
    ]);
    (text, units).prop_map(|(text, unit)| Number {
        value: text.replace('_', "").parse().unwrap(),
        integer: !text.contains(['.', 'e', 'E']),
        text,
        unit,
    })
}

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(v(ValueKind::Auto)),
        any::<bool>().prop_map(|b| v(ValueKind::Bool(b))),
        name().prop_map(|n| v(ValueKind::Ident(n))),
        "[^\r\n]{0,12}".prop_map(|s| v(ValueKind::Str(s))),
        number().prop_map(|n| v(ValueKind::Number(n))),
        (id(), id()).prop_map(|(what, place)| v(ValueKind::Placed { what, place })),
    ]
}

fn block_of(value: BoxedStrategy<Value>) -> impl Strategy<Value = Block> {
    prop::collection::vec((id(), value), 0..4).prop_map(|entries| Block {
        entries: entries
            .into_iter()
            .map(|(key, value)| Entry {
                key,
                value,
                span: Span::default(),
            })
            .collect(),
        span: Span::default(),
    })
}

fn value() -> BoxedStrategy<Value> {
    scalar()
        .prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(|xs| v(ValueKind::List(xs))),
                prop::collection::vec(inner.clone(), 0..4).prop_map(|xs| v(ValueKind::Tuple(xs))),
                block_of(inner.clone()).prop_map(|b| v(ValueKind::Block(b))),
                scalar().prop_map(|s| v(ValueKind::Every(Box::new(s)))),
            ]
        })
        .boxed()
}

/// Section arguments: any value but a block.
fn arg() -> impl Strategy<Value = Value> {
    value().prop_filter("blocks are bodies, not arguments", |x| {
        !matches!(x.kind, ValueKind::Block(_))
    })
}

fn plan() -> impl Strategy<Value = PlanFile> {
    let section = (
        id(),
        prop::collection::vec(arg(), 0..3),
        prop::option::of(block_of(value())),
    );
    prop::collection::vec(section, 0..5).prop_map(|sections| PlanFile {
        sections: sections
            .into_iter()
            .map(|(name, args, body)| Section {
                name,
                args,
                body,
                span: Span::default(),
            })
            .collect(),
        comments: Vec::new(),
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_text_never_panics(src in ".{0,200}") {
        let _ = parse("p.plan", &src);
        check_round_trip(&src)?;
    }

    #[test]
    fn plan_like_text_never_panics(src in "[a-zA-Z0-9 {}\\[\\]()=,:\"\\\\#\n%.\\-_]{0,120}") {
        check_round_trip(&src)?;
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..200)) {
        if let Ok(text) = decode_utf8("p.plan", &bytes) {
            let _ = parse("p.plan", text);
        }
    }

    #[test]
    fn mutated_plans_never_panic(edits in prop::collection::vec(edit(), 1..6)) {
        let src = apply(SEED, &edits);
        check_round_trip(&src)?;
    }

    #[test]
    fn generated_trees_round_trip(file in plan()) {
        let text = format(&file, "");
        let parsed = parse("gen.plan", &text)
            .map_err(|e| TestCaseError::fail(format!("{e}\n{text}")))?;
        prop_assert_eq!(without_spans(&file), without_spans(&parsed), "\n{}", text);
        prop_assert_eq!(&format(&parsed, &text), &text, "not idempotent");
    }
}

#[test]
fn seed_plan_round_trips() {
    check_round_trip(SEED).unwrap();
    assert!(parse("seed.plan", SEED).is_ok());
}
