//! The measured-run file: one JSON object per line, `"record": "env"` for the
//! machine and `"record": "config"` for one configuration and what it measured.
//! Only the fields the scorer (and the ground-truth tests) read are typed; the
//! rest of each line (per-phase timings, notes) is ignored.

use serde::Deserialize;
use serde_json::{Map, Number, Value};
use std::path::Path;

/// One line of the file.
#[derive(Clone, Debug, Deserialize)]
#[serde(tag = "record", rename_all = "lowercase")]
pub enum Record {
    /// The machine and library versions the runs were measured with (kept whole).
    Env(Map<String, Value>),
    Config(Box<MeasuredRun>),
}

/// One measured configuration.
#[derive(Clone, Debug, Deserialize)]
pub struct MeasuredRun {
    pub name: String,
    pub config: RunConfig,
    /// The run ran out of memory: its plan must be predicted not to fit.
    #[serde(default)]
    pub oom: bool,
    /// The highest `torch.cuda.max_memory_allocated()` over the training steps.
    #[serde(rename = "peak_train_B", default)]
    pub peak_train_bytes: Option<u64>,
}

/// What was run: the model, the batch, precision, optimizer and memory savers.
#[derive(Clone, Debug, Deserialize)]
pub struct RunConfig {
    pub name: String,
    pub family: Family,
    pub hidden: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub intermediate: u64,
    pub vocab: u64,
    pub max_pos: u64,
    pub tie_embeddings: bool,
    pub batch: u64,
    pub seq: u64,
    #[serde(default = "one")]
    pub grad_accum: u64,
    pub weight_dtype: WeightDtype,
    pub autocast: Autocast,
    pub optimizer: OptimizerName,
    pub grad_ckpt: bool,
    #[serde(default = "one")]
    pub ckpt_every: u64,
    pub attn: AttnImpl,
    #[serde(default)]
    pub lora: Option<Lora>,
    pub loss: LossName,
    /// Kept as written so the plan text spells it the way the file does.
    #[serde(default = "zero")]
    pub dropout: Number,
}

fn one() -> u64 {
    1
}

fn zero() -> Number {
    Number::from_f64(0.0).expect("0.0 is finite")
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Family {
    /// LlamaForCausalLM: a decoder.
    Llama,
    /// XLM-RoBERTa: an encoder.
    Xlmr,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WeightDtype {
    Fp32,
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Autocast {
    Bf16,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OptimizerName {
    /// torch.optim.AdamW, foreach.
    Adamw,
    AdamwFused,
    Sgd,
    /// SGD with momentum 0.9.
    SgdMomentum,
    /// transformers' Adafactor.
    Adafactor,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum AttnImpl {
    Sdpa,
    Eager,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LossName {
    Lm,
    Mlm,
    Contrastive,
}

/// A PEFT LoRA adapter; `targets` are Hugging Face module names.
#[derive(Clone, Debug, Deserialize)]
pub struct Lora {
    pub r: u64,
    pub alpha: Number,
    pub targets: Vec<String>,
    #[serde(default = "zero")]
    pub dropout: Number,
}

/// A whole file: its environment records and its configurations, in order.
#[derive(Clone, Debug, Default)]
pub struct MeasuredFile {
    pub env: Vec<Map<String, Value>>,
    pub runs: Vec<MeasuredRun>,
}

/// Why a measured-run file cannot be scored at all.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum FileError {
    #[error("cannot read {file}: {reason}")]
    #[diagnostic(code(rcoa::validate::read))]
    Read { file: String, reason: String },
    #[error("{file}:{line}: not a measured run: {reason}")]
    #[diagnostic(
        code(rcoa::validate::malformed),
        help("each line is one JSON object with \"record\": \"env\" or \"record\": \"config\" (see tests/groundtruth/README.md)")
    )]
    Malformed {
        file: String,
        line: usize,
        reason: String,
    },
    #[error("{file}: no configurations to score")]
    #[diagnostic(
        code(rcoa::validate::empty),
        help("the file needs at least one line with \"record\": \"config\"")
    )]
    Empty { file: String },
}

/// Reads and parses a measured-run file.
pub fn read(path: &Path) -> Result<MeasuredFile, FileError> {
    let file = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|e| FileError::Read {
        file: file.clone(),
        reason: match e.kind() {
            std::io::ErrorKind::NotFound => "no such file".to_string(),
            std::io::ErrorKind::InvalidData => "not UTF-8 text".to_string(),
            _ => e.to_string(),
        },
    })?;
    parse(&file, &text)
}

/// Parses the text of a measured-run file; `file` names it in errors. Blank lines are skipped.
pub fn parse(file: &str, text: &str) -> Result<MeasuredFile, FileError> {
    let mut out = MeasuredFile::default();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let record: Record = serde_json::from_str(line).map_err(|e| FileError::Malformed {
            file: file.to_string(),
            line: i + 1,
            reason: e.to_string(),
        })?;
        match record {
            Record::Env(env) => out.env.push(env),
            Record::Config(run) => {
                let run = *run;
                if !run.oom && run.peak_train_bytes.is_none() {
                    return Err(FileError::Malformed {
                        file: file.to_string(),
                        line: i + 1,
                        reason: format!(
                            "configuration `{}` did not run out of memory but has no peak_train_B",
                            run.name
                        ),
                    });
                }
                out.runs.push(run);
            }
        }
    }
    if out.runs.is_empty() {
        return Err(FileError::Empty {
            file: file.to_string(),
        });
    }
    Ok(out)
}

/// A small fitting row for the validate tests.
#[cfg(test)]
pub(crate) mod tests_support {
    pub(crate) const ROW: &str = r#"{"record": "config", "name": "tiny", "config": {"name": "tiny", "family": "llama", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "intermediate": 128, "vocab": 1000, "max_pos": 256, "tie_embeddings": false, "batch": 2, "seq": 128, "grad_accum": 1, "weight_dtype": "fp32", "autocast": "bf16", "optimizer": "adamw", "grad_ckpt": false, "ckpt_every": 1, "attn": "sdpa", "lora": null, "loss": "lm", "dropout": 0.0, "steps": 3, "note": "ignored"}, "status": "ok", "oom": false, "peak_train_B": 1000000}"#;
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::tests_support::ROW;

    #[test]
    fn reads_env_and_config_lines() {
        let text = format!("{{\"record\": \"env\", \"torch\": \"2.11.0\"}}\n\n{ROW}\n");
        let f = parse("t.jsonl", &text).unwrap();
        assert_eq!(f.env.len(), 1);
        assert_eq!(f.env[0]["torch"], "2.11.0");
        assert_eq!(f.runs.len(), 1);
        let r = &f.runs[0];
        assert_eq!(r.name, "tiny");
        assert_eq!(r.peak_train_bytes, Some(1_000_000));
        assert_eq!(r.config.family, Family::Llama);
        assert_eq!(r.config.optimizer, OptimizerName::Adamw);
        assert!(r.config.lora.is_none());
    }

    #[test]
    fn a_bad_line_names_file_and_line() {
        let text = format!("{ROW}\n{{\"record\": \"config\", \"name\": 3}}\n");
        let e = parse("gt.jsonl", &text).unwrap_err();
        assert!(matches!(e, FileError::Malformed { line: 2, .. }), "{e}");
        assert!(e.to_string().starts_with("gt.jsonl:2: "), "{e}");
        let e = parse("gt.jsonl", "not json\n").unwrap_err();
        assert!(e.to_string().starts_with("gt.jsonl:1: "), "{e}");
        let e = parse("gt.jsonl", "{\"record\": \"weather\"}\n").unwrap_err();
        assert!(e.to_string().contains("weather"), "{e}");
    }

    #[test]
    fn an_unknown_optimizer_is_a_malformed_line() {
        let text = ROW.replace("\"adamw\"", "\"lion\"");
        let e = parse("gt.jsonl", &text).unwrap_err();
        assert!(e.to_string().contains("lion"), "{e}");
    }

    #[test]
    fn a_fitting_row_needs_its_peak() {
        let text = ROW.replace(", \"peak_train_B\": 1000000", "");
        let e = parse("gt.jsonl", &text).unwrap_err();
        assert!(e.to_string().contains("peak_train_B"), "{e}");
        let oom = text.replace("\"oom\": false", "\"oom\": true");
        assert!(parse("gt.jsonl", &oom).unwrap().runs[0].oom);
    }

    #[test]
    fn no_configurations_is_an_error() {
        let e = parse("gt.jsonl", "").unwrap_err();
        assert_eq!(e.to_string(), "gt.jsonl: no configurations to score");
        let e = parse("gt.jsonl", "{\"record\": \"env\"}\n").unwrap_err();
        assert!(matches!(e, FileError::Empty { .. }));
    }
}
