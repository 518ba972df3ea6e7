//! Helpers shared by the CLI tests that run `rcoa ARGS…` from the workspace root.

use std::path::PathBuf;
use std::process::{Command, Output};

pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// `rcoa ARGS...` run from the workspace root (so paths in output are relative).
pub fn rcoa(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_rcoa"))
        .args(args)
        .current_dir(root())
        .output()
        .expect("run rcoa")
}

pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

pub fn assert_no_panic(out: &Output) {
    let err = text(&out.stderr);
    assert!(!err.contains("panicked"), "rcoa panicked:\n{err}");
    assert!(!err.contains("RUST_BACKTRACE"), "rcoa panicked:\n{err}");
}
