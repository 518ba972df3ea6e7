//! The resolver's diagnostics: [`ResolveError`] (one problem) and
//! [`ResolveErrors`] (all problems of a file, with its source attached).
//!
//! Both are plain data implementing `miette::Diagnostic`; only the CLI
//! renders them. A file with one problem renders as that problem; with more,
//! as a header line and each problem as a related diagnostic, in source
//! order (problems about the file as a whole, such as a missing section,
//! first).

use miette::{Diagnostic, LabeledSpan, NamedSource, SourceCode};
use rcoa_grammar::Span;
use std::fmt;

/// One problem: a stable code, a message, labelled spans (the first is the
/// offending text) and an optional help line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ResolveError {
    pub(crate) code: &'static str,
    pub(crate) message: String,
    pub(crate) labels: Vec<(Span, String)>,
    pub(crate) help: Option<String>,
}

impl ResolveError {
    /// The stable code, e.g. `rcoa::unknown_gpu`.
    pub fn code(&self) -> &'static str {
        self.code
    }
    pub fn message(&self) -> &str {
        &self.message
    }
    /// The offending text, if the problem has a place in the file.
    pub fn span(&self) -> Option<Span> {
        self.labels.first().map(|l| l.0)
    }
    /// Every labelled span with its label text, the offending text first.
    pub fn labels(&self) -> &[(Span, String)] {
        &self.labels
    }
    pub fn help(&self) -> Option<&str> {
        self.help.as_deref()
    }
}

impl fmt::Display for ResolveError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

impl std::error::Error for ResolveError {}

impl Diagnostic for ResolveError {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        Some(Box::new(self.code))
    }
    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.help
            .as_ref()
            .map(|h| Box::new(h) as Box<dyn fmt::Display>)
    }
    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        if self.labels.is_empty() {
            return None;
        }
        Some(Box::new(self.labels.iter().enumerate().map(
            |(i, (span, text))| {
                let label = (!text.is_empty()).then(|| text.clone());
                if i == 0 {
                    LabeledSpan::new_primary_with_span(label, *span)
                } else {
                    LabeledSpan::new_with_span(label, *span)
                }
            },
        )))
    }
}

/// Every problem the resolver found in one file (never empty), sorted by
/// location, with the file's name and text for rendering.
#[derive(Debug)]
pub struct ResolveErrors {
    source: NamedSource<String>,
    name: String,
    errors: Vec<ResolveError>,
}

impl ResolveErrors {
    pub(crate) fn new(name: &str, source: &str, errors: Vec<ResolveError>) -> Self {
        debug_assert!(!errors.is_empty());
        ResolveErrors {
            source: NamedSource::new(name, source.to_string()),
            name: name.to_string(),
            errors,
        }
    }
    /// The problems, in source order.
    pub fn errors(&self) -> &[ResolveError] {
        &self.errors
    }
    pub fn len(&self) -> usize {
        self.errors.len()
    }
    pub fn is_empty(&self) -> bool {
        self.errors.is_empty()
    }
    /// The codes of all problems, in order (handy in tests).
    pub fn codes(&self) -> Vec<&'static str> {
        self.errors.iter().map(|e| e.code).collect()
    }
    fn single(&self) -> Option<&ResolveError> {
        match self.errors.as_slice() {
            [one] => Some(one),
            _ => None,
        }
    }
}

impl fmt::Display for ResolveErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.single() {
            Some(e) => f.write_str(&e.message),
            None => f.write_str(&super::wording::many_problems(
                self.errors.len(),
                &self.name,
            )),
        }
    }
}

impl std::error::Error for ResolveErrors {}

impl Diagnostic for ResolveErrors {
    fn code<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        match self.single() {
            Some(e) => Some(Box::new(e.code)),
            None => Some(Box::new("rcoa::invalid_plan")),
        }
    }
    fn help<'a>(&'a self) -> Option<Box<dyn fmt::Display + 'a>> {
        self.single().and_then(Diagnostic::help)
    }
    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        self.single().and_then(Diagnostic::labels)
    }
    fn source_code(&self) -> Option<&dyn SourceCode> {
        Some(&self.source)
    }
    fn related<'a>(&'a self) -> Option<Box<dyn Iterator<Item = &'a dyn Diagnostic> + 'a>> {
        if self.single().is_some() {
            return None;
        }
        Some(Box::new(self.errors.iter().map(|e| e as &dyn Diagnostic)))
    }
}
