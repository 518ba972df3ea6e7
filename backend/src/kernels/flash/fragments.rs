//! What the register kernels (`forward_registers`, `backward_registers`) share: PTX's
//! `m16n8k16` fragment layouts, the loads of `A` and `B` fragments from shared-memory
//! tiles, one warp's product, and the sums and maxima across a quad of lanes, each on the
//! tensor cores ([`Fragments::Registers`]) or emulated through shared memory on any device
//! ([`Fragments::Emulated`]), so that lavapipe checks the kernels' indices.

use cubecl::cmma::MmaDefinition;
use cubecl::prelude::*;

/// How a warp multiplies fragments and shares values between its lanes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fragments {
    /// PTX `mma.sync.m16n8k16` and warp shuffles (CUDA).
    Registers,
    /// The same through shared memory and cube barriers (any device).
    Emulated,
}

impl Fragments {
    /// The f32 shared memory a cube of 4 warps passes to [`product`] and [`across_quad`]:
    /// none with the registers (one element, as a cube's array cannot be empty).
    pub const fn scratch_len(self) -> usize {
        match self {
            Fragments::Registers => 1,
            Fragments::Emulated => 4 * SCRATCH_PER_WARP,
        }
    }
}

/// Two values of a fragment: the 32 bits a lane passes per register (16-bit inputs), or an
/// accumulator's pair of adjacent columns.
pub type Pair<E> = Vector<E, Const<2>>;

/// Shared memory the emulation takes per warp: an `A` fragment (16 × 16) and a `B` (16 × 8).
pub const SCRATCH_PER_WARP: usize = 16 * 16 + 16 * 8;

/// (row, col) of element `i` of a lane's `A` fragment (16 × 16, 8 elements).
#[cube]
pub fn a_place(lane: usize, #[comptime] i: usize) -> (usize, usize) {
    let row = lane / 4 + comptime![8 * ((i / 2) % 2)];
    let col = (lane % 4) * 2 + comptime![i % 2 + 8 * (i / 4)];
    (row, col)
}

/// A lane's `A` fragment of a 16-bit tile in shared memory, row-major from `offset` with
/// row stride `ld`: rows `offset / ld ..+ 16`, 16 columns; each pair one 32-bit load.
#[cube]
pub fn a_fragment<F: Float>(
    tile: &SharedMemory<F>,
    offset: usize,
    ld: usize,
    lane: usize,
) -> Array<Pair<F>> {
    let mut a = Array::<Pair<F>>::new(4usize);
    #[unroll]
    for p in 0..4usize {
        let mut pair = Pair::<F>::empty();
        #[unroll]
        for e in 0..2usize {
            let (r, col) = a_place(lane, p * 2 + e);
            pair[e] = tile[offset + r * ld + col];
        }
        a[p] = pair;
    }
    a
}

/// (k, n) of element `i` of a lane's `B` fragment (16 × 8, 4 elements).
#[cube]
pub fn b_place(lane: usize, #[comptime] i: usize) -> (usize, usize) {
    let k = (lane % 4) * 2 + comptime![i % 2 + 8 * (i / 2)];
    (k, lane / 4)
}

/// A lane's `B` fragment of a 16-bit tile in shared memory, `B[kk][n]` at
/// `offset + kk · k_stride + n · n_stride`: K's as it is stored (`k_stride` 1, each pair
/// one 32-bit load), V's across its rows.
#[cube]
pub fn b_fragment<F: Float>(
    tile: &SharedMemory<F>,
    offset: usize,
    #[comptime] k_stride: usize,
    #[comptime] n_stride: usize,
    lane: usize,
) -> Array<Pair<F>> {
    let mut b = Array::<Pair<F>>::new(2usize);
    #[unroll]
    for p in 0..2usize {
        let mut pair = Pair::<F>::empty();
        #[unroll]
        for e in 0..2usize {
            let (kk, n) = b_place(lane, p * 2 + e);
            pair[e] = tile[offset + kk * k_stride + n * n_stride];
        }
        b[p] = pair;
    }
    b
}

/// (row, col) of element `i` of a lane's accumulator (16 × 8, 4 elements): vector `i / 2`
/// holds row `lane / 4` (`i < 2`) or that row + 8, columns `(lane % 4) · 2 ..+ 2`.
#[cube]
pub fn c_place(lane: usize, #[comptime] i: usize) -> (usize, usize) {
    let row = lane / 4 + comptime![8 * (i / 2)];
    let col = (lane % 4) * 2 + comptime![i % 2];
    (row, col)
}

/// `c += a b` for the calling warp: one `m16n8k16` product.
#[cube]
pub fn product<F: Float>(
    a: &Array<Pair<F>>,
    b: &Array<Pair<F>>,
    c: &mut Array<Pair<f32>>,
    scratch: &mut SharedMemory<f32>,
    #[comptime] frags: Fragments,
) {
    if comptime![frags == Fragments::Registers] {
        let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
        def.execute_inplace(a, b, c);
    } else {
        let unit = UNIT_POS as usize;
        let lane = unit % 32;
        let base = (unit / 32) * SCRATCH_PER_WARP;
        #[unroll]
        for i in 0..8usize {
            let (r, col) = a_place(lane, i);
            scratch[base + r * 16 + col] = f32::cast_from(a[i / 2][i % 2]);
        }
        #[unroll]
        for i in 0..4usize {
            let (kk, n) = b_place(lane, i);
            scratch[base + 256 + kk * 8 + n] = f32::cast_from(b[i / 2][i % 2]);
        }
        sync_cube();
        #[unroll]
        for half in 0..2usize {
            let mut pair = c[half];
            #[unroll]
            for e in 0..2usize {
                let (r, col) = c_place(lane, half * 2 + e);
                let mut sum = f32::new(0.0);
                for kk in 0..16usize {
                    sum += scratch[base + r * 16 + kk] * scratch[base + 256 + kk * 8 + col];
                }
                pair[e] += sum;
            }
            c[half] = pair;
        }
        sync_cube();
    }
}

/// The maximum (or, with `sum`, the sum) of `x` over the 4 lanes that hold the same rows.
#[cube]
pub fn across_quad(
    x: f32,
    scratch: &mut SharedMemory<f32>,
    #[comptime] sum: bool,
    #[comptime] frags: Fragments,
) -> f32 {
    let mut out = x;
    if comptime![frags == Fragments::Registers] {
        #[unroll]
        for step in 0..2u32 {
            let other = plane_shuffle_xor(out, 1u32 << step);
            if sum {
                out += other;
            } else {
                out = max(out, other);
            }
        }
    } else {
        let unit = UNIT_POS as usize;
        scratch[unit] = x;
        sync_cube();
        let first = unit - unit % 4;
        out = scratch[first];
        #[unroll]
        for i in 1..4usize {
            let other = scratch[first + i];
            if sum {
                out += other;
            } else {
                out = max(out, other);
            }
        }
        sync_cube();
    }
    out
}

/// A lane's `A` fragments of the 16 rows from `offset` of a tile (row stride `ld`) across
/// `steps` steps of 16 columns: fragment `kq` is pairs `4 kq ..+ 4`. Kept in registers
/// for a whole kernel (`Registers` unrolls every loop).
#[cube]
pub fn a_fragments<F: Float>(
    tile: &SharedMemory<F>,
    offset: usize,
    ld: usize,
    lane: usize,
    #[comptime] steps: usize,
    #[comptime] unroll: bool,
) -> Array<Pair<F>> {
    let mut out = Array::<Pair<F>>::new(steps * 4);
    #[unroll(unroll)]
    for kq in 0..steps {
        let a = a_fragment::<F>(tile, offset + kq * 16, ld, lane);
        #[unroll]
        for p in 0..4usize {
            out[kq * 4 + p] = a[p];
        }
    }
    out
}

/// `A Bᵀ` for 16 columns: the calling warp's 16 rows of `A` against rows `row ..+ 16` of
/// `tile` (row stride `ld`). `A` is `a` (from [`a_fragments`], `steps` of 16 columns) or,
/// with `from_tile`, read fragment by fragment from `a_tile` at `a_offset` (row stride
/// `ld`), for a kernel that cannot hold it in registers (`a` is then not read).
///
/// Two accumulator tiles of 8 columns, as 4 pairs: `jt · 2 + half` for tile `jt`, rows
/// `lane / 4 + 8 half`. Those 4 pairs, rounded to the input type, are element for element
/// the `A` fragment of the same 16 × 16 block (pair `p`: tile `p / 2`, half `p % 2`), which
/// is how a kernel multiplies a block of probabilities without leaving the registers.
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn scores<F: Float>(
    a: &Array<Pair<F>>,
    a_tile: &SharedMemory<F>,
    a_offset: usize,
    tile: &SharedMemory<F>,
    row: usize,
    #[comptime] ld: usize,
    lane: usize,
    scratch: &mut SharedMemory<f32>,
    #[comptime] steps: usize,
    #[comptime] from_tile: bool,
    #[comptime] frags: Fragments,
) -> Array<Pair<f32>> {
    let unroll = comptime![frags == Fragments::Registers];
    let mut out = Array::<Pair<f32>>::new(4usize);
    #[unroll]
    for jt in 0..2usize {
        let mut c = Array::<Pair<f32>>::new(2usize);
        c[0] = Pair::<f32>::new(0.0f32);
        c[1] = Pair::<f32>::new(0.0f32);
        #[unroll(unroll)]
        for kq in 0..steps {
            let mut fa = Array::<Pair<F>>::new(4usize);
            if from_tile {
                let loaded = a_fragment::<F>(a_tile, a_offset + kq * 16, ld, lane);
                #[unroll]
                for p in 0..4usize {
                    fa[p] = loaded[p];
                }
            } else {
                #[unroll]
                for p in 0..4usize {
                    fa[p] = a[kq * 4 + p];
                }
            }
            // B[kk][n] = tile[row + 8 jt + n][16 kq + kk].
            let fb = b_fragment::<F>(tile, (row + jt * 8) * ld + kq * 16, 1usize, ld, lane);
            product::<F>(&fa, &fb, &mut c, scratch, frags);
        }
        out[jt * 2] = c[0];
        out[jt * 2 + 1] = c[1];
    }
    out
}

/// `acc += a T` where `a` is an `A` fragment (16 × 16) and `T` rows `row ..+ 16` of `tile`
/// (row stride `ld`), all `tiles` 8-column tiles of them; `acc` holds two pairs per tile
/// (`n · 2 + half`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn accumulate<F: Float>(
    a: &Array<Pair<F>>,
    tile: &SharedMemory<F>,
    row: usize,
    #[comptime] ld: usize,
    acc: &mut Array<Pair<f32>>,
    lane: usize,
    scratch: &mut SharedMemory<f32>,
    #[comptime] tiles: usize,
    #[comptime] frags: Fragments,
) {
    let unroll = comptime![frags == Fragments::Registers];
    #[unroll(unroll)]
    for n in 0..tiles {
        // B[kk][c] = tile[row + kk][8 n + c].
        let b = b_fragment::<F>(tile, row * ld + n * 8, ld, 1usize, lane);
        let mut c = Array::<Pair<f32>>::new(2usize);
        c[0] = acc[n * 2];
        c[1] = acc[n * 2 + 1];
        product::<F>(a, &b, &mut c, scratch, frags);
        acc[n * 2] = c[0];
        acc[n * 2 + 1] = c[1];
    }
}

/// `tiles` accumulator tiles of zeros (two pairs each).
#[cube]
pub fn zeros(#[comptime] tiles: usize, #[comptime] unroll: bool) -> Array<Pair<f32>> {
    let mut out = Array::<Pair<f32>>::new(tiles * 2);
    #[unroll(unroll)]
    for i in 0..tiles * 2 {
        out[i] = Pair::<f32>::new(0.0f32);
    }
    out
}
