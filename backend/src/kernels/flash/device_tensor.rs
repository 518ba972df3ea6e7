//! A contiguous tensor on a CubeCL device, uploaded from and read back as
//! f32 on the host, whatever type it holds, and one attention call's set of
//! them: what the kernel tests (`tests_kernels.rs`) and the kernel benchmark
//! (`benches/flash.rs`) hand the launches in `launch.rs`.

use cubecl::prelude::*;

use super::launch::{self, BackwardInputs, BackwardOutputs, FlashLaunch};

/// An element type a [`DeviceTensor`] holds: f32, f16 or bf16, converted
/// from and to f32 on the host.
pub trait Elem: CubeElement + Float {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl Elem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Elem for burn::tensor::f16 {
    fn from_f32(x: f32) -> Self {
        Self::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
}

impl Elem for burn::tensor::bf16 {
    fn from_f32(x: f32) -> Self {
        Self::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        self.to_f32()
    }
}

/// A contiguous tensor on the device.
pub struct DeviceTensor<R: Runtime> {
    handle: cubecl::server::Handle,
    runtime: std::marker::PhantomData<R>,
    shape: Vec<usize>,
}

impl<R: Runtime> DeviceTensor<R> {
    pub fn new(client: &ComputeClient<R>, data: &[f32], shape: &[usize]) -> Self {
        Self::new_as::<f32>(client, data, shape)
    }

    /// `data` stored as `E`.
    pub fn new_as<E: Elem>(client: &ComputeClient<R>, data: &[f32], shape: &[usize]) -> Self {
        assert_eq!(data.len(), shape.iter().product::<usize>());
        let data: Vec<E> = data.iter().map(|&x| E::from_f32(x)).collect();
        DeviceTensor {
            handle: client.create_from_slice(E::as_bytes(&data)),
            shape: shape.to_vec(),
            runtime: std::marker::PhantomData,
        }
    }

    /// 32-bit words, as they are (`[n]`).
    pub fn words(client: &ComputeClient<R>, words: &[u32]) -> Self {
        Self::words_shaped(client, words, &[words.len()])
    }

    /// 32-bit integers laid out as `shape`.
    pub fn words_shaped(client: &ComputeClient<R>, words: &[u32], shape: &[usize]) -> Self {
        assert_eq!(words.len(), shape.iter().product::<usize>());
        DeviceTensor {
            handle: client.create_from_slice(u32::as_bytes(words)),
            shape: shape.to_vec(),
            runtime: std::marker::PhantomData,
        }
    }

    pub fn zeros(client: &ComputeClient<R>, shape: &[usize]) -> Self {
        Self::zeros_as::<f32>(client, shape)
    }

    pub fn zeros_as<E: Elem>(client: &ComputeClient<R>, shape: &[usize]) -> Self {
        Self::new_as::<E>(client, &vec![0.0; shape.iter().product()], shape)
    }

    pub fn arg(&self) -> TensorArg<R> {
        let mut strides = vec![1; self.shape.len()];
        for i in (0..self.shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * self.shape[i + 1];
        }
        // SAFETY: the handle holds a contiguous tensor of this shape.
        unsafe {
            TensorArg::from_raw_parts(
                self.handle.clone(),
                strides.as_slice().into(),
                self.shape.as_slice().into(),
            )
        }
    }

    pub fn read(&self, client: &ComputeClient<R>) -> Vec<f32> {
        self.read_as::<f32>(client)
    }

    pub fn read_as<E: Elem>(&self, client: &ComputeClient<R>) -> Vec<f32> {
        let bytes = client.read_one_unchecked(self.handle.clone());
        E::from_bytes(&bytes).iter().map(|&x| x.to_f32()).collect()
    }
}

/// What one attention call reads from the host, in f32: q `[b, h, s, d]`,
/// k and v `[b, kv_heads, t, d]`, dO like q, and the padding bias `[b, t]`
/// (None: no padding).
pub struct HostInputs<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub d_o: &'a [f32],
    pub key_bias: Option<&'a [f32]>,
    /// The dropout's two seed words (None: no dropout).
    pub dropout_seed: Option<[u32; 2]>,
    /// Packed rows: each token's document `[start, end)`, `[b, s, 2]` (None: one
    /// sequence per row).
    pub spans: Option<&'a [u32]>,
}

/// One attention call's tensors on the device, as the kernels take them:
/// the inputs (q, k, v, dO in `E`; the key bias in f32, a 1 × 1
/// placeholder without padding) and zeroed outputs (O and the gradients in
/// `E`; LSE, the one-pass backward's dQ accumulator and the rows' D in f32) for [`AttentionTensors::forward`] and
/// [`AttentionTensors::backward`] to write.
pub struct AttentionTensors<R: Runtime> {
    pub q: DeviceTensor<R>,
    pub k: DeviceTensor<R>,
    pub v: DeviceTensor<R>,
    pub d_o: DeviceTensor<R>,
    pub key_bias: DeviceTensor<R>,
    /// `[2]` u32 seed words, or a 1-element placeholder.
    pub dropout_seed: DeviceTensor<R>,
    /// `[b, s, 2]` u32 document spans, or a 1 × 1 × 2 placeholder.
    pub spans: DeviceTensor<R>,
    pub o: DeviceTensor<R>,
    pub lse: DeviceTensor<R>,
    pub d_q: DeviceTensor<R>,
    pub d_k: DeviceTensor<R>,
    pub d_v: DeviceTensor<R>,
    /// dQ's fp32 accumulator, for a one-pass backward
    /// (`FlashLaunch::one_pass`), which zeroes it itself.
    pub d_q_acc: DeviceTensor<R>,
    /// The rows' D, fp32 `[b, h, s]`, which the block-product backward
    /// writes and reads.
    pub d_rows: DeviceTensor<R>,
}

impl<R: Runtime> AttentionTensors<R> {
    pub fn new<E: Elem>(
        client: &ComputeClient<R>,
        dims: &launch::FlashDims,
        host: HostInputs<'_>,
    ) -> Self {
        let qs = [dims.batch, dims.heads, dims.q_len, dims.head_dim];
        let ks = [dims.batch, dims.kv_heads, dims.kv_len, dims.head_dim];
        AttentionTensors {
            q: DeviceTensor::new_as::<E>(client, host.q, &qs),
            k: DeviceTensor::new_as::<E>(client, host.k, &ks),
            v: DeviceTensor::new_as::<E>(client, host.v, &ks),
            d_o: DeviceTensor::new_as::<E>(client, host.d_o, &qs),
            key_bias: match host.key_bias {
                Some(bias) => DeviceTensor::new(client, bias, &[dims.batch, dims.kv_len]),
                None => DeviceTensor::zeros(client, &[1, 1]),
            },
            dropout_seed: DeviceTensor::words(client, &host.dropout_seed.unwrap_or([0, 0])),
            spans: match host.spans {
                Some(sp) => DeviceTensor::words_shaped(client, sp, &[dims.batch, dims.q_len, 2]),
                None => DeviceTensor::words_shaped(client, &[0, 1], &[1, 1, 2]),
            },
            o: DeviceTensor::zeros_as::<E>(client, &qs),
            lse: DeviceTensor::zeros(client, &[dims.batch, dims.heads, dims.q_len]),
            d_q: DeviceTensor::zeros_as::<E>(client, &qs),
            d_k: DeviceTensor::zeros_as::<E>(client, &ks),
            d_v: DeviceTensor::zeros_as::<E>(client, &ks),
            d_q_acc: DeviceTensor::zeros(client, &qs),
            d_rows: DeviceTensor::zeros(client, &[dims.batch, dims.heads, dims.q_len]),
        }
    }

    /// Writes O and LSE.
    pub fn forward(&self, client: &ComputeClient<R>, cfg: &FlashLaunch) {
        launch::forward(
            client,
            cfg,
            self.q.arg(),
            self.k.arg(),
            self.v.arg(),
            self.key_bias.arg(),
            self.dropout_seed.arg(),
            self.spans.arg(),
            self.o.arg(),
            self.lse.arg(),
        );
    }

    /// Writes dQ, dK and dV from the O and LSE [`AttentionTensors::forward`]
    /// wrote.
    pub fn backward(&self, client: &ComputeClient<R>, cfg: &FlashLaunch) {
        let (inputs, out) = self.backward_args();
        launch::backward(client, cfg, inputs, out);
    }

    /// The backward's arguments: what it reads and what it writes.
    pub fn backward_args(&self) -> (BackwardInputs<R>, BackwardOutputs<R>) {
        let inputs = BackwardInputs {
            q: self.q.arg(),
            k: self.k.arg(),
            v: self.v.arg(),
            o: self.o.arg(),
            d_o: self.d_o.arg(),
            lse: self.lse.arg(),
            key_bias: self.key_bias.arg(),
            dropout_seed: self.dropout_seed.arg(),
            spans: self.spans.arg(),
        };
        let out = BackwardOutputs {
            d_q: self.d_q.arg(),
            d_k: self.d_k.arg(),
            d_v: self.d_v.arg(),
            d_q_acc: self.d_q_acc.arg(),
            d_rows: self.d_rows.arg(),
        };
        (inputs, out)
    }
}
