//! What `--save` writes for the Hugging Face ecosystem beside rcoa's own
//! record, decided once per run:
//! - a full fine-tune: `model.safetensors` (sharded above `max_shard_bytes`)
//!   with the source checkpoint's `config.json` (one written from the plan's
//!   shape without a source: `config`) and tokenizer files (and
//!   XLM-R's pooler, which rcoa does not train, copied from the source);
//! - LoRA: `adapter_model.safetensors` + `adapter_config.json` (PEFT) and
//!   the tokenizer files, but no `config.json`: `transformers` then loads
//!   the folder as an adapter on `base_model_name_or_path`;
//! - LoRA with `--merge-lora`: the merged full weights, as a full fine-tune
//!   (no adapter files, which `transformers` would load instead).

use super::lora::{lora_factors, merged_params};
use super::peft::{peft_adapter, PeftInfo};
use super::read::read_matching;
use super::write::{
    hf_tensors, hf_tensors_of, write_file, write_model, HfTensor, DEFAULT_MAX_SHARD_BYTES,
};
use super::{origin, save_prefix, Family};
use crate::model::Model;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::ModelSpec;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// Files of the source checkpoint a full (or merged) save carries over
/// (`chat_template.jinja`: where transformers 5 keeps the chat template).
const MODEL_SIDE_FILES: &[&str] = &[
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// Those an adapter save carries over (its base has the config).
const ADAPTER_SIDE_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
];

/// How `--save` writes Hugging Face weights (`rcoa run --merge-lora
/// --max-shard-size`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SaveOptions {
    /// Write LoRA merged into full weights instead of a PEFT adapter.
    pub merge_lora: bool,
    /// Shard full weights above this many bytes.
    pub max_shard_bytes: u64,
}

impl Default for SaveOptions {
    fn default() -> Self {
        SaveOptions {
            merge_lora: false,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
        }
    }
}

/// The adapter as PEFT describes it.
#[derive(Clone, Debug)]
struct Lora {
    rank: u64,
    alpha: f64,
    dropout: f64,
}

/// How a run's checkpoints are written in the Hugging Face layout.
#[derive(Clone, Debug)]
pub struct Export {
    family: Family,
    /// The checkpoint the run started from: its config and tokenizer files
    /// are copied, and an adapter names it as its base.
    source: Option<PathBuf>,
    lora: Option<Lora>,
    /// Write LoRA merged into full weights instead of a PEFT adapter.
    merge_lora: bool,
    /// Shard the full weights above this many bytes.
    pub max_shard_bytes: u64,
    /// For a `config.json` where the source has none.
    model: ModelSpec,
}

impl Export {
    /// The export of `plan`'s model, or `None` when its family's Hugging
    /// Face layout cannot hold every parameter of `model` (a custom shape
    /// no `transformers` class has): rcoa's own record is then the only
    /// checkpoint.
    pub fn for_plan<B: Backend>(plan: &LoweredPlan, model: &Model<B>) -> Option<Export> {
        let family = Family::of(&plan.model);
        let prefix = save_prefix(family);
        let fits = param_names(model)
            .iter()
            .filter(|n| !n.contains(".lora."))
            .all(|n| origin(family, prefix, n).is_some());
        fits.then(|| Export {
            family,
            source: plan.model.weights.as_ref().map(PathBuf::from),
            lora: plan.adapter.as_ref().map(|a| Lora {
                rank: a.rank,
                alpha: a.alpha,
                dropout: a.dropout,
            }),
            merge_lora: false,
            max_shard_bytes: DEFAULT_MAX_SHARD_BYTES,
            model: plan.model.clone(),
        })
    }

    /// Save LoRA merged into the base weights (`--merge-lora`); an error
    /// when there is no adapter to merge.
    pub fn set_merge_lora(&mut self) -> Result<(), String> {
        if self.lora.is_none() {
            return Err(
                "--merge-lora merges a LoRA adapter into the base weights, and this plan has no `adapter lora`: \
                 a full fine-tune's --save already writes full weights"
                    .into(),
            );
        }
        self.merge_lora = true;
        Ok(())
    }

    /// Write the Hugging Face files of `model` into `dir`; returns their names.
    pub fn write<B: Backend>(&self, model: &Model<B>, dir: &Path) -> Result<Vec<String>, String> {
        let mut files = match &self.lora {
            None => {
                let mut tensors = hf_tensors(model, self.family)?;
                self.carry_over(&mut tensors)?;
                write_model(&tensors, dir, self.max_shard_bytes)?
            }
            Some(l) if self.merge_lora => {
                let merged = merged_params(model, l.alpha / l.rank as f64)?;
                let mut tensors = hf_tensors_of(merged, self.family)?;
                self.carry_over(&mut tensors)?;
                write_model(&tensors, dir, self.max_shard_bytes)?
            }
            Some(l) => self.write_adapter(model, l, dir)?,
        };
        let side = if self.lora.is_some() && !self.merge_lora {
            ADAPTER_SIDE_FILES
        } else {
            MODEL_SIDE_FILES
        };
        if let Some(src) = &self.source {
            for f in side {
                if src.join(f).is_file() {
                    std::fs::copy(src.join(f), dir.join(f))
                        .map_err(|e| format!("cannot copy {f} from {}: {e}", src.display()))?;
                    files.push(f.to_string());
                }
            }
        }
        let full = self.lora.is_none() || self.merge_lora;
        if full && !dir.join("config.json").exists() {
            // No source config (a preset or a shape written in the plan).
            if let Some(c) = super::config::hf_config(&self.model) {
                let text = serde_json::to_string_pretty(&c).map_err(|e| e.to_string())?;
                std::fs::write(dir.join("config.json"), text + "\n")
                    .map_err(|e| format!("cannot write config.json: {e}"))?;
                files.push("config.json".into());
            }
        }
        Ok(files)
    }

    /// The source's tensors of the saved class that rcoa does not train
    /// (XLM-R's pooler, which `XLMRobertaModel` has and rcoa has not), so
    /// the save is as complete as its source: `transformers` would
    /// re-initialise a missing pooler at random.
    fn carry_over(&self, tensors: &mut BTreeMap<String, HfTensor>) -> Result<(), String> {
        let (Family::Bert, Some(src)) = (self.family, &self.source) else {
            return Ok(());
        };
        let pooler =
            |k: &str| k.ends_with("pooler.dense.weight") || k.ends_with("pooler.dense.bias");
        let Some(found) = read_matching(src, &pooler)? else {
            return Ok(());
        };
        for (k, t) in found {
            // Under the prefix rcoa saves with, whatever the source's was.
            let i = k.find("pooler.dense.").unwrap_or(0);
            let key = format!("{}{}", save_prefix(self.family), &k[i..]);
            tensors.entry(key).or_insert(t);
        }
        Ok(())
    }

    fn write_adapter<B: Backend>(
        &self,
        model: &Model<B>,
        l: &Lora,
        dir: &Path,
    ) -> Result<Vec<String>, String> {
        let factors = lora_factors(model)?;
        let linears = linear_layers(model);
        let base = self
            .source
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned());
        let info = PeftInfo {
            family: self.family,
            rank: l.rank,
            alpha: l.alpha,
            dropout: l.dropout,
            base: base.as_deref(),
            linears: &linears,
        };
        let (tensors, config) = peft_adapter(&factors, &info)?;
        write_file(tensors.iter(), &dir.join("adapter_model.safetensors"))?;
        let text = serde_json::to_string_pretty(&config).map_err(|e| e.to_string())?;
        std::fs::write(dir.join("adapter_config.json"), text + "\n")
            .map_err(|e| format!("cannot write adapter_config.json: {e}"))?;
        Ok(vec![
            "adapter_model.safetensors".into(),
            "adapter_config.json".into(),
        ])
    }
}

/// Every float parameter's field path (`layers.0.attn.q.weight`,
/// `embed.tokens`, `layers.0.attn.q.lora.a`): the names `Model::export`
/// and `Model::load` use, read without copying any values.
fn param_names<B: Backend>(model: &Model<B>) -> Vec<String> {
    paths(model).into_iter().map(|(p, _)| p).collect()
}

/// The linear layers (`layers.0.attn.q`): parents of a `Linear`'s weight.
fn linear_layers<B: Backend>(model: &Model<B>) -> Vec<String> {
    paths(model)
        .into_iter()
        .filter(|(_, in_linear)| *in_linear)
        .filter_map(|(p, _)| p.strip_suffix(".weight").map(str::to_string))
        .collect()
}

/// Every float parameter's path, and whether it is a field of a `Linear`.
fn paths<B: Backend>(model: &Model<B>) -> Vec<(String, bool)> {
    struct Paths {
        path: Vec<(String, String)>,
        out: Vec<(String, bool)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Paths {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.path
                .push((name.to_string(), container_type.to_string()));
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<B, D>>) {
            let name: Vec<&str> = self.path.iter().map(|(n, _)| n.as_str()).collect();
            let in_linear = self.path.last().is_some_and(|(_, c)| c == "Struct:Linear");
            self.out.push((name.join("."), in_linear));
        }
    }
    let mut v = Paths {
        path: vec![],
        out: vec![],
    };
    model.visit(&mut v);
    v.out
}
