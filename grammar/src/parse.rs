//! From text to [`PlanFile`]: pest does the recognising, this module builds
//! the tree and, on failure, works out which mistake was made.
//!
//! Order of work in [`parse`]: a structural pre-scan (strings closed, escapes
//! valid, brackets balanced, nesting bounded) runs first, because pest would
//! only notice an unclosed `{` at the end of the file, far from the cause;
//! then pest parses; then pairs become AST nodes. Each AST node's span is
//! exactly its pest pair's span (no surrounding whitespace).
//!
//! Invariant: no input makes this module panic — bad input is a
//! [`ParseError`].

use crate::ast::*;
use crate::error::{Expected, ParseError, SyntaxError};
use crate::lex::{self, Structural, Tok, Token};
use pest::iterators::Pair;
use pest::Parser as _;

#[derive(pest_derive::Parser)]
#[grammar = "plan.pest"]
struct PlanParser;

/// Decodes a file's bytes, or says where the first invalid byte is.
pub fn decode_utf8<'b>(name: &str, bytes: &'b [u8]) -> Result<&'b str, ParseError> {
    std::str::from_utf8(bytes).map_err(|e| {
        let at = e.valid_up_to();
        // The lossy text is identical up to `at`, where U+FFFD (3 bytes)
        // stands for the bad sequence: label that.
        let text = String::from_utf8_lossy(bytes);
        ParseError::new(
            name,
            &text,
            SyntaxError::InvalidUtf8 {
                at: Span::new(at, at + '\u{FFFD}'.len_utf8()),
                byte: bytes.get(at).copied().unwrap_or(0),
            },
        )
    })
}

/// Parses a `.plan` file. `name` is used in diagnostics only.
pub fn parse(name: &str, source: &str) -> Result<PlanFile, ParseError> {
    parse_inner(source).map_err(|e| ParseError::new(name, source, e))
}

fn parse_inner(source: &str) -> Result<PlanFile, SyntaxError> {
    let toks = lex::tokens(source);
    if let Some(s) = lex::prescan(source, &toks) {
        return Err(structural(source, s));
    }
    // Detail on: pest ≥ 2.7.10 otherwise keeps too little to explain errors.
    pest::set_error_detail(true);
    let mut pairs = match PlanParser::parse(Rule::file, source) {
        Ok(p) => p,
        Err(e) => return Err(diagnose(source, &toks, &e)),
    };
    let Some(file) = pairs.next() else {
        return Ok(PlanFile {
            sections: Vec::new(),
            comments: Vec::new(),
        });
    };
    let comments = file
        .clone()
        .into_inner()
        .flatten()
        .filter(|p| p.as_rule() == Rule::COMMENT)
        .map(|p| Comment {
            text: p.as_str().get(1..).unwrap_or("").to_string(),
            span: span(&p),
        })
        .collect();
    let sections = inner(file)
        .filter(|p| p.as_rule() == Rule::section)
        .map(section)
        .collect::<Result<_, _>>()?;
    Ok(PlanFile { sections, comments })
}

fn structural(source: &str, s: Structural) -> SyntaxError {
    match s {
        Structural::UnterminatedString { open } => SyntaxError::UnterminatedString { open },
        Structural::InvalidEscape { at } => SyntaxError::InvalidEscape {
            at,
            text: source.get(at.start..at.end).unwrap_or("\\").to_string(),
        },
        Structural::Unclosed {
            open,
            delim,
            next_section,
            eof,
        } => SyntaxError::UnclosedDelimiter {
            open,
            delim,
            next_section,
            eof,
        },
        Structural::Mismatched {
            open,
            open_delim,
            close,
            close_delim,
        } => SyntaxError::MismatchedDelimiter {
            open,
            open_delim,
            close,
            close_delim,
        },
        Structural::UnmatchedClose { close, delim } => SyntaxError::UnmatchedClose { close, delim },
        Structural::TooDeep { at } => SyntaxError::TooDeep {
            at,
            limit: lex::MAX_DEPTH,
        },
    }
}

// ---------------------------------------------------------------------------
// Pairs → AST

fn span(p: &Pair<'_, Rule>) -> Span {
    let s = p.as_span();
    Span::new(s.start(), s.end())
}

/// Children without comments (comments are collected separately).
fn inner<'i>(p: Pair<'i, Rule>) -> impl Iterator<Item = Pair<'i, Rule>> {
    p.into_inner().filter(|c| c.as_rule() != Rule::COMMENT)
}

fn ident(p: Pair<'_, Rule>) -> Ident {
    Ident {
        name: p.as_str().to_string(),
        span: span(&p),
    }
}

fn section(p: Pair<'_, Rule>) -> Result<Section, SyntaxError> {
    let sp = span(&p);
    let mut name = None;
    let mut args = Vec::new();
    let mut body = None;
    for c in inner(p) {
        match c.as_rule() {
            Rule::ident => name = Some(ident(c)),
            Rule::arg => args.push(value(c)?),
            Rule::block => body = Some(block(c)?),
            _ => {}
        }
    }
    let name = name.unwrap_or(Ident {
        name: String::new(),
        span: Span::new(sp.start, sp.start),
    });
    // pest's pair may end with the spaces or comment skipped before an
    // absent block; the section ends at its last real token.
    let end = body
        .as_ref()
        .map(|b| b.span.end)
        .or(args.last().map(|a| a.span.end))
        .unwrap_or(name.span.end);
    let span = Span::new(name.span.start, end);
    Ok(Section {
        name,
        args,
        body,
        span,
    })
}

fn block(p: Pair<'_, Rule>) -> Result<Block, SyntaxError> {
    let sp = span(&p);
    let entries = inner(p)
        .filter(|c| c.as_rule() == Rule::entry)
        .map(entry)
        .collect::<Result<_, _>>()?;
    Ok(Block { entries, span: sp })
}

fn entry(p: Pair<'_, Rule>) -> Result<Entry, SyntaxError> {
    let sp = span(&p);
    let mut key = None;
    let mut val = None;
    for c in inner(p) {
        match c.as_rule() {
            Rule::ident => key = Some(ident(c)),
            Rule::value => val = Some(value(c)?),
            Rule::block => {
                let s = span(&c);
                val = Some(Value {
                    kind: ValueKind::Block(block(c)?),
                    span: s,
                });
            }
            _ => {}
        }
    }
    // The grammar guarantees both; fall back to empty nodes, not a panic.
    let key = key.unwrap_or(Ident {
        name: String::new(),
        span: Span::new(sp.start, sp.start),
    });
    let value = val.unwrap_or(Value {
        kind: ValueKind::Auto,
        span: Span::new(sp.end, sp.end),
    });
    Ok(Entry {
        key,
        value,
        span: sp,
    })
}

/// Converts `value`/`arg` wrappers and the concrete value rules.
fn value(p: Pair<'_, Rule>) -> Result<Value, SyntaxError> {
    let sp = span(&p);
    let kind = match p.as_rule() {
        Rule::value | Rule::arg => {
            return match inner(p).next() {
                Some(c) => value(c),
                None => Ok(Value {
                    kind: ValueKind::Auto,
                    span: sp,
                }),
            }
        }
        Rule::block => ValueKind::Block(block(p)?),
        Rule::list => ValueKind::List(items(p)?),
        Rule::tuple => ValueKind::Tuple(items(p)?),
        Rule::every => {
            let operand = inner(p).find(|c| c.as_rule() != Rule::kw_every);
            match operand {
                Some(c) => {
                    // Trailing spaces before the `!eq` lookahead are inside
                    // the pair; end the span at the operand.
                    let v = value(c)?;
                    let span = Span::new(sp.start, v.span.end);
                    return Ok(Value {
                        kind: ValueKind::Every(Box::new(v)),
                        span,
                    });
                }
                None => ValueKind::Ident("every".into()),
            }
        }
        Rule::string => {
            let body = inner(p).next().map(|b| b.as_str()).unwrap_or("");
            ValueKind::Str(unescape(body))
        }
        Rule::number => ValueKind::Number(number(p)?),
        Rule::auto => ValueKind::Auto,
        Rule::boolean => ValueKind::Bool(p.as_str() == "true"),
        Rule::placed => {
            let mut parts = inner(p).map(ident);
            match (parts.next(), parts.next()) {
                (Some(what), Some(place)) => ValueKind::Placed { what, place },
                _ => ValueKind::Ident(String::new()),
            }
        }
        _ => ValueKind::Ident(p.as_str().to_string()),
    };
    Ok(Value { kind, span: sp })
}

fn items(p: Pair<'_, Rule>) -> Result<Vec<Value>, SyntaxError> {
    inner(p)
        .filter(|c| c.as_rule() == Rule::value)
        .map(value)
        .collect()
}

/// Decodes `\"` and `\\` (the grammar admits no other escape).
fn unescape(body: &str) -> String {
    let mut out = String::with_capacity(body.len());
    let mut chars = body.chars();
    while let Some(c) = chars.next() {
        if c == '\\' {
            if let Some(n) = chars.next() {
                out.push(n);
            }
        } else {
            out.push(c);
        }
    }
    out
}

fn number(p: Pair<'_, Rule>) -> Result<Number, SyntaxError> {
    let sp = span(&p);
    let mut text = String::new();
    let mut unit = None;
    for c in inner(p) {
        match c.as_rule() {
            Rule::num_lit => text = c.as_str().to_string(),
            Rule::unit | Rule::suffix => unit = unit_of(c.as_str()),
            _ => {}
        }
    }
    let digits: String = text.chars().filter(|&c| c != '_').collect();
    let value: f64 = match digits.parse() {
        Ok(v) if f64::is_finite(v) => v,
        _ => return Err(SyntaxError::NumberOutOfRange { at: sp }),
    };
    let integer = !text.contains(['.', 'e', 'E']);
    Ok(Number {
        value,
        text,
        integer,
        unit,
    })
}

/// The unit spelled exactly `s`, if any.
pub(crate) fn unit_of(s: &str) -> Option<Unit> {
    ALL_UNITS.iter().copied().find(|u| u.as_str() == s)
}

pub(crate) const ALL_UNITS: [Unit; 19] = [
    Unit::K,
    Unit::M,
    Unit::B,
    Unit::T,
    Unit::KB,
    Unit::MB,
    Unit::GB,
    Unit::TB,
    Unit::KiB,
    Unit::MiB,
    Unit::GiB,
    Unit::TiB,
    Unit::Percent,
    Unit::Gbps,
    Unit::Mbps,
    Unit::Tbps,
    Unit::MBps,
    Unit::GBps,
    Unit::TBps,
];

// ---------------------------------------------------------------------------
// Failure → SyntaxError

/// Turns pest's failure into the most specific [`SyntaxError`] we can name.
///
/// pest says where it stopped and which rules it tried there; the tokens
/// around that point say what the writer probably meant. Checks go from the
/// most specific shape to the generic fallback.
fn diagnose(source: &str, toks: &[Token], err: &pest::error::Error<Rule>) -> SyntaxError {
    let pos = match err.location {
        pest::error::InputLocation::Pos(p) => p,
        pest::error::InputLocation::Span((s, _)) => s,
    };
    let positives: &[Rule] = match &err.variant {
        pest::error::ErrorVariant::ParsingError { positives, .. } => positives,
        pest::error::ErrorVariant::CustomError { .. } => &[],
    };
    let tried = |r: Rule| positives.contains(&r);
    let idx = toks
        .iter()
        .position(|t| t.span.end > pos)
        .unwrap_or(toks.len());
    let tok_at = |i: usize| toks.get(i);
    let text = |t: &Token| t.text(source).to_string();
    let (found, found_text) = match tok_at(idx) {
        Some(t) if t.tok == Tok::Newline => (Span::new(t.span.start, t.span.start), text(t)),
        Some(t) => (t.span, text(t)),
        None => (Span::new(source.len(), source.len()), String::new()),
    };
    let prev = idx.checked_sub(1).and_then(tok_at);
    let prev_is_number = prev.is_some_and(|t| t.tok == Tok::Number);
    let context = lex::enclosing(toks, found.start);

    if let Some(e) = per_second_unit(source, toks, idx) {
        return e;
    }
    match tok_at(idx).map(|t| &t.tok) {
        Some(Tok::Other(ch)) => return SyntaxError::UnexpectedCharacter { at: found, ch: *ch },
        // pest stopped inside a number (`1_`), or a number is followed by
        // something that continues it wrongly (`1.`, `2e`, `1.5.3`).
        Some(Tok::Number) if pos > found.start => {
            let end = toks
                .get(idx + 1)
                .filter(|t| t.tok == (Tok::Word { glued: true }))
                .map_or(found.end, |t| t.span.end);
            let at = Span::new(found.start, end);
            return SyntaxError::MalformedNumber {
                at,
                text: source.get(at.start..at.end).unwrap_or("").to_string(),
            };
        }
        Some(Tok::Word { glued: true }) if continues_number(&found_text) => {
            let start = prev.map_or(found.start, |t| t.span.start);
            let at = Span::new(start, found.end);
            return SyntaxError::MalformedNumber {
                at,
                text: source.get(at.start..at.end).unwrap_or("").to_string(),
            };
        }
        Some(Tok::Word { glued: true }) => {
            return SyntaxError::UnknownUnit {
                at: found,
                suggestion: unit_like(&found_text),
                word: found_text,
            }
        }
        Some(Tok::Word { glued: false })
            if found_text.starts_with(|c: char| c.is_ascii_uppercase()) =>
        {
            if prev_is_number {
                if matches!(found_text.as_str(), "K" | "M" | "T") {
                    let number = prev.map(text).unwrap_or_default();
                    return SyntaxError::DetachedSuffix {
                        at: found,
                        number,
                        suffix: found_text,
                    };
                }
                return SyntaxError::UnknownUnit {
                    at: found,
                    suggestion: unit_like(&found_text),
                    word: found_text,
                };
            }
            if unit_of(&found_text).is_some() {
                return SyntaxError::UnitWithoutNumber {
                    at: found,
                    unit: found_text,
                };
            }
            return SyntaxError::UppercaseName {
                at: found,
                word: found_text,
            };
        }
        Some(Tok::Punct('%')) if !prev_is_number => {
            return SyntaxError::UnitWithoutNumber {
                at: found,
                unit: found_text,
            }
        }
        _ => {}
    }

    if tried(Rule::eq) {
        // pest read a key and wants `=`. If that "key" is a lower-case unit
        // after a number (`40 gib`), the real mistake is the unit's case.
        if let Some(key) = prev.filter(|t| matches!(t.tok, Tok::Word { .. })) {
            let key_text = text(key);
            let before = idx.checked_sub(2).and_then(tok_at);
            if before.is_some_and(|t| t.tok == Tok::Number) {
                if let Some(u) = unit_like(&key_text) {
                    return SyntaxError::UnknownUnit {
                        at: key.span,
                        word: key_text,
                        suggestion: Some(u),
                    };
                }
            }
            return SyntaxError::ExpectedEquals {
                key: key.span,
                key_text,
                found,
                found_text,
            };
        }
    }

    if tried(Rule::value) {
        if let Some(eq) = prev.filter(|t| t.tok == Tok::Punct('=')) {
            let key_text = idx
                .checked_sub(2)
                .and_then(tok_at)
                .filter(|t| matches!(t.tok, Tok::Word { .. }))
                .map(text);
            return SyntaxError::ExpectedValue {
                eq: eq.span,
                key_text,
                found,
            };
        }
    }

    if context.is_none() {
        if found_text == "=" {
            let key = prev
                .filter(|t| matches!(t.tok, Tok::Word { .. }))
                .map(|t| (t.span, text(t)));
            return SyntaxError::EntryOutsideBlock { eq: found, key };
        }
        let line_start = prev.is_none_or(|t| t.tok == Tok::Newline || t.tok == Tok::Punct('}'));
        if line_start {
            // `model` NEWLINE `"llama-3.1-8b"`: an argument that wandered
            // onto the next line after a lone section name.
            let lone_name = idx
                .checked_sub(2)
                .and_then(tok_at)
                .filter(|t| matches!(t.tok, Tok::Word { glued: false }))
                .filter(|_| idx < 3 || tok_at(idx - 3).is_some_and(|t| t.tok == Tok::Newline))
                .filter(|_| prev.is_some_and(|t| t.tok == Tok::Newline))
                .filter(|_| found_text != "=")
                .map(text);
            return SyntaxError::ExpectedSectionName {
                found,
                found_text,
                after_name: lone_name,
            };
        }
    }

    if context == Some('{') && tried(Rule::ident) {
        let entry_start =
            prev.is_none_or(|t| matches!(t.tok, Tok::Newline | Tok::Punct('{') | Tok::Punct(',')));
        if entry_start && found_text != "}" {
            return SyntaxError::ExpectedKey { found, found_text };
        }
        let value_like = tok_at(idx).is_some_and(|t| {
            matches!(
                t.tok,
                Tok::Str { .. } | Tok::Number | Tok::Punct('[') | Tok::Punct('(')
            )
        });
        if value_like {
            return SyntaxError::ExtraValue { found, found_text };
        }
    }
    let at_line_start = prev.is_none_or(|t| t.tok == Tok::Newline || t.tok == Tok::Punct('}'));

    let mut expected: Vec<Expected> = positives
        .iter()
        .filter_map(|r| match r {
            Rule::ident if context.is_none() && at_line_start => Some(Expected::SectionName),
            Rule::ident if context == Some('{') => Some(Expected::Key),
            Rule::ident | Rule::value | Rule::arg => Some(Expected::Value),
            Rule::eq => Some(Expected::Equals),
            Rule::block => Some(Expected::BlockStart),
            Rule::unit | Rule::suffix => Some(Expected::Unit),
            Rule::EOI => Some(Expected::LineEnd),
            _ => None,
        })
        .collect();
    match context {
        Some('{') => expected.push(Expected::BlockEnd),
        Some('[') => expected.push(Expected::ListEnd),
        Some('(') => expected.push(Expected::TupleEnd),
        _ => {}
    }
    // A unit is never what the writer missed when something else fits.
    if expected.len() > 1 {
        expected.retain(|e| *e != Expected::Unit);
    }
    expected.sort();
    expected.dedup();
    SyntaxError::UnexpectedToken {
        found,
        found_text,
        expected,
    }
}

/// Whether a word glued to a number reads as a broken continuation of the
/// number rather than a unit: `.`, `_`, `.5`, `e`, `E+`.
fn continues_number(word: &str) -> bool {
    let starts_odd = word.starts_with(['.', '_', '-']);
    let bare_exponent = matches!(word, "e" | "E");
    starts_odd || bare_exponent
}

/// `40 GiB/s`, `5 KB/s`, `10 gb/s`, `7 Mb/s`: a number, a word and `/s`
/// where pest stopped at the `/` (the word taken as a size unit, or as the
/// next key) or at the word. The rate is one unknown unit, not a stray `/`.
fn per_second_unit(source: &str, toks: &[Token], idx: usize) -> Option<SyntaxError> {
    let tok = |i: usize, is: fn(&Tok) -> bool| toks.get(i).filter(|t| is(&t.tok));
    let is_slash = |t: &Tok| *t == Tok::Punct('/');
    let is_word = |t: &Tok| matches!(t, Tok::Word { .. });
    let slash = if tok(idx + 1, is_slash).is_some() {
        idx + 1
    } else {
        idx
    };
    tok(slash, is_slash)?;
    tok(slash.checked_sub(2)?, |t| *t == Tok::Number)?;
    let word = tok(slash - 1, is_word)?;
    let per = tok(slash + 1, is_word)?;
    let at = Span::new(word.span.start, per.span.end);
    let text = source.get(at.start..at.end)?.to_string();
    // A lower-case `b` is a bit: `Gb/s` is `Gbps`, not `GB/s` (8 x more).
    let bits = text
        .strip_suffix("b/s")
        .and_then(|prefix| unit_of(&format!("{prefix}bps")))
        .map(|u| u.as_str());
    Some(SyntaxError::UnknownUnit {
        at,
        suggestion: bits.or_else(|| unit_like(&text)),
        word: text,
    })
}

/// The unit a wrongly-cased word stands for (`gib` → `GiB`), if any.
fn unit_like(word: &str) -> Option<&'static str> {
    ALL_UNITS
        .iter()
        .map(|u| u.as_str())
        .find(|u| u.eq_ignore_ascii_case(word))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok(src: &str) -> PlanFile {
        match parse("t.plan", src) {
            Ok(f) => f,
            Err(e) => panic!("{src:?} failed: {} ({})", e, e.code_str()),
        }
    }

    fn one_value(src: &str) -> ValueKind {
        let f = ok(&format!("s {{ k = {src} }}"));
        f.sections[0].body.as_ref().unwrap().entries[0]
            .value
            .kind
            .clone()
    }

    fn num(src: &str) -> Number {
        match one_value(src) {
            ValueKind::Number(n) => n,
            other => panic!("{src}: {other:?}"),
        }
    }

    #[test]
    fn numbers_and_units() {
        let n = num("42");
        assert_eq!(
            (n.value, n.integer, n.unit, n.text.as_str()),
            (42.0, true, None, "42")
        );
        let n = num("1_000");
        assert_eq!((n.value, n.text.as_str()), (1000.0, "1_000"));
        let n = num("2e-5");
        assert_eq!((n.value, n.integer), (2e-5, false));
        assert_eq!(num("0.95").value, 0.95);
        assert_eq!(num("-3").value, -3.0);
        assert_eq!(num("8B").unit, Some(Unit::B));
        assert_eq!(num("128K").unit, Some(Unit::K));
        assert_eq!(num("7M").unit, Some(Unit::M));
        assert_eq!(num("2T").unit, Some(Unit::T));
        assert_eq!(num("40 GiB").unit, Some(Unit::GiB));
        assert_eq!(num("80GB").unit, Some(Unit::GB));
        assert_eq!(num("8 B").unit, Some(Unit::B));
        for u in ["KB", "MB", "TB", "KiB", "MiB", "TiB"] {
            assert_eq!(num(&format!("3 {u}")).unit.map(Unit::as_str), Some(u));
        }
        assert_eq!(num("90%").unit, Some(Unit::Percent));
        for u in ["Gbps", "Mbps", "Tbps", "GB/s", "MB/s", "TB/s"] {
            assert_eq!(num(&format!("400 {u}")).unit.map(Unit::as_str), Some(u));
            assert_eq!(num(&format!("400{u}")).unit.map(Unit::as_str), Some(u));
        }
    }

    #[test]
    fn count_suffix_must_touch() {
        assert!(parse("t", "s { k = 128 K }").is_err());
        assert!(parse("t", "s { k = 8x }").is_err());
        assert!(parse("t", "s { k = 40 GiBx }").is_err());
    }

    #[test]
    fn scalar_values() {
        assert_eq!(one_value("auto"), ValueKind::Auto);
        assert_eq!(one_value("true"), ValueKind::Bool(true));
        assert_eq!(one_value("false"), ValueKind::Bool(false));
        assert_eq!(one_value("autox"), ValueKind::Ident("autox".into()));
        assert_eq!(
            one_value("llama-3.1-8b"),
            ValueKind::Ident("llama-3.1-8b".into())
        );
        assert_eq!(one_value(r#""a\"b\\c""#), ValueKind::Str("a\"b\\c".into()));
        match one_value("optimizer:cpu") {
            ValueKind::Placed { what, place } => assert_eq!(
                (what.name.as_str(), place.name.as_str()),
                ("optimizer", "cpu")
            ),
            other => panic!("{other:?}"),
        }
        match one_value("every 2") {
            ValueKind::Every(v) => assert!(matches!(v.kind, ValueKind::Number(_))),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn every_does_not_swallow_a_key() {
        let src = "s { a = every 2  # c\n every = 2 }";
        let f = ok(src);
        let v = &f.sections[0].body.as_ref().unwrap().entries[0].value;
        assert_eq!(&src[v.span.start..v.span.end], "every 2");
        let f = ok("s { a = every\n every = 2 }");
        let e = &f.sections[0].body.as_ref().unwrap().entries;
        assert_eq!(e.len(), 2);
        assert_eq!(e[0].value.kind, ValueKind::Ident("every".into()));
        assert_eq!(e[1].key.name, "every");
    }

    #[test]
    fn lists_tuples_blocks() {
        match one_value("[q, k, v, o]") {
            ValueKind::List(v) => assert_eq!(v.len(), 4),
            other => panic!("{other:?}"),
        }
        match one_value("[a b\n c,]") {
            ValueKind::List(v) => assert_eq!(v.len(), 3),
            other => panic!("{other:?}"),
        }
        assert_eq!(one_value("[]"), ValueKind::List(vec![]));
        match one_value("(0.9, 0.95)") {
            ValueKind::Tuple(v) => assert_eq!(v.len(), 2),
            other => panic!("{other:?}"),
        }
        assert!(parse("t", "s { k = [a,,b] }").is_err());
        let f = ok("hardware { gpu { memory = 48 GiB  bf16_tflops = 362  bandwidth = 864 GB/s } }");
        let e = &f.sections[0].body.as_ref().unwrap().entries[0];
        match &e.value.kind {
            ValueKind::Block(b) => assert_eq!(b.entries.len(), 3),
            other => panic!("{other:?}"),
        }
        let g = ok("hardware { gpu = { memory = 48 GiB } }");
        assert!(matches!(
            g.sections[0].body.as_ref().unwrap().entries[0].value.kind,
            ValueKind::Block(_)
        ));
    }

    #[test]
    fn sections_and_lines() {
        let f = ok("precision bf16\noptimizer adamw\nmodel hf \"config.json\"\ntarget pytorch\nmodel { layers = 2 }");
        let names: Vec<_> = f.sections.iter().map(|s| s.name.name.as_str()).collect();
        assert_eq!(
            names,
            ["precision", "optimizer", "model", "target", "model"]
        );
        assert_eq!(f.sections[0].args.len(), 1);
        assert_eq!(f.sections[2].args.len(), 2);
        assert!(f.sections[4].body.is_some());
        let f = ok("optimizer adamw { lr = 2e-5, betas = (0.9, 0.95) }");
        assert_eq!(f.sections[0].args[0].kind, ValueKind::Ident("adamw".into()));
        assert_eq!(f.sections[0].body.as_ref().unwrap().entries.len(), 2);
        // A block may start on the line after the name.
        let f = ok("train\n{\n seq_len = 1\n}\n");
        assert!(f.sections[0].body.is_some());
        // Unknown names are not parse errors.
        ok("bogus_section whatever { nonsense_key = 1 }");
    }

    #[test]
    fn spans_and_comments() {
        let src = "# head\nmodel \"x\" # tail\ntrain { seq_len = 2048 } # t2\n";
        let f = ok(src);
        assert_eq!(f.comments.len(), 3);
        assert_eq!(f.comments[0].text, " head");
        assert_eq!(
            &src[f.comments[1].span.start..f.comments[1].span.end],
            "# tail"
        );
        let s = &f.sections[0];
        assert_eq!(&src[s.span.start..s.span.end], "model \"x\"");
        let t = &f.sections[1];
        assert_eq!(&src[t.span.start..t.span.end], "train { seq_len = 2048 }");
        let e = &t.body.as_ref().unwrap().entries[0];
        assert_eq!(&src[e.span.start..e.span.end], "seq_len = 2048");
        assert_eq!(&src[e.value.span.start..e.value.span.end], "2048");
    }

    #[test]
    fn codes_for_common_mistakes() {
        for (src, code) in [
            ("t { a = \"x\" \"y\" }", "rcoa::syntax::extra_value"),
            ("t { a = 1 2 }", "rcoa::syntax::extra_value"),
            ("t { a: 1 }", "rcoa::syntax::expected_equals"),
            ("model: \"x\"", "rcoa::syntax::unexpected_token"),
            ("t { a = 4 KIB }", "rcoa::syntax::unknown_unit"),
            ("t { , }", "rcoa::syntax::expected_key"),
            ("x = 1", "rcoa::syntax::entry_outside_block"),
        ] {
            let e = parse("t", src).unwrap_err();
            assert_eq!(e.code_str(), code, "{src}: {e}");
        }
        let e = parse("t", "model: \"x\"").unwrap_err();
        assert!(!e.to_string().contains("section name"), "{e}");
    }

    /// The deepest nesting the pre-scan allows must parse without
    /// exhausting a test thread's stack (debug build, 2 MiB).
    #[test]
    fn deepest_allowed_nesting_parses() {
        let depth = lex::MAX_DEPTH - 1; // one level is the block itself
        let src = format!("s {{ k = {}1{} }}", "[".repeat(depth), "]".repeat(depth));
        let f = ok(&src);
        let _ = crate::format(&f, &src);
        let src = format!(
            "s {{ k = {}1{} }}",
            "[".repeat(depth + 1),
            "]".repeat(depth + 1)
        );
        assert_eq!(
            parse("t", &src).unwrap_err().code_str(),
            "rcoa::syntax::too_deep"
        );
    }

    /// Regression: a recursive `every` operand made failing input like
    /// this take 2^depth steps (20 levels: 10 s).
    #[test]
    fn nested_every_is_not_exponential() {
        let n = 60;
        let src = format!("s {{ k = {}x ={} }}", "every [".repeat(n), "]".repeat(n));
        let start = std::time::Instant::now();
        assert!(parse("t", &src).is_err());
        assert!(
            start.elapsed() < std::time::Duration::from_secs(2),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn malformed_numbers() {
        for bad in ["1.", "1_", "2e", "1.5.3", "3e+"] {
            let e = parse("t", &format!("s {{ k = {bad} }}")).unwrap_err();
            assert_eq!(e.code_str(), "rcoa::syntax::malformed_number", "{bad}");
        }
    }

    #[test]
    fn empty_and_blank_files() {
        assert!(ok("").sections.is_empty());
        assert!(ok("\n\n  # only a comment\r\n").sections.is_empty());
        ok("\u{FEFF}model \"x\"");
    }

    #[test]
    fn decode_utf8_locates_bad_bytes() {
        let e = decode_utf8("t", b"model \"\xff\"").unwrap_err();
        assert_eq!(e.code_str(), "rcoa::invalid_utf8");
        assert_eq!(e.span().start, 7);
        assert_eq!(decode_utf8("t", b"ok").unwrap(), "ok");
    }

    /// Every ```plan block of docs/language.md parses (fragments included).
    #[test]
    fn language_md_examples_parse() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/language.md");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let blocks = crate::testutil::plan_blocks(&text);
        assert!(!blocks.is_empty());
        for b in blocks {
            ok(&b);
        }
        // Inline examples in backticks that are whole sections.
        for ex in [
            "adapter lora { rank = 32  alpha = 64  targets = [q, k, v, o, gate, up, down]  dropout = 0.05 }",
            "hardware { gpu { memory = 48 GiB  bf16_tflops = 362  bandwidth = 864 GB/s } }",
            "precision bf16",
            "model hf \"path/to/config.json\"",
            "fit { checkpoint = every 2  offload = [optimizer:cpu, params:nvme]  budget = 38 GiB }",
            "train { global_batch = 1B }",
            "parallel { zero = 3  tensor = 1  pipeline = 1 }",
            "hardware { intra_node = 900 GB/s  inter_node = 400 Gbps }",
        ] {
            ok(ex);
        }
    }
}
