//! CubeCL's memory pools on CUDA: which configuration `rcoa run --memory-pool`
//! gives the device, and the `compact` one designed against a replay of the
//! memory model's allocations (`replay`, tests only; `docs/memory-pool.md`).
//!
//! CubeCL 0.10's default (`SubSlices`) cuts pages of a quarter of the GPU's
//! memory, divided by 4 down to ~20 MiB, and a pool takes a tensor when it
//! is below the pool's slice limit or fills 80–100 % of its page: on an H100
//! a 2.5–4 GiB tensor takes a whole 19.8 GiB page, a 268 MB attention score
//! a 332 MB one. Pages are kept once grown (nothing frees them unless
//! `memory_cleanup` is called), so reserved memory ends 1.2–1.7 × the bytes
//! in use (docs/burn-h100.md). `compact` slices tensors up to 1 MiB out of
//! 8 MiB pages and everything else up to 1 GiB out of 1 GiB pages, and gives
//! larger tensors a page of their own, of their size (within 4 %).
//! `expandable` slices every tensor above 1 MiB out of one page of address
//! space that the vendored cubecl-cuda backs with device memory only as far
//! up as slices are handed out (its `compute/storage/expandable.rs`): one
//! heap, with no page boundaries to leave holes at.

#[cfg(any(test, feature = "pool-replay"))]
pub mod replay;

/// Which pool configuration the run's CUDA device gets.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PoolChoice {
    /// [`compact_pools`]: rcoa's default since 2026-11-28f. CubeCL's own pools size their
    /// pages from the device's memory, so their waste grows with the card (replayed up to
    /// 2.1 × the bytes in use on an H200); these pages do not, and `target burn`'s `fits`
    /// factors are measured on them (docs/memory-pool.md).
    #[default]
    Compact,
    /// [`expandable_pools`], with [`EXPANSION`].
    Expandable,
    /// CubeCL's own (`SubSlices`), what the measurements before 2026-11-28f used.
    Cubecl,
}

impl PoolChoice {
    /// Every choice, the default first, in the order `--memory-pool` lists them.
    pub const ALL: [PoolChoice; 3] = [
        PoolChoice::Compact,
        PoolChoice::Expandable,
        PoolChoice::Cubecl,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            PoolChoice::Cubecl => "cubecl",
            PoolChoice::Compact => "compact",
            PoolChoice::Expandable => "expandable",
        }
    }
}

impl std::str::FromStr for PoolChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        PoolChoice::ALL
            .into_iter()
            .find(|c| c.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown memory pool `{s}`: use `compact` (the default), `expandable` or \
                     `cubecl` (CubeCL's own pools)"
                )
            })
    }
}

/// One pool of a configuration, as CubeCL's `MemoryPoolOptions` describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pool {
    /// Every allocation a page of its own; takes sizes up to `max_alloc`.
    Exclusive { max_alloc: u64 },
    /// Slices of `page`-byte pages; takes sizes up to `max_slice` (or within 20 % of a page).
    Sliced { page: u64, max_slice: u64 },
}

const MIB: u64 = 1 << 20;
/// Tensors up to this size are sliced out of small pages.
pub const SMALL_FROM: u64 = MIB;
/// The page every tensor above [`SMALL_FROM`] and up to its size is sliced out of, whatever
/// its size: sharing pages between sizes lets the backward reuse what the loss's large
/// transients grew (exclusive pages per size class left those idle at the recompute peak:
/// 1.42 × on llama350m_gc). Its size is the one the replay's sweep found best
/// (`docs/memory-pool.md`): the transformer steps measured have their largest tensors,
/// the fp32 logits, at about 1 GB.
pub const PAGE: u64 = 1 << 30;
/// Ratio between neighbouring exclusive pools' largest sizes above [`PAGE`]: a tensor gets a
/// page of its own size, reused by tensors at most this much smaller.
pub const EXCLUSIVE_STEP: f64 = 1.04;
/// The largest tensor the compact configuration takes.
pub const LARGEST: u64 = 256 << 30;
/// CUDA's allocation alignment as CubeCL uses it (`cuMemAllocPitch`'s).
pub const ALIGNMENT: u64 = 512;

/// How the `expandable` configuration's large page grows: pages of at least `min_page`
/// bytes are address space, backed by device memory in multiples of `step` bytes as far up
/// as slices are handed out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Expansion {
    pub min_page: u64,
    pub step: u64,
}

/// The `expandable` configuration's one large page: address space, so its size costs no
/// memory; it bounds the largest tensor, as [`LARGEST`] does `compact`'s.
pub const EXPANDABLE_PAGE: u64 = LARGEST;

/// Device memory is mapped under the large page 20 MiB at a time at least (a multiple of
/// the 2 MiB granularity of CUDA's physical allocations; PyTorch's expandable segments
/// grow large pools by 20 MiB too): fewer driver calls, at most 20 MiB reserved unused.
pub const EXPANSION: Expansion = Expansion {
    min_page: EXPANDABLE_PAGE,
    step: 20 * MIB,
};

/// The `expandable` configuration: small tensors apart as in [`compact_pools`] (they
/// would only lengthen the large page's list of slices), everything else sliced first
/// fit out of one page of [`EXPANDABLE_PAGE`] bytes of address space (see [`EXPANSION`]).
pub fn expandable_pools() -> Vec<Pool> {
    vec![
        Pool::Exclusive { max_alloc: 0 },
        Pool::Sliced {
            page: 8 * MIB,
            max_slice: SMALL_FROM,
        },
        Pool::Sliced {
            page: EXPANDABLE_PAGE,
            max_slice: EXPANDABLE_PAGE,
        },
    ]
}

/// The `compact` configuration, first pool first (CubeCL gives an allocation to the first
/// pool that takes its size).
pub fn compact_pools() -> Vec<Pool> {
    let mut pools = vec![
        // Below CubeCL's alignment offsets are unusable on some backends; CubeCL's presets
        // keep such sizes apart too.
        Pool::Exclusive { max_alloc: 0 },
        Pool::Sliced {
            page: 8 * MIB,
            max_slice: SMALL_FROM,
        },
        Pool::Sliced {
            page: PAGE,
            max_slice: PAGE,
        },
    ];
    let mut max = PAGE as f64;
    while (max as u64) < LARGEST {
        max *= EXCLUSIVE_STEP;
        pools.push(Pool::Exclusive {
            max_alloc: (max as u64).next_multiple_of(ALIGNMENT),
        });
    }
    pools
}

/// The configuration of `choice` as CubeCL takes it; `None`: CubeCL's default.
#[cfg(any(test, feature = "cuda", feature = "pool-replay"))]
pub fn memory_configuration(
    choice: PoolChoice,
) -> Option<cubecl_runtime::memory_management::MemoryConfiguration> {
    match choice {
        PoolChoice::Cubecl => None,
        PoolChoice::Compact => Some(to_cubecl(&compact_pools())),
        PoolChoice::Expandable => Some(to_cubecl(&expandable_pools())),
    }
}

#[cfg(any(test, feature = "cuda", feature = "pool-replay"))]
pub(crate) fn to_cubecl(pools: &[Pool]) -> cubecl_runtime::memory_management::MemoryConfiguration {
    use cubecl_runtime::memory_management::{MemoryConfiguration, MemoryPoolOptions, PoolType};
    MemoryConfiguration::Custom {
        pool_options: pools
            .iter()
            .map(|p| MemoryPoolOptions {
                pool_type: match *p {
                    Pool::Exclusive { max_alloc } => PoolType::ExclusivePages {
                        max_alloc_size: max_alloc,
                    },
                    Pool::Sliced { page, max_slice } => PoolType::SlicedPages {
                        page_size: page,
                        max_slice_size: max_slice,
                    },
                },
                // Never: CubeCL 0.10 only checks it after a failed kernel, and a page given
                // back would be grown again by the next step.
                dealloc_period: None,
            })
            .collect(),
    }
}

/// The choice of this process (`rcoa run --memory-pool`), as 1 + its place in
/// [`PoolChoice::ALL`]; 0 until one is made. CubeCL's configuration is process-wide too,
/// and fixed once a device is in use.
static SELECTED: std::sync::atomic::AtomicU8 = std::sync::atomic::AtomicU8::new(0);

/// Select the pools the CUDA devices of this process get (`configure` applies it).
pub fn select(choice: PoolChoice) {
    let index = PoolChoice::ALL
        .iter()
        .position(|&c| c == choice)
        .expect("ALL lists every choice");
    SELECTED.store(index as u8 + 1, std::sync::atomic::Ordering::SeqCst);
}

/// What [`select`] chose ([`PoolChoice::default`] when nothing did).
pub fn selected() -> PoolChoice {
    match SELECTED.load(std::sync::atomic::Ordering::SeqCst) {
        0 => PoolChoice::default(),
        i => PoolChoice::ALL[i as usize - 1],
    }
}

/// The pools of this process's CUDA devices, once the first run chose them.
#[cfg(feature = "cuda")]
static APPLIED: std::sync::Mutex<Option<PoolChoice>> = std::sync::Mutex::new(None);

/// Whether a run choosing `choice` may go on, given the choice an earlier run of this
/// process applied (`applied`, updated): CubeCL's pools are fixed once a device is in use,
/// so a later run must choose the same. `Ok(true)`: this is the first, set the pools.
#[cfg(any(test, feature = "cuda"))]
fn settle(applied: &mut Option<PoolChoice>, choice: PoolChoice) -> Result<bool, String> {
    match *applied {
        None => {
            *applied = Some(choice);
            Ok(true)
        }
        Some(earlier) if earlier == choice => Ok(false),
        Some(earlier) => Err(format!(
            "--memory-pool {} in a process whose GPU already runs with the {} pools (they \
             are fixed once the device is in use); run it in a fresh process",
            choice.as_str(),
            earlier.as_str()
        )),
    }
}

/// Give the CUDA devices of this process `choice`'s pools. Must run before the first use
/// of a device (`cuda::run` calls it before anything touches one).
#[cfg(feature = "cuda")]
pub fn configure(choice: PoolChoice) -> Result<(), crate::RunError> {
    let mut applied = APPLIED.lock().unwrap_or_else(|p| p.into_inner());
    let first = settle(&mut applied, choice).map_err(crate::RunError::Backend)?;
    let Some(config) = memory_configuration(choice).filter(|_| first) else {
        return Ok(());
    };
    let mut unused = cubecl::cuda::set_memory_configuration(config);
    if choice == PoolChoice::Expandable {
        // Pinned host memory must not get a page of 256 GiB: it keeps `compact`'s pools.
        unused &= cubecl::cuda::set_pinned_memory_configuration(to_cubecl(&compact_pools()));
        unused &= cubecl::cuda::set_expandable_pages(Some(cubecl::cuda::ExpandablePages {
            min_page: EXPANSION.min_page,
            step: EXPANSION.step,
        }));
    }
    if unused {
        Ok(())
    } else {
        *applied = Some(PoolChoice::Cubecl);
        Err(crate::RunError::Backend(format!(
            "--memory-pool {} came after this process had already used the GPU with CubeCL's \
             own pools, which stay; run it in a fresh process",
            choice.as_str()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The compiler's page for a tensor under `compact` (`fits`' term for the flat exchange
    /// vector) is the page these pools give it, or for an exclusive pool its bound.
    #[test]
    fn the_compiler_knows_the_compact_pages() {
        let pools = compact_pools();
        for bytes in [
            1u64,
            MIB,
            MIB + 1,
            536_423_424,
            PAGE,
            PAGE + 1,
            3 << 30,
            40 << 30,
        ] {
            let page = pools
                .iter()
                .find_map(|p| match *p {
                    Pool::Sliced { page, max_slice } if bytes <= max_slice => Some(page),
                    Pool::Exclusive { max_alloc } if max_alloc > 0 && bytes <= max_alloc => {
                        Some(max_alloc)
                    }
                    _ => None,
                })
                .expect("a pool takes it");
            assert_eq!(
                rcoa_compiler::memory::parallel::compact_pool_page(bytes),
                page,
                "{bytes} B"
            );
        }
    }

    #[test]
    fn compact_pools_cover_every_size_in_order() {
        let pools = compact_pools();
        // CubeCL numbers pools with a u8 and puts its persistent pool after them.
        assert!(pools.len() < 250, "{}", pools.len());
        let max = |p: &Pool| match *p {
            Pool::Exclusive { max_alloc } => max_alloc,
            Pool::Sliced { max_slice, .. } => max_slice,
        };
        assert!(pools.windows(2).all(|w| max(&w[0]) < max(&w[1])));
        assert!(max(pools.last().unwrap()) >= LARGEST);
        for p in &pools {
            match *p {
                Pool::Exclusive { max_alloc } => assert_eq!(max_alloc % ALIGNMENT, 0),
                Pool::Sliced { page, max_slice } => {
                    assert_eq!(page % ALIGNMENT, 0);
                    assert!(max_slice <= page);
                }
            }
        }
    }

    #[test]
    fn the_first_run_of_a_process_fixes_its_pools() {
        let mut applied = None;
        assert_eq!(settle(&mut applied, PoolChoice::Compact), Ok(true));
        assert_eq!(settle(&mut applied, PoolChoice::Compact), Ok(false));
        let e = settle(&mut applied, PoolChoice::Cubecl).unwrap_err();
        assert!(
            e.contains("fresh process") && e.contains("compact pools"),
            "{e}"
        );
        let mut applied = None;
        assert_eq!(settle(&mut applied, PoolChoice::Cubecl), Ok(true));
        assert!(settle(&mut applied, PoolChoice::Compact).is_err());
    }

    #[test]
    fn selection_is_remembered() {
        assert_eq!(selected(), PoolChoice::Compact);
        select(PoolChoice::Cubecl);
        assert_eq!(selected(), PoolChoice::Cubecl);
        select(PoolChoice::Compact);
        assert_eq!(selected(), PoolChoice::Compact);
        select(PoolChoice::Expandable);
        assert_eq!(selected(), PoolChoice::Expandable);
        select(PoolChoice::Compact);
        assert_eq!(selected(), PoolChoice::Compact);
    }

    #[test]
    fn choice_parses_and_names_itself() {
        for c in PoolChoice::ALL {
            assert_eq!(c.as_str().parse::<PoolChoice>(), Ok(c));
        }
        let e = "big".parse::<PoolChoice>().unwrap_err();
        assert!(
            e.contains("`cubecl`") && e.contains("`compact`") && e.contains("`expandable`"),
            "{e}"
        );
    }

    #[test]
    fn only_the_expandable_page_is_address_space() {
        let pools = expandable_pools();
        let pages: Vec<u64> = pools
            .iter()
            .filter_map(|p| match *p {
                Pool::Sliced { page, .. } => Some(page),
                Pool::Exclusive { .. } => None,
            })
            .collect();
        assert_eq!(
            pages
                .iter()
                .filter(|&&p| p >= EXPANSION.min_page)
                .collect::<Vec<_>>(),
            [&EXPANDABLE_PAGE]
        );
        // Any tensor of the compact configuration fits the expandable one.
        assert!(matches!(
            pools.last(),
            Some(Pool::Sliced { max_slice, .. }) if *max_slice >= LARGEST
        ));
        // CUDA maps physical memory in multiples of 2 MiB.
        assert_eq!(EXPANSION.step % (2 * MIB), 0);
        // Pinned host memory gets the compact pools, none of which is address space.
        assert!(compact_pools().iter().all(|p| match *p {
            Pool::Sliced { page, .. } => page < EXPANSION.min_page,
            Pool::Exclusive { .. } => true,
        }));
    }
}
