//! Training on right-padded contrastive pairs (a pairs JSONL file): the
//! padding is invisible (other pad ids give the same loss and gradients),
//! and the segmented step (layers recomputed from their inputs on the inner
//! backend) gives the gradients of one graph over the whole model, mask
//! included.

use burn::optim::GradientsParams;
use burn::tensor::ElementConversion;
use rcoa_backend::data::Batch;
use rcoa_backend::memory::RssProbe;
use rcoa_backend::train::Trainer;
use rcoa_backend::RunOptions;
use rcoa_compiler::spec::Loss;

type Cpu = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

fn trainer() -> (Trainer<Cpu>, std::path::PathBuf) {
    let dir = std::env::temp_dir().join(format!("rcoa-pairs-grads-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let data = dir.join("pairs.jsonl");
    // Byte tokens under the tiny plan's 64 ids: a table of the bytes used.
    std::fs::write(
        &data,
        "{\"query\": \"ab\", \"positive\": \"abcabcabcabcabcabc\"}\n\
         {\"query\": \"cab\", \"positive\": \"cb\"}\n\
         {\"query\": \"bbb\", \"positive\": \"b\"}\n",
    )
    .unwrap();
    let mut plan = rcoa_backend::testing::tiny_encoder_plan(Loss::Contrastive);
    plan.resolved.micro_batch = 4;
    let opts = RunOptions {
        steps: 1,
        seed: 5,
        data: Some(data),
        ..Default::default()
    };
    let t = rcoa_backend::testing::trainer::<Cpu>(&plan, &opts, 5).unwrap();
    (t, dir)
}

fn grads(t: &Trainer<Cpu>, batch: &Batch) -> (f64, Vec<Vec<f32>>) {
    let mut acc = GradientsParams::new();
    let mut probe = RssProbe::new();
    let loss = t
        .micro_step(batch, 0, 0, 1.0, &mut acc, &mut probe)
        .into_scalar()
        .elem::<f64>();
    (loss, t.flatten(&acc))
}

fn max_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b
        .iter()
        .flatten()
        .fold(0f32, |m, v| m.max(v.abs()))
        .max(1e-6);
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .fold(0f32, |m, (x, y)| m.max((x - y).abs() / scale))
}

#[test]
fn padded_pairs_train_as_if_the_padding_were_absent() {
    let (mut t, dir) = trainer();
    t.set_train_mode(false);
    let batch = t.batcher.batch(0, 0);
    let keep = batch.keep.clone().expect("pairs are padded");
    assert!(keep.iter().any(|k| !k), "some row is shorter than seq_len");
    let (loss, g) = grads(&t, &batch);
    assert!(loss.is_finite() && loss > 0.0);

    // Other ids under the padding: nothing changes.
    let mut other = batch.clone();
    for (i, k) in keep.iter().enumerate() {
        if !k {
            other.inputs[i] = (i % 7) as i64;
        }
    }
    let (loss2, g2) = grads(&t, &other);
    assert!((loss - loss2).abs() < 1e-6, "{loss} vs {loss2}");
    assert!(max_diff(&g2, &g) < 1e-5);

    // Without the mask the pads would count: the mask is what hides them.
    let mut unmasked = other.clone();
    unmasked.keep = None;
    let (loss3, _) = grads(&t, &unmasked);
    assert!((loss3 - loss).abs() > 1e-4, "the mask changes nothing?");

    // Every layer recomputed, alternate layers, none: one graph's gradients.
    let (ref_loss, ref_grads) = t.reference_grads(&batch, 0, 0);
    let reference = t.flatten(&ref_grads);
    let n = t.checkpointed.len();
    for pattern in [
        vec![true; n],
        (0..n).map(|i| i % 2 == 0).collect(),
        vec![false; n],
    ] {
        t.set_checkpointed(pattern.clone());
        let (l, g) = grads(&t, &batch);
        assert!(
            (l - ref_loss).abs() < 1e-5,
            "{pattern:?}: {l} vs {ref_loss}"
        );
        let d = max_diff(&g, &reference);
        assert!(d < 1e-4, "{pattern:?}: gradients differ by {d}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
