//! Whether the GPU a run trains on is the one its plan was compiled for.
//!
//! The compiler predicts the peak, the `fits` verdict and the kernels' choice
//! for the plan's `hardware.gpu`; `rcoa run` trains on whatever GPU it finds.
//! A plan for an H100 run on a 48 GB card may run out of memory where the
//! plan said it fits, and the measured peak beside the predicted one then
//! compares different things. The run says so before it starts.

use rcoa_compiler::catalog::catalog;
use rcoa_compiler::report::gib;
use rcoa_compiler::spec::GpuSpec;

/// Memory within this fraction of the plan's is the plan's (drivers and ECC move it
/// by a few MiB).
const SAME_MEMORY: f64 = 0.005;

/// A note when the device (`name` as CUDA gives it, `memory_bytes` its total)
/// is not the plan's GPU: a different catalog entry, or, where the catalog does
/// not know it, different memory. `None` where they agree.
pub fn plan_gpu_note(plan: &GpuSpec, name: &str, memory_bytes: u64) -> Option<String> {
    let entry = catalog().gpu_by_device_name(name);
    let ratio = memory_bytes as f64 / plan.memory_bytes as f64;
    let same_memory = (ratio - 1.0).abs() <= SAME_MEMORY;
    match entry {
        Some(e) if e.name == plan.name => return None,
        None if same_memory => return None,
        _ => {}
    }
    let known = entry.map_or(String::new(), |e| format!(", `{}` in the catalog", e.name));
    let less = if ratio < 1.0 - SAME_MEMORY {
        " This GPU has less memory: the run may run out of memory where the plan fits."
    } else {
        ""
    };
    let compile = entry.map_or(String::new(), |e| {
        format!(
            " Compile the plan with `hardware {{ gpu = {} }}` to predict for this GPU.",
            e.name
        )
    });
    Some(format!(
        "the plan was compiled for {} ({}); this GPU is {name} ({}{known}): \
         the predicted peak, the `fits` verdict and the kernels' choice are for {}.{less}{compile}",
        plan.name,
        gib(plan.memory_bytes),
        gib(memory_bytes),
        plan.name,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(name: &str) -> GpuSpec {
        catalog().gpu(name).expect("a catalog GPU").spec()
    }

    #[test]
    fn the_plans_own_gpu_needs_no_note() {
        let h100 = gpu("h100-80gb");
        assert_eq!(
            plan_gpu_note(&h100, "NVIDIA H100 80GB HBM3", h100.memory_bytes),
            None
        );
        // A custom GPU of the device's memory, and a device the catalog does not know.
        let custom = GpuSpec::custom("custom", 85_000_000_000, 800.0, 2e12);
        assert_eq!(
            plan_gpu_note(&custom, "NVIDIA H100 PCIe", 85_020_000_000),
            None
        );
    }

    #[test]
    fn a_smaller_catalog_gpu_is_named_with_the_risk_and_the_fix() {
        let note = plan_gpu_note(
            &gpu("h100-80gb"),
            "NVIDIA L40S",
            gpu("l40s-48gb").memory_bytes,
        )
        .expect("a note");
        assert_eq!(
            note,
            "the plan was compiled for h100-80gb (79.18 GiB); this GPU is NVIDIA L40S \
             (44.53 GiB, `l40s-48gb` in the catalog): the predicted peak, the `fits` verdict \
             and the kernels' choice are for h100-80gb. This GPU has less memory: the run may \
             run out of memory where the plan fits. Compile the plan with \
             `hardware { gpu = l40s-48gb }` to predict for this GPU."
        );
    }

    #[test]
    fn a_larger_or_unknown_gpu_is_named_without_a_fix_it_cannot_give() {
        let h200 = gpu("h200-141gb");
        let note =
            plan_gpu_note(&gpu("h100-80gb"), "NVIDIA H200", h200.memory_bytes).expect("a note");
        assert!(
            !note.contains("less memory") && note.contains("gpu = h200-141gb"),
            "{note}"
        );
        let note = plan_gpu_note(&gpu("h100-80gb"), "NVIDIA A10", 23_836_098_560).expect("a note");
        assert!(
            note.contains("NVIDIA A10 (22.20 GiB)")
                && note.contains("less memory")
                && !note.contains("Compile"),
            "{note}"
        );
    }
}
