//! The model at start-up, built one unit at a time.
//!
//! Each unit (the embedding, each layer, the head) is made by the
//! constructors `Model::new` uses, in their order, so the generator draws the
//! values of a whole build; its Hugging Face tensors are loaded (read from
//! the files one tensor at a time, `weights::LazyLoader`; a QLoRA base is
//! quantized as it loads); then
//! - with ZeRO-3 or parameter offload, the unit (fp32, the values the master
//!   shard starts from) is cut into this rank's shards, which go to their
//!   place in the storage dtype (`shard::zero3::Builder`; a QLoRA layer's
//!   NF4 bases are cut too when the weights are sharded), and the whole unit
//!   is dropped before the next one is made; the trainer keeps a skeleton of
//!   placeholders;
//! - with ZeRO 1/2 or the optimizer on the host (`shard::Builder`): this
//!   rank's part of the fp32 master shard is cut from the unit (made in fp32
//!   when an fp32 master is kept), then the unit is cast to its storage
//!   dtype and kept whole;
//! - otherwise the unit is made directly in its storage dtype (fp32 when an
//!   fp32 master is stepped: the trainer casts its 16-bit working copy from
//!   it, both are the steady state; frozen parameters, which have no master,
//!   are made in the 16-bit dtype and shared by the two).
//!
//! So no more than one unit exists at a time beyond what the run keeps. The
//! compiler's `burn` profile charges exactly that as the `setup` point
//! (`rcoa_compiler::memory::SETUP_OP`).
//!
//! Before the first unit, the host memory an offloaded run will hold is
//! checked against the machine's free memory (`shard::layout::check_host`).

use crate::model::{Model, ModelInit, Part};
use crate::ops::ExecAutodiff;
use crate::shard::zero3::{self, Placeholders, Zero3};
use crate::train::{CastParams, Precision};
use crate::RunError;
use burn::module::Module;
use burn::tensor::FloatDType;
use rcoa_compiler::lowered::LoweredPlan;
use std::path::Path;

/// What the trainer keeps of the model: the weights (a skeleton with ZeRO-3
/// or parameter offload) and the per-unit shards, if any, or the flat
/// sharded optimizer with its master shard (ZeRO 1/2, optimizer offload).
pub struct Built<B: ExecAutodiff> {
    pub model: Model<B>,
    pub zero3: Option<Zero3<B::InnerBackend>>,
    pub zero: Option<crate::shard::Zero<B::InnerBackend>>,
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
    let (ranks, _, local) = crate::shard::rank_place(collective)?;
    crate::shard::layout::check_host(
        plan,
        precision,
        (ranks, local),
        crate::host_memory_available(),
    )?;
    let storage = zero3::Storage {
        dtype: precision.params,
        master: precision.master,
    };
    let mut shards = zero3::Builder::new(plan, storage, collective)?;
    let mut flat = crate::shard::Builder::new(plan, precision.params, collective)?;
    // A unit made in fp32 for its master is cast to its storage dtype once
    // the master's part is cut.
    let cast = (flat.is_some() && precision.master).then_some(precision.params);
    // Sharded units are cut from fp32 (the master's values); whole ones are
    // made in the dtype the run keeps them in.
    let dtype = if shards.is_some() || precision.master {
        FloatDType::F32
    } else {
        precision.params
    };
    // Frozen parameters have no master: beside an fp32 master they are made
    // in the storage dtype, and the 16-bit working copy shares them.
    let frozen = if shards.is_some() {
        dtype
    } else {
        precision.params
    };
    let init = ModelInit {
        model: &plan.model,
        adapter: plan.adapter.as_ref(),
        lm_head,
        dtype,
        frozen,
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
        if let Some(z) = &mut flat {
            match &part {
                Part::Embed(e) => z.add::<B, _>(e)?,
                Part::Layer(_, l) => z.add::<B, _>(&**l)?,
                Part::Head(h) => z.add::<B, _>(h)?,
            }
            if let Some(dt) = cast {
                part = match part {
                    Part::Embed(e) => Part::Embed(e.map(&mut CastParams(dt))),
                    Part::Layer(i, l) => Part::Layer(i, Box::new(l.map(&mut CastParams(dt)))),
                    Part::Head(h) => Part::Head(h.map(&mut CastParams(dt))),
                };
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
            Part::Layer(i, mut l) => {
                b.add::<B, _>(&*l)?;
                b.add_nf4(&mut l)?;
                Part::Layer(i, Box::new(l.map(&mut Placeholders)))
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
    let zero = flat.map(|b| b.finish()).transpose()?;
    Ok(Built { model, zero3, zero })
}

#[cfg(test)]
mod tests {
    //! The compiler's `setup` point against the executor's build, measured
    //! with the counting allocator (in a process of its own: other tests
    //! allocate meanwhile).

    use crate::memory::{AllocProbe, MemoryProbe};
    use crate::train::{Trainer, TrainerConfig};
    use crate::RunOptions;

    type Cpu = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

    const CHILD: &str = "RCOA_SETUP_MEASURE_CHILD";

    /// A decoder whose units are megabytes (the embedding, each layer and
    /// the head about 4 MiB in fp32), so per-tensor bookkeeping is noise.
    fn plan(global_batch: u32, extra: &str) -> String {
        format!(
            "model {{\n  arch = decoder\n  layers = 2\n  hidden = 256\n  heads = 4\n  ffn = 1024\n  \
             mlp = swiglu\n  norm = rmsnorm\n  tie_embeddings = false\n  vocab = 4096\n  max_positions = 64\n}}\n\
             precision fp32\noptimizer adamw {{ lr = 1e-3 }}\n\
             train {{ seq_len = 16  global_batch = {global_batch}  micro_batch = 2  grad_accum = 1 }}\n\
             fit {{ checkpoint = none }}\n{extra}\ntarget burn\n"
        )
    }

    /// The lowered plan and the compiler's setup point for `text`.
    fn compile(text: &str) -> (rcoa_compiler::lowered::LoweredPlan, u64) {
        let file = rcoa_grammar::parse("t.plan", text).expect("plan parses");
        let cx = rcoa_compiler::resolve::ResolveContext::new("t.plan", text, ".");
        let spec = rcoa_compiler::resolve::resolve(&file, &cx).expect("plan resolves");
        let c = rcoa_compiler::compile(&spec).expect("plan compiles");
        let setup = c.report.phase_peaks["setup"];
        (c.lowered, setup)
    }

    /// Live heap bytes at the highest point of `Trainer::new`, above those
    /// live before it.
    fn measured_setup(
        plan: &rcoa_compiler::lowered::LoweredPlan,
        collective: Option<crate::distributed::Collective<burn::backend::NdArray<f32>>>,
        opts: &RunOptions,
    ) -> u64 {
        let batcher = crate::batcher(plan, opts).unwrap();
        let mut probe = AllocProbe::new().expect("the test binary counts its allocations");
        let t = Trainer::<Cpu>::new(
            plan,
            TrainerConfig {
                seed: 5,
                batcher,
                sixteen_bit: false,
                collective,
            },
            Default::default(),
        )
        .unwrap();
        probe.sample();
        drop(t);
        probe.step_peak()
    }

    fn close(what: &str, measured: u64, predicted: u64) {
        let err = measured as f64 / predicted as f64 - 1.0;
        println!("{what}: measured {measured} predicted {predicted} ({err:+.4})");
        assert!(
            err.abs() < 0.02,
            "{what}: measured {measured} vs predicted {predicted} ({err:+.3})"
        );
    }

    #[test]
    fn predicted_setup_peak_is_the_measured_one() {
        crate::testing::run_ignored_in_child("setup::tests::setup_measured_in_child", CHILD);
    }

    /// One rank keeping the whole model (the CPU runs fp32: a 16-bit plan
    /// runs as this one here), and ZeRO-3 over two ranks (threads), each
    /// building its shards while the other waits: the highest live bytes of
    /// the build equal the compiler's `setup` point within 2%.
    #[test]
    #[ignore = "run in its own process by predicted_setup_peak_is_the_measured_one"]
    fn setup_measured_in_child() {
        assert!(std::env::var_os(CHILD).is_some(), "run by its parent test");
        let (whole, predicted) = compile(&plan(2, "hardware { gpu = h100-80gb }"));
        let whole_model = predicted;
        let opts = RunOptions {
            steps: 1,
            seed: 5,
            ..Default::default()
        };
        // Thread pools and first-use buffers before the measurement.
        measured_setup(&whole, None, &opts);
        close(
            "whole model",
            measured_setup(&whole, None, &opts),
            predicted,
        );

        let (sharded, predicted) = compile(&plan(
            4,
            "hardware { gpu = h100-80gb  gpus_per_node = 2 }\nparallel { data = 2  zero = 3 }",
        ));
        assert_eq!(sharded.resolved.zero, 3);
        let turn = std::sync::Arc::new(std::sync::Mutex::new(()));
        let ranks: Vec<_> = (0..2u32)
            .map(|local| {
                let (plan, turn, opts) = (sharded.clone(), turn.clone(), opts.clone());
                std::thread::spawn(move || {
                    use crate::distributed::Collective;
                    let d = crate::testing::thread_rank(local, 60);
                    let c = Collective::register(&d, &Default::default()).unwrap();
                    let mut o = opts;
                    o.distributed = Some(d);
                    // One build at a time: the probe's peak is process-wide.
                    let _one = turn.lock().unwrap_or_else(|e| e.into_inner());
                    measured_setup(&plan, Some(c), &o)
                })
            })
            .collect();
        // The highest point is the head's cut (the last unit: the most
        // shards left before it). The prediction is CubeCL's, where
        // flattening and slicing a parameter make views; burn-ndarray's
        // `reshape` and `slice` copy (`CowArray::into_shared`,
        // `slice_move(..).to_shared()`), so on the CPU the cut also holds
        // the head's flattened copy, its sliced half, and `cat`'s second
        // copy of the shard (its `reshape` after `concatenate`).
        let head = 256 + 256 * 4096u64;
        let ndarray = 4 * head + 2 * 4 * head.div_ceil(2);
        for (i, r) in ranks.into_iter().enumerate() {
            close(
                &format!("ZeRO-3 rank {i}"),
                r.join().unwrap(),
                predicted + ndarray,
            );
        }
        // Below the whole fp32 model, which every rank built before it built
        // a unit at a time.
        assert!(predicted < whole_model, "{predicted} vs {whole_model}");
    }
}
