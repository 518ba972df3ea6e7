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
    /// The file's tokens.
    File {
        tokens: Vec<u32>,
        name: String,
    },
}

impl Source {
    /// Read and tokenize a text file for a model with `vocab` token ids.
    pub fn from_file(path: &Path, vocab: u64, need: usize) -> Result<Self, RunError> {
        let bytes = std::fs::read(path)
            .map_err(|e| RunError::Data(format!("cannot read `{}`: {e}", path.display())))?;
        let tokens: Vec<u32> = if vocab >= 256 {
            bytes.iter().map(|&b| b as u32).collect()
        } else {
            let mut used = [false; 256];
            for &b in &bytes {
                used[b as usize] = true;
            }
            let table: Vec<u8> = (0..=255u8).filter(|&b| used[b as usize]).collect();
            if table.len() as u64 > vocab {
                return Err(RunError::Data(format!(
                    "`{}` uses {} distinct bytes but the model's vocabulary has {vocab} ids; \
                     use a model with vocab >= 256 (byte-level) or a file with fewer distinct characters",
                    path.display(),
                    table.len()
                )));
            }
            let mut index = [0u32; 256];
            for (i, &b) in table.iter().enumerate() {
                index[b as usize] = i as u32;
            }
            bytes.iter().map(|&b| index[b as usize]).collect()
        };
        if tokens.len() < need {
            return Err(RunError::Data(format!(
                "`{}` has {} tokens; one training sequence needs {need}",
                path.display(),
                tokens.len()
            )));
        }
        Ok(Source::File {
            tokens,
            name: path.display().to_string(),
        })
    }

    pub fn describe(&self) -> String {
        match self {
            Source::Synthetic { .. } => "synthetic tokens".to_string(),
            Source::File { tokens, name } => format!("{name} ({} tokens)", tokens.len()),
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
            Source::File { tokens, .. } => {
                let start = rng.below((tokens.len() - len + 1) as u64) as usize;
                tokens[start..start + len].to_vec()
            }
        }
    }

    /// View `view` of contrastive "document" `doc`: views of one document
    /// share its motif (synthetic, with 60% of tokens replaced independently
    /// and the motif's phase shifted) or overlap by half (a file window and
    /// the window half a sequence later). Different documents draw from the
    /// same small alphabet, so in-batch negatives look alike at first and
    /// the model has to learn to tell them apart.
    fn view(&self, doc: u64, view: u64, len: usize) -> Vec<u32> {
        match self {
            Source::Synthetic { vocab } => {
                // A small shared alphabet and 60% noise keep documents alike,
                // so the loss starts high instead of at zero.
                let alphabet = (*vocab).clamp(2, 32);
                let draw = |rng: &mut Rng| rng.below(alphabet) as u32;
                let mut motif_rng = Rng::new(doc);
                let motif: Vec<u32> = (0..8).map(|_| draw(&mut motif_rng)).collect();
                let mut noise = Rng::keyed(doc, view, 7, 7);
                let phase = noise.below(8) as usize;
                (0..len)
                    .map(|i| {
                        if noise.unit() < 0.6 {
                            draw(&mut noise)
                        } else {
                            motif[(i + phase) % motif.len()]
                        }
                    })
                    .collect()
            }
            Source::File { tokens, .. } => {
                let span = (len + len / 2).min(tokens.len());
                let start = Rng::new(doc).below((tokens.len() - span + 1) as u64) as usize;
                let offset = if view == 0 { 0 } else { span - len };
                tokens[start + offset..start + offset + len].to_vec()
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

    pub fn batch(&self, step: u64, micro: u64) -> Batch {
        let (rows, s) = (self.rows(), self.seq);
        let mut inputs = Vec::with_capacity(rows * s);
        let mut targets = Vec::new();
        let mut weights = Vec::new();
        let base = self.rank * rows as u64;
        match self.loss {
            Loss::CausalLm => {
                for r in 0..rows {
                    let mut rng = Rng::keyed(self.seed, step, micro, base + r as u64);
                    let seq = self.source.sequence(&mut rng, s + 1);
                    inputs.extend(seq[..s].iter().map(|&t| t as i64));
                    targets.extend(seq[1..].iter().map(|&t| t as i64));
                }
            }
            Loss::MaskedLm => {
                // The last id is the mask token.
                let mask_id = self.vocab.saturating_sub(1) as i64;
                for r in 0..rows {
                    let mut rng = Rng::keyed(self.seed, step, micro, base + r as u64);
                    let seq = self.source.sequence(&mut rng, s);
                    for &t in &seq {
                        let masked = rng.unit() < MLM_RATE;
                        inputs.push(if masked { mask_id } else { t as i64 });
                        targets.push(t as i64);
                        weights.push(if masked { 1.0 } else { 0.0 });
                    }
                }
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
                            let other = Rng::keyed(
                                self.seed ^ 0x5EED,
                                step,
                                micro,
                                (base as usize + g) as u64 * self.group as u64 + j as u64,
                            )
                            .next_u64();
                            self.source.view(other, 0, s)
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
        Batch {
            inputs,
            rows,
            seq: s,
            targets,
            weights,
        }
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

    #[test]
    fn small_vocab_file_uses_a_character_table() {
        let dir = std::env::temp_dir().join(format!("rcoa-data-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("t.txt");
        std::fs::write(&p, "abcabcabcabcabcabc").unwrap();
        let s = Source::from_file(&p, 8, 5).unwrap();
        match &s {
            Source::File { tokens, .. } => assert_eq!(&tokens[..4], &[0, 1, 2, 0]),
            _ => unreachable!(),
        }
        assert!(Source::from_file(&p, 2, 5).is_err());
        assert!(Source::from_file(&p, 300, 100).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
