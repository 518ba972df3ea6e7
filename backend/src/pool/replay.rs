//! A run's allocations replayed through CubeCL 0.10's own memory management on the CPU.
//!
//! The events are the compiler's memory model of the run (`memory::trace`: the tape the
//! `burn` profile walks, the parameters made at setup, the optimizer one parameter at a
//! time); the pools are cubecl-runtime's `MemoryManagement` itself, over a storage that
//! hands out ids and counts bytes but allocates nothing. What it reserves at its highest,
//! divided by the highest bytes in use, is the pool factor `fits` multiplies by. An
//! expandable page ([`super::Expansion`]) counts what the vendored cubecl-cuda would map
//! under it: the end of its highest slice handed out, in steps.

use super::{memory_configuration, Expansion, PoolChoice, EXPANSION};
use cubecl_ir::MemoryDeviceProperties;
use cubecl_runtime::logging::ServerLogger;
use cubecl_runtime::memory_management::{
    ManagedMemoryHandle, MemoryAllocationMode, MemoryConfiguration, MemoryManagement,
    MemoryManagementOptions,
};
use cubecl_runtime::server::IoError;
use cubecl_runtime::storage::{ComputeStorage, StorageHandle, StorageId, StorageUtilization};
use rcoa_compiler::memory::trace::{Event, Trace};
use std::collections::HashMap;
use std::sync::Arc;

/// `cuDeviceTotalMem` of the H100 80GB HBM3 of docs/burn-h100.md (its runs' `total_B`).
pub const H100_MEMORY: u64 = 85_017_493_504;
/// An H200's memory as CUDA reports it: CubeCL's default pool sizes its pages from it.
pub const H200_MEMORY: u64 = 150_754_820_096;

/// A storage of ids only: what CubeCL's pools ask of the device, counted.
#[derive(Default)]
struct FakeStorage {
    /// Pages allocated whole: their sizes.
    sizes: HashMap<StorageId, u64>,
    expansion: Option<Expansion>,
    /// Expandable pages: (size asked, bytes mapped).
    expandable: HashMap<StorageId, (u64, u64)>,
    reserved: u64,
    peak_reserved: u64,
}

impl FakeStorage {
    /// What cubecl-cuda's `Command::reserve` does after CubeCL placed a slice: map an
    /// expandable page up to the slice's end, in whole steps.
    fn commit(&mut self, slice: &StorageHandle) {
        let (Some(expansion), Some((asked, mapped))) =
            (self.expansion, self.expandable.get_mut(&slice.id))
        else {
            return;
        };
        let end = slice.utilization.offset + slice.utilization.size;
        if end > *mapped {
            let grown = (end - *mapped)
                .next_multiple_of(expansion.step)
                .min(*asked - *mapped);
            *mapped += grown;
            self.reserved += grown;
            self.peak_reserved = self.peak_reserved.max(self.reserved);
        }
    }

    /// Bytes reserved as CubeCL counts them: every page whole, expandable ones too.
    fn pages_asked(&self) -> u64 {
        self.sizes.values().sum::<u64>() + self.expandable.values().map(|(a, _)| a).sum::<u64>()
    }
}

impl ComputeStorage for FakeStorage {
    type Resource = ();
    fn alignment(&self) -> usize {
        super::ALIGNMENT as usize
    }
    fn get(&mut self, _handle: &StorageHandle) {}
    fn alloc(&mut self, size: u64) -> Result<StorageHandle, IoError> {
        let id = StorageId::new();
        if self.expansion.is_some_and(|e| size >= e.min_page) {
            self.expandable.insert(id, (size, 0));
        } else {
            self.sizes.insert(id, size);
            self.reserved += size;
            self.peak_reserved = self.peak_reserved.max(self.reserved);
        }
        Ok(StorageHandle::new(
            id,
            StorageUtilization { offset: 0, size },
        ))
    }
    fn dealloc(&mut self, id: StorageId) {
        if let Some(size) = self.sizes.remove(&id) {
            self.reserved -= size;
        }
        if let Some((_, mapped)) = self.expandable.remove(&id) {
            self.reserved -= mapped;
        }
    }
    fn flush(&mut self) {}
}

/// What a replay measured.
#[derive(Clone, Copy, Debug)]
pub struct Replayed {
    /// The highest bytes reserved from the device.
    pub reserved: u64,
    /// The highest bytes in use (live allocations, unpadded).
    pub in_use: u64,
}

impl Replayed {
    pub fn factor(&self) -> f64 {
        self.reserved as f64 / self.in_use as f64
    }
}

/// Replay `trace` through the pools of `config` (`None`: CubeCL's default, `SubSlices`) on a
/// device of `device_memory` bytes, with the pages `expansion` names expandable.
/// `persistent_params`: the parameters are made under `memory_persistent_allocations`
/// (Burn's own initialisers do; rcoa's model does not).
pub fn replay(
    trace: &Trace,
    config: Option<MemoryConfiguration>,
    expansion: Option<Expansion>,
    device_memory: u64,
    persistent_params: bool,
) -> Replayed {
    let props = MemoryDeviceProperties {
        // cubecl-cuda's: a quarter of the device's memory.
        max_page_size: device_memory / 4,
        alignment: super::ALIGNMENT,
    };
    let mut mm = MemoryManagement::from_configuration(
        FakeStorage {
            expansion,
            ..FakeStorage::default()
        },
        &props,
        config.unwrap_or_default(),
        Arc::new(ServerLogger::default()),
        MemoryManagementOptions::new("replay"),
    );
    let mut handles: HashMap<u64, (ManagedMemoryHandle, u64)> = HashMap::new();
    let (mut in_use, mut peak_in_use) = (0u64, 0u64);
    for e in &trace.events {
        match *e {
            Event::Alloc { id, bytes, param } => {
                let persistent = param && persistent_params;
                if persistent {
                    mm.mode(MemoryAllocationMode::Persistent);
                }
                let h = mm
                    .reserve(bytes)
                    .unwrap_or_else(|e| panic!("no pool takes {bytes} B: {e:?}"));
                if persistent {
                    mm.mode(MemoryAllocationMode::Auto);
                }
                let slice = mm.get_storage(h.clone().binding()).expect("a slice");
                mm.storage().commit(&slice);
                handles.insert(id, (h, bytes));
                in_use += bytes;
                peak_in_use = peak_in_use.max(in_use);
            }
            Event::Free { id } => {
                if let Some((_, bytes)) = handles.remove(&id) {
                    in_use -= bytes;
                }
            }
            Event::StepEnd => {
                // CubeCL's own account agrees with the storage's.
                assert_eq!(mm.memory_usage().bytes_reserved, mm.storage().pages_asked());
            }
        }
    }
    Replayed {
        reserved: mm.storage().peak_reserved,
        in_use: peak_in_use,
    }
}

/// The trace of `steps` steps of the plan `source` (named `name`, its paths relative to
/// `base_dir`), as `rcoa run` would execute it: parsed, resolved, compiled for its target.
pub fn plan_trace(
    name: &str,
    source: &str,
    base_dir: &std::path::Path,
    steps: u32,
) -> Result<Trace, String> {
    let file = rcoa_grammar::parse(name, source).map_err(|e| e.to_string())?;
    let ctx = rcoa_compiler::resolve::ResolveContext {
        name: name.into(),
        source: source.into(),
        base_dir: base_dir.into(),
    };
    let spec = rcoa_compiler::resolve::resolve(&file, &ctx).map_err(|e| format!("{e:?}"))?;
    let c = rcoa_compiler::compile(&spec).map_err(|e| format!("{e:?}"))?;
    rcoa_compiler::memory::trace::run_trace(&spec, &c.candidate, &c.profile, steps)
        .map_err(|e| e.to_string())
}

/// [`replay`] with the pools of `choice` on an H100.
pub fn replay_choice(trace: &Trace, choice: PoolChoice, persistent_params: bool) -> Replayed {
    replay(
        trace,
        memory_configuration(choice),
        (choice == PoolChoice::Expandable).then_some(EXPANSION),
        H100_MEMORY,
        persistent_params,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::PathBuf;

    fn bench_dir() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("bench")
    }

    /// The run's trace of a plan of `backend/bench/` (or of `source` under that name).
    fn trace_of(name: &str, source: Option<&str>, steps: u32) -> Trace {
        let source = match source {
            Some(s) => s.to_string(),
            None => std::fs::read_to_string(bench_dir().join(name)).expect("bench plan"),
        };
        plan_trace(name, &source, &bench_dir(), steps).expect("a trace")
    }

    /// A pool that gives every allocation a page of exactly its size reserves exactly the
    /// bytes in use at the highest point: checks the replay's accounting, not CubeCL.
    #[test]
    fn one_page_per_allocation_reserves_the_peak_in_use() {
        use cubecl_runtime::memory_management::{MemoryPoolOptions, PoolType};
        let trace = trace_of("tiny.plan", Some(TINY), 2);
        // Exclusive pools whose sizes are the trace's own: a page is made of the size
        // asked and reused only by that size.
        let mut sizes: Vec<u64> = trace
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Alloc { bytes, .. } => Some(bytes.next_multiple_of(super::super::ALIGNMENT)),
                _ => None,
            })
            .collect();
        sizes.sort_unstable();
        sizes.dedup();
        let config = MemoryConfiguration::Custom {
            pool_options: sizes
                .iter()
                .map(|&s| MemoryPoolOptions {
                    pool_type: PoolType::ExclusivePages { max_alloc_size: s },
                    dealloc_period: None,
                })
                .collect(),
        };
        assert!(sizes.len() < 250, "{} sizes", sizes.len());
        let r = replay(&trace, Some(config), None, H100_MEMORY, false);
        assert_eq!(r.in_use, trace.peak_live);
        assert!(r.reserved >= r.in_use);
    }

    /// An expandable page reserves the top of its heap: a hole below it is reused by a
    /// tensor that fits it and skipped by one that does not.
    #[test]
    fn an_expandable_page_reserves_up_to_its_highest_slice() {
        use cubecl_runtime::memory_management::{MemoryPoolOptions, PoolType};
        const MIB: u64 = 1 << 20;
        let alloc = |id, mib| Event::Alloc {
            id,
            bytes: mib * MIB,
            param: false,
        };
        let trace = Trace {
            events: vec![
                alloc(1, 3),
                alloc(2, 5),
                Event::Free { id: 1 },
                alloc(3, 2), // in the hole at 0..3 MiB
                alloc(4, 4), // not in the 1 MiB left there: above the 5 MiB one
                Event::StepEnd,
            ],
            peak_live: 11 * MIB,
        };
        let config = MemoryConfiguration::Custom {
            pool_options: vec![MemoryPoolOptions {
                pool_type: PoolType::SlicedPages {
                    page_size: 1 << 30,
                    max_slice_size: 1 << 30,
                },
                dealloc_period: None,
            }],
        };
        let exact = Expansion {
            min_page: 1 << 30,
            step: MIB,
        };
        let with = |expansion| replay(&trace, Some(config.clone()), expansion, H100_MEMORY, false);
        let r = with(Some(exact));
        assert_eq!((r.in_use, r.reserved), (11 * MIB, 12 * MIB));
        // Mapped in steps of 5 MiB: 5 (the first slice's 3), 10 (to 8), 15 (to 12).
        let coarse = Expansion {
            step: 5 * MIB,
            ..exact
        };
        assert_eq!(with(Some(coarse)).reserved, 15 * MIB);
        // Without expansion the page is allocated whole.
        assert_eq!(with(None).reserved, 1 << 30);
    }

    const TINY: &str = r#"
model { arch = decoder layers = 2 hidden = 256 heads = 4 ffn = 688 vocab = 1000 max_positions = 128 }
hardware { gpu = h100-80gb }
precision { params = fp32 compute = bf16 master = fp32 }
optimizer adamw { lr = 1e-4 }
train { seq_len = 128 global_batch = 4 micro_batch = 4 grad_accum = 1 attention = eager }
fit { checkpoint = none }
target burn
"#;

    /// The rows of docs/burn-h100.md: (plan, measured reserved ÷ the model's highest bytes
    /// in use, fused executor).
    const MEASURED: &[(&str, f64)] = &[
        ("llama350m_eager.plan", 1.275),
        ("llama350m_fp32.plan", 1.204),
        ("llama125m_base.plan", 1.318),
        ("llama125m_bf16.plan", 1.339),
        ("llama125m_fp32.plan", 1.236),
        ("llama_gqa.plan", 1.231),
        ("llama350m_gc.plan", 1.644),
        ("llama125m_every2.plan", 1.421),
    ];

    /// Every row: the measured ones, the ≥ 1B plan, and three held out of the choice of
    /// `compact`'s sizes (changed from the rows above after the sweep was done).
    fn rows() -> Vec<(String, Trace, Option<f64>)> {
        let bench = |p: &str| std::fs::read_to_string(bench_dir().join(p)).expect("bench plan");
        let mut rows: Vec<(String, Trace, Option<f64>)> = MEASURED
            .iter()
            .map(|(p, m)| (p.to_string(), trace_of(p, None, 3), Some(*m)))
            .collect();
        let llama1b = bench("llama1b_pool.plan");
        rows.push((
            "llama1b_pool.plan (Llama-3.2-1B shape, mb 2 × 2, all recomputed)".into(),
            trace_of("llama1b_pool.plan", None, 3),
            None,
        ));
        // Each change must apply: a held-out plan equal to its source would prove nothing.
        let edit = |src: &str, changes: &[(&str, &str)]| {
            changes.iter().fold(src.to_string(), |s, (from, to)| {
                assert!(s.contains(from), "`{from}` not in the plan");
                s.replace(from, to)
            })
        };
        let held_out = [
            (
                "held out: llama1b bf16 + fp32 master, mb 1 × 4, no recompute",
                edit(
                    &llama1b,
                    &[
                        ("checkpoint = full", "checkpoint = none"),
                        ("micro_batch = 2", "micro_batch = 1"),
                        ("grad_accum = 2", "grad_accum = 4"),
                        ("params = fp32", "params = bf16"),
                    ],
                ),
            ),
            (
                "held out: llama350m seq 2048, mb 4, every 2nd layer recomputed",
                edit(
                    &bench("llama350m_eager.plan"),
                    &[
                        ("seq_len = 1024", "seq_len = 2048"),
                        ("micro_batch = 8", "micro_batch = 4"),
                        ("global_batch = 8", "global_batch = 4"),
                        ("checkpoint = none", "checkpoint = every 2"),
                    ],
                ),
            ),
            (
                "held out: llama_gqa vocab 50304, mb 16 × 2",
                edit(
                    &bench("llama_gqa.plan"),
                    &[
                        ("micro_batch = 8", "micro_batch = 16"),
                        ("global_batch = 16", "global_batch = 32"),
                        ("vocab = 32000", "vocab = 50304"),
                    ],
                ),
            ),
            (
                LARGE_VOCAB,
                edit(
                    &bench("llama350m_gc.plan"),
                    &[("vocab = 32000", "vocab = 100000")],
                ),
            ),
            (
                "issue 13's ≥ 1B speed shape (speed.py `1b`: Llama-3.2-1B, mb 4 × 2048, fp32 weights)",
                edit(
                    &bench("speed350m.plan"),
                    &[
                        ("layers = 24  hidden = 1024  heads = 16", "layers = 16  hidden = 2048  heads = 32"),
                        ("kv_heads = 16  ffn = 2816  vocab = 32000", "kv_heads = 8  ffn = 8192  vocab = 128256"),
                        ("tie_embeddings = false", "tie_embeddings = true"),
                    ],
                ),
            ),
            (
                LARGEST_VOCAB,
                edit(
                    &bench("llama350m_gc.plan"),
                    &[("vocab = 32000", "vocab = 151936")],
                ),
            ),
        ];
        for (name, source) in held_out {
            rows.push((
                name.to_string(),
                trace_of("held_out.plan", Some(&source), 3),
                None,
            ));
        }
        rows
    }

    /// Runs measured on an H100 with `--memory-pool compact`: the plan and the highest
    /// bytes the pool reserved (`measured_reserved_bytes`,
    /// `bench/h100-results/2026-11-25/call2/speed350-compact-rcoa.jsonl`).
    const MEASURED_COMPACT: &[(&str, u64)] = &[("speed350m.plan", 33_361_494_016)];

    /// `speed350m_flash.plan` as `gpu_one_call.sh` ran it on an H200 (2026-11-28f): the
    /// pool, and `measured_reserved_bytes` and `measured_peak_bytes`
    /// (`bench/h100-results/2026-11-28f/pool-*.jsonl`, 6 steps).
    const MEASURED_FLASH_H200: &[(PoolChoice, u64, u64)] = &[
        (PoolChoice::Compact, 20_484_980_736, 16_313_268_736),
        (PoolChoice::Expandable, 19_608_371_200, 16_313_268_736),
    ];

    /// The pools measured against their replays: reserved ÷ the replay's highest bytes in
    /// use (printed for docs/memory-pool.md). Not a bar: the measurements are over the
    /// issue's 1.1 where the replays are under it, and the table records both.
    #[test]
    fn pools_measured_beside_their_replays() {
        println!("| plan | pool | highest in use, replay (B) | sampled peak, measured (B) | reserved ÷ replay's in use, measured | replay |");
        println!("| --- | --- | ---: | ---: | ---: | ---: |");
        let rows = MEASURED_COMPACT
            .iter()
            .map(|(plan, reserved)| (*plan, PoolChoice::Compact, *reserved, None))
            .chain(MEASURED_FLASH_H200.iter().map(|(pool, reserved, peak)| {
                ("speed350m_flash.plan", *pool, *reserved, Some(*peak))
            }));
        for (plan, pool, reserved, peak) in rows {
            let trace = trace_of(plan, None, 3);
            let r = replay_choice(&trace, pool, false);
            let measured = reserved as f64 / r.in_use as f64;
            println!(
                "| {plan} | {} | {} | {} | {measured:.3} | {:.3} |",
                pool.as_str(),
                r.in_use,
                peak.map_or("—".into(), |p| p.to_string()),
                r.factor()
            );
            // The replay's bytes in use are the model's: below them no pool could reserve.
            assert!(measured >= 1.0, "{plan}: reserved below the bytes in use");
        }
    }

    const LARGE_VOCAB: &str = "held out: llama350m_gc vocab 100000 (all recomputed)";
    const LARGEST_VOCAB: &str =
        "held out: llama350m_gc vocab 151936 (all recomputed; added with `expandable`)";

    /// Rows a pool reserves more than 1.1 × for, and the most it may.
    ///
    /// `compact`: CubeCL's sliced pages are filled first-fit, and there the parameters,
    /// gradients and optimizer state (0.4 GB each at vocab 100000) share 1 GiB pages with
    /// the step's transients, so holes open that later tensors do not fit. No configuration
    /// of CubeCL 0.10's pool types did better on every row (docs/memory-pool.md).
    ///
    /// `expandable` has no page boundaries, but its one heap is filled first fit too: at a
    /// Qwen-sized vocabulary with every layer recomputed, the loss's three 1.2 GB blocks
    /// find no hole left below the top in the second step.
    const OVER_THE_BAR: &[(&str, PoolChoice, f64)] = &[
        (
            "held out: llama1b bf16 + fp32 master, mb 1 × 4, no recompute",
            PoolChoice::Compact,
            1.115,
        ),
        (LARGE_VOCAB, PoolChoice::Compact, 1.19),
        (LARGEST_VOCAB, PoolChoice::Compact, 1.26),
        (LARGEST_VOCAB, PoolChoice::Expandable, 1.13),
    ];

    /// The table of docs/memory-pool.md (`cargo test -p rcoa-backend --lib pool::replay --
    /// --nocapture` prints it), and the bound of the compact and expandable pools: 1.1 on
    /// every row but those [`OVER_THE_BAR`] names, which may not grow.
    #[test]
    fn compact_and_expandable_pools_reserve_at_most_1_1_times_the_bytes_in_use() {
        println!("| plan | highest in use (B) | measured (H100) | default (replay) | default on an H200 (replay) | compact (replay) | compact, parameters persistent | expandable (replay) |");
        println!("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |");
        let mut over = Vec::new();
        for (name, trace, measured) in rows() {
            let d = replay_choice(&trace, PoolChoice::Cubecl, false);
            let d200 = replay(&trace, None, None, H200_MEMORY, false);
            let c = replay_choice(&trace, PoolChoice::Compact, false);
            let cp = replay_choice(&trace, PoolChoice::Compact, true);
            let e = replay_choice(&trace, PoolChoice::Expandable, false);
            println!(
                "| {name} | {} | {} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3} |",
                d.in_use,
                measured.map_or("—".into(), |m| format!("{m:.3}")),
                d.factor(),
                d200.factor(),
                c.factor(),
                cp.factor(),
                e.factor()
            );
            for (pool, r) in [(PoolChoice::Compact, c), (PoolChoice::Expandable, e)] {
                let bound = OVER_THE_BAR
                    .iter()
                    .find(|(n, p, _)| *n == name && *p == pool)
                    .map_or(1.1, |(_, _, b)| *b);
                if r.factor() > bound {
                    over.push(format!(
                        "{name}: {} {:.3} > {bound}",
                        pool.as_str(),
                        r.factor()
                    ));
                }
            }
        }
        assert!(over.is_empty(), "compact reserves too much: {over:?}");
    }

    /// How much the compact pools' factor depends on the size of their large page: printed
    /// for docs/memory-pool.md (`-- --ignored --nocapture`).
    #[test]
    #[ignore = "a table for the docs, 30 s"]
    fn page_size_sensitivity() {
        let rows = rows();
        for mib in [512u64, 768, 1024, 1280, 1536, 2048] {
            let pools: Vec<_> = crate::pool::compact_pools()
                .into_iter()
                .map(|p| match p {
                    crate::pool::Pool::Sliced { page, .. } if page == crate::pool::PAGE => {
                        crate::pool::Pool::Sliced {
                            page: mib << 20,
                            max_slice: mib << 20,
                        }
                    }
                    p => p,
                })
                .collect();
            let f: Vec<String> = rows
                .iter()
                .map(|(_, t, _)| {
                    let r = replay(
                        t,
                        Some(crate::pool::to_cubecl(&pools)),
                        None,
                        H100_MEMORY,
                        false,
                    );
                    format!("{:.3}", r.factor())
                })
                .collect();
            println!("| {mib} MiB | {} |", f.join(" | "));
        }
    }
}
