//! The forward kernel in FlashAttention-2's structure: each warp owns 16 query rows and
//! keeps their scores, their running maxima and sums and their output in registers, as
//! PTX `m16n8k16` accumulator fragments, from the first key block to the last. Per key
//! block the cube stages K and V in shared memory (one block at a time, or the next one
//! copied ahead while this one is read: `stream`); each warp then
//!
//! 1. computes its `S = Q Kᵀ` tiles with register products (`mma.sync`; Q's fragments were
//!    loaded once), 8 tiles of 16 × 8;
//! 2. scales and masks them in place, takes each row's maximum across the 4 lanes that hold
//!    the row (two warp shuffles), and takes the online-softmax step on its registers;
//! 3. reads the probabilities, rounded to the input type, as the `A` fragments of `P V`:
//!    the accumulators of two adjacent 8-key tiles are, element for element, one 16-key
//!    `A` fragment (`tests_manual_mma` checks that on a GPU), so `P` never leaves the
//!    registers;
//! 4. adds `P V` into its output fragments.
//!
//! Nothing goes through shared memory but K and V (and Q once, through K's tile): the block-product kernels
//! (`forward_blocks.rs`) store `S` and `P V` to shared memory and reload them for every
//! product, which is where their time went (docs/flash-attention.md).
//!
//! [`Fragments::Emulated`] runs the same data flow on any device: each product and each
//! shuffle goes through shared memory in PTX's layouts, with the cube's barriers. That is
//! how lavapipe checks every index of this kernel; on CUDA only the products and the
//! shuffles differ.
//!
//! Takes 16-bit inputs, head dims of 16 to 128 in 16s, causal or not, key padding and
//! grouped-query attention; not dropout (the launch keeps the block kernels for it).

use cubecl::prelude::*;

pub use super::fragments::Fragments;
use super::fragments::{a_fragments, accumulate, across_quad, scores, zeros, Pair};
use super::stream::{check_shared, commit, ready_barrier, stage_block, tile_of, wait};
pub use super::stream::{Staging, BLOCK, UNITS};
use super::tile::{
    document_first, excluded, first_key_block, key_blocks, pad_bias, stage_tile_at, staged_ld,
    unmasked, MASKED,
};

/// The largest head dim: 16 output fragments (64 fp32 a lane) beside 16 of S.
pub const MAX_HEAD_DIM: usize = 128;

/// Shapes and arguments as `flash_forward_blocks` (without dropout): `q [b, h, s, d]`,
/// `k, v [b, h / group, t, d]`, `out` like q, `lse [b, h, s]` (any strides); cubes of
/// [`UNITS`] over (`s / BLOCK`, `b · h`). `head_dim` equals the tensors' last extent, a
/// multiple of 16 up to [`MAX_HEAD_DIM`]; with [`Fragments::Registers`], F is f16 or bf16.
/// K and V are streamed as `staging` says (`stream`; [`Staging::Copies`] only on CUDA).
#[cube(launch, fast_math = FastMath::ReducedPrecision | FastMath::NotNaN | FastMath::NotInf)]
// `collapsible_if`: the nested tests keep the compile-time one apart (joined, the body
// would be expanded without staging ahead too).
#[allow(clippy::too_many_arguments, clippy::collapsible_if)]
pub fn flash_forward_registers<F: Float, N: Size>(
    q: &Tensor<Vector<F, N>>,
    k: &Tensor<Vector<F, N>>,
    v: &Tensor<Vector<F, N>>,
    key_bias: &Tensor<f32>,
    spans: &Tensor<u32>,
    out: &mut Tensor<F>,
    lse: &mut Tensor<f32>,
    scale: f32,
    group: u32,
    window_len: u32,
    #[comptime] head_dim: usize,
    #[comptime] causal: bool,
    #[comptime] windowed: bool,
    #[comptime] padding: bool,
    #[comptime] documents: bool,
    #[comptime] frags: Fragments,
    #[comptime] staging: Staging,
    #[define(F)] _dtype: StorageType,
) {
    // Everything unrolls on CUDA, so the fragments stay in registers. The emulation keeps
    // the loops: lavapipe's shader compiler took more than 15 minutes on one unrolled
    // kernel at head dim 64.
    // Without a window its bound is the constant 0, which the compiler folds away: at head
    // dim 128 the kernels have no register to spare.
    let mut window = 0u32;
    if windowed {
        window = window_len;
    }
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
    // This lane's two rows: `rows[0]` and 8 below it.
    let row0 = first + warp * 16 + lane / 4;

    let hd_ld = comptime![staged_ld(head_dim)];
    let tiles = comptime![staging.tiles()];
    let mut ks = SharedMemory::<F>::new_aligned(tiles * BLOCK * hd_ld, 128usize);
    let mut vs = SharedMemory::<F>::new_aligned(tiles * BLOCK * hd_ld, 128usize);
    let scratch_len = comptime![frags.scratch_len()];
    let mut scratch = SharedMemory::<f32>::new(scratch_len);

    let qbase = bi * q.stride(0) + hi * q.stride(1);
    let kbase = bi * k.stride(0) + kvh * k.stride(1);
    let vbase = bi * v.stride(0) + kvh * v.stride(1);
    // Q passes through K's last tile on its way to the registers: the first key block
    // goes to the first, and the second is staged only after the first block's barrier.
    let q_at = comptime![(tiles - 1) * BLOCK * hd_ld];
    stage_tile_at::<F, N>(
        q, &mut ks, q_at, qbase, first, s, BLOCK, head_dim, hd_ld, UNITS,
    );
    sync_cube();

    // Q's A fragments, one per 16 head-dim columns, for the whole kernel.
    let ksteps = comptime![head_dim / 16];
    let qf = a_fragments::<F>(&ks, q_at + warp * 16 * hd_ld, hd_ld, lane, ksteps, frags);

    // S's 8 tiles of 8 keys and the output's tiles of 8 columns: two pairs each (rows
    // `row0` and `row0 + 8`).
    let key_tiles = comptime![BLOCK / 8];
    let out_tiles = comptime![head_dim / 8];
    let mut o = zeros(out_tiles, unroll);
    // Per row of the two (`row0`, `row0 + 8`): the running maximum (the same in the
    // quad), this lane's share of the sum, and the row the masks read (clamped).
    let mut m = Array::<f32>::new(2usize);
    let mut l = Array::<f32>::new(2usize);
    let mut rows = Array::<usize>::new(2usize);
    // Packed rows: where each row's document starts (0 otherwise, folded away).
    let mut doc_lo = Array::<usize>::new(2usize);
    #[unroll]
    for half in 0..2usize {
        m[half] = f32::new(MASKED);
        l[half] = f32::new(0.0);
        rows[half] = min(row0 + half * 8, s - 1);
        doc_lo[half] = document_first(spans, bi, rows[half], documents);
    }
    let lo_first = document_first(spans, bi, min(first, s - 1), documents);
    let lo_last = document_first(spans, bi, min(first + BLOCK, s) - 1, documents);

    let start = first_key_block(first, BLOCK, window, lo_first);
    let blocks = key_blocks(first, BLOCK, s, t, causal);
    let ready = ready_barrier(staging);
    if comptime![staging.ahead()] {
        if start < blocks {
            let j0 = start * BLOCK;
            stage_block::<F, N>(k, &mut ks, 0, kbase, j0, t, head_dim, hd_ld, staging);
            stage_block::<F, N>(v, &mut vs, 0, vbase, j0, t, head_dim, hd_ld, staging);
            commit(&ready, staging);
        }
    }
    for kb in start..blocks {
        let j0 = kb * BLOCK;
        let tile = tile_of(kb - start, staging);
        if comptime![!staging.ahead()] {
            // Every warp is past the last block's reads of K and V.
            sync_cube();
            stage_block::<F, N>(k, &mut ks, 0, kbase, j0, t, head_dim, hd_ld, staging);
            stage_block::<F, N>(v, &mut vs, 0, vbase, j0, t, head_dim, hd_ld, staging);
        }
        wait(&ready, staging);
        if comptime![staging.ahead()] {
            if kb + 1 < blocks {
                let next = 1 - tile;
                let j1 = j0 + BLOCK;
                stage_block::<F, N>(k, &mut ks, next, kbase, j1, t, head_dim, hd_ld, staging);
                stage_block::<F, N>(v, &mut vs, next, vbase, j1, t, head_dim, hd_ld, staging);
                commit(&ready, staging);
            }
        }
        // This block's rows of the tiles.
        let at = tile * BLOCK;

        let mut sc = Array::<Pair<f32>>::new(key_tiles * 2);
        #[unroll(unroll)]
        for kp in 0..comptime![BLOCK / 16] {
            let c = scores::<F>(
                &qf,
                &ks,
                0,
                &ks,
                at + kp * 16,
                hd_ld,
                lane,
                &mut scratch,
                ksteps,
                false,
                frags,
            );
            #[unroll]
            for i in 0..4usize {
                sc[kp * 4 + i] = c[i];
            }
        }

        // Scaled and masked in place; each row's maximum over this lane's columns.
        let open = unmasked(first, j0, BLOCK, s, t, causal, padding, window, lo_last);
        let mut top = Array::<f32>::new(2usize);
        top[0] = f32::new(MASKED);
        top[1] = f32::new(MASKED);
        #[unroll(unroll)]
        for j in 0..key_tiles {
            #[unroll]
            for half in 0..2usize {
                let mut pair = sc[j * 2 + half];
                #[unroll]
                for e in 0..2usize {
                    let key = j0 + j * 8 + quad * 2 + e;
                    let mut x = pair[e] * scale;
                    if !open {
                        let r = rows[half];
                        if excluded(key, r, t, causal, window, doc_lo[half], r, documents) {
                            x = f32::new(MASKED);
                        } else if padding {
                            x += pad_bias(key_bias, bi, key);
                        }
                    }
                    pair[e] = x;
                    top[half] = max(top[half], x);
                }
                sc[j * 2 + half] = pair;
            }
        }
        // The rows' new maxima; the output and the sums rescaled to them.
        #[unroll]
        for half in 0..2usize {
            let mb = max(m[half], across_quad(top[half], &mut scratch, false, frags));
            let alpha = (m[half] - mb).exp();
            l[half] *= alpha;
            #[unroll(unroll)]
            for n in 0..out_tiles {
                o[n * 2 + half] = o[n * 2 + half] * Pair::<f32>::new(alpha);
            }
            m[half] = mb;
        }
        // P in place; this lane's share of each row's sum (the quad adds up at the end).
        #[unroll(unroll)]
        for j in 0..key_tiles {
            #[unroll]
            for half in 0..2usize {
                let mut pair = sc[j * 2 + half];
                #[unroll]
                for e in 0..2usize {
                    let x = pair[e];
                    let p = select(x > f32::new(MASKED), (x - m[half]).exp(), f32::new(0.0));
                    pair[e] = p;
                    l[half] += p;
                }
                sc[j * 2 + half] = pair;
            }
        }

        // O += P V, 16 keys at a time: key tiles 2 kp and 2 kp + 1 are the A fragment.
        #[unroll(unroll)]
        for kp in 0..comptime![BLOCK / 16] {
            let mut a = Array::<Pair<F>>::new(4usize);
            #[unroll]
            for p in 0..4usize {
                // A's elements 2 p, 2 p + 1 = tile 2 kp + p / 2, its pair p % 2.
                a[p] = Pair::<F>::cast_from(sc[(kp * 2 + p / 2) * 2 + p % 2]);
            }
            accumulate::<F>(
                &a,
                &vs,
                (at + kp * 16) * hd_ld,
                hd_ld,
                &mut o,
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
        // (Every lane reaches this: the emulation's barriers.)
        let total = across_quad(l[half], &mut scratch, true, frags);
        if row < s {
            let ob = bi * out.stride(0) + hi * out.stride(1) + row * out.stride(2);
            let inv = f32::new(1.0) / total;
            #[unroll(unroll)]
            for n in 0..out_tiles {
                let pair = o[n * 2 + half];
                #[unroll]
                for e in 0..2usize {
                    let col = n * 8 + quad * 2 + e;
                    out[ob + col * out.stride(3)] = F::cast_from(pair[e] * inv);
                }
            }
            if quad == 0 {
                lse[bi * lse.stride(0) + hi * lse.stride(1) + row * lse.stride(2)] =
                    m[half] + total.ln();
            }
        }
    }
}

/// The shared memory a cube of [`flash_forward_registers`] takes: K's and V's tiles
/// (`staging.tiles()` each) and the emulation's scratch.
pub fn shared_bytes(head_dim: usize, elem: usize, frags: Fragments, staging: Staging) -> usize {
    let tile = staging.tiles() * BLOCK * staged_ld(head_dim);
    super::stream::shared_bytes(&[(tile, elem), (tile, elem), (frags.scratch_len(), 4)])
}

/// Writes `out` and `lse` as `launch::forward` does, with [`flash_forward_registers`]
/// (`cfg.dropout` must be `None`; `cfg.dims.head_dim` a multiple of 16 up to
/// [`MAX_HEAD_DIM`]), K and V streamed as `staging` says.
#[allow(clippy::too_many_arguments)]
pub fn launch<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: &super::launch::FlashLaunch,
    frags: Fragments,
    staging: Staging,
    q: TensorArg<R>,
    k: TensorArg<R>,
    v: TensorArg<R>,
    key_bias: TensorArg<R>,
    spans: TensorArg<R>,
    out: TensorArg<R>,
    lse: TensorArg<R>,
) {
    let d = &cfg.dims;
    assert!(cfg.dropout.is_none(), "the register forward has no dropout");
    assert!(
        d.head_dim.is_multiple_of(16) && d.head_dim <= MAX_HEAD_DIM,
        "head dim {}",
        d.head_dim
    );
    let width = super::launch::vector_width(client, cfg.dtype, d.head_dim, &[&q, &k, &v]);
    check_shared(
        client,
        shared_bytes(d.head_dim, cfg.dtype.size(), frags, staging),
        "the register forward",
    );
    let count = CubeCount::Static(
        d.q_len.div_ceil(BLOCK) as u32,
        (d.batch * d.heads) as u32,
        1,
    );
    flash_forward_registers::launch::<R>(
        client,
        count,
        CubeDim::new_1d(UNITS as u32),
        width,
        q,
        k,
        v,
        key_bias,
        spans,
        out,
        lse,
        cfg.scale,
        d.group(),
        cfg.window as u32,
        d.head_dim,
        cfg.causal,
        cfg.window > 0,
        cfg.padding,
        cfg.documents,
        frags,
        staging,
        cfg.dtype,
    );
}

#[cfg(test)]
mod tests {
    use super::super::device_tensor::Elem;
    use super::super::reference::{worst, Problem};
    use super::super::tests_kernels::register_forward_on;
    use super::*;

    /// The kernel's O and LSE against the f64 reference, on the inputs rounded to `E`:
    /// within `tol` (O) and 1e-3 (LSE).
    fn check<R: Runtime, E: Elem>(
        client: &ComputeClient<R>,
        frags: Fragments,
        staging: Staging,
        mut p: Problem,
        tol: f64,
    ) {
        let Some((what, _, t)) = register_forward_on::<R, E>(client, frags, staging, &mut p) else {
            return;
        };
        let want = p.expected();
        let o = worst(&t.o.read_as::<E>(client), &want.o);
        let lse = worst(&t.lse.read(client), &want.lse);
        assert!(o <= tol, "{what}: O differs by {o:e} (> {tol:e})");
        assert!(lse <= 1e-3, "{what}: LSE differs by {lse:e}");
    }

    #[cfg(feature = "wgpu-kernels")]
    mod wgpu {
        use super::*;
        use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

        fn client() -> Option<ComputeClient<WgpuRuntime>> {
            crate::testing::client_or_skip::<WgpuRuntime>(
                || WgpuDevice::DefaultDevice,
                "vulkan",
                "the register forward's emulation",
            )
        }

        /// f32 through the same data flow: every index, to fp32 rounding.
        #[test]
        fn emulated_fragments_match_the_reference_in_f32() {
            let Some(client) = client() else { return };
            // (Lavapipe gives a cube 32 KiB of shared memory: two f32 tiles of 64 rows fit up to
            // head dim 32.) 70 queries: a second, partial block of 64; four query heads per kv
            // head.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Problem::new(1, 8, 2, 70, 70, 32, true, &[], 31),
                1e-4,
            );
            // Bidirectional with padded keys.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Problem::new(2, 2, 2, 33, 33, 32, false, &[0, 9], 32),
                1e-4,
            );
            // Causal with padding, grouped, d 16; three key blocks.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Problem::new(2, 4, 2, 130, 130, 16, true, &[3, 9], 33),
                1e-4,
            );
            // Bidirectional, more keys than queries.
            check::<_, f32>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Problem::new(1, 2, 1, 20, 90, 16, false, &[], 34),
                1e-4,
            );
        }

        /// K and V staged a block ahead into second tiles (the schedule of the asynchronous
        /// copies, with plain loads): every block read from the tile it went to. (Four f32
        /// tiles of 64 rows fit lavapipe's 32 KiB at head dim 16.)
        #[test]
        fn emulated_fragments_staged_ahead_match_the_reference() {
            let Some(client) = client() else { return };
            for p in [
                // Causal with padding, grouped; three key blocks, so both tiles are reused.
                Problem::new(2, 4, 2, 130, 130, 16, true, &[3, 9], 33),
                // Bidirectional: four key blocks past one query block; one key block.
                Problem::new(1, 2, 1, 20, 200, 16, false, &[], 36),
                Problem::new(1, 2, 2, 90, 20, 16, false, &[4], 37),
            ] {
                check::<_, f32>(&client, Fragments::Emulated, Staging::Double, p, 1e-4);
            }
            check::<_, burn::tensor::f16>(
                &client,
                Fragments::Emulated,
                Staging::Double,
                Problem::new(2, 4, 2, 150, 150, 32, true, &[0, 5], 38),
                2e-2,
            );
        }

        /// A cube that needs more shared memory than the device gives is refused, saying
        /// how much it needs, where wgpu's own error would not reach the caller.
        #[test]
        fn a_launch_past_the_shared_memory_limit_says_so() {
            let Some(client) = client() else { return };
            // Two f32 tiles each of K and V at d 64: 72 KiB, past lavapipe's 32.
            let need = shared_bytes(64, 4, Fragments::Emulated, Staging::Double);
            let max = client.properties().hardware.max_shared_memory_size;
            if need <= max {
                eprintln!("SKIPPED: this device gives {max} bytes of shared memory a cube");
                return;
            }
            let mut p = Problem::new(1, 1, 1, 64, 64, 64, false, &[], 1);
            let refused = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                register_forward_on::<_, f32>(&client, Fragments::Emulated, Staging::Double, &mut p)
                    .is_some()
            }))
            .expect_err("the launch went ahead");
            let message = refused
                .downcast_ref::<String>()
                .expect("a formatted message");
            assert!(
                message.contains(&format!("needs {need} bytes of shared memory"))
                    && message.contains(&max.to_string()),
                "{message}"
            );
        }

        /// 16-bit inputs: P rounded to the input type before `P V`, as on the tensor cores.
        #[test]
        fn emulated_fragments_match_the_reference_in_f16() {
            let Some(client) = client() else { return };
            check::<_, burn::tensor::f16>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Problem::new(2, 4, 2, 37, 37, 64, true, &[0, 5], 9),
                2e-2,
            );
            check::<_, burn::tensor::f16>(
                &client,
                Fragments::Emulated,
                Staging::Single,
                Problem::new(1, 2, 2, 80, 80, 48, false, &[], 10),
                2e-2,
            );
        }
    }

    /// The register products and shuffles themselves, at the head dims the executor runs.
    #[cfg(feature = "cuda")]
    mod cuda {
        use super::super::super::tests_kernels::register_cuda_problems;
        use super::*;
        use cubecl::cuda::{CudaDevice, CudaRuntime};

        /// At the head dims the executor runs, both masks, in bf16 and (`f16`) fp16, with
        /// `staging`; `None` where the device has no CUDA.
        fn on_cuda(staging: Staging, f16: bool) -> Option<()> {
            let client = crate::testing::client_or_skip::<CudaRuntime>(
                || CudaDevice::new(0),
                "cuda",
                "the register forward",
            )?;
            let frags = Fragments::Registers;
            for p in register_cuda_problems(40) {
                check::<_, burn::tensor::bf16>(&client, frags, staging, p.clone(), 3e-2);
                if f16 {
                    check::<_, burn::tensor::f16>(&client, frags, staging, p, 1e-2);
                }
            }
            Some(())
        }

        #[test]
        fn register_fragments_match_the_reference() {
            on_cuda(Staging::Single, true);
        }

        /// The other side's blocks copied a block ahead (`cp.async`, 16 bytes a copy, on a
        /// barrier), in bf16 (the staging does not depend on the type): a test of its own, so
        /// that `gpu_flash_call.sh` tells it apart.
        #[test]
        fn copied_ahead_match_the_reference() {
            on_cuda(Staging::Copies(8), false);
        }
    }

    /// The CUDA source: register products and shuffles, nothing on the stack (ptxas,
    /// `sm_90a`), at the head dims and types the executor runs. No GPU needed.
    #[cfg(all(feature = "cuda", feature = "wgpu-kernels"))]
    mod source {
        use super::super::super::tests_cuda_source::{
            client, compiles, copies_async, float, on_register_mma_spilling, settings,
            shared_as_estimated, tensor, COPIES_SPILL,
        };
        use super::*;
        use cubecl::ir::FloatKind;
        use cubecl::wgpu::WgpuRuntime;

        /// One block at a time in both 16-bit types; copied ahead (`cp.async` into second
        /// tiles, completing on a barrier) in bf16.
        #[test]
        fn the_register_forward_compiles_without_spills() {
            let Some(client) = client() else { return };
            for kind in [FloatKind::BF16, FloatKind::F16] {
                for staging in [Staging::Single, Staging::Copies(8)] {
                    if kind == FloatKind::F16 && staging.copies() {
                        continue;
                    }
                    for head_dim in [64, 128] {
                        // The third: causal under a sliding window, the fourth over packed
                        // documents (each its own compile-time variant).
                        for (causal, padding, windowed, documents) in [
                            (true, false, false, false),
                            (false, true, false, false),
                            (true, false, true, false),
                            (true, false, false, true),
                        ] {
                            let kernel =
                                flash_forward_registers::FlashForwardRegisters::<WgpuRuntime>::new(
                                    settings(UNITS as u32),
                                    client.clone(),
                                    tensor(),
                                    tensor(),
                                    tensor(),
                                    tensor(),
                                    tensor(),
                                    tensor(),
                                    tensor(),
                                    (),
                                    (),
                                    (),
                                    // Staged 2 16-bit values at a time, as launched.
                                    2,
                                    head_dim,
                                    causal,
                                    windowed,
                                    padding,
                                    documents,
                                    Fragments::Registers,
                                    staging,
                                    float(kind),
                                );
                            let what = format!(
                                "register forward {kind:?} {staging:?} d{head_dim} causal {causal} padding {padding} window {windowed} documents {documents}"
                            );
                            let compiled = compiles(kernel, &what);
                            // (`COPIES_SPILL` says why the copies may spill a
                            // little.)
                            let spill = if staging.copies() { COPIES_SPILL } else { 0 };
                            on_register_mma_spilling(&compiled, spill, &what);
                            copies_async(&compiled, staging.copies(), &what);
                            let need = shared_bytes(head_dim, 2, Fragments::Registers, staging);
                            shared_as_estimated(&compiled, need, &what);
                            assert!(
                                compiled.lowered.source.contains("__shfl_xor_sync"),
                                "{what}: no shuffles"
                            );
                        }
                    }
                }
            }
        }
    }
}
