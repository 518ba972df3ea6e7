//! One module per subcommand; `common` holds loading and diagnostic rendering shared by them,
//! `compile_notice` what `run` says while CUDA kernels compile.

pub mod catalog;
pub mod check;
pub mod common;
pub mod compile;
pub mod compile_ahead;
pub mod compile_notice;
pub mod emit;
pub mod eval;
pub mod fmt;
pub mod init;
pub mod orchestrate;
pub mod run;
pub mod validate;
pub mod warmup;
