//! `rcoa warmup`: compile and tune, ahead of a run, the kernels the run will
//! need, by running the run itself briefly on a throwaway model.
//!
//! CubeCL 0.10 has no ahead-of-time compilation: NVRTC compiles each kernel
//! when it is first launched, on the device's thread, and autotune measures
//! its candidates when an op first meets a new tuning key. So the only way to
//! fill the caches is to launch what the run launches. Warm-up runs the
//! executor's own code (`execute_ranks`: the model, the step with the plan's
//! recomputation, precision, ZeRO and offload, the evaluation), with:
//! - two optimizer steps: the first creates the optimizer state and the
//!   second updates it, which are other kernels;
//! - at most two micro-batches per step: the first gradient is stored and
//!   the second added, which is another kernel; more add nothing new;
//! - the `--data` file, when given: a pairs file's padding masks are other
//!   kernels (`shapes`);
//! - the `--eval` file, when given, evaluated as the run does (before the
//!   first step and after the last): its full batches and its short last
//!   one;
//! - nothing saved: no checkpoint, and the weights are dropped at the end.
//!   Only the kernel caches (and their record of warmed shapes,
//!   `kernel_cache::record_warmed`) change.
//!
//! On the CPU the same steps run; ndarray compiles nothing, so there is
//! nothing to keep.

use crate::kernel_cache;
use crate::memory::MemoryProbe;
use crate::shapes::{Pass, Shape};
use crate::{Event, RunError, RunOptions};
use rcoa_compiler::lowered::LoweredPlan;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Optimizer steps a warm-up runs (see the module header).
pub const STEPS: u64 = 2;
/// Micro-batches per step at most (see the module header).
pub const MAX_GRAD_ACCUM: u64 = 2;

/// Where warm-up reports what it is doing: one line, replaced as it goes
/// (`micro-batch 8 × 2048 · step 1 of 2 · forward:layer3`).
pub type Progress = Arc<dyn Fn(&str) + Send + Sync>;

/// What a warm-up did.
#[derive(Clone, Debug)]
pub struct WarmupReport {
    pub device: String,
    /// The shapes it ran, in order (`shapes::of_run`).
    pub shapes: Vec<Shape>,
    pub seconds: f64,
    /// CUDA: the kernel cache and its entries before and after.
    pub cache: Option<CacheReport>,
}

#[derive(Clone, Debug)]
pub struct CacheReport {
    pub dir: PathBuf,
    pub entries_before: u64,
    pub entries_after: u64,
    /// The record of warmed shapes could not be written (the run will
    /// announce compilation it does not do).
    pub record_error: Option<String>,
}

/// The plan a warm-up runs: the run's, with at most `MAX_GRAD_ACCUM`
/// micro-batches per step.
pub fn warm_plan(plan: &LoweredPlan) -> LoweredPlan {
    let mut p = plan.clone();
    p.resolved.grad_accum = p.resolved.grad_accum.clamp(1, MAX_GRAD_ACCUM);
    p
}

/// The options a warm-up runs with: the run's data, evaluation, tokenizer,
/// seed and ranks; `STEPS` steps; nothing saved, resumed or evaluated
/// between the first evaluation and the last.
pub fn warm_options(opts: &RunOptions) -> RunOptions {
    RunOptions {
        steps: STEPS,
        seed: opts.seed,
        data: opts.data.clone(),
        tokenizer: opts.tokenizer.clone(),
        eval: opts.eval.clone(),
        eval_every: None,
        save: None,
        save_every: None,
        hf_save: Default::default(),
        resume: None,
        distributed: opts.distributed.clone(),
    }
}

// ------------------------------------------------------------- progress

/// What the progress line says now: the pass and its shapes; the probes
/// append the point in the step (`MemoryProbe::at`). The executor's probe
/// factories are plain functions, so the line's sink is process-wide; one
/// warm-up runs at a time (`ACTIVE`).
struct Line {
    report: Progress,
    context: String,
}

static LINE: Mutex<Option<Line>> = Mutex::new(None);
static ACTIVE: Mutex<()> = Mutex::new(());

fn set_context(context: String) {
    let mut line = LINE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = line.as_mut() {
        (l.report)(&context);
        l.context = context;
    }
}

fn at(point: &str) {
    let line = LINE.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(l) = line.as_ref() {
        (l.report)(&format!("{} · {point}", l.context));
    }
}

/// A rank's probe that also moves the progress line.
pub(crate) struct Reporting(pub(crate) Box<dyn MemoryProbe>);

impl MemoryProbe for Reporting {
    fn sample(&mut self) -> u64 {
        self.0.sample()
    }
    fn begin_step(&mut self) {
        self.0.begin_step()
    }
    fn step_peak(&self) -> u64 {
        self.0.step_peak()
    }
    fn peak(&self) -> u64 {
        self.0.peak()
    }
    fn peak_reserved(&self) -> Option<u64> {
        self.0.peak_reserved()
    }
    fn what(&self) -> &'static str {
        self.0.what()
    }
    fn at(&mut self, point: &dyn Fn() -> String) {
        at(&point());
    }
}

fn list(shapes: &[Shape], pass: Pass) -> String {
    let v: Vec<String> = shapes
        .iter()
        .filter(|s| s.pass == pass)
        .map(Shape::to_string)
        .collect();
    v.join(", ")
}

/// Follows the run's events to name the pass under way.
pub(crate) struct Follow {
    pub(crate) shapes: Vec<Shape>,
    pub(crate) device: String,
    /// CUDA: the kernel cache and its entries when the run began.
    pub(crate) cache: Option<(PathBuf, u64)>,
}

impl Follow {
    fn on(&mut self, e: Event) {
        match e {
            Event::Compiling { dir, entries, .. } => self.cache = Some((dir, entries)),
            Event::Started(s) => {
                self.device = s.device;
                self.shapes = s.shapes;
                if self.shapes.iter().any(|s| s.pass == Pass::Eval) {
                    set_context(format!(
                        "{} · evaluation (forward)",
                        list(&self.shapes, Pass::Eval)
                    ));
                } else {
                    self.step(1);
                }
            }
            Event::Eval(r) if r.step == 0 => self.step(1),
            Event::Step(r) if r.step < STEPS => self.step(r.step + 1),
            Event::Step(_) if self.shapes.iter().any(|s| s.pass == Pass::Eval) => set_context(
                format!("{} · evaluation (forward)", list(&self.shapes, Pass::Eval)),
            ),
            _ => {}
        }
    }

    fn step(&self, n: u64) {
        set_context(format!(
            "{} · step {n} of {STEPS}",
            list(&self.shapes, Pass::Train)
        ));
    }
}

/// Run the warm-up of `plan` (as `rcoa run` would run it with `opts`) on
/// the CPU or, with `cuda`, on CUDA, reporting progress to `progress`.
pub fn run(
    plan: &LoweredPlan,
    opts: &RunOptions,
    cuda: bool,
    progress: Progress,
) -> Result<WarmupReport, RunError> {
    let start = Instant::now();
    let (follow, result) = run_steps(plan, opts, cuda, progress);
    result?;
    let cache = follow.cache.map(|(dir, before)| {
        // Keyed by the plan the run will compute, not the warm-up's.
        let ranks = opts.distributed.as_ref().map_or(1, |d| d.ranks());
        let fingerprint = kernel_cache::plan_fingerprint(plan, ranks);
        let record_error = kernel_cache::record_warmed(&dir, &fingerprint, &follow.shapes)
            .err()
            .map(|e| e.to_string());
        CacheReport {
            entries_after: kernel_cache::count_entries(&dir),
            entries_before: before,
            dir,
            record_error,
        }
    });
    Ok(WarmupReport {
        device: follow.device,
        shapes: follow.shapes,
        seconds: start.elapsed().as_secs_f64(),
        cache,
    })
}

/// The warm-up's steps (the module header), reporting progress; what the
/// run's events said, and how it ended. `run` and the recording pass of
/// `crate::prebuild` share them.
pub(crate) fn run_steps(
    plan: &LoweredPlan,
    opts: &RunOptions,
    cuda: bool,
    progress: Progress,
) -> (Follow, Result<crate::Summary, RunError>) {
    let _one = ACTIVE.lock().unwrap_or_else(|e| e.into_inner());
    *LINE.lock().unwrap_or_else(|e| e.into_inner()) = Some(Line {
        report: progress,
        context: "building the model".into(),
    });
    set_context("building the model".into());
    let warm = warm_plan(plan);
    let wopts = warm_options(opts);
    let mut follow = Follow {
        shapes: Vec::new(),
        device: String::new(),
        cache: None,
    };
    let result = if cuda {
        run_cuda(&warm, &wopts, &mut |e| follow.on(e))
    } else {
        crate::run_cpu_probed(
            &warm,
            &wopts,
            |_| Box::new(Reporting(crate::memory::cpu_probe())),
            &mut |e| follow.on(e),
        )
    };
    *LINE.lock().unwrap_or_else(|e| e.into_inner()) = None;
    (follow, result)
}

fn run_cuda(
    plan: &LoweredPlan,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<crate::Summary, RunError> {
    #[cfg(feature = "cuda")]
    {
        crate::cuda::run_probed(
            plan,
            opts,
            |d| {
                Box::new(Reporting(Box::new(crate::cuda::CudaProbe::new(d))))
                    as Box<dyn MemoryProbe>
            },
            on_event,
        )
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = (plan, opts, on_event);
        Err(RunError::CudaNotBuilt)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::tiny_plan;

    #[test]
    fn warm_up_runs_the_plans_steps_with_at_most_two_micro_batches_and_says_where_it_is() {
        let _rng = crate::tests::serial();
        let mut plan = tiny_plan();
        plan.resolved.grad_accum = 5;
        assert_eq!(warm_plan(&plan).resolved.grad_accum, 2);
        plan.resolved.grad_accum = 1;
        assert_eq!(warm_plan(&plan).resolved.grad_accum, 1);
        plan.resolved.grad_accum = 3;
        let lines = Arc::new(Mutex::new(Vec::<String>::new()));
        let sink = lines.clone();
        let opts = RunOptions {
            steps: 50,
            save: Some(std::env::temp_dir().join("rcoa-warmup-must-not-write")),
            ..Default::default()
        };
        let report = run(
            &plan,
            &opts,
            false,
            Arc::new(move |l: &str| sink.lock().unwrap().push(l.to_string())),
        )
        .unwrap();
        assert!(report.cache.is_none(), "the CPU has no kernel cache");
        assert_eq!(report.device, "cpu (ndarray)");
        let micro = plan.resolved.micro_batch as usize;
        assert_eq!(
            report.shapes,
            vec![Shape {
                pass: Pass::Train,
                rows: micro,
                seq: plan.train.seq_len as usize,
                padded: false
            }]
        );
        assert!(!std::env::temp_dir()
            .join("rcoa-warmup-must-not-write")
            .exists());
        let lines = lines.lock().unwrap();
        let shape = format!("micro-batch {micro} × {}", plan.train.seq_len);
        for want in [
            "building the model".to_string(),
            format!("{shape} · step 1 of 2"),
            format!("{shape} · step 1 of 2 · forward:layer0"),
            format!("{shape} · step 1 of 2 · backward:embedding"),
            format!("{shape} · step 2 of 2 · optimizer"),
        ] {
            assert!(
                lines.contains(&want),
                "no progress line `{want}` in {lines:?}"
            );
        }
        // Two micro-batches per step, two steps: the embedding's backward
        // ends four micro-batches.
        let micro_batches = lines
            .iter()
            .filter(|l| l.ends_with("backward:embedding"))
            .count();
        assert_eq!(micro_batches, 4);
        assert!(!lines.iter().any(|l| l.contains("step 3")));
    }
}
