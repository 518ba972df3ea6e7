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
    /// Returns the line announced, if any.
    pub fn started(&mut self, shapes: &[Shape], bar: Option<&ProgressBar>) -> Option<String> {
        let Some(dir) = &self.cache else {
            return None;
        };
        self.shapes = shapes.to_vec();
        let warmed = kernel_cache::warmed(dir, &self.fingerprint);
        self.pending = shapes::notices(shapes, &warmed, dir, self.entries);
        let first = if shapes.iter().any(|s| s.pass == Pass::Eval) {
            Pass::Eval
        } else {
            Pass::Train
        };
        self.announce(first, bar)
    }

    /// The first `pass` ended: its shapes are cached now. The first step
    /// follows the first evaluation. Returns the line announced, if any.
    pub fn finished(&mut self, pass: Pass, bar: Option<&ProgressBar>) -> Option<String> {
        let Some(dir) = &self.cache else {
            return None;
        };
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
                    say(bar, &line);
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
            return self.announce(Pass::Train, bar);
        }
        None
    }

    fn announce(&mut self, pass: Pass, bar: Option<&ProgressBar>) -> Option<String> {
        let i = self.pending.iter().position(|n| n.pass == pass)?;
        let notice = self.pending.remove(i);
        if !self.show {
            return Some(notice.line);
        }
        say(bar, &notice.line);
        if let Some(b) = bar {
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
        Some(notice.line)
    }
}

/// A line on stderr above the bar. `ProgressBar::println` prints nothing
/// when stderr is not a terminal (a log file), and these lines matter there.
fn say(bar: Option<&ProgressBar>, line: &str) {
    match bar {
        Some(b) => b.suspend(|| eprintln!("{line}")),
        None => eprintln!("{line}"),
    }
}

/// The style of `rcoa run`'s step bar.
pub fn step_bar_style() -> ProgressStyle {
    ProgressStyle::with_template("{bar:30} {pos}/{len} steps  {msg}")
        .unwrap_or_else(|_| ProgressStyle::default_bar())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(pass: Pass, rows: usize) -> Shape {
        Shape {
            pass,
            rows,
            seq: 32,
            padded: false,
        }
    }

    #[test]
    fn each_new_shape_is_announced_before_its_pass_and_a_second_run_is_quiet() {
        let dir = std::env::temp_dir().join(format!("rcoa-notice-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let plan = rcoa_backend::testing::tiny_plan();
        let shapes = [
            shape(Pass::Eval, 4),
            shape(Pass::Eval, 3),
            shape(Pass::Train, 4),
        ];
        // The CPU: no kernel cache, nothing said.
        let mut cpu = CompileNotice::new(&plan, 1, false);
        assert_eq!(cpu.started(&shapes, None), None);
        assert_eq!(cpu.finished(Pass::Eval, None), None);

        // An empty cache: the evaluation runs first, then the first step.
        let mut run = CompileNotice::new(&plan, 1, false);
        run.compiling(dir.clone(), 0);
        let eval = run.started(&shapes, None).expect("the evaluation compiles");
        assert!(
            eval.starts_with(
                "compiling kernels for the first evaluation (eval batch 4 × 32, eval batch 3 × 32)"
            ),
            "{eval}"
        );
        // CubeCL wrote its entries meanwhile.
        std::fs::create_dir_all(dir.join("cuda")).unwrap();
        std::fs::write(dir.join("cuda/ptx.json.log"), "{}\n{}\n").unwrap();
        let step = run
            .finished(Pass::Eval, None)
            .expect("then the step compiles");
        assert!(
            step.starts_with("compiling kernels for the first step (micro-batch 4 × 32); cache "),
            "{step}"
        );
        assert_eq!(run.finished(Pass::Train, None), None);
        // Later evaluations say nothing more.
        assert_eq!(run.finished(Pass::Eval, None), None);

        // The next run of the plan finds every shape warm.
        let mut next = CompileNotice::new(&plan, 1, false);
        next.compiling(dir.clone(), 2);
        assert_eq!(next.started(&shapes, None), None);
        assert_eq!(next.finished(Pass::Eval, None), None);
        // Another plan (two ranks) is not warm.
        let mut other = CompileNotice::new(&plan, 2, false);
        other.compiling(dir.clone(), 2);
        assert!(other
            .started(&shapes, None)
            .unwrap()
            .contains("has 2 entries"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
