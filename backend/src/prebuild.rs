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

#[cfg(any(test, feature = "cuda"))]
mod affinity;
mod workers;

#[cfg(feature = "cuda")]
use affinity::HeaderAffinity;
#[cfg(feature = "cuda")]
use workers::{compile_here, WorkerPool};
pub use workers::{serve_compile_worker, JOB_VAR};

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
    run_slots(
        jobs.clamp(1, items.len().max(1)),
        |_| {
            let i = next.fetch_add(1, Ordering::Relaxed);
            items.get(i).map(|item| (i, item))
        },
        |_, (i, item)| (i, compile(item)),
        |(i, r)| done(i, r),
    );
}

/// `slots` threads, thread `s` running `work(s, job)` on each job `next(s)`
/// gives it until it gives none; each result goes to `done` on the calling
/// thread as it arrives.
fn run_slots<J, R: Send>(
    slots: usize,
    next: impl Fn(usize) -> Option<J> + Sync,
    work: impl Fn(usize, J) -> R + Sync,
    mut done: impl FnMut(R),
) {
    std::thread::scope(|scope| {
        let (tx, rx) = std::sync::mpsc::channel();
        for slot in 0..slots.max(1) {
            let tx = tx.clone();
            let (next, work) = (&next, &work);
            scope.spawn(move || {
                while let Some(job) = next(slot) {
                    if tx.send(work(slot, job)).is_err() {
                        break;
                    }
                }
            });
        }
        drop(tx);
        for r in rx {
            done(r);
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

/// CUDA: the kernels this process compiled with NVRTC when they were
/// launched (cache misses), in launch order, each with the seconds it held
/// up the device's thread. After compiling ahead: what the recording
/// missed, and what that cost the first step. `None` without the CUDA build.
pub fn compiled_at_launch() -> Option<Vec<(String, f64)>> {
    #[cfg(feature = "cuda")]
    {
        Some(
            cubecl::cuda::prebuild::compiled_at_launch()
                .into_iter()
                .map(|c| (c.entrypoint_name, c.seconds))
                .collect(),
        )
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
    /// that includes them ([`PrecompiledHeaders`], or each worker's own);
    /// 0 where NVRTC has no precompiled headers (before CUDA 12.8).
    pub precompiled_headers: usize,
    /// Precompiled headers written: one per set with threads, one per set
    /// and worker holding it with processes (`HeaderAffinity`).
    pub headers_written: usize,
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
        Workers::Processes { program, args } => WorkerPool::new(program, args, threads),
        Workers::Threads => None,
    };
    // Threads share this process's precompiled headers, written here first;
    // each worker process writes its own, for the sets `affinity` sends it.
    let headers = match &pool {
        Some(_) => PrecompiledHeaders::none(),
        None => PrecompiledHeaders::create(&todo, threads),
    };
    let sets: Vec<HeaderSet> = todo.iter().map(|k| header_set(k)).collect();
    let affinity = HeaderAffinity::new(
        &sets,
        threads,
        pool.is_some() && cubecl::cuda::prebuild::precompiled_headers_supported(),
    );
    run_slots(
        threads,
        |slot| affinity.next(slot),
        |slot, (i, precompile)| {
            let (k, start) = (todo[i], std::time::Instant::now());
            let image = match &pool {
                Some(pool) => {
                    let image = pool.compile(slot, k, precompile);
                    if !pool.has_worker(slot) {
                        affinity.lost(slot);
                    }
                    image
                }
                None => compile_here(k, headers.of(k)),
            };
            (i, start.elapsed().as_secs_f64(), image)
        },
        |(i, secs, image)| {
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
    // Threads: the phase's own headers; processes: the workers'.
    let (precompiled_headers, headers_written) = match &pool {
        Some(_) => affinity.headers(),
        None => (headers.len(), headers.len()),
    };
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
        precompiled_headers,
        headers_written,
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
        let sets = shared_header_sets(kernels);
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

/// The header sets that two or more of `kernels` share, in the order first
/// met: those worth a precompiled header in this process (writing one costs
/// about a compile and saves most of each later one).
#[cfg(feature = "cuda")]
fn shared_header_sets<'a>(
    kernels: &[&'a cubecl::cuda::prebuild::RecordedKernel],
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
        .filter(|&(_, n)| n >= 2)
        .map(|(set, _)| set)
        .collect()
}

/// The [`SLOWEST`] longest of `times`, longest first.
pub fn slowest(mut times: Vec<(String, f64)>) -> Vec<(String, f64)> {
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
        let pool = WorkerPool::new(&program, &args, 2).unwrap();
        assert!(!pool.has_worker(0) && !pool.has_worker(1));
        let mut ids = Vec::new();
        for _ in 0..2 {
            let there = pool.compile(0, &k, false).unwrap();
            assert!(
                there.cubin && there.bytes == here.bytes,
                "the cubins differ"
            );
            ids.push(pool.worker_id(0));
        }
        // One worker served both jobs of its slot, and left nothing in its
        // directory; the other slot started none.
        assert!(ids[0].is_some() && ids[0] == ids[1], "{ids:?}");
        assert!(!pool.has_worker(1));
        assert_eq!(std::fs::read_dir(&pool.dir.0).unwrap().count(), 0);
        // A header set to precompile: the worker writes its own header (NVRTC
        // reads only those its own process wrote) and keeps it for the next
        // kernel of the set; the cubins are the same.
        if prebuild::precompiled_headers_supported() {
            let heavy = barrier_kernel();
            let here = prebuild::compile(&heavy).unwrap();
            for _ in 0..2 {
                let there = pool.compile(0, &heavy, true).unwrap();
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
        let nowhere = WorkerPool::new(Path::new("/nonexistent/rcoa"), &[], 1).unwrap();
        assert!(nowhere.compile(0, &k, false).unwrap().bytes == here.bytes);
        assert!(!nowhere.has_worker(0));
        // One that ends without doing its job: how it ended is the error,
        // the slot has no worker (the phase then forgets its headers), and
        // the next job gets a new worker.
        let quits = WorkerPool::new(Path::new("true"), &[], 1).unwrap();
        for _ in 0..2 {
            let Err(e) = quits.compile(0, &k, false) else {
                panic!("`true` did no job, yet a result was read");
            };
            assert!(
                e.starts_with("the compile worker ended with exit status: 0"),
                "{e}"
            );
            assert!(!quits.has_worker(0));
        }
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
        // The seven share their headers: parsed once where NVRTC can, in
        // this process, or in each worker that two or more of the kernels
        // left for each holder make worth it: 7 >= 2 and 6 >= 4 for the first
        // two workers to start (one, if one worker took four before the
        // second started), never 5 >= 6 for the third.
        let pch = usize::from(prebuild::precompiled_headers_supported());
        assert_eq!(r.precompiled_headers, pch);
        let writes = if noun == "processes" { 1..=2 } else { 1..=1 };
        assert!(
            writes.contains(&r.headers_written) || pch == 0 && r.headers_written == 0,
            "{} headers written",
            r.headers_written
        );
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
        let sets = shared_header_sets(&[&a, &c, &b, &d]);
        assert_eq!(
            sets,
            vec![("#include <cuda_bf16.h>\n", a.options.as_slice())]
        );
        assert!(shared_header_sets(&[&a, &c]).is_empty());
    }
}
