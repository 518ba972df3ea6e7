//! The `burn` profile's model of the executor's ZeRO-3 and parameter offload, checked
//! against the contract the executor implements (`backend/src/shard`): every rank keeps a
//! 1/N shard of every unit (embedding, layer, head) at rest; a unit is gathered whole for
//! its forward and kept by its graph until its backward, unless it is a checkpointed layer,
//! whose gathered weights die after its forward and are gathered again for its recompute;
//! the next unit's gather is in flight beside the running one; each unit's fp32 gradient
//! exists in full until the backward leaves the unit, then only a 1/N fp32 accumulator.
//! Expected values are sums over the unit list, independent of the tape walk.

use rcoa_compiler::memory::{evaluate, Candidate, Category, MemoryReport, Phase};
use rcoa_compiler::profile::{Profile, ZERO3_PREFETCH_UNITS};
use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::spec::{Offload, OffloadTo, OffloadWhat, Spec};

fn spec(gpus: u64, extra: &str) -> Spec {
    let src = format!(
        "model \"llama-3.2-1b\"\nhardware {{ gpu = h100-80gb  gpus_per_node = {gpus} }}\n\
         precision bf16\ntrain {{ seq_len = 512  global_batch = 16 }}\n{extra}\ntarget burn\n"
    );
    let file = rcoa_grammar::parse("t.plan", &src).unwrap();
    resolve(&file, &ResolveContext::new("t.plan", src.as_str(), ".")).unwrap()
}

fn cand(data: u64, zero: u8, checkpoint_layers: Vec<u64>, offload: &[OffloadWhat]) -> Candidate {
    Candidate {
        micro_batch: 2,
        grad_accum: 2,
        data,
        zero,
        tensor: 1,
        pipeline: 1,
        context: 1,
        sequence: false,
        checkpoint_layers,
        selective: false,
        offload: offload
            .iter()
            .map(|&what| Offload {
                what,
                to: OffloadTo::Cpu,
            })
            .collect(),
    }
}

fn run(s: &Spec, c: &Candidate) -> MemoryReport {
    evaluate(s, c, &Profile::burn(), true)
}

/// Live bytes of `cat` at the segment boundary `(phase, op, layer)` of the timeline.
fn at(r: &MemoryReport, phase: Phase, op: &str, layer: Option<u64>, cat: Category) -> u64 {
    r.timeline
        .iter()
        .find(|s| s.phase == phase && s.op == op && s.layer == layer)
        .unwrap_or_else(|| panic!("no sample {phase:?} {op} {layer:?}"))
        .by_category[cat as usize]
}

fn unit(r: &MemoryReport, name: &str, layer: Option<u64>) -> u64 {
    r.units
        .iter()
        .find(|u| u.name == name && u.layer == layer)
        .unwrap()
        .gathered_bytes
}

#[test]
fn units_are_the_embedding_every_layer_and_the_head_which_gathers_the_tied_table_again() {
    let s = spec(4, "");
    let r = run(&s, &cand(4, 3, vec![], &[]));
    let layers = s.model.layers;
    assert_eq!(r.units.len() as u64, layers + 2);
    let table = s.model.vocab * s.model.hidden * 2;
    // llama-3.2-1b ties its head: the head unit is the final norm and the table again.
    assert_eq!(unit(&r, "embedding", None), table);
    assert_eq!(unit(&r, "head", None), table + 512.max(s.model.hidden * 2));
    // q, k, v, o, gate, up, down and two RMSNorm weights, bf16.
    let m = &s.model;
    let attn = m.hidden * (m.heads + 2 * m.kv_heads) * m.head_dim + m.heads * m.head_dim * m.hidden;
    let layer = (attn + 3 * m.hidden * m.ffn + 2 * m.hidden) * 2;
    // Each of the layer's nine tensors is rounded to 512 bytes on its own.
    let l0 = unit(&r, "layer", Some(0));
    assert!(l0 >= layer && l0 < layer + 9 * 512, "{l0} vs {layer}");
    // At rest: a quarter of every parameter (rounded per tensor).
    let all: u64 = r.units[..r.units.len() - 1]
        .iter()
        .map(|u| u.gathered_bytes)
        .sum::<u64>()
        + s.model.hidden * 2;
    assert!(r.resident_param_bytes >= all / 4 && r.resident_param_bytes < all / 4 + 4096);
}

#[test]
fn gathered_weights_stay_until_the_backward_unless_the_layer_is_checkpointed() {
    if !rcoa_compiler::profile::BURN_RUNS_ZERO3 {
        return;
    }
    let s = spec(4, "");
    let layers = s.model.layers;
    let w = |r: &MemoryReport| at(r, Phase::Forward, "loss", None, Category::Weights);
    // No layer checkpointed: at the end of the forward every unit's graph holds its
    // gathered weights (nothing is in flight any more: the head ran last).
    let none = run(&s, &cand(4, 3, vec![], &[]));
    let every: u64 = none.units.iter().map(|u| u.gathered_bytes).sum();
    assert_eq!(w(&none), none.resident_param_bytes + every);
    // Every layer checkpointed: only the embedding's and the head's graphs hold theirs.
    let full = run(&s, &cand(4, 3, (0..layers).collect(), &[]));
    assert_eq!(
        w(&full),
        full.resident_param_bytes + unit(&full, "embedding", None) + unit(&full, "head", None)
    );
    // After layer 3's forward, the next unit's gather is in flight.
    let after3 = at(&full, Phase::Forward, "output", Some(3), Category::Weights);
    let ahead: u64 = (4..4 + ZERO3_PREFETCH_UNITS as u64)
        .map(|l| unit(&full, "layer", Some(l)))
        .sum();
    assert_eq!(
        after3,
        full.resident_param_bytes + unit(&full, "embedding", None) + ahead
    );
    // Replicated (ZeRO-2) weights are the whole model at every point.
    let z2 = run(&s, &cand(4, 2, (0..layers).collect(), &[]));
    assert!(z2.units.is_empty());
    assert!(w(&full) < w(&z2));
}

#[test]
fn gradients_are_a_sharded_fp32_accumulator_and_the_unit_being_reduce_scattered() {
    if !rcoa_compiler::profile::BURN_RUNS_ZERO3 {
        return;
    }
    let s = spec(4, "");
    let layers = s.model.layers;
    let r = run(&s, &cand(4, 3, (0..layers).collect(), &[]));
    let acc = (r.params_trainable * 4).div_ceil(4);
    let acc = acc.div_ceil(512) * 512;
    // Through the forward only the accumulator exists.
    assert_eq!(at(&r, Phase::Forward, "loss", None, Category::Grads), acc);
    // After the head's backward its fp32 gradient has been reduce-scattered: the
    // accumulator again, whatever the unit sizes.
    let top = Some(layers);
    assert_eq!(
        at(&r, Phase::Backward, "backward", top, Category::Grads),
        acc
    );
    // Inside a unit's backward the unit's full fp32 gradient adds at most its own size.
    let most: u64 = r.units.iter().map(|u| u.gathered_bytes * 2).max().unwrap();
    assert!(r.phase_peaks["backward"] <= r.phase_peaks["forward"] + most + acc);
    // With the optimizer on the host the executor keeps the accumulator there too (each
    // unit's shard goes down as the backward leaves it): none of it on the device.
    let host = run(
        &s,
        &cand(4, 3, (0..layers).collect(), &[OffloadWhat::Optimizer]),
    );
    assert_eq!(at(&host, Phase::Forward, "loss", None, Category::Grads), 0);
    assert_eq!(host.breakdown["optimizer"], 0);
}

#[test]
fn parameter_offload_alone_keeps_no_weights_at_rest_and_one_staging_buffer() {
    if !rcoa_compiler::profile::BURN_RUNS_ZERO3 {
        return;
    }
    let s = spec(1, "");
    let layers = s.model.layers;
    let c = cand(
        1,
        0,
        (0..layers).collect(),
        &[OffloadWhat::Optimizer, OffloadWhat::Params],
    );
    let r = rcoa_compiler::memory::parallel::evaluate(&s, &c, &Profile::burn(), false);
    assert!(
        r.resident_param_bytes < 1 << 10,
        "{}",
        r.resident_param_bytes
    );
    // The host keeps fp32 weights: the largest unit comes up as fp32 before its cast.
    let largest = r.units.iter().map(|u| u.gathered_bytes).max().unwrap();
    assert_eq!(r.breakdown["communication"], largest * 4 / 2);
    let replicated = run(&s, &cand(1, 0, (0..layers).collect(), &[]));
    assert!(r.peak_bytes < replicated.peak_bytes);
}

/// Gradient offload (beside the optimizer) runs the per-unit step with the weights whole on
/// the device: units read in place (nothing gathered, nothing prefetched), no gradient
/// between units, no flat exchange at the step's end; at the step the updated fp32 values
/// come up and replace the old weights a unit at a time (`Zero3::finish_step`).
#[test]
fn gradient_offload_keeps_whole_weights_and_no_gradient_between_units() {
    let s = spec(4, "");
    let layers = s.model.layers;
    let all: Vec<u64> = (0..layers).collect();
    let both = [OffloadWhat::Optimizer, OffloadWhat::Grads];
    let r = run(&s, &cand(4, 0, all.clone(), &both));
    assert_eq!(r.units.len() as u64, layers + 2);
    let w = |phase, op, layer| at(&r, phase, op, layer, Category::Weights);
    // Weights at rest are the whole model at every point: the units add nothing.
    assert_eq!(w(Phase::Forward, "loss", None), r.resident_param_bytes);
    assert_eq!(w(Phase::Forward, "output", Some(3)), r.resident_param_bytes);
    // Between units no gradient is on the device.
    let g = |phase, op, layer| at(&r, phase, op, layer, Category::Grads);
    assert_eq!(g(Phase::Forward, "loss", None), 0);
    assert_eq!(g(Phase::Backward, "backward", Some(layers)), 0);
    for smp in r.timeline.iter().filter(|x| x.phase == Phase::Backward) {
        let grads = smp.by_category[Category::Grads as usize];
        assert_eq!(grads, 0, "{} {:?}", smp.op, smp.layer);
    }
    // The optimizer alone keeps every gradient on the device through the backward and
    // exchanges a flat fp32 vector at the step's end.
    let opt = run(&s, &cand(4, 0, all, &[OffloadWhat::Optimizer]));
    assert!(opt.units.is_empty());
    assert!(r.phase_peaks["backward"] < opt.phase_peaks["backward"]);
    assert!(
        r.peak_bytes < opt.peak_bytes,
        "{} < {}",
        r.peak_bytes,
        opt.peak_bytes
    );
    // The step: the updated fp32 values up (all of them: ZeRO 0), cast to bf16 a unit at a
    // time in place of the old weights, never whole beside them.
    let values = r.params_trainable;
    let step = r.phase_peaks["optimizer"];
    assert!(step >= r.resident_param_bytes + values * 4, "{step}");
    assert!(
        step < r.resident_param_bytes + values * 4 + values,
        "{step}"
    );
    // ZeRO 2: a quarter of the values comes up (three bytes a value less than ZeRO 0), and
    // only the largest unit is all-gathered at once, in bf16; a whole fp32 gather would
    // have added four bytes a value.
    let z2 = run(&s, &cand(4, 2, (0..layers).collect(), &both));
    let step2 = z2.phase_peaks["optimizer"];
    assert!(step2 >= z2.resident_param_bytes + values, "{step2}");
    assert!(step2 + values * 2 < step, "{step2} vs {step}");
}

/// The lowered plan says what the model charged: which units are gathered again.
#[test]
fn the_lowered_residency_names_sharded_gathered_and_offloaded_state() {
    if !rcoa_compiler::profile::BURN_RUNS_ZERO3 {
        return;
    }
    let s = spec(
        4,
        "parallel { zero = 3 }\nfit { checkpoint = every 2  offload = [optimizer] }",
    );
    let c = rcoa_compiler::compile(&s).unwrap();
    let res = c.lowered.residency();
    use rcoa_compiler::lowered::Place;
    assert_eq!(res.weight_shards, 4);
    assert_eq!(res.weights, Place::Device);
    assert_eq!(res.units.len() as u64, s.model.layers + 2);
    let again: Vec<u64> = res
        .units
        .iter()
        .filter(|u| u.regathered_for_backward)
        .map(|u| u.layer.unwrap())
        .collect();
    assert_eq!(again, c.lowered.resolved.checkpoint_layers);
    // Offload is allowed, not required: the residency follows what the search chose.
    let host = c
        .lowered
        .resolved
        .offload
        .iter()
        .any(|o| o.what == OffloadWhat::Optimizer);
    let place = if host { Place::Host } else { Place::Device };
    assert_eq!(res.optimizer_state, place);
    assert_eq!(res.master, Some(place));
    assert_eq!(res.grad_accumulator, place);
    assert_eq!(res.prefetch_units, ZERO3_PREFETCH_UNITS as u64);
    assert!(!res.staging_buffer);
    // ZeRO-2 holds everything on the device, nothing gathered per unit.
    let z2 = rcoa_compiler::compile(&spec(4, "parallel { zero = 2 }")).unwrap();
    let res = z2.lowered.residency();
    assert!(res.units.is_empty() && res.weight_shards == 1 && res.optimizer_shards == 4);
}

/// `checkpoint = auto` on the Burn executor tries `selective` as a choice of its own,
/// and picks it where it is the fastest that fits (`tests/compile/burn-zero3-1b-4xa100.plan`):
/// no layer recomputed whole, and every alternative is explained.
#[test]
fn auto_checkpointing_picks_selective_where_it_is_the_fastest_that_fits() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/compile/burn-zero3-1b-4xa100.plan"
    );
    let src = std::fs::read_to_string(path).unwrap();
    let file = rcoa_grammar::parse("t.plan", &src).unwrap();
    let s = resolve(&file, &ResolveContext::new("t.plan", src.as_str(), ".")).unwrap();
    let c = rcoa_compiler::compile(&s).unwrap();
    let r = &c.lowered.resolved;
    assert_eq!(r.checkpoint, "selective");
    assert!(r.checkpoint_layers.is_empty());
    assert!(c.candidate.selective);
    assert!(c
        .explain
        .rejected
        .iter()
        .any(|x| x.what == "checkpoint = none"));
    assert!(c
        .explain
        .decisions
        .iter()
        .any(|d| d.pass == "checkpoint" && d.what.contains("selective")));
}
