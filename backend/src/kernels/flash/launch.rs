//! Host side of the kernels: block size, grid, launch. Runtime-generic: the
//! same launches run on CUDA (`rcoa run`) and on wgpu (the tests, through
//! lavapipe where there is no GPU).

use cubecl::ir::features::AtomicUsage;
use cubecl::ir::{ElemType, FloatKind, Type};
use cubecl::prelude::*;

use super::backward::{flash_backward_kv, flash_backward_q};
use super::backward_blocks::{flash_backward_kv_blocks, flash_backward_q_blocks};
use super::forward::flash_forward;
use super::forward_blocks::flash_forward_blocks;
use super::mma::{Products, TILE};

/// The largest head dimension the kernels take: a block of 8 rows of 256
/// fp32 values per staged tensor keeps shared memory at 16 KiB (the least
/// Vulkan guarantees).
pub const MAX_HEAD_DIM: usize = 256;

/// What one attention call computes on: `q [batch, heads, q_len, head_dim]`,
/// `k, v [batch, kv_heads, kv_len, head_dim]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlashDims {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub q_len: usize,
    pub kv_len: usize,
    pub head_dim: usize,
}

/// Which kernels compute the forward and the backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlashKernels {
    /// `forward.rs`, `backward.rs`: each unit scores its row against fp32
    /// rows staged in shared memory, scalar FMAs.
    Rows,
    /// `forward_blocks.rs`, `backward_blocks.rs`: the block products over
    /// shared-memory tiles (`mma.rs`), computed as `products` says.
    Blocks { products: Products },
}

/// One launch's settings besides the tensors.
#[derive(Clone, Copy, Debug)]
pub struct FlashLaunch {
    pub dims: FlashDims,
    pub causal: bool,
    /// A sliding window (with `causal`): query `i` sees only the `window` keys up to
    /// itself, `i − window < j ≤ i` (Mistral's and Phi-3's `sliding_window`); 0 for
    /// none. Every kernel skips the key blocks outside every row's window and masks the
    /// rest (`tile::first_key_block`, `query_blocks`, `excluded`).
    pub window: usize,
    /// A `key_bias [batch, kv_len]` fp32 tensor is passed (otherwise a
    /// 1-element placeholder is, and never read).
    pub padding: bool,
    /// Packed rows (with `causal`): a `spans [batch, q_len, 2]` tensor of 32-bit integers
    /// gives each token's document as `[start, end)`, and a query sees only the keys of
    /// its own. Every kernel skips the key blocks before the first row's document (and the
    /// query blocks past the last key's) and masks the rest (`tile::document_first`,
    /// `document_last`); otherwise a placeholder is passed, never read.
    pub documents: bool,
    pub scale: f32,
    /// The element type of q, k, v, O, dO and the gradients; LSE and the key
    /// bias are fp32.
    pub dtype: StorageType,
    /// The kernels asked for; [`FlashLaunch::kernels`] says which run.
    pub kernels: FlashKernels,
    /// Unroll the loops over each unit's own rows (its query, output or
    /// gradient rows, fp32), so that they stay in registers instead of
    /// local memory; [`unrolls`] says where that pays.
    pub unroll: bool,
    /// Attention dropout's probability (its seed is a tensor the kernels
    /// read: `super::dropout`), or `None`.
    pub dropout: Option<f64>,
    /// The backward computes dQ in the key-block kernel, adding it to an
    /// fp32 accumulator atomically (FlashAttention-2's one pass: 5 block
    /// products instead of 7), where the `Blocks` kernels run
    /// ([`FlashLaunch::one_pass`]). Needs fp32 atomic adds
    /// ([`has_atomic_add`]); the sums' order then varies from run to run.
    pub atomic_dq: bool,
    /// Units per row the block-product kernels are asked to run
    /// ([`FlashLaunch::units_per_row`]; [`UNITS_PER_ROW`] by default).
    pub units_per_row: usize,
    /// The block-product kernels' planes take 2 × 2 tiles of a product at a
    /// time where it fits (`mma::pairs_fit`): on tensor cores, one fragment
    /// load from shared memory per product instead of two.
    pub tile_pairs: bool,
    /// The tensor-core forward and key-block backward stage their tiles
    /// with CUDA's asynchronous copies, the next block's loads under this
    /// block's products (`forward_blocks`, `backward_blocks`), where
    /// [`async_copy_fits`]; the register kernels copy a block ahead into
    /// second tiles ([`FlashLaunch::register_staging`]). A trial setting.
    pub async_copy: bool,
    /// The forward runs in FlashAttention-2's structure, each warp's scores and output in
    /// registers (`forward_registers`), where [`FlashLaunch::register_forward_runs`]. On by
    /// default (`RCOA_FLASH_REGISTERS`).
    pub register_forward: bool,
    /// The backward runs in the same structure (`backward_registers`: its key kernel adds
    /// dQ up where [`FlashLaunch::one_pass`], else a query kernel computes it), where
    /// [`FlashLaunch::register_backward_runs`]. On by default.
    pub register_backward: bool,
    /// The shared memory a cube may take on the device, in bytes (CUDA's opt-in limit per
    /// block: 227 KiB on an H100, 163 KiB on an A100, 99 KiB on Ada and consumer Ampere).
    /// Kernels that need more do not run there ([`FlashLaunch::kernels`]).
    pub max_shared: usize,
}

/// Whether the kernels unroll their loops over a unit's rows on `client`'s
/// runtime: everywhere but wgpu. On CUDA that takes the rows out of local
/// memory (ptxas, bf16, head dim 64: the `Rows` forward's stack frame from
/// 640 bytes to 128, the block-product kernels' from 256–1024 to none) and
/// NVRTC compiles each kernel in seconds. Lavapipe's shader compiler took
/// 431 s instead of 63 for the kernel tests with every loop unrolled,
/// so the tests there run the loops as loops (the same code; the unrolled
/// form runs there in one test, at a small head dim).
pub fn unrolls<R: Runtime>(client: &ComputeClient<R>) -> bool {
    !R::name(client).starts_with("wgpu")
}

/// The largest head dimension the tensor-core kernels take: each unit keeps
/// its gradient or output rows in registers (2 × 128 fp32 for dK, dV) and
/// the key-block backward's tiles take 117 KiB of shared memory at 64 rows
/// and bf16.
pub const MAX_TENSOR_CORE_HEAD_DIM: usize = 128;

impl FlashLaunch {
    /// The hash below which dropout drops (`super::dropout::threshold`).
    fn drop_threshold(&self) -> u32 {
        self.dropout.map_or(0, super::dropout::threshold)
    }

    /// What a kept probability is multiplied by.
    fn drop_scale(&self) -> f32 {
        self.dropout.map_or(1.0, super::dropout::keep_scale) as f32
    }

    /// The kernels that run: tensor cores take 16-bit inputs and a head dim
    /// that is a multiple of their 16-wide tiles, up to
    /// [`MAX_TENSOR_CORE_HEAD_DIM`]; their tiling on scalar FMAs (a test of
    /// it) head dims in 16s up to 64; either only where each of their cubes
    /// fits the device's shared memory ([`FlashLaunch::blocks_shared_bytes`]:
    /// the tensor-core backward at head dim 128 takes 121 KiB, past the 99 KiB
    /// of an L40S or an RTX 4090); other shapes run `Rows`.
    pub fn kernels(&self) -> FlashKernels {
        if self.shape_takes() && self.shared_fits() {
            self.kernels
        } else {
            FlashKernels::Rows
        }
    }

    /// The kernels asked for take this shape and type (the first half of
    /// [`FlashLaunch::kernels`]).
    pub(crate) fn shape_takes(&self) -> bool {
        let d = self.dims.head_dim;
        let tiled = d.is_multiple_of(TILE);
        match self.kernels {
            FlashKernels::Blocks {
                products: Products::TensorCores,
            } => {
                let half = matches!(
                    self.dtype,
                    StorageType::Scalar(ElemType::Float(FloatKind::F16 | FloatKind::BF16))
                );
                half && tiled && d <= MAX_TENSOR_CORE_HEAD_DIM
            }
            FlashKernels::Blocks {
                products: Products::TiledScalar,
            } => tiled && d <= 64,
            _ => true,
        }
    }

    /// Each cube of the kernels asked for fits the device's shared memory (the second
    /// half of [`FlashLaunch::kernels`]).
    pub(crate) fn shared_fits(&self) -> bool {
        self.shared_need() <= self.max_shared
    }

    /// The most shared memory a cube of the block kernels asked for takes
    /// ([`FlashLaunch::blocks_shared_bytes`]); 0 for the `Rows` kernels, whose
    /// 16 KiB any device gives.
    pub fn shared_need(&self) -> usize {
        match self.kernels {
            FlashKernels::Blocks { products } => self
                .blocks_shared_bytes(products)
                .into_iter()
                .max()
                .unwrap_or(0),
            FlashKernels::Rows => 0,
        }
    }

    /// The backward runs in one pass ([`FlashLaunch::atomic_dq`]): asked
    /// for, and the `Blocks` kernels run (the `Rows` kernels have only the
    /// atomics-free split), with the block products or in registers.
    pub fn one_pass(&self) -> bool {
        self.atomic_dq && matches!(self.kernels(), FlashKernels::Blocks { .. })
    }

    /// Query (and key) rows per block of the `Blocks` kernels: 64 on
    /// tensor cores (four warps with two units per row, each warp taking
    /// 16 × 16 tiles of the block products in turn); 16 for their tiling on
    /// scalar FMAs; otherwise
    /// `1024 / head_dim` up to 16, which keeps the fp32 tiles within 20 KiB
    /// (lavapipe gives 32 KiB; 16 rows at head dim 128 took 33 KiB and did
    /// not launch).
    fn blocks_block(products: Products, head_dim: usize) -> usize {
        match products {
            Products::TensorCores => 64,
            Products::TiledScalar => TILE,
            Products::Scalar => (1024 / head_dim.max(1)).clamp(1, TILE),
        }
    }

    /// Units per row of the block-product kernels: `asked` where it divides
    /// the block and the head dim, else two where that does, else one. Each
    /// takes its share of its row's score columns and of its output or
    /// gradient row. With two (the default, [`UNITS_PER_ROW`]) a cube of 64
    /// rows has four warps: they share the products and the staging, and a
    /// unit keeps half the fp32 row in registers (the key-block backward's
    /// two rows of 128 spilled from a thread's 255 registers with one unit
    /// per row). Four give eight warps at the same shared memory: twice the
    /// warps an SM has to hide each other's latency.
    pub fn units_per_row(asked: usize, block: usize, head_dim: usize) -> usize {
        let fits = |u: usize| u >= 1 && block.is_multiple_of(u) && head_dim.is_multiple_of(u);
        if fits(asked) {
            asked
        } else if asked > 2 && fits(2) {
            2
        } else {
            1
        }
    }

    /// Bytes of shared memory a cube of each block-product kernel takes with
    /// `products` at this launch's head dim, type and units per row, as each
    /// lays its tiles out (`forward_blocks`, `backward_blocks`), every array
    /// from a 128-byte boundary, and the barrier of asynchronous copies where
    /// asked: `[forward, key-block backward, query-block backward]`. The
    /// source tests check each against what CubeCL lays out
    /// (`tests_cuda_source`).
    pub fn blocks_shared_bytes(&self, products: Products) -> [usize; 3] {
        use super::mma::{PAD_F32, PAD_HALF};
        let d = self.dims.head_dim;
        let block = Self::blocks_block(products, d);
        let split = Self::units_per_row(self.units_per_row, block, d);
        let elem = self.dtype.size();
        let staged = (block * super::tile::staged_ld(d), elem);
        let scores = (block * (block + PAD_HALF), elem);
        let (s_ld, out_ld) = (block + PAD_F32, d + PAD_F32);
        let row = (block, 4);
        let barrier = if self.async_copy { 128 } else { 0 };
        let bytes = super::stream::shared_bytes;
        // Both backward kernels: Q, dO, K, V; a score tile (dS, or the key kernel's Pᵀ); S
        // and dP side by side (transposed in the key kernel), then the products.
        let backward = [
            staged,
            staged,
            staged,
            staged,
            scores,
            (block * (2 * s_ld).max(out_ld), 4),
        ];
        [
            // Q, K, V; P; S, then P V; each unit's partial maximum and sum.
            bytes(&[
                staged,
                staged,
                staged,
                scores,
                (block * s_ld.max(out_ld), 4),
                (block * split, 4),
            ]) + barrier,
            // The key kernel also has dSᵀ beside Pᵀ, and its rows' L, D and dropout keys.
            bytes(&[&backward[..], &[scores, row, row, row]].concat()) + barrier,
            bytes(&backward),
        ]
    }
}

/// Units per row the block-product kernels run by default
/// ([`FlashLaunch::units_per_row`]).
pub const UNITS_PER_ROW: usize = 2;

impl FlashDims {
    /// Why the kernels cannot take these shapes, if they cannot.
    pub fn check(&self, causal: bool, window: usize, documents: bool) -> Result<(), String> {
        let d = self;
        if d.batch == 0 || d.heads == 0 || d.q_len == 0 || d.kv_len == 0 || d.head_dim == 0 {
            return Err(format!("empty attention shape {d:?}"));
        }
        if d.kv_heads == 0 || !d.heads.is_multiple_of(d.kv_heads) {
            return Err(format!(
                "{} query heads cannot share {} kv heads evenly",
                d.heads, d.kv_heads
            ));
        }
        if d.head_dim > MAX_HEAD_DIM {
            return Err(format!(
                "head dim {} is above the fused kernel's {MAX_HEAD_DIM}",
                d.head_dim
            ));
        }
        if window > 0 && !causal {
            return Err(format!(
                "a sliding window of {window} needs causal attention"
            ));
        }
        if documents && !causal {
            return Err("packed documents need causal attention".into());
        }
        if causal && d.q_len != d.kv_len {
            return Err(format!(
                "causal attention needs as many queries as keys ({} vs {})",
                d.q_len, d.kv_len
            ));
        }
        Ok(())
    }

    /// Rows per block of the `Rows` kernels (= units per cube):
    /// [`FlashDims::rows_block`] at this head dim.
    pub fn block(&self) -> usize {
        Self::rows_block(self.head_dim)
    }

    /// 2048 / head_dim fp32 values, so a staged `[block, head_dim]` tile is
    /// 8 KiB, capped at 32 rows.
    pub fn rows_block(head_dim: usize) -> usize {
        (2048 / head_dim.max(1)).clamp(1, 32)
    }

    pub(crate) fn group(&self) -> u32 {
        (self.heads / self.kv_heads) as u32
    }
}

/// Whether `client`'s device multiplies 16 × 16 × 16 tiles of `dtype` into
/// fp32 on tensor cores (`cmma`).
pub fn has_tensor_cores<R: Runtime>(client: &ComputeClient<R>, dtype: StorageType) -> bool {
    client
        .properties()
        .features
        .matmul
        .cmma
        .contains(&tensor_core_tile(dtype))
}

/// The `cmma` tile the tensor-core kernels multiply: `dtype` inputs, fp32
/// accumulators, [`TILE`] on each side.
pub(crate) fn tensor_core_tile(dtype: StorageType) -> cubecl::ir::features::MmaConfig {
    let tile = TILE as u32;
    cubecl::ir::features::MmaConfig {
        a_type: dtype,
        b_type: dtype,
        cd_type: StorageType::Scalar(ElemType::Float(FloatKind::F32)),
        m: tile,
        n: tile,
        k: tile,
    }
}

/// Whether `client`'s device adds fp32 values to memory atomically, as the
/// one-pass backward does ([`FlashLaunch::atomic_dq`]).
pub fn has_atomic_add<R: Runtime>(client: &ComputeClient<R>) -> bool {
    let ty = Type::new(StorageType::Atomic(ElemType::Float(FloatKind::F32)));
    client
        .properties()
        .atomic_type_usage(ty)
        .contains(AtomicUsage::Add)
}

/// The bytes of one shared-memory bank: what a unit may stage at once
/// ([`vector_width`]).
const BANK_BYTES: usize = 4;

/// Elements a unit of the block-product kernels reads at once when it
/// stages q, k, v and dO (`tile::stage_tile`): as many as fill one
/// shared-memory bank (2 16-bit values, 1 fp32), where that divides the
/// head dim and every stride but the last of every tensor in `staged`,
/// whose last stride is 1 and whose byte offset is a multiple of it, and
/// the runtime loads that width; 1 (one element at a time, any strides)
/// otherwise.
///
/// Why no wider: `stage_tile` still stores to shared memory one element at
/// a time (a vector store into the tiles the `cmma` loads read needs
/// `Slice::with_vector_size`, which CubeCL 0.10 has only for unchecked
/// launches and not on wgpu). With `w` elements of 2 bytes per unit, a
/// warp's store of element `i` hits bank `(w · unit / 2 + i / 2) mod 32`:
/// no conflict for `w = 2`, 2-way for 4, 4-way for 8. Loads of 16 bytes
/// would cut the load instructions by 8 and quadruple the staging's
/// shared-memory cycles, a quarter or more of a key block's shared-memory
/// traffic in the forward; 4-byte loads halve the load instructions, a
/// warp reading 128 bytes, and keep the stores as they were.
pub fn vector_width<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    head_dim: usize,
    staged: &[&TensorArg<R>],
) -> usize {
    let bytes = dtype.size();
    client
        .io_optimized_vector_sizes(bytes)
        .find(|&w| w > 1 && w * bytes <= BANK_BYTES && aligned(bytes, head_dim, staged, w))
        .unwrap_or(1)
}

/// Whether every tensor in `staged` can be read `width` elements (of
/// `bytes` each) at a time along rows of `head_dim`: the head dim and every
/// stride but the last a multiple of `width`, the last stride 1, and the
/// byte offset a multiple of `width · bytes`.
fn aligned<R: Runtime>(
    bytes: usize,
    head_dim: usize,
    staged: &[&TensorArg<R>],
    width: usize,
) -> bool {
    head_dim.is_multiple_of(width)
        && staged.iter().all(|t| match t {
            TensorArg::Handle { handle } => {
                let strides = &handle.strides;
                let last = strides.len().saturating_sub(1);
                strides.get(last) == Some(&1)
                    && strides[..last].iter().all(|s| s.is_multiple_of(width))
                    && handle
                        .handle
                        .offset_start
                        .unwrap_or(0)
                        .is_multiple_of((width * bytes) as u64)
            }
            TensorArg::Alias { .. } => false,
        })
}

/// The bytes of one asynchronous copy (`tile::stage_tile_async`).
const ASYNC_COPY_BYTES: usize = 16;

/// Elements per asynchronous copy of the tensor-core kernels, where they may
/// stage `staged` that way ([`FlashLaunch::async_copy`]): the device copies
/// asynchronously (CUDA from sm 80), and the rows are read 16 bytes at a
/// time (`aligned`) on top of the [`vector_width`] the kernel reads them
/// in. `None` otherwise.
pub fn async_copy_fits<R: Runtime>(
    client: &ComputeClient<R>,
    dtype: StorageType,
    head_dim: usize,
    staged: &[&TensorArg<R>],
    width: usize,
) -> Option<usize> {
    let copy = ASYNC_COPY_BYTES / dtype.size();
    (client.properties().features.copy_async
        && width > 1
        && copy.is_multiple_of(width)
        && aligned(dtype.size(), head_dim, staged, copy))
    .then_some(copy)
}

impl FlashLaunch {
    /// How the block-product kernels (`products`) stage `staged`: the
    /// [`vector_width`] they read it in and, where they copy it
    /// asynchronously ([`FlashLaunch::async_copy`], [`async_copy_fits`]),
    /// the elements per copy (`None` where they stage synchronously).
    pub(crate) fn staging<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        products: Products,
        staged: &[&TensorArg<R>],
    ) -> (usize, Option<usize>) {
        let head_dim = self.dims.head_dim;
        let width = vector_width(client, self.dtype, head_dim, staged);
        let copy = (self.async_copy && products == Products::TensorCores)
            .then(|| async_copy_fits(client, self.dtype, head_dim, staged, width))
            .flatten();
        (width, copy)
    }

    /// How the register kernels stream the other side's blocks past `staged`: copied
    /// asynchronously, a block ahead, where [`FlashLaunch::async_copy`] asks and
    /// [`async_copy_fits`]; else one block at a time.
    pub(crate) fn register_staging<R: Runtime>(
        &self,
        client: &ComputeClient<R>,
        staged: &[&TensorArg<R>],
    ) -> super::stream::Staging {
        use super::stream::Staging;
        let (_, copy) = self.staging(client, Products::TensorCores, staged);
        // A second set of tiles past the device's shared memory: one block at a time.
        copy.map(Staging::Copies)
            .filter(|&copies| {
                self.register_shared_bytes(copies).into_iter().max() <= Some(self.max_shared)
            })
            .unwrap_or(Staging::Single)
    }
}

/// Cubes of `units` units over `rows` rows in blocks of `block`, for each
/// of `slices` slices.
fn grid(rows: usize, block: usize, units: usize, slices: usize) -> (CubeCount, CubeDim) {
    (
        CubeCount::Static(rows.div_ceil(block) as u32, slices as u32, 1),
        CubeDim::new_1d(units as u32),
    )
}

/// Launches the `Rows` kernel `$kernel` over `$rows_of` rows in `$slices`
/// slices, with the tensors `$t` and the settings every `Rows` kernel takes
/// after them, in their order.
macro_rules! launch_rows {
    ($client:expr, $cfg:expr, $kernel:ident, $rows_of:expr, $slices:expr, [$($t:expr),*]) => {{
        let (cfg, d) = ($cfg, &$cfg.dims);
        let block = d.block();
        let (count, dim) = grid($rows_of, block, block, $slices);
        $kernel::launch::<R>(
            $client, count, dim, $($t,)* cfg.scale, d.group(), cfg.drop_threshold(),
            cfg.drop_scale(), cfg.window as u32, d.head_dim, block, cfg.causal, cfg.padding,
            cfg.documents, cfg.dropout.is_some(), cfg.unroll, cfg.dtype,
        );
    }};
}

/// Launches the block-product kernel `$kernel` (`$products`) as
/// [`launch_rows`] does, with the width `$width` it stages its inputs in
/// before the tensors, its units per row after its block size, and after
/// its products and tile pairing the compile-time `flags`, where given.
macro_rules! launch_blocks {
    ($client:expr, $cfg:expr, $kernel:ident, $products:expr, $rows_of:expr, $slices:expr, $width:expr, [$($t:expr),*] $(, flags: [$($f:expr),*])?) => {{
        let (cfg, d, products) = ($cfg, &$cfg.dims, $products);
        let block = FlashLaunch::blocks_block(products, d.head_dim);
        let split = FlashLaunch::units_per_row(cfg.units_per_row, block, d.head_dim);
        let (count, dim) = grid($rows_of, block, block * split, $slices);
        $kernel::launch::<R>(
            $client, count, dim, $width, $($t,)* cfg.scale, d.group(),
            cfg.drop_threshold(), cfg.drop_scale(), cfg.window as u32, d.head_dim, block, split,
            cfg.causal,
            cfg.padding, cfg.documents, cfg.dropout.is_some(), cfg.unroll, products, cfg.tile_pairs,
            $($($f,)*)? cfg.dtype,
        );
    }};
}

/// Writes `out [b, h, s, d]` (`dtype`) and `lse [b, h, s]` (fp32).
/// `dropout_seed`: the two seed words (`[2]`, 32-bit integers) where
/// `cfg.dropout` is set, a placeholder that is never read otherwise.
#[allow(clippy::too_many_arguments)]
pub fn forward<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: &FlashLaunch,
    q: TensorArg<R>,
    k: TensorArg<R>,
    v: TensorArg<R>,
    key_bias: TensorArg<R>,
    dropout_seed: TensorArg<R>,
    spans: TensorArg<R>,
    out: TensorArg<R>,
    lse: TensorArg<R>,
) {
    let d = &cfg.dims;
    match cfg.kernels() {
        FlashKernels::Rows => launch_rows!(
            client,
            cfg,
            flash_forward,
            d.q_len,
            d.batch * d.heads,
            [q, k, v, key_bias, dropout_seed, spans, out, lse]
        ),
        FlashKernels::Blocks { .. } if cfg.register_forward_runs() => {
            let staging = cfg.register_staging(client, &[&q, &k, &v]);
            super::forward_registers::launch(
                client,
                cfg,
                super::forward_registers::Fragments::Registers,
                staging,
                q,
                k,
                v,
                key_bias,
                spans,
                out,
                lse,
            )
        }
        FlashKernels::Blocks { products } => {
            let (width, copy) = cfg.staging(client, products, &[&q, &k, &v]);
            launch_blocks!(
                client,
                cfg,
                flash_forward_blocks,
                products,
                d.q_len,
                d.batch * d.heads,
                width,
                [q, k, v, key_bias, dropout_seed, spans, out, lse],
                flags: [copy.is_some(), copy.unwrap_or(1)]
            )
        }
    }
}

/// The tensors the backward reads (`o` and `lse` from [`forward`]).
pub struct BackwardInputs<R: Runtime> {
    pub q: TensorArg<R>,
    pub k: TensorArg<R>,
    pub v: TensorArg<R>,
    pub o: TensorArg<R>,
    pub d_o: TensorArg<R>,
    pub lse: TensorArg<R>,
    pub key_bias: TensorArg<R>,
    /// As [`forward`]'s.
    pub dropout_seed: TensorArg<R>,
    /// As [`forward`]'s.
    pub spans: TensorArg<R>,
}

/// What the backward writes: the gradients, in the inputs' type and
/// layout, and the one-pass backward's fp32 dQ accumulator.
pub struct BackwardOutputs<R: Runtime> {
    pub d_q: TensorArg<R>,
    pub d_k: TensorArg<R>,
    pub d_v: TensorArg<R>,
    /// Where [`FlashLaunch::one_pass`]: an fp32 tensor of dQ's shape
    /// ([`FlashLaunch::dq_accumulator`]) with `d_q`'s strides, both without gaps,
    /// which the backward zeroes, adds to and casts into `d_q` element by element
    /// in memory order; otherwise any placeholder, never read.
    pub d_q_acc: TensorArg<R>,
    /// Where the block-product kernels run: an fp32 `[b, h, s]` tensor
    /// ([`FlashLaunch::row_dots`]) for `D = rowsum(dO ∘ O)`, which the
    /// backward writes before the key-block kernel reads it; otherwise any
    /// placeholder, never read.
    pub d_rows: TensorArg<R>,
}

impl FlashLaunch {
    /// Whether the forward runs `forward_registers`: asked for
    /// ([`FlashLaunch::register_forward`]), where [`FlashLaunch::registers_take`].
    pub fn register_forward_runs(&self) -> bool {
        self.register_forward
            && self.registers_take()
            && self.register_shared_bytes(super::stream::Staging::Single)[0] <= self.max_shared
    }

    /// Whether the backward runs `backward_registers`: asked for
    /// ([`FlashLaunch::register_backward`]), where the register forward would run.
    pub fn register_backward_runs(&self) -> bool {
        self.register_backward
            && self.registers_take()
            && self.register_shared_bytes(super::stream::Staging::Single)[1] <= self.max_shared
    }

    /// The register kernels take this launch: tensor cores (16-bit inputs, head dims in
    /// 16s up to 128: the register products' shapes), without dropout (which they do not
    /// draw).
    fn registers_take(&self) -> bool {
        self.kernels()
            == FlashKernels::Blocks {
                products: Products::TensorCores,
            }
            && self.dropout.is_none()
            && self.dims.head_dim <= super::forward_registers::MAX_HEAD_DIM
    }

    /// Bytes of shared memory a cube of the register forward, and the larger of the
    /// register backward's two kernels, take with their blocks streamed as `staging` says.
    pub fn register_shared_bytes(&self, staging: super::stream::Staging) -> [usize; 2] {
        use super::forward_registers::Fragments;
        let (d, elem) = (self.dims.head_dim, self.dtype.size());
        let forward =
            super::forward_registers::shared_bytes(d, elem, Fragments::Registers, staging);
        let (key, query) = super::backward_registers::shared_bytes(
            d,
            elem,
            self.padding,
            self.one_pass(),
            Fragments::Registers,
            staging,
        );
        [forward, key.max(query)]
    }

    /// The shape of the fp32 dQ accumulator the backward needs
    /// ([`BackwardOutputs::d_q_acc`]), or `None` where it runs in two
    /// passes.
    pub fn dq_accumulator(&self) -> Option<[usize; 4]> {
        let d = &self.dims;
        self.one_pass()
            .then_some([d.batch, d.heads, d.q_len, d.head_dim])
    }

    /// The shape of the fp32 `D` rows the block-product backward needs
    /// ([`BackwardOutputs::d_rows`]), or `None` where the `Rows` kernels
    /// run (they compute D themselves).
    pub fn row_dots(&self) -> Option<[usize; 3]> {
        let d = &self.dims;
        matches!(self.kernels(), FlashKernels::Blocks { .. }).then_some([d.batch, d.heads, d.q_len])
    }
}

/// Writes dQ, dK and dV. The `Rows` kernels: one launch over key blocks for
/// dK and dV and one over query blocks for dQ. The block-product kernels:
/// a small kernel computes the rows' D first; then one launch over key
/// blocks that also adds dQ up ([`FlashLaunch::one_pass`]), between zeroing
/// the accumulator and casting it, or one over key blocks and one over
/// query blocks, both reading D.
pub fn backward<R: Runtime>(
    client: &ComputeClient<R>,
    cfg: &FlashLaunch,
    x: BackwardInputs<R>,
    out: BackwardOutputs<R>,
) {
    let d = &cfg.dims;
    let products = match cfg.kernels() {
        FlashKernels::Rows => {
            let second = x.clone();
            launch_rows!(
                client,
                cfg,
                flash_backward_kv,
                d.kv_len,
                d.batch * d.kv_heads,
                [
                    x.q,
                    x.k,
                    x.v,
                    x.o,
                    x.d_o,
                    x.lse,
                    x.key_bias,
                    x.dropout_seed,
                    x.spans,
                    out.d_k,
                    out.d_v
                ]
            );
            let x = second;
            launch_rows!(
                client,
                cfg,
                flash_backward_q,
                d.q_len,
                d.batch * d.heads,
                [
                    x.q,
                    x.k,
                    x.v,
                    x.o,
                    x.d_o,
                    x.lse,
                    x.key_bias,
                    x.dropout_seed,
                    x.spans,
                    out.d_q
                ]
            );
            return;
        }
        FlashKernels::Blocks { products } => products,
    };
    // The tensors the block kernels stage (O goes only to
    // `scratch::row_dots`, which stages nothing).
    let (width, copy) = cfg.staging(client, products, &[&x.q, &x.k, &x.v, &x.d_o]);
    let one_pass = cfg.one_pass();
    super::scratch::row_dots(
        client,
        cfg,
        clone_arg(&x.o),
        clone_arg(&x.d_o),
        clone_arg(&out.d_rows),
    );
    if cfg.register_backward_runs() {
        let frags = super::fragments::Fragments::Registers;
        let staging = cfg.register_staging(client, &[&x.q, &x.k, &x.v, &x.d_o]);
        super::backward_registers::launch(client, cfg, frags, staging, one_pass, x, out);
        return;
    }
    // The second pass reads the same inputs and D.
    let (second, d_rows) = (x.clone(), clone_arg(&out.d_rows));
    let (acc, d_q) = (clone_arg(&out.d_q_acc), clone_arg(&out.d_q));
    let key_blocks = || {
        launch_blocks!(
            client,
            cfg,
            flash_backward_kv_blocks,
            products,
            d.kv_len,
            d.batch * d.kv_heads,
            width,
            [x.q, x.k, x.v, x.d_o, x.lse, out.d_rows, x.key_bias, x.dropout_seed, x.spans, out.d_k, out.d_v, out.d_q_acc],
            flags: [one_pass, copy.is_some(), copy.unwrap_or(1)]
        )
    };
    if one_pass {
        super::scratch::accumulate_dq(client, cfg, acc, d_q, key_blocks);
        return;
    }
    key_blocks();
    let x = second;
    launch_blocks!(
        client,
        cfg,
        flash_backward_q_blocks,
        products,
        d.q_len,
        d.batch * d.heads,
        width,
        [
            x.q,
            x.k,
            x.v,
            x.d_o,
            x.lse,
            d_rows,
            x.key_bias,
            x.dropout_seed,
            x.spans,
            d_q
        ]
    );
}

/// Another argument for the same tensor (`TensorArg` is not `Clone`; its
/// binding is a handle, not the data).
pub(super) fn clone_arg<R: Runtime>(a: &TensorArg<R>) -> TensorArg<R> {
    match a {
        TensorArg::Handle { handle } => TensorArg::Handle {
            handle: handle.clone(),
        },
        TensorArg::Alias {
            input_pos,
            strides,
            shape,
        } => TensorArg::Alias {
            input_pos: *input_pos,
            strides: strides.clone(),
            shape: shape.clone(),
        },
    }
}

impl<R: Runtime> Clone for BackwardInputs<R> {
    fn clone(&self) -> Self {
        BackwardInputs {
            q: clone_arg(&self.q),
            k: clone_arg(&self.k),
            v: clone_arg(&self.v),
            o: clone_arg(&self.o),
            d_o: clone_arg(&self.d_o),
            lse: clone_arg(&self.lse),
            key_bias: clone_arg(&self.key_bias),
            dropout_seed: clone_arg(&self.dropout_seed),
            spans: clone_arg(&self.spans),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launch(head_dim: usize, kind: FloatKind) -> FlashLaunch {
        FlashLaunch {
            window: 0,
            documents: false,
            dims: FlashDims {
                batch: 1,
                heads: 4,
                kv_heads: 2,
                q_len: 100,
                kv_len: 100,
                head_dim,
            },
            causal: true,
            padding: false,
            scale: 0.125,
            dtype: StorageType::Scalar(ElemType::Float(kind)),
            kernels: FlashKernels::Blocks {
                products: Products::TensorCores,
            },
            unroll: true,
            dropout: None,
            atomic_dq: true,
            units_per_row: UNITS_PER_ROW,
            tile_pairs: false,
            async_copy: false,
            register_forward: false,
            register_backward: false,
            max_shared: H100_SHARED,
        }
    }

    /// CUDA's opt-in shared memory per block on an H100 and on an L40S (Ada), bytes.
    const H100_SHARED: usize = 227 * 1024;
    const ADA_SHARED: usize = 99 * 1024;

    /// The register kernels run where asked, on the tensor-core path, without dropout;
    /// otherwise the block kernels do. The register backward runs in one pass, with the dQ
    /// accumulator, as the block kernels' does: where atomics are asked for.
    #[test]
    fn the_register_kernels_run_only_where_their_products_do() {
        let asked = |d, kind| FlashLaunch {
            register_forward: true,
            register_backward: true,
            ..launch(d, kind)
        };
        let runs = |cfg: FlashLaunch| {
            assert_eq!(
                cfg.register_forward_runs(),
                cfg.register_backward_runs(),
                "{cfg:?}"
            );
            cfg.register_forward_runs()
        };
        for d in [16, 64, 128] {
            assert!(runs(asked(d, FloatKind::BF16)), "bf16 d{d}");
            assert!(runs(asked(d, FloatKind::F16)), "f16 d{d}");
            assert!(!runs(launch(d, FloatKind::BF16)), "not asked d{d}");
            assert!(launch(d, FloatKind::BF16).one_pass(), "d{d}");
            assert!(asked(d, FloatKind::BF16).one_pass(), "registers d{d}");
            assert!(asked(d, FloatKind::BF16).dq_accumulator().is_some());
            let two_pass = FlashLaunch {
                atomic_dq: false,
                ..asked(d, FloatKind::BF16)
            };
            assert!(runs(two_pass) && !two_pass.one_pass(), "d{d}");
            assert_eq!(two_pass.dq_accumulator(), None);
        }
        assert!(!runs(asked(64, FloatKind::F32)), "no f32 mma");
        assert!(!runs(asked(24, FloatKind::BF16)), "d24");
        assert!(!runs(asked(256, FloatKind::BF16)), "d256");
        let dropped = FlashLaunch {
            dropout: Some(0.1),
            ..asked(64, FloatKind::BF16)
        };
        assert!(!runs(dropped), "dropout");
        assert!(dropped.one_pass(), "dropout keeps the one pass");
        let forward_only = FlashLaunch {
            register_backward: false,
            ..asked(64, FloatKind::BF16)
        };
        assert!(forward_only.register_forward_runs() && forward_only.one_pass());
    }

    /// On a device whose shared memory a block is below what a block kernel's cube takes,
    /// the `Rows` kernels run instead of failing at launch: the tensor-core backward at head
    /// dim 128 takes 121 KiB, which an H100 (227 KiB) gives and an L40S or RTX 4090 (99 KiB)
    /// does not; at head dim 64 the largest, 89 KiB, fits both, not a T4's 64 KiB.
    #[test]
    fn block_kernels_run_only_where_their_cubes_fit_the_shared_memory() {
        let on = |d, max_shared| FlashLaunch {
            max_shared,
            ..launch(d, FloatKind::BF16)
        };
        let tc = FlashKernels::Blocks {
            products: Products::TensorCores,
        };
        let kib = |d| {
            on(d, H100_SHARED)
                .blocks_shared_bytes(Products::TensorCores)
                .map(|b| b.div_ceil(1024))
        };
        assert_eq!(kib(128), [94, 121, 111]);
        assert_eq!(kib(64), [54, 89, 79]);
        assert_eq!(on(128, H100_SHARED).kernels(), tc);
        assert_eq!(on(64, ADA_SHARED).kernels(), tc);
        let ada = on(128, ADA_SHARED);
        assert!(ada.shape_takes() && !ada.shared_fits());
        assert_eq!(ada.kernels(), FlashKernels::Rows);
        assert!(!ada.one_pass(), "the Rows kernels run in two passes");
        assert_eq!(on(64, 64 * 1024).kernels(), FlashKernels::Rows);
        // The limit is the largest of the three cubes, to the byte.
        let need = on(128, 0).shared_need();
        assert_eq!(
            need.div_ceil(1024),
            121,
            "the key-block backward's, the largest"
        );
        assert_eq!(on(128, need).kernels(), tc);
        assert_eq!(on(128, need - 1).kernels(), FlashKernels::Rows);
        // The register kernels (trials) run where the block kernels would and their own
        // cubes fit: at head dim 128 theirs are the smaller, so the block kernels' limit
        // is theirs.
        let registers = |max_shared| FlashLaunch {
            register_forward: true,
            register_backward: true,
            ..on(128, max_shared)
        };
        let [forward, backward] =
            registers(need).register_shared_bytes(super::super::stream::Staging::Single);
        assert!(
            forward < backward && backward <= need,
            "{forward} {backward} {need}"
        );
        let fits = registers(need);
        assert!(fits.register_forward_runs() && fits.register_backward_runs());
        let short = registers(need - 1);
        assert!(!short.register_forward_runs() && !short.register_backward_runs());
    }

    /// The memory model tabulates the shared memory a block of the tensor-core kernels
    /// takes at each head dim, and charges the one-pass backward's fp32 dQ accumulator
    /// where they run: by type and head dim on a GPU whose shared memory it does not know
    /// (a custom one), where it assumes they fit.
    #[test]
    fn the_memory_model_knows_where_the_backward_runs_in_one_pass() {
        use rcoa_compiler::memory::build::{
            burn_flash_one_pass, BURN_FLASH_TENSOR_CORE_HEAD_DIM,
            BURN_FLASH_TENSOR_CORE_SHARED_BYTES,
        };
        use rcoa_compiler::spec::GpuSpec;
        assert_eq!(
            MAX_TENSOR_CORE_HEAD_DIM as u64,
            BURN_FLASH_TENSOR_CORE_HEAD_DIM
        );
        for kind in [FloatKind::BF16, FloatKind::F16] {
            let need: Vec<u64> = (16..=MAX_TENSOR_CORE_HEAD_DIM)
                .step_by(16)
                .map(|d| launch(d, kind).shared_need() as u64)
                .collect();
            assert_eq!(need, BURN_FLASH_TENSOR_CORE_SHARED_BYTES, "{kind:?}");
        }
        let custom = GpuSpec::custom("custom", 1 << 30, 1.0, 1e10);
        for (kind, dtype) in KINDS {
            for d in HEAD_DIMS {
                let cfg = FlashLaunch {
                    max_shared: usize::MAX,
                    ..launch(d, kind)
                };
                assert_eq!(
                    cfg.one_pass(),
                    burn_flash_one_pass(dtype, d as u64, &custom),
                    "{kind:?} d{d}"
                );
            }
        }
        let mut rows = launch(64, FloatKind::BF16);
        rows.kernels = FlashKernels::Rows;
        assert!(!rows.one_pass(), "the Rows kernels have two passes only");
    }

    const KINDS: [(FloatKind, rcoa_compiler::spec::Dtype); 3] = [
        (FloatKind::BF16, rcoa_compiler::spec::Dtype::Bf16),
        (FloatKind::F16, rcoa_compiler::spec::Dtype::Fp16),
        (FloatKind::F32, rcoa_compiler::spec::Dtype::Fp32),
    ];
    const HEAD_DIMS: [usize; 9] = [16, 24, 64, 80, 96, 100, 128, 144, 256];

    /// On every catalog GPU the executor and the memory model pick the same flash kernels.
    /// The executor's choice is made as on the device: tensor cores where CUDA's runtime
    /// registers the type's `cmma` tile for the GPU's compute capability, within the
    /// shared memory it reports (`fused::launch_config`, `FlashLaunch::kernels`). The
    /// catalog's shared memory and bf16 tensor cores are checked against the same tables.
    #[cfg(feature = "cuda")]
    #[test]
    fn the_memory_model_knows_which_flash_kernels_run_on_each_catalog_gpu() {
        use cubecl::cuda::prebuild::{max_shared_memory, wmma_combinations};
        use rcoa_compiler::memory::build::burn_flash_one_pass;
        for g in &rcoa_compiler::catalog::catalog().gpus {
            let shared = max_shared_memory(g.sm);
            assert_eq!(shared as u64, g.shared_memory_per_block_bytes, "{}", g.name);
            let wmma = wmma_combinations(g.sm);
            let cmma = |kind| {
                wmma.contains(&tensor_core_tile(StorageType::Scalar(ElemType::Float(
                    kind,
                ))))
            };
            assert_eq!(cmma(FloatKind::BF16), g.bf16_tensor_cores, "{}", g.name);
            assert!(cmma(FloatKind::F16), "{}", g.name);
            let spec = g.spec();
            for (kind, dtype) in KINDS {
                for d in HEAD_DIMS {
                    let mut cfg = FlashLaunch {
                        max_shared: shared,
                        ..launch(d, kind)
                    };
                    if !cmma(kind) {
                        cfg.kernels = FlashKernels::Rows;
                    }
                    assert_eq!(
                        cfg.one_pass(),
                        burn_flash_one_pass(dtype, d as u64, &spec),
                        "{} {kind:?} d{d}",
                        g.name
                    );
                }
            }
        }
    }

    #[test]
    fn rows_split_as_asked_where_that_divides_them() {
        let two = UNITS_PER_ROW;
        assert_eq!(FlashLaunch::units_per_row(two, 64, 64), 2);
        assert_eq!(FlashLaunch::units_per_row(two, 64, 128), 2);
        assert_eq!(FlashLaunch::units_per_row(two, 16, 24), 2);
        assert_eq!(FlashLaunch::units_per_row(4, 64, 64), 4);
        assert_eq!(FlashLaunch::units_per_row(8, 64, 64), 8);
        // Four do not divide 24 columns of 6: two do.
        assert_eq!(FlashLaunch::units_per_row(4, 16, 24), 4);
        assert_eq!(FlashLaunch::units_per_row(4, 16, 18), 2);
        assert_eq!(FlashLaunch::units_per_row(1, 64, 64), 1);
        // The scalar products' blocks of 1024 / head_dim rows may be odd.
        let block = FlashLaunch::blocks_block(Products::Scalar, 200);
        assert_eq!(block, 5);
        assert_eq!(FlashLaunch::units_per_row(two, block, 200), 1);
        assert_eq!(FlashLaunch::units_per_row(4, block, 200), 1);
        assert_eq!(FlashLaunch::units_per_row(two, 16, 25), 1);
        // Tensor cores always split in two by default.
        for d in (16..=MAX_TENSOR_CORE_HEAD_DIM).step_by(16) {
            let block = FlashLaunch::blocks_block(Products::TensorCores, d);
            assert_eq!(FlashLaunch::units_per_row(two, block, d), 2, "d{d}");
        }
    }

    #[test]
    fn tensor_cores_take_16_bit_types_and_head_dims_in_16s_up_to_128() {
        let tc = FlashKernels::Blocks {
            products: Products::TensorCores,
        };
        for kind in [FloatKind::BF16, FloatKind::F16] {
            for d in [16, 64, 80, 128] {
                assert_eq!(launch(d, kind).kernels(), tc, "{kind:?} d{d}");
            }
            for d in [24, 100, 144, 256] {
                assert_eq!(
                    launch(d, kind).kernels(),
                    FlashKernels::Rows,
                    "{kind:?} d{d}"
                );
            }
        }
        assert_eq!(launch(64, FloatKind::F32).kernels(), FlashKernels::Rows);
        // The scalar block products take any shape; their tiled form, the
        // tensor cores' tiles.
        let mut scalar = launch(24, FloatKind::F32);
        scalar.kernels = FlashKernels::Blocks {
            products: Products::Scalar,
        };
        assert_eq!(scalar.kernels(), scalar.kernels);
        scalar.kernels = FlashKernels::Blocks {
            products: Products::TiledScalar,
        };
        assert_eq!(scalar.kernels(), FlashKernels::Rows);
        scalar.dims.head_dim = 64;
        assert_eq!(scalar.kernels(), scalar.kernels);
    }
}
