//! Data-parallel training with Burn's collective engine (`burn-collective`
//! 0.21): over processes (nodes), over devices within a process, or both.
//!
//! A process drives `devices` data-parallel ranks, one thread and one device
//! each (`crate::execute_ranks`); `nodes` processes meet through a global
//! orchestrator. Rank `node_rank * devices + local` is the global rank. Every
//! rank builds the same model from the same seed (identical initial
//! weights), trains on its own shard of each global batch (`Batcher::rank`),
//! and before every optimizer step all-reduces (mean) the accumulated
//! gradient of every trainable parameter with `burn_collective::all_reduce`.
//! The optimizer step is then the same computation on the same inputs on
//! every rank, so the weights stay equal without ever being broadcast.
//!
//! Invariants the collective relies on:
//! - every rank issues the same all-reduces in the same order: gradients are
//!   reduced in the model's visit order (a structural order, the same in every
//!   process), never in `ParamId` order (ids are random per process);
//! - peer ids are the global ranks, unique across nodes;
//! - the collective is registered on the *inner* backend (gradients live
//!   there), as burn-collective asks for autodiff backends.
//!
//! Within a process burn-collective reduces the ranks' tensors itself (a
//! tree over the devices). Between processes they meet through the global
//! orchestrator (`orchestrate`, run by `rcoa orchestrate`), a WebSocket
//! server; tensors then travel peer to peer through each node's data service
//! (host memory, WebSocket). One process alone (`nodes` = 1 without an
//! orchestrator) never touches the network: burn-collective only starts its
//! global layer when the configuration names an orchestrator. burn-collective
//! binds both servers on all interfaces (0.0.0.0): that is the library's
//! choice, not configurable in 0.21.
//!
//! burn-collective 0.21 has no timeout: a rank that died leaves the others
//! waiting forever. Every blocking collective call here is bounded
//! (`Timeouts`, see `bounded`).

use crate::RunError;
use burn::module::{ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};
use burn_collective::{CollectiveConfig, PeerId, ReduceOperation};
use burn_communication::Address;
use std::cell::Cell;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// How long one collective call may wait for the other ranks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Timeouts {
    /// Joining the run and the first all-reduce. Joining waits for every
    /// rank to start; the first all-reduce for every rank to build its model
    /// and run its first step, which on CUDA with a cold kernel cache
    /// compiles kernels (minutes for a new model shape), and a peer's cache
    /// may be cold when this one's is warm.
    pub first: Duration,
    /// Every later all-reduce, and leaving the collective.
    pub steady: Duration,
}

impl Timeouts {
    /// 30 minutes to join and for the first step, 10 minutes afterwards
    /// (PyTorch's NCCL default): a step of a large model takes seconds, so
    /// 10 minutes without the peers' gradients means a rank died or hung.
    pub const DEFAULT: Timeouts = Timeouts {
        first: Duration::from_secs(1800),
        steady: Duration::from_secs(600),
    };

    /// The same limit for every call (`--collective-timeout`).
    pub fn uniform(limit: Duration) -> Self {
        Timeouts {
            first: limit,
            steady: limit,
        }
    }
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts::DEFAULT
    }
}

/// How the processes of a multi-node run meet.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Network {
    /// The orchestrator, `HOST:PORT` or `ws://HOST:PORT`.
    pub orchestrator: String,
    /// How the other processes reach this one, `HOST:PORT` or `ws://HOST:PORT`.
    pub node_address: String,
    /// The port this process's tensor data service listens on (the port of
    /// `node_address` unless a proxy sits between them).
    pub data_port: u16,
}

/// Where this process (and one of its threads) sits in a data-parallel run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Distributed {
    /// Processes in the run.
    pub nodes: u32,
    /// This process's index, `0..nodes`.
    pub node_rank: u32,
    /// Devices this process drives, one data-parallel rank (a thread) each.
    pub devices: u32,
    /// Which of them this rank is, `0..devices` (`execute_ranks` sets it per
    /// thread).
    pub local: u32,
    /// The orchestrator and this process's data service; `None`: this
    /// process is the whole run (`nodes` = 1), its ranks reduce locally.
    pub network: Option<Network>,
    pub timeouts: Timeouts,
}

impl Distributed {
    /// Data-parallel ranks in the run: `nodes × devices`.
    pub fn ranks(&self) -> u64 {
        self.nodes as u64 * self.devices as u64
    }

    /// This rank's global index (its burn-collective peer id).
    pub fn rank(&self) -> u64 {
        self.node_rank as u64 * self.devices as u64 + self.local as u64
    }

    /// `measure` (a memory probe's `what`), with what it counts beyond the
    /// compiler's prediction in this run: over several processes a probe of
    /// host memory (`host`: `--device cpu`, no device pool) also counts
    /// the ring's host copies (the block it sends, the chunks it receives),
    /// which the prediction (device memory) leaves out; docs/distributed.md
    /// measures them (1–1.44 blocks) and a test bounds them.
    pub fn describe_measure(d: Option<&Self>, measure: &str, host: bool) -> String {
        match d {
            Some(d) if host && d.nodes > 1 => format!(
                "{measure}; with --nodes {} also the network transport's host copies of the \
                 exchanged gradient blocks, which the prediction leaves out (up to the flat fp32 \
                 gradients / {} plus 24 MiB: docs/distributed.md)",
                d.nodes, d.nodes
            ),
            _ => measure.to_string(),
        }
    }

    /// Refuse inconsistent settings before anything connects.
    pub fn validate(&self) -> Result<(), RunError> {
        let bad = |s: String| Err(RunError::Distributed(s));
        if self.devices == 0 {
            return bad("--devices must be at least 1".into());
        }
        if self.nodes == 0 || self.node_rank >= self.nodes {
            return bad(format!(
                "rank {} is not in 0..{} (--node-rank must be below --nodes)",
                self.node_rank, self.nodes
            ));
        }
        if self.local >= self.devices {
            return bad(format!(
                "device {} is not in 0..{} (--devices)",
                self.local, self.devices
            ));
        }
        if self.ranks() > u32::MAX as u64 {
            return bad(format!(
                "{} nodes × {} devices is more ranks than burn-collective can number",
                self.nodes, self.devices
            ));
        }
        if self.timeouts.first.is_zero() || self.timeouts.steady.is_zero() {
            return bad("--collective-timeout must be at least 1 second".into());
        }
        match &self.network {
            None if self.nodes > 1 => bad(format!(
                "{} nodes need an orchestrator (--orchestrator, --node-address)",
                self.nodes
            )),
            None => Ok(()),
            Some(n) => {
                for (what, a) in [
                    ("orchestrator", &n.orchestrator),
                    ("node address", &n.node_address),
                ] {
                    ws_address(a).map_err(|e| RunError::Distributed(format!("the {what} {e}")))?;
                }
                Ok(())
            }
        }
    }
}

/// Route burn-communication's log to stderr, warnings and errors only: it
/// would otherwise install a subscriber printing every transfer at INFO on
/// stdout, where `rcoa run --format json` writes its lines. burn-collective
/// still prints `Connecting to ...` on stdout (a `println!`), which JSON
/// readers skip as a line that does not start with `{`.
fn quiet_logs() {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(tracing_subscriber::filter::LevelFilter::WARN)
        .try_init();
}

/// `HOST:PORT` → `ws://HOST:PORT` (burn-communication 0.21 rejects addresses
/// without the scheme instead of adding it).
fn ws_address(a: &str) -> Result<Address, String> {
    let url = if a.contains("://") {
        a.to_string()
    } else {
        format!("ws://{a}")
    };
    let rest = url
        .strip_prefix("ws://")
        .ok_or_else(|| format!("`{a}` is not a ws:// address"))?;
    let port = rest.rsplit_once(':').map(|(_, p)| p);
    if port.is_none_or(|p| p.parse::<u16>().is_err()) {
        return Err(format!("`{a}` has no HOST:PORT"));
    }
    Address::from_str(&url).map_err(|e| format!("`{a}`: {e}"))
}

/// What `execute` tells its rank's `Collective` while the trainer owns it.
#[derive(Debug, Default)]
pub struct Progress {
    /// The optimizer step under way (1-based), named in timeout errors.
    step: AtomicU64,
    /// Every step ran: leaving the collective is due (after a failure it is
    /// skipped, see `Collective::drop`).
    done: AtomicBool,
}

impl Progress {
    pub fn set_step(&self, step: u64) {
        self.step.store(step, Ordering::Relaxed);
    }

    pub fn set_done(&self) {
        self.done.store(true, Ordering::Relaxed);
    }
}

/// One rank's membership in the collective, registered on backend `I` (the
/// inner backend of the autodiff backend being trained).
pub struct Collective<I: Backend> {
    peer: PeerId,
    ranks: u32,
    /// Ranks of this process (`--devices`).
    devices: u32,
    timeouts: Timeouts,
    progress: Arc<Progress>,
    /// All-reduces issued so far (the first one gets `Timeouts::first`).
    calls: Cell<u64>,
    /// A collective call failed or timed out: burn-collective's server may
    /// still wait inside it, so nothing more is sent to it.
    broken: Cell<bool>,
    finished: bool,
    _backend: std::marker::PhantomData<I>,
}

fn collective_error(what: &str, e: burn_collective::CollectiveError) -> RunError {
    RunError::Distributed(format!("{what}: {e:?}"))
}

pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// Why a bounded call did not return a value.
enum Unfinished {
    TimedOut,
    Panicked(String),
}

/// Run the blocking collective call `f` on a helper thread and wait for it
/// at most `limit`.
///
/// burn-collective 0.21 waits on a channel without a timeout and has no way
/// to cancel an operation: its server task is inside the operation, waiting
/// for a peer. So the call cannot be interrupted, only abandoned: on timeout
/// the helper thread is left blocked and the caller gets an error, which
/// ends the run; `rcoa run` then returns from `main`, and the process exit
/// ends the abandoned thread. No watchdog has to kill the process, since the
/// error reaches the caller. The cost is one thread spawn per call (one
/// all-reduce per optimizer step: microseconds against a step). A panic
/// inside burn-collective (it unwraps its channels, e.g. after its server
/// task died) is caught here too.
fn bounded<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, Unfinished> {
    started(limit, f).wait()
}

/// A blocking call running on its helper thread (`started`), to be waited
/// for by its deadline.
struct Started<T> {
    rx: Option<std::sync::mpsc::Receiver<Result<T, String>>>,
    /// Why it could not start, reported by `wait`.
    failed: Option<String>,
    deadline: std::time::Instant,
}

/// Start `f` on a helper thread now; `wait` gives its result, or gives up
/// `limit` after the start (the same rules as `bounded`).
///
/// `f` runs as the caller's stream. CubeCL keys its streams, and each
/// stream's memory pool, by thread: on a helper thread of its own, a call
/// would read its input across streams and allocate its result (a gathered
/// unit, a reduced shard) in a pool of another stream. That memory is
/// invisible to the caller's probe (`client.memory_usage()` reports the
/// calling stream's pool only), and since every call has a fresh thread, the
/// calls walk through the device's stream slots (128) and their pages are
/// reused by no later call. As the caller's stream the call is ordered with
/// the caller's kernels and its bytes are the caller's.
fn started<T: Send + 'static>(
    limit: Duration,
    f: impl FnOnce() -> T + Send + 'static,
) -> Started<T> {
    let deadline = std::time::Instant::now() + limit;
    let (tx, rx) = std::sync::mpsc::sync_channel(1);
    let stream = burn::tensor::StreamId::current();
    let spawned = std::thread::Builder::new()
        .name("rcoa-collective".into())
        .spawn(move || {
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| stream.executes(f)));
            let _ = tx.send(r.map_err(|p| panic_text(p.as_ref())));
        });
    match spawned {
        Ok(_) => Started {
            rx: Some(rx),
            failed: None,
            deadline,
        },
        Err(e) => Started {
            rx: None,
            failed: Some(format!("cannot start a thread: {e}")),
            deadline,
        },
    }
}

impl<T> Started<T> {
    fn wait(self) -> Result<T, Unfinished> {
        let Some(rx) = self.rx else {
            return Err(Unfinished::Panicked(self.failed.unwrap_or_default()));
        };
        let left = self
            .deadline
            .saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok(Ok(v)) => Ok(v),
            Ok(Err(p)) => Err(Unfinished::Panicked(p)),
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => Err(Unfinished::TimedOut),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => Err(Unfinished::Panicked(
                "the collective call ended without a result".into(),
            )),
        }
    }
}

/// A collective call under way (`Collective::start_all_gather`): the rank
/// computes while it runs, then `Collective::finish_call` waits for it.
pub struct Pending<T> {
    call: Started<Result<T, burn_collective::CollectiveError>>,
    what: String,
    limit: Duration,
    first: bool,
}

fn seconds(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s.fract() == 0.0 {
        format!("{s:.0} s")
    } else {
        format!("{s:.1} s")
    }
}

impl<I: Backend> Collective<I> {
    /// Join the collective; returns once every rank has joined (or with an
    /// error after `Timeouts::first`).
    pub fn register(d: &Distributed, device: &I::Device) -> Result<Self, RunError> {
        d.validate()?;
        quiet_logs();
        let mut config = CollectiveConfig::default().with_num_devices(d.devices as usize);
        let meeting = match &d.network {
            Some(n) => {
                let global = ws_address(&n.orchestrator).map_err(RunError::Distributed)?;
                let node = ws_address(&n.node_address).map_err(RunError::Distributed)?;
                let at = format!("the orchestrator at {global}");
                config = config
                    .with_num_nodes(d.nodes)
                    .with_global_address(global)
                    .with_node_address(node)
                    .with_data_service_port(n.data_port);
                at
            }
            None => "the other threads of this process".into(),
        };
        let rank = d.rank();
        let peer = PeerId(rank as u32);
        let device = device.clone();
        let limit = d.timeouts.first;
        match bounded(limit, move || {
            burn_collective::register::<I>(peer, device, config)
        }) {
            Ok(r) => r.map_err(|e| collective_error("cannot join the collective", e))?,
            Err(Unfinished::TimedOut) => {
                return Err(RunError::Distributed(format!(
                    "rank {rank} could not join the collective within {} (--collective-timeout): \
                     waited for all {} ranks ({} process(es) × {} device(s)) to meet through {meeting}; \
                     a rank may not have started, may have died, or may use other --nodes/--orchestrator",
                    seconds(limit),
                    d.ranks(),
                    d.nodes,
                    d.devices
                )))
            }
            Err(Unfinished::Panicked(p)) => {
                return Err(RunError::Distributed(format!(
                    "rank {rank} could not join the collective: burn-collective failed: {p}"
                )))
            }
        }
        Ok(Collective {
            peer,
            ranks: d.ranks() as u32,
            devices: d.devices,
            timeouts: d.timeouts,
            progress: Arc::new(Progress::default()),
            calls: Cell::new(0),
            broken: Cell::new(false),
            finished: false,
            _backend: std::marker::PhantomData,
        })
    }

    pub fn ranks(&self) -> u32 {
        self.ranks
    }

    pub fn rank(&self) -> u32 {
        self.peer.0
    }

    /// Ranks this process drives (threads sharing its host).
    pub fn local_ranks(&self) -> u32 {
        self.devices
    }

    /// The handle `execute` reports the step and the end of the run through.
    pub fn progress(&self) -> Arc<Progress> {
        self.progress.clone()
    }

    /// Run the collective call `f` (named `what` in errors) with this rank's
    /// timeout: the first call of the run gets `Timeouts::first`.
    fn call<T: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce(PeerId) -> Result<T, burn_collective::CollectiveError> + Send + 'static,
    ) -> Result<T, RunError> {
        let p = self.start(what, f)?;
        self.finish_call(p)
    }

    /// Start the collective call `f` on its helper thread; `finish_call`
    /// waits for it. Every rank must start its calls in the same order, and
    /// one rank never has two under way (burn-collective's server handles
    /// one operation of a peer at a time).
    fn start<T: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce(PeerId) -> Result<T, burn_collective::CollectiveError> + Send + 'static,
    ) -> Result<Pending<T>, RunError> {
        if self.broken.get() {
            return Err(RunError::Collective(
                "an earlier collective call of this rank failed".into(),
            ));
        }
        let first = self.calls.get() == 0;
        self.calls.set(self.calls.get() + 1);
        let limit = if first {
            self.timeouts.first
        } else {
            self.timeouts.steady
        };
        let step = self.progress.step.load(Ordering::Relaxed);
        let peer = self.peer;
        let call = started(limit, move || f(peer));
        Ok(Pending {
            call,
            what: format!("the {what} of step {step} (rank {})", self.peer.0),
            limit,
            first,
        })
    }

    /// Wait for a call `start` began, with the deadline it began with.
    pub fn finish_call<T>(&self, p: Pending<T>) -> Result<T, RunError> {
        let Pending {
            call,
            what,
            limit,
            first,
        } = p;
        let fail = |s: String| {
            self.broken.set(true);
            Err(RunError::Collective(s))
        };
        match call.wait() {
            Ok(Ok(t)) => Ok(t),
            Ok(Err(burn_collective::CollectiveError::LocalServerMissing)) => fail(format!(
                "{what} failed: burn-collective's server stopped, which it does when a peer's \
                 connection breaks: a rank may have died; ranks: {}",
                self.ranks
            )),
            // burn-collective does not export the global error type.
            Ok(Err(e)) if format!("{e:?}").contains("PeerLost") => fail(format!(
                "{what} failed: a peer process closed its connection mid-transfer (it died or \
                 stopped); ranks: {}",
                self.ranks
            )),
            Ok(Err(e)) => fail(format!("{what} failed: {e:?}")),
            Err(Unfinished::Panicked(p)) => fail(format!("{what} failed: burn-collective: {p}")),
            Err(Unfinished::TimedOut) => fail(format!(
                "{what} did not complete within {} (--collective-timeout{}): a rank may have died or hung; ranks: {}",
                seconds(limit),
                if first { ", first step" } else { "" },
                self.ranks
            )),
        }
    }

    /// Mean of `t` over all ranks.
    pub fn mean<const D: usize>(&self, t: Tensor<I, D>) -> Result<Tensor<I, D>, RunError> {
        let primitive = t.into_primitive().tensor();
        let t = self.call("all-reduce", move |peer| {
            burn_collective::all_reduce::<I>(peer, primitive, ReduceOperation::Mean)
        })?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(t)))
    }

    /// Every rank's `shard` (the same length on every rank), concatenated in
    /// shard-index order (`shard_index`): the all-gather of burn-collective
    /// (patched, see `vendor/RCOA-PATCH.md`).
    pub fn all_gather(&self, shard: Tensor<I, 1>) -> Result<Tensor<I, 1>, RunError> {
        let primitive = shard.into_primitive().tensor();
        let t = self.call("all-gather", move |peer| {
            burn_collective::all_gather::<I>(peer, primitive)
        })?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(t)))
    }

    /// Start the all-gather of `shard` (as `all_gather`) and return while it
    /// runs: ZeRO-3 gathers the next unit's weights during this one's
    /// compute. `finish_call` gives the result.
    pub fn start_all_gather(&self, shard: Tensor<I, 1>) -> Result<Pending<Tensor<I, 1>>, RunError> {
        let primitive = shard.into_primitive().tensor();
        self.start("all-gather", move |peer| {
            burn_collective::all_gather::<I>(peer, primitive)
                .map(|t| Tensor::from_primitive(TensorPrimitive::Float(t)))
        })
    }

    /// This rank's shard of the mean of `t` over the ranks, and the shard's
    /// index; `t`'s length must be a multiple of the rank count.
    pub fn reduce_scatter_mean(&self, t: Tensor<I, 1>) -> Result<(Tensor<I, 1>, usize), RunError> {
        let primitive = t.into_primitive().tensor();
        let (t, index) = self.call("reduce-scatter", move |peer| {
            burn_collective::reduce_scatter::<I>(peer, primitive, ReduceOperation::Mean)
        })?;
        Ok((Tensor::from_primitive(TensorPrimitive::Float(t)), index))
    }

    /// Which shard of a flat tensor the sharded collectives give this rank.
    /// A local question to this process's collective server; it does not
    /// count as the run's first call.
    pub fn shard_index(&self) -> Result<usize, RunError> {
        let peer = self.peer;
        match bounded(self.timeouts.steady, move || {
            burn_collective::shard_index::<I>(peer)
        }) {
            Ok(Ok(i)) => Ok(i),
            Ok(Err(e)) => Err(RunError::Collective(format!(
                "rank {} has no shard index: {e:?}",
                peer.0
            ))),
            Err(_) => Err(RunError::Collective(format!(
                "rank {}: burn-collective did not say which shard it owns",
                peer.0
            ))),
        }
    }

    /// Replace every gradient in `grads` by its mean over the ranks, and
    /// return the mean of `loss`: one all-reduce per step over a flat fp32
    /// vector holding every gradient, in the visit order of `model` (the same
    /// on every rank), then the loss. One message per step instead of one per
    /// parameter (DDP's buckets, taken to one); it also carries the 1-element
    /// loss, which burn-collective's ring cannot reduce alone (it slices the
    /// tensor into one part per rank).
    ///
    /// With `unscale` (fp16's 1 / loss scale, `crate::loss_scale`) the mean
    /// vector is checked (one reduction; the same verdict on every rank, which
    /// all hold it) and divided by the scale in place, before the gradients
    /// become views of it: no second gradient-sized copy. `false`: a value is
    /// not finite (the gradients are then left scaled, for no step to read).
    pub fn mean_step<B, M>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
        loss: Tensor<I, 1>,
        unscale: Option<f64>,
    ) -> Result<(Tensor<I, 1>, bool), RunError>
    where
        B: AutodiffBackend<InnerBackend = I>,
        M: burn::module::Module<B>,
    {
        let mut gather = Gather::<I> {
            grads,
            parts: Vec::new(),
            dtypes: Vec::new(),
        };
        // The gradients are taken out of `grads` as they are read: once
        // concatenated, the flat vector is their only copy during the
        // all-reduce (not a second full-size one beside them).
        model.visit(&mut gather);
        let Gather {
            grads,
            mut parts,
            dtypes,
        } = gather;
        let loss_dtype = loss.dtype();
        parts.push(loss.cast(FloatDType::F32));
        let flat = self.mean(Tensor::cat(parts, 0))?;
        use crate::loss_scale::{may_step, scaled_check};
        let finite = may_step(scaled_check(&flat, unscale));
        let flat = match unscale {
            Some(inv) if finite => flat.mul_scalar(inv),
            _ => flat,
        };
        let total = flat.dims()[0];
        let mut scatter = Scatter::<I> {
            grads,
            flat: flat.clone(),
            at: 0,
            dtypes: dtypes.into_iter(),
        };
        model.visit(&mut scatter);
        let loss = flat.slice(scatter.at..total);
        let loss = match unscale {
            // The vector's division took the loss with it: back, exactly (a power of two).
            Some(inv) if finite => loss.mul_scalar(1.0 / inv),
            _ => loss,
        };
        Ok((crate::model::to_dtype(loss, loss_dtype.into()), finite))
    }

    /// Leave the collective (once, when the trainer is dropped), after a run
    /// whose every step ran. After a failure it is skipped: burn-collective's
    /// server may be waiting inside an operation that will never complete and
    /// would not answer, and the run is ending anyway (the peers stop at their
    /// own timeout).
    fn finish(&mut self) -> Result<(), RunError> {
        if self.finished || self.broken.get() || !self.progress.done.load(Ordering::Relaxed) {
            return Ok(());
        }
        self.finished = true;
        let peer = self.peer;
        match bounded(self.timeouts.steady, move || {
            burn_collective::finish_collective::<I>(peer)
        }) {
            Ok(r) => r.map_err(|e| collective_error("cannot leave the collective", e)),
            Err(Unfinished::TimedOut) => Err(RunError::Distributed(format!(
                "rank {} could not leave the collective within {}",
                peer.0,
                seconds(self.timeouts.steady)
            ))),
            Err(Unfinished::Panicked(p)) => Err(RunError::Distributed(format!(
                "rank {} could not leave the collective: {p}",
                peer.0
            ))),
        }
    }
}

impl<I: Backend> Drop for Collective<I> {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// Takes the gradients out of `grads`, flattened and in fp32, in visit
/// order; `dtypes` has one entry per float parameter visited (`None`: it
/// had no gradient).
struct Gather<'a, I: Backend> {
    grads: &'a mut GradientsParams,
    parts: Vec<Tensor<I, 1>>,
    dtypes: Vec<Option<DType>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let g = self.grads.remove::<B::InnerBackend, D>(param.id);
        self.dtypes.push(g.as_ref().map(|g| g.dtype()));
        if let Some(g) = g {
            self.parts.push(g.cast(FloatDType::F32).flatten(0, D - 1));
        }
    }
}

/// Puts the reduced gradients back, in their shape and dtype, for the
/// parameters `Gather` took one from (the same visit).
struct Scatter<'a, I: Backend> {
    grads: &'a mut GradientsParams,
    flat: Tensor<I, 1>,
    at: usize,
    dtypes: std::vec::IntoIter<Option<DType>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scatter<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(dtype) = self.dtypes.next().flatten() else {
            return;
        };
        let shape = param.shape();
        let n = shape.num_elements();
        let part = self.flat.clone().slice(self.at..self.at + n).reshape(shape);
        self.at += n;
        let part = crate::model::to_dtype(part, dtype.into());
        self.grads.register::<B::InnerBackend, D>(param.id, part);
    }
}

/// Run burn-collective's global orchestrator on `port` (all interfaces) until
/// `timeout` passes or the process gets SIGINT/SIGTERM. `Ok(true)`: stopped
/// by the timeout.
pub fn orchestrate(port: u16, timeout: Duration) -> Result<bool, RunError> {
    // burn-collective only logs a failed bind and returns; check first so
    // the error reaches the user.
    std::net::TcpListener::bind(("0.0.0.0", port)).map_err(|e| {
        RunError::Distributed(format!(
            "the orchestrator cannot listen on port {port}: {e}"
        ))
    })?;
    quiet_logs();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .map_err(|e| RunError::Distributed(format!("cannot start the async runtime: {e}")))?;
    rt.block_on(async move {
        tokio::select! {
            _ = burn_collective::start_global_orchestrator(port) => Ok(false),
            _ = tokio::time::sleep(timeout) => Ok(true),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A collective call's helper thread works as the caller's stream, so
    /// its device reads and allocations are the caller's (`started`); a
    /// thread of its own would be a stream of its own.
    #[test]
    fn collective_calls_run_as_the_callers_stream() {
        use burn::tensor::StreamId;
        let here = StreamId::current();
        let other = std::thread::spawn(StreamId::current).join().unwrap();
        assert_ne!(other, here, "a plain thread is a stream of its own");
        let inside = started(Duration::from_secs(10), StreamId::current)
            .wait()
            .ok()
            .expect("the call returns");
        assert_eq!(inside, here);
        // The helper thread keeps the caller's stream for its whole call.
        let pending = started(Duration::from_secs(10), || {
            let first = StreamId::current();
            std::thread::sleep(Duration::from_millis(20));
            (first, StreamId::current())
        });
        assert_eq!(pending.wait().ok(), Some((here, here)));
    }

    /// burn-collective's server runs an operation as the stream of its
    /// caller (`burn_collective::OnStream`, rcoa patch): every poll, across
    /// awaits and worker threads; outside it a worker is a stream of its own.
    #[test]
    fn collective_server_polls_as_the_callers_stream() {
        use burn::tensor::StreamId;
        let caller = StreamId::current();
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_time()
            .build()
            .unwrap();
        let (seen, after) = rt.block_on(async move {
            tokio::spawn(async move {
                let seen = burn_collective::OnStream::new(caller, async {
                    let a = StreamId::current();
                    tokio::task::yield_now().await;
                    tokio::time::sleep(Duration::from_millis(5)).await;
                    (a, StreamId::current())
                })
                .await;
                (seen, StreamId::current())
            })
            .await
            .unwrap()
        });
        assert_eq!(seen, (caller, caller));
        assert_ne!(after, caller, "a worker thread is a stream of its own");
    }

    #[test]
    fn addresses_get_the_ws_scheme() {
        assert_eq!(
            ws_address("127.0.0.1:4000").unwrap().to_string(),
            "ws://127.0.0.1:4000"
        );
        assert!(ws_address("http://x:1").is_err());
        assert!(ws_address("localhost").is_err());
        assert!(ws_address("ws://h:99999").is_err());
    }

    fn one_node(devices: u32, local: u32) -> Distributed {
        Distributed {
            nodes: 1,
            node_rank: 0,
            devices,
            local,
            network: None,
            timeouts: Timeouts::uniform(Duration::from_secs(20)),
        }
    }

    #[test]
    fn ranks_must_be_below_nodes() {
        let d = Distributed {
            nodes: 2,
            node_rank: 2,
            devices: 1,
            local: 0,
            network: Some(Network {
                orchestrator: "127.0.0.1:1".into(),
                node_address: "127.0.0.1:2".into(),
                data_port: 2,
            }),
            timeouts: Timeouts::DEFAULT,
        };
        assert!(d.validate().is_err());
        assert!(Distributed {
            node_rank: 1,
            ..d.clone()
        }
        .validate()
        .is_ok());
        // Several nodes need the orchestrator; one node does not.
        assert!(Distributed {
            node_rank: 1,
            network: None,
            ..d
        }
        .validate()
        .is_err());
        assert!(one_node(2, 1).validate().is_ok());
    }

    #[test]
    fn devices_and_timeouts_are_checked() {
        let e = one_node(0, 0).validate().unwrap_err().to_string();
        assert!(e.contains("--devices must be at least 1"), "{e}");
        assert!(one_node(2, 2).validate().is_err());
        let zero = Distributed {
            timeouts: Timeouts::uniform(Duration::ZERO),
            ..one_node(2, 0)
        };
        assert!(zero
            .validate()
            .unwrap_err()
            .to_string()
            .contains("--collective-timeout"));
        let huge = Distributed {
            nodes: u32::MAX,
            node_rank: 0,
            devices: 2,
            local: 0,
            network: Some(Network {
                orchestrator: "127.0.0.1:1".into(),
                node_address: "127.0.0.1:2".into(),
                data_port: 2,
            }),
            timeouts: Timeouts::DEFAULT,
        };
        assert!(huge.validate().is_err());
    }

    #[test]
    fn global_rank_is_node_major() {
        let d = Distributed {
            nodes: 3,
            node_rank: 2,
            devices: 4,
            local: 1,
            network: None,
            timeouts: Timeouts::DEFAULT,
        };
        assert_eq!(d.ranks(), 12);
        assert_eq!(d.rank(), 9);
    }

    #[test]
    fn a_bounded_call_times_out_or_reports_its_panic() {
        let start = std::time::Instant::now();
        let r = bounded(Duration::from_millis(200), || {
            std::thread::sleep(Duration::from_secs(30))
        });
        assert!(matches!(r, Err(Unfinished::TimedOut)));
        assert!(start.elapsed() < Duration::from_secs(5));
        let r = bounded(Duration::from_secs(5), || -> u32 { panic!("boom") });
        assert!(matches!(r, Err(Unfinished::Panicked(p)) if p == "boom"));
        assert!(matches!(bounded(Duration::from_secs(5), || 7), Ok(7)));
        assert_eq!(seconds(Duration::from_secs(600)), "600 s");
        assert_eq!(seconds(Duration::from_millis(1500)), "1.5 s");
    }

    /// Two threads of this process, one rank each, with no orchestrator:
    /// burn-collective's local all-reduce (the `--devices` path) averages
    /// their tensors.
    #[test]
    fn two_local_ranks_reduce_without_an_orchestrator() {
        type I = burn::backend::NdArray<f32>;
        let threads: Vec<_> = (0..2u32)
            .map(|local| {
                std::thread::spawn(move || {
                    let device = Default::default();
                    let c = Collective::<I>::register(&one_node(2, local), &device)?;
                    c.progress().set_step(1);
                    let t = Tensor::<I, 1>::from_floats([1.0 + local as f32, 10.0], &device);
                    let m = c.mean(t)?;
                    c.progress().set_done();
                    Ok::<_, RunError>(m.into_data().to_vec::<f32>().unwrap())
                })
            })
            .collect();
        for t in threads {
            assert_eq!(t.join().unwrap().unwrap(), vec![1.5, 10.0]);
        }
    }

    /// Two threads: the reduce-scatter gives each its half of the mean, the
    /// all-gather puts the halves back in shard-index order, and the indices
    /// are the ones `shard_index` names.
    #[test]
    fn two_local_ranks_reduce_scatter_and_all_gather() {
        // Its own backend type: the collective server is one per backend
        // type and process, and other tests use NdArray<f32>.
        type I = burn::backend::NdArray<f32, i32>;
        let threads: Vec<_> = (0..2u32)
            .map(|local| {
                std::thread::spawn(move || {
                    let device = Default::default();
                    let c = Collective::<I>::register(&one_node(2, local), &device)?;
                    c.progress().set_step(1);
                    let index = c.shard_index()?;
                    let x = local as f32;
                    let t = Tensor::<I, 1>::from_floats([x, 2.0 * x, 10.0, 20.0 + x], &device);
                    let (shard, at) = c.reduce_scatter_mean(t)?;
                    assert_eq!(at, index);
                    let mine = Tensor::<I, 1>::from_floats([index as f32 * 100.0; 3], &device);
                    let all = c.all_gather(mine)?;
                    c.progress().set_done();
                    Ok::<_, RunError>((
                        index,
                        shard.into_data().to_vec::<f32>().unwrap(),
                        all.into_data().to_vec::<f32>().unwrap(),
                    ))
                })
            })
            .collect();
        let mut indices = Vec::new();
        for t in threads {
            let (index, shard, all) = t.join().unwrap().unwrap();
            let want: [[f32; 2]; 2] = [[0.5, 1.0], [10.0, 20.5]];
            assert_eq!(shard, want[index].to_vec());
            assert_eq!(all, vec![0.0, 0.0, 0.0, 100.0, 100.0, 100.0]);
            indices.push(index);
        }
        indices.sort();
        assert_eq!(indices, vec![0, 1]);
    }
}
