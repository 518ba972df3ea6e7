//! The model at start-up, built one unit at a time.
//!
//! Each unit (the embedding, each layer, the head) is made by the
//! constructors `Model::new` uses, in their order, so the generator draws the
//! values of a whole build; its Hugging Face tensors are loaded (read from
//! the files one tensor at a time, `weights::LazyLoader`; a QLoRA base is
//! quantized as it loads); then
//! - with ZeRO-3 or parameter offload, the unit (fp32, the values the master
//!   shard starts from) is cut into this rank's shards, which go to their
//!   place in the storage dtype (`shard::zero3::Builder`), and the whole unit
//!   is dropped before the next one is made; the trainer keeps a skeleton of
//!   placeholders;
//! - otherwise the unit is made directly in its storage dtype (fp32 when an
//!   fp32 master is stepped: the trainer casts its 16-bit working copy from
//!   it, both are the steady state).
//!
//! So no more than one unit exists at a time beyond what the run keeps. The
//! compiler's `burn` profile charges exactly that as the `setup` point
//! (`rcoa_compiler::memory::SETUP_OP`).

use crate::model::{Model, ModelInit, Part};
use crate::ops::ExecAutodiff;
use crate::shard::zero3::{self, Placeholders, Zero3};
use crate::train::Precision;
use crate::RunError;
use burn::module::Module;
use burn::tensor::FloatDType;
use rcoa_compiler::lowered::LoweredPlan;
use std::path::Path;

/// What the trainer keeps of the model: the weights (a skeleton with ZeRO-3
/// or parameter offload) and the per-unit shards, if any.
pub struct Built<B: ExecAutodiff> {
    pub model: Model<B>,
    pub zero3: Option<Zero3<B::InnerBackend>>,
}

/// Build `plan`'s model for this rank (`collective`), its weights from the
/// plan's Hugging Face checkpoint if it names one.
pub fn build<B: ExecAutodiff>(
    plan: &LoweredPlan,
    precision: Precision,
    lm_head: bool,
    collective: Option<&crate::distributed::Collective<B::InnerBackend>>,
    device: &B::Device,
) -> Result<Built<B>, RunError> {
    let storage = zero3::Storage {
        dtype: precision.params,
        master: precision.master,
    };
    let mut shards = zero3::Builder::new(plan, storage, collective)?;
    // Sharded units are cut from fp32 (the master's values); whole ones are
    // made in the dtype the run keeps them in.
    let dtype = if shards.is_some() || precision.master {
        FloatDType::F32
    } else {
        precision.params
    };
    let init = ModelInit {
        model: &plan.model,
        adapter: plan.adapter.as_ref(),
        lm_head,
        dtype,
    };
    let dir = plan.model.weights.as_deref().map(Path::new);
    let mut loader = dir
        .map(|d| crate::weights::LazyLoader::open(&plan.model, d))
        .transpose()?;
    let mut parts = Vec::new();
    Model::<B>::build_parts(&init, device, &mut |mut part| {
        if let Some(l) = &mut loader {
            // A Hugging Face checkpoint replaces the random base weights
            // (LoRA's A and B keep their initialisation).
            part.load(&mut |name, shape| l.values(name, shape));
            if let Some(e) = part.quantization_error() {
                let dir = dir.map(|d| d.display().to_string()).unwrap_or_default();
                return Err(RunError::Weights(format!("{dir}: {e}")));
            }
        }
        let Some(b) = &mut shards else {
            parts.push(part);
            return Ok(());
        };
        let kept = match part {
            Part::Embed(e) => {
                b.add::<B, _>(&e)?;
                Part::Embed(e.map(&mut Placeholders))
            }
            Part::Layer(i, l) => {
                b.add::<B, _>(&l)?;
                Part::Layer(i, l.map(&mut Placeholders))
            }
            Part::Head(h) => {
                b.add::<B, _>(&h)?;
                Part::Head(h.map(&mut Placeholders))
            }
        };
        parts.push(kept);
        Ok(())
    })?;
    if let (Some(l), Some(d)) = (loader, dir) {
        l.finish()
            .map_err(|e| RunError::Weights(format!("{}: {e}", d.display())))?;
    }
    let model = Model::from_parts(parts);
    let zero3 = shards.map(|b| b.finish(plan)).transpose()?;
    Ok(Built { model, zero3 })
}
