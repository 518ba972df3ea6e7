//! The Hugging Face fixtures (tests/fixtures/hf, built by
//! tools/hf_fixtures/make_fixtures.py): weights loaded through the plan path
//! must reproduce the losses and embeddings `transformers` computed; weights
//! saved (full, sharded, PEFT adapters, merged LoRA) must compute what the
//! model that saved them computes, read back the way `transformers` and
//! `peft` read them.

use burn::backend::NdArray;
use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use rcoa_backend::model::{Ctx, Model, ModelInit};
use rcoa_backend::weights::{load_from, read_checkpoint, Export, Family, Stored};
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::spec::{AdapterKind, AdapterSpec, Dtype, ModelSpec, Proj};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

type B = NdArray<f32>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The model of a plan whose `model hf` names the fixture folder.
fn spec(name: &str, loss: &str) -> ModelSpec {
    spec_at(&format!("tests/fixtures/hf/{name}"), loss)
}

/// The model of a plan whose `model hf` names `dir`.
fn spec_at(dir: &str, loss: &str) -> ModelSpec {
    let text = format!(
        "model hf \"{dir}\"\nhardware {{ gpu = h100-80gb }}\nprecision fp32\noptimizer adamw {{ lr = 1e-3 }}\ntrain {{\n  seq_len = 16\n  global_batch = 4\n  micro_batch = 4\n  loss = {loss}\n}}\ntarget burn\n"
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
    let init = ModelInit::f32(m, None, lm_head);
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
    causal_loss_with(model, m, window, Attention::Eager)
}

/// The executor's attentions: eager, selective (`ops::attention_core`), fused
/// (`ops::flash_attention`, here its blocked CPU path).
#[derive(Clone, Copy, Debug)]
enum Attention {
    Eager,
    Selective,
    Flash,
}

/// [`causal_loss`] through `attention`.
fn causal_loss_with(model: &Model<B>, m: &ModelSpec, window: &[i64], attention: Attention) -> f64 {
    let device = Default::default();
    let s = window.len();
    let flash = matches!(attention, Attention::Flash);
    let mut ctx = Ctx::<B>::new(m, None, s, FloatDType::F32, flash, &device);
    ctx.train = false;
    ctx.selective = matches!(attention, Attention::Selective);
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

/// Qwen2: biases on q, k and v only, tied embeddings, base 1e6.
#[test]
fn qwen2_matches_transformers() {
    check_causal("qwen2");
}

/// Qwen3: RMSNorm over each head of q and k, `head_dim` 32 with 4 heads of a 64-wide
/// model.
#[test]
fn qwen3_matches_transformers() {
    check_causal("qwen3");
}

/// Phi-3: q, k and v read from row blocks of `qkv_proj` (4 query heads, 2 key/value
/// heads), gate and up from the halves of `gate_up_proj`.
#[test]
fn phi3_matches_transformers() {
    check_causal("phi3");
}

/// Mistral v0.1's sliding window in small: a window of 5 inside 16-token sequences, masked
/// by the eager and the selective attentions' bias and by the fused attention as
/// transformers masks it; the same weights without the window compute other losses, so the
/// window is what agrees.
#[test]
fn a_sliding_window_shorter_than_the_sequence_matches_transformers() {
    check_causal("mistral-window");
    let m = spec("mistral-window", "causal_lm");
    assert_eq!(m.numerics.sliding_window, Some(5));
    let model = loaded(&m, true).unwrap();
    let r = reference("mistral-window");
    let want: Vec<f64> = serde_json::from_value(r["losses"].clone()).unwrap();
    let without: Vec<f64> = serde_json::from_value(r["losses_without_window"].clone()).unwrap();
    for ((w, want), without) in ids(&r["windows"]).iter().zip(want).zip(without) {
        assert!((want - without).abs() > 1e-2, "the window changes the loss");
        for attention in [Attention::Selective, Attention::Flash] {
            let got = causal_loss_with(&model, &m, w, attention);
            assert!(
                (got - want).abs() < 1e-4,
                "{attention:?}: loss {got} vs transformers {want}"
            );
        }
    }
}

/// Phi-4-mini's RoPE in small: half of each head rotated, the rest passed through;
/// LongRoPE's long factors on the 16-token windows (past the pretraining length of 8)
/// and its short ones on their first 8 tokens; cos and sin scaled by sqrt 2.
#[test]
fn phi3_longrope_partial_rotary_matches_transformers() {
    check_causal("phi3-longrope");
    let m = spec("phi3-longrope", "causal_lm");
    assert_eq!(m.numerics.rotary_dims, Some(m.head_dim / 2));
    let model = loaded(&m, true).unwrap();
    let r = reference("phi3-longrope");
    let want: Vec<f64> = serde_json::from_value(r["short_losses"].clone()).unwrap();
    for (w, want) in ids(&r["short_windows"]).iter().zip(want) {
        assert_eq!(w.len(), 8);
        let got = causal_loss(&model, &m, w);
        assert!(
            (got - want).abs() < 1e-4,
            "8 tokens: loss {got} vs transformers {want}"
        );
    }
}

/// Llama 3.1's RoPE rescaling (`rope_type = llama3`), with the head's frequencies in all
/// three of its bands.
#[test]
fn llama3_rope_scaling_matches_transformers() {
    check_causal("llama3-rope");
}

/// Mean-pooled, L2-normalised last hidden states of the padded rows in
/// `r` (`input_ids`, `attention_mask`), as the fixture script pools them.
fn pooled(model: &Model<B>, m: &ModelSpec, r: &serde_json::Value) -> Vec<Vec<f64>> {
    let input = ids(&r["input_ids"]);
    let mask = ids(&r["attention_mask"]);
    let (rows, s) = (input.len(), input[0].len());
    let device = Default::default();
    let keep: Vec<bool> = mask.iter().flatten().map(|&k| k == 1).collect();
    let mut ctx = Ctx::<B>::new(m, None, s, FloatDType::F32, false, &device);
    ctx.train = false;
    let ctx = ctx.with_padding(&keep, rows, s, &device);
    let flat: Vec<i64> = input.iter().flatten().copied().collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(flat, [rows, s]), &device);
    let h: Vec<f32> = model.hidden(tokens, &ctx).into_data().to_vec().unwrap();
    let d = m.hidden as usize;
    (0..rows)
        .map(|r| {
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
            e.iter().map(|x| x / n / norm).collect()
        })
        .collect()
}

fn assert_embeddings(got: &[Vec<f64>], want: &[Vec<f64>], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (r, (g, w)) in got.iter().zip(want).enumerate() {
        for (i, (x, y)) in g.iter().zip(w).enumerate() {
            assert!((x - y).abs() < 1e-4, "{what}: row {r} dim {i}: {x} vs {y}");
        }
    }
}

#[test]
fn xlmr_sharded_embeddings_match_transformers() {
    let m = spec("xlmr", "contrastive");
    let model = loaded(&m, false).unwrap_or_else(|e| panic!("xlmr: {e}"));
    let r = reference("xlmr");
    let want: Vec<Vec<f64>> = serde_json::from_value(r["embeddings"].clone()).unwrap();
    assert_embeddings(&pooled(&model, &m, &r), &want, "xlmr vs transformers");
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
    let mut ctx = Ctx::<B>::new(&m, None, 8, FloatDType::F32, false, &device);
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

/// RoPE rescaling `rcoa run` does not compute is predicted for PyTorch targets and
/// refused for `target burn` when the plan compiles, naming the type.
#[test]
fn yarn_rope_scaling_is_refused_for_rcoa_run() {
    let dir = std::env::temp_dir().join(format!("rcoa-hf-rope-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let cfg = root().join("tests/fixtures/hf/llama/config.json");
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(cfg).unwrap()).unwrap();
    json["rope_scaling"] = serde_json::json!({"rope_type": "yarn", "factor": 4.0});
    std::fs::write(dir.join("config.json"), json.to_string()).unwrap();
    let compiled = |target: &str| {
        let text = format!(
            "model hf \"{}\"\nhardware {{ gpu = h100-80gb }}\nprecision fp32\noptimizer adamw {{ lr = 1e-3 }}\ntrain {{\n  seq_len = 16\n  global_batch = 4\n  micro_batch = 4\n}}\ntarget {target}\n",
            dir.display()
        );
        let file = rcoa_grammar::parse("fixture.plan", &text).expect("plan parses");
        let ctx = ResolveContext::new("fixture.plan", text.clone(), root());
        let spec = resolve(&file, &ctx).expect("the config reads");
        rcoa_compiler::compile(&spec).map(|_| ())
    };
    assert!(compiled("pytorch").is_ok());
    let e = format!("{:?}", compiled("burn").expect_err("refused"));
    assert!(e.contains("`yarn`"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Save in the HF layout and read back: the same tensors the fixture holds
/// (names, shapes, values), so the same logits.
#[test]
fn saved_hf_tensors_equal_the_checkpoint_they_came_from() {
    use rcoa_backend::weights::{hf_tensors, write_model, DEFAULT_MAX_SHARD_BYTES};
    for name in ["llama", "gpt2", "xlmr", "qwen2", "qwen3"] {
        let lm = name != "xlmr";
        let m = spec(name, if lm { "causal_lm" } else { "contrastive" });
        let model = loaded(&m, lm).unwrap();
        let dir = std::env::temp_dir().join(format!("rcoa-hf-save-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let t = hf_tensors(&model, Family::of(&m)).unwrap();
        write_model(&t, &dir, DEFAULT_MAX_SHARD_BYTES).unwrap();
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
                    hf_save: Default::default(),
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
        // The fixture's chat template goes with the tokenizer.
        "chat_template.jinja",
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

// ---------------------------------------------------------------- weights out: PEFT, merged, sharded

fn lora(targets: &[Proj], rank: u64, alpha: f64) -> AdapterSpec {
    let mut targets = targets.to_vec();
    targets.sort();
    AdapterSpec {
        kind: AdapterKind::Lora,
        rank,
        alpha,
        targets,
        dropout: 0.05,
        base: Dtype::Fp32,
    }
}

/// Sets both LoRA factors to values of a fixed sequence: `b` (zero at
/// initialisation) so that the adapter changes what the model computes, and
/// `a` (drawn from the backend's generator, which tests that train reseed
/// concurrently) so that how much it changes is the same on every run.
struct FixedLora {
    path: Vec<String>,
    state: u64,
}

impl<X: Backend> ModuleMapper<X> for FixedLora {
    fn enter_module(&mut self, name: &str, _container_type: &str) {
        self.path.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.pop();
    }
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<X, D>>) -> Param<Tensor<X, D>> {
        let n = self.path.len();
        if n < 2 || self.path[n - 2] != "lora" || !matches!(self.path[n - 1].as_str(), "a" | "b") {
            return param;
        }
        let (id, t, _) = param.consume();
        let shape = t.shape();
        let values: Vec<f32> = (0..shape.num_elements())
            .map(|_| {
                self.state = self
                    .state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((self.state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.4
            })
            .collect();
        let t = Tensor::<X, D>::from_data(TensorData::new(values, shape), &t.device());
        Param::initialized(id, t.set_require_grad(true))
    }
}

/// The fixture's weights with the adapter `a` on top, its `b`s nonzero.
fn adapted(m: &ModelSpec, a: &AdapterSpec, lm_head: bool) -> Model<B> {
    let device = Default::default();
    let init = ModelInit::f32(m, Some(a), lm_head);
    let mut model = Model::<B>::new(&init, &device);
    let dir = m.weights.as_ref().expect("a fixture");
    rcoa_backend::weights::load_into(&mut model, m, Path::new(dir)).unwrap();
    model.map(&mut FixedLora {
        path: vec![],
        state: 7,
    })
}

/// A plain model (no adapter) with the weights in `stored`.
fn plain_from(m: &ModelSpec, stored: &Stored, lm_head: bool) -> Model<B> {
    let init = ModelInit::f32(m, None, lm_head);
    let mut model = Model::<B>::new(&init, &Default::default());
    load_from(&mut model, Family::of(m), stored).unwrap_or_else(|e| panic!("{e}"));
    model
}

/// Logits (decoders) or last hidden states (XLM-R) of two fixed rows.
fn outputs(model: &Model<B>, m: &ModelSpec, adapter: Option<&AdapterSpec>, lm: bool) -> Vec<f32> {
    let device = Default::default();
    let s = 8;
    let ids: Vec<i64> = (0..2 * s as i64).map(|i| (i * 37 + 5) % 200 + 3).collect();
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(ids, [2, s]), &device);
    let mut ctx = Ctx::<B>::new(m, adapter, s, FloatDType::F32, false, &device);
    ctx.train = false;
    let h = model.hidden(tokens, &ctx);
    let out = if lm {
        model.head.logits(h, &model.embed, &ctx)
    } else {
        h
    };
    out.into_data().to_vec().unwrap()
}

fn assert_close(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    let worst = got
        .iter()
        .zip(want)
        .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
        .fold(0f32, f32::max);
    assert!(worst < 1e-4, "{what}: worst relative difference {worst}");
}

fn plan_for(m: &ModelSpec, a: Option<&AdapterSpec>) -> LoweredPlan {
    let mut plan = rcoa_backend::testing::tiny_plan();
    plan.model = m.clone();
    plan.adapter = a.cloned();
    plan
}

fn fresh_dir(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("rcoa-hf-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn tensors_of(path: &Path) -> BTreeMap<String, (Vec<usize>, Vec<f32>)> {
    let bytes = std::fs::read(path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    st.tensors()
        .into_iter()
        .map(|(k, v)| {
            assert_eq!(v.dtype(), safetensors::Dtype::F32, "{k}");
            let vals = v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (k, (v.shape().to_vec(), vals))
        })
        .collect()
}

/// The base checkpoint with the PEFT adapter in `dir` merged in the way PEFT
/// does, from PEFT's two files alone: a module is adapted when its name
/// equals a `target_modules` entry or ends with `.` + entry; its rank and
/// alpha come from `rank_pattern` / `alpha_pattern` (keys matched the same
/// way), else `r` / `lora_alpha`; `W += lora_B · lora_A · alpha / r`,
/// transposed for `Conv1D` (`fan_in_fan_out`). Every module the targets
/// catch must have its factors in the file, and the file nothing else.
fn peft_merge(base: &Stored, dir: &Path) -> Stored {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(cfg["peft_type"], "LORA");
    assert_eq!(cfg["bias"], "none");
    assert_eq!(cfg["use_rslora"], false);
    let factors = tensors_of(&dir.join("adapter_model.safetensors"));
    let targets: Vec<String> = serde_json::from_value(cfg["target_modules"].clone()).unwrap();
    let r = cfg["r"].as_f64().unwrap();
    let alpha = cfg["lora_alpha"].as_f64().unwrap();
    let fan_in_fan_out = cfg["fan_in_fan_out"].as_bool().unwrap();
    let hit = |m: &str, t: &str| m == t || m.ends_with(&format!(".{t}"));
    let pattern = |key: &str, m: &str, default: f64| -> f64 {
        let map = cfg[key].as_object().unwrap();
        map.iter()
            .find(|(k, _)| {
                assert!(
                    k.chars()
                        .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.'),
                    "pattern key {k} is a plain name"
                );
                hit(m, k)
            })
            .map(|(_, v)| v.as_f64().unwrap())
            .unwrap_or(default)
    };
    let mut out = base.clone();
    let mut used = 0;
    for (key, (shape, _)) in base {
        let Some(module) = key.strip_suffix(".weight").filter(|_| shape.len() == 2) else {
            continue;
        };
        let targeted = targets.iter().any(|t| hit(module, t));
        let ka = format!("base_model.model.{module}.lora_A.weight");
        let kb = format!("base_model.model.{module}.lora_B.weight");
        assert_eq!(
            targeted,
            factors.contains_key(&ka) && factors.contains_key(&kb),
            "{module}: caught by {targets:?}: {targeted}; factors in the file: {}",
            factors.contains_key(&ka)
        );
        if !targeted {
            continue;
        }
        used += 2;
        let rank = pattern("rank_pattern", module, r);
        let scale = pattern("alpha_pattern", module, alpha) / rank;
        let (sa, a) = &factors[&ka];
        let (sb, b) = &factors[&kb];
        let rk = rank as usize;
        let (d_in, d_out) = if fan_in_fan_out {
            (shape[0], shape[1])
        } else {
            (shape[1], shape[0])
        };
        assert_eq!(sa, &vec![rk, d_in], "{ka}");
        assert_eq!(sb, &vec![d_out, rk], "{kb}");
        let w = &mut out.get_mut(key).unwrap().1;
        for o in 0..d_out {
            for i in 0..d_in {
                let d: f64 = (0..rk)
                    .map(|q| b[o * rk + q] as f64 * a[q * d_in + i] as f64)
                    .sum();
                let at = if fan_in_fan_out {
                    i * d_out + o
                } else {
                    o * d_in + i
                };
                w[at] += (d * scale) as f32;
            }
        }
    }
    assert_eq!(
        used,
        factors.len(),
        "keys no module takes: {:?}",
        factors.keys()
    );
    out
}

/// A LoRA adapter saved in PEFT's layout, merged as PEFT merges it into the
/// base checkpoint, computes what rcoa's adapted model computes: key names,
/// transposes, scaling, GPT-2's fused `c_attn` (rank_pattern) and XLM-R's
/// ambiguous `output.dense` are all in play.
#[test]
fn peft_adapters_compute_what_the_adapted_model_computes() {
    let cases: [(&str, &str, AdapterSpec); 4] = [
        ("llama", "causal_lm", lora(&Proj::ALL, 4, 8.0)),
        (
            "gpt2",
            "causal_lm",
            lora(&[Proj::Q, Proj::V, Proj::O], 4, 16.0),
        ),
        ("gpt2", "causal_lm", lora(&[Proj::K], 2, 2.0)),
        (
            "xlmr",
            "contrastive",
            lora(&[Proj::Q, Proj::V, Proj::Down], 4, 8.0),
        ),
    ];
    for (i, (name, loss, a)) in cases.iter().enumerate() {
        let lm = *loss != "contrastive";
        let m = spec(name, loss);
        let model = adapted(&m, a, lm);
        let want = outputs(&model, &m, Some(a), lm);
        let base = read_checkpoint(Path::new(m.weights.as_ref().unwrap())).unwrap();
        let before = outputs(&plain_from(&m, &base, lm), &m, None, lm);
        let moved = want.iter().zip(&before).any(|(x, y)| (x - y).abs() > 1e-2);
        assert!(
            moved,
            "{name}: the adapter changes nothing: the test would prove nothing"
        );

        let dir = fresh_dir(&format!("peft-{name}-{i}"));
        let export = Export::for_plan(&plan_for(&m, Some(a)), &model).expect("an HF layout");
        let files = export.write(&model, &dir).unwrap();
        assert!(
            files.contains(&"adapter_model.safetensors".to_string()),
            "{files:?}"
        );
        assert!(dir.join("tokenizer.json").is_file());
        // No config.json nor full weights: transformers loads the folder as an adapter.
        assert!(!dir.join("config.json").exists() && !dir.join("model.safetensors").exists());
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        assert_eq!(cfg["base_model_name_or_path"], m.weights.clone().unwrap());
        assert_eq!(
            cfg["task_type"],
            if lm {
                "CAUSAL_LM"
            } else {
                "FEATURE_EXTRACTION"
            }
        );
        assert_eq!(cfg["lora_dropout"], 0.05);

        let merged = peft_merge(&base, &dir);
        let got = outputs(&plain_from(&m, &merged, lm), &m, None, lm);
        assert_close(
            &got,
            &want,
            &format!("{name} {:?} through PEFT's layout", a.targets),
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn peft_target_modules_are_the_usual_names_and_never_catch_unadapted_modules() {
    let target_modules = |name: &str, loss: &str, a: AdapterSpec| -> serde_json::Value {
        let m = spec(name, loss);
        let model = adapted(&m, &a, loss != "contrastive");
        let dir = fresh_dir(&format!("targets-{name}"));
        Export::for_plan(&plan_for(&m, Some(&a)), &model)
            .unwrap()
            .write(&model, &dir)
            .unwrap();
        let cfg: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(dir.join("adapter_config.json")).unwrap(),
        )
        .unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        cfg
    };
    let c = target_modules("llama", "causal_lm", lora(&[Proj::Q, Proj::V], 8, 16.0));
    assert_eq!(c["target_modules"], serde_json::json!(["q_proj", "v_proj"]));
    assert_eq!(
        (c["r"].as_u64(), c["lora_alpha"].as_f64()),
        (Some(8), Some(16.0))
    );
    assert_eq!(c["fan_in_fan_out"], false);
    // GPT-2: q and v live in one Conv1D of rank 2·4; o is `attn.c_proj`
    // (`c_proj` alone would catch the MLP's too).
    let c = target_modules(
        "gpt2",
        "causal_lm",
        lora(&[Proj::Q, Proj::V, Proj::O], 4, 16.0),
    );
    assert_eq!(
        c["target_modules"],
        serde_json::json!(["c_attn", "attn.c_proj"])
    );
    assert_eq!(c["fan_in_fan_out"], true);
    assert_eq!(c["r"], 4);
    assert_eq!(c["rank_pattern"], serde_json::json!({"c_attn": 8}));
    assert_eq!(c["alpha_pattern"], serde_json::json!({"c_attn": 32.0}));
    // XLM-R: the layer output's `output.dense` also names the attention output.
    let c = target_modules("xlmr", "contrastive", lora(&[Proj::Q, Proj::Down], 4, 8.0));
    assert_eq!(
        c["target_modules"],
        serde_json::json!(["query", "layer.0.output.dense", "layer.1.output.dense"])
    );
}

/// `--merge-lora`: full weights that a plain model loads and computes the
/// adapted model's outputs with, with the config and tokenizer beside them.
#[test]
fn merged_lora_weights_compute_what_the_adapted_model_computes() {
    for (name, loss, a) in [
        (
            "mistral",
            "causal_lm",
            lora(&[Proj::Q, Proj::K, Proj::Up], 4, 8.0),
        ),
        (
            "gpt2",
            "causal_lm",
            lora(&[Proj::Q, Proj::V, Proj::Down], 2, 4.0),
        ),
        ("xlmr", "contrastive", lora(&[Proj::V, Proj::O], 4, 4.0)),
    ] {
        let lm = loss != "contrastive";
        let m = spec(name, loss);
        let model = adapted(&m, &a, lm);
        let want = outputs(&model, &m, Some(&a), lm);
        let dir = fresh_dir(&format!("merged-{name}"));
        let mut export = Export::for_plan(&plan_for(&m, Some(&a)), &model).unwrap();
        export.set_merge_lora().unwrap();
        export.write(&model, &dir).unwrap();
        for f in ["config.json", "tokenizer.json", "model.safetensors"] {
            assert!(dir.join(f).is_file(), "{name}: {f} missing");
        }
        assert!(!dir.join("adapter_config.json").exists());
        let merged = read_checkpoint(&dir).unwrap();
        let got = outputs(&plain_from(&m, &merged, lm), &m, None, lm);
        assert_close(&got, &want, &format!("{name} merged"));
        if name == "xlmr" {
            // The pooler rcoa does not train comes over from the source.
            let src = read_checkpoint(Path::new(m.weights.as_ref().unwrap())).unwrap();
            for k in ["pooler.dense.weight", "pooler.dense.bias"] {
                assert_eq!(merged.get(k), src.get(k), "{k}");
                assert!(merged.contains_key(k), "{k}");
            }
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
    let m = spec("llama", "causal_lm");
    let plain = loaded(&m, true).unwrap();
    let mut export = Export::for_plan(&plan_for(&m, None), &plain).unwrap();
    let e = export.set_merge_lora().unwrap_err();
    assert!(e.contains("has no `adapter lora`"), "{e}");
}

fn trainer_for(plan: &LoweredPlan) -> rcoa_backend::train::Trainer<burn::backend::Autodiff<B>> {
    rcoa_backend::train::Trainer::new(
        plan,
        rcoa_backend::train::TrainerConfig {
            seed: 1,
            batcher: rcoa_backend::batcher(
                plan,
                &rcoa_backend::RunOptions {
                    steps: 1,
                    seed: 1,
                    ..Default::default()
                },
            )
            .unwrap(),
            sixteen_bit: false,
            collective: None,
        },
        Default::default(),
    )
    .unwrap()
}

/// Above the shard size the save is split as `transformers` splits it, and
/// the loader reads the shards back to the same tensors.
#[test]
fn a_save_above_the_shard_size_is_sharded_and_reads_back() {
    let mut plan = rcoa_backend::testing::tiny_plan();
    plan.model = spec("llama", "causal_lm");
    let mut tr = trainer_for(&plan);
    let max = 60_000u64;
    tr.export_mut().expect("an HF layout").max_shard_bytes = max;
    let dir = fresh_dir("sharded");
    tr.save(&dir).unwrap();
    assert!(!dir.join("model.safetensors").exists());
    let index: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let files: std::collections::BTreeSet<&str> =
        map.values().map(|v| v.as_str().unwrap()).collect();
    let n = files.len();
    assert!(n > 2, "{n} shards");
    let mut total = 0u64;
    for (k, f) in files.iter().enumerate() {
        assert_eq!(*f, format!("model-{:05}-of-{n:05}.safetensors", k + 1));
        let t = tensors_of(&dir.join(f));
        let bytes: u64 = t.values().map(|(_, v)| 4 * v.len() as u64).sum();
        assert!(
            bytes <= max || t.len() == 1,
            "{f}: {bytes} bytes in {} tensors",
            t.len()
        );
        for key in t.keys() {
            assert_eq!(map[key], *f, "{key} is in {f}");
        }
        total += bytes;
    }
    assert_eq!(index["metadata"]["total_size"], total);
    let back = read_checkpoint(&dir).unwrap();
    let orig = read_checkpoint(Path::new(plan.model.weights.as_ref().unwrap())).unwrap();
    assert_eq!(back, orig);
    assert!(dir.join("config.json").is_file() && dir.join("state.json").is_file());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A LoRA run's `--save` writes the PEFT files beside rcoa's own state,
/// with the factors it trained.
#[test]
fn a_lora_run_saves_a_peft_adapter_beside_its_state() {
    let mut plan = rcoa_backend::testing::tiny_plan();
    plan.model = spec("llama", "causal_lm");
    plan.adapter = Some(lora(&[Proj::Q, Proj::V], 4, 8.0));
    let mut tr = trainer_for(&plan);
    let mut probe = rcoa_backend::memory::cpu_probe();
    tr.train_step(probe.as_mut()).unwrap();
    let dir = fresh_dir("lora-run");
    tr.save(&dir).unwrap();
    for f in [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tokenizer.json",
        "state.json",
        "model.bin",
        "optimizer.bin",
    ] {
        assert!(dir.join(f).is_file(), "{f} missing");
    }
    assert!(!dir.join("model.safetensors").exists());
    let t = tensors_of(&dir.join("adapter_model.safetensors"));
    assert_eq!(t.len(), 2 * 2 * 2, "{:?}", t.keys());
    let b = &t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"];
    assert_eq!(b.0, vec![64, 4]);
    assert!(
        b.1.iter().any(|x| *x != 0.0),
        "one step of training moves B"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// What `transformers` and `peft` computed from rcoa's own saves
/// (`tools/hf_fixtures/roundtrip.py --record`: a sharded full fine-tune, full
/// fine-tunes of Qwen2, Qwen3, Phi-3, of Llama 3.1's and Phi-4-mini's RoPE and of a sliding
/// window shorter than the sequence, PEFT adapters
/// for Llama, GPT-2, Qwen2, Qwen3, Phi-3 and XLM-R, merged GPT-2 and Phi-3 LoRAs), rcoa
/// computes from the same files: the round trip, checked on every test run.
#[test]
fn transformers_and_peft_compute_on_rcoa_saves_what_rcoa_computes() {
    let dir = root().join("tests/fixtures/hf/roundtrip");
    let rt: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("roundtrip.json")).unwrap())
            .unwrap();
    let cases = &rt["cases"];
    let losses = |v: &serde_json::Value| -> Vec<f64> { serde_json::from_value(v.clone()).unwrap() };
    let check_windows =
        |model: &Model<B>, m: &ModelSpec, fixture: &str, want: Vec<f64>, what: &str| {
            let windows = ids(&reference(fixture)["windows"]);
            assert_eq!(windows.len(), want.len(), "{what}");
            for (w, want) in windows.iter().zip(want) {
                let got = causal_loss(model, m, w);
                assert!((got - want).abs() < 1e-4, "{what}: rcoa {got} vs {want}");
            }
        };
    // The full fine-tune, sharded by rcoa, as `model hf` loads it.
    assert!(dir
        .join("llama-full/model.safetensors.index.json")
        .is_file());
    for (case, fixture) in [
        ("llama-full", "llama"),
        ("qwen2-full", "qwen2"),
        ("qwen3-full", "qwen3"),
        ("llama3-rope-full", "llama3-rope"),
        ("phi3-full", "phi3"),
        ("phi3-longrope-full", "phi3-longrope"),
        ("mistral-window-full", "mistral-window"),
    ] {
        let m = spec(&format!("roundtrip/{case}"), "causal_lm");
        let model = loaded(&m, true).unwrap();
        let want = losses(&cases[case]["transformers"]["window_losses"]);
        check_windows(&model, &m, fixture, want, &format!("{case}, transformers"));
    }
    // The merged LoRAs of fused modules (GPT-2's c_attn; Phi-3's qkv_proj, gate_up_proj).
    for (case, fixture) in [("gpt2-lora", "gpt2"), ("phi3-lora", "phi3")] {
        let m = spec(&format!("roundtrip/{case}-merged"), "causal_lm");
        let model = loaded(&m, true).unwrap();
        let want = losses(&cases[case]["transformers_merged"]["window_losses"]);
        check_windows(
            &model,
            &m,
            fixture,
            want,
            &format!("{case} merged, transformers"),
        );
    }
    // Adapters: the base fixture with the PEFT files merged as PEFT merges.
    for (case, fixture) in [
        ("llama-lora", "llama"),
        ("gpt2-lora", "gpt2"),
        ("qwen2-lora", "qwen2"),
        ("qwen3-lora", "qwen3"),
        ("phi3-lora", "phi3"),
    ] {
        let m = spec(fixture, "causal_lm");
        let base = read_checkpoint(Path::new(m.weights.as_ref().unwrap())).unwrap();
        let merged = peft_merge(&base, &dir.join(case));
        let model = plain_from(&m, &merged, true);
        let want = losses(&cases[case]["peft"]["window_losses"]);
        check_windows(&model, &m, fixture, want, &format!("{case}, peft"));
    }
    let m = spec("xlmr", "contrastive");
    let base = read_checkpoint(Path::new(m.weights.as_ref().unwrap())).unwrap();
    let model = plain_from(&m, &peft_merge(&base, &dir.join("xlmr-lora")), false);
    let want: Vec<Vec<f64>> =
        serde_json::from_value(cases["xlmr-lora"]["peft"]["embeddings"].clone()).unwrap();
    assert_embeddings(
        &pooled(&model, &m, &reference("xlmr")),
        &want,
        "xlmr-lora, peft",
    );
}

/// A full fine-tune of a shape from a preset or the plan (no source
/// checkpoint) saves a `config.json` that reads back, through the same
/// config reader as `model hf`, to the same model, whose weights load.
#[test]
fn a_model_without_a_source_saves_a_config_that_reads_back_to_it() {
    use rcoa_compiler::spec::{Biases, Loss, Mlp, Norm, Positions, RopeScaling};
    let llama = rcoa_backend::testing::tiny_plan();
    let mut gpt2 = rcoa_backend::testing::tiny_plan();
    gpt2.model.norm = Norm::Layernorm;
    gpt2.model.mlp = Mlp::Gelu;
    gpt2.model.positions = Positions::Learned;
    gpt2.model.kv_heads = gpt2.model.heads;
    gpt2.model.tie_embeddings = true;
    gpt2.model.numerics.gelu_tanh = true;
    let bert = rcoa_backend::testing::tiny_encoder_plan(Loss::Contrastive);
    let mut xlmr = bert.clone();
    xlmr.model.numerics.position_offset = 2;
    xlmr.model.max_positions = 18;
    let mut qwen2 = llama.clone();
    qwen2.model.numerics.linear_bias = Some(Biases::Qkv);
    let mut biased = llama.clone();
    biased.model.numerics.linear_bias = Some(Biases::All);
    biased.model.numerics.rope_scaling = Some(RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_positions: 16,
    });
    let mut linear = llama.clone();
    linear.model.numerics.rope_scaling = Some(RopeScaling::Linear { factor: 2.0 });
    let mut qwen3 = llama.clone();
    qwen3.model.numerics.qk_norm = true;
    let mut mistral = llama.clone();
    mistral.model.numerics.sliding_window = Some(16);
    let mut phi3 = mistral.clone();
    phi3.model.numerics.fused_projections = true;
    phi3.model.numerics.padding_idx = Some(3);
    // Phi-4-mini's RoPE: three quarters of each head rotated, LongRoPE.
    let mut phi4 = phi3.clone();
    let rotated = phi4.model.head_dim * 3 / 4;
    phi4.model.numerics.rotary_dims = Some(rotated);
    phi4.model.numerics.rope_scaling = Some(RopeScaling::LongRope {
        short_factor: (0..rotated / 2).map(|i| 1.0 + i as f64 / 8.0).collect(),
        long_factor: (0..rotated / 2).map(|i| 2.0 + i as f64).collect(),
        original_max_positions: 8,
        attention_factor: 1.3,
    });
    for (what, plan, loss) in [
        ("llama", llama, "causal_lm"),
        ("qwen2", qwen2, "causal_lm"),
        ("llama-biases-llama3-rope", biased, "causal_lm"),
        ("llama-linear-rope", linear, "causal_lm"),
        ("qwen3", qwen3, "causal_lm"),
        ("mistral-window", mistral, "causal_lm"),
        ("phi3", phi3, "causal_lm"),
        ("phi3-longrope-partial", phi4, "causal_lm"),
        ("gpt2", gpt2, "causal_lm"),
        ("bert", bert, "contrastive"),
        ("xlmr", xlmr, "contrastive"),
    ] {
        let tr = trainer_for(&plan);
        let dir = fresh_dir(&format!("config-{what}"));
        tr.save(&dir).unwrap();
        assert!(dir.join("config.json").is_file(), "{what}: no config.json");
        let mut back = spec_at(dir.to_str().unwrap(), loss);
        back.name = plan.model.name.clone();
        back.weights = None;
        assert_eq!(
            back, plan.model,
            "{what}: the config reads back to another model"
        );
        loaded(&spec_at(dir.to_str().unwrap(), loss), loss != "contrastive")
            .unwrap_or_else(|e| panic!("{what}: {e}"));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
