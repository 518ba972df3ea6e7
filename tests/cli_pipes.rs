//! Output into a closed pipe (`rcoa check plans/*.plan | head -1`) ends the
//! command quietly, as `cat` or `grep` end: no panic, no "Broken pipe" text,
//! never exit 101.

#[allow(dead_code)] // each test binary uses part of the shared helpers
mod common;

use common::{root, text};
use std::process::{Command, Stdio};

/// Runs `rcoa ARGS` with its stdout's reading end already closed, so its
/// first write meets a closed pipe.
fn into_closed_pipe(args: &[&str]) {
    let mut child = Command::new(env!("CARGO_BIN_EXE_rcoa"))
        .args(args)
        .current_dir(root())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start rcoa");
    drop(child.stdout.take());
    let out = child.wait_with_output().expect("wait for rcoa");
    let err = text(&out.stderr);
    assert!(!err.contains("panicked"), "{args:?} panicked:\n{err}");
    assert!(!err.contains("Broken pipe"), "{args:?}:\n{err}");
    assert_ne!(out.status.code(), Some(101), "{args:?}: {err}");
    #[cfg(unix)]
    {
        use std::os::unix::process::ExitStatusExt;
        // Ended by SIGPIPE, as other tools are (the shell shows 141), or
        // finished before writing.
        assert!(
            out.status.signal() == Some(13) || out.status.success(),
            "{args:?}: {:?} {err}",
            out.status
        );
    }
}

#[test]
fn every_command_ends_quietly_into_a_closed_pipe() {
    for args in [
        &[
            "check",
            "plans/tiny-cpu.plan",
            "plans/llama-3.1-8b-full-1xh100.plan",
        ][..],
        &[
            "compile",
            "plans/llama-3.1-8b-full-4xa100-40gb.plan",
            "--explain",
        ],
        &["compile", "plans/tiny-cpu.plan", "--format", "json"],
        &["catalog", "models"],
        &["fmt", "plans/tiny-cpu.plan"],
        &[
            "emit",
            "plans/llama-3.1-70b-zero3-8x80gb.plan",
            "--target",
            "deepspeed",
        ],
        &["validate", "tests/groundtruth/h100-pytorch.jsonl"],
        &[
            "run",
            "plans/tiny-cpu.plan",
            "--steps",
            "2",
            "--format",
            "json",
        ],
        &["--help"],
    ] {
        into_closed_pipe(args);
    }
}
