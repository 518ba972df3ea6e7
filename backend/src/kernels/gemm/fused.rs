//! `ExecBackend::matmul_2d` on `burn::backend::Cuda<f32>`: cuBLAS when
//! `RCOA_MATMUL=cublas` asks for it and the library loads, Burn's matmul
//! (CubeCL's kernels, fused with their neighbours) otherwise.

use burn::backend::Cuda;
use burn::tensor::ops::{FloatTensor, FloatTensorOps};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

use super::cublas::{self, Pointers};
use super::glue::{blas_matmul, Blas, Elem};
use super::layout::Call;

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
        Engine::Cublas if cublas::available() && cublas::tf32() => {
            "matmuls on cuBLAS, fp32 ones as TF32"
        }
        Engine::Cublas if cublas::available() => "matmuls on cuBLAS",
        Engine::Cublas => "matmuls on CubeCL (RCOA_MATMUL=cublas, but no cuBLAS loads)",
        Engine::CubeCl => "matmuls on CubeCL",
    }
}

fn note_once(why: String) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| eprintln!("note: {why}"));
}

thread_local! {
    /// A test's engine for this thread's products, over `RCOA_MATMUL`'s.
    static ENGINE_HERE: std::cell::Cell<Option<Engine>> = const { std::cell::Cell::new(None) };
}

/// Runs `f` with this thread's products on `engine` (the tests compare the two engines in
/// one process, where `RCOA_MATMUL` is read once).
#[cfg(test)]
pub(crate) fn with_engine<T>(engine: Engine, f: impl FnOnce() -> T) -> T {
    let before = ENGINE_HERE.replace(Some(engine));
    let out = f();
    ENGINE_HERE.set(before);
    out
}

/// `x [n, k] · w [k, m]` by the engine `RCOA_MATMUL` asks for.
pub fn matmul_2d(x: FloatTensor<Backend>, w: FloatTensor<Backend>) -> FloatTensor<Backend> {
    if ENGINE_HERE.get().unwrap_or_else(engine_asked) == Engine::Cublas {
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

/// cuBLAS as the glue's BLAS: the operands' device memory, resolved on this
/// thread's stream (which waits for their writes), and the call queued
/// there.
struct Cublas;

impl Blas<CudaRuntime> for Cublas {
    fn gemm(
        call: &Call,
        elem: Elem,
        p: &CubeTensor<CudaRuntime>,
        q: &CubeTensor<CudaRuntime>,
        out: CubeTensor<CudaRuntime>,
    ) -> Result<CubeTensor<CudaRuntime>, String> {
        if crate::prebuild::recording() {
            // A recording executes nothing; the output's values mean nothing.
            return Ok(out);
        }
        let client = out.client.clone();
        let resource = |t: &CubeTensor<CudaRuntime>| {
            client
                .get_resource(t.handle.clone())
                .map_err(|e| format!("a matrix's device memory: {e:?}"))
        };
        // The resources keep the memory from reuse until the product is queued.
        let (pr, qr, cr) = (resource(p)?, resource(q)?, resource(&out)?);
        let ptrs = Pointers {
            p: pr.resource().ptr,
            q: qr.resource().ptr,
            c: cr.resource().ptr,
        };
        let stream = cr.resource().stream;
        // SAFETY: the three resources are this stream's view of live tensors
        // (p and q of the shapes `call` was built from, out `call.ldc ·
        // call.n` elements, contiguous); their memory is reused only by work
        // queued after this.
        unsafe { cublas::gemm(&client, call, elem, ptrs, stream)? };
        Ok(out)
    }
}

/// `x [n, k] · w [k, m]` on cuBLAS, or why not (the caller's matmul runs).
pub fn cublas_matmul(
    x: FloatTensor<Backend>,
    w: FloatTensor<Backend>,
) -> Result<FloatTensor<Backend>, String> {
    blas_matmul::<CudaRuntime, u8, Cublas>(x, w)
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
