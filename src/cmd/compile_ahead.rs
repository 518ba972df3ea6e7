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

/// How long the recording pass may take. It runs two steps' host work with no
/// kernel executed, then lowers the kernels on every core: seconds to a few
/// minutes. Past this something is stuck; the run goes on without it.
const RECORD_LIMIT: Duration = Duration::from_secs(20 * 60);

/// `child`'s exit status, or `None` (and the child killed) after `limit`.
fn wait_at_most(
    mut child: std::process::Child,
    limit: Duration,
) -> Option<std::process::ExitStatus> {
    let start = std::time::Instant::now();
    loop {
        match child.try_wait() {
            Ok(Some(status)) => return Some(status),
            Ok(None) if start.elapsed() < limit => std::thread::sleep(Duration::from_millis(50)),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
        }
    }
}

/// Makes `cmd`'s process die with the thread that spawns it (Linux's
/// parent-death signal). A `rcoa run` killed by a timeout must not leave its
/// recording pass holding the GPU for up to [`RECORD_LIMIT`]; the thread
/// that spawns it waits for it, so it outlives the child otherwise.
fn dies_with_parent(cmd: &mut std::process::Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: runs in the forked child before exec, calling only the
        // async-signal-safe prctl and getppid.
        unsafe {
            cmd.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                // The parent died before the signal was set: nothing will send it.
                if libc::getppid() != parent {
                    return Err(std::io::Error::other(
                        "rcoa exited before its recording pass started",
                    ));
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = cmd;
}

/// `--compile-jobs`: how many NVRTC compiles run at once (each in a worker process);
/// default this machine's cores.
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
    /// One line: what was compiled, on how many processes (or threads), in how long.
    pub fn summary(&self) -> String {
        let c = &self.compile;
        format!(
            "{} kernels compiled on {} {} in {:.1} s ({} as cubins, {} header sets precompiled), of {} recorded in {:.1} s{}",
            c.compiled,
            c.threads,
            c.workers,
            c.seconds,
            c.cubins,
            c.precompiled_headers,
            c.recorded,
            self.record_seconds,
            if c.cached > 0 {
                format!(" ({} already cached)", c.cached)
            } else {
                String::new()
            }
        )
    }

    /// The longest compiles and the kernels NVRTC refused, on stderr.
    pub fn notes(&self) {
        if let Some(line) = self.slowest() {
            eprintln!("{line}");
        }
        let failed = &self.compile.failed;
        if !failed.is_empty() {
            eprintln!(
                "note: NVRTC refused {} recorded kernel(s); the steps meet them as a run does (the tuner skips a candidate that does not build): {}",
                failed.len(),
                failed.join("; ")
            );
        }
    }

    /// `slowest compiles: NAME 12.3 s, ...`: what bounds the compile phase from below.
    fn slowest(&self) -> Option<String> {
        let s = &self.compile.slowest;
        (!s.is_empty()).then(|| format!("slowest compiles: {}", named_times(s)))
    }

    pub fn json(&self) -> serde_json::Value {
        let c = &self.compile;
        serde_json::json!({
            "event": "compiled_ahead", "recorded": c.recorded, "cached": c.cached,
            "compiled": c.compiled, "cubins": c.cubins, "failed": c.failed.len(),
            "threads": c.threads, "workers": c.workers, "precompiled_headers": c.precompiled_headers,
            "headers_written": c.headers_written,
            "record_seconds": self.record_seconds,
            "compile_seconds": c.seconds,
            "slowest": named_times_json(&c.slowest),
        })
    }
}

/// `NAME 12.3 s, NAME 2.0 s`.
fn named_times(times: &[(String, f64)]) -> String {
    let each: Vec<String> = times.iter().map(|(k, t)| format!("{k} {t:.1} s")).collect();
    each.join(", ")
}

/// `[{"kernel": NAME, "seconds": 12.3}, ...]`.
fn named_times_json(times: &[(String, f64)]) -> serde_json::Value {
    times
        .iter()
        .map(|(k, t)| serde_json::json!({"kernel": k, "seconds": t}))
        .collect()
}

/// The kernels the steps compiled at their first launch (CUDA): after
/// compiling ahead, what the recording missed. Each held up the device's
/// thread in the step that met it, so their time is part of the first
/// step's; naming them says what the recording must learn to reach.
pub struct AtLaunch(Vec<(String, f64)>);

impl AtLaunch {
    /// This process's, where rcoa was built with CUDA.
    pub fn now() -> Option<AtLaunch> {
        rcoa_backend::prebuild::compiled_at_launch().map(AtLaunch)
    }

    fn seconds(&self) -> f64 {
        self.0.iter().map(|(_, t)| t).sum()
    }

    fn slowest(&self) -> Vec<(String, f64)> {
        rcoa_backend::prebuild::slowest(self.0.clone())
    }

    /// `N compiled at their first launch (not cached or compiled ahead)`,
    /// then their time and the slowest, where there were any.
    pub fn line(&self) -> String {
        let n = self.0.len();
        let mut line = format!("{n} compiled at their first launch (not cached or compiled ahead)");
        if n > 0 {
            let slowest = self.slowest();
            line += &format!(
                ", {:.1} s in all; {}: {}",
                self.seconds(),
                if n > slowest.len() { "slowest" } else { "each" },
                named_times(&slowest)
            );
        }
        line
    }

    /// The summary's `kernels_compiled_at_launch` (a count, as before),
    /// `kernels_compiled_at_launch_seconds` and `kernels_compiled_at_launch_slowest`.
    pub fn add_to(&self, summary: &mut serde_json::Value) {
        summary["kernels_compiled_at_launch"] = self.0.len().into();
        summary["kernels_compiled_at_launch_seconds"] = self.seconds().into();
        summary["kernels_compiled_at_launch_slowest"] = named_times_json(&self.slowest());
    }
}

impl Recording {
    /// Record the kernels (a child process), then compile them `jobs` at a
    /// time into the cache. Nothing with one job, or without the CUDA
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
        dies_with_parent(&mut child);
        if let Some(d) = &self.data {
            child.arg("--data").arg(d);
        }
        if let Some(e) = &self.eval {
            child.arg("--eval").arg(e);
        }
        if let Some(a) = self.autotune {
            child.args(["--autotune", a.level().as_str()]);
        }
        let workers = rcoa_backend::prebuild::Workers::this_program();
        eprintln!(
            "compiling kernels ahead, {jobs} at a time in {}: first, recording what the steps launch (running none)",
            workers.noun()
        );
        let start = std::time::Instant::now();
        let status = match child.spawn() {
            Ok(c) => wait_at_most(c, RECORD_LIMIT),
            Err(e) => return give_up(format!("the recording pass could not start: {e}")),
        };
        let record_seconds = start.elapsed().as_secs_f64();
        match status {
            Some(s) if s.success() => {}
            Some(s) if file.exists() => {
                eprintln!("note: the recording pass ended with {s}; compiling what it recorded")
            }
            Some(s) => return give_up(format!("the recording pass failed ({s})")),
            None => {
                return give_up(format!(
                    "the recording pass was stopped after {} s",
                    RECORD_LIMIT.as_secs()
                ))
            }
        }
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{spinner} {elapsed:>4} NVRTC in {msg}: {pos}/{len} kernels",
            )
            .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
        );
        bar.set_message(format!("{jobs} {}", workers.noun()));
        bar.enable_steady_tick(Duration::from_millis(200));
        let result =
            rcoa_backend::prebuild::compile_recorded(&file, jobs, &workers, &mut |done, total| {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_names_what_speed_py_and_the_docs_read() {
        let p = Prebuilt {
            record_seconds: 8.25,
            compile: CompileReport {
                dir: PathBuf::from("/cache/h100"),
                recorded: 412,
                cached: 2,
                compiled: 409,
                cubins: 409,
                failed: vec!["k: error".into()],
                threads: 16,
                workers: "processes",
                precompiled_headers: 4,
                headers_written: 9,
                seconds: 21.5,
                slowest: vec![("matmul_a".into(), 9.25), ("fuse_b".into(), 2.0)],
            },
        };
        assert_eq!(
            p.summary(),
            "409 kernels compiled on 16 processes in 21.5 s (409 as cubins, 4 header sets precompiled), of 412 recorded in 8.2 s (2 already cached)"
        );
        // backend/bench/speed.py adds these two; docs/cold-start.md lists them all.
        let j = p.json();
        assert_eq!(j["event"], "compiled_ahead");
        assert_eq!(j["record_seconds"], 8.25);
        assert_eq!(j["compile_seconds"], 21.5);
        for key in [
            "recorded",
            "cached",
            "compiled",
            "cubins",
            "failed",
            "threads",
            "precompiled_headers",
            "headers_written",
        ] {
            assert!(j[key].is_u64(), "{key} in {j}");
        }
        assert_eq!(j["failed"], 1);
        assert_eq!(j["workers"], "processes");
        assert_eq!(j["slowest"][0]["kernel"], "matmul_a");
        assert_eq!(j["slowest"][1]["seconds"], 2.0);
        assert_eq!(
            p.slowest().as_deref(),
            Some("slowest compiles: matmul_a 9.2 s, fuse_b 2.0 s")
        );
    }

    #[test]
    fn kernels_compiled_at_launch_are_counted_timed_and_the_slowest_named() {
        let none = AtLaunch(Vec::new());
        assert_eq!(
            none.line(),
            "0 compiled at their first launch (not cached or compiled ahead)"
        );
        let mut j = serde_json::json!({"event": "summary"});
        none.add_to(&mut j);
        assert_eq!(j["kernels_compiled_at_launch"], 0);
        assert_eq!(j["kernels_compiled_at_launch_seconds"], 0.0);
        assert_eq!(
            j["kernels_compiled_at_launch_slowest"],
            serde_json::json!([])
        );

        let two = AtLaunch(vec![("fuse_a".into(), 0.5), ("matmul_b".into(), 1.75)]);
        assert_eq!(
            two.line(),
            "2 compiled at their first launch (not cached or compiled ahead), 2.2 s in all; each: matmul_b 1.8 s, fuse_a 0.5 s"
        );
        let seven = AtLaunch((0..7).map(|i| (format!("k{i}"), f64::from(i))).collect());
        assert!(
            seven.line().ends_with(
                "21.0 s in all; slowest: k6 6.0 s, k5 5.0 s, k4 4.0 s, k3 3.0 s, k2 2.0 s"
            ),
            "{}",
            seven.line()
        );
        let mut j = serde_json::json!({"event": "summary"});
        seven.add_to(&mut j);
        assert_eq!(j["kernels_compiled_at_launch"], 7);
        assert_eq!(j["kernels_compiled_at_launch_seconds"], 21.0);
        let slowest = j["kernels_compiled_at_launch_slowest"].as_array().unwrap();
        assert_eq!(slowest.len(), rcoa_backend::prebuild::SLOWEST);
        assert_eq!(
            slowest[0],
            serde_json::json!({"kernel": "k6", "seconds": 6.0})
        );
    }

    #[test]
    fn a_child_past_its_limit_is_stopped_and_one_within_it_is_waited_for() {
        let sleep = |secs: &str| {
            std::process::Command::new("sleep")
                .arg(secs)
                .spawn()
                .unwrap()
        };
        let start = std::time::Instant::now();
        assert_eq!(wait_at_most(sleep("30"), Duration::from_millis(200)), None);
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "killed, not waited for"
        );
        let status = wait_at_most(sleep("0"), Duration::from_secs(30)).unwrap();
        assert!(status.success());
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_recording_child_dies_with_what_spawned_it() {
        // The spawning thread ends at once: the parent-death signal fires
        // then (for `rcoa run`, when the process is killed).
        let child = std::thread::spawn(|| {
            let mut cmd = std::process::Command::new("sleep");
            cmd.arg("30");
            dies_with_parent(&mut cmd);
            cmd.spawn().unwrap()
        })
        .join()
        .unwrap();
        let start = std::time::Instant::now();
        let status = wait_at_most(child, Duration::from_secs(20)).expect("killed, not timed out");
        assert!(start.elapsed() < Duration::from_secs(10));
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(status.signal(), Some(libc::SIGKILL));
    }
}
