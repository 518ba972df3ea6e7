//! RoPE's inverse frequencies `θ_i = base^(-2i/d)` over the `d` rotated values of a head,
//! with the rescalings Hugging Face configs ask for (`rope_scaling`): `linear` divides
//! every frequency by the factor; `llama3` (Llama 3.1 and later) divides only the low
//! ones, keeps the high ones and blends the band between, as transformers'
//! `_compute_llama3_parameters`; `longrope` (Phi-3.5, Phi-4-mini) divides each by its own
//! factor, the short list's while the sequence is within the pretraining length and the
//! long list's beyond (transformers' `longrope_frequency_update`), and scales cos and sin.

use rcoa_compiler::spec::{Numerics, RopeScaling};

/// `θ_i` for `i` in `0..rotary_dims / 2` at sequences of `seq` positions, in f64 (the
/// executor rounds them to f32, as transformers computes them), and the factor on cos
/// and sin (transformers' `attention_scaling`: 1 but for LongRoPE).
pub fn frequencies(n: &Numerics, rotary_dims: usize, seq: usize) -> (Vec<f64>, f64) {
    let d = rotary_dims as f64;
    let plain = (0..rotary_dims / 2).map(|i| 1.0 / n.rope_theta.powf(2.0 * i as f64 / d));
    let inv = match &n.rope_scaling {
        None => plain.collect(),
        Some(RopeScaling::Linear { factor }) => plain.map(|f| f / factor).collect(),
        Some(RopeScaling::LongRope {
            short_factor,
            long_factor,
            original_max_positions,
            attention_factor,
        }) => {
            let ext = if seq as u64 > *original_max_positions {
                long_factor
            } else {
                short_factor
            };
            // Lengths are checked before a model is built (`executed::check`).
            assert_eq!(ext.len(), rotary_dims / 2, "one LongRoPE factor per pair");
            let inv = plain.zip(ext).map(|(f, e)| f / e).collect();
            return (inv, *attention_factor);
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor: low,
            high_freq_factor: high,
            original_max_positions,
        }) => {
            let old = *original_max_positions as f64;
            let (low_wavelen, high_wavelen) = (old / low, old / high);
            plain
                .map(|f| {
                    let wavelen = 2.0 * std::f64::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / factor
                    } else {
                        let smooth = (old / wavelen - low) / (high - low);
                        (1.0 - smooth) * f / factor + smooth * f
                    }
                })
                .collect()
        }
        // Refused before a model is built: `executed::check` when a plan compiles for
        // `rcoa run` or `rcoa eval`, `executed::check_lowered` in `Trainer::new`.
        Some(RopeScaling::Other { name }) => {
            panic!("`rcoa run` does not compute RoPE scaling of type `{name}`")
        }
    };
    (inv, 1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numerics(scaling: Option<RopeScaling>) -> Numerics {
        Numerics {
            rope_theta: 500000.0,
            rope_scaling: scaling,
            ..Default::default()
        }
    }

    fn close(got: f64, want: f64) -> bool {
        (got / want - 1.0).abs() < 1e-6
    }

    /// Llama 3.1 8B's rescaling (head 128, base 500000, factor 8, low 1, high 4, 8192
    /// positions) against transformers 5.23's `_compute_llama3_parameters` (fp32), at
    /// frequencies of each band: kept, blended, divided.
    #[test]
    fn llama3_matches_transformers() {
        let (f, scale) = frequencies(
            &numerics(Some(RopeScaling::Llama3 {
                factor: 8.0,
                low_freq_factor: 1.0,
                high_freq_factor: 4.0,
                original_max_positions: 8192,
            })),
            128,
            4096,
        );
        assert_eq!(scale, 1.0);
        assert_eq!(f.len(), 64);
        for (i, want) in LLAMA31 {
            assert!(close(f[i], want), "θ_{i}: {} against {want}", f[i]);
        }
    }

    #[test]
    fn linear_divides_every_frequency() {
        let (plain, _) = frequencies(&numerics(None), 16, 8);
        let (linear, _) = frequencies(&numerics(Some(RopeScaling::Linear { factor: 4.0 })), 16, 8);
        assert_eq!(plain[0], 1.0);
        assert!(close(plain[1], 500000f64.powf(-2.0 / 16.0)));
        for (p, l) in plain.iter().zip(&linear) {
            assert!(close(*l, p / 4.0));
        }
    }

    /// Phi-4-mini's shape (heads of 128, 96 rotated, base 10000, 4096 pretraining and
    /// 131072 positions) with made-up factors (short `1 + i/100`, long `1 + 0.8 i`), against
    /// transformers 5.23's `_compute_longrope_parameters` at `seq_len` None and 4097:
    /// the short list within the pretraining length, the long one past it, and the
    /// attention factor from the ratio of the two lengths.
    #[test]
    fn longrope_matches_transformers() {
        let n = numerics(Some(RopeScaling::LongRope {
            short_factor: (0..48).map(|i| 1.0 + 0.01 * i as f64).collect(),
            long_factor: (0..48).map(|i| 1.0 + 0.8 * i as f64).collect(),
            original_max_positions: 4096,
            attention_factor: (1.0 + 32f64.ln() / 4096f64.ln()).sqrt(),
        }));
        let n = Numerics {
            rope_theta: 10000.0,
            ..n
        };
        let (short, scale) = frequencies(&n, 96, 4096);
        let (long, long_scale) = frequencies(&n, 96, 4097);
        assert_eq!((short.len(), long.len()), (48, 48));
        assert!(close(scale, 1.1902380714238083) && scale == long_scale);
        for (i, s, l) in PHI4_SHAPE {
            assert!(close(short[i], s), "short θ_{i}: {} against {s}", short[i]);
            assert!(close(long[i], l), "long θ_{i}: {} against {l}", long[i]);
        }
    }

    /// (index, short θ, long θ) printed by transformers 5.23.
    const PHI4_SHAPE: [(usize, f64, f64); 6] = [
        (0, 1.000000000e+00, 1.000000000e+00),
        (1, 8.172318339e-01, 4.585578442e-01),
        (7, 2.439399213e-01, 3.954783827e-02),
        (20, 1.795362309e-02, 1.267314656e-03),
        (33, 1.337052207e-03, 6.490071246e-05),
        (47, 8.241683827e-05, 3.138672582e-06),
    ];

    /// (index, θ) printed by transformers 5.23 for Llama 3.1's parameters; the comments
    /// give the unscaled wavelength (kept below 2048 positions, divided above 8192).
    const LLAMA31: [(usize, f64); 16] = [
        (0, 1.000000000e+00),  // wavelength 6
        (10, 1.286873817e-01), // wavelength 49
        (20, 1.656044088e-02), // wavelength 379
        (26, 4.839421250e-03), // wavelength 1298
        (27, 3.942275885e-03), // wavelength 1594
        (28, 3.211446106e-03), // wavelength 1956
        (29, 2.166570630e-03), // wavelength 2402
        (30, 1.371893683e-03), // wavelength 2948
        (31, 8.567514597e-04), // wavelength 3619
        (32, 5.248460220e-04), // wavelength 4443
        (33, 3.126936499e-04), // wavelength 5454
        (34, 1.785077911e-04), // wavelength 6695
        (35, 9.556212171e-05), // wavelength 8219
        (40, 3.428102355e-05), // wavelength 22911
        (50, 4.411534519e-06), // wavelength 178033
        (63, 3.068925878e-07), // wavelength 2559196
    ];
}
