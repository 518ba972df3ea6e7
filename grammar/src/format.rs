//! The canonical layout of a `.plan` file (`rcoa fmt`).
//!
//! Rules, in the order a reader meets them:
//! - Sections appear in source order, separated by exactly one blank line.
//! - A section is `name arg arg { ... }` with single spaces; entries are
//!   `key = value`, or `key { ... }` for a block value (the optional `=`
//!   before a block is dropped).
//! - A block, list or tuple stays on one line when it was written on one
//!   line, holds no comment, and the line fits in [`WIDTH`] columns; one-line
//!   blocks separate entries with two spaces (`{ params = bf16  compute =
//!   bf16 }`), lists and tuples use `, `. Otherwise the block puts one entry
//!   per line, and the list or tuple one item per line with a trailing comma,
//!   each indented two spaces deeper.
//! - Numbers keep their digits as written (`1_000`, `2e-5`); count suffixes
//!   (`K M B T`) and `%` touch the number, other units follow a space
//!   (`40 GiB`, `900 GB/s`). Strings are re-escaped.
//! - Comments stay where they were: a comment that followed code on its line
//!   stays at the end of that line (one space before `#`); any other comment
//!   gets its own line before the item it preceded, at that item's indent.
//!   Trailing whitespace in comments is dropped.
//! - One blank line is kept where the source had one or more between items
//!   or comments inside a file or block; none right after `{` or before `}`.
//!
//! Invariants (tested): `format(format(x)) == format(x)`, and the output
//! parses to the same tree as the input, ignoring spans ([`without_spans`]).

use crate::ast::*;

/// Column limit for keeping a block, list or tuple on one line.
pub const WIDTH: usize = 100;

/// Formats a parsed file. `source` must be the text `file` was parsed from
/// (it is read for comments' neighbourhoods and the author's line breaks).
pub fn format(file: &PlanFile, source: &str) -> String {
    let mut comments: Vec<&Comment> = file.comments.iter().collect();
    comments.sort_by_key(|c| c.span.start);
    let mut f = Formatter {
        src: source,
        comments,
        next: 0,
        out: String::new(),
        last_end: 0,
        force_blank: false,
        just_opened: true,
    };
    for (i, s) in file.sections.iter().enumerate() {
        f.force_blank = i > 0;
        f.leading(s.span.start, 0);
        f.section(s);
    }
    f.leading(usize::MAX, 0);
    f.out
}

struct Formatter<'a> {
    src: &'a str,
    comments: Vec<&'a Comment>,
    /// The first comment not yet written.
    next: usize,
    out: String,
    /// Source offset of the end of what was written last (for blank lines).
    last_end: usize,
    /// The next line must be preceded by a blank line (between sections).
    force_blank: bool,
    /// Nothing written since a `{`/`[`/`(` line or the file start.
    just_opened: bool,
}

impl Formatter<'_> {
    fn column(&self) -> usize {
        let line_start = self.out.rfind('\n').map_or(0, |i| i + 1);
        self.out[line_start..].chars().count()
    }

    /// Whether the source between two offsets holds an empty line.
    fn blank_between(&self, a: usize, b: usize) -> bool {
        let gap = self.src.get(a.min(b)..b.min(self.src.len())).unwrap_or("");
        let gap = gap.replace("\r\n", "\n").replace('\r', "\n");
        gap.matches('\n').count() >= 2
    }

    /// Starts a new output line for an item or comment starting at `start`.
    fn begin_line(&mut self, start: usize, indent: usize) {
        let blank =
            self.force_blank || (!self.just_opened && self.blank_between(self.last_end, start));
        if blank && !self.out.is_empty() {
            self.out.push('\n');
        }
        self.force_blank = false;
        self.just_opened = false;
        for _ in 0..indent {
            self.out.push_str("  ");
        }
    }

    /// Ends the current line: a comment that follows `end` on the same
    /// source line, with only spaces or a comma between, is appended to it.
    fn end_line(&mut self, end: usize) {
        self.last_end = end;
        if let Some(c) = self.comments.get(self.next) {
            let gap = self.src.get(end..c.span.start).unwrap_or("\n");
            if c.span.start >= end && gap.chars().all(|ch| matches!(ch, ' ' | '\t' | ',')) {
                self.out.push_str(" #");
                self.out.push_str(c.text.trim_end());
                self.last_end = c.span.end;
                self.next += 1;
            }
        }
        self.out.push('\n');
    }

    /// Writes, on their own lines, the comments that start before `pos`.
    fn leading(&mut self, pos: usize, indent: usize) {
        while let Some(c) = self.comments.get(self.next).copied() {
            if c.span.start >= pos {
                break;
            }
            self.next += 1;
            self.begin_line(c.span.start, indent);
            self.out.push('#');
            self.out.push_str(c.text.trim_end());
            self.out.push('\n');
            self.last_end = c.span.end;
        }
    }

    /// True when no unwritten comment starts before `end` and the source
    /// text of `span` is on one line: the node may be written inline.
    fn inline_ok(&self, span: Span) -> bool {
        let text = self.src.get(span.start..span.end).unwrap_or("\n");
        let no_comment = self
            .comments
            .get(self.next)
            .is_none_or(|c| c.span.start >= span.end);
        no_comment && !text.contains(['\n', '\r'])
    }

    fn section(&mut self, s: &Section) {
        self.begin_line(s.span.start, 0);
        self.out.push_str(&s.name.name);
        for a in &s.args {
            self.out.push(' ');
            self.value(a, 0);
        }
        match &s.body {
            Some(b) => {
                self.out.push(' ');
                self.block(b, 0);
                self.end_line(b.span.end);
            }
            None => {
                let end = s.args.last().map_or(s.name.span.end, |a| a.span.end);
                self.end_line(end);
            }
        }
    }

    /// Writes a block starting at the current column; leaves the line open
    /// after the closing `}`.
    fn block(&mut self, b: &Block, indent: usize) {
        if b.entries.is_empty() && self.inline_ok(b.span) {
            self.out.push_str("{}");
            return;
        }
        if self.inline_ok(b.span) {
            if let Some(text) = inline_block(b) {
                if self.column() + text.chars().count() <= WIDTH {
                    self.out.push_str(&text);
                    return;
                }
            }
        }
        self.out.push('{');
        // The `{` line's trailing comment, if any.
        self.end_line(b.span.start + 1);
        self.just_opened = true;
        for e in &b.entries {
            self.leading(e.span.start, indent + 1);
            self.begin_line(e.span.start, indent + 1);
            self.out.push_str(&e.key.name);
            match &e.value.kind {
                ValueKind::Block(inner) => {
                    self.out.push(' ');
                    self.block(inner, indent + 1);
                }
                _ => {
                    self.out.push_str(" = ");
                    self.value(&e.value, indent + 1);
                }
            }
            self.end_line(e.span.end);
        }
        let close = b.span.end.saturating_sub(1);
        self.leading(close, indent + 1);
        self.just_opened = true; // no blank line before `}`
        self.begin_line(close, indent);
        self.out.push('}');
    }

    /// Writes a value at the current column; multi-line lists, tuples and
    /// blocks indent their items at `indent + 1`.
    fn value(&mut self, v: &Value, indent: usize) {
        let (items, open, close) = match &v.kind {
            ValueKind::Block(b) => return self.block(b, indent),
            ValueKind::List(items) => (items, '[', ']'),
            ValueKind::Tuple(items) => (items, '(', ')'),
            ValueKind::Every(inner) => {
                self.out.push_str("every ");
                return self.value(inner, indent);
            }
            _ => {
                self.out.push_str(&inline_value(v).unwrap_or_default());
                return;
            }
        };
        if self.inline_ok(v.span) {
            if let Some(text) = inline_value(v) {
                if self.column() + text.chars().count() <= WIDTH {
                    self.out.push_str(&text);
                    return;
                }
            }
        }
        self.out.push(open);
        self.end_line(v.span.start + 1);
        self.just_opened = true;
        for item in items {
            self.leading(item.span.start, indent + 1);
            self.begin_line(item.span.start, indent + 1);
            self.value(item, indent + 1);
            self.out.push(',');
            // (A comment after the item's comma is still on its line.)
            self.end_line(item.span.end);
        }
        let end = v.span.end.saturating_sub(1);
        self.leading(end, indent + 1);
        self.just_opened = true;
        self.begin_line(end, indent);
        self.out.push(close);
    }
}

fn inline_block(b: &Block) -> Option<String> {
    if b.entries.is_empty() {
        return Some("{}".into());
    }
    let mut parts = Vec::with_capacity(b.entries.len());
    for e in &b.entries {
        parts.push(match &e.value.kind {
            ValueKind::Block(inner) => format!("{} {}", e.key.name, inline_block(inner)?),
            _ => format!("{} = {}", e.key.name, inline_value(&e.value)?),
        });
    }
    Some(format!("{{ {} }}", parts.join("  ")))
}

/// A value on one line (always possible; `Option` for uniformity with
/// blocks and to keep the call sites honest).
fn inline_value(v: &Value) -> Option<String> {
    Some(match &v.kind {
        ValueKind::Auto => "auto".into(),
        ValueKind::Bool(b) => b.to_string(),
        ValueKind::Ident(s) => s.clone(),
        ValueKind::Str(s) => quote(s),
        ValueKind::Number(n) => number(n),
        ValueKind::List(items) => format!("[{}]", inline_items(items)?),
        ValueKind::Tuple(items) => format!("({})", inline_items(items)?),
        ValueKind::Block(b) => inline_block(b)?,
        ValueKind::Every(inner) => format!("every {}", inline_value(inner)?),
        ValueKind::Placed { what, place } => format!("{}:{}", what.name, place.name),
    })
}

fn inline_items(items: &[Value]) -> Option<String> {
    let parts: Option<Vec<String>> = items.iter().map(inline_value).collect();
    Some(parts?.join(", "))
}

/// A string literal with `"` and `\` escaped.
pub fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        if c == '"' || c == '\\' {
            out.push('\\');
        }
        out.push(c);
    }
    out.push('"');
    out
}

/// A number as written, with its unit in canonical spelling and spacing.
pub fn number(n: &Number) -> String {
    match n.unit {
        None => n.text.clone(),
        Some(u @ (Unit::K | Unit::M | Unit::B | Unit::T | Unit::Percent)) => {
            format!("{}{}", n.text, u.as_str())
        }
        Some(u) => format!("{} {}", n.text, u.as_str()),
    }
}

/// A copy of `file` with every span zeroed and comment text trimmed at the
/// end: two files are "the same plan, laid out differently" exactly when
/// their `without_spans` are equal.
pub fn without_spans(file: &PlanFile) -> PlanFile {
    fn ident(i: &Ident) -> Ident {
        Ident {
            name: i.name.clone(),
            span: Span::default(),
        }
    }
    fn block(b: &Block) -> Block {
        Block {
            entries: b
                .entries
                .iter()
                .map(|e| Entry {
                    key: ident(&e.key),
                    value: value(&e.value),
                    span: Span::default(),
                })
                .collect(),
            span: Span::default(),
        }
    }
    fn value(v: &Value) -> Value {
        let kind = match &v.kind {
            ValueKind::List(items) => ValueKind::List(items.iter().map(value).collect()),
            ValueKind::Tuple(items) => ValueKind::Tuple(items.iter().map(value).collect()),
            ValueKind::Block(b) => ValueKind::Block(block(b)),
            ValueKind::Every(inner) => ValueKind::Every(Box::new(value(inner))),
            ValueKind::Placed { what, place } => ValueKind::Placed {
                what: ident(what),
                place: ident(place),
            },
            other => other.clone(),
        };
        Value {
            kind,
            span: Span::default(),
        }
    }
    PlanFile {
        sections: file
            .sections
            .iter()
            .map(|s| Section {
                name: ident(&s.name),
                args: s.args.iter().map(value).collect(),
                body: s.body.as_ref().map(block),
                span: Span::default(),
            })
            .collect(),
        comments: file
            .comments
            .iter()
            .map(|c| Comment {
                text: c.text.trim_end().to_string(),
                span: Span::default(),
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parse;

    /// Formats `src`, checks the two invariants, returns the output.
    fn fmt(src: &str) -> String {
        let a = parse("a.plan", src).unwrap_or_else(|e| panic!("input: {e}\n{src}"));
        let once = format(&a, src);
        let b = parse("b.plan", &once).unwrap_or_else(|e| panic!("output: {e}\n{once}"));
        assert_eq!(
            without_spans(&a),
            without_spans(&b),
            "tree changed:\n{once}"
        );
        let twice = format(&b, &once);
        assert_eq!(once, twice, "not idempotent");
        once
    }

    #[test]
    fn canonical_spacing_and_units() {
        let out = fmt("model   \"llama-3.1-8b\"\nfit{budget=80GB  x = 900GB/s y=128K z=1_000 w = 90 % v = 8 B}\n");
        assert_eq!(
            out,
            "model \"llama-3.1-8b\"\n\nfit { budget = 80 GB  x = 900 GB/s  y = 128K  z = 1_000  w = 90%  v = 8B }\n"
        );
    }

    #[test]
    fn multi_line_blocks_stay_multi_line() {
        let src = "hardware {\n   gpu           = a100-40gb\n\n\n   gpus_per_node = 4, nodes=1\n gpu2 = { memory = 48 GiB }\n}\n";
        assert_eq!(
            fmt(src),
            "hardware {\n  gpu = a100-40gb\n\n  gpus_per_node = 4\n  nodes = 1\n  gpu2 { memory = 48 GiB }\n}\n"
        );
    }

    #[test]
    fn comments_stay_in_place() {
        let src = "# header\n\n# about the model\nmodel \"x\"   # a preset   \ntrain { # loop\n  seq_len = 1 # short\n  # before steps\n  steps = 2\n  # last\n}\n# tail\n";
        assert_eq!(
            fmt(src),
            "# header\n\n# about the model\nmodel \"x\" # a preset\n\ntrain { # loop\n  seq_len = 1 # short\n  # before steps\n  steps = 2\n  # last\n}\n# tail\n"
        );
    }

    #[test]
    fn comments_in_lists_make_them_multi_line() {
        let src = "fit { offload = [optimizer, # first\n params] }\n";
        assert_eq!(
            fmt(src),
            "fit {\n  offload = [\n    optimizer, # first\n    params,\n  ]\n}\n"
        );
    }

    #[test]
    fn comment_between_header_and_block() {
        let out = fmt("train # why\n{ seq_len = 1 }\n");
        assert!(out.contains("# why"), "{out}");
    }

    #[test]
    fn strings_and_odd_values() {
        let out = fmt("m hf \"a\\\"b\\\\c\" { c = every 2  o = [optimizer:cpu]  t = (0.9, 0.95)  n = -1 e = [] }\n");
        assert_eq!(
            out,
            "m hf \"a\\\"b\\\\c\" { c = every 2  o = [optimizer:cpu]  t = (0.9, 0.95)  n = -1  e = [] }\n"
        );
    }

    #[test]
    fn long_lines_break() {
        let items: Vec<String> = (0..30).map(|i| format!("item{i}")).collect();
        let src = format!("s {{ k = [{}] }}\n", items.join(", "));
        let out = fmt(&src);
        assert!(out.lines().all(|l| l.chars().count() <= WIDTH), "{out}");
        assert!(out.contains("    item0,\n"), "{out}");
    }

    #[test]
    fn empty_things() {
        assert_eq!(fmt(""), "");
        assert_eq!(fmt("# only\n"), "# only\n");
        assert_eq!(fmt("a {}\nb {\n}\n"), "a {}\n\nb {\n}\n");
    }

    #[test]
    fn language_md_examples_round_trip() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/language.md");
        let text = std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
        let blocks = crate::testutil::plan_blocks(&text);
        assert!(blocks.len() >= 10, "{} plan blocks", blocks.len());
        for b in blocks {
            fmt(&b);
        }
    }

    /// Every plan under `<workspace>/plans` formats stably (skipped if none).
    #[test]
    fn repository_plans_round_trip() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../plans");
        let Ok(entries) = std::fs::read_dir(&dir) else {
            eprintln!("skipped: {} not found", dir.display());
            return;
        };
        let mut paths: Vec<_> = entries
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "plan"))
            .collect();
        paths.sort();
        for p in paths {
            let src = std::fs::read_to_string(&p).unwrap();
            if parse("p", &src).is_err() {
                // Deliberately broken example plans are the parser's business.
                continue;
            }
            fmt(&src);
        }
    }
}
