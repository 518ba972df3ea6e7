//! Property test: data files as people write them wrong never make loading or batching
//! panic. Lines are drawn from valid and broken supervised fine-tuning examples,
//! documents, pairs and junk; a file either loads, and then every batch of its first
//! steps has the plan's shape with weights in {0, 1}, or is refused with a
//! `RunError::Data` that names the file.

use proptest::prelude::*;
use rcoa_backend::data::files::FileSpec;
use rcoa_backend::data::{packing, Batcher, Completion, SftRows, Source};
use rcoa_backend::tokenizer::TextTokenizer;
use rcoa_compiler::spec::Loss;

const LINES: &[&str] = &[
    r#"{"prompt": "ab", "completion": "cd"}"#,
    r#"{"prompt": "", "completion": ""}"#,
    r#"{"prompt": "a very long prompt that fills the sequence", "completion": "x"}"#,
    r#"{"prompt": "ab"}"#,
    r#"{"prompt": 3, "completion": "x"}"#,
    r#"{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}"#,
    r#"{"messages": [{"role": "user", "content": "hi"}]}"#,
    r#"{"messages": "hi"}"#,
    r#"{"messages": [{"content": "no role"}]}"#,
    r#"{"text": "a document"}"#,
    r#"{"text": ""}"#,
    r#"{"query": "q", "positive": "p"}"#,
    r#"{"completion": "only"}"#,
    r#"[1, 2]"#,
    r#"not json"#,
    "",
    r#"{"prompt": "ünïcødé ✓", "completion": "😀"}"#,
];

fn spec(
    loss: Loss,
    seq: usize,
    vocab: u64,
    examples: usize,
    assistant_only: bool,
    packing: bool,
) -> FileSpec {
    FileSpec {
        loss,
        seq,
        vocab,
        positives: 0,
        negatives: 0,
        batch_examples: examples,
        assistant_only,
        packing,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn data_files_load_or_say_what_is_wrong(
        lines in prop::collection::vec(0..LINES.len(), 1..6),
        seq in 2usize..12,
        micro in 1usize..3,
        accum in 1u64..3,
        loss in prop_oneof![Just(Loss::CausalLm), Just(Loss::MaskedLm), Just(Loss::Contrastive)],
        vocab in prop_oneof![Just(300u64), Just(40u64)],
        assistant_only in any::<bool>(),
        packing in any::<bool>(),
    ) {
        let dir = std::env::temp_dir().join(format!("rcoa-data-props-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("d.jsonl");
        let text: Vec<&str> = lines.iter().map(|&i| LINES[i]).collect();
        std::fs::write(&path, text.join("\n")).unwrap();
        // Contrastive in-batch pairs: two rows an example.
        let rows = if loss == Loss::Contrastive { 2 * micro } else { micro };
        match Source::from_file(&path, &spec(loss, seq, vocab, micro, assistant_only, packing), &TextTokenizer::Bytes) {
            Err(e) => {
                let m = e.to_string();
                prop_assert!(m.contains("d.jsonl"), "{m}");
            }
            Ok(source) => {
                let b = Batcher {
                    source,
                    seed: 1,
                    loss,
                    micro_batch: rows,
                    seq,
                    vocab,
                    group: 2,
                    positives: 0,
                    grouped: false,
                    rank: 0,
                    ranks: 1,
                    grad_accum: accum,
                    mask_id: None,
                };
                for step in 0..3 {
                    for m in 0..accum {
                        let batch = b.batch(step, m);
                        prop_assert_eq!(batch.inputs.len(), batch.rows * seq);
                        if let Some(p) = &batch.positions {
                            prop_assert_eq!(p.len(), batch.rows * seq);
                            prop_assert!(p.iter().all(|&p| p >= 0 && (p as usize) < seq));
                        }
                        prop_assert!(batch.weights.iter().all(|&w| w == 0.0 || w == 1.0));
                        prop_assert!(batch.loss_weight.is_finite() && batch.loss_weight >= 0.0);
                        prop_assert!(batch.inputs.iter().all(|&t| t >= 0 && (t as u64) < vocab.max(256)));
                    }
                }
            }
        }
    }

    /// A supervised example's row weights are 1 exactly where its target is scored:
    /// after the prompt and, with an assistant mask, the assistant's; `scored` counts them.
    #[test]
    fn completion_rows_weigh_what_scored_counts(
        len in 1usize..20,
        prompt in 0usize..22,
        mask in prop::option::of(prop::collection::vec(any::<bool>(), 20)),
        seq in 1usize..24,
    ) {
        let c = Completion {
            ids: (0..len as u32).collect(),
            prompt,
            assistant: mask.map(|m| m[..len].to_vec()),
        };
        let (mut inputs, mut targets, mut weights) = (Vec::new(), Vec::new(), Vec::new());
        c.row(seq, 99, &mut inputs, &mut targets, &mut weights);
        prop_assert_eq!(weights.len(), seq);
        prop_assert_eq!(weights.iter().filter(|&&w| w == 1.0).count(), c.scored(seq));
        for (p, &w) in weights.iter().enumerate() {
            let t = p + 1;
            let want = t < len.min(seq)
                && t >= prompt
                && c.assistant.as_ref().is_none_or(|a| a[t]);
            prop_assert_eq!(w == 1.0, want, "position {}", p);
        }
    }

    /// Packed rows hold every example of their bins once, in order, each scored where
    /// it is scored alone; positions count from 0 through each example, so the documents
    /// read back from them are the bin's examples (and the padding after them).
    #[test]
    fn packed_rows_hold_their_examples_as_they_score_alone(
        lens in prop::collection::vec((1usize..12, 0usize..6), 1..12),
        seq in 1usize..16,
    ) {
        let examples: Vec<Completion> = lens
            .iter()
            .enumerate()
            .map(|(i, &(len, prompt))| Completion {
                ids: (0..len as u32).map(|t| 100 * i as u32 + t).collect(),
                prompt,
                assistant: None,
            })
            .collect();
        let bins = packing::bins(&examples, seq);
        let mut out = SftRows::new(true);
        for b in &bins {
            packing::row(&examples, b, seq, 7, &mut out);
        }
        let (inputs, weights) = (out.inputs, out.weights);
        let positions = out.positions.expect("packed rows carry positions");
        prop_assert_eq!(inputs.len(), bins.len() * seq);
        prop_assert_eq!(positions.len(), inputs.len());
        let scored: usize = examples.iter().map(|e| e.scored(seq)).sum();
        prop_assert_eq!(weights.iter().filter(|&&w| w == 1.0).count(), scored);
        let docs = packing::documents(&positions, seq);
        for (r, b) in bins.iter().enumerate() {
            let row = &inputs[r * seq..(r + 1) * seq];
            let mut at = 0;
            for (d, &e) in b.iter().enumerate() {
                let len = examples[e].ids.len().min(seq);
                let want: Vec<i64> = examples[e].ids[..len].iter().map(|&t| t as i64).collect();
                prop_assert_eq!(&row[at..at + len], &want[..]);
                prop_assert!(docs[r * seq + at..r * seq + at + len].iter().all(|&x| x == d as i64));
                at += len;
            }
            prop_assert!(row[at..].iter().all(|&t| t == 7));
        }
    }
}
