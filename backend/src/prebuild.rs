//! Compiling a run's CUDA kernels on every core, ahead of it
//! (`rcoa warmup`; docs/cold-start.md, "Compiling on every core").
//!
//! CubeCL 0.10 compiles each kernel with NVRTC at its first launch, on the
//! device's thread: a cold first step is hundreds of compilations in a row.
//! The kernels a run launches can only be found by running it, but not by
//! running it *correctly*: shapes, not values, choose them. So the warm-up
//! is split in three:
//!
//! 1. **Record** (`record`, in a process of its own): the warm-up's steps
//!    with every launch lowered to CUDA C++ and recorded instead of executed
//!    (`cubecl::cuda::prebuild`, a patch of the vendored cubecl-cuda). The
//!    process's values mean nothing and its tunings timed launches that did
//!    nothing, so it keeps nothing but the list of kernels.
//! 2. **Compile** (`compile_recorded`): NVRTC on all of them, `jobs` at a
//!    time, each to a cubin for this GPU; stored in CubeCL's PTX cache
//!    under the key a launch looks for.
//! 3. **Warm** (`crate::warmup`, unchanged): the steps again, for real. Every
//!    kernel is now a cache hit; what remains is autotune's measurements and
//!    whatever the recording missed, compiled as before.
//!
//! Phase 3 makes the caches exactly what a plain warm-up makes, so a wrong
//! or incomplete recording costs time, never correctness.

use crate::warmup::Progress;
use crate::{RunError, RunOptions};
use rcoa_compiler::lowered::LoweredPlan;
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::path::{Path, PathBuf};

/// This process is a recording pass (`record`): its values mean nothing
/// (reads give zeros, `cubecl::cuda::prebuild`), so work done only for them
/// is skipped.
pub(crate) fn recording() -> bool {
    #[cfg(feature = "cuda")]
    {
        cubecl::cuda::prebuild::recording()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// Write `items` to `path`, one JSON object per line.
pub fn write_records<T: Serialize>(path: &Path, items: &[T]) -> std::io::Result<()> {
    use std::io::Write;
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for item in items {
        serde_json::to_writer(&mut out, item)?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

/// Read what `write_records` wrote. A line that does not parse is an error
/// naming it: a record file is only ever written whole by rcoa.
pub fn read_records<T: DeserializeOwned>(path: &Path) -> Result<Vec<T>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read the recorded kernels {}: {e}", path.display()))?;
    text.lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
        .map(|(i, l)| {
            serde_json::from_str(l).map_err(|e| format!("{} line {}: {e}", path.display(), i + 1))
        })
        .collect()
}

/// Run `compile` on every item, `jobs` threads at a time, and hand each
/// result to `done` on the calling thread as it arrives (with the item's
/// index), so that whatever `done` writes needs no lock. Items are taken in
/// order; the results arrive in the order they finish.
pub fn compile_all<T: Sync, R: Send>(
    items: &[T],
    jobs: usize,
    compile: impl Fn(&T) -> R + Sync,
    mut done: impl FnMut(usize, R),
) {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let next = AtomicUsize::new(0);
    let threads = jobs.clamp(1, items.len().max(1));
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel();
        for _ in 0..threads {
            let tx = tx.clone();
            let (next, compile) = (&next, &compile);
            scope.spawn(move || loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                if tx.send((i, compile(item))).is_err() {
                    break;
                }
            });
        }
        drop(tx);
        for (i, r) in rx {
            done(i, r);
        }
    });
}

/// Where the compile phase runs NVRTC.
///
/// NVRTC takes a process-wide lock for part of every compile: a thread in
/// `nvrtcCompileProgram` waits in `pthread_mutex_lock` while another thread
/// compiles. On the 2-core machine that measured it (NVRTC 12.9 and 13.5),
/// two threads compiling kernels that include CUDA's barrier headers took
/// longer than one (12.6 s against 9.1 s for eight), where two processes
/// took 6.1 s (`docs/cold-start.md`, "A process per core"). The more
/// threads, the larger the share that waits: the H200's 16 threads compiled
/// the 350M plan's 272 kernels in 91 s, 5.4 s of thread time a kernel.
/// Processes share no lock.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Workers {
    /// NVRTC in this process, one compile per thread.
    Threads,
    /// NVRTC in worker processes, one per job slot, each compiling kernel
    /// after kernel (NVRTC's start-up and a precompiled header's load are
    /// paid once a worker): `program args…` started with [`JOB_VAR`] set,
    /// which [`serve_compile_worker`] serves. A kernel whose worker cannot be
    /// started is compiled on the calling thread.
    Processes { program: PathBuf, args: Vec<String> },
}

impl Workers {
    /// Worker processes, each this program (the `rcoa` binary, whose `main`
    /// serves [`JOB_VAR`] first); threads where this program cannot be
    /// named, or where `RCOA_COMPILE_THREADS=1` asks for them (to compare).
    pub fn this_program() -> Workers {
        if std::env::var("RCOA_COMPILE_THREADS").is_ok_and(|v| v == "1") {
            return Workers::Threads;
        }
        match std::env::current_exe() {
            Ok(program) => Workers::Processes {
                program,
                args: Vec::new(),
            },
            Err(_) => Workers::Threads,
        }
    }

    /// "processes" or "threads", for the run's messages.
    pub fn noun(&self) -> &'static str {
        match self {
            Workers::Threads => "threads",
            Workers::Processes { .. } => "processes",
        }
    }
}

/// The environment variable that makes a process a compile worker: the
/// directory of its jobs. The worker reads job names from stdin, one a
/// line. Job `NAME` is `DIR/NAME.json` (the kernel, and whether to
/// precompile its headers); its result goes to `DIR/NAME.out`, and then the worker writes
/// [`DONE`]` NAME` on a line of stdout. It ends at the end of stdin.
pub const JOB_VAR: &str = "RCOA_NVRTC_JOBS";

/// What a worker's line of stdout starts with when a job's result is
/// written (other lines, a test harness's, are not the worker's).
const DONE: &str = "rcoa-nvrtc-done";

/// If this process was started as a compile worker ([`JOB_VAR`]), serve it
/// and say how the process should end; otherwise `None` (call it first
/// thing in `main`). A result file holds `C` and a cubin, `P` and PTX, or
/// `E` and NVRTC's error.
pub fn serve_compile_worker() -> Option<std::process::ExitCode> {
    use std::io::{BufRead, Write};
    let dir = PathBuf::from(std::env::var_os(JOB_VAR)?);
    let mut jobs = JobCompiler::new(&dir);
    let mut stdout = std::io::stdout().lock();
    for name in std::io::stdin().lock().lines() {
        let Ok(name) = name else { break };
        let stem = dir.join(name.trim());
        let result = match jobs.run(&stem.with_extension("json")) {
            Ok((cubin, mut bytes)) => {
                bytes.insert(0, if cubin { b'C' } else { b'P' });
                bytes
            }
            Err(e) => [b"E".as_slice(), e.as_bytes()].concat(),
        };
        let told = std::fs::write(stem.with_extension("out"), result).and_then(|()| {
            writeln!(stdout, "{DONE} {}", name.trim())?;
            stdout.flush()
        });
        if told.is_err() {
            return Some(std::process::ExitCode::FAILURE);
        }
    }
    Some(std::process::ExitCode::SUCCESS)
}

/// A compile job: the kernel, and whether its header set is one that
/// several kernels of the phase share (so worth precompiling).
#[cfg(feature = "cuda")]
#[derive(serde::Serialize, serde::Deserialize)]
struct Job {
    kernel: cubecl::cuda::prebuild::RecordedKernel,
    precompile: bool,
}

/// A worker's compiles, with the precompiled headers it made itself: NVRTC
/// reads a precompiled header only in the process that wrote it ("not
/// created by the same dynamic instance of the NVRTC library", and the
/// headers parsed again), so each worker writes its own, once per header
/// set, into the jobs' directory.
#[cfg(feature = "cuda")]
struct JobCompiler {
    dir: PathBuf,
    /// Each header set met, and its precompiled header, if NVRTC wrote one.
    headers: Vec<(OwnedHeaderSet, Option<PathBuf>)>,
}

/// A [`HeaderSet`] a worker keeps: its includes and NVRTC options.
#[cfg(feature = "cuda")]
type OwnedHeaderSet = (String, Vec<String>);

#[cfg(feature = "cuda")]
impl JobCompiler {
    fn new(dir: &Path) -> Self {
        JobCompiler {
            dir: dir.to_path_buf(),
            headers: Vec::new(),
        }
    }

    fn run(&mut self, file: &Path) -> Result<(bool, Vec<u8>), String> {
        let text = std::fs::read_to_string(file)
            .map_err(|e| format!("cannot read the compile job {}: {e}", file.display()))?;
        let job: Job = serde_json::from_str(&text)
            .map_err(|e| format!("the compile job {}: {e}", file.display()))?;
        crate::cuda::compiler().map_err(|e| e.to_string())?;
        let pch = if job.precompile {
            self.header(&job.kernel)
        } else {
            None
        };
        let image = compile_here(&job.kernel, pch.as_deref())?;
        Ok((image.cubin, image.bytes.iter().map(|&b| b as u8).collect()))
    }

    /// This worker's precompiled header of `kernel`'s header set, written
    /// at the set's first kernel.
    fn header(&mut self, kernel: &cubecl::cuda::prebuild::RecordedKernel) -> Option<PathBuf> {
        let (prefix, options) = header_set(kernel);
        let set = (prefix.to_string(), options.to_vec());
        if let Some((_, pch)) = self.headers.iter().find(|(s, _)| *s == set) {
            return pch.clone();
        }
        let path = self.dir.join(format!(
            "headers-{}-{}.pch",
            std::process::id(),
            self.headers.len()
        ));
        let made = cubecl::cuda::prebuild::create_pch(prefix, options, &path).is_ok();
        let pch = made.then_some(path);
        self.headers.push((set, pch.clone()));
        pch
    }
}

#[cfg(feature = "cuda")]
impl Drop for JobCompiler {
    fn drop(&mut self) {
        for (_, pch) in &self.headers {
            if let Some(pch) = pch {
                let _ = std::fs::remove_file(pch);
            }
        }
    }
}

/// Without the CUDA build: every job is refused.
#[cfg(not(feature = "cuda"))]
struct JobCompiler;

#[cfg(not(feature = "cuda"))]
impl JobCompiler {
    fn new(_: &Path) -> Self {
        JobCompiler
    }

    fn run(&mut self, _: &Path) -> Result<(bool, Vec<u8>), String> {
        Err("this rcoa was built without CUDA: it has no NVRTC to compile with".into())
    }
}

/// NVRTC on `kernel` in this process, with its precompiled header if any.
#[cfg(feature = "cuda")]
fn compile_here(
    kernel: &cubecl::cuda::prebuild::RecordedKernel,
    pch: Option<&Path>,
) -> Result<cubecl::cuda::prebuild::Image, String> {
    match pch {
        Some(pch) => cubecl::cuda::prebuild::compile_with_pch(kernel, pch),
        None => cubecl::cuda::prebuild::compile(kernel),
    }
}

/// A compile worker process and its pipes.
#[cfg(feature = "cuda")]
struct Worker {
    child: std::process::Child,
    jobs: std::process::ChildStdin,
    done: std::io::BufReader<std::process::ChildStdout>,
}

#[cfg(feature = "cuda")]
impl Worker {
    fn start((program, args): (&Path, &[String]), dir: &Path) -> std::io::Result<Worker> {
        use std::process::Stdio;
        let mut child = std::process::Command::new(program)
            .args(args)
            .env(JOB_VAR, dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()?;
        let (jobs, done) = (child.stdin.take(), child.stdout.take());
        match (jobs, done) {
            (Some(jobs), Some(done)) => Ok(Worker {
                child,
                jobs,
                done: std::io::BufReader::new(done),
            }),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                Err(std::io::Error::other("the worker's pipes were not made"))
            }
        }
    }

    /// Job `name` (already written to the worker's directory): `Ok(())` once
    /// its result is written, `Err` if the worker ended first.
    fn run(&mut self, name: &str) -> std::io::Result<()> {
        use std::io::{BufRead, Write};
        writeln!(self.jobs, "{name}")?;
        self.jobs.flush()?;
        let mut line = String::new();
        loop {
            line.clear();
            if self.done.read_line(&mut line)? == 0 {
                return Err(std::io::ErrorKind::UnexpectedEof.into());
            }
            if line.trim_end() == format!("{DONE} {name}") {
                return Ok(());
            }
        }
    }

    /// The end of a worker that failed a job: how it ended.
    fn ended(mut self) -> String {
        drop(self.jobs);
        let _ = self.child.kill();
        match self.child.wait() {
            Ok(status) => format!("the compile worker ended with {status}"),
            Err(e) => format!("the compile worker was lost: {e}"),
        }
    }
}

/// The compile phase's worker processes (`Workers::Processes`): started as
/// jobs need them, at most one per job slot, and ended with the phase.
#[cfg(feature = "cuda")]
struct WorkerPool<'a> {
    command: (&'a Path, &'a [String]),
    dir: ScratchDir,
    idle: std::sync::Mutex<Vec<Worker>>,
    names: std::sync::atomic::AtomicUsize,
    /// SIGPIPE's disposition before the pool, put back after it: while it
    /// lives, a write to a worker that has died is an error (`rcoa`'s `main`
    /// lets SIGPIPE end the process, for `rcoa check | head`).
    #[cfg(unix)]
    sigpipe: libc::sighandler_t,
}

#[cfg(feature = "cuda")]
impl<'a> WorkerPool<'a> {
    fn new(program: &'a Path, args: &'a [String]) -> Option<Self> {
        let dir = ScratchDir::create("rcoa-nvrtc-jobs")?;
        Some(WorkerPool {
            command: (program, args),
            dir,
            idle: std::sync::Mutex::new(Vec::new()),
            names: std::sync::atomic::AtomicUsize::new(0),
            // SAFETY: only SIGPIPE's disposition changes, to ignore (Rust's own
            // default), and `drop` puts the previous one back.
            #[cfg(unix)]
            sigpipe: unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) },
        })
    }

    /// `kernel` compiled by an idle worker, or a new one; on the calling
    /// thread if none can be started.
    fn compile(
        &self,
        kernel: &cubecl::cuda::prebuild::RecordedKernel,
        precompile: bool,
    ) -> Result<cubecl::cuda::prebuild::Image, String> {
        let name = self
            .names
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed)
            .to_string();
        let stem = self.dir.0.join(&name);
        let (job_file, out_file) = (stem.with_extension("json"), stem.with_extension("out"));
        let job = Job {
            kernel: kernel.clone(),
            precompile,
        };
        let written = serde_json::to_vec(&job)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&job_file, bytes));
        let idle = self.idle.lock().map(|mut idle| idle.pop()).ok().flatten();
        let worker = match (written, idle) {
            (Ok(()), Some(w)) => Some(w),
            (Ok(()), None) => Worker::start(self.command, &self.dir.0).ok(),
            (Err(_), _) => None,
        };
        let Some(mut worker) = worker else {
            let _ = std::fs::remove_file(&job_file);
            return compile_here(kernel, None);
        };
        let ran = worker.run(&name);
        let _ = std::fs::remove_file(&job_file);
        let result = std::fs::read(&out_file);
        let _ = std::fs::remove_file(&out_file);
        if let Err(e) = ran {
            let ended = worker.ended();
            return Err(format!("{ended} ({e})"));
        }
        if let Ok(mut idle) = self.idle.lock() {
            idle.push(worker);
        }
        match result.as_deref() {
            Ok([tag @ (b'C' | b'P'), bytes @ ..]) => Ok(cubecl::cuda::prebuild::Image {
                bytes: bytes.iter().map(|&b| b as std::ffi::c_char).collect(),
                cubin: *tag == b'C',
            }),
            Ok([b'E', why @ ..]) => Err(String::from_utf8_lossy(why).into_owned()),
            Ok(_) => Err("the compile worker wrote an empty result".into()),
            Err(e) => Err(format!("the compile worker's result: {e}")),
        }
    }
}

#[cfg(feature = "cuda")]
impl Drop for WorkerPool<'_> {
    /// The end of stdin ends each worker; wait for them, so none outlives
    /// the phase.
    fn drop(&mut self) {
        let workers = self.idle.get_mut().map(std::mem::take).unwrap_or_default();
        for w in workers {
            drop(w.jobs);
            let mut child = w.child;
            let _ = child.wait();
        }
        // SAFETY: puts back the disposition `new` found.
        #[cfg(unix)]
        unsafe {
            libc::signal(libc::SIGPIPE, self.sigpipe);
        }
    }
}

/// Whether this GPU's kernel cache holds nothing warmed for `plan` run on
/// `ranks` ranks (`kernel_cache::warmed`): a run that compiles all its
/// kernels in its first pass. False without CUDA (the run says why itself).
pub fn cold_for(plan: &LoweredPlan, ranks: u64) -> bool {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::preflight().is_ok_and(|info| {
            let dir = crate::cuda::cache_dir(&info);
            let fingerprint = crate::kernel_cache::plan_fingerprint(plan, ranks);
            crate::kernel_cache::warmed(&dir, &fingerprint).is_empty()
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (plan, ranks);
        false
    }
}

/// CUDA: kernels this process compiled with NVRTC when they were launched
/// (cache misses). After compiling ahead: what the recording missed.
/// `None` without the CUDA build.
pub fn compiled_at_launch() -> Option<u64> {
    #[cfg(feature = "cuda")]
    {
        Some(cubecl::cuda::prebuild::compiled_at_launch() as u64)
    }
    #[cfg(not(feature = "cuda"))]
    {
        None
    }
}

/// What the recording pass did.
#[derive(Clone, Debug)]
pub struct RecordReport {
    /// Kernels recorded (those the PTX cache did not hold).
    pub kernels: usize,
    /// `kernel: why` for recorded launches that could not be lowered (or
    /// ask for more shared memory than the device has): a run's launch of
    /// them fails the same way, and an autotune candidate is then skipped.
    pub refused: Vec<String>,
    pub seconds: f64,
    /// The steps ended early with this error (values that mean nothing can
    /// break what a real run never meets); the kernels recorded before
    /// stand, and the real steps compile the rest.
    pub stopped: Option<String>,
}

/// Phase 1: the warm-up's steps with launches recorded, not executed; the
/// kernels, lowered to CUDA C++ on `jobs` threads, go to `out`
/// (`write_records`). Run it in a process of its own: the process's device
/// state is meaningless after.
pub fn record(
    plan: &LoweredPlan,
    opts: &RunOptions,
    out: &Path,
    jobs: usize,
    progress: Progress,
) -> Result<RecordReport, RunError> {
    #[cfg(feature = "cuda")]
    {
        let start = std::time::Instant::now();
        let autotune =
            std::env::temp_dir().join(format!("rcoa-record-autotune-{}", std::process::id()));
        crate::cuda::start_recording(autotune.clone());
        let (_, result) = crate::warmup::run_steps(plan, opts, true, progress);
        let (kernels, refused) = lower_recorded(jobs);
        let _ = std::fs::remove_dir_all(&autotune);
        let stopped = match result {
            // Nothing ran (no CUDA, a bad data file): the run's own error.
            Err(e) if kernels.is_empty() && refused.is_empty() => return Err(e),
            Err(e) => Some(e.to_string()),
            Ok(_) => None,
        };
        write_records(out, &kernels).map_err(|e| {
            RunError::Prebuild(format!(
                "cannot write the recorded kernels to {}: {e}",
                out.display()
            ))
        })?;
        Ok(RecordReport {
            kernels: kernels.len(),
            refused,
            seconds: start.elapsed().as_secs_f64(),
            stopped,
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (plan, opts, out, jobs, progress);
        Err(RunError::CudaNotBuilt)
    }
}

/// The recorded launches lowered to CUDA C++ on `jobs` threads, in launch
/// order, and `kernel: why` for those refused. CubeCL's expansion panics on
/// some configurations: that kernel is refused, the others still come out.
#[cfg(feature = "cuda")]
fn lower_recorded(jobs: usize) -> (Vec<cubecl::cuda::prebuild::RecordedKernel>, Vec<String>) {
    let pending = cubecl::cuda::prebuild::take_pending();
    let mut lowered: Vec<Option<Result<_, String>>> = pending.iter().map(|_| None).collect();
    compile_all(
        &pending,
        jobs,
        |p| {
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| p.lower()))
                .unwrap_or_else(|e| Err(crate::cuda::panic_text(e.as_ref())))
        },
        |i, r| lowered[i] = Some(r),
    );
    let (mut kernels, mut refused) = (Vec::new(), Vec::new());
    for (p, r) in pending.iter().zip(lowered) {
        match r {
            Some(Ok(k)) => kernels.push(k),
            Some(Err(why)) => refused.push(format!("{}: {why}", p.name())),
            None => {}
        }
    }
    (kernels, refused)
}

/// What the compile phase did.
#[derive(Clone, Debug)]
pub struct CompileReport {
    /// The kernel cache written (`cuda::cache_dir`).
    pub dir: PathBuf,
    pub recorded: usize,
    /// Recorded, but in the cache by the time of compiling.
    pub cached: usize,
    pub compiled: usize,
    /// Of `compiled`, those NVRTC gave as cubins (no driver JIT at load).
    pub cubins: usize,
    /// `entry point: first line of NVRTC's log`, for kernels NVRTC refused;
    /// the steps meet them as a run does (recording cannot tell an autotune
    /// candidate that does not build, which the tuner then skips).
    pub failed: Vec<String>,
    /// How many compiles ran at once, and in what (`Workers::noun`).
    pub threads: usize,
    pub workers: &'static str,
    /// Distinct header sets NVRTC parsed once and read back for each kernel
    /// that includes them ([`PrecompiledHeaders`]); 0 where NVRTC has no
    /// precompiled headers (before CUDA 12.8).
    pub precompiled_headers: usize,
    pub seconds: f64,
    /// The [`SLOWEST`] longest single compiles: `(entry point, seconds)`, longest first.
    /// The first bounds the phase from below however many threads there are.
    pub slowest: Vec<(String, f64)>,
}

/// How many of the longest compiles a [`CompileReport`] names.
pub const SLOWEST: usize = 5;

/// The order to compile `kernels` in: longest source first. With N threads the phase
/// lasts at least its longest compile, and a long one started last lasts past all the
/// others; on the 350M plan 272 kernels took 91 s on 16 threads (an H200, 2026-11-28f),
/// 5.4 s a kernel against 0.3 s for a flash kernel, so a few long ones are likely.
/// Source length stands in for compile time, which is not known before compiling.
#[cfg(any(test, feature = "cuda"))]
fn longest_first<K>(kernels: &mut [&K], len: impl Fn(&K) -> usize) {
    kernels.sort_by_key(|k| std::cmp::Reverse(len(k)));
}

/// Phase 2: NVRTC on the kernels `record` wrote to `file`, `jobs` at a time
/// in `workers`, into this GPU's kernel cache. `progress(done, total)` after each.
pub fn compile_recorded(
    file: &Path,
    jobs: usize,
    workers: &Workers,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CompileReport, RunError> {
    #[cfg(feature = "cuda")]
    {
        let start = std::time::Instant::now();
        let info = crate::cuda::preflight()?;
        compile_into(
            file,
            &crate::cuda::cache_dir(&info),
            jobs,
            workers,
            progress,
        )
        .map(|mut r| {
            r.seconds = start.elapsed().as_secs_f64();
            r
        })
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (file, jobs, workers, progress);
        Err(RunError::CudaNotBuilt)
    }
}

/// `compile_recorded` into the kernel cache `dir`. NVRTC needs no GPU, so
/// this runs wherever NVRTC and the CUDA headers are (`cuda::compiler`).
#[cfg(feature = "cuda")]
pub fn compile_into(
    file: &Path,
    dir: &Path,
    jobs: usize,
    workers: &Workers,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<CompileReport, RunError> {
    use cubecl::cuda::prebuild::{KernelCache, RecordedKernel};
    let start = std::time::Instant::now();
    crate::cuda::compiler()?;
    let dir = dir.to_path_buf();
    std::fs::create_dir_all(&dir).map_err(|e| {
        RunError::CudaUnavailable(format!(
            "cannot create the kernel cache {}: {e}",
            dir.display()
        ))
    })?;
    let kernels: Vec<RecordedKernel> = read_records(file).map_err(RunError::Prebuild)?;
    let mut cache = KernelCache::open(&dir);
    let mut todo: Vec<&RecordedKernel> = kernels.iter().filter(|k| !cache.contains(k)).collect();
    longest_first(&mut todo, |k| k.source.len());
    let threads = jobs.clamp(1, todo.len().max(1));
    let (mut compiled, mut cubins, mut failed, mut n) = (0, 0, Vec::new(), 0);
    let mut times = Vec::with_capacity(todo.len());
    progress(0, todo.len());
    let pool = match workers {
        Workers::Processes { program, args } => WorkerPool::new(program, args),
        Workers::Threads => None,
    };
    // Threads share this process's precompiled headers; each worker process
    // writes its own (`JobCompiler`) for the sets named here, so none are
    // written here for them.
    let (headers, shared) = match &pool {
        Some(_) if cubecl::cuda::prebuild::precompiled_headers_supported() => (
            PrecompiledHeaders::none(),
            shared_header_sets(&todo, 2 * threads),
        ),
        Some(_) => (PrecompiledHeaders::none(), Vec::new()),
        None => (PrecompiledHeaders::create(&todo, threads), Vec::new()),
    };
    compile_all(
        &todo,
        threads,
        |k| {
            let start = std::time::Instant::now();
            let image = match &pool {
                Some(pool) => pool.compile(k, shared.contains(&header_set(k))),
                None => compile_here(k, headers.of(k)),
            };
            (start.elapsed().as_secs_f64(), image)
        },
        |i, (secs, image)| {
            let k = todo[i];
            times.push((k.entrypoint_name.clone(), secs));
            match image.and_then(|image| {
                let cubin = image.cubin;
                cache.insert(k, image).map(|()| cubin)
            }) {
                Ok(cubin) => {
                    compiled += 1;
                    cubins += cubin as usize;
                }
                Err(e) => failed.push(format!(
                    "{}: {}",
                    k.entrypoint_name,
                    e.lines()
                        .find(|l| !l.trim().is_empty() && !l.starts_with('['))
                        .unwrap_or(&e)
                        .trim()
                )),
            }
            n += 1;
            progress(n, todo.len());
        },
    );
    Ok(CompileReport {
        dir,
        recorded: kernels.len(),
        cached: kernels.len() - todo.len(),
        compiled,
        cubins,
        failed,
        threads,
        workers: if pool.is_some() {
            workers.noun()
        } else {
            Workers::Threads.noun()
        },
        // One of the two is empty: the phase's own headers, or the workers'.
        precompiled_headers: headers.len() + shared.len(),
        seconds: start.elapsed().as_secs_f64(),
        slowest: slowest(times),
    })
}

/// NVRTC's precompiled headers for a compile phase, in a directory of their
/// own that goes with them: one per header set (`prebuild::header_prefix`)
/// and NVRTC options that two kernels or more share. A kernel's compile
/// parses its headers anew, and CUDA's are large: `cuda/barrier` and
/// cooperative groups, which CubeCL includes in every kernel that uses
/// barriers or TMA (the accelerated matmuls, their tuning candidates),
/// take 1.5 s of a 2 s compile on the CPU that wrote this, 0.3 s read back.
/// Compiling the flash kernels' 54 variants on 2 threads took 37 s with
/// them against 43 s without (NVRTC 12.9; `docs/cold-start.md`).
#[cfg(feature = "cuda")]
struct PrecompiledHeaders<'a> {
    /// Removed with them.
    _dir: Option<ScratchDir>,
    /// Each header set written, and its file.
    files: Vec<(HeaderSet<'a>, PathBuf)>,
}

/// A directory of a compile phase's own under the system's temporary one,
/// removed when dropped.
#[cfg(feature = "cuda")]
struct ScratchDir(PathBuf);

#[cfg(feature = "cuda")]
impl ScratchDir {
    /// `NAME-PID-N`: two compile phases of one process must not share one.
    fn create(name: &str) -> Option<ScratchDir> {
        static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("{name}-{}-{call}", std::process::id()));
        std::fs::create_dir_all(&dir).ok().map(|()| ScratchDir(dir))
    }
}

#[cfg(feature = "cuda")]
impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A kernel's leading includes (`prebuild::header_prefix`) and its NVRTC
/// options: what a precompiled header is made for.
#[cfg(feature = "cuda")]
type HeaderSet<'a> = (&'a str, &'a [String]);

#[cfg(feature = "cuda")]
fn header_set(kernel: &cubecl::cuda::prebuild::RecordedKernel) -> HeaderSet<'_> {
    (
        cubecl::cuda::prebuild::header_prefix(&kernel.source),
        kernel.options.as_slice(),
    )
}

#[cfg(feature = "cuda")]
impl<'a> PrecompiledHeaders<'a> {
    /// Writes them on `threads` threads, where NVRTC has them (12.8 and
    /// later). One that NVRTC does not write is left out: its kernels
    /// compile as before.
    fn none() -> Self {
        PrecompiledHeaders {
            _dir: None,
            files: Vec::new(),
        }
    }

    fn create(kernels: &[&'a cubecl::cuda::prebuild::RecordedKernel], threads: usize) -> Self {
        let mut headers = Self::none();
        if !cubecl::cuda::prebuild::precompiled_headers_supported() {
            return headers;
        }
        let sets = shared_header_sets(kernels, 2);
        if sets.is_empty() {
            return headers;
        }
        let Some(dir) = ScratchDir::create("rcoa-pch") else {
            return headers;
        };
        let jobs: Vec<(HeaderSet<'a>, PathBuf)> = sets
            .into_iter()
            .enumerate()
            .map(|(i, set)| (set, dir.0.join(format!("headers-{i}.pch"))))
            .collect();
        compile_all(
            &jobs,
            threads,
            |((prefix, options), path)| {
                cubecl::cuda::prebuild::create_pch(prefix, options, path).is_ok()
            },
            |i, made| {
                if made {
                    headers.files.push(jobs[i].clone());
                }
            },
        );
        headers._dir = Some(dir);
        headers
    }

    /// The precompiled header of `kernel`'s headers and options, if any.
    fn of(&self, kernel: &cubecl::cuda::prebuild::RecordedKernel) -> Option<&Path> {
        let set = header_set(kernel);
        self.files
            .iter()
            .find(|(s, _)| *s == set)
            .map(|(_, path)| path.as_path())
    }

    fn len(&self) -> usize {
        self.files.len()
    }
}

/// The header sets that `at_least` of `kernels` share, in the order first
/// met: those worth a precompiled header. Writing one costs about a compile
/// and saves most of each later one, so in this process (threads) two
/// kernels are enough; a set whose kernels are spread over N worker
/// processes, each writing its own, wants two a worker.
#[cfg(feature = "cuda")]
fn shared_header_sets<'a>(
    kernels: &[&'a cubecl::cuda::prebuild::RecordedKernel],
    at_least: usize,
) -> Vec<HeaderSet<'a>> {
    let mut sets: Vec<(HeaderSet<'a>, usize)> = Vec::new();
    for k in kernels {
        let set = header_set(k);
        match sets.iter_mut().find(|(s, _)| *s == set) {
            Some((_, n)) => *n += 1,
            None => sets.push((set, 1)),
        }
    }
    sets.into_iter()
        .filter(|&(_, n)| n >= at_least.max(2))
        .map(|(set, _)| set)
        .collect()
}

/// The [`SLOWEST`] longest of `times`, longest first.
#[cfg(any(test, feature = "cuda"))]
fn slowest(mut times: Vec<(String, f64)>) -> Vec<(String, f64)> {
    times.sort_by(|a, b| b.1.total_cmp(&a.1));
    times.truncate(SLOWEST);
    times
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn every_item_is_compiled_once_and_its_result_reaches_the_caller() {
        let items: Vec<u64> = (0..37).collect();
        for jobs in [1, 4, 100] {
            let calls = Mutex::new(Vec::new());
            let mut got = vec![None; items.len()];
            compile_all(
                &items,
                jobs,
                |&x| {
                    calls.lock().unwrap().push(x);
                    x * x
                },
                |i, r| {
                    assert!(got[i].is_none(), "item {i} delivered twice");
                    got[i] = Some(r);
                },
            );
            let mut calls = calls.into_inner().unwrap();
            calls.sort();
            assert_eq!(calls, items, "jobs {jobs}");
            assert_eq!(
                got,
                items.iter().map(|x| Some(x * x)).collect::<Vec<_>>(),
                "jobs {jobs}"
            );
        }
        compile_all(&[] as &[u8], 8, |_| (), |_, _| panic!("nothing to deliver"));
    }

    #[test]
    fn the_threads_compile_at_the_same_time() {
        // Four items that each wait until all four are being compiled: with
        // one thread per item this ends; compiled one at a time it would not.
        let started = std::sync::Barrier::new(4);
        let mut n = 0;
        compile_all(&[0; 4], 4, |_| started.wait(), |_, _| n += 1);
        assert_eq!(n, 4);
    }

    #[derive(Debug, PartialEq, serde::Serialize, serde::Deserialize)]
    struct K {
        hash: String,
        source: String,
    }

    #[test]
    fn the_longest_sources_compile_first_and_the_slowest_are_named() {
        let sources = ["ab", "abcdef", "", "abcd"];
        let mut order: Vec<&&str> = sources.iter().collect();
        longest_first(&mut order, |s| s.len());
        assert_eq!(order, [&"abcdef", &"abcd", &"ab", &""]);
        let times: Vec<(String, f64)> = (0..8).map(|i| (format!("k{i}"), (i % 5) as f64)).collect();
        let top = slowest(times);
        assert_eq!(top.len(), SLOWEST);
        assert_eq!(top[0].1, 4.0);
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(slowest(Vec::new()).is_empty());
    }

    #[test]
    fn records_round_trip_and_a_damaged_line_is_named() {
        let dir = std::env::temp_dir().join(format!("rcoa-prebuild-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kernels.jsonl");
        let ks = vec![
            K {
                hash: "00ff".into(),
                source: "extern \"C\" __global__ void k() {\n}\n".into(),
            },
            K {
                hash: "0a".into(),
                source: String::new(),
            },
        ];
        write_records(&path, &ks).unwrap();
        assert_eq!(read_records::<K>(&path).unwrap(), ks);
        assert_eq!(
            std::fs::read_to_string(&path).unwrap().lines().count(),
            2,
            "one kernel per line"
        );
        std::fs::write(&path, "{\"hash\":\"1\",\"source\":\"\"}\n{\"hash\":2}\n").unwrap();
        let e = read_records::<K>(&path).unwrap_err();
        assert!(e.contains("line 2"), "{e}");
        let e = read_records::<K>(&dir.join("missing.jsonl")).unwrap_err();
        assert!(e.contains("cannot read the recorded kernels"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn without_the_cuda_build_there_is_nothing_to_record_or_compile() {
        let plan = crate::testing::tiny_plan();
        let out = std::env::temp_dir().join("rcoa-prebuild-never-written.jsonl");
        let e = record(
            &plan,
            &RunOptions::default(),
            &out,
            2,
            std::sync::Arc::new(|_: &str| {}),
        )
        .unwrap_err();
        assert!(matches!(e, RunError::CudaNotBuilt), "{e}");
        assert!(!out.exists());
        let e = compile_recorded(&out, 4, &Workers::Threads, &mut |_, _| {}).unwrap_err();
        assert!(matches!(e, RunError::CudaNotBuilt), "{e}");
        assert!(!cold_for(&plan, 1), "no CUDA: nothing to compile ahead");
        assert_eq!(compiled_at_launch(), None);
    }
}

/// NVRTC needs no GPU: with the CUDA toolkit, or NVRTC and the headers from
/// PyPI (`tools/nvrtc_from_pypi.sh`, which `.ci/run` calls), the compile
/// phase runs on any machine. Without them these print `SKIPPED` and pass.
#[cfg(all(test, feature = "cuda"))]
mod nvrtc_tests {
    use super::*;
    use cubecl::cuda::prebuild::{self, KernelCache, RecordedKernel};

    /// A kernel as CubeCL's CUDA dialect writes one: C linkage, bf16 from the
    /// toolkit's headers, and CubeCL's options (which name the toolkit's include paths).
    fn kernel(name: &str, body: &str) -> RecordedKernel {
        kernel_with(name, body, prebuild::nvrtc_options(90))
    }

    fn kernel_with(name: &str, body: &str, options: Vec<String>) -> RecordedKernel {
        RecordedKernel {
            hash: format!(
                "{:032x}",
                name.bytes().fold(0u128, |h, b| h * 131 + b as u128)
            ),
            entrypoint_name: name.to_string(),
            shared_mem_bytes: 0,
            source: format!(
                "#include <cuda_bf16.h>\n\
                 extern \"C\" __global__ void {name}(__nv_bfloat16* x, float s, unsigned n) {{\n\
                 unsigned i = blockIdx.x * blockDim.x + threadIdx.x;\n\
                 if (i < n) {{ {body} }}\n}}\n"
            ),
            options,
        }
    }

    fn nvrtc() -> bool {
        match crate::cuda::compiler() {
            Ok(_) => true,
            Err(e) => {
                crate::testing::skip("nvrtc", &e.to_string());
                false
            }
        }
    }

    /// The compile workers of these tests: this test binary, started with
    /// [`JOB_VAR`] and the name of [`compile_job_entry`].
    fn this_test_binary() -> Workers {
        Workers::Processes {
            program: std::env::current_exe().unwrap(),
            args: [
                "prebuild::nvrtc_tests::compile_job_entry",
                "--exact",
                "--ignored",
                "--quiet",
                "--test-threads",
                "1",
            ]
            .map(String::from)
            .to_vec(),
        }
    }

    /// The entry point of [`this_test_binary`]'s workers, as `main` is the
    /// `rcoa` binary's: compile jobs until the end of stdin.
    #[test]
    #[ignore = "an entry point: the compile-worker tests start it with RCOA_NVRTC_JOBS set"]
    fn compile_job_entry() {
        serve_compile_worker();
    }

    #[test]
    fn recorded_kernels_compile_on_threads_to_cubins_the_kernel_cache_keeps() {
        compiled_into_the_kernel_cache(&Workers::Threads, "threads");
    }

    /// The same in worker processes, which NVRTC's process-wide lock does
    /// not slow (`Workers`): the same cubins, NVRTC's errors carried back.
    #[test]
    fn recorded_kernels_compile_in_processes_to_the_same_cubins() {
        compiled_into_the_kernel_cache(&this_test_binary(), "processes");
        if !nvrtc() {
            return;
        }
        let Workers::Processes { program, args } = this_test_binary() else {
            unreachable!()
        };
        let k = kernel(
            "rcoa_scale",
            "x[i] = __float2bfloat16(__bfloat162float(x[i]) * s);",
        );
        let here = prebuild::compile(&k).unwrap();
        let pool = WorkerPool::new(&program, &args).unwrap();
        for _ in 0..2 {
            let there = pool.compile(&k, false).unwrap();
            assert!(
                there.cubin && there.bytes == here.bytes,
                "the cubins differ"
            );
        }
        // One worker served both jobs, and left nothing in its directory.
        assert_eq!(pool.idle.lock().unwrap().len(), 1);
        assert_eq!(std::fs::read_dir(&pool.dir.0).unwrap().count(), 0);
        // A header set to precompile: the worker writes its own header (NVRTC
        // reads only those its own process wrote) and keeps it for the next
        // kernel of the set; the cubins are the same.
        if prebuild::precompiled_headers_supported() {
            let heavy = barrier_kernel();
            let here = prebuild::compile(&heavy).unwrap();
            for _ in 0..2 {
                let there = pool.compile(&heavy, true).unwrap();
                assert!(there.bytes == here.bytes, "the cubins differ");
            }
            let files: Vec<String> = std::fs::read_dir(&pool.dir.0)
                .unwrap()
                .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
                .collect();
            assert!(
                files.len() == 1 && files[0].starts_with("headers-") && files[0].ends_with(".pch"),
                "{files:?}"
            );
        }
        let dir = pool.dir.0.clone();
        drop(pool);
        assert!(!dir.exists());
        // A worker that cannot start: the kernel is compiled here instead.
        let nowhere = WorkerPool::new(Path::new("/nonexistent/rcoa"), &[]).unwrap();
        assert!(nowhere.compile(&k, false).unwrap().bytes == here.bytes);
        // One that ends without doing its job: how it ended is the error,
        // and the next job gets a new worker.
        let quits = WorkerPool::new(Path::new("true"), &[]).unwrap();
        for _ in 0..2 {
            let Err(e) = quits.compile(&k, false) else {
                panic!("`true` did no job, yet a result was read");
            };
            assert!(
                e.starts_with("the compile worker ended with exit status: 0"),
                "{e}"
            );
        }
        assert!(quits.idle.lock().unwrap().is_empty());
    }

    fn compiled_into_the_kernel_cache(workers: &Workers, noun: &str) {
        if !nvrtc() {
            return;
        }
        let good = "x[i] = __float2bfloat16(__bfloat162float(x[i]) * s);";
        let image = prebuild::compile(&kernel("rcoa_scale", good)).unwrap();
        // sm_90a is a real architecture: NVRTC ran ptxas and gave an ELF cubin.
        assert!(image.cubin);
        let magic: Vec<u8> = image.bytes[..4].iter().map(|&b| b as u8).collect();
        assert_eq!(magic, b"\x7fELF");

        let dir = std::env::temp_dir().join(format!("rcoa-nvrtc-{noun}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let mut ks: Vec<RecordedKernel> = (0..6)
            .map(|i| kernel(&format!("rcoa_k{i}"), good))
            .collect();
        // NVRTC's refusal names the error; it is counted, not fatal.
        ks.push(kernel("rcoa_broken", "x[i] = no_such_function(s);"));
        let file = dir.join("kernels.jsonl");
        write_records(&file, &ks).unwrap();
        let cache_dir = dir.join("cache");
        let mut seen = Vec::new();
        let r = compile_into(&file, &cache_dir, 3, workers, &mut |done, total| {
            seen.push((done, total))
        })
        .unwrap();
        assert_eq!((r.recorded, r.cached, r.compiled, r.cubins), (7, 0, 6, 6));
        assert_eq!((r.threads, r.workers), (3, noun));
        // The seven share their headers: parsed once where NVRTC can.
        let pch = usize::from(prebuild::precompiled_headers_supported());
        assert_eq!(r.precompiled_headers, pch);
        assert_eq!(r.failed.len(), 1, "{:?}", r.failed);
        assert!(
            r.failed[0].starts_with("rcoa_broken: ") && r.failed[0].contains("no_such_function"),
            "{:?}",
            r.failed
        );
        assert_eq!(seen.first(), Some(&(0, 7)));
        assert_eq!(seen.last(), Some(&(7, 7)));
        // Every compile was timed (the refused one too); the longest are named.
        assert_eq!(r.slowest.len(), SLOWEST);
        assert!(r.slowest.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!(r
            .slowest
            .iter()
            .all(|(name, s)| name.starts_with("rcoa_") && *s > 0.0));
        // A later process finds them where a launch looks, under their keys;
        // compiling again finds everything cached but the broken one.
        let cache = KernelCache::open(&cache_dir);
        assert!(ks[..6].iter().all(|k| cache.contains(k)));
        assert!(!cache.contains(&ks[6]));
        drop(cache);
        let again = compile_into(&file, &cache_dir, 3, workers, &mut |_, _| {}).unwrap();
        assert_eq!(
            (again.cached, again.compiled, again.failed.len()),
            (6, 0, 1)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The heaviest headers CubeCL writes: the barriers'.
    const BARRIER_HEADERS: &str = "#include <cuda_runtime.h>\n#include <cuda_bf16.h>\n\
                                   #include <cooperative_groups.h>\n#include <cuda/barrier>\n";

    fn barrier_kernel() -> RecordedKernel {
        let mut k = kernel(
            "rcoa_scale",
            "x[i] = __float2bfloat16(__bfloat162float(x[i]) * s);",
        );
        k.source = format!(
            "{BARRIER_HEADERS}{}",
            k.source.replace("#include <cuda_bf16.h>\n", "")
        );
        k
    }

    /// A kernel read with its headers precompiled compiles to the same bytes
    /// as without them, for the heaviest headers CubeCL writes (barriers).
    #[test]
    fn a_precompiled_header_changes_nothing_but_the_time() {
        if !nvrtc() {
            return;
        }
        if !prebuild::precompiled_headers_supported() {
            crate::testing::skip("nvrtc", "NVRTC before 12.8 has no precompiled headers");
            return;
        }
        let k = barrier_kernel();
        let headers = BARRIER_HEADERS;
        assert_eq!(prebuild::header_prefix(&k.source), headers);
        let dir = std::env::temp_dir().join(format!("rcoa-pch-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let pch = dir.join("h.pch");
        prebuild::create_pch(headers, &k.options, &pch).unwrap();
        let with = prebuild::compile_with_pch(&k, &pch).unwrap();
        let without = prebuild::compile(&k).unwrap();
        assert!(with.cubin && without.cubin);
        assert!(with.bytes == without.bytes, "the cubins differ");
        // A header file NVRTC cannot read costs the kernel nothing.
        let missing = prebuild::compile_with_pch(&k, &dir.join("none.pch")).unwrap();
        assert!(missing.bytes == without.bytes);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Only header sets (with their options) that two kernels share get a
    /// precompiled header. Grouping needs no NVRTC, so this runs without CUDA too.
    #[test]
    fn header_sets_shared_by_two_kernels_are_the_ones_precompiled() {
        let kernel =
            |name| kernel_with(name, "x[i] = s;", vec!["--gpu-architecture=sm_90a".into()]);
        let a = kernel("rcoa_a");
        let b = kernel("rcoa_b");
        let mut c = kernel("rcoa_c");
        c.source = format!("#include <mma.h>\n{}", c.source);
        let mut d = kernel("rcoa_d");
        d.options.push("-G".to_string());
        let sets = shared_header_sets(&[&a, &c, &b, &d], 2);
        assert_eq!(
            sets,
            vec![("#include <cuda_bf16.h>\n", a.options.as_slice())]
        );
        assert!(shared_header_sets(&[&a, &c], 2).is_empty());
        // Spread over three workers, two kernels are not worth a header each.
        assert!(shared_header_sets(&[&a, &c, &b, &d], 6).is_empty());
        assert_eq!(shared_header_sets(&[&a, &b, &a, &b, &a, &b], 6).len(), 1);
    }
}
