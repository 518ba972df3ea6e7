//! The kernels against the f64 reference, on any CubeCL runtime: wgpu
//! (`wgpu-kernels`; on this project's CPU-only machines that is lavapipe,
//! Vulkan on the CPU) and CUDA (`cuda`, for the GPU session). With no
//! device the tests print why and pass without checking anything.

use cubecl::prelude::*;

use super::device_tensor::{AttentionTensors, Elem, HostInputs};
use super::launch::{has_atomic_add, unrolls, FlashDims, FlashKernels, FlashLaunch, UNITS_PER_ROW};
use super::mma::Products;
use super::reference::{worst, Problem};
use crate::testing::client_or_skip;

/// The kernels under test: which compute, whether the backward runs in one
/// pass (`FlashLaunch::atomic_dq`), and with how many units per row (both
/// for the block-product kernels only).
#[derive(Clone, Copy, Debug)]
struct Under {
    kernels: FlashKernels,
    one_pass: bool,
    units_per_row: usize,
    tile_pairs: bool,
    async_copy: bool,
}

impl Under {
    const fn two_pass(kernels: FlashKernels) -> Self {
        Under {
            kernels,
            one_pass: false,
            units_per_row: UNITS_PER_ROW,
            tile_pairs: false,
            async_copy: false,
        }
    }

    const fn one_pass(kernels: FlashKernels) -> Self {
        Under {
            kernels,
            one_pass: true,
            units_per_row: UNITS_PER_ROW,
            tile_pairs: false,
            async_copy: false,
        }
    }

    const fn with_units_per_row(self, units_per_row: usize) -> Self {
        Under {
            units_per_row,
            ..self
        }
    }

    /// The tiled kernels' blocks of 16 rows never fit pairs: only the
    /// tensor-core trials on CUDA take them.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    const fn with_tile_pairs(self) -> Self {
        Under {
            tile_pairs: true,
            ..self
        }
    }

    /// The asynchronous copies: CUDA only (wgpu has no barrier objects).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    const fn with_async_copy(self) -> Self {
        Under {
            async_copy: true,
            ..self
        }
    }
}

/// `x` rounded to `E` and back.
pub(super) fn round<E: Elem>(x: &[f32]) -> Vec<f32> {
    x.iter().map(|&v| E::from_f32(v).to_f32()).collect()
}

/// The kernels' dimensions of problem `p`.
pub(super) fn dims(p: &Problem) -> FlashDims {
    FlashDims {
        batch: p.b,
        heads: p.h,
        kv_heads: p.kvh,
        q_len: p.s,
        kv_len: p.t,
        head_dim: p.d,
    }
}

/// `p`'s inputs (its key padding and dropout seed too) on `client`, in `E`, with room
/// for every output.
fn tensors<R: Runtime, E: Elem>(client: &ComputeClient<R>, p: &Problem) -> AttentionTensors<R> {
    let bias = p.key_bias();
    AttentionTensors::<R>::new::<E>(
        client,
        &dims(p),
        HostInputs {
            q: &p.q,
            k: &p.k,
            v: &p.v,
            d_o: &p.d_o,
            key_bias: bias.as_deref(),
            dropout_seed: p.dropout.map(|(_, seed)| seed),
            spans: p.spans.as_deref(),
        },
    )
}

/// `p` on `client` for the register kernels: its inputs rounded to `E` (in `p` too, so
/// that the reference takes the same), a launch for its shape, its tensors, and O and LSE
/// written by the register forward with `frags` and `staging`. Also a name for `p` in
/// messages. `None`, with a note, where the device has no `E`.
pub(super) fn register_forward_on<R: Runtime, E: Elem>(
    client: &ComputeClient<R>,
    frags: super::fragments::Fragments,
    staging: super::stream::Staging,
    p: &mut Problem,
) -> Option<(String, FlashLaunch, AttentionTensors<R>)> {
    let what = format!(
        "{} {staging:?} b{} h{}/{} s{} t{} d{} causal {} padding {}",
        std::any::type_name::<E>(),
        p.b,
        p.h,
        p.kvh,
        p.s,
        p.t,
        p.d,
        p.causal,
        p.keep.is_some()
    );
    let ty = E::as_type_native_unchecked();
    if !client.properties().supports_type(ty) {
        eprintln!("SKIPPED: no {ty:?} on this device; {what} did not run");
        return None;
    }
    for x in [&mut p.q, &mut p.k, &mut p.v, &mut p.d_o] {
        *x = round::<E>(x);
    }
    let dims = dims(p);
    let cfg = FlashLaunch {
        dims,
        causal: p.causal,
        window: p.window,
        padding: p.keep.is_some(),
        documents: p.spans.is_some(),
        scale: p.scale as f32,
        dtype: ty.storage_type(),
        kernels: FlashKernels::Blocks {
            products: Products::TiledScalar,
        },
        unroll: false,
        dropout: None,
        atomic_dq: false,
        units_per_row: UNITS_PER_ROW,
        tile_pairs: false,
        async_copy: false,
        register_forward: false,
        register_backward: false,
        max_shared: client.properties().hardware.max_shared_memory_size,
    };
    let t = tensors::<R, E>(client, p);
    super::forward_registers::launch(
        client,
        &cfg,
        frags,
        staging,
        t.q.arg(),
        t.k.arg(),
        t.v.arg(),
        t.key_bias.arg(),
        t.spans.arg(),
        t.o.arg(),
        t.lse.arg(),
    );
    Some((what, cfg, t))
}

/// The problems the register kernels' CUDA tests run: the executor's head dims (64, 128),
/// causal with padded keys and bidirectional without, grouped queries, three blocks a side;
/// causal under a sliding window of 50 keys (shorter than a block); and causal over packed
/// documents.
#[cfg(feature = "cuda")]
pub(super) fn register_cuda_problems(seed: u64) -> impl Iterator<Item = Problem> {
    [64, 128].into_iter().flat_map(move |d| {
        [
            (true, &[0usize, 5][..], 0),
            (false, &[][..], 0),
            (true, &[][..], 50),
        ]
        .into_iter()
        .map(move |(causal, pads, window)| {
            Problem::new(2, 8, 2, 150, 150, d, causal, pads, seed + d as u64).with_window(window)
        })
        .chain(std::iter::once(
            Problem::new(2, 8, 2, 150, 150, d, true, &[], seed + 3 + d as u64)
                .with_documents(&[&[20, 70, 1, 30], &[64, 64]]),
        ))
    })
}

/// Everything one problem's kernels return.
struct Got {
    o: Vec<f32>,
    lse: Vec<f32>,
    d_q: Vec<f32>,
    d_k: Vec<f32>,
    d_v: Vec<f32>,
}

/// The kernels on `p`, with q, k, v, O, dO and the gradients in `E`
/// (`under` computing them, their loops unrolled as the runtime has them
/// or as `unroll` says); `None`, with a note, where the runtime cannot
/// add fp32 atomically and `under` is a one-pass backward.
fn run<R: Runtime, E: Elem>(
    client: &ComputeClient<R>,
    p: &Problem,
    under: Under,
    unroll: Option<bool>,
) -> Option<Got> {
    if under.one_pass && !has_atomic_add(client) {
        eprintln!(
            "SKIPPED: {} adds no fp32 atomically; the one-pass backward did not run",
            std::any::type_name::<R>()
        );
        return None;
    }
    let dims = dims(p);
    dims.check(p.causal, p.window, p.spans.is_some())
        .expect("a shape the kernels take");
    let cfg = FlashLaunch {
        dims,
        causal: p.causal,
        window: p.window,
        padding: p.keep.is_some(),
        documents: p.spans.is_some(),
        scale: p.scale as f32,
        dtype: E::as_type_native_unchecked().storage_type(),
        kernels: under.kernels,
        unroll: unroll.unwrap_or_else(|| unrolls(client)),
        dropout: p.dropout.map(|(prob, _)| prob),
        atomic_dq: under.one_pass,
        units_per_row: under.units_per_row,
        tile_pairs: under.tile_pairs,
        async_copy: under.async_copy,
        register_forward: false,
        register_backward: false,
        max_shared: client.properties().hardware.max_shared_memory_size,
    };
    assert_eq!(cfg.kernels(), under.kernels, "the kernels under test run");
    assert_eq!(
        cfg.one_pass(),
        under.one_pass,
        "the backward under test runs"
    );
    let t = tensors::<R, E>(client, p);
    if under.async_copy {
        let FlashKernels::Blocks { products } = under.kernels else {
            panic!("asynchronous copies are the block-product kernels'")
        };
        let (q, k, v) = (t.q.arg(), t.k.arg(), t.v.arg());
        assert!(
            cfg.staging(client, products, &[&q, &k, &v]).1.is_some(),
            "the asynchronous copies under test run"
        );
    }
    t.forward(client, &cfg);
    t.backward(client, &cfg);
    Some(Got {
        o: t.o.read_as::<E>(client),
        lse: t.lse.read(client),
        d_q: t.d_q.read_as::<E>(client),
        d_k: t.d_k.read_as::<E>(client),
        d_v: t.d_v.read_as::<E>(client),
    })
}

/// Output within 1e-4, LSE within 1e-4, gradients within 1e-3 (relative to
/// `1 + |x|`), for one problem.
fn check<R: Runtime>(client: Option<ComputeClient<R>>, p: Problem, what: &str, under: Under) {
    check_unrolled(client, p, what, under, None);
}

/// [`check`], with the kernels' loops unrolled or not as `unroll` says
/// (`None`: as the runtime has them).
fn check_unrolled<R: Runtime>(
    client: Option<ComputeClient<R>>,
    p: Problem,
    what: &str,
    under: Under,
    unroll: Option<bool>,
) {
    let Some(client) = client else { return };
    let want = p.expected();
    let Some(got) = run::<R, f32>(&client, &p, under, unroll) else {
        return;
    };
    let errs = [
        ("O", worst(&got.o, &want.o), 1e-4),
        ("LSE", worst(&got.lse, &want.lse), 1e-4),
        ("dQ", worst(&got.d_q, &want.d_q), 1e-3),
        ("dK", worst(&got.d_k, &want.d_k), 1e-3),
        ("dV", worst(&got.d_v, &want.d_v), 1e-3),
    ];
    for (name, err, tol) in errs {
        assert!(err <= tol, "{what}: {name} differs by {err:e} (> {tol:e})");
    }
}

/// The kernels with 16-bit inputs and outputs (fp32 accumulation) against
/// the reference on the same rounded inputs: the output within `tol`, the
/// gradients within `4 · tol`, LSE (fp32) within 1e-3. Skipped, with a note,
/// where the runtime lacks the type.
fn check_16bit<R: Runtime, E: Elem>(client: Option<ComputeClient<R>>, tol: f64, under: Under) {
    check_16bit_on::<R, E>(
        client,
        Problem::new(2, 4, 2, 37, 37, 64, true, &[0, 5], 9),
        tol,
        under,
    );
}

/// [`check_16bit`] on problem `p`.
fn check_16bit_on<R: Runtime, E: Elem>(
    client: Option<ComputeClient<R>>,
    mut p: Problem,
    tol: f64,
    under: Under,
) {
    let Some(client) = client else { return };
    let ty = E::as_type_native_unchecked();
    if !client.properties().supports_type(ty) {
        eprintln!(
            "SKIPPED: {} has no {ty:?}; the 16-bit kernels were not run",
            std::any::type_name::<R>()
        );
        return;
    }
    p.q = round::<E>(&p.q);
    p.k = round::<E>(&p.k);
    p.v = round::<E>(&p.v);
    p.d_o = round::<E>(&p.d_o);
    let want = p.expected();
    let Some(got) = run::<R, E>(&client, &p, under, None) else {
        return;
    };
    let errs = [
        ("O", worst(&got.o, &want.o), tol),
        ("LSE", worst(&got.lse, &want.lse), 1e-3),
        ("dQ", worst(&got.d_q, &want.d_q), 4.0 * tol),
        ("dK", worst(&got.d_k, &want.d_k), 4.0 * tol),
        ("dV", worst(&got.d_v, &want.d_v), 4.0 * tol),
    ];
    for (name, err, tol) in errs {
        assert!(err <= tol, "{ty:?}: {name} differs by {err:e} (> {tol:e})");
    }
}

/// The same problems on each runtime, with the kernels `$under`.
macro_rules! kernel_tests {
    ($under:expr) => {
        use super::*;
        const KERNELS: Under = $under;

        #[test]
        fn bidirectional() {
            // 37 queries: not a multiple of the 32-row block.
            check(
                client(),
                Problem::new(2, 4, 4, 37, 37, 32, false, &[], 1),
                "bidirectional d32",
                KERNELS,
            );
        }

        #[test]
        fn causal() {
            check(
                client(),
                Problem::new(2, 4, 4, 45, 45, 32, true, &[], 2),
                "causal d32",
                KERNELS,
            );
        }

        #[test]
        fn grouped_query_causal() {
            // Four query heads per kv head; d 64 (the block is 32 rows).
            check(
                client(),
                Problem::new(1, 8, 2, 70, 70, 64, true, &[], 3),
                "gqa causal d64",
                KERNELS,
            );
        }

        #[test]
        fn padding() {
            // Batch rows with 0 and 9 padded keys, bidirectional (an encoder) and
            // causal with grouped query heads.
            check(
                client(),
                Problem::new(2, 2, 2, 33, 33, 32, false, &[0, 9], 4),
                "padding",
                KERNELS,
            );
            check(
                client(),
                Problem::new(2, 4, 2, 33, 33, 32, true, &[3, 9], 5),
                "padding causal gqa",
                KERNELS,
            );
        }

        #[test]
        fn sliding_window() {
            // Windows shorter than a block (whole key blocks skipped at both ends,
            // rows whose first block is all outside their window), longer than one,
            // of one key (each query sees itself only), with grouped queries and
            // padded keys.
            for (b, h, kvh, s, d, pads, window, seed) in [
                (1, 2, 2, 100, 32, &[][..], 20, 20),
                (2, 4, 2, 70, 64, &[0, 7][..], 33, 21),
                (1, 2, 1, 40, 32, &[][..], 1, 22),
                (1, 2, 2, 97, 32, &[][..], 64, 23),
            ] {
                check(
                    client(),
                    Problem::new(b, h, kvh, s, s, d, true, pads, seed).with_window(window),
                    &format!("window {window} s{s} d{d}"),
                    KERNELS,
                );
            }
        }

        /// Packed rows: documents shorter than a block and longer than one, one that
        /// starts inside a block and ends in the next, a one-token document, the row's
        /// rest after them, with grouped queries, padded keys and a sliding window.
        #[test]
        fn documents() {
            let cases: [(Problem, &str); 3] = [
                (
                    Problem::new(2, 4, 2, 70, 70, 32, true, &[], 60)
                        .with_documents(&[&[5, 40, 1, 20], &[33, 2]]),
                    "documents gqa",
                ),
                // (The padded keys end the last document: a row whose visible keys
                // are all padding is averaged differently, `docs/flash-attention.md`.)
                (
                    Problem::new(1, 2, 2, 100, 100, 64, true, &[3], 61)
                        .with_documents(&[&[17, 50]]),
                    "documents padding d64",
                ),
                (
                    Problem::new(1, 2, 1, 90, 90, 32, true, &[], 62)
                        .with_documents(&[&[45, 44]])
                        .with_window(20),
                    "documents window 20",
                ),
            ];
            for (p, what) in cases {
                check(client(), p, what, KERNELS);
            }
        }

        #[test]
        fn head_dim_128_cross_lengths() {
            // d 128 (16-row blocks), more keys than queries (bidirectional only).
            check(
                client(),
                Problem::new(1, 2, 1, 19, 40, 128, false, &[], 6),
                "d128 cross",
                KERNELS,
            );
            check(
                client(),
                Problem::new(1, 2, 2, 50, 50, 128, true, &[], 7),
                "d128 causal",
                KERNELS,
            );
        }

        #[test]
        fn odd_head_dim() {
            check(
                client(),
                Problem::new(1, 3, 1, 17, 17, 24, true, &[2], 8),
                "d24",
                KERNELS,
            );
            // No vector width divides 17: the block-product kernels stage
            // one element at a time (`launch::vector_width`).
            check(
                client(),
                Problem::new(1, 2, 1, 19, 19, 17, true, &[], 12),
                "d17",
                KERNELS,
            );
        }

        #[test]
        fn head_dim_200() {
            // Blocks of 5 rows for the scalar block products (1024 / 200):
            // odd, so their backward runs one unit per row.
            check(
                client(),
                Problem::new(1, 2, 1, 13, 13, 200, true, &[], 10),
                "d200",
                KERNELS,
            );
        }

        #[test]
        fn dropout() {
            // The kernels drop what the reference drops (the same hash), in
            // the forward and in both backward kernels: grouped-query causal
            // attention with padding, and cross lengths.
            check(
                client(),
                Problem::new(2, 4, 2, 37, 37, 32, true, &[0, 5], 13)
                    .with_dropout(0.2, [3, 1 << 20]),
                "dropout causal gqa padding",
                KERNELS,
            );
            check(
                client(),
                Problem::new(1, 2, 1, 19, 40, 64, false, &[], 14).with_dropout(0.5, [9, 9]),
                "dropout cross",
                KERNELS,
            );
        }

        #[test]
        fn f16() {
            check_16bit::<_, burn::tensor::f16>(client(), 2e-3, KERNELS);
        }

        #[test]
        fn bf16() {
            check_16bit::<_, burn::tensor::bf16>(client(), 1.6e-2, KERNELS);
        }
    };
}

/// The `Blocks` kernels with `Products::TiledScalar`: the tensor-core path's
/// planes, tiles, operand slices and strides, multiplied on scalar FMAs, so
/// that every index of that path is checked where `cmma` does not run. Head
/// dims in 16s up to 64; f32 at the f32 tolerances, and f16.
macro_rules! tiled_tests {
    ($one_pass:expr, $units_per_row:expr) => {
        use super::*;
        const KERNELS: Under = Under {
            kernels: FlashKernels::Blocks {
                products: Products::TiledScalar,
            },
            one_pass: $one_pass,
            units_per_row: $units_per_row,
            tile_pairs: false,
            async_copy: false,
        };

        fn problems() -> Vec<(Problem, &'static str)> {
            vec![
                (
                    Problem::new(2, 4, 2, 37, 37, 64, true, &[0, 5], 9),
                    "gqa causal padding d64",
                ),
                (
                    Problem::new(2, 4, 4, 37, 37, 32, false, &[], 1),
                    "bidirectional d32",
                ),
                (
                    Problem::new(1, 8, 2, 70, 70, 64, true, &[], 3),
                    "gqa causal d64",
                ),
                (
                    Problem::new(2, 4, 2, 33, 33, 32, true, &[3, 9], 5),
                    "padding causal gqa",
                ),
                (
                    Problem::new(1, 2, 1, 19, 40, 32, false, &[], 6),
                    "cross lengths",
                ),
                (
                    Problem::new(2, 4, 2, 33, 33, 32, true, &[3, 9], 15).with_dropout(0.3, [4, 44]),
                    "dropout padding causal gqa",
                ),
                (
                    Problem::new(2, 4, 2, 70, 70, 64, true, &[0, 5], 24).with_window(20),
                    "window 20 gqa padding d64",
                ),
                (
                    Problem::new(1, 2, 2, 50, 50, 32, true, &[], 25).with_window(16),
                    "window of a block d32",
                ),
            ]
        }

        #[test]
        fn f32() {
            for (p, what) in problems() {
                check(client(), p, what, KERNELS);
            }
        }

        #[test]
        fn f16() {
            for (p, _) in problems() {
                check_16bit_on::<_, burn::tensor::f16>(client(), p, 2e-3, KERNELS);
            }
        }
    };
}

#[cfg(feature = "wgpu-kernels")]
mod wgpu {
    use super::*;
    use cubecl::wgpu::{WgpuDevice, WgpuRuntime};

    fn client() -> Option<ComputeClient<WgpuRuntime>> {
        static C: std::sync::OnceLock<Option<ComputeClient<WgpuRuntime>>> =
            std::sync::OnceLock::new();
        C.get_or_init(|| {
            client_or_skip::<WgpuRuntime>(
                || WgpuDevice::DefaultDevice,
                "vulkan",
                "the flash kernels",
            )
        })
        .clone()
    }

    /// `forward.rs` and `backward.rs`.
    mod rows {
        kernel_tests!(Under::two_pass(FlashKernels::Rows));
    }

    /// `forward_blocks.rs` and `backward_blocks.rs` with their products on
    /// scalar FMAs: the tensor-core kernels' data flow, on a device without
    /// tensor cores.
    mod blocks {
        kernel_tests!(Under::two_pass(FlashKernels::Blocks {
            products: Products::Scalar
        }));
    }

    /// The same, with the backward in one pass (dQ added atomically).
    mod blocks_one_pass {
        kernel_tests!(Under::one_pass(FlashKernels::Blocks {
            products: Products::Scalar
        }));
    }

    mod tiled {
        tiled_tests!(false, UNITS_PER_ROW);
    }

    mod tiled_one_pass {
        tiled_tests!(true, UNITS_PER_ROW);
    }

    /// Four units per row: eight planes share a block of 16 rows' tiles.
    mod tiled_four_per_row {
        tiled_tests!(true, 4);
    }

    /// The loops over each unit's rows unrolled, as CUDA runs them (the
    /// tests above run them as loops on wgpu: `launch::unrolls`), at head
    /// dim 16, where lavapipe compiles the unrolled kernels in seconds.
    #[test]
    fn unrolled() {
        let p = || Problem::new(2, 4, 2, 37, 37, 16, true, &[0, 5], 11);
        let scalar = FlashKernels::Blocks {
            products: Products::Scalar,
        };
        let tiled = FlashKernels::Blocks {
            products: Products::TiledScalar,
        };
        for under in [
            Under::two_pass(FlashKernels::Rows),
            Under::two_pass(scalar),
            Under::two_pass(tiled),
            Under::one_pass(tiled),
            Under::one_pass(tiled).with_units_per_row(4),
        ] {
            let what = format!("{under:?} unrolled, d16");
            check_unrolled(client(), p(), &what, under, Some(true));
        }
    }

    /// The kernels above staged their inputs two elements at a time where
    /// they are 16-bit and the head dim allows (one shared-memory bank a
    /// unit: `launch::vector_width`), and one at a time otherwise: both of
    /// `stage_tile`'s paths ran.
    #[test]
    fn inputs_are_staged_a_bank_at_a_time_where_the_head_dim_allows() {
        let Some(client) = client() else { return };
        let width = |d: usize, half: bool| {
            let t = super::super::device_tensor::DeviceTensor::<WgpuRuntime>::zeros(
                &client,
                &[1, 2, 3, d],
            );
            let ty = if half {
                burn::tensor::f16::as_type_native_unchecked()
            } else {
                f32::as_type_native_unchecked()
            };
            super::super::launch::vector_width(&client, ty.storage_type(), d, &[&t.arg(), &t.arg()])
        };
        assert_eq!(width(64, true), 2);
        assert_eq!(width(24, true), 2);
        assert_eq!(width(17, true), 1);
        assert_eq!(width(64, false), 1);
    }

    /// Burn's `Wgpu` backend (fusion on, as CUDA's): `ops::flash_attention`
    /// and its autodiff node through the fusion glue (`fused.rs`), the
    /// kernels underneath.
    #[test]
    fn fused_backend_autodiff() {
        let Some(client) = client() else { return };
        type B = burn::backend::Wgpu<f32>;
        let check = super::super::tests_blocked::check_on::<B>;
        let problems = || {
            [
                (
                    Problem::new(2, 4, 2, 37, 37, 32, true, &[0, 5], 31),
                    "causal gqa padding",
                ),
                (
                    Problem::new(1, 2, 2, 21, 21, 64, false, &[], 32),
                    "bidirectional",
                ),
                // The seed as Burn holds it (the backend's 32-bit ints),
                // resolved through the fusion layer.
                (
                    Problem::new(1, 4, 2, 29, 29, 32, true, &[], 33).with_dropout(0.25, [6, 600]),
                    "dropout",
                ),
                (
                    Problem::new(1, 4, 2, 45, 45, 32, true, &[0], 34).with_window(12),
                    "window",
                ),
                // The spans as Burn holds them (the backend's 32-bit ints), resolved
                // through the fusion layer.
                (
                    Problem::new(2, 4, 2, 45, 45, 32, true, &[], 35)
                        .with_documents(&[&[10, 30], &[44]]),
                    "documents",
                ),
            ]
        };
        // The device's choice here (the `Rows` kernels: no tensor cores).
        for (p, what) in problems() {
            check(p, what);
        }
        // The block-product kernels with the one-pass backward, as CUDA
        // runs them: the glue's dQ accumulator and its cast.
        if !has_atomic_add(&client) {
            eprintln!("SKIPPED: no fp32 atomic adds; the one-pass glue did not run");
            return;
        }
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                *super::super::fused::TEST_KERNELS.lock().unwrap() = None;
            }
        }
        let _reset = Reset;
        *super::super::fused::TEST_KERNELS.lock().unwrap() = Some(FlashKernels::Blocks {
            products: Products::TiledScalar,
        });
        for (p, what) in problems() {
            check(p, &format!("{what}, block products in one pass"));
        }
    }

    /// The glue's gradients come back in the projections' order, `[b, s, h, d]` in memory
    /// (`fused::heads_last`), under both backwards, and so does the output, from the kernels
    /// and from the blocked path they fall back to, so the model's way to and from the
    /// projections is a view, not a copy; the values are the same tests' above.
    #[test]
    fn fused_outputs_and_gradients_are_stored_heads_last() {
        use crate::kernels::flash::blocked::FlashMask;
        use crate::ops::ExecBackend;
        use burn::tensor::ops::FloatTensor;
        use burn::tensor::{Distribution, Tensor, TensorPrimitive};
        let Some(client) = client() else { return };
        type B = burn::backend::Wgpu<f32>;
        let dev = WgpuDevice::DefaultDevice;
        let (b, h, kvh, s, d) = (2, 4, 2, 16, 32);
        let t = |heads: usize| {
            Tensor::<B, 4>::random([b, heads, s, d], Distribution::Normal(0.0, 1.0), &dev)
                .into_primitive()
                .tensor()
        };
        let resolve = crate::kernels::fusion::resolve::<WgpuRuntime, u32>;
        // The buffer's id in CubeCL's pool (only its `Debug` shows it).
        let memory = |g| {
            let dbg = format!("{:?}", resolve(g).handle.memory);
            let at = dbg.find("ManagedMemoryId").expect("a memory id");
            dbg[at..].split('}').next().unwrap().to_string()
        };
        // Stored `[b, s, heads, d]`, and the model's `swap_dims(1, 2).reshape([b, s, heads·d])`
        // between it and its projection is the same buffer, not a copy.
        let heads_last = |g: FloatTensor<B>, heads: usize, what: &str| {
            let strides: Vec<usize> = resolve(g.clone()).meta.strides().to_vec();
            assert_eq!(strides, [s * heads * d, d, heads * d, 1], "{what}");
            let flat = Tensor::<B, 4>::from_primitive(TensorPrimitive::Float(g.clone()))
                .swap_dims(1, 2)
                .reshape([b, s, heads * d])
                .into_primitive()
                .tensor();
            assert_eq!(
                memory(flat),
                memory(g),
                "{what}: the projection's side is a copy"
            );
        };
        let mut kernels = vec![None];
        if has_atomic_add(&client) {
            kernels.push(Some(FlashKernels::Blocks {
                products: Products::TiledScalar,
            }));
        }
        for k in kernels {
            *super::super::fused::TEST_KERNELS.lock().unwrap() = k;
            let mask = FlashMask::<B> {
                causal: true,
                window: 0,
                key_bias: None,
                documents: None,
                dropout: None,
            };
            let (q, kk, v) = (t(h), t(kvh), t(kvh));
            let (o, lse) =
                B::flash_attention_forward(q.clone(), kk.clone(), v.clone(), &mask, 0.125);
            heads_last(o.clone(), h, &format!("{k:?}: o"));
            let d_o = t(h);
            let [dq, dk, dv] = B::flash_attention_backward(q, kk, v, o, lse, d_o, &mask, 0.125);
            *super::super::fused::TEST_KERNELS.lock().unwrap() = None;
            heads_last(dq, h, &format!("{k:?}: dq"));
            heads_last(dk, kvh, &format!("{k:?}: dk"));
            heads_last(dv, kvh, &format!("{k:?}: dv"));
        }
        // Causal with fewer keys than queries: the kernels take no such shape, and the
        // blocked path they fall back to stores its output in their order too.
        let mask = FlashMask::<B> {
            causal: true,
            window: 0,
            key_bias: None,
            documents: None,
            dropout: None,
        };
        let short = |heads: usize| {
            Tensor::<B, 4>::random([b, heads, s / 2, d], Distribution::Normal(0.0, 1.0), &dev)
                .into_primitive()
                .tensor()
        };
        let (o, _) = B::flash_attention_forward(t(h), short(kvh), short(kvh), &mask, 0.125);
        heads_last(o, h, "blocked: o");
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use cubecl::cuda::{CudaDevice, CudaRuntime};

    fn client() -> Option<ComputeClient<CudaRuntime>> {
        static C: std::sync::OnceLock<Option<ComputeClient<CudaRuntime>>> =
            std::sync::OnceLock::new();
        C.get_or_init(|| {
            client_or_skip::<CudaRuntime>(|| CudaDevice::new(0), "cuda", "the flash kernels")
        })
        .clone()
    }

    mod rows {
        kernel_tests!(Under::two_pass(FlashKernels::Rows));
    }

    mod blocks {
        kernel_tests!(Under::two_pass(FlashKernels::Blocks {
            products: Products::Scalar
        }));
    }

    mod blocks_one_pass {
        kernel_tests!(Under::one_pass(FlashKernels::Blocks {
            products: Products::Scalar
        }));
    }

    mod tiled {
        tiled_tests!(false, UNITS_PER_ROW);
    }

    mod tiled_one_pass {
        tiled_tests!(true, UNITS_PER_ROW);
    }

    /// Four units per row: eight planes share a block of 16 rows' tiles.
    mod tiled_four_per_row {
        tiled_tests!(true, 4);
    }

    /// The `Blocks` kernels on tensor cores: 16-bit inputs only, head
    /// dims that are multiples of 16 (the problems of `kernel_tests!` with
    /// such dims, rounded to 16 bits).
    mod tensor_cores {
        use super::*;
        const TENSOR_CORES: FlashKernels = FlashKernels::Blocks {
            products: Products::TensorCores,
        };
        /// Both backwards (the one-pass backward is the default where it
        /// runs: `fused::one_pass_asked`).
        const BOTH: [Under; 2] = [Under::two_pass(TENSOR_CORES), Under::one_pass(TENSOR_CORES)];

        fn problems() -> Vec<Problem> {
            vec![
                Problem::new(2, 4, 2, 37, 37, 64, true, &[0, 5], 9),
                Problem::new(2, 4, 4, 37, 37, 32, false, &[], 1),
                Problem::new(1, 8, 2, 70, 70, 64, true, &[], 3),
                Problem::new(2, 4, 2, 33, 33, 32, true, &[3, 9], 5),
                Problem::new(1, 2, 1, 19, 40, 128, false, &[], 6),
                Problem::new(1, 2, 2, 150, 150, 128, true, &[], 7),
            ]
        }

        /// Sliding windows shorter and longer than the 64-row blocks, at the executor's
        /// head dims, under both backwards (the register kernels' windows are in
        /// `register_cuda_problems`).
        #[test]
        fn sliding_window() {
            let problems = || {
                [
                    Problem::new(2, 4, 2, 200, 200, 64, true, &[0, 7], 26).with_window(50),
                    Problem::new(1, 4, 4, 200, 200, 128, true, &[], 27).with_window(100),
                    Problem::new(1, 2, 2, 130, 130, 64, true, &[], 28).with_window(64),
                ]
            };
            for under in BOTH {
                for p in problems() {
                    check_16bit_on::<_, burn::tensor::f16>(client(), p.clone(), 2e-3, under);
                    check_16bit_on::<_, burn::tensor::bf16>(client(), p, 1.6e-2, under);
                }
            }
        }

        /// Packed rows at the executor's head dims, documents shorter and longer than
        /// the 64-row blocks, under both backwards (the register kernels' are in
        /// `register_cuda_problems`).
        #[test]
        fn documents() {
            let problems = || {
                [
                    Problem::new(2, 4, 2, 200, 200, 64, true, &[], 36)
                        .with_documents(&[&[30, 100, 1, 40], &[150]]),
                    Problem::new(1, 4, 4, 200, 200, 128, true, &[0], 37)
                        .with_documents(&[&[64, 64, 10]])
                        .with_window(50),
                ]
            };
            for under in BOTH {
                for p in problems() {
                    check_16bit_on::<_, burn::tensor::f16>(client(), p.clone(), 2e-3, under);
                    check_16bit_on::<_, burn::tensor::bf16>(client(), p, 1.6e-2, under);
                }
            }
        }

        /// Apart from the others: the speed runs (no dropout) may take the
        /// kernels whether or not this passes (`gpu_one_call.sh`).
        #[test]
        fn dropout() {
            let p =
                || Problem::new(2, 4, 2, 70, 70, 64, true, &[0, 5], 16).with_dropout(0.1, [8, 88]);
            for under in BOTH {
                check_16bit_on::<_, burn::tensor::f16>(client(), p(), 2e-3, under);
                check_16bit_on::<_, burn::tensor::bf16>(client(), p(), 1.6e-2, under);
            }
        }

        #[test]
        fn f16() {
            for under in BOTH {
                for p in problems() {
                    check_16bit_on::<_, burn::tensor::f16>(client(), p, 2e-3, under);
                }
            }
        }

        #[test]
        fn bf16() {
            for under in BOTH {
                for p in problems() {
                    check_16bit_on::<_, burn::tensor::bf16>(client(), p, 1.6e-2, under);
                }
            }
        }
    }

    /// The tensor-core kernels' settings under trial, not their defaults:
    /// four units per row, 2 × 2 tiles per plane (with both, and with
    /// the one-pass backward), and the forward's asynchronous copies.
    /// Apart from `tensor_cores`, which decides
    /// whether a GPU call's speed run takes the tensor cores at all
    /// (`gpu_flash_call.sh`).
    mod tensor_core_trials {
        use super::*;
        const TENSOR_CORES: FlashKernels = FlashKernels::Blocks {
            products: Products::TensorCores,
        };
        const TRIALS: [Under; 5] = [
            Under::one_pass(TENSOR_CORES).with_units_per_row(4),
            Under::one_pass(TENSOR_CORES).with_tile_pairs(),
            Under::two_pass(TENSOR_CORES).with_tile_pairs(),
            Under::one_pass(TENSOR_CORES).with_async_copy(),
            Under::two_pass(TENSOR_CORES).with_async_copy(),
        ];

        fn problems() -> Vec<Problem> {
            vec![
                Problem::new(2, 4, 2, 37, 37, 64, true, &[0, 5], 9),
                Problem::new(2, 4, 2, 70, 70, 64, true, &[0, 5], 16).with_dropout(0.1, [8, 88]),
                Problem::new(1, 2, 1, 19, 40, 128, false, &[], 6),
                Problem::new(1, 2, 2, 150, 150, 128, true, &[], 7),
            ]
        }

        #[test]
        fn bf16() {
            for under in TRIALS {
                for p in problems() {
                    check_16bit_on::<_, burn::tensor::bf16>(client(), p, 1.6e-2, under);
                }
            }
        }
    }
}
