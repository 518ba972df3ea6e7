//! Drives the memory model from the measured ground truth without the front end:
//! each row of `tests/groundtruth/h100-pytorch.jsonl` (read with `rcoa_compiler::validate::row`)
//! becomes a `Spec` the way `rcoa validate` writes its `.plan` file, and the predicted peak
//! is compared with the measured one.
//! `RCOA_GT_VERBOSE=1 cargo test -p rcoa-compiler --test groundtruth_memory -- --nocapture`
//! prints every row (with the predicted/measured forward end, forward peak and backward
//! peak of step 2); `RCOA_GT_ROW=<name>` adds that row's breakdown and timeline.

use rcoa_compiler::memory::{evaluate, Candidate};
use rcoa_compiler::profile::Profile;
use rcoa_compiler::spec::*;
use rcoa_compiler::testing::SpecBuilder;
use rcoa_compiler::validate::plan::lora_target;
use rcoa_compiler::validate::row::{
    self, AttnImpl, Autocast, Family, LossName, OptimizerName, RunConfig, WeightDtype,
};
use serde_json::Value;
use std::path::PathBuf;

fn data_path() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/groundtruth/h100-pytorch.jsonl")
}

fn proj(name: &str) -> Option<Proj> {
    Some(match lora_target(name)? {
        "q" => Proj::Q,
        "k" => Proj::K,
        "v" => Proj::V,
        "o" => Proj::O,
        "gate" => Proj::Gate,
        "up" => Proj::Up,
        _ => Proj::Down,
    })
}

fn spec_of(c: &RunConfig) -> Spec {
    let wd = match c.weight_dtype {
        WeightDtype::Bf16 => Dtype::Bf16,
        WeightDtype::Fp32 => Dtype::Fp32,
    };
    let compute = match c.autocast {
        Autocast::Bf16 => Dtype::Bf16,
        Autocast::None => wd,
    };
    let (kind, implementation, momentum) = match c.optimizer {
        OptimizerName::Adamw => (OptimizerKind::Adamw, OptImpl::Foreach, 0.0),
        OptimizerName::AdamwFused => (OptimizerKind::Adamw, OptImpl::Fused, 0.0),
        OptimizerName::Sgd => (OptimizerKind::Sgd, OptImpl::Foreach, 0.0),
        OptimizerName::SgdMomentum => (OptimizerKind::Sgd, OptImpl::Foreach, 0.9),
        OptimizerName::Adafactor => (OptimizerKind::Adafactor, OptImpl::Foreach, 0.0),
    };
    let adapter = c.lora.as_ref().map(|l| {
        let mut targets: Vec<Proj> = l.targets.iter().filter_map(|t| proj(t)).collect();
        targets.sort();
        targets.dedup();
        AdapterSpec {
            kind: AdapterKind::Lora,
            rank: l.r,
            alpha: l.alpha.as_f64().unwrap(),
            targets,
            dropout: l.dropout.as_f64().unwrap(),
            base: wd,
        }
    });
    let checkpoint = match (c.grad_ckpt, c.ckpt_every) {
        (false, _) => CheckpointChoice::None,
        (true, 1) => CheckpointChoice::Full,
        (true, n) => CheckpointChoice::Every(n),
    };
    let (mb, ga) = (c.batch, c.grad_accum);
    let family = match c.family {
        Family::Llama => SpecBuilder::new(),
        Family::Xlmr => SpecBuilder::new().encoder(),
    };
    family
        .layers(c.layers)
        .hidden(c.hidden)
        .heads(c.heads, c.kv_heads)
        .head_dim(c.hidden / c.heads)
        .ffn(c.intermediate)
        .vocab(c.vocab)
        .max_positions(c.max_pos)
        .tie_embeddings(c.tie_embeddings)
        .dropout(c.dropout.as_f64().unwrap())
        .adapter(adapter)
        .gpu_tflops(989.0)
        .precision(wd, compute, None)
        .optimizer(kind)
        .optimizer_impl(implementation)
        .momentum(momentum)
        // transformers' Adafactor as measured: no first moment (`beta1=None`), the
        // resolver's default for `optimizer adafactor`.
        .betas(
            if kind == OptimizerKind::Adafactor {
                0.0
            } else {
                0.9
            },
            0.999,
        )
        .seq_len(c.seq)
        .global_batch(mb * ga)
        .micro_batch(Choice::Fixed(mb))
        .grad_accum(Choice::Fixed(ga))
        .attention(match c.attn {
            AttnImpl::Eager => Attention::Eager,
            AttnImpl::Sdpa => Attention::Sdpa,
        })
        .loss(match c.loss {
            LossName::Lm => Loss::CausalLm,
            LossName::Mlm => Loss::MaskedLm,
            LossName::Contrastive => Loss::Contrastive,
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
        selective: spec.fit.checkpoint == CheckpointChoice::Selective,
        offload: vec![],
    }
}

#[test]
fn pytorch_profile_tracks_groundtruth() {
    let path = data_path();
    let measured = row::read(&path).unwrap_or_else(|e| panic!("{e}"));
    // The per-phase measurements the typed rows leave out, for the verbose print.
    let raw: Vec<Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|r| r["record"] == "config")
        .collect();
    let verbose = std::env::var("RCOA_GT_VERBOSE").is_ok();
    let profile = Profile::pytorch();
    let mut errs = Vec::new();
    for (run, r) in measured.runs.iter().zip(&raw) {
        let spec = spec_of(&run.config);
        let cand = candidate(&spec);
        let rep = evaluate(&spec, &cand, &profile, verbose);
        let name = run.name.as_str();
        let fits = rep.peak_bytes + rep.reserve_bytes <= spec.hardware.gpu.memory_bytes;
        if run.oom {
            if verbose {
                println!(
                    "{name:30} OOM predicted {:.2} GiB fits={fits}",
                    rep.peak_bytes as f64 / 2f64.powi(30)
                );
            }
            assert!(!fits, "{name}: measured OOM, predicted fit");
            continue;
        }
        let meas = run.peak_train_bytes.unwrap() as f64;
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
