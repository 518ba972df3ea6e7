//! Adam-mini on a real checkpoint: three steps of the `llama` fixture with
//! rcoa's model and optimizer (`optim::adam_mini`: the blocks found from
//! rcoa's module paths) give the losses that transformers with the authors'
//! package (blocks from the transformers names) gives
//! (`tests/fixtures/hf/llama/adam_mini.json`, written by
//! `tools/hf_fixtures/adam_mini_steps.py`).

use burn::backend::{Autodiff, NdArray};
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::activation::log_softmax;
use burn::tensor::{FloatDType, Int, Tensor, TensorData};
use rcoa_backend::model::{Ctx, Model, ModelInit};
use rcoa_backend::optim::adam_mini::{initial_records, AdamMiniOptimizer};
use rcoa_compiler::resolve::{resolve, ResolveContext};
use rcoa_compiler::spec::ModelSpec;
use std::path::{Path, PathBuf};

type B = Autodiff<NdArray<f32>>;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn llama() -> ModelSpec {
    let text = "model hf \"tests/fixtures/hf/llama\"\nhardware { gpu = h100-80gb }\nprecision fp32\n\
                optimizer adam-mini\ntrain { seq_len = 16  global_batch = 1  micro_batch = 1 }\ntarget burn\n";
    let file = rcoa_grammar::parse("fixture.plan", text).expect("plan parses");
    let ctx = ResolveContext::new("fixture.plan", text, root());
    resolve(&file, &ctx).expect("plan resolves").model
}

/// Mean next-token cross-entropy of one window (`labels=input_ids`).
fn loss(model: &Model<B>, m: &ModelSpec, window: &[i64]) -> Tensor<B, 1> {
    let device = Default::default();
    let s = window.len();
    let ctx = Ctx::<B>::new(m, None, s, FloatDType::F32, false, &device);
    let tokens = Tensor::<B, 2, Int>::from_data(TensorData::new(window.to_vec(), [1, s]), &device);
    let logits = model
        .head
        .logits(model.hidden(tokens, &ctx), &model.embed, &ctx);
    let next = Tensor::<B, 3, Int>::from_data(
        TensorData::new(window[1..].to_vec(), [1, s - 1, 1]),
        &device,
    );
    log_softmax(logits.narrow(1, 0, s - 1), 2)
        .gather(2, next)
        .mean()
        .neg()
        .reshape([1])
}

fn value(t: Tensor<B, 1>) -> f64 {
    t.into_scalar() as f64
}

#[test]
fn three_steps_of_a_checkpoint_match_transformers_with_the_package() {
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(root().join("tests/fixtures/hf/llama/adam_mini.json")).unwrap(),
    )
    .unwrap();
    let h = &r["hyper"];
    let f = |v: &serde_json::Value| v.as_f64().unwrap();
    let m = llama();
    let device = Default::default();
    let init = ModelInit::f32(&m, None, true);
    let mut model = Model::<B>::new(&init, &device);
    rcoa_backend::weights::load_into(&mut model, &m, &root().join("tests/fixtures/hf/llama"))
        .unwrap();
    let rule = AdamMiniOptimizer::new(
        f(&h["betas"][0]),
        f(&h["betas"][1]),
        f(&h["eps"]),
        f(&h["weight_decay"]),
    );
    let records = initial_records(&model, &m).unwrap();
    // Every parameter has its blocks: embedding, head, 2 × (q, k, v, o, gate, up, down,
    // two norms), the final norm.
    assert_eq!(records.len(), 2 + 2 * 9 + 1);
    let mut optim = OptimizerAdaptor::from(rule).load_record(records.into_iter().collect());
    let windows: Vec<Vec<i64>> = serde_json::from_value(r["windows"].clone()).unwrap();
    let want: Vec<f64> = serde_json::from_value(r["step_losses"].clone()).unwrap();
    for (w, want) in windows.iter().zip(want) {
        let l = loss(&model, &m, w);
        let got = value(l.clone());
        // Measured: within 1e-6 (fp32, CPU).
        assert!(
            (got - want).abs() < 1e-5,
            "step loss {got} vs transformers {want}"
        );
        let grads = GradientsParams::from_grads(l.backward(), &model);
        model = optim.step(f(&h["lr"]), model, grads);
        assert_eq!(optim.optim().take_error(), None);
    }
    let after = &r["after"];
    let windows: Vec<Vec<i64>> = serde_json::from_value(after["windows"].clone()).unwrap();
    let want: Vec<f64> = serde_json::from_value(after["losses"].clone()).unwrap();
    let fresh = Model::<B>::new(&init, &device);
    for (w, want) in windows.iter().zip(want) {
        let got = value(loss(&model, &m, w));
        println!("after three steps: {got} (transformers {want})");
        assert!(
            (got - want).abs() < 1e-5,
            "loss after the steps {got} vs transformers {want}"
        );
        // The trained model is not a fresh one by accident.
        assert!((value(loss(&fresh, &m, w)) - want).abs() > 1e-2);
    }
}
