//! `rcoa validate`: score the memory model against measured training runs.
//!
//! A measurement file is JSON lines. A line with `"record": "config"` is one
//! training configuration run on a GPU: `config` says what ran (the schema of
//! `tests/groundtruth/README.md`), `oom` whether it ran out of memory and
//! `peak_train_B` the highest `torch.cuda.max_memory_allocated()` over its
//! training steps. Other records (`"env"`: the machine) are skipped.
//!
//! Each configuration becomes a `.plan` text ([`plan_text`]), which is
//! parsed, resolved and compiled in-process; `memory.peak_bytes` is compared
//! with `peak_train_B`. A configuration measured out of memory must be
//! predicted not to fit. [`Summary`] prints the one-line verdict.

use serde::Deserialize;
use std::fmt;

/// One measured configuration, as the measuring script writes it.
#[derive(Clone, Debug, Deserialize)]
pub struct Config {
    pub name: String,
    /// `llama` (a decoder) or `xlmr` (an encoder).
    pub family: String,
    pub hidden: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub intermediate: u64,
    pub vocab: u64,
    pub max_pos: u64,
    pub tie_embeddings: bool,
    /// Micro-batch.
    pub batch: u64,
    pub seq: u64,
    #[serde(default = "one")]
    pub grad_accum: u64,
    /// `fp32` or `bf16`.
    pub weight_dtype: String,
    /// `bf16` or `none`.
    pub autocast: String,
    /// `adamw`, `adamw_fused`, `sgd`, `sgd_momentum`, `adafactor`.
    pub optimizer: String,
    pub grad_ckpt: bool,
    #[serde(default = "one")]
    pub ckpt_every: u64,
    /// `sdpa` or `eager`.
    pub attn: String,
    #[serde(default)]
    pub lora: Option<Lora>,
    /// `lm`, `mlm` or `contrastive`.
    pub loss: String,
    #[serde(default)]
    pub dropout: f64,
}

fn one() -> u64 {
    1
}

/// A PEFT LoRA adapter as measured.
#[derive(Clone, Debug, Deserialize)]
pub struct Lora {
    pub r: u64,
    pub alpha: f64,
    /// Hugging Face module names (`q_proj`, `query`, `output.dense`, ...).
    pub targets: Vec<String>,
    #[serde(default)]
    pub dropout: f64,
}

/// A `"record": "config"` line.
#[derive(Clone, Debug, Deserialize)]
pub struct Row {
    pub config: Config,
    pub oom: bool,
    /// Measured peak allocated bytes over the training steps (absent or
    /// meaningless for OOM rows).
    #[serde(default, rename = "peak_train_B")]
    pub peak_train_bytes: Option<f64>,
}

/// A line that is not a usable measurement.
#[derive(Clone, Debug, PartialEq)]
pub struct BadLine {
    /// 1-based.
    pub line: usize,
    pub message: String,
}

impl fmt::Display for BadLine {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "line {}: {}", self.line, self.message)
    }
}

/// The configuration rows of a measurement file, in order. Blank lines are
/// skipped; any other line must be a JSON object with a `record` field.
pub fn parse_rows(text: &str) -> Result<Vec<Row>, BadLine> {
    let mut rows = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let bad = |message: String| BadLine {
            line: i + 1,
            message,
        };
        if line.trim().is_empty() {
            continue;
        }
        let value: serde_json::Value =
            serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
        let record = value
            .get("record")
            .ok_or_else(|| bad("no `record` field (expected \"config\" or \"env\")".into()))?;
        if record != "config" {
            continue;
        }
        let row: Row = serde_json::from_value(value)
            .map_err(|e| bad(format!("not a measured configuration: {e}")))?;
        if !row.oom && row.peak_train_bytes.is_none() {
            return Err(bad(format!(
                "configuration `{}` did not run out of memory but has no `peak_train_B`",
                row.config.name
            )));
        }
        rows.push(row);
    }
    Ok(rows)
}

/// Rcoa's short name of a Hugging Face module that LoRA targets.
fn lora_target(module: &str) -> &str {
    match module {
        "q_proj" | "query" => "q",
        "k_proj" | "key" => "k",
        "v_proj" | "value" => "v",
        "o_proj" | "dense" | "attention.output.dense" => "o",
        "gate_proj" => "gate",
        "up_proj" | "intermediate.dense" => "up",
        "down_proj" | "output.dense" => "down",
        other => other,
    }
}

/// The `.plan` text that describes a measured configuration (`target pytorch`:
/// the measurements are PyTorch eager with Hugging Face models and PEFT).
pub fn plan_text(c: &Config) -> Result<String, String> {
    let llama = match c.family.as_str() {
        "llama" => true,
        "xlmr" => false,
        f => return Err(format!("unknown family `{f}` (expected llama or xlmr)")),
    };
    let mut out = format!("# measured configuration {}\nmodel {{\n", c.name);
    let keys: [(&str, String); 12] = [
        ("arch", if llama { "decoder" } else { "encoder" }.into()),
        ("layers", c.layers.to_string()),
        ("hidden", c.hidden.to_string()),
        ("heads", c.heads.to_string()),
        ("kv_heads", c.kv_heads.to_string()),
        ("ffn", c.intermediate.to_string()),
        ("mlp", if llama { "swiglu" } else { "gelu" }.into()),
        ("norm", if llama { "rmsnorm" } else { "layernorm" }.into()),
        ("vocab", c.vocab.to_string()),
        ("max_positions", c.max_pos.to_string()),
        ("tie_embeddings", c.tie_embeddings.to_string()),
        ("dropout", format!("{:?}", c.dropout)),
    ];
    for (k, v) in keys {
        out += &format!("  {k} = {v}\n");
    }
    out += "}\n";
    if let Some(l) = &c.lora {
        let mut targets: Vec<&str> = Vec::new();
        for t in &l.targets {
            let short = lora_target(t);
            if !targets.contains(&short) {
                targets.push(short);
            }
        }
        out += &format!(
            "adapter lora {{ rank = {}  alpha = {:?}  targets = [{}]  dropout = {:?} }}\n",
            l.r,
            l.alpha,
            targets.join(", "),
            l.dropout
        );
    }
    out += "hardware { gpu = h100-80gb }\n";
    let compute = if c.autocast == "bf16" {
        "bf16"
    } else {
        c.weight_dtype.as_str()
    };
    out += &format!(
        "precision {{ params = {}  compute = {compute}  master = none }}\n",
        c.weight_dtype
    );
    out += match c.optimizer.as_str() {
        "adamw" => "optimizer adamw { impl = foreach }\n",
        "adamw_fused" => "optimizer adamw { impl = fused }\n",
        "sgd_momentum" => "optimizer sgd { momentum = 0.9 }\n",
        "sgd" => "optimizer sgd { momentum = 0 }\n",
        "adafactor" => "optimizer adafactor\n",
        o => return Err(format!("unknown optimizer `{o}`")),
    };
    let loss = match c.loss.as_str() {
        "lm" => "causal_lm",
        "mlm" => "masked_lm",
        "contrastive" => "contrastive",
        l => return Err(format!("unknown loss `{l}`")),
    };
    out += &format!(
        "train {{ seq_len = {}  micro_batch = {}  grad_accum = {}  global_batch = {}  attention = {}  loss = {loss} }}\n",
        c.seq,
        c.batch,
        c.grad_accum,
        c.batch * c.grad_accum,
        c.attn
    );
    let checkpoint = match (c.grad_ckpt, c.ckpt_every) {
        (false, _) => "none".to_string(),
        (true, 0 | 1) => "full".to_string(),
        (true, n) => format!("every {n}"),
    };
    out += &format!("fit {{ checkpoint = {checkpoint}  offload = [] }}\ntarget pytorch\n");
    Ok(out)
}

/// What the compiler predicts for a plan text: peak bytes per GPU and whether it fits.
pub fn predict(name: &str, text: &str) -> Result<(u64, bool), String> {
    let file = rcoa_grammar::parse(name, text).map_err(|e| e.to_string())?;
    let ctx = crate::resolve::ResolveContext::new(name.to_string(), text.to_string(), ".");
    let (spec, _) = crate::resolve::resolve_with_spans(&file, &ctx).map_err(|e| {
        let mut s = e.to_string();
        if let Some(first) = miette::Diagnostic::related(&e).and_then(|mut r| r.next()) {
            s = format!("{s}: {first}");
        }
        s
    })?;
    let c = crate::compile(&spec).map_err(|e| e.to_string())?;
    Ok((c.lowered.prediction.peak_bytes, c.lowered.prediction.fits))
}

/// How one configuration scored.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Ran: measured and predicted peak bytes, `(predicted - measured) / measured`.
    Measured {
        measured: u64,
        predicted: u64,
        rel_err: f64,
        fits: bool,
    },
    /// Ran out of memory; right when predicted not to fit.
    Oom { predicted: u64, fits: bool },
    /// No prediction (the plan did not compile): why.
    Failed(String),
}

/// One configuration's name and outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct Scored {
    pub name: String,
    pub outcome: Outcome,
}

/// Score one measured row.
pub fn score(row: &Row) -> Scored {
    let name = row.config.name.clone();
    let predicted = plan_text(&row.config).and_then(|t| predict(&format!("{name}.plan"), &t));
    let outcome = match predicted {
        Err(e) => Outcome::Failed(e),
        Ok((predicted, fits)) if row.oom => Outcome::Oom { predicted, fits },
        Ok((predicted, fits)) => {
            let measured = row.peak_train_bytes.unwrap_or(0.0);
            Outcome::Measured {
                measured: measured as u64,
                predicted,
                rel_err: (predicted as f64 - measured) / measured,
                fits,
            }
        }
    };
    Scored { name, outcome }
}

/// The verdict over all rows.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Summary {
    /// Configurations that ran (not OOM) and were predicted.
    pub n: usize,
    pub median_abs_err: f64,
    pub p90_abs_err: f64,
    pub max_abs_err: f64,
    pub oom_correct: usize,
    pub oom_total: usize,
    pub fit_correct: usize,
    pub fit_total: usize,
    pub failures: usize,
}

impl Summary {
    /// Median as Python's `statistics.median`; p90 as the sorted error at
    /// `round(0.9 × (n − 1))`, rounding half to even as Python does.
    pub fn of(scored: &[Scored]) -> Summary {
        let mut errs = Vec::new();
        let (mut oom_correct, mut oom_total, mut fit_correct, mut fit_total, mut failures) =
            (0, 0, 0, 0, 0);
        for s in scored {
            match &s.outcome {
                Outcome::Measured { rel_err, fits, .. } => {
                    errs.push(rel_err.abs());
                    fit_total += 1;
                    fit_correct += usize::from(*fits);
                }
                Outcome::Oom { fits, .. } => {
                    oom_total += 1;
                    oom_correct += usize::from(!fits);
                }
                Outcome::Failed(_) => failures += 1,
            }
        }
        errs.sort_by(f64::total_cmp);
        let n = errs.len();
        let median = match n {
            0 => 0.0,
            _ if n % 2 == 1 => errs[n / 2],
            _ => (errs[n / 2 - 1] + errs[n / 2]) / 2.0,
        };
        let p90 = if n == 0 {
            0.0
        } else {
            let at = (0.9 * (n - 1) as f64).round_ties_even() as usize;
            errs[at.min(n - 1)]
        };
        Summary {
            n,
            median_abs_err: median,
            p90_abs_err: p90,
            max_abs_err: errs.last().copied().unwrap_or(0.0),
            oom_correct,
            oom_total,
            fit_correct,
            fit_total,
            failures,
        }
    }
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.n == 0 {
            return write!(
                f,
                "accuracy: n=0 oom_correct={}/{} failures={}",
                self.oom_correct, self.oom_total, self.failures
            );
        }
        write!(
            f,
            "accuracy: n={} median_abs_err={:.1}% p90_abs_err={:.1}% max_abs_err={:.1}% oom_correct={}/{} fit_correct={}/{} failures={}",
            self.n,
            100.0 * self.median_abs_err,
            100.0 * self.p90_abs_err,
            100.0 * self.max_abs_err,
            self.oom_correct,
            self.oom_total,
            self.fit_correct,
            self.fit_total,
            self.failures
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA: &str = r#"{"record": "config", "name": "t", "config": {"name": "t", "family": "llama", "hidden": 256, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 512, "vocab": 1000, "max_pos": 512, "tie_embeddings": false, "batch": 2, "seq": 128, "grad_accum": 1, "weight_dtype": "fp32", "autocast": "bf16", "optimizer": "adamw", "grad_ckpt": true, "ckpt_every": 2, "attn": "sdpa", "lora": {"r": 8, "alpha": 16, "targets": ["q_proj", "v_proj", "query"], "dropout": 0.05}, "loss": "lm", "dropout": 0.0}, "oom": false, "peak_train_B": 100000000}"#;

    #[test]
    fn rows_skip_env_and_blank_lines() {
        let text = format!("{{\"record\": \"env\", \"gpu\": \"x\"}}\n\n{LLAMA}\n");
        let rows = parse_rows(&text).unwrap();
        assert_eq!(rows.len(), 1);
        assert_eq!(rows[0].config.name, "t");
        assert_eq!(rows[0].peak_train_bytes, Some(1e8));
    }

    #[test]
    fn malformed_lines_name_their_line() {
        let e = parse_rows(&format!("{LLAMA}\n{{not json\n")).unwrap_err();
        assert_eq!(e.line, 2);
        assert!(e.message.contains("not JSON"), "{e}");
        let e = parse_rows("{\"name\": 1}\n").unwrap_err();
        assert!(e.message.contains("record"), "{e}");
        let e = parse_rows("{\"record\": \"config\", \"config\": {\"name\": \"x\"}}").unwrap_err();
        assert!(e.message.contains("not a measured configuration"), "{e}");
        let e = parse_rows(&LLAMA.replace(", \"peak_train_B\": 100000000", "")).unwrap_err();
        assert!(e.message.contains("peak_train_B"), "{e}");
    }

    #[test]
    fn plan_text_compiles_and_maps_lora_targets_once() {
        let rows = parse_rows(LLAMA).unwrap();
        let text = plan_text(&rows[0].config).unwrap();
        assert!(text.contains("targets = [q, v]"), "{text}");
        assert!(text.contains("checkpoint = every 2"), "{text}");
        assert!(text.contains("params = fp32  compute = bf16"), "{text}");
        let (peak, fits) = predict("t.plan", &text).unwrap();
        assert!(peak > 0 && fits);
    }

    #[test]
    fn unknown_values_fail_the_row_not_the_run() {
        let rows = parse_rows(&LLAMA.replace("\"adamw\"", "\"lamb\"")).unwrap();
        let s = score(&rows[0]);
        assert!(matches!(&s.outcome, Outcome::Failed(m) if m.contains("lamb")));
        assert_eq!(Summary::of(&[s]).failures, 1);
    }

    #[test]
    fn oom_rows_must_be_predicted_not_to_fit() {
        let big = LLAMA
            .replace("\"oom\": false", "\"oom\": true")
            .replace("\"layers\": 2", "\"layers\": 400")
            .replace("\"hidden\": 256", "\"hidden\": 8192")
            .replace("\"intermediate\": 512", "\"intermediate\": 28672");
        let scored = score(&parse_rows(&big).unwrap()[0]);
        assert!(matches!(scored.outcome, Outcome::Oom { fits: false, .. }));
        let summary = Summary::of(&[scored]);
        assert_eq!((summary.oom_correct, summary.oom_total), (1, 1));
    }

    #[test]
    fn summary_matches_python_statistics() {
        let s = |e: f64| Scored {
            name: String::new(),
            outcome: Outcome::Measured {
                measured: 1,
                predicted: 1,
                rel_err: e,
                fits: true,
            },
        };
        // Even count: the median averages the middle two; p90 index round(0.9*3)=3.
        let sum = Summary::of(&[s(0.01), s(-0.04), s(0.02), s(0.03)]);
        assert!((sum.median_abs_err - 0.025).abs() < 1e-12);
        assert_eq!(sum.p90_abs_err, 0.04);
        // p90 index round(0.9*5) = round(4.5) = 4 (half to even).
        let sum = Summary::of(&[s(0.1), s(0.2), s(0.3), s(0.4), s(0.5), s(0.6)]);
        assert_eq!(sum.p90_abs_err, 0.5);
        assert_eq!(
            sum.to_string(),
            "accuracy: n=6 median_abs_err=35.0% p90_abs_err=50.0% max_abs_err=60.0% oom_correct=0/0 fit_correct=6/6 failures=0"
        );
    }
}
