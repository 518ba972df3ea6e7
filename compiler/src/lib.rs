//! rcoa's compiler: from the `.plan` syntax tree to a lowered training plan.
//!
//! One direction of flow (see `DESIGN.md`):
//! `ast::PlanFile` → [`resolve`] → [`spec::Spec`] → graph → passes → [`lowered::LoweredPlan`].

pub mod catalog;
pub mod compile;
pub mod cost;
pub mod emit;
pub mod executed;
pub mod explain;
pub mod graph;
pub mod lowered;
pub mod memory;
pub mod passes;
pub mod profile;
pub mod report;
pub mod resolve;
pub mod scale;
pub mod search;
pub mod spec;
/// Test support: a builder of [`spec::Spec`]s for the compiler's tests. Not for production use.
#[doc(hidden)]
pub mod testing;
pub mod validate;

pub use compile::{compile, Compilation, CompileError};
