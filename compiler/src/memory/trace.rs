//! The allocations of a whole `rcoa run` on one GPU, in order, for replaying through an
//! allocator (`rcoa-backend`'s pool replay runs them through CubeCL's memory management).
//!
//! The events are the memory model's own: the liveness walk of the step's tape
//! ([`tape::walk_traced`]: every tensor made and freed, gradients, op scratch), wrapped in
//! what the Burn executor does around it: the parameters made at setup, `steps` steps of
//! `grad_accum` micro-batches each, and after each step the optimizer, which visits one
//! parameter at a time (Burn's `OptimizerAdaptor`): its state made at the first step, its
//! temporaries ([`optimizer::model`] of that parameter alone), its gradient freed, and with
//! an fp32 master the 16-bit working copy cast anew. A pool keeps the pages it grew, so what
//! it reserves depends on the order of everything before the peak, not only on the peak.
//!
//! Scope: one GPU without sharding (no data, tensor, pipeline or context parallelism, no
//! offload, no step in the backward); anything else is refused, never approximated.

use crate::memory::tape::{self, Buffer, Role};
use crate::memory::{build, engines, optimizer, Candidate};
use crate::profile::Profile;
use crate::spec::{OptimizerKind, Spec};
use std::collections::HashMap;

/// One allocation event of a run. Ids are unique over the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// `bytes` allocated; `param`: a parameter (or its fp32 master) made at setup, which
    /// Burn makes under `memory_persistent_allocations` when it initialises a module itself.
    Alloc {
        id: u64,
        bytes: u64,
        param: bool,
    },
    Free {
        id: u64,
    },
    /// A step ended (after its optimizer step).
    StepEnd,
}

/// The events of a run and the bytes they keep live at their highest.
#[derive(Clone, Debug)]
pub struct Trace {
    pub events: Vec<Event>,
    /// The highest sum of live bytes over the events (the model's bytes in use at its
    /// highest op, transients included).
    pub peak_live: u64,
}

/// Why a candidate has no trace.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("the allocation trace covers one GPU without sharding, offload or a step in the backward; this plan has {0}")]
pub struct Unsupported(pub String);

/// The run's events for `steps` steps of `cand` under `profile` (the `burn` one for
/// `rcoa run`).
pub fn run_trace(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    steps: u32,
) -> Result<Trace, Unsupported> {
    let refuse = |what: &str| Err(Unsupported(what.to_string()));
    if cand.data > 1 || cand.tensor > 1 || cand.pipeline > 1 || cand.context > 1 {
        return refuse("parallelism over more than one GPU");
    }
    if !cand.offload.is_empty() {
        return refuse("offload");
    }
    if spec.optimizer_in_backward {
        return refuse("the optimizer step in the backward");
    }
    let b = build::Builder::new(spec, profile, cand).build(0..spec.model.layers, true, true);
    let (tape, trainable) = (b.tape, b.trainable);
    let first = tape::Persistent {
        grad_divisor: 1,
        sampled: profile.peak_sampled_at_segments,
        recompute_holds_output: profile.recompute_holds_output,
        ..Default::default()
    };
    let later = tape::Persistent {
        grads_exist: true,
        ..first.clone()
    };
    let (_, first_events) = tape::walk_traced(&tape, &first);
    let (_, later_events) = tape::walk_traced(&tape, &later);

    let mut t = Tracer::default();
    // Setup: the parameters, in the order the model makes them, and the fp32 masters.
    let mut param_id: HashMap<u32, u64> = HashMap::new();
    for (i, info) in tape.tensors.iter().enumerate() {
        if info.role == Role::Param {
            param_id.insert(i as u32, t.alloc(info.bytes, true));
        }
    }
    let per_param: Vec<_> = trainable
        .iter()
        .map(|&p| optimizer::model(spec, profile, &tape, &[p], cand))
        .collect();
    for m in &per_param {
        if m.master_bytes > 0 {
            t.alloc(m.master_bytes, true);
        }
    }
    if profile.workspace_bytes > 0 {
        t.alloc(profile.workspace_bytes, false);
    }
    for bytes in engines::burn_context_tensors(spec, profile, cand.micro_batch) {
        t.alloc(bytes, false);
    }
    // Moments per parameter: Adam's two, one otherwise.
    let moments = match spec.optimizer.kind {
        OptimizerKind::Adamw | OptimizerKind::Adam | OptimizerKind::Adam8bit => 2,
        _ => 1,
    };
    let mut grads: HashMap<u32, u64> = HashMap::new();
    for step in 0..steps {
        for micro in 0..cand.grad_accum.max(1) {
            let events = if micro == 0 {
                &first_events
            } else {
                &later_events
            };
            let mut live: HashMap<Buffer, u64> = HashMap::new();
            for e in events {
                match *e {
                    tape::Event::Alloc { buffer, bytes } => {
                        if let Buffer::Tensor(x) = buffer {
                            if tape.tensor(x).role == Role::Param {
                                continue;
                            }
                        }
                        let id = t.alloc(bytes, false);
                        match buffer {
                            Buffer::Grad(x) if tape.tensor(x).role == Role::Param => {
                                grads.insert(x.0, id);
                            }
                            _ => {
                                live.insert(buffer, id);
                            }
                        }
                    }
                    tape::Event::Free { buffer } => {
                        if let Some(id) = live.remove(&buffer) {
                            t.free(id);
                        } else if let Buffer::Grad(x) = buffer {
                            // A unit's gradient reduce-scattered (not in scope) or freed.
                            if let Some(id) = grads.remove(&x.0) {
                                t.free(id);
                            }
                        }
                    }
                }
            }
            // What the walk leaves live (the loss, step inputs) dies with the micro-step.
            let mut rest: Vec<u64> = live.into_values().collect();
            rest.sort_unstable();
            for id in rest {
                t.free(id);
            }
        }
        // The optimizer, one parameter at a time.
        for (&(p, _), m) in trainable.iter().zip(&per_param) {
            let state = m.state_bytes - m.master_bytes;
            if step == 0 && state > 0 {
                for _ in 0..moments {
                    t.alloc(state / moments, false);
                }
            }
            let temps: Vec<u64> = (0..moments)
                .filter(|_| m.temp_bytes > 0)
                .map(|_| t.alloc(m.temp_bytes / moments, false))
                .collect();
            for id in temps {
                t.free(id);
            }
            if let Some(g) = grads.remove(&p.0) {
                t.free(g);
            }
            if m.master_bytes > 0 {
                // The 16-bit working copy is cast anew from the updated master.
                let new = t.alloc(tape.tensor(p).bytes, false);
                if let Some(old) = param_id.insert(p.0, new) {
                    t.free(old);
                }
            }
        }
        t.events.push(Event::StepEnd);
    }
    Ok(Trace {
        events: t.events,
        peak_live: t.peak,
    })
}

#[derive(Default)]
struct Tracer {
    events: Vec<Event>,
    next: u64,
    sizes: HashMap<u64, u64>,
    live: u64,
    peak: u64,
}

impl Tracer {
    fn alloc(&mut self, bytes: u64, param: bool) -> u64 {
        let id = self.next;
        self.next += 1;
        self.events.push(Event::Alloc { id, bytes, param });
        self.sizes.insert(id, bytes);
        self.live += bytes;
        self.peak = self.peak.max(self.live);
        id
    }
    fn free(&mut self, id: u64) {
        if let Some(bytes) = self.sizes.remove(&id) {
            self.live -= bytes;
            self.events.push(Event::Free { id });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::{Attention, CheckpointChoice, Choice, Dtype, Target};
    use crate::testing::SpecBuilder;

    fn small(checkpoint: CheckpointChoice) -> Spec {
        SpecBuilder::new()
            .layers(2)
            .hidden(256)
            .heads(4, 4)
            .head_dim(64)
            .ffn(688)
            .vocab(1000)
            .seq_len(128)
            .max_positions(128)
            .global_batch(4)
            .micro_batch(Choice::Fixed(4))
            .grad_accum(Choice::Fixed(1))
            .precision(Dtype::Fp32, Dtype::Bf16, Some(Dtype::Fp32))
            .attention(Attention::Eager)
            .checkpoint(checkpoint)
            .target(Target::Burn)
            .build()
    }

    /// Every id is allocated once and freed at most once, and the live bytes at the
    /// highest point are the memory model's highest bytes in use at any op.
    #[test]
    fn trace_is_balanced_and_peaks_where_the_model_does() {
        for ckpt in [CheckpointChoice::None, CheckpointChoice::Full] {
            let spec = small(ckpt);
            let c = crate::compile(&spec).expect("compiles");
            let trace = run_trace(&spec, &c.candidate, &c.profile, 3).expect("in scope");
            let mut live: HashMap<u64, u64> = HashMap::new();
            let mut between_steps = Vec::new();
            for e in &trace.events {
                match *e {
                    Event::Alloc { id, bytes, .. } => assert!(live.insert(id, bytes).is_none()),
                    Event::Free { id } => assert!(live.remove(&id).is_some(), "free of {id}"),
                    Event::StepEnd => between_steps.push(live.values().sum::<u64>()),
                }
            }
            // Between steps the parameters and the optimizer state only: the same each step.
            assert_eq!(between_steps.len(), 3);
            assert!(
                between_steps.windows(2).all(|w| w[0] == w[1]),
                "{between_steps:?}"
            );
            assert!(between_steps[0] > c.report.resident_param_bytes);
            // The highest live bytes are the model's highest bytes in use at any op, which
            // the pool term of its reserve covers.
            assert!(
                trace.peak_live == c.report.in_use_max_bytes,
                "{ckpt:?}: trace {} against the model's {}",
                trace.peak_live,
                c.report.in_use_max_bytes
            );
        }
    }

    /// The chunked loss's scratch reaches the allocator as the executor makes it: three
    /// `[chunk, vocab]` fp32 blocks, made one after another, each its own buffer (one
    /// buffer of their sum took a page of its own where the executor slices three).
    #[test]
    fn the_chunked_loss_scratch_is_three_logits_blocks() {
        let mut spec = small(CheckpointChoice::None);
        spec.model.vocab = 40_000;
        spec.train.chunked_loss = Some(true);
        let c = crate::compile(&spec).expect("compiles");
        let trace = run_trace(&spec, &c.candidate, &c.profile, 1).expect("in scope");
        let tokens = spec.train.seq_len * 4;
        let block = tokens.min(crate::memory::build::CHUNKED_LOSS_TOKENS) * 40_000 * 4;
        let sizes: Vec<u64> = trace
            .events
            .iter()
            .filter_map(|e| match *e {
                Event::Alloc { bytes, .. } => Some(bytes),
                _ => None,
            })
            .collect();
        let runs = sizes
            .windows(3)
            .filter(|w| w.iter().all(|&b| b == block))
            .count();
        // The forward and the backward, each three in a row.
        assert_eq!(runs, 2, "{block} B blocks in {sizes:?}");
        assert!(
            sizes.iter().all(|&b| b < 3 * block),
            "one buffer of their sum"
        );
    }

    #[test]
    fn sharded_plans_are_refused() {
        let spec = small(CheckpointChoice::None);
        let c = crate::compile(&spec).expect("compiles");
        let mut cand = c.candidate.clone();
        cand.data = 2;
        let e = run_trace(&spec, &cand, &c.profile, 1).unwrap_err();
        assert!(e.to_string().contains("more than one GPU"), "{e}");
    }
}
