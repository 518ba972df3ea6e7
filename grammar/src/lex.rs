//! A forgiving tokenizer used only to explain syntax errors.
//!
//! The pest grammar is the parser; this lexer never decides whether a file is
//! valid. It exists because good messages need context pest does not keep:
//! which delimiter is still open, what the previous token was (`=` means a
//! value was expected), whether a word is glued to a number (`40gib`).
//!
//! Invariants: [`tokens`] accepts every `&str` and never panics; tokens are in
//! source order, do not overlap, and lie on char boundaries. Spaces, tabs and
//! comments produce no tokens; newlines do.

use crate::ast::Span;

/// What a token is, as far as diagnostics care.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Tok {
    Newline,
    /// A run of `[A-Za-z][A-Za-z0-9_.-]*`. `glued` when it follows a number
    /// with no space (`40gib`, `8x`).
    Word {
        glued: bool,
    },
    /// `-`? digits with optional fraction and exponent.
    Number,
    /// A string literal. `terminated` is false when the line or file ended
    /// first; `bad_escape` is the first escape other than `\"` and `\\`.
    Str {
        terminated: bool,
        bad_escape: Option<Span>,
    },
    /// One of `{ } [ ] ( ) = , : % /`.
    Punct(char),
    /// Any other character (`@`, `;`, non-ASCII letters, ...).
    Other(char),
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Token {
    pub tok: Tok,
    pub span: Span,
}

impl Token {
    pub fn text<'s>(&self, source: &'s str) -> &'s str {
        source.get(self.span.start..self.span.end).unwrap_or("")
    }
}

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | '-')
}

/// Splits `source` into tokens (see the module doc for the guarantees).
pub(crate) fn tokens(source: &str) -> Vec<Token> {
    let bytes = source.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    while i < source.len() {
        // Every branch advances `i` by at least one whole char.
        let c = match source[i..].chars().next() {
            Some(c) => c,
            None => break,
        };
        let start = i;
        match c {
            ' ' | '\t' | '\u{FEFF}' => i += c.len_utf8(),
            '#' => {
                while i < source.len() && bytes[i] != b'\n' && bytes[i] != b'\r' {
                    i += 1;
                }
            }
            '\n' => {
                i += 1;
                out.push(tok(Tok::Newline, start, i));
            }
            '\r' => {
                i += 1;
                if bytes.get(i) == Some(&b'\n') {
                    i += 1;
                }
                out.push(tok(Tok::Newline, start, i));
            }
            '"' => {
                i += 1;
                let mut terminated = false;
                let mut bad_escape = None;
                while i < source.len() {
                    match bytes[i] {
                        b'"' => {
                            i += 1;
                            terminated = true;
                            break;
                        }
                        b'\n' | b'\r' => break,
                        b'\\' => {
                            let next = source[i + 1..].chars().next();
                            match next {
                                Some('"') | Some('\\') => i += 2,
                                Some('\n') | Some('\r') | None => {
                                    // A backslash right before the line end
                                    // escapes nothing; the string is open.
                                    bad_escape.get_or_insert(Span::new(i, i + 1));
                                    i += 1;
                                }
                                Some(other) => {
                                    let end = i + 1 + other.len_utf8();
                                    bad_escape.get_or_insert(Span::new(i, end));
                                    i = end;
                                }
                            }
                        }
                        _ => i += source[i..].chars().next().map_or(1, char::len_utf8),
                    }
                }
                out.push(tok(
                    Tok::Str {
                        terminated,
                        bad_escape,
                    },
                    start,
                    i,
                ));
            }
            '0'..='9' => i = number(source, i, &mut out),
            '-' if bytes.get(i + 1).is_some_and(u8::is_ascii_digit) => {
                i = number(source, i, &mut out)
            }
            c if c.is_ascii_alphabetic() => {
                while i < source.len() && is_word_char(bytes[i] as char) {
                    i += 1;
                }
                out.push(tok(Tok::Word { glued: false }, start, i));
            }
            '{' | '}' | '[' | ']' | '(' | ')' | '=' | ',' | ':' | '%' | '/' => {
                i += 1;
                out.push(tok(Tok::Punct(c), start, i));
            }
            other => {
                i += other.len_utf8();
                out.push(tok(Tok::Other(other), start, i));
            }
        }
    }
    out
}

fn tok(tok: Tok, start: usize, end: usize) -> Token {
    Token {
        tok,
        span: Span::new(start, end),
    }
}

/// Lexes a number starting at `i` (digits or `-digit`), then any word glued
/// to it; returns the new position.
fn number(source: &str, mut i: usize, out: &mut Vec<Token>) -> usize {
    let bytes = source.as_bytes();
    let start = i;
    let digits = |mut j: usize| {
        while j < bytes.len() && (bytes[j].is_ascii_digit() || bytes[j] == b'_') {
            j += 1;
        }
        j
    };
    if bytes[i] == b'-' {
        i += 1;
    }
    i = digits(i);
    if bytes.get(i) == Some(&b'.') && bytes.get(i + 1).is_some_and(u8::is_ascii_digit) {
        i = digits(i + 1);
    }
    if matches!(bytes.get(i), Some(b'e') | Some(b'E')) {
        let mut j = i + 1;
        if matches!(bytes.get(j), Some(b'+') | Some(b'-')) {
            j += 1;
        }
        if bytes.get(j).is_some_and(u8::is_ascii_digit) {
            i = digits(j);
        }
    }
    out.push(tok(Tok::Number, start, i));
    let word_start = i;
    while i < bytes.len() && is_word_char(bytes[i] as char) {
        i += 1;
    }
    if i > word_start {
        out.push(tok(Tok::Word { glued: true }, word_start, i));
    }
    i
}

/// A problem found by [`prescan`]: these are reported before pest runs
/// because pest would only see their consequences, far from the cause.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Structural {
    UnterminatedString {
        open: Span,
    },
    InvalidEscape {
        at: Span,
    },
    /// An opener never closed; `close_hint` is where the file ended.
    Unclosed {
        open: Span,
        delim: char,
        next_section: Option<Span>,
        eof: usize,
    },
    /// `[ ... }`: the closer does not match the innermost opener.
    Mismatched {
        open: Span,
        open_delim: char,
        close: Span,
        close_delim: char,
    },
    /// A closer with nothing open.
    UnmatchedClose {
        close: Span,
        delim: char,
    },
    TooDeep {
        at: Span,
    },
}

/// How deeply `{ [ (` may nest. Plans need three or four levels; the limit
/// keeps the recursive descent (pest's and ours) far from the stack's end on
/// hostile input.
pub(crate) const MAX_DEPTH: usize = 64;

/// Checks strings and delimiter balance over the whole file; returns the most
/// fundamental problem, if any.
pub(crate) fn prescan(source: &str, toks: &[Token]) -> Option<Structural> {
    let _ = source;
    for t in toks {
        if let Tok::Str {
            terminated: false, ..
        } = t.tok
        {
            return Some(Structural::UnterminatedString {
                open: Span::new(t.span.start, t.span.start + 1),
            });
        }
    }
    for t in toks {
        if let Tok::Str {
            bad_escape: Some(at),
            ..
        } = t.tok
        {
            return Some(Structural::InvalidEscape { at });
        }
    }
    let mut stack: Vec<(char, Span)> = Vec::new();
    for t in toks {
        let Tok::Punct(c) = t.tok else { continue };
        match c {
            '{' | '[' | '(' => {
                stack.push((c, t.span));
                if stack.len() > MAX_DEPTH {
                    return Some(Structural::TooDeep { at: t.span });
                }
            }
            '}' | ']' | ')' => match stack.pop() {
                None => {
                    return Some(Structural::UnmatchedClose {
                        close: t.span,
                        delim: c,
                    })
                }
                Some((open_delim, open)) if closer(open_delim) != c => {
                    return Some(Structural::Mismatched {
                        open,
                        open_delim,
                        close: t.span,
                        close_delim: c,
                    })
                }
                Some(_) => {}
            },
            _ => {}
        }
    }
    stack.pop().map(|(delim, open)| Structural::Unclosed {
        open,
        delim,
        next_section: next_section_after(source, toks, open),
        eof: source.trim_end().len(),
    })
}

/// Columns of indentation on the line holding byte `at`.
fn indent_of(source: &str, at: usize) -> usize {
    let start = source[..at].rfind(['\n', '\r']).map_or(0, |i| i + 1);
    source[start..at]
        .chars()
        .take_while(|c| matches!(c, ' ' | '\t'))
        .count()
}

fn next_section_after(source: &str, toks: &[Token], open: Span) -> Option<Span> {
    let base = indent_of(source, open.start);
    let after = toks.iter().position(|t| t.span.start > open.start)?;
    toks[after..].windows(3).find_map(|w| {
        let starts_line = w[0].tok == Tok::Newline;
        let is_name = w[1].tok == Tok::Word { glued: false };
        let not_entry = w[2].tok != Tok::Punct('=');
        (starts_line && is_name && not_entry && indent_of(source, w[1].span.start) <= base)
            .then_some(w[1].span)
    })
}

pub(crate) fn closer(open: char) -> char {
    match open {
        '{' => '}',
        '[' => ']',
        _ => ')',
    }
}

/// The innermost delimiter open at byte `pos`, if any.
pub(crate) fn enclosing(toks: &[Token], pos: usize) -> Option<char> {
    let mut stack = Vec::new();
    for t in toks.iter().take_while(|t| t.span.start < pos) {
        match t.tok {
            Tok::Punct(c @ ('{' | '[' | '(')) => stack.push(c),
            Tok::Punct('}' | ']' | ')') => {
                stack.pop();
            }
            _ => {}
        }
    }
    stack.pop()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(s: &str) -> Vec<Tok> {
        tokens(s).into_iter().map(|t| t.tok).collect()
    }

    #[test]
    fn words_numbers_and_glue() {
        assert_eq!(
            kinds("lr = 2e-5 40gib"),
            vec![
                Tok::Word { glued: false },
                Tok::Punct('='),
                Tok::Number,
                Tok::Number,
                Tok::Word { glued: true },
            ]
        );
    }

    #[test]
    fn comments_vanish_newlines_stay() {
        assert_eq!(kinds("# hi \"\n{"), vec![Tok::Newline, Tok::Punct('{')]);
    }

    #[test]
    fn prescan_finds_unclosed_and_bad_strings() {
        let s = "a {\n b = [1, 2\n}";
        assert!(matches!(
            prescan(s, &tokens(s)),
            Some(Structural::Mismatched {
                open_delim: '[',
                close_delim: '}',
                ..
            })
        ));
        let s = "model \"x\n";
        assert!(matches!(
            prescan(s, &tokens(s)),
            Some(Structural::UnterminatedString { .. })
        ));
        let s = "model \"a\\nb\"";
        assert_eq!(
            prescan(s, &tokens(s)),
            Some(Structural::InvalidEscape {
                at: Span::new(8, 10)
            })
        );
        let s = "a {\n  b = 1\n  c { d = 1 }\nx = 2\ntrain {}\n";
        assert!(matches!(
            prescan(s, &tokens(s)),
            Some(Structural::Unclosed {
                next_section: Some(Span { start: 32, end: 37 }),
                ..
            })
        ));
        let s = "a { b = 1";
        assert!(matches!(
            prescan(s, &tokens(s)),
            Some(Structural::Unclosed {
                delim: '{',
                next_section: None,
                ..
            })
        ));
    }

    #[test]
    fn never_panics_on_odd_text() {
        for s in [
            "\\",
            "\"\\",
            "-",
            "1e",
            "1.",
            "é\u{FEFF}\r",
            "\"\\é\"",
            "9_9.9e+",
        ] {
            let _ = prescan(s, &tokens(s));
        }
    }
}
