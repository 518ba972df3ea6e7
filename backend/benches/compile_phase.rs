//! The compile phase of a cold start (`prebuild::compile_into`), with NVRTC in threads
//! against NVRTC in worker processes, on the same kernels in one run: seconds for the
//! whole phase, each into an empty kernel cache, and the threads' time over the
//! processes'. NVRTC takes a process-wide lock for part of every compile, so threads
//! wait on each other; processes do not (`prebuild::Workers`, `docs/cold-start.md`).
//!
//!     cargo bench -p rcoa-backend --features cuda --bench compile_phase -- [--jobs N] [--kernels K] [--sources DIR]
//!
//! Needs no GPU, only NVRTC and the CUDA headers (`CUDA_PATH`; `tools/nvrtc_from_pypi.sh`);
//! prints why not and times nothing otherwise. The kernels are, by default, what CubeCL's
//! cold runs are made of: kernels that include the barrier headers (as the accelerated
//! matmuls and their tuning candidates do) with small bodies, and kernels whose unrolled
//! loops keep ptxas busy, half each; K of them (default four a job). `--sources DIR`
//! compiles the `.cu` files of `DIR` instead (what `RCOA_DUMP_KERNELS` writes). `--jobs`
//! defaults to this machine's cores.

#[cfg(feature = "cuda")]
mod bench {
    use cubecl::cuda::prebuild::{nvrtc_options, RecordedKernel};
    use rcoa_backend::prebuild::{compile_into, write_records, CompileReport, Workers};
    use std::path::{Path, PathBuf};

    struct Args {
        jobs: usize,
        kernels: Option<usize>,
        sources: Option<PathBuf>,
    }

    fn args() -> Result<Args, String> {
        let mut a = Args {
            jobs: std::thread::available_parallelism().map_or(1, |n| n.get()),
            kernels: None,
            sources: None,
        };
        let mut it = std::env::args().skip(1).filter(|s| s != "--bench");
        while let Some(flag) = it.next() {
            let mut value = || it.next().ok_or(format!("{flag} needs a value"));
            match flag.as_str() {
                "--jobs" => a.jobs = value()?.parse().map_err(|e| format!("--jobs: {e}"))?,
                "--kernels" => {
                    a.kernels = Some(value()?.parse().map_err(|e| format!("--kernels: {e}"))?)
                }
                "--sources" => a.sources = Some(PathBuf::from(value()?)),
                other => return Err(format!("unknown argument `{other}`")),
            }
        }
        Ok(a)
    }

    /// A kernel as CubeCL lowers one: C linkage, its includes first.
    fn kernel(name: String, source: String) -> RecordedKernel {
        let hash = name
            .bytes()
            .fold(0u128, |h, b| h.wrapping_mul(131).wrapping_add(b as u128));
        RecordedKernel {
            hash: format!("{hash:032x}"),
            entrypoint_name: name,
            shared_mem_bytes: 0,
            source,
            options: nvrtc_options(90),
        }
    }

    /// Kernel `i` of the default set: even ones parse the barrier headers around a small
    /// body, odd ones give ptxas an unrolled loop of products through shared memory.
    fn synthetic(i: usize) -> RecordedKernel {
        let name = format!("rcoa_bench_{i}");
        let source = if i.is_multiple_of(2) {
            format!(
                "#include <cuda_bf16.h>\n#include <cooperative_groups.h>\n#include <cuda/barrier>\n\
                 extern \"C\" __global__ void {name}(__nv_bfloat16* x, float s, unsigned n) {{\n\
                 __shared__ cuda::barrier<cuda::thread_scope_block> bar;\n\
                 auto block = cooperative_groups::this_thread_block();\n\
                 if (block.thread_rank() == 0) {{ init(&bar, block.size()); }}\n\
                 block.sync();\n\
                 unsigned j = blockIdx.x * blockDim.x + threadIdx.x;\n\
                 if (j < n) {{ x[j] = __float2bfloat16(__bfloat162float(x[j]) * s + {i}.0f); }}\n\
                 bar.arrive_and_wait();\n}}\n"
            )
        } else {
            format!(
                "#include <cuda_bf16.h>\n\
                 extern \"C\" __global__ void {name}(const __nv_bfloat16* __restrict__ a, \
                 const __nv_bfloat16* __restrict__ b, float* __restrict__ c, unsigned n) {{\n\
                 __shared__ float tile[32][33];\n\
                 float acc[16];\n\
                 #pragma unroll\n\
                 for (int r = 0; r < 16; ++r) acc[r] = 0.0f;\n\
                 unsigned t = threadIdx.x;\n\
                 for (unsigned k = 0; k < n; k += 32) {{\n\
                   tile[t / 32][t % 32] = __bfloat162float(a[k + t]) * {i}.0f;\n\
                   __syncthreads();\n\
                   #pragma unroll\n\
                   for (int j = 0; j < 16; ++j) {{\n\
                     #pragma unroll\n\
                     for (int r = 0; r < 16; ++r)\n\
                       acc[r] = fmaf(tile[(j + r) % 32][t % 32], __bfloat162float(b[k + j * 16 + r]), acc[r]);\n\
                   }}\n\
                   __syncthreads();\n\
                 }}\n\
                 #pragma unroll\n\
                 for (int r = 0; r < 16; ++r) c[blockIdx.x * 512 + r * 32 + t % 32] = acc[r];\n}}\n"
            )
        };
        kernel(name, source)
    }

    /// The `.cu` files of `dir`, each a kernel whose entry point is named in its source.
    fn from_sources(dir: &Path) -> Result<Vec<RecordedKernel>, String> {
        let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
            .map_err(|e| format!("{}: {e}", dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "cu"))
            .collect();
        files.sort();
        files
            .iter()
            .map(|p| {
                let source =
                    std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?;
                let name = p
                    .file_stem()
                    .unwrap_or_default()
                    .to_string_lossy()
                    .into_owned();
                Ok(kernel(name, source))
            })
            .collect()
    }

    fn phase(
        kernels: &[RecordedKernel],
        jobs: usize,
        workers: &Workers,
        scratch: &Path,
        round: usize,
    ) -> Result<CompileReport, String> {
        let dir = scratch.join(format!("{}-{round}", workers.noun()));
        std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
        let file = dir.join("kernels.jsonl");
        write_records(&file, kernels).map_err(|e| e.to_string())?;
        let r = compile_into(&file, &dir.join("cache"), jobs, workers, &mut |_, _| {})
            .map_err(|e| e.to_string())?;
        if r.compiled != kernels.len() {
            return Err(format!(
                "{} of {} kernels compiled in {}: {:?}",
                r.compiled,
                kernels.len(),
                workers.noun(),
                r.failed
            ));
        }
        Ok(r)
    }

    pub fn main() {
        let a = match args() {
            Ok(a) => a,
            Err(e) => {
                eprintln!("compile_phase: {e}");
                std::process::exit(2);
            }
        };
        if let Err(e) = rcoa_backend::cuda::compiler() {
            println!("compile_phase: no NVRTC to time ({e})");
            return;
        }
        let kernels = match &a.sources {
            Some(dir) => match from_sources(dir) {
                Ok(k) if !k.is_empty() => k,
                Ok(_) => {
                    eprintln!("compile_phase: no .cu files in {}", dir.display());
                    std::process::exit(2);
                }
                Err(e) => {
                    eprintln!("compile_phase: {e}");
                    std::process::exit(2);
                }
            },
            None => (0..a.kernels.unwrap_or(4 * a.jobs))
                .map(synthetic)
                .collect(),
        };
        let processes = Workers::Processes {
            program: std::env::current_exe().expect("this bench's own path"),
            args: Vec::new(),
        };
        let scratch =
            std::env::temp_dir().join(format!("rcoa-compile-phase-{}", std::process::id()));
        println!(
            "compile phase: {} kernels, {} at a time, each into an empty kernel cache",
            kernels.len(),
            a.jobs
        );
        let mut best = [f64::INFINITY; 2];
        // Twice each, alternating, so that neither side has the machine's caches to itself.
        for round in 0..2 {
            for (i, workers) in [Workers::Threads, processes.clone()].iter().enumerate() {
                match phase(&kernels, a.jobs, workers, &scratch, round) {
                    Ok(r) => {
                        println!(
                            "  {:<9} {:>7.2} s  ({} header sets precompiled, {} headers written; slowest {:.2} s)",
                            workers.noun(),
                            r.seconds,
                            r.precompiled_headers,
                            r.headers_written,
                            r.slowest.first().map_or(0.0, |s| s.1)
                        );
                        best[i] = best[i].min(r.seconds);
                    }
                    Err(e) => {
                        eprintln!("compile_phase: {e}");
                        let _ = std::fs::remove_dir_all(&scratch);
                        std::process::exit(1);
                    }
                }
            }
        }
        let _ = std::fs::remove_dir_all(&scratch);
        println!(
            "best: threads {:.2} s, processes {:.2} s; threads / processes = {:.2}",
            best[0],
            best[1],
            best[0] / best[1]
        );
    }
}

fn main() -> std::process::ExitCode {
    // The processes the phase starts are this bench again, with a job to do.
    if let Some(code) = rcoa_backend::prebuild::serve_compile_worker() {
        return code;
    }
    #[cfg(feature = "cuda")]
    bench::main();
    #[cfg(not(feature = "cuda"))]
    println!("compile_phase: built without the `cuda` feature; nothing to time");
    std::process::ExitCode::SUCCESS
}
