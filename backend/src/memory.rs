//! Measured memory, beside the compiler's prediction.
//!
//! Neither backend has a peak counter, so the trainer samples: after every
//! layer's forward and backward, after the loss and after the optimizer step.
//! What a sample reads depends on the device:
//! - CPU (ndarray): the process's resident set. `VmHWM` (the kernel's
//!   high-water mark of the resident set) minus the resident set before the
//!   model was built: the peak RSS growth of training. It includes the
//!   allocator's retained pages and everything else the process touched, so
//!   it is an upper bound on tensor bytes.
//! - CUDA: CubeCL's memory manager, `bytes_in_use` (live tensor bytes, the
//!   quantity the compiler predicts), minus what was in use before the model
//!   was built; `bytes_reserved` (pool pages taken from the driver) is kept
//!   beside it.

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

    #[test]
    fn rss_probe_sees_an_allocation() {
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
