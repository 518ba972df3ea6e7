//! What the resolver found wrong, as data.
//!
//! Detection (the section resolvers and [`super::constraints`]) builds these
//! values and never writes prose; [`super::wording`] turns each into a
//! user-facing [`ResolveError`](super::ResolveError) with its code, message,
//! labels and help. Keeping the two apart lets the wording be reviewed in one
//! place and keeps the checks short.

use rcoa_grammar::{Span, Unit};

/// The family of a name that was not found; decides the error code.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum NameKind {
    Model,
    Gpu,
    Dtype,
    Optimizer,
    Adapter,
    Target,
    /// Any other enumerated value (`mlp`, `attention`, `checkpoint`, ...).
    Value,
}

/// The kind of value a slot takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Expected {
    /// A whole number (count suffixes K/M/B/T allowed).
    Integer,
    IntegerOrAuto,
    /// A plain number.
    Number,
    /// A probability: a number in [0, 1) or a percentage.
    Probability,
    Bool,
    BoolOrAuto,
    /// A size: number and byte unit.
    Size,
    /// A size or a percentage of GPU memory.
    SizeOrPercent,
    /// A bandwidth: `400 Gbps`, `900 GB/s`.
    Bandwidth,
    /// One of a fixed set of names.
    Name,
    /// A catalog GPU name or a `{ ... }` block.
    GpuNameOrBlock,
    /// A list of names, `[q, k, v]`.
    NameList,
    /// A list of offload items.
    OffloadList,
    /// `(0.9, 0.999)`
    Pair,
    /// `none`, `full`, `selective`, `auto` or `every N`.
    Checkpoint,
    /// `true`, `false` or `qkv`.
    Bias,
    /// A string (a path).
    Path,
}

/// A numeric range a value broke.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) enum Range {
    /// An integer at least this.
    AtLeast(u64),
    /// An integer in lo..=hi.
    Between(u64, u64),
    /// A real number > 0.
    Positive,
    /// A real number >= 0.
    NonNegative,
    /// A real number in [0, 1).
    UnitInterval,
    /// A percentage in (0 %, 100 %].
    Percent,
    /// A size of at least this many bytes.
    Bytes(u64),
}

/// Why a `hf "config.json"` could not be used.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum HfDetail {
    /// The file could not be read (the OS error text and the full path tried).
    Read {
        path: String,
        error: String,
    },
    Json(String),
    NotObject,
    NoModelType,
    UnknownModelType(String),
    MissingKey {
        model_type: String,
        key: &'static str,
    },
    WrongType {
        key: &'static str,
        expected: &'static str,
    },
    /// A value the config reader understands but rcoa cannot reproduce.
    Unsupported {
        key: &'static str,
        value: String,
    },
}

/// One arithmetic check of `data × tensor × pipeline × context = GPUs`.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ParallelProduct {
    /// The fixed degrees, in order data, tensor, pipeline, context.
    pub terms: Vec<(&'static str, u64)>,
    pub product: u64,
    pub gpus_per_node: u64,
    pub nodes: u64,
    /// False when some degree is `auto`: the product must then divide the GPU count.
    pub complete: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Problem {
    // ------------------------------------------------------------ structure
    UnknownSection {
        name: String,
        span: Span,
    },
    DuplicateSection {
        name: String,
        first: Span,
        again: Span,
    },
    MissingSection {
        name: &'static str,
    },
    MissingArgument {
        section: &'static str,
        span: Span,
    },
    UnexpectedArgument {
        section: &'static str,
        span: Span,
    },
    MissingBlock {
        section: &'static str,
        span: Span,
    },
    UnexpectedBlock {
        section: &'static str,
        span: Span,
    },
    UnknownKey {
        section: &'static str,
        key: String,
        span: Span,
        allowed: &'static [&'static str],
    },
    DuplicateKey {
        key: String,
        first: Span,
        again: Span,
    },
    MissingKey {
        section: &'static str,
        key: &'static str,
        span: Span,
    },

    // ------------------------------------------------------------ values
    UnknownName {
        kind: NameKind,
        slot: &'static str,
        name: String,
        span: Span,
        /// The valid names for this slot, in reference order.
        choices: Vec<String>,
    },
    WrongKind {
        slot: &'static str,
        expected: Expected,
        /// What was written, described (see `wording::found`).
        found: String,
        span: Span,
    },
    WrongUnit {
        slot: &'static str,
        unit: Unit,
        expected: Expected,
        span: Span,
    },
    OutOfRange {
        slot: &'static str,
        /// The value as written.
        text: String,
        range: Range,
        span: Span,
    },

    // ------------------------------------------------------------ constraints
    /// `value` of `what` is not divisible by `by` of `by_what`.
    NotDivisible {
        what: &'static str,
        value: u64,
        by_what: &'static str,
        by: u64,
        span: Span,
        by_span: Option<Span>,
        /// The span is the divisor's (`tensor = 3`), not the divided value's.
        divisor_is_primary: bool,
        /// Degrees that would work, when there is a useful list.
        options: Vec<u64>,
    },
    /// micro_batch × grad_accum × data ≠ global_batch (all known).
    BatchMismatch {
        micro: u64,
        accum: u64,
        data: u64,
        data_derived: bool,
        global: u64,
        span: Span,
        /// Other values that took part: where, which key, its value.
        others: Vec<(Span, &'static str, u64)>,
    },
    /// global_batch is not a multiple of the fixed factors.
    BatchNotMultiple {
        /// The fixed factors, named.
        factors: Vec<(&'static str, u64)>,
        global: u64,
        span: Span,
        /// Other values that took part: where, which key, its value.
        others: Vec<(Span, &'static str, u64)>,
    },
    ParallelMismatch {
        check: ParallelProduct,
        span: Span,
        /// Other values that took part: where, which key, its value.
        others: Vec<(Span, &'static str, u64)>,
    },
    KvHeadsExceedHeads {
        kv_heads: u64,
        heads: u64,
        span: Span,
    },
    ExpertsPerToken {
        per_token: u64,
        experts: u64,
        span: Span,
    },
    PipelineTooDeep {
        pipeline: u64,
        layers: u64,
        span: Span,
    },
    CheckpointEveryTooLarge {
        every: u64,
        layers: u64,
        span: Span,
    },
    SeqLenTooLong {
        seq_len: u64,
        max_positions: u64,
        span: Span,
    },
    BudgetTooLarge {
        budget: u64,
        gpu: String,
        memory: u64,
        span: Span,
    },
    ReserveTooLarge {
        reserve: u64,
        budget: u64,
        span: Span,
    },
    SequenceNeedsTensor {
        span: Span,
        tensor_span: Option<Span>,
    },
    ExpertNeedsExperts {
        expert: u64,
        experts: u64,
        span: Span,
    },
    QloraBase {
        base: String,
        span: Span,
    },
    TargetNotInModel {
        target: &'static str,
        span: Span,
    },
    EmptyTargets {
        span: Span,
    },
    /// A key that means nothing in this configuration (`momentum` for adamw).
    NotApplicable {
        key: &'static str,
        because: Inapplicable,
        span: Span,
    },
    OffloadNeedsStorage {
        nvme: bool,
        span: Span,
    },
    /// `must_offload` sends `item`'s tensors to one place and `other` (in `must_offload`
    /// or `offload`) to another.
    OffloadTwoPlaces {
        item: String,
        other: String,
        span: Span,
        other_span: Option<Span>,
    },
    Tf32NeedsFp32 {
        span: Span,
    },
    /// `autocast = true` with nothing narrower to cast to, or `autocast = false` where
    /// fp32 weights with 16-bit compute can only run as autocast.
    AutocastConflict {
        span: Span,
        on: bool,
    },
    HfConfig {
        detail: HfDetail,
        span: Span,
    },
}

/// Why a key does not apply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Inapplicable {
    /// Only SGD has `momentum`.
    MomentumNeedsSgd,
    /// SGD has no `betas`.
    SgdHasNoBetas,
    /// `positives` / `negatives` need `loss = contrastive`.
    NeedsContrastive,
    /// `assistant_only_loss` needs `loss = causal_lm`.
    NeedsCausalLm,
    /// `base` is for QLoRA.
    BaseNeedsQlora,
    /// `virtual_stages` > 1 needs a fixed `pipeline` > 1.
    VirtualStagesNeedPipeline,
    /// bitsandbytes has paged Adam, AdamW, 8-bit Adam and Lion only.
    PagedNeedsBitsandbytes,
    /// `in_backward` steps each parameter once per backward: no accumulation.
    InBackwardNoAccumulation,
}

impl Problem {
    /// Where the problem is, for sorting (file-level problems first).
    pub(crate) fn position(&self) -> usize {
        self.primary_span().map_or(0, |s| s.start)
    }

    pub(crate) fn primary_span(&self) -> Option<Span> {
        use Problem::*;
        match self {
            MissingSection { .. } => None,
            UnknownSection { span, .. }
            | MissingArgument { span, .. }
            | UnexpectedArgument { span, .. }
            | MissingBlock { span, .. }
            | UnexpectedBlock { span, .. }
            | UnknownKey { span, .. }
            | MissingKey { span, .. }
            | UnknownName { span, .. }
            | WrongKind { span, .. }
            | WrongUnit { span, .. }
            | OutOfRange { span, .. }
            | NotDivisible { span, .. }
            | BatchMismatch { span, .. }
            | BatchNotMultiple { span, .. }
            | ParallelMismatch { span, .. }
            | KvHeadsExceedHeads { span, .. }
            | ExpertsPerToken { span, .. }
            | PipelineTooDeep { span, .. }
            | CheckpointEveryTooLarge { span, .. }
            | SeqLenTooLong { span, .. }
            | BudgetTooLarge { span, .. }
            | ReserveTooLarge { span, .. }
            | SequenceNeedsTensor { span, .. }
            | OffloadTwoPlaces { span, .. }
            | ExpertNeedsExperts { span, .. }
            | QloraBase { span, .. }
            | TargetNotInModel { span, .. }
            | EmptyTargets { span }
            | NotApplicable { span, .. }
            | OffloadNeedsStorage { span, .. }
            | Tf32NeedsFp32 { span }
            | AutocastConflict { span, .. }
            | HfConfig { span, .. } => Some(*span),
            DuplicateSection { again, .. } | DuplicateKey { again, .. } => Some(*again),
        }
    }
}
