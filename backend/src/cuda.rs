//! CUDA: preflight, CubeCL's persistent caches, memory sampling, and the
//! `Autodiff<Cuda>` instantiation of the executor.
//!
//! cudarc loads libcuda and libnvrtc with dlopen at first use and panics when
//! one is missing; NVRTC then needs the CUDA headers. So before any Burn call
//! the preflight opens both libraries itself, initialises the driver, reads the
//! GPU's name and the driver version, and looks for `cuda_fp16.h` where
//! CubeCL will (`$CUDA_PATH/include`, else `/usr/local/cuda/include`, ...).
//! Anything missing is a `RunError::CudaUnavailable` (exit 2), never a panic.
//! When NVRTC is not on the loader path but sits in `$CUDA_PATH/lib64`, the
//! preflight loads it from there and keeps it loaded, so cudarc's later
//! dlopen by name finds it (the loader matches already-loaded sonames).
//!
//! Kernels are compiled at run time by NVRTC (minutes for a new model shape)
//! and matmul kernels are autotuned. Both caches are made persistent under
//! `$RCOA_CACHE_DIR` or `$XDG_CACHE_HOME/rcoa/cubecl/<gpu>-driver<version>`
//! (`~/.cache/...`), keyed by GPU and driver because compiled kernels and
//! tuning results are only valid for them. A cold cache is reported so the
//! user knows the first step compiles.
//!
//! Order matters (docs/cold-start.md): the driver's own PTX→SASS cache is
//! configured through the environment, which the driver reads once, at
//! `cuInit`, and the preflight's is the first; so the preflight sets it
//! (`configure_driver_jit_cache`) between finding the driver and `cuInit`.
//! CubeCL's configuration is read once per process, at its first use, so
//! `configure_cache` sets it before any CubeCL call.

use crate::memory::MemoryProbe;
use crate::{Event, RunError, RunOptions, Summary};
use cubecl::cuda::{CudaDevice, CudaRuntime};
use cubecl::Runtime;
use rcoa_compiler::lowered::LoweredPlan;
use std::path::PathBuf;

/// What the preflight found.
#[derive(Clone, Debug)]
pub struct CudaInfo {
    pub gpu: String,
    /// GPU 0's memory, bytes (`cuDeviceTotalMem`, what PyTorch's `total_memory` reads).
    pub memory_bytes: u64,
    /// e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    pub include_dir: PathBuf,
}

const DRIVER_NAMES: &[&str] = &["libcuda.so", "libcuda.so.1"];
const NVRTC_NAMES: &[&str] = &[
    "libnvrtc.so",
    "libnvrtc.so.13",
    "libnvrtc.so.12",
    "libnvrtc.so.11",
];

fn open_any(names: &[&str]) -> Option<libloading::Library> {
    names
        .iter()
        .find_map(|n| unsafe { libloading::Library::new(*n) }.ok())
}

/// Check the driver, NVRTC and headers; never panics.
pub fn preflight() -> Result<CudaInfo, RunError> {
    let unavailable = |s: String| RunError::CudaUnavailable(s);
    let driver = open_any(DRIVER_NAMES).ok_or_else(|| {
        unavailable("the NVIDIA driver library (libcuda.so) was not found: is there a GPU and its driver on this machine?".into())
    })?;
    // Loading the library did not initialise CUDA; `query_driver` will.
    configure_driver_jit_cache();
    let include_dir = compiler()?;
    let (gpu, memory_bytes, driver_version) =
        unsafe { query_driver(&driver) }.map_err(unavailable)?;
    // Keep the driver loaded: cudarc opens it again by name.
    std::mem::forget(driver);
    Ok(CudaInfo {
        gpu,
        memory_bytes,
        driver_version,
        include_dir,
    })
}

/// NVRTC, loaded for cudarc, and the CUDA headers it includes: what compiles
/// kernels, which needs no GPU. Returns the headers' directory; never panics.
pub fn compiler() -> Result<PathBuf, RunError> {
    let unavailable = |s: String| RunError::CudaUnavailable(s);
    let cuda_path = cubecl::cuda::install::cuda_path();
    if open_any(NVRTC_NAMES).is_none() {
        // Load it from the toolkit directory and keep it loaded for cudarc.
        let dirs: Vec<PathBuf> = cuda_path
            .iter()
            .flat_map(|p| [p.join("lib64"), p.join("lib")])
            .collect();
        let found = dirs.iter().find_map(|d| {
            let entries = std::fs::read_dir(d).ok()?;
            let mut libs: Vec<PathBuf> = entries
                .filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name()
                        .and_then(|n| n.to_str())
                        .is_some_and(|n| n.starts_with("libnvrtc.so"))
                })
                .collect();
            libs.sort();
            libs.into_iter()
                .find_map(|p| unsafe { libloading::Library::new(&p) }.ok())
        });
        match found {
            Some(lib) => std::mem::forget(lib),
            None => {
                return Err(unavailable(format!(
                    "NVRTC (libnvrtc.so), which compiles CubeCL's kernels, was not found on the library path{}; \
                     install the CUDA toolkit and add its lib64 to LD_LIBRARY_PATH",
                    cuda_path.as_ref().map(|p| format!(" nor in {}/lib64", p.display())).unwrap_or_default()
                )))
            }
        }
    }
    let include_dir = cuda_path.as_ref().map(|p| p.join("include")).filter(|d| d.join("cuda_fp16.h").exists()).ok_or_else(|| {
        unavailable(format!(
            "the CUDA headers NVRTC needs (cuda_fp16.h, cuda_bf16.h) were not found in {}; set CUDA_PATH to the toolkit",
            cuda_path.map(|p| p.join("include").display().to_string()).unwrap_or_else(|| "$CUDA_PATH/include or /usr/local/cuda/include".into())
        ))
    })?;
    Ok(include_dir)
}

/// `cuInit`, `cuDriverGetVersion`, `cuDeviceGet(0)`, `cuDeviceGetName`,
/// `cuDeviceTotalMem`: the name, memory and driver version.
unsafe fn query_driver(lib: &libloading::Library) -> Result<(String, u64, i32), String> {
    type Init = unsafe extern "C" fn(u32) -> i32;
    type Version = unsafe extern "C" fn(*mut i32) -> i32;
    type Count = unsafe extern "C" fn(*mut i32) -> i32;
    type Get = unsafe extern "C" fn(*mut i32, i32) -> i32;
    type Name = unsafe extern "C" fn(*mut std::os::raw::c_char, i32, i32) -> i32;
    type TotalMem = unsafe extern "C" fn(*mut usize, i32) -> i32;
    let sym = |name: &[u8]| {
        format!(
            "libcuda has no {}",
            String::from_utf8_lossy(&name[..name.len() - 1])
        )
    };
    let init: libloading::Symbol<Init> = lib.get(b"cuInit\0").map_err(|_| sym(b"cuInit\0"))?;
    let rc = init(0);
    if rc != 0 {
        return Err(format!(
            "the CUDA driver failed to initialise (cuInit error {rc}): no usable GPU?"
        ));
    }
    let version: libloading::Symbol<Version> = lib
        .get(b"cuDriverGetVersion\0")
        .map_err(|_| sym(b"cuDriverGetVersion\0"))?;
    let mut v = 0;
    version(&mut v);
    let count: libloading::Symbol<Count> = lib
        .get(b"cuDeviceGetCount\0")
        .map_err(|_| sym(b"cuDeviceGetCount\0"))?;
    let mut n = 0;
    if count(&mut n) != 0 || n == 0 {
        return Err("the CUDA driver sees no GPU".into());
    }
    let get: libloading::Symbol<Get> = lib
        .get(b"cuDeviceGet\0")
        .map_err(|_| sym(b"cuDeviceGet\0"))?;
    let mut dev = 0;
    get(&mut dev, 0);
    let name_fn: libloading::Symbol<Name> = lib
        .get(b"cuDeviceGetName\0")
        .map_err(|_| sym(b"cuDeviceGetName\0"))?;
    let mut buf = [0 as std::os::raw::c_char; 256];
    name_fn(buf.as_mut_ptr(), buf.len() as i32, dev);
    let name = std::ffi::CStr::from_ptr(buf.as_ptr())
        .to_string_lossy()
        .into_owned();
    let total: libloading::Symbol<TotalMem> = lib
        .get(b"cuDeviceTotalMem_v2\0")
        .map_err(|_| sym(b"cuDeviceTotalMem_v2\0"))?;
    let mut bytes = 0usize;
    total(&mut bytes, dev);
    Ok((name, bytes as u64, v))
}

/// The persistent cache directory for this GPU and driver.
pub fn cache_dir(info: &CudaInfo) -> PathBuf {
    let root = crate::kernel_cache::cache_root();
    let gpu: String = info
        .gpu
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    root.join(format!("{gpu}-driver{}", info.driver_version))
}

/// Point the driver's PTX→SASS JIT cache at `kernel_cache::driver_jit_dir`
/// with room for a model's kernels, unless the user set `CUDA_CACHE_PATH` /
/// `CUDA_CACHE_MAXSIZE`. CubeCL caches PTX only; every load of it is JIT-
/// compiled by the driver, whose default cache (`~/.nv/ComputeCache`, 1 GiB)
/// is shared with every other CUDA program and evicts the oldest entries.
/// Must run before the first `cuInit` (the preflight's, which calls it once
/// the driver library is found): the driver reads these variables there, once.
pub fn configure_driver_jit_cache() {
    let root = crate::kernel_cache::cache_root();
    let env = crate::kernel_cache::driver_jit_env(&root, |v| std::env::var_os(v).is_some());
    for (name, value) in env {
        if name == "CUDA_CACHE_PATH" {
            // rcoa names the directory, so rcoa makes it; the driver only
            // has to write there.
            let _ = std::fs::create_dir_all(&value);
        }
        // Before any CUDA or rank thread exists; nothing reads the
        // environment concurrently.
        std::env::set_var(name, value);
    }
}

/// Set by `start_recording`: where the autotune cache goes instead.
static RECORDING_AUTOTUNE_DIR: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);

/// From now on this process's launches are recorded, not executed
/// (`cubecl::cuda::prebuild`, `crate::prebuild`). Tuning then times
/// launches that do nothing, so its results go to `autotune_dir`, to be
/// thrown away, not to the kernel cache. Before the first CubeCL call.
pub(crate) fn start_recording(autotune_dir: PathBuf) {
    *RECORDING_AUTOTUNE_DIR
        .lock()
        .unwrap_or_else(|e| e.into_inner()) = Some(autotune_dir);
    cubecl::cuda::prebuild::start_recording();
}

/// Point CubeCL's compilation and autotune caches at `dir`, and apply the
/// autotune level `kernel_cache::set_autotune` chose. Returns whether the
/// cache was cold (empty). Must run before the first CubeCL call.
///
/// Starts from the configuration CubeCL itself would read (a `cubecl.toml`
/// or `burn.toml`'s `[cubecl]` in the working directory or above, then
/// `CUBECL_AUTOTUNE_LEVEL` and the debug variables), so those still apply;
/// only the cache locations, and the level when chosen, are rcoa's.
pub fn configure_cache(dir: &std::path::Path) -> Result<bool, RunError> {
    use crate::kernel_cache::AutotuneLevel as Level;
    use cubecl::config::autotune::AutotuneLevel;
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    let cold = std::fs::read_dir(dir)
        .map(|mut d| d.next().is_none())
        .unwrap_or(true);
    std::fs::create_dir_all(dir).map_err(|e| {
        RunError::CudaUnavailable(format!(
            "cannot create the kernel cache {}: {e}",
            dir.display()
        ))
    })?;
    // CubeCL panics on a malformed configuration file.
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let read =
        std::panic::catch_unwind(|| CubeClRuntimeConfig::from_current_dir().override_from_env());
    std::panic::set_hook(previous);
    let mut cfg = read.map_err(|p| {
        RunError::Unsupported(format!(
            "CubeCL's configuration file (cubecl.toml or burn.toml's [cubecl], in the working directory or above) \
             cannot be read: {}; fix or remove it",
            panic_text(p.as_ref())
        ))
    })?;
    cfg.compilation.cache = Some(CacheConfig::File(dir.to_path_buf()));
    let autotune_dir = RECORDING_AUTOTUNE_DIR
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    if let Some(recording) = &autotune_dir {
        // The tunings this cache has: the recording launches only their
        // winners (a failed copy only costs compiling every candidate).
        if let Err(e) = crate::kernel_cache::copy_tunings(dir, recording) {
            eprintln!(
                "note: the cache's tunings were not copied for the recording ({e}); it records every candidate"
            );
        }
    }
    cfg.autotune.cache = CacheConfig::File(autotune_dir.unwrap_or_else(|| dir.to_path_buf()));
    if let Some(level) = crate::kernel_cache::autotune() {
        cfg.autotune.level = match level {
            Level::Minimal => AutotuneLevel::Minimal,
            Level::Balanced => AutotuneLevel::Balanced,
            Level::Extensive => AutotuneLevel::Extensive,
            Level::Full => AutotuneLevel::Full,
        };
    }
    // `set` panics if CubeCL already read its configuration (a second run in
    // one process); the first configuration then stays, which is fine.
    let _ = std::panic::catch_unwind(|| CubeClRuntimeConfig::set(cfg));
    Ok(cold)
}

/// CubeCL's memory manager: live bytes and pool reservations.
pub struct CudaProbe {
    client: cubecl::client::ComputeClient<CudaRuntime>,
    device: CudaDevice,
    baseline: u64,
    step_peak: u64,
    peak: u64,
    reserved: u64,
}

impl CudaProbe {
    pub fn new(device: &CudaDevice) -> Self {
        let client = CudaRuntime::client(device);
        let baseline = client.memory_usage().map(|m| m.bytes_in_use).unwrap_or(0);
        CudaProbe {
            client,
            device: device.clone(),
            baseline,
            step_peak: 0,
            peak: 0,
            reserved: 0,
        }
    }
}

/// With fusion, ops wait in Burn's queue: until they are handed to CubeCL the
/// allocator has not seen the segment's tensors. Hand them over without waiting
/// for the GPU: `Backend::sync` would also wait for every kernel, and doing
/// that after every layer cost 22% of the 350M step (0.288 s against 0.225 s
/// sampling once per step, docs/burn-h100.md).
fn drain_fusion_queue(device: &CudaDevice) {
    type Runtime = burn_cubecl::fusion::FusionCubeRuntime<CudaRuntime>;
    burn_fusion::client::GlobalFusionClient::<Runtime>::load(device).sync(|| ());
}

impl MemoryProbe for CudaProbe {
    fn sample(&mut self) -> u64 {
        drain_fusion_queue(&self.device);
        let Ok(m) = self.client.memory_usage() else {
            return 0;
        };
        let v = m.bytes_in_use.saturating_sub(self.baseline);
        self.step_peak = self.step_peak.max(v);
        self.peak = self.peak.max(v);
        self.reserved = self.reserved.max(m.bytes_reserved);
        v
    }
    fn begin_step(&mut self) {
        self.step_peak = 0;
    }
    fn step_peak(&self) -> u64 {
        self.step_peak
    }
    fn peak(&self) -> u64 {
        self.peak
    }
    fn peak_reserved(&self) -> Option<u64> {
        Some(self.reserved)
    }
    fn what(&self) -> &'static str {
        "CubeCL bytes in use (live tensors), sampled after every layer's forward and backward, inside the ZeRO-1/2 exchange and after the optimizer step"
    }
}

pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "unknown panic".into())
}

/// The CUDA executor's instantiation.
pub(crate) type B = burn::backend::Autodiff<burn::backend::Cuda<f32>>;

/// Train on GPU 0, or with `--devices N` on GPUs 0..N, one rank (thread)
/// each (`execute_ranks`).
pub fn run(
    plan: &LoweredPlan,
    opts: &RunOptions,
    on_event: &mut dyn FnMut(Event),
) -> Result<Summary, RunError> {
    run_probed(plan, opts, |d| Box::new(CudaProbe::new(d)), on_event)
}

/// `run` with each rank's probe from `probe` (`crate::warmup` wraps
/// `CudaProbe` to report progress).
pub(crate) fn run_probed(
    plan: &LoweredPlan,
    opts: &RunOptions,
    probe: crate::ProbeFactory<CudaDevice>,
    on_event: &mut dyn FnMut(Event),
) -> Result<Summary, RunError> {
    let n = opts.distributed.as_ref().map_or(1, |d| d.devices);
    let timing = crate::kernel_profile::selected();
    if timing {
        crate::kernel_profile::one_rank(n).map_err(RunError::Unsupported)?;
    }
    let info = preflight()?;
    if let Some(note) =
        crate::device_check::plan_gpu_note(&plan.hardware.gpu, &info.gpu, info.memory_bytes)
    {
        eprintln!("note: {note}");
    }
    let dir = cache_dir(&info);
    let cold = configure_cache(&dir)?;
    // CubeCL's pools are fixed when the device is first used: after the caches
    // (the pool setter is cubecl-cuda's own, not `CubeClRuntimeConfig`), before
    // the first kernel.
    crate::pool::configure(crate::pool::selected())?;
    crate::kernels::gemm::cublas::set_tf32(
        plan.precision.compute == rcoa_compiler::spec::Dtype::Tf32,
    );
    on_event(Event::Compiling {
        cold,
        entries: crate::kernel_cache::count_entries(&dir),
        dir: dir.clone(),
    });
    let name = |i: u32| {
        format!(
            "cuda:{i}{} {} (driver {}.{}, fusion on, {}, kernel cache {})",
            if n > 1 {
                format!(" (of {n} in this process)")
            } else {
                String::new()
            },
            info.gpu,
            info.driver_version / 1000,
            (info.driver_version % 1000) / 10,
            crate::kernels::gemm::fused::engine_in_use(),
            dir.display()
        )
    };
    let devices = (0..n)
        .map(|i| crate::LocalDevice {
            device: CudaDevice::new(i as usize),
            name: name(i),
        })
        .collect();
    // `--profile-kernels`: what each step launched, taken when the step
    // reports (after its device sync); setup, evaluation and saving are
    // taken at their own events and left out.
    let mut steps = Vec::new();
    let mut timing_error = None;
    if timing {
        cubecl::cuda::kernel_timing::start();
    }
    let mut observe = |e: Event| {
        if timing {
            match cubecl::cuda::kernel_timing::take() {
                Ok(k) => {
                    if let Event::Step(r) = &e {
                        steps.push(crate::kernel_profile::StepKernels::new(
                            r.step,
                            r.step_seconds,
                            k.iter().map(|t| (t.name, t.seconds)),
                        ));
                    }
                }
                Err(err) => {
                    timing_error.get_or_insert(err);
                }
            }
        }
        on_event(e)
    };
    // Backend panics (cudarc, CubeCL, out of memory) become errors; the
    // ranks' threads catch theirs (`execute_ranks`), silently too.
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {}));
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        if n > 1 {
            let seen = CudaRuntime::client(&CudaDevice::new(0)).device_count(0);
            if seen < n as usize {
                return Err(RunError::Distributed(format!(
                    "--devices {n} needs {n} GPUs but the CUDA driver sees {seen} \
                     (CUDA_VISIBLE_DEVICES may hide some): at most --devices {seen} here"
                )));
            }
        }
        crate::execute_ranks::<B>(plan, opts, devices, true, probe, &mut observe)
    }));
    std::panic::set_hook(previous);
    let mut summary = result.unwrap_or_else(|p| Err(RunError::Backend(panic_text(p.as_ref()))))?;
    if timing {
        summary.kernel_steps = Some(match timing_error {
            None => Ok(steps),
            Some(e) => Err(e),
        });
    }
    Ok(summary)
}
