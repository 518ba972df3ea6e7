//! `rcoa init --model M --gpu G [--gpus N] [--nodes K] --global-batch B [--seq-len S] [-o FILE]`:
//! a starting `.plan` with every choice the compiler can make left `auto`.
//!
//! The model is a catalog preset or a Hugging Face `config.json` (or its
//! folder). The plan is checked and compiled before it is written, so what
//! `init` writes always resolves; stderr then says what the compiler chose
//! and what to edit next. Exit status: 0 written, 2 a bad name or value.

use rcoa_compiler::catalog;
use rcoa_compiler::resolve::{did_you_mean, resolve_with_spans, ResolveContext};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(clap::Args)]
pub struct Args {
    /// A model preset (`rcoa catalog models`) or the path of a Hugging Face config.json (or its folder).
    #[arg(long)]
    pub model: String,
    /// A catalog GPU (`rcoa catalog gpus`).
    #[arg(long)]
    pub gpu: String,
    /// GPUs per node.
    #[arg(long, default_value_t = 1)]
    pub gpus: u64,
    /// Nodes.
    #[arg(long, default_value_t = 1)]
    pub nodes: u64,
    /// Sequences per optimizer step, all GPUs together.
    #[arg(long)]
    pub global_batch: u64,
    /// Tokens per sequence (default: 2048, or the model's positions if fewer).
    #[arg(long)]
    pub seq_len: Option<u64>,
    /// Write the plan here instead of stdout (refuses to overwrite).
    #[arg(short = 'o', long = "out", value_name = "FILE")]
    pub out: Option<PathBuf>,
}

pub fn run(args: Args) -> ExitCode {
    match init(&args) {
        Ok(()) => ExitCode::SUCCESS,
        Err(msg) => {
            eprintln!("error: {msg}");
            ExitCode::from(super::common::BAD_PLAN)
        }
    }
}

fn init(args: &Args) -> Result<(), String> {
    let c = catalog::catalog();
    if c.gpu(&args.gpu).is_none() {
        return Err(match did_you_mean(&args.gpu, c.gpu_names()) {
            Some(n) => format!("unknown GPU `{}`: did you mean `{n}`?", args.gpu),
            None => format!("unknown GPU `{}`; `rcoa catalog gpus` lists them", args.gpu),
        });
    }
    for (name, v) in [
        ("--gpus", args.gpus),
        ("--nodes", args.nodes),
        ("--global-batch", args.global_batch),
    ] {
        if v == 0 {
            return Err(format!("{name} must be at least 1"));
        }
    }
    let plan_dir = args
        .out
        .as_ref()
        .and_then(|p| p.parent())
        .map(Path::to_path_buf)
        .unwrap_or_default();
    if !plan_dir.as_os_str().is_empty() {
        std::fs::create_dir_all(&plan_dir)
            .map_err(|e| format!("cannot create `{}`: {e}", plan_dir.display()))?;
    }
    let (model_line, positions) = model_line(&args.model, &plan_dir)?;
    let seq_len = args
        .seq_len
        .unwrap_or_else(|| positions.map_or(2048, |p| p.min(2048)));
    let text = plan_text(args, &model_line, seq_len);
    // What is written must resolve and compile: check it as `rcoa check` would.
    let name = args
        .out
        .as_ref()
        .map_or("<init>".to_string(), |p| p.display().to_string());
    let file = rcoa_grammar::parse(&name, &text).map_err(|e| e.to_string())?;
    let ctx = ResolveContext::new(name.clone(), text.clone(), plan_dir.clone());
    let (spec, _) = resolve_with_spans(&file, &ctx)
        .map_err(|e| super::common::render(&e).trim_end().to_string())?;
    let compiled = rcoa_compiler::compile(&spec).map_err(|e| super::common::render(&e))?;
    match &args.out {
        Some(path) => {
            if path.exists() {
                return Err(format!(
                    "`{}` exists; rcoa init does not overwrite a plan",
                    path.display()
                ));
            }
            super::common::write_atomic(path, text.as_bytes(), |_| Ok(()))
                .map_err(|e| format!("cannot write `{}`: {e}", path.display()))?;
            eprintln!("wrote {}", path.display());
        }
        None => print!("{text}"),
    }
    let p = &compiled.lowered.prediction;
    let r = &compiled.lowered.resolved;
    eprintln!(
        "{}: peak {:.2} GiB of {:.2} GiB per GPU; micro_batch {} × grad_accum {} × data {}, zero {}, checkpoint {}",
        if p.fits { "fits" } else { "does not fit" },
        p.peak_bytes as f64 / GIB,
        p.budget_bytes as f64 / GIB,
        r.micro_batch,
        r.grad_accum,
        r.data,
        r.zero,
        r.checkpoint
    );
    eprintln!("next:");
    for line in NEXT {
        eprintln!("  - {line}");
    }
    Ok(())
}

const GIB: f64 = (1u64 << 30) as f64;

/// What a user edits first, in the order it matters.
const NEXT: &[&str] = &[
    "`rcoa compile PLAN --explain` shows every choice the compiler made and the alternatives it rejected",
    "precision: `precision bf16` trains in bf16 with an fp32 master; `{ params = fp32 compute = bf16 master = none }` is autocast",
    "a LoRA fine-tune: add `adapter lora { rank = 16 alpha = 32 targets = [q, k, v, o] }` (or `adapter qlora` for a 4-bit base)",
    "optimizer: lr, betas and weight_decay in `optimizer adamw { ... }`; `adam8bit` halves optimizer state",
    "fit: allow `offload = [optimizer]` to let the compiler move state to the host; `budget = 90%` leaves headroom",
    "target: `target pytorch`, `fsdp`, `deepspeed` or `megatron` predicts that engine's job instead of `rcoa run` (docs/engines.md)",
];

/// The `model` line for a preset or a Hugging Face config, and the model's
/// positions when the catalog knows them.
fn model_line(model: &str, plan_dir: &Path) -> Result<(String, Option<u64>), String> {
    let path = Path::new(model);
    let looks_like_path = model.contains('/') || model.ends_with(".json") || path.exists();
    if !looks_like_path {
        let c = catalog::catalog();
        return match c.model(model) {
            Some(m) => Ok((format!("model \"{model}\""), Some(m.spec.max_positions))),
            None => Err(match did_you_mean(model, c.model_names()) {
                Some(n) => format!("unknown model preset `{model}`: did you mean `{n}`?"),
                None => format!(
                    "unknown model preset `{model}`; `rcoa catalog models` lists them, or give the path of a Hugging Face config.json"
                ),
            }),
        };
    }
    let config = if path.is_dir() {
        path.join("config.json")
    } else {
        path.to_path_buf()
    };
    if !config.is_file() {
        return Err(format!("no Hugging Face config at `{}`", config.display()));
    }
    // The plan reads the path relative to its own folder.
    let absolute =
        std::fs::canonicalize(&config).map_err(|e| format!("`{}`: {e}", config.display()))?;
    let base = std::fs::canonicalize(if plan_dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        plan_dir
    })
    .map_err(|e| format!("`{}`: {e}", plan_dir.display()))?;
    let shown = absolute
        .strip_prefix(&base)
        .map(Path::to_path_buf)
        .unwrap_or(absolute.clone());
    let shown = shown.display().to_string();
    if shown.contains('"') || shown.contains('\\') {
        return Err(format!(
            "the path `{shown}` cannot be written in a plan string"
        ));
    }
    Ok((format!("model hf \"{shown}\""), None))
}

/// The precision line: bf16 with an fp32 master, or on a GPU whose bf16 runs on the CUDA
/// cores the same in fp16 (its tensor cores' type; fp16's loss is scaled, by PyTorch's
/// GradScaler and by `rcoa run` alike), with a comment that says why.
fn precision_lines(gpu: Option<&catalog::GpuEntry>) -> String {
    match gpu {
        Some(gpu) if !gpu.bf16_tensor_cores => format!(
            "# {} has no bf16 tensor cores: bf16 runs on its CUDA cores ({:.1} TFLOP/s).\n\
             # Its fp16 tensor cores ({:.1} TFLOP/s) take fp16: fp16 weights, an fp32 master\n\
             # copy, and the loss scaled dynamically (PyTorch's GradScaler, and `rcoa run`).\n\
             precision fp16\n",
            gpu.name, gpu.bf16_tflops, gpu.fp16_tflops
        ),
        _ => "precision bf16\n".to_string(),
    }
}

fn plan_text(args: &Args, model_line: &str, seq_len: u64) -> String {
    let precision = precision_lines(catalog::gpu(&args.gpu));
    format!(
        "# Written by `rcoa init`: every choice the compiler can make is `auto`.\n\
         # `rcoa compile THIS.plan --explain` shows what it decides and why.\n\
         {model_line}\n\
         \n\
         hardware {{\n  gpu           = {gpu}\n  gpus_per_node = {gpus}\n  nodes         = {nodes}\n}}\n\
         \n\
         {precision}\
         \n\
         optimizer adamw {{ lr = 2e-5 }}\n\
         \n\
         train {{\n  seq_len      = {seq_len}\n  global_batch = {batch}\n  micro_batch  = auto\n  grad_accum   = auto\n}}\n\
         \n\
         parallel {{ data = auto  zero = auto  tensor = auto  pipeline = auto }}\n\
         \n\
         fit {{\n  budget     = 95%\n  checkpoint = auto\n  offload    = []\n}}\n",
        gpu = args.gpu,
        gpus = args.gpus,
        nodes = args.nodes,
        batch = args.global_batch,
    )
}
