//! The compile phase's worker processes: NVRTC holds a process-wide lock
//! for part of every compile, so the phase runs it in copies of `rcoa`
//! started with [`JOB_VAR`] (`Workers::Processes`), one per job slot. The
//! parent writes each kernel's job to a file, names it on the worker's stdin,
//! and reads the result back from a file once the worker says it is written.

use std::path::{Path, PathBuf};

#[cfg(feature = "cuda")]
use super::{header_set, ScratchDir};

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
pub(super) fn compile_here(
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

/// The compile phase's worker processes (`Workers::Processes`): one per job
/// slot, started at the slot's first kernel (and again after one ends), and
/// ended with the phase. A slot keeps its worker, so the precompiled headers
/// that worker wrote serve the kernels `HeaderAffinity` sends that slot.
#[cfg(feature = "cuda")]
pub(super) struct WorkerPool<'a> {
    command: (&'a Path, &'a [String]),
    pub(super) dir: ScratchDir,
    slots: Vec<std::sync::Mutex<Option<Worker>>>,
    names: std::sync::atomic::AtomicUsize,
    /// SIGPIPE's disposition before the pool, put back after it: while it
    /// lives, a write to a worker that has died is an error (`rcoa`'s `main`
    /// lets SIGPIPE end the process, for `rcoa check | head`).
    #[cfg(unix)]
    sigpipe: libc::sighandler_t,
}

#[cfg(feature = "cuda")]
impl<'a> WorkerPool<'a> {
    pub(super) fn new(program: &'a Path, args: &'a [String], slots: usize) -> Option<Self> {
        let dir = ScratchDir::create("rcoa-nvrtc-jobs")?;
        Some(WorkerPool {
            command: (program, args),
            dir,
            slots: (0..slots.max(1))
                .map(|_| std::sync::Mutex::new(None))
                .collect(),
            names: std::sync::atomic::AtomicUsize::new(0),
            // SAFETY: only SIGPIPE's disposition changes, to ignore (Rust's own
            // default), and `drop` puts the previous one back.
            #[cfg(unix)]
            sigpipe: unsafe { libc::signal(libc::SIGPIPE, libc::SIG_IGN) },
        })
    }

    /// Whether `slot` has a worker: false before its first kernel, and after
    /// its worker ended or could not be started (its headers went with it).
    pub(super) fn has_worker(&self, slot: usize) -> bool {
        self.slots[slot].lock().is_ok_and(|w| w.is_some())
    }

    /// `slot`'s worker's process id, for the tests.
    #[cfg(test)]
    pub(super) fn worker_id(&self, slot: usize) -> Option<u32> {
        self.slots[slot]
            .lock()
            .ok()
            .and_then(|w| w.as_ref().map(|w| w.child.id()))
    }

    /// `kernel` compiled by `slot`'s worker (with its set's precompiled
    /// header where `precompile`), started if the slot has none; on the
    /// calling thread if none can be started.
    pub(super) fn compile(
        &self,
        slot: usize,
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
        let mut held = self.slots[slot].lock().unwrap_or_else(|e| e.into_inner());
        if written.is_ok() && held.is_none() {
            *held = Worker::start(self.command, &self.dir.0).ok();
        }
        let Some(worker) = held.as_mut().filter(|_| written.is_ok()) else {
            let _ = std::fs::remove_file(&job_file);
            return compile_here(kernel, None);
        };
        let ran = worker.run(&name);
        let _ = std::fs::remove_file(&job_file);
        let result = std::fs::read(&out_file);
        let _ = std::fs::remove_file(&out_file);
        if let Err(e) = ran {
            let ended = held.take().map(Worker::ended).unwrap_or_default();
            return Err(format!("{ended} ({e})"));
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
        for slot in &mut self.slots {
            let worker = slot.get_mut().map(Option::take).unwrap_or_default();
            if let Some(w) = worker {
                drop(w.jobs);
                let mut child = w.child;
                let _ = child.wait();
            }
        }
        // SAFETY: puts back the disposition `new` found.
        #[cfg(unix)]
        unsafe {
            libc::signal(libc::SIGPIPE, self.sigpipe);
        }
    }
}
