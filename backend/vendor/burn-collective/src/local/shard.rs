//! rcoa patch: all-gather and reduce-scatter over flat (1-D) tensors, for
//! sharded data parallelism (ZeRO).
//!
//! Rank `r` of `R = nodes × devices` owns shard `index(r) = p × devices + j`
//! of every flat tensor, `p` the node's position in the global ring (nodes
//! sorted by their orchestrator-assigned id) and `j` the rank's position among
//! this node's peers sorted by id. Both operations and `shard_index` use that
//! numbering, so what a reduce-scatter hands a rank is what its all-gather
//! puts back in the same place. Shards are equal: the caller pads.
//!
//! Within a node the devices' tensors meet on the first device (sorted by
//! peer id): a sum for the reduce-scatter, a concatenation for the
//! all-gather. Between nodes the global ring runs one of its two phases
//! (`global::node::ring`): phase 1 (add) is a reduce-scatter, phase 2
//! (replace) an all-gather.

use crate::global::node::base::Node;
use crate::{CollectiveConfig, CollectiveError, PeerId, ReduceOperation};
use burn_backend::{Backend, Slice, TensorMetadata};
use burn_communication::Protocol;
use burn_std::Shape;
use std::sync::mpsc::SyncSender;

/// A rank's shard and its index (see the module documentation).
pub(crate) type ShardResult<T> = Result<(T, usize), CollectiveError>;

/// Which sharded collective.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ShardKind {
    /// Every rank passes its shard and gets the concatenation of all shards.
    AllGather,
    /// Every rank passes a full tensor and gets its shard of the reduction.
    ReduceScatter(ReduceOperation),
}

struct ShardCall<B: Backend> {
    caller: PeerId,
    /// Taken when the operation runs, so that the ring owns it alone (a
    /// tensor still held here would stay allocated through the exchange).
    input: Option<B::FloatTensorPrimitive>,
    device: B::Device,
    result_sender: SyncSender<ShardResult<B::FloatTensorPrimitive>>,
}

/// An all-gather or reduce-scatter waiting for this node's peers.
pub struct ShardOp<B: Backend> {
    kind: ShardKind,
    shape: Shape,
    calls: Vec<ShardCall<B>>,
}

impl<B: Backend> ShardOp<B> {
    pub fn new(kind: ShardKind, shape: Shape) -> Self {
        Self {
            kind,
            shape,
            calls: vec![],
        }
    }

    /// Register one peer's call; `true` once every local peer has called.
    pub(crate) fn register_call(
        &mut self,
        caller: PeerId,
        kind: ShardKind,
        input: B::FloatTensorPrimitive,
        device: B::Device,
        result_sender: SyncSender<ShardResult<B::FloatTensorPrimitive>>,
        peer_count: usize,
    ) -> Result<bool, CollectiveError> {
        let refuse = |err: CollectiveError| {
            // The caller hears why too, not only the peers already waiting.
            let _ = result_sender.send(Err(err.clone()));
            Err(err)
        };
        if self.kind != kind {
            return refuse(CollectiveError::ShardOperationMismatch);
        }
        if self.shape != input.shape() || self.shape.num_dims() != 1 {
            return refuse(CollectiveError::ShardShapeMismatch);
        }
        self.calls.push(ShardCall {
            caller,
            input: Some(input),
            device,
            result_sender,
        });
        Ok(self.calls.len() == peer_count)
    }

    pub async fn execute<P: Protocol>(
        mut self,
        config: &CollectiveConfig,
        global_client: &mut Option<Node<B, P>>,
    ) {
        self.calls.sort_by_key(|c| c.caller.0);
        match self.run(config, global_client).await {
            Ok(results) => {
                for (call, result) in self.calls.iter().zip(results) {
                    // A caller that gave up (timeout) has dropped its receiver.
                    let _ = call.result_sender.send(Ok(result));
                }
            }
            Err(err) => self.fail(err),
        }
    }

    async fn run<P: Protocol>(
        &mut self,
        config: &CollectiveConfig,
        global_client: &mut Option<Node<B, P>>,
    ) -> Result<Vec<(B::FloatTensorPrimitive, usize)>, CollectiveError> {
        let devices = self.calls.len();
        let home = self.calls[0].device.clone();
        let (position, nodes, ranks) = match global_client {
            Some(node) => node.ring_position().await.map_err(CollectiveError::Global)?,
            None => (0, 1, devices),
        };
        // Equal shards need the same device count on every node.
        if config.num_devices != devices || ranks != nodes * devices {
            return Err(CollectiveError::ShardUnevenNodes);
        }
        let len = self.shape[0];
        let mut inputs = self.calls.iter_mut().map(|c| {
            let input = c.input.take().expect("each call's input is taken once");
            B::float_to_device(input, &home)
        });
        match self.kind {
            ShardKind::AllGather => {
                let parts = inputs.collect::<Vec<_>>();
                let block = if parts.len() == 1 {
                    parts.into_iter().next().unwrap()
                } else {
                    B::float_cat(parts, 0)
                };
                let full = match global_client {
                    Some(node) => node.all_gather(block).await.map_err(CollectiveError::Global)?,
                    None => block,
                };
                Ok(self
                    .calls
                    .iter()
                    .enumerate()
                    .map(|(j, c)| {
                        (
                            B::float_to_device(full.clone(), &c.device),
                            position * devices + j,
                        )
                    })
                    .collect())
            }
            ShardKind::ReduceScatter(op) => {
                if len % ranks != 0 {
                    return Err(CollectiveError::ShardShapeMismatch);
                }
                let mut sum = inputs.next().expect("one call per local peer");
                for input in inputs {
                    sum = B::float_add(sum, input);
                }
                let mut block = match global_client {
                    Some(node) => node
                        .reduce_scatter(sum)
                        .await
                        .map_err(CollectiveError::Global)?,
                    None => sum,
                };
                if op == ReduceOperation::Mean {
                    block = B::float_div_scalar(block, (ranks as f32).into());
                }
                let shard = len / ranks;
                Ok(self
                    .calls
                    .iter()
                    .enumerate()
                    .map(|(j, c)| {
                        let part = B::float_slice(
                            block.clone(),
                            &[Slice::from(j * shard..(j + 1) * shard)],
                        );
                        (B::float_to_device(part, &c.device), position * devices + j)
                    })
                    .collect())
            }
        }
    }

    pub(crate) fn fail(self, err: CollectiveError) {
        for call in self.calls {
            let _ = call.result_sender.send(Err(err.clone()));
        }
    }
}
