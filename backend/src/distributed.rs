//! Data-parallel training over processes with Burn's collective engine
//! (`burn-collective` 0.21).
//!
//! One process is one data-parallel rank with one device. Every rank builds
//! the same model from the same seed (identical initial weights), trains on
//! its own shard of each global batch (`Batcher::rank`), and before every
//! optimizer step all-reduces (mean) the accumulated gradient of every
//! trainable parameter with `burn_collective::all_reduce`. The optimizer step
//! is then the same computation on the same inputs on every rank, so the
//! weights stay equal without ever being broadcast.
//!
//! Invariants the collective relies on:
//! - every rank issues the same all-reduces in the same order: gradients are
//!   reduced in the model's visit order (a structural order, the same in every
//!   process), never in `ParamId` order (ids are random per process);
//! - peer ids are the global ranks, unique across nodes;
//! - the collective is registered on the *inner* backend (gradients live
//!   there), as burn-collective asks for autodiff backends.
//!
//! Processes meet through a global orchestrator (`orchestrate`, run by
//! `rcoa orchestrate`), a WebSocket server; tensors then travel peer to peer
//! through each node's data service (host memory, WebSocket). burn-collective
//! binds both servers on all interfaces (0.0.0.0): that is the library's
//! choice, not configurable in 0.21.

use crate::RunError;
use burn::module::{ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};
use burn_collective::{CollectiveConfig, PeerId, ReduceOperation};
use burn_communication::Address;
use std::str::FromStr;
use std::time::Duration;

/// Where this process sits in a multi-process data-parallel run.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Distributed {
    /// Processes (ranks) in the run, one device each.
    pub nodes: u32,
    /// This process's rank, `0..nodes`.
    pub rank: u32,
    /// The orchestrator, `HOST:PORT` or `ws://HOST:PORT`.
    pub orchestrator: String,
    /// How the other ranks reach this one, `HOST:PORT` or `ws://HOST:PORT`.
    pub node_address: String,
    /// The port this rank's tensor data service listens on (the port of
    /// `node_address` unless a proxy sits between them).
    pub data_port: u16,
}

impl Distributed {
    /// Refuse inconsistent settings before anything connects.
    pub fn validate(&self) -> Result<(), RunError> {
        if self.nodes == 0 || self.rank >= self.nodes {
            return Err(RunError::Distributed(format!(
                "rank {} is not in 0..{} (--node-rank must be below --nodes)",
                self.rank, self.nodes
            )));
        }
        for (what, a) in [
            ("orchestrator", &self.orchestrator),
            ("node address", &self.node_address),
        ] {
            ws_address(a).map_err(|e| RunError::Distributed(format!("the {what} {e}")))?;
        }
        Ok(())
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

/// This process's membership in the collective, registered on backend `I`
/// (the inner backend of the autodiff backend being trained).
pub struct Collective<I: Backend> {
    peer: PeerId,
    ranks: u32,
    finished: bool,
    _backend: std::marker::PhantomData<I>,
}

fn collective_error(what: &str, e: burn_collective::CollectiveError) -> RunError {
    RunError::Distributed(format!("{what}: {e:?}"))
}

impl<I: Backend> Collective<I> {
    /// Register with the orchestrator; returns once every rank has registered.
    pub fn register(d: &Distributed, device: &I::Device) -> Result<Self, RunError> {
        d.validate()?;
        quiet_logs();
        let global = ws_address(&d.orchestrator).map_err(RunError::Distributed)?;
        let node = ws_address(&d.node_address).map_err(RunError::Distributed)?;
        let config = CollectiveConfig::default()
            .with_num_devices(1)
            .with_num_nodes(d.nodes)
            .with_global_address(global)
            .with_node_address(node)
            .with_data_service_port(d.data_port);
        let peer = PeerId(d.rank);
        burn_collective::register::<I>(peer, device.clone(), config)
            .map_err(|e| collective_error("cannot join the collective", e))?;
        Ok(Collective {
            peer,
            ranks: d.nodes,
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

    /// Mean of `t` over all ranks.
    pub fn mean<const D: usize>(&self, t: Tensor<I, D>) -> Result<Tensor<I, D>, RunError> {
        let primitive = t.into_primitive().tensor();
        let reduced = burn_collective::all_reduce::<I>(self.peer, primitive, ReduceOperation::Mean)
            .map_err(|e| RunError::Backend(format!("the all-reduce failed: {e:?}")))?;
        Ok(Tensor::from_primitive(TensorPrimitive::Float(reduced)))
    }

    /// Replace every gradient in `grads` by its mean over the ranks, and
    /// return the mean of `loss`: one all-reduce per step over a flat fp32
    /// vector holding every gradient, in the visit order of `model` (the same
    /// on every rank), then the loss. One message per step instead of one per
    /// parameter (DDP's buckets, taken to one); it also carries the 1-element
    /// loss, which burn-collective's ring cannot reduce alone (it slices the
    /// tensor into one part per rank).
    pub fn mean_step<B, M>(
        &self,
        model: &M,
        grads: &mut GradientsParams,
        loss: Tensor<I, 1>,
    ) -> Result<Tensor<I, 1>, RunError>
    where
        B: AutodiffBackend<InnerBackend = I>,
        M: burn::module::Module<B>,
    {
        let mut gather = Gather::<I> {
            grads,
            parts: Vec::new(),
            dtypes: Vec::new(),
        };
        model.visit(&mut gather);
        let Gather {
            grads,
            mut parts,
            dtypes,
        } = gather;
        let loss_dtype = loss.dtype();
        parts.push(loss.cast(FloatDType::F32));
        let flat = self.mean(Tensor::cat(parts, 0))?;
        let total = flat.dims()[0];
        let mut scatter = Scatter::<I> {
            grads,
            flat: flat.clone(),
            at: 0,
            dtypes: dtypes.into_iter(),
        };
        model.visit(&mut scatter);
        let loss = flat.slice(scatter.at..total);
        Ok(crate::model::to_dtype(loss, loss_dtype.into()))
    }

    /// Leave the collective (once; also on drop).
    pub fn finish(&mut self) -> Result<(), RunError> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        burn_collective::finish_collective::<I>(self.peer)
            .map_err(|e| collective_error("cannot leave the collective", e))
    }
}

impl<I: Backend> Drop for Collective<I> {
    fn drop(&mut self) {
        let _ = self.finish();
    }
}

/// Reads the gradients of `grads`, flattened and in fp32, in visit order.
struct Gather<'a, I: Backend> {
    grads: &'a mut GradientsParams,
    parts: Vec<Tensor<I, 1>>,
    dtypes: Vec<DType>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
            self.dtypes.push(g.dtype());
            self.parts.push(g.cast(FloatDType::F32).flatten(0, D - 1));
        }
    }
}

/// Puts the reduced gradients back, in their shape and dtype, in the order
/// `Gather` took them (the same visit).
struct Scatter<'a, I: Backend> {
    grads: &'a mut GradientsParams,
    flat: Tensor<I, 1>,
    at: usize,
    dtypes: std::vec::IntoIter<DType>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Scatter<'_, B::InnerBackend> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let Some(g) = self.grads.remove::<B::InnerBackend, D>(param.id) else {
            return;
        };
        // Exactly the parameters `Gather` read have a gradient here.
        let shape = g.shape();
        let n = shape.num_elements();
        let dtype = self.dtypes.next().unwrap_or(DType::F32);
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

    #[test]
    fn ranks_must_be_below_nodes() {
        let d = Distributed {
            nodes: 2,
            rank: 2,
            orchestrator: "127.0.0.1:1".into(),
            node_address: "127.0.0.1:2".into(),
            data_port: 2,
        };
        assert!(d.validate().is_err());
        assert!(Distributed { rank: 1, ..d }.validate().is_ok());
    }
}
