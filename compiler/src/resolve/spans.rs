//! Where each resolved value was written: a side table of spans.
//!
//! The [`Spec`](crate::spec::Spec) holds no spans (it is serialized and
//! compared by value); later stages that want to point at the plan text
//! (e.g. "cannot fit: raise `fit.budget`") look the span up here by path:
//!
//! - `"train"`: the section's name, as written (`train` in `train { ... }`);
//! - `"model.args"`: the section's arguments (`"llama-3.1-8b"`, `hf "c.json"`);
//! - `"train.seq_len"`: the value of a key;
//! - `"hardware.gpu.memory"`: a key of a nested block.
//!
//! Values that came from defaults have no entry.

use rcoa_grammar::Span;
use std::collections::BTreeMap;

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpanTable {
    spans: BTreeMap<String, Span>,
}

impl SpanTable {
    pub fn get(&self, path: &str) -> Option<Span> {
        self.spans.get(path).copied()
    }

    /// The span of a key's value, else of its section's name.
    pub fn key_or_section(&self, section: &str, key: &str) -> Option<Span> {
        self.get(&format!("{section}.{key}"))
            .or_else(|| self.get(section))
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, Span)> {
        self.spans.iter().map(|(k, v)| (k.as_str(), *v))
    }

    pub(crate) fn insert(&mut self, path: impl Into<String>, span: Span) {
        self.spans.entry(path.into()).or_insert(span);
    }
}
