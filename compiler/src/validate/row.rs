//! The measured-run file: one JSON object per line, `"record": "env"` for the
//! machine and `"record": "config"` for one configuration and what it measured.
//! Only the fields the scorer (and the ground-truth tests) read are typed; the
//! rest of each line (per-phase timings, notes) is ignored.
//!
//! A multi-GPU row (`tools/measure_multigpu.py`: rank 0 of a world of N under
//! PyTorch's fake process group) adds `world_size`, `engine` and the engine's
//! sharding settings; a single-GPU row leaves them out and reads as
//! `engine: eager` on a world of 1.

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
    /// The model's parameter bytes as built, before any engine sharded them.
    #[serde(rename = "param_bytes", default)]
    pub param_bytes: Option<u64>,
    /// `tools/measure_multigpu.py` let go of the parameters it built before the engine
    /// replaced them (absent from rows measured before that fix).
    #[serde(default)]
    pub built_params_released: bool,
    /// The `ds_config` a DeepSpeed run was given (`tools/measure_multigpu.py` records it):
    /// the ZeRO sizes it sets override DeepSpeed's defaults.
    #[serde(default)]
    pub deepspeed_config: Option<Value>,
}

impl MeasuredRun {
    /// The peak the engine's rank 0 reached: `peak_train_B`, less what the measuring script
    /// itself held. Before `built_params_released`, `measure_multigpu.py` kept a list of the
    /// parameters it built, so when FSDP2 (`fully_shard`) or tensor parallelism
    /// (`parallelize_module`) replaced them by their shards, the whole unsharded model
    /// stayed allocated on rank 0 through every phase (`alloc_setup_B` − `param_bytes_local`
    /// = `param_bytes`). A constant live set adds its bytes to every phase's
    /// `max_memory_allocated()` and nothing else, so taking `param_bytes` off is exact.
    pub fn engine_peak_bytes(&self) -> Option<u64> {
        let peak = self.peak_train_bytes?;
        let replaced = matches!(self.config.engine, Engine::Fsdp2 | Engine::Tp);
        match self.param_bytes {
            Some(held) if replaced && !self.built_params_released => {
                Some(peak.saturating_sub(held))
            }
            _ => Some(peak),
        }
    }
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
    /// Ranks in the job (`world_size`; written on every multi-GPU row, absent
    /// on a single-GPU one); the row measures rank 0. Read it with [`RunConfig::world_size`].
    #[serde(rename = "world_size", default)]
    pub world: Option<u64>,
    /// How the ranks split the work.
    #[serde(default)]
    pub engine: Engine,
    /// Tensor-parallel degree (`engine: tp`); the data-parallel degree is `world_size / tensor_parallel`.
    #[serde(default = "one")]
    pub tensor_parallel: u64,
    /// Megatron-style sequence parallelism inside the tensor-parallel group.
    #[serde(default)]
    pub sequence_parallel: bool,
    /// DeepSpeed's ZeRO stage (`engine: deepspeed`; 0–3).
    #[serde(default)]
    pub zero_stage: Option<u64>,
    /// FSDP2's `MixedPrecisionPolicy` (`engine: fsdp2`); `None`: the layers compute in the weights' dtype.
    #[serde(default)]
    pub fsdp_mp: Option<FsdpMixedPrecision>,
    /// FSDP2's `reshard_after_forward`.
    #[serde(default = "yes")]
    pub reshard_after_forward: bool,
    /// fp32 master weights beside 16-bit weights (DeepSpeed's bf16 mode).
    #[serde(default)]
    pub master_weights: MasterWeights,
}

fn yes() -> bool {
    true
}

/// The training engine a row ran under.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// One process, plain PyTorch eager (the single-GPU rows).
    #[default]
    Eager,
    /// `DistributedDataParallel`: every rank holds the whole model.
    Ddp,
    /// FSDP2 (`fully_shard` per decoder layer and the root): ZeRO-3.
    Fsdp2,
    /// Tensor parallelism through DTensor's `parallelize_module`.
    Tp,
    /// DeepSpeed ZeRO (stage in `zero_stage`).
    Deepspeed,
}

impl Engine {
    pub fn name(self) -> &'static str {
        match self {
            Engine::Eager => "eager",
            Engine::Ddp => "ddp",
            Engine::Fsdp2 => "fsdp2",
            Engine::Tp => "tp",
            Engine::Deepspeed => "deepspeed",
        }
    }
}

/// FSDP2's `MixedPrecisionPolicy(param_dtype, reduce_dtype)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
pub struct FsdpMixedPrecision {
    /// The dtype of the gathered (unsharded) weights the layers compute with.
    pub param_dtype: WeightDtype,
    /// The dtype gradients are reduce-scattered in.
    pub reduce_dtype: WeightDtype,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MasterWeights {
    #[default]
    None,
    Fp32,
}

impl RunConfig {
    /// Ranks in the job: 1 for a single-GPU row.
    pub fn world_size(&self) -> u64 {
        self.world.unwrap_or(1)
    }

    /// The data-parallel degree.
    pub fn data_parallel(&self) -> u64 {
        self.world_size() / self.tensor_parallel.max(1)
    }

    /// Settings that parse but cannot describe one run: a world of 0, a
    /// degree that does not divide it, a setting the engine does not have.
    pub fn check(&self) -> Result<(), String> {
        let engine = self.engine.name();
        if self.engine != Engine::Eager && self.world.is_none() {
            return Err(format!(
                "engine {engine} without world_size; a multi-GPU row says how many ranks it ran"
            ));
        }
        let world_size = self.world_size();
        if world_size == 0 {
            return Err("world_size is 0; a run has at least one rank".into());
        }
        if self.tensor_parallel == 0 || !world_size.is_multiple_of(self.tensor_parallel) {
            return Err(format!(
                "tensor_parallel {} does not divide world_size {world_size}",
                self.tensor_parallel
            ));
        }
        match self.engine {
            Engine::Eager if world_size != 1 => {
                return Err(format!(
                    "engine eager runs one rank, not world_size {world_size}; name the multi-GPU engine (ddp, fsdp2, tp, deepspeed)"
                ))
            }
            Engine::Tp if self.tensor_parallel < 2 => {
                return Err("engine tp needs tensor_parallel >= 2".into())
            }
            Engine::Deepspeed => match self.zero_stage {
                Some(0..=3) => {}
                Some(s) => return Err(format!("zero_stage {s}; DeepSpeed's stages are 0 to 3")),
                None => return Err("engine deepspeed needs zero_stage (0 to 3)".into()),
            },
            _ => {}
        }
        if self.engine != Engine::Tp && self.tensor_parallel != 1 {
            return Err(format!(
                "tensor_parallel {} with engine {engine}; only engine tp splits the layers",
                self.tensor_parallel
            ));
        }
        if self.sequence_parallel && self.tensor_parallel < 2 {
            return Err("sequence_parallel needs tensor_parallel >= 2".into());
        }
        if self.engine != Engine::Deepspeed && self.zero_stage.is_some() {
            return Err(format!(
                "zero_stage with engine {engine}; it is DeepSpeed's setting (fsdp2 is ZeRO-3 by construction)"
            ));
        }
        if self.engine != Engine::Fsdp2 && self.fsdp_mp.is_some() {
            return Err(format!(
                "fsdp_mp with engine {engine}; it is FSDP2's setting"
            ));
        }
        if !self.reshard_after_forward {
            return Err(
                "reshard_after_forward false: the plan language has no setting for weights kept gathered from the forward to the backward".into(),
            );
        }
        if self.master_weights == MasterWeights::Fp32 && self.weight_dtype == WeightDtype::Fp32 {
            return Err(
                "master_weights fp32 over fp32 weights; master copies are for 16-bit weights"
                    .into(),
            );
        }
        Ok(())
    }
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
                if let Err(reason) = run.config.check() {
                    return Err(FileError::Malformed {
                        file: file.to_string(),
                        line: i + 1,
                        reason: format!("configuration `{}`: {reason}", run.name),
                    });
                }
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

    /// [`ROW`] as rank 0 of a multi-GPU run: `fields` are JSON members added to its `config`.
    pub(crate) fn multi(fields: &str) -> String {
        ROW.replace("\"note\": \"ignored\"", fields)
    }

    pub(crate) fn ddp() -> String {
        multi(r#""world_size": 8, "engine": "ddp""#)
    }

    pub(crate) fn tp() -> String {
        multi(r#""world_size": 2, "engine": "tp", "tensor_parallel": 2, "sequence_parallel": true"#)
    }

    pub(crate) fn fsdp2() -> String {
        multi(
            r#""world_size": 16, "engine": "fsdp2", "fsdp_mp": {"param_dtype": "bf16", "reduce_dtype": "fp32"}, "reshard_after_forward": true"#,
        )
        .replace("\"autocast\": \"bf16\"", "\"autocast\": \"none\"")
    }

    pub(crate) fn deepspeed() -> String {
        multi(
            r#""world_size": 4, "engine": "deepspeed", "zero_stage": 2, "master_weights": "fp32""#,
        )
        .replace("\"weight_dtype\": \"fp32\"", "\"weight_dtype\": \"bf16\"")
        .replace("\"autocast\": \"bf16\"", "\"autocast\": \"none\"")
    }
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

    /// Rows of FSDP2 and tensor parallelism measured while the script still held the built
    /// parameters are scored without that copy; DDP's and DeepSpeed's never had it, and a
    /// row saying the script let go of them is taken as measured.
    #[test]
    fn the_scripts_copy_of_replaced_parameters_is_taken_off() {
        use super::tests_support::{ddp, deepspeed, fsdp2, tp};
        let with = |row: String, fields: &str| {
            row.replace(
                "\"peak_train_B\": 1000000",
                &format!("\"peak_train_B\": 1000000, \"param_bytes\": 300000{fields}"),
            )
        };
        let peak = |text: String| parse("t.jsonl", &text).unwrap().runs[0].engine_peak_bytes();
        assert_eq!(peak(with(fsdp2(), "")), Some(700_000));
        assert_eq!(peak(with(tp(), "")), Some(700_000));
        assert_eq!(peak(with(ddp(), "")), Some(1_000_000));
        assert_eq!(peak(with(deepspeed(), "")), Some(1_000_000));
        let released = ", \"built_params_released\": true";
        assert_eq!(peak(with(fsdp2(), released)), Some(1_000_000));
        // No param_bytes recorded: nothing to take off.
        assert_eq!(peak(fsdp2()), Some(1_000_000));
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
    fn a_single_gpu_row_is_one_eager_rank() {
        let c = &parse("t.jsonl", ROW).unwrap().runs[0].config;
        assert_eq!(
            (c.world_size(), c.engine, c.tensor_parallel),
            (1, Engine::Eager, 1)
        );
        assert_eq!(
            (c.zero_stage, c.fsdp_mp, c.master_weights),
            (None, None, MasterWeights::None)
        );
        assert!(c.reshard_after_forward && !c.sequence_parallel);
    }

    #[test]
    fn multi_gpu_rows_parse_with_their_engine_settings() {
        use super::tests_support::{ddp, deepspeed, fsdp2, tp};
        let one = |text: String| parse("mgpu.jsonl", &text).unwrap().runs.remove(0).config;
        let c = one(ddp());
        assert_eq!(
            (c.world_size(), c.engine, c.data_parallel()),
            (8, Engine::Ddp, 8)
        );
        let c = one(tp());
        assert_eq!(
            (c.engine, c.tensor_parallel, c.data_parallel()),
            (Engine::Tp, 2, 1)
        );
        assert!(c.sequence_parallel);
        let c = one(fsdp2());
        assert_eq!((c.engine, c.data_parallel()), (Engine::Fsdp2, 16));
        assert_eq!(
            c.fsdp_mp,
            Some(FsdpMixedPrecision {
                param_dtype: WeightDtype::Bf16,
                reduce_dtype: WeightDtype::Fp32
            })
        );
        let c = one(deepspeed());
        assert_eq!((c.engine, c.zero_stage), (Engine::Deepspeed, Some(2)));
        assert_eq!(
            (c.weight_dtype, c.master_weights),
            (WeightDtype::Bf16, MasterWeights::Fp32)
        );
    }

    #[test]
    fn a_bad_multi_gpu_row_names_file_line_and_what_is_wrong() {
        use super::tests_support::{ddp, deepspeed, fsdp2, multi, tp};
        let env = "{\"record\": \"env\"}\n";
        for (row, words) in [
            (
                multi(r#""world_size": 8, "engine": "megatron""#),
                "unknown variant `megatron`",
            ),
            (
                multi(r#""world_size": 0, "engine": "ddp""#),
                "world_size is 0",
            ),
            (multi(r#""world_size": 4"#), "engine eager runs one rank"),
            (multi(r#""engine": "ddp""#), "engine ddp without world_size"),
            (
                ddp().replace(r#""world_size": 8"#, r#""world_size": "8""#),
                "expected u64",
            ),
            (
                ddp().replace(r#""batch": 2, "#, ""),
                "missing field `batch`",
            ),
            (multi(r#""world_size": -2, "engine": "ddp""#), "-2"),
            (
                tp().replace(r#""tensor_parallel": 2"#, r#""tensor_parallel": 3"#),
                "does not divide",
            ),
            (
                tp().replace(r#""tensor_parallel": 2, "#, ""),
                "engine tp needs tensor_parallel",
            ),
            (
                ddp().replace(
                    r#""world_size": 8"#,
                    r#""world_size": 8, "tensor_parallel": 2"#,
                ),
                "only engine tp",
            ),
            (
                deepspeed().replace(r#""zero_stage": 2, "#, ""),
                "needs zero_stage",
            ),
            (
                deepspeed().replace(r#""zero_stage": 2"#, r#""zero_stage": 4"#),
                "stages are 0 to 3",
            ),
            (
                ddp().replace("\"ddp\"", "\"ddp\", \"zero_stage\": 1"),
                "DeepSpeed's setting",
            ),
            (
                ddp().replace("\"ddp\"", "\"ddp\", \"sequence_parallel\": true"),
                "sequence_parallel",
            ),
            (
                fsdp2().replace("\"engine\": \"fsdp2\"", "\"engine\": \"ddp\""),
                "FSDP2's setting",
            ),
            (
                fsdp2().replace(
                    "\"reshard_after_forward\": true",
                    "\"reshard_after_forward\": false",
                ),
                "reshard_after_forward",
            ),
            (
                fsdp2().replace(r#""param_dtype": "bf16", "#, ""),
                "param_dtype",
            ),
            (
                deepspeed().replace("\"weight_dtype\": \"bf16\"", "\"weight_dtype\": \"fp32\""),
                "master_weights",
            ),
        ] {
            let e = parse("mgpu.jsonl", &format!("{env}{row}\n")).unwrap_err();
            let msg = e.to_string();
            assert!(msg.starts_with("mgpu.jsonl:2: "), "{msg}");
            assert!(msg.contains(words), "{words:?} not in {msg}");
        }
    }

    #[test]
    fn no_configurations_is_an_error() {
        let e = parse("gt.jsonl", "").unwrap_err();
        assert_eq!(e.to_string(), "gt.jsonl: no configurations to score");
        let e = parse("gt.jsonl", "{\"record\": \"env\"}\n").unwrap_err();
        assert!(matches!(e, FileError::Empty { .. }));
    }
}
