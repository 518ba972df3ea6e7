//! Reading typed values out of the generic syntax tree.
//!
//! The grammar types values only by their shape; here a slot (a key of a
//! section) says what it takes, and the readers convert: count suffixes
//! K/M/B/T to integers (powers of 1000), sizes to bytes (KB..TB powers of
//! 1000, KiB..TiB powers of 1024, a bare `B` is bytes), bandwidths to
//! bytes/s (`Gbps` are bits), percentages to fractions. Every reader returns
//! `None` after reporting exactly one problem, so callers just propagate.
//!
//! [`Fields`] reads a block: it reports unknown and duplicated keys once, up
//! front, and records the span of every key's value in the span table.

use super::problem::{Expected, NameKind, Problem, Range};
use super::spans::SpanTable;
use super::wording;
use super::ResolveContext;
use crate::spec::Choice;
use rcoa_grammar::{Block, Entry, Number, Span, Unit, Value, ValueKind};
use std::collections::BTreeMap;

/// The largest count any slot takes unless it says otherwise (4.3 billion):
/// far beyond any real job, and small enough that the products later stages
/// form (tokens × hidden × bytes, GPUs × ...) stay far from `u64` overflow.
pub(crate) const MAX_COUNT: u64 = 1 << 32;

/// The resolver's working state: the problems found so far and the spans of
/// what was read.
pub(crate) struct Cx<'a> {
    pub ctx: &'a ResolveContext,
    pub problems: Vec<Problem>,
    pub spans: SpanTable,
    /// Values the plan left out and resolve filled in: (`section.key = value`, why).
    pub defaults: Vec<(String, String)>,
}

impl<'a> Cx<'a> {
    pub(crate) fn new(ctx: &'a ResolveContext) -> Self {
        Cx {
            ctx,
            problems: Vec::new(),
            spans: SpanTable::default(),
            defaults: Vec::new(),
        }
    }

    pub(crate) fn report(&mut self, p: Problem) {
        self.problems.push(p);
    }

    /// The text of a span as written (empty if the span is not in the source).
    pub(crate) fn text(&self, span: Span) -> &str {
        self.ctx.source.get(span.start..span.end).unwrap_or("")
    }

    /// How many problems so far; compare before/after to know whether a section was clean.
    pub(crate) fn mark(&self) -> usize {
        self.problems.len()
    }

    pub(crate) fn clean_since(&self, mark: usize) -> bool {
        self.problems.len() == mark
    }
}

/// The entries of one block, keyed by their (known) names.
pub(crate) struct Fields<'a> {
    section: &'static str,
    header: Span,
    entries: BTreeMap<&'static str, &'a Entry>,
    /// Keys the unknown ones look like misspellings of (already reported).
    misspelt: Vec<String>,
}

impl<'a> Fields<'a> {
    /// Reads `block` (if any) of `section`; `path` prefixes span-table keys
    /// (`"train"`, `"hardware.gpu"`), `header` is where a missing key is reported.
    pub(crate) fn read(
        cx: &mut Cx,
        section: &'static str,
        path: &str,
        header: Span,
        block: Option<&'a Block>,
        allowed: &'static [&'static str],
    ) -> Self {
        let mut entries: BTreeMap<&'static str, &'a Entry> = BTreeMap::new();
        let mut misspelt = Vec::new();
        for e in block.map(|b| b.entries.as_slice()).unwrap_or(&[]) {
            let Some(key) = allowed.iter().copied().find(|k| *k == e.key.name) else {
                misspelt.extend(super::suggest::nearest(
                    &e.key.name,
                    allowed.iter().copied(),
                ));
                cx.report(Problem::UnknownKey {
                    section,
                    key: e.key.name.clone(),
                    span: e.key.span,
                    allowed,
                });
                continue;
            };
            if let Some(first) = entries.get(key) {
                cx.report(Problem::DuplicateKey {
                    key: key.to_string(),
                    first: first.key.span,
                    again: e.key.span,
                });
                continue;
            }
            cx.spans.insert(format!("{path}.{key}"), e.value.span);
            entries.insert(key, e);
        }
        Fields {
            section,
            header,
            entries,
            misspelt,
        }
    }

    pub(crate) fn get(&self, key: &str) -> Option<&'a Value> {
        self.entries.get(key).map(|e| &e.value)
    }

    /// The value of a key the section cannot do without. A missing key that
    /// an unknown key looks like a misspelling of is not reported again.
    pub(crate) fn require(&self, cx: &mut Cx, key: &'static str) -> Option<&'a Value> {
        let v = self.get(key);
        if v.is_none() && !self.misspelt.iter().any(|m| m == key) {
            cx.report(Problem::MissingKey {
                section: self.section,
                key,
                span: self.header,
            });
        }
        v
    }

    /// Where the key's value was written.
    pub(crate) fn span(&self, key: &str) -> Option<Span> {
        self.get(key).map(|v| v.span)
    }
}

pub(crate) fn wrong_kind(cx: &mut Cx, v: &Value, slot: &'static str, expected: Expected) {
    cx.report(Problem::WrongKind {
        slot,
        expected,
        found: wording::found(&v.kind),
        span: v.span,
    });
}

fn out_of_range(cx: &mut Cx, v: &Value, slot: &'static str, range: Range) {
    let text = cx.text(v.span).to_string();
    cx.report(Problem::OutOfRange {
        slot,
        text,
        range,
        span: v.span,
    });
}

/// A count: a number with no unit or a K/M/B/T suffix, scaled.
fn count(
    cx: &mut Cx,
    v: &Value,
    n: &Number,
    slot: &'static str,
    expected: Expected,
) -> Option<f64> {
    let scale = match n.unit {
        None => 1.0,
        Some(Unit::K) => 1e3,
        Some(Unit::M) => 1e6,
        Some(Unit::B) => 1e9,
        Some(Unit::T) => 1e12,
        Some(unit) => {
            cx.report(Problem::WrongUnit {
                slot,
                unit,
                expected,
                span: v.span,
            });
            return None;
        }
    };
    Some(n.value * scale)
}

/// A whole number of at least `min`.
pub(crate) fn integer(cx: &mut Cx, v: &Value, slot: &'static str, min: u64) -> Option<u64> {
    integer_in(cx, v, slot, min, MAX_COUNT)
}

/// A whole number in `lo..=hi`.
pub(crate) fn integer_in(
    cx: &mut Cx,
    v: &Value,
    slot: &'static str,
    lo: u64,
    hi: u64,
) -> Option<u64> {
    integer_as(cx, v, slot, lo, hi, Expected::Integer)
}

fn integer_as(
    cx: &mut Cx,
    v: &Value,
    slot: &'static str,
    lo: u64,
    hi: u64,
    expected: Expected,
) -> Option<u64> {
    let ValueKind::Number(n) = &v.kind else {
        wrong_kind(cx, v, slot, expected);
        return None;
    };
    let x = count(cx, v, n, slot, expected)?;
    if !x.is_finite() || x.fract() != 0.0 {
        let found = format!("`{}`", cx.text(v.span));
        cx.report(Problem::WrongKind {
            slot,
            expected,
            found,
            span: v.span,
        });
        return None;
    }
    if x < lo as f64 || x > hi as f64 {
        // Below the minimum, say the minimum; above the cap, say both ends.
        let range = if x < lo as f64 && hi == MAX_COUNT {
            Range::AtLeast(lo)
        } else {
            Range::Between(lo, hi)
        };
        out_of_range(cx, v, slot, range);
        return None;
    }
    Some(x as u64)
}

/// A whole number of at least `min`, or `auto`.
pub(crate) fn auto_integer(
    cx: &mut Cx,
    v: &Value,
    slot: &'static str,
    min: u64,
) -> Option<Choice<u64>> {
    auto_integer_in(cx, v, slot, min, MAX_COUNT)
}

pub(crate) fn auto_integer_in(
    cx: &mut Cx,
    v: &Value,
    slot: &'static str,
    lo: u64,
    hi: u64,
) -> Option<Choice<u64>> {
    if matches!(v.kind, ValueKind::Auto) {
        return Some(Choice::Auto);
    }
    integer_as(cx, v, slot, lo, hi, Expected::IntegerOrAuto).map(Choice::Fixed)
}

/// A plain real number within `range` (`Positive`, `NonNegative` or `UnitInterval`).
pub(crate) fn number(cx: &mut Cx, v: &Value, slot: &'static str, range: Range) -> Option<f64> {
    let x = match &v.kind {
        ValueKind::Number(n) if n.unit.is_none() => n.value,
        ValueKind::Number(n) if range == Range::UnitInterval && n.unit == Some(Unit::Percent) => {
            n.value / 100.0
        }
        ValueKind::Number(Number {
            unit: Some(unit), ..
        }) => {
            let expected = if range == Range::UnitInterval {
                Expected::Probability
            } else {
                Expected::Number
            };
            cx.report(Problem::WrongUnit {
                slot,
                unit: *unit,
                expected,
                span: v.span,
            });
            return None;
        }
        _ => {
            let expected = if range == Range::UnitInterval {
                Expected::Probability
            } else {
                Expected::Number
            };
            wrong_kind(cx, v, slot, expected);
            return None;
        }
    };
    let ok = x.is_finite()
        && match range {
            Range::Positive => x > 0.0,
            Range::NonNegative => x >= 0.0,
            Range::UnitInterval => (0.0..1.0).contains(&x),
            Range::Percent => x > 0.0 && x <= 1.0,
            Range::AtLeast(n) => x >= n as f64,
            Range::Between(lo, hi) => x >= lo as f64 && x <= hi as f64,
            Range::Bytes(n) => x >= n as f64,
        };
    if !ok {
        out_of_range(cx, v, slot, range);
        return None;
    }
    Some(x)
}

pub(crate) fn boolean(cx: &mut Cx, v: &Value, slot: &'static str) -> Option<bool> {
    match v.kind {
        ValueKind::Bool(b) => Some(b),
        _ => {
            wrong_kind(cx, v, slot, Expected::Bool);
            None
        }
    }
}

pub(crate) fn auto_bool(cx: &mut Cx, v: &Value, slot: &'static str) -> Option<Choice<bool>> {
    match v.kind {
        ValueKind::Bool(b) => Some(Choice::Fixed(b)),
        ValueKind::Auto => Some(Choice::Auto),
        _ => {
            wrong_kind(cx, v, slot, Expected::BoolOrAuto);
            None
        }
    }
}

fn size_scale(unit: Unit) -> Option<f64> {
    Some(match unit {
        Unit::B => 1.0,
        Unit::KB => 1e3,
        Unit::MB => 1e6,
        Unit::GB => 1e9,
        Unit::TB => 1e12,
        Unit::KiB => 1024.0,
        Unit::MiB => 1024.0 * 1024.0,
        Unit::GiB => 1024.0 * 1024.0 * 1024.0,
        Unit::TiB => 1024.0 * 1024.0 * 1024.0 * 1024.0,
        _ => return None,
    })
}

/// A size in bytes (rounded to a whole byte), at least `min`.
pub(crate) fn size(cx: &mut Cx, v: &Value, slot: &'static str, min: u64) -> Option<u64> {
    size_as(cx, v, slot, min, Expected::Size)
}

fn size_as(
    cx: &mut Cx,
    v: &Value,
    slot: &'static str,
    min: u64,
    expected: Expected,
) -> Option<u64> {
    let ValueKind::Number(n) = &v.kind else {
        wrong_kind(cx, v, slot, expected);
        return None;
    };
    let Some(unit) = n.unit else {
        wrong_kind(cx, v, slot, expected);
        return None;
    };
    let Some(scale) = size_scale(unit) else {
        cx.report(Problem::WrongUnit {
            slot,
            unit,
            expected,
            span: v.span,
        });
        return None;
    };
    let bytes = (n.value * scale).round();
    // 2^62 bytes (4 EiB) is far beyond any device or host.
    if !bytes.is_finite() || bytes < min as f64 || bytes > (1u64 << 62) as f64 {
        out_of_range(cx, v, slot, Range::Bytes(min));
        return None;
    }
    Some(bytes as u64)
}

/// A budget: bytes, or a share of GPU memory in (0 %, 100 %].
pub(crate) fn budget(cx: &mut Cx, v: &Value, slot: &'static str) -> Option<crate::spec::Budget> {
    use crate::spec::Budget;
    match &v.kind {
        ValueKind::Number(Number {
            unit: Some(Unit::Percent),
            value,
            ..
        }) => {
            let f = value / 100.0;
            if !(f.is_finite() && f > 0.0 && f <= 1.0) {
                out_of_range(cx, v, slot, Range::Percent);
                return None;
            }
            Some(Budget::Fraction(f))
        }
        _ => size_as(cx, v, slot, 1, Expected::SizeOrPercent).map(Budget::Bytes),
    }
}

/// A bandwidth in bytes/s.
pub(crate) fn bandwidth(cx: &mut Cx, v: &Value, slot: &'static str) -> Option<f64> {
    let ValueKind::Number(n) = &v.kind else {
        wrong_kind(cx, v, slot, Expected::Bandwidth);
        return None;
    };
    let scale = match n.unit {
        Some(Unit::Mbps) => 1e6 / 8.0,
        Some(Unit::Gbps) => 1e9 / 8.0,
        Some(Unit::Tbps) => 1e12 / 8.0,
        Some(Unit::MBps) => 1e6,
        Some(Unit::GBps) => 1e9,
        Some(Unit::TBps) => 1e12,
        None => {
            wrong_kind(cx, v, slot, Expected::Bandwidth);
            return None;
        }
        Some(unit) => {
            cx.report(Problem::WrongUnit {
                slot,
                unit,
                expected: Expected::Bandwidth,
                span: v.span,
            });
            return None;
        }
    };
    let x = n.value * scale;
    if !(x.is_finite() && x > 0.0) {
        out_of_range(cx, v, slot, Range::Positive);
        return None;
    }
    Some(x)
}

/// The text of a name written as an identifier or a string.
pub(crate) fn name_of(v: &Value) -> Option<&str> {
    match &v.kind {
        ValueKind::Ident(s) | ValueKind::Str(s) => Some(s),
        _ => None,
    }
}

/// One of a fixed set of names.
pub(crate) fn pick<T: Copy>(
    cx: &mut Cx,
    v: &Value,
    slot: &'static str,
    kind: NameKind,
    options: &[(&'static str, T)],
) -> Option<T> {
    let Some(name) = name_of(v) else {
        wrong_kind(cx, v, slot, Expected::Name);
        return None;
    };
    if let Some((_, t)) = options.iter().find(|(n, _)| *n == name) {
        return Some(*t);
    }
    cx.report(Problem::UnknownName {
        kind,
        slot,
        name: name.to_string(),
        span: v.span,
        choices: options.iter().map(|(n, _)| n.to_string()).collect(),
    });
    None
}

/// `(a, b)`, each a number in `range`.
pub(crate) fn pair(cx: &mut Cx, v: &Value, slot: &'static str, range: Range) -> Option<(f64, f64)> {
    match &v.kind {
        ValueKind::Tuple(items) if items.len() == 2 => {
            let a = number(cx, &items[0], slot, range);
            let b = number(cx, &items[1], slot, range);
            Some((a?, b?))
        }
        _ => {
            wrong_kind(cx, v, slot, Expected::Pair);
            None
        }
    }
}
