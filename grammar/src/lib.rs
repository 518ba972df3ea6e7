//! The `.plan` language: a pest grammar (`plan.pest`), the syntax tree with
//! byte spans ([`ast`]), parse diagnostics and the canonical formatter.
//!
//! Knows nothing of GPUs, models or memory: which sections and keys exist is
//! the resolver's business (`rcoa-compiler`).
//!
//! Entry points: [`decode_utf8`], [`parse`] and (for `rcoa fmt`) [`format()`];
//! [`render::render_plain`] turns any diagnostic into deterministic text.
//!
//! Design note. *Constraints:* errors must name the mistake (missing `=`,
//! unclosed block at its opener) rather than pest's rule names, and no input
//! may panic or take long. *Solution:* pest recognises; a small forgiving
//! lexer (`lex`) first checks strings and bracket balance (pest would
//! notice an unclosed `{` only at the end of the file), then, when pest
//! fails, gives `parse` the neighbouring tokens it needs to classify the
//! failure into a [`SyntaxError`]; all wording lives in [`error`]. Nesting is
//! capped at 64 and the grammar has no rule parsed twice on backtracking, so
//! time is linear in practice. *Trade-off:* one diagnostic per file (the
//! first problem), not a recovered list; parse errors are cheap to fix one
//! at a time and the resolver reports its problems all together.

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
