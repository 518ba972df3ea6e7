//! The Hugging Face fixtures (tests/fixtures/hf, built by
//! tools/hf_fixtures/make_fixtures.py): weights loaded through the plan path
//! must reproduce the losses and embeddings `transformers` computed.

use burn::backend::NdArray;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use rcoa_backend::model::{Ctx, Model, ModelInit};
use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::spec::ModelSpec;
use std::path::{Path, PathBuf};

type B = NdArray<f32>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The model of a plan whose `model hf` names the fixture folder.
fn spec(name: &str, loss: &str) -> ModelSpec {
    let text = format!(
        "model hf \"tests/fixtures/hf/{name}\"\nhardware {{ gpu = h100-80gb }}\nprecision fp32\noptimizer adamw {{ lr = 1e-3 }}\ntrain {{\n  seq_len = 16\n  global_batch = 4\n  micro_batch = 4\n  loss = {loss}\n}}\ntarget burn\n"
    );
    let file = rcoa_grammar::parse("fixture.plan", &text).expect("plan parses");
    let ctx = ResolveContext::new("fixture.plan", text.clone(), root());
    resolve(&file, &ctx).expect("plan resolves").model
}

fn reference(name: &str) -> serde_json::Value {
    let p = root().join(format!("tests/fixtures/hf/{name}/reference.json"));
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

fn loaded(m: &ModelSpec, lm_head: bool) -> Result<Model<B>, rcoa_backend::RunError> {
    let device = Default::default();
    let init = ModelInit {
        model: m,
        adapter: None,
        lm_head,
        dtype: FloatDType::F32,
    };
    let mut model = Model::<B>::new(&init, &device);
    let dir = m.weights.as_ref().expect("the spec names the checkpoint");
    rcoa_backend::weights::load_into(&mut model, m, Path::new(dir))?;
    Ok(model)
}

fn ids(v: &serde_json::Value) -> Vec<Vec<i64>> {
    serde_json::from_value(v.clone()).unwrap()
}

/// Mean next-token cross-entropy of one window, as `labels=input_ids` does.
fn causal_loss(model: &Model<B>, m: &ModelSpec, window: &[i64]) -> f64 {
    let device = Default::default();
    let s = window.len();
    let mut ctx = Ctx::<B>::new(m, None, s, FloatDType::F32, &device);
    ctx.train = false;
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(window.to_vec(), [1, s]), &device);
    let h = model.hidden(tokens, &ctx);
    let logits = model.head.logits(h, &model.embed, &ctx);
    let v = logits.dims()[2];
    let l: Vec<f32> = logits.into_data().to_vec().unwrap();
    let mut total = 0.0;
    for p in 0..s - 1 {
        let row = &l[p * v..(p + 1) * v];
        let max = row.iter().cloned().fold(f32::MIN, f32::max) as f64;
        let lse = max
            + row
                .iter()
                .map(|x| (*x as f64 - max).exp())
                .sum::<f64>()
                .ln();
        total += lse - row[window[p + 1] as usize] as f64;
    }
    total / (s - 1) as f64
}

fn check_causal(name: &str) {
    let m = spec(name, "causal_lm");
    let model = loaded(&m, true).unwrap_or_else(|e| panic!("{name}: {e}"));
    let r = reference(name);
    let want: Vec<f64> = serde_json::from_value(r["losses"].clone()).unwrap();
    for (w, want) in ids(&r["windows"]).iter().zip(want) {
        let got = causal_loss(&model, &m, w);
        assert!(
            // Measured: within 3e-7 of transformers in fp32.
            (got - want).abs() < 1e-4,
            "{name}: loss {got} vs transformers {want}"
        );
    }
}

#[test]
fn llama_matches_transformers() {
    check_causal("llama");
}

#[test]
fn mistral_bf16_on_disk_matches_transformers() {
    check_causal("mistral");
}

#[test]
fn gpt2_matches_transformers() {
    check_causal("gpt2");
}

#[test]
fn xlmr_sharded_embeddings_match_transformers() {
    let m = spec("xlmr", "contrastive");
    let model = loaded(&m, false).unwrap_or_else(|e| panic!("xlmr: {e}"));
    let r = reference("xlmr");
    let input = ids(&r["input_ids"]);
    let mask = ids(&r["attention_mask"]);
    let want: Vec<Vec<f64>> = serde_json::from_value(r["embeddings"].clone()).unwrap();
    let (rows, s) = (input.len(), input[0].len());
    let device = Default::default();
    let keep: Vec<bool> = mask.iter().flatten().map(|&k| k == 1).collect();
    let mut ctx = Ctx::<B>::new(&m, None, s, FloatDType::F32, &device);
    ctx.train = false;
    let ctx = ctx.with_padding(&keep, rows, s, &device);
    let flat: Vec<i64> = input.iter().flatten().copied().collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [rows, s]), &device);
    let h: Vec<f32> = model.hidden(tokens, &ctx).into_data().to_vec().unwrap();
    let d = m.hidden as usize;
    for r in 0..rows {
        let mut e = vec![0f64; d];
        let mut n = 0.0;
        for p in 0..s {
            if keep[r * s + p] {
                n += 1.0;
                for (i, x) in e.iter_mut().enumerate() {
                    *x += h[(r * s + p) * d + i] as f64;
                }
            }
        }
        let norm = e.iter().map(|x| (x / n) * (x / n)).sum::<f64>().sqrt();
        for (i, x) in e.iter().enumerate() {
            let got = x / n / norm;
            assert!(
                (got - want[r][i]).abs() < 1e-4,
                "row {r} dim {i}: {got} vs transformers {}",
                want[r][i]
            );
        }
    }
}

#[test]
fn a_missing_a_misshaped_and_a_truncated_checkpoint_are_named() {
    let dir = std::env::temp_dir().join(format!("rcoa-hf-bad-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let src = root().join("tests/fixtures/hf/llama");
    // Rewrite the checkpoint without one tensor and with another reshaped.
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut kept = vec![];
    for (name, view) in st.tensors() {
        if name == "model.layers.1.mlp.up_proj.weight" {
            continue;
        }
        let shape = if name == "model.norm.weight" {
            vec![view.shape()[0] / 2, 2]
        } else {
            view.shape().to_vec()
        };
        kept.push((name, view.dtype(), shape, view.data().to_vec()));
    }
    let views: Vec<(String, safetensors::tensor::TensorView)> = kept
        .iter()
        .map(|(n, dt, s, d)| {
            let v = safetensors::tensor::TensorView::new(*dt, s.clone(), d).unwrap();
            (n.clone(), v)
        })
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
    let mut m = spec("llama", "causal_lm");
    m.weights = Some(dir.to_string_lossy().into_owned());
    let e = loaded(&m, true).expect_err("refused").to_string();
    assert!(
        e.contains("missing tensors: model.layers.1.mlp.up_proj.weight"),
        "{e}"
    );
    assert!(e.contains("`model.norm.weight` is [32, 2]"), "{e}");
    // A truncated file is a sentence naming it, not an internal error.
    let full = std::fs::read(dir.join("model.safetensors")).unwrap();
    std::fs::write(dir.join("model.safetensors"), &full[..full.len() / 2]).unwrap();
    let e = loaded(&m, true).expect_err("refused").to_string();
    assert!(
        e.contains("model.safetensors is not a readable safetensors file"),
        "{e}"
    );
    assert!(e.contains("truncated or corrupt"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_later_token_never_changes_an_earlier_position() {
    let m = spec("llama", "causal_lm");
    let model = loaded(&m, true).unwrap();
    let device = Default::default();
    let mut ctx = Ctx::<B>::new(&m, None, 8, FloatDType::F32, &device);
    ctx.train = false;
    let logits = |w: Vec<i64>| -> Vec<f32> {
        let t = Tensor::<B, 2, Int>::from_data(TensorData::new(w, [1, 8]), &device);
        let h = model.hidden(t, &ctx);
        model
            .head
            .logits(h, &model.embed, &ctx)
            .into_data()
            .to_vec()
            .unwrap()
    };
    let a = logits(vec![5, 6, 7, 8, 9, 10, 11, 12]);
    let b = logits(vec![5, 6, 7, 8, 9, 10, 11, 40]);
    let v = m.vocab as usize;
    assert_eq!(a[..7 * v], b[..7 * v], "positions 0..7 saw token 7");
    assert_ne!(a[7 * v..], b[7 * v..]);
}

#[test]
fn a_config_path_and_its_folder_name_the_same_checkpoint() {
    let by_dir = spec("llama", "causal_lm");
    let by_config = spec("llama/config.json", "causal_lm");
    assert_eq!(by_dir.weights, by_config.weights);
    assert_eq!(by_config.numerics.rope_theta, 500000.0);
    assert_eq!(by_config.numerics.norm_eps, 1e-6);
    let gpt2 = spec("gpt2", "causal_lm");
    assert!(gpt2.numerics.gelu_tanh);
    let xlmr = spec("xlmr", "contrastive");
    assert_eq!(xlmr.numerics.position_offset, 2);
}

#[test]
fn llama3_rope_scaling_is_refused() {
    let dir = std::env::temp_dir().join(format!("rcoa-hf-rope-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = root().join("tests/fixtures/hf/llama/config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cfg).unwrap()).unwrap();
    json["rope_scaling"] = serde_json::json!({"rope_type": "llama3", "factor": 8.0});
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let text = format!(
        "model hf \"{}\"\nhardware {{ gpu = h100-80gb }}\nprecision fp32\noptimizer adamw {{ lr = 1e-3 }}\ntrain {{\n  seq_len = 16\n  global_batch = 4\n  micro_batch = 4\n}}\ntarget burn\n",
        dir.display()
    );
    let file = rcoa_grammar::parse("fixture.plan", &text).expect("plan parses");
    let ctx = ResolveContext::new("fixture.plan", text.clone(), root());
    let e = format!("{:?}", resolve(&file, &ctx).expect_err("refused"));
    assert!(e.contains("rope_scaling"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Save in the HF layout and read back: the same tensors the fixture holds
/// (names, shapes, values), so the same logits.
#[test]
fn saved_hf_tensors_equal_the_checkpoint_they_came_from() {
    use rcoa_backend::weights::{hf_tensors, read_checkpoint, write_safetensors, Family};
    for name in ["llama", "gpt2", "xlmr"] {
        let lm = name != "xlmr";
        let m = spec(name, if lm { "causal_lm" } else { "contrastive" });
        let model = loaded(&m, lm).unwrap();
        let dir = std::env::temp_dir().join(format!("rcoa-hf-save-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t = hf_tensors(&model, Family::of(&m)).unwrap();
        write_safetensors(&t, &dir).unwrap();
        let back = read_checkpoint(&dir).unwrap();
        let orig = read_checkpoint(Path::new(m.weights.as_ref().unwrap())).unwrap();
        for (k, (shape, values)) in &back {
            // XLM-R's type row was folded into the positions: compare sums.
            if k.contains("token_type") || k.contains("position_embeddings") {
                continue;
            }
            let (s, v) = orig
                .get(k)
                .unwrap_or_else(|| panic!("{name}: {k} not in the source"));
            assert_eq!(s, shape, "{name}: {k}");
            assert_eq!(v, values, "{name}: {k}");
        }
        let mut again = loaded(&m, lm).unwrap();
        rcoa_backend::weights::load_from(&mut again, Family::of(&m), &back).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

/// `rcoa run --save` of a model started from a checkpoint writes a folder
/// `transformers` can load: config, tokenizer and the weights.
#[test]
fn a_full_fine_tune_saves_the_hf_layout_beside_its_state() {
    let mut plan = rcoa_backend::testing::tiny_plan();
    plan.model = spec("llama", "causal_lm");
    let tr = rcoa_backend::train::Trainer::<burn::backend::Autodiff<B>>::new(
        &plan,
        rcoa_backend::train::TrainerConfig {
            seed: 1,
            batcher: rcoa_backend::batcher(
                &plan,
                &rcoa_backend::RunOptions {
                    steps: 1,
                    seed: 1,
                    data: None,
                    tokenizer: None,
                    eval: None,
                    eval_every: None,
                    save: None,
                    save_every: None,
                    resume: None,
                    distributed: None,
                },
            )
            .unwrap(),
            sixteen_bit: false,
            collective: None,
        },
        Default::default(),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("rcoa-hf-trainer-{}", std::process::id()));
    tr.save(&dir).unwrap();
    for f in [
        "config.json",
        "tokenizer.json",
        "model.safetensors",
        "state.json",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    let back = rcoa_backend::weights::read_checkpoint(&dir).unwrap();
    let orig =
        rcoa_backend::weights::read_checkpoint(Path::new(plan.model.weights.as_ref().unwrap()))
            .unwrap();
    assert_eq!(back, orig);
    let _ = std::fs::remove_dir_all(&dir);
}
