//! Every user-facing word the resolver says, in one place.
//!
//! [`word`] turns a detected [`Problem`] into a [`ResolveError`]: its stable
//! code, a one-line message, labels on the offending text and a help line
//! that says what to write instead (the nearest valid name, the allowed
//! values, or the arithmetic that failed). Review this file as prose: the
//! checks elsewhere only build `Problem` values.
//!
//! Conventions: messages start lower case and quote the plan's own spelling
//! in backticks; values the user wrote are echoed as written, computed ones
//! as plain digits (sizes in GiB); help lines say what to write instead and
//! start with a verb or "did you mean". Error codes are stable: tests and
//! users match on them, so rename one only with the golden files.

use super::error::ResolveError;
use super::problem::{Expected, HfDetail, Inapplicable, NameKind, Problem, Range};
use super::suggest;
use rcoa_grammar::{Unit, ValueKind};

/// The header of a multi-problem report.
pub(crate) fn many_problems(n: usize, file: &str) -> String {
    format!("{n} problems in {file}")
}

/// How a written value is described in "found ..." messages.
pub(crate) fn found(v: &ValueKind) -> String {
    match v {
        ValueKind::Auto => "`auto`".into(),
        ValueKind::Bool(b) => format!("the boolean `{b}`"),
        ValueKind::Ident(s) => format!("the name `{s}`"),
        ValueKind::Str(_) => "a string".into(),
        ValueKind::Number(n) => match n.unit {
            None if n.integer => "an integer".into(),
            None => "a number".into(),
            Some(u) => format!("a {}", unit_family(u)),
        },
        ValueKind::List(_) => "a list".into(),
        ValueKind::Tuple(_) => "a tuple".into(),
        ValueKind::Block(_) => "a block".into(),
        ValueKind::Every(_) => "`every N`".into(),
        ValueKind::Placed { .. } => "a placement `what:where`".into(),
    }
}

fn unit_family(u: Unit) -> &'static str {
    match u {
        Unit::K | Unit::M | Unit::T => "count",
        // Ambiguous on its own; in a "found" position it was taken as bytes.
        Unit::B => "size",
        Unit::KB
        | Unit::MB
        | Unit::GB
        | Unit::TB
        | Unit::KiB
        | Unit::MiB
        | Unit::GiB
        | Unit::TiB => "size",
        Unit::Percent => "percentage",
        Unit::Gbps | Unit::Mbps | Unit::Tbps | Unit::MBps | Unit::GBps | Unit::TBps => "bandwidth",
    }
}

fn expected(e: Expected) -> &'static str {
    match e {
        Expected::Integer => "an integer",
        Expected::IntegerOrAuto => "an integer or `auto`",
        Expected::Number => "a number",
        Expected::Probability => "a probability (a number from 0 to 1, or a percentage)",
        Expected::Bool => "`true` or `false`",
        Expected::BoolOrAuto => "`true`, `false` or `auto`",
        Expected::Size => "a size",
        Expected::SizeOrPercent => "a size or a percentage",
        Expected::Bandwidth => "a bandwidth",
        Expected::Name => "a name",
        Expected::GpuNameOrBlock => "a GPU name or a `{ ... }` block",
        Expected::NameList => "a list of names",
        Expected::OffloadList => "a list of what may be offloaded",
        Expected::Pair => "a pair of numbers",
        Expected::Checkpoint => "`none`, `full`, `selective`, `auto` or `every N`",
        Expected::Path => "a path in quotes",
        Expected::Bias => "`true`, `false` or `qkv`",
    }
}

/// An example of a valid value, for help lines.
fn example(slot: &str, e: Expected) -> String {
    let v = match (slot, e) {
        ("betas", _) => "(0.9, 0.999)",
        ("budget", _) => "95%",
        ("memory", _) | ("host_memory", _) | ("nvme", _) | ("reserve", _) => "40 GiB",
        ("intra_node", _) | ("bandwidth", _) => "900 GB/s",
        ("inter_node", _) => "400 Gbps",
        ("targets", _) => "[q, k, v, o]",
        ("offload", _) => "[optimizer, params:cpu]",
        ("checkpoint", _) => "every 2",
        ("seq_len", _) => "2048",
        ("lr", _) => "2e-5",
        (_, Expected::Integer) => "8",
        (_, Expected::IntegerOrAuto) => "auto",
        (_, Expected::Number) => "0.1",
        (_, Expected::Probability) => "0.05",
        (_, Expected::Bool) | (_, Expected::BoolOrAuto) | (_, Expected::Bias) => "true",
        (_, Expected::Size) => "40 GiB",
        (_, Expected::SizeOrPercent) => "95%",
        (_, Expected::Bandwidth) => "900 GB/s",
        (_, Expected::Pair) => "(0.9, 0.999)",
        (_, Expected::Checkpoint) => "every 2",
        (_, Expected::GpuNameOrBlock) => "h100-80gb",
        (_, Expected::Path) => "\"config.json\"",
        (_, Expected::Name) | (_, Expected::NameList) | (_, Expected::OffloadList) => "...",
    };
    format!("{slot} = {v}")
}

/// How a section is written, for "missing" and "takes no argument" help.
fn section_usage(section: &str) -> &'static str {
    match section {
        "model" => "model \"llama-3.1-8b\", model hf \"config.json\" or model { arch = decoder layers = 2 ... }",
        "adapter" => "adapter lora { rank = 16 alpha = 32 targets = [q, k, v, o] }",
        "hardware" => "hardware { gpu = h100-80gb gpus_per_node = 8 }",
        "precision" => "precision bf16 or precision { params = bf16 compute = bf16 master = fp32 }",
        "optimizer" => "optimizer adamw { lr = 2e-5 }",
        "train" => "train { seq_len = 2048 global_batch = 256 }",
        "parallel" => "parallel { data = auto zero = 3 }",
        "fit" => "fit { budget = 95% checkpoint = auto }",
        "target" => "target burn or target pytorch",
        _ => "",
    }
}

fn join(names: &[String]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn join_static(names: &[&str]) -> String {
    names
        .iter()
        .map(|n| format!("`{n}`"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn range_text(r: Range) -> String {
    match r {
        Range::AtLeast(1) => "a positive integer".into(),
        Range::AtLeast(n) => format!("an integer of at least {n}"),
        Range::Between(lo, hi) => format!("an integer from {lo} to {hi}"),
        Range::Positive => "a number greater than 0".into(),
        Range::NonNegative => "a number of at least 0".into(),
        Range::UnitInterval => "a number from 0 up to, but not including, 1".into(),
        Range::Percent => "a percentage above 0% and at most 100%".into(),
        Range::Bytes(0) => "a size of 0 bytes or more".into(),
        Range::Bytes(_) => "a size above 0 bytes".into(),
    }
}

/// Bytes for people: GiB with two decimals, or the exact count when small.
pub(crate) fn bytes(b: u64) -> String {
    const GIB: f64 = (1u64 << 30) as f64;
    if b >= 1 << 30 {
        format!("{:.2} GiB", b as f64 / GIB)
    } else if b >= 1 << 20 {
        format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64)
    } else {
        format!("{b} bytes")
    }
}

fn dtype_or_value(kind: NameKind) -> (&'static str, &'static str) {
    match kind {
        NameKind::Model => ("rcoa::unknown_model", "model preset"),
        NameKind::Gpu => ("rcoa::unknown_gpu", "GPU"),
        NameKind::Dtype => ("rcoa::unknown_dtype", "dtype"),
        NameKind::Optimizer => ("rcoa::unknown_optimizer", "optimizer"),
        NameKind::Adapter => ("rcoa::unknown_adapter", "adapter"),
        NameKind::Target => ("rcoa::unknown_target", "target"),
        NameKind::Value => ("rcoa::unknown_value", "value"),
    }
}

fn err(
    code: &'static str,
    message: String,
    labels: Vec<(rcoa_grammar::Span, String)>,
    help: Option<String>,
) -> ResolveError {
    ResolveError {
        code,
        message,
        labels,
        help,
    }
}

/// The user-facing form of a problem.
pub(crate) fn word(p: Problem) -> ResolveError {
    use Problem::*;
    match p {
        UnknownSection { name, span } => {
            let near = suggest::nearest(&name, super::SECTIONS.iter().copied());
            err(
                "rcoa::unknown_section",
                format!("unknown section `{name}`"),
                vec![(span, "not a section".into())],
                Some(match near {
                    Some(n) => format!("did you mean `{n}`?"),
                    None => format!("sections are {}", join_static(super::SECTIONS)),
                }),
            )
        }
        DuplicateSection { name, first, again } => err(
            "rcoa::duplicate_section",
            format!("section `{name}` appears twice"),
            vec![(again, "written again here".into()), (first, "first written here".into())],
            Some(format!("merge the two `{name}` sections into one")),
        ),
        // Located at the start of the file (1:1), so the message names
        // FILE:1:1 like every other problem, also in an empty file.
        MissingSection { name } => err(
            "rcoa::missing_section",
            format!("the plan has no `{name}` section"),
            vec![(rcoa_grammar::Span::new(0, 0), format!("no `{name}` section in this file"))],
            Some(format!("add one, e.g. `{}`", section_usage(name))),
        ),
        MissingArgument { section, span } => {
            let (message, help) = match section {
                "model" => ("`model` needs a preset name, `hf \"path\"` or a block".to_string(), format!("write {}", section_usage(section))),
                "optimizer" => (
                    "`optimizer` needs a name".to_string(),
                    format!("write e.g. `optimizer adamw {{ lr = 2e-5 }}`; optimizers are {}", join_static(super::optimizer::NAMES)),
                ),
                "adapter" => ("`adapter` needs a kind".to_string(), "write `adapter lora { ... }` or `adapter qlora { ... }`".to_string()),
                "target" => ("`target` needs a name".to_string(), "write `target burn` or `target pytorch`".to_string()),
                "hf" => ("`model hf` needs the path of a config.json".to_string(), "write e.g. `model hf \"models/config.json\"`".to_string()),
                _ => (format!("`{section}` needs an argument"), format!("write {}", section_usage(section))),
            };
            err("rcoa::missing_argument", message, vec![(span, "argument expected after this".into())], Some(help))
        }
        UnexpectedArgument { section, span } => err(
            "rcoa::unexpected_argument",
            format!("`{section}` takes no argument here"),
            vec![(span, "unexpected".into())],
            Some(format!("write {}", section_usage(section))),
        ),
        MissingBlock { section, span } => err(
            "rcoa::missing_block",
            format!("`{section}` needs a block `{{ ... }}`"),
            vec![(span, "block expected after this".into())],
            Some(format!("write {}", section_usage(section))),
        ),
        UnexpectedBlock { section, span } => err(
            "rcoa::unexpected_block",
            format!("`{section}` takes no block"),
            vec![(span, "unexpected".into())],
            Some(format!("write {}", section_usage(section))),
        ),
        UnknownKey { section, key, span, allowed } => {
            let near = suggest::nearest(&key, allowed.iter().copied());
            err(
                "rcoa::unknown_key",
                format!("unknown key `{key}` in `{section}`"),
                vec![(span, format!("not a key of `{section}`"))],
                Some(match near {
                    Some(n) => format!("did you mean `{n}`?"),
                    None => format!("keys of `{section}` are {}", join_static(allowed)),
                }),
            )
        }
        DuplicateKey { key, first, again } => err(
            "rcoa::duplicate_key",
            format!("key `{key}` is set twice"),
            vec![(again, "set again here".into()), (first, "first set here".into())],
            Some("keep one of them".into()),
        ),
        MissingKey { section, key, span } => err(
            "rcoa::missing_key",
            format!("`{section}` needs `{key}`"),
            vec![(span, format!("no `{key}` in this section"))],
            Some(format!("add `{}`", missing_key_example(section, key))),
        ),
        UnknownName { kind, slot, name, span, choices } => {
            let (code, what) = dtype_or_value(kind);
            let near = suggest::nearest(&name, choices.iter().map(String::as_str));
            let list = match kind {
                NameKind::Model => "`rcoa catalog models` lists them".to_string(),
                NameKind::Gpu => format!("known GPUs are {} (`rcoa catalog gpus`), or give a block `gpu {{ memory = 48 GiB bf16_tflops = 362 bandwidth = 864 GB/s }}`", join(&choices)),
                _ => format!("`{slot}` is one of {}", join(&choices)),
            };
            let message = match kind {
                NameKind::Value => format!("`{slot}` cannot be `{name}`"),
                NameKind::Dtype => format!("`{name}` is not a dtype `{slot}` can have"),
                _ => format!("unknown {what} `{name}`"),
            };
            err(
                code,
                message,
                vec![(
                    span,
                    match kind {
                        NameKind::Dtype => format!("not a `{slot}` dtype"),
                        NameKind::Value => format!("not a valid `{slot}`"),
                        _ => format!("not a known {what}"),
                    },
                )],
                Some(match near {
                    Some(n) => format!("did you mean `{n}`? {list}"),
                    None => list,
                }),
            )
        }
        WrongKind { slot, expected: e, found, span } => err(
            "rcoa::wrong_kind",
            format!("`{slot}` expects {}, found {found}", expected(e)),
            vec![(span, format!("expected {}", expected(e)))],
            Some(match (e, found.as_str()) {
                (_, "`auto`") => format!("`{slot}` cannot be `auto`; write e.g. `{}`", example(slot, e)),
                (Expected::Size | Expected::SizeOrPercent, "an integer" | "a number") => {
                    format!("give a unit: B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), e.g. `{}`", example(slot, e))
                }
                (Expected::Bandwidth, "an integer" | "a number") => "give a unit: Mbps, Gbps, Tbps (bits) or MB/s, GB/s, TB/s (bytes), e.g. `900 GB/s`".to_string(),
                (Expected::Integer | Expected::IntegerOrAuto, "a number") => format!("`{slot}` counts whole things; write e.g. `{}`", example(slot, e)),
                _ => format!("write e.g. `{}`", example(slot, e)),
            }),
        ),
        WrongUnit { slot, unit, expected: e, span } => {
            let units = match e {
                Expected::Size => "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)",
                Expected::SizeOrPercent => "B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, or %",
                Expected::Bandwidth => "Mbps, Gbps, Tbps (bits per second) or MB/s, GB/s, TB/s (bytes per second)",
                Expected::Integer | Expected::IntegerOrAuto => "the count suffixes K, M, B, T (powers of 1000)",
                Expected::Probability => "% or no unit",
                _ => "no unit",
            };
            err(
                "rcoa::wrong_unit",
                format!("`{slot}` expects {}, but `{}` is a {} unit", expected(e), unit.as_str(), unit_family_for_message(unit, e)),
                vec![(span, format!("`{}` does not fit here", unit.as_str()))],
                Some(format!("`{slot}` takes {units}, e.g. `{}`", example(slot, e))),
            )
        }
        OutOfRange { slot, text, range, span } => err(
            "rcoa::out_of_range",
            format!("`{slot}` is out of range: {text}"),
            vec![(span, format!("must be {}", range_text(range)))],
            Some(format!("`{slot}` must be {}", range_text(range))),
        ),
        NotDivisible {
            what,
            value,
            by_what,
            by,
            span,
            by_span,
            divisor_is_primary,
            options,
        } => {
            let amount = quantity(what, value);
            let primary = if divisor_is_primary { format!("does not divide {amount}") } else { format!("{value} is not a multiple of {by}") };
            let mut labels = vec![(span, primary)];
            if let Some(b) = by_span {
                labels.push((b, format!("{by_what} = {by}")));
            }
            let verb = if what == "heads" || what == "kv_heads" { "are" } else { "is" };
            let mut help = format!("{amount} {verb} not divisible by {by_what} = {by}");
            if !options.is_empty() {
                help.push_str(&format!("; {by_what} degrees that divide it: {}", options.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")));
            }
            err(
                "rcoa::not_divisible",
                format!("`{what}` ({value}) is not divisible by `{by_what}` ({by})"),
                labels,
                Some(help),
            )
        }
        BatchMismatch { micro, accum, data, data_derived, global, span, others } => {
            let mut labels = vec![(span, format!("global_batch = {global}"))];
            labels.extend(others.into_iter().map(|(s, n, v)| (s, format!("{n} = {v}"))));
            let data_note = if data_derived { " (the GPUs left over by tensor, pipeline and context)" } else { "" };
            err(
                "rcoa::batch_mismatch",
                "global_batch is not micro_batch × grad_accum × data".into(),
                labels,
                Some(format!(
                    "micro_batch {micro} × grad_accum {accum} × data {data}{data_note} = {}, but global_batch = {global}",
                    micro as u128 * accum as u128 * data as u128
                )),
            )
        }
        BatchNotMultiple { factors, global, span, others } => {
            let product: u128 = factors.iter().map(|(_, v)| *v as u128).product();
            let written = factors.iter().map(|(n, v)| format!("{n} {v}")).collect::<Vec<_>>().join(" × ");
            let mut labels = vec![(span, format!("global_batch = {global}"))];
            labels.extend(others.into_iter().map(|(s, n, v)| (s, format!("{n} = {v}"))));
            err(
                "rcoa::batch_mismatch",
                format!("global_batch {global} cannot be split into {}", factors.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(" × ")),
                labels,
                Some(format!(
                    "{written} = {product}, and {global} is not a multiple of {product}; make global_batch a multiple of {product} or change the fixed factors"
                )),
            )
        }
        ParallelMismatch { check, span, others } => {
            let written = check.terms.iter().map(|(n, v)| format!("{n} {v}")).collect::<Vec<_>>().join(" × ");
            let gpus = check.gpus_per_node as u128 * check.nodes as u128;
            let mut labels = vec![(span, format!("{written} = {}", check.product))];
            labels.extend(others.into_iter().map(|(s, n, v)| (s, format!("{n} = {v}"))));
            let help = if check.complete {
                format!(
                    "{written} = {}, but the plan has {gpus} GPUs (gpus_per_node {} × nodes {}); the product must equal the GPU count",
                    check.product, check.gpus_per_node, check.nodes
                )
            } else {
                format!(
                    "{written} = {} does not divide the {gpus} GPUs (gpus_per_node {} × nodes {}), so no degree left as `auto` can make up the rest",
                    check.product, check.gpus_per_node, check.nodes
                )
            };
            err("rcoa::parallel_mismatch", "data × tensor × pipeline × context does not match the GPU count".into(), labels, Some(help))
        }
        KvHeadsExceedHeads { kv_heads, heads, span } => err(
            "rcoa::out_of_range",
            format!("`kv_heads` ({kv_heads}) is more than `heads` ({heads})"),
            vec![(span, format!("at most {heads}"))],
            Some("grouped-query attention shares each key/value head among several query heads; kv_heads must divide heads".into()),
        ),
        ExpertsPerToken { per_token, experts, span } => err(
            "rcoa::out_of_range",
            format!("`experts_per_token` ({per_token}) is more than `experts` ({experts})"),
            vec![(span, format!("at most {experts}"))],
            Some(format!("a token can be routed to at most the {experts} experts of a layer")),
        ),
        PipelineTooDeep { pipeline, layers, span } => err(
            "rcoa::out_of_range",
            format!("`pipeline` ({pipeline}) is more than the model's {layers} layers"),
            vec![(span, format!("at most {layers}"))],
            Some(format!("each pipeline stage needs at least one layer; use pipeline <= {layers}")),
        ),
        CheckpointEveryTooLarge { every, layers, span } => err(
            "rcoa::out_of_range",
            format!("`checkpoint = every {every}` skips past the model's {layers} layers"),
            vec![(span, format!("at most every {layers}"))],
            Some(format!("use `every N` with N from 1 to {layers}, or `checkpoint = none`")),
        ),
        SeqLenTooLong { seq_len, max_positions, span } => err(
            "rcoa::out_of_range",
            format!("`seq_len` ({seq_len}) is longer than the model's {max_positions} learned positions"),
            vec![(span, format!("at most {max_positions}"))],
            Some(format!("learned position embeddings have one row per position; use seq_len <= {max_positions}")),
        ),
        BudgetTooLarge { budget, gpu, memory, span } => err(
            "rcoa::out_of_range",
            format!("`budget` ({}) is more than the {}'s memory ({})", bytes(budget), gpu, bytes(memory)),
            vec![(span, format!("at most {}", bytes(memory)))],
            Some("give a budget within GPU memory, or a share such as `budget = 95%`".into()),
        ),
        ReserveTooLarge { reserve, budget, span } => err(
            "rcoa::out_of_range",
            format!("`reserve` ({}) leaves nothing of the budget ({})", bytes(reserve), bytes(budget)),
            vec![(span, format!("must be less than {}", bytes(budget)))],
            Some("the reserve is taken out of the budget; make it smaller or raise `budget`".into()),
        ),
        OffloadTwoPlaces {
            item,
            other,
            span,
            other_span,
        } => {
            let mut labels = vec![(span, "required here".to_string())];
            if let Some(o) = other_span {
                labels.push((o, format!("`{other}` here")));
            }
            err(
                "rcoa::conflict",
                format!("`must_offload` requires `{item}`, but `{other}` puts the same tensors elsewhere"),
                labels,
                Some(format!("a kind of tensor lives in one place: remove `{other}`, or require it instead of `{item}`")),
            )
        }
        SequenceNeedsTensor { span, tensor_span } => {
            let mut labels = vec![(span, "needs tensor parallelism".to_string())];
            if let Some(t) = tensor_span {
                labels.push((t, "tensor = 1".into()));
            }
            err(
                "rcoa::conflict",
                "`sequence = true` needs `tensor` greater than 1".into(),
                labels,
                Some("sequence parallelism splits the activations tensor parallelism leaves replicated; set `tensor = 2` or more (or `auto`), or `sequence = false`".into()),
            )
        }
        ExpertNeedsExperts { expert, experts, span } => err(
            "rcoa::not_divisible",
            format!("`expert` ({expert}) does not divide the model's {experts} experts"),
            vec![(span, format!("{experts} experts cannot be split {expert} ways"))],
            Some(if experts <= 1 { "expert parallelism needs a mixture-of-experts model (`experts` > 1); use `expert = 1`".to_string() } else { format!("use an expert degree that divides {experts}") }),
        ),
        QloraBase { base, span } => err(
            "rcoa::conflict",
            format!("QLoRA stores its frozen base weights in `nf4`, not `{base}`"),
            vec![(span, "must be nf4".into())],
            Some("write `base = nf4`, or use `adapter lora` to keep the base in the params dtype".into()),
        ),
        TargetNotInModel { target, span } => err(
            "rcoa::conflict",
            format!("the model has no `{target}` projection"),
            vec![(span, "not in this model".into())],
            Some("`gate` exists only in gated (`mlp = swiglu`) models; `gelu` and `squared_relu` MLPs have `up` and `down`".into()),
        ),
        EmptyTargets { span } => err(
            "rcoa::out_of_range",
            "`targets` is empty: the adapter would train nothing".into(),
            vec![(span, "no projections".into())],
            Some("list the projections to adapt, e.g. `targets = [q, k, v, o]`".into()),
        ),
        NotApplicable { key, because, span } => {
            let (message, help) = match because {
                Inapplicable::MomentumNeedsSgd => (
                    format!("`{key}` applies only to `optimizer sgd`"),
                    "Adam-style optimizers take `betas = (0.9, 0.999)` instead".to_string(),
                ),
                Inapplicable::SgdHasNoBetas => (format!("`{key}` does not apply to `optimizer sgd`"), "SGD takes `momentum = 0.9` instead".to_string()),
                Inapplicable::NeedsContrastive => (
                    format!("`{key}` applies only to `loss = contrastive`"),
                    "set `loss = contrastive`, or remove it".to_string(),
                ),
                Inapplicable::NeedsCausalLm => (
                    format!("`{key}` applies only to `loss = causal_lm`"),
                    if key == "packing" {
                        "it bins whole examples into a causal LM's sequences; remove it, or train with `loss = causal_lm`"
                    } else {
                        "it picks the assistant's tokens of chat conversations for a causal LM's loss; remove it, or train with `loss = causal_lm`"
                    }
                    .to_string(),
                ),
                Inapplicable::BaseNeedsQlora => (
                    format!("`{key}` applies only to `adapter qlora`"),
                    "a LoRA base keeps the params dtype; use `adapter qlora { base = nf4 ... }` for a 4-bit base".to_string(),
                ),
                Inapplicable::PagedNeedsBitsandbytes => (
                    format!("`{key}` applies only to adam, adamw, adam8bit and lion"),
                    "bitsandbytes has paged versions of those optimizers only; write `impl = foreach` or `fused`, or change the optimizer".to_string(),
                ),
                Inapplicable::InBackwardNoAccumulation => (
                    format!("`{key}` cannot accumulate gradients over micro-batches"),
                    "each parameter's step runs as its gradient is produced, so every backward is a step (torchtune refuses `gradient_accumulation_steps` > 1 with `optimizer_in_bwd`): write `grad_accum = 1`, or remove `in_backward`".to_string(),
                ),
                Inapplicable::VirtualStagesNeedPipeline => (
                    format!("`{key}` needs a pipeline: a fixed `pipeline` of 2 or more"),
                    "interleaving splits each pipeline rank's layers into model chunks; write `pipeline = 4` (say), or remove it".to_string(),
                ),
            };
            err("rcoa::not_applicable", message, vec![(span, "not applicable here".into())], Some(help))
        }
        OffloadNeedsStorage { nvme, span } => {
            let (what, key) = if nvme { ("NVMe", "nvme") } else { ("CPU memory", "host_memory") };
            err(
                "rcoa::missing_key",
                format!("offloading to {what} needs `hardware.{key}`"),
                vec![(span, format!("needs `hardware.{key}`"))],
                Some(format!("say how much there is per node, e.g. `{key} = {}` in `hardware`", if nvme { "3.84 TB" } else { "512 GiB" })),
            )
        }
        Tf32NeedsFp32 { span } => err(
            "rcoa::conflict",
            "`compute = tf32` needs `params = fp32`".into(),
            vec![(span, "tf32 matmuls read fp32 tensors".into())],
            Some("use `params = fp32 compute = tf32`, or `compute = bf16` for 16-bit weights".into()),
        ),
        AutocastConflict { span, on: true } => err(
            "rcoa::conflict",
            "`autocast = true` needs a 16-bit `compute`".into(),
            vec![(span, "nothing narrower to cast to".into())],
            Some("autocast runs matmuls in `compute`: set `compute = bf16` (or fp16)".into()),
        ),
        AutocastConflict { span, on: false } => err(
            "rcoa::conflict",
            "fp32 weights with 16-bit `compute` always run as autocast".into(),
            vec![(span, "cannot be turned off here".into())],
            Some("remove `autocast = false`, or store the weights in the compute dtype (`params = bf16`)".into()),
        ),
        HfConfig { detail, span } => {
            let (message, label, help) = match detail {
                HfDetail::Read { path, error } => (
                    format!("cannot read the Hugging Face config `{path}`: {error}"),
                    "cannot read this file".to_string(),
                    "the path is relative to the plan file's folder".to_string(),
                ),
                HfDetail::Json(e) => (format!("the Hugging Face config is not valid JSON: {e}"), "invalid JSON".into(), "give the model's `config.json` as saved by `transformers`".into()),
                HfDetail::NotObject => ("the Hugging Face config is not a JSON object".into(), "not a config.json".into(), "give the model's `config.json` as saved by `transformers`".into()),
                HfDetail::NoModelType => ("the Hugging Face config has no `model_type`".into(), "no `model_type`".into(), format!("supported model types: {}", join_static(super::hf::MODEL_TYPES))),
                HfDetail::UnknownModelType(t) => (
                    format!("unsupported Hugging Face `model_type` `{t}`"),
                    format!("model_type `{t}`"),
                    format!("supported model types: {}; or describe the architecture with `model {{ ... }}`", join_static(super::hf::MODEL_TYPES)),
                ),
                HfDetail::MissingKey { model_type, key } => (
                    format!("the `{model_type}` config has no `{key}`"),
                    format!("no `{key}`"),
                    format!("add `{key}` to the config, or override it: `model hf \"...\" {{ ... }}`"),
                ),
                HfDetail::WrongType { key, expected } => (format!("`{key}` in the Hugging Face config is not {expected}"), format!("bad `{key}`"), format!("`{key}` must be {expected}")),
                HfDetail::Unsupported { key, value } => (
                    format!("rcoa cannot reproduce `{key}` = {value} from the Hugging Face config"),
                    format!("unsupported `{key}`"),
                    "rcoa's forward would not match `transformers`; use a checkpoint without it, or describe the architecture with `model { ... }`".to_string(),
                ),
            };
            err("rcoa::hf_config", message, vec![(span, label)], Some(help))
        }
    }
}

/// A model dimension or count, said the way people say it ("32 heads").
fn quantity(what: &str, value: u64) -> String {
    match what {
        "heads" => format!("{value} heads"),
        "kv_heads" => format!("{value} kv heads"),
        "hidden" => format!("hidden size {value}"),
        "ffn" => format!("ffn size {value}"),
        "vocab" => format!("a vocabulary of {value}"),
        _ => format!("{what} {value}"),
    }
}

fn unit_family_for_message(u: Unit, e: Expected) -> &'static str {
    // A bare `B` in a count slot is a billion, so it is never "wrong" there;
    // where it is wrong it is bytes.
    match (u, e) {
        (Unit::B, _) => "size",
        _ => unit_family(u),
    }
}

fn missing_key_example(section: &str, key: &str) -> String {
    let v = match (section, key) {
        ("train", "seq_len") => "2048",
        ("train", "global_batch") => "256",
        ("hardware", "gpu") => "h100-80gb",
        ("gpu", "memory") => "48 GiB",
        ("gpu", "bf16_tflops") => "362",
        ("gpu", "bandwidth") => "864 GB/s",
        ("model", "arch") => "decoder",
        ("model", "mlp") => "swiglu",
        ("model", "norm") => "rmsnorm",
        ("model", "tie_embeddings") => "false",
        ("model", "max_positions") => "4096",
        ("adapter", "rank") => "16",
        ("adapter", "alpha") => "32",
        ("adapter", "targets") => "[q, k, v, o]",
        _ => "...",
    };
    format!("{key} = {v}")
}
