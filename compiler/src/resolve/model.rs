//! The `model` section: a catalog preset, a Hugging Face `config.json`, or
//! an explicit architecture, each optionally followed by a block of keys.
//!
//! - `model "llama-3.1-8b"` / `model "llama-3.1-8b" { dropout = 0.1 }`:
//!   the preset, with the block's keys overriding it;
//! - `model hf "path/config.json" { ... }`: the config's architecture
//!   ([`super::hf`]), with overrides;
//! - `model { ... }`: everything from the block. Keys with a default in
//!   `DSL.md` may be left out (`kv_heads` = heads, `head_dim` = hidden/heads,
//!   `positions` = rope for decoders and learned for encoders, `experts` and
//!   `experts_per_token` = 1, `dropout` = 0); the others are required, since
//!   the plan would otherwise be a guess.
//!
//! After merging, [`check_shape`] applies the shape constraints (kv_heads
//! divides heads, hidden divisible by heads unless `head_dim` is given,
//! experts_per_token <= experts); the catalog's tests run the same check on
//! every preset.

use super::hf;
use super::problem::{Expected, NameKind, Problem, Range};
use super::values::{self, Cx, Fields};
use crate::catalog;
use crate::spec::{Arch, Biases, Mlp, ModelSpec, Norm, Positions};
use rcoa_grammar::{Section, Span, ValueKind};

pub(crate) const KEYS: &[&str] = &[
    "arch",
    "layers",
    "hidden",
    "heads",
    "kv_heads",
    "head_dim",
    "ffn",
    "mlp",
    "norm",
    "positions",
    "vocab",
    "max_positions",
    "tie_embeddings",
    "experts",
    "experts_per_token",
    "dropout",
    "bias",
    "qk_norm",
];

/// Keys an explicit `model { ... }` must give. The others default from
/// `arch` ([`arch_defaults`]); `max_positions` from `train.seq_len`.
const REQUIRED: &[&str] = &["arch", "layers", "hidden", "heads", "ffn", "vocab"];

/// What an explicit block leaves out means what the common models of its
/// family do: decoders as LLaMA (SwiGLU, RMSNorm, RoPE, untied head),
/// encoders as BERT / XLM-R (GELU, LayerNorm, learned positions, tied head).
fn arch_defaults(arch: Arch) -> (Mlp, Norm, bool) {
    match arch {
        Arch::Decoder => (Mlp::Swiglu, Norm::Rmsnorm, false),
        Arch::Encoder => (Mlp::Gelu, Norm::Layernorm, true),
    }
}

const ARCHS: &[(&str, Arch)] = &[("decoder", Arch::Decoder), ("encoder", Arch::Encoder)];
const MLPS: &[(&str, Mlp)] = &[
    ("swiglu", Mlp::Swiglu),
    ("gelu", Mlp::Gelu),
    ("squared_relu", Mlp::SquaredRelu),
];
/// `true` and `false` are booleans, not names; they are listed for the error's choices.
const BIASES: &[(&str, Biases)] = &[
    ("true", Biases::All),
    ("false", Biases::None),
    ("qkv", Biases::Qkv),
];
const NORMS: &[(&str, Norm)] = &[("rmsnorm", Norm::Rmsnorm), ("layernorm", Norm::Layernorm)];
const POSITIONS: &[(&str, Positions)] =
    &[("rope", Positions::Rope), ("learned", Positions::Learned)];

/// A model being assembled: `None` is "not given (yet)".
#[derive(Default)]
struct Draft {
    arch: Option<Arch>,
    layers: Option<u64>,
    hidden: Option<u64>,
    heads: Option<u64>,
    kv_heads: Option<u64>,
    head_dim: Option<u64>,
    ffn: Option<u64>,
    mlp: Option<Mlp>,
    norm: Option<Norm>,
    positions: Option<Positions>,
    vocab: Option<u64>,
    max_positions: Option<u64>,
    tie_embeddings: Option<bool>,
    experts: Option<u64>,
    experts_per_token: Option<u64>,
    dropout: Option<f64>,
    /// Written `bias`, or the base's; `None`: the family's ([`ModelSpec::biases`]).
    bias: Option<Biases>,
    qk_norm: Option<bool>,
}

impl Draft {
    fn from_spec(m: &ModelSpec) -> Self {
        Draft {
            arch: Some(m.arch),
            layers: Some(m.layers),
            hidden: Some(m.hidden),
            heads: Some(m.heads),
            kv_heads: Some(m.kv_heads),
            head_dim: Some(m.head_dim),
            ffn: Some(m.ffn),
            mlp: Some(m.mlp),
            norm: Some(m.norm),
            positions: Some(m.positions),
            vocab: Some(m.vocab),
            max_positions: Some(m.max_positions),
            tie_embeddings: Some(m.tie_embeddings),
            experts: Some(m.experts),
            experts_per_token: Some(m.experts_per_token),
            dropout: Some(m.dropout),
            bias: m.numerics.linear_bias,
            qk_norm: Some(m.numerics.qk_norm),
        }
    }
}

pub(super) fn resolve(cx: &mut Cx, s: &Section) -> Option<ModelSpec> {
    let mark = cx.mark();
    // Where shape problems of the base (preset / config) are reported.
    let mut base_span = s.name.span;
    let (name, base) = match s.args.as_slice() {
        [] if s.body.is_none() => {
            cx.report(Problem::MissingArgument {
                section: "model",
                span: s.name.span,
            });
            return None;
        }
        [] => ("custom".to_string(), None),
        [first, rest @ ..] if matches!(&first.kind, ValueKind::Ident(h) if h == "hf") => {
            cx.spans.insert(
                "model.args",
                first.span.to(rest.last().map_or(first.span, |v| v.span)),
            );
            match rest {
                [] => {
                    cx.report(Problem::MissingArgument {
                        section: "hf",
                        span: first.span,
                    });
                    return None;
                }
                [path, extra @ ..] => {
                    for e in extra {
                        cx.report(Problem::UnexpectedArgument {
                            section: "model",
                            span: e.span,
                        });
                    }
                    base_span = path.span;
                    let ValueKind::Str(p) = &path.kind else {
                        cx.report(Problem::WrongKind {
                            slot: "hf",
                            expected: Expected::Path,
                            found: super::wording::found(&path.kind),
                            span: path.span,
                        });
                        return None;
                    };
                    let spec = hf::load(cx, p, path.span)?;
                    (spec.name.clone(), Some(spec))
                }
            }
        }
        [preset, extra @ ..] => {
            for e in extra {
                cx.report(Problem::UnexpectedArgument {
                    section: "model",
                    span: e.span,
                });
            }
            cx.spans.insert("model.args", preset.span);
            base_span = preset.span;
            let Some(n) = values::name_of(preset) else {
                cx.report(Problem::WrongKind {
                    slot: "model",
                    expected: Expected::Name,
                    found: super::wording::found(&preset.kind),
                    span: preset.span,
                });
                return None;
            };
            match catalog::model(n) {
                Some(entry) => (entry.name.clone(), Some(entry.spec.clone())),
                None => {
                    cx.report(Problem::UnknownName {
                        kind: NameKind::Model,
                        slot: "model",
                        name: n.to_string(),
                        span: preset.span,
                        choices: catalog::catalog()
                            .model_names()
                            .map(str::to_string)
                            .collect(),
                    });
                    return None;
                }
            }
        }
    };

    let explicit = base.is_none();
    let mut d = base.as_ref().map(Draft::from_spec).unwrap_or_default();
    let f = Fields::read(cx, "model", "model", s.name.span, s.body.as_ref(), KEYS);
    if explicit {
        for key in REQUIRED {
            f.require(cx, key);
        }
    }
    // A preset's head_dim is derived from its hidden/heads; an override of
    // either re-derives it unless head_dim itself is written.
    let head_dim_written = f.get("head_dim").is_some();
    if !head_dim_written && (f.get("hidden").is_some() || f.get("heads").is_some()) {
        d.head_dim = None;
    }
    if let Some(v) = f.get("arch") {
        let arch = values::pick(cx, v, "arch", NameKind::Value, ARCHS);
        // A changed arch changes the positions default (unless written).
        if arch != d.arch && f.get("positions").is_none() {
            d.positions = None;
        }
        d.arch = arch.or(d.arch);
    }
    read_u64(cx, &f, "layers", &mut d.layers);
    read_u64(cx, &f, "hidden", &mut d.hidden);
    read_u64(cx, &f, "heads", &mut d.heads);
    read_u64(cx, &f, "kv_heads", &mut d.kv_heads);
    read_u64(cx, &f, "head_dim", &mut d.head_dim);
    read_u64(cx, &f, "ffn", &mut d.ffn);
    read_u64(cx, &f, "vocab", &mut d.vocab);
    read_u64(cx, &f, "max_positions", &mut d.max_positions);
    read_u64(cx, &f, "experts", &mut d.experts);
    read_u64(cx, &f, "experts_per_token", &mut d.experts_per_token);
    if let Some(v) = f.get("mlp") {
        d.mlp = values::pick(cx, v, "mlp", NameKind::Value, MLPS).or(d.mlp);
    }
    if let Some(v) = f.get("norm") {
        d.norm = values::pick(cx, v, "norm", NameKind::Value, NORMS).or(d.norm);
    }
    if let Some(v) = f.get("positions") {
        d.positions = values::pick(cx, v, "positions", NameKind::Value, POSITIONS).or(d.positions);
    }
    if let Some(v) = f.get("tie_embeddings") {
        d.tie_embeddings = values::boolean(cx, v, "tie_embeddings").or(d.tie_embeddings);
    }
    if let Some(v) = f.get("dropout") {
        d.dropout = values::number(cx, v, "dropout", Range::UnitInterval).or(d.dropout);
    }
    if let Some(v) = f.get("bias") {
        d.bias = match &v.kind {
            ValueKind::Bool(b) => Some(if *b { Biases::All } else { Biases::None }),
            ValueKind::Ident(_) | ValueKind::Str(_) => {
                values::pick(cx, v, "bias", NameKind::Value, BIASES)
            }
            _ => {
                values::wrong_kind(cx, v, "bias", Expected::Bias);
                None
            }
        }
        .or(d.bias);
    }
    if let Some(v) = f.get("qk_norm") {
        d.qk_norm = values::boolean(cx, v, "qk_norm").or(d.qk_norm);
    }
    if !cx.clean_since(mark) {
        return None;
    }
    if explicit {
        if let Some(arch) = d.arch {
            let (mlp, norm, tie) = arch_defaults(arch);
            let why = match arch {
                Arch::Decoder => "the default for a decoder",
                Arch::Encoder => "the default for an encoder",
            };
            let mut note = |key: &str, value: &str| {
                cx.defaults
                    .push((format!("model.{key} = {value}"), why.to_string()));
            };
            if d.mlp.is_none() {
                d.mlp = Some(mlp);
                note("mlp", mlp_name(mlp));
            }
            if d.norm.is_none() {
                d.norm = Some(norm);
                note("norm", norm_name(norm));
            }
            if d.positions.is_none() {
                let positions = default_positions(arch);
                d.positions = Some(positions);
                note("positions", positions_name(positions));
            }
            if d.tie_embeddings.is_none() {
                d.tie_embeddings = Some(tie);
                note("tie_embeddings", if tie { "true" } else { "false" });
            }
        }
    }

    // Every required key is present here (checked above, or from the base);
    // `max_positions` left out of an explicit block is 0 here and becomes
    // `train.seq_len` once the train section is resolved (`resolve`).
    let (
        Some(arch),
        Some(layers),
        Some(hidden),
        Some(heads),
        Some(ffn),
        Some(mlp),
        Some(norm),
        Some(vocab),
        Some(max_positions),
        Some(tie),
    ) = (
        d.arch,
        d.layers,
        d.hidden,
        d.heads,
        d.ffn,
        d.mlp,
        d.norm,
        d.vocab,
        d.max_positions.or(explicit.then_some(0)),
        d.tie_embeddings,
    )
    else {
        return None;
    };
    let span_of = |key: &str| f.span(key).unwrap_or(base_span);
    if !head_dim_written && d.head_dim.is_none() && hidden % heads != 0 {
        cx.report(Problem::NotDivisible {
            what: "hidden",
            value: hidden,
            by_what: "heads",
            by: heads,
            span: span_of("hidden"),
            by_span: f.span("heads"),
            divisor_is_primary: false,
            options: vec![],
        });
        return None;
    }
    let spec = ModelSpec {
        name,
        arch,
        layers,
        hidden,
        heads,
        kv_heads: d.kv_heads.unwrap_or(heads),
        head_dim: d.head_dim.unwrap_or(hidden / heads),
        ffn,
        mlp,
        norm,
        positions: d.positions.unwrap_or(default_positions(arch)),
        vocab,
        max_positions,
        tie_embeddings: tie,
        experts: d.experts.unwrap_or(1),
        experts_per_token: d.experts_per_token.unwrap_or(1),
        dropout: d.dropout.unwrap_or(0.0),
        // A Hugging Face base keeps its numerics and checkpoint; an override
        // of its shape then makes the checkpoint not fit, reported at load.
        numerics: crate::spec::Numerics {
            linear_bias: d.bias,
            qk_norm: d.qk_norm.unwrap_or(false),
            ..base
                .as_ref()
                .map(|b| b.numerics.clone())
                .unwrap_or_default()
        },
        weights: base.as_ref().and_then(|b| b.weights.clone()),
    };
    for p in check_shape(&spec, &span_of) {
        cx.report(p);
    }
    cx.clean_since(mark).then_some(spec)
}

fn default_positions(arch: Arch) -> Positions {
    match arch {
        Arch::Decoder => Positions::Rope,
        Arch::Encoder => Positions::Learned,
    }
}

fn mlp_name(m: Mlp) -> &'static str {
    MLPS.iter().find(|(_, v)| *v == m).map_or("?", |(n, _)| n)
}

fn norm_name(n: Norm) -> &'static str {
    NORMS.iter().find(|(_, v)| *v == n).map_or("?", |(k, _)| k)
}

fn positions_name(p: Positions) -> &'static str {
    POSITIONS
        .iter()
        .find(|(_, v)| *v == p)
        .map_or("?", |(k, _)| k)
}

/// Upper bounds on model dimensions: 100x the largest real models, and low
/// enough that parameter and activation arithmetic cannot overflow `u64`.
fn max_of(key: &str) -> u64 {
    match key {
        "layers" => 1 << 16,
        "hidden" | "head_dim" => 1 << 20,
        "heads" | "kv_heads" | "experts" | "experts_per_token" => 1 << 16,
        "ffn" => 1 << 22,
        // Vocabulary and positions: 16M entries.
        _ => 1 << 24,
    }
}

fn read_u64(cx: &mut Cx, f: &Fields, key: &'static str, into: &mut Option<u64>) {
    if let Some(v) = f.get(key) {
        if let Some(x) = values::integer_in(cx, v, key, 1, max_of(key)) {
            *into = Some(x);
        }
    }
}

/// Shape constraints every model (preset, config or explicit) satisfies.
/// `span_of(key)` says where to point for a key.
pub(crate) fn check_shape(m: &ModelSpec, span_of: &dyn Fn(&str) -> Span) -> Vec<Problem> {
    let mut out = Vec::new();
    if m.kv_heads > m.heads {
        out.push(Problem::KvHeadsExceedHeads {
            kv_heads: m.kv_heads,
            heads: m.heads,
            span: span_of("kv_heads"),
        });
    } else if m.kv_heads == 0 || !m.heads.is_multiple_of(m.kv_heads) {
        out.push(Problem::NotDivisible {
            what: "heads",
            value: m.heads,
            by_what: "kv_heads",
            by: m.kv_heads,
            span: span_of("kv_heads"),
            by_span: None,
            divisor_is_primary: false,
            options: divisors(m.heads),
        });
    }
    if m.experts_per_token > m.experts {
        out.push(Problem::ExpertsPerToken {
            per_token: m.experts_per_token,
            experts: m.experts,
            span: span_of("experts_per_token"),
        });
    }
    out
}

/// All divisors of n, ascending (n is a head count: small).
pub(crate) fn divisors(n: u64) -> Vec<u64> {
    (1..=n.min(1 << 16))
        .filter(|d| n.is_multiple_of(*d))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_preset_satisfies_the_shape_constraints() {
        for e in &catalog::catalog().models {
            let problems = check_shape(&e.spec, &|_| Span::default());
            assert!(problems.is_empty(), "{}: {problems:?}", e.name);
            assert_eq!(e.spec.hidden % e.spec.heads, 0, "{}", e.name);
            assert!(
                e.spec.layers > 0 && e.spec.vocab > 0 && e.spec.ffn > 0,
                "{}",
                e.name
            );
        }
    }
}
