//! What `rcoa run` says on CUDA while a pass compiles kernels: before the
//! first pass of each shape the kernel cache lacks, a line on stderr
//! (`rcoa_backend::shapes::notices`), then a spinner with the elapsed time
//! until the pass ends; afterwards the shapes are recorded as warm in the
//! cache (`kernel_cache::record_warmed`), so the next run stays quiet about
//! them. On the CPU nothing of this happens (no `Compiling` event).

use indicatif::{ProgressBar, ProgressStyle};
use rcoa_backend::kernel_cache;
use rcoa_backend::shapes::{self, Notice, Pass, Shape};
use rcoa_compiler::lowered::LoweredPlan;
use std::path::PathBuf;
use std::time::Duration;

pub struct CompileNotice {
    /// Print and spin (text mode, the process that talks to the user).
    show: bool,
    fingerprint: String,
    /// The kernel cache, once the CUDA executor named it.
    cache: Option<PathBuf>,
    entries: u64,
    shapes: Vec<Shape>,
    pending: Vec<Notice>,
    /// The pass whose notice is up, its spinner turning.
    spinning: Option<Pass>,
}

impl CompileNotice {
    pub fn new(plan: &LoweredPlan, ranks: u64, show: bool) -> Self {
        CompileNotice {
            show,
            fingerprint: kernel_cache::plan_fingerprint(plan, ranks),
            cache: None,
            entries: 0,
            shapes: Vec::new(),
            pending: Vec::new(),
            spinning: None,
        }
    }

    /// The CUDA executor configured its kernel cache `dir`.
    pub fn compiling(&mut self, dir: PathBuf, entries: u64) {
        self.cache = Some(dir);
        self.entries = entries;
    }

    /// The model is built; `shapes` are what the run will compute. The first
    /// pass is the evaluation when the run has one, else the first step.
    pub fn started(&mut self, shapes: &[Shape], bar: Option<&ProgressBar>) {
        let Some(dir) = &self.cache else { return };
        self.shapes = shapes.to_vec();
        let warmed = kernel_cache::warmed(dir, &self.fingerprint);
        self.pending = shapes::notices(shapes, &warmed, dir, self.entries);
        let first = if shapes.iter().any(|s| s.pass == Pass::Eval) {
            Pass::Eval
        } else {
            Pass::Train
        };
        self.announce(first, bar);
    }

    /// The first `pass` ended: its shapes are cached now. The first step
    /// follows the first evaluation.
    pub fn finished(&mut self, pass: Pass, bar: Option<&ProgressBar>) {
        let Some(dir) = &self.cache else { return };
        let done: Vec<Shape> = self
            .shapes
            .iter()
            .filter(|s| s.pass == pass)
            .copied()
            .collect();
        if !done.is_empty() {
            self.shapes.retain(|s| s.pass != pass);
            if let Err(e) = kernel_cache::record_warmed(dir, &self.fingerprint, &done) {
                if self.show {
                    let line = format!(
                        "note: cannot record the compiled shapes in {}: {e}",
                        dir.display()
                    );
                    match bar {
                        Some(b) => b.println(line),
                        None => eprintln!("{line}"),
                    }
                }
            }
        }
        if self.spinning == Some(pass) {
            self.spinning = None;
            if let Some(b) = bar {
                b.disable_steady_tick();
                b.set_style(step_bar_style());
                b.set_message("");
            }
        }
        if pass == Pass::Eval {
            self.announce(Pass::Train, bar);
        }
    }

    fn announce(&mut self, pass: Pass, bar: Option<&ProgressBar>) {
        let Some(i) = self.pending.iter().position(|n| n.pass == pass) else {
            return;
        };
        let notice = self.pending.remove(i);
        if !self.show {
            return;
        }
        match bar {
            Some(b) => {
                b.println(&notice.line);
                b.set_style(
                    ProgressStyle::with_template("{spinner} {elapsed} {msg}")
                        .unwrap_or_else(|_| ProgressStyle::default_spinner()),
                );
                let what = match pass {
                    Pass::Eval => "the first evaluation",
                    Pass::Train => "the first step",
                };
                b.set_message(format!("compiling kernels for {what}"));
                b.enable_steady_tick(Duration::from_millis(200));
                self.spinning = Some(pass);
            }
            None => eprintln!("{}", notice.line),
        }
    }
}

/// The style of `rcoa run`'s step bar.
pub fn step_bar_style() -> ProgressStyle {
    ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
}
