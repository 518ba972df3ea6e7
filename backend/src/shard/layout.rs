//! What a rank's shards will hold, from the plan alone, before the first
//! unit is built: the units' parameter counts (`unit_values`, the shapes
//! `Model::build_parts` makes), hence the bounds of ZeRO 1/2's flat shard
//! (which the start-up cuts the fp32 master from, a unit at a time) and the
//! host memory an offloaded run will hold (`host_bytes`), checked against
//! the machine's free memory before minutes of loading (`check_host`).
//!
//! `crate::setup` compares the counts with the units it builds: a mismatch
//! is an error, never a shard cut at the wrong place.

use super::zero3;
use crate::optim::Rule;
use crate::train::Precision;
use crate::RunError;
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::{AdapterKind, Arch, Loss, Mlp, Norm, OffloadTo, OffloadWhat, Positions};

/// Float parameter values of one unit (the embedding, a layer, the head).
/// QLoRA's NF4 bases are not float parameters: counted in neither.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct UnitValues {
    pub trainable: usize,
    pub frozen: usize,
}

impl UnitValues {
    fn add(&mut self, n: usize, trainable: bool) {
        if trainable {
            self.trainable += n;
        } else {
            self.frozen += n;
        }
    }
}

/// The units `Model::build_parts` makes for `plan`, in its order, with the
/// values of their float parameters (the constructors of `crate::model`).
pub fn unit_values(plan: &LoweredPlan) -> Vec<UnitValues> {
    let m = &plan.model;
    let a = plan.adapter.as_ref();
    let base = a.is_none();
    let (d, v) = (m.hidden as usize, m.vocab as usize);
    let norm = |u: &mut UnitValues| {
        let per = if m.norm == Norm::Layernorm { 2 } else { 1 };
        u.add(per * d, base);
    };
    let mut embed = UnitValues::default();
    embed.add(v * d, base);
    if m.positions == Positions::Learned {
        embed.add(m.max_positions as usize * d, base);
    }
    if m.arch == Arch::Encoder {
        norm(&mut embed);
    }
    let (h, kv, hd, ffn) = (
        m.heads as usize,
        m.kv_heads as usize,
        m.head_dim as usize,
        m.ffn as usize,
    );
    let mut projections = vec![
        (rcoa_compiler::spec::Proj::Q, d, h * hd),
        (rcoa_compiler::spec::Proj::K, d, kv * hd),
        (rcoa_compiler::spec::Proj::V, d, kv * hd),
        (rcoa_compiler::spec::Proj::O, h * hd, d),
    ];
    if m.mlp == Mlp::Swiglu {
        projections.push((rcoa_compiler::spec::Proj::Gate, d, ffn));
    }
    projections.push((rcoa_compiler::spec::Proj::Up, d, ffn));
    projections.push((rcoa_compiler::spec::Proj::Down, ffn, d));
    let mut layer = UnitValues::default();
    // The norms, Qwen3's q/k norms and the projections' biases: base parameters, whole
    // (and not quantized under QLoRA), as the compiler counts them.
    for (_, n) in rcoa_compiler::memory::parallel::layer_vectors(m, 1) {
        layer.add(n as usize, base);
    }
    let quantized = a.is_some_and(|a| a.kind == AdapterKind::Qlora);
    for (proj, d_in, d_out) in projections {
        if !quantized {
            layer.add(d_in * d_out, base);
        }
        if let Some(a) = a.filter(|a| a.targets.contains(&proj)) {
            let r = a.rank as usize;
            layer.add(d_in * r + r * d_out, true);
        }
    }
    let mut head = UnitValues::default();
    if m.arch == Arch::Decoder {
        norm(&mut head);
    }
    let lm_head = plan.train.loss != Loss::Contrastive;
    if lm_head && !m.tie_embeddings {
        head.add(d * v, base);
    }
    let mut units = vec![embed];
    units.extend(std::iter::repeat_n(layer, m.layers as usize));
    units.push(head);
    units
}

/// Does `plan` move `what` to host memory?
pub(crate) fn offloads(plan: &LoweredPlan, what: OffloadWhat) -> bool {
    plan.resolved
        .offload
        .iter()
        .any(|o| o.what == what && o.to == OffloadTo::Cpu)
}

/// Whether `plan` steps a flat sharded optimizer (`super::Zero`): ZeRO 1 or
/// 2, or the optimizer on the host, with whole weights on every rank.
pub fn flat_zero(plan: &LoweredPlan) -> bool {
    let host = offloads(plan, OffloadWhat::Optimizer);
    (plan.resolved.zero > 0 || host) && !zero3::wanted(plan)
}

/// Host bytes one rank of `plan` will hold (over `ranks` data-parallel
/// ranks), at the precision it runs: what `super::Zero::host_bytes` and
/// `zero3::Zero3::host_bytes` hold once built, known before.
pub fn host_bytes(plan: &LoweredPlan, precision: Precision, ranks: usize) -> Result<u64, RunError> {
    let opt_host = offloads(plan, OffloadWhat::Optimizer);
    let params_host = offloads(plan, OffloadWhat::Params);
    if !opt_host && !params_host {
        return Ok(0);
    }
    let state = Rule::for_plan(plan)?.state_per_param();
    let stage = plan.resolved.zero;
    let units = unit_values(plan);
    if flat_zero(plan) {
        let len: usize = units.iter().map(|u| u.trainable).sum();
        let shards = if stage == 0 { 1 } else { ranks.max(1) };
        return Ok(if opt_host {
            super::flat_host_bytes(state, len.div_ceil(shards))
        } else {
            0
        });
    }
    if !zero3::wanted(plan) {
        return Ok(0);
    }
    let ranks = ranks.max(1);
    let wshards = if stage >= 3 { ranks } else { 1 };
    let oshards = if stage >= 1 { ranks } else { 1 };
    let storage = zero3::Storage {
        dtype: precision.params,
        master: precision.master,
    };
    let per = |n: usize, s: usize| n.div_ceil(s);
    let t_ws: usize = units.iter().map(|u| per(u.trainable, wshards)).sum();
    let f_ws: usize = units.iter().map(|u| per(u.frozen, wshards)).sum();
    let t_os: usize = units.iter().map(|u| per(u.trainable, oshards)).sum();
    let mut values = 0;
    if params_host {
        values += t_ws + f_ws;
    }
    if zero3::master_separate(wshards, oshards, &storage, params_host, opt_host)
        && (opt_host || params_host)
    {
        values += t_os;
    }
    if opt_host {
        values += (state + 1) * t_os;
    }
    Ok((values * 4) as u64)
}

/// Host bytes one rank of `plan` holds for checkpointed layers' inputs at
/// the end of a micro-batch's forward (`offload = [activations]`,
/// `Trainer::micro_step_with`): one `[rows, seq, hidden]` activation in the
/// compute dtype per layer in `Residency::inputs_on_host`.
pub fn host_activation_bytes(plan: &LoweredPlan, precision: Precision) -> u64 {
    let layers = plan.residency().inputs_on_host.len() as u64;
    let rows = plan.resolved.micro_batch * plan.train.sequences_per_item();
    let bytes = burn::tensor::DType::from(precision.compute).size() as u64;
    layers * rows * plan.train.seq_len * plan.model.hidden * bytes
}

/// Refuse, before anything is built, a run whose offloaded state does not
/// fit in `available` host bytes (`crate::host_memory_available`): this
/// process's `local` ranks of `ranks` together.
pub fn check_host(
    plan: &LoweredPlan,
    precision: Precision,
    (ranks, local): (usize, usize),
    available: Option<u64>,
) -> Result<(), RunError> {
    let need = (host_bytes(plan, precision, ranks)? + host_activation_bytes(plan, precision))
        * local.max(1) as u64;
    if need == 0 {
        return Ok(());
    }
    crate::check_host_memory(plan, need, available)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::{Model, ModelInit, Part};
    use crate::testing::{tiny_encoder_plan, tiny_plan};
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::tensor::Tensor;
    use rcoa_compiler::spec::{AdapterSpec, Biases, Dtype, Offload, Proj};

    type Cpu = burn::backend::Autodiff<burn::backend::NdArray<f32>>;

    /// Float values per unit of the model `Model::build_parts` makes.
    fn built(plan: &LoweredPlan) -> Vec<UnitValues> {
        struct Count(UnitValues);
        impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for Count {
            fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<B, D>>) {
                self.0.add(p.shape().num_elements(), p.is_require_grad());
            }
        }
        let init = ModelInit::f32(
            &plan.model,
            plan.adapter.as_ref(),
            plan.train.loss != Loss::Contrastive,
        );
        let mut out = Vec::new();
        Model::<Cpu>::build_parts(&init, &Default::default(), &mut |part| {
            let mut c = Count(UnitValues::default());
            match &part {
                Part::Embed(e) => e.visit(&mut c),
                Part::Layer(_, l) => l.visit(&mut c),
                Part::Head(h) => h.visit(&mut c),
            }
            out.push(c.0);
            Ok::<_, std::convert::Infallible>(())
        })
        .unwrap();
        out
    }

    fn adapter(kind: AdapterKind) -> AdapterSpec {
        AdapterSpec {
            kind,
            rank: 4,
            alpha: 8.0,
            targets: vec![Proj::Q, Proj::V, Proj::Gate, Proj::Down],
            dropout: 0.0,
            base: if kind == AdapterKind::Qlora {
                Dtype::Nf4
            } else {
                Dtype::Fp32
            },
        }
    }

    #[test]
    fn the_plan_gives_the_units_the_build_makes() {
        let _serial = crate::tests::serial();
        let mut plans = vec![
            tiny_plan(),
            tiny_encoder_plan(Loss::MaskedLm),
            tiny_encoder_plan(Loss::Contrastive),
        ];
        let mut tied = tiny_plan();
        tied.model.tie_embeddings = true;
        tied.model.norm = Norm::Layernorm;
        tied.model.mlp = Mlp::Gelu;
        plans.push(tied);
        for biases in [Biases::Qkv, Biases::All] {
            let mut p = tiny_plan();
            p.model.numerics.linear_bias = Some(biases);
            plans.push(p);
        }
        let mut qk = tiny_plan();
        qk.model.numerics.qk_norm = true;
        plans.push(qk.clone());
        qk.model.norm = Norm::Layernorm;
        plans.push(qk);
        for kind in [AdapterKind::Lora, AdapterKind::Qlora] {
            let mut p = tiny_plan();
            p.adapter = Some(adapter(kind));
            p.model.numerics.linear_bias = Some(Biases::Qkv);
            p.model.numerics.qk_norm = true;
            plans.push(p);
        }
        for p in &plans {
            let want = built(p);
            assert_eq!(unit_values(p), want, "{:?} {:?}", p.model.arch, p.adapter);
            assert_eq!(want.len() as u64, p.model.layers + 2);
        }
    }

    fn offload(what: &[OffloadWhat]) -> Vec<Offload> {
        what.iter()
            .map(|&what| Offload {
                what,
                to: OffloadTo::Cpu,
            })
            .collect()
    }

    /// The host bytes known from the plan are those the built shards hold
    /// (one rank: `Zero` for ZeRO 0-2 with the optimizer offloaded, `Zero3`
    /// for ZeRO-3 or the parameters offloaded).
    #[test]
    fn host_bytes_before_the_build_are_those_after_it() {
        let _serial = crate::tests::serial();
        let cases: &[(u8, &[OffloadWhat])] = &[
            (0, &[OffloadWhat::Optimizer]),
            (1, &[OffloadWhat::Optimizer]),
            (3, &[OffloadWhat::Optimizer]),
            (0, &[OffloadWhat::Params]),
            (3, &[OffloadWhat::Optimizer, OffloadWhat::Params]),
            (2, &[]),
        ];
        for (zero, what) in cases {
            let mut plan = tiny_plan();
            plan.adapter = (*zero == 3).then(|| adapter(AdapterKind::Lora));
            plan.resolved.zero = *zero;
            plan.resolved.offload = offload(what);
            let (precision, _) = Precision::for_plan(&plan, false).unwrap();
            let want = host_bytes(&plan, precision, 1).unwrap();
            let opts = crate::RunOptions {
                steps: 1,
                seed: 3,
                ..Default::default()
            };
            let t = crate::testing::trainer::<Cpu>(&plan, &opts, 3).unwrap();
            let got = match (t.zero(), t.zero3()) {
                (Some(z), _) => z.host_bytes(),
                (_, Some(z)) => z.host_bytes(),
                _ => 0,
            };
            assert_eq!(want, got, "zero {zero}, offload {what:?}");
            assert_eq!(want > 0, !what.is_empty(), "zero {zero}, offload {what:?}");
        }
    }

    /// An offloaded plan is refused on a host with less free memory than it
    /// will hold, before a unit is built (`crate::setup` asks first); a plan
    /// that offloads nothing needs none.
    #[test]
    fn offload_beyond_free_host_memory_is_refused_before_the_build() {
        let mut plan = tiny_plan();
        plan.resolved.data = 2;
        plan.resolved.zero = 3;
        plan.resolved.offload = offload(&[OffloadWhat::Optimizer, OffloadWhat::Params]);
        let (precision, _) = Precision::for_plan(&plan, false).unwrap();
        let per_rank = host_bytes(&plan, precision, 2).unwrap();
        assert!(per_rank > 0);
        // Two ranks in this process hold twice one rank's.
        let e = check_host(&plan, precision, (2, 2), Some(2 * per_rank - 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("host memory"), "{e}");
        assert!(check_host(&plan, precision, (2, 2), Some(2 * per_rank)).is_ok());
        assert!(check_host(&plan, precision, (2, 1), Some(per_rank)).is_ok());
        plan.resolved.offload.clear();
        assert!(check_host(&plan, precision, (2, 2), Some(0)).is_ok());
    }
}
