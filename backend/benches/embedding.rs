//! The token embedding's gradient timed both ways in one run: Burn's `select_assign` (one
//! unit per column walking every token) against `kernels::embedding` (units per column and
//! id bucket), for a model's tokens, vocabulary and width: milliseconds, the bytes each
//! moves over its time, our speed over Burn's, and the largest difference between the two
//! (so a fast wrong kernel shows).
//!
//!     cargo bench -p rcoa-backend --features cuda --bench embedding -- [tokens vocab hidden]
//!
//! The default is the 350M decoder's step, 4 × 2048 tokens into 32000 × 1024, then a 1B's
//! (32000 × 2048), in bf16 (f16 on wgpu, whose shaders have no bf16). On CUDA with `--features cuda` and a device; else, with
//! `--features wgpu-kernels`, on a Vulkan device (lavapipe: the CPU, so its ratio says
//! little about a GPU).

mod common;

#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
mod bench {
    use burn::tensor::backend::Backend;
    use burn::tensor::ops::FloatTensor;
    use burn::tensor::{
        Distribution, ElementConversion, FloatDType, Int, Tensor, TensorData, TensorPrimitive,
    };
    use rcoa_backend::ops::ExecBackend;

    const WARMUP: usize = 3;
    const REPEATS: usize = 20;

    /// Mean seconds of `f` over `REPEATS` calls queued back to back, after warming up.
    fn time<B: Backend>(dev: &B::Device, f: impl FnMut() -> FloatTensor<B>) -> f64 {
        crate::common::mean_seconds::<B, _>(dev, WARMUP, REPEATS, f)
    }

    /// Token ids as text has them: a few ids very often, the rest spread over the vocabulary.
    fn ids(tokens: usize, vocab: usize) -> Vec<i32> {
        (0..tokens)
            .map(|t| {
                let r = (t as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 33;
                let id = if r.is_multiple_of(4) {
                    r % 64
                } else {
                    r % vocab as u64
                };
                id as i32
            })
            .collect()
    }

    fn float<B: Backend>(p: FloatTensor<B>) -> Tensor<B, 2> {
        Tensor::from_primitive(TensorPrimitive::Float(p))
    }

    /// One shape both ways.
    fn shape<B: ExecBackend>(
        tokens: usize,
        vocab: usize,
        hidden: usize,
        dtype: FloatDType,
        dev: &B::Device,
    ) {
        let ids =
            Tensor::<B, 2, Int>::from_data(TensorData::new(ids(tokens, vocab), [1, tokens]), dev);
        let dy = Tensor::<B, 3>::random([1, tokens, hidden], Distribution::Uniform(-1.0, 1.0), dev)
            .cast(dtype);
        let table = Tensor::<B, 2>::zeros([vocab, hidden], dev).cast(dtype);
        let prim = |t: &Tensor<B, 2>| t.clone().into_primitive().tensor();
        let dy_prim = || dy.clone().into_primitive().tensor();
        let burns = || B::embedding_backward(prim(&table), dy_prim(), ids.clone().into_primitive());
        let ours = || B::embedding_grad(prim(&table), dy_prim(), ids.clone().into_primitive());
        let t_burn = time::<B>(dev, burns);
        let t_ours = time::<B>(dev, ours);
        let diff = (float::<B>(ours()).cast(FloatDType::F32)
            - float::<B>(burns()).cast(FloatDType::F32))
        .abs()
        .max()
        .into_scalar()
        .elem::<f64>();
        // Each writes the zeroed table once and reads each token's gradient row once.
        let bytes = 2.0 * (vocab * hidden + tokens * hidden) as f64;
        println!(
            "{tokens:>6} tokens into {vocab:>6} × {hidden:>5}  Burn {:>8.3} ms {:>7.1} GB/s  ours {:>8.3} ms {:>7.1} GB/s  {:>6.2} ×  max diff {diff:.2e}",
            t_burn * 1e3,
            bytes / t_burn / 1e9,
            t_ours * 1e3,
            bytes / t_ours / 1e9,
            t_burn / t_ours,
        );
    }

    pub fn run<B: ExecBackend>(dev: &B::Device, device: &str, dtype: FloatDType, args: &[usize]) {
        println!("{device}, {dtype:?}; ratio: Burn's time over ours (above 1: ours faster)");
        if let [tokens, vocab, hidden, ..] = *args {
            shape::<B>(tokens, vocab, hidden, dtype, dev);
        } else {
            shape::<B>(8192, 32000, 1024, dtype, dev);
            shape::<B>(8192, 32000, 2048, dtype, dev);
        }
    }
}

#[cfg(any(feature = "cuda", feature = "wgpu-kernels"))]
use burn::tensor::FloatDType;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    #[cfg(feature = "cuda")]
    if rcoa_backend::cuda::preflight().is_ok() {
        use burn::backend::{cuda::CudaDevice, Cuda};
        if let Some(dev) = common::device::<Cuda<f32>>(|| CudaDevice::new(0)) {
            return bench::run::<Cuda<f32>>(&dev, "CUDA", FloatDType::BF16, &args);
        }
    }
    #[cfg(feature = "wgpu-kernels")]
    {
        use burn::backend::{wgpu::WgpuDevice, Wgpu};
        if let Some(dev) = common::device::<Wgpu<f32>>(|| WgpuDevice::DefaultDevice) {
            // WGSL has no bf16.
            return bench::run::<Wgpu<f32>>(&dev, "Vulkan (wgpu)", FloatDType::F16, &args);
        }
    }
    let _ = args;
    println!("no CUDA or Vulkan device (or neither feature, cuda, wgpu-kernels): nothing timed");
}
