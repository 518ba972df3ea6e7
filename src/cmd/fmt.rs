//! `rcoa fmt FILE... [--check]`: rewrite plans in canonical layout.
//!
//! Works on syntax only (`decode_utf8` + `parse` + `format`), so it formats
//! plans whose names the resolver would reject — formatting should never wait
//! for a plan to be correct. A file is rewritten only when its text changes,
//! through a temporary file in the same directory and a rename, so a crash
//! never leaves half a plan behind.
//!
//! Exit codes: 0 all formatted (or, with `--check`, already canonical);
//! 1 with `--check`, some file would change; 2 a file could not be read,
//! parsed or written.

use super::common::render;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// Plan files to format in place.
    #[arg(required = true, value_name = "FILE")]
    pub files: Vec<PathBuf>,
    /// Change nothing; exit 1 and name each file that is not formatted.
    #[arg(long)]
    pub check: bool,
}

/// What happened to one file.
#[derive(Debug, PartialEq, Eq)]
enum Outcome {
    Unchanged,
    /// Rewritten, or with `--check`, would be.
    Changed,
    /// Reported on stderr already.
    Failed,
}

pub fn run(args: Args) -> ExitCode {
    let mut worst = 0u8;
    for path in &args.files {
        let code = match fmt_file(path, args.check) {
            Outcome::Unchanged => 0,
            Outcome::Changed if args.check => {
                println!("{}: not formatted", path.display());
                1
            }
            Outcome::Changed => 0,
            Outcome::Failed => 2,
        };
        worst = worst.max(code);
    }
    ExitCode::from(worst)
}

fn fmt_file(path: &Path, check: bool) -> Outcome {
    let name = path.display().to_string();
    let bytes = match std::fs::read(path) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("rcoa fmt: cannot read {name}: {e}");
            return Outcome::Failed;
        }
    };
    let parsed = rcoa_grammar::decode_utf8(&name, &bytes)
        .and_then(|text| rcoa_grammar::parse(&name, text).map(|file| (text, file)));
    let (text, file) = match parsed {
        Ok(ok) => ok,
        Err(diag) => {
            // Plain text unless stderr is a terminal, like every subcommand.
            eprint!("{}", render(&diag));
            return Outcome::Failed;
        }
    };
    let formatted = rcoa_grammar::format(&file, text);
    if formatted == text {
        return Outcome::Unchanged;
    }
    if check {
        return Outcome::Changed;
    }
    // The formatted file keeps the original's permissions.
    let keep_permissions = |tmp: &Path| match std::fs::metadata(path) {
        Ok(meta) => std::fs::set_permissions(tmp, meta.permissions()),
        Err(_) => Ok(()),
    };
    match super::common::write_atomic(path, formatted.as_bytes(), keep_permissions) {
        Ok(()) => Outcome::Changed,
        Err(e) => {
            eprintln!("rcoa fmt: cannot write {name}: {e}");
            Outcome::Failed
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_plan(tag: &str, text: &[u8]) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rcoa-fmt-test-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("p.plan");
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn check_reports_then_write_fixes() {
        let path = temp_plan("fix", b"train{seq_len=1}\n");
        assert_eq!(fmt_file(&path, true), Outcome::Changed);
        assert_eq!(
            std::fs::read(&path).unwrap(),
            b"train{seq_len=1}\n",
            "--check writes nothing"
        );
        assert_eq!(fmt_file(&path, false), Outcome::Changed);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap(),
            "train { seq_len = 1 }\n"
        );
        assert_eq!(fmt_file(&path, true), Outcome::Unchanged);
        let leftovers = std::fs::read_dir(path.parent().unwrap()).unwrap().count();
        assert_eq!(leftovers, 1, "no temporary file left behind");
    }

    #[test]
    fn bad_plans_fail_without_writing() {
        let path = temp_plan("bad", b"train { seq_len = \n");
        assert_eq!(fmt_file(&path, false), Outcome::Failed);
        assert_eq!(std::fs::read(&path).unwrap(), b"train { seq_len = \n");
        let path = temp_plan("utf8", b"model \"\xff\"\n");
        assert_eq!(fmt_file(&path, false), Outcome::Failed);
        assert_eq!(
            fmt_file(Path::new("/nonexistent/x.plan"), true),
            Outcome::Failed
        );
    }
}
