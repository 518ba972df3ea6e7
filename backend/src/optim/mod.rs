//! An optimizer over one flat fp32 vector: a ZeRO rank's shard of the
//! trainable parameters (`crate::shard`).
//!
//! The update is Burn 0.21's (`burn-optim` `AdamW`, `Adam` with
//! `AdaptiveMomentum`, `Sgd` with `Momentum` and `WeightDecay`), operation
//! for operation and with the same scalar types, so that a sharded run and
//! one rank with Burn's `OptimizerAdaptor` end with the same weights (tested:
//! `same_update_as_burn`). Two places hold the state and run the update:
//! - `Place::Device`: 1-D tensors on the rank's device (ZeRO without
//!   offload);
//! - `Place::Host`: `Vec<f32>` in host memory, the update split over host
//!   threads (`offload = [optimizer]`): the gradient shard comes down, the
//!   updated weights go up.

use crate::RunError;
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use rcoa_compiler::lowered::LoweredPlan;
use rcoa_compiler::spec::OptimizerKind;

pub mod adafactor;
pub mod adam8bit;
pub mod adam_mini;
mod host;
pub mod lion;
pub use host::Rule;

/// The first error a step met, for the optimizers whose steps cannot return one
/// through Burn's `SimpleOptimizer::step` (8-bit Adam, Adam-mini): the step that met it
/// left its parameter unchanged, and the trainer takes it after every step.
#[derive(Clone, Debug, Default)]
pub struct StepError(std::sync::Arc<std::sync::Mutex<Option<String>>>);

impl StepError {
    /// Keep `why` unless an earlier error is still untaken.
    pub fn fail(&self, why: String) {
        let mut e = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if e.is_none() {
            *e = Some(why);
        }
    }

    /// The error since the last call, if any.
    pub fn take(&self) -> Option<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).take()
    }
}

impl Rule {
    /// The rule `train::Optim::for_plan` builds with Burn for `plan`.
    pub fn for_plan(plan: &LoweredPlan) -> Result<Rule, RunError> {
        let o = &plan.optimizer;
        let (beta_1, beta_2) = (o.betas.0 as f32, o.betas.1 as f32);
        // PyTorch's default epsilon, as `Optim::for_plan`.
        let epsilon = 1e-8;
        let penalty = (o.weight_decay > 0.0).then_some(o.weight_decay as f32);
        Ok(match o.kind {
            OptimizerKind::Adamw => Rule::AdamW {
                beta_1,
                beta_2,
                epsilon,
                weight_decay: o.weight_decay as f32,
            },
            OptimizerKind::Adam => Rule::Adam {
                beta_1,
                beta_2,
                epsilon,
                penalty,
            },
            OptimizerKind::Sgd => Rule::Sgd {
                momentum: (o.momentum > 0.0).then_some(o.momentum),
                penalty,
            },
            OptimizerKind::Lion => Rule::Lion {
                beta_1,
                beta_2,
                weight_decay: o.weight_decay as f32,
            },
            OptimizerKind::Adam8bit => {
                return Err(RunError::Unsupported(format!(
                    "optimizer adam8bit with zero = {} or an offloaded optimizer: its 8-bit moments are quantized per \
                     parameter (blocks of 256 within each, fp32 below 4096 values, as bitsandbytes), which a flat \
                     shard would cut across; run adam8bit with zero = 0 and nothing offloaded, or adamw with ZeRO",
                    plan.resolved.zero
                )))
            }
            OptimizerKind::Adafactor => {
                return Err(RunError::Unsupported(format!(
                    "optimizer adafactor with zero = {} or an offloaded optimizer: its second moment is factored per \
                     matrix (a mean per row and per column), which a flat shard would cut across; run adafactor \
                     with zero = 0 and nothing offloaded, or adamw with ZeRO",
                    plan.resolved.zero
                )))
            }
            OptimizerKind::AdamMini => {
                return Err(RunError::Unsupported(format!(
                    "optimizer adam-mini with zero = {} or an offloaded optimizer: its second moment is one value per \
                     block of a parameter (an attention head, a neuron, a token), which a flat shard would cut \
                     across; run adam-mini with zero = 0 and nothing offloaded, or adamw with ZeRO",
                    plan.resolved.zero
                )))
            }
        })
    }
}

/// Where the state lives and the update runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Place {
    Device,
    /// Host memory, the update over this many threads.
    Host {
        threads: usize,
    },
}

enum State<B: Backend> {
    Device {
        m1: Option<Tensor<B, 1>>,
        m2: Option<Tensor<B, 1>>,
    },
    Host {
        m1: Vec<f32>,
        m2: Vec<f32>,
    },
}

/// The optimizer of one flat shard.
pub struct FlatOptim<B: Backend> {
    rule: Rule,
    place: Place,
    /// Steps taken (Burn's `time`).
    time: usize,
    /// Elements of the shard.
    len: usize,
    state: State<B>,
}

impl<B: Backend> FlatOptim<B> {
    pub fn new(rule: Rule, place: Place, len: usize) -> Self {
        let state = match place {
            Place::Device => State::Device { m1: None, m2: None },
            Place::Host { .. } => State::Host {
                m1: Vec::new(),
                m2: Vec::new(),
            },
        };
        FlatOptim {
            rule,
            place,
            time: 0,
            len,
            state,
        }
    }

    pub fn rule(&self) -> Rule {
        self.rule
    }

    pub fn place(&self) -> Place {
        self.place
    }

    pub fn steps(&self) -> usize {
        self.time
    }

    /// One update of `params` (the shard, fp32) with `grad` times `unscale`
    /// (fp16's 1 / loss scale; `None`: 1); returns the new shard on
    /// `params`' device.
    pub fn step(
        &mut self,
        lr: f64,
        params: Tensor<B, 1>,
        grad: Tensor<B, 1>,
        unscale: Option<f64>,
    ) -> Result<Tensor<B, 1>, RunError> {
        let n = params.dims()[0];
        if n != self.len || grad.dims()[0] != n {
            return Err(RunError::Backend(format!(
                "the optimizer holds a shard of {} values; got {n} weights and {} gradients",
                self.len,
                grad.dims()[0]
            )));
        }
        self.time += 1;
        match self.place {
            Place::Device => {
                // Inside the step, whose own temporaries are as large: no
                // gradient-sized copy outlives it.
                let grad = match unscale {
                    Some(inv) => grad.mul_scalar(inv),
                    None => grad,
                };
                Ok(self.step_device(lr, params, grad))
            }
            Place::Host { threads } => {
                let device = params.device();
                let mut p = host(params)?;
                let g = host_unscaled(grad, unscale, threads)?;
                self.step_host(lr, &mut p, &g, threads);
                Ok(Tensor::from_data(TensorData::new(p, [n]), &device))
            }
        }
    }

    /// One update of the host-resident fp32 shard `params` (offload) with
    /// `grad` (brought down from the device) times `unscale`; returns the
    /// updated shard on `grad`'s device.
    pub fn step_host_master(
        &mut self,
        lr: f64,
        params: &mut [f32],
        grad: Tensor<B, 1>,
        unscale: Option<f64>,
    ) -> Result<Tensor<B, 1>, RunError> {
        let Place::Host { threads } = self.place else {
            return Err(RunError::Backend(
                "a host master needs the optimizer on the host".into(),
            ));
        };
        let n = params.len();
        if n != self.len || grad.dims()[0] != n {
            return Err(RunError::Backend(format!(
                "the optimizer holds a shard of {} values; got {n} weights and {} gradients",
                self.len,
                grad.dims()[0]
            )));
        }
        let device = grad.device();
        let g = host_unscaled(grad, unscale, threads)?;
        self.time += 1;
        self.step_host(lr, params, &g, threads);
        Ok(Tensor::from_data(
            TensorData::new(params.to_vec(), [n]),
            &device,
        ))
    }

    /// One update of the host-resident fp32 shard `params` with a gradient
    /// accumulated in host memory (`grad`): nothing crosses to the device.
    pub fn step_host_grad(
        &mut self,
        lr: f64,
        params: &mut [f32],
        grad: &[f32],
    ) -> Result<(), RunError> {
        let threads = self.host_threads()?;
        let n = params.len();
        if n != self.len || grad.len() != n {
            return Err(RunError::Backend(format!(
                "the optimizer holds a shard of {} values; got {n} weights and {} gradients",
                self.len,
                grad.len()
            )));
        }
        self.time += 1;
        self.step_host(lr, params, grad, threads);
        Ok(())
    }

    /// A gradient accumulated in host memory divided by fp16's loss scale
    /// (`acc *= unscale`) over the host optimizer's threads; whether every
    /// value is finite.
    pub fn unscale_host(&self, acc: &mut [f32], unscale: f64) -> Result<bool, RunError> {
        Ok(host::unscale(acc, unscale as f32, self.host_threads()?))
    }

    /// `acc += g` element by element over the host optimizer's threads:
    /// a gradient shard added into an accumulator kept beside the state.
    pub fn accumulate_host(&self, acc: &mut [f32], g: &[f32]) -> Result<(), RunError> {
        if acc.len() != g.len() {
            return Err(RunError::Backend(format!(
                "a gradient shard of {} values added to {} accumulated ones",
                g.len(),
                acc.len()
            )));
        }
        host::add(acc, g, self.host_threads()?);
        Ok(())
    }

    fn host_threads(&self) -> Result<usize, RunError> {
        match self.place {
            Place::Host { threads } => Ok(threads),
            Place::Device => Err(RunError::Backend(
                "a host gradient needs the optimizer on the host".into(),
            )),
        }
    }

    /// Burn's tensor operations, in Burn's order.
    fn step_device(&mut self, lr: f64, t: Tensor<B, 1>, mut grad: Tensor<B, 1>) -> Tensor<B, 1> {
        let time = self.time as i32;
        let State::Device { m1, m2 } = &mut self.state else {
            unreachable!("a device optimizer holds device state")
        };
        let moments = |m1: &mut Option<Tensor<B, 1>>,
                       m2: &mut Option<Tensor<B, 1>>,
                       grad: Tensor<B, 1>,
                       b1: f32,
                       b2: f32| {
            let (f1, f2) = (1.0 - b1, 1.0 - b2);
            *m1 = Some(match m1.take() {
                Some(m) => m.mul_scalar(b1).add(grad.clone().mul_scalar(f1)),
                None => grad.clone().mul_scalar(f1),
            });
            *m2 = Some(match m2.take() {
                Some(m) => m.mul_scalar(b2).add(grad.square().mul_scalar(f2)),
                None => grad.square().mul_scalar(f2),
            });
        };
        match self.rule {
            Rule::AdamW {
                beta_1,
                beta_2,
                epsilon,
                weight_decay,
            } => {
                moments(m1, m2, grad, beta_1, beta_2);
                let m1c = m1.clone().unwrap().div_scalar(1f32 - beta_1.powi(time));
                let m2c = m2.clone().unwrap().div_scalar(1f32 - beta_2.powi(time));
                let delta = m1c.div(m2c.sqrt().add_scalar(epsilon));
                let decay_rate = lr * (weight_decay as f64);
                let decayed = if decay_rate == 0.0 {
                    t
                } else {
                    t.mul_scalar(1.0 - decay_rate)
                };
                decayed - delta.mul_scalar(lr)
            }
            Rule::Adam {
                beta_1,
                beta_2,
                epsilon,
                penalty,
            } => {
                if let Some(p) = penalty {
                    grad = t.clone().mul_scalar(p).add(grad);
                }
                moments(m1, m2, grad, beta_1, beta_2);
                let bc2 = (1.0 - beta_2.powi(time)).sqrt();
                let factor = bc2 / (1.0 - beta_1.powi(time));
                let update = m1
                    .clone()
                    .unwrap()
                    .mul_scalar(factor)
                    .div(m2.clone().unwrap().sqrt().add_scalar(epsilon * bc2));
                t - update.mul_scalar(lr)
            }
            Rule::Lion {
                beta_1,
                beta_2,
                weight_decay,
            } => {
                let lion = lion::LionOptimizer {
                    beta_1,
                    beta_2,
                    weight_decay,
                };
                let (t, m) = lion.update(lr, t, grad, m1.take());
                *m1 = Some(m);
                t
            }
            Rule::Sgd { momentum, penalty } => {
                if let Some(p) = penalty {
                    grad = t.clone().mul_scalar(p).add(grad);
                }
                if let Some(mu) = momentum {
                    // Burn's `Momentum` with dampening 0, not Nesterov.
                    let v = match m1.take() {
                        Some(v) => grad.mul_scalar(1.0).add(v.mul_scalar(mu)),
                        None => grad,
                    };
                    *m1 = Some(v.clone());
                    grad = v;
                }
                t - grad.mul_scalar(lr)
            }
        }
    }

    /// The same arithmetic per element, over `threads` host threads.
    fn step_host(&mut self, lr: f64, p: &mut [f32], g: &[f32], threads: usize) {
        let State::Host { m1, m2 } = &mut self.state else {
            unreachable!("a host optimizer holds host state")
        };
        host::step(self.rule, lr, self.time as i32, p, g, m1, m2, threads);
    }

    /// The state as bytes: `RCOAFLAT`, version 1, rule tag, time, length,
    /// then the state vectors (fp32 little endian). With `load_state`, a
    /// rank's shard of a checkpoint.
    pub fn save_state(&self) -> Result<Vec<u8>, RunError> {
        let (m1, m2) = match &self.state {
            State::Device { m1, m2 } => (
                m1.clone().map(host).transpose()?.unwrap_or_default(),
                m2.clone().map(host).transpose()?.unwrap_or_default(),
            ),
            State::Host { m1, m2 } => (m1.clone(), m2.clone()),
        };
        let mut out = Vec::with_capacity(32 + 4 * (m1.len() + m2.len()));
        out.extend_from_slice(b"RCOAFLAT");
        out.extend_from_slice(&1u32.to_le_bytes());
        out.extend_from_slice(&self.rule_tag().to_le_bytes());
        out.extend_from_slice(&(self.time as u64).to_le_bytes());
        out.extend_from_slice(&(self.len as u64).to_le_bytes());
        for v in [&m1, &m2] {
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for x in v.iter() {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }
        Ok(out)
    }

    /// Restore what `save_state` wrote, for the same rule and shard length.
    pub fn load_state(&mut self, bytes: &[u8], device: &B::Device) -> Result<(), RunError> {
        let bad = |s: &str| Err(RunError::Checkpoint(format!("optimizer shard state: {s}")));
        let mut r = Reader(bytes);
        if r.take(8) != Some(b"RCOAFLAT".as_slice()) {
            return bad("not an rcoa flat optimizer state");
        }
        if r.u32() != Some(1) {
            return bad("unknown version");
        }
        if r.u32() != Some(self.rule_tag()) {
            return bad("written for another optimizer");
        }
        let (Some(time), Some(len)) = (r.u64(), r.u64()) else {
            return bad("truncated");
        };
        if len as usize != self.len {
            return bad(&format!(
                "its shard has {len} values, this rank's {} (another rank count?)",
                self.len
            ));
        }
        let mut vecs = Vec::new();
        for _ in 0..2 {
            let Some(n) = r.u64() else {
                return bad("truncated");
            };
            if n != 0 && n != len {
                return bad("a state vector of the wrong length");
            }
            let Some(raw) = r.take(4 * n as usize) else {
                return bad("truncated");
            };
            vecs.push(
                raw.chunks_exact(4)
                    .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                    .collect::<Vec<f32>>(),
            );
        }
        if !r.0.is_empty() {
            return bad("trailing bytes");
        }
        let m2 = vecs.pop().unwrap_or_default();
        let m1 = vecs.pop().unwrap_or_default();
        self.time = time as usize;
        self.state = match self.place {
            Place::Host { .. } => State::Host { m1, m2 },
            Place::Device => {
                let t = |v: Vec<f32>| {
                    (!v.is_empty()).then(|| {
                        let n = v.len();
                        Tensor::from_data(TensorData::new(v, [n]), device)
                    })
                };
                State::Device {
                    m1: t(m1),
                    m2: t(m2),
                }
            }
        };
        Ok(())
    }

    fn rule_tag(&self) -> u32 {
        match self.rule {
            Rule::AdamW { .. } => 1,
            Rule::Adam { .. } => 2,
            Rule::Sgd { momentum: None, .. } => 3,
            Rule::Sgd { .. } => 4,
            Rule::Lion { .. } => 5,
        }
    }
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Some(a)
    }
    fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .map(|b| u32::from_le_bytes(b.try_into().unwrap()))
    }
    fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()))
    }
}

/// `grad` in host memory, times `unscale` there (no device copy).
fn host_unscaled<B: Backend>(
    grad: Tensor<B, 1>,
    unscale: Option<f64>,
    threads: usize,
) -> Result<Vec<f32>, RunError> {
    let mut g = host(grad)?;
    if let Some(inv) = unscale {
        host::unscale(&mut g, inv as f32, threads);
    }
    Ok(g)
}

/// A 1-D tensor's values in host memory.
pub fn to_host<B: Backend>(t: Tensor<B, 1>) -> Result<Vec<f32>, RunError> {
    host(t)
}

fn host<B: Backend>(t: Tensor<B, 1>) -> Result<Vec<f32>, RunError> {
    // `try_into_data`: a failed kernel before the read (on CUDA: a launch error) is an
    // error here, with where it surfaced, not a panic caught far away as "reading data".
    t.try_into_data()
        .map_err(|e| RunError::Backend(format!("reading a shard back to the host: {e}")))?
        .convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| RunError::Backend(format!("cannot read a shard back: {e:?}")))
}

#[cfg(test)]
mod tests;
