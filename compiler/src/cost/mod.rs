//! The time model: FLOPs over the GPU's rate, bytes over its bandwidth.
//!
//! One micro-step's matmul FLOPs (forward, backward, recompute of
//! checkpointed layers; a frozen weight's gradient is not computed) run at
//! the GPU's dense bf16 rate times the profile's efficiency (fp32 compute runs
//! TF32 at half that rate); memory-bound ops move their bytes at the
//! bandwidth times the profile's efficiency. The optimizer reads and writes
//! parameters, gradients and state once. Data parallelism adds a gradient
//! all-reduce (ring: 2(d-1)/d of the gradient bytes), overlapped with nothing
//! (pessimistic). Invariant: the model is monotone — more FLOPs, bytes or
//! traffic never predict a faster step.

mod fsdp;
pub mod parallel;

use crate::memory::{Candidate, MemoryReport};
use crate::profile::Profile;
use crate::spec::{Dtype, Spec};
use serde::Serialize;

#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TimeEstimate {
    pub step_seconds: f64,
    pub tokens_per_second: f64,
    pub compute_seconds: f64,
    pub memory_seconds: f64,
    pub optimizer_seconds: f64,
    pub communication_seconds: f64,
}

pub fn estimate(
    spec: &Spec,
    cand: &Candidate,
    profile: &Profile,
    report: &MemoryReport,
) -> TimeEstimate {
    let gpu = &spec.hardware.gpu;
    let compute = spec.precision.compute;
    let rate_scale = match compute {
        // fp32 compute runs TF32 tensor cores: half the bf16 rate.
        Dtype::Fp32 | Dtype::Tf32 => 0.5,
        Dtype::Fp8 => 2.0,
        _ => 1.0,
    };
    let flops_rate = gpu.bf16_tflops * 1e12 * profile.matmul_efficiency * rate_scale;
    // The executor's fused attention kernels run at their own measured rate.
    let fused_rate = profile
        .fused_attention_efficiency
        .map_or(flops_rate, |e| gpu.bf16_tflops * 1e12 * e * rate_scale);
    let bw = gpu.bandwidth_bytes_per_s * profile.bandwidth_efficiency;
    let ga = cand.grad_accum.max(1) as f64;
    let fused = report.step_fused_attention_flops;
    let compute_s =
        ga * ((report.step_flops - fused) / flops_rate.max(1.0) + fused / fused_rate.max(1.0));
    let launch_s = ga * report.step_kernels as f64 * profile.kernel_overhead_s;
    let memory_s = ga * report.step_bytes_moved / bw.max(1.0) + launch_s;
    let persistent: u64 = ["weights", "grads", "optimizer"]
        .iter()
        .filter_map(|k| report.breakdown.get(*k))
        .sum();
    let optimizer_s = 2.0 * persistent as f64 / bw.max(1.0);
    let d = cand.data.max(1) as f64;
    let grad_bytes =
        report.params_trainable as f64 * spec.precision.grads.bytes() / cand.tensor.max(1) as f64;
    let link = if spec.hardware.nodes > 1 {
        spec.hardware.inter_node_bytes_per_s
    } else {
        spec.hardware.intra_node_bytes_per_s
    };
    let communication_s = if d > 1.0 {
        2.0 * (d - 1.0) / d * grad_bytes / link.max(1.0)
    } else {
        0.0
    };
    let step = compute_s + memory_s + optimizer_s + communication_s + profile.step_overhead_s;
    let tokens = spec.train.seq_len as f64
        * (cand.micro_batch * spec.train.sequences_per_item()) as f64
        * ga
        * d;
    TimeEstimate {
        step_seconds: step,
        tokens_per_second: tokens / step,
        compute_seconds: compute_s,
        memory_seconds: memory_s,
        optimizer_seconds: optimizer_s,
        communication_seconds: communication_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::evaluate;
    use crate::spec::{Attention, Target};
    use crate::testing::{one_gpu, SpecBuilder};

    /// Under `target burn` the flash kernels' FLOPs run at the profile's fused-attention
    /// rate and the rest at the matmul rate; eager attention has no fused FLOPs.
    #[test]
    fn fused_attention_runs_at_its_own_rate() {
        let profile = Profile::for_target(Target::Burn);
        let (fused_eff, mm_eff) = (
            profile
                .fused_attention_efficiency
                .expect("burn's is measured"),
            profile.matmul_efficiency,
        );
        let mut spec = SpecBuilder::new().target(Target::Burn).build();
        spec.train.attention = Attention::Flash;
        let c = one_gpu(4);
        let r = evaluate(&spec, &c, &profile, false);
        let fused = r.step_fused_attention_flops;
        assert!(
            fused > 0.0 && fused < r.step_flops,
            "{fused} of {}",
            r.step_flops
        );
        let t = estimate(&spec, &c, &profile, &r);
        let all_at_matmul_rate = estimate(
            &spec,
            &c,
            &profile,
            &MemoryReport {
                step_fused_attention_flops: 0.0,
                ..r.clone()
            },
        );
        // The fused FLOPs' time grows by the ratio of the two rates.
        let extra = t.compute_seconds - all_at_matmul_rate.compute_seconds;
        let at_matmul = fused / r.step_flops * all_at_matmul_rate.compute_seconds;
        let ratio = extra / at_matmul;
        assert!((ratio - (mm_eff / fused_eff - 1.0)).abs() < 1e-6, "{ratio}");
        spec.train.attention = Attention::Eager;
        assert_eq!(
            evaluate(&spec, &c, &profile, false).step_fused_attention_flops,
            0.0
        );
    }
}
