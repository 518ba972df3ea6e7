//! Text to token ids: the Hugging Face `tokenizer.json` beside the model's
//! config (the `tokenizers` crate, pure Rust), or byte tokens for plans
//! without one.
//!
//! A Hugging Face tokenizer encodes as `tokenizer(text)` does in
//! `transformers`: the post-processor adds the special tokens (`<s>` for
//! Llama, `<s> … </s>` for XLM-R), and any padding or truncation stored in
//! `tokenizer.json` is off (`transformers` turns them off unless a call asks
//! for them). The special ids the data pipeline needs (end of sequence,
//! padding, mask) come from `tokenizer_config.json`, else from the model's
//! `config.json`.

use crate::RunError;
use std::path::{Path, PathBuf};

/// How a plan's text becomes token ids.
pub enum TextTokenizer {
    Hf(Box<HfTokenizer>),
    /// One token per byte (vocabularies of 256 or more), or per distinct
    /// byte of the data (`ByteTable`) for smaller ones.
    Bytes,
}

pub struct HfTokenizer {
    tok: tokenizers::Tokenizer,
    pub path: PathBuf,
    /// Appended after every document of a packed stream.
    pub eos: Option<u32>,
    /// Right-padding of unpacked sequences (masked out of attention and pooling).
    pub pad: u32,
    /// Masked LM's mask token.
    pub mask: Option<u32>,
    /// The chat template (`crate::chat`), or why it could not be read.
    chat: Result<Option<crate::chat::ChatTemplate>, String>,
}

impl TextTokenizer {
    /// The tokenizer in `dir` (`tokenizer.json`), if there is one; byte
    /// tokens otherwise. A tokenizer with more ids than the model's
    /// vocabulary (`vocab`) is refused.
    pub fn from_dir(dir: Option<&Path>, vocab: u64) -> Result<Self, RunError> {
        let Some(path) = dir
            .map(|d| d.join("tokenizer.json"))
            .filter(|p| p.is_file())
        else {
            return Ok(TextTokenizer::Bytes);
        };
        Ok(TextTokenizer::Hf(Box::new(HfTokenizer::load(
            &path, vocab,
        )?)))
    }

    pub fn describe(&self) -> String {
        match self {
            TextTokenizer::Hf(t) => format!("tokenizer {}", t.path.display()),
            TextTokenizer::Bytes => "byte tokens".into(),
        }
    }
}

/// `key` of a JSON config: a string token (`"</s>"`, or `{"content": "</s>"}`
/// as `AddedToken`s are saved).
fn token_name(v: &serde_json::Value) -> Option<&str> {
    v.as_str()
        .or_else(|| v.get("content").and_then(|c| c.as_str()))
}

/// An id from `config.json` (`eos_token_id` may be a list: the first).
fn config_id(v: &serde_json::Value) -> Option<u32> {
    v.as_u64()
        .or_else(|| {
            v.as_array()
                .and_then(|a| a.first())
                .and_then(|x| x.as_u64())
        })
        .and_then(|x| u32::try_from(x).ok())
}

fn read_json(path: &Path) -> serde_json::Value {
    std::fs::read_to_string(path)
        .ok()
        .and_then(|t| serde_json::from_str(&t).ok())
        .unwrap_or(serde_json::Value::Null)
}

impl HfTokenizer {
    pub fn load(path: &Path, vocab: u64) -> Result<Self, RunError> {
        let mut tok = tokenizers::Tokenizer::from_file(path).map_err(|e| {
            RunError::Data(format!(
                "cannot read the tokenizer `{}`: {e}; a `tokenizer.json` beside the config must be one \
                 `tokenizers` (Hugging Face) writes, or remove it to train on byte tokens",
                path.display()
            ))
        })?;
        tok.with_padding(None);
        tok.with_truncation(None)
            .map_err(|e| RunError::Data(format!("the tokenizer `{}`: {e}", path.display())))?;
        let size = tok.get_vocab_size(true) as u64;
        if size > vocab {
            return Err(RunError::Data(format!(
                "the tokenizer `{}` has {size} ids but the model's vocabulary has {vocab}: \
                 they must belong to the same model",
                path.display()
            )));
        }
        let dir = path.parent().unwrap_or(Path::new("."));
        let tcfg = read_json(&dir.join("tokenizer_config.json"));
        let cfg = read_json(&dir.join("config.json"));
        let special = |name: &str, id_key: &str| -> Option<u32> {
            tcfg.get(name)
                .and_then(token_name)
                .and_then(|t| tok.token_to_id(t))
                .or_else(|| cfg.get(id_key).and_then(config_id))
        };
        let eos = special("eos_token", "eos_token_id");
        let pad = special("pad_token", "pad_token_id")
            .or_else(|| tok.token_to_id("<pad>"))
            .unwrap_or(0);
        let mask = special("mask_token", "mask_token_id").or_else(|| tok.token_to_id("<mask>"));
        Ok(HfTokenizer {
            tok,
            path: path.to_path_buf(),
            eos,
            pad,
            mask,
            chat: crate::chat::ChatTemplate::load(dir, &tcfg),
        })
    }

    /// The ids of `text` without the post-processor's special tokens (a rendered chat
    /// template has its own, as `apply_chat_template` tokenizes it).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tok
            .encode(text, false)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// The ids of a rendered conversation (as [`Self::encode_plain`]) and, for each, whether
    /// it is the assistant's: in one of `spans` (byte ranges of `text`, the template's
    /// `{% generation %}` blocks) as transformers' `assistant_masks` counts it, from the
    /// token holding a span's first character to the one holding its last (to the end
    /// when that character is in no token), stopping at a span whose first character is
    /// in none.
    pub fn encode_assistant(
        &self,
        text: &str,
        spans: &[std::ops::Range<usize>],
    ) -> Result<(Vec<u32>, Vec<bool>), String> {
        // Byte offsets (`encode`, not `encode_char_offsets`): a character's first byte
        // finds the token transformers finds for the character.
        let enc = self.tok.encode(text, false).map_err(|e| e.to_string())?;
        let ids = enc.get_ids().to_vec();
        let mut assistant = vec![false; ids.len()];
        for span in spans {
            let Some((last, _)) = text[..span.end].char_indices().next_back() else {
                continue;
            };
            let Some(first) = enc.char_to_token(span.start, 0) else {
                break;
            };
            let end = match enc.char_to_token(last, 0) {
                Some(t) if t > 0 => t + 1,
                _ => ids.len(),
            };
            for a in assistant.iter_mut().take(end).skip(first) {
                *a = true;
            }
        }
        Ok((ids, assistant))
    }

    /// The ids of the tokenizer's special tokens (`</s>`, `<|im_end|>`) and its end of
    /// sequence.
    pub fn special_ids(&self) -> std::collections::HashSet<u32> {
        self.tok
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special)
            .map(|(id, _)| id)
            .chain(self.eos)
            .collect()
    }

    /// The chat template conversations are rendered with.
    pub fn chat(&self) -> Result<&crate::chat::ChatTemplate, String> {
        match &self.chat {
            Ok(Some(t)) => Ok(t),
            Ok(None) => Err(format!(
                "holds conversations, but the tokenizer `{}` has no chat template (`chat_template` in \
                 tokenizer_config.json, or chat_template.jinja)",
                self.path.display()
            )),
            Err(e) => Err(format!("the tokenizer's chat template: {e}")),
        }
    }

    /// The ids of `text` with the post-processor's special tokens.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.tok
            .encode(text, true)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }
}

/// Byte tokens for a model whose vocabulary holds fewer than 256 ids: the
/// distinct bytes the data uses, in byte order.
#[derive(Clone, Debug)]
pub struct ByteTable {
    index: Option<Box<[u32; 256]>>,
}

impl ByteTable {
    /// The table for `bytes` under a `vocab`-id model; `None` index (identity)
    /// when the vocabulary holds every byte. Errors say how many distinct
    /// bytes there were.
    pub fn build<'a>(chunks: impl Iterator<Item = &'a [u8]>, vocab: u64) -> Result<Self, usize> {
        if vocab >= 256 {
            return Ok(ByteTable { index: None });
        }
        let mut used = [false; 256];
        for c in chunks {
            for &b in c {
                used[b as usize] = true;
            }
        }
        let table: Vec<u8> = (0..=255u8).filter(|&b| used[b as usize]).collect();
        if table.len() as u64 > vocab {
            return Err(table.len());
        }
        let mut index = Box::new([0u32; 256]);
        for (i, &b) in table.iter().enumerate() {
            index[b as usize] = i as u32;
        }
        Ok(ByteTable { index: Some(index) })
    }

    pub fn encode(&self, bytes: &[u8]) -> Vec<u32> {
        match &self.index {
            None => bytes.iter().map(|&b| b as u32).collect(),
            Some(ix) => bytes.iter().map(|&b| ix[b as usize]).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture(name: &str) -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../tests/fixtures/hf/{name}"))
    }

    fn reference(name: &str) -> serde_json::Value {
        let p = fixture(name).join("reference.json");
        serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
    }

    /// The fixtures' eval texts, encoded as make_fixtures.py's `windows`
    /// does (`tok.encode(t).ids + [eos]`, concatenated, cut into windows of
    /// 16), must give the windows `transformers` scored.
    fn check_causal(name: &str) {
        // Off the memory probe's tests' threads (they count every allocation).
        let _serial = crate::tests::serial();
        let t = match TextTokenizer::from_dir(Some(&fixture(name)), 1 << 20).unwrap() {
            TextTokenizer::Hf(t) => t,
            TextTokenizer::Bytes => panic!("{name}: no tokenizer found"),
        };
        let eos = t.eos.expect("an end-of-sequence token");
        let texts = std::fs::read_to_string(fixture(name).join("eval.jsonl")).unwrap();
        let mut ids = Vec::new();
        for line in texts.lines() {
            let v: serde_json::Value = serde_json::from_str(line).unwrap();
            ids.extend(t.encode(v["text"].as_str().unwrap()).unwrap());
            ids.push(eos);
        }
        let r = reference(name);
        let want: Vec<Vec<u32>> = serde_json::from_value(r["windows"].clone()).unwrap();
        for (i, w) in want.iter().enumerate() {
            assert_eq!(
                &ids[i * 16..(i + 1) * 16],
                w.as_slice(),
                "{name} window {i}"
            );
        }
        assert_eq!(
            ids.len() / 16,
            r["eval"]["windows"].as_u64().unwrap() as usize
        );
    }

    #[test]
    fn llama_tokenizer_encodes_as_transformers() {
        check_causal("llama");
    }

    /// Supervised fine-tuning examples as TRL's `SFTTrainer` prepares them
    /// (`tools/hf_fixtures/sft_reference.py`): the same ids and the same scored labels,
    /// cut to the reference's length, the examples with no scored token within it
    /// dropped. Text prompt-completion; conversations through the fixture's
    /// `chat_template.jinja` (every token scored); conversational prompt-completion.
    #[test]
    fn supervised_examples_tokenize_as_trl() {
        let dir = fixture("llama");
        let tok = TextTokenizer::from_dir(Some(&dir), 1 << 20).unwrap();
        for name in ["sft", "sft_chat", "sft_chat_prompt"] {
            let path = dir.join(format!("{name}.jsonl"));
            let r: serde_json::Value = serde_json::from_str(
                &std::fs::read_to_string(dir.join(format!("{name}_reference.json"))).unwrap(),
            )
            .unwrap();
            let seq = r["seq_len"].as_u64().unwrap() as usize;
            let read = crate::data::files::read_completions(&path).unwrap();
            let (examples, _) =
                crate::data::files::scored_completions(&path, &read, &tok, 1 << 20, seq, false)
                    .unwrap();
            let ids: Vec<Vec<u32>> = serde_json::from_value(r["input_ids"].clone()).unwrap();
            let labels: Vec<Vec<i64>> = serde_json::from_value(r["labels"].clone()).unwrap();
            assert_eq!(examples.len(), ids.len(), "{name}");
            for ((e, want), labels) in examples.iter().zip(&ids).zip(&labels) {
                let got = &e.ids[..e.ids.len().min(seq)];
                assert_eq!(got, want.as_slice(), "{name}");
                let scored: Vec<bool> = (0..got.len()).map(|p| p >= e.prompt).collect();
                let want: Vec<bool> = labels.iter().map(|&l| l != -100).collect();
                assert_eq!(scored, want, "{name}");
            }
        }
    }

    /// `train.assistant_only_loss` as TRL's `assistant_only_loss` scores conversations
    /// (`tools/hf_fixtures/sft_assistant_reference.py`): the llama fixture's tokenizer
    /// with a template whose assistant turns are `{% generation %}` blocks; the same ids,
    /// transformers' `assistant_masks`, and TRL's labels (the prompt's tokens and every
    /// token outside the blocks unscored). `variant`: blocks that end on a character of two
    /// bytes, rendered and masked directly.
    #[test]
    fn assistant_only_examples_score_as_trl() {
        let dir = fixture("llama-marked");
        let tok = TextTokenizer::from_dir(Some(&dir), 1 << 20).unwrap();
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
                .unwrap();
        let want = |e: &serde_json::Value, key: &str| -> Vec<i64> {
            serde_json::from_value(e[key].clone()).unwrap()
        };
        for name in ["conversations", "prompts"] {
            let path = dir.join(format!("{name}.jsonl"));
            let read = crate::data::files::read_completions(&path).unwrap();
            let (examples, _) =
                crate::data::files::scored_completions(&path, &read, &tok, 1 << 20, 1 << 20, true)
                    .unwrap();
            let refs = r[name].as_array().unwrap();
            assert_eq!(examples.len(), refs.len(), "{name}");
            for (e, r) in examples.iter().zip(refs) {
                let ids: Vec<i64> = e.ids.iter().map(|&i| i as i64).collect();
                assert_eq!(ids, want(r, "input_ids"), "{name}");
                let mask: Vec<i64> = e
                    .assistant
                    .as_ref()
                    .unwrap()
                    .iter()
                    .map(|&a| a as i64)
                    .collect();
                assert_eq!(mask, want(r, "assistant_masks"), "{name}");
                let scored: Vec<bool> = (0..ids.len()).map(|t| e.scores(t)).collect();
                let labels: Vec<bool> = want(r, "labels").iter().map(|&l| l != -100).collect();
                assert_eq!(scored, labels, "{name}");
            }
            // Without the flag, the same file scores every token after the prompt: the
            // conversations' user turns too.
            let (whole, _) =
                crate::data::files::scored_completions(&path, &read, &tok, 1 << 20, 1 << 20, false)
                    .unwrap();
            for (w, a) in whole.iter().zip(&examples) {
                assert!(w.ids == a.ids && w.assistant.is_none(), "{name}");
                let (w, a) = (w.scored(1 << 20), a.scored(1 << 20));
                assert!(
                    if name == "conversations" {
                        w > a
                    } else {
                        w >= a
                    },
                    "{name}: {w} {a}"
                );
            }
        }
        let TextTokenizer::Hf(t) = &tok else {
            panic!("a tokenizer")
        };
        // The variant beside the fixture's tokenizer_config.json (its special tokens).
        let vdir = std::env::temp_dir().join(format!("rcoa-variant-{}", std::process::id()));
        std::fs::create_dir_all(&vdir).unwrap();
        std::fs::write(
            vdir.join("chat_template.jinja"),
            r["variant_template"].as_str().unwrap(),
        )
        .unwrap();
        let tcfg = read_json(&dir.join("tokenizer_config.json"));
        let variant = crate::chat::ChatTemplate::load(&vdir, &tcfg)
            .unwrap()
            .unwrap();
        // Its blocks leave `</s>` out: the data's description says the model may not learn
        // to stop (TRL's warning); the fixture's own template puts it in.
        for f in ["tokenizer.json", "tokenizer_config.json"] {
            std::fs::copy(dir.join(f), vdir.join(f)).unwrap();
        }
        let describe = |tokenizer_dir: &Path| {
            let tok = TextTokenizer::from_dir(Some(tokenizer_dir), 1 << 20).unwrap();
            let spec = crate::data::files::FileSpec {
                loss: rcoa_compiler::spec::Loss::CausalLm,
                seq: 1 << 10,
                vocab: 1 << 20,
                positives: 0,
                negatives: 0,
                batch_examples: 1,
                assistant_only: true,
                packing: false,
            };
            let path = dir.join("conversations.jsonl");
            crate::data::Source::from_file(&path, &spec, &tok)
                .unwrap()
                .describe()
        };
        let (own, left_out) = (describe(&dir), describe(&vdir));
        assert!(
            own.contains("3 conversations, the assistant's tokens scored"),
            "{own}"
        );
        assert!(!own.contains("may not learn to stop"), "{own}");
        assert!(left_out.contains("may not learn to stop"), "{left_out}");
        std::fs::remove_dir_all(&vdir).unwrap();
        let variant = variant.renderer().unwrap();
        let convs = std::fs::read_to_string(dir.join("conversations.jsonl")).unwrap();
        for (line, r) in convs.lines().zip(r["variant"].as_array().unwrap()) {
            let c: serde_json::Value = serde_json::from_str(line).unwrap();
            let (text, spans) = variant.render_marked(&c["messages"], false).unwrap();
            assert_eq!(text, r["text"].as_str().unwrap());
            let (ids, mask) = t.encode_assistant(&text, &spans).unwrap();
            let ids: Vec<i64> = ids.iter().map(|&i| i as i64).collect();
            let mask: Vec<i64> = mask.iter().map(|&a| a as i64).collect();
            assert_eq!(
                (ids, mask),
                (want(r, "input_ids"), want(r, "assistant_masks"))
            );
        }
    }

    #[test]
    fn mistral_tokenizer_encodes_as_transformers() {
        check_causal("mistral");
    }

    #[test]
    fn gpt2_tokenizer_encodes_as_transformers() {
        check_causal("gpt2");
    }

    #[test]
    fn xlmr_tokenizer_adds_its_specials_and_pads_with_pad() {
        let _serial = crate::tests::serial();
        let t = match TextTokenizer::from_dir(Some(&fixture("xlmr")), 1 << 20).unwrap() {
            TextTokenizer::Hf(t) => t,
            TextTokenizer::Bytes => panic!("no tokenizer found"),
        };
        let ids = t.encode("the cat sat.").unwrap();
        assert_eq!(ids.first(), Some(&0), "<s> first: {ids:?}");
        assert_eq!(ids.last(), Some(&2), "</s> last: {ids:?}");
        assert_eq!(t.pad, 1);
    }

    #[test]
    fn a_tokenizer_larger_than_the_model_is_refused() {
        let e = TextTokenizer::from_dir(Some(&fixture("llama")), 100)
            .err()
            .expect("refused");
        assert!(e.to_string().contains("vocabulary has 100"), "{e}");
    }

    #[test]
    fn no_tokenizer_means_bytes() {
        let dir = std::env::temp_dir();
        assert!(matches!(
            TextTokenizer::from_dir(Some(&dir.join("rcoa-no-such-dir")), 300).unwrap(),
            TextTokenizer::Bytes
        ));
    }
}
