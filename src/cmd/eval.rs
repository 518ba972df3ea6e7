//! `rcoa eval PLAN --data FILE [--format json]`: the held-out loss of the
//! plan's model (its Hugging Face weights, a `--checkpoint` written by
//! `rcoa run --save`, or the seeded random initialisation) on a data file,
//! forward only on the CPU, under the conventions `docs/data.md` pins
//! (`rcoa_backend::eval`). Exit status: 0 done, 2 bad plan, data or weights.

use rcoa_backend::eval::EvalOptions;
use rcoa_compiler::lowered::LoweredPlan;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

pub use super::common::Format;

#[derive(clap::Args)]
pub struct Args {
    /// The `.plan` file whose model to evaluate.
    plan: PathBuf,
    /// Held-out data: JSONL `{"text": …}` documents (causal LM), JSONL pairs
    /// `{"query": …, "positive": …}` (contrastive), or plain text (one document).
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// Evaluate the weights of a checkpoint written by `rcoa run --save`.
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    /// Seed of the random initialisation (and LoRA's A) when the plan has no weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    #[arg(long, value_enum, default_value = "text")]
    format: Format,
}

/// The folder of a `model hf "PATH"` plan's config (where `tokenizer.json`
/// sits): PATH is relative to the plan's folder, and names the folder or
/// its `config.json`. `None` for presets and custom shapes.
pub fn hf_config_dir(plan_path: &Path, plan: &LoweredPlan) -> Option<PathBuf> {
    let rel = plan.model.name.strip_prefix("hf:")?;
    let full = plan_path.parent().unwrap_or(Path::new("")).join(rel);
    if full.is_dir() {
        Some(full)
    } else {
        full.parent().map(Path::to_path_buf)
    }
}

pub fn run(args: Args) -> ExitCode {
    // The executor's forward, so the plan is compiled for it (`target burn`), which refuses
    // what it does not compute (RoPE rescaling it does not know, a sliding window shorter
    // than the sequence) as `rcoa run` does.
    let plan = match super::run::lower_plan(&args.plan) {
        Ok(p) => p,
        Err(code) => return code,
    };
    let opts = EvalOptions {
        data: args.data.clone(),
        tokenizer: hf_config_dir(&args.plan, &plan),
        checkpoint: args.checkpoint.clone(),
        seed: args.seed,
    };
    match rcoa_backend::eval::evaluate_plan_cpu(&plan, &opts) {
        Ok(r) => {
            let unit = r.unit;
            if args.format == Format::Json {
                let v = serde_json::json!({
                    "event": "eval", "eval_loss": r.eval_loss, "examples": r.examples,
                    "unit": unit, "batches": r.batches, "step": r.step,
                    "data": args.data.display().to_string(), "weights": plan.model.weights,
                });
                println!("{v}");
            } else {
                println!("eval loss  {:.6}", r.eval_loss);
                println!(
                    "data       {} ({} {unit} in {} batches)",
                    args.data.display(),
                    r.examples,
                    r.batches
                );
                match (&args.checkpoint, &plan.model.weights) {
                    (Some(c), _) => {
                        println!("weights    checkpoint {} (step {})", c.display(), r.step)
                    }
                    (None, Some(w)) => println!("weights    the Hugging Face checkpoint {w}"),
                    (None, None) => {
                        println!("weights    random initialisation (seed {})", args.seed)
                    }
                }
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{}", rcoa_grammar::render::render_plain(&e));
            ExitCode::from(2)
        }
    }
}
