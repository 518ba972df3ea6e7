//! rcoa patch: pages backed by device memory only as far as they are used.
//!
//! A page of at least [`ExpandablePages::min_page`] bytes is virtual address space
//! (`cuMemAddressReserve`), and [`ExpandablePage::commit`] maps physical memory
//! (`cuMemCreate`, `cuMemMap`, `cuMemSetAccess`) up to the end of a slice handed out, in
//! multiples of [`ExpandablePages::step`]. CubeCL's sliced pool fills a page first fit
//! from its start, so one large page that takes every size is one heap whose top is what
//! the device gives: no slack from rounding tensors up to pages, and a hole of any size is
//! reused by any smaller tensor. PyTorch's `expandable_segments` rests on the same calls.
//!
//! Memory is mapped once and kept until the page is freed: nothing is unmapped while a
//! kernel could still use it.

use cudarc::driver::DriverError;
use cudarc::driver::sys::{
    self, CUdevice, CUdeviceptr, CUmemAccessDesc, CUmemAllocationProp,
    CUmemGenericAllocationHandle, CUmemLocation,
};
use std::mem::MaybeUninit;

/// Which pages of a device's memory management are expandable, and how they grow.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpandablePages {
    /// A page this large or larger is reserved as address space and mapped as used.
    pub min_page: u64,
    /// Physical memory is mapped in multiples of this many bytes (rounded up to the
    /// device's allocation granularity).
    pub step: u64,
}

/// One expandable page: reserved address space, mapped from its start up to `mapped`.
pub(crate) struct ExpandablePage {
    base: CUdeviceptr,
    /// The size asked for, what CubeCL counts as the page.
    asked: u64,
    /// The address space reserved: `asked`, at most 9/8 of the device's memory (what
    /// PyTorch reserves per segment), rounded up to `step`.
    size: u64,
    step: u64,
    device: CUdevice,
    /// The physical allocations mapped, in address order: (handle, offset, bytes).
    chunks: Vec<(CUmemGenericAllocationHandle, u64, u64)>,
    mapped: u64,
}

/// CUDA 13.2 turned `CUmemLocation::id` into a union with the same layout (an `int`
/// after the location's type); writing both words keeps this independent of the version
/// cudarc's bindings were generated for.
fn device_location(device: CUdevice) -> CUmemLocation {
    const _: () = assert!(std::mem::size_of::<CUmemLocation>() == 8);
    let mut location = MaybeUninit::<CUmemLocation>::zeroed();
    // SAFETY: `CUmemLocation` is two 32-bit words, the location type then the id
    // (asserted size, `#[repr(C)]` in every cudarc binding), and every bit pattern of an
    // integer is valid.
    unsafe {
        let words = location.as_mut_ptr() as *mut [i32; 2];
        (*words)[0] = sys::CUmemLocationType::CU_MEM_LOCATION_TYPE_DEVICE as i32;
        (*words)[1] = device;
        location.assume_init()
    }
}

fn allocation_prop(device: CUdevice) -> CUmemAllocationProp {
    // SAFETY: a C struct of integers and a pointer, for which zero is valid (no handle
    // types requested, no flags, no Windows metadata).
    let mut prop: CUmemAllocationProp = unsafe { MaybeUninit::zeroed().assume_init() };
    prop.type_ = sys::CUmemAllocationType::CU_MEM_ALLOCATION_TYPE_PINNED;
    prop.location = device_location(device);
    prop
}

impl ExpandablePage {
    /// Reserve `size` bytes of address space on the current context's device; nothing is
    /// mapped yet.
    pub fn reserve(size: u64, step: u64) -> Result<Self, DriverError> {
        let mut device = 0;
        // SAFETY: the context of the device whose storage this is is current on this thread
        // (every allocation of a CubeCL CUDA server runs there); the calls write only into
        // the locals passed.
        unsafe {
            sys::cuCtxGetDevice(&mut device).result()?;
            let prop = allocation_prop(device);
            let mut granularity = 0usize;
            sys::cuMemGetAllocationGranularity(
                &mut granularity,
                &prop,
                sys::CUmemAllocationGranularity_flags::CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
            )
            .result()?;
            let granularity = (granularity as u64).max(1);
            let step = step.max(1).next_multiple_of(granularity);
            // More than the device has could never be mapped; a page of 256 GiB of address
            // space per stream need not be asked of the driver.
            let mut total = 0usize;
            sys::cuDeviceTotalMem_v2(&mut total, device).result()?;
            let reserved = size.min(total as u64 / 8 * 9).next_multiple_of(step);
            let mut base = 0;
            sys::cuMemAddressReserve(&mut base, reserved as usize, granularity as usize, 0, 0)
                .result()?;
            Ok(Self {
                base,
                asked: size,
                size: reserved,
                step,
                device,
                chunks: Vec::new(),
                mapped: 0,
            })
        }
    }

    /// The start of the page's address range.
    pub fn base(&self) -> CUdeviceptr {
        self.base
    }

    /// The bytes of device memory mapped.
    pub fn mapped(&self) -> u64 {
        self.mapped
    }

    /// The page's size as asked for (what CubeCL counts as reserved for it).
    pub fn asked(&self) -> u64 {
        self.asked
    }

    /// Map device memory so that the first `end` bytes of the page are usable. One
    /// physical allocation covers the whole growth; a failure maps nothing of it.
    pub fn commit(&mut self, end: u64) -> Result<(), DriverError> {
        if end <= self.mapped {
            return Ok(());
        }
        if end > self.size {
            // Above what the device could back: out of memory, as a mapping would be.
            return Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY));
        }
        let bytes = (end - self.mapped)
            .next_multiple_of(self.step)
            .min(self.size - self.mapped);
        debug_assert_eq!(bytes % self.step, 0);
        let at = self.base + self.mapped;
        let prop = allocation_prop(self.device);
        let access = CUmemAccessDesc {
            location: device_location(self.device),
            flags: sys::CUmemAccess_flags::CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        };
        let mut handle = 0;
        // SAFETY: `[at, at + bytes)` lies in this page's reserved range above everything
        // mapped, so no kernel can be using it; each failure undoes what succeeded before it.
        unsafe {
            sys::cuMemCreate(&mut handle, bytes as usize, &prop, 0).result()?;
            if let Err(e) = sys::cuMemMap(at, bytes as usize, 0, handle, 0).result() {
                let _ = sys::cuMemRelease(handle);
                return Err(e);
            }
            if let Err(e) = sys::cuMemSetAccess(at, bytes as usize, &access, 1).result() {
                let _ = sys::cuMemUnmap(at, bytes as usize);
                let _ = sys::cuMemRelease(handle);
                return Err(e);
            }
        }
        self.chunks.push((handle, self.mapped, bytes));
        self.mapped += bytes;
        Ok(())
    }

    /// Unmap and free everything. The caller has waited for every kernel that used it.
    pub fn release(self) {
        // SAFETY: each chunk was mapped at its offset with its size by `commit`, and the
        // range was reserved by `reserve`; they are released once, here.
        unsafe {
            for &(handle, offset, bytes) in &self.chunks {
                if let Err(e) = sys::cuMemUnmap(self.base + offset, bytes as usize).result() {
                    eprintln!("CUDA unmap error: {e}");
                }
                let _ = sys::cuMemRelease(handle);
            }
            let _ = sys::cuMemAddressFree(self.base, self.size as usize);
        }
    }
}
