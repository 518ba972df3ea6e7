//! The `.plan` language: a pest grammar (`plan.pest`), the syntax tree with
//! byte spans ([`ast`]), parse diagnostics and the canonical formatter.
//!
//! Knows nothing of GPUs, models or memory: which sections and keys exist is
//! the resolver's business (`rcoa-compiler`).
//!
//! Entry points: [`decode_utf8`], [`parse`] and (for `rcoa fmt`) [`format()`];
//! [`render::render_plain`] turns any diagnostic into deterministic text.

pub mod ast;
pub mod error;
pub mod format;
mod lex;
mod parse;
pub mod render;
#[cfg(test)]
mod testutil;

pub use ast::*;
pub use error::{Expected, ParseError, SyntaxError};
pub use format::format;
pub use parse::{decode_utf8, parse};
