//! Where CUDA kernels are cached, how they are tuned, and which batch shapes
//! a cache already holds: the parts of the cold start that need no GPU, so
//! the CPU build and its tests have them (`cuda` applies them).
//!
//! Three caches make a warm start (docs/cold-start.md):
//! - CubeCL's PTX cache (`cuda/<cubecl version>/ptx.json.log`) and autotune
//!   cache (`autotune/<cubecl version>/<device>/<op>.json.log`), both under
//!   the per-GPU, per-driver directory `cuda::cache_dir` names. CubeCL
//!   stores one JSON entry per line; `count_entries` counts them.
//! - The driver's PTX→SASS cache (`CUDA_CACHE_PATH`): CubeCL hands PTX to
//!   `cuModuleLoadData`, which JIT-compiles it for the GPU on every load, even
//!   from CubeCL's cache. `driver_jit_dir` puts it beside CubeCL's caches.
//! - `warmed.jsonl`, rcoa's own: the shapes (`shapes::Shape`) of a plan
//!   whose kernels a finished pass compiled into this cache, so `rcoa run`
//!   knows which of its first passes will compile (`shapes::notices`).

use crate::shapes::Shape;
use rcoa_compiler::lowered::LoweredPlan;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};

/// The root of rcoa's kernel caches: `$RCOA_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/rcoa/cubecl`, else `~/.cache/rcoa/cubecl`.
pub fn cache_root() -> PathBuf {
    std::env::var_os("RCOA_CACHE_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            let base = std::env::var_os("XDG_CACHE_HOME")
                .map(PathBuf::from)
                .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
                .unwrap_or_else(std::env::temp_dir);
            base.join("rcoa").join("cubecl")
        })
}

/// The driver's JIT cache directory under `root`. The driver keys its
/// entries by GPU, driver and PTX itself, so one directory serves every
/// GPU; it must be named before CUDA initialises, when the GPU's name (which
/// keys CubeCL's caches) is not known yet.
pub fn driver_jit_dir(root: &Path) -> PathBuf {
    root.join("driver-jit")
}

/// The driver's JIT cache size: its documented maximum (4 GiB). The
/// default (1 GiB on servers, 256 MiB on embedded platforms) is shared with
/// every other CUDA program of the user, and an evicted kernel is
/// JIT-compiled again at its next load.
pub const DRIVER_JIT_MAXSIZE: u64 = 4 << 30;

/// The environment the driver's JIT cache needs, for variables the user
/// has not set (theirs win): `(name, value)` pairs to set before CUDA
/// initialises.
pub fn driver_jit_env(root: &Path, is_set: impl Fn(&str) -> bool) -> Vec<(&'static str, String)> {
    let mut env = Vec::new();
    if !is_set("CUDA_CACHE_PATH") {
        env.push((
            "CUDA_CACHE_PATH",
            driver_jit_dir(root).display().to_string(),
        ));
    }
    if !is_set("CUDA_CACHE_MAXSIZE") {
        env.push(("CUDA_CACHE_MAXSIZE", DRIVER_JIT_MAXSIZE.to_string()));
    }
    env
}

/// CubeCL's cache files under `dir` (`*.json.log`, in any depth).
fn cubecl_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let path = e.path();
        let Ok(kind) = e.file_type() else { continue };
        if kind.is_dir() {
            cubecl_files(&path, out);
        } else if path
            .file_name()
            .and_then(|f| f.to_str())
            .is_some_and(|f| f.ends_with(".json.log"))
        {
            out.push(path);
        }
    }
}

/// Entries in CubeCL's caches under `dir`: lines of its `*.json.log`
/// files (one compiled kernel or one tuning result each). 0 for a missing
/// directory. Reads the files (the PTX cache of a model is around 100 MB),
/// so it is for messages, once per run; `has_entries` is the cheap test.
pub fn count_entries(dir: &Path) -> u64 {
    use std::io::Read;
    let mut files = Vec::new();
    cubecl_files(dir, &mut files);
    let mut n = 0;
    let mut buf = vec![0u8; 1 << 20];
    for path in files {
        let Ok(mut f) = std::fs::File::open(&path) else {
            continue;
        };
        while let Ok(len) = f.read(&mut buf) {
            if len == 0 {
                break;
            }
            n += buf[..len].iter().filter(|&&b| b == b'\n').count() as u64;
        }
    }
    n
}

/// Whether CubeCL's caches under `dir` hold anything (file sizes only).
pub fn has_entries(dir: &Path) -> bool {
    let mut files = Vec::new();
    cubecl_files(dir, &mut files);
    files
        .iter()
        .any(|p| std::fs::metadata(p).is_ok_and(|m| m.len() > 0))
}

// ---------------------------------------------------------------- autotune

/// Copies the tuning results in the cache `dir` (CubeCL's
/// `autotune/**/*.json.log`) to the same places under `to`, and returns
/// the entries copied. The recording pass of compiling ahead
/// (`prebuild::record`) keeps its own tunings apart, since it times
/// launches that do nothing; seeded with these, its tuner finds the keys
/// this cache has already tuned and launches (so records) only their
/// fastest candidate, not every candidate again. Missing files copy
/// nothing.
pub fn copy_tunings(dir: &Path, to: &Path) -> std::io::Result<u64> {
    let mut files = Vec::new();
    cubecl_files(&dir.join(AUTOTUNE_DIR), &mut files);
    let mut entries = 0;
    for file in files {
        let Ok(rel) = file.strip_prefix(dir) else {
            continue;
        };
        let dest = to.join(rel);
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)?;
        }
        let text = std::fs::read(&file)?;
        entries += text.iter().filter(|&&b| b == b'\n').count() as u64;
        std::fs::write(&dest, text)?;
    }
    Ok(entries)
}

/// CubeCL's autotune cache, under a kernel cache directory.
const AUTOTUNE_DIR: &str = "autotune";

/// CubeCL's autotune level (`cubecl_runtime::config::autotune::AutotuneLevel`,
/// mirrored so the CPU build and the CLI can name it). It sets how coarsely
/// tuned ops' shapes are bucketed into tuning keys, not which kernels are
/// tried (docs/cold-start.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AutotuneLevel {
    Minimal,
    Balanced,
    Extensive,
    Full,
}

impl AutotuneLevel {
    pub fn as_str(self) -> &'static str {
        match self {
            AutotuneLevel::Minimal => "minimal",
            AutotuneLevel::Balanced => "balanced",
            AutotuneLevel::Extensive => "extensive",
            AutotuneLevel::Full => "full",
        }
    }
}

/// 0: not chosen (CubeCL's own: `CUBECL_AUTOTUNE_LEVEL`, a `cubecl.toml`,
/// else balanced); otherwise 1 + the level.
static AUTOTUNE: AtomicU8 = AtomicU8::new(0);

/// Choose the autotune level for this process's CUDA runs. CubeCL reads its
/// configuration once per process, so it applies to the first CUDA run.
pub fn set_autotune(level: Option<AutotuneLevel>) {
    let v = match level {
        None => 0,
        Some(AutotuneLevel::Minimal) => 1,
        Some(AutotuneLevel::Balanced) => 2,
        Some(AutotuneLevel::Extensive) => 3,
        Some(AutotuneLevel::Full) => 4,
    };
    AUTOTUNE.store(v, Ordering::Relaxed);
}

/// The level `set_autotune` chose, if any.
pub fn autotune() -> Option<AutotuneLevel> {
    match AUTOTUNE.load(Ordering::Relaxed) {
        1 => Some(AutotuneLevel::Minimal),
        2 => Some(AutotuneLevel::Balanced),
        3 => Some(AutotuneLevel::Extensive),
        4 => Some(AutotuneLevel::Full),
        _ => None,
    }
}

// ---------------------------------------------------------------- warmed shapes

/// What decides a plan's kernels besides the batch shape: the lowered plan
/// (model, precision, optimizer, recomputation, ranks), the rcoa version that
/// generates them, the data-parallel ranks and the autotune level (which
/// buckets tuning keys). FNV-1a, stable across machines and Rust versions.
pub fn plan_fingerprint(plan: &LoweredPlan, ranks: u64) -> String {
    let text = serde_json::to_string(plan).unwrap_or_default();
    let level = autotune().map_or_else(
        || std::env::var("CUBECL_AUTOTUNE_LEVEL").unwrap_or_default(),
        |l| l.as_str().to_string(),
    );
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in [
        text.as_str(),
        env!("CARGO_PKG_VERSION"),
        &ranks.to_string(),
        &level,
    ] {
        for b in part.bytes().chain([0u8]) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    format!("{h:016x}")
}

const WARMED: &str = "warmed.jsonl";

/// The shapes of the plan `fingerprint` that a finished pass compiled into
/// the cache `dir` (`record_warmed`). A cache with no CubeCL entry holds
/// none, whatever the record says (it was emptied).
pub fn warmed(dir: &Path, fingerprint: &str) -> Vec<Shape> {
    if !has_entries(dir) {
        return Vec::new();
    }
    let Ok(text) = std::fs::read_to_string(dir.join(WARMED)) else {
        return Vec::new();
    };
    let mut out: Vec<Shape> = Vec::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
            continue; // a line cut short by a killed process
        };
        if v["plan"].as_str() != Some(fingerprint) {
            continue;
        }
        if let Ok(s) = serde_json::from_value::<Shape>(v["shape"].clone()) {
            if !out.contains(&s) {
                out.push(s);
            }
        }
    }
    out
}

/// Add `shapes` of the plan `fingerprint` to the record of `dir`. The record
/// only saves a message later, so failing to write it is not an error of
/// the run; the error is returned for the caller to mention.
pub fn record_warmed(dir: &Path, fingerprint: &str, shapes: &[Shape]) -> std::io::Result<()> {
    use std::io::Write;
    let known = warmed(dir, fingerprint);
    let mut text = String::new();
    for s in shapes.iter().filter(|s| !known.contains(s)) {
        text.push_str(&serde_json::json!({ "plan": fingerprint, "shape": s }).to_string());
        text.push('\n');
    }
    if text.is_empty() {
        return Ok(());
    }
    std::fs::create_dir_all(dir)?;
    // One write of whole lines in append mode: concurrent runs interleave
    // lines, never parts of them.
    std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(WARMED))?
        .write_all(text.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::shapes::Pass;

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rcoa-kc-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    #[test]
    fn counts_cubecl_entries_by_line_and_nothing_else() {
        let d = tmp("count");
        assert_eq!(count_entries(&d), 0);
        let ptx = d.join("cuda/0.10.0");
        let tune = d.join("autotune/0.10.0/cuda-0");
        std::fs::create_dir_all(&ptx).unwrap();
        std::fs::create_dir_all(&tune).unwrap();
        std::fs::write(
            ptx.join("ptx.json.log"),
            "{\"a\":1}\n{\"b\":2}\n{\"c\":3}\n",
        )
        .unwrap();
        std::fs::write(tune.join("matmul.json.log"), "{\"k\":1}\n").unwrap();
        std::fs::write(tune.join("matmul.json.log.lock"), "x\ny\n").unwrap();
        std::fs::write(d.join(WARMED), "{}\n{}\n").unwrap();
        assert_eq!(count_entries(&d), 4);
        assert!(has_entries(&d));
        std::fs::write(ptx.join("ptx.json.log"), "").unwrap();
        std::fs::write(tune.join("matmul.json.log"), "").unwrap();
        assert_eq!(count_entries(&d), 0);
        assert!(
            !has_entries(&d),
            "the record and lock files are not CubeCL's entries"
        );
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn tunings_are_copied_where_the_recording_reads_them_and_nothing_else() {
        let d = tmp("tunings-from");
        let to = tmp("tunings-to");
        assert_eq!(copy_tunings(&d, &to).unwrap(), 0, "no cache, nothing");
        let tune = d.join("autotune/0.10.0/cuda-0");
        std::fs::create_dir_all(&tune).unwrap();
        std::fs::create_dir_all(d.join("cuda/0.10.0")).unwrap();
        std::fs::write(tune.join("matmul.json.log"), "{\"k\":1}\n{\"k\":2}\n").unwrap();
        std::fs::write(tune.join("reduce.json.log"), "{\"k\":3}\n").unwrap();
        std::fs::write(tune.join("matmul.json.log.lock"), "x\n").unwrap();
        std::fs::write(d.join("cuda/0.10.0/ptx.json.log"), "{\"p\":1}\n").unwrap();
        assert_eq!(copy_tunings(&d, &to).unwrap(), 3);
        let copied = to.join("autotune/0.10.0/cuda-0");
        assert_eq!(
            std::fs::read_to_string(copied.join("matmul.json.log")).unwrap(),
            "{\"k\":1}\n{\"k\":2}\n"
        );
        assert!(copied.join("reduce.json.log").exists());
        assert!(!copied.join("matmul.json.log.lock").exists());
        assert!(!to.join("cuda").exists(), "kernels are not tunings");
        assert_eq!(count_entries(&to), 3);
        std::fs::remove_dir_all(&d).unwrap();
        std::fs::remove_dir_all(&to).unwrap();
    }

    #[test]
    fn the_record_keeps_shapes_per_plan_and_forgets_them_with_the_cache() {
        let d = tmp("record");
        let a = Shape {
            pass: Pass::Train,
            rows: 8,
            seq: 2048,
            padded: false,
        };
        let b = Shape {
            pass: Pass::Eval,
            rows: 3,
            seq: 2048,
            padded: false,
        };
        std::fs::create_dir_all(d.join("cuda")).unwrap();
        std::fs::write(d.join("cuda/ptx.json.log"), "{}\n").unwrap();
        record_warmed(&d, "p1", &[a, b]).unwrap();
        record_warmed(&d, "p1", &[a]).unwrap();
        record_warmed(&d, "p2", &[b]).unwrap();
        assert_eq!(warmed(&d, "p1"), vec![a, b]);
        assert_eq!(warmed(&d, "p2"), vec![b]);
        assert!(warmed(&d, "p3").is_empty());
        // No duplicate line was appended for `a`.
        let lines = std::fs::read_to_string(d.join(WARMED)).unwrap();
        assert_eq!(lines.lines().count(), 3);
        // A torn last line is skipped, not an error.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(d.join(WARMED))
            .unwrap();
        std::io::Write::write_all(&mut f, b"{\"plan\":\"p1\",\"sha").unwrap();
        assert_eq!(warmed(&d, "p1"), vec![a, b]);
        // CubeCL's entries gone: nothing is warm.
        std::fs::remove_dir_all(d.join("cuda")).unwrap();
        assert!(warmed(&d, "p1").is_empty());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_users_driver_cache_settings_win() {
        let root = Path::new("/c");
        let all = driver_jit_env(root, |_| false);
        assert_eq!(
            all,
            vec![
                ("CUDA_CACHE_PATH", "/c/driver-jit".to_string()),
                ("CUDA_CACHE_MAXSIZE", "4294967296".to_string())
            ]
        );
        let theirs = driver_jit_env(root, |v| v == "CUDA_CACHE_PATH");
        assert_eq!(
            theirs,
            vec![("CUDA_CACHE_MAXSIZE", "4294967296".to_string())]
        );
    }
}
