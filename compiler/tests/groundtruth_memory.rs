//! Drives the memory model from the measured ground truth without the front end:
//! each row of `tests/groundtruth/h100-pytorch.jsonl` becomes a `Spec` the way
//! `rcoa validate` writes its `.plan` file (`rcoa_compiler::validate::plan_text`),
//! and the predicted peak is compared with the measured one.
//! `RCOA_GT_VERBOSE=1 cargo test -p rcoa-compiler --test groundtruth_memory -- --nocapture`
//! prints every row (with the predicted/measured forward end, forward peak and backward
//! peak of step 2); `RCOA_GT_ROW=<name>` adds that row's breakdown and timeline.

use rcoa_compiler::memory::{evaluate, Candidate};
use rcoa_compiler::profile::Profile;
use rcoa_compiler::spec::*;
use rcoa_compiler::testing::SpecBuilder;
use serde_json::Value;
use std::path::PathBuf;

fn data_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/groundtruth/h100-pytorch.jsonl")
}

fn proj(name: &str) -> Vec<Proj> {
    match name {
        "q_proj" | "query" => vec![Proj::Q],
        "k_proj" | "key" => vec![Proj::K],
        "v_proj" | "value" => vec![Proj::V],
        "o_proj" | "dense" | "attention.output.dense" => vec![Proj::O],
        "gate_proj" => vec![Proj::Gate],
        "up_proj" | "intermediate.dense" => vec![Proj::Up],
        "down_proj" | "output.dense" => vec![Proj::Down],
        _ => vec![],
    }
}

fn spec_of(c: &Value) -> Spec {
    let u = |k: &str| c[k].as_u64().unwrap();
    let llama = c["family"] == "llama";
    let hidden = u("hidden");
    let heads = u("heads");
    let wd = if c["weight_dtype"] == "bf16" {
        Dtype::Bf16
    } else {
        Dtype::Fp32
    };
    let compute = if c["autocast"] == "bf16" {
        Dtype::Bf16
    } else {
        wd
    };
    let (kind, implementation, momentum) = match c["optimizer"].as_str().unwrap() {
        "adamw" => (OptimizerKind::Adamw, OptImpl::Foreach, 0.0),
        "adamw_fused" => (OptimizerKind::Adamw, OptImpl::Fused, 0.0),
        "sgd" => (OptimizerKind::Sgd, OptImpl::Foreach, 0.0),
        "sgd_momentum" => (OptimizerKind::Sgd, OptImpl::Foreach, 0.9),
        "adafactor" => (OptimizerKind::Adafactor, OptImpl::Foreach, 0.0),
        o => panic!("optimizer {o}"),
    };
    let adapter = c["lora"].as_object().map(|l| {
        let mut targets: Vec<Proj> = l["targets"]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|t| proj(t.as_str().unwrap()))
            .collect();
        targets.sort();
        targets.dedup();
        AdapterSpec {
            kind: AdapterKind::Lora,
            rank: l["r"].as_u64().unwrap(),
            alpha: l["alpha"].as_f64().unwrap(),
            targets,
            dropout: l.get("dropout").and_then(|d| d.as_f64()).unwrap_or(0.0),
            base: wd,
        }
    });
    let checkpoint = if c["grad_ckpt"].as_bool().unwrap() {
        match c["ckpt_every"].as_u64().unwrap_or(1) {
            1 => CheckpointChoice::Full,
            n => CheckpointChoice::Every(n),
        }
    } else {
        CheckpointChoice::None
    };
    let mb = u("batch");
    let ga = c["grad_accum"].as_u64().unwrap_or(1);
    let family = if llama {
        SpecBuilder::new()
    } else {
        SpecBuilder::new().encoder()
    };
    family
        .layers(u("layers"))
        .hidden(hidden)
        .heads(heads, u("kv_heads"))
        .head_dim(hidden / heads)
        .ffn(u("intermediate"))
        .vocab(u("vocab"))
        .max_positions(u("max_pos"))
        .tie_embeddings(c["tie_embeddings"].as_bool().unwrap())
        .dropout(c["dropout"].as_f64().unwrap_or(0.0))
        .adapter(adapter)
        .gpu_tflops(989.0)
        .precision(wd, compute, None)
        .optimizer(kind)
        .optimizer_impl(implementation)
        .momentum(momentum)
        .betas(0.9, 0.999)
        .seq_len(u("seq"))
        .global_batch(mb * ga)
        .micro_batch(Choice::Fixed(mb))
        .grad_accum(Choice::Fixed(ga))
        .attention(if c["attn"] == "eager" {
            Attention::Eager
        } else {
            Attention::Sdpa
        })
        .loss(match c["loss"].as_str().unwrap() {
            "lm" => Loss::CausalLm,
            "mlm" => Loss::MaskedLm,
            _ => Loss::Contrastive,
        })
        .checkpoint(checkpoint)
        .build()
}

fn candidate(spec: &Spec) -> Candidate {
    let layers = spec.model.layers;
    let checkpoint_layers = match spec.fit.checkpoint {
        CheckpointChoice::Full => (0..layers).collect(),
        CheckpointChoice::Every(n) => (0..layers).filter(|i| i % n == 0).collect(),
        _ => vec![],
    };
    Candidate {
        micro_batch: spec.train.micro_batch.fixed().unwrap(),
        grad_accum: spec.train.grad_accum.fixed().unwrap(),
        data: 1,
        zero: 0,
        tensor: 1,
        pipeline: 1,
        context: 1,
        sequence: false,
        checkpoint_layers,
        offload: vec![],
    }
}

#[test]
fn pytorch_profile_tracks_groundtruth() {
    let path = data_path();
    let verbose = std::env::var("RCOA_GT_VERBOSE").is_ok();
    let profile = Profile::pytorch();
    let mut errs = Vec::new();
    for line in std::fs::read_to_string(path).unwrap().lines() {
        let r: Value = serde_json::from_str(line).unwrap();
        if r["record"] != "config" {
            continue;
        }
        let spec = spec_of(&r["config"]);
        let cand = candidate(&spec);
        let rep = evaluate(&spec, &cand, &profile, verbose);
        let name = r["name"].as_str().unwrap();
        let fits = rep.peak_bytes + rep.reserve_bytes <= spec.hardware.gpu.memory_bytes;
        if r["oom"].as_bool().unwrap() {
            if verbose {
                println!(
                    "{name:30} OOM predicted {:.2} GiB fits={fits}",
                    rep.peak_bytes as f64 / 2f64.powi(30)
                );
            }
            assert!(!fits, "{name}: measured OOM, predicted fit");
            continue;
        }
        let meas = r["peak_train_B"].as_f64().unwrap();
        let err = (rep.peak_bytes as f64 - meas) / meas;
        if verbose {
            let phase = r["peak_phase_step3"].as_str().unwrap_or("?");
            println!(
                "{name:30} meas {:7.2} pred {:7.2} err {:+6.1}%  meas@{phase} pred@{} {:?}",
                meas / 1e9,
                rep.peak_bytes as f64 / 1e9,
                100.0 * err,
                rep.peak,
                rep.phase_peaks
                    .iter()
                    .map(|(k, v)| format!("{k}={:.2}", *v as f64 / 1e9))
                    .collect::<Vec<_>>()
            );
        }
        if verbose {
            let fe = rep
                .timeline
                .iter()
                .find(|s| s.op == "forward end")
                .map_or(0, |s| s.bytes);
            let fp = rep.phase_peaks.get("forward").copied().unwrap_or(0);
            let bp = rep.phase_peaks.get("backward").copied().unwrap_or(0);
            let st = &r["steps"][1]["phases"];
            let mfe = st[0]["alloc_B"].as_f64().unwrap_or(0.0);
            let mfp = st[0]["peak_B"].as_f64().unwrap_or(0.0);
            let mbp = st[1]["peak_B"].as_f64().unwrap_or(0.0);
            println!(
                "    fwd_end {:.3}/{:.3} fwd_peak {:.3}/{:.3} bwd_peak {:.3}/{:.3}",
                fe as f64 / 1e9,
                mfe / 1e9,
                fp as f64 / 1e9,
                mfp / 1e9,
                bp as f64 / 1e9,
                mbp / 1e9
            );
        }
        if std::env::var("RCOA_GT_ROW").is_ok_and(|r| r == name) {
            println!("breakdown {:?}", rep.breakdown);
            for smp in &rep.timeline {
                println!(
                    "  {:?} {:?} {} {:.3}",
                    smp.phase,
                    smp.layer,
                    smp.op,
                    smp.bytes as f64 / 1e9
                );
            }
        }
        assert!(fits, "{name}: fits in reality, predicted not to");
        errs.push(err.abs());
    }
    errs.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let median = errs[errs.len() / 2];
    let max = *errs.last().unwrap();
    println!("median {:.2}% max {:.2}%", 100.0 * median, 100.0 * max);
    assert!(median <= 0.03 && max <= 0.12, "median {median} max {max}");
}
