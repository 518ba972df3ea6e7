//! Where a CUDA step's time goes (`rcoa run --profile-kernels`): every
//! kernel's time on the GPU, measured by a pair of CUDA events around its
//! launch (the vendored cubecl-cuda's `kernel_timing`), summed per step and
//! grouped into families (matmuls, attention, fused element-wise, ...).
//!
//! The timing is process-wide, like CubeCL's configuration, so it is chosen
//! once per process ([`select`]) for a run of one rank. This module holds
//! what needs no GPU: the grouping, the per-step sums and the report, so
//! they are tested on any machine.

use serde::Serialize;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};

static SELECTED: AtomicBool = AtomicBool::new(false);

/// Time every kernel of this process's CUDA run (`rcoa run --profile-kernels`).
pub fn select(on: bool) {
    SELECTED.store(on, Ordering::Relaxed);
}

pub fn selected() -> bool {
    SELECTED.load(Ordering::Relaxed)
}

/// Whether a run of `devices` ranks in this process can be profiled: the
/// timing is process-wide, so only one rank's kernels may be timed.
pub fn one_rank(devices: u32) -> Result<(), String> {
    if devices > 1 {
        Err(
            "--profile-kernels times every kernel of the process, so it profiles one rank: \
             run it with --devices 1"
                .into(),
        )
    } else {
        Ok(())
    }
}

/// What a kernel does, from its name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// Matrix products (cubek-matmul, fused matmuls, GEMV).
    Matmul,
    /// rcoa's flash-attention kernels, cubek-attention.
    Attention,
    /// Burn's fusion: element-wise chains compiled into one kernel.
    FusedElementwise,
    /// One element-wise op per kernel (what fusion did not take).
    Elementwise,
    /// Sums, means, maxima, softmax's reductions, fused reductions.
    Reduction,
    /// Moving bytes: copies to contiguous, slices, gathers, casts, fills.
    Layout,
    /// Random numbers (dropout masks, initialisation).
    Random,
    Other,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Matmul => "matmul",
            Family::Attention => "attention",
            Family::FusedElementwise => "fused element-wise",
            Family::Elementwise => "element-wise",
            Family::Reduction => "reduction",
            Family::Layout => "layout (copy, slice, cast)",
            Family::Random => "random",
            Family::Other => "other",
        }
    }
}

/// The family of the kernel named `name` (a Rust type name, as CubeCL's
/// kernels are named). The kernel's own type comes first, its generic
/// arguments after, so only the part before the first `<` is read: a fused
/// kernel's arguments may name a matmul's types.
pub fn family(name: &str) -> Family {
    let own = name.split('<').next().unwrap_or(name).to_ascii_lowercase();
    let has = |words: &[&str]| words.iter().any(|w| own.contains(w));
    if has(&["flash", "attention"]) {
        Family::Attention
    } else if has(&["matmul", "gemv", "gemm", "conv"]) {
        Family::Matmul
    } else if has(&["elemwise_fuse", "elemwisefuse"]) {
        Family::FusedElementwise
    } else if has(&[
        "reduce",
        "shared_sum",
        "softmax",
        "cumulative",
        "argmax",
        "argmin",
    ]) {
        Family::Reduction
    } else if has(&["prng", "random", "uniform", "bernoulli", "normal"]) {
        Family::Random
    } else if has(&[
        "copy",
        "contiguous",
        "slice",
        "gather",
        "select",
        "scatter",
        // rcoa's embedding gradient: a scatter-add, as Burn's `select_assign` it replaces.
        "embedding",
        "cast",
        "repeat",
        "flip",
        "full_kernel",
        "fullkernel",
        "mask",
        "permute",
        "transpose",
        "concat",
    ]) {
        Family::Layout
    } else if has(&[
        "unary",
        "binop",
        // rcoa's RoPE: the rotation that replaced a flip (layout) and its fused products.
        "rope_kernel",
        "ropekernel",
        "kernel_cmp",
        "kernelcmp",
        "scalar",
        "predicate",
    ]) {
        Family::Elementwise
    } else {
        Family::Other
    }
}

/// `name` without module paths: `a::b::Foo<c::Bar, d::Baz<e::F>>` becomes
/// `Foo<Bar, Baz<F>>`.
pub fn short_name(name: &str) -> String {
    let mut out = String::with_capacity(name.len());
    let mut word = String::new();
    let flush = |word: &mut String, out: &mut String| {
        out.push_str(word.rsplit("::").next().unwrap_or(word));
        word.clear();
    };
    for c in name.chars() {
        if c.is_alphanumeric() || c == '_' || c == ':' {
            word.push(c);
        } else {
            flush(&mut word, &mut out);
            out.push(c);
        }
    }
    flush(&mut word, &mut out);
    out
}

/// One kernel's launches in one step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KernelStat {
    pub name: String,
    pub launches: u64,
    pub seconds: f64,
}

/// The kernels one step launched, summed by kernel, and the step's time on
/// the host's clock.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StepKernels {
    pub step: u64,
    pub step_seconds: f64,
    /// By total time, longest first.
    pub kernels: Vec<KernelStat>,
}

impl StepKernels {
    /// From each launch's (kernel name, GPU seconds).
    pub fn new<'a>(
        step: u64,
        step_seconds: f64,
        launches: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> Self {
        let mut by: BTreeMap<&str, (u64, f64)> = BTreeMap::new();
        for (name, s) in launches {
            let e = by.entry(name).or_default();
            e.0 += 1;
            e.1 += s;
        }
        let mut kernels: Vec<KernelStat> = by
            .into_iter()
            .map(|(name, (launches, seconds))| KernelStat {
                name: name.to_string(),
                launches,
                seconds,
            })
            .collect();
        kernels.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
        StepKernels {
            step,
            step_seconds,
            kernels,
        }
    }

    pub fn kernel_seconds(&self) -> f64 {
        self.kernels.iter().map(|k| k.seconds).sum()
    }

    pub fn launches(&self) -> u64 {
        self.kernels.iter().map(|k| k.launches).sum()
    }
}

/// A family's or a kernel's share of the steps profiled, per step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Row {
    /// The family (`Family::as_str`) or the kernel's `short_name`.
    pub name: String,
    pub family: Family,
    pub seconds_per_step: f64,
    pub launches_per_step: f64,
    /// Of the kernels' time.
    pub share: f64,
}

/// The steady steps' kernels, averaged per step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KernelProfile {
    /// The steps averaged (the first is left out when there are others: it
    /// compiles and tunes).
    pub steps: Vec<u64>,
    /// Mean step time on the host's clock.
    pub step_seconds: f64,
    /// Mean sum of the kernels' GPU times per step.
    pub kernel_seconds: f64,
    pub launches_per_step: f64,
    /// `kernel_seconds / step_seconds`: below 1, the GPU waited for the host
    /// (launch overhead, syncs, copies between host and device) for the
    /// rest of the step.
    pub busy: f64,
    /// Longest first.
    pub families: Vec<Row>,
    /// The longest kernels, longest first ([`KernelProfile::TOP`] at most).
    pub kernels: Vec<Row>,
    /// The compiler's count of the step's matmul and attention FLOPs, when
    /// known.
    pub plan_flops_per_step: Option<f64>,
    /// `plan_flops_per_step` over the matmul and attention kernels' time.
    pub compute_tflops: Option<f64>,
    /// `plan_flops_per_step` over the step time.
    pub step_tflops: Option<f64>,
}

impl KernelProfile {
    pub const TOP: usize = 25;

    /// None when no step was profiled.
    pub fn new(steps: &[StepKernels], plan_flops_per_step: Option<f64>) -> Option<Self> {
        let used: &[StepKernels] = if steps.len() > 1 { &steps[1..] } else { steps };
        if used.is_empty() {
            return None;
        }
        let n = used.len() as f64;
        let mean = |f: &dyn Fn(&StepKernels) -> f64| used.iter().map(f).sum::<f64>() / n;
        let step_seconds = mean(&|s| s.step_seconds);
        let kernel_seconds = mean(&|s| s.kernel_seconds());
        let share = |s: f64| {
            if kernel_seconds > 0.0 {
                s / kernel_seconds
            } else {
                0.0
            }
        };

        let mut families: BTreeMap<Family, (f64, u64)> = BTreeMap::new();
        let mut kernels: BTreeMap<&str, (f64, u64)> = BTreeMap::new();
        for k in used.iter().flat_map(|s| &s.kernels) {
            let f = families.entry(family(&k.name)).or_default();
            f.0 += k.seconds;
            f.1 += k.launches;
            let e = kernels.entry(&k.name).or_default();
            e.0 += k.seconds;
            e.1 += k.launches;
        }
        let rows = |name: String, family: Family, (seconds, launches): (f64, u64)| Row {
            name,
            family,
            seconds_per_step: seconds / n,
            launches_per_step: launches as f64 / n,
            share: share(seconds / n),
        };
        let longest_first = |v: &mut Vec<Row>| {
            v.sort_by(|a, b| {
                b.seconds_per_step
                    .total_cmp(&a.seconds_per_step)
                    .then_with(|| a.name.cmp(&b.name))
            })
        };
        let mut families: Vec<Row> = families
            .into_iter()
            .map(|(f, v)| rows(f.as_str().to_string(), f, v))
            .collect();
        longest_first(&mut families);
        let mut kernels: Vec<Row> = kernels
            .into_iter()
            .map(|(name, v)| rows(short_name(name), family(name), v))
            .collect();
        longest_first(&mut kernels);
        kernels.truncate(Self::TOP);

        let compute_seconds: f64 = families
            .iter()
            .filter(|r| matches!(r.family, Family::Matmul | Family::Attention))
            .map(|r| r.seconds_per_step)
            .sum();
        let rate = |flops: f64, s: f64| (s > 0.0).then(|| flops / s / 1e12);
        Some(KernelProfile {
            steps: used.iter().map(|s| s.step).collect(),
            step_seconds,
            kernel_seconds,
            launches_per_step: mean(&|s| s.launches() as f64),
            busy: if step_seconds > 0.0 {
                kernel_seconds / step_seconds
            } else {
                0.0
            },
            families,
            kernels,
            plan_flops_per_step,
            compute_tflops: plan_flops_per_step.and_then(|f| rate(f, compute_seconds)),
            step_tflops: plan_flops_per_step.and_then(|f| rate(f, step_seconds)),
        })
    }

    /// The report for people; `peak_tflops`: the GPU's dense rate in the step's compute type, to
    /// put the rates beside.
    pub fn render(&self, peak_tflops: Option<f64>) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let steps = match (self.steps.first(), self.steps.last()) {
            (Some(a), Some(b)) if a != b => format!("steps {a}-{b}"),
            (Some(a), _) => format!("step {a}"),
            _ => String::new(),
        };
        let _ = writeln!(
            s,
            "kernels          {:.4} s on the GPU per {:.4} s step ({:.0}% busy), {:.0} launches a step; {steps}, timed by CUDA events",
            self.kernel_seconds,
            self.step_seconds,
            self.busy * 100.0,
            self.launches_per_step
        );
        let of_peak = |t: f64| {
            peak_tflops.filter(|p| *p > 0.0).map_or(String::new(), |p| {
                format!(" ({:.0}% of the GPU's {p:.0})", t / p * 100.0)
            })
        };
        if let (Some(f), Some(c), Some(st)) = (
            self.plan_flops_per_step,
            self.compute_tflops,
            self.step_tflops,
        ) {
            let _ = writeln!(
                s,
                "                 the plan's {:.2} TFLOP a step: {c:.1} TFLOP/s in the matmul and attention kernels{}, {st:.1} over the whole step{}",
                f / 1e12,
                of_peak(c),
                of_peak(st)
            );
        }
        let table = |s: &mut String, title: &str, rows: &[Row], width: usize| {
            let _ = writeln!(
                s,
                "  {title:<width$}  {:>10}  {:>6}  {:>9}  {:>10}",
                "per step", "share", "launches", "per launch"
            );
            for r in rows {
                let name: String = if r.name.chars().count() > width {
                    let cut: String = r.name.chars().take(width - 1).collect();
                    format!("{cut}…")
                } else {
                    r.name.clone()
                };
                let per_launch = if r.launches_per_step > 0.0 {
                    r.seconds_per_step / r.launches_per_step
                } else {
                    0.0
                };
                let _ = writeln!(
                    s,
                    "  {name:<width$}  {:>8.2}ms  {:>5.1}%  {:>9.1}  {:>8.1}µs",
                    r.seconds_per_step * 1e3,
                    r.share * 100.0,
                    r.launches_per_step,
                    per_launch * 1e6
                );
            }
        };
        table(&mut s, "family", &self.families, 28);
        table(&mut s, "kernel (longest first)", &self.kernels, 60);
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Type names as CubeCL's kernels carry them (`core::any::type_name` of
    // the struct `#[cube(launch)]` generates), shortened where long.
    const MATMUL: &str = "cubek_matmul::components::batch::partitioned_matmul::matmul::matmul_entry::MatmulEntry<cubek_matmul::launch::TensorArgs, half::binary16::bf16, cubek_matmul::components::global::single_stage::simple::setup::SimpleMatmulFamily<cubek_matmul::components::stage::Plane>, cubecl_cuda::runtime::CudaRuntime>";
    const FUSED: &str = "burn_cubecl_fusion::engine::codegen::kernel::elemwise_fuse::ElemwiseFuse<cubecl_cuda::runtime::CudaRuntime>";
    const FLASH: &str = "rcoa_backend::kernels::flash::forward_blocks::flash_forward_blocks::FlashForwardBlocks<half::binary16::bf16, cubecl_cuda::runtime::CudaRuntime>";

    #[test]
    fn families_come_from_the_kernels_own_type() {
        assert_eq!(family(MATMUL), Family::Matmul);
        assert_eq!(family(FUSED), Family::FusedElementwise);
        assert_eq!(family(FLASH), Family::Attention);
        assert_eq!(
            family("burn_cubecl_fusion::optim::reduce::kernel::reduce_kernel_fused::ReduceKernelFused<R>"),
            Family::Reduction
        );
        assert_eq!(
            family("cubecl_std::tensor::contiguous::copy_kernel::CopyKernel<f32, R>"),
            Family::Layout
        );
        assert_eq!(
            family("burn_cubecl::kernel::cast::base::cast_element::CastElement<f32, bf16, R>"),
            Family::Layout
        );
        assert_eq!(
            family("burn_cubecl::kernel::binary::kernel_binop::KernelBinop<f32, Add, R>"),
            Family::Elementwise
        );
        assert_eq!(
            family("cubek_random::base::prng_kernel::PrngKernel<R>"),
            Family::Random
        );
        assert_eq!(
            family("rcoa_backend::kernels::embedding::fused::embedding_grad_kernel::EmbeddingGradKernel<R>"),
            Family::Layout
        );
        assert_eq!(
            family("rcoa_backend::kernels::rope::fused::rope_kernel::RopeKernel<R>"),
            Family::Elementwise
        );
        assert_eq!(family("some_crate::Mystery<u8>"), Family::Other);
        // `RCOA_MATMUL=cublas`: timed by `kernels::gemm::cublas` under this name.
        assert_eq!(family("cublas_gemm"), Family::Matmul);
        // A fused kernel named after a matmul in its arguments is still fused.
        assert_eq!(
            family("burn_cubecl_fusion::x::elemwise_fuse::ElemwiseFuse<cubek_matmul::Matmul>"),
            Family::FusedElementwise
        );
    }

    #[test]
    fn short_names_drop_module_paths_everywhere() {
        assert_eq!(
            short_name("a::b::Foo<c::Bar, d::Baz<e::F>>"),
            "Foo<Bar, Baz<F>>"
        );
        assert_eq!(short_name("Plain"), "Plain");
        assert_eq!(short_name(FLASH), "FlashForwardBlocks<bf16, CudaRuntime>");
        assert_eq!(short_name("&[a::B; 2]"), "&[B; 2]");
    }

    fn step(step: u64, wall: f64, launches: &[(&'static str, f64)]) -> StepKernels {
        StepKernels::new(step, wall, launches.iter().copied())
    }

    #[test]
    fn a_step_sums_launches_by_kernel_longest_first() {
        let s = step(1, 1.0, &[(FUSED, 0.1), (MATMUL, 0.3), (FUSED, 0.15)]);
        assert_eq!(s.launches(), 3);
        assert!((s.kernel_seconds() - 0.55).abs() < 1e-12);
        assert_eq!(s.kernels[0].name, MATMUL);
        assert_eq!(s.kernels[1].launches, 2);
        assert!((s.kernels[1].seconds - 0.25).abs() < 1e-12);
    }

    #[test]
    fn the_profile_averages_the_steps_after_the_first() {
        let steps = [
            // Compiles and tunes: left out.
            step(1, 9.0, &[(MATMUL, 5.0), (FUSED, 3.0)]),
            step(
                2,
                0.2,
                &[(MATMUL, 0.10), (FUSED, 0.02), (FUSED, 0.02), (FLASH, 0.03)],
            ),
            step(3, 0.3, &[(MATMUL, 0.12), (FUSED, 0.04), (FLASH, 0.06)]),
        ];
        let p = KernelProfile::new(&steps, Some(20e12)).expect("steps");
        assert_eq!(p.steps, vec![2, 3]);
        assert!((p.step_seconds - 0.25).abs() < 1e-12);
        assert!((p.kernel_seconds - 0.195).abs() < 1e-12);
        assert!((p.busy - 0.78).abs() < 1e-12);
        assert!((p.launches_per_step - 3.5).abs() < 1e-12);
        let names: Vec<&str> = p.families.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["matmul", "attention", "fused element-wise"]);
        let m = &p.families[0];
        assert!((m.seconds_per_step - 0.11).abs() < 1e-12);
        assert!((m.share - 0.11 / 0.195).abs() < 1e-12);
        assert!((p.families[2].launches_per_step - 1.5).abs() < 1e-12);
        let total: f64 = p.families.iter().map(|r| r.share).sum();
        assert!((total - 1.0).abs() < 1e-12);
        // 20 TFLOP over 0.11 s of matmuls and 0.045 s of attention a step.
        assert!((p.compute_tflops.expect("flops") - 20.0 / 0.155).abs() < 1e-9);
        assert!((p.step_tflops.expect("flops") - 80.0).abs() < 1e-9);
        assert_eq!(p.kernels[0].name, short_name(MATMUL));
    }

    #[test]
    fn one_step_is_used_when_it_is_all_there_is() {
        let p = KernelProfile::new(&[step(1, 2.0, &[(MATMUL, 1.0)])], None).expect("a step");
        assert_eq!(p.steps, vec![1]);
        assert_eq!(p.compute_tflops, None);
        assert!(KernelProfile::new(&[], None).is_none());
    }

    #[test]
    fn no_kernels_gives_zero_shares_not_nan() {
        let p =
            KernelProfile::new(&[step(1, 1.0, &[]), step(2, 1.0, &[])], Some(1e12)).expect("steps");
        assert_eq!(p.kernel_seconds, 0.0);
        assert!(p.families.is_empty());
        assert_eq!(p.compute_tflops, None);
        assert_eq!(p.step_tflops, Some(1.0));
        assert!(!p.render(Some(989.0)).contains("NaN"));
    }

    #[test]
    fn only_the_longest_kernels_are_kept() {
        let names: Vec<String> = (0..40).map(|i| format!("k::Kernel{i:02}")).collect();
        let launches: Vec<(&str, f64)> = names
            .iter()
            .enumerate()
            .map(|(i, n)| (n.as_str(), i as f64 * 1e-3))
            .collect();
        let s = StepKernels::new(1, 1.0, launches);
        let p = KernelProfile::new(&[s], None).expect("a step");
        assert_eq!(p.kernels.len(), KernelProfile::TOP);
        assert_eq!(p.kernels[0].name, "Kernel39");
        // Every kernel still counts in its family.
        assert_eq!(p.families[0].launches_per_step, 40.0);
    }

    #[test]
    fn the_report_for_people() {
        let steps = [
            step(1, 9.0, &[(MATMUL, 5.0)]),
            step(
                2,
                0.2,
                &[(MATMUL, 0.10), (FUSED, 0.02), (FUSED, 0.02), (FLASH, 0.03)],
            ),
            step(3, 0.3, &[(MATMUL, 0.12), (FUSED, 0.04), (FLASH, 0.06)]),
        ];
        let p = KernelProfile::new(&steps, Some(20e12)).expect("steps");
        insta::assert_snapshot!(p.render(Some(989.4)));
    }
}
