//! `ExecBackend::matmul_2d` on `burn::backend::Cuda<f32>`: cuBLAS when
//! `RCOA_MATMUL=cublas` asks for it and the library loads, Burn's matmul
//! (CubeCL's kernels, fused with their neighbours) otherwise.

use burn::backend::Cuda;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn::tensor::{DType, Shape};
use burn_cubecl::kernel::into_contiguous;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

use super::cublas::{self, Elem, Pointers};
use super::layout::{Call, Operand};
use crate::kernels::fusion::{empty, register, resolve};

type Backend = Cuda<f32>;

/// Which library multiplies `matmul_2d`'s matrices on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engine {
    /// Burn's matmul: CubeCL's kernels, autotuned.
    CubeCl,
    /// cuBLAS (`cublasGemmEx`), where the library loads.
    Cublas,
}

/// `RCOA_MATMUL`: `cublas`, or `cubecl` (the default until cuBLAS is timed
/// on a GPU, `docs/burn-h100.md`). Any other value is refused once.
pub fn engine_asked() -> Engine {
    static ASKED: std::sync::OnceLock<Engine> = std::sync::OnceLock::new();
    *ASKED.get_or_init(|| {
        let var = std::env::var("RCOA_MATMUL").ok();
        parse_engine(var.as_deref()).unwrap_or_else(|why| {
            eprintln!("warning: {why}");
            Engine::CubeCl
        })
    })
}

fn parse_engine(var: Option<&str>) -> Result<Engine, String> {
    match var.map(str::trim) {
        None | Some("cubecl") => Ok(Engine::CubeCl),
        Some("cublas") => Ok(Engine::Cublas),
        Some(v) => Err(format!(
            "RCOA_MATMUL={v} is neither `cublas` nor `cubecl`; CubeCL's matmuls run"
        )),
    }
}

/// Which library multiplies, for the run's device line.
pub fn engine_in_use() -> &'static str {
    match engine_asked() {
        Engine::Cublas if cublas::available() => "matmuls on cuBLAS",
        Engine::Cublas => "matmuls on CubeCL (RCOA_MATMUL=cublas, but no cuBLAS loads)",
        Engine::CubeCl => "matmuls on CubeCL",
    }
}

fn note_once(why: String) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| eprintln!("note: {why}"));
}

/// `x [n, k] · w [k, m]` by the engine `RCOA_MATMUL` asks for.
pub fn matmul_2d(x: FloatTensor<Backend>, w: FloatTensor<Backend>) -> FloatTensor<Backend> {
    if engine_asked() == Engine::Cublas {
        if !cublas::available() {
            note_once(
                "RCOA_MATMUL=cublas, but no cuBLAS library loads (libcublas.so.13 or .12 on \
                 the library path); CubeCL's matmuls run"
                    .into(),
            );
        } else {
            match cublas_matmul(x.clone(), w.clone()) {
                Ok(y) => return y,
                Err(why) => note_once(format!("a matmul runs on CubeCL instead of cuBLAS: {why}")),
            }
        }
    }
    Backend::float_matmul(x, w)
}

fn elem(dtype: DType) -> Option<Elem> {
    match dtype {
        DType::F32 => Some(Elem::F32),
        DType::F16 => Some(Elem::F16),
        DType::BF16 => Some(Elem::Bf16),
        _ => None,
    }
}

/// A 2-D tensor's BLAS layout, copied contiguous first when it has neither
/// order (`Operand::of`).
fn operand(t: CubeTensor<CudaRuntime>) -> (CubeTensor<CudaRuntime>, Operand) {
    let [rows, cols] = t.meta.shape().dims::<2>();
    let strides = t.meta.strides();
    match Operand::of(rows, cols, strides[0], strides[1]) {
        Some(op) => (t, op),
        None => {
            let t = into_contiguous(t);
            (
                t,
                Operand::of(rows, cols, cols, 1).expect("a contiguous matrix"),
            )
        }
    }
}

/// `x [n, k] · w [k, m]` on cuBLAS, or why not (the caller's matmul runs).
pub fn cublas_matmul(
    x: FloatTensor<Backend>,
    w: FloatTensor<Backend>,
) -> Result<FloatTensor<Backend>, String> {
    if x.shape.num_dims() != 2 || w.shape.num_dims() != 2 {
        return Err(format!("not 2-D: {:?} · {:?}", x.shape, w.shape));
    }
    let Some(ty) = elem(x.dtype).filter(|_| x.dtype == w.dtype) else {
        return Err(format!("element types {:?} · {:?}", x.dtype, w.dtype));
    };
    let ([n, k], [k2, m]) = (x.shape.dims::<2>(), w.shape.dims::<2>());
    if k != k2 {
        return Err(format!("inner dims {k} and {k2}"));
    }
    let (xc, a) = operand(resolve::<CudaRuntime, u8>(x));
    let (wc, b) = operand(resolve::<CudaRuntime, u8>(w));
    let Some(call) = Call::new(n, k, m, a, b) else {
        return Err(format!(
            "{n} × {k} × {m} is empty or over cuBLAS's 32-bit sizes"
        ));
    };
    let out = empty(&xc, Shape::new([n, m]), xc.dtype);
    if crate::prebuild::recording() {
        // A recording executes nothing; the output's values mean nothing.
        return Ok(register::<CudaRuntime, u8>(out));
    }
    let client = xc.client.clone();
    let resource = |t: &CubeTensor<CudaRuntime>| {
        client
            .get_resource(t.handle.clone())
            .map_err(|e| format!("a matrix's device memory: {e:?}"))
    };
    // Each lookup makes this thread's stream wait for the tensor's writes;
    // the resources keep the memory from reuse until the product is queued.
    let (p, q, c) = (resource(&wc)?, resource(&xc)?, resource(&out)?);
    let ptrs = Pointers {
        p: p.resource().ptr,
        q: q.resource().ptr,
        c: c.resource().ptr,
    };
    let stream = c.resource().stream;
    // SAFETY: the three resources are this stream's view of live tensors
    // (x and w of the shapes `call` was built from, out `n · m` elements
    // contiguous); their memory is reused only by work queued after this.
    unsafe { cublas::gemm(&client, &call, ty, ptrs, stream)? };
    drop((p, q, c, xc, wc));
    Ok(register::<CudaRuntime, u8>(out))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rcoa_matmul_names_an_engine_or_is_refused() {
        assert_eq!(parse_engine(None), Ok(Engine::CubeCl));
        assert_eq!(parse_engine(Some("cubecl")), Ok(Engine::CubeCl));
        assert_eq!(parse_engine(Some(" cublas ")), Ok(Engine::Cublas));
        let why = parse_engine(Some("cuBLAS")).unwrap_err();
        assert!(
            why.contains("RCOA_MATMUL=cuBLAS") && why.contains("CubeCL"),
            "{why}"
        );
    }
}
