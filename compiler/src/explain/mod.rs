//! Explaining a compilation to people (text) and machines (JSON).
//!
//! The decision log is data: every pass (and, for now, the defaults that
//! stand in for the search) appends a [`Decision`] saying what it set and
//! why, with the numbers that drove it. Rendering is separate and
//! deterministic: no timings of the compiler itself, no paths, no colours, so
//! `--explain` output can be a golden file.
//!
//! On more than one GPU (or with offload) the text adds a `per rank` section:
//! what each rank the memory model distinguishes holds (its layers, its share
//! of weights, gradients and optimizer state, its communication buffers; the
//! worst marked) and the worst rank's traffic table. Those rows are the
//! [`crate::cost::parallel::Traffic`] rows the step time sums, so the seconds
//! shown are the seconds priced; the JSON carries them as `parallel.ranks` and
//! `parallel.traffic`.

mod setups;

use crate::compile::Compilation;
use crate::memory::{Category, Phase, Sample};
use crate::profile::Profile;
use crate::spec::{CheckpointChoice, Choice, Spec};
use serde::Serialize;
use serde_json::{json, Value};
use std::fmt::Write;

/// One thing the compiler set, and why.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Decision {
    /// The pass (or `given` / `defaults` / `model`) that made it.
    pub pass: String,
    pub what: String,
    pub why: String,
}

impl Decision {
    pub fn new(pass: impl Into<String>, what: impl Into<String>, why: impl Into<String>) -> Self {
        Decision {
            pass: pass.into(),
            what: what.into(),
            why: why.into(),
        }
    }
}

/// The decision log of one compilation.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Explain {
    pub decisions: Vec<Decision>,
    /// The best alternatives the fit search rejected, per setting, and why they lost.
    pub rejected: Vec<Rejected>,
}

/// A setting the fit search did not choose, with its best numbers and why it lost.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Rejected {
    /// The setting, e.g. `zero = 2`.
    pub what: String,
    /// Predicted peak of the best candidate with this setting (reserve not included).
    pub peak_bytes: u64,
    pub step_seconds: f64,
    /// e.g. `44.10 GiB > 37.60 GiB budget`, `1.234 s/step vs 1.100 s (+12.2%)`.
    pub why: String,
}

/// The settings the plan fixed, and what the runtime profile makes of them.
pub fn record_given(spec: &Spec, profile: &Profile, log: &mut Vec<Decision>) {
    for (what, why) in &spec.defaults {
        log.push(Decision::new(
            "default",
            what.clone(),
            format!("{why}; write the key in the plan to change it"),
        ));
    }
    let p = &spec.precision;
    let autocast = profile.autocast && p.is_autocast();
    log.push(Decision::new(
        "given",
        format!("precision params = {} compute = {}", p.params.as_str(), p.compute.as_str()),
        if autocast {
            "autocast: fp32 weights, 16-bit matmuls; trainable weights get cached 16-bit copies for the forward, the residual stream stays fp32".to_string()
        } else if profile.engine == crate::profile::Engine::Fsdp2 && p.is_autocast() {
            format!(
                "FSDP2 MixedPrecisionPolicy(param_dtype={c}, reduce_dtype=fp32): {} sharded weights at rest, each layer gathered in {c} only while it runs, fp32 sharded gradients; modules compute in {c}, no autocast",
                p.params.as_str(),
                c = p.compute.as_str()
            )
        } else {
            format!("{} runs in the weights' element type, no casts", profile.name)
        },
    ));
    let fixed = |c: Choice<u64>| c.fixed().map(|v| v.to_string());
    for (name, v) in [
        ("micro_batch", fixed(spec.train.micro_batch)),
        ("grad_accum", fixed(spec.train.grad_accum)),
        ("data", fixed(spec.parallel.data)),
        ("tensor", fixed(spec.parallel.tensor)),
        ("pipeline", fixed(spec.parallel.pipeline)),
        ("context", fixed(spec.parallel.context)),
        ("zero", spec.parallel.zero.fixed().map(|z| z.to_string())),
    ] {
        if let Some(v) = v {
            log.push(Decision::new(
                "given",
                format!("{name} = {v}"),
                "fixed by the plan",
            ));
        }
    }
    match spec.fit.checkpoint {
        CheckpointChoice::None => log.push(Decision::new("given", "checkpoint = none", "fixed by the plan: every layer keeps its saved activations")),
        CheckpointChoice::Full => log.push(Decision::new(
            "given",
            "checkpoint = full",
            format!("fixed by the plan: every layer keeps only its input and is recomputed in the backward ({})", mechanism(profile)),
        )),
        CheckpointChoice::Every(n) => log.push(Decision::new(
            "given",
            format!("checkpoint = every {n}"),
            format!("fixed by the plan: layers 0, {n}, {}, ... are recomputed ({})", 2 * n, mechanism(profile)),
        )),
        _ => {}
    }
    if profile.fused(spec.train.attention) {
        let why = if profile.fused_attention {
            "fused kernel: no [batch, heads, seq, seq] scores are kept (math backend when fp32 with grouped-query attention)".to_string()
        } else {
            let kept = "rcoa's fused kernel: q, k, v, the output and an fp32 log-sum-exp are kept, no [batch, heads, seq, seq] scores";
            match crate::memory::build::burn_flash_rows_why(
                spec.precision.compute,
                spec.model.head_dim,
                &spec.hardware.gpu,
            ) {
                None => {
                    let window = spec
                        .model
                        .numerics
                        .window_within(spec.train.seq_len)
                        .map(|w| {
                            format!(
                                "; the kernels skip the key blocks outside the sliding window of {w} \
                                 keys and mask the rest"
                            )
                        })
                        .unwrap_or_default();
                    format!(
                        "{kept}; on tensor cores, the backward in one pass with an fp32 dQ accumulator{window}"
                    )
                }
                Some(why) => {
                    let rate = profile
                        .fused_attention_rows_efficiency
                        .map(|e| {
                            format!(
                                ", priced at {:.1} TFLOP/s",
                                e * spec.hardware.gpu.cuda_core_tflops()
                            )
                        })
                        .unwrap_or_default();
                    format!("{kept}; {why}, so its Rows kernels run on the CUDA cores: two passes, no dQ accumulator{rate}")
                }
            }
        };
        log.push(Decision::new(
            "model",
            format!("attention = {:?}", spec.train.attention).to_lowercase(),
            why,
        ));
    } else {
        log.push(Decision::new(
            "model",
            "attention = eager",
            format!(
                "{}: the [batch, heads, seq, seq] scores and softmax are saved per layer",
                profile.name
            ),
        ));
    }
    if spec.train.packing {
        let mask = if profile.burn_ops && spec.train.attention == crate::spec::Attention::Flash {
            "the fused kernels read each token's document span and skip the key blocks of other documents; each micro-batch adds the spans, the tokens' positions and the RoPE rows gathered at them"
        } else if profile.burn_ops {
            "each micro-batch adds its [micro_batch, 1, seq, seq] document mask in the compute dtype, with the tokens' positions and the RoPE rows gathered at them"
        } else if spec.train.attention == crate::spec::Attention::Flash {
            "flash-attention takes the documents as sequences of their own lengths: no mask"
        } else {
            "transformers reads the documents from the position ids and gives attention their [batch, 1, seq, seq] mask"
        };
        log.push(Decision::new(
            "given",
            "packing = true",
            format!(
                "whole examples binned into each sequence (best-fit decreasing), attending only to themselves, positions restarting at each; {mask}"
            ),
        ));
    }
    let gpu = &spec.hardware.gpu;
    if p.compute == crate::spec::Dtype::Bf16 && !gpu.bf16_tensor_cores {
        log.push(Decision::new(
            "model",
            format!("bf16 matmuls at {:.1} TFLOP/s", gpu.dense_tflops(p.compute)),
            format!(
                "{} has no bf16 tensor cores, so bf16 runs on its CUDA cores; compute = fp16 runs on its tensor cores at {:.1} TFLOP/s",
                gpu.name,
                gpu.dense_tflops(crate::spec::Dtype::Fp16)
            ),
        ));
    }
    techniques(spec, profile, log);
    setups::record(spec, log);
    if let Some(a) = &spec.adapter {
        if profile.adapter_suffix_match
            && spec.model.arch == crate::spec::Arch::Encoder
            && a.targets.contains(&crate::spec::Proj::O)
        {
            log.push(Decision::new("model", "adapter on o also adapts up and down", "PEFT matches `dense` by suffix: attention.output.dense, intermediate.dense and output.dense"));
        }
        if profile.adapters_fp32 {
            log.push(Decision::new(
                "model",
                "adapter weights fp32",
                "PEFT keeps adapter weights in fp32 and casts their input to fp32",
            ));
        }
    }
}

/// What each memory technique of the plan saves and costs: the memory model evaluated
/// with and without it for one sequence on one GPU (micro_batch 1, no parallelism).
fn techniques(spec: &Spec, profile: &Profile, log: &mut Vec<Decision>) {
    use crate::memory::parallel::evaluate;
    use crate::memory::Candidate;
    use crate::spec::{AdapterKind, OptimizerKind};
    let cand = Candidate {
        micro_batch: 1,
        grad_accum: 1,
        data: 1,
        zero: 0,
        tensor: 1,
        pipeline: 1,
        context: 1,
        sequence: false,
        checkpoint_layers: vec![],
        selective: spec.fit.checkpoint == CheckpointChoice::Selective,
        offload: vec![],
    };
    let measure = |s: &Spec| {
        let cand = Candidate {
            selective: s.fit.checkpoint == CheckpointChoice::Selective,
            ..cand.clone()
        };
        let r = evaluate(s, &cand, profile, false);
        (r.peak_bytes as f64, r.step_flops)
    };
    let (peak, flops) = measure(spec);
    let mut compare = |what: &str, how: &str, without: Spec| {
        let (p0, f0) = measure(&without);
        let saved = p0 - peak;
        let cost = if f0 > 0.0 {
            (flops / f0 - 1.0) * 100.0
        } else {
            0.0
        };
        log.push(Decision::new(
            "model",
            what,
            format!(
                "{how}; per sequence on one GPU: peak {} {} ({:.2} GiB without), step FLOPs {:+.1}%",
                if saved >= 0.0 { "−" } else { "+" },
                gib(saved.abs().round() as u64),
                p0 / (1u64 << 30) as f64,
                cost
            ),
        ));
    };
    if spec.fit.checkpoint == CheckpointChoice::Selective {
        let mut without = spec.clone();
        without.fit.checkpoint = CheckpointChoice::None;
        let how = if profile.fused(spec.train.attention) {
            "selective recomputation: the fused attention kernel keeps no scores, so there is nothing to recompute"
        } else {
            "selective recomputation: the attention scores and probabilities are not saved; the backward recomputes q·kᵀ and probs·v"
        };
        compare("checkpoint = selective", how, without);
    }
    if crate::memory::build::Builder::new(spec, profile, &cand).chunked_loss() {
        let mut without = spec.clone();
        without.train.chunked_loss = Some(false);
        compare(
            "loss chunked",
            &format!(
                "the LM head and cross-entropy {} tokens at a time: no [tokens, vocab] fp32 logits; the backward recomputes each chunk's logits",
                crate::memory::build::CHUNKED_LOSS_TOKENS
            ),
            without,
        );
    }
    if spec.optimizer_in_backward {
        let mut without = spec.clone();
        without.optimizer_in_backward = false;
        compare(
            "optimizer step in the backward",
            "each gradient freed by its parameter's step as the backward completes it, against one step after the backward over all of them",
            without,
        );
    }
    if spec.optimizer.kind == OptimizerKind::Adam8bit {
        let mut without = spec.clone();
        without.optimizer.kind = OptimizerKind::Adamw;
        compare(
            "optimizer state 8-bit",
            "bitsandbytes' block-wise 8-bit moments: a byte per value and an fp32 absmax per 256 (fp32 below 4096 values), against AdamW",
            without,
        );
    }
    if spec
        .adapter
        .as_ref()
        .is_some_and(|a| a.kind == AdapterKind::Qlora)
    {
        let mut without = spec.clone();
        if let Some(w) = without.adapter.as_mut() {
            w.kind = AdapterKind::Lora;
            w.base = spec.precision.params;
        }
        compare(
            "base weights nf4",
            "QLoRA: the frozen base stored as 4-bit NF4 and dequantized per use, against LoRA on the plan's weights",
            without,
        );
    }
}

fn mechanism(profile: &Profile) -> &'static str {
    profile.recompute_mechanism()
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];

/// A row of bars for `samples` (at most `width` columns, each the max of its bucket).
fn sparkline(samples: &[&Sample], peak: u64, width: usize) -> String {
    if samples.is_empty() || peak == 0 {
        return String::new();
    }
    let cols = samples.len().min(width);
    let mut out = String::new();
    for c in 0..cols {
        let lo = c * samples.len() / cols;
        let hi = ((c + 1) * samples.len() / cols).max(lo + 1);
        let m = samples[lo..hi].iter().map(|s| s.bytes).max().unwrap_or(0);
        let i = ((m as f64 / peak as f64) * 7.0).round() as usize;
        out.push(BARS[i.min(7)]);
    }
    out
}

/// The `--explain` text.
pub fn render_text(c: &Compilation) -> String {
    let l = &c.lowered;
    let m = &l.model;
    let r = &l.resolved;
    let pr = &l.prediction;
    let rep = &c.report;
    let mut s = String::new();
    let _ = writeln!(
        s,
        "model     {} {} layers, hidden {}, heads {}/{}, ffn {}, vocab {}: {:.3} B params, {:.3} B trainable",
        match m.arch {
            crate::spec::Arch::Decoder => "decoder",
            crate::spec::Arch::Encoder => "encoder",
        },
        m.layers,
        m.hidden,
        m.heads,
        m.kv_heads,
        m.ffn,
        m.vocab,
        rep.params_total as f64 / 1e9,
        rep.params_trainable as f64 / 1e9
    );
    let _ = writeln!(
        s,
        "target    {} on {} × {}",
        c.profile.name,
        l.hardware.gpus_per_node * l.hardware.nodes,
        l.hardware.gpu.name
    );
    let _ = writeln!(
        s,
        "resolved  micro_batch {} × grad_accum {} × data {}; zero {}; tensor {}; pipeline {}; context {}; checkpoint {}; offload [{}]",
        r.micro_batch,
        r.grad_accum,
        r.data,
        r.zero,
        r.tensor,
        r.pipeline,
        r.context,
        r.checkpoint,
        r.offload_names().join(", ")
    );
    let _ = writeln!(
        s,
        "graph     {} ops ({} per layer), {} tensors, {} parameters ({} trainable); one layer saves {}",
        c.graph.ops,
        c.graph.ops_per_layer,
        c.graph.tensors,
        c.graph.params,
        c.graph.trainable_params,
        gib(c.graph.saved_bytes_per_layer)
    );
    let _ = writeln!(s);
    let _ = writeln!(s, "memory per GPU at the peak");
    for cat in Category::ALL {
        let b = rep.breakdown.get(cat.as_str()).copied().unwrap_or(0);
        let share = if rep.peak_bytes > 0 {
            100.0 * b as f64 / rep.peak_bytes as f64
        } else {
            0.0
        };
        let _ = writeln!(s, "  {:<18} {:>11}  {:>5.1}%", cat.as_str(), gib(b), share);
    }
    let _ = writeln!(s, "  {:<18} {:>11}", "peak", gib(pr.peak_bytes));
    if rep.paged_bytes > 0 {
        let _ = writeln!(
            s,
            "  {:<18} {:>11}  of the optimizer state in unified memory (`impl = paged`), {} of it on the host at the peak",
            "paged",
            gib(rep.paged_bytes),
            gib(rep.paged_evicted_bytes)
        );
    }
    if rep.host_activation_bytes > 0 {
        let _ = writeln!(
            s,
            "  {:<18} {:>11}  checkpointed layer inputs in host memory between forward and recompute (`offload = [activations]`)",
            "host activations",
            gib(rep.host_activation_bytes)
        );
    }
    let kept = if rep.reserve_pool_bytes > 0 {
        format!(
            "kept out of the budget: {} of reserve (context, buffers), {} for the allocator's pages above the peak (its slack, and transients inside layers)",
            gib(rep.reserve_bytes - rep.reserve_pool_bytes).trim(),
            gib(rep.reserve_pool_bytes).trim()
        )
    } else {
        "kept out of the budget".to_string()
    };
    let _ = writeln!(
        s,
        "  {:<18} {:>11}  ({kept})",
        "reserved",
        gib(rep.reserve_bytes)
    );
    let _ = writeln!(
        s,
        "  {:<18} {:>11}  {}",
        "budget",
        gib(pr.budget_bytes),
        if pr.fits {
            format!(
                "fits, {} to spare",
                gib(pr
                    .budget_bytes
                    .saturating_sub(pr.peak_bytes + rep.reserve_bytes))
            )
        } else {
            format!(
                "DOES NOT FIT: {} over",
                gib((pr.peak_bytes + rep.reserve_bytes).saturating_sub(pr.budget_bytes))
            )
        }
    );
    let _ = writeln!(s, "peak at   {}", rep.peak);
    let _ = writeln!(
        s,
        "phases    {}",
        rep.phase_peaks
            .iter()
            .map(|(k, v)| format!("{k} {}", gib(*v)))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(s);
    let _ = writeln!(s, "timeline (live bytes; █ = peak {})", gib(rep.peak_bytes));
    for phase in [Phase::Forward, Phase::Backward, Phase::Optimizer] {
        let samples: Vec<&Sample> = rep.timeline.iter().filter(|x| x.phase == phase).collect();
        let top = samples.iter().map(|x| x.bytes).max().unwrap_or(0);
        let _ = writeln!(
            s,
            "  {:<9} {:<64} max {}",
            phase.as_str(),
            sparkline(&samples, rep.peak_bytes, 64),
            gib(top)
        );
    }
    let _ = writeln!(s);
    let t = &c.time;
    let _ = writeln!(
        s,
        "time      {:.3} s per step, {:.0} tokens/s (matmuls {:.3} s, memory-bound {:.3} s, optimizer {:.3} s, communication {:.3} s)",
        t.step_seconds, t.tokens_per_second, t.compute_seconds, t.memory_seconds, t.optimizer_seconds, t.communication_seconds
    );
    render_ranks(&mut s, c);
    let _ = writeln!(s);
    let _ = writeln!(s, "decisions");
    for d in &c.explain.decisions {
        let _ = writeln!(s, "  [{}] {}: {}", d.pass, d.what, d.why);
    }
    if !c.explain.rejected.is_empty() {
        let _ = writeln!(s);
        let _ = writeln!(s, "rejected alternatives (best candidate of each)");
        for r in &c.explain.rejected {
            let _ = writeln!(s, "  {}: {}", r.what, r.why);
        }
    }
    s
}

/// Bytes in the largest binary unit that keeps them above 1 (KiB, MiB or GiB).
fn bytes_h(b: f64) -> String {
    const K: f64 = 1024.0;
    if b >= K * K * K {
        format!("{:.2} GiB", b / (K * K * K))
    } else if b >= K * K {
        format!("{:.2} MiB", b / (K * K))
    } else if b >= K {
        format!("{:.2} KiB", b / K)
    } else {
        format!("{b:.0} B")
    }
}

/// Seconds with enough digits for millisecond-scale traffic.
fn secs(x: f64) -> String {
    format!("{x:.4} s")
}

/// The `per rank` section: what each distinct rank holds and what the worst rank sends.
/// Shown when the plan spans more than one GPU or moves anything to the host.
fn render_ranks(s: &mut String, c: &Compilation) {
    let hw = &c.lowered.hardware;
    let gpus = hw.gpus_per_node * hw.nodes;
    let st = &c.step;
    if gpus <= 1 && st.traffic.is_empty() {
        return;
    }
    let _ = writeln!(s);
    let _ = writeln!(
        s,
        "per rank ({gpus} GPUs on {} node{}; {})",
        hw.nodes,
        if hw.nodes == 1 { "" } else { "s" },
        if c.ranks.len() > 1 {
            "ranks differ by pipeline stage: the first and the last"
        } else {
            "every rank holds the same"
        }
    );
    for r in &c.ranks {
        let _ = writeln!(
            s,
            "  {}: peak {}{}",
            r.layers,
            gib(r.peak_bytes),
            if r.worst && c.ranks.len() > 1 {
                "  ← worst rank, the peak reported above"
            } else {
                ""
            }
        );
        for sh in &r.shards {
            let _ = writeln!(s, "    {sh}");
        }
        for h in &r.holds {
            let _ = writeln!(s, "    {:<14} {:>11}  {}", h.what, gib(h.bytes), h.share);
        }
    }
    let _ = writeln!(s);
    if st.traffic.is_empty() {
        let _ = writeln!(s, "traffic   none: nothing crosses a link");
        return;
    }
    let _ = writeln!(
        s,
        "traffic of the worst rank per step ({} micro-steps; ring collectives, nothing overlapped)",
        c.candidate.grad_accum.max(1)
    );
    let _ = writeln!(
        s,
        "  {:<15} {:<12} {:<11} {:>11} {:>11}  {:<20} {:>10}  what",
        "collective", "group", "link", "per call", "sent/call", "calls", "time/step"
    );
    for t in &st.traffic {
        let calls = format!("{} per {}", t.calls, t.cadence.as_str());
        let _ = writeln!(
            s,
            "  {:<15} {:<12} {:<11} {:>11} {:>11}  {:<20} {:>10}  {}",
            t.collective.as_str(),
            if t.group_size > 1 {
                format!("{} × {}", t.group.as_str(), t.group_size)
            } else {
                t.group.as_str().to_string()
            },
            t.link.as_str(),
            bytes_h(t.bytes_per_call),
            bytes_h(t.sent_bytes_per_call),
            calls,
            secs(t.seconds_per_step),
            t.what
        );
    }
    let parts: Vec<String> = [
        ("data", st.data_parallel_s),
        ("tensor", st.tensor_parallel_s),
        ("context", st.context_parallel_s),
        ("pipeline", st.pipeline_p2p_s),
    ]
    .iter()
    .filter(|(_, x)| *x > 0.0)
    .map(|(k, x)| format!("{k} {}", secs(*x)))
    .collect();
    let mut total = format!(
        "  total     communication {} ({})",
        secs(st.communication_s()),
        if parts.is_empty() {
            "none".to_string()
        } else {
            parts.join(", ")
        }
    );
    if st.offload_s > 0.0 {
        let _ = write!(
            total,
            "; offload {} (CPU optimizer {} of it)",
            secs(st.offload_s),
            secs(st.host_optimizer_s)
        );
    }
    if st.bubble_s > 0.0 {
        let _ = write!(total, "; pipeline bubble {}", secs(st.bubble_s));
    }
    let _ = writeln!(s, "{total}");
}

/// The `--format json` object (DESIGN.md's contract, plus detail).
pub fn to_json(c: &Compilation) -> Value {
    let l = &c.lowered;
    let r = &l.resolved;
    let pr = &l.prediction;
    let rep = &c.report;
    let mut out = json!({
        "target": c.profile.name,
        "memory": {
            "peak_bytes": pr.peak_bytes,
            "budget_bytes": pr.budget_bytes,
            "fits": pr.fits,
            "reserve_bytes": rep.reserve_bytes,
            "breakdown": pr.breakdown,
            "peak_at": { "phase": rep.peak.phase, "op": rep.peak.op, "layer": rep.peak.layer, "text": pr.peak_at },
            "phase_peaks": rep.phase_peaks,
            "timeline": rep.timeline,
        },
        "decisions": c.explain.decisions,
        "rejected": c.explain.rejected,
        "search": c.search,
        "time": {
            "step_seconds": pr.step_seconds,
            "tokens_per_second": pr.tokens_per_second,
            "compute_seconds": c.time.compute_seconds,
            "memory_seconds": c.time.memory_seconds,
            "optimizer_seconds": c.time.optimizer_seconds,
            "communication_seconds": c.time.communication_seconds,
        },
        "resolved": {
            "micro_batch": r.micro_batch,
            "grad_accum": r.grad_accum,
            "data": r.data,
            "zero": r.zero,
            "tensor": r.tensor,
            "pipeline": r.pipeline,
            "context": r.context,
            "expert": r.expert,
            "sequence": r.sequence,
            "checkpoint": r.checkpoint,
            "checkpoint_layers": r.checkpoint_layers,
            "offload": r.offload_names(),
        },
        "parallel": {
            "ranks": c.ranks,
            "traffic": c.step.traffic,
            "communication_seconds": c.step.communication_s(),
            "offload_seconds": c.step.offload_s,
            "host_optimizer_seconds": c.step.host_optimizer_s,
            "bubble_seconds": c.step.bubble_s,
        },
        "residency": l.residency(),
        "params": { "total": rep.params_total, "trainable": rep.params_trainable },
        "graph": c.graph,
    });
    if rep.paged_bytes > 0 {
        // `impl = paged` (memory::paged): the state in unified memory, and what of it the
        // driver keeps on the host at the peak.
        out["memory"]["paged_bytes"] = json!(rep.paged_bytes);
        out["memory"]["paged_evicted_bytes"] = json!(rep.paged_evicted_bytes);
    }
    if rep.host_activation_bytes > 0 {
        out["memory"]["host_activation_bytes"] = json!(rep.host_activation_bytes);
    }
    out
}
