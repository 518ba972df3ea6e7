//! The engines' own option lists, vendored as data, and checkers that hold
//! emitted files against them.
//!
//! `schema/*.txt` are plain-text copies of what each engine accepts, each file
//! saying where it was taken from: DeepSpeed's configuration keys
//! (`deepspeed_keys.txt`), Accelerate's launch-config fields
//! (`accelerate_keys.txt`), torchrun's flags (`torchrun_flags.txt`) and
//! sbatch's options (`sbatch_options.txt`). They are embedded at compile time
//! and parsed once.
//!
//! The checkers return every problem found (not the first), as sentences
//! naming the key and what was wrong, so a failing test says all of it. The
//! emitters run them on their own output before returning it, so a typo in a
//! key can never reach a user; the tests run them too, on text parsed back
//! from the emitted files.

use serde_json::Value;
use std::collections::BTreeMap;
use std::sync::OnceLock;

const DEEPSPEED_KEYS: &str = include_str!("schema/deepspeed_keys.txt");
const ACCELERATE_KEYS: &str = include_str!("schema/accelerate_keys.txt");
const TORCHRUN_FLAGS: &str = include_str!("schema/torchrun_flags.txt");
const SBATCH_OPTIONS: &str = include_str!("schema/sbatch_options.txt");

/// The JSON type an engine expects for a key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ValueType {
    Bool,
    /// A JSON integer (no fraction, no exponent that leaves one).
    Int,
    /// Any JSON number.
    Float,
    String,
    FloatList,
    StringList,
    /// A dictionary whose keys are listed in the schema.
    Object,
    /// A dictionary whose keys the engine leaves open; its keys are not checked.
    Map,
}

impl ValueType {
    fn parse(s: &str) -> Option<Self> {
        Some(match s {
            "bool" => ValueType::Bool,
            "int" => ValueType::Int,
            "float" => ValueType::Float,
            "string" => ValueType::String,
            "float[]" => ValueType::FloatList,
            "string[]" => ValueType::StringList,
            "object" => ValueType::Object,
            "map" => ValueType::Map,
            _ => return None,
        })
    }

    fn accepts(self, v: &Value) -> bool {
        match self {
            ValueType::Bool => v.is_boolean(),
            ValueType::Int => v.is_i64() || v.is_u64(),
            ValueType::Float => v.is_number(),
            ValueType::String => v.is_string(),
            ValueType::FloatList => v.as_array().is_some_and(|a| a.iter().all(Value::is_number)),
            ValueType::StringList => v.as_array().is_some_and(|a| a.iter().all(Value::is_string)),
            ValueType::Object | ValueType::Map => v.is_object(),
        }
    }

    fn name(self) -> &'static str {
        match self {
            ValueType::Bool => "a boolean",
            ValueType::Int => "an integer",
            ValueType::Float => "a number",
            ValueType::String => "a string",
            ValueType::FloatList => "a list of numbers",
            ValueType::StringList => "a list of strings",
            ValueType::Object | ValueType::Map => "a dictionary",
        }
    }
}

/// One key of a configuration schema.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeySpec {
    pub ty: ValueType,
    /// Allowed values (compared with the JSON value's text form); empty = any value of the type.
    pub allowed: Vec<String>,
}

/// A configuration schema: dotted key paths to what they accept.
#[derive(Clone, Debug, Default)]
pub struct KeySchema {
    pub keys: BTreeMap<String, KeySpec>,
}

impl KeySchema {
    /// Parses the `path type [a|b|c]` format of `schema/*_keys.txt`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut keys = BTreeMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut words = line.split_whitespace();
            let (Some(path), Some(ty)) = (words.next(), words.next()) else {
                return Err(format!("line {}: expected `path type`", n + 1));
            };
            let ty = ValueType::parse(ty)
                .ok_or_else(|| format!("line {}: unknown type `{ty}`", n + 1))?;
            let allowed = words
                .next()
                .map(|a| a.split('|').map(str::to_string).collect())
                .unwrap_or_default();
            keys.insert(path.to_string(), KeySpec { ty, allowed });
        }
        Ok(KeySchema { keys })
    }

    /// Every problem with `value` against this schema: unknown keys, wrong
    /// types, values outside the allowed set.
    pub fn check(&self, value: &Value) -> Vec<String> {
        let mut problems = Vec::new();
        match value.as_object() {
            Some(map) => {
                for (k, v) in map {
                    self.check_at(k, v, &mut problems);
                }
            }
            None => problems.push("the configuration is not a dictionary".to_string()),
        }
        problems
    }

    fn check_at(&self, path: &str, v: &Value, problems: &mut Vec<String>) {
        let Some(spec) = self.keys.get(path) else {
            problems.push(format!("`{path}` is not a key the engine knows"));
            return;
        };
        if !spec.ty.accepts(v) {
            problems.push(format!("`{path}` must be {}, not `{v}`", spec.ty.name()));
            return;
        }
        if !spec.allowed.is_empty() {
            let text = match v {
                Value::String(s) => s.clone(),
                other => other.to_string(),
            };
            if !spec.allowed.contains(&text) {
                problems.push(format!(
                    "`{path}` = `{text}` is not one of {}",
                    spec.allowed.join(", ")
                ));
            }
        }
        if spec.ty == ValueType::Object {
            if let Some(map) = v.as_object() {
                for (k, child) in map {
                    self.check_at(&format!("{path}.{k}"), child, problems);
                }
            }
        }
    }
}

/// Whether a command-line option takes a value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Arity {
    /// `--opt=VALUE` or `--opt VALUE`.
    Value,
    /// `--opt` alone.
    Flag,
    /// Either (`--exclusive`, `--exclusive=user`).
    Optional,
}

/// A command's options: every accepted spelling to its arity.
#[derive(Clone, Debug, Default)]
pub struct OptionList {
    pub options: BTreeMap<String, Arity>,
}

impl OptionList {
    /// Parses the `spelling... arity` format of `schema/*_flags.txt` / `*_options.txt`.
    pub fn parse(text: &str) -> Result<Self, String> {
        let mut options = BTreeMap::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let words: Vec<&str> = line.split_whitespace().collect();
            let (arity, names) = words
                .split_last()
                .ok_or_else(|| format!("line {}: empty", n + 1))?;
            let arity = match *arity {
                "value" => Arity::Value,
                "flag" => Arity::Flag,
                "optional" => Arity::Optional,
                other => return Err(format!("line {}: unknown arity `{other}`", n + 1)),
            };
            if names.is_empty() {
                return Err(format!("line {}: no option name", n + 1));
            }
            for name in names {
                options.insert(name.to_string(), arity);
            }
        }
        Ok(OptionList { options })
    }

    /// Checks options as they appear on a command line (`--a=1`, `--b 2`, `--flag`),
    /// stopping at the first word that is not an option (the program and its arguments).
    pub fn check_args(&self, args: &[String]) -> Vec<String> {
        let mut problems = Vec::new();
        let mut i = 0;
        while i < args.len() {
            let arg = &args[i];
            if !arg.starts_with('-') {
                break;
            }
            let (name, inline_value) = match arg.split_once('=') {
                Some((n, v)) => (n, Some(v)),
                None => (arg.as_str(), None),
            };
            match self.options.get(name) {
                None => problems.push(format!("`{name}` is not an option the command knows")),
                Some(Arity::Flag) if inline_value.is_some() => {
                    problems.push(format!("`{name}` takes no value"));
                }
                Some(Arity::Value) if inline_value.is_none() => {
                    if i + 1 >= args.len() {
                        problems.push(format!("`{name}` needs a value"));
                    }
                    i += 1;
                }
                Some(Arity::Value) if inline_value == Some("") => {
                    problems.push(format!("`{name}` has an empty value"));
                }
                _ => {}
            }
            i += 1;
        }
        problems
    }
}

fn parsed<T>(
    cell: &'static OnceLock<T>,
    parse: impl FnOnce() -> Result<T, String>,
    what: &str,
) -> &'static T {
    cell.get_or_init(|| match parse() {
        Ok(v) => v,
        // The data files are part of the source tree and tested; a parse failure
        // is a build defect, caught by `schema_files_parse` before any release.
        Err(e) => panic!("vendored {what} schema is malformed: {e}"),
    })
}

/// DeepSpeed's configuration keys.
pub fn deepspeed_keys() -> &'static KeySchema {
    static CELL: OnceLock<KeySchema> = OnceLock::new();
    parsed(&CELL, || KeySchema::parse(DEEPSPEED_KEYS), "DeepSpeed")
}

/// Accelerate's launch-configuration fields.
pub fn accelerate_keys() -> &'static KeySchema {
    static CELL: OnceLock<KeySchema> = OnceLock::new();
    parsed(&CELL, || KeySchema::parse(ACCELERATE_KEYS), "Accelerate")
}

/// torchrun's options.
pub fn torchrun_flags() -> &'static OptionList {
    static CELL: OnceLock<OptionList> = OnceLock::new();
    parsed(&CELL, || OptionList::parse(TORCHRUN_FLAGS), "torchrun")
}

/// sbatch's options.
pub fn sbatch_options() -> &'static OptionList {
    static CELL: OnceLock<OptionList> = OnceLock::new();
    parsed(&CELL, || OptionList::parse(SBATCH_OPTIONS), "sbatch")
}

/// Joins backslash-continued lines of a shell script into logical lines.
pub fn logical_lines(script: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut current = String::new();
    for line in script.lines() {
        let trimmed = line.trim_end();
        if let Some(body) = trimmed.strip_suffix('\\') {
            current.push_str(body);
            current.push(' ');
        } else {
            current.push_str(trimmed);
            out.push(std::mem::take(&mut current));
        }
    }
    if !current.is_empty() {
        out.push(current);
    }
    out
}

/// The options of every `torchrun` invocation in a shell script (commented
/// lines included, so variants shown in comments are checked too): the words
/// after `torchrun`, when the first of them is an option.
pub fn torchrun_invocations(script: &str) -> Vec<Vec<String>> {
    logical_lines(script)
        .iter()
        .filter_map(|line| {
            let line = line.trim_start().trim_start_matches('#').trim_start();
            let words: Vec<&str> = line.split_whitespace().collect();
            // `torchrun` followed by an option is a call; prose that names torchrun is not.
            let at = words
                .windows(2)
                .position(|w| w[0] == "torchrun" && w[1].starts_with('-'))?;
            Some(words[at + 1..].iter().map(|w| w.to_string()).collect())
        })
        .collect()
}

/// Problems with the torchrun invocations of a script (none found is a problem too).
pub fn check_torchrun_script(script: &str) -> Vec<String> {
    let calls = torchrun_invocations(script);
    if calls.is_empty() {
        return vec!["the script runs no torchrun".to_string()];
    }
    calls
        .iter()
        .flat_map(|args| torchrun_flags().check_args(args))
        .collect()
}

/// The options of a batch script's `#SBATCH` lines, in order (sbatch reads
/// them only before the first command, so lines after it are reported).
pub fn sbatch_directives(script: &str) -> (Vec<String>, Vec<String>) {
    let mut args = Vec::new();
    let mut problems = Vec::new();
    let mut in_header = true;
    for (n, line) in script.lines().enumerate() {
        let t = line.trim();
        if let Some(rest) = t.strip_prefix("#SBATCH") {
            if !in_header {
                problems.push(format!(
                    "line {}: `#SBATCH` after the first command is ignored by sbatch",
                    n + 1
                ));
            }
            args.extend(rest.split_whitespace().map(str::to_string));
        } else if !(t.is_empty() || t.starts_with('#')) {
            in_header = false;
        }
    }
    (args, problems)
}

/// Problems with a batch script's `#SBATCH` options.
pub fn check_sbatch_script(script: &str) -> Vec<String> {
    let (args, mut problems) = sbatch_directives(script);
    if args.is_empty() {
        problems.push("the script has no #SBATCH options".to_string());
    }
    // Every directive is one `--opt[=value]` word: a second word would be read as a value.
    for a in &args {
        if !a.starts_with("--") {
            problems.push(format!("`{a}` on an #SBATCH line is not a long option"));
        }
    }
    problems.extend(sbatch_options().check_args(&args));
    problems
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn schema_files_parse() {
        assert!(deepspeed_keys()
            .keys
            .contains_key("zero_optimization.stage3_prefetch_bucket_size"));
        assert!(accelerate_keys()
            .keys
            .contains_key("deepspeed_config.deepspeed_config_file"));
        assert_eq!(
            torchrun_flags().options.get("--nproc_per_node"),
            Some(&Arity::Value)
        );
        assert_eq!(
            sbatch_options().options.get("--exclusive"),
            Some(&Arity::Optional)
        );
    }

    #[test]
    fn key_schema_reports_unknown_keys_types_and_values() {
        let problems = deepspeed_keys().check(&json!({
            "train_batch_size": 1.5,
            "zero_optimization": { "stage": 4, "stage3_prefetch_bucket": 1 },
            "fp16": { "enabled": "yes" },
            "scheduler": { "type": "WarmupLR", "params": { "anything": 1 } },
        }));
        assert_eq!(problems.len(), 4, "{problems:#?}");
        assert!(problems
            .iter()
            .any(|p| p.contains("`train_batch_size` must be an integer")));
        assert!(problems
            .iter()
            .any(|p| p.contains("`zero_optimization.stage` = `4`")));
        assert!(problems
            .iter()
            .any(|p| p.contains("`zero_optimization.stage3_prefetch_bucket` is not a key")));
        assert!(problems
            .iter()
            .any(|p| p.contains("`fp16.enabled` must be a boolean")));
    }

    #[test]
    fn option_list_checks_spelling_and_arity() {
        let args: Vec<String> = [
            "--nnodes=2",
            "--nproc_per_node",
            "8",
            "--standalone=1",
            "--bogus",
            "train.py",
            "--x",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let problems = torchrun_flags().check_args(&args);
        assert_eq!(
            problems,
            vec![
                "`--standalone` takes no value",
                "`--bogus` is not an option the command knows"
            ]
        );
    }

    #[test]
    fn sbatch_lines_after_a_command_are_reported() {
        let script = "#!/bin/bash\n#SBATCH --nodes=2\n#SBATCH --gpu-per-node=8\necho hi\n#SBATCH --time=1:00:00\n";
        let problems = check_sbatch_script(script);
        assert!(
            problems
                .iter()
                .any(|p| p.contains("after the first command")),
            "{problems:?}"
        );
        assert!(
            problems.iter().any(|p| p.contains("--gpu-per-node")),
            "{problems:?}"
        );
    }

    #[test]
    fn torchrun_lines_are_found_across_continuations() {
        let script =
            "exec torchrun \\\n  --nnodes=1 \\\n  --nproc_per_node=8 \\\n  train.py --lr 1\n";
        assert_eq!(
            torchrun_invocations(script),
            vec![vec![
                "--nnodes=1",
                "--nproc_per_node=8",
                "train.py",
                "--lr",
                "1"
            ]]
        );
        assert!(check_torchrun_script(script).is_empty());
        assert_eq!(
            check_torchrun_script("echo no"),
            vec!["the script runs no torchrun"]
        );
    }
}
