//! Implements the collective ring all-reduce algorithm on the global level

use core::ops::Range;
use std::{collections::HashMap, sync::Arc};

use crate::{NodeId, global::shared::GlobalCollectiveError, node::sync::SyncService};
use burn_backend::{Backend, DType, Shape, TensorData, TensorMetadata};
use burn_communication::{Address, Protocol, data_service::TensorDataService};
use burn_std::{bf16, f16};

// https://blog.dailydoseofds.com/p/all-reduce-and-ring-reduce-for-model

// Example: tensors=3, slices=3

// phase 1
// o->o  o
// o  o->o
//>o  o  o->

// o  1->o
//>o  o  1->
// 1->o  o

// o  1  2
// 2  o  1
// 1  2  o

// phase 2
//>o  1  2->
// 2->o  1
// 1  2->o

// 2->1  2
// 2  2->1
//>1  2  2->

// 2  2  2
// 2  2  2
// 2  2  2

/// rcoa patch: the ring runs on the host. The tensor is read back once, its
/// blocks travel as raw bytes in chunks of at most `CHUNK_BYTES` (one
/// transfer each, the next chunk's download under way while this one is
/// added), and the result is written to the device once. The release read
/// every block back, serialised it whole with rmp-serde and wrote every
/// received block and every partial sum to the device: on loopback it moved
/// 0.05 GB/s where bare TCP moves 0.5-1 GB/s (`cargo bench -p rcoa-backend
/// --bench transport`), and the device held each block several times over
/// during the exchange.
const CHUNK_BYTES: usize = 8 << 20;

/// Transfer ids of one cycle: chunk `c` of cycle `k` is `k * CYCLE_IDS + c`,
/// the same on every node (each computes the chunking of the block it
/// receives as its sender does of the block it sends).
const CYCLE_IDS: u64 = 1 << 32;

/// Ring all-reduce algorithm with summation
///
/// * `node` - The id of the current node
/// * `nodes` - Map of all nodes in the operation
/// * `data_service` - The data service handles peer-to-peer tensor transfers
/// * `sync_service` - The sync service handles syncing with peers
/// * `tensor` - The tensor to reduce, of any shape; its elements are split
///   into one block per node
pub(crate) async fn ring_all_reduce_sum<B, P>(
    node: NodeId,
    nodes: &HashMap<NodeId, Address>,
    data_service: Arc<TensorDataService<B, P>>,
    sync_service: Arc<SyncService<P>>,
    tensor: B::FloatTensorPrimitive,
) -> Result<B::FloatTensorPrimitive, GlobalCollectiveError>
where
    B: Backend,
    P: Protocol,
{
    let device = B::float_device(&tensor);
    let mut host = HostTensor::read::<B>(tensor).await?;
    let mut ring = Ring::new(node, nodes, data_service);
    let n = ring.len();
    let blocks = host.blocks(n);
    // Phase 1: add
    ring.cycles(&mut host, &blocks, ring.position, true).await?;
    // Phase 2: replace (phase 1 left the node holding the block after its own)
    ring.cycles(&mut host, &blocks, (ring.position + 1) % n, false)
        .await?;
    // Wait for all nodes to finish
    sync_service.sync().await;
    Ok(host.write::<B>(&device))
}

/// rcoa patch: phase 1 of the ring alone, a reduce-scatter. `tensor` is 1-D
/// and its length a multiple of the node count; the node at ring position `p`
/// returns block `p` of the sum.
pub(crate) async fn ring_reduce_scatter_sum<B, P>(
    node: NodeId,
    nodes: &HashMap<NodeId, Address>,
    data_service: Arc<TensorDataService<B, P>>,
    sync_service: Arc<SyncService<P>>,
    tensor: B::FloatTensorPrimitive,
) -> Result<B::FloatTensorPrimitive, GlobalCollectiveError>
where
    B: Backend,
    P: Protocol,
{
    let n = nodes.len();
    if tensor.shape()[0] % n != 0 {
        return Err(GlobalCollectiveError::RingReduceImpossible);
    }
    let device = B::float_device(&tensor);
    let mut host = HostTensor::read::<B>(tensor).await?;
    let mut ring = Ring::new(node, nodes, data_service);
    let blocks = host.blocks(n);
    // Phase 1 ends holding the block after the one it starts sending: start
    // one before this node's own.
    let position = ring.position;
    ring.cycles(&mut host, &blocks, (position + n - 1) % n, true)
        .await?;
    sync_service.sync().await;
    Ok(host.block(&blocks[position]).write::<B>(&device))
}

/// rcoa patch: phase 2 of the ring alone, an all-gather. Every node passes
/// its block (1-D, the same length everywhere) and gets all blocks in ring
/// order.
pub(crate) async fn ring_all_gather<B, P>(
    node: NodeId,
    nodes: &HashMap<NodeId, Address>,
    data_service: Arc<TensorDataService<B, P>>,
    sync_service: Arc<SyncService<P>>,
    block: B::FloatTensorPrimitive,
) -> Result<B::FloatTensorPrimitive, GlobalCollectiveError>
where
    B: Backend,
    P: Protocol,
{
    let device = B::float_device(&block);
    let mine = HostTensor::read::<B>(block).await?;
    let mut ring = Ring::new(node, nodes, data_service);
    let n = ring.len();
    let position = ring.position;
    // The other blocks are overwritten by phase 2.
    let mut host = mine.repeated(n, position);
    let blocks = host.blocks(n);
    ring.cycles(&mut host, &blocks, position, false).await?;
    sync_service.sync().await;
    Ok(host.write::<B>(&device))
}

/// A tensor's bytes on the host while the ring works on them (the buffer
/// the read-back filled, written back as it is).
struct HostTensor {
    bytes: burn_std::Bytes,
    shape: Shape,
    dtype: DType,
}

impl HostTensor {
    async fn read<B: Backend>(
        tensor: B::FloatTensorPrimitive,
    ) -> Result<Self, GlobalCollectiveError> {
        let data = B::float_into_data(tensor)
            .await
            .map_err(|e| GlobalCollectiveError::Server(format!("read-back failed: {e:?}")))?;
        let (dtype, shape) = (data.dtype, data.shape.clone());
        if !matches!(dtype, DType::F64 | DType::F32 | DType::F16 | DType::BF16) {
            return Err(GlobalCollectiveError::Server(format!(
                "the ring cannot add {dtype:?} tensors"
            )));
        }
        Ok(HostTensor {
            bytes: data.into_bytes(),
            shape,
            dtype,
        })
    }

    fn elements(&self) -> usize {
        self.bytes.len() / self.dtype.size()
    }

    /// Byte ranges of `n` blocks of (nearly) equal element counts.
    fn blocks(&self, n: usize) -> Vec<Range<usize>> {
        let (len, size) = (self.elements(), self.dtype.size());
        (0..n)
            .map(|i| i * len / n * size..(i + 1) * len / n * size)
            .collect()
    }

    /// One block of this 1-D tensor, as a tensor of its own.
    fn block(&self, range: &Range<usize>) -> HostTensor {
        let mut bytes = zeros(range.len(), self.dtype);
        bytes.copy_from_slice(&self.bytes[range.clone()]);
        HostTensor {
            shape: Shape::new([range.len() / self.dtype.size()]),
            bytes,
            dtype: self.dtype,
        }
    }

    /// `n` copies of this 1-D tensor end to end, the one at `at` its own
    /// bytes and the others zeros.
    fn repeated(self, n: usize, at: usize) -> HostTensor {
        let len = self.bytes.len();
        let mut bytes = zeros(len * n, self.dtype);
        bytes[at * len..(at + 1) * len].copy_from_slice(&self.bytes);
        HostTensor {
            shape: Shape::new([self.shape[0] * n]),
            bytes,
            dtype: self.dtype,
        }
    }

    fn write<B: Backend>(self, device: &B::Device) -> B::FloatTensorPrimitive {
        B::float_from_data(
            TensorData::from_bytes(self.bytes, self.shape, self.dtype),
            device,
        )
    }

    /// Add the elements in `from` (little-endian, this tensor's dtype) to
    /// the bytes at `at..`.
    fn add(&mut self, at: usize, from: &[u8]) {
        let to = &mut self.bytes[at..at + from.len()];
        fn add_as<const W: usize>(
            to: &mut [u8],
            from: &[u8],
            f: impl Fn([u8; W], [u8; W]) -> [u8; W],
        ) {
            for (t, f_) in to.chunks_exact_mut(W).zip(from.chunks_exact(W)) {
                let sum = f(t.try_into().unwrap(), f_.try_into().unwrap());
                t.copy_from_slice(&sum);
            }
        }
        match self.dtype {
            DType::F64 => add_as::<8>(to, from, |a, b| {
                (f64::from_le_bytes(a) + f64::from_le_bytes(b)).to_le_bytes()
            }),
            DType::F32 => add_as::<4>(to, from, |a, b| {
                (f32::from_le_bytes(a) + f32::from_le_bytes(b)).to_le_bytes()
            }),
            // Half precision adds in f32 and rounds once, as a fused
            // reduction kernel does.
            DType::F16 => add_as::<2>(to, from, |a, b| {
                f16::from_f32(f16::from_le_bytes(a).to_f32() + f16::from_le_bytes(b).to_f32())
                    .to_le_bytes()
            }),
            DType::BF16 => add_as::<2>(to, from, |a, b| {
                bf16::from_f32(
                    bf16::from_le_bytes(a).to_f32() + bf16::from_le_bytes(b).to_f32(),
                )
                .to_le_bytes()
            }),
            _ => unreachable!("`read` admits float dtypes only"),
        }
    }
}

/// `len` zero bytes allocated as elements of `dtype`: a backend takes such a
/// buffer as its tensor without copying, where bytes allocated as `u8` are
/// converted (NdArray: element by element, 0.3 GB/s).
fn zeros(len: usize, dtype: DType) -> burn_std::Bytes {
    let n = len / dtype.size();
    match dtype.size() {
        8 => burn_std::Bytes::from_elems(vec![0u64; n]),
        4 => burn_std::Bytes::from_elems(vec![0u32; n]),
        _ => burn_std::Bytes::from_elems(vec![0u16; n]),
    }
}

/// This node's place in the ring and its link to the previous node.
struct Ring<B: Backend, P: Protocol> {
    position: usize,
    len: usize,
    prev: Address,
    prev_id: NodeId,
    data_service: Arc<TensorDataService<B, P>>,
    /// Cycles done in this operation (transfer ids, `CYCLE_IDS`).
    cycle: u64,
}

impl<B: Backend, P: Protocol> Ring<B, P> {
    fn new(
        node: NodeId,
        nodes: &HashMap<NodeId, Address>,
        data_service: Arc<TensorDataService<B, P>>,
    ) -> Self {
        let ring = get_ring_topology(nodes.keys().cloned().collect::<Vec<_>>());
        let len = ring.len();
        let position = ring.iter().position(|id| *id == node).expect("Node is in ring");
        let prev_id = ring[(position + len - 1) % len];
        Ring {
            position,
            len,
            prev: nodes.get(&prev_id).unwrap().clone(),
            prev_id,
            data_service,
            cycle: 0,
        }
    }

    fn len(&self) -> usize {
        self.len
    }

    /// N-1 cycles of one phase: send block `send`, receive the one before it
    /// from the previous node and add it to ours (`add`, phase 1) or take
    /// it (phase 2), then send that one next.
    async fn cycles(
        &mut self,
        host: &mut HostTensor,
        blocks: &[Range<usize>],
        mut send: usize,
        add: bool,
    ) -> Result<(), GlobalCollectiveError> {
        let n = blocks.len();
        for _ in 0..n - 1 {
            let recv = (send + n - 1) % n;
            let base = self.cycle * CYCLE_IDS;
            let outgoing = bytes::Bytes::copy_from_slice(&host.bytes[blocks[send].clone()]);
            for (c, range) in chunks(outgoing.len()).into_iter().enumerate() {
                self.data_service
                    .expose_bytes(outgoing.slice(range), 1, (base + c as u64).into())
                    .await;
            }
            let incoming = chunks(blocks[recv].len());
            let download = |c: usize| {
                let (service, prev) = (self.data_service.clone(), self.prev.clone());
                tokio::spawn(
                    async move { service.download_bytes(prev, (base + c as u64).into()).await },
                )
            };
            let mut next = Some(download(0));
            for (c, range) in incoming.iter().enumerate() {
                // A peer that died (closed its connection, or could not be
                // reached: the download task panics then) is an error, not a
                // panic of the collective server task.
                let got = next.take().expect("one download per chunk").await;
                let Ok(Some(got)) = got else {
                    return Err(GlobalCollectiveError::PeerLost(self.prev_id));
                };
                if c + 1 < incoming.len() {
                    next = Some(download(c + 1));
                }
                if got.len() != range.len() {
                    return Err(GlobalCollectiveError::PeerSentIncoherentTensor);
                }
                let at = blocks[recv].start + range.start;
                if add {
                    host.add(at, &got);
                } else {
                    host.bytes[at..at + got.len()].copy_from_slice(&got);
                }
            }
            send = recv;
            self.cycle += 1;
        }
        Ok(())
    }
}

/// The chunks a block of `len` bytes travels in (one, empty, for an empty
/// block, so that sender and receiver still meet).
fn chunks(len: usize) -> Vec<Range<usize>> {
    if len == 0 {
        return vec![0..0];
    }
    (0..len.div_ceil(CHUNK_BYTES))
        .map(|c| c * CHUNK_BYTES..((c + 1) * CHUNK_BYTES).min(len))
        .collect()
}

/// Get the ring topology
fn get_ring_topology(mut nodes: Vec<NodeId>) -> Vec<NodeId> {
    // This ordering could be more sophisticated, using node proximities etc
    nodes.sort();

    nodes
}
