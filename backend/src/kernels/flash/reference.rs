//! Attention and its gradients by the definition, in f64 loops over
//! contiguous `[b, h, n, d]` buffers: the independent reference the kernels
//! and the blocked path are tested against.

use super::dropout;

/// One test problem: shapes, masks and the inputs.
#[derive(Clone)]
pub struct Problem {
    pub b: usize,
    pub h: usize,
    pub kvh: usize,
    pub s: usize,
    pub t: usize,
    pub d: usize,
    pub causal: bool,
    /// A sliding window (with `causal`): query `i` sees keys `i − window < j ≤ i`; 0 for
    /// none.
    pub window: usize,
    /// `[b, t]`: false for a padded key.
    pub keep: Option<Vec<bool>>,
    /// Packed rows (with `causal`): `[b, s, 2]` each token's document as `[start, end)`;
    /// a query sees only the keys of its own.
    pub spans: Option<Vec<u32>>,
    pub scale: f64,
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// The upstream gradient of the output.
    pub d_o: Vec<f32>,
    /// Attention dropout: its probability and the two seed words the
    /// kernels read (`super::dropout`).
    pub dropout: Option<(f64, [u32; 2])>,
}

/// What the reference computes.
pub struct Expected {
    pub o: Vec<f32>,
    pub lse: Vec<f32>,
    pub d_q: Vec<f32>,
    pub d_k: Vec<f32>,
    pub d_v: Vec<f32>,
}

/// A deterministic pseudo-random fill (no RNG state shared with Burn's).
pub fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

impl Problem {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        b: usize,
        h: usize,
        kvh: usize,
        s: usize,
        t: usize,
        d: usize,
        causal: bool,
        padded: &[usize],
        seed: u64,
    ) -> Self {
        // `padded[row]` keys at the end of each batch row are padding.
        let keep = (!padded.is_empty()).then(|| {
            (0..b)
                .flat_map(|bi| (0..t).map(move |j| j + padded[bi] < t))
                .collect::<Vec<_>>()
        });
        Problem {
            b,
            h,
            kvh,
            s,
            t,
            d,
            causal,
            window: 0,
            keep,
            spans: None,
            scale: 1.0 / (d as f64).sqrt(),
            q: fill(b * h * s * d, seed),
            k: fill(b * kvh * t * d, seed + 1),
            v: fill(b * kvh * t * d, seed + 2),
            d_o: fill(b * h * s * d, seed + 3),
            dropout: None,
        }
    }

    /// The same problem under a sliding window of `window` keys.
    pub fn with_window(mut self, window: usize) -> Self {
        self.window = window;
        self
    }

    /// The same problem over packed rows: row `bi` holds documents of `lengths[bi]`
    /// tokens one after the other (the rest of the row one more document).
    pub fn with_documents(mut self, lengths: &[&[usize]]) -> Self {
        assert_eq!(lengths.len(), self.b, "one list of lengths per batch row");
        let mut spans = Vec::with_capacity(self.b * self.s * 2);
        for row in lengths {
            let mut start = 0usize;
            for &n in row.iter().chain(std::iter::once(&usize::MAX)) {
                let end = start.saturating_add(n).min(self.s);
                for _ in start..end {
                    spans.extend([start as u32, end as u32]);
                }
                start = end;
                if start == self.s {
                    break;
                }
            }
        }
        self.spans = Some(spans);
        self
    }

    /// The same problem with dropout `p` under the seed words `seed`.
    pub fn with_dropout(mut self, p: f64, seed: [u32; 2]) -> Self {
        self.dropout = Some((p, seed));
        self
    }

    /// The keep factor of score `(i, j)` of head slice `bh`: 1 without
    /// dropout; 0 or `1 / (1 − p)` with it.
    fn keep(&self, bh: usize, i: usize, j: usize) -> f64 {
        match self.dropout {
            None => 1.0,
            Some((p, [w0, w1])) => {
                let row = dropout::row_key(dropout::seed32(w0, w1), bh, i);
                if dropout::keeps(row, j, dropout::threshold(p)) {
                    dropout::keep_scale(p)
                } else {
                    0.0
                }
            }
        }
    }

    /// The padding as the kernels take it: an additive `[b, t]` bias, 0 or
    /// the executor's -1e9.
    pub fn key_bias(&self) -> Option<Vec<f32>> {
        self.keep
            .as_ref()
            .map(|k| k.iter().map(|&x| if x { 0.0 } else { -1.0e9 }).collect())
    }

    pub fn expected(&self) -> Expected {
        let (b, h, s, t, d) = (self.b, self.h, self.s, self.t, self.d);
        let g = h / self.kvh;
        let mut e = Expected {
            o: vec![0.0; b * h * s * d],
            lse: vec![0.0; b * h * s],
            d_q: vec![0.0; b * h * s * d],
            d_k: vec![0.0; b * self.kvh * t * d],
            d_v: vec![0.0; b * self.kvh * t * d],
        };
        let mut dk = vec![0.0f64; e.d_k.len()];
        let mut dv = vec![0.0f64; e.d_v.len()];
        for bi in 0..b {
            for hi in 0..h {
                let kh = hi / g;
                let qa = |i: usize, c: usize| self.q[((bi * h + hi) * s + i) * d + c] as f64;
                let doa = |i: usize, c: usize| self.d_o[((bi * h + hi) * s + i) * d + c] as f64;
                let kv_at = |i: usize| ((bi * self.kvh + kh) * t + i) * d;
                for i in 0..s {
                    // Scores with the eager path's masks: causal excluded,
                    // padding as an additive -1e9.
                    let sc: Vec<Option<f64>> = (0..t)
                        .map(|j| {
                            if self.causal && j > i || self.window > 0 && i >= j + self.window {
                                return None;
                            }
                            if let Some(sp) = &self.spans {
                                if j < sp[(bi * s + i) * 2] as usize {
                                    return None;
                                }
                            }
                            let dot: f64 =
                                (0..d).map(|c| qa(i, c) * self.k[kv_at(j) + c] as f64).sum();
                            let pad = match &self.keep {
                                Some(keep) if !keep[bi * t + j] => -1.0e9,
                                _ => 0.0,
                            };
                            Some(dot * self.scale + pad)
                        })
                        .collect();
                    let m = sc.iter().flatten().cloned().fold(f64::MIN, f64::max);
                    let sum: f64 = sc.iter().flatten().map(|x| (x - m).exp()).sum();
                    let lse = m + sum.ln();
                    e.lse[(bi * h + hi) * s + i] = lse as f32;
                    let p: Vec<f64> = sc
                        .iter()
                        .map(|x| x.map_or(0.0, |x| (x - lse).exp()))
                        .collect();
                    // Dropout after the softmax: the LSE is of P, O of P ∘ Z.
                    let z: Vec<f64> = (0..t).map(|j| self.keep(bi * h + hi, i, j)).collect();
                    let mut o = vec![0.0f64; d];
                    for (j, pj) in p.iter().enumerate() {
                        for (c, oc) in o.iter_mut().enumerate() {
                            *oc += pj * z[j] * self.v[kv_at(j) + c] as f64;
                        }
                    }
                    let row = ((bi * h + hi) * s + i) * d;
                    for (c, oc) in o.iter().enumerate() {
                        e.o[row + c] = *oc as f32;
                    }
                    // Dropout backward, dP = (dO vᵀ) ∘ Z; softmax backward,
                    // dS = P ∘ (dP − rowsum(dO ∘ O)).
                    let big_d: f64 = (0..d).map(|c| doa(i, c) * o[c]).sum();
                    let mut dq = vec![0.0f64; d];
                    for (j, pj) in p.iter().enumerate() {
                        let dp: f64 = (0..d)
                            .map(|c| doa(i, c) * self.v[kv_at(j) + c] as f64)
                            .sum::<f64>()
                            * z[j];
                        let ds = pj * (dp - big_d) * self.scale;
                        for c in 0..d {
                            dq[c] += ds * self.k[kv_at(j) + c] as f64;
                            dk[kv_at(j) + c] += ds * qa(i, c);
                            dv[kv_at(j) + c] += pj * z[j] * doa(i, c);
                        }
                    }
                    for (c, g) in dq.iter().enumerate() {
                        e.d_q[row + c] = *g as f32;
                    }
                }
            }
        }
        e.d_k = dk.into_iter().map(|x| x as f32).collect();
        e.d_v = dv.into_iter().map(|x| x as f32).collect();
        e
    }
}

/// The largest `|got − want| / (1 + |want|)`: relative for large values,
/// absolute near zero.
pub fn worst(got: &[f32], want: &[f32]) -> f64 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    got.iter()
        .zip(want)
        .map(|(&g, &w)| {
            if !g.is_finite() {
                return f64::INFINITY;
            }
            (g as f64 - w as f64).abs() / (1.0 + (w as f64).abs())
        })
        .fold(0.0, f64::max)
}
