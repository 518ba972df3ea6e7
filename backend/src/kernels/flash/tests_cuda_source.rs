//! The flash kernels' CUDA source, checked without a GPU: each kernel is
//! expanded (with lavapipe's client, which the expansion only asks for
//! device properties), lowered by CubeCL's CUDA compiler for an H100
//! (`sm_90a`), and compiled by NVRTC to a cubin, as its first launch on the
//! GPU would. Lavapipe has no `cmma`: the tensor-core kernels' indices run
//! there (`Products::TiledScalar`), their `cmma` calls only compile here.
//!
//! Needs both `cuda` (CubeCL's CUDA compiler, NVRTC) and `wgpu-kernels` (a
//! client to expand with); skips with a note without a Vulkan device or
//! NVRTC (`tools/nvrtc_from_pypi.sh` fetches one).

use cubecl::cuda::prebuild;
use cubecl::ir::{ElemType, FloatKind};
use cubecl::prelude::*;
use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

use super::backward::{flash_backward_kv::FlashBackwardKv, flash_backward_q::FlashBackwardQ};
use super::backward_blocks::{
    flash_backward_kv_blocks::FlashBackwardKvBlocks, flash_backward_q_blocks::FlashBackwardQBlocks,
};
use super::forward::flash_forward::FlashForward;
use super::forward_blocks::flash_forward_blocks::FlashForwardBlocks;
use super::launch::{FlashDims, FlashKernels, FlashLaunch, UNITS_PER_ROW};
use super::mma::{Products, PAD_F32, PAD_HALF};
use super::tile::staged_ld;

const SM: u32 = 90;

pub(crate) fn client() -> Option<ComputeClient<WgpuRuntime>> {
    let headers = match crate::cuda::compiler() {
        Ok(h) => h,
        Err(e) => {
            crate::testing::skip(
                "nvrtc",
                &format!("{e}; the flash kernels' CUDA source was not compiled"),
            );
            return None;
        }
    };
    // wmma's `mma.h` includes `crt/mma.h`, which a toolkit has and NVRTC's
    // PyPI wheels lack (`tools/nvrtc_from_pypi.sh` takes it from nvcc's since
    // 2026-11-28).
    // CubeCL's barriers include CCCL's `cuda/barrier`, which needs `nv/target`
    // (in the script's headers since 2026-11-28i).
    for header in ["crt/mma.h", "nv/target"] {
        assert!(
            headers.join(header).exists(),
            "{} has no {header}: run `sh tools/nvrtc_from_pypi.sh` again",
            headers.display()
        );
    }
    let found = std::panic::catch_unwind(|| WgpuRuntime::client(&WgpuDevice::DefaultDevice));
    if found.is_err() {
        crate::testing::skip("vulkan", "no Vulkan device to expand the kernels with");
    }
    found.ok()
}

pub(crate) fn settings(units: u32) -> KernelSettings {
    KernelSettings::default()
        .cube_dim(CubeDim::new_1d(units))
        .address_type(AddressType::U32)
}

pub(crate) fn tensor() -> TensorCompilationArg {
    TensorCompilationArg { inplace: None }
}

pub(crate) fn float(kind: FloatKind) -> StorageType {
    StorageType::Scalar(ElemType::Float(kind))
}

/// A kernel lowered for the H100, and ptxas's report of its resources.
pub(crate) struct Compiled {
    pub(crate) lowered: prebuild::RecordedKernel,
    pub(crate) ptxas: String,
}

/// Lowers `kernel` for the H100 and compiles it with NVRTC: a cubin, or
/// NVRTC's log in the panic. Prints ptxas's report (`--nocapture`).
pub(crate) fn compiles<K: CubeKernel>(kernel: K, what: &str) -> Compiled {
    let lowered = prebuild::lower_for(kernel, SM).unwrap_or_else(|e| panic!("{what}: {e}"));
    let started = std::time::Instant::now();
    let (image, ptxas) = prebuild::compile_verbose(&lowered)
        .unwrap_or_else(|e| panic!("{what}: {e}\n{}", lowered.source));
    let seconds = started.elapsed().as_secs_f64();
    assert!(image.cubin, "{what}: NVRTC gave PTX, not an sm_{SM}a cubin");
    let used: Vec<&str> = ptxas
        .lines()
        .filter(|l| l.contains("Used") || l.contains("stack"))
        .collect();
    eprintln!("{what}: NVRTC {seconds:.1} s; {}", used.join("; "));
    dump(&lowered, &image, what);
    Compiled { lowered, ptxas }
}

/// With `RCOA_DUMP_KERNELS=DIR`, writes the kernel's CUDA source and cubin
/// to `DIR/<what>.cu` and `.cubin`, for reading the machine code without a
/// GPU (`cuobjdump -sass`, from PyPI's `nvidia-cuda-cuobjdump`).
fn dump(lowered: &prebuild::RecordedKernel, image: &prebuild::Image, what: &str) {
    let Some(dir) = std::env::var_os("RCOA_DUMP_KERNELS") else {
        return;
    };
    let dir = std::path::PathBuf::from(dir);
    std::fs::create_dir_all(&dir).expect("the dump directory");
    let name: String = what
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    let bytes: Vec<u8> = image.bytes.iter().map(|&b| b as u8).collect();
    std::fs::write(dir.join(format!("{name}.cu")), &lowered.source).expect("the source");
    std::fs::write(dir.join(format!("{name}.cubin")), bytes).expect("the cubin");
}

/// With `async_copy`, the tiles go straight to shared memory, 16 bytes a
/// copy, and the products wait on the copies' barriers; without it, none of
/// that is in the source.
pub(crate) fn copies_async(compiled: &Compiled, async_copy: bool, what: &str) {
    let source = &compiled.lowered.source;
    for sign in [
        "__cp_async_shared_global<16>",
        "arrive_and_wait()",
        "__cp_async_arrive(",
    ] {
        assert_eq!(source.contains(sign), async_copy, "{what}: {sign}");
    }
}

/// The shared memory a launch checks against the device's limit (`estimate`, from the
/// kernel's `shared_bytes`) covers what CubeCL lays out for the cube, and by no more than
/// 1 KiB: an estimate below it would let an oversized launch through to fail on the
/// device, one far above it would refuse launches that fit.
pub(crate) fn shared_as_estimated(compiled: &Compiled, estimate: usize, what: &str) {
    let laid = compiled.lowered.shared_mem_bytes;
    assert!(
        laid <= estimate && estimate <= laid + 1024,
        "{what}: CubeCL lays out {laid} bytes of shared memory a cube; the launch checks {estimate}"
    );
}

/// dQ is added to global memory atomically in one pass only.
pub(crate) fn atomically_adds(compiled: &Compiled, one_pass: bool, what: &str) {
    assert_eq!(
        compiled.lowered.source.contains("atomicAdd("),
        one_pass,
        "{what}: atomic adds"
    );
}

/// One compiled configuration of the tensor-core kernels.
#[derive(Clone, Copy)]
struct Variant {
    kind: FloatKind,
    head_dim: usize,
    causal: bool,
    padding: bool,
    dropout: bool,
    units_per_row: usize,
    tile_pairs: bool,
    /// The asynchronous copies (`FlashLaunch::async_copy`; the two-pass
    /// query-block kernel has none).
    async_copy: bool,
}

/// The shapes the tensor-core kernels are compiled for here: both 16-bit
/// types, the head dims of the plans (64, 128) and a small one, with and
/// without the causal and padding masks and dropout, at the default units
/// per row; and the plans' head dims at bf16 with four units per row,
/// with 2 × 2 tiles per plane, and with asynchronous copies.
fn tensor_core_variants() -> Vec<Variant> {
    let mut out = Vec::new();
    for kind in [FloatKind::BF16, FloatKind::F16] {
        for (head_dim, causal, padding, dropout) in [
            (64, true, true, false),
            (128, false, false, true),
            (32, true, false, false),
            (64, true, false, true),
        ] {
            out.push(Variant {
                kind,
                head_dim,
                causal,
                padding,
                dropout,
                units_per_row: UNITS_PER_ROW,
                tile_pairs: false,
                async_copy: false,
            });
        }
    }
    for head_dim in [64, 128] {
        for (units_per_row, tile_pairs) in [(4, false), (UNITS_PER_ROW, true)] {
            out.push(Variant {
                kind: FloatKind::BF16,
                head_dim,
                causal: true,
                padding: false,
                dropout: false,
                units_per_row,
                tile_pairs,
                async_copy: false,
            });
        }
        out.push(Variant {
            kind: FloatKind::BF16,
            head_dim,
            causal: true,
            padding: true,
            dropout: false,
            units_per_row: UNITS_PER_ROW,
            tile_pairs: false,
            async_copy: true,
        });
    }
    out
}

/// The block-product kernels run their products on tensor cores, and their
/// tiles fit an H100 block (227 KiB opt-in): 16-bit tiles of `tiles16`
/// elements and fp32 ones of `tiles32`, give or take small row vectors.
fn on_tensor_cores(
    compiled: &Compiled,
    tiles16: usize,
    tiles32: usize,
    head_dim: usize,
    what: &str,
) {
    let lowered = &compiled.lowered;
    // Each unit's output or gradient rows (fp32) are registers: their loops
    // are unrolled, so no index is a run-time value (that puts the whole
    // array in local memory, as ptxas's stack frame shows: 64 bytes or more
    // for the smallest share, 16 values at head dim 32), and they fit a
    // thread's 255 registers (with one unit per row, the key-block
    // backward's two rows of 128 did not, and spilled 580 bytes). ptxas may
    // still spill a register or two where it aims at fewer registers (f16
    // at head dim 32: 16 bytes).
    let stack = stack_bytes(compiled, what);
    assert!(
        stack <= 32,
        "{what} (head dim {head_dim}): {stack} bytes of local memory\n{}",
        compiled.ptxas
    );
    assert!(lowered.source.contains("wmma::mma_sync"), "{what}: no wmma");
    // The inputs are staged two 16-bit values at a time (`tile::stage_tile`).
    assert!(
        lowered.source.contains("_2* __restrict__ buffer_0"),
        "{what}: q is not read as pairs\n{}",
        &lowered.source[..lowered.source.len().min(3000)]
    );
    // Fast math (the kernels' `fast_math`): the exponentials are CUDA's
    // intrinsic, not the range-reduced `exp`.
    assert!(lowered.source.contains("__expf("), "{what}: no __expf");
    assert!(
        !lowered.source.contains("= exp("),
        "{what}: a full-precision exp"
    );
    let want = tiles16 * 2 + tiles32 * 4;
    assert!(
        lowered.shared_mem_bytes >= want && lowered.shared_mem_bytes <= want + 1024,
        "{what}: {} B of shared memory, {want} B of tiles",
        lowered.shared_mem_bytes
    );
    assert!(lowered.shared_mem_bytes <= 227 * 1024, "{what}");
}

const BLOCK: usize = 64;

/// What a launch of the tensor-core block kernels checks against the device's shared
/// memory for `v` ([`FlashLaunch::blocks_shared_bytes`]): forward, key-block backward,
/// query-block backward.
fn blocks_estimate(v: &Variant) -> [usize; 3] {
    let products = Products::TensorCores;
    FlashLaunch {
        window: 0,
        documents: false,
        dims: FlashDims {
            batch: 1,
            heads: 1,
            kv_heads: 1,
            q_len: 128,
            kv_len: 128,
            head_dim: v.head_dim,
        },
        causal: v.causal,
        padding: v.padding,
        scale: 1.0,
        dtype: float(v.kind),
        kernels: FlashKernels::Blocks { products },
        unroll: true,
        dropout: v.dropout.then_some(0.1),
        atomic_dq: false,
        units_per_row: v.units_per_row,
        tile_pairs: v.tile_pairs,
        async_copy: v.async_copy,
        register_forward: false,
        register_backward: false,
        max_shared: usize::MAX,
    }
    .blocks_shared_bytes(products)
}

/// The tensor-core forward kernel of `v`, as launched: 2 16-bit values (a bank) staged at
/// a time, 16 bytes an asynchronous copy (`launch::async_copy_fits`).
fn forward_blocks(
    client: &ComputeClient<WgpuRuntime>,
    v: &Variant,
) -> FlashForwardBlocks<WgpuRuntime> {
    FlashForwardBlocks::<WgpuRuntime>::new(
        settings((BLOCK * v.units_per_row) as u32),
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
        (),
        (),
        (),
        2,
        v.head_dim,
        BLOCK,
        v.units_per_row,
        v.causal,
        v.padding,
        false,
        v.dropout,
        true,
        Products::TensorCores,
        v.tile_pairs,
        v.async_copy,
        8,
        float(v.kind),
    )
}

#[test]
fn the_tensor_core_forward_compiles_for_an_h100() {
    let Some(client) = client() else { return };
    for v in tensor_core_variants() {
        let Variant {
            kind,
            head_dim,
            dropout,
            units_per_row: split,
            tile_pairs,
            async_copy,
            ..
        } = v;
        let what = format!(
            "flash_forward_blocks {kind:?} d{head_dim} dropout {dropout} {split} units a row, pairs {tile_pairs}, async {async_copy}"
        );
        let kernel = forward_blocks(&client, &v);
        // Q, K, V and P, their rows padded; S (then P V), rows padded.
        let tiles16 = 3 * BLOCK * staged_ld(head_dim) + BLOCK * (BLOCK + PAD_HALF);
        let tiles32 = BLOCK * (BLOCK.max(head_dim) + PAD_F32);
        let compiled = compiles(kernel, &what);
        on_tensor_cores(&compiled, tiles16, tiles32, head_dim, &what);
        copies_async(&compiled, async_copy, &what);
        shared_as_estimated(&compiled, blocks_estimate(&v)[0], &what);
    }
}

#[test]
fn the_tensor_core_backward_compiles_for_an_h100() {
    let Some(client) = client() else { return };
    for v in tensor_core_variants() {
        let Variant {
            kind,
            head_dim,
            causal,
            padding,
            dropout,
            units_per_row: split,
            tile_pairs,
            async_copy,
        } = v;
        // K, V, Q, dO and two score tiles; S and dP (then the products);
        // every tile's rows padded.
        let tiles16 = 4 * BLOCK * staged_ld(head_dim) + 2 * BLOCK * (BLOCK + PAD_HALF);
        let tiles32 = BLOCK * (2 * (BLOCK + PAD_F32)).max(head_dim + PAD_F32);
        for one_pass in [false, true] {
            let what = format!(
                "flash_backward_kv_blocks {kind:?} d{head_dim} dropout {dropout} one pass {one_pass} {split} units a row, pairs {tile_pairs}, async {async_copy}"
            );
            let kernel = FlashBackwardKvBlocks::<WgpuRuntime>::new(
                settings((BLOCK * split) as u32),
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
                tensor(),
                tensor(),
                tensor(),
                (),
                (),
                (),
                (),
                (),
                // Staged 2 16-bit values (a bank) at a time, as launched.
                2,
                head_dim,
                BLOCK,
                split,
                causal,
                padding,
                false,
                dropout,
                true,
                Products::TensorCores,
                tile_pairs,
                one_pass,
                async_copy,
                // 16 bytes a copy (`launch::async_copy_fits`).
                8,
                float(kind),
            );
            let compiled = compiles(kernel, &what);
            on_tensor_cores(&compiled, tiles16, tiles32, head_dim, &what);
            copies_async(&compiled, async_copy, &what);
            atomically_adds(&compiled, one_pass, &what);
            shared_as_estimated(&compiled, blocks_estimate(&v)[1], &what);
        }

        if async_copy {
            // The two-pass query-block kernel stages synchronously.
            continue;
        }
        let what = format!(
            "flash_backward_q_blocks {kind:?} d{head_dim} dropout {dropout} {split} units a row, pairs {tile_pairs}"
        );
        let kernel = FlashBackwardQBlocks::<WgpuRuntime>::new(
            settings((BLOCK * split) as u32),
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
            tensor(),
            (),
            (),
            (),
            (),
            (),
            // Staged 2 16-bit values (a bank) at a time, as launched.
            2,
            head_dim,
            BLOCK,
            split,
            causal,
            padding,
            false,
            dropout,
            true,
            Products::TensorCores,
            tile_pairs,
            float(kind),
        );
        let tiles16 = 4 * BLOCK * staged_ld(head_dim) + BLOCK * (BLOCK + PAD_HALF);
        let compiled = compiles(kernel, &what);
        on_tensor_cores(&compiled, tiles16, tiles32, head_dim, &what);
        shared_as_estimated(&compiled, blocks_estimate(&v)[2], &what);
    }
}

/// PTX's register `mma.sync.m16n8k16` (CubeCL's manual MMA) in the source, and nothing on
/// the stack: the fragments stay in registers.
pub(crate) fn on_register_mma(compiled: &Compiled, what: &str) {
    on_register_mma_spilling(compiled, 0, what);
}

/// The stack the kernels that copy a block ahead may take ([`on_register_mma_spilling`]).
///
/// CubeCL lays out shared memory in a different order from one expansion to the next (a
/// hash map's), and from the same source ptxas then gave the query kernel (bf16, d 128)
/// 168 registers and a 12- or 16-byte frame (two spilled values) in some builds, 176–229
/// registers and none in others; a small change elsewhere in the kernel once made it 24.
/// At 168 it aims at three cubes an SM, which the kernel's 102 KiB of shared memory does
/// not allow anyway. An array of fragments on the stack would be hundreds of bytes.
pub(crate) const COPIES_SPILL: usize = 32;

/// [`on_register_mma`], with at most `spill` bytes on the stack: a few registers ptxas may
/// spill to fit one more cube an SM, never an array of fragments (hundreds of bytes).
pub(crate) fn on_register_mma_spilling(compiled: &Compiled, spill: usize, what: &str) {
    let source = &compiled.lowered.source;
    assert!(
        source.contains("mma.sync.aligned.m16n8k16.row.col.f32"),
        "{what}: no register mma\n{source}"
    );
    let stack = stack_bytes(compiled, what);
    assert!(
        stack <= spill,
        "{what}: {stack} bytes of stack (> {spill}): {}",
        compiled.ptxas
    );
}

/// ptxas's stack frame, in bytes: the unit's arrays that live in local
/// memory, and its spilled registers.
fn stack_bytes(compiled: &Compiled, what: &str) -> usize {
    compiled
        .ptxas
        .lines()
        .find_map(|l| {
            let (n, _) = l.split_once(" bytes stack frame")?;
            n.rsplit(|c: char| !c.is_ascii_digit()).next()?.parse().ok()
        })
        .unwrap_or_else(|| {
            panic!(
                "{what}: no stack frame in ptxas's report\n{}",
                compiled.ptxas
            )
        })
}

/// The three `Rows` kernels (bf16, `head_dim`, blocks as the launch has
/// them), with their loops over each unit's rows unrolled or not.
fn rows_kernels(
    client: &ComputeClient<WgpuRuntime>,
    head_dim: usize,
    unroll: bool,
) -> Vec<(&'static str, usize, Compiled)> {
    let bf16 = float(FloatKind::BF16);
    let block = FlashDims::rows_block(head_dim);
    let what = |name: &str| format!("{name} d{head_dim} unroll {unroll}");
    let forward = FlashForward::<WgpuRuntime>::new(
        settings(block as u32),
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
        (),
        (),
        (),
        head_dim,
        block,
        true,
        true,
        false,
        false,
        unroll,
        bf16,
    );
    let kv = FlashBackwardKv::<WgpuRuntime>::new(
        settings(block as u32),
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
        tensor(),
        tensor(),
        (),
        (),
        (),
        (),
        (),
        head_dim,
        block,
        true,
        true,
        false,
        false,
        unroll,
        bf16,
    );
    let q = FlashBackwardQ::<WgpuRuntime>::new(
        settings(block as u32),
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
        tensor(),
        (),
        (),
        (),
        (),
        (),
        head_dim,
        block,
        true,
        true,
        false,
        false,
        unroll,
        bf16,
    );
    vec![
        (
            "flash_forward",
            2,
            compiles(forward, &what("flash_forward")),
        ),
        (
            "flash_backward_kv",
            4,
            compiles(kv, &what("flash_backward_kv")),
        ),
        (
            "flash_backward_q",
            3,
            compiles(q, &what("flash_backward_q")),
        ),
    ]
}

/// The `Rows` kernels, which have run on an H100 (`docs/burn-h100.md`), as
/// CUDA runs them (`launch::unrolls`): where a unit's rows fit its
/// registers (`tile::unroll_rows`), at most half their bytes are left in
/// local memory (the forward's row of scores, indexed by the key, and
/// spilled registers: the key-block backward's four rows of 64 do not
/// quite fit 255). With loops to a run-time bound, ptxas had put every row
/// there (bf16, head dim 64: 640, 1024 and 768 bytes). Where the rows do
/// not fit (head dim 128, both backward kernels), the loops stay loops:
/// unrolled, they spilled more than the arrays take.
#[test]
fn the_rows_kernels_keep_their_rows_in_registers_where_they_fit() {
    let Some(client) = client() else { return };
    for head_dim in [64, 128] {
        let loops = rows_kernels(&client, head_dim, false);
        let unrolled = rows_kernels(&client, head_dim, true);
        for ((name, rows, loops), (_, _, unrolled)) in loops.iter().zip(&unrolled) {
            let (as_loops, after) = (stack_bytes(loops, name), stack_bytes(unrolled, name));
            let arrays = rows * head_dim * 4;
            if super::tile::unroll_rows(true, *rows, head_dim) {
                assert!(
                    2 * after <= arrays,
                    "{name} d{head_dim}: {after} bytes of local memory unrolled, its rows take {arrays}\n{}",
                    unrolled.ptxas
                );
            } else {
                assert_eq!(after, as_loops, "{name} d{head_dim}: not unrolled");
            }
        }
    }
}

/// The `cmma` tiles CUDA's runtime registers for a GPU (`prebuild::wmma_combinations`,
/// which the executor's choice of tensor cores reads) are the ones NVRTC compiles for its
/// architecture: the tensor-core forward at head dim 64 compiles in fp16 from Volta on and
/// in bf16 from Ampere on. CubeCL's own list claims bf16 on a V100 and a T4, where
/// the same kernel failed to compile (`fragment<.., __nv_bfloat16, ..>` is incomplete).
#[test]
fn tensor_cores_are_registered_where_their_kernels_compile() {
    let Some(client) = client() else { return };
    for sm in [70u32, 75, 80, 89, 90] {
        for kind in [FloatKind::F16, FloatKind::BF16] {
            let kernel = forward_blocks(
                &client,
                &Variant {
                    kind,
                    head_dim: 64,
                    causal: true,
                    padding: false,
                    dropout: false,
                    units_per_row: UNITS_PER_ROW,
                    tile_pairs: false,
                    async_copy: false,
                },
            );
            let built = prebuild::lower_for(kernel, sm).and_then(|k| prebuild::compile(&k));
            let registered = prebuild::wmma_combinations(sm)
                .contains(&super::launch::tensor_core_tile(float(kind)));
            assert_eq!(
                built.is_ok(),
                registered,
                "sm_{sm} {kind:?}: registered {registered}, NVRTC: {}",
                built.err().unwrap_or_default()
            );
        }
    }
}
