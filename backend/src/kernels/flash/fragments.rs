//! What the register kernels (`forward_registers`, `backward_registers`) share: PTX's
//! `m16n8k16` fragment layouts, the loads of `A` and `B` fragments from shared-memory
//! tiles, one warp's product, and the sums and maxima across a quad of lanes, each on the
//! tensor cores ([`Fragments::Registers`]) or emulated through shared memory on any device
//! ([`Fragments::Emulated`]), so that lavapipe checks the kernels' indices.

use cubecl::cmma::MmaDefinition;
use cubecl::ir::MatrixIdent;
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

/// (k, n) of element `i` of a lane's `B` fragment (16 × 8, 4 elements).
#[cube]
pub fn b_place(lane: usize, #[comptime] i: usize) -> (usize, usize) {
    let k = (lane % 4) * 2 + comptime![i % 2 + 8 * (i / 2)];
    (k, lane / 4)
}

/// Which rows of a 16 × 16 block the lanes of `ldmatrix.x4` pass, matrix `m` being lanes
/// `8 m ..+ 8`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rows {
    /// Matrix `m` at rows `8 (m % 2)`, columns `8 (m / 2)`: an `A` fragment's pair order.
    DownThenAcross,
    /// Matrix `m` at rows `8 (m / 2)`, columns `8 (m % 2)`: two `B` tiles of a stored `Bᵀ`.
    AcrossThenDown,
}

/// The first element of the row lane `lane` passes to `ldmatrix.x4` for the 16 × 16 block
/// at `offset` of a tile with row stride `ld`.
#[cube]
fn row_start(lane: usize, offset: usize, #[comptime] ld: usize, #[comptime] rows: Rows) -> usize {
    let mut start = offset + (lane % 16) * ld + (lane / 16) * 8;
    if comptime![rows == Rows::AcrossThenDown] {
        start = offset + (lane % 8 + (lane / 16) * 8) * ld + ((lane / 8) % 2) * 8;
    }
    start
}

/// `ldmatrix.sync.aligned.m8n8.x4.b16` (with `trans`, `.trans`) on the 16 × 16 block at
/// `offset` of a 16-bit tile in shared memory (row stride `ld`, rows 16-byte aligned):
/// four 8 × 8 matrices in one instruction. Lane `l` passes the start of row `l % 8` of
/// matrix `l / 8` ([`row_start`]) and gets one pair of each matrix `i`: its row `l / 4`,
/// columns `2 (l % 4) ..+ 2`; with `trans`, column `l / 4` of its rows `2 (l % 4) ..+ 2`.
/// Emulated, each lane computes the row starts the others pass: the same function, no
/// exchange (a barrier per load made lavapipe's kernel tests ten times slower).
#[cube]
pub fn load_matrices<F: Float>(
    tile: &SharedMemory<F>,
    offset: usize,
    #[comptime] ld: usize,
    lane: usize,
    #[comptime] rows: Rows,
    #[comptime] trans: bool,
    #[comptime] frags: Fragments,
) -> Array<Pair<F>> {
    let mut out = Array::<Pair<F>>::new(4usize);
    if comptime![frags == Fragments::Registers] {
        let def = MmaDefinition::<F, F, f32>::new(16usize, 8usize, 16usize);
        let start = row_start(lane, offset, ld, rows);
        let row = tile.slice(start, start + 8);
        let loaded = def.load_matrix::<F, Const<2>>(&row, MatrixIdent::B, 4usize, trans);
        #[unroll]
        for i in 0..4usize {
            out[i] = loaded[i];
        }
    } else {
        #[unroll]
        for i in 0..4usize {
            let mut pair = Pair::<F>::empty();
            #[unroll]
            for e in 0..2usize {
                let mut r = lane / 4;
                let mut c = (lane % 4) * 2 + e;
                if trans {
                    r = (lane % 4) * 2 + e;
                    c = lane / 4;
                }
                pair[e] = tile[row_start(i * 8 + r, offset, ld, rows) + c];
            }
            out[i] = pair;
        }
    }
    out
}

/// A lane's `A` fragment of the 16 × 16 block at `offset` of a row-major 16-bit tile (row
/// stride `ld`).
#[cube]
pub fn a_fragment<F: Float>(
    tile: &SharedMemory<F>,
    offset: usize,
    #[comptime] ld: usize,
    lane: usize,
    #[comptime] frags: Fragments,
) -> Array<Pair<F>> {
    load_matrices::<F>(tile, offset, ld, lane, Rows::DownThenAcross, false, frags)
}

/// Pairs `2 i ..+ 2` of `x`: one of the two `B` fragments one [`load_matrices`] gives.
#[cube]
fn half_of<F: Float>(x: &Array<Pair<F>>, #[comptime] i: usize) -> Array<Pair<F>> {
    let mut out = Array::<Pair<F>>::new(2usize);
    out[0] = x[i * 2];
    out[1] = x[i * 2 + 1];
    out
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
#[allow(clippy::too_many_arguments)]
pub fn a_fragments<F: Float>(
    tile: &SharedMemory<F>,
    offset: usize,
    #[comptime] ld: usize,
    lane: usize,
    #[comptime] steps: usize,
    #[comptime] frags: Fragments,
) -> Array<Pair<F>> {
    let unroll = comptime![frags == Fragments::Registers];
    let mut out = Array::<Pair<F>>::new(steps * 4);
    #[unroll(unroll)]
    for kq in 0..steps {
        let a = a_fragment::<F>(tile, offset + kq * 16, ld, lane, frags);
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
    let mut c0 = Array::<Pair<f32>>::new(2usize);
    let mut c1 = Array::<Pair<f32>>::new(2usize);
    #[unroll]
    for i in 0..2usize {
        c0[i] = Pair::<f32>::new(0.0f32);
        c1[i] = Pair::<f32>::new(0.0f32);
    }
    #[unroll(unroll)]
    for kq in 0..steps {
        let mut fa = Array::<Pair<F>>::new(4usize);
        if from_tile {
            let loaded = a_fragment::<F>(a_tile, a_offset + kq * 16, ld, lane, frags);
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
        // B[kk][n] = tile[row + n][16 kq + kk] (`Bᵀ` is stored): both 8-column tiles' `B`
        // fragments, pairs 0–1 and 2–3, in one load.
        let at = row * ld + kq * 16;
        let fb = load_matrices::<F>(tile, at, ld, lane, Rows::AcrossThenDown, false, frags);
        product::<F>(&fa, &half_of::<F>(&fb, 0usize), &mut c0, scratch, frags);
        product::<F>(&fa, &half_of::<F>(&fb, 1usize), &mut c1, scratch, frags);
    }
    let mut out = Array::<Pair<f32>>::new(4usize);
    out[0] = c0[0];
    out[1] = c0[1];
    out[2] = c1[0];
    out[3] = c1[1];
    out
}

/// `acc += a T` where `a` is an `A` fragment (16 × 16) and `T` the 16 rows of `tile` (row
/// stride `ld`) from element `offset` (`row · ld + col` for rows `row ..+ 16` from column
/// `col`), all `tiles` 8-column tiles of them (an even number); `acc` holds two pairs per
/// tile (`n · 2 + half`).
#[cube]
#[allow(clippy::too_many_arguments)]
pub fn accumulate<F: Float>(
    a: &Array<Pair<F>>,
    tile: &SharedMemory<F>,
    offset: usize,
    #[comptime] ld: usize,
    acc: &mut Array<Pair<f32>>,
    lane: usize,
    scratch: &mut SharedMemory<f32>,
    #[comptime] tiles: usize,
    #[comptime] frags: Fragments,
) {
    let unroll = comptime![frags == Fragments::Registers];
    #[unroll(unroll)]
    for n2 in 0..comptime![tiles / 2] {
        // B[kk][c] = T[kk][16 n2 + c] (`B` is stored): the `B` fragments of tiles
        // 2 n2 and 2 n2 + 1, pairs 0–1 and 2–3, in one load (`A`'s matrices, transposed).
        let at = offset + n2 * 16;
        let b = load_matrices::<F>(tile, at, ld, lane, Rows::DownThenAcross, true, frags);
        #[unroll]
        for h in 0..2usize {
            let n = n2 * 2 + h;
            let mut c = Array::<Pair<f32>>::new(2usize);
            c[0] = acc[n * 2];
            c[1] = acc[n * 2 + 1];
            product::<F>(a, &half_of::<F>(&b, h), &mut c, scratch, frags);
            acc[n * 2] = c[0];
            acc[n * 2 + 1] = c[1];
        }
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

#[cfg(test)]
mod tests {
    use super::super::device_tensor::{DeviceTensor, Elem};
    use super::*;

    /// The padded row stride of the probe's tile: 48 bytes, a multiple of 16 as
    /// `ldmatrix` needs, and not 32, so a wrong stride shows.
    const LD: usize = 24;

    /// One warp loads a 16 × 16 tile (`input[r · 16 + c] = r · 16 + c`) into shared memory
    /// and runs [`load_matrices`] on it; `out [32, 4, 2]` gets each lane's pairs.
    #[cube(launch)]
    fn load_matrices_probe<F: Float>(
        input: &Tensor<F>,
        out: &mut Tensor<F>,
        #[comptime] rows: Rows,
        #[comptime] trans: bool,
        #[comptime] frags: Fragments,
        #[define(F)] _dtype: StorageType,
    ) {
        let lane = UNIT_POS as usize;
        let mut tile = SharedMemory::<F>::new_aligned(16 * LD, 128usize);
        let mut e = lane;
        while e < 256 {
            tile[(e / 16) * LD + e % 16] = input[e];
            e += 32;
        }
        sync_cube();
        let m = load_matrices::<F>(&tile, 0, LD, lane, rows, trans, frags);
        #[unroll]
        for i in 0..4usize {
            #[unroll]
            for e in 0..2usize {
                out[lane * 8 + i * 2 + e] = m[i][e];
            }
        }
    }

    /// What `ldmatrix.x4` (PTX ISA, "Warp-level matrix load instruction: ldmatrix") gives
    /// lane `l` as element `e` of matrix `i`, the 8 × 8 block whose rows the lanes `8 i ..+
    /// 8` pass (at `rows`' place for it): its row `l / 4`, column `2 (l % 4) + e`, or
    /// transposed, its row `2 (l % 4) + e`, column `l / 4`.
    fn ptx_ldmatrix(l: usize, i: usize, e: usize, rows: Rows, trans: bool) -> f32 {
        let (r0, c0) = match rows {
            Rows::DownThenAcross => (8 * (i % 2), 8 * (i / 2)),
            Rows::AcrossThenDown => (8 * (i / 2), 8 * (i % 2)),
        };
        let (r, c) = if trans {
            (2 * (l % 4) + e, l / 4)
        } else {
            (l / 4, 2 * (l % 4) + e)
        };
        ((r0 + r) * 16 + c0 + c) as f32
    }

    fn check<R: Runtime, E: Elem>(client: &ComputeClient<R>, frags: Fragments) {
        let ty = E::as_type_native_unchecked();
        if !client.properties().supports_type(ty) {
            eprintln!("SKIPPED: no {ty:?} on this device; the ldmatrix probe did not run");
            return;
        }
        let input: Vec<f32> = (0..256).map(|x| x as f32).collect();
        for rows in [Rows::DownThenAcross, Rows::AcrossThenDown] {
            for trans in [false, true] {
                let a = DeviceTensor::<R>::new_as::<E>(client, &input, &[256]);
                let out = DeviceTensor::<R>::zeros_as::<E>(client, &[256]);
                load_matrices_probe::launch::<R>(
                    client,
                    CubeCount::Static(1, 1, 1),
                    CubeDim::new_1d(32),
                    a.arg(),
                    out.arg(),
                    rows,
                    trans,
                    frags,
                    ty.storage_type(),
                );
                let got = out.read_as::<E>(client);
                for l in 0..32 {
                    for i in 0..4 {
                        for e in 0..2 {
                            assert_eq!(
                                got[l * 8 + i * 2 + e],
                                ptx_ldmatrix(l, i, e, rows, trans),
                                "{frags:?} {rows:?} trans {trans}: lane {l}, matrix {i}, element {e}"
                            );
                        }
                    }
                }
            }
        }
    }

    /// The emulation follows PTX's `ldmatrix` as `ptx_ldmatrix` reads it.
    #[cfg(feature = "wgpu-kernels")]
    #[test]
    fn emulated_load_matrices_is_ptx_ldmatrix() {
        use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
        let Some(client) = crate::testing::client_or_skip::<WgpuRuntime>(
            || WgpuDevice::DefaultDevice,
            "vulkan",
            "the ldmatrix emulation's probe",
        ) else {
            return;
        };
        check::<_, burn::tensor::f16>(&client, Fragments::Emulated);
        check::<_, f32>(&client, Fragments::Emulated);
    }

    /// The GPU's `ldmatrix` is what the emulation (and so every kernel test on lavapipe)
    /// assumes.
    #[cfg(feature = "cuda")]
    #[test]
    fn register_load_matrices_is_ptx_ldmatrix() {
        use cubecl::cuda::{CudaDevice, CudaRuntime};
        let Some(client) = crate::testing::client_or_skip::<CudaRuntime>(
            || CudaDevice::new(0),
            "cuda",
            "the ldmatrix probe",
        ) else {
            return;
        };
        check::<_, burn::tensor::bf16>(&client, Fragments::Registers);
        check::<_, burn::tensor::f16>(&client, Fragments::Registers);
    }
}
