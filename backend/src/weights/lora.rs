//! rcoa's LoRA factors, read from a model by their module paths, and the
//! merged weights `W + A·B·alpha/rank`.
//!
//! `model.rs` keeps `Lora`'s fields private and `Model::export` hands out the
//! base parameters only, so the factors are found the way Burn's own stores
//! find tensors: a `ModuleVisitor` that follows `enter_module`/`exit_module`
//! and sees each parameter under its field path
//! (`layers.0.attn.q.lora.a`).

use super::write::{HfTensor, RcoaTensor};
use crate::model::Model;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use std::collections::BTreeMap;

/// One adapted linear layer's factors in rcoa's layout: `a` is `[in, rank]`,
/// `b` is `[rank, out]`, and the layer adds `x·a·b·scale`.
#[derive(Clone, Debug, PartialEq)]
pub struct Factors {
    pub a: HfTensor,
    pub b: HfTensor,
}

/// Every adapted linear layer of `model`, by rcoa name (`layers.0.attn.q`).
pub fn lora_factors<B: Backend>(model: &Model<B>) -> Result<BTreeMap<String, Factors>, String> {
    struct Collect {
        path: Vec<String>,
        found: BTreeMap<String, (Option<HfTensor>, Option<HfTensor>)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Collect {
        fn enter_module(&mut self, name: &str, _container_type: &str) {
            self.path.push(name.to_string());
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.pop();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let n = self.path.len();
            if n < 3 || self.path[n - 2] != "lora" {
                return;
            }
            let which = self.path[n - 1].clone();
            let layer = self.path[..n - 2].join(".");
            let t = param.val().cast(FloatDType::F32);
            let shape = t.dims().to_vec();
            let values: Vec<f32> = t.into_data().convert::<f32>().to_vec().unwrap_or_default();
            let slot = self.found.entry(layer).or_default();
            match which.as_str() {
                "a" => slot.0 = Some((shape, values)),
                "b" => slot.1 = Some((shape, values)),
                _ => {}
            }
        }
    }
    let mut c = Collect {
        path: vec![],
        found: BTreeMap::new(),
    };
    model.visit(&mut c);
    let mut out = BTreeMap::new();
    for (layer, pair) in c.found {
        match pair {
            (Some(a), Some(b)) if a.0.len() == 2 && b.0.len() == 2 && a.0[1] == b.0[0] => {
                out.insert(layer, Factors { a, b });
            }
            _ => {
                return Err(format!(
                    "the LoRA adapter of `{layer}` does not have an `a` [in, rank] and a `b` [rank, out] factor"
                ))
            }
        }
    }
    Ok(out)
}

/// `a · b · scale`, `[in, out]`, accumulated in f64.
pub fn delta(f: &Factors, scale: f64) -> Vec<f32> {
    let (d_in, r) = (f.a.0[0], f.a.0[1]);
    let d_out = f.b.0[1];
    let mut out = vec![0f32; d_in * d_out];
    let mut row = vec![0f64; d_out];
    for i in 0..d_in {
        row.iter_mut().for_each(|x| *x = 0.0);
        for k in 0..r {
            let aik = f.a.1[i * r + k] as f64;
            if aik == 0.0 {
                continue;
            }
            for (x, bkj) in row.iter_mut().zip(&f.b.1[k * d_out..(k + 1) * d_out]) {
                *x += aik * *bkj as f64;
            }
        }
        for (o, x) in out[i * d_out..(i + 1) * d_out].iter_mut().zip(&row) {
            *o = (x * scale) as f32;
        }
    }
    out
}

/// The base parameters of `model` (rcoa names, as `Model::export` gives
/// them) with every adapted layer's weight replaced by `W + a·b·scale`: the
/// model a plain forward computes the same outputs with.
pub fn merged_params<B: Backend>(model: &Model<B>, scale: f64) -> Result<Vec<RcoaTensor>, String> {
    let factors = lora_factors(model)?;
    let mut params: Vec<RcoaTensor> = vec![];
    model.export(&mut |name, shape, values| params.push((name.to_string(), shape, values)));
    let mut merged = 0;
    for (name, shape, values) in &mut params {
        let Some(layer) = name.strip_suffix(".weight") else {
            continue;
        };
        let Some(f) = factors.get(layer) else {
            continue;
        };
        if shape.as_slice() != [f.a.0[0], f.b.0[1]] {
            return Err(format!(
                "`{name}` is {shape:?} but its LoRA factors make [{}, {}]",
                f.a.0[0], f.b.0[1]
            ));
        }
        for (w, d) in values.iter_mut().zip(delta(f, scale)) {
            *w += d;
        }
        merged += 1;
    }
    if merged != factors.len() {
        return Err(format!(
            "{} LoRA adapters but {merged} base weights to merge them into",
            factors.len()
        ));
    }
    Ok(params)
}
