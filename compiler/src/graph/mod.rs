//! The training step as a graph: one node per operation, one edge per tensor.
//!
//! Built from the memory model's tape ([`crate::memory::tape::Tape`]) so the
//! two never disagree: forward operations (embedding, norms, projections,
//! attention, MLP, residuals, head, loss, adapters) are nodes; parameters and
//! step inputs are source nodes; the optimizer update is a sink that every
//! trainable parameter's gradient flows into. Each edge carries the tensor's
//! shape, dtype and bytes; each op node lists the tensors it saves for the
//! backward, so the saved-for-backward sets are explicit.
//!
//! Invariants: nodes are never removed (petgraph's `Graph::remove_node`
//! renumbers), so [`NodeId`]s stay valid; node order is the forward schedule.

use crate::memory::tape::{OpId, Role, Tape, TensorId};
use crate::memory::{build::Builder, Candidate};
use crate::profile::Profile;
use crate::spec::{Dtype, Spec};
use petgraph::graph::{DiGraph, NodeIndex};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt;

/// A node of the step graph (prints as `n3`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct NodeId(pub u32);

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "n{}", self.0)
    }
}

impl From<NodeIndex> for NodeId {
    fn from(i: NodeIndex) -> Self {
        NodeId(i.index() as u32)
    }
}

#[derive(Clone, Debug, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Node {
    /// Token ids, labels (or a pipeline stage's incoming activations).
    Input { tensor: TensorId },
    /// A parameter; `trainable` ones have a gradient and optimizer state.
    Param {
        tensor: TensorId,
        name: &'static str,
        trainable: bool,
    },
    /// A forward operation and the tensors it saves for its backward.
    Op {
        op: OpId,
        name: &'static str,
        layer: Option<u32>,
        saved: Vec<TensorId>,
        saved_bytes: u64,
    },
    /// The optimizer update: reads every trainable parameter's gradient.
    OptimizerUpdate,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EdgeKind {
    /// A forward tensor from its producer to a consumer.
    Tensor,
    /// A parameter's gradient into the optimizer update.
    Grad,
}

#[derive(Clone, Debug, Serialize)]
pub struct Edge {
    pub kind: EdgeKind,
    pub tensor: TensorId,
    pub shape: Vec<u64>,
    pub dtype: Dtype,
    pub bytes: u64,
}

/// The step graph of one (model, micro-batch shape) and the tape it came from.
pub struct TrainGraph {
    pub graph: DiGraph<Node, Edge>,
    pub tape: Tape,
}

/// Counts for `--explain` and reports.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct GraphSummary {
    pub ops: usize,
    pub tensors: usize,
    pub params: usize,
    pub trainable_params: usize,
    /// Operations per layer (layers are alike).
    pub ops_per_layer: usize,
    /// Bytes one layer saves for its backward when not checkpointed (layer 1: inputs need grad).
    pub saved_bytes_per_layer: u64,
    /// Operations by name, sorted.
    pub op_counts: BTreeMap<String, usize>,
}

impl TrainGraph {
    /// Build the graph of one micro-step for `cand` (checkpointing does not change the graph,
    /// only which saved sets are kept; the candidate's parallel degrees set the shapes).
    pub fn build(spec: &Spec, cand: &Candidate, profile: &Profile) -> TrainGraph {
        let b = Builder::new(spec, profile, cand).build(0..spec.model.layers, true, true);
        Self::from_tape(b.tape)
    }

    pub fn from_tape(tape: Tape) -> TrainGraph {
        let mut graph = DiGraph::new();
        let mut node_of_tensor: Vec<Option<NodeIndex>> = vec![None; tape.tensors.len()];
        for (i, t) in tape.tensors.iter().enumerate() {
            if t.producer.is_some() {
                continue;
            }
            let tensor = TensorId(i as u32);
            let node = match t.role {
                Role::Param => Node::Param {
                    tensor,
                    name: t.name,
                    trainable: t.requires_grad,
                },
                _ => Node::Input { tensor },
            };
            node_of_tensor[i] = Some(graph.add_node(node));
        }
        let mut op_nodes = Vec::with_capacity(tape.ops.len());
        for (i, op) in tape.ops.iter().enumerate() {
            let saved_bytes = op.saved.iter().map(|t| tape.tensor(*t).bytes).sum();
            let n = graph.add_node(Node::Op {
                op: OpId(i as u32),
                name: op.name,
                layer: op.layer,
                saved: op.saved.clone(),
                saved_bytes,
            });
            op_nodes.push(n);
            for &out in &op.outputs {
                node_of_tensor[out.0 as usize] = Some(n);
            }
            for &inp in &op.inputs {
                if let Some(src) = node_of_tensor[inp.0 as usize] {
                    let t = tape.tensor(inp);
                    graph.add_edge(
                        src,
                        n,
                        Edge {
                            kind: EdgeKind::Tensor,
                            tensor: inp,
                            shape: t.shape.clone(),
                            dtype: t.dtype,
                            bytes: t.bytes,
                        },
                    );
                }
            }
        }
        let update = graph.add_node(Node::OptimizerUpdate);
        for (i, t) in tape.tensors.iter().enumerate() {
            if t.role == Role::Param && t.requires_grad {
                if let Some(src) = node_of_tensor[i] {
                    graph.add_edge(
                        src,
                        update,
                        Edge {
                            kind: EdgeKind::Grad,
                            tensor: TensorId(i as u32),
                            shape: t.shape.clone(),
                            dtype: t.dtype,
                            bytes: t.grad_bytes,
                        },
                    );
                }
            }
        }
        TrainGraph { graph, tape }
    }

    pub fn summary(&self) -> GraphSummary {
        let mut op_counts = BTreeMap::new();
        let mut params = 0;
        let mut trainable = 0;
        for n in self.graph.node_weights() {
            match n {
                Node::Op { name, .. } => *op_counts.entry(name.to_string()).or_insert(0) += 1,
                Node::Param { trainable: t, .. } => {
                    params += 1;
                    trainable += *t as usize;
                }
                _ => {}
            }
        }
        let layer = self.tape.layers.get(1).or(self.tape.layers.first());
        let (ops_per_layer, saved) = layer.map_or((0, 0), |l| {
            let mut saved: Vec<TensorId> = Vec::new();
            for op in &self.tape.ops[l.first_op as usize..l.end_op as usize] {
                if op.has_backward(&self.tape) {
                    saved.extend(op.saved.iter().copied());
                }
            }
            saved.sort();
            saved.dedup();
            let bytes = saved
                .iter()
                .map(|t| self.tape.tensor(*t))
                .filter(|t| t.role != Role::Param)
                .map(|t| t.bytes)
                .sum();
            ((l.end_op - l.first_op) as usize, bytes)
        });
        GraphSummary {
            ops: self.tape.ops.len(),
            tensors: self.tape.tensors.len(),
            params,
            trainable_params: trainable,
            ops_per_layer,
            saved_bytes_per_layer: saved,
            op_counts,
        }
    }
}
