//! The kernels under `burn::backend::Cuda<f32>` (Burn's CubeCL backend
//! behind its fusion layer): the fusion queue is drained into CubeCL tensors
//! (`resolve_tensor_float`), the kernels run on them, and their outputs are
//! registered back with the fusion client as fresh tensors (what Burn's own
//! `float_from_data` does). Shapes the kernels do not take (head dim above
//! `launch::MAX_HEAD_DIM`, causal with `s != t`) run the blocked plain path
//! instead, with one note on stderr.

use burn::backend::ir::{BackendIr, InitOperationIr, OperationIr};
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::ops::numeric::empty_device_dtype;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::CubeBackend;
use burn_fusion::stream::OperationStreams;
use burn_fusion::{get_client, NoOp};
use cubecl::cuda::CudaRuntime;
use cubecl::prelude::TensorArg;

use super::blocked::FlashMask;
use super::launch::{self, BackwardInputs, FlashDims, FlashLaunch};

type Inner = CubeBackend<CudaRuntime, f32, i32, u8>;
type Cuda = burn::backend::Cuda<f32>;
type Cube = CubeTensor<CudaRuntime>;

/// The CubeCL tensor behind a fusion tensor (queued ops run first).
fn resolve(t: FloatTensor<Cuda>) -> Cube {
    let client = t.client.clone();
    client.resolve_tensor_float::<Inner>(t)
}

/// A CubeCL tensor handed back to the fusion layer.
fn register(t: Cube) -> FloatTensor<Cuda> {
    let client = get_client::<Inner>(&t.device);
    let (shape, dtype) = (t.shape(), t.dtype);
    let handle = <Inner as BackendIr>::float_tensor_handle(t);
    let desc = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            OperationStreams::default(),
            OperationIr::Init(desc),
            NoOp::<Inner>::new(),
        )
        .remove(0)
}

fn empty(like: &Cube, shape: Shape, dtype: DType) -> Cube {
    empty_device_dtype(like.client.clone(), like.device.clone(), shape, dtype)
}

/// The launch settings, or why the kernels cannot take these shapes.
fn settings(
    q: &Cube,
    k: &Cube,
    causal: bool,
    padding: bool,
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
    dims.check(causal)?;
    Ok(FlashLaunch {
        dims,
        causal,
        padding,
        scale: scale as f32,
        dtype: q.dtype.into(),
    })
}

fn fallback_note(why: &str) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| eprintln!("note: flash attention runs the blocked plain path: {why}"));
}

/// The key bias as the kernels read it (fp32), or a 1-element placeholder.
fn key_bias(mask: &FlashMask<Cuda>, like: &Cube) -> Cube {
    match &mask.key_bias {
        Some(b) => {
            let b = Cuda::float_cast(b.clone().into_primitive().tensor(), FloatDType::F32);
            into_contiguous(resolve(b))
        }
        None => empty(like, Shape::new([1, 1]), DType::F32),
    }
}

fn arg(t: &Cube) -> TensorArg<CudaRuntime> {
    t.clone().into_tensor_arg()
}

/// `ExecBackend::flash_attention_forward` on CUDA.
pub fn forward(
    q: FloatTensor<Cuda>,
    k: FloatTensor<Cuda>,
    v: FloatTensor<Cuda>,
    mask: &FlashMask<Cuda>,
    scale: f64,
) -> (FloatTensor<Cuda>, FloatTensor<Cuda>) {
    let (qc, kc, vc) = (resolve(q), resolve(k), resolve(v));
    let cfg = match settings(&qc, &kc, mask.causal, mask.key_bias.is_some(), scale) {
        Ok(cfg) => cfg,
        Err(why) => {
            fallback_note(&why);
            let (o, lse) = super::blocked::forward(
                float4(register(qc)),
                float4(register(kc)),
                float4(register(vc)),
                mask,
                scale,
            );
            return (o.into_primitive().tensor(), lse.into_primitive().tensor());
        }
    };
    let d = cfg.dims;
    let bias = key_bias(mask, &qc);
    let o = empty(
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
        arg(&o),
        arg(&lse),
    );
    (register(o), register(lse))
}

/// `ExecBackend::flash_attention_backward` on CUDA.
#[allow(clippy::too_many_arguments)]
pub fn backward(
    q: FloatTensor<Cuda>,
    k: FloatTensor<Cuda>,
    v: FloatTensor<Cuda>,
    o: FloatTensor<Cuda>,
    lse: FloatTensor<Cuda>,
    d_o: FloatTensor<Cuda>,
    mask: &FlashMask<Cuda>,
    scale: f64,
) -> [FloatTensor<Cuda>; 3] {
    let (qc, kc, vc) = (resolve(q), resolve(k), resolve(v));
    let cfg = match settings(&qc, &kc, mask.causal, mask.key_bias.is_some(), scale) {
        // The forward fell back for the same shapes: its LSE is the blocked
        // path's, so the backward follows it.
        Err(_) => {
            let lse = burn::tensor::Tensor::<Cuda, 3>::from_primitive(
                burn::tensor::TensorPrimitive::Float(lse),
            );
            let (dq, dk, dv) = super::blocked::backward(
                float4(register(qc)),
                float4(register(kc)),
                float4(register(vc)),
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
    let (oc, lsec, doc) = (resolve(o), resolve(lse), resolve(d_o));
    let bias = key_bias(mask, &qc);
    let d_q = empty(&qc, qc.shape(), qc.dtype);
    let d_k = empty(&kc, kc.shape(), kc.dtype);
    let d_v = empty(&vc, vc.shape(), vc.dtype);
    let client = qc.client.clone();
    let inputs = || BackwardInputs {
        q: arg(&qc),
        k: arg(&kc),
        v: arg(&vc),
        o: arg(&oc),
        d_o: arg(&doc),
        lse: arg(&lsec),
        key_bias: arg(&bias),
    };
    launch::backward_kv(&client, &cfg, inputs(), arg(&d_k), arg(&d_v));
    launch::backward_q(&client, &cfg, inputs(), arg(&d_q));
    [register(d_q), register(d_k), register(d_v)]
}

fn float4(t: FloatTensor<Cuda>) -> burn::tensor::Tensor<Cuda, 4> {
    burn::tensor::Tensor::from_primitive(burn::tensor::TensorPrimitive::Float(t))
}
