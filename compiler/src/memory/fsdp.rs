//! FSDP2's own buffers placed on the tape: what `fully_shard` holds while each op runs, in
//! the forward, in a checkpointed layer's recompute and in the backward.
//!
//! The units are the ones a plan's `fully_shard` calls make (`emit::script`): every
//! transformer layer, then the root (the embedding, the final norm and the head: every
//! parameter no layer reads). From PyTorch's `torch/distributed/fsdp/_fully_shard/`
//! (torch 2.11; `_fsdp_param_group.py`, `_fsdp_collectives.py`, `_fsdp_state.py`):
//!
//! - **Gathered copies.** `unshard` all-gathers a unit into one flat output in
//!   `param_dtype` (`foreach_all_gather`), `wait_for_unshard` copies it out into one
//!   unsharded tensor per parameter (`foreach_all_gather_copy_out`). In the forward the
//!   flat output is kept in `comm_ctx.all_gather_state` until the next unit's copy-out
//!   ("[Note: Overlapping all-gather copy-in and all-gather]"), and the root's post-forward
//!   drops the last one; in the backward it is freed right after the copy-out.
//!   `reshard_after_forward=True` (`zero = 3`; the root too, as rcoa's script writes it)
//!   frees a unit's copies after its forward; a root unit stays gathered through the whole
//!   forward (its forward is the model's) and, gathered again by its pre-backward, through
//!   the whole backward (its post-backward runs in the final callback: no input of the root
//!   needs a gradient). `False` (`zero = 2`) keeps every unit gathered from its forward to
//!   its backward.
//! - **Backward prefetch.** A unit's pre-backward all-gathers the unit before it in forward
//!   order (`_backward_prefetch`): that flat output lives while the unit's backward runs.
//! - **Gradients.** Autograd accumulates the unsharded gradients (in `param_dtype`) until
//!   the unit's post-backward, which copies them into one reduce-scatter input in
//!   `reduce_dtype` (`foreach_reduce`) kept in `comm_ctx.reduce_scatter_state` until the
//!   next unit's post-backward. The sharded gradient is what the tape already charges per
//!   parameter (`Persistent::grad_divisor`); the root's unsharded gradients wait for the
//!   final callback.
//!
//! Each parameter is padded to a multiple of the data degree along its first dimension
//! (`_fsdp_param.py` `_init_sharded_param`), so gathered and reduced sizes are padded.
//!
//! Checked against rank 0 of the fake-process-group rows in
//! `tests/groundtruth/h100-multigpu.jsonl` (docs/accuracy.md, "FSDP2").

use super::tape::{Role, Tape};

/// Which `fully_shard` unit an op belongs to.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Unit {
    /// Root ops before the first layer (the embedding).
    RootBefore,
    /// The `k`-th layer of the tape's stage.
    Layer(usize),
    /// Root ops after the last layer (final norm, head, loss).
    RootAfter,
}

/// What one unit gathers and reduces.
#[derive(Clone, Copy, Default)]
struct UnitBytes {
    /// The unsharded parameters, one allocation each.
    unsharded: u64,
    /// The flat all-gather output.
    flat: u64,
    /// The flat reduce-scatter input.
    reduce: u64,
}

/// FSDP2's settings for one tape.
pub(crate) struct Schedule<'a> {
    /// The data-parallel degree the units are sharded over.
    pub data: u64,
    /// `reshard_after_forward=True` (`zero = 3`).
    pub reshard: bool,
    /// Bytes of a reduce-scatter element (`reduce_dtype`).
    pub reduce_bytes: f64,
    /// The allocator's size for a request (`Profile::allocated`).
    pub allocated: &'a dyn Fn(u64) -> u64,
}

impl Schedule<'_> {
    /// Elements of `p` after padding its first dimension to a multiple of the data degree.
    fn padded(&self, shape: &[u64]) -> u64 {
        let d = self.data.max(1);
        match shape {
            [] => 0,
            [rows, rest @ ..] => rows.div_ceil(d) * d * rest.iter().product::<u64>(),
        }
    }

    /// Charge FSDP2's buffers to every op of `tape` (its `engine` scratch).
    pub fn apply(&self, tape: &mut Tape) {
        let n_layers = tape.layers.len();
        let unit_of = |tape: &Tape, op: usize| -> Unit {
            match tape.layer_of_op(op) {
                Some(l) => Unit::Layer((l.index - tape.layers[0].index) as usize),
                None if n_layers > 0 && op >= tape.layers[0].first_op as usize => Unit::RootAfter,
                None => Unit::RootBefore,
            }
        };
        let units: Vec<Unit> = (0..tape.ops.len()).map(|o| unit_of(tape, o)).collect();
        // Each parameter belongs to the unit of the first op that reads it; its gradient is
        // made by the backward of the last op that reads it (the first of them to run
        // backward: a tied head's, for the embedding table).
        let mut owner: Vec<Option<usize>> = vec![None; tape.tensors.len()];
        let mut last_reader: Vec<usize> = vec![0; tape.tensors.len()];
        for (o, op) in tape.ops.iter().enumerate() {
            for &t in &op.inputs {
                let i = t.0 as usize;
                if tape.tensors[i].role == Role::Param {
                    owner[i].get_or_insert(o);
                    last_reader[i] = o;
                }
            }
        }
        // Per unit: [root, layer 0, layer 1, ...].
        let slot = |u: Unit| match u {
            Unit::RootBefore | Unit::RootAfter => 0,
            Unit::Layer(k) => k + 1,
        };
        let mut sums = vec![(0u64, 0u64, 0u64); n_layers + 1];
        // Gradient bytes each op's backward makes.
        let mut grad_at = vec![0u64; tape.ops.len()];
        for (i, o) in owner.iter().enumerate() {
            let Some(o) = *o else { continue };
            let t = &tape.tensors[i];
            let b = t.dtype.bytes();
            let padded = self.padded(&t.shape);
            let s = &mut sums[slot(units[o])];
            s.0 += (self.allocated)((padded as f64 * b).ceil() as u64);
            s.1 += padded;
            if t.requires_grad {
                s.2 += padded;
                let elems: u64 = t.shape.iter().product();
                grad_at[last_reader[i]] += (self.allocated)((elems as f64 * b).ceil() as u64);
            }
        }
        // The compute dtype's bytes of the flat buffers: the parameters' own (the tape
        // holds them in `param_dtype`); units of mixed dtypes take the widest.
        let mut widest = vec![0f64; n_layers + 1];
        for (i, o) in owner.iter().enumerate() {
            if let Some(o) = *o {
                let w = &mut widest[slot(units[o])];
                *w = w.max(tape.tensors[i].dtype.bytes());
            }
        }
        let bytes: Vec<UnitBytes> = sums
            .iter()
            .zip(&widest)
            .map(|(&(unsharded, elems, trainable), &b)| UnitBytes {
                unsharded,
                flat: (self.allocated)((elems as f64 * b).ceil() as u64),
                reduce: if trainable > 0 {
                    (self.allocated)((trainable as f64 * self.reduce_bytes).ceil() as u64)
                } else {
                    0
                },
            })
            .collect();
        let root = bytes[0];
        let layer = |k: usize| bytes[k + 1];
        let last_flat = if n_layers > 0 {
            layer(n_layers - 1).flat
        } else {
            root.flat
        };
        // Layers gathered before `k` and still gathered (reshard_after_forward=False).
        let kept_before = |k: usize| -> u64 {
            if self.reshard {
                0
            } else {
                (0..k).map(|j| layer(j).unsharded).sum()
            }
        };
        let all_layers: u64 = (0..n_layers).map(|j| layer(j).unsharded).sum();
        // The gradients already made when op `o`'s backward runs (not its own, which the
        // walk charges as the op's): the root's, of root ops after `o` (the backward runs
        // them first); its layer's, of the layer's ops after `o`.
        let n_ops = tape.ops.len();
        let mut root_grads_after = vec![0u64; n_ops + 1];
        let mut layer_grads_after = vec![0u64; n_ops];
        let mut running = 0u64;
        for o in (0..n_ops).rev() {
            let root_op = !matches!(units[o], Unit::Layer(_));
            root_grads_after[o] = root_grads_after[o + 1] + if root_op { grad_at[o] } else { 0 };
            if o + 1 < n_ops && units[o + 1] != units[o] {
                running = 0;
            }
            if !root_op {
                layer_grads_after[o] = running;
                running += grad_at[o];
            }
        }
        for (o, op) in tape.ops.iter_mut().enumerate() {
            let s = &mut op.engine;
            match units[o] {
                Unit::RootBefore => {
                    s.forward = [root.unsharded + root.flat, 0];
                    // The first layer's reduce-scatter input waits for the root's.
                    let rs = if n_layers > 0 { layer(0).reduce } else { 0 };
                    s.backward = [root.unsharded, rs + root_grads_after[o + 1]];
                }
                Unit::Layer(k) => {
                    let u = layer(k);
                    s.forward = [root.unsharded + kept_before(k) + u.unsharded + u.flat, 0];
                    let prefetch = if self.reshard && k > 0 {
                        layer(k - 1).flat
                    } else {
                        0
                    };
                    let rs = if k + 1 < n_layers {
                        layer(k + 1).reduce
                    } else {
                        0
                    };
                    let gathered = root.unsharded + kept_before(k) + u.unsharded + prefetch;
                    let waiting = rs + root_grads_after[o + 1];
                    s.recompute = [gathered, waiting];
                    s.backward = [gathered, waiting + layer_grads_after[o]];
                }
                Unit::RootAfter => {
                    let kept = if self.reshard { 0 } else { all_layers };
                    s.forward = [root.unsharded + kept + last_flat, 0];
                    // Backward: the root gathered again, the last layer prefetched.
                    let prefetch = if self.reshard { last_flat } else { 0 };
                    s.backward = [root.unsharded + kept + prefetch, root_grads_after[o + 1]];
                }
            }
        }
    }
}
