//! A BLAS product under Burn's fusion layer, for any CubeCL runtime: the
//! operands are drained from the fusion queue, their strides become the
//! call's flags and leading dimensions (`layout`; an operand with neither
//! order is copied contiguous), the output is allocated, the BLAS writes
//! it, and it is handed back to fusion. cuBLAS is the one BLAS `rcoa run`
//! uses (`fused`); the tests run this glue on wgpu with a host BLAS, so the
//! strides and offsets Burn's tensors really have are checked on any
//! machine.

use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use burn_cubecl::{BoolElement, CubeRuntime};

use super::layout::{Call, Op, Operand};
use crate::kernels::fusion::{empty, register, resolve, Fused};

/// The element type of all three matrices; products accumulate in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Elem {
    F32,
    F16,
    Bf16,
}

impl Elem {
    fn of(dtype: DType) -> Option<Self> {
        match dtype {
            DType::F32 => Some(Elem::F32),
            DType::F16 => Some(Elem::F16),
            DType::BF16 => Some(Elem::Bf16),
            _ => None,
        }
    }
}

/// A BLAS that writes a product into a CubeCL tensor.
pub trait Blas<R: CubeRuntime> {
    /// `out = op(P) · op(Q)` as `call` says, where `p` holds the row-major
    /// B's memory and `q` A's; returns the output (`out`, written).
    fn gemm(
        call: &Call,
        elem: Elem,
        p: &CubeTensor<R>,
        q: &CubeTensor<R>,
        out: CubeTensor<R>,
    ) -> Result<CubeTensor<R>, String>;
}

/// A 2-D tensor's BLAS layout, copied contiguous first when it has neither
/// order (`Operand::of`).
fn operand<R: CubeRuntime>(t: CubeTensor<R>) -> (CubeTensor<R>, Operand) {
    let [rows, cols] = t.meta.shape().dims::<2>();
    let strides = t.meta.strides();
    match Operand::of(rows, cols, strides[0], strides[1]) {
        Some(op) => (t, op),
        None => {
            let t = into_contiguous(t);
            let op = Operand::of(rows, cols, cols, 1).expect("a contiguous matrix");
            (t, op)
        }
    }
}

/// `x [n, k] · w [k, m]` on the BLAS `G`, or why not (the caller's matmul
/// runs then).
pub fn blas_matmul<R: CubeRuntime, BT: BoolElement, G: Blas<R>>(
    x: FloatTensor<Fused<R, BT>>,
    w: FloatTensor<Fused<R, BT>>,
) -> Result<FloatTensor<Fused<R, BT>>, String> {
    if x.shape.num_dims() != 2 || w.shape.num_dims() != 2 {
        return Err(format!("not 2-D: {:?} · {:?}", x.shape, w.shape));
    }
    let Some(elem) = Elem::of(x.dtype).filter(|_| x.dtype == w.dtype) else {
        return Err(format!("element types {:?} · {:?}", x.dtype, w.dtype));
    };
    let ([n, k], [k2, m]) = (x.shape.dims::<2>(), w.shape.dims::<2>());
    if k != k2 {
        return Err(format!("inner dims {k} and {k2}"));
    }
    let x = resolve::<R, BT>(x);
    let w = resolve::<R, BT>(w);
    let out = empty(&x, Shape::new([n, m]), x.dtype);
    let out = product_into::<R, G>(x, w, elem, out)?;
    Ok(register::<R, BT>(out))
}

/// Writes `x · w` into `out`, an `[n, m]` stored row by row whose rows may
/// start further apart than `m`; BLAS is told that leading dimension. The
/// outputs `blas_matmul` makes are contiguous (`fusion::empty`), but Burn's
/// own allocations on CUDA pad each row to a multiple of up to 512 bytes (a
/// `[64, 80]` f32's rows start 128 elements apart), and such an output
/// written as if contiguous was 2026-11-30h's wrong f32 `64×96×80` product.
fn product_into<R: CubeRuntime, G: Blas<R>>(
    x: CubeTensor<R>,
    w: CubeTensor<R>,
    elem: Elem,
    out: CubeTensor<R>,
) -> Result<CubeTensor<R>, String> {
    let ([n, k], [_, m]) = (x.meta.shape().dims::<2>(), w.meta.shape().dims::<2>());
    let (xc, a) = operand(x);
    let (wc, b) = operand(w);
    let Some(ldc) = out_rows(&out) else {
        return Err(format!(
            "an output stored with strides {:?}, not row by row",
            out.meta.strides()
        ));
    };
    let Some(call) = Call::new(n, k, m, a, b, ldc) else {
        return Err(format!(
            "{n} × {k} × {m} is empty or over BLAS's 32-bit sizes"
        ));
    };
    G::gemm(&call, elem, &wc, &xc, out)
}

/// The distance between an output's rows, where it is stored row by row.
fn out_rows<R: CubeRuntime>(out: &CubeTensor<R>) -> Option<usize> {
    let [rows, cols] = out.meta.shape().dims::<2>();
    let strides = out.meta.strides();
    match Operand::of(rows, cols, strides[0], strides[1])? {
        Operand { op: Op::N, ld } => Some(ld),
        Operand { op: Op::T, .. } => None,
    }
}

#[cfg(all(test, feature = "wgpu-kernels"))]
mod tests {
    use super::*;
    use crate::kernels::gemm::layout::reference_gemm;
    use burn::backend::wgpu::{Wgpu, WgpuDevice};
    use burn::tensor::{Tensor, TensorData, TensorPrimitive};
    use cubecl::wgpu::WgpuRuntime;
    use std::cell::RefCell;

    type B = Wgpu<f32>;

    thread_local! {
        /// The calls the host BLAS was given on this test's thread, so the
        /// test can see the flags.
        static CALLS: RefCell<Vec<Call>> = const { RefCell::new(Vec::new()) };
    }

    /// BLAS's definition run on the host over the operands' raw memory (from
    /// their handles' starts, as a device pointer would see it).
    struct HostBlas;

    impl Blas<WgpuRuntime> for HostBlas {
        fn gemm(
            call: &Call,
            elem: Elem,
            p: &CubeTensor<WgpuRuntime>,
            q: &CubeTensor<WgpuRuntime>,
            out: CubeTensor<WgpuRuntime>,
        ) -> Result<CubeTensor<WgpuRuntime>, String> {
            assert_eq!(elem, Elem::F32, "the host BLAS reads f32");
            CALLS.with(|c| c.borrow_mut().push(*call));
            let raw = |t: &CubeTensor<WgpuRuntime>| -> Vec<f64> {
                let bytes = t.client.read_one(t.handle.clone()).unwrap();
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().unwrap()) as f64)
                    .collect()
            };
            // C's memory as BLAS leaves it, `ldc` apart, under the output's own layout (its
            // gaps hold NaN, so a read of them shows).
            let c = reference_gemm(call, &raw(p), &raw(q));
            let c: Vec<u8> = c.iter().flat_map(|v| (*v as f32).to_le_bytes()).collect();
            let handle = out.client.create_from_slice(&c);
            Ok(CubeTensor::new(
                out.client.clone(),
                handle,
                out.meta.as_ref().clone(),
                out.device.clone(),
                out.dtype,
            ))
        }
    }

    fn device() -> Option<WgpuDevice> {
        let dev = || WgpuDevice::DefaultDevice;
        crate::testing::client_or_skip::<WgpuRuntime>(dev, "vulkan", "the BLAS glue tests")
            .map(|_| dev())
    }

    fn matrix(rows: usize, cols: usize, seed: usize, dev: &WgpuDevice) -> Tensor<B, 2> {
        let v: Vec<f32> = (0..rows * cols)
            .map(|i| (((i * 7 + seed * 13) % 19) as f32 - 9.0) / 9.0)
            .collect();
        // Written by a kernel (the fusion queue) just before use.
        Tensor::from_data(TensorData::new(v, [rows, cols]), dev).mul_scalar(0.5)
    }

    /// Burn's own product, the reference.
    fn burn_product(x: &Tensor<B, 2>, w: &Tensor<B, 2>) -> Vec<f32> {
        let y = x.clone().matmul(w.clone());
        y.into_data().to_vec::<f32>().unwrap()
    }

    fn cube(t: Tensor<B, 2>) -> CubeTensor<WgpuRuntime> {
        resolve::<WgpuRuntime, u32>(t.into_primitive().tensor())
    }

    /// The glue's product against Burn's matmul of the same tensors, and
    /// the flags the BLAS was given.
    fn check(x: Tensor<B, 2>, w: Tensor<B, 2>) -> Call {
        CALLS.with(|c| c.borrow_mut().clear());
        let want = burn_product(&x, &w);
        let y = blas_matmul::<WgpuRuntime, u32, HostBlas>(
            x.into_primitive().tensor(),
            w.into_primitive().tensor(),
        )
        .expect("the glue takes it");
        assert_close(y, &want);
        CALLS.with(|c| c.borrow_mut().pop()).expect("one BLAS call")
    }

    fn assert_close(y: FloatTensor<Fused<WgpuRuntime, u32>>, want: &[f32]) {
        let got = Tensor::<B, 2>::from_primitive(TensorPrimitive::Float(y))
            .into_data()
            .to_vec::<f32>()
            .unwrap();
        assert_eq!(got.len(), want.len());
        for (i, (g, r)) in got.iter().zip(want).enumerate() {
            assert!(
                (g - r).abs() <= 1e-5 * (1.0 + r.abs()),
                "[{i}]: {g} against {r}"
            );
        }
    }

    #[test]
    fn transposed_views_reach_blas_as_flags_not_copies() {
        let Some(dev) = device() else { return };
        let (n, k, m) = (12, 8, 5);
        // Forward, then the backward's two products as autodiff makes them.
        let x = matrix(n, k, 1, &dev);
        let w = matrix(k, m, 2, &dev);
        let dy = matrix(n, m, 3, &dev);
        let call = check(x.clone(), w.clone());
        assert_eq!((call.trans_p, call.trans_q), (Op::N, Op::N));
        let call = check(dy.clone(), w.transpose());
        assert_eq!((call.trans_p, call.trans_q), (Op::T, Op::N), "dy · wᵀ");
        let call = check(x.transpose(), dy);
        assert_eq!((call.trans_p, call.trans_q), (Op::N, Op::T), "xᵀ · dy");
    }

    #[test]
    fn a_slice_of_rows_reads_from_its_offset() {
        let Some(dev) = device() else { return };
        // Rows 8.. of a [40, 64] f32 matrix start 2 KiB into its buffer.
        let big = matrix(40, 64, 4, &dev);
        let w = matrix(64, 16, 5, &dev);
        check(big.clone().narrow(0, 8, 24), w.clone());
        // And a slice's transpose (the chunked loss's `hᵀ` of one chunk).
        let dy = matrix(24, 16, 6, &dev);
        check(big.narrow(0, 8, 24).transpose(), dy);
    }

    #[test]
    fn a_pitched_output_is_written_through_its_row_stride() {
        // CUDA's allocator pads rows (a [64, 80] f32 output's start 128 elements apart);
        // wgpu's does not, so the test makes such an output: 5 columns of a [12, 8].
        let Some(dev) = device() else { return };
        let (n, k, m, pitch) = (12, 7, 5, 8);
        let x = matrix(n, k, 8, &dev);
        let w = matrix(k, m, 9, &dev);
        let want = burn_product(&x, &w);
        let mut out = cube(Tensor::<B, 2>::zeros([n, pitch], &dev));
        out.meta.shape_mut()[1] = m;
        assert_eq!(out.meta.strides()[..], [pitch, 1]);
        CALLS.with(|c| c.borrow_mut().clear());
        let y = product_into::<WgpuRuntime, HostBlas>(cube(x), cube(w), Elem::F32, out)
            .expect("the glue takes it");
        let call = CALLS.with(|c| c.borrow_mut().pop()).expect("one BLAS call");
        assert_eq!(call.ldc, pitch as i32);
        assert_close(register::<WgpuRuntime, u32>(y), &want);
    }

    #[test]
    fn an_output_stored_by_columns_is_refused() {
        let Some(dev) = device() else { return };
        let out = cube(Tensor::<B, 2>::zeros([5, 12], &dev).transpose());
        let (x, w) = (cube(matrix(12, 7, 1, &dev)), cube(matrix(7, 5, 2, &dev)));
        let why = product_into::<WgpuRuntime, HostBlas>(x, w, Elem::F32, out).unwrap_err();
        assert!(why.contains("not row by row"), "{why}");
    }

    #[test]
    fn an_operand_with_neither_order_is_copied_first() {
        // Burn's own ops copy such a view before it gets here (a reshape
        // does), so the test makes one: every other column of a [6, 16].
        let Some(dev) = device() else { return };
        let full = matrix(6, 16, 7, &dev);
        let host = full.clone().into_data().to_vec::<f32>().unwrap();
        let want: Vec<f32> = (0..6)
            .flat_map(|i| (0..8).map(move |j| (i, j)))
            .map(|(i, j)| host[i * 16 + 2 * j])
            .collect();
        let mut t = resolve::<WgpuRuntime, u32>(full.into_primitive().tensor());
        t.meta.shape_mut()[1] = 8;
        t.meta.strides_mut()[1] = 2;
        let (t, op) = operand(t);
        assert_eq!(op, Operand { op: Op::N, ld: 8 });
        let bytes = t.client.read_one(t.handle.clone()).unwrap();
        let got: Vec<f32> = bytes
            .chunks_exact(4)
            .take(48)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect();
        assert_eq!(got, want);
    }
}
