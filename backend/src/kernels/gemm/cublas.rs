//! cuBLAS, loaded at run time (cudarc's `dlopen`, like libcuda and NVRTC),
//! queued on CubeCL's stream so its products run in order with CubeCL's
//! kernels and no host sync is added.
//!
//! One cuBLAS handle per thread and CUDA context: CubeCL gives each thread
//! its own stream, and a handle must not be used by two threads at once.
//! Each handle computes in a workspace taken from CubeCL's pool, not one
//! cuBLAS allocates itself, so the memory probe sees it (`WORKSPACE_BYTES`).
//! Handles and workspaces live as long as their thread.

use std::cell::RefCell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use cubecl::cuda::CudaRuntime;
use cubecl::prelude::ComputeClient;
use cudarc::cublas::sys as cb;
use cudarc::driver::sys as cu;

use super::glue::Elem;
use super::layout::{Call, Op};

/// The workspace each handle computes in: what cuBLAS's own default is on
/// Hopper (and what PyTorch gives it there).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// Whether a cuBLAS library loads (the names cudarc tries: `libcublas.so`,
/// `libcublas.so.13`, `.12`, ... on the library path), checked once.
pub fn available() -> bool {
    static PRESENT: OnceLock<bool> = OnceLock::new();
    // SAFETY: opening the library runs its initialisers, which have no
    // preconditions; the handle is closed again.
    *PRESENT.get_or_init(|| unsafe { cb::is_culib_present() })
}

/// Whether fp32 products read their operands as TF32 on tensor cores: a plan
/// that computes in `tf32`. A plan in `fp32` gets exact fp32 products, as
/// PyTorch's default (`allow_tf32 = False`). Set once per run, before its
/// first product ([`set_tf32`]).
static TF32: AtomicBool = AtomicBool::new(false);

/// fp32 products as TF32 (`precision { compute = tf32 }`) or exact.
pub fn set_tf32(on: bool) {
    TF32.store(on, Ordering::Relaxed);
}

pub fn tf32() -> bool {
    TF32.load(Ordering::Relaxed)
}

/// What cuBLAS accumulates and rounds in: f32 always; for fp32 matrices,
/// operands rounded to TF32 where asked.
fn compute_type(elem: Elem, tf32: bool) -> cb::cublasComputeType_t {
    match elem {
        Elem::F32 if tf32 => cb::cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
        _ => cb::cublasComputeType_t::CUBLAS_COMPUTE_32F,
    }
}

fn data_type(elem: Elem) -> cb::cudaDataType_t {
    match elem {
        Elem::F32 => cb::cudaDataType_t::CUDA_R_32F,
        Elem::F16 => cb::cudaDataType_t::CUDA_R_16F,
        Elem::Bf16 => cb::cudaDataType_t::CUDA_R_16BF,
    }
}

/// Device addresses of one product's matrices, in [`Call`]'s slots.
#[derive(Clone, Copy, Debug)]
pub struct Pointers {
    pub p: u64,
    pub q: u64,
    pub c: u64,
}

struct Entry {
    context: cu::CUcontext,
    handle: cb::cublasHandle_t,
    /// The stream the handle was last given (giving a stream resets the
    /// workspace, so both are set again only when it changes).
    stream: cu::CUstream,
    workspace: (cubecl::server::Handle, u64),
}

thread_local! {
    static HANDLES: RefCell<Vec<Entry>> = const { RefCell::new(Vec::new()) };
}

fn driver(what: &str, r: cu::CUresult) -> Result<(), String> {
    match r {
        cu::CUresult::CUDA_SUCCESS => Ok(()),
        e => Err(format!("{what}: {e:?}")),
    }
}

fn status(what: &str, s: cb::cublasStatus_t) -> Result<(), String> {
    match s {
        cb::cublasStatus_t::CUBLAS_STATUS_SUCCESS => Ok(()),
        e => Err(format!("{what}: {e:?}")),
    }
}

/// Makes `stream`'s context current on this thread (CubeCL makes it current
/// on the thread that runs its commands, which may be another).
fn enter_context(stream: cu::CUstream) -> Result<cu::CUcontext, String> {
    let mut context = std::ptr::null_mut();
    let mut current = std::ptr::null_mut();
    // SAFETY: plain queries and a context switch on a live stream's context.
    unsafe {
        driver("cuStreamGetCtx", cu::cuStreamGetCtx(stream, &mut context))?;
        driver("cuCtxGetCurrent", cu::cuCtxGetCurrent(&mut current))?;
        if current != context {
            driver("cuCtxSetCurrent", cu::cuCtxSetCurrent(context))?;
        }
    }
    Ok(context)
}

/// This thread's handle for `context`, bound to `stream` with its workspace.
fn with_handle<T>(
    client: &ComputeClient<CudaRuntime>,
    context: cu::CUcontext,
    stream: cu::CUstream,
    f: impl FnOnce(cb::cublasHandle_t) -> Result<T, String>,
) -> Result<T, String> {
    HANDLES.with(|handles| {
        let mut handles = handles.borrow_mut();
        let i = match handles.iter().position(|e| e.context == context) {
            Some(i) => i,
            None => {
                let mut handle = std::ptr::null_mut();
                // SAFETY: the context is current (`enter_context`).
                status("cublasCreate", unsafe { cb::cublasCreate_v2(&mut handle) })?;
                let memory = client.empty(WORKSPACE_BYTES);
                let ptr = client
                    .get_resource(memory.clone())
                    .map_err(|e| format!("the cuBLAS workspace: {e:?}"))?
                    .resource()
                    .ptr;
                handles.push(Entry {
                    context,
                    handle,
                    stream: std::ptr::null_mut(),
                    workspace: (memory, ptr),
                });
                handles.len() - 1
            }
        };
        let entry = &mut handles[i];
        if entry.stream != stream {
            let (_, ptr) = entry.workspace;
            // SAFETY: a live handle, a live stream of its context, and a
            // workspace the entry keeps allocated for the handle's life.
            unsafe {
                status(
                    "cublasSetStream",
                    cb::cublasSetStream_v2(entry.handle, stream as cb::cudaStream_t),
                )?;
                status(
                    "cublasSetWorkspace",
                    cb::cublasSetWorkspace_v2(entry.handle, ptr as *mut c_void, WORKSPACE_BYTES),
                )?;
            }
            entry.stream = stream;
        }
        f(entry.handle)
    })
}

fn op(op: Op) -> cb::cublasOperation_t {
    match op {
        Op::N => cb::cublasOperation_t::CUBLAS_OP_N,
        Op::T => cb::cublasOperation_t::CUBLAS_OP_T,
    }
}

/// Queues `C = op(P) · op(Q)` on `stream`, all matrices `elem`, accumulated
/// in f32 on tensor cores where the type has them (fp32 ones only as TF32,
/// [`set_tf32`]). Returns once queued.
///
/// # Safety
///
/// The pointers must address device memory of `stream`'s context that stays
/// allocated until the stream reaches the product: P and Q holding the
/// matrices `call` describes, C `call.ldc · call.n` elements.
pub unsafe fn gemm(
    client: &ComputeClient<CudaRuntime>,
    call: &Call,
    elem: Elem,
    ptrs: Pointers,
    stream: cu::CUstream,
) -> Result<(), String> {
    let context = enter_context(stream)?;
    with_handle(client, context, stream, |handle| {
        let (one, zero) = (1.0f32, 0.0f32);
        let (ty, compute) = (data_type(elem), compute_type(elem, tf32()));
        let s = cubecl::cuda::kernel_timing::time_external("cublas_gemm", stream, || {
            // SAFETY: the caller's pointers; alpha and beta are f32 as
            // both 32F compute types require; `Call::new` checked the sizes.
            unsafe {
                cb::cublasGemmEx(
                    handle,
                    op(call.trans_p),
                    op(call.trans_q),
                    call.m,
                    call.n,
                    call.k,
                    (&one as *const f32).cast(),
                    ptrs.p as *const c_void,
                    ty,
                    call.ld_p,
                    ptrs.q as *const c_void,
                    ty,
                    call.ld_q,
                    (&zero as *const f32).cast(),
                    ptrs.c as *mut c_void,
                    ty,
                    call.ldc,
                    compute,
                    cb::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
        });
        status("cublasGemmEx", s)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_fp32_products_of_a_tf32_plan_round_to_tf32() {
        use cb::cublasComputeType_t::{CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32};
        assert_eq!(compute_type(Elem::F32, false), CUBLAS_COMPUTE_32F);
        assert_eq!(compute_type(Elem::F32, true), CUBLAS_COMPUTE_32F_FAST_TF32);
        for elem in [Elem::F16, Elem::Bf16] {
            for tf32 in [false, true] {
                assert_eq!(compute_type(elem, tf32), CUBLAS_COMPUTE_32F);
            }
        }
    }
}
