//! What a checkpoint belongs to, so that `--resume` refuses a checkpoint of
//! another run instead of loading it: Burn's `load_record` replaces tensors
//! without comparing shapes, and an optimizer record of another kind fails
//! only as an undecodable file.
//!
//! `state.json` records what the saved state depends on: the model's shape
//! (and whether it has a vocabulary head), the adapter (kind, rank, alpha,
//! targets: alpha scales every adapted layer), the optimizer's kind (and
//! whether SGD keeps momentum), and how parameters are stored (dtype, fp32
//! master copy), with a fingerprint of them all. What the state does not
//! depend on — learning rate, betas, weight decay, steps, batch sizes,
//! sequence length, the compute dtype, checkpointing — may change on resume.

use crate::train::Precision;
use crate::RunError;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Tensor};
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::{Loss, OptimizerKind};
use std::collections::BTreeMap;
use std::path::Path;

/// The checkpoint format `Trainer::save` writes; format 1 had no identity.
pub const FORMAT: u64 = 2;

/// What must match for a checkpoint to resume: `section.key` → value.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Identity(pub BTreeMap<String, String>);

fn text<T: serde::Serialize>(v: &T) -> String {
    match serde_json::to_value(v) {
        Ok(serde_json::Value::String(s)) => s,
        Ok(other) => other.to_string(),
        Err(_) => String::new(),
    }
}

fn dtype(d: FloatDType) -> &'static str {
    match d {
        FloatDType::BF16 => "bf16",
        FloatDType::F16 => "fp16",
        FloatDType::F64 => "fp64",
        _ => "fp32",
    }
}

impl Identity {
    /// The identity of a run of `plan` executed with `precision`.
    pub fn of(plan: &LoweredPlan, precision: &Precision) -> Identity {
        let m = &plan.model;
        let mut e = BTreeMap::new();
        let mut put = |k: &str, v: String| {
            e.insert(k.to_string(), v);
        };
        put("model.arch", text(&m.arch));
        put("model.layers", m.layers.to_string());
        put("model.hidden", m.hidden.to_string());
        put("model.heads", m.heads.to_string());
        put("model.kv_heads", m.kv_heads.to_string());
        put("model.head_dim", m.head_dim.to_string());
        put("model.ffn", m.ffn.to_string());
        put("model.mlp", text(&m.mlp));
        put("model.norm", text(&m.norm));
        put("model.positions", text(&m.positions));
        put("model.vocab", m.vocab.to_string());
        put("model.max_positions", m.max_positions.to_string());
        put("model.tie_embeddings", m.tie_embeddings.to_string());
        put("model.experts", m.experts.to_string());
        // Written only where they differ from the family's, so the identities of
        // checkpoints saved before these entries existed stay the same.
        if m.biases() != m.family_biases() {
            put("model.bias", m.biases().as_str().into());
        }
        if m.numerics.qk_norm {
            put("model.qk_norm", "true".into());
        }
        if let Some(r) = &m.numerics.rope_scaling {
            put("model.rope_scaling", format!("{r:?}"));
        }
        if let Some(r) = m.numerics.rotary_dims {
            put("model.rotary_dims", r.to_string());
        }
        // The row the lookup gives no gradient: resumed under another, that row's
        // training would change in silence.
        if let Some(p) = m.numerics.padding_idx {
            put("model.padding_idx", p.to_string());
        }
        // Contrastive training builds no vocabulary head.
        put(
            "model.lm_head",
            (plan.train.loss != Loss::Contrastive).to_string(),
        );
        match &plan.adapter {
            None => put("adapter.kind", "none".into()),
            Some(a) => {
                put("adapter.kind", text(&a.kind));
                put("adapter.rank", a.rank.to_string());
                put("adapter.alpha", a.alpha.to_string());
                let t: Vec<&str> = a.targets.iter().map(|p| p.as_str()).collect();
                put("adapter.targets", t.join(","));
            }
        }
        let o = &plan.optimizer;
        put("optimizer.kind", o.kind.as_str().into());
        if o.kind == OptimizerKind::Sgd {
            put("optimizer.momentum", (o.momentum > 0.0).to_string());
        }
        put("precision.params", dtype(precision.params).into());
        put("precision.master", precision.master.to_string());
        Identity(e)
    }

    /// FNV-1a (64 bit) over the sorted entries: the same on every machine
    /// and version of Rust, unlike `std`'s hasher.
    pub fn fingerprint(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for (k, v) in &self.0 {
            for b in k.bytes().chain([0u8]).chain(v.bytes()).chain([0u8]) {
                h ^= b as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        format!("{h:016x}")
    }

    /// The `state.json` fields that carry it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "belongs_to": self.0,
            "fingerprint": self.fingerprint(),
        })
    }

    /// Refuse to resume from `dir` (whose `state.json` is `state`) unless it
    /// belongs to a run with this identity; the error names every entry
    /// that differs.
    pub fn check(&self, state: &serde_json::Value, dir: &Path) -> Result<(), RunError> {
        let at = dir.display();
        let format = state["format"].as_u64().unwrap_or(0);
        let recorded = state["belongs_to"].as_object();
        let Some(recorded) = recorded.filter(|_| format >= FORMAT) else {
            return Err(RunError::Checkpoint(format!(
                "the checkpoint `{at}` does not record which model, adapter and optimizer it belongs to \
                 (written by an older rcoa, format {format}): it cannot be resumed safely; start again \
                 without --resume"
            )));
        };
        let theirs: BTreeMap<String, String> = recorded
            .iter()
            .map(|(k, v)| (k.clone(), v.as_str().unwrap_or_default().to_string()))
            .collect();
        let theirs = Identity(theirs);
        let stored = state["fingerprint"].as_str().unwrap_or_default();
        if stored != theirs.fingerprint() {
            return Err(RunError::Checkpoint(format!(
                "the checkpoint `{at}` is inconsistent: its state.json's fingerprint does not match what it \
                 records (edited or corrupt); resume from another checkpoint, or start again without --resume"
            )));
        }
        if theirs.fingerprint() == self.fingerprint() {
            return Ok(());
        }
        let what = differences(&theirs.0, &self.0);
        let hf = if dir.join("config.json").is_file()
            && (dir.join("model.safetensors").is_file()
                || dir.join("model.safetensors.index.json").is_file())
        {
            format!(
                "; to fine-tune these weights further with another plan, start from them with `model hf \"{at}\"` instead"
            )
        } else {
            String::new()
        };
        Err(RunError::Checkpoint(format!(
            "the checkpoint `{at}` belongs to another run and cannot be resumed with this plan: {}. \
             Resume with the plan it was saved by, or start again without --resume{hf}",
            what.join("; ")
        )))
    }
}

/// The shape of every float parameter of `m`, in visit order.
pub fn param_shapes<B: Backend, M: Module<B>>(m: &M) -> Vec<Vec<usize>> {
    struct Shapes(Vec<Vec<usize>>);
    impl<B: Backend> ModuleVisitor<B> for Shapes {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            self.0.push(param.shape().to_vec());
        }
    }
    let mut s = Shapes(vec![]);
    m.visit(&mut s);
    s.0
}

/// Refuse weights loaded from `file` whose shapes (`got`) are not those of
/// the plan's model (`want`).
pub fn same_shapes(want: &[Vec<usize>], got: &[Vec<usize>], file: &Path) -> Result<(), RunError> {
    if want == got {
        return Ok(());
    }
    let count = if want.len() != got.len() {
        format!(
            "{} parameters in the checkpoint, {} in this plan; ",
            got.len(),
            want.len()
        )
    } else {
        String::new()
    };
    let bad: Vec<String> = want
        .iter()
        .zip(got)
        .enumerate()
        .filter(|(_, (a, b))| a != b)
        .map(|(i, (a, b))| format!("parameter {i}: {b:?} in the checkpoint, {a:?} in this plan"))
        .take(5)
        .collect();
    Err(RunError::Checkpoint(format!(
        "`{}` holds weights of another shape than this plan's model ({count}{}): resume with the plan \
         it was saved by, or start again without --resume",
        file.display(),
        bad.join(", ")
    )))
}

/// Per section (`model`, `adapter`, ...), what differs: each differing key
/// with both values, or, where the two sides record different keys (an
/// adapter against none, SGD's momentum), each side whole.
fn differences(was: &BTreeMap<String, String>, now: &BTreeMap<String, String>) -> Vec<String> {
    let section = |m: &BTreeMap<String, String>, name: &str| -> BTreeMap<String, String> {
        m.iter()
            .filter_map(|(k, v)| {
                let (s, key) = k.split_once('.').unwrap_or(("plan", k));
                (s == name).then(|| (key.to_string(), v.clone()))
            })
            .collect()
    };
    let names: std::collections::BTreeSet<&str> = was
        .keys()
        .chain(now.keys())
        .map(|k| k.split_once('.').map_or("plan", |(s, _)| s))
        .collect();
    let whole = |m: &BTreeMap<String, String>| -> String {
        let v: Vec<String> = m.iter().map(|(k, v)| format!("{k} {v}")).collect();
        v.join(", ")
    };
    let mut out = vec![];
    for name in names {
        let (a, b) = (section(was, name), section(now, name));
        if a == b {
            continue;
        }
        if a.keys().ne(b.keys()) {
            out.push(format!(
                "{name}: {} in the checkpoint; {} in this plan",
                whole(&a),
                whole(&b)
            ));
            continue;
        }
        let d: Vec<String> = a
            .iter()
            .filter(|(k, v)| b.get(*k) != Some(*v))
            .map(|(k, v)| format!("{k} {v} in the checkpoint, {} in this plan", b[k]))
            .collect();
        out.push(format!("{name}: {}", d.join(", ")));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::tiny_plan;

    fn fp32() -> Precision {
        Precision {
            params: FloatDType::F32,
            compute: FloatDType::F32,
            master: false,
        }
    }

    #[test]
    fn the_storage_dtype_must_match_but_the_compute_dtype_may_change() {
        let plan = tiny_plan();
        let saved = Identity::of(&plan, &fp32());
        let mut state = saved.to_json();
        state["format"] = FORMAT.into();
        let dir = Path::new("/nonexistent/ckpt");
        let autocast = Precision {
            compute: FloatDType::BF16,
            ..fp32()
        };
        Identity::of(&plan, &autocast).check(&state, dir).unwrap();
        let master = Precision {
            params: FloatDType::BF16,
            compute: FloatDType::BF16,
            master: true,
        };
        let e = Identity::of(&plan, &master)
            .check(&state, dir)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("precision: master false in the checkpoint, true in this plan, params fp32 in the checkpoint, bf16 in this plan"),
            "{e}"
        );
    }

    /// Biases, q/k norms, RoPE's rescaling and rotated share, the pad token's row are the
    /// model's too (a `bias = qkv`
    /// checkpoint resumed without them would drop its biases in silence); a plan that
    /// writes its family's biases is the same model as one that does not.
    #[test]
    fn biases_qk_norms_and_rope_are_part_of_the_model() {
        use rcoa_compiler::spec::{Biases, RopeScaling};
        let plan = tiny_plan();
        let mut state = Identity::of(&plan, &fp32()).to_json();
        state["format"] = FORMAT.into();
        let dir = Path::new("/nonexistent/ckpt");
        let mut same = plan.clone();
        same.model.numerics.linear_bias = Some(Biases::None);
        Identity::of(&same, &fp32()).check(&state, dir).unwrap();
        let mut qkv = plan.clone();
        qkv.model.numerics.linear_bias = Some(Biases::Qkv);
        let mut qk = plan.clone();
        qk.model.numerics.qk_norm = true;
        let mut rope = plan.clone();
        rope.model.numerics.rope_scaling = Some(RopeScaling::Linear { factor: 2.0 });
        let mut partial = plan.clone();
        partial.model.numerics.rotary_dims = Some(partial.model.head_dim / 2);
        let mut padded = plan.clone();
        padded.model.numerics.padding_idx = Some(0);
        for (other, key) in [
            (qkv, "bias qkv"),
            (qk, "qk_norm true"),
            (rope, "rope_scaling Linear"),
            (partial, "rotary_dims"),
            (padded, "padding_idx"),
        ] {
            let e = Identity::of(&other, &fp32())
                .check(&state, dir)
                .unwrap_err()
                .to_string();
            assert!(e.contains(key), "{key}: {e}");
        }
    }

    #[test]
    fn the_fingerprint_is_stable_and_depends_on_every_entry() {
        let plan = tiny_plan();
        let a = Identity::of(&plan, &fp32());
        assert_eq!(a.fingerprint(), Identity::of(&plan, &fp32()).fingerprint());
        for (k, _) in a.0.iter() {
            let mut b = a.clone();
            b.0.insert(k.clone(), "changed".into());
            assert_ne!(a.fingerprint(), b.fingerprint(), "{k}");
        }
    }
}
