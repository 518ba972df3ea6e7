//! The kernels under Burn's CubeCL backends behind their fusion layer
//! (`burn::backend::Cuda<f32>`; `Wgpu<f32>` in the tests, so this glue runs
//! on lavapipe too), through `kernels::fusion`. Shapes the kernels do not take (head dim above
//! `launch::MAX_HEAD_DIM`, causal with `s != t`) run the blocked plain path
//! instead, with one note on stderr.

use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeRuntime};
use cubecl::prelude::{StorageType, TensorArg};

use super::blocked::FlashMask;
use super::launch::{self, BackwardInputs, BackwardOutputs, FlashDims, FlashKernels, FlashLaunch};
use super::mma::Products;
use crate::kernels::fusion::{empty, register, resolve, Fused, Inner};

/// The launch settings, or why the kernels cannot take these shapes.
fn settings<R: CubeRuntime, BT: BoolElement>(
    q: &CubeTensor<R>,
    k: &CubeTensor<R>,
    mask: &FlashMask<Fused<R, BT>>,
    scale: f64,
) -> Result<FlashLaunch, String> {
    let [batch, heads, q_len, head_dim] = q.shape().dims::<4>();
    let [_, kv_heads, kv_len, _] = k.shape().dims::<4>();
    let dims = FlashDims {
        batch,
        heads,
        kv_heads,
        q_len,
        kv_len,
        head_dim,
    };
    dims.check(mask.causal, mask.window, mask.documents.is_some())?;
    let dtype: StorageType = q.dtype.into();
    let registers = registers_asked();
    let mut cfg = FlashLaunch {
        dims,
        causal: mask.causal,
        window: mask.window,
        padding: mask.key_bias.is_some(),
        documents: mask.documents.is_some(),
        scale: scale as f32,
        dtype,
        kernels: FlashKernels::Rows,
        unroll: launch::unrolls(&q.client),
        dropout: mask.dropout.as_ref().map(|d| d.p),
        atomic_dq: one_pass_asked() && launch::has_atomic_add(&q.client),
        units_per_row: units_per_row_asked(),
        tile_pairs: std::env::var("RCOA_FLASH_TILE_PAIRS").as_deref() == Ok("1"),
        async_copy: std::env::var("RCOA_FLASH_ASYNC_COPY").as_deref() == Ok("1"),
        register_forward: registers.forward,
        register_backward: registers.backward,
        max_shared: q.client.properties().hardware.max_shared_memory_size,
    };
    let asked = tensor_cores_asked();
    if asked != Some(false) {
        let cmma = launch::has_tensor_cores(&q.client, dtype);
        if cmma {
            cfg.kernels = FlashKernels::Blocks {
                products: Products::TensorCores,
            };
        }
        if asked == Some(true) {
            static TOLD: std::sync::Once = std::sync::Once::new();
            TOLD.call_once(|| eprintln!("note: {}", tensor_core_note(cmma, &cfg)));
        } else if cmma && cfg.shape_takes() && !cfg.shared_fits() {
            // Not asked for, but a user on such a GPU should know why attention is slow.
            static TOLD: std::sync::Once = std::sync::Once::new();
            TOLD.call_once(|| eprintln!("note: {}", shared_note(&cfg)));
        }
    }
    #[cfg(test)]
    if let Some(kernels) = *TEST_KERNELS.lock().unwrap() {
        cfg.kernels = kernels;
    }
    Ok(cfg)
}

/// The kernels a test runs through this glue instead of the device's
/// choice: the block-product kernels (and their one-pass backward) on a
/// device without tensor cores. One test sets it (`tests_kernels`).
#[cfg(test)]
pub(super) static TEST_KERNELS: std::sync::Mutex<Option<FlashKernels>> =
    std::sync::Mutex::new(None);

/// The tensor-core kernels run wherever the device multiplies the type's
/// tiles on them and the shape suits them (`FlashLaunch::kernels`): their
/// tests passed on an H200 (2026-11-28f), where they ran 2.9 × the scalar
/// `Rows` kernels (`docs/flash-attention.md`). `RCOA_FLASH_TENSOR_CORES=0`
/// turns them off (`Some(false)`); `=1` asks for them and says once whether
/// they run (`Some(true)`).
fn tensor_cores_asked() -> Option<bool> {
    static ASKED: std::sync::OnceLock<Option<bool>> = std::sync::OnceLock::new();
    *ASKED.get_or_init(
        || match std::env::var("RCOA_FLASH_TENSOR_CORES").as_deref() {
            Ok("1") => Some(true),
            Ok("0") => Some(false),
            _ => None,
        },
    )
}

/// The block-product kernels' backward runs in one pass, adding dQ up with
/// atomics (`launch::FlashLaunch::atomic_dq`: 5 block products instead of
/// 7), wherever the device adds fp32 atomically.
/// `RCOA_FLASH_ONE_PASS=0` keeps the atomics-free two passes, whose
/// gradients are the same bits from run to run.
fn one_pass_asked() -> bool {
    static ASKED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| std::env::var("RCOA_FLASH_ONE_PASS").as_deref() != Ok("0"))
}

/// Which directions run in FlashAttention-2's register structure (`forward_registers`,
/// `backward_registers`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RegistersAsked {
    forward: bool,
    backward: bool,
}

impl RegistersAsked {
    /// Neither direction: the block kernels both ways.
    const NEITHER: RegistersAsked = RegistersAsked {
        forward: false,
        backward: false,
    };
}

impl Default for RegistersAsked {
    /// Both, wherever they take the launch (`FlashLaunch::register_forward_runs`): their
    /// CUDA tests passed on an H200 (2026-11-30h), where they ran the 350M shape's
    /// attention (forward and one-pass backward) in 1.51 ms against the block kernels'
    /// 3.12 ms (`docs/flash-attention.md`), and the 350M step took 0.168 s against 0.202 s.
    fn default() -> Self {
        RegistersAsked {
            forward: true,
            backward: true,
        }
    }
}

/// `RCOA_FLASH_REGISTERS`: `forward`, `backward`, both (`forward,backward`, or `1`, the
/// default), or `0` for neither (the block kernels both ways). Any other word is refused
/// once, on stderr, and the default runs.
fn registers_asked() -> RegistersAsked {
    static ASKED: std::sync::OnceLock<RegistersAsked> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| {
        let value = std::env::var("RCOA_FLASH_REGISTERS").unwrap_or_default();
        parse_registers(&value).unwrap_or_else(|word| {
            eprintln!(
                "warning: RCOA_FLASH_REGISTERS={value}: `{word}` is not forward, backward, 1 \
                 or 0; the register kernels run both ways"
            );
            RegistersAsked::default()
        })
    })
}

fn parse_registers(value: &str) -> Result<RegistersAsked, &str> {
    let value = value.trim();
    if value.is_empty() {
        return Ok(RegistersAsked::default());
    }
    if value == "0" {
        return Ok(RegistersAsked::NEITHER);
    }
    let mut asked = RegistersAsked::NEITHER;
    for word in value.split(',').map(str::trim).filter(|w| !w.is_empty()) {
        match word {
            "forward" => asked.forward = true,
            "backward" => asked.backward = true,
            "1" => asked = RegistersAsked::default(),
            _ => return Err(word),
        }
    }
    Ok(asked)
}

/// Units per row of the block-product kernels: `RCOA_FLASH_UNITS_PER_ROW`
/// (1, 2, 4 or 8; `launch::FlashLaunch::units_per_row` says what each
/// changes), else `launch::UNITS_PER_ROW`. Any other value is refused once,
/// on stderr, for the default.
fn units_per_row_asked() -> usize {
    static ASKED: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| {
        let var = std::env::var("RCOA_FLASH_UNITS_PER_ROW").ok();
        parse_units_per_row(var.as_deref()).unwrap_or_else(|why| {
            eprintln!("warning: {why}");
            launch::UNITS_PER_ROW
        })
    })
}

fn parse_units_per_row(var: Option<&str>) -> Result<usize, String> {
    match var {
        None => Ok(launch::UNITS_PER_ROW),
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n @ (1 | 2 | 4 | 8)) => Ok(n),
            _ => Err(format!(
                "RCOA_FLASH_UNITS_PER_ROW={v} is not 1, 2, 4 or 8; the flash kernels run {} units per row",
                launch::UNITS_PER_ROW
            )),
        },
    }
}

/// What a run that asked for tensor cores is told (once): that they run, or
/// why the scalar kernels run instead. `cmma`: the device multiplies the
/// type's tiles on them.
fn tensor_core_note(cmma: bool, cfg: &FlashLaunch) -> String {
    let scalar = "the scalar flash kernels run";
    if !cmma {
        format!(
            "RCOA_FLASH_TENSOR_CORES=1, but this device has no tensor cores for {:?}; {scalar}",
            cfg.dtype
        )
    } else if cfg.kernels() == cfg.kernels {
        "flash attention runs on tensor cores (RCOA_FLASH_TENSOR_CORES=1)".to_string()
    } else if !cfg.shape_takes() {
        format!(
            "RCOA_FLASH_TENSOR_CORES=1, but the tensor-core kernels take 16-bit inputs and head \
             dims in 16s up to {}, not {:?} at head dim {}; {scalar}",
            launch::MAX_TENSOR_CORE_HEAD_DIM,
            cfg.dtype,
            cfg.dims.head_dim
        )
    } else {
        format!("RCOA_FLASH_TENSOR_CORES=1, but {}", shared_note(cfg))
    }
}

/// Why the tensor-core kernels do not run where they would but for the device's
/// shared memory.
fn shared_note(cfg: &FlashLaunch) -> String {
    format!(
        "at head dim {} the tensor-core flash kernels take {} KiB of shared memory a block, \
         and this device gives {} KiB; the scalar flash kernels run (slower)",
        cfg.dims.head_dim,
        cfg.shared_need().div_ceil(1024),
        cfg.max_shared / 1024
    )
}

fn fallback_note(why: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| eprintln!("note: flash attention runs the blocked plain path: {why}"));
}

/// The key bias as the kernels read it (fp32), or a 1-element placeholder.
fn key_bias<R: CubeRuntime, BT: BoolElement>(
    mask: &FlashMask<Fused<R, BT>>,
    like: &CubeTensor<R>,
) -> CubeTensor<R> {
    match &mask.key_bias {
        Some(b) => {
            let b =
                Fused::<R, BT>::float_cast(b.clone().into_primitive().tensor(), FloatDType::F32);
            into_contiguous(resolve::<R, BT>(b))
        }
        None => empty(like, Shape::new([1, 1]), DType::F32),
    }
}

/// An int tensor of the mask as the kernels read it (32-bit integers: the backend's int
/// type), or a placeholder of `placeholder`'s shape, never read.
fn ints<R: CubeRuntime, BT: BoolElement, const D: usize>(
    t: Option<&burn::tensor::Tensor<Fused<R, BT>, D, burn::tensor::Int>>,
    like: &CubeTensor<R>,
    placeholder: Shape,
) -> CubeTensor<R> {
    match t {
        Some(t) => {
            let t = t.clone().into_primitive();
            let client = t.client.clone();
            into_contiguous(client.resolve_tensor_int::<Inner<R, BT>>(t))
        }
        None => empty(like, placeholder, DType::I32),
    }
}

/// The dropout's two seed words (`[2]`), or a placeholder.
fn dropout_seed<R: CubeRuntime, BT: BoolElement>(
    mask: &FlashMask<Fused<R, BT>>,
    like: &CubeTensor<R>,
) -> CubeTensor<R> {
    ints(
        mask.dropout.as_ref().map(|d| &d.seed),
        like,
        Shape::new([1]),
    )
}

/// The documents' spans (`[b, s, 2]`), or a placeholder.
fn spans<R: CubeRuntime, BT: BoolElement>(
    mask: &FlashMask<Fused<R, BT>>,
    like: &CubeTensor<R>,
) -> CubeTensor<R> {
    ints(mask.documents.as_ref(), like, Shape::new([1, 1, 2]))
}

fn arg<R: CubeRuntime>(t: &CubeTensor<R>) -> TensorArg<R> {
    t.clone().into_tensor_arg()
}

/// An output and its log-sum-exp.
type OutLse<B> = (FloatTensor<B>, FloatTensor<B>);

/// `ExecBackend::flash_attention_forward` on a fused CubeCL backend.
pub fn forward<R: CubeRuntime, BT: BoolElement>(
    q: FloatTensor<Fused<R, BT>>,
    k: FloatTensor<Fused<R, BT>>,
    v: FloatTensor<Fused<R, BT>>,
    mask: &FlashMask<Fused<R, BT>>,
    scale: f64,
) -> OutLse<Fused<R, BT>> {
    let (qc, kc, vc) = (
        resolve::<R, BT>(q),
        resolve::<R, BT>(k),
        resolve::<R, BT>(v),
    );
    let cfg = match settings(&qc, &kc, mask, scale) {
        Ok(cfg) => cfg,
        Err(why) => {
            fallback_note(&why);
            let (o, lse) = super::blocked::forward(
                float4(register::<R, BT>(qc)),
                float4(register::<R, BT>(kc)),
                float4(register::<R, BT>(vc)),
                mask,
                scale,
            );
            let o = stored_heads_last(o);
            return (o.into_primitive().tensor(), lse.into_primitive().tensor());
        }
    };
    let d = cfg.dims;
    let bias = key_bias::<R, BT>(mask, &qc);
    let seed = dropout_seed::<R, BT>(mask, &qc);
    let docs = spans::<R, BT>(mask, &qc);
    let o = heads_last(
        &qc,
        Shape::new([d.batch, d.heads, d.q_len, d.head_dim]),
        qc.dtype,
    );
    let lse = empty(&qc, Shape::new([d.batch, d.heads, d.q_len]), DType::F32);
    let client = qc.client.clone();
    launch::forward(
        &client,
        &cfg,
        arg(&qc),
        arg(&kc),
        arg(&vc),
        arg(&bias),
        arg(&seed),
        arg(&docs),
        arg(&o),
        arg(&lse),
    );
    (register::<R, BT>(o), register::<R, BT>(lse))
}

/// `ExecBackend::flash_attention_backward` on a fused CubeCL backend.
#[allow(clippy::too_many_arguments)]
pub fn backward<R: CubeRuntime, BT: BoolElement>(
    q: FloatTensor<Fused<R, BT>>,
    k: FloatTensor<Fused<R, BT>>,
    v: FloatTensor<Fused<R, BT>>,
    o: FloatTensor<Fused<R, BT>>,
    lse: FloatTensor<Fused<R, BT>>,
    d_o: FloatTensor<Fused<R, BT>>,
    mask: &FlashMask<Fused<R, BT>>,
    scale: f64,
) -> [FloatTensor<Fused<R, BT>>; 3] {
    let (qc, kc, vc) = (
        resolve::<R, BT>(q),
        resolve::<R, BT>(k),
        resolve::<R, BT>(v),
    );
    let cfg = match settings(&qc, &kc, mask, scale) {
        // The forward fell back for the same shapes: its LSE is the blocked
        // path's, so the backward follows it.
        Err(_) => {
            let lse = burn::tensor::Tensor::<Fused<R, BT>, 3>::from_primitive(
                burn::tensor::TensorPrimitive::Float(lse),
            );
            let (dq, dk, dv) = super::blocked::backward(
                float4(register::<R, BT>(qc)),
                float4(register::<R, BT>(kc)),
                float4(register::<R, BT>(vc)),
                float4(o),
                lse,
                float4(d_o),
                mask,
                scale,
            );
            return [dq, dk, dv].map(|t| t.into_primitive().tensor());
        }
        Ok(cfg) => cfg,
    };
    let (oc, lsec, doc) = (
        resolve::<R, BT>(o),
        resolve::<R, BT>(lse),
        resolve::<R, BT>(d_o),
    );
    let bias = key_bias::<R, BT>(mask, &qc);
    let seed = dropout_seed::<R, BT>(mask, &qc);
    let docs = spans::<R, BT>(mask, &qc);
    let d_q = heads_last(&qc, qc.shape(), qc.dtype);
    let d_k = heads_last(&kc, kc.shape(), kc.dtype);
    let d_v = heads_last(&vc, vc.shape(), vc.dtype);
    // Freed when this returns: transients of the backward, which the
    // `burn` profile charges (`memory::build` `burn_flash_attention`); a
    // one-element placeholder where the kernels that run read none.
    let scratch =
        |shape: Option<Shape>| empty(&qc, shape.unwrap_or_else(|| Shape::new([1])), DType::F32);
    // dQ's layout: it is zeroed and cast into dQ element by element in memory order.
    let d_q_acc = match cfg.dq_accumulator() {
        Some(shape) => heads_last(&qc, Shape::new(shape), DType::F32),
        None => scratch(None),
    };
    let d_rows = scratch(cfg.row_dots().map(Shape::new));
    let client = qc.client.clone();
    let inputs = BackwardInputs {
        q: arg(&qc),
        k: arg(&kc),
        v: arg(&vc),
        o: arg(&oc),
        d_o: arg(&doc),
        lse: arg(&lsec),
        key_bias: arg(&bias),
        dropout_seed: arg(&seed),
        spans: arg(&docs),
    };
    let out = BackwardOutputs {
        d_q: arg(&d_q),
        d_k: arg(&d_k),
        d_v: arg(&d_v),
        d_q_acc: arg(&d_q_acc),
        d_rows: arg(&d_rows),
    };
    launch::backward(&client, &cfg, inputs, out);
    [
        register::<R, BT>(d_q),
        register::<R, BT>(d_k),
        register::<R, BT>(d_v),
    ]
}

/// An uninitialised `[b, h, s, d]` tensor stored as `[b, s, h, d]`: the output in the order
/// the output projection reads it, and a gradient in the order its projection has it. The
/// model's `swap_dims(1, 2).reshape([b, s, h·d])` on either way is then a view; from a
/// `[b, h, s, d]`-ordered tensor it was a copy, one per o, q, k and v in every layer, and
/// the output's copy was kept for the backward beside the output. The kernels write
/// through the strides.
fn heads_last<R: CubeRuntime>(like: &CubeTensor<R>, shape: Shape, dtype: DType) -> CubeTensor<R> {
    let [b, h, s, d] = shape.dims::<4>();
    let mut t = empty(like, Shape::new([b, s, h, d]), dtype);
    t.meta.swap(1, 2);
    t
}

/// The blocked path's contiguous `[b, h, s, d]` output in the kernels' order (`heads_last`),
/// so the `burn` profile's one saved output holds where the kernels fall back too. The copy
/// is made here, while the contiguous one is a transient. (NdArray keeps the blocked path's
/// order: its `reshape` copies even a contiguous tensor, so there the order saves nothing.)
fn stored_heads_last<B: burn::tensor::backend::Backend>(
    o: burn::tensor::Tensor<B, 4>,
) -> burn::tensor::Tensor<B, 4> {
    let [b, h, s, d] = o.dims();
    o.swap_dims(1, 2)
        .reshape([b, s, h * d])
        .reshape([b, s, h, d])
        .swap_dims(1, 2)
}

fn float4<R: CubeRuntime, BT: BoolElement>(
    t: FloatTensor<Fused<R, BT>>,
) -> burn::tensor::Tensor<Fused<R, BT>, 4> {
    burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(t))
}

#[cfg(test)]
mod tests {
    use super::*;
    use cubecl::ir::{ElemType, FloatKind};

    #[test]
    fn the_register_kernels_run_both_ways_unless_told_otherwise() {
        let both = RegistersAsked {
            forward: true,
            backward: true,
        };
        assert_eq!(parse_registers(""), Ok(both));
        assert_eq!(RegistersAsked::default(), both);
        assert_eq!(parse_registers("1"), Ok(both));
        assert_eq!(parse_registers("forward, backward"), Ok(both));
        assert_eq!(
            parse_registers("backward"),
            Ok(RegistersAsked {
                forward: false,
                backward: true
            })
        );
        assert_eq!(parse_registers("forward,bwd"), Err("bwd"));
        assert_eq!(
            parse_registers(" 0 "),
            Ok(RegistersAsked {
                forward: false,
                backward: false
            })
        );
        assert_eq!(parse_registers("forward,0"), Err("0"));
    }

    fn cfg(head_dim: usize, kind: FloatKind) -> FlashLaunch {
        FlashLaunch {
            window: 0,
            documents: false,
            dims: FlashDims {
                batch: 1,
                heads: 2,
                kv_heads: 2,
                q_len: 8,
                kv_len: 8,
                head_dim,
            },
            causal: true,
            padding: false,
            scale: 1.0,
            dtype: StorageType::Scalar(ElemType::Float(kind)),
            kernels: FlashKernels::Blocks {
                products: Products::TensorCores,
            },
            unroll: true,
            dropout: None,
            atomic_dq: true,
            units_per_row: launch::UNITS_PER_ROW,
            tile_pairs: false,
            async_copy: false,
            register_forward: false,
            register_backward: false,
            max_shared: 227 * 1024,
        }
    }

    #[test]
    fn units_per_row_are_1_2_4_or_8() {
        assert_eq!(parse_units_per_row(None), Ok(launch::UNITS_PER_ROW));
        assert_eq!(parse_units_per_row(Some("4")), Ok(4));
        assert_eq!(parse_units_per_row(Some(" 8 ")), Ok(8));
        for bad in ["3", "0", "16", "four", ""] {
            let err = parse_units_per_row(Some(bad)).unwrap_err();
            assert!(err.contains("is not 1, 2, 4 or 8"), "{bad}: {err}");
        }
    }

    #[test]
    fn a_run_that_asks_for_tensor_cores_is_told_whether_it_got_them() {
        let note = tensor_core_note(true, &cfg(64, FloatKind::BF16));
        assert!(
            note.starts_with("flash attention runs on tensor cores"),
            "{note}"
        );
        let note = tensor_core_note(true, &cfg(84, FloatKind::BF16));
        assert!(
            note.contains("head dim 84") && note.ends_with("the scalar flash kernels run"),
            "{note}"
        );
        let note = tensor_core_note(false, &cfg(64, FloatKind::F32));
        assert!(
            note.contains("no tensor cores for") && note.contains("F32"),
            "{note}"
        );
        // An L40S's 99 KiB: the backward's 121 KiB at head dim 128 does not fit.
        let ada = FlashLaunch {
            max_shared: 99 * 1024,
            ..cfg(128, FloatKind::BF16)
        };
        let note = tensor_core_note(true, &ada);
        assert_eq!(
            note,
            "RCOA_FLASH_TENSOR_CORES=1, but at head dim 128 the tensor-core flash kernels take \
             121 KiB of shared memory a block, and this device gives 99 KiB; the scalar flash \
             kernels run (slower)"
        );
    }
}
