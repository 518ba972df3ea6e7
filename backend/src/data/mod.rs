//! Training data: synthetic token streams (the default) or a local text file.
//!
//! Invariant: the batch for (step, micro-batch) is a pure function of the
//! seed, the step, the micro-batch index and the data-parallel rank. No iterator state is carried, so
//! a run resumed from a checkpoint at step k sees exactly the batches an
//! uninterrupted run would have seen from step k on.
//!
//! Synthetic sequences are drawn from a Zipf-like distribution over a small
//! alphabet with a repeated motif, so a model can learn something (the loss
//! falls) within a few steps. A text file is tokenized byte by byte when the
//! model's vocabulary holds all 256 bytes, otherwise by a character table
//! built from the bytes the file uses.
//!
//! Supervised fine-tuning files (TRL's formats: `{"prompt": …, "completion": …}`,
//! `{"messages": [..]}`, conversational prompt-completion) train one example per row,
//! right-padded, with the loss on the completion's tokens only (every token of a
//! conversation), normalised over every completion token of
//! the step (all micro-batches and ranks), as `transformers`' Trainer does since it
//! counts `num_items_in_batch`.

pub mod files;
pub mod order;
pub mod packing;

use crate::RunError;
use rcoa_compiler::spec::Loss;
use std::path::Path;

/// SplitMix64: tiny, fast, and the same on every platform.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }
    /// A generator for one (seed, a, b, c) tuple.
    pub fn keyed(seed: u64, a: u64, b: u64, c: u64) -> Self {
        let mut r = Rng(seed ^ 0x9E37_79B9_7F4A_7C15);
        for k in [a, b, c] {
            r.0 ^= k.wrapping_mul(0xBF58_476D_1CE4_E5B9);
            r.next_u64();
        }
        r
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 {
            0
        } else {
            self.next_u64() % n
        }
    }
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// Where tokens come from.
#[derive(Clone, Debug)]
pub enum Source {
    Synthetic {
        vocab: u64,
    },
    /// A plain text file's tokens, read in windows at seeded random offsets.
    File {
        tokens: Vec<u32>,
        name: String,
    },
    /// JSONL documents tokenized, each followed by EOS, concatenated: cut
    /// into consecutive windows (`Source::windows`) taken in a seeded order,
    /// every window once per epoch.
    Packed {
        tokens: Vec<u32>,
        name: String,
        docs: usize,
    },
    /// JSONL pairs or groups: per anchor its rows `[query, positives..,
    /// negatives..]` (as many as the plan trains with), each truncated to
    /// `seq_len`; right-padded with `pad` in a batch. Anchors are taken in a
    /// seeded order, every anchor once per epoch.
    Pairs {
        examples: Vec<Vec<Vec<u32>>>,
        pad: u32,
        name: String,
    },
    /// JSONL prompt-completion examples, tokenized as TRL's `SFTTrainer` does: the
    /// prompt and completion together (post-processor applied), EOS appended, the
    /// prompt's own token count marking where the scored completion starts. Taken in a
    /// seeded order, every example once per epoch, one per row.
    Completions {
        examples: Vec<Completion>,
        pad: u32,
        name: String,
        /// What the file holds, for messages: "prompt-completion examples",
        /// "conversations".
        kind: String,
        /// `train.packing`: the examples binned into rows (`packing::bins`), each row one
        /// bin, taken in a seeded order, every bin once per epoch. `None`: one example per
        /// row.
        bins: Option<Vec<Vec<usize>>>,
    },
}

/// One prompt-completion example: its ids, how many of them are the prompt's and, under
/// `train.assistant_only_loss`, which are the assistant's.
#[derive(Clone, Debug, PartialEq)]
pub struct Completion {
    pub ids: Vec<u32>,
    pub prompt: usize,
    /// One flag per id (transformers' `assistant_masks`): only the assistant's tokens are
    /// scored. `None`: every token after the prompt is.
    pub assistant: Option<Vec<bool>>,
}

impl Completion {
    /// Is token `t` a target the loss scores (TRL's labels: not the prompt's, and the
    /// assistant's where that is asked)?
    pub(crate) fn scores(&self, t: usize) -> bool {
        t >= self.prompt && self.assistant.as_ref().is_none_or(|a| a[t])
    }

    /// Next-token predictions of the example cut to `seq` tokens that are scored: those
    /// whose target is a completion token (TRL's `completion_mask` shifted by one) and,
    /// with `assistant`, the assistant's.
    pub fn scored(&self, seq: usize) -> usize {
        (1..self.ids.len().min(seq))
            .filter(|&t| self.scores(t))
            .count()
    }

    /// The example as one row of `seq` positions, appended to a batch: cut to `seq`
    /// tokens (TRL's `max_length`) and right-padded with `pad`; the target of position
    /// `p` is token `p + 1`, weighted 1 where that token is the completion's.
    pub fn row(
        &self,
        seq: usize,
        pad: u32,
        inputs: &mut Vec<i64>,
        targets: &mut Vec<i64>,
        weights: &mut Vec<f32>,
    ) {
        self.tokens(seq, seq, pad, inputs, targets, weights);
    }

    /// The first `width` positions of [`Completion::row`] (a packed row takes each
    /// example's own length: `packing::row`).
    pub(crate) fn tokens(
        &self,
        width: usize,
        seq: usize,
        pad: u32,
        inputs: &mut Vec<i64>,
        targets: &mut Vec<i64>,
        weights: &mut Vec<f32>,
    ) {
        let len = self.ids.len().min(seq);
        let at = |p: usize| if p < len { self.ids[p] } else { pad } as i64;
        for p in 0..width {
            inputs.push(at(p));
            targets.push(at(p + 1));
            weights.push(if p + 1 < len && self.scores(p + 1) {
                1.0
            } else {
                0.0
            });
        }
    }
}

/// Supervised rows as a batch holds them, `[rows, seq]` each: one example per row, or
/// (packed) a bin of examples per row with each token's position.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SftRows {
    pub inputs: Vec<i64>,
    pub targets: Vec<i64>,
    pub weights: Vec<f32>,
    /// Packed rows: each token's position in its example ([`Batch::positions`]).
    pub positions: Option<Vec<i64>>,
}

impl SftRows {
    pub fn new(packed: bool) -> Self {
        SftRows {
            positions: packed.then(Vec::new),
            ..Default::default()
        }
    }

    /// Appends the row of `seq` positions holding `row` of `examples`: its one example
    /// right-padded ([`Completion::row`]), or a packed bin ([`packing::row`]).
    pub fn push(&mut self, examples: &[Completion], row: &[usize], seq: usize, pad: u32) {
        if self.positions.is_some() {
            packing::row(examples, row, seq, pad, self);
        } else {
            examples[row[0]].row(
                seq,
                pad,
                &mut self.inputs,
                &mut self.targets,
                &mut self.weights,
            );
        }
    }
}

/// Tokens one training row reads: causal LM predicts `seq` next tokens
/// from `seq + 1`.
pub fn window_len(loss: Loss, seq: usize) -> usize {
    match loss {
        Loss::CausalLm => seq + 1,
        _ => seq,
    }
}

/// Share of positions a noisy (positive) view of a synthetic contrastive
/// text replaces with random tokens.
const NOISE: f64 = 0.15;

impl Source {
    /// The training source of `path` (see `files`).
    pub fn from_file(
        path: &Path,
        spec: &files::FileSpec,
        tok: &crate::tokenizer::TextTokenizer,
    ) -> Result<Self, RunError> {
        files::load(path, spec, tok)
    }

    pub fn describe(&self) -> String {
        match self {
            Source::Synthetic { .. } => "synthetic tokens".to_string(),
            Source::File { tokens, name } => format!("{name} ({} tokens)", tokens.len()),
            Source::Packed { tokens, name, docs } => {
                format!("{name} ({docs} documents, {} tokens packed)", tokens.len())
            }
            Source::Completions {
                examples,
                name,
                kind,
                bins,
                ..
            } => match bins {
                None => format!("{name} ({} {kind})", examples.len()),
                Some(b) => format!(
                    "{name} ({} {kind}, packed into {} sequence{})",
                    examples.len(),
                    b.len(),
                    if b.len() == 1 { "" } else { "s" }
                ),
            },
            Source::Pairs { examples, name, .. } => {
                let rows = examples.first().map_or(0, Vec::len);
                if rows == 2 {
                    format!("{name} ({} pairs)", examples.len())
                } else {
                    format!("{name} ({} anchors of {rows} texts)", examples.len())
                }
            }
        }
    }

    pub fn token_count(&self) -> usize {
        match self {
            Source::Synthetic { .. } => 0,
            Source::File { tokens, .. } | Source::Packed { tokens, .. } => tokens.len(),
            Source::Pairs { examples, .. } => examples.iter().flatten().map(Vec::len).sum(),
            Source::Completions { examples, .. } => examples.iter().map(|e| e.ids.len()).sum(),
        }
    }

    /// Packed: the number of training windows for `loss` (windows of
    /// `window_len` tokens every `seq` tokens, so causal windows overlap by
    /// the one token both predict from and to).
    pub fn windows(&self, loss: Loss, seq: usize) -> usize {
        match self {
            Source::Packed { tokens, .. } => {
                let extra = window_len(loss, seq) - seq;
                tokens.len().saturating_sub(extra) / seq.max(1)
            }
            _ => 0,
        }
    }

    /// One sequence of `len` tokens.
    fn sequence(&self, rng: &mut Rng, len: usize) -> Vec<u32> {
        match self {
            Source::Synthetic { vocab } => {
                // A motif of 8 tokens repeated with 10% noise, tokens from a
                // skewed distribution over at most 256 ids.
                let alphabet = (*vocab).clamp(2, 256);
                let draw = |rng: &mut Rng| {
                    let u = rng.unit();
                    ((u * u * u) * alphabet as f64) as u32 % alphabet as u32
                };
                let motif: Vec<u32> = (0..8).map(|_| draw(rng)).collect();
                (0..len)
                    .map(|i| {
                        if rng.unit() < 0.1 {
                            draw(rng)
                        } else {
                            motif[i % motif.len()]
                        }
                    })
                    .collect()
            }
            Source::File { tokens, .. } | Source::Packed { tokens, .. } => {
                let start = rng.below((tokens.len() - len + 1) as u64) as usize;
                tokens[start..start + len].to_vec()
            }
            Source::Pairs { .. } => unreachable!("pairs are batched by `Batcher::pairs`"),
            Source::Completions { .. } => {
                unreachable!("completions are batched by `Batcher::completions`")
            }
        }
    }

    /// View `view` of contrastive "document" `doc`.
    ///
    /// Synthetic: every text is an arrangement of one shared bag of tokens
    /// (drawn once from the first 64 ids); a document is its own seeded
    /// order of the bag, view 0 is that order and every other view replaces
    /// a share (`NOISE`) of its positions with random tokens. Negatives are
    /// other orders of the same tokens, so to an untrained encoder (mean
    /// pooling: nearly a bag of tokens) every candidate looks alike and the
    /// loss starts near chance; it falls as the model learns which token
    /// sits where.
    ///
    /// File: a window and the window half a sequence later overlap by half.
    fn view(&self, doc: u64, view: u64, len: usize) -> Vec<u32> {
        match self {
            Source::Synthetic { vocab } => {
                let alphabet = (*vocab).clamp(2, 64);
                let mut bag = Rng::keyed(0x7E3F_1A7E, len as u64, 0, 0);
                let mut text: Vec<u32> = (0..len).map(|_| bag.below(alphabet) as u32).collect();
                // The document's order: a seeded Fisher-Yates shuffle.
                let mut order = Rng::keyed(doc, 0x0A11, 0, 0);
                for i in (1..len).rev() {
                    text.swap(i, order.below(i as u64 + 1) as usize);
                }
                if view > 0 {
                    let mut noise = Rng::keyed(doc, view, 7, 7);
                    for t in &mut text {
                        if noise.unit() < NOISE {
                            *t = noise.below(alphabet) as u32;
                        }
                    }
                }
                text
            }
            Source::File { tokens, .. } | Source::Packed { tokens, .. } => {
                let span = (len + len / 2).min(tokens.len());
                let start = Rng::new(doc).below((tokens.len() - span + 1) as u64) as usize;
                let offset = if view == 0 { 0 } else { span - len };
                tokens[start + offset..start + offset + len].to_vec()
            }
            Source::Pairs { .. } => unreachable!("pairs are batched by `Batcher::pairs`"),
            Source::Completions { .. } => {
                unreachable!("completions train a causal LM (`files::load` refuses the rest)")
            }
        }
    }
}
/// One micro-batch on the host.
#[derive(Clone, Debug, PartialEq)]
pub struct Batch {
    /// Sequences encoded, row-major `[rows, seq]`.
    pub inputs: Vec<i64>,
    pub rows: usize,
    pub seq: usize,
    /// Causal and masked LM: the token to predict at each input position, `[rows, seq]`.
    pub targets: Vec<i64>,
    /// Masked LM: 1.0 where the position was masked and is scored, `[rows, seq]`.
    pub weights: Vec<f32>,
    /// Packed rows (`train.packing`): each token's position in its example, `[rows,
    /// seq]`, restarting at 0 with each (transformers' `position_ids`); attention stays
    /// within each example. `None`: positions `0..seq` in every row.
    pub positions: Option<Vec<i64>>,
    /// Right-padded rows (contrastive pairs from a file): true for real
    /// tokens, `[rows, seq]`, as Hugging Face's `attention_mask`. `None`:
    /// every token is real (packed or synthetic sequences).
    pub keep: Option<Vec<bool>>,
    /// Factor on the micro-batch's loss (its mean over its scored positions) that makes
    /// the step's gradient the mean over every scored position of the step: 1, but for
    /// prompt-completion examples, whose micro-batches score different numbers of
    /// tokens (`scored × grad_accum × ranks / scored in the step`).
    pub loss_weight: f64,
}

/// The shape of the batches a plan trains on.
#[derive(Clone, Debug)]
pub struct Batcher {
    pub source: Source,
    pub seed: u64,
    pub loss: Loss,
    pub micro_batch: usize,
    pub seq: usize,
    pub vocab: u64,
    /// Contrastive: sequences per anchor (1 + positives + negatives), or 2 for
    /// in-batch pairs when neither is given.
    pub group: usize,
    pub positives: usize,
    /// Contrastive with explicit positives/negatives: `micro_batch` counts
    /// anchors, each encoding `group` rows. Otherwise it counts rows.
    pub grouped: bool,
    /// Data-parallel rank: rank r's micro-batch holds rows (or groups)
    /// `r*n .. (r+1)*n` of the global micro-batch, so R ranks with
    /// micro-batch n see exactly the rows one process with R*n would see.
    pub rank: u64,
    /// Data-parallel ranks and micro-batches per step: where a micro-batch
    /// sits in the run's stream of a file's examples (`Batcher::position`).
    pub ranks: u64,
    pub grad_accum: u64,
    /// Masked LM's mask token: the tokenizer's, else the last id.
    pub mask_id: Option<u32>,
}

/// Share of positions masked for masked-LM training (BERT).
const MLM_RATE: f64 = 0.15;

impl Batcher {
    /// Rows (sequences) one micro-batch encodes.
    pub fn rows(&self) -> usize {
        match self.loss {
            Loss::Contrastive if self.grouped => self.micro_batch * self.group,
            _ => self.micro_batch,
        }
    }

    /// Examples (rows, or contrastive anchors) one micro-batch of one rank takes.
    pub fn examples_per_rank(&self) -> usize {
        match self.loss {
            Loss::Contrastive => self.rows() / self.group.max(1),
            _ => self.rows(),
        }
    }

    /// Position of example `i` of this rank's micro-batch `micro` of step
    /// `step` in the run's stream: the global micro-batches in order, each
    /// holding the ranks' examples in rank order.
    fn position(&self, step: u64, micro: u64, i: usize) -> u64 {
        let per_rank = self.examples_per_rank() as u64;
        ((step * self.grad_accum.max(1) + micro) * self.ranks.max(1) + self.rank) * per_rank
            + i as u64
    }

    /// Row `i`'s tokens: the packed file's window at its place in the
    /// run's order, or a synthetic / random window drawn from `rng`.
    fn lm_row(&self, step: u64, micro: u64, i: usize, rng: &mut Rng, len: usize) -> Vec<u32> {
        if let Source::Packed { tokens, .. } = &self.source {
            let n = self.source.windows(self.loss, self.seq) as u64;
            let w = order::example(self.position(step, micro, i), n, self.seed);
            return tokens[w * self.seq..w * self.seq + len].to_vec();
        }
        self.source.sequence(rng, len)
    }

    pub fn batch(&self, step: u64, micro: u64) -> Batch {
        let (rows, s) = (self.rows(), self.seq);
        let mut inputs = Vec::with_capacity(rows * s);
        let mut targets = Vec::new();
        let mut weights = Vec::new();
        let mut keep = None;
        let mut positions = None;
        let base = self.rank * rows as u64;
        match self.loss {
            Loss::CausalLm if matches!(self.source, Source::Completions { .. }) => {
                let r = self.completions(step, micro);
                (inputs, targets, weights, positions) =
                    (r.inputs, r.targets, r.weights, r.positions);
            }
            Loss::CausalLm => {
                for r in 0..rows {
                    let mut rng = Rng::keyed(self.seed, step, micro, base + r as u64);
                    let seq = self.lm_row(step, micro, r, &mut rng, s + 1);
                    inputs.extend(seq[..s].iter().map(|&t| t as i64));
                    targets.extend(seq[1..].iter().map(|&t| t as i64));
                }
            }
            Loss::MaskedLm => {
                let mask_id = self
                    .mask_id
                    .map_or(self.vocab.saturating_sub(1) as i64, |m| m as i64);
                for r in 0..rows {
                    // The masked positions are drawn from the row's generator
                    // also for packed files (whose windows come in order).
                    let mut rng = Rng::keyed(self.seed, step, micro, base + r as u64);
                    let seq = self.lm_row(step, micro, r, &mut rng, s);
                    for &t in &seq {
                        let masked = rng.unit() < MLM_RATE;
                        inputs.push(if masked { mask_id } else { t as i64 });
                        targets.push(t as i64);
                        weights.push(if masked { 1.0 } else { 0.0 });
                    }
                }
            }
            Loss::Contrastive if matches!(self.source, Source::Pairs { .. }) => {
                keep = Some(self.pairs(step, micro, &mut inputs));
            }
            Loss::Contrastive => {
                // Groups of `group` rows: an anchor, its positives (other
                // views of its document) and its negatives (other documents).
                let groups = rows / self.group.max(1);
                let base = self.rank * groups as u64;
                for g in 0..groups {
                    let doc = Rng::keyed(self.seed, step, micro, base + g as u64).next_u64();
                    inputs.extend(self.source.view(doc, 0, s).iter().map(|&t| t as i64));
                    for j in 1..self.group {
                        let row = if j <= self.positives.max(1) {
                            self.source.view(doc, j as u64, s)
                        } else {
                            let key = Rng::keyed(
                                self.seed ^ 0x5EED,
                                step,
                                micro,
                                (base as usize + g) as u64 * self.group as u64 + j as u64,
                            )
                            .next_u64();
                            self.source.view(key, 0, s)
                        };
                        inputs.extend(row.iter().map(|&t| t as i64));
                    }
                }
                // Any leftover row (odd micro-batch with in-batch pairs) is padding for shape only.
                while inputs.len() < rows * s {
                    inputs.push(0);
                }
            }
        }
        let loss_weight = match &self.source {
            Source::Completions { .. } => {
                let scored: f32 = weights.iter().sum();
                let step_scored = self.scored_in_step(step);
                if step_scored == 0 {
                    0.0
                } else {
                    scored as f64 * (self.grad_accum.max(1) * self.ranks.max(1)) as f64
                        / step_scored as f64
                }
            }
            _ => 1.0,
        };
        Batch {
            inputs,
            rows,
            seq: s,
            targets,
            weights,
            positions,
            keep,
            loss_weight,
        }
    }

    /// What the row at `position` of the run's stream holds: its examples (one, or a
    /// packed row's bin) in the order the row takes them.
    fn row_examples(&self, position: u64) -> std::borrow::Cow<'_, [usize]> {
        let Source::Completions { examples, bins, .. } = &self.source else {
            unreachable!("called for prompt-completion files only")
        };
        match bins {
            Some(bins) => bins[order::example(position, bins.len() as u64, self.seed)][..].into(),
            None => vec![order::example(position, examples.len() as u64, self.seed)].into(),
        }
    }

    /// Prompt-completion rows ([`SftRows::push`]). Padding needs no mask: causal attention
    /// never shows a real position the pads after it.
    fn completions(&self, step: u64, micro: u64) -> SftRows {
        let Source::Completions {
            examples,
            pad,
            bins,
            ..
        } = &self.source
        else {
            unreachable!("called for prompt-completion files only")
        };
        let mut out = SftRows::new(bins.is_some());
        for i in 0..self.rows() {
            let row = self.row_examples(self.position(step, micro, i));
            out.push(examples, &row, self.seq, *pad);
        }
        out
    }

    /// Scored positions of step `step` over its micro-batches and every rank's rows.
    fn scored_in_step(&self, step: u64) -> usize {
        let Source::Completions { examples, .. } = &self.source else {
            unreachable!("called for prompt-completion files only")
        };
        let per_rank = self.examples_per_rank() as u64;
        let per_step = self.grad_accum.max(1) * self.ranks.max(1) * per_rank;
        let first = step * per_step;
        (first..first + per_step)
            .map(|p| {
                let row = self.row_examples(p);
                row.iter()
                    .map(|&e| examples[e].scored(self.seq))
                    .sum::<usize>()
            })
            .sum()
    }

    fn pairs(&self, step: u64, micro: u64, inputs: &mut Vec<i64>) -> Vec<bool> {
        let Source::Pairs { examples, pad, .. } = &self.source else {
            unreachable!("called for pairs files only")
        };
        let (rows, s) = (self.rows(), self.seq);
        let mut keep = Vec::with_capacity(rows * s);
        let n = examples.len() as u64;
        for i in 0..self.examples_per_rank() {
            let e = order::example(self.position(step, micro, i), n, self.seed);
            for row in examples[e].iter().take(self.group) {
                let len = row.len().min(s);
                inputs.extend(row[..len].iter().map(|&t| t as i64));
                inputs.extend(std::iter::repeat_n(*pad as i64, s - len));
                keep.extend((0..s).map(|p| p < len));
            }
        }
        while inputs.len() < rows * s {
            inputs.push(*pad as i64);
            keep.push(true);
        }
        keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn batcher(loss: Loss) -> Batcher {
        Batcher {
            source: Source::Synthetic { vocab: 100 },
            seed: 7,
            loss,
            micro_batch: 2,
            seq: 16,
            vocab: 100,
            group: 2,
            positives: 0,
            grouped: false,
            rank: 0,
            ranks: 1,
            grad_accum: 1,
            mask_id: None,
        }
    }

    #[test]
    fn ranks_hold_consecutive_rows_of_the_global_batch() {
        let one = Batcher {
            micro_batch: 4,
            ..batcher(Loss::CausalLm)
        };
        let (a, b) = (
            Batcher {
                rank: 0,
                ..batcher(Loss::CausalLm)
            },
            Batcher {
                rank: 1,
                ..batcher(Loss::CausalLm)
            },
        );
        let whole = one.batch(2, 1);
        let (a, b) = (a.batch(2, 1), b.batch(2, 1));
        assert_eq!([a.inputs, b.inputs].concat(), whole.inputs);
        assert_eq!([a.targets, b.targets].concat(), whole.targets);
    }

    #[test]
    fn batches_are_a_function_of_step_and_micro() {
        let b = batcher(Loss::CausalLm);
        assert_eq!(b.batch(3, 1), b.batch(3, 1));
        assert_ne!(b.batch(3, 1), b.batch(4, 1));
        assert_ne!(b.batch(3, 0), b.batch(3, 1));
    }

    #[test]
    fn causal_targets_are_inputs_shifted() {
        let b = batcher(Loss::CausalLm).batch(0, 0);
        assert_eq!(b.inputs.len(), 32);
        assert_eq!(&b.inputs[1..16], &b.targets[..15]);
        assert!(b.inputs.iter().all(|&t| (0..100).contains(&t)));
    }

    #[test]
    fn masked_lm_masks_some_positions() {
        let b = batcher(Loss::MaskedLm).batch(0, 0);
        let masked = b.weights.iter().filter(|&&w| w > 0.0).count();
        assert!(masked > 0 && masked < 32);
        for i in 0..32 {
            if b.weights[i] > 0.0 {
                assert_eq!(b.inputs[i], 99);
            }
        }
    }

    fn temp(name: &str, text: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("rcoa-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn spec(loss: Loss, seq: usize, vocab: u64, batch_examples: usize) -> files::FileSpec {
        files::FileSpec {
            loss,
            seq,
            vocab,
            positives: 0,
            negatives: 0,
            batch_examples,
            assistant_only: false,
            packing: false,
        }
    }

    fn load(p: &Path, spec: &files::FileSpec) -> Result<Source, RunError> {
        Source::from_file(p, spec, &crate::tokenizer::TextTokenizer::Bytes)
    }

    #[test]
    fn small_vocab_file_uses_a_character_table() {
        let p = temp("t.txt", "abcabcabcabcabcabc");
        let s = load(&p, &spec(Loss::CausalLm, 4, 8, 1)).unwrap();
        match &s {
            Source::File { tokens, .. } => assert_eq!(&tokens[..4], &[0, 1, 2, 0]),
            _ => unreachable!(),
        }
        assert!(load(&p, &spec(Loss::CausalLm, 4, 2, 1)).is_err());
        assert!(load(&p, &spec(Loss::CausalLm, 99, 300, 1)).is_err());
    }

    /// The error of loading `text` as `name` for `loss`.
    fn bad(name: &str, text: &str, loss: Loss) -> String {
        let p = temp(name, text);
        match load(&p, &spec(loss, 4, 300, 2)) {
            Err(RunError::Data(m)) => m,
            other => panic!("{name}: expected a data error, got {other:?}"),
        }
    }

    #[test]
    fn a_line_that_is_not_json_is_named() {
        let m = bad(
            "nj.jsonl",
            "{\"text\": \"a\"}\n\n{\"text\": oops}\n",
            Loss::CausalLm,
        );
        assert!(m.contains("line 3 is not JSON"), "{m}");
    }

    #[test]
    fn a_missing_key_is_named_with_its_line() {
        let m = bad(
            "mk.jsonl",
            "{\"text\": \"abcdefgh\"}\n{\"txt\": \"a\"}\n",
            Loss::CausalLm,
        );
        assert!(m.contains("line 2 has no \"text\""), "{m}");
        let m = bad(
            "mq.jsonl",
            "{\"query\": \"a\", \"positive\": \"b\"}\n{\"text\": \"a\"}\n",
            Loss::Contrastive,
        );
        assert!(m.contains("line 2 has no \"query\""), "{m}");
        let m = bad("mp.jsonl", "{\"query\": \"a\"}\n", Loss::Contrastive);
        assert!(m.contains("line 1 has 0 positive(s)"), "{m}");
        let m = bad("ns.jsonl", "{\"text\": 3}\n", Loss::CausalLm);
        assert!(m.contains("line 1: \"text\" must be a string"), "{m}");
    }

    #[test]
    fn an_empty_file_is_refused() {
        let m = bad("empty.jsonl", "\n  \n", Loss::CausalLm);
        assert!(m.contains("has no examples"), "{m}");
    }

    #[test]
    fn too_few_examples_for_a_batch_are_refused() {
        // Two micro-batch examples needed: one pair is too few.
        let m = bad(
            "few.jsonl",
            "{\"query\": \"a\", \"positive\": \"b\"}\n",
            Loss::Contrastive,
        );
        assert!(m.contains("has 1 anchors") && m.contains("needs 2"), "{m}");
        // "abc\n" packs into 4 tokens: one window of 4 + 1 is too few.
        let m = bad("short.jsonl", "{\"text\": \"abc\"}\n", Loss::CausalLm);
        assert!(m.contains("packs into 0 sequences"), "{m}");
    }

    #[test]
    fn grouped_plans_need_enough_negatives_per_line() {
        let p = temp(
            "g.jsonl",
            "{\"query\": \"a\", \"positives\": [\"b\"], \"negatives\": [\"c\"]}\n",
        );
        let mut sp = spec(Loss::Contrastive, 4, 300, 1);
        sp.positives = 1;
        sp.negatives = 2;
        let m = load(&p, &sp).unwrap_err().to_string();
        assert!(
            m.contains("line 1 has 1 negative(s)") && m.contains("with 2"),
            "{m}"
        );
        sp.negatives = 1;
        match load(&p, &sp).unwrap() {
            Source::Pairs { examples, .. } => {
                assert_eq!(examples, vec![vec![vec![97], vec![98], vec![99]]])
            }
            other => panic!("{other:?}"),
        }
    }

    fn packed_batcher(loss: Loss, text: &str, micro_batch: usize) -> Batcher {
        let p = temp(&format!("packed-{micro_batch}-{loss:?}.jsonl"), text);
        let examples = if loss == Loss::Contrastive {
            micro_batch / 2
        } else {
            micro_batch
        };
        let source = load(&p, &spec(loss, 4, 300, examples)).unwrap();
        Batcher {
            source,
            micro_batch,
            seq: 4,
            vocab: 300,
            ..batcher(loss)
        }
    }

    #[test]
    fn documents_are_packed_with_a_separator_and_every_window_is_seen_once_per_epoch() {
        // Byte tokens: each document then "\n" (the byte tokens' EOS).
        let b = packed_batcher(
            Loss::CausalLm,
            "{\"text\": \"abcdefg\"}\n{\"text\": \"hijklmn\"}\n",
            1,
        );
        match &b.source {
            Source::Packed { tokens, docs, .. } => {
                assert_eq!(*docs, 2);
                assert_eq!(tokens.len(), 16);
                assert_eq!(tokens[7], b'\n' as u32);
            }
            other => panic!("{other:?}"),
        }
        // (16 - 1) / 4 = 3 windows of 5 tokens every 4: one epoch is 3 steps.
        let mut starts: Vec<i64> = (0..3).map(|step| b.batch(step, 0).inputs[0]).collect();
        starts.sort();
        assert_eq!(starts, vec![b'a' as i64, b'e' as i64, b'h' as i64]);
        let w = b.batch(0, 0);
        assert_eq!(&w.inputs[1..], &w.targets[..3]);
        assert!(w.keep.is_none());
    }

    #[test]
    fn pairs_are_right_padded_with_a_mask() {
        let text = "{\"query\": \"ab\", \"positive\": \"abcdef\"}\n{\"query\": \"xyz\", \"positive\": \"x\"}\n";
        let b = packed_batcher(Loss::Contrastive, text, 4);
        let batch = b.batch(0, 0);
        let keep = batch.keep.as_ref().expect("a mask");
        assert_eq!(batch.rows, 4);
        // Every row: its text truncated to seq 4, then padding (id 0) masked out.
        for r in 0..4 {
            let row = &batch.inputs[r * 4..(r + 1) * 4];
            let real = keep[r * 4..(r + 1) * 4].iter().filter(|&&k| k).count();
            assert!((1..=4).contains(&real));
            assert!(row[real..].iter().all(|&t| t == 0), "{row:?}");
            assert!(keep[r * 4..r * 4 + real].iter().all(|&k| k));
        }
        let queries: Vec<i64> = [0, 2].iter().map(|r| batch.inputs[r * 4]).collect();
        let mut q = queries.clone();
        q.sort();
        assert_eq!(q, vec![b'a' as i64, b'x' as i64], "both pairs, once each");
        assert_eq!(b.batch(1, 0), b.batch(1, 0));
    }

    #[test]
    fn ranks_of_a_packed_file_split_the_global_batch() {
        let text: String = (0..20)
            .map(|i| format!("{{\"text\": \"doc {i} text\"}}\n"))
            .collect();
        let one = packed_batcher(Loss::CausalLm, &text, 4);
        let half = |rank| Batcher {
            micro_batch: 2,
            rank,
            ranks: 2,
            ..one.clone()
        };
        let whole = one.batch(3, 0);
        assert_eq!(
            [half(0).batch(3, 0).inputs, half(1).batch(3, 0).inputs].concat(),
            whole.inputs
        );
    }

    #[test]
    fn grouped_batches_hold_each_anchor_with_its_own_positives_and_negatives() {
        let text: String = (0..3)
            .map(|i| {
                format!(
                    "{{\"query\": \"q{i}\", \"positives\": [\"p{i}\", \"x\"], \"negatives\": [\"n{i}\", \"m{i}\", \"y\"]}}\n"
                )
            })
            .collect();
        let p = temp("grouped.jsonl", &text);
        let mut sp = spec(Loss::Contrastive, 4, 300, 2);
        sp.positives = 1;
        sp.negatives = 2;
        let b = Batcher {
            source: load(&p, &sp).unwrap(),
            loss: Loss::Contrastive,
            micro_batch: 2,
            seq: 4,
            vocab: 300,
            group: 4,
            positives: 1,
            grouped: true,
            ..batcher(Loss::Contrastive)
        };
        let batch = b.batch(0, 0);
        assert_eq!(batch.rows, 8);
        let keep = batch.keep.as_ref().unwrap();
        let mut anchors = Vec::new();
        for g in 0..2 {
            let row = |j: usize| &batch.inputs[(g * 4 + j) * 4..(g * 4 + j) * 4 + 2];
            let digit = row(0)[1];
            assert_eq!(row(0)[0], b'q' as i64);
            for (j, c) in [(1, b'p'), (2, b'n'), (3, b'm')] {
                assert_eq!(row(j), &[c as i64, digit], "group {g} row {j}");
            }
            assert!(keep[g * 16..g * 16 + 16]
                .chunks(4)
                .all(|r| r == [true, true, false, false]));
            anchors.push(digit);
        }
        assert_ne!(anchors[0], anchors[1]);
    }

    fn completions_batcher(text: &str, seq: usize, micro_batch: usize, grad_accum: u64) -> Batcher {
        let p = temp(&format!("sft-{seq}-{micro_batch}-{grad_accum}.jsonl"), text);
        let source = load(&p, &spec(Loss::CausalLm, seq, 300, micro_batch)).unwrap();
        Batcher {
            source,
            micro_batch,
            seq,
            vocab: 300,
            grad_accum,
            ..batcher(Loss::CausalLm)
        }
    }

    /// TRL's prompt-completion rows: prompt and completion as one text, EOS (`\n` for
    /// bytes) appended, right-padded; the loss on the predictions of completion tokens.
    #[test]
    fn prompt_completion_rows_score_the_completion_only() {
        let b = completions_batcher("{\"prompt\": \"ab\", \"completion\": \"cd\"}\n", 8, 1, 1);
        match &b.source {
            Source::Completions { examples, pad, .. } => {
                assert_eq!(examples[0].ids, b"abcd\n".map(u32::from).to_vec());
                assert_eq!((examples[0].prompt, *pad), (2, 0));
                assert_eq!(examples[0].scored(8), 3);
            }
            other => panic!("{other:?}"),
        }
        let batch = b.batch(0, 0);
        let t = |s: &[u8]| s.iter().map(|&c| c as i64).collect::<Vec<_>>();
        assert_eq!(batch.inputs, [t(b"abcd\n"), vec![0; 3]].concat());
        assert_eq!(batch.targets, [t(b"bcd\n"), vec![0; 4]].concat());
        // Position 0 predicts the prompt's `b`; 1..=3 predict `c`, `d` and EOS.
        assert_eq!(batch.weights, vec![0., 1., 1., 1., 0., 0., 0., 0.]);
        assert!(batch.keep.is_none());
        assert_eq!(batch.loss_weight, 1.0);
        // Cut to 3 tokens (TRL's `max_length`): `abc` scores only `c`.
        let b = completions_batcher("{\"prompt\": \"ab\", \"completion\": \"cd\"}\n", 3, 1, 1);
        let batch = b.batch(0, 0);
        assert_eq!(batch.inputs, t(b"abc"));
        assert_eq!(batch.weights, vec![0., 1., 0.]);
    }

    /// Micro-batches that score different numbers of tokens weigh by them: the step's
    /// loss is the mean over every scored token of the step (transformers'
    /// `num_items_in_batch`), so it does not depend on how the step is split.
    #[test]
    fn prompt_completion_micro_batches_weigh_by_their_scored_tokens() {
        let text = "{\"prompt\": \"a\", \"completion\": \"bcdefg\"}\n\
                    {\"prompt\": \"hijk\", \"completion\": \"l\"}\n\
                    {\"prompt\": \"m\", \"completion\": \"nop\"}\n";
        let b = completions_batcher(text, 8, 1, 3);
        for step in 0..4 {
            let scored: Vec<f64> = (0..3)
                .map(|m| b.batch(step, m).weights.iter().sum::<f32>() as f64)
                .collect();
            let total: f64 = scored.iter().sum();
            // An epoch is the three examples, scoring 7, 2 and 4 tokens (completion + EOS).
            assert_eq!(total, 13.0, "step {step}");
            for (m, n) in scored.iter().enumerate() {
                let w = b.batch(step, m as u64).loss_weight;
                assert!(
                    (w - n * 3.0 / total).abs() < 1e-12,
                    "step {step} micro {m}: {w}"
                );
            }
        }
        // Two data-parallel ranks: each rank's weight counts its share of the step's
        // tokens (the ranks' mean gradient is then the step's token mean).
        let ranks: Vec<Batcher> = (0..2)
            .map(|rank| Batcher {
                rank,
                ranks: 2,
                grad_accum: 1,
                ..b.clone()
            })
            .collect();
        for step in 0..3 {
            let n: Vec<f64> = ranks
                .iter()
                .map(|r| r.batch(step, 0).weights.iter().sum::<f32>() as f64)
                .collect();
            for (r, b) in ranks.iter().enumerate() {
                let w = b.batch(step, 0).loss_weight;
                assert!(
                    (w - n[r] * 2.0 / (n[0] + n[1])).abs() < 1e-12,
                    "step {step} rank {r}"
                );
            }
        }
        // Every example once per epoch, in a seeded order.
        let mut firsts: Vec<i64> = (0..3).map(|m| b.batch(0, m).inputs[0]).collect();
        firsts.sort();
        assert_eq!(firsts, vec![b'a' as i64, b'h' as i64, b'm' as i64]);
    }

    #[test]
    fn prompt_completion_files_say_what_is_wrong() {
        let bad = |name: &str, text: &str, loss: Loss| {
            load(&temp(name, text), &spec(loss, 8, 300, 1))
                .unwrap_err()
                .to_string()
        };
        let m = bad(
            "no-completion.jsonl",
            "{\"prompt\": \"ab\"}\n",
            Loss::CausalLm,
        );
        assert!(
            m.contains("line 1 has no \"completion\"") && m.contains("supervised fine-tuning"),
            "{m}"
        );
        let m = bad(
            "mixed.jsonl",
            "{\"prompt\": \"ab\", \"completion\": \"c\"}\n{\"text\": \"x\"}\n",
            Loss::CausalLm,
        );
        assert!(m.contains("line 2 has no \"prompt\""), "{m}");
        let m = bad(
            "mlm.jsonl",
            "{\"prompt\": \"ab\", \"completion\": \"c\"}\n",
            Loss::MaskedLm,
        );
        assert!(m.contains("train a causal LM"), "{m}");
        let m = load(
            &temp("two.jsonl", "{\"prompt\": \"ab\", \"completion\": \"c\"}\n"),
            &spec(Loss::CausalLm, 8, 300, 2),
        )
        .unwrap_err()
        .to_string();
        assert!(
            m.contains("has 1 examples with a completion token within seq_len 8 (1 lines); one micro-batch over all ranks needs 2"),
            "{m}"
        );
        // A prompt that fills the sequence scores nothing: dropped, as TRL drops it.
        let m = bad(
            "long-prompt.jsonl",
            "{\"prompt\": \"abcdefgh\", \"completion\": \"c\"}\n",
            Loss::CausalLm,
        );
        assert!(
            m.contains("no example has a completion token within its first 8 tokens"),
            "{m}"
        );
    }
}
