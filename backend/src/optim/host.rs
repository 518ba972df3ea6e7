//! The optimizer update on host `f32` slices, split over threads: what
//! `offload = [optimizer]` runs. Plain `std`, no Burn: the benchmark
//! (`backend/bench/host-optimizer`) compiles this file alone.

/// The update rule and its hyper-parameters, in Burn's scalar types.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Rule {
    /// Decoupled weight decay (`lr × weight_decay`, in f64 as Burn computes it).
    AdamW {
        beta_1: f32,
        beta_2: f32,
        epsilon: f32,
        weight_decay: f32,
    },
    /// L2 penalty added to the gradient.
    Adam {
        beta_1: f32,
        beta_2: f32,
        epsilon: f32,
        penalty: Option<f32>,
    },
    Sgd {
        momentum: Option<f64>,
        penalty: Option<f32>,
    },
    /// Decoupled weight decay as `AdamW`; one moment (`optim::lion`).
    Lion {
        beta_1: f32,
        beta_2: f32,
        weight_decay: f32,
    },
}

impl Rule {
    /// fp32 values of state per parameter (moments, or the velocity).
    pub fn state_per_param(&self) -> usize {
        match self {
            Rule::AdamW { .. } | Rule::Adam { .. } => 2,
            Rule::Sgd { momentum, .. } => usize::from(momentum.is_some()),
            Rule::Lion { .. } => 1,
        }
    }
}

/// One step (`time`, 1-based) of `p` with `g`; `m1`/`m2` hold the state
/// (empty before the first step: allocated here).
#[allow(clippy::too_many_arguments)]
pub fn step(
    rule: Rule,
    lr: f64,
    time: i32,
    p: &mut [f32],
    g: &[f32],
    m1: &mut Vec<f32>,
    m2: &mut Vec<f32>,
    threads: usize,
) {
    let n = p.len();
    let first = m1.is_empty() && m2.is_empty();
    let need = rule.state_per_param();
    if first {
        *m1 = if need >= 1 { vec![0.0; n] } else { Vec::new() };
        *m2 = if need >= 2 { vec![0.0; n] } else { Vec::new() };
    }
    let chunk = n.div_ceil(threads.max(1)).max(1);
    let update = Update {
        rule,
        lr,
        time,
        first,
    };
    std::thread::scope(|s| {
        let mut m1s = m1.chunks_mut(chunk);
        let mut m2s = m2.chunks_mut(chunk);
        for (pc, gc) in p.chunks_mut(chunk).zip(g.chunks(chunk)) {
            let a = m1s.next().unwrap_or_default();
            let b = m2s.next().unwrap_or_default();
            s.spawn(move || update.run(pc, gc, a, b));
        }
    });
}

/// Threads and chunk length for an element-wise pass over `len` values: no
/// more threads than pay for spawning (`1 << 16` values each).
fn split(len: usize, threads: usize) -> (usize, usize) {
    const PER_THREAD: usize = 1 << 16;
    let threads = threads.clamp(1, len.div_ceil(PER_THREAD).max(1));
    (threads, len.div_ceil(threads).max(1))
}

/// `acc += g`, split over `threads` when the slices are long enough to pay
/// for spawning them. Each element is one fp32 addition, as a device `+`.
pub fn add(acc: &mut [f32], g: &[f32], threads: usize) {
    let (threads, chunk) = split(acc.len(), threads);
    let run = |a: &mut [f32], g: &[f32]| {
        for (a, &g) in a.iter_mut().zip(g) {
            *a += g;
        }
    };
    if threads == 1 {
        return run(acc, g);
    }
    std::thread::scope(|s| {
        for (a, g) in acc.chunks_mut(chunk).zip(g.chunks(chunk)) {
            s.spawn(move || run(a, g));
        }
    });
}

/// `v *= factor` (fp16's loss scale divided out, `crate::loss_scale`) over
/// `threads`, as `add` splits them; whether every value is finite.
pub fn unscale(v: &mut [f32], factor: f32, threads: usize) -> bool {
    let (threads, chunk) = split(v.len(), threads);
    let run = |v: &mut [f32]| {
        let mut finite = true;
        for x in v.iter_mut() {
            *x *= factor;
            finite &= x.is_finite();
        }
        finite
    };
    if threads == 1 {
        return run(v);
    }
    std::thread::scope(|s| {
        let parts: Vec<_> = v
            .chunks_mut(chunk)
            .map(|c| s.spawn(move || run(c)))
            .collect();
        parts.into_iter().all(|p| p.join().unwrap_or(false))
    })
}

/// One host update over a chunk (the scalars of `step_device`, per element).
#[derive(Clone, Copy)]
struct Update {
    rule: Rule,
    lr: f64,
    time: i32,
    first: bool,
}

impl Update {
    fn run(self, p: &mut [f32], g: &[f32], m1: &mut [f32], m2: &mut [f32]) {
        let lr = self.lr as f32;
        let first = self.first;
        let moments = |i: usize, g: f32, m1: &mut [f32], m2: &mut [f32], b1: f32, b2: f32| {
            let (f1, f2) = (1.0 - b1, 1.0 - b2);
            m1[i] = if first { g * f1 } else { m1[i] * b1 + g * f1 };
            m2[i] = if first {
                (g * g) * f2
            } else {
                m2[i] * b2 + (g * g) * f2
            };
        };
        match self.rule {
            Rule::AdamW {
                beta_1,
                beta_2,
                epsilon,
                weight_decay,
            } => {
                let c1 = 1f32 - beta_1.powi(self.time);
                let c2 = 1f32 - beta_2.powi(self.time);
                let decay_rate = self.lr * (weight_decay as f64);
                // × 1.0 is exact: no decay gives Burn's undecayed weights.
                let keep = if decay_rate == 0.0 {
                    1.0
                } else {
                    (1.0 - decay_rate) as f32
                };
                let k = AdamW {
                    b1: beta_1,
                    b2: beta_2,
                    c1,
                    c2,
                    epsilon,
                    keep,
                    lr,
                };
                if first {
                    k.run::<true>(p, g, m1, m2)
                } else {
                    k.run::<false>(p, g, m1, m2)
                }
            }
            Rule::Adam {
                beta_1,
                beta_2,
                epsilon,
                penalty,
            } => {
                let bc2 = (1.0 - beta_2.powi(self.time)).sqrt();
                let factor = bc2 / (1.0 - beta_1.powi(self.time));
                let eps = epsilon * bc2;
                for i in 0..p.len() {
                    let gi = match penalty {
                        Some(c) => p[i] * c + g[i],
                        None => g[i],
                    };
                    moments(i, gi, m1, m2, beta_1, beta_2);
                    let update = (m1[i] * factor) / (m2[i].sqrt() + eps);
                    p[i] -= update * lr;
                }
            }
            Rule::Lion {
                beta_1,
                beta_2,
                weight_decay,
            } => {
                let decay_rate = self.lr * (weight_decay as f64);
                let keep = if decay_rate == 0.0 {
                    1.0
                } else {
                    (1.0 - decay_rate) as f32
                };
                let (f1, f2) = (1.0 - beta_1, 1.0 - beta_2);
                for i in 0..p.len() {
                    // `optim::lion`'s device operations, one element at a time.
                    let direction = if first {
                        g[i] * f1
                    } else {
                        m1[i] * beta_1 + g[i] * f1
                    };
                    p[i] = p[i] * keep - (sign(direction) + direction * 0.0) * lr;
                    m1[i] = if first {
                        g[i] * f2
                    } else {
                        m1[i] * beta_2 + g[i] * f2
                    };
                }
            }
            Rule::Sgd { momentum, penalty } => {
                let mu = momentum.map(|m| m as f32);
                for i in 0..p.len() {
                    let mut gi = match penalty {
                        Some(c) => p[i] * c + g[i],
                        None => g[i],
                    };
                    if let Some(mu) = mu {
                        let v = if first { gi } else { gi * 1.0 + m1[i] * mu };
                        m1[i] = v;
                        gi = v;
                    }
                    p[i] -= gi * lr;
                }
            }
        }
    }
}

/// −1, 0 or 1 as a tensor's `sign()` (and torch's) for numbers: `f32::signum`
/// gives 1 for +0. The Lion step adds `direction · 0` as `optim::lion` does,
/// so a NaN or infinite direction makes the value NaN on the host as on the
/// device, whatever `sign` gives it.
fn sign(x: f32) -> f32 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        x
    }
}

/// The AdamW loop, branch-free per element (zipped slices: no bounds
/// checks, so the compiler vectorizes it).
struct AdamW {
    b1: f32,
    b2: f32,
    c1: f32,
    c2: f32,
    epsilon: f32,
    keep: f32,
    lr: f32,
}

impl AdamW {
    fn run<const FIRST: bool>(&self, p: &mut [f32], g: &[f32], m1: &mut [f32], m2: &mut [f32]) {
        let (f1, f2) = (1.0 - self.b1, 1.0 - self.b2);
        for (((p, &g), m1), m2) in p.iter_mut().zip(g).zip(m1.iter_mut()).zip(m2.iter_mut()) {
            if FIRST {
                *m1 = g * f1;
                *m2 = (g * g) * f2;
            } else {
                *m1 = *m1 * self.b1 + g * f1;
                *m2 = *m2 * self.b2 + (g * g) * f2;
            }
            let delta = (*m1 / self.c1) / ((*m2 / self.c2).sqrt() + self.epsilon);
            *p = *p * self.keep - delta * self.lr;
        }
    }
}
