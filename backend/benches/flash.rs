//! The fused-attention kernels timed alone, in one run: the `Rows` kernels
//! (scalar FMAs, what `attention = flash` runs by default) against the
//! block-product kernels on tensor cores (`RCOA_FLASH_TENSOR_CORES=1`), on
//! one attention shape, forward and backward (dK/dV and dQ; on tensor cores
//! in two passes and in one, dQ added atomically, with four units a row
//! instead of two (eight warps a cube), with each warp taking 2 × 2
//! tiles of a product at a time, and with the forward's tiles staged by
//! asynchronous copies under the products; then both directions in
//! FlashAttention-2's register structure, streaming the other side's blocks one
//! at a time and copied a block ahead, the backward in two passes and in one). Prints each
//! one's milliseconds and TFLOP/s and the ratio to the first (`Rows`; above 1:
//! faster) as it is timed, then the largest difference between the two
//! outputs and gradients, so a fast wrong kernel does not pass unseen. Each kind runs again with
//! attention dropout (p 0.1: the kernels hash every score's place twice in
//! the backward), whose outputs differ by design and are not compared.
//!
//!     cargo bench -p rcoa-backend --features cuda --bench flash -- [batch heads kv_heads seq head_dim]
//!
//! The default shape is the 350M decoder's at seq 2048 (4 × 16 heads × 2048
//! × 64, causal, bf16). Without a CUDA build it runs on wgpu (`--features
//! wgpu-kernels`; lavapipe without a GPU) in f32 with the tensor cores' tiling
//! on scalar FMAs: a check of the benchmark, not a timing.
//!
//! FLOPs count what FlashAttention counts: forward `4 · b · h · s² · d`,
//! backward 2.5 × that, halved for causal.

mod common;

#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
mod bench {
    use cubecl::prelude::*;
    use rcoa_backend::kernels::flash::device_tensor::{AttentionTensors, Elem, HostInputs};
    use rcoa_backend::kernels::flash::launch::{
        has_atomic_add, unrolls, FlashDims, FlashKernels, FlashLaunch, UNITS_PER_ROW,
    };
    use std::time::Instant;

    /// A row of the table: the kernels and the settings they run with
    /// (`FlashLaunch`'s fields of the same names).
    #[derive(Clone, Copy)]
    pub struct Variant {
        name: &'static str,
        kernels: FlashKernels,
        /// The backward in one pass, dQ added atomically.
        one_pass: bool,
        units_per_row: usize,
        /// Each plane takes 2 × 2 tiles of a product at a time.
        tile_pairs: bool,
        /// The forward stages its tiles with asynchronous copies.
        async_copy: bool,
        /// The forward keeps each warp's scores and output in registers.
        register_forward: bool,
        /// The backward keeps each warp's gradient rows in registers.
        register_backward: bool,
    }

    impl Variant {
        /// Two-pass backward, the default units per row, one tile at a time,
        /// synchronous staging.
        pub const fn new(name: &'static str, kernels: FlashKernels) -> Self {
            Variant {
                name,
                kernels,
                one_pass: false,
                units_per_row: UNITS_PER_ROW,
                tile_pairs: false,
                async_copy: false,
                register_forward: false,
                register_backward: false,
            }
        }
        pub const fn one_pass(self) -> Self {
            Variant {
                one_pass: true,
                ..self
            }
        }
        pub const fn units_per_row(self, units_per_row: usize) -> Self {
            Variant {
                units_per_row,
                ..self
            }
        }
        // Rows of the CUDA table only.
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        pub const fn tile_pairs(self) -> Self {
            Variant {
                tile_pairs: true,
                ..self
            }
        }
        // Rows of the CUDA table only.
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        pub const fn async_copy(self) -> Self {
            Variant {
                async_copy: true,
                ..self
            }
        }
        // Rows of the CUDA table only.
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        pub const fn register_forward(self) -> Self {
            Variant {
                register_forward: true,
                ..self
            }
        }
        // Rows of the CUDA table only.
        #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
        pub const fn register_backward(self) -> Self {
            Variant {
                register_backward: true,
                ..self
            }
        }
    }

    const WARMUP: usize = 2;
    const REPEATS: usize = 10;

    /// `n` values in [-1, 1) from a seeded generator (no `rand` needed).
    fn random(n: usize, seed: u64) -> Vec<f32> {
        let mut x = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
            })
            .collect()
    }

    /// Median seconds of `f` then a device sync, after warming up.
    fn time<R: Runtime>(client: &ComputeClient<R>, mut f: impl FnMut()) -> f64 {
        let sync = || cubecl::future::block_on(client.sync()).expect("device sync");
        for _ in 0..WARMUP {
            f();
        }
        sync();
        let mut t: Vec<f64> = (0..REPEATS)
            .map(|_| {
                let start = Instant::now();
                f();
                sync();
                start.elapsed().as_secs_f64()
            })
            .collect();
        t.sort_by(|a, b| a.partial_cmp(b).unwrap());
        t[REPEATS / 2]
    }

    struct Result {
        name: String,
        dropout: bool,
        forward: f64,
        backward: f64,
        outputs: Vec<Vec<f32>>,
    }

    pub fn run<R: Runtime, E: Elem>(
        client: ComputeClient<R>,
        dims: FlashDims,
        variants: &[Variant],
    ) {
        // Each kind without dropout, then with it (its cost, not its outputs).
        let variants: Vec<(String, Variant, Option<f64>)> = variants
            .iter()
            .map(|v| (v.name.to_string(), *v, None))
            .chain(
                variants
                    .iter()
                    .map(|v| (format!("{} + dropout 0.1", v.name), *v, Some(0.1))),
            )
            .collect();
        let causal = true;
        let q_len = dims.batch * dims.heads * dims.q_len * dims.head_dim;
        let kv_len = dims.batch * dims.kv_heads * dims.kv_len * dims.head_dim;
        let t = AttentionTensors::<R>::new::<E>(
            &client,
            &dims,
            HostInputs {
                q: &random(q_len, 1),
                k: &random(kv_len, 2),
                v: &random(kv_len, 3),
                d_o: &random(q_len, 4),
                key_bias: None,
                dropout_seed: None,
                spans: None,
            },
        );
        let dtype = E::as_type_native_unchecked().storage_type();
        let flops_fwd = 4.0
            * (dims.batch * dims.heads) as f64
            * dims.q_len as f64
            * dims.kv_len as f64
            * dims.head_dim as f64
            / if causal { 2.0 } else { 1.0 };
        println!(
            "flash attention, batch {} × {} heads ({} kv) × seq {} × head dim {}, causal, {dtype:?}",
            dims.batch, dims.heads, dims.kv_heads, dims.q_len, dims.head_dim
        );
        // Each row as it is measured: a run cut short by a time limit keeps what it timed.
        println!(
            "  {:<44} {:>10} {:>9} {:>10} {:>9} {:>8}",
            "kernels", "fwd ms", "TFLOP/s", "bwd ms", "TFLOP/s", "× first"
        );
        let mut results: Vec<Result> = Vec::new();
        for (name, v, dropout) in variants {
            let (kernels, one_pass) = (v.kernels, v.one_pass);
            let cfg = FlashLaunch {
                dims,
                causal,
                window: 0,
                padding: false,
                documents: false,
                scale: 1.0 / (dims.head_dim as f32).sqrt(),
                dtype,
                kernels,
                unroll: unrolls(&client),
                dropout,
                atomic_dq: one_pass && has_atomic_add(&client),
                units_per_row: v.units_per_row,
                tile_pairs: v.tile_pairs,
                async_copy: v.async_copy,
                register_forward: v.register_forward,
                register_backward: v.register_backward,
                max_shared: client.properties().hardware.max_shared_memory_size,
            };
            if cfg.kernels() != kernels
                || cfg.one_pass() != one_pass
                || cfg.register_forward_runs() != v.register_forward
                || cfg.register_backward_runs() != v.register_backward
            {
                println!("  {name:<44} skipped: these kernels do not take this shape or type");
                continue;
            }
            let forward = time(&client, || t.forward(&client, &cfg));
            let backward = time(&client, || t.backward(&client, &cfg));
            let outputs = [&t.o, &t.d_q, &t.d_k, &t.d_v]
                .iter()
                .map(|b| b.read_as::<E>(&client))
                .collect();
            results.push(Result {
                dropout: dropout.is_some(),
                name,
                forward,
                backward,
                outputs,
            });
            let (base, r) = (&results[0], &results[results.len() - 1]);
            let total = |x: &Result| x.forward + x.backward;
            println!(
                "  {:<44} {:>10.3} {:>9.1} {:>10.3} {:>9.1} {:>8.2}",
                r.name,
                r.forward * 1e3,
                flops_fwd / r.forward / 1e12,
                r.backward * 1e3,
                2.5 * flops_fwd / r.backward / 1e12,
                total(base) / total(r),
            );
        }
        let Some(base) = results.first() else { return };
        for r in results[1..].iter().filter(|r| !r.dropout) {
            let worst = ["O", "dQ", "dK", "dV"]
                .iter()
                .zip(r.outputs.iter().zip(&base.outputs))
                .map(|(name, (a, b))| {
                    let d = a
                        .iter()
                        .zip(b)
                        .map(|(x, y)| (x - y).abs() / (1.0 + y.abs()))
                        .fold(0.0f32, f32::max);
                    format!("{name} {d:.1e}")
                })
                .collect::<Vec<_>>()
                .join(", ");
            println!(
                "  {} against {}: largest relative difference {worst}",
                r.name, base.name
            );
        }
    }

    pub fn dims_from_args(default: FlashDims) -> FlashDims {
        let n: Vec<usize> = std::env::args()
            .skip(1)
            .filter_map(|a| a.parse().ok())
            .collect();
        match n[..] {
            [batch, heads, kv_heads, seq, head_dim] => FlashDims {
                batch,
                heads,
                kv_heads,
                q_len: seq,
                kv_len: seq,
                head_dim,
            },
            _ => default,
        }
    }
}

#[cfg(feature = "cuda")]
fn main() {
    use burn::tensor::bf16;
    use cubecl::cuda::{CudaDevice, CudaRuntime};
    use cubecl::prelude::Runtime;
    use rcoa_backend::kernels::flash::launch::{FlashDims, FlashKernels};
    use rcoa_backend::kernels::flash::mma::Products;
    const TENSOR_CORES: FlashKernels = FlashKernels::Blocks {
        products: Products::TensorCores,
    };
    let dims = bench::dims_from_args(FlashDims {
        batch: 4,
        heads: 16,
        kv_heads: 16,
        q_len: 2048,
        kv_len: 2048,
        head_dim: 64,
    });
    let Some(client) = common::quietly(|| CudaRuntime::client(&CudaDevice::new(0))) else {
        println!("no CUDA device: nothing timed");
        return;
    };
    bench::run::<CudaRuntime, bf16>(
        client,
        dims,
        &[
            bench::Variant::new("rows (scalar FMAs)", FlashKernels::Rows).units_per_row(1),
            bench::Variant::new("blocks on tensor cores", TENSOR_CORES),
            bench::Variant::new("tensor cores, one-pass backward", TENSOR_CORES).one_pass(),
            bench::Variant::new("tensor cores, one pass, 4 units a row", TENSOR_CORES)
                .one_pass()
                .units_per_row(4),
            bench::Variant::new("tensor cores, one pass, 2 x 2 tiles", TENSOR_CORES)
                .one_pass()
                .tile_pairs(),
            bench::Variant::new("tensor cores, one pass, async copies", TENSOR_CORES)
                .one_pass()
                .async_copy(),
            bench::Variant::new("register forward (FA2), one pass", TENSOR_CORES)
                .one_pass()
                .register_forward(),
            bench::Variant::new("register forward and backward (FA2)", TENSOR_CORES)
                .register_forward()
                .register_backward(),
            bench::Variant::new("registers, blocks copied ahead", TENSOR_CORES)
                .register_forward()
                .register_backward()
                .async_copy(),
            bench::Variant::new("registers, one-pass backward", TENSOR_CORES)
                .one_pass()
                .register_forward()
                .register_backward(),
            bench::Variant::new("registers, one pass, copied ahead", TENSOR_CORES)
                .one_pass()
                .register_forward()
                .register_backward()
                .async_copy(),
        ],
    );
}

#[cfg(all(feature = "wgpu-kernels", not(feature = "cuda")))]
fn main() {
    use cubecl::prelude::Runtime;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};
    use rcoa_backend::kernels::flash::launch::{FlashDims, FlashKernels};
    use rcoa_backend::kernels::flash::mma::Products;
    const TILED: FlashKernels = FlashKernels::Blocks {
        products: Products::TiledScalar,
    };
    let dims = bench::dims_from_args(FlashDims {
        batch: 1,
        heads: 2,
        kv_heads: 2,
        q_len: 64,
        kv_len: 64,
        head_dim: 32,
    });
    let Some(client) = common::quietly(|| WgpuRuntime::client(&WgpuDevice::DefaultDevice)) else {
        println!("no Vulkan device: nothing timed");
        return;
    };
    bench::run::<WgpuRuntime, f32>(
        client,
        dims,
        &[
            bench::Variant::new("rows (scalar FMAs)", FlashKernels::Rows).units_per_row(1),
            bench::Variant::new("blocks, tiles on scalar FMAs", TILED),
            bench::Variant::new("tiles on scalar FMAs, one pass", TILED).one_pass(),
            bench::Variant::new("tiles on scalar FMAs, one pass, 4 a row", TILED)
                .one_pass()
                .units_per_row(4),
        ],
    );
}

#[cfg(not(any(feature = "cuda", feature = "wgpu-kernels")))]
fn main() {
    println!("the flash kernels need --features cuda (or wgpu-kernels): nothing timed");
}
