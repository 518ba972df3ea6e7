//! RoPE over part of each head (Phi-4-mini's `partial_rotary_factor`) under LongRoPE,
//! against the `burn` profile: the executor's gather path keeps nothing the whole-head
//! path does not, beyond its wider tables and the swap index. Measured with the counting
//! allocator in a process of its own.

use super::in_backward::{measured_peak, predicted_peak};
use super::serial;

const CHILD: &str = "RCOA_PARTIAL_ROPE_MEASURE_CHILD";

/// A Phi-3 config (heads of 64 over a 128-wide model) written beside the test's plan:
/// whole heads rotated, or half of each under LongRoPE past its pretraining length.
fn plan(dir: &std::path::Path, partial: bool) -> String {
    let rope = if partial {
        let list = |v: f64| format!("[{}]", vec![v.to_string(); 16].join(", "));
        format!(
            r#""original_max_position_embeddings": 128, "partial_rotary_factor": 0.5,
               "rope_scaling": {{"type": "longrope", "short_factor": {}, "long_factor": {}}},"#,
            list(1.0),
            list(4.0)
        )
    } else {
        String::new()
    };
    let config = format!(
        r#"{{"model_type": "phi3", "num_hidden_layers": 2, "hidden_size": 128,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
            "intermediate_size": 256, "vocab_size": 512, "max_position_embeddings": 1024,
            {rope} "pad_token_id": null}}"#
    );
    let path = dir.join(if partial {
        "partial.json"
    } else {
        "whole.json"
    });
    std::fs::write(&path, config).unwrap();
    format!(
        "model hf \"{}\"\nprecision fp32\noptimizer adamw {{ lr = 1e-3 }}\n\
         train {{ seq_len = 256  global_batch = 4  micro_batch = 4  grad_accum = 1 }}\n\
         fit {{ checkpoint = none }}\nhardware {{ gpu = h100-80gb }}\ntarget burn\n",
        path.display()
    )
}

#[test]
fn partial_rope_keeps_what_the_burn_profile_charges() {
    crate::testing::run_ignored_in_child(
        "tests::partial_rope::partial_rope_measured_in_child",
        CHILD,
    );
}

#[test]
#[ignore = "run in its own process by partial_rope_keeps_what_the_burn_profile_charges"]
fn partial_rope_measured_in_child() {
    assert!(std::env::var_os(CHILD).is_some(), "run by its parent test");
    let _g = serial();
    let dir = std::env::temp_dir().join(format!("rcoa-partial-rope-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    measured_peak(&predicted_peak(&plan(&dir, false)).0);
    let (mut measured, mut errors) = (Vec::new(), Vec::new());
    for partial in [false, true] {
        let (lowered, p) = predicted_peak(&plan(&dir, partial));
        assert_eq!(lowered.model.numerics.rotary_dims.is_some(), partial);
        let m = measured_peak(&lowered);
        let err = m as f64 / p as f64 - 1.0;
        println!("partial rotary {partial}: measured {m} predicted {p} ({err:+.4})");
        // Measured +3.1 % both, with both rotations one autodiff node (`kernels::rope`;
        // +4.1 % and +4.4 % while Burn's autodiff ran through their compositions, whose
        // backward held one more q-sized tensor at once): ndarray copies some of what
        // CubeCL views (qk_norm's test sees the same).
        assert!((-0.05..0.06).contains(&err), "partial {partial}: {err:+.4}");
        measured.push(m as f64);
        errors.push(err);
    }
    assert!(
        (errors[1] - errors[0]).abs() < 0.01,
        "the partial path's error {:+.4} strays from the whole-head one's {:+.4}",
        errors[1],
        errors[0]
    );
    // The peak moves by the tables (32 KiB predicted and measured), not by a kept
    // `[b, h, s, d]` tensor of q (512 KiB).
    let kept = 4.0 * 256.0 * 2.0 * 64.0 * 4.0;
    assert!(
        (measured[1] - measured[0]).abs() < kept / 2.0,
        "partial rotation moved the peak by {} B",
        measured[1] - measured[0]
    );
    std::fs::remove_dir_all(&dir).ok();
}
