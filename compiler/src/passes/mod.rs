//! The passes that make a plan fit, and the pass manager that runs them.
//!
//! Each pass is a type implementing [`Pass`], built from the part of the
//! [`Spec`] it needs (its own options, never the whole plan file). A pass
//! narrows one domain of the [`SearchSpace`] held by the [`Plan`] — the values
//! a setting may take, a single one when the plan fixed it — and logs what it
//! decided with the numbers behind it. Passes never print and never evaluate
//! the memory model; the last pass, [`fit::Fit`], searches the product of the
//! domains (see [`crate::search`]) and records the chosen candidate, the best
//! rejected alternatives and why they lost.
//!
//! [`run`] is the pipeline: one function listing the passes in order, each
//! ordering constraint commented (Cranelift's `Context::optimize`).
//! Invariant: after [`run`], every domain is non-empty (an empty domain is a
//! [`CompileError`] naming the setting), and `plan.chosen` is the candidate the
//! search found, fitting or — when nothing fits — the smallest one.

pub mod adapter;
pub mod batch;
pub mod checkpoint;
pub mod fit;
pub mod offload;
pub mod precision;
pub mod sharding;

use crate::compile::CompileError;
use crate::explain::Decision;
use crate::profile::Profile;
use crate::search::{Outcome, SearchStats};
use crate::spec::{Objective, Offload, Spec};
use serde::Serialize;

/// The parallel layout of the GPUs: data × tensor × pipeline × context = GPUs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Layout {
    pub data: u64,
    pub tensor: u64,
    pub pipeline: u64,
    pub context: u64,
}

impl std::fmt::Display for Layout {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "data {} × tensor {} × pipeline {} × context {}",
            self.data, self.tensor, self.pipeline, self.context
        )
    }
}

/// Which layers are recomputed in the backward pass.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Recompute {
    /// The first `n` layers of every pipeline stage (Megatron's "block" method);
    /// 0 is none, the stage's layer count is full.
    Block(u64),
    /// Every `n`-th layer of the model (layers 0, n, 2n, ...).
    Every(u64),
    /// No layer recomputed whole; every layer's attention core recomputed in its backward
    /// (`checkpoint = selective`).
    Selective,
    /// Every layer recomputed but the outputs its forward keeps: torchtitan's op-level
    /// selective recomputation (`checkpoint = selective_op`; `memory::build` marks them).
    SelectiveOp,
}

/// The checkpoint domain: fixed by the plan, or every block size of a stage (`auto`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CheckpointDomain {
    /// Exactly this setting.
    Fixed(Recompute),
    /// Every stage checkpoints its first `k` layers, `k` from 0 to the stage's layers;
    /// `selective`: [`Recompute::Selective`] is a choice of its own too.
    AnyBlock { selective: bool },
}

/// What the passes leave for the search: one domain per setting.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SearchSpace {
    /// data × tensor × pipeline × context layouts that use every GPU (sharding pass).
    pub layouts: Vec<Layout>,
    /// ZeRO stages (sharding pass). Stages above 0 are only tried with data > 1.
    pub zero: Vec<u8>,
    /// Sequence parallelism (sharding pass); only `true` with tensor > 1.
    pub sequence: Vec<bool>,
    /// Micro-batch values (batch pass); each layout keeps those dividing its per-rank batch.
    pub micro_batch: Vec<u64>,
    /// Fixed gradient accumulation, or derived from the batch (batch pass).
    pub grad_accum: Option<u64>,
    /// Recomputation (checkpoint pass).
    pub checkpoint: CheckpointDomain,
    /// Sets of offloads that may be used, each sorted; always contains `[]` first
    /// unless the plan forces none other (offload pass).
    pub offload: Vec<Vec<Offload>>,
    /// What the search minimises.
    pub objective: Objective,
    /// Budget and reserve, bytes per GPU.
    pub budget_bytes: u64,
    pub reserve_bytes: u64,
}

impl SearchSpace {
    /// Drop every offload set holding an item `drop` names (what the engine does not run
    /// with the plan's other settings); whether any went. The caller refuses a space left
    /// without a set.
    pub fn drop_offload_sets(&mut self, drop: impl Fn(&Offload) -> bool) -> bool {
        let before = self.offload.len();
        self.offload.retain(|set| !set.iter().any(&drop));
        self.offload.len() < before
    }

    /// The space of a plan before any pass: everything fixed to the no-op value.
    pub fn new(spec: &Spec, profile: &Profile) -> Self {
        SearchSpace {
            layouts: Vec::new(),
            zero: vec![0],
            sequence: vec![false],
            micro_batch: Vec::new(),
            grad_accum: None,
            checkpoint: CheckpointDomain::Fixed(Recompute::Block(0)),
            offload: vec![Vec::new()],
            objective: spec.fit.objective,
            budget_bytes: spec.fit.budget_bytes(spec.hardware.gpu.memory_bytes),
            reserve_bytes: spec.fit.reserve.unwrap_or(profile.default_reserve_bytes),
        }
    }
}

/// The plan the passes work on: the space and, after the fit pass, its outcome.
#[derive(Clone, Debug)]
pub struct Plan {
    pub space: SearchSpace,
    /// Set by [`fit::Fit`].
    pub outcome: Option<Outcome>,
    pub stats: SearchStats,
}

/// One pass of the pipeline.
pub trait Pass {
    /// Name shown in `--explain` (`[sharding] ...`).
    fn name(&self) -> &'static str;
    /// Narrow the plan's domains (or search them) and log each decision.
    fn run(&self, plan: &mut Plan, log: &mut Vec<Decision>) -> Result<(), CompileError>;
}

/// Log one decision of `pass`.
pub(crate) fn decide(
    log: &mut Vec<Decision>,
    pass: &dyn Pass,
    what: impl Into<String>,
    why: impl Into<String>,
) {
    log.push(Decision::new(pass.name(), what, why));
}

/// The divisors of `n`, ascending (O(√n)).
pub(crate) fn divisors(n: u64) -> Vec<u64> {
    let mut out: Vec<u64> = Vec::new();
    let mut i = 1;
    while i * i <= n {
        if n.is_multiple_of(i) {
            out.push(i);
            if i != n / i {
                out.push(n / i);
            }
        }
        i += 1;
    }
    out.sort_unstable();
    out
}

pub(crate) fn gib(b: f64) -> String {
    format!("{:.2} GiB", b / (1u64 << 30) as f64)
}

/// The pipeline: every pass in order. Returns the plan with the search's outcome.
pub fn run(spec: &Spec, profile: &Profile, log: &mut Vec<Decision>) -> Result<Plan, CompileError> {
    let mut plan = Plan {
        space: SearchSpace::new(spec, profile),
        outcome: None,
        stats: SearchStats::default(),
    };
    // Precision and adapter first: they fix the bytes per parameter that the later
    // passes quote (and nothing of the space depends on a later pass).
    let precision = precision::Precision::new(
        &spec.precision,
        &spec.optimizer,
        &spec.model,
        spec.adapter.as_ref(),
    );
    precision.run(&mut plan, log)?;
    let adapter = adapter::Adapter::new(spec.adapter.as_ref(), &spec.model);
    adapter.run(&mut plan, log)?;
    // Sharding before batch: the data degree of each layout sets its per-rank batch.
    sharding::Sharding::new(
        &spec.parallel,
        &spec.hardware,
        &spec.model,
        &spec.train,
        spec.target,
    )
    .run(&mut plan, log)?;
    checkpoint::Checkpoint::new(spec, profile).run(&mut plan, log)?;
    offload::Offload::new(&spec.fit.offload, &spec.hardware, spec.target)
        .required(&spec.fit.must_offload)
        .run(&mut plan, log)?;
    adapter.narrow_executed(spec.target, &mut plan, log)?;
    precision.narrow_executed(spec.target, spec.optimizer_in_backward, &mut plan, log)?;
    // Batch after sharding: micro-batches must divide some layout's per-rank batch.
    batch::Batch::new(spec).run(&mut plan, log)?;
    // Fit last: it searches the product of every domain narrowed above.
    fit::Fit::new(spec, profile).run(&mut plan, log)?;
    if cfg!(debug_assertions) {
        let problems = verify(spec, &plan);
        if !problems.is_empty() {
            return Err(CompileError::Inconsistent {
                what: format!(
                    "the pass pipeline broke its invariants: {}",
                    problems.join("; ")
                ),
                help: "this is a bug in rcoa's passes; please report the plan".into(),
            });
        }
    }
    Ok(plan)
}

/// The invariants of a plan after the pipeline, all of them (debug builds and tests run
/// this after [`run`]): every layout uses every GPU and divides the global batch, every
/// domain is non-empty, the chosen point comes from the domains and is consistent with
/// the batch, and a fitting outcome is within the budget.
pub fn verify(spec: &Spec, plan: &Plan) -> Vec<String> {
    let mut out = Vec::new();
    let s = &plan.space;
    let gpus = spec.gpu_count().max(1);
    let g = spec.train.global_batch;
    if s.layouts.is_empty() {
        out.push("no layout".to_string());
    }
    for l in &s.layouts {
        if l.data * l.tensor * l.pipeline * l.context != gpus {
            out.push(format!("{l} does not use the {gpus} GPUs"));
        }
        if !g.is_multiple_of(l.data.max(1)) {
            out.push(format!("{l}: data does not divide global_batch {g}"));
        }
    }
    for (name, empty) in [
        ("zero", s.zero.is_empty()),
        ("sequence", s.sequence.is_empty()),
        ("micro_batch", s.micro_batch.is_empty()),
        ("offload", s.offload.is_empty()),
    ] {
        if empty {
            out.push(format!("empty {name} domain"));
        }
    }
    match &plan.outcome {
        None => out.push("no outcome after the fit pass".to_string()),
        Some(o) => {
            let p = &o.point;
            if !s.layouts.contains(&p.layout) {
                out.push(format!("chosen {} is not in the space", p.layout));
            }
            if p.layout.data > 1 && !s.zero.contains(&p.zero) {
                out.push(format!("chosen zero {} is not in the space", p.zero));
            }
            if !s.micro_batch.contains(&p.micro_batch) || !s.offload.contains(&p.offload) {
                out.push("chosen micro_batch or offload is not in the space".to_string());
            }
            if p.micro_batch * p.grad_accum * p.layout.data != g {
                out.push(format!(
                    "micro_batch {} × grad_accum {} × data {} ≠ global_batch {g}",
                    p.micro_batch, p.grad_accum, p.layout.data
                ));
            }
            let e = &o.eval;
            if o.fits && e.need_bytes() > e.budget_bytes {
                out.push("a fitting outcome is over its budget".to_string());
            }
        }
    }
    out
}
