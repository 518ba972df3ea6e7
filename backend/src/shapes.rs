//! The batch shapes a run computes, and which of them are new to the kernel
//! cache.
//!
//! CubeCL compiles per shape: fused kernels and autotune keys carry the
//! tensors' dimensions, so the first pass of every distinct shape compiles
//! (minutes for a model on an empty cache) and later passes reuse it. A run
//! computes few shapes:
//! - training: every micro-batch is `[rows, seq_len]`, full (files are read
//!   in epochs and pairs are right-padded, `data::Batcher`), so there is no
//!   short last micro-batch; a pairs file adds a key-padding mask, which is
//!   other kernels;
//! - evaluation (`--eval`, forward only): batches of `micro_batch` windows
//!   and the short last one (causal LM), or `2 × micro_batch` padded rows
//!   (contrastive pairs; the short last batch is dropped), `eval`.
//!
//! Recomputation adds no shape: a recomputed layer runs the same shapes on
//! the backend without autodiff first, and those kernels are part of the
//! first step (`train`).

use crate::data::{Batcher, Source};
use crate::eval::EvalSet;
use std::path::Path;

/// Which pass computes a shape: a training step (forward, backward,
/// optimizer) or an evaluation (forward only, another loss).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Pass {
    Train,
    Eval,
}

/// One batch shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Shape {
    pub pass: Pass,
    pub rows: usize,
    pub seq: usize,
    /// With a key-padding mask (pairs files, contrastive evaluation).
    pub padded: bool,
}

impl std::fmt::Display for Shape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let what = match self.pass {
            Pass::Train => "micro-batch",
            Pass::Eval => "eval batch",
        };
        write!(f, "{what} {} × {}", self.rows, self.seq)?;
        if self.padded {
            write!(f, " padded")?;
        }
        Ok(())
    }
}

/// The training micro-batch's shape.
pub fn of_training(batcher: &Batcher) -> Shape {
    Shape {
        pass: Pass::Train,
        rows: batcher.rows(),
        seq: batcher.seq,
        padded: matches!(batcher.source, Source::Pairs { .. }),
    }
}

/// The shapes `eval::evaluate` computes for `set`, full batches first.
pub fn of_eval(set: &EvalSet) -> Vec<Shape> {
    let eval = |rows, seq, padded| Shape {
        pass: Pass::Eval,
        rows,
        seq,
        padded,
    };
    match set {
        EvalSet::Causal { windows, batch, .. } => {
            let (n, b) = (windows.len(), (*batch).max(1));
            let seq = windows.first().map_or(0, Vec::len);
            let mut out = Vec::new();
            if n >= b {
                out.push(eval(b, seq, false));
            }
            if n % b != 0 {
                out.push(eval(n % b, seq, false));
            }
            out
        }
        EvalSet::Completions {
            examples,
            batch,
            seq,
            ..
        } => {
            // Right-padded without a mask: causal attention hides the pads.
            let (n, b) = (examples.len(), (*batch).max(1));
            let mut out = Vec::new();
            if n >= b {
                out.push(eval(b, *seq, false));
            }
            if n % b != 0 {
                out.push(eval(n % b, *seq, false));
            }
            out
        }
        EvalSet::Contrastive {
            pairs, batch, seq, ..
        } => {
            let b = (*batch).max(1);
            if pairs.len() >= b {
                vec![eval(2 * b, *seq, true)]
            } else {
                Vec::new()
            }
        }
    }
}

/// The distinct shapes of a run, in the order they first run: the
/// evaluation before the first step, then training.
pub fn of_run(batcher: &Batcher, eval: Option<&EvalSet>) -> Vec<Shape> {
    let mut out = eval.map(of_eval).unwrap_or_default();
    out.push(of_training(batcher));
    out
}

/// The shapes of `run` not in `warmed`, each once, in `run`'s order.
pub fn new_shapes(run: &[Shape], warmed: &[Shape]) -> Vec<Shape> {
    let mut out: Vec<Shape> = Vec::new();
    for s in run {
        if !warmed.contains(s) && !out.contains(s) {
            out.push(*s);
        }
    }
    out
}

/// What `rcoa run` says before a pass whose shapes will compile.
#[derive(Clone, Debug, PartialEq)]
pub struct Notice {
    pub pass: Pass,
    pub shapes: Vec<Shape>,
    pub line: String,
}

/// The notices of a run on CUDA, in the order of its passes (the
/// evaluation, when there is one, runs before the first step): one per pass
/// with new shapes, none for a pass whose shapes the cache `dir` (with
/// `entries` entries) already holds.
pub fn notices(run: &[Shape], warmed: &[Shape], dir: &Path, entries: u64) -> Vec<Notice> {
    let new = new_shapes(run, warmed);
    [(Pass::Eval, "evaluation"), (Pass::Train, "step")]
        .into_iter()
        .filter_map(|(pass, name)| {
            let shapes: Vec<Shape> = new.iter().filter(|s| s.pass == pass).copied().collect();
            if shapes.is_empty() {
                return None;
            }
            let list: Vec<String> = shapes.iter().map(Shape::to_string).collect();
            Some(Notice {
                pass,
                line: format!(
                    "compiling kernels for the first {name} ({}); cache {} has {entries} entries; `rcoa warmup` compiles ahead",
                    list.join(", "),
                    dir.display()
                ),
                shapes,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use rcoa_compiler::spec::Loss;

    fn batcher(source: Source, loss: Loss, micro: usize) -> Batcher {
        Batcher {
            source,
            seed: 0,
            loss,
            micro_batch: micro,
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

    fn shape(pass: Pass, rows: usize, padded: bool) -> Shape {
        Shape {
            pass,
            rows,
            seq: 16,
            padded,
        }
    }

    fn causal(windows: usize, batch: usize) -> EvalSet {
        EvalSet::Causal {
            windows: vec![vec![0; 16]; windows],
            batch,
            chunked: false,
        }
    }

    #[test]
    fn a_run_computes_its_micro_batch_and_the_evaluations_batches() {
        let b = batcher(Source::Synthetic { vocab: 100 }, Loss::CausalLm, 8);
        assert_eq!(of_run(&b, None), vec![shape(Pass::Train, 8, false)]);
        // 19 windows in batches of 8: two full, one of 3.
        assert_eq!(
            of_run(&b, Some(&causal(19, 8))),
            vec![
                shape(Pass::Eval, 8, false),
                shape(Pass::Eval, 3, false),
                shape(Pass::Train, 8, false)
            ]
        );
        // No short batch when the windows divide; only a short one below a batch.
        assert_eq!(of_eval(&causal(16, 8)), vec![shape(Pass::Eval, 8, false)]);
        assert_eq!(of_eval(&causal(5, 8)), vec![shape(Pass::Eval, 5, false)]);
        // Contrastive evaluation: query and positive rows, padded; the short
        // last batch is dropped.
        let pairs = EvalSet::Contrastive {
            pairs: vec![(vec![1], vec![2]); 7],
            pad: 0,
            batch: 4,
            seq: 16,
        };
        assert_eq!(of_eval(&pairs), vec![shape(Pass::Eval, 8, true)]);
        // A pairs file's micro-batch carries a padding mask.
        let p = batcher(
            Source::Pairs {
                examples: vec![vec![vec![1], vec![2]]],
                pad: 0,
                name: "p".into(),
            },
            Loss::Contrastive,
            4,
        );
        assert_eq!(of_training(&p), shape(Pass::Train, 4, true));
        // Grouped contrastive: anchors × (1 + positives + negatives) rows.
        let mut g = batcher(Source::Synthetic { vocab: 100 }, Loss::Contrastive, 2);
        g.grouped = true;
        g.group = 3;
        assert_eq!(of_training(&g).rows, 6);
    }

    #[test]
    fn only_shapes_the_cache_lacks_are_announced_before_their_pass() {
        let dir = Path::new("/cache/h100");
        let run = vec![
            shape(Pass::Eval, 8, false),
            shape(Pass::Eval, 3, false),
            shape(Pass::Train, 8, false),
        ];
        // Empty cache: the evaluation (first) and the step each get a line.
        let n = notices(&run, &[], dir, 0);
        assert_eq!(n.len(), 2);
        assert_eq!(n[0].pass, Pass::Eval);
        assert_eq!(
            n[0].line,
            "compiling kernels for the first evaluation (eval batch 8 × 16, eval batch 3 × 16); \
             cache /cache/h100 has 0 entries; `rcoa warmup` compiles ahead"
        );
        assert_eq!(
            n[1].line,
            "compiling kernels for the first step (micro-batch 8 × 16); cache /cache/h100 has 0 entries; \
             `rcoa warmup` compiles ahead"
        );
        // The training shape warmed, the short eval batch not.
        let warmed = vec![shape(Pass::Train, 8, false), shape(Pass::Eval, 8, false)];
        let n = notices(&run, &warmed, dir, 120);
        assert_eq!(n.len(), 1);
        assert_eq!(n[0].shapes, vec![shape(Pass::Eval, 3, false)]);
        assert!(n[0].line.contains("has 120 entries"));
        // All warmed: nothing to say. A shape of another pass is not the same shape.
        assert!(notices(&run, &run, dir, 120).is_empty());
        assert_eq!(
            new_shapes(
                &[shape(Pass::Eval, 8, false)],
                &[shape(Pass::Train, 8, false)]
            )
            .len(),
            1
        );
        // Repeated shapes are announced once.
        let twice = vec![shape(Pass::Train, 8, false), shape(Pass::Train, 8, false)];
        assert_eq!(new_shapes(&twice, &[]).len(), 1);
    }
}
