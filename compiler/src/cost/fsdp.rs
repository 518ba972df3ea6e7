//! FSDP2's traffic (`target fsdp`), read from `torch/distributed/fsdp/_fully_shard/`:
//!
//! - **all-gathers in `param_dtype`**: `_fsdp_param.py` `all_gather_inputs` casts each
//!   sharded parameter to `MixedPrecisionPolicy.param_dtype` *before* the collective
//!   (`_to_dtype_if_needed`; the foreach fast path of `_fsdp_collectives.py`
//!   `_get_param_all_gather_inputs` copies the fp32 shards into a `param_dtype` buffer), so
//!   the wire carries the 16-bit copy, not the fp32 shard. Every unit is gathered for its
//!   forward; with `reshard_after_forward=True` (`zero = 3`, which rcoa's script passes to
//!   the root too) every unit again for its backward (a layer's recompute included).
//! - **reduce-scatter in `reduce_dtype`**: `foreach_reduce` copies the unit's gradients
//!   into a reduce-scatter input every micro-step, in the shards' dtype (fp32 under the
//!   mixed-precision policy rcoa writes; bf16 shards without a policy reduce in bf16).
//! - **no all-gather after the step**: the optimizer updates the sharded parameters in place.
//! - **`CPUOffloadPolicy`**: each gathered unit's shards come up from pinned host memory in
//!   their own dtype (`sharded_param_data.to(device)`, before the cast), each reduced fp32
//!   gradient shard goes down (`new_sharded_grad.to("cpu")`), and the optimizer steps on
//!   the host over the shards; nothing comes back after the step.

use super::parallel::{Cadence, Collective, Group, Link, Rows, PCIE_BYTES_PER_S};
use crate::memory::{parallel::layer_params, Candidate, MemoryReport};
use crate::spec::{OffloadWhat, Spec};

/// Bytes of the gathered copy of one parameter value: `param_dtype` (the compute dtype)
/// when it is narrower than the stored weights, the weights' dtype otherwise.
pub fn gathered_bytes_per_value(spec: &Spec) -> f64 {
    spec.precision
        .compute
        .bytes()
        .min(spec.precision.params.bytes())
}

/// (parameters of this stage's layers, of its root unit), per tensor-parallel rank.
fn stage_params(spec: &Spec, cand: &Candidate, report: &MemoryReport) -> (f64, f64) {
    let layers = spec.model.layers.div_ceil(cand.pipeline.max(1));
    let in_layers = (layers * layer_params(&spec.model, cand.tensor)).min(report.params_total);
    (
        in_layers as f64,
        report.params_total.saturating_sub(in_layers) as f64,
    )
}

/// FSDP2's data-parallel rows over `n` ranks on `link`.
pub(super) fn data_parallel(
    r: &mut Rows,
    spec: &Spec,
    cand: &Candidate,
    report: &MemoryReport,
    n: u64,
    link: (Link, f64),
) {
    let (layers, root) = stage_params(spec, cand, report);
    let ag = gathered_bytes_per_value(spec);
    let (g, mi) = (Group::Data, Cadence::MicroStep);
    let mut gathers = vec!["FSDP2 all-gather of every unit for its forward, in param_dtype"];
    if crate::memory::engines::fsdp_reshards_after_forward(cand.zero) {
        gathers.push("FSDP2 all-gather of every unit again for its backward (reshard_after_forward=True), in param_dtype");
    }
    for what in gathers {
        let bytes = (layers + root) * ag;
        r.push(Collective::AllGather, what, g, n, link, bytes, 1.0, mi);
    }
    let reduce = spec.precision.params.bytes();
    let w = if reduce >= 4.0 {
        "FSDP2 reduce-scatter of the gradients in reduce_dtype (fp32)"
    } else {
        "FSDP2 reduce-scatter of the gradients in reduce_dtype (the 16-bit shards' dtype)"
    };
    let grads = report.params_trainable as f64 * reduce;
    r.push(Collective::ReduceScatter, w, g, n, link, grads, 1.0, mi);
}

/// `CPUOffloadPolicy`'s host transfers, and the seconds of the host optimizer's step.
pub(super) fn offload(r: &mut Rows, spec: &Spec, cand: &Candidate, report: &MemoryReport) -> f64 {
    if !cand.offloads(OffloadWhat::Params) {
        return 0.0;
    }
    let d = cand.data.max(1) as f64;
    let (layers, root) = stage_params(spec, cand, report);
    let gathered = (layers + root)
        * if crate::memory::engines::fsdp_reshards_after_forward(cand.zero) {
            2.0
        } else {
            1.0
        };
    let pcie = (Link::Pcie, PCIE_BYTES_PER_S);
    let (h, ht, mi) = (Group::Host, Collective::HostTransfer, Cadence::MicroStep);
    let w = "FSDP2 CPU offload: parameter shards uploaded before each all-gather";
    let param_b = spec.precision.params.bytes();
    r.push(ht, w, h, 1, pcie, gathered * param_b / d, 1.0, mi);
    let trainable = report.params_trainable as f64;
    let g = "FSDP2 CPU offload: reduced fp32 gradient shards to the host";
    r.push(ht, g, h, 1, pcie, trainable * 4.0 / d, 1.0, mi);
    // The host step reads and writes the fp32 shard, its gradient and the state.
    let state = trainable * (spec.optimizer.state.bytes() * 2.0 + 4.0) / d;
    state / crate::profile::Profile::for_target(spec.target).host_optimizer_bytes_per_s
}

#[cfg(test)]
mod tests {
    use super::super::parallel::{traffic, Collective};
    use crate::memory::parallel::{evaluate, layer_params};
    use crate::profile::Profile;
    use crate::spec::{Offload, OffloadTo, Spec};
    use crate::testing::one_gpu;

    /// Two layers, hidden 256, on four GPUs of one node, FSDP2 with bf16 gathered copies.
    fn spec(precision: &str) -> Spec {
        let src = format!(
            "model {{ arch = decoder layers = 2 hidden = 256 heads = 4 kv_heads = 4 ffn = 1024 vocab = 1000 tie_embeddings = false }}\n\
             hardware {{ gpu = h100-80gb gpus_per_node = 4 }}\nprecision {precision}\n\
             optimizer adamw {{ lr = 1e-4 }}\ntrain {{ seq_len = 128 global_batch = 16 }}\n\
             parallel {{ zero = 3 }}\ntarget fsdp\n"
        );
        let file = rcoa_grammar::parse("t.plan", &src).unwrap();
        let ctx =
            crate::resolve::ResolveContext::new("t.plan", &src, std::path::PathBuf::from("."));
        crate::resolve::resolve(&file, &ctx).unwrap()
    }

    /// `MixedPrecisionPolicy(param_dtype=bf16)` casts before the all-gather: the wire
    /// carries 2 bytes a value, not the fp32 shard's 4; the gradients go in fp32.
    #[test]
    fn fsdp2_gathers_the_bf16_cast_and_reduces_in_fp32() {
        let s = spec("{ params = fp32 compute = bf16 }");
        let c = crate::memory::Candidate {
            data: 4,
            zero: 3,
            ..one_gpu(1)
        };
        let r = evaluate(&s, &c, &Profile::for_target(s.target), false);
        let rows = traffic(&s, &c, &r).0;
        let layer = layer_params(&s.model, 1) as f64;
        let root = (2 * 1000 * 256 + 256) as f64;
        let bytes_of = |what: &str| {
            rows.iter()
                .find(|x| x.what.contains(what))
                .unwrap_or_else(|| panic!("{what}: {rows:?}"))
                .bytes_per_call
        };
        assert_eq!(bytes_of("forward"), (2.0 * layer + root) * 2.0);
        assert_eq!(bytes_of("backward"), (2.0 * layer + root) * 2.0);
        assert_eq!(bytes_of("reduce-scatter"), r.params_trainable as f64 * 4.0);
        assert_eq!(r.params_trainable as f64, 2.0 * layer + root);
        // Each rank sends (n-1)/n of each: 3/4.
        let ag = rows
            .iter()
            .find(|x| x.collective == Collective::AllGather)
            .unwrap();
        assert_eq!(ag.sent_bytes_per_call, ag.bytes_per_call * 0.75);
        assert!(!rows.iter().any(|x| x.what.contains("updated")), "{rows:?}");
        // fp32 compute gathers fp32; zero = 2 keeps layers gathered: no backward gather.
        let fp32 = spec("{ params = fp32 compute = fp32 }");
        let r32 = evaluate(&fp32, &c, &Profile::for_target(fp32.target), false);
        let rows32 = traffic(&fp32, &c, &r32).0;
        assert_eq!(rows32[0].bytes_per_call, (2.0 * layer + root) * 4.0);
        let z2 = crate::memory::Candidate {
            zero: 2,
            ..c.clone()
        };
        let rows2 = traffic(&s, &z2, &r).0;
        assert!(
            !rows2.iter().any(|x| x.what.contains("backward")),
            "{rows2:?}"
        );
    }

    /// `CPUOffloadPolicy`: the fp32 shards come up before each gather, the fp32 gradient
    /// shards go down every micro-step, the step runs on the host; nothing else moves.
    #[test]
    fn fsdp2_cpu_offload_moves_shards_not_updated_weights() {
        let s = spec("{ params = fp32 compute = bf16 }");
        let offload = crate::profile::engines::FSDP_CPU_OFFLOAD
            .iter()
            .map(|&what| Offload {
                what,
                to: OffloadTo::Cpu,
            })
            .collect();
        let c = crate::memory::Candidate {
            data: 4,
            zero: 3,
            offload,
            ..one_gpu(1)
        };
        let r = evaluate(&s, &c, &Profile::for_target(s.target), false);
        let (rows, host_s) = traffic(&s, &c, &r);
        let host: Vec<_> = rows
            .iter()
            .filter(|x| x.collective == Collective::HostTransfer)
            .collect();
        assert_eq!(host.len(), 2, "{host:?}");
        let layer = layer_params(&s.model, 1) as f64;
        let root = (2 * 1000 * 256 + 256) as f64;
        // Forward: both layers and the root; backward: all of them again; fp32, 1/4 each.
        assert_eq!(
            host[0].bytes_per_call,
            (4.0 * layer + 2.0 * root) * 4.0 / 4.0
        );
        assert_eq!(
            host[1].bytes_per_call,
            r.params_trainable as f64 * 4.0 / 4.0
        );
        assert!(host_s > 0.0);
    }
}
