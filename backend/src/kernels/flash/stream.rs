//! How the register kernels (`forward_registers`, `backward_registers`) stream the blocks
//! of the other side through shared memory: K and V past a forward's or a query kernel's
//! queries, q and dO (with their LSE and D) past a key kernel's keys.
//!
//! [`Staging::Single`] stages each block into one tile per operand and reads it: two cube
//! barriers a block, and nothing computes while the block loads. [`Staging::Copies`] is
//! FlashAttention-2's pipeline: two tiles per operand, and block `i + 1`'s copies issued
//! with `cp.async` into the other tile as soon as block `i` is in, so they run under block
//! `i`'s products and complete on a barrier; one barrier a block. [`Staging::Double`] is
//! the same schedule with plain loads, which is how lavapipe (no barrier objects, no
//! asynchronous copies) checks its indices: the tile each block goes to and is read from.
//!
//! A kernel runs the schedule as
//!
//! ```text
//! if ahead: stage block 0 into tile 0; commit
//! for each block i:
//!     if !ahead: sync_cube; stage block i into tile 0
//!     wait                       (all of block i in; every unit past block i − 1's reads)
//!     if ahead and i + 1 < n: stage block i + 1 into tile (i + 1) % 2; commit
//!     compute on tile i % 2 (0 without ahead)
//! ```
//!
//! so a tile is overwritten only after every unit passed the barrier that follows its last
//! reads, and the last block issues no copy (none is left in flight at the end).

use cubecl::prelude::barrier::{copy_async, Barrier};
use cubecl::prelude::*;

use super::tile::{copy_barrier, stage_tile_async_at, stage_tile_at};

/// Rows of a streamed block (and of the block a cube owns): 4 warps of 16.
pub const BLOCK: usize = 64;
/// Units of a register kernel's cube: 4 warps of 32.
pub const UNITS: usize = 128;

/// How a register kernel stages the blocks it streams.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Staging {
    /// One tile per operand; each block staged with plain loads, then read.
    Single,
    /// Two tiles per operand, the next block staged ahead with plain loads (the schedule
    /// of `Copies`, checked on any device; on CUDA a warp still waits for its loads where
    /// it stores them, so this hides nothing there).
    Double,
    /// Two tiles per operand, the next block copied ahead with `cp.async`, this many
    /// 16-bit elements (16 bytes) a copy (`launch::async_copy_fits`).
    Copies(usize),
}

impl Staging {
    /// Tiles per streamed operand.
    pub const fn tiles(self) -> usize {
        match self {
            Staging::Single => 1,
            Staging::Double | Staging::Copies(_) => 2,
        }
    }

    /// Whether the next block is staged before this one is read.
    pub const fn ahead(self) -> bool {
        !matches!(self, Staging::Single)
    }

    /// Whether the staging copies asynchronously.
    pub const fn copies(self) -> bool {
        matches!(self, Staging::Copies(_))
    }

    /// Elements per asynchronous copy (1 where there are none: unused).
    pub const fn copy(self) -> usize {
        match self {
            Staging::Copies(copy) => copy,
            Staging::Single | Staging::Double => 1,
        }
    }
}

/// The tile of block `i` under `staging` (0 without `ahead`).
#[cube]
pub fn tile_of(i: usize, #[comptime] staging: Staging) -> usize {
    if comptime![staging.ahead()] {
        i % 2
    } else {
        usize::new(0)
    }
}

/// Stages rows `r0 .. r0 + BLOCK` of one `(batch, head)` slice of `src` (from element
/// `base`; rows past `n` repeat row `n − 1`) into tile `tile` of `dst`, whose tiles are
/// `BLOCK · ld` elements each (`tile::stage_tile`'s layout).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn stage_block<F: Float, N: Size>(
    src: &Tensor<Vector<F, N>>,
    dst: &mut SharedMemory<F>,
    tile: usize,
    base: usize,
    r0: usize,
    n: usize,
    #[comptime] dim: usize,
    #[comptime] ld: usize,
    #[comptime] staging: Staging,
) {
    let at = tile * comptime![BLOCK * ld];
    if comptime![staging.copies()] {
        let copy = comptime![staging.copy()];
        stage_tile_async_at::<F, N>(src, dst, at, base, r0, n, BLOCK, dim, ld, UNITS, copy);
    } else {
        stage_tile_at::<F, N>(src, dst, at, base, r0, n, BLOCK, dim, ld, UNITS);
    }
}

/// `dst[to] = src[from]` for one fp32 value of a block's row (its LSE, D or key bias): a
/// 4-byte `cp.async` under [`Staging::Copies`], completing with the block's tiles.
#[cube]
pub fn stage_value(
    src: &Tensor<f32>,
    from: usize,
    dst: &mut SharedMemory<f32>,
    to: usize,
    #[comptime] staging: Staging,
) {
    if comptime![staging.copies()] {
        let mut into = dst.slice_mut(to, to + 1);
        copy_async::<f32>(&src.slice(from, from + 1), &mut into, 1u32);
    } else {
        dst[to] = src[from];
    }
}

/// The barrier the copies of [`Staging::Copies`] complete on (every unit arrives on it once
/// a block); none elsewhere, since wgpu has no barrier objects.
#[cube]
pub fn ready_barrier(#[comptime] staging: Staging) -> ComptimeOption<Shared<Barrier>> {
    copy_barrier(comptime![staging.copies()])
}

/// After a block's copies are issued: they complete on `ready`.
#[cube]
pub fn commit(ready: &ComptimeOption<Shared<Barrier>>, #[comptime] staging: Staging) {
    if comptime![staging.copies()] {
        ready.unwrap().commit_copy_async();
    }
}

/// Before a block is read: all of it is in shared memory, and every unit is past the reads
/// of the block before (a barrier of the whole cube either way). The kernels rely on the
/// second half too: it is what lets a tile (and the one-pass backward's `dS` tile) be
/// written again. So every unit must arrive here; an arrival by one elected unit or a bulk
/// (TMA) copy would need its own barrier, and a `fence.proxy.async` before the copy.
#[cube]
pub fn wait(ready: &ComptimeOption<Shared<Barrier>>, #[comptime] staging: Staging) {
    if comptime![staging.copies()] {
        ready.unwrap().arrive_and_wait();
    } else {
        sync_cube();
    }
}

/// Bytes of shared memory a cube's arrays take: `(elements, bytes per element)` each,
/// every array from a 128-byte boundary (as the kernels align their tiles).
pub fn shared_bytes(arrays: &[(usize, usize)]) -> usize {
    arrays
        .iter()
        .map(|&(n, size)| (n * size).next_multiple_of(128))
        .sum()
}

/// Panics, with what and how much, where a cube of `what` needs more shared memory than
/// `client`'s device gives one: such a launch does not run, and wgpu's error does not
/// reach the caller.
pub fn check_shared<R: Runtime>(client: &ComputeClient<R>, bytes: usize, what: &str) {
    let max = client.properties().hardware.max_shared_memory_size;
    assert!(
        bytes <= max,
        "{what} needs {bytes} bytes of shared memory a cube; the device gives {max}"
    );
}
