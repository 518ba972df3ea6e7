//! Data files: plain text (a token stream), JSONL documents `{"text": …}`
//! (causal and masked LM, packed), JSONL supervised fine-tuning examples in TRL's
//! formats — `{"prompt": …, "completion": …}` text, `{"messages": [..]}` conversations
//! and conversational prompt-completion, rendered by the chat template (`crate::chat`)
//! — (causal LM, the loss on the completion), and JSONL pairs or groups
//! `{"query", "positive"}` / `{"query", "positives": [..], "negatives": [..]}`
//! (contrastive). A file is JSONL when its name ends in `.jsonl` or
//! `.ndjson`. Every problem is a `RunError::Data` that names the file and,
//! for JSONL, the line.

use super::Source;
use crate::tokenizer::{ByteTable, TextTokenizer};
use crate::RunError;
use rcoa_compiler::spec::Loss;
use std::path::Path;

/// What a plan needs of its data file.
#[derive(Clone, Debug)]
pub struct FileSpec {
    pub loss: Loss,
    pub seq: usize,
    pub vocab: u64,
    /// Contrastive: positives and negatives per anchor the plan trains with
    /// (0, 0: in-batch pairs, one positive each).
    pub positives: usize,
    pub negatives: usize,
    /// Examples one micro-batch takes over all data-parallel ranks: rows
    /// (language modelling) or anchors (contrastive).
    pub batch_examples: usize,
    /// `train.assistant_only_loss`: conversations scored on the assistant's tokens only.
    pub assistant_only: bool,
    /// `train.packing`: supervised examples and JSONL documents binned whole into rows
    /// (`super::packing`).
    pub packing: bool,
}

pub fn is_jsonl(path: &Path) -> bool {
    matches!(
        path.extension().and_then(|e| e.to_str()),
        Some("jsonl" | "ndjson")
    )
}

fn data_err(path: &Path, what: impl std::fmt::Display) -> RunError {
    RunError::Data(format!("`{}`: {what}", path.display()))
}

fn read_text(path: &Path) -> Result<String, RunError> {
    let bytes = std::fs::read(path)
        .map_err(|e| RunError::Data(format!("cannot read `{}`: {e}", path.display())))?;
    String::from_utf8(bytes).map_err(|e| {
        data_err(
            path,
            format!(
                "not UTF-8 text (byte {}): a data file holds text",
                e.utf8_error().valid_up_to()
            ),
        )
    })
}

/// The JSON objects of a JSONL file with their 1-based line numbers; blank
/// lines are skipped, an empty file is an error.
fn objects(path: &Path) -> Result<Vec<(usize, Obj)>, RunError> {
    let text = read_text(path)?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line).map_err(|e| {
            data_err(
                path,
                format!("line {n} is not JSON ({e}); a JSONL file holds one JSON object per line"),
            )
        })?;
        match v {
            serde_json::Value::Object(o) => out.push((n, o)),
            _ => {
                return Err(data_err(
                    path,
                    format!("line {n} is not a JSON object; each line must be one, such as {{\"text\": \"…\"}}"),
                ))
            }
        }
    }
    if out.is_empty() {
        return Err(data_err(path, "has no examples (the file is empty)"));
    }
    Ok(out)
}

type Obj = serde_json::Map<String, serde_json::Value>;

fn string(path: &Path, n: usize, o: &Obj, key: &str) -> Result<Option<String>, RunError> {
    match o.get(key) {
        None => Ok(None),
        Some(serde_json::Value::String(s)) => Ok(Some(s.clone())),
        Some(_) => Err(data_err(
            path,
            format!("line {n}: \"{key}\" must be a string"),
        )),
    }
}

fn strings(path: &Path, n: usize, o: &Obj, key: &str) -> Result<Option<Vec<String>>, RunError> {
    match o.get(key) {
        None => Ok(None),
        Some(serde_json::Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_str().map(str::to_string).ok_or_else(|| {
                    data_err(
                        path,
                        format!("line {n}: \"{key}\" must be a list of strings"),
                    )
                })
            })
            .collect::<Result<Vec<_>, _>>()
            .map(Some),
        Some(_) => Err(data_err(
            path,
            format!("line {n}: \"{key}\" must be a list of strings"),
        )),
    }
}

/// The documents of a `{"text": …}` JSONL file.
pub fn read_texts(path: &Path) -> Result<Vec<String>, RunError> {
    objects(path)?
        .into_iter()
        .map(|(n, o)| {
            string(path, n, &o, "text")?.ok_or_else(|| {
                data_err(
                    path,
                    format!(
                        "line {n} has no \"text\"; language-model data is JSONL with one {{\"text\": \"…\"}} per document{}",
                        if o.contains_key("query") { " (this line is a contrastive pair: the plan's loss is not contrastive)" } else { "" }
                    ),
                )
            })
        })
        .collect()
}

/// Does the file hold supervised fine-tuning examples (a `"prompt"` or `"messages"`)?
/// Its first object says: only the first non-blank line is read, so a file of documents
/// is not parsed twice. A line that is no JSON object answers no, and the reader of
/// documents reports it.
pub fn is_completions(path: &Path) -> Result<bool, RunError> {
    use std::io::BufRead;
    let file = std::fs::File::open(path)
        .map_err(|e| RunError::Data(format!("cannot read `{}`: {e}", path.display())))?;
    for line in std::io::BufReader::new(file).lines() {
        let Ok(line) = line else {
            return Ok(false);
        };
        if line.trim().is_empty() {
            continue;
        }
        let first: Option<Obj> = serde_json::from_str(&line).ok();
        return Ok(first.is_some_and(|o| o.contains_key("prompt") || o.contains_key("messages")));
    }
    Ok(false)
}

/// One supervised fine-tuning example, as TRL's dataset formats give it.
#[derive(Clone, Debug, PartialEq)]
pub enum SftExample {
    /// `{"prompt": "…", "completion": "…"}`.
    Text { prompt: String, completion: String },
    /// Messages rendered by the chat template: `{"prompt": [..], "completion": [..]}`
    /// (the loss on the completion's messages), or `{"messages": [..]}` (`prompt`
    /// empty: the loss on the whole conversation, as TRL's default).
    Chat {
        prompt: Vec<serde_json::Value>,
        completion: Vec<serde_json::Value>,
    },
}

/// A list of message objects (`{"role": …, "content": …}`).
fn messages(path: &Path, n: usize, o: &Obj, key: &str) -> Result<Vec<serde_json::Value>, RunError> {
    match o.get(key) {
        Some(serde_json::Value::Array(a)) if a.iter().all(|m| m.get("role").is_some()) => {
            Ok(a.clone())
        }
        _ => Err(data_err(
            path,
            format!(
                "line {n}: \"{key}\" must be a list of messages {{\"role\": …, \"content\": …}}"
            ),
        )),
    }
}

/// The examples of a supervised fine-tuning JSONL file, each in the format of the first.
pub fn read_completions(path: &Path) -> Result<Vec<SftExample>, RunError> {
    let all = objects(path)?;
    let first = &all[0].1;
    let conversations = first.contains_key("messages");
    let chat = conversations || first.get("prompt").is_some_and(|p| p.is_array());
    all.iter()
        .map(|(n, o)| {
            let n = *n;
            if conversations {
                return Ok(SftExample::Chat {
                    prompt: Vec::new(),
                    completion: messages(path, n, o, "messages")?,
                });
            }
            if chat {
                return Ok(SftExample::Chat {
                    prompt: messages(path, n, o, "prompt")?,
                    completion: messages(path, n, o, "completion")?,
                });
            }
            let get = |key: &str| {
                string(path, n, o, key)?.ok_or_else(|| {
                    data_err(
                        path,
                        format!(
                            "line {n} has no \"{key}\"; supervised fine-tuning data is JSONL with one \
                             {{\"prompt\": \"…\", \"completion\": \"…\"}} per example (the first line has a prompt)"
                        ),
                    )
                })
            };
            Ok(SftExample::Text {
                prompt: get("prompt")?,
                completion: get("completion")?,
            })
        })
        .collect()
}

/// Supervised fine-tuning examples tokenized as TRL's `SFTTrainer` (1.x) tokenizes them.
/// Text: the prompt and the completion as one text (so the tokens at the seam are
/// those of the whole), EOS appended unless the ids already end with it, with the
/// post-processor's special tokens. Messages: rendered by the tokenizer's chat template
/// (the prompt alone with the assistant's turn opened) and tokenized without special
/// tokens, as `apply_chat_template` does; no EOS added. Either way the completion
/// starts where the ids of the prompt alone and of the whole first differ. Byte tokens:
/// the bytes, `\n` as EOS. `assistant_only` (conversations only): each id also says
/// whether the template's `{% generation %}` blocks hold it, as TRL's
/// `assistant_only_loss` has transformers mark them.
pub fn encode_completions(
    path: &Path,
    examples: &[SftExample],
    tok: &TextTokenizer,
    vocab: u64,
    assistant_only: bool,
) -> Result<(Vec<super::Completion>, u32), RunError> {
    if assistant_only && !matches!(examples.first(), Some(SftExample::Chat { .. })) {
        return Err(assistant_only_needs_conversations(path));
    }
    if let Some(SftExample::Chat { .. }) = examples.first() {
        let TextTokenizer::Hf(t) = tok else {
            return Err(data_err(
                path,
                "holds conversations, which need the checkpoint's tokenizer and its chat template (no tokenizer.json here)",
            ));
        };
        let chat = t.chat().map_err(|e| data_err(path, e))?;
        if assistant_only && !chat.marks_assistant() {
            return Err(data_err(
                path,
                "`train.assistant_only_loss` scores the tokens the chat template marks as the assistant's, and this \
                 template has no `{% generation %}` … `{% endgeneration %}` block: add one around the assistant's \
                 turn in `chat_template.jinja` (TRL's training templates do), or remove `assistant_only_loss`",
            ));
        }
        let template = chat.renderer().map_err(|e| data_err(path, e))?;
        let encode = |text: &str| {
            t.encode_plain(text)
                .map_err(|e| data_err(path, format!("cannot tokenize: {e}")))
        };
        let out = examples
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let SftExample::Chat { prompt, completion } = e else {
                    unreachable!("one format per file")
                };
                let render = |m: &[serde_json::Value], open: bool| {
                    template
                        .render(&serde_json::Value::Array(m.to_vec()), open)
                        .map_err(|e| data_err(path, format!("example {}: {e}", i + 1)))
                };
                let whole: Vec<serde_json::Value> =
                    prompt.iter().chain(completion).cloned().collect();
                let (ids, assistant) = if assistant_only {
                    let (text, spans) = template
                        .render_marked(&serde_json::Value::Array(whole), false)
                        .map_err(|e| data_err(path, format!("example {}: {e}", i + 1)))?;
                    let (ids, marked) = t
                        .encode_assistant(&text, &spans)
                        .map_err(|e| data_err(path, format!("cannot tokenize: {e}")))?;
                    if !marked.contains(&true) {
                        return Err(data_err(
                            path,
                            format!(
                                "example {}: `train.assistant_only_loss`, but the chat template marked none of its \
                                 tokens as the assistant's (no `{{% generation %}}` block rendered)",
                                i + 1
                            ),
                        ));
                    }
                    (ids, Some(marked))
                } else {
                    (encode(&render(&whole, false)?)?, None)
                };
                let prompt = if prompt.is_empty() {
                    0
                } else {
                    common_prefix(&encode(&render(prompt, true)?)?, &ids)
                };
                Ok(super::Completion {
                    ids,
                    prompt,
                    assistant,
                })
            })
            .collect::<Result<Vec<_>, RunError>>()?;
        return Ok((out, t.pad));
    }
    let mut texts: Vec<String> = Vec::with_capacity(2 * examples.len());
    for e in examples {
        let SftExample::Text { prompt, completion } = e else {
            unreachable!("one format per file")
        };
        texts.push(prompt.clone());
        texts.push(format!("{prompt}{completion}"));
    }
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let enc = encode(path, &refs, tok, vocab)?;
    let out = enc
        .ids
        .chunks_exact(2)
        .map(|c| {
            let mut ids = c[1].clone();
            if let Some(eos) = enc.eos.filter(|e| ids.last() != Some(e)) {
                ids.push(eos);
            }
            // Merges across the seam make the prompt's ids no prefix of the whole's: the
            // completion starts where they part (TRL's `common_prefix_length`).
            super::Completion {
                prompt: common_prefix(&c[0], &ids),
                ids,
                assistant: None,
            }
        })
        .collect();
    Ok((out, enc.pad))
}

/// Whether some assistant turn's last scored token is a special token (an end-of-turn
/// token such as `</s>` or `<|im_end|>`): TRL warns when a template's `{% generation %}`
/// blocks stop before it, as then no step teaches the model to end its turn.
fn assistant_turns_end_on_a_special_token(
    examples: &[super::Completion],
    t: &crate::tokenizer::HfTokenizer,
) -> bool {
    let special = t.special_ids();
    examples.iter().any(|e| {
        let Some(a) = &e.assistant else { return false };
        (0..e.ids.len())
            .any(|i| a[i] && !a.get(i + 1).copied().unwrap_or(false) && special.contains(&e.ids[i]))
    })
}

/// `train.assistant_only_loss` with data that is not conversations.
pub fn assistant_only_needs_conversations(path: &Path) -> RunError {
    data_err(
        path,
        "`train.assistant_only_loss` scores the assistant's turns of conversations, and this file holds none: it \
         needs JSONL `{\"messages\": [..]}` or `{\"prompt\": [messages], \"completion\": [messages]}` (text \
         prompt-completion examples are already scored on the completion only), or remove `assistant_only_loss`",
    )
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// [`encode_completions`] without the examples whose first `seq` tokens hold no
/// completion token (a prompt as long as the sequence), which TRL drops too ("Dropping
/// fully masked examples"); an error when none is left.
pub fn scored_completions(
    path: &Path,
    pairs: &[SftExample],
    tok: &TextTokenizer,
    vocab: u64,
    seq: usize,
    assistant_only: bool,
) -> Result<(Vec<super::Completion>, u32), RunError> {
    let (mut examples, pad) = encode_completions(path, pairs, tok, vocab, assistant_only)?;
    examples.retain(|e| e.scored(seq) > 0);
    if examples.is_empty() {
        let what = if assistant_only {
            "an assistant token after its prompt"
        } else {
            "a completion token"
        };
        return Err(data_err(
            path,
            format!(
                "no example has {what} within its first {seq} tokens (seq_len): every prompt fills \
                 the sequence; raise seq_len or shorten the prompts"
            ),
        ));
    }
    Ok((examples, pad))
}

/// One anchor and its texts, as the file gives them.
#[derive(Clone, Debug, PartialEq)]
pub struct PairText {
    pub line: usize,
    pub query: String,
    pub positives: Vec<String>,
    pub negatives: Vec<String>,
}

/// The anchors of a pairs / groups JSONL file, each with at least
/// `positives` positives (`"positive"` or `"positives"`) and `negatives`
/// negatives (`"negative"` or `"negatives"`).
pub fn read_pairs(
    path: &Path,
    positives: usize,
    negatives: usize,
) -> Result<Vec<PairText>, RunError> {
    let mut out = Vec::new();
    for (n, o) in objects(path)? {
        let query = string(path, n, &o, "query")?.ok_or_else(|| {
            data_err(
                path,
                format!(
                    "line {n} has no \"query\"; contrastive data is JSONL pairs {{\"query\": \"…\", \"positive\": \"…\"}}{}",
                    if o.contains_key("text") { " (this line is a document: the plan's loss is contrastive)" } else { "" }
                ),
            )
        })?;
        let mut pos = strings(path, n, &o, "positives")?.unwrap_or_default();
        if let Some(p) = string(path, n, &o, "positive")? {
            pos.insert(0, p);
        }
        let mut neg = strings(path, n, &o, "negatives")?.unwrap_or_default();
        if let Some(p) = string(path, n, &o, "negative")? {
            neg.insert(0, p);
        }
        let need_pos = positives.max(1);
        if pos.len() < need_pos {
            return Err(data_err(
                path,
                format!(
                    "line {n} has {} positive(s) but the plan trains with {need_pos} per anchor: \
                     give \"positive\": \"…\" or \"positives\": [..]",
                    pos.len()
                ),
            ));
        }
        if neg.len() < negatives {
            return Err(data_err(
                path,
                format!(
                    "line {n} has {} negative(s) but the plan trains with {negatives} per anchor (train.negatives): \
                     give \"negatives\": [..]",
                    neg.len()
                ),
            ));
        }
        out.push(PairText {
            line: n,
            query,
            positives: pos,
            negatives: neg,
        });
    }
    Ok(out)
}

/// Texts to ids: through the tokenizer (post-processor applied), or as bytes
/// (a table of the bytes used for vocabularies under 256). Also returns the
/// token that ends a document in a packed stream (EOS; `\n` for bytes) and
/// the padding id.
pub struct Encoded {
    pub ids: Vec<Vec<u32>>,
    pub eos: Option<u32>,
    pub pad: u32,
}

pub fn encode(
    path: &Path,
    texts: &[&str],
    tok: &TextTokenizer,
    vocab: u64,
) -> Result<Encoded, RunError> {
    match tok {
        TextTokenizer::Hf(t) => {
            let ids = texts
                .iter()
                .map(|s| {
                    t.encode(s)
                        .map_err(|e| data_err(path, format!("cannot tokenize: {e}")))
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Encoded {
                ids,
                eos: t.eos,
                pad: t.pad,
            })
        }
        TextTokenizer::Bytes => {
            let table = ByteTable::build(
                texts.iter().map(|s| s.as_bytes()).chain([&b"\n"[..]]),
                vocab,
            )
            .map_err(|used| byte_table_err(path, used, vocab))?;
            Ok(Encoded {
                ids: texts.iter().map(|s| table.encode(s.as_bytes())).collect(),
                eos: table.encode(b"\n").first().copied(),
                pad: 0,
            })
        }
    }
}

fn byte_table_err(path: &Path, used: usize, vocab: u64) -> RunError {
    RunError::Data(format!(
        "`{}` uses {used} distinct bytes but the model's vocabulary has {vocab} ids; \
         use a model with vocab >= 256 (byte-level) or a file with fewer distinct characters",
        path.display()
    ))
}

/// Documents tokenized, each followed by `eos` (when there is one), concatenated.
pub fn pack(docs: Vec<Vec<u32>>, eos: Option<u32>) -> Vec<u32> {
    let mut out = Vec::with_capacity(docs.iter().map(|d| d.len() + 1).sum());
    for d in docs {
        out.extend(d);
        out.extend(eos);
    }
    out
}

/// The training source of `path` for a plan.
pub fn load(path: &Path, spec: &FileSpec, tok: &TextTokenizer) -> Result<Source, RunError> {
    let name = path.display().to_string();
    if spec.assistant_only && !(is_jsonl(path) && is_completions(path)?) {
        return Err(assistant_only_needs_conversations(path));
    }
    if !is_jsonl(path) {
        return plain_text(path, spec, tok);
    }
    if spec.loss == Loss::Contrastive {
        let pairs = read_pairs(path, spec.positives, spec.negatives)?;
        let group = if spec.positives + spec.negatives > 0 {
            1 + spec.positives + spec.negatives
        } else {
            2
        };
        let take_pos = spec.positives.max(1);
        let mut texts: Vec<&str> = Vec::with_capacity(pairs.len() * group);
        for p in &pairs {
            texts.push(&p.query);
            texts.extend(p.positives.iter().take(take_pos).map(String::as_str));
            texts.extend(p.negatives.iter().take(spec.negatives).map(String::as_str));
        }
        let enc = encode(path, &texts, tok, spec.vocab)?;
        if pairs.len() < spec.batch_examples {
            return Err(data_err(
                path,
                format!(
                    "has {} anchors (lines); one micro-batch over all ranks needs {}: add examples or lower micro_batch",
                    pairs.len(),
                    spec.batch_examples
                ),
            ));
        }
        let seq = spec.seq;
        let examples = enc
            .ids
            .chunks(group)
            .map(|rows| {
                rows.iter()
                    .map(|r| r[..r.len().min(seq)].to_vec())
                    .collect()
            })
            .collect();
        return Ok(Source::Pairs {
            examples,
            pad: enc.pad,
            name,
        });
    }
    if is_completions(path)? {
        if spec.loss != Loss::CausalLm {
            return Err(data_err(
                path,
                "holds prompt-completion examples, which train a causal LM (`train.loss = causal_lm`)",
            ));
        }
        let pairs = read_completions(path)?;
        let (examples, pad) =
            scored_completions(path, &pairs, tok, spec.vocab, spec.seq, spec.assistant_only)?;
        let bins = spec
            .packing
            .then(|| super::packing::bins(&examples, spec.seq));
        let rows = bins.as_ref().map_or(examples.len(), Vec::len);
        if rows < spec.batch_examples {
            let packed = match &bins {
                Some(b) => format!(", packed into {} sequences", b.len()),
                None => String::new(),
            };
            return Err(data_err(
                path,
                format!(
                    "has {} examples with a completion token within seq_len {} ({} lines{packed}); one \
                     micro-batch over all ranks needs {}{}: add examples or lower micro_batch",
                    examples.len(),
                    spec.seq,
                    pairs.len(),
                    spec.batch_examples,
                    if bins.is_some() { " sequences" } else { "" },
                ),
            ));
        }
        let mut kind = match pairs.first() {
            Some(SftExample::Chat { prompt, .. }) if prompt.is_empty() => "conversations",
            Some(SftExample::Chat { .. }) => "conversational prompt-completion examples",
            _ => "prompt-completion examples",
        }
        .to_string();
        if spec.assistant_only {
            kind += ", the assistant's tokens scored";
            if let TextTokenizer::Hf(t) = tok {
                if !assistant_turns_end_on_a_special_token(&examples, t) {
                    kind += " (no assistant turn ends on a special token: the chat template's \
                             `{% generation %}` blocks leave the end-of-turn token out of the loss, so the model \
                             may not learn to stop)";
                }
            }
        }
        return Ok(Source::Completions {
            examples,
            pad,
            name,
            kind,
            bins,
        });
    }
    let texts = read_texts(path)?;
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let enc = encode(path, &refs, tok, spec.vocab)?;
    if spec.packing && spec.loss == Loss::CausalLm {
        return packed_documents(path, enc, spec);
    }
    let docs = enc.ids.len();
    let tokens = pack(enc.ids, enc.eos);
    let source = Source::Packed { tokens, name, docs };
    let windows = source.windows(spec.loss, spec.seq);
    if windows < spec.batch_examples {
        let len = super::window_len(spec.loss, spec.seq);
        return Err(data_err(
            path,
            format!(
                "packs into {windows} sequences of {len} tokens ({} tokens from {docs} documents); one micro-batch \
                 over all ranks needs {}: add text or lower seq_len or micro_batch",
                source.token_count(),
                spec.batch_examples
            ),
        ));
    }
    Ok(source)
}

/// `train.packing` over JSONL documents: each document with its EOS is an example scored
/// on every token, cut to `seq_len` and binned whole (`super::packing`), instead of the
/// documents run together and cut into windows.
fn packed_documents(path: &Path, enc: Encoded, spec: &FileSpec) -> Result<Source, RunError> {
    let pad = enc.pad;
    let examples = documents_as_examples(enc, spec.seq);
    let bins = super::packing::bins(&examples, spec.seq);
    if bins.len() < spec.batch_examples {
        return Err(data_err(
            path,
            format!(
                "has {} documents of two tokens or more, packed into {} sequences of {} tokens; one \
                 micro-batch over all ranks needs {}: add documents or lower micro_batch",
                examples.len(),
                bins.len(),
                spec.seq,
                spec.batch_examples
            ),
        ));
    }
    Ok(Source::Completions {
        examples,
        pad,
        name: path.display().to_string(),
        kind: "documents".into(),
        bins: Some(bins),
    })
}

/// Documents, each with its EOS, as examples scored on every token (those of two tokens or
/// more within `seq`), for packing.
pub fn documents_as_examples(enc: Encoded, seq: usize) -> Vec<super::Completion> {
    enc.ids
        .into_iter()
        .map(|mut ids| {
            ids.extend(enc.eos);
            super::Completion {
                ids,
                prompt: 0,
                assistant: None,
            }
        })
        .filter(|e| e.scored(seq) > 0)
        .collect()
}

/// Plain text: the whole file is one document (bytes, or the tokenizer's
/// ids with EOS), trained on in windows at seeded random offsets.
fn plain_text(path: &Path, spec: &FileSpec, tok: &TextTokenizer) -> Result<Source, RunError> {
    let need = super::window_len(spec.loss, spec.seq);
    let tokens = match tok {
        TextTokenizer::Hf(_) => {
            let text = read_text(path)?;
            let enc = encode(path, &[&text], tok, spec.vocab)?;
            pack(enc.ids, enc.eos)
        }
        TextTokenizer::Bytes => {
            let bytes = std::fs::read(path)
                .map_err(|e| RunError::Data(format!("cannot read `{}`: {e}", path.display())))?;
            let table = ByteTable::build(std::iter::once(&bytes[..]), spec.vocab)
                .map_err(|used| byte_table_err(path, used, spec.vocab))?;
            table.encode(&bytes)
        }
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
