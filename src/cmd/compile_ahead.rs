//! Compiling a run's CUDA kernels on every core before its first step
//! (`rcoa_backend::prebuild`): `rcoa warmup` always does, `rcoa run` when
//! the kernel cache holds nothing for the plan. The recording pass runs in
//! a child process (`rcoa warmup PLAN --record-kernels FILE`): its device
//! state is garbage afterwards. Every failure here only loses the head
//! start: a note on stderr, and the steps compile as CubeCL always does.

use super::run::Autotune;
use rcoa_backend::prebuild::CompileReport;
use std::path::PathBuf;
use std::time::Duration;

/// `--compile-jobs`: the threads NVRTC runs on; default this machine's cores.
pub fn jobs(arg: Option<u32>) -> usize {
    arg.map_or_else(
        || std::thread::available_parallelism().map_or(1, |n| n.get()),
        |n| n as usize,
    )
}

/// What the recording pass needs to launch what the run will: the run's
/// plan, ranks, data and evaluation files and autotune level.
pub struct Recording {
    pub plan: PathBuf,
    pub devices: u32,
    pub data: Option<PathBuf>,
    pub eval: Option<PathBuf>,
    pub autotune: Option<Autotune>,
}

pub struct Prebuilt {
    pub record_seconds: f64,
    pub compile: CompileReport,
}

impl Prebuilt {
    /// One line: what was compiled, on how many threads, in how long.
    pub fn summary(&self) -> String {
        let c = &self.compile;
        format!(
            "{} kernels compiled on {} threads in {:.1} s ({} as cubins), of {} recorded in {:.1} s{}",
            c.compiled,
            c.threads,
            c.seconds,
            c.cubins,
            c.recorded,
            self.record_seconds,
            if c.cached > 0 {
                format!(" ({} already cached)", c.cached)
            } else {
                String::new()
            }
        )
    }

    /// Kernels NVRTC refused, on stderr.
    pub fn notes(&self) {
        let failed = &self.compile.failed;
        if !failed.is_empty() {
            eprintln!(
                "note: NVRTC refused {} recorded kernel(s); the steps meet them as a run does (the tuner skips a candidate that does not build): {}",
                failed.len(),
                failed.join("; ")
            );
        }
    }

    pub fn json(&self) -> serde_json::Value {
        let c = &self.compile;
        serde_json::json!({
            "event": "compiled_ahead", "recorded": c.recorded, "cached": c.cached,
            "compiled": c.compiled, "cubins": c.cubins, "failed": c.failed.len(),
            "threads": c.threads, "record_seconds": self.record_seconds,
            "compile_seconds": c.seconds,
        })
    }
}

impl Recording {
    /// Record the kernels (a child process), then compile them on `jobs`
    /// threads into the cache. Nothing with one job, or without the CUDA
    /// build (the steps say so themselves).
    pub fn compile(&self, jobs: usize) -> Option<Prebuilt> {
        if jobs <= 1 || !rcoa_backend::CUDA_BUILT {
            return None;
        }
        let give_up = |why: String| {
            eprintln!("note: {why}; the kernels compile one at a time in the first step instead");
            None
        };
        let exe = match std::env::current_exe() {
            Ok(e) => e,
            Err(e) => {
                return give_up(format!(
                    "cannot find this program to record the kernels: {e}"
                ))
            }
        };
        let file = std::env::temp_dir().join(format!("rcoa-kernels-{}.jsonl", std::process::id()));
        let mut child = std::process::Command::new(exe);
        child
            .arg("warmup")
            .arg(&self.plan)
            .args(["--device", "cuda", "--devices", &self.devices.to_string()])
            .arg("--record-kernels")
            .arg(&file)
            .args(["--compile-jobs", &jobs.to_string()])
            .stdout(std::process::Stdio::null())
            // Its memory samples are of a run that computed nothing; they
            // would sit among the real run's in the same stderr.
            .env_remove("RCOA_MEMORY_TRACE");
        if let Some(d) = &self.data {
            child.arg("--data").arg(d);
        }
        if let Some(e) = &self.eval {
            child.arg("--eval").arg(e);
        }
        if let Some(a) = self.autotune {
            child.args(["--autotune", a.level().as_str()]);
        }
        eprintln!(
            "compiling kernels ahead on {jobs} threads: first, recording what the steps launch (running none)"
        );
        let start = std::time::Instant::now();
        let status = child.status();
        let record_seconds = start.elapsed().as_secs_f64();
        match status {
            Ok(s) if s.success() => {}
            Ok(s) if file.exists() => {
                eprintln!("note: the recording pass ended with {s}; compiling what it recorded")
            }
            Ok(s) => return give_up(format!("the recording pass failed ({s})")),
            Err(e) => return give_up(format!("the recording pass could not start: {e}")),
        }
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {elapsed:>4} NVRTC on {msg} threads: {pos}/{len} kernels",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(jobs.to_string());
        bar.enable_steady_tick(Duration::from_millis(200));
        let result = rcoa_backend::prebuild::compile_recorded(&file, jobs, &mut |done, total| {
            bar.set_length(total as u64);
            bar.set_position(done as u64);
        });
        bar.finish_and_clear();
        let _ = std::fs::remove_file(&file);
        match result {
            Ok(compile) => Some(Prebuilt {
                record_seconds,
                compile,
            }),
            Err(e) => give_up(format!("compiling ahead failed: {e}")),
        }
    }
}
