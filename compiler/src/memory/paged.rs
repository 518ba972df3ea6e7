//! bitsandbytes' paged optimizers (`optimizer { impl = paged }`): the state tensors are
//! CUDA unified memory (`cudaMallocManaged`), which the driver keeps on the device while it
//! has room and evicts to host memory page by page when device allocations need the room.
//!
//! So the state counts on the device only as far as the budget leaves room for it: at the
//! step's highest point, what does not fit is on the host ([`evict`]). A plan whose
//! bytes other than the paged state exceed the budget still does not fit: eviction only
//! moves the paged state. The evicted pages move out as the forward and backward need the
//! room and come back when the optimizer step reads them: twice their bytes over PCIe a
//! step, priced by the cost model as host traffic. PyTorch's own counters
//! (`max_memory_allocated`) never see managed memory; what the model reports is the
//! device's, as `nvidia-smi` shows it.

use super::{Category, MemoryReport};
use crate::spec::Spec;

/// Take off the peak the paged state the budget has no room for.
pub fn evict(spec: &Spec, r: &mut MemoryReport) {
    if r.paged_bytes == 0 {
        return;
    }
    let budget = spec.fit.budget_bytes(spec.hardware.gpu.memory_bytes);
    let over = (r.peak_bytes + r.reserve_bytes).saturating_sub(budget);
    let evicted = over.min(r.paged_bytes);
    if evicted == 0 {
        return;
    }
    r.peak_bytes -= evicted;
    if let Some(b) = r.breakdown.get_mut(Category::Optimizer.as_str()) {
        *b = b.saturating_sub(evicted);
    }
    r.paged_evicted_bytes = evicted;
}
