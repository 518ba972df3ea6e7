//! rcoa patch: compile a run's kernels ahead of it, on every core.
//!
//! CubeCL 0.10 compiles a kernel with NVRTC when it is first launched, on
//! the device's thread, so a model's few hundred kernels compile one after
//! another (414.7 s for a 350M decoder on an H100). The kernels a run
//! launches cannot be listed without running it, but the run does not need
//! correct values to find them: the shapes, and so the kernels, do not
//! depend on the data. So:
//!
//! 1. `start_recording`: from then on every launch in this process is
//!    recorded when the PTX cache does not hold it, and *not executed*. The
//!    run goes on over buffers nobody wrote, and reads back zeros
//!    (`CudaServer::read`) so that the host's checks do not stop it. Its
//!    results are meaningless, and the process must not keep anything it
//!    tuned (the caller points the autotune cache elsewhere).
//! 2. `take_pending` gives the recorded launches; `Pending::lower` lowers one
//!    to CUDA C++ from any thread (and checks what a launch would: the shared
//!    memory); `compile` runs NVRTC on one of them,
//!    from any thread (NVRTC programs are independent), for the GPU's own
//!    architecture, so the result is a cubin the driver loads without its
//!    PTX→SASS step (PTX when NVRTC cannot give one).
//! 3. `KernelCache::insert` stores each result where `CudaContext::compile_kernel`
//!    looks first, under the same key; a later process finds them there.
//!
//! `create_pch` and `compile_with_pch` let step 2 parse each distinct set of
//! headers once instead of once per kernel.

use crate::CudaCompiler;
use crate::compute::context::PtxCacheEntry;
use cubecl_common::cache::CacheOption;
use cubecl_core::ExecutionMode;
use cubecl_core::compilation_cache::CompilationCache;
use cubecl_core::hash::StableHash;
use cubecl_cpp::shared::CompilationOptions;
use cubecl_runtime::compiler::CubeTask;
use std::collections::HashSet;
use std::ffi::{CStr, CString, c_char};
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};

/// A recorded kernel, lowered: what NVRTC needs, and what the PTX cache
/// stores beside the compiled image.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RecordedKernel {
    /// `KernelId::stable_hash()` in hex: the PTX cache's key.
    pub hash: String,
    pub entrypoint_name: String,
    pub shared_mem_bytes: usize,
    /// The CUDA C++ source.
    pub source: String,
    /// NVRTC's options, as `compile_kernel` passes them.
    pub options: Vec<String>,
}

impl RecordedKernel {
    pub fn key(&self) -> Option<StableHash> {
        StableHash::from_str_radix(&self.hash, 16).ok()
    }
}

static RECORDING: AtomicBool = AtomicBool::new(false);
static COMPILED_AT_LAUNCH: Mutex<Vec<LaunchCompile>> = Mutex::new(Vec::new());

/// A kernel this process compiled with NVRTC at its launch (a cache miss),
/// and how long that stalled the device's thread: code generation, NVRTC
/// and ptxas, not the module load.
#[derive(Clone, Debug, PartialEq)]
pub struct LaunchCompile {
    pub entrypoint_name: String,
    pub seconds: f64,
}

/// Kernels this process compiled with NVRTC at their launch, in launch
/// order: after compiling ahead, what the recording did not reach, and the
/// time each added to the step that met it.
pub fn compiled_at_launch() -> Vec<LaunchCompile> {
    COMPILED_AT_LAUNCH
        .lock()
        .map(|c| c.clone())
        .unwrap_or_default()
}

pub(crate) fn note_compiled_at_launch(entrypoint_name: &str, seconds: f64) {
    if let Ok(mut c) = COMPILED_AT_LAUNCH.lock() {
        c.push(LaunchCompile {
            entrypoint_name: entrypoint_name.to_string(),
            seconds,
        });
    }
}

/// A launch recorded but not yet lowered: lowering (CubeCL's expansion,
/// optimizer and C++ generation) waits for [`Pending::lower`], which the
/// caller runs on every core instead of on the device's thread.
pub struct Pending {
    pub(crate) hash: StableHash,
    pub(crate) task: Box<dyn CubeTask<CudaCompiler>>,
    pub(crate) mode: ExecutionMode,
    pub(crate) options: CompilationOptions,
    pub(crate) max_shared_mem_bytes: usize,
    pub(crate) nvrtc_options: Vec<String>,
}

static RECORDED: Mutex<(Vec<Pending>, Option<HashSet<StableHash>>)> =
    Mutex::new((Vec::new(), None));

/// From now on, launches in this process are recorded and not executed.
/// There is no way back: the process's device state is meaningless after.
pub fn start_recording() {
    RECORDING.store(true, Ordering::SeqCst);
}

/// Whether `start_recording` was called in this process.
pub fn recording() -> bool {
    RECORDING.load(Ordering::Relaxed)
}

/// Whether `hash` was recorded already (kernels repeat; each is kept once).
pub(crate) fn recorded(hash: StableHash) -> bool {
    let guard = RECORDED.lock().unwrap_or_else(|p| p.into_inner());
    guard.1.as_ref().is_some_and(|seen| seen.contains(&hash))
}

pub(crate) fn record(kernel: Pending) {
    let mut guard = RECORDED.lock().unwrap_or_else(|p| p.into_inner());
    let (list, seen) = &mut *guard;
    if seen.get_or_insert_with(HashSet::new).insert(kernel.hash) {
        list.push(kernel);
    }
}

/// The kernels recorded so far, in launch order; the list starts again.
pub fn take_pending() -> Vec<Pending> {
    let mut guard = RECORDED.lock().unwrap_or_else(|p| p.into_inner());
    std::mem::take(&mut guard.0)
}

impl Pending {
    /// The kernel's name, for messages.
    pub fn name(&self) -> String {
        self.task.name().to_string()
    }

    /// Lower to CUDA C++, from any thread. A kernel whose lowering fails, or
    /// whose shared memory exceeds the device's, is refused with why: its
    /// launch would fail the same way in a run.
    pub fn lower(&self) -> Result<RecordedKernel, String> {
        let compiled = self
            .task
            .compile(
                &mut Default::default(),
                &self.options,
                self.mode,
                self.task.address_type(),
            )
            .map_err(|e| e.to_string().lines().next().unwrap_or_default().to_string())?;
        let shared_mem_bytes = compiled
            .repr
            .as_ref()
            .map(|repr| repr.shared_memory_size())
            .unwrap_or(0);
        if shared_mem_bytes > self.max_shared_mem_bytes {
            return Err(format!(
                "{shared_mem_bytes} bytes of shared memory, above the device's {}",
                self.max_shared_mem_bytes
            ));
        }
        Ok(RecordedKernel {
            hash: format!("{:032x}", self.hash),
            entrypoint_name: compiled.entrypoint_name,
            shared_mem_bytes,
            source: compiled.source,
            options: self.nvrtc_options.clone(),
        })
    }
}

/// NVRTC's options for a GPU of compute capability `sm` (90 for an H100):
/// what `CudaContext::compile_kernel` has always passed.
pub fn nvrtc_options(sm: u32) -> Vec<String> {
    use crate::install::{cccl_include_path, include_path};
    let arch = if sm >= 90 {
        format!("--gpu-architecture=sm_{sm}a")
    } else {
        format!("--gpu-architecture=sm_{sm}")
    };
    let cccl = cccl_include_path();
    let mut options = vec![
        arch,
        format!("--include-path={}", include_path().to_str().unwrap()),
        "-lineinfo".to_string(),
    ];
    if cccl.exists() {
        options.push(format!("--include-path={}", cccl.to_str().unwrap()));
    }
    options
}

/// The C++ compiler's options on a GPU of compute capability `sm` (90 for an
/// H100): what `CudaRuntime::client` sets from the device, which only its
/// warp size can change (32 on every NVIDIA GPU).
pub fn compilation_options(sm: u32) -> CompilationOptions {
    use cubecl_cpp::shared::CppSupportedFeatures;
    CompilationOptions {
        warp_size: 32,
        supports_features: CppSupportedFeatures {
            fast_math: true,
            grid_constants: sm >= 70,
            fast_tanh: sm >= 75 && cudarc::driver::sys::CUDA_VERSION >= 12080,
            clusters: sm >= 90,
            elect_sync: sm >= 90,
        },
    }
}

/// Lower a kernel to CUDA C++ for a GPU of compute capability `sm`, without
/// one: what its first launch there would hand NVRTC. `kernel` may come from
/// any runtime's launch code (the expansion is runtime-independent), so a
/// machine without a GPU can build a kernel with another runtime's client
/// and check that its CUDA source compiles.
pub fn lower_for<K: cubecl_runtime::kernel::CubeKernel>(
    kernel: K,
    sm: u32,
) -> Result<RecordedKernel, String> {
    let hash = kernel.id().stable_hash();
    let task: Box<dyn CubeTask<CudaCompiler>> = Box::new(cubecl_runtime::kernel::KernelTask::<
        CudaCompiler,
        K,
    >::new(kernel));
    Pending {
        hash,
        task,
        mode: ExecutionMode::Checked,
        options: compilation_options(sm),
        max_shared_mem_bytes: max_shared_memory(sm),
        nvrtc_options: nvrtc_options(sm),
    }
    .lower()
}

/// The `wmma` shapes and types a GPU of compute capability `sm` compiles,
/// which `CudaRuntime::client` registers as the device's `cmma` features.
/// cubecl-cpp's list claims bf16 from 7.0 and 8-bit integers from 7.0, but
/// CUDA's `mma.h` defines bf16 fragments from 8.0 (NVRTC for `sm_75`:
/// incomplete type `fragment<matrix_a, 16, 16, 16, __nv_bfloat16, ..>`) and
/// integer ones from 7.2. Claimed there, a kernel that picks tensor cores by
/// the features (Burn's matmuls, rcoa's flash attention) fails to compile
/// on a V100 or a T4 instead of taking its other path.
pub fn wmma_combinations(sm: u32) -> cubecl_cpp::shared::SupportedMmaCombinations {
    use cubecl_core::ir::{ElemType, FloatKind, StorageType};
    use cubecl_cpp::DialectWmmaCompiler;
    let arch = cubecl_cpp::cuda::arch::CudaArchitecture { version: sm };
    let compiles = |t: StorageType| match t {
        StorageType::Scalar(ElemType::Float(FloatKind::BF16)) => sm >= 80,
        StorageType::Scalar(ElemType::Int(_) | ElemType::UInt(_)) => sm >= 72,
        _ => true,
    };
    crate::WmmaCompiler::supported_wmma_combinations(&arch)
        .into_iter()
        .filter(|c| compiles(c.a_type) && compiles(c.b_type))
        .collect()
}

/// The opt-in shared memory per block of compute capability `sm` (CUDA's
/// programming guide, "Technical Specifications per Compute Capability").
pub fn max_shared_memory(sm: u32) -> usize {
    let kib = match sm {
        90.. => 227,
        80 | 87 => 163,
        86 | 89 => 99,
        70 | 72 => 96,
        75 => 64,
        _ => 48,
    };
    kib * 1024
}

/// A compiled kernel image: a cubin for the GPU NVRTC targeted, else PTX.
pub struct Image {
    pub bytes: Vec<c_char>,
    pub cubin: bool,
}

/// NVRTC on one recorded kernel. Safe to call from several threads at once.
pub fn compile(kernel: &RecordedKernel) -> Result<Image, String> {
    compile_with(kernel, &[]).map(|(image, _)| image)
}

/// [`compile`], with ptxas's report of the kernel's resources (`-v`:
/// registers, stack frame, spills, shared memory) from NVRTC's log: what a
/// kernel costs an SM, known without a GPU.
pub fn compile_verbose(kernel: &RecordedKernel) -> Result<(Image, String), String> {
    compile_with(kernel, &["--ptxas-options=-v".to_string()])
}

fn compile_with(kernel: &RecordedKernel, extra: &[String]) -> Result<(Image, String), String> {
    let source = CString::new(kernel.source.as_str()).map_err(|e| e.to_string())?;
    let program = cudarc::nvrtc::result::create_program(source.as_c_str(), None)
        .map_err(|e| format!("{e:?}"))?;
    let options: Vec<String> = kernel.options.iter().chain(extra).cloned().collect();
    // SAFETY: `program` was created above and is destroyed once, at the end;
    // the buffers passed to NVRTC are sized by its own size queries.
    unsafe {
        let result = image(program, &options);
        let _ = cudarc::nvrtc::result::destroy_program(program);
        result
    }
}

unsafe fn program_log(program: cudarc::nvrtc::sys::nvrtcProgram) -> String {
    // SAFETY: the caller's program is alive; NVRTC sizes the buffer.
    unsafe {
        cudarc::nvrtc::result::get_program_log(program)
            .map(|l| CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned())
            .unwrap_or_default()
    }
}

unsafe fn image(
    program: cudarc::nvrtc::sys::nvrtcProgram,
    options: &[String],
) -> Result<(Image, String), String> {
    use cudarc::nvrtc::sys;
    unsafe {
        if cudarc::nvrtc::result::compile_program(program, options).is_err() {
            let log = program_log(program);
            return Err(format!("[Compilation Error]\n{log}"));
        }
        let log = program_log(program);
        // A real architecture (`sm_90a`) makes NVRTC run ptxas too; the
        // cubin then spares the driver its JIT at every load.
        let mut size = 0usize;
        if sys::nvrtcGetCUBINSize(program, &mut size).result().is_ok() && size > 0 {
            let mut bytes: Vec<c_char> = vec![0; size];
            if sys::nvrtcGetCUBIN(program, bytes.as_mut_ptr())
                .result()
                .is_ok()
            {
                return Ok((Image { bytes, cubin: true }, log));
            }
        }
        cudarc::nvrtc::result::get_ptx(program)
            .map(|bytes| {
                (
                    Image {
                        bytes,
                        cubin: false,
                    },
                    log,
                )
            })
            .map_err(|e| format!("{e:?}"))
    }
}

/// The leading `#include` lines of a kernel's CUDA source: what a
/// precompiled header of it holds. CubeCL writes a kernel's includes first,
/// chosen by what it uses (16-bit types, `wmma`, barriers, TMA), so a run's
/// few hundred kernels share a handful of these.
pub fn header_prefix(source: &str) -> &str {
    let end: usize = source
        .split_inclusive('\n')
        .take_while(|line| line.starts_with("#include"))
        .map(str::len)
        .sum();
    &source[..end]
}

/// Whether this NVRTC takes precompiled headers (`--create-pch`,
/// `--use-pch`: CUDA 12.8 and later).
pub fn precompiled_headers_supported() -> bool {
    let (mut major, mut minor) = (0, 0);
    // SAFETY: NVRTC writes two ints.
    let ok = unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .is_ok();
    ok && (major, minor) >= (12, 8)
}

/// Writes NVRTC's precompiled header of `prefix` (a [`header_prefix`]) for
/// the NVRTC `options` to `path`. Parsing CUDA's headers is much of a small
/// kernel's compile: `cuda/barrier` and cooperative groups, which CubeCL
/// includes for barriers and TMA, take 1.5 s of NVRTC time per kernel
/// (12.9, on the CPU that wrote this), 0.3 s with their precompiled state.
pub fn create_pch(prefix: &str, options: &[String], path: &Path) -> Result<(), String> {
    let stub = RecordedKernel {
        hash: String::new(),
        entrypoint_name: "rcoa_pch_stub".to_string(),
        shared_mem_bytes: 0,
        source: format!("{prefix}extern \"C\" __global__ void rcoa_pch_stub() {{}}\n"),
        options: options.to_vec(),
    };
    let (_, log) = compile_with(&stub, &[format!("--create-pch={}", path.display())])?;
    if path.exists() {
        Ok(())
    } else {
        Err(format!("NVRTC wrote no precompiled header: {}", log.trim()))
    }
}

/// [`compile`], reading the kernel's headers from `pch` (a [`create_pch`]
/// of its [`header_prefix`] and options). The image is the one [`compile`]
/// gives (the headers' parse is all a precompiled header holds). Should
/// NVRTC refuse it with the header, the kernel is compiled without: a
/// precompiled header costs time, never a kernel.
pub fn compile_with_pch(kernel: &RecordedKernel, pch: &Path) -> Result<Image, String> {
    compile_with(kernel, &[format!("--use-pch={}", pch.display())])
        .map(|(image, _)| image)
        .or_else(|_| compile(kernel))
}

/// The PTX cache of the compilation-cache directory `root` (what
/// `CubeClRuntimeConfig`'s `compilation.cache` names), the file
/// `CudaContext::compile_kernel` reads.
pub struct KernelCache {
    cache: CompilationCache<StableHash, PtxCacheEntry>,
}

impl KernelCache {
    pub fn open(root: &Path) -> Self {
        KernelCache {
            cache: CompilationCache::new("ptx", CacheOption::default().name("cuda").root(root)),
        }
    }

    pub fn contains(&self, kernel: &RecordedKernel) -> bool {
        kernel.key().is_some_and(|k| self.cache.get(&k).is_some())
    }

    pub fn insert(&mut self, kernel: &RecordedKernel, image: Image) -> Result<(), String> {
        let key = kernel
            .key()
            .ok_or_else(|| format!("bad kernel hash `{}`", kernel.hash))?;
        self.cache
            .insert(
                key,
                PtxCacheEntry::new(
                    kernel.entrypoint_name.clone(),
                    kernel.shared_mem_bytes,
                    image.bytes,
                ),
            )
            .map_err(|e| format!("{e:?}"))
    }
}
