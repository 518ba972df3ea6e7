//! Parse diagnostics: what went wrong (data) and how to say it (prose).
//!
//! Detection lives in `parse.rs` and `lex.rs` and produces a [`SyntaxError`],
//! a plain enum holding spans and the offending text. Every user-facing word
//! — message, label, help line — is written in this file, so the wording can
//! be reviewed as prose in one place (Gleam's habit). Codes are stable
//! (`rcoa::syntax::*`, `rcoa::invalid_utf8`): tests, docs and users may match
//! on them.

use crate::ast::Span;
use miette::{Diagnostic, LabeledSpan, NamedSource, SourceCode};
use std::fmt;

/// One syntax problem, with the spans needed to point at it.
#[derive(Clone, Debug, PartialEq)]
pub enum SyntaxError {
    /// Bytes that are not UTF-8. `at` is in the lossily decoded text.
    InvalidUtf8 { at: Span, byte: u8 },
    /// `"...` with no closing quote on its line; `open` is the `"`.
    UnterminatedString { open: Span },
    /// `\n`, `\t`, ... inside a string; only `\"` and `\\` exist.
    InvalidEscape { at: Span, text: String },
    /// A `{`, `[` or `(` never closed. `next_section` is a later line that
    /// looks like the start of a new section (where the closer probably
    /// belongs); `eof` is the end of the file's last text.
    UnclosedDelimiter {
        open: Span,
        delim: char,
        next_section: Option<Span>,
        eof: usize,
    },
    /// A closer that does not match the innermost open delimiter.
    MismatchedDelimiter {
        open: Span,
        open_delim: char,
        close: Span,
        close_delim: char,
    },
    /// A closer with nothing open.
    UnmatchedClose { close: Span, delim: char },
    /// Delimiters nested deeper than the parser allows.
    TooDeep { at: Span, limit: usize },
    /// `key value` inside a block: the `=` is missing.
    ExpectedEquals {
        key: Span,
        key_text: String,
        found: Span,
        found_text: String,
    },
    /// `a = "x" "y"`, `a = 1 2`: a second value where an entry should end.
    ExtraValue { found: Span, found_text: String },
    /// `key =` followed by the end of the line, a `}` or a `,`.
    ExpectedValue {
        eq: Span,
        key_text: Option<String>,
        found: Span,
    },
    /// `budget = GiB`: a unit where a number should come first.
    UnitWithoutNumber { at: Span, unit: String },
    /// `40gib`, `8x`: a word glued to a number that is not a unit.
    UnknownUnit {
        at: Span,
        word: String,
        suggestion: Option<&'static str>,
    },
    /// `128 K`: a count suffix separated from its number.
    DetachedSuffix {
        at: Span,
        number: String,
        suffix: String,
    },
    /// `BF16`, `Lr`: names are lower-case.
    UppercaseName { at: Span, word: String },
    /// `seq_len = 2048` outside any block.
    EntryOutsideBlock {
        eq: Span,
        key: Option<(Span, String)>,
    },
    /// Something that cannot start a section at the top level.
    /// `after_name` is set when the line before held only a section name,
    /// so the found value was probably meant as its argument.
    ExpectedSectionName {
        found: Span,
        found_text: String,
        after_name: Option<String>,
    },
    /// `1.`, `1_`, `2e`, `1.5.3`: digits that do not form a number.
    MalformedNumber { at: Span, text: String },
    /// Inside a block, something that cannot start an entry.
    ExpectedKey { found: Span, found_text: String },
    /// A number too large to represent (`1e999`).
    NumberOutOfRange { at: Span },
    /// A character the language never uses (`@`, `;`, `é` outside strings).
    UnexpectedCharacter { at: Span, ch: char },
    /// Anything else: what was found and, in words, what was expected.
    UnexpectedToken {
        found: Span,
        found_text: String,
        expected: Vec<Expected>,
    },
}

/// A thing the parser could have accepted, named for humans.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Expected {
    SectionName,
    Key,
    Equals,
    Value,
    BlockStart,
    BlockEnd,
    ListEnd,
    TupleEnd,
    Comma,
    LineEnd,
    Unit,
}

impl Expected {
    fn words(self) -> &'static str {
        match self {
            Expected::SectionName => "a section name",
            Expected::Key => "a key",
            Expected::Equals => "`=`",
            Expected::Value => "a value",
            Expected::BlockStart => "`{`",
            Expected::BlockEnd => "`}`",
            Expected::ListEnd => "`]`",
            Expected::TupleEnd => "`)`",
            Expected::Comma => "`,`",
            Expected::LineEnd => "the end of the line",
            Expected::Unit => "a unit",
        }
    }
}

const VALUE_SHAPES: &str =
    "values look like `42`, `40 GiB`, `95%`, `bf16`, `\"text\"`, `[a, b]` or `(0.9, 0.95)`";

fn delim_name(c: char) -> &'static str {
    match c {
        '{' | '}' => "block",
        '[' | ']' => "list",
        _ => "tuple",
    }
}

fn closer_of(open: char) -> char {
    match open {
        '{' => '}',
        '[' => ']',
        _ => ')',
    }
}

fn opener_of(close: char) -> char {
    match close {
        '}' => '{',
        ']' => '[',
        _ => '(',
    }
}

/// Shortens offending text for messages: first line, at most 24 chars.
fn shown(text: &str) -> String {
    let line = text.lines().next().unwrap_or("");
    let mut s: String = line.chars().take(24).collect();
    if line.chars().count() > 24 {
        s.push('…');
    }
    s
}

fn found_words(text: &str) -> String {
    if text.is_empty() {
        "the end of the file".to_string()
    } else if text.starts_with('\n') || text.starts_with('\r') {
        "the end of the line".to_string()
    } else {
        format!("`{}`", shown(text))
    }
}

impl SyntaxError {
    /// The stable code users and tests match on.
    pub fn code(&self) -> &'static str {
        match self {
            SyntaxError::InvalidUtf8 { .. } => "rcoa::invalid_utf8",
            SyntaxError::UnterminatedString { .. } => "rcoa::syntax::unterminated_string",
            SyntaxError::InvalidEscape { .. } => "rcoa::syntax::invalid_escape",
            SyntaxError::UnclosedDelimiter { delim: '{', .. } => "rcoa::syntax::unclosed_block",
            SyntaxError::UnclosedDelimiter { delim: '[', .. } => "rcoa::syntax::unclosed_list",
            SyntaxError::UnclosedDelimiter { .. } => "rcoa::syntax::unclosed_tuple",
            SyntaxError::MismatchedDelimiter { .. } => "rcoa::syntax::mismatched_delimiter",
            SyntaxError::UnmatchedClose { .. } => "rcoa::syntax::unmatched_close",
            SyntaxError::TooDeep { .. } => "rcoa::syntax::too_deep",
            SyntaxError::ExpectedEquals { .. } => "rcoa::syntax::expected_equals",
            SyntaxError::ExtraValue { .. } => "rcoa::syntax::extra_value",
            SyntaxError::ExpectedValue { .. } => "rcoa::syntax::expected_value",
            SyntaxError::UnitWithoutNumber { .. } => "rcoa::syntax::unit_without_number",
            SyntaxError::UnknownUnit { .. } => "rcoa::syntax::unknown_unit",
            SyntaxError::DetachedSuffix { .. } => "rcoa::syntax::detached_suffix",
            SyntaxError::UppercaseName { .. } => "rcoa::syntax::uppercase_name",
            SyntaxError::EntryOutsideBlock { .. } => "rcoa::syntax::entry_outside_block",
            SyntaxError::ExpectedSectionName { .. } => "rcoa::syntax::expected_section",
            SyntaxError::MalformedNumber { .. } => "rcoa::syntax::malformed_number",
            SyntaxError::ExpectedKey { .. } => "rcoa::syntax::expected_key",
            SyntaxError::NumberOutOfRange { .. } => "rcoa::syntax::number_out_of_range",
            SyntaxError::UnexpectedCharacter { .. } => "rcoa::syntax::unexpected_character",
            SyntaxError::UnexpectedToken { .. } => "rcoa::syntax::unexpected_token",
        }
    }

    /// The one-line headline.
    pub fn message(&self) -> String {
        match self {
            SyntaxError::InvalidUtf8 { byte, .. } => {
                format!("the file is not valid UTF-8 (byte 0x{byte:02X})")
            }
            SyntaxError::UnterminatedString { .. } => "unterminated string".into(),
            SyntaxError::InvalidEscape { text, .. } => {
                format!("unknown escape `{text}` in a string")
            }
            SyntaxError::UnclosedDelimiter { delim, .. } => {
                format!(
                    "unclosed {}: `{delim}` has no matching `{}`",
                    delim_name(*delim),
                    closer_of(*delim)
                )
            }
            SyntaxError::MismatchedDelimiter {
                open_delim,
                close_delim,
                ..
            } => format!(
                "mismatched `{close_delim}`: the innermost open {} needs `{}`",
                delim_name(*open_delim),
                closer_of(*open_delim)
            ),
            SyntaxError::UnmatchedClose { delim, .. } => {
                format!(
                    "unexpected `{delim}`: no `{}` is open here",
                    opener_of(*delim)
                )
            }
            SyntaxError::TooDeep { limit, .. } => {
                format!("blocks, lists and tuples nest more than {limit} deep")
            }
            SyntaxError::ExpectedEquals { key_text, .. } => {
                format!("expected `=` after `{key_text}`")
            }
            SyntaxError::ExtraValue { found_text, .. } => {
                format!("unexpected second value {}", found_words(found_text))
            }
            SyntaxError::ExpectedValue { key_text, .. } => match key_text {
                Some(k) => format!("`{k} =` has no value"),
                None => "`=` has no value".into(),
            },
            SyntaxError::UnitWithoutNumber { unit, .. } => {
                format!("the unit `{unit}` has no number before it")
            }
            SyntaxError::UnknownUnit { word, .. } => format!("unknown unit `{}`", shown(word)),
            SyntaxError::DetachedSuffix { suffix, .. } => {
                format!("the suffix `{suffix}` must touch its number")
            }
            SyntaxError::UppercaseName { word, .. } => {
                format!("names are lower-case, found `{}`", shown(word))
            }
            SyntaxError::EntryOutsideBlock { key, .. } => match key {
                Some((_, k)) => format!("`{k} = ...` is outside any block"),
                None => "`=` outside any block".into(),
            },
            SyntaxError::MalformedNumber { text, .. } => {
                format!("malformed number `{}`", shown(text))
            }
            SyntaxError::ExpectedSectionName { found_text, .. } => {
                format!("expected a section name, found {}", found_words(found_text))
            }
            SyntaxError::ExpectedKey { found_text, .. } => {
                format!("expected a key, found {}", found_words(found_text))
            }
            SyntaxError::NumberOutOfRange { .. } => "number out of range".into(),
            SyntaxError::UnexpectedCharacter { ch, .. } => {
                if ch.is_control() || ch.is_whitespace() {
                    format!("unexpected character `{}`", ch.escape_unicode())
                } else {
                    format!("unexpected character `{ch}`")
                }
            }
            SyntaxError::UnexpectedToken {
                found_text,
                expected,
                ..
            } => {
                let found = found_words(found_text);
                if expected.is_empty() {
                    format!("unexpected {found}")
                } else {
                    format!("expected {}, found {found}", or_list(expected))
                }
            }
        }
    }

    /// Labelled spans; the first is primary.
    pub fn labels(&self) -> Vec<(Span, String)> {
        match self {
            SyntaxError::InvalidUtf8 { at, .. } => vec![(*at, "not UTF-8".into())],
            SyntaxError::UnterminatedString { open } => {
                vec![(*open, "this string is never closed".into())]
            }
            SyntaxError::InvalidEscape { at, .. } => vec![(*at, "unknown escape".into())],
            SyntaxError::UnclosedDelimiter {
                open,
                delim,
                next_section,
                eof,
            } => vec![
                (
                    *open,
                    format!("this {} is never closed", delim_name(*delim)),
                ),
                match next_section {
                    Some(s) => (*s, "a new section starts here, still inside it".into()),
                    None => (Span::new(*eof, *eof), "the file ends here".into()),
                },
            ],
            SyntaxError::MismatchedDelimiter {
                open,
                open_delim,
                close,
                ..
            } => vec![
                (
                    *close,
                    format!("expected `{}` before this", closer_of(*open_delim)),
                ),
                (
                    *open,
                    format!("this {} is still open", delim_name(*open_delim)),
                ),
            ],
            SyntaxError::UnmatchedClose { close, .. } => {
                vec![(*close, "nothing to close".into())]
            }
            SyntaxError::TooDeep { at, .. } => vec![(*at, "too deep".into())],
            SyntaxError::ExtraValue { found, .. } => {
                vec![(*found, "a key takes one value".into())]
            }
            SyntaxError::ExpectedEquals { key, found, .. } => vec![
                (*found, "expected `=` before this".into()),
                (*key, "this key".into()),
            ],
            SyntaxError::ExpectedValue { eq, found, .. } => vec![
                (*found, "expected a value here".into()),
                (*eq, "after this `=`".into()),
            ],
            SyntaxError::UnitWithoutNumber { at, .. } => vec![(*at, "a unit alone".into())],
            SyntaxError::UnknownUnit { at, .. } => vec![(*at, "not a unit".into())],
            SyntaxError::DetachedSuffix { at, .. } => {
                vec![(*at, "remove the space before this".into())]
            }
            SyntaxError::UppercaseName { at, .. } => vec![(*at, "upper-case letters".into())],
            SyntaxError::EntryOutsideBlock { eq, key } => {
                let mut v = vec![(*eq, "entries belong inside `{ }`".into())];
                if let Some((span, _)) = key {
                    v.push((*span, "read as a section name".into()));
                }
                v
            }
            SyntaxError::MalformedNumber { at, .. } => vec![(*at, "not a number".into())],
            SyntaxError::ExpectedSectionName { found, .. } => {
                vec![(*found, "a section starts with a lower-case name".into())]
            }
            SyntaxError::ExpectedKey { found, .. } => {
                vec![(*found, "an entry starts with a lower-case key".into())]
            }
            SyntaxError::NumberOutOfRange { at } => vec![(*at, "too large".into())],
            SyntaxError::UnexpectedCharacter { at, .. } => {
                vec![(*at, "not part of the language".into())]
            }
            SyntaxError::UnexpectedToken { found, .. } => vec![(*found, "unexpected".into())],
        }
    }

    /// The help line: what to do about it.
    pub fn help(&self) -> Option<String> {
        Some(match self {
            SyntaxError::InvalidUtf8 { .. } => "save the plan as UTF-8 text".into(),
            SyntaxError::UnterminatedString { .. } => {
                "strings end with `\"` on the same line; write `\\\"` for a quote inside".into()
            }
            SyntaxError::InvalidEscape { .. } => {
                "the only escapes are `\\\"` (a quote) and `\\\\` (a backslash)".into()
            }
            SyntaxError::UnclosedDelimiter {
                delim,
                next_section,
                ..
            } => {
                let closer = closer_of(*delim);
                let name = delim_name(*delim);
                match next_section {
                    Some(_) => format!(
                        "a {name} opened here is never closed; add `{closer}` before the next section"
                    ),
                    None => format!("a {name} opened here is never closed; add `{closer}`"),
                }
            }
            SyntaxError::MismatchedDelimiter { open_delim, .. } => format!(
                "close the {} with `{}` first",
                delim_name(*open_delim),
                closer_of(*open_delim)
            ),
            SyntaxError::UnmatchedClose { delim, .. } => {
                format!("remove this `{delim}`, or add the `{}` it should close", opener_of(*delim))
            }
            SyntaxError::TooDeep { .. } => "flatten the value; plans need only a few levels".into(),
            SyntaxError::ExpectedEquals {
                key_text,
                found_text,
                ..
            } if found_text == ":" => {
                format!("entries use `=`, not `:` (which only joins a placement such as `optimizer:cpu`): `{key_text} = ...`")
            }
            SyntaxError::ExpectedEquals { key_text, .. } => {
                format!("entries are written `key = value`, e.g. `{key_text} = ...`")
            }
            SyntaxError::ExtraValue { .. } => {
                "for several values write a list `[a, b]` or a tuple `(a, b)`".into()
            }
            SyntaxError::ExpectedValue { .. } => {
                format!("{VALUE_SHAPES}; the value goes on the same line as `=`")
            }
            SyntaxError::UnitWithoutNumber { unit, .. } => {
                format!("put the number first, e.g. `40 {unit}`")
            }
            SyntaxError::UnknownUnit {
                suggestion: Some(s),
                word,
                ..
            } if s.eq_ignore_ascii_case(word) => {
                format!("units are case-sensitive: did you mean `{s}`?")
            }
            SyntaxError::UnknownUnit {
                suggestion: Some(s),
                ..
            } => format!("did you mean `{s}`?"),
            SyntaxError::UnknownUnit { .. } => {
                "units are K M B T (counts), B KB MB GB TB KiB MiB GiB TiB (sizes), % and Gbps Mbps Tbps GB/s MB/s TB/s".into()
            }
            SyntaxError::DetachedSuffix { number, suffix, .. } => {
                format!("write `{number}{suffix}`")
            }
            SyntaxError::UppercaseName { word, .. } => {
                if word.chars().all(|c| c.is_ascii_alphanumeric() || "_.-".contains(c)) {
                    format!("write `{}`", word.to_ascii_lowercase())
                } else {
                    "names use a-z, 0-9, `_`, `.` and `-`, starting with a letter".into()
                }
            }
            SyntaxError::EntryOutsideBlock { key, .. } => match key {
                Some((_, k)) => format!("put it in its section's block, e.g. `train {{ {k} = ... }}`"),
                None => "put entries in a section's block: `name { key = value }`".into(),
            },
            SyntaxError::MalformedNumber { .. } => {
                "numbers look like `42`, `1_000`, `0.95` or `2e-5`, with an optional unit: `40 GiB`".into()
            }
            SyntaxError::ExpectedSectionName {
                after_name: Some(name),
                ..
            } => format!("a section's arguments go on the same line as its name: `{name} ...`"),
            SyntaxError::ExpectedSectionName { .. } => {
                "a file is a list of sections such as `model \"llama-3.1-8b\"` or `train { seq_len = 2048 }`".into()
            }
            SyntaxError::ExpectedKey { .. } => {
                "entries are written `key = value`, with a lower-case key".into()
            }
            SyntaxError::NumberOutOfRange { .. } => {
                "numbers must fit a 64-bit float; use a unit instead of many digits".into()
            }
            SyntaxError::UnexpectedCharacter { ch, .. } => match ch {
                ';' => "entries are separated by newlines or `,`, not `;`".into(),
                '\'' => "strings use double quotes: `\"...\"`".into(),
                '.' => "numbers start with a digit: write `0.5`, not `.5`".into(),
                _ => "remove it; outside strings and comments a plan uses a-z, 0-9, `_ . - : % /`, `=`, `,` and brackets".into(),
            },
            SyntaxError::UnexpectedToken { found_text, .. } if found_text == ":" => {
                "`:` joins a placement with no spaces around it, as in `optimizer:cpu`".into()
            }
            SyntaxError::UnexpectedToken { expected, .. } => {
                if expected.contains(&Expected::Value) {
                    VALUE_SHAPES.into()
                } else if expected.contains(&Expected::Key) {
                    "a block holds entries `key = value`, separated by newlines or `,`".into()
                } else {
                    "a file is a list of sections such as `model \"llama-3.1-8b\"` or `train { seq_len = 2048 }`".into()
                }
            }
        })
    }
}

fn or_list(items: &[Expected]) -> String {
    let words: Vec<&str> = items.iter().map(|e| e.words()).collect();
    match words.as_slice() {
        [] => String::new(),
        [one] => (*one).to_string(),
        [init @ .., last] => format!("{} or {last}", init.join(", ")),
    }
}

/// A syntax error in a named `.plan` file, ready to render.
///
/// Boxed so that `Result<PlanFile, ParseError>` stays small.
#[derive(Clone, Debug)]
pub struct ParseError(Box<Inner>);

#[derive(Clone, Debug)]
struct Inner {
    error: SyntaxError,
    src: NamedSource<String>,
}

impl ParseError {
    pub fn new(name: &str, source: &str, error: SyntaxError) -> Self {
        ParseError(Box::new(Inner {
            error,
            src: NamedSource::new(name, source.to_string()),
        }))
    }

    /// What went wrong, as data.
    pub fn error(&self) -> &SyntaxError {
        &self.0.error
    }

    /// The file name given to [`crate::parse`].
    pub fn name(&self) -> &str {
        self.0.src.name()
    }

    /// The stable diagnostic code, e.g. `rcoa::syntax::unclosed_block`.
    pub fn code_str(&self) -> &'static str {
        self.0.error.code()
    }

    /// The primary span (where the caret points).
    pub fn span(&self) -> Span {
        self.0
            .error
            .labels()
            .first()
            .map(|(s, _)| *s)
            .unwrap_or_default()
    }
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0.error.message())
    }
}

impl std::error::Error for ParseError {}

impl Diagnostic for ParseError {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new(self.0.error.code()))
    }

    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.0
            .error
            .help()
            .map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        Some(&self.0.src)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        let len = self.0.src.inner().len();
        let labels = self
            .0
            .error
            .labels()
            .into_iter()
            .enumerate()
            .map(move |(i, (span, text))| {
                // Clamp so a label can never point past the source.
                let start = span.start.min(len);
                let end = span.end.clamp(start, len);
                let s = Span::new(start, end);
                if i == 0 {
                    LabeledSpan::new_primary_with_span(Some(text), s)
                } else {
                    LabeledSpan::new_with_span(Some(text), s)
                }
            });
        Some(Box::new(labels))
    }
}
