//! The syntax tree of a `.plan` file.
//!
//! The grammar is deliberately generic: a file is a list of sections, a
//! section is `name arg* { key = value ... }?`, and values are typed only by
//! their lexical shape (number, size, identifier, list, ...). Which sections
//! and keys exist, and what a bare `B` means in a given slot, is decided by
//! the resolver in `rcoa-compiler`, so that unknown names get "did you mean"
//! diagnostics instead of parse errors. Every node carries its byte span.

/// A byte range into the source text, `start..end`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct Span {
    pub start: usize,
    pub end: usize,
}

impl Span {
    pub fn new(start: usize, end: usize) -> Self {
        Span { start, end }
    }
    pub fn len(&self) -> usize {
        self.end - self.start
    }
    pub fn is_empty(&self) -> bool {
        self.start == self.end
    }
    /// The smallest span covering both.
    pub fn to(self, other: Span) -> Span {
        Span::new(self.start.min(other.start), self.end.max(other.end))
    }
}

impl From<Span> for miette::SourceSpan {
    fn from(s: Span) -> Self {
        (s.start, s.len()).into()
    }
}

/// A whole `.plan` file.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanFile {
    pub sections: Vec<Section>,
    /// Every `# ...` comment in source order (kept for `rcoa fmt`).
    pub comments: Vec<Comment>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Comment {
    /// The text after `#`, without the line break.
    pub text: String,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ident {
    pub name: String,
    pub span: Span,
}

/// `name arg* { entries }?`, e.g. `model hf "config.json"`, `optimizer adamw { lr = 2e-5 }`,
/// `precision bf16`, `hardware { ... }`. Arguments sit on the same line as the name.
#[derive(Clone, Debug, PartialEq)]
pub struct Section {
    pub name: Ident,
    pub args: Vec<Value>,
    pub body: Option<Block>,
    pub span: Span,
}

/// `{ key = value ... }`; also used as a value (`gpu { memory = 48 GiB }`).
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    pub entries: Vec<Entry>,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Entry {
    pub key: Ident,
    pub value: Value,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Value {
    pub kind: ValueKind,
    pub span: Span,
}

#[derive(Clone, Debug, PartialEq)]
pub enum ValueKind {
    /// `auto`
    Auto,
    /// `true` / `false`
    Bool(bool),
    /// `bf16`, `a100-40gb`, `llama-3.1-8b`
    Ident(String),
    /// `"llama-3.1-8b"`, escapes already decoded.
    Str(String),
    /// `42`, `1_000`, `2e-5`, `8B`, `40 GiB`, `90%`, `400 Gbps`, `900 GB/s`.
    Number(Number),
    /// `[a, b, c]`
    List(Vec<Value>),
    /// `(0.9, 0.95)`
    Tuple(Vec<Value>),
    /// `{ key = value ... }`
    Block(Block),
    /// `every 2`: a keyword followed by a value (checkpoint every Nth layer).
    Every(Box<Value>),
    /// `optimizer:cpu`: what moves, and where to.
    Placed { what: Ident, place: Ident },
}

/// A number as written, with its unit or count suffix, if any. The value is
/// not scaled: `40 GiB` is `value = 40.0, unit = Some(GiB)`.
#[derive(Clone, Debug, PartialEq)]
pub struct Number {
    pub value: f64,
    /// The digits as written (underscores kept), for the formatter.
    pub text: String,
    /// True when written without `.` or exponent.
    pub integer: bool,
    pub unit: Option<Unit>,
}

/// Units and suffixes. `B` is ambiguous on purpose: bytes in a size slot, a
/// billion in a count slot; the resolver decides.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Unit {
    /// `K` (thousand)
    K,
    /// `M` (million)
    M,
    /// `B`: bytes, or a billion
    B,
    /// `T` (trillion)
    T,
    KB,
    MB,
    GB,
    TB,
    KiB,
    MiB,
    GiB,
    TiB,
    /// `%`
    Percent,
    /// `Gbps` (gigabits per second)
    Gbps,
    /// `Mbps`
    Mbps,
    /// `Tbps`
    Tbps,
    /// `MB/s`
    MBps,
    /// `GB/s`
    GBps,
    /// `TB/s`
    TBps,
}

impl Unit {
    /// The unit as written in canonical form.
    pub fn as_str(self) -> &'static str {
        match self {
            Unit::K => "K",
            Unit::M => "M",
            Unit::B => "B",
            Unit::T => "T",
            Unit::KB => "KB",
            Unit::MB => "MB",
            Unit::GB => "GB",
            Unit::TB => "TB",
            Unit::KiB => "KiB",
            Unit::MiB => "MiB",
            Unit::GiB => "GiB",
            Unit::TiB => "TiB",
            Unit::Percent => "%",
            Unit::Gbps => "Gbps",
            Unit::Mbps => "Mbps",
            Unit::Tbps => "Tbps",
            Unit::MBps => "MB/s",
            Unit::GBps => "GB/s",
            Unit::TBps => "TB/s",
        }
    }
}
