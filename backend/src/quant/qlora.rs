//! The QLoRA base projection `y = x · dequant(W)` as one autodiff node whose
//! only saved state is the packed NF4 weight (codes and scales, which the
//! layer holds anyway): the backward dequantizes again for
//! `dx = dy · dequant(W)ᵀ`, and `W` is frozen, so it gets no gradient and no
//! fp32 copy of it outlives the forward or the backward.
//!
//! The executor calls [`nf4_linear`]; the LoRA path (`x · A · B`) is ordinary
//! Burn ops beside it. `W` is `[d_in, d_out]`, Burn's `Linear` layout
//! (bitsandbytes quantizes PyTorch's `[d_out, d_in]`: the blocks run along the
//! other axis, which changes nothing but the bytes' order).
//!
//! Neither pass dequantizes the whole weight at once: it takes
//! [`chunk_rows`] rows of `W` (whole NF4 blocks, about [`CHUNK_VALUES`]
//! values) at a time, so the dequantized transient is bounded by the chunk,
//! not by the weight. The rows of `W` are the input features, so the forward
//! sums `x[:, rows] · W[rows, :]` into `y`, and the backward writes
//! `dy · W[rows, :]ᵀ` into `dx[:, rows]` (in place where the backend can).
//! In a 16-bit dtype the forward's sum is rounded once per chunk, not once:
//! a few more roundings of `y`, which the dense bf16 matmul does not have.
//!
//! Transient per use on ndarray (fp32), measured with the counting
//! allocator: `201/16 · C + ~1.2 KiB` bytes for `C = chunk_rows · d_out`
//! dequantized values (the byte indices widened to i64, the two nibble
//! halves, their interleaving, the scaled values), while the op's output
//! (`y` or `dx`) is already live when there is more than one chunk. A whole
//! `[4096, 14336]` projection at once would be 704 MiB; a chunk is 50 MiB.
//!
//! Why 4 Mi values (16 MiB of fp32 weight) a chunk: each chunk costs a few
//! kernel launches on CUDA (two table gathers, the scaling, the matmul, the
//! accumulation; about ten), some tens of microseconds, against a matmul of
//! `n · 4 Mi` multiply-adds; a `[4096, 4096]` weight is 4 chunks and
//! Mistral-7B's largest projections (58.7 M values) 14 or 15, so the
//! launches stay small beside the matmuls while the transient is a quarter
//! to a fifteenth of the whole weight's.

use super::nf4::{DeviceScales, Nf4Tensor, BLOCK};
use crate::ops::ExecBackend;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{unary, Backward, Ops, OpsKind};
use burn::backend::autodiff::Autodiff;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Tensor, TensorPrimitive};

/// `x · dequant(W)` for `x [.., d_in]`.
pub fn nf4_linear<B: ExecBackend, const D: usize>(
    x: Tensor<B, D>,
    w: &Nf4Tensor<B>,
) -> Tensor<B, D> {
    let dims = x.dims();
    let rows: usize = dims[..D - 1].iter().product();
    let x2 = x.reshape([rows, dims[D - 1]]);
    let y = B::nf4_matmul(x2.into_primitive().tensor(), w);
    let mut out = dims;
    out[D - 1] = w.shape[1];
    Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y)).reshape(out)
}

/// Weight values dequantized at once, at most (but see [`chunk_rows`]).
pub const CHUNK_VALUES: usize = 1 << 22;

/// Rows of a `[rows, cols]` NF4 weight per chunk of at most `limit` values
/// ([`CHUNK_VALUES`] in use): a multiple of `64 / gcd(cols, 64)` rows, so
/// every chunk starts on an NF4 block, as many as fit; but at least one such
/// multiple, so a weight with more than `limit / 64` columns (or an odd
/// count above `limit / 64`) takes chunks larger than `limit`.
pub fn chunk_rows(shape: [usize; 2], limit: usize) -> usize {
    let [rows, cols] = shape;
    let cols = cols.max(1);
    let align = BLOCK / gcd(cols, BLOCK);
    let fit = limit / cols / align * align;
    fit.max(align).min(rows.max(1))
}

fn gcd(a: usize, b: usize) -> usize {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// `(start, len)` of each chunk of rows of `w`.
fn chunks(shape: [usize; 2], limit: usize) -> impl Iterator<Item = (usize, usize)> {
    let step = chunk_rows(shape, limit);
    (0..shape[0])
        .step_by(step)
        .map(move |r| (r, step.min(shape[0] - r)))
}

/// The plain computation: `y = Σ x[:, rows] · dequant(W[rows, :])`, each
/// chunk dequantized in the input's dtype.
pub(crate) fn nf4_matmul_plain<B: Backend>(x: FloatTensor<B>, w: &Nf4Tensor<B>) -> FloatTensor<B> {
    matmul_chunked::<B>(x, w, CHUNK_VALUES)
}

fn matmul_chunked<B: Backend>(x: FloatTensor<B>, w: &Nf4Tensor<B>, limit: usize) -> FloatTensor<B> {
    let x = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(x));
    let [d_in, d_out] = w.shape;
    let n = x.dims()[0];
    let mut y: Option<Tensor<B, 2>> = None;
    for (start, len) in chunks(w.shape, limit) {
        let wc = w.rows(start, len).dequantize().cast(x.dtype());
        let xc = if len == d_in {
            x.clone()
        } else {
            x.clone().narrow(1, start, len)
        };
        let part = xc.matmul(wc);
        y = Some(match y {
            None => part,
            Some(y) => y + part,
        });
    }
    // No input features: the empty sum.
    y.unwrap_or_else(|| Tensor::zeros([n, d_out], (&x.device(), x.dtype())))
        .into_primitive()
        .tensor()
}

/// `dx = dy · dequant(W)ᵀ`, `dx[:, rows] = dy · dequant(W[rows, :])ᵀ` a
/// chunk at a time, written into one `dx` (in place where the backend can).
fn input_grad_chunked<B: Backend>(
    dy: FloatTensor<B>,
    w: &Nf4Tensor<B>,
    limit: usize,
) -> FloatTensor<B> {
    let dy = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(dy));
    let [d_in, _] = w.shape;
    let n = dy.dims()[0];
    let part = |start: usize, len: usize| {
        let wt = w.rows(start, len).dequantize().cast(dy.dtype()).transpose();
        dy.clone().matmul(wt)
    };
    if chunk_rows(w.shape, limit) >= d_in {
        return part(0, d_in).into_primitive().tensor();
    }
    let mut dx = Tensor::<B, 2>::zeros([n, d_in], (&dy.device(), dy.dtype()));
    for (start, len) in chunks(w.shape, limit) {
        dx = dx.slice_assign([0..n, start..start + len], part(start, len));
    }
    dx.into_primitive().tensor()
}

impl<B: AutodiffBackend> Nf4Tensor<B> {
    /// The same packed weight on the inner backend (no copy).
    pub fn inner(&self) -> Nf4Tensor<B::InnerBackend> {
        let scales = match &self.scales {
            DeviceScales::Fp32(a) => DeviceScales::Fp32(a.clone().inner()),
            DeviceScales::Double {
                codes,
                absmax2,
                offset,
            } => DeviceScales::Double {
                codes: codes.clone().inner(),
                absmax2: absmax2.clone().inner(),
                offset: *offset,
            },
        };
        Nf4Tensor {
            packed: self.packed.clone().inner(),
            scales,
            shape: self.shape,
        }
    }

    /// The packed weight of the inner backend on this one (no copy).
    pub fn from_inner(w: Nf4Tensor<B::InnerBackend>) -> Self {
        let scales = match w.scales {
            DeviceScales::Fp32(a) => DeviceScales::Fp32(Tensor::from_inner(a)),
            DeviceScales::Double {
                codes,
                absmax2,
                offset,
            } => DeviceScales::Double {
                codes: Tensor::from_inner(codes),
                absmax2: Tensor::from_inner(absmax2),
                offset,
            },
        };
        Nf4Tensor {
            packed: Tensor::from_inner(w.packed),
            scales,
            shape: w.shape,
        }
    }
}

#[derive(Debug)]
struct Nf4Matmul;

impl<B: Backend> Backward<B, 1> for Nf4Matmul {
    /// The packed weight: dequantized again in the backward.
    type State = Nf4Tensor<B>;

    fn backward(
        self,
        ops: Ops<Self::State, 1>,
        grads: &mut Gradients,
        _checkpointer: &mut Checkpointer,
    ) {
        let w = ops.state;
        unary::<B, _>(ops.parents, ops.node, grads, |dy| {
            input_grad_chunked::<B>(dy, &w, CHUNK_VALUES)
        });
    }
}

/// [`ExecBackend::nf4_matmul`] under autodiff.
pub(crate) fn nf4_matmul_autodiff<B: ExecBackend, C: CheckpointStrategy>(
    x: FloatTensor<Autodiff<B, C>>,
    w: &Nf4Tensor<Autodiff<B, C>>,
) -> FloatTensor<Autodiff<B, C>> {
    let w = w.inner();
    match Nf4Matmul
        .prepare::<C>([x.node.clone()])
        .compute_bound()
        .stateful()
    {
        OpsKind::Tracked(prep) => {
            let y = B::nf4_matmul(x.primitive, &w);
            prep.finish(w, y)
        }
        OpsKind::UnTracked(prep) => prep.finish(B::nf4_matmul(x.primitive, &w)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::nf4::Nf4Weight;
    use crate::quant::tests::det_weights;
    use burn::tensor::{Distribution, Tolerance};

    type Cpu = Autodiff<burn::backend::NdArray<f32>>;

    /// Forward equals `x · dequant(W)` with the dequantized weight as a plain
    /// tensor; dx equals that matmul's gradient; nothing of W is trainable.
    #[test]
    fn nf4_linear_matches_dequantized_matmul() {
        // Burn's CPU generator is global: hold the trainers' lock while drawing.
        let _serial = crate::tests::serial();
        let device = Default::default();
        for double in [false, true] {
            let (din, dout) = (96, 40);
            let w =
                Nf4Weight::quantize(&det_weights(din * dout, 0.002), [din, dout], double).unwrap();
            let wd = w.to_device::<Cpu>(&device).unwrap();
            let dense = Tensor::<Cpu, 1>::from_floats(w.dequantize().unwrap().as_slice(), &device)
                .reshape([din, dout]);
            let x0 = Tensor::<Cpu, 3>::random([2, 5, din], Distribution::Normal(0.0, 1.0), &device);
            let up =
                Tensor::<Cpu, 3>::random([2, 5, dout], Distribution::Normal(0.0, 1.0), &device);

            let x = x0.clone().require_grad();
            let y = nf4_linear(x.clone(), &wd);
            let grads = (y.clone() * up.clone()).sum().backward();
            let dx = x.grad(&grads).expect("x has a gradient");
            if let crate::quant::nf4::DeviceScales::Fp32(a) = &wd.scales {
                assert!(a.grad(&grads).is_none(), "the scales are frozen");
            }

            let xr = x0.require_grad();
            let dense = dense.require_grad();
            let yr = xr.clone().matmul(dense.clone().unsqueeze::<3>());
            let gr = (yr.clone() * up).sum().backward();
            let tol = Tolerance::<f32>::absolute(1e-5);
            y.inner()
                .into_data()
                .assert_approx_eq(&yr.inner().into_data(), tol);
            dx.into_data()
                .assert_approx_eq(&xr.grad(&gr).unwrap().into_data(), tol);
        }
    }

    /// Without a tracked input nothing is recorded and the value is the same.
    #[test]
    fn untracked_input_gives_the_same_value() {
        // Burn's CPU generator is global: hold the trainers' lock while drawing.
        let _serial = crate::tests::serial();
        let device = Default::default();
        let w = Nf4Weight::quantize(&det_weights(64 * 8, 0.01), [64, 8], false).unwrap();
        let wd = w.to_device::<Cpu>(&device).unwrap();
        let x = Tensor::<Cpu, 2>::random([3, 64], Distribution::Default, &device);
        let a = nf4_linear(x.clone(), &wd);
        let b = nf4_linear(x.require_grad(), &wd);
        a.into_data()
            .assert_approx_eq(&b.inner().into_data(), Tolerance::<f32>::absolute(0.0));
    }

    /// A 4096 x 4096 weight is 4 chunks and Mistral-7B's projections 14 or
    /// 15; every chunk starts on an NF4 block and, where one aligned row
    /// group fits, holds at most the limit.
    #[test]
    fn chunks_are_whole_blocks_and_few() {
        let count = |shape: [usize; 2]| chunks(shape, CHUNK_VALUES).count();
        assert_eq!(count([4096, 4096]), 4);
        assert_eq!(count([14336, 4096]), 14);
        assert_eq!(count([4096, 14336]), 15);
        assert_eq!(count([96, 40]), 1);
        for (shape, limit) in [
            ([4096, 4096], CHUNK_VALUES),
            ([4096, 14336], CHUNK_VALUES),
            ([150, 7], 500),
            ([600, 40], 640),
            ([33, 100], 64),
        ] {
            let mut next = 0;
            for (start, len) in chunks(shape, limit) {
                assert_eq!(start, next, "{shape:?}: chunks tile the rows");
                assert_eq!(start * shape[1] % BLOCK, 0, "{shape:?}: {start}");
                let align = BLOCK / gcd(shape[1], BLOCK);
                if align * shape[1] <= limit {
                    assert!(len * shape[1] <= limit, "{shape:?}: {len} rows");
                }
                next = start + len;
            }
            assert_eq!(next, shape[0]);
        }
    }

    /// The dense reference: the CPU dequantization as a Burn tensor.
    fn dense<B: Backend>(w: &Nf4Weight, device: &B::Device) -> Tensor<B, 2> {
        Tensor::<B, 1>::from_floats(w.dequantize().unwrap().as_slice(), device).reshape(w.shape)
    }

    /// Chunked forward and input gradient equal `x · W` and `dy · Wᵀ` with
    /// the dequantized `W`: chunks that split double quantization's
    /// 256-block groups, an odd column count (chunks of 64 rows) whose last
    /// chunk ends in the padded block, more rows than one chunk's.
    #[test]
    fn chunked_matmul_equals_the_dense_one() {
        type B = burn::backend::NdArray<f32>;
        let device = Default::default();
        for ([din, dout], limit) in [([600, 40], 640), ([150, 7], 500), ([33, 100], 64)] {
            for double in [false, true] {
                let w = Nf4Weight::quantize(&det_weights(din * dout, 0.002), [din, dout], double)
                    .unwrap();
                assert!(chunks(w.shape, limit).count() > 2);
                let wd = w.to_device::<B>(&device).unwrap();
                let dense = dense::<B>(&w, &device);
                let x = Tensor::<B, 2>::from_floats(
                    Tensor::<B, 1>::from_floats(det_weights(5 * din, 0.01).as_slice(), &device)
                        .reshape([5, din])
                        .into_data(),
                    &device,
                );
                let dy =
                    Tensor::<B, 1>::from_floats(det_weights(5 * dout, 0.03).as_slice(), &device)
                        .reshape([5, dout]);
                let y = matmul_chunked::<B>(x.clone().into_primitive().tensor(), &wd, limit);
                let dx = input_grad_chunked::<B>(dy.clone().into_primitive().tensor(), &wd, limit);
                let tol = Tolerance::<f32>::rel_abs(1e-5, 1e-6);
                Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y))
                    .into_data()
                    .assert_approx_eq(&x.matmul(dense.clone()).into_data(), tol);
                Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(dx))
                    .into_data()
                    .assert_approx_eq(&dy.matmul(dense.transpose()).into_data(), tol);
            }
        }
    }

    /// Through autodiff at the real chunk size: a weight of two chunks gives
    /// the dense model's output and input gradient.
    #[test]
    fn weight_larger_than_a_chunk_matches_the_dense_model() {
        let _serial = crate::tests::serial();
        let device = Default::default();
        let (din, dout) = (520, 8192);
        assert_eq!(chunks([din, dout], CHUNK_VALUES).count(), 2);
        let w = Nf4Weight::quantize(&det_weights(din * dout, 0.002), [din, dout], true).unwrap();
        let wd = w.to_device::<Cpu>(&device).unwrap();
        let x0 = Tensor::<Cpu, 2>::random([3, din], Distribution::Normal(0.0, 1.0), &device);
        let up = Tensor::<Cpu, 2>::random([3, dout], Distribution::Normal(0.0, 1.0), &device);

        let x = x0.clone().require_grad();
        let y = nf4_linear(x.clone(), &wd);
        let grads = (y.clone() * up.clone()).sum().backward();
        let dx = x.grad(&grads).expect("x has a gradient");

        let xr = x0.require_grad();
        let yr = xr.clone().matmul(dense::<Cpu>(&w, &device));
        let gr = (yr.clone() * up).sum().backward();
        let tol = Tolerance::<f32>::rel_abs(1e-5, 1e-5);
        y.inner()
            .into_data()
            .assert_approx_eq(&yr.inner().into_data(), tol);
        dx.into_data()
            .assert_approx_eq(&xr.grad(&gr).unwrap().into_data(), tol);
    }

    /// Set in the child process of [`transient_is_bounded_by_the_chunk`].
    const CHILD: &str = "RCOA_QLORA_TRANSIENT_CHILD";

    /// The peak heap bytes above those live before the call, counted by the
    /// test binary's [`crate::memory::TrackingAlloc`] (process-wide, hence
    /// the child process that runs nothing else).
    fn peak_of(f: impl FnOnce()) -> u64 {
        use crate::memory::{AllocProbe, MemoryProbe};
        let mut probe = AllocProbe::new().expect("the test binary counts allocations");
        f();
        probe.sample();
        probe.step_peak()
    }

    /// Measures in a process of its own: other tests allocate meanwhile.
    #[test]
    fn transient_is_bounded_by_the_chunk() {
        crate::testing::run_ignored_in_child("quant::qlora::tests::transient_in_child", CHILD);
    }

    /// A 1024 x 1024 weight in chunks of 64 Ki values: forward and input
    /// gradient stay below a bound of the chunk's size that dequantizing
    /// the whole weight exceeds.
    #[test]
    #[ignore = "run in its own process by transient_is_bounded_by_the_chunk"]
    fn transient_in_child() {
        assert!(std::env::var_os(CHILD).is_some(), "run by its parent test");
        type B = burn::backend::NdArray<f32>;
        let device = Default::default();
        let (n, d, limit) = (8, 1024, 1 << 16);
        for double in [false, true] {
            let w = Nf4Weight::quantize(&det_weights(d * d, 0.002), [d, d], double).unwrap();
            let wd = w.to_device::<B>(&device).unwrap();
            let x = Tensor::<B, 2>::random([n, d], Distribution::Default, &device);
            let run = |limit: usize| {
                let fwd = peak_of(|| {
                    let y = matmul_chunked::<B>(x.clone().into_primitive().tensor(), &wd, limit);
                    drop(y);
                });
                let bwd = peak_of(|| {
                    let dx =
                        input_grad_chunked::<B>(x.clone().into_primitive().tensor(), &wd, limit);
                    drop(dx);
                });
                (fwd, bwd)
            };
            run(limit); // thread pools and first-use buffers
            let (chunked, whole) = (run(limit), run(usize::MAX));
            println!("double {double}: chunked {chunked:?} whole {whole:?} bytes");
            // Measured: 201/16 bytes per dequantized value and ~1 KiB of
            // tables, with the output (8 x 1024 fp32) live meanwhile.
            let out = (n * d * 4) as u64;
            let bound = 13 * limit as u64 + out + (64 << 10);
            assert!(
                chunked.0 <= bound && chunked.1 <= bound,
                "{chunked:?} > {bound}"
            );
            let weight = (d * d) as u64;
            assert!(whole.0 > 12 * weight && whole.1 > 12 * weight, "{whole:?}");
        }
    }
}
