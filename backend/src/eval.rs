//! Held-out evaluation (`rcoa eval`, `rcoa run --eval`): forward only, on a
//! backend without autodiff, under conventions pinned so the numbers compare
//! with other tools (`transformers`, sentence-transformers):
//!
//! - causal LM: every document tokenized as `tokenizer(text)` does
//!   (post-processor applied), EOS appended, all concatenated, cut into
//!   consecutive windows of `seq_len` (the remainder dropped); the loss is
//!   the mean next-token cross-entropy over all windows with labels = inputs,
//!   as `transformers` computes it with `labels=input_ids` (each window
//!   predicts its tokens 1.. from 0..);
//! - causal LM on prompt-completion examples (`{"prompt", "completion"}`, the
//!   training data of supervised fine-tuning): each example tokenized as
//!   training tokenizes it (TRL's `SFTTrainer`), cut to `seq_len` tokens (an
//!   example left with no completion token is dropped, as TRL drops it); the
//!   loss is the mean cross-entropy over every completion token of the set
//!   (labels -100 on the prompt), whatever the batch size;
//! - contrastive: consecutive batches of `micro_batch` pairs (the last
//!   partial batch dropped), texts tokenized with the post-processor,
//!   truncated to `seq_len`, right-padded; mean pooling over the attention
//!   mask, L2-normalised, scores q·pᵀ / 0.05, mean cross-entropy with the
//!   diagonal as targets, averaged over the batches.
//!
//! Plain text files are one document. Masked LM has no pinned convention
//! and is refused.

use crate::data::files;
use crate::loss::{contrastive_loss, lm_loss, ContrastiveLayout, TAU};
use crate::loss_chunked::{chunked_lm_loss, DEFAULT_CHUNK};
use crate::model::{Ctx, Model};
use crate::ops::ExecBackend;
use crate::tokenizer::TextTokenizer;
use crate::RunError;
use burn::tensor::{ElementConversion, Int, Tensor, TensorData};
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::Loss;
use std::path::Path;

/// A held-out set, tokenized.
#[derive(Clone, Debug)]
pub enum EvalSet {
    /// Windows of `seq_len` tokens.
    Causal {
        windows: Vec<Vec<u32>>,
        /// Windows per forward pass (the plan's micro-batch; the result does
        /// not depend on it).
        batch: usize,
        chunked: bool,
    },
    /// Prompt-completion examples (`data::Completion`), batched in file order: one per
    /// row, or (`train.packing`) packed, a bin per row (`data::packing`), which gives the
    /// same loss.
    Completions {
        examples: Vec<crate::data::Completion>,
        pad: u32,
        batch: usize,
        seq: usize,
        chunked: bool,
        bins: Option<Vec<Vec<usize>>>,
    },
    /// (query, positive) ids, truncated to `seq_len`.
    Contrastive {
        pairs: Vec<(Vec<u32>, Vec<u32>)>,
        pad: u32,
        /// Pairs per batch: the plan's micro-batch.
        batch: usize,
        /// Rows are right-padded to `seq_len` (the length the model's
        /// context is built for; padding is masked out, so the loss is that
        /// of padding to the longest row).
        seq: usize,
    },
}

/// One evaluation's result.
#[derive(Clone, Debug, serde::Serialize)]
pub struct EvalReport {
    /// Optimizer steps trained before it (0: the starting weights).
    pub step: u64,
    pub eval_loss: f64,
    /// Windows (causal), prompt-completion examples or pairs (contrastive) scored.
    pub examples: usize,
    /// What `examples` counts: `windows`, `examples` or `pairs`.
    pub unit: &'static str,
    pub batches: usize,
}

fn data_err(path: &Path, what: impl std::fmt::Display) -> RunError {
    RunError::Data(format!("`{}`: {what}", path.display()))
}

impl EvalSet {
    /// Read and tokenize `path` for `plan`.
    pub fn load(plan: &LoweredPlan, path: &Path, tok: &TextTokenizer) -> Result<Self, RunError> {
        let seq = plan.train.seq_len as usize;
        let micro = plan.resolved.micro_batch.max(1) as usize;
        let vocab = plan.model.vocab;
        match plan.train.loss {
            Loss::CausalLm if files::is_jsonl(path) && files::is_completions(path)? => {
                let pairs = files::read_completions(path)?;
                let (examples, pad) = files::scored_completions(
                    path,
                    &pairs,
                    tok,
                    vocab,
                    seq,
                    plan.train.assistant_only_loss,
                )?;
                Ok(EvalSet::completions(plan, examples, pad))
            }
            Loss::CausalLm if plan.train.assistant_only_loss => {
                Err(files::assistant_only_needs_conversations(path))
            }
            Loss::CausalLm => {
                let texts = if files::is_jsonl(path) {
                    files::read_texts(path)?
                } else {
                    vec![std::fs::read_to_string(path).map_err(|e| {
                        RunError::Data(format!("cannot read `{}` as text: {e}", path.display()))
                    })?]
                };
                let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
                let enc = files::encode(path, &refs, tok, vocab)?;
                if plan.train.packing && files::is_jsonl(path) {
                    // Packed documents, as training packs them (`files::packed_documents`).
                    let pad = enc.pad;
                    let docs = files::documents_as_examples(enc, seq);
                    if docs.is_empty() {
                        return Err(data_err(path, "has no document of two tokens or more"));
                    }
                    return Ok(EvalSet::completions(plan, docs, pad));
                }
                let stream = files::pack(enc.ids, enc.eos);
                let windows: Vec<Vec<u32>> = stream.chunks_exact(seq).map(<[u32]>::to_vec).collect();
                if windows.is_empty() || seq < 2 {
                    return Err(data_err(
                        path,
                        format!(
                            "has {} tokens: not one evaluation window of seq_len {seq} (each window predicts its tokens after the first)",
                            stream.len()
                        ),
                    ));
                }
                Ok(EvalSet::Causal {
                    windows,
                    batch: micro,
                    chunked: plan.train.chunked_loss_for(vocab),
                })
            }
            Loss::Contrastive => {
                if !files::is_jsonl(path) {
                    return Err(data_err(
                        path,
                        "contrastive evaluation reads JSONL pairs {\"query\": …, \"positive\": …} (a `.jsonl` file)",
                    ));
                }
                let pairs = files::read_pairs(path, 1, 0)?;
                let mut texts = Vec::with_capacity(2 * pairs.len());
                for p in &pairs {
                    texts.push(p.query.as_str());
                    texts.push(p.positives[0].as_str());
                }
                let enc = files::encode(path, &texts, tok, vocab)?;
                if pairs.len() < micro {
                    return Err(data_err(
                        path,
                        format!(
                            "has {} pairs; one evaluation batch is micro_batch = {micro} pairs (the last partial batch is dropped)",
                            pairs.len()
                        ),
                    ));
                }
                let cut = |v: &Vec<u32>| v[..v.len().min(seq)].to_vec();
                let pairs = enc.ids.chunks_exact(2).map(|c| (cut(&c[0]), cut(&c[1]))).collect();
                Ok(EvalSet::Contrastive {
                    pairs,
                    pad: enc.pad,
                    batch: micro,
                    seq,
                })
            }
            Loss::MaskedLm => Err(RunError::Unsupported(
                "evaluation of a masked LM: `rcoa eval` and `--eval` compute the causal LM and contrastive losses \
                 (their conventions are pinned in docs/data.md); masked LM has none yet"
                    .into(),
            )),
        }
    }

    /// Supervised examples (or documents) for `plan`: packed as it packs them.
    fn completions(plan: &LoweredPlan, examples: Vec<crate::data::Completion>, pad: u32) -> Self {
        let seq = plan.train.seq_len as usize;
        EvalSet::Completions {
            bins: plan
                .train
                .packing
                .then(|| crate::data::packing::bins(&examples, seq)),
            examples,
            pad,
            batch: plan.resolved.micro_batch.max(1) as usize,
            seq,
            chunked: plan.train.chunked_loss_for(plan.model.vocab),
        }
    }

    /// What [`EvalSet::examples`] counts.
    pub fn unit(&self) -> &'static str {
        match self {
            EvalSet::Causal { .. } => "windows",
            EvalSet::Completions { .. } => "examples",
            EvalSet::Contrastive { .. } => "pairs",
        }
    }

    pub fn examples(&self) -> usize {
        match self {
            EvalSet::Causal { windows, .. } => windows.len(),
            EvalSet::Completions { examples, .. } => examples.len(),
            EvalSet::Contrastive { pairs, batch, .. } => pairs.len() / batch * batch,
        }
    }
}

/// The held-out loss of `model` on `set`. `ctx` is the model's context for
/// `seq_len` (its `train` flag is turned off here: no dropout).
pub fn evaluate<B: ExecBackend>(
    model: &Model<B>,
    ctx: &Ctx<B>,
    set: &EvalSet,
    device: &B::Device,
) -> Result<(f64, usize), RunError> {
    let mut ctx = ctx.clone();
    ctx.train = false;
    let ints = |v: Vec<i64>, rows: usize, s: usize| {
        Tensor::<B, 2, Int>::from_data(
            TensorData::new(v, [rows, s]).convert::<B::IntElem>(),
            device,
        )
    };
    match set {
        EvalSet::Causal {
            windows,
            batch,
            chunked,
        } => {
            let mut total = 0.0f64;
            let mut batches = 0;
            for chunk in windows.chunks((*batch).max(1)) {
                let (rows, s) = (chunk.len(), chunk[0].len());
                let inputs: Vec<i64> = chunk.iter().flatten().map(|&t| t as i64).collect();
                // Position p predicts token p + 1; the last position of a
                // window predicts nothing (weight 0), as `labels=input_ids`.
                let mut targets = Vec::with_capacity(rows * s);
                let mut weights = Vec::with_capacity(rows * s);
                for w in chunk {
                    targets.extend(w[1..].iter().map(|&t| t as i64));
                    targets.push(0);
                    weights.extend(std::iter::repeat_n(1.0f32, s - 1));
                    weights.push(0.0);
                }
                let mean = weighted_mean(
                    model,
                    &ctx,
                    inputs,
                    targets,
                    weights,
                    [rows, s],
                    *chunked,
                    device,
                )?;
                // Every window scores s - 1 positions: the batch mean times its
                // windows sums window means.
                total += mean * rows as f64;
                batches += 1;
            }
            Ok((total / windows.len() as f64, batches))
        }
        EvalSet::Completions {
            examples,
            pad,
            batch,
            seq,
            chunked,
            bins,
        } => {
            let s = *seq;
            // Each row's examples: a bin when packed, else one example.
            let singles: Vec<usize>;
            let rows: Vec<&[usize]> = match bins {
                Some(b) => b.iter().map(Vec::as_slice).collect(),
                None => {
                    singles = (0..examples.len()).collect();
                    singles.chunks(1).collect()
                }
            };
            let (mut total, mut scored) = (0.0f64, 0usize);
            let mut batches = 0;
            for chunk in rows.chunks((*batch).max(1)) {
                let n_rows = chunk.len();
                let mut out = crate::data::SftRows::new(bins.is_some());
                for row in chunk {
                    out.push(examples, row, s, *pad);
                }
                let n = chunk
                    .iter()
                    .flat_map(|r| r.iter())
                    .map(|&e| examples[e].scored(s))
                    .sum::<usize>();
                if n == 0 {
                    continue;
                }
                let packed = out
                    .positions
                    .as_ref()
                    .map(|p| ctx.with_documents(p, n_rows, s, device));
                let mean = weighted_mean(
                    model,
                    packed.as_ref().unwrap_or(&ctx),
                    out.inputs,
                    out.targets,
                    out.weights,
                    [n_rows, s],
                    *chunked,
                    device,
                )?;
                total += mean * n as f64;
                scored += n;
                batches += 1;
            }
            Ok((total / scored.max(1) as f64, batches))
        }
        EvalSet::Contrastive {
            pairs,
            pad,
            batch,
            seq,
        } => {
            let s = *seq;
            let layout = ContrastiveLayout {
                group: 2,
                positives: 1,
                grouped: false,
            };
            let mut total = 0.0f64;
            let mut batches = 0;
            for chunk in pairs.chunks_exact((*batch).max(1)) {
                let rows = 2 * chunk.len();
                let mut inputs = Vec::with_capacity(rows * s);
                let mut keep = Vec::with_capacity(rows * s);
                // Rows 2i and 2i + 1: query i and its positive (the layout
                // the in-batch contrastive loss reads).
                for (q, p) in chunk {
                    for row in [q, p] {
                        inputs.extend(row.iter().map(|&t| t as i64));
                        inputs.extend(std::iter::repeat_n(*pad as i64, s - row.len()));
                        keep.extend((0..s).map(|i| i < row.len()));
                    }
                }
                let c = ctx.with_padding(&keep, rows, s, device);
                let h = model.hidden(ints(inputs, rows, s), &c);
                let mask: Vec<f32> = keep.iter().map(|&k| if k { 1.0 } else { 0.0 }).collect();
                let mask = Tensor::<B, 2>::from_data(TensorData::new(mask, [rows, s]), device);
                let l = contrastive_loss(h, layout, Some(mask), TAU);
                total += l.into_scalar().elem::<f64>();
                batches += 1;
            }
            Ok((total / batches.max(1) as f64, batches))
        }
    }
}

/// The mean cross-entropy of `model` over the positions `weights` marks (`[rows, s]`).
#[allow(clippy::too_many_arguments)]
fn weighted_mean<B: ExecBackend>(
    model: &Model<B>,
    ctx: &Ctx<B>,
    inputs: Vec<i64>,
    targets: Vec<i64>,
    weights: Vec<f32>,
    [rows, s]: [usize; 2],
    chunked: bool,
    device: &B::Device,
) -> Result<f64, RunError> {
    let ints = |v: Vec<i64>| {
        Tensor::<B, 2, Int>::from_data(
            TensorData::new(v, [rows, s]).convert::<B::IntElem>(),
            device,
        )
    };
    let h = model.hidden(ints(inputs), ctx);
    let targets = ints(targets);
    let weights = Tensor::<B, 2>::from_data(TensorData::new(weights, [rows, s]), device);
    let mean = if chunked {
        chunked_lm_loss(
            h,
            model.head.weight(&model.embed, ctx),
            targets,
            Some(weights),
            DEFAULT_CHUNK,
        )
        .map_err(|e| RunError::Backend(e.to_string()))?
    } else {
        lm_loss(
            model.head.logits(h, &model.embed, ctx),
            targets,
            Some(weights),
        )
    };
    Ok(mean.into_scalar().elem::<f64>())
}

/// Evaluate `trainer`'s current weights on `set`.
pub(crate) fn report<B: crate::ops::ExecAutodiff>(
    trainer: &crate::train::Trainer<B>,
    set: &EvalSet,
) -> Result<EvalReport, RunError> {
    let (loss, batches) = trainer.evaluate(set)?;
    Ok(EvalReport {
        step: trainer.step,
        eval_loss: loss,
        examples: set.examples(),
        unit: set.unit(),
        batches,
    })
}

/// What `rcoa eval` evaluates besides the plan.
#[derive(Clone, Debug, Default)]
pub struct EvalOptions {
    pub data: std::path::PathBuf,
    /// The folder of `tokenizer.json` (`crate::RunOptions::tokenizer`).
    pub tokenizer: Option<std::path::PathBuf>,
    /// A checkpoint written by `rcoa run --save` whose weights to evaluate;
    /// `None`: the plan's starting weights (its Hugging Face checkpoint, or
    /// the random initialisation of `seed`).
    pub checkpoint: Option<std::path::PathBuf>,
    pub seed: u64,
}

/// `rcoa eval`: the held-out loss of the plan's model on the CPU. The model
/// is built as `rcoa run` builds it (same weights, adapter, initialisation),
/// in fp32, and run forward only. Evaluation is one process whatever the
/// plan's data parallelism.
pub fn evaluate_plan_cpu(plan: &LoweredPlan, opts: &EvalOptions) -> Result<EvalReport, RunError> {
    type Cpu = burn::backend::Autodiff<burn::backend::NdArray<f32>>;
    let mut plan = plan.clone();
    plan.resolved.data = 1;
    plan.resolved.zero = 0;
    plan.resolved.offload.clear();
    let run = crate::RunOptions {
        steps: 0,
        seed: opts.seed,
        data: None,
        tokenizer: opts.tokenizer.clone(),
        eval: Some(opts.data.clone()),
        ..Default::default()
    };
    let tok = crate::tokenizer(&plan, &run)?;
    let set = EvalSet::load(&plan, &opts.data, &tok)?;
    let device = Default::default();
    let mut trainer = {
        let _init = crate::INIT.lock().unwrap_or_else(|e| e.into_inner());
        crate::train::Trainer::<Cpu>::new(
            &plan,
            crate::train::TrainerConfig {
                seed: opts.seed,
                batcher: crate::batcher(&plan, &run)?,
                sixteen_bit: false,
                collective: None,
            },
            device,
        )?
    };
    if let Some(dir) = &opts.checkpoint {
        trainer.resume(dir)?;
    }
    report(&trainer, &set)
}
