//! Measured memory, beside the compiler's prediction.
//!
//! Neither backend has a peak counter, so the trainer samples: after every
//! layer's forward and backward, after the loss and after the optimizer step.
//! What a sample reads depends on the device:
//! - CPU (ndarray): live heap bytes, counted by [`TrackingAlloc`] (the
//!   `rcoa` binary's global allocator; ndarray's tensors are heap
//!   allocations), minus what was live before the model was built: the same
//!   quantity the compiler predicts, tensor bytes in use, with every
//!   allocation seen (not only at samples). Without that allocator (a library
//!   user's binary) the fallback is the resident set: `VmHWM` minus the RSS
//!   before the model, an upper bound that includes the allocator's retained
//!   pages.
//! - CUDA: CubeCL's memory manager, `bytes_in_use` (live tensor bytes, the
//!   quantity the compiler predicts), minus what was in use before the model
//!   was built; `bytes_reserved` (pool pages taken from the driver) is kept
//!   beside it.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// `RCOA_MEMORY_TRACE=1`: print memory samples to stderr as they are taken.
pub fn trace_on() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("RCOA_MEMORY_TRACE").is_ok_and(|v| v == "1"))
}

/// A source of memory samples.
pub trait MemoryProbe {
    /// Read the device's memory now, fold it into the peaks, and return it.
    fn sample(&mut self) -> u64;
    /// Start a new step's peak.
    fn begin_step(&mut self);
    /// Highest sample since `begin_step`.
    fn step_peak(&self) -> u64;
    /// Highest sample of the run.
    fn peak(&self) -> u64;
    /// Highest reserved (pool) bytes, where the device has such a notion.
    fn peak_reserved(&self) -> Option<u64>;
    /// What `peak` measures, for people.
    fn what(&self) -> &'static str;
    /// Where the step is, told before every sample point (`forward:layer3`,
    /// `optimizer`), sampled or not. A progress display uses it
    /// (`crate::warmup`); probes ignore it.
    fn at(&mut self, _at: &dyn Fn() -> String) {}
}

/// Live heap bytes of the process, and their high-water marks: one since
/// the last [`AllocProbe::begin_step`], one since the last probe was made.
static LIVE: AtomicU64 = AtomicU64::new(0);
static STEP_PEAK: AtomicU64 = AtomicU64::new(0);
static RUN_PEAK: AtomicU64 = AtomicU64::new(0);

/// The system allocator, counting the bytes it has handed out and not got
/// back. Install it as the global allocator of a binary
/// (`#[global_allocator] static A: TrackingAlloc = TrackingAlloc;`) to make
/// [`AllocProbe`] available. Costs two relaxed atomic adds per allocation and
/// a compare on the peaks.
pub struct TrackingAlloc;

impl TrackingAlloc {
    #[inline]
    fn grew(by: usize) {
        let now = LIVE.fetch_add(by as u64, Ordering::Relaxed) + by as u64;
        if now > STEP_PEAK.load(Ordering::Relaxed) {
            STEP_PEAK.fetch_max(now, Ordering::Relaxed);
        }
        if now > RUN_PEAK.load(Ordering::Relaxed) {
            RUN_PEAK.fetch_max(now, Ordering::Relaxed);
        }
    }
    #[inline]
    fn shrank(by: usize) {
        LIVE.fetch_sub(by as u64, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to `System` unchanged; the counters are
// bookkeeping only and never affect what is allocated.
unsafe impl GlobalAlloc for TrackingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            Self::grew(layout.size());
        }
        p
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc_zeroed(layout);
        if !p.is_null() {
            Self::grew(layout.size());
        }
        p
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout);
        Self::shrank(layout.size());
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let p = System.realloc(ptr, layout, new_size);
        if !p.is_null() {
            if new_size > layout.size() {
                Self::grew(new_size - layout.size());
            } else {
                Self::shrank(layout.size() - new_size);
            }
        }
        p
    }
}

/// Whether [`TrackingAlloc`] is this process's global allocator: it has
/// counted the allocations made before this call (every Rust program makes
/// some before `main`'s work starts).
pub fn tracking_installed() -> bool {
    LIVE.load(Ordering::Relaxed) > 0
}

/// Live heap bytes counted by [`TrackingAlloc`] above those live when the
/// probe was made (before the model was built). Process-wide: with
/// `--devices N` on the CPU it holds every rank's tensors.
pub struct AllocProbe {
    baseline: u64,
    step_peak: u64,
    peak: u64,
}

impl AllocProbe {
    /// Call before the model is built; `None` unless [`TrackingAlloc`] is installed.
    pub fn new() -> Option<Self> {
        if !tracking_installed() {
            return None;
        }
        let baseline = LIVE.load(Ordering::Relaxed);
        RUN_PEAK.store(baseline, Ordering::Relaxed);
        STEP_PEAK.store(baseline, Ordering::Relaxed);
        Some(AllocProbe {
            baseline,
            step_peak: 0,
            peak: 0,
        })
    }
}

impl MemoryProbe for AllocProbe {
    fn sample(&mut self) -> u64 {
        let step = STEP_PEAK
            .load(Ordering::Relaxed)
            .saturating_sub(self.baseline);
        let run = RUN_PEAK
            .load(Ordering::Relaxed)
            .saturating_sub(self.baseline);
        self.step_peak = self.step_peak.max(step);
        self.peak = self.peak.max(run).max(step);
        LIVE.load(Ordering::Relaxed).saturating_sub(self.baseline)
    }
    fn begin_step(&mut self) {
        self.step_peak = 0;
        STEP_PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    }
    fn step_peak(&self) -> u64 {
        self.step_peak
    }
    fn peak(&self) -> u64 {
        self.peak
    }
    fn peak_reserved(&self) -> Option<u64> {
        None
    }
    fn what(&self) -> &'static str {
        "peak live heap bytes (every allocation counted; minus those live before the model was built)"
    }
}

/// The CPU's best probe: [`AllocProbe`] where the binary installed
/// [`TrackingAlloc`], else [`RssProbe`].
pub fn cpu_probe() -> Box<dyn MemoryProbe> {
    match AllocProbe::new() {
        Some(p) => Box::new(p),
        None => Box::new(RssProbe::new()),
    }
}

/// Reads `VmHWM` and `VmRSS` (bytes) from `/proc/self/status`.
pub fn proc_status() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = s.lines().find(|l| l.starts_with(name))?;
        let kb: u64 = line[name.len()..].split_whitespace().next()?.parse().ok()?;
        Some(kb * 1024)
    };
    Some((field("VmHWM:")?, field("VmRSS:")?))
}

/// Peak RSS growth of this process (Linux); zero where `/proc` is absent.
pub struct RssProbe {
    baseline: u64,
    step_peak: u64,
    peak: u64,
}

impl RssProbe {
    /// Call before the model is built.
    pub fn new() -> Self {
        let baseline = proc_status().map(|(_, rss)| rss).unwrap_or(0);
        RssProbe {
            baseline,
            step_peak: 0,
            peak: 0,
        }
    }
}

impl Default for RssProbe {
    fn default() -> Self {
        Self::new()
    }
}

impl MemoryProbe for RssProbe {
    fn sample(&mut self) -> u64 {
        let Some((hwm, _)) = proc_status() else {
            return 0;
        };
        let v = hwm.saturating_sub(self.baseline);
        self.step_peak = self.step_peak.max(v);
        self.peak = self.peak.max(v);
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
        None
    }
    fn what(&self) -> &'static str {
        "process peak RSS growth (VmHWM minus RSS before the model was built)"
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Set in the child process of [`alloc_probe_counts_live_bytes_exactly`].
    const CHILD: &str = "RCOA_ALLOC_PROBE_CHILD";

    /// The backend's test binary counts its allocations (src/tests.rs
    /// installs the allocator), so the probe sees a buffer exactly, and its
    /// release. Measured in a process of its own: the count is process-wide,
    /// and tests that hold no lock allocate meanwhile (a run saw 25 MB more).
    #[test]
    fn alloc_probe_counts_live_bytes_exactly() {
        crate::testing::run_ignored_in_child("memory::tests::alloc_probe_in_child", CHILD);
    }

    #[test]
    #[ignore = "run in its own process by alloc_probe_counts_live_bytes_exactly"]
    fn alloc_probe_in_child() {
        assert!(std::env::var_os(CHILD).is_some(), "run by its parent test");
        let mut p = AllocProbe::new().expect("the test binary installs TrackingAlloc");
        p.begin_step();
        let v = vec![7u8; 48 << 20];
        let live = p.sample();
        assert!(live >= 48 << 20, "live {live}");
        drop(std::hint::black_box(v));
        let after = p.sample();
        assert!(after + (40 << 20) < live, "freed: {after} vs {live}");
        // The peak keeps the buffer, and little else: nothing else runs.
        assert!(p.step_peak() >= 48 << 20 && p.peak() >= 48 << 20);
        assert!(p.peak() < 49 << 20, "peak {}", p.peak());
    }

    #[test]
    fn rss_probe_sees_an_allocation() {
        let _serial = crate::tests::serial();
        if proc_status().is_none() {
            return;
        }
        let mut p = RssProbe::new();
        let v = vec![1u8; 64 << 20];
        p.sample();
        assert!(v.iter().map(|&b| b as u64).sum::<u64>() == 64 << 20);
        assert!(p.peak() >= 32 << 20, "peak {}", p.peak());
    }
}
