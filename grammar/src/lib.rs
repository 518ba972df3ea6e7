//! The `.plan` language: a pest grammar (`plan.pest`), the syntax tree with
//! byte spans ([`ast`]), parse diagnostics and the canonical formatter.
//!
//! Knows nothing of GPUs, models or memory: which sections and keys exist is
//! the resolver's business (`rcoa-compiler`).
//!
//! Entry points: [`parse`] and [`format()`].

pub mod ast;

pub use ast::*;
