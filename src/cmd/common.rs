//! Shared by the subcommands: loading a plan (read, decode, parse, resolve)
//! and rendering diagnostics.
//!
//! Every stage's failure is a miette diagnostic rendered to stderr, and the
//! caller gets exit code 2 ("bad plan") — never a panic. Rendering is
//! deterministic ([`render_plain`]: no colour, fixed width) unless stderr is
//! a terminal, where miette's fancy unicode theme with colour is used.

use rcoa_compiler::resolve::{resolve_with_spans, ResolveContext, SpanTable};
use rcoa_compiler::spec::Spec;
use rcoa_grammar::render::render_plain;
use rcoa_grammar::PlanFile;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `--format`: words for people, or JSON for programs (every subcommand that reports).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    Text,
    Json,
}

/// Exit code for a plan that cannot be read, parsed or resolved.
pub const BAD_PLAN: u8 = 2;

/// A plan read from disk and resolved.
#[derive(Debug)]
#[allow(dead_code)] // fields are read by different subcommands
pub struct LoadedPlan {
    pub path: PathBuf,
    /// The file's text.
    pub source: String,
    pub file: PlanFile,
    pub spec: Spec,
    /// Where each resolved value was written (for later diagnostics).
    pub spans: SpanTable,
}

/// Why a plan could not be loaded; already reported on stderr when returned
/// from [`load_spec`].
pub enum LoadError {
    /// The file could not be read (a message, not a diagnostic).
    Read(String),
    Diagnostic(Box<dyn miette::Diagnostic>),
}

/// Reads, decodes, parses and resolves `path`; on failure renders the
/// diagnostics to stderr and returns exit code 2.
pub fn load_spec(path: &Path) -> Result<LoadedPlan, ExitCode> {
    try_load(path).map_err(|e| {
        report(&e);
        ExitCode::from(BAD_PLAN)
    })
}

/// [`load_spec`] without printing: the caller decides how to report.
pub fn try_load(path: &Path) -> Result<LoadedPlan, LoadError> {
    let name = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| LoadError::Read(read_error(&name, &e)))?;
    let source =
        rcoa_grammar::decode_utf8(&name, &bytes).map_err(|e| LoadError::Diagnostic(Box::new(e)))?;
    let file =
        rcoa_grammar::parse(&name, source).map_err(|e| LoadError::Diagnostic(Box::new(e)))?;
    // `model hf "config.json"` is relative to the plan's folder.
    let base_dir = path.parent().map(Path::to_path_buf).unwrap_or_default();
    let ctx = ResolveContext::new(name, source, base_dir);
    let (spec, spans) =
        resolve_with_spans(&file, &ctx).map_err(|e| LoadError::Diagnostic(Box::new(e)))?;
    Ok(LoadedPlan {
        path: path.to_path_buf(),
        source: ctx.source,
        file,
        spec,
        spans,
    })
}

/// Prints a load error to stderr.
pub fn report(e: &LoadError) {
    match e {
        LoadError::Read(msg) => eprintln!("error: {msg}"),
        LoadError::Diagnostic(d) => eprint!("{}", render(d.as_ref())),
    }
}

fn read_error(name: &str, e: &std::io::Error) -> String {
    match e.kind() {
        std::io::ErrorKind::NotFound => format!("cannot read {name}: no such file"),
        std::io::ErrorKind::IsADirectory => format!("cannot read {name}: it is a directory"),
        _ => format!("cannot read {name}: {e}"),
    }
}

/// A diagnostic for people: fancy with colour on a terminal, plain otherwise.
pub fn render(diag: &dyn miette::Diagnostic) -> String {
    if std::io::stderr().is_terminal() {
        let handler = miette::GraphicalReportHandler::new_themed(miette::GraphicalTheme::unicode());
        let mut out = String::new();
        if handler.render_report(&mut out, diag).is_ok() {
            return out;
        }
    }
    render_plain(diag)
}

/// Write `contents` to `path` so that a reader sees the old file or the new one, never half
/// of it: a temporary file beside `path`, written and synced, `prepare`d (permissions, mode),
/// then renamed over `path`. The temporary is removed on any failure. Every file a
/// subcommand writes (formatted plans, reports, lowered plans, emitted configs) goes here.
pub fn write_atomic(
    path: &Path,
    contents: &[u8],
    prepare: impl FnOnce(&Path) -> std::io::Result<()>,
) -> std::io::Result<()> {
    use std::io::Write;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.rcoa-{}.tmp", std::process::id()));
    let result = (|| {
        let mut file = std::fs::File::create(&tmp)?;
        file.write_all(contents)?;
        file.sync_all()?;
        drop(file);
        prepare(&tmp)?;
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("rcoa-atomic-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn atomic_write_replaces_the_file_and_leaves_no_temporary() {
        let dir = scratch("replace");
        let path = dir.join("r.html");
        write_atomic(&path, b"one", |_| Ok(())).unwrap();
        write_atomic(&path, b"two", |_| Ok(())).unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "two");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file left behind");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_failed_prepare_keeps_the_old_file_and_removes_the_temporary() {
        let dir = scratch("fail");
        let path = dir.join("plan.plan");
        std::fs::write(&path, "old").unwrap();
        let err = write_atomic(&path, b"new", |_| Err(std::io::Error::other("no")));
        assert!(err.is_err());
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "old");
        let left: Vec<_> = std::fs::read_dir(&dir).unwrap().collect();
        assert_eq!(left.len(), 1, "no temporary file left behind");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
