//! The time model: FLOPs over the GPU's rate, bytes over its bandwidth.
//!
//! One micro-step's matmul FLOPs (forward, backward, recompute of
//! checkpointed layers; a frozen weight's gradient is not computed) run at
//! the GPU's dense rate for the compute type (fp32 runs TF32 at half the bf16
//! rate) times the profile's efficiency, which may differ for fp32, for eager
//! attention's products and for fused attention; memory-bound ops move their
//! bytes at the bandwidth times the profile's efficiency. The optimizer reads and writes
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
    let peak = gpu.dense_tflops(spec.precision.compute) * 1e12;
    let linear_efficiency = match spec.precision.compute {
        Dtype::Fp32 | Dtype::Tf32 => profile
            .fp32_matmul_efficiency
            .unwrap_or(profile.matmul_efficiency),
        _ => profile.matmul_efficiency,
    };
    let flops_rate = peak * linear_efficiency;
    // Eager attention's products where the executor runs them at their own rate.
    let attention_rate = profile
        .attention_matmul_efficiency
        .map_or(flops_rate, |e| peak * e);
    // The executor's fused attention kernels run at their own measured rate.
    let fused_rate = profile
        .fused_attention_efficiency
        .map_or(flops_rate, |e| peak * e);
    let rows_rate = profile
        .fused_attention_rows_efficiency
        .map_or(fused_rate, |e| gpu.cuda_core_tflops() * 1e12 * e);
    let bw = gpu.bandwidth_bytes_per_s * profile.bandwidth_efficiency;
    let ga = cand.grad_accum.max(1) as f64;
    let (fused, rows, attention) = (
        report.step_fused_attention_flops,
        report.step_fused_attention_rows_flops,
        report.step_attention_matmul_flops,
    );
    let compute_s = ga
        * ((report.step_flops - fused - rows - attention) / flops_rate.max(1.0)
            + fused / fused_rate.max(1.0)
            + rows / rows_rate.max(1.0)
            + attention / attention_rate.max(1.0));
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

    /// A sliding window shorter than the sequence under `target burn`'s flash: the kernels
    /// compute `Σ_i min(i + 1, w)` scores, not half the square, at the fused rate; one as
    /// long as the sequence is full causal attention.
    #[test]
    fn a_window_computes_only_its_scores() {
        let profile = Profile::for_target(Target::Burn);
        let mut spec = SpecBuilder::new().target(Target::Burn).build();
        spec.train.attention = Attention::Flash;
        let c = one_gpu(2);
        let full = evaluate(&spec, &c, &profile, false);
        let s = spec.train.seq_len;
        let w = s / 4;
        spec.model.numerics.sliding_window = Some(w);
        let r = evaluate(&spec, &c, &profile, false);
        let share = (w * (w + 1) / 2 + (s - w) * w) as f64 / (s * s) as f64;
        let ratio = r.step_fused_attention_flops / full.step_fused_attention_flops;
        assert!((ratio - share / 0.5).abs() < 1e-9, "{ratio} {share}");
        let (t_full, t_win) = (
            estimate(&spec, &c, &profile, &full).compute_seconds,
            estimate(&spec, &c, &profile, &r).compute_seconds,
        );
        let rate = spec.hardware.gpu.dense_tflops(spec.precision.compute)
            * 1e12
            * profile.fused_attention_efficiency.expect("measured");
        let saved = (full.step_fused_attention_flops - r.step_fused_attention_flops) / rate;
        assert!(
            ((t_full - t_win) / saved - 1.0).abs() < 1e-9,
            "{t_full} {t_win} {saved}"
        );
        spec.model.numerics.sliding_window = Some(s);
        let same = evaluate(&spec, &c, &profile, false);
        assert_eq!(
            same.step_fused_attention_flops,
            full.step_fused_attention_flops
        );
    }

    /// Under `target burn` eager attention's two products run at their own rate and the
    /// linear layers at the compute type's: fp32 at `fp32_matmul_efficiency` of the TF32
    /// rate, bf16 at `matmul_efficiency` of the bf16 rate. Flash plans have no such FLOPs.
    #[test]
    fn eager_attention_and_fp32_products_run_at_their_own_rates() {
        let profile = Profile::for_target(Target::Burn);
        let att_eff = profile
            .attention_matmul_efficiency
            .expect("burn's is fitted");
        let c = one_gpu(4);
        let compute_s = |compute: Dtype, attention: Attention| {
            let mut spec = SpecBuilder::new()
                .target(Target::Burn)
                .precision(Dtype::Fp32, compute, None)
                .build();
            spec.train.attention = attention;
            let r = evaluate(&spec, &c, &profile, false);
            let t = estimate(&spec, &c, &profile, &r);
            (
                r,
                t.compute_seconds,
                spec.hardware.gpu.dense_tflops(compute) * 1e12,
            )
        };
        for (compute, eff) in [
            (Dtype::Bf16, profile.matmul_efficiency),
            (Dtype::Fp32, profile.fp32_matmul_efficiency.expect("fitted")),
        ] {
            let (r, seconds, peak) = compute_s(compute, Attention::Eager);
            let att = r.step_attention_matmul_flops;
            assert!(att > 0.0 && att < r.step_flops, "{att} of {}", r.step_flops);
            let expected = (r.step_flops - att) / (peak * eff) + att / (peak * att_eff);
            assert!(
                (seconds / expected - 1.0).abs() < 1e-9,
                "{compute:?}: {seconds} {expected}"
            );
        }
        let (flash, _, _) = compute_s(Dtype::Bf16, Attention::Flash);
        assert_eq!(flash.step_attention_matmul_flops, 0.0);
    }

    /// A step computes at its compute type's rate: fp16 on a V100's tensor cores is 8 x
    /// its bf16 (the CUDA cores'), fp32 there runs on the CUDA cores too, and on an H100
    /// fp32 is TF32 at half the bf16 rate.
    #[test]
    fn each_compute_type_runs_at_its_own_rate() {
        let gpu = |name| crate::catalog::gpu(name).expect("a catalog GPU").spec();
        let (v100, h100) = (gpu("v100-32gb"), gpu("h100-80gb"));
        assert_eq!(v100.dense_tflops(Dtype::Fp16), 125.0);
        assert_eq!(v100.dense_tflops(Dtype::Bf16), 15.7);
        assert_eq!(v100.dense_tflops(Dtype::Fp32), 15.7);
        assert_eq!(h100.dense_tflops(Dtype::Fp16), 989.4);
        assert_eq!(h100.dense_tflops(Dtype::Tf32), 494.7);
        let custom = crate::spec::GpuSpec::custom("custom", 1 << 34, 100.0, 1e12);
        assert_eq!(custom.dense_tflops(Dtype::Fp16), 100.0);
        assert_eq!(custom.dense_tflops(Dtype::Fp32), 50.0);

        let profile = Profile::for_target(Target::Pytorch);
        let compute_s = |compute: Dtype| {
            let mut spec = SpecBuilder::new()
                .precision(Dtype::Fp32, compute, None)
                .build();
            spec.hardware.gpu = v100.clone();
            let c = one_gpu(2);
            let r = evaluate(&spec, &c, &profile, false);
            estimate(&spec, &c, &profile, &r).compute_seconds
        };
        let ratio = compute_s(Dtype::Bf16) / compute_s(Dtype::Fp16);
        assert!((ratio - 125.0 / 15.7).abs() < 1e-6, "{ratio}");
    }

    /// Where the executor's tensor-core flash kernels do not fit the GPU's shared memory
    /// (head dim 128 on an L40S), its `Rows` kernels run on the CUDA cores at
    /// `fused_attention_rows_efficiency` of their fp32 rate; at head dim 64 the tensor-core
    /// kernels run at `fused_attention_efficiency` of the bf16 rate.
    #[test]
    fn fused_attention_on_the_cuda_cores_runs_at_their_rate() {
        let profile = Profile::for_target(Target::Burn);
        let l40s = crate::catalog::gpu("l40s-48gb")
            .expect("a catalog GPU")
            .spec();
        let run = |head_dim| {
            let mut spec = SpecBuilder::new()
                .target(Target::Burn)
                .head_dim(head_dim)
                .build();
            spec.hardware.gpu = l40s.clone();
            spec.train.attention = Attention::Flash;
            let c = one_gpu(2);
            let r = evaluate(&spec, &c, &profile, false);
            let t = estimate(&spec, &c, &profile, &r);
            let none = MemoryReport {
                step_fused_attention_flops: 0.0,
                step_fused_attention_rows_flops: 0.0,
                step_flops: r.step_flops
                    - r.step_fused_attention_flops
                    - r.step_fused_attention_rows_flops,
                ..r.clone()
            };
            let attention_s =
                t.compute_seconds - estimate(&spec, &c, &profile, &none).compute_seconds;
            (r, attention_s)
        };
        let (rows, rows_s) = run(128);
        assert_eq!(rows.step_fused_attention_flops, 0.0);
        let rate = 91.6e12 * profile.fused_attention_rows_efficiency.expect("measured");
        let expected = rows.step_fused_attention_rows_flops / rate;
        assert!(
            expected > 0.0 && (rows_s / expected - 1.0).abs() < 1e-9,
            "{rows_s} {expected}"
        );
        let (tensor, tensor_s) = run(64);
        assert_eq!(tensor.step_fused_attention_rows_flops, 0.0);
        let rate = 362.05e12 * profile.fused_attention_efficiency.expect("measured");
        let expected = tensor.step_fused_attention_flops / rate;
        assert!(
            expected > 0.0 && (tensor_s / expected - 1.0).abs() < 1e-9,
            "{tensor_s} {expected}"
        );
    }
}
