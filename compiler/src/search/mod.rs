//! The fit search: the best candidate of a [`SearchSpace`] under the budget.
//!
//! A candidate ([`Point`]) is one value from every domain: a layout, a ZeRO
//! stage, sequence parallelism, a micro-batch, a recompute set and an
//! offload set. Its evaluation ([`Evaluator::eval`]) walks the worst stage's
//! tape ([`crate::memory::parallel::evaluate`], without a timeline) and
//! prices the step ([`crate::cost::parallel::estimate`]); evaluations are
//! memoized by point.
//!
//! [`search`] returns the same candidate as [`exhaustive`] (a test runs both
//! on small spaces) while walking far fewer tapes, using two facts of the
//! memory and time models that the property tests check:
//!
//! 1. memory is non-increasing in the number of recomputed layers and
//!    non-decreasing in the micro-batch; step time strictly increases with
//!    the number of recomputed layers;
//! 2. so within a group (every setting but the recompute count fixed) the
//!    best candidate is the fewest recomputed layers that fit, found by
//!    binary search between "none" and "all"; a group whose "all" does not
//!    fit is infeasible, and so is every larger micro-batch of it; a group
//!    whose "none" is already slower than the best found cannot win.
//!
//! The order of candidates is total and deterministic: fitting first, then
//! the objective (step time, or peak), then the other (peak, or step
//! time), then the point itself — so both searches break ties the same way.
//! Among candidates that do not fit, the least need (peak and reserve, what
//! the budget holds) comes first: the plan a does-not-fit diagnostic names
//! is the least need among each group's most-recompute candidate and the
//! winning group's recompute scan (the exhaustive search agrees on the
//! tested spaces).
//! The chosen candidate is re-evaluated with the full timeline by
//! [`crate::compile`]; the search records, per setting, the best rejected
//! alternatives and why they lost.

pub mod diagnose;

use crate::cost::parallel::{self as cost, StepTime};
use crate::memory::{self, Candidate};
use crate::passes::{CheckpointDomain, Layout, Recompute, SearchSpace};
use crate::profile::Profile;
use crate::spec::{Objective, Offload, OffloadTo, OffloadWhat, Spec};
use serde::Serialize;
use std::collections::BTreeMap;

/// One point of the search space.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Point {
    pub layout: Layout,
    pub zero: u8,
    pub sequence: bool,
    pub micro_batch: u64,
    pub grad_accum: u64,
    pub recompute: Recompute,
    pub offload: Vec<Offload>,
}

impl Point {
    /// The memory model's candidate: recompute as layer indices.
    pub fn candidate(&self, layers: u64) -> Candidate {
        let l = self.layout;
        let per_stage = layers.div_ceil(l.pipeline.max(1));
        let checkpoint_layers = match self.recompute {
            Recompute::Block(k) => (0..layers).filter(|i| i % per_stage.max(1) < k).collect(),
            Recompute::Every(n) => (0..layers).filter(|i| i % n.max(1) == 0).collect(),
            Recompute::Selective => Vec::new(),
            Recompute::SelectiveOp => (0..layers).collect(),
        };
        Candidate {
            micro_batch: self.micro_batch,
            grad_accum: self.grad_accum,
            data: l.data,
            zero: self.zero,
            tensor: l.tensor,
            pipeline: l.pipeline,
            context: l.context,
            sequence: self.sequence,
            checkpoint_layers,
            selective: self.recompute == Recompute::Selective,
            offload: self.offload.clone(),
        }
    }

    /// `"none"`, `"full"`, `"selective"`, `"every 2"`, `"first 3 of 8 layers per stage"`.
    pub fn checkpoint_string(&self, layers: u64) -> String {
        let per_stage = layers.div_ceil(self.layout.pipeline.max(1));
        match self.recompute {
            Recompute::Block(0) => "none".into(),
            Recompute::Block(k) if k >= per_stage => "full".into(),
            Recompute::Block(k) if self.layout.pipeline > 1 => {
                format!("first {k} of {per_stage} layers per stage")
            }
            Recompute::Block(k) => format!("first {k} of {layers} layers"),
            Recompute::Every(1) => "full".into(),
            Recompute::Every(n) => format!("every {n}"),
            Recompute::Selective => "selective".into(),
            Recompute::SelectiveOp => "selective_op".into(),
        }
    }
}

/// What one evaluation says.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Eval {
    /// Predicted peak on the worst rank (communication buffers included, reserve not).
    pub peak_bytes: u64,
    pub reserve_bytes: u64,
    pub budget_bytes: u64,
    /// Host (or NVMe) bytes per node the offloads need, and what the node has.
    pub host_bytes: u64,
    pub host_capacity: Option<u64>,
    pub step_seconds: f64,
    pub fits: bool,
}

impl Eval {
    /// What the budget is compared with: the peak and the reserve (which, with the Burn
    /// executor's pool pages, differs between candidates of equal peak).
    pub fn need_bytes(&self) -> u64 {
        self.peak_bytes + self.reserve_bytes
    }
    fn memory_fits(&self) -> bool {
        self.need_bytes() <= self.budget_bytes
    }
    fn host_fits(&self) -> bool {
        self.host_capacity.is_none_or(|c| self.host_bytes <= c)
    }
}

pub use crate::explain::Rejected;

/// Counts of the search's work (deterministic: no wall-clock times).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SearchStats {
    /// Candidates in the space.
    pub space: u64,
    /// Tapes walked (distinct candidates evaluated).
    pub evaluated: u64,
    /// Groups skipped without a walk beyond their bounds.
    pub pruned_groups: u64,
}

/// The search's answer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Outcome {
    pub point: Point,
    pub eval: Eval,
    /// Some candidate fits (else `point` is the candidate found that needs the least).
    pub fits: bool,
    pub rejected: Vec<Rejected>,
}

/// Evaluates points, memoized; every evaluation also feeds the rejected-alternative table.
pub struct Evaluator<'a> {
    spec: &'a Spec,
    profile: &'a Profile,
    space: &'a SearchSpace,
    memo: BTreeMap<Point, Eval>,
}

impl<'a> Evaluator<'a> {
    pub fn new(spec: &'a Spec, profile: &'a Profile, space: &'a SearchSpace) -> Self {
        Evaluator {
            spec,
            profile,
            space,
            memo: BTreeMap::new(),
        }
    }

    /// The evaluation of `p` if it was walked.
    pub fn memo_get(&self, p: &Point) -> Option<Eval> {
        self.memo.get(p).cloned()
    }

    pub fn evaluated(&self) -> u64 {
        self.memo.len() as u64
    }

    /// Memory and time of `p` (one tape walk the first time, a lookup after).
    pub fn eval(&mut self, p: &Point) -> Eval {
        if let Some(e) = self.memo.get(p) {
            return e.clone();
        }
        let e = evaluate_point(self.spec, self.profile, self.space, p).0;
        self.memo.insert(p.clone(), e.clone());
        e
    }
}

/// Evaluate `p` once, returning the time detail too.
pub fn evaluate_point(
    spec: &Spec,
    profile: &Profile,
    space: &SearchSpace,
    p: &Point,
) -> (Eval, StepTime) {
    let cand = p.candidate(spec.model.layers);
    let report = memory::parallel::evaluate(spec, &cand, profile, false);
    let time = cost::estimate(spec, &cand, profile, &report);
    let (host_bytes, host_capacity) = host_need(spec, &cand, &report);
    let mut e = Eval {
        peak_bytes: report.peak_bytes,
        // The memory model's reserve: the plan's (or the profile's) plus the allocator pool's
        // pages beyond the peak in use (`Profile::pool_factor`; 0 for PyTorch).
        reserve_bytes: report.reserve_bytes.max(space.reserve_bytes),
        budget_bytes: space.budget_bytes,
        host_bytes,
        host_capacity,
        step_seconds: time.step_seconds,
        fits: false,
    };
    e.fits = e.memory_fits() && e.host_fits();
    (e, time)
}

/// Bytes per node the offloads put on the host (or NVMe), and the node's capacity.
fn host_need(spec: &Spec, cand: &Candidate, report: &memory::MemoryReport) -> (u64, Option<u64>) {
    if cand.offload.is_empty() {
        return (0, None);
    }
    let shard = if cand.zero >= 1 { cand.data.max(1) } else { 1 } as f64;
    let trainable = report.params_trainable as f64;
    // Checkpointed layers' inputs waiting for their recompute (the Burn executor).
    let mut per_rank = report.host_activation_bytes as f64;
    let mut nvme = false;
    if !report.units.is_empty() {
        // The Burn executor's ZeRO-3 / parameter offload (`backend/src/shard/zero3.rs`): the
        // host weights are fp32 shards and are the optimizer's master; the state (and the
        // master when the weights stay on the device) beside the host optimizer; the fp32
        // gradient-shard accumulator there too when the executor keeps it there.
        let profile = Profile::for_target(spec.target);
        let wshards = if cand.zero >= 3 { cand.data.max(1) } else { 1 } as f64;
        if memory::burn_host_grad_accumulator(&profile, cand) {
            per_rank += trainable * 4.0 / shard;
        }
        if cand.offloads(OffloadWhat::Params) {
            per_rank += report.params_total as f64 * 4.0 / wshards;
        }
        if cand.offloads(OffloadWhat::Optimizer) {
            let master = match spec.precision.master {
                Some(m) if !cand.offloads(OffloadWhat::Params) => m.bytes(),
                _ => 0.0,
            };
            per_rank += trainable * (2.0 * spec.optimizer.state.bytes() + master) / shard;
        }
        let bytes = (per_rank * spec.hardware.gpus_per_node.max(1) as f64) as u64;
        return (bytes, spec.hardware.host_memory_bytes);
    }
    for o in &cand.offload {
        nvme |= o.to == OffloadTo::Nvme;
        per_rank += match o.what {
            OffloadWhat::Optimizer => {
                let master = spec.precision.master.map_or(0.0, |m| m.bytes());
                trainable * (2.0 * spec.optimizer.state.bytes() + master) / shard
            }
            OffloadWhat::Params => {
                report.params_total as f64 * spec.precision.params.bytes() / cand.data.max(1) as f64
            }
            OffloadWhat::Grads => trainable * spec.precision.grads.bytes() / shard,
            // Counted above, from the tape.
            OffloadWhat::Activations => 0.0,
        };
    }
    let bytes = (per_rank * spec.hardware.gpus_per_node.max(1) as f64) as u64;
    let cap = if nvme {
        spec.hardware.nvme_bytes
    } else {
        spec.hardware.host_memory_bytes
    };
    (bytes, cap)
}

/// The total order of candidates (smaller is better).
fn better(obj: Objective, a: (&Point, &Eval), b: (&Point, &Eval)) -> bool {
    use std::cmp::Ordering;
    let (pa, ea) = a;
    let (pb, eb) = b;
    let o = eb.fits.cmp(&ea.fits).then_with(|| match (ea.fits, obj) {
        (true, Objective::Throughput) => ea
            .step_seconds
            .total_cmp(&eb.step_seconds)
            .then(ea.peak_bytes.cmp(&eb.peak_bytes)),
        // The least memory asked of the budget: with the Burn executor's pool pages in the
        // reserve, two plans of equal peak hold different amounts of the GPU.
        (true, Objective::Memory) | (false, _) => ea
            .need_bytes()
            .cmp(&eb.need_bytes())
            .then(ea.step_seconds.total_cmp(&eb.step_seconds)),
    });
    o.then_with(|| pa.cmp(pb)) == Ordering::Less
}

/// Every group of the space: all settings but the recompute count, in point order.
struct Group {
    base: Point,
    /// Recompute options, memory non-increasing and time increasing: `Block(0..=per_stage)`
    /// for `AnyBlock`, `[Selective]` (a list of its own), or the fixed one.
    ks: Vec<Recompute>,
}

fn groups(spec: &Spec, space: &SearchSpace) -> Vec<Vec<Group>> {
    // Outer: one list per (layout, zero, sequence, offload), micro-batches ascending inside.
    let mut out = Vec::new();
    let g = spec.train.global_batch.max(1);
    for &layout in &space.layouts {
        let zeros: Vec<u8> = if layout.data > 1 {
            space.zero.clone()
        } else {
            // Without data parallelism every stage is the same candidate.
            vec![*space.zero.iter().min().unwrap_or(&0)]
        };
        let seqs: Vec<bool> = if layout.tensor > 1 {
            space.sequence.clone()
        } else {
            vec![false]
        };
        let per_rank = g / layout.data.max(1);
        let per_stage = spec.model.layers.div_ceil(layout.pipeline.max(1));
        // Each family is searched on its own: selective is not between two block counts.
        let families: Vec<Vec<Recompute>> = match space.checkpoint {
            CheckpointDomain::Fixed(Recompute::Block(k)) => {
                vec![vec![Recompute::Block(k.min(per_stage))]]
            }
            CheckpointDomain::Fixed(r) => vec![vec![r]],
            CheckpointDomain::AnyBlock { selective } => {
                let mut v = vec![(0..=per_stage).map(Recompute::Block).collect()];
                if selective {
                    v.push(vec![Recompute::Selective]);
                }
                v
            }
        };
        for &zero in &zeros {
            for &sequence in &seqs {
                for (off, ks) in space
                    .offload
                    .iter()
                    .flat_map(|o| families.iter().map(move |k| (o, k)))
                {
                    // DeepSpeed moves parameters to the host only under ZeRO-3; the Burn
                    // executor under any stage (every rank streams all the host weights).
                    let burn = spec.target == crate::spec::Target::Burn;
                    if off.iter().any(|o| o.what == OffloadWhat::Params) && zero < 3 && !burn {
                        continue;
                    }
                    let mut list = Vec::new();
                    let mut mbs = space.micro_batch.clone();
                    mbs.sort_unstable();
                    for &mb in &mbs {
                        if mb == 0 || !per_rank.is_multiple_of(mb) {
                            continue;
                        }
                        let ga = per_rank / mb;
                        if space.grad_accum.is_some_and(|f| f != ga) {
                            continue;
                        }
                        // A step in the backward is one step per backward: no accumulation.
                        if spec.optimizer_in_backward && ga != 1 {
                            continue;
                        }
                        // Megatron's interleaved schedule runs micro-batches in groups of
                        // the pipeline size.
                        if spec.parallel.virtual_stages > 1
                            && !ga.is_multiple_of(layout.pipeline.max(1))
                        {
                            continue;
                        }
                        list.push(Group {
                            base: Point {
                                layout,
                                zero,
                                sequence,
                                micro_batch: mb,
                                grad_accum: ga,
                                recompute: ks[0],
                                offload: off.clone(),
                            },
                            ks: ks.clone(),
                        });
                    }
                    if !list.is_empty() {
                        out.push(list);
                    }
                }
            }
        }
    }
    out
}

/// Candidates in the groups (the size of the space the searches see).
fn count(all: &[Vec<Group>]) -> u64 {
    all.iter().flatten().map(|g| g.ks.len() as u64).sum()
}

/// The best candidate by evaluating every point (the reference for tests and the benchmark).
pub fn exhaustive(
    spec: &Spec,
    profile: &Profile,
    space: &SearchSpace,
) -> (Option<(Point, Eval)>, SearchStats) {
    let mut ev = Evaluator::new(spec, profile, space);
    let mut best: Option<(Point, Eval)> = None;
    let all = groups(spec, space);
    let size = count(&all);
    for list in all {
        for g in list {
            for &k in &g.ks {
                let p = Point {
                    recompute: k,
                    ..g.base.clone()
                };
                let e = ev.eval(&p);
                if best
                    .as_ref()
                    .is_none_or(|(bp, be)| better(space.objective, (&p, &e), (bp, be)))
                {
                    best = Some((p, e));
                }
            }
        }
    }
    let stats = SearchStats {
        space: size,
        evaluated: ev.evaluated(),
        pruned_groups: 0,
    };
    (best, stats)
}

/// Smallest index in `lo..=hi` where `ok` holds, given `ok(hi)` and monotonicity.
fn first_true(mut lo: usize, mut hi: usize, mut ok: impl FnMut(usize) -> bool) -> usize {
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if ok(mid) {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    hi
}

/// The recompute options of a group (`at(0..=last)`, memory non-increasing) that may hold
/// its least need: none recomputed, and the fewest recomputed that need no more than all
/// of them. Need (peak + reserve) falls with the peak from one recomputed layer on, but
/// not from none to one under the `burn` profile, whose pool takes a larger factor of the
/// bytes in use once a layer is recomputed (`Profile::pool_factor_recompute`).
fn least_need(ev: &mut Evaluator, at: &dyn Fn(usize) -> Point, last: usize) -> Vec<usize> {
    if last == 0 {
        return vec![0];
    }
    let floor = ev.eval(&at(last)).need_bytes();
    vec![
        0,
        first_true(1, last, |i| ev.eval(&at(i)).need_bytes() <= floor),
    ]
}

/// The best candidate of `space` (same answer as [`exhaustive`]), the evaluator
/// (for the rejected alternatives) and counts of the work.
pub fn search<'a>(
    spec: &'a Spec,
    profile: &'a Profile,
    space: &'a SearchSpace,
) -> (Option<(Point, Eval)>, Evaluator<'a>, SearchStats) {
    let mut ev = Evaluator::new(spec, profile, space);
    let obj = space.objective;
    let mut best: Option<(Point, Eval)> = None;
    let mut pruned = 0u64;
    let consider = |best: &mut Option<(Point, Eval)>, p: Point, e: Eval| {
        if best
            .as_ref()
            .is_none_or(|(bp, be)| better(obj, (&p, &e), (bp, be)))
        {
            *best = Some((p, e));
        }
    };
    let all = groups(spec, space);
    let size = count(&all);
    for list in all {
        for g in list {
            let at = |i: usize| Point {
                recompute: g.ks[i],
                ..g.base.clone()
            };
            let last = g.ks.len() - 1;
            // The most recompute: the group's least memory.
            let top = at(last);
            let e_top = ev.eval(&top);
            if !e_top.fits {
                if !e_top.memory_fits() {
                    // Larger micro-batches of this list only need more memory.
                    consider(&mut best, top, e_top);
                    pruned += 1;
                    break;
                }
                // Over the host's capacity: the least-memory point decides nothing else.
                consider(&mut best, top, e_top);
                continue;
            }
            match obj {
                Objective::Throughput => {
                    let low = at(0);
                    let e_low = ev.eval(&low);
                    if e_low.fits || last == 0 {
                        consider(&mut best, low, e_low);
                        continue;
                    }
                    // Recompute only adds time: a group slower without it cannot win.
                    if best
                        .as_ref()
                        .is_some_and(|(_, b)| b.fits && e_low.step_seconds >= b.step_seconds)
                    {
                        pruned += 1;
                        continue;
                    }
                    let i = first_true(1, last, |i| ev.eval(&at(i)).fits);
                    let p = at(i);
                    let e = ev.eval(&p);
                    consider(&mut best, p, e);
                }
                Objective::Memory => {
                    for i in least_need(&mut ev, &at, last) {
                        let p = at(i);
                        let e = ev.eval(&p);
                        consider(&mut best, p, e);
                    }
                }
            }
        }
    }
    // Nothing fits: the least need, and among equal needs the least recompute.
    if let Some((bp, be)) = best.clone() {
        if !be.fits {
            let ks: Vec<Recompute> = match space.checkpoint {
                CheckpointDomain::AnyBlock { .. } if bp.recompute != Recompute::Selective => {
                    let per_stage = spec.model.layers.div_ceil(bp.layout.pipeline.max(1));
                    (0..=per_stage).map(Recompute::Block).collect()
                }
                _ => vec![bp.recompute],
            };
            let last = ks.len() - 1;
            let at = |i: usize| Point {
                recompute: ks[i],
                ..bp.clone()
            };
            for i in least_need(&mut ev, &at, last) {
                let p = at(i);
                let e = ev.eval(&p);
                consider(&mut best, p, e);
            }
        }
    }
    let stats = SearchStats {
        space: size,
        evaluated: ev.evaluated(),
        pruned_groups: pruned,
    };
    (best, ev, stats)
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Per setting, the best evaluated alternatives to `chosen` and why they lost.
pub fn rejected(
    ev: &Evaluator,
    chosen: &Point,
    chosen_eval: &Eval,
    layers: u64,
    obj: Objective,
) -> Vec<Rejected> {
    type Key = (u8, String);
    let mut best: BTreeMap<Key, (Point, Eval)> = BTreeMap::new();
    let settings = |p: &Point| -> Vec<Key> {
        vec![
            (0, format!("layout {}", p.layout)),
            (1, format!("zero = {}", p.zero)),
            (2, format!("micro_batch = {}", p.micro_batch)),
            (3, format!("checkpoint = {}", p.checkpoint_string(layers))),
            (
                4,
                format!(
                    "offload = [{}]",
                    p.offload
                        .iter()
                        .map(|o| o.to_string())
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            ),
        ]
    };
    let mine = settings(chosen);
    for (p, e) in &ev.memo {
        for k in settings(p) {
            if mine.contains(&k) {
                continue;
            }
            let replace = best
                .get(&k)
                .is_none_or(|(bp, be)| better(obj, (p, e), (bp, be)));
            if replace {
                best.insert(k, (p.clone(), e.clone()));
            }
        }
    }
    // At most three alternatives per setting, best first.
    let mut by_setting: BTreeMap<u8, Vec<(String, Point, Eval)>> = BTreeMap::new();
    for ((s, what), (p, e)) in best {
        by_setting.entry(s).or_default().push((what, p, e));
    }
    let mut out = Vec::new();
    for (_, mut v) in by_setting {
        v.sort_by(|a, b| {
            if better(obj, (&a.1, &a.2), (&b.1, &b.2)) {
                std::cmp::Ordering::Less
            } else {
                std::cmp::Ordering::Greater
            }
        });
        // At most three per setting; `checkpoint = selective` (a choice of its own, not a
        // block count) is always shown when it was tried.
        let kept: Vec<_> = v
            .into_iter()
            .enumerate()
            .filter(|(i, (what, _, _))| *i < 3 || what == "checkpoint = selective")
            .map(|(_, x)| x)
            .collect();
        for (what, _, e) in kept {
            let why = if !e.memory_fits() {
                format!(
                    "{} > {} budget (peak {} + reserve {})",
                    gib(e.need_bytes()),
                    gib(e.budget_bytes),
                    gib(e.peak_bytes),
                    gib(e.reserve_bytes)
                )
            } else if !e.host_fits() {
                format!(
                    "offload needs {} per node > {} of host memory",
                    gib(e.host_bytes),
                    gib(e.host_capacity.unwrap_or(0))
                )
            } else if obj == Objective::Memory {
                format!(
                    "needs {} vs {} (peak + reserve)",
                    gib(e.need_bytes()),
                    gib(chosen_eval.need_bytes())
                )
            } else {
                format!(
                    "{:.3} s/step vs {:.3} s ({:+.1}%)",
                    e.step_seconds,
                    chosen_eval.step_seconds,
                    100.0 * (e.step_seconds / chosen_eval.step_seconds.max(1e-12) - 1.0)
                )
            };
            out.push(Rejected {
                what,
                peak_bytes: e.peak_bytes,
                step_seconds: e.step_seconds,
                why,
            });
        }
    }
    out
}
