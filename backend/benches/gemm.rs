//! The linear layers' products timed on both engines in one run: Burn's
//! matmul (CubeCL's autotuned kernels, what `rcoa run` uses by default)
//! against cuBLAS (`RCOA_MATMUL=cublas`, `kernels::gemm`). For each product
//! of one layer of the model (and the head), forward `x · w` and backward
//! `dy · wᵀ`, `xᵀ · dy` with the transposes as views, as autodiff hands them
//! over: milliseconds, TFLOP/s, cuBLAS's speed over CubeCL's, and the largest
//! difference between the two outputs (so a fast wrong product shows). Then
//! the step's total over all layers.
//!
//!     cargo bench -p rcoa-backend --features cuda --bench gemm -- [tokens hidden ffn vocab layers]
//!
//! The default is the 350M decoder at 4 × 2048 tokens (hidden 1024, ffn
//! 2816, vocab 32000, 24 layers), bf16. Needs a CUDA device and a cuBLAS
//! library on the library path; prints why not and times nothing otherwise.
//!
//! It uses `rcoa run`'s kernel cache (`RCOA_CACHE_DIR`, as a run sets it):
//! after a run of the same model, CubeCL's matmuls are compiled and tuned
//! already, so the bench times them rather than their tuning (twenty
//! candidates compiled per shape otherwise).

mod common;

#[cfg(feature = "cuda")]
mod bench {
    use burn::backend::cuda::CudaDevice;
    use burn::backend::Cuda;
    use burn::tensor::ops::FloatTensor;
    use burn::tensor::{Distribution, FloatDType, Tensor, TensorPrimitive};
    use rcoa_backend::kernels::gemm::{cublas, fused};

    type B = Cuda<f32>;
    const WARMUP: usize = 3;
    const REPEATS: usize = 20;

    /// Mean seconds of `f` over `REPEATS` calls queued back to back, after
    /// warming up (the autotuner's first runs among them).
    fn time(dev: &CudaDevice, f: impl FnMut() -> Tensor<B, 2>) -> f64 {
        crate::common::mean_seconds::<B, _>(dev, WARMUP, REPEATS, f)
    }

    fn prim(t: &Tensor<B, 2>) -> FloatTensor<B> {
        t.clone().into_primitive().tensor()
    }

    fn tensor(p: FloatTensor<B>) -> Tensor<B, 2> {
        Tensor::from_primitive(TensorPrimitive::Float(p))
    }

    fn random(shape: [usize; 2], dev: &CudaDevice) -> Tensor<B, 2> {
        Tensor::<B, 2>::random(shape, Distribution::Uniform(-1.0, 1.0), dev).cast(FloatDType::BF16)
    }

    fn largest_difference(a: Tensor<B, 2>, b: Tensor<B, 2>) -> (f32, f32) {
        let scale = b.clone().abs().max().cast(FloatDType::F32).into_scalar();
        let diff = (a.cast(FloatDType::F32) - b.cast(FloatDType::F32))
            .abs()
            .max()
            .into_scalar();
        (diff, scale)
    }

    /// Times one product both ways; returns (CubeCL, cuBLAS) seconds.
    fn product(name: &str, x: Tensor<B, 2>, w: Tensor<B, 2>, dev: &CudaDevice) -> (f64, f64) {
        let ([n, k], [_, m]) = (x.dims(), w.dims());
        let flops = 2.0 * (n * k * m) as f64;
        let cubecl = time(dev, || x.clone().matmul(w.clone()));
        let ours = || tensor(fused::cublas_matmul(prim(&x), prim(&w)).expect("cuBLAS takes it"));
        let blas = time(dev, ours);
        let (diff, scale) = largest_difference(ours(), x.clone().matmul(w.clone()));
        println!(
            "{name:<22} {n:>6} × {k:>5} × {m:>6}  CubeCL {:>8.3} ms {:>6.1} TFLOP/s  cuBLAS {:>8.3} ms {:>6.1} TFLOP/s  {:>5.2} ×  max diff {diff:.2e} of {scale:.2e}",
            cubecl * 1e3,
            flops / cubecl / 1e12,
            blas * 1e3,
            flops / blas / 1e12,
            cubecl / blas,
        );
        (cubecl, blas)
    }

    /// The three products of a linear layer `[d_in → d_out]` over `tokens`.
    fn linear(
        name: &str,
        tokens: usize,
        d_in: usize,
        d_out: usize,
        dev: &CudaDevice,
    ) -> (f64, f64) {
        let x = random([tokens, d_in], dev);
        let w = random([d_in, d_out], dev);
        let dy = random([tokens, d_out], dev);
        let f = product(&format!("{name} x·w"), x.clone(), w.clone(), dev);
        let dx = product(&format!("{name} dy·wᵀ"), dy.clone(), w.transpose(), dev);
        let dw = product(&format!("{name} xᵀ·dy"), x.transpose(), dy, dev);
        (f.0 + dx.0 + dw.0, f.1 + dx.1 + dw.1)
    }

    pub fn run(args: &[usize]) {
        let arg = |i: usize, d: usize| args.get(i).copied().unwrap_or(d);
        let (tokens, hidden, ffn, vocab, layers) = (
            arg(0, 8192),
            arg(1, 1024),
            arg(2, 2816),
            arg(3, 32000),
            arg(4, 24),
        );
        // rcoa run's cache: its tunings and compiled kernels.
        match rcoa_backend::cuda::preflight() {
            Ok(info) => {
                let dir = rcoa_backend::cuda::cache_dir(&info);
                if let Err(e) = rcoa_backend::cuda::configure_cache(&dir) {
                    println!("the kernel cache {}: {e}", dir.display());
                }
            }
            Err(e) => {
                println!("no CUDA: {e}; nothing timed");
                return;
            }
        }
        // Without a device the first use panics; keep its message off the output.
        let Some(dev) = crate::common::device::<B>(|| CudaDevice::new(0)) else {
            println!("no CUDA device: nothing timed");
            return;
        };
        if !cublas::available() {
            println!(
                "no cuBLAS library on the library path (libcublas.so.13 or .12): nothing timed"
            );
            return;
        }
        println!("bf16, {tokens} tokens, hidden {hidden}, ffn {ffn}, vocab {vocab}, {layers} layers; ratio: CubeCL's time over cuBLAS's (above 1: cuBLAS faster)");
        // Per layer: q, k, v, o (hidden → hidden), gate and up, down.
        let attn = linear("attention proj", tokens, hidden, hidden, &dev);
        let up = linear("gate/up", tokens, hidden, ffn, &dev);
        let down = linear("down", tokens, ffn, hidden, &dev);
        let head = linear("head", tokens, hidden, vocab, &dev);
        let step = |e: fn(&(f64, f64)) -> f64| {
            layers as f64 * (4.0 * e(&attn) + 2.0 * e(&up) + e(&down)) + e(&head)
        };
        let (c, b) = (step(|t| t.0), step(|t| t.1));
        let flops = 6.0
            * tokens as f64
            * (layers as f64 * (4 * hidden * hidden + 3 * hidden * ffn) as f64
                + (hidden * vocab) as f64);
        println!(
            "a step's linear products: CubeCL {:.1} ms ({:.0} TFLOP/s), cuBLAS {:.1} ms ({:.0} TFLOP/s): {:.2} ×",
            c * 1e3,
            flops / c / 1e12,
            b * 1e3,
            flops / b / 1e12,
            c / b
        );
    }
}

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    #[cfg(feature = "cuda")]
    bench::run(&args);
    #[cfg(not(feature = "cuda"))]
    {
        let _ = args;
        println!("the gemm bench needs --features cuda: nothing timed");
    }
}
