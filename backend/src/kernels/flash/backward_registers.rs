//! The backward kernels in the register structure of `forward_registers`: each warp owns
//! 16 rows and keeps its gradient rows in registers, as PTX `m16n8k16` accumulator
//! fragments, from the first block of the other side to the last. Two kernels, as
//! `backward_blocks` without its one pass (no atomics; dQ's sums in a fixed order):
//!
//! - [`flash_backward_kv_registers`]: a warp owns 16 keys and holds K's and V's rows as
//!   `A` fragments. Per staged block of 64 queries (q, dO, their LSE and D), 16 queries at
//!   a time: `Sᵀ = K Qᵀ` and `dPᵀ = V dOᵀ` on the tensor cores, `Pᵀ` and
//!   `dSᵀ = Pᵀ ∘ (dPᵀ − D) · scale` in place, then `dV += Pᵀ dO` and `dK += dSᵀ Q` with
//!   `Pᵀ` and `dSᵀ` as the `A` fragments, straight from the accumulators
//!   (`fragments::scores`).
//! - [`flash_backward_q_registers`]: a warp owns 16 queries and holds q's and dO's rows.
//!   Per staged block of 64 keys (K, V), 16 keys at a time: `S = Q Kᵀ`, `dP = dO Vᵀ`,
//!   `dS`, then `dQ += dS K`.
//!
//! Nothing goes through shared memory but the staged tiles and (key kernel) the LSE and D
//! of the staged queries: the block-product kernels store every product's result to
//! shared memory and reload it for the next (docs/flash-attention.md), and that is where
//! 145 of the 350M step's 180 attention milliseconds went.
//!
//! `D = rowsum(dO ∘ O)` comes from `scratch::row_dots`, as for the block kernels. Takes
//! what the register forward takes: 16-bit inputs on CUDA, head dims of 16 to 128 in 16s,
//! causal or not, key padding, grouped-query attention; not dropout.
//! [`Fragments::Emulated`] runs both on any device, which is how lavapipe checks them.

use cubecl::prelude::*;

use super::fragments::{a_fragments, accumulate, scores, zeros, Fragments, Pair};
use super::launch::{BackwardInputs, BackwardOutputs, FlashLaunch};
use super::tile::{
    excluded, first_query_block, key_blocks, pad_bias, stage_tile, staged_ld, unmasked,
};

/// Rows a cube owns and rows a block stages: 4 warps of 16.
pub const BLOCK: usize = 64;
/// Units a cube has: 4 warps of 32.
pub const UNITS: usize = 128;
/// The largest head dim at which the key kernel holds K's and V's rows in registers beside
/// dK and dV, and the query kernel q's and dO's beside dQ: at 128, ptxas (sm_90a) needed
/// 255 registers and spilled (76 bytes in the key kernel, 8 in the query kernel).
const RESIDENT_HEAD_DIM: usize = 64;

/// The `A` fragment of the 16 × 16 block whose 4 fp32 pairs `fragments::scores` returned
/// (turned into `Pᵀ`, `dSᵀ` or `dS`), rounded to the input type.
#[cube]
fn as_a<F: Float>(c: &Array<Pair<f32>>) -> Array<Pair<F>> {
    let mut a = Array::<Pair<F>>::new(4usize);
    #[unroll]
    for p in 0..4usize {
        a[p] = Pair::<F>::cast_from(c[p]);
    }
    a
}

/// `p` and `ds = p (dp − d) · scale` of one score: `p = exp(x − lse)` where the score `x`
/// (scaled, with its key's bias) takes part, 0 where `masked`.
#[cube]
fn probability_and_gradient(
    x: f32,
    dp: f32,
    lse: f32,
    d: f32,
    scale: f32,
    masked: bool,
) -> (f32, f32) {
    let p = select(masked, f32::new(0.0), (x - lse).exp());
    (p, p * (dp - d) * scale)
}

/// dK and dV for [`BLOCK`] keys of one `(batch, kv head)`; cubes of [`UNITS`] over
/// (`t / BLOCK`, `b · kv_heads`). Inputs as `flash_backward_kv_blocks`'s (`d_rows` from
/// `scratch::row_dots`), without dropout; `head_dim` as `flash_forward_registers`'s.
#[cube(launch, fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
#[allow(clippy::too_many_arguments)]
pub fn flash_backward_kv_registers<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    d_rows: &Tensor<f32>,
    key_bias: &Tensor<f32>,
    d_k: &mut Tensor<F>,
    d_v: &mut Tensor<F>,
    scale: f32,
    group: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] padding: bool,
    #[comptime] frags: Fragments,
    #[define(F)] _dtype: StorageType,
) {
    let unroll = comptime![frags == Fragments::Registers];
    let kv_heads = k.shape(1);
    let s = q.shape(2);
    let t = k.shape(2);
    let bkv = CUBE_POS_Y as usize;
    let bi = bkv / kv_heads;
    let kvh = bkv % kv_heads;
    let unit = UNIT_POS as usize;
    let lane = unit % 32;
    let warp = unit / 32;
    let quad = lane % 4;
    let first = CUBE_POS_X as usize * BLOCK;
    // This lane's two keys: `key0` and 8 past it.
    let key0 = first + warp * 16 + lane / 4;

    let hd_ld = comptime![staged_ld(head_dim)];
    let mut qs = SharedMemory::<F>::new_aligned(BLOCK * hd_ld, 128usize);
    let mut dos = SharedMemory::<F>::new_aligned(BLOCK * hd_ld, 128usize);
    let mut ls = SharedMemory::<f32>::new(BLOCK);
    let mut drow = SharedMemory::<f32>::new(BLOCK);
    let mut scratch = SharedMemory::<f32>::new(comptime![frags.scratch_len()]);
    // K's and V's rows stay in registers up to `RESIDENT_HEAD_DIM`, passing through q's and
    // dO's tiles on their way; past it they stay in tiles of their own.
    let resident = comptime![head_dim <= RESIDENT_HEAD_DIM];
    let kv_tile = comptime![if resident { 1 } else { BLOCK * hd_ld }];
    let mut ks = SharedMemory::<F>::new_aligned(kv_tile, 128usize);
    let mut vs = SharedMemory::<F>::new_aligned(kv_tile, 128usize);

    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);
    if resident {
        stage_tile::<F, N>(k, &mut qs, kbase, first, t, BLOCK, head_dim, hd_ld, UNITS);
        stage_tile::<F, N>(v, &mut dos, vbase, first, t, BLOCK, head_dim, hd_ld, UNITS);
    } else {
        stage_tile::<F, N>(k, &mut ks, kbase, first, t, BLOCK, head_dim, hd_ld, UNITS);
        stage_tile::<F, N>(v, &mut vs, vbase, first, t, BLOCK, head_dim, hd_ld, UNITS);
    }
    sync_cube();
    let steps = comptime![head_dim / 16];
    // (Not resident: one fragment's loads, never read, which the compiler drops.)
    let held = comptime![if resident { steps } else { 1 }];
    let own = warp * 16 * hd_ld;
    let kf = a_fragments::<F>(&qs, own, hd_ld, lane, held, frags);
    let vf = a_fragments::<F>(&dos, own, hd_ld, lane, held, frags);
    let from_tile = comptime![!resident];

    let out_tiles = comptime![head_dim / 8];
    let mut dk = zeros(out_tiles, unroll);
    let mut dv = zeros(out_tiles, unroll);
    // The two keys' padding biases (a key past the end reads the last one's; it is
    // masked anyway).
    let mut bias = Array::<f32>::new(2usize);
    #[unroll]
    for half in 0..2usize {
        bias[half] = f32::new(0.0);
        if padding {
            bias[half] = pad_bias(key_bias, bi, min(key0 + half * 8, t - 1));
        }
    }

    let group = group as usize;
    let blocks = s.div_ceil(BLOCK);
    let start = first_query_block(first, BLOCK, s, causal);
    for g in 0..group {
        let hi = kvh * group + g;
        let qbase = bi * q.stride(0) + hi * q.stride(1);
        let dobase = bi * d_o.stride(0) + hi * d_o.stride(1);
        for qb in start..blocks {
            let i0 = qb * BLOCK;
            // Every warp is past the last block's reads (and the first fragments' loads).
            sync_cube();
            stage_tile::<F, N>(q, &mut qs, qbase, i0, s, BLOCK, head_dim, hd_ld, UNITS);
            stage_tile::<F, N>(d_o, &mut dos, dobase, i0, s, BLOCK, head_dim, hd_ld, UNITS);
            if unit < BLOCK {
                let ir = min(i0 + unit, s - 1);
                ls[unit] = lse[bi * lse.stride(0) + hi * lse.stride(1) + ir * lse.stride(2)];
                drow[unit] =
                    d_rows[bi * d_rows.stride(0) + hi * d_rows.stride(1) + ir * d_rows.stride(2)];
            }
            sync_cube();

            let open = unmasked(i0, first, BLOCK, s, t, causal, padding);
            // A loop on the GPU too: only shared-memory offsets depend on `sub`, and unrolled
            // ptxas hoisted the next 16 rows' loads into registers dK and dV need.
            for sub in 0..comptime![BLOCK / 16] {
                let (row, sc) = (sub * 16, &mut scratch);
                let st = scores::<F>(
                    &kf, &ks, own, &qs, row, hd_ld, lane, sc, steps, from_tile, frags,
                );
                let dpt = scores::<F>(
                    &vf, &vs, own, &dos, row, hd_ld, lane, sc, steps, from_tile, frags,
                );
                let mut pt = Array::<Pair<f32>>::new(4usize);
                let mut dst = Array::<Pair<f32>>::new(4usize);
                #[unroll]
                for c in 0..4usize {
                    // Tile `c / 2` of 8 queries, key `key0 + 8 (c % 2)`.
                    let half = c % 2;
                    let key = key0 + half * 8;
                    let mut p2 = Pair::<f32>::empty();
                    let mut ds2 = Pair::<f32>::empty();
                    #[unroll]
                    for e in 0..2usize {
                        let ql = sub * 16 + (c / 2) * 8 + quad * 2 + e;
                        let i = i0 + ql;
                        let mut x = st[c][e] * scale;
                        let mut masked = false;
                        if !open {
                            masked = i >= s || excluded(key, i, t, causal);
                            x += bias[half];
                        }
                        let (p, ds) =
                            probability_and_gradient(x, dpt[c][e], ls[ql], drow[ql], scale, masked);
                        p2[e] = p;
                        ds2[e] = ds;
                    }
                    pt[c] = p2;
                    dst[c] = ds2;
                }
                let pa = as_a::<F>(&pt);
                let dsa = as_a::<F>(&dst);
                accumulate::<F>(
                    &pa,
                    &dos,
                    sub * 16,
                    hd_ld,
                    &mut dv,
                    lane,
                    &mut scratch,
                    out_tiles,
                    frags,
                );
                accumulate::<F>(
                    &dsa,
                    &qs,
                    sub * 16,
                    hd_ld,
                    &mut dk,
                    lane,
                    &mut scratch,
                    out_tiles,
                    frags,
                );
            }
        }
    }

    #[unroll]
    for half in 0..2usize {
        let key = key0 + half * 8;
        if key < t {
            let kb = bi * d_k.stride(0) + kvh * d_k.stride(1) + key * d_k.stride(2);
            let vb = bi * d_v.stride(0) + kvh * d_v.stride(1) + key * d_v.stride(2);
            #[unroll(unroll)]
            for n in 0..out_tiles {
                let gk = dk[n * 2 + half];
                let gv = dv[n * 2 + half];
                #[unroll]
                for e in 0..2usize {
                    let col = n * 8 + quad * 2 + e;
                    d_k[kb + col * d_k.stride(3)] = F::cast_from(gk[e]);
                    d_v[vb + col * d_v.stride(3)] = F::cast_from(gv[e]);
                }
            }
        }
    }
}

/// dQ for [`BLOCK`] queries of one `(batch, head)`; cubes of [`UNITS`] over
/// (`s / BLOCK`, `b · h`). Arguments as [`flash_backward_kv_registers`]'s, with `d_q`.
#[cube(launch, fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
// `collapsible_if`: the nested tests keep the compile-time one apart (joined, the body
// would be expanded without padding too).
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_backward_q_registers<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    d_o: &Tensor<Vector<F, N>>,
    lse: &Tensor<f32>,
    d_rows: &Tensor<f32>,
    key_bias: &Tensor<f32>,
    d_q: &mut Tensor<F>,
    scale: f32,
    group: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] padding: bool,
    #[comptime] frags: Fragments,
    #[define(F)] _dtype: StorageType,
) {
    let unroll = comptime![frags == Fragments::Registers];
    let heads = q.shape(1);
    let s = q.shape(2);
    let t = k.shape(2);
    let bh = CUBE_POS_Y as usize;
    let bi = bh / heads;
    let hi = bh % heads;
    let kvh = hi / group as usize;
    let unit = UNIT_POS as usize;
    let lane = unit % 32;
    let warp = unit / 32;
    let quad = lane % 4;
    let first = CUBE_POS_X as usize * BLOCK;
    // This lane's two queries: `row0` and 8 below it.
    let row0 = first + warp * 16 + lane / 4;

    let hd_ld = comptime![staged_ld(head_dim)];
    let mut ks = SharedMemory::<F>::new_aligned(BLOCK * hd_ld, 128usize);
    let mut vs = SharedMemory::<F>::new_aligned(BLOCK * hd_ld, 128usize);
    let mut scratch = SharedMemory::<f32>::new(comptime![frags.scratch_len()]);
    // As K and V in the key kernel: q's and dO's rows in registers up to
    // `RESIDENT_HEAD_DIM` (through K's and V's tiles), past it in tiles of their own.
    let resident = comptime![head_dim <= RESIDENT_HEAD_DIM];
    let own_tile = comptime![if resident { 1 } else { BLOCK * hd_ld }];
    let mut qs = SharedMemory::<F>::new_aligned(own_tile, 128usize);
    let mut dos = SharedMemory::<F>::new_aligned(own_tile, 128usize);

    let qbase = bi * q.stride(0) + hi * q.stride(1);
    let dobase = bi * d_o.stride(0) + hi * d_o.stride(1);
    if resident {
        stage_tile::<F, N>(q, &mut ks, qbase, first, s, BLOCK, head_dim, hd_ld, UNITS);
        stage_tile::<F, N>(
            d_o, &mut vs, dobase, first, s, BLOCK, head_dim, hd_ld, UNITS,
        );
    } else {
        stage_tile::<F, N>(q, &mut qs, qbase, first, s, BLOCK, head_dim, hd_ld, UNITS);
        stage_tile::<F, N>(
            d_o, &mut dos, dobase, first, s, BLOCK, head_dim, hd_ld, UNITS,
        );
    }
    sync_cube();
    let steps = comptime![head_dim / 16];
    let held = comptime![if resident { steps } else { 1 }];
    let own = warp * 16 * hd_ld;
    let qf = a_fragments::<F>(&ks, own, hd_ld, lane, held, frags);
    let dof = a_fragments::<F>(&vs, own, hd_ld, lane, held, frags);
    let from_tile = comptime![!resident];
    // The staged keys' padding biases: one load per key, not one per score (loads from
    // global memory the unrolled loop would hold registers for).
    let mut kbias = SharedMemory::<f32>::new(comptime![if padding { BLOCK } else { 1 }]);

    let out_tiles = comptime![head_dim / 8];
    let mut dq = zeros(out_tiles, unroll);
    // Per query of the two: the row the masks read (clamped), its LSE and D.
    let mut rows = Array::<usize>::new(2usize);
    let mut row_lse = Array::<f32>::new(2usize);
    let mut row_d = Array::<f32>::new(2usize);
    #[unroll]
    for half in 0..2usize {
        let r = min(row0 + half * 8, s - 1);
        rows[half] = r;
        row_lse[half] = lse[bi * lse.stride(0) + hi * lse.stride(1) + r * lse.stride(2)];
        row_d[half] = d_rows[bi * d_rows.stride(0) + hi * d_rows.stride(1) + r * d_rows.stride(2)];
    }

    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);
    for kb in 0..key_blocks(first, BLOCK, s, t, causal) {
        let j0 = kb * BLOCK;
        // Every warp is past the last block's reads (and the first fragments' loads).
        sync_cube();
        stage_tile::<F, N>(k, &mut ks, kbase, j0, t, BLOCK, head_dim, hd_ld, UNITS);
        stage_tile::<F, N>(v, &mut vs, vbase, j0, t, BLOCK, head_dim, hd_ld, UNITS);
        if padding {
            if unit < BLOCK {
                kbias[unit] = pad_bias(key_bias, bi, min(j0 + unit, t - 1));
            }
        }
        sync_cube();

        let open = unmasked(first, j0, BLOCK, s, t, causal, padding);
        // Unrolled where q and dO are resident; past that ptxas hoisted the next 16 keys'
        // loads into registers dQ needs, as in the key kernel.
        #[unroll(unroll && resident)]
        for sub in 0..comptime![BLOCK / 16] {
            let (row, scr) = (sub * 16, &mut scratch);
            let sc = scores::<F>(
                &qf, &qs, own, &ks, row, hd_ld, lane, scr, steps, from_tile, frags,
            );
            let dp = scores::<F>(
                &dof, &dos, own, &vs, row, hd_ld, lane, scr, steps, from_tile, frags,
            );
            let mut ds = Array::<Pair<f32>>::new(4usize);
            #[unroll]
            for c in 0..4usize {
                // Tile `c / 2` of 8 keys, query `row0 + 8 (c % 2)`.
                let half = c % 2;
                let mut ds2 = Pair::<f32>::empty();
                #[unroll]
                for e in 0..2usize {
                    let key = j0 + sub * 16 + (c / 2) * 8 + quad * 2 + e;
                    let mut x = sc[c][e] * scale;
                    let mut masked = false;
                    if !open {
                        masked = excluded(key, rows[half], t, causal);
                        if padding {
                            x += kbias[key - j0];
                        }
                    }
                    let (_, g) = probability_and_gradient(
                        x,
                        dp[c][e],
                        row_lse[half],
                        row_d[half],
                        scale,
                        masked,
                    );
                    ds2[e] = g;
                }
                ds[c] = ds2;
            }
            let dsa = as_a::<F>(&ds);
            accumulate::<F>(
                &dsa,
                &ks,
                sub * 16,
                hd_ld,
                &mut dq,
                lane,
                &mut scratch,
                out_tiles,
                frags,
            );
        }
    }

    #[unroll]
    for half in 0..2usize {
        let row = row0 + half * 8;
        if row < s {
            let base = bi * d_q.stride(0) + hi * d_q.stride(1) + row * d_q.stride(2);
            #[unroll(unroll)]
            for n in 0..out_tiles {
                let gq = dq[n * 2 + half];
                #[unroll]
                for e in 0..2usize {
                    d_q[base + (n * 8 + quad * 2 + e) * d_q.stride(3)] = F::cast_from(gq[e]);
                }
            }
        }
    }
}

/// Writes dQ, dK and dV as `launch::backward` does, with the two kernels above, from `D`
/// in `out.d_rows` (written before); `out.d_q_acc` is not touched. `cfg.dropout` must be
/// `None` and `cfg.dims.head_dim` a multiple of 16 up to 128.
pub fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: &FlashLaunch,
    frags: Fragments,
    x: BackwardInputs<R>,
    out: BackwardOutputs<R>,
) {
    let d = &cfg.dims;
    assert!(
        cfg.dropout.is_none(),
        "the register backward has no dropout"
    );
    assert!(
        d.head_dim.is_multiple_of(16) && d.head_dim <= super::forward_registers::MAX_HEAD_DIM,
        "head dim {}",
        d.head_dim
    );
    let width =
        super::launch::vector_width(client, cfg.dtype, d.head_dim, &[&x.q, &x.k, &x.v, &x.d_o]);
    let second = x.clone();
    let d_rows = super::launch::clone_arg(&out.d_rows);
    flash_backward_kv_registers::launch::<R>(
        client,
        CubeCount::Static(
            d.kv_len.div_ceil(BLOCK) as u32,
            (d.batch * d.kv_heads) as u32,
            1,
        ),
        CubeDim::new_1d(UNITS as u32),
        width,
        x.q,
        x.k,
        x.v,
        x.d_o,
        x.lse,
        out.d_rows,
        x.key_bias,
        out.d_k,
        out.d_v,
        cfg.scale,
        d.group(),
        d.head_dim,
        cfg.causal,
        cfg.padding,
        frags,
        cfg.dtype,
    );
    let x = second;
    flash_backward_q_registers::launch::<R>(
        client,
        CubeCount::Static(
            d.q_len.div_ceil(BLOCK) as u32,
            (d.batch * d.heads) as u32,
            1,
        ),
        CubeDim::new_1d(UNITS as u32),
        width,
        x.q,
        x.k,
        x.v,
        x.d_o,
        x.lse,
        d_rows,
        x.key_bias,
        out.d_q,
        cfg.scale,
        d.group(),
        d.head_dim,
        cfg.causal,
        cfg.padding,
        frags,
        cfg.dtype,
    );
}

#[cfg(test)]
mod tests {
    use super::super::device_tensor::Elem;
    use super::super::reference::{worst, Problem};
    use super::super::tests_kernels::register_forward_on;
    use super::*;

    /// dQ, dK and dV against the f64 reference, on the inputs rounded to `E`, within `tol`;
    /// O and LSE from the register forward with the same `frags`.
    fn check<R: Runtime, E: Elem>(
        client: &ComputeClient<R>,
        frags: Fragments,
        mut p: Problem,
        tol: f64,
    ) {
        let Some((what, cfg, t)) = register_forward_on::<R, E>(client, frags, &mut p) else {
            return;
        };
        super::super::scratch::row_dots(client, &cfg, t.o.arg(), t.d_o.arg(), t.d_rows.arg());
        let (inputs, out) = t.backward_args();
        launch(client, &cfg, frags, inputs, out);
        let want = p.expected();
        for (name, got, want) in [
            ("dQ", &t.d_q, &want.d_q),
            ("dK", &t.d_k, &want.d_k),
            ("dV", &t.d_v, &want.d_v),
        ] {
            let err = worst(&got.read_as::<E>(client), want);
            assert!(err <= tol, "{what}: {name} differs by {err:e} (> {tol:e})");
        }
    }

    #[cfg(feature = "wgpu-kernels")]
    mod wgpu {
        use super::*;
        use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

        fn client() -> Option<ComputeClient<WgpuRuntime>> {
            crate::testing::client_or_skip::<WgpuRuntime>(
                || WgpuDevice::DefaultDevice,
                "vulkan",
                "the register backward's emulation",
            )
        }

        /// f32 through the same data flow: every index, to fp32 rounding. (Lavapipe gives a
        /// cube 32 KiB of shared memory: two f32 tiles of 64 rows fit up to head dim 32.)
        #[test]
        fn emulated_fragments_match_the_reference_in_f32() {
            let Some(client) = client() else { return };
            // Causal, four query heads per kv head; a second, partial block of 64 on both
            // sides.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Problem::new(1, 8, 2, 70, 70, 32, true, &[], 31),
                1e-3,
            );
            // Bidirectional with padded keys.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Problem::new(2, 2, 2, 33, 33, 32, false, &[0, 9], 32),
                1e-3,
            );
            // Causal with padding, grouped, d 16; three blocks on each side.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Problem::new(2, 4, 2, 130, 130, 16, true, &[3, 9], 33),
                1e-3,
            );
            // Bidirectional, more keys than queries, and fewer.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Problem::new(1, 2, 1, 20, 90, 16, false, &[], 34),
                1e-3,
            );
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Problem::new(1, 2, 2, 90, 20, 16, false, &[2], 35),
                1e-3,
            );
        }

        /// 16-bit inputs: P and dS rounded to the input type before their products, as on
        /// the tensor cores.
        #[test]
        fn emulated_fragments_match_the_reference_in_f16() {
            let Some(client) = client() else { return };
            check::<_, burn::tensor::f16>(
                &client,
                Fragments::Emulated,
                Problem::new(2, 4, 2, 37, 37, 32, true, &[0, 5], 9),
                2e-2,
            );
        }
    }

    /// The register products themselves, at the head dims the executor runs.
    #[cfg(feature = "cuda")]
    mod cuda {
        use super::*;
        use cubecl::cuda::{CudaDevice, CudaRuntime};

        #[test]
        fn register_fragments_match_the_reference() {
            let Some(client) = crate::testing::client_or_skip::<CudaRuntime>(
                || CudaDevice::new(0),
                "cuda",
                "the register backward",
            ) else {
                return;
            };
            for d in [64, 128] {
                for (causal, pads) in [(true, &[0usize, 5][..]), (false, &[][..])] {
                    let p = || Problem::new(2, 8, 2, 150, 150, d, causal, pads, 60 + d as u64);
                    check::<_, burn::tensor::bf16>(&client, Fragments::Registers, p(), 5e-2);
                    check::<_, burn::tensor::f16>(&client, Fragments::Registers, p(), 2e-2);
                }
            }
        }
    }

    /// The CUDA source: register products, nothing on the stack (ptxas, `sm_90a`), at the
    /// head dims and types the executor runs. No GPU needed.
    #[cfg(all(feature = "cuda", feature = "wgpu-kernels"))]
    mod source {
        use super::super::super::tests_cuda_source::{
            client, compiles, float, on_register_mma, settings, tensor,
        };
        use super::*;
        use cubecl::ir::FloatKind;
        use cubecl::wgpu::WgpuRuntime;

        #[test]
        fn the_register_backward_compiles_without_spills() {
            let Some(client) = client() else { return };
            for kind in [FloatKind::BF16, FloatKind::F16] {
                for head_dim in [64, 128] {
                    for (causal, padding) in [(true, false), (false, true)] {
                        let what = |kernel: &str| {
                            format!(
                                "register backward {kernel} {kind:?} d{head_dim} causal {causal} padding {padding}"
                            )
                        };
                        let kv = flash_backward_kv_registers::FlashBackwardKvRegisters::<
                            WgpuRuntime,
                        >::new(
                            settings(UNITS as u32),
                            client.clone(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            tensor(),
                            (),
                            (),
                            // Staged 2 16-bit values at a time, as launched.
                            2,
                            head_dim,
                            causal,
                            padding,
                            Fragments::Registers,
                            float(kind),
                        );
                        on_register_mma(&compiles(kv, &what("kv")), &what("kv"));
                        let q =
                            flash_backward_q_registers::FlashBackwardQRegisters::<WgpuRuntime>::new(
                                settings(UNITS as u32),
                                client.clone(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                tensor(),
                                (),
                                (),
                                2,
                                head_dim,
                                causal,
                                padding,
                                Fragments::Registers,
                                float(kind),
                            );
                        on_register_mma(&compiles(q, &what("q")), &what("q"));
                    }
                }
            }
        }
    }
}
