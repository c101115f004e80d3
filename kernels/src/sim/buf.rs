//! Simulated device memory: pages from the simulator library that kernels write through raw
//! pointers while Rust holds only `&` references to the buffer (the launch wrappers pass outputs
//! as `&R::Buf`). Padding bytes before and after the elements catch a kernel writing just out of
//! bounds; the inaccessible pages around the padding (`ffi::map`) make an access further out fault,
//! which the simulator reports as the launch's error.

use std::ptr::NonNull;

use crate::gpu::{DevBuf, Elem};

/// Padding before the elements, in bytes (after them: at least this, up to the page's end).
const PAD_BYTES: usize = 64;
/// All ones: an f32 or bf16 read of the padding is a NaN and an i32 one is -1, so a kernel that
/// *reads* just out of bounds (which only the pages further out fault on) poisons its output
/// instead of passing.
const PAD_BYTE: u8 = 0xFF;

pub struct SimBuf<T> {
    /// `PAD_BYTES`, then `len` elements, then padding to the end of `bytes`.
    region: Region,
    len: usize,
    _elems: std::marker::PhantomData<T>,
}

// SAFETY: like device memory, a SimBuf is only written by kernels during a launch, and the safe
// launch wrappers only write buffers the caller passed as `&mut` (or created themselves); sharing
// `&SimBuf` across threads otherwise only reads it.
unsafe impl<T: Send> Send for SimBuf<T> {}
unsafe impl<T: Sync> Sync for SimBuf<T> {}

impl<T> DevBuf for SimBuf<T> {
    fn len(&self) -> usize {
        self.len
    }
}

impl<T: Elem> SimBuf<T> {
    /// A buffer holding `host`, or None when the memory cannot be mapped.
    pub(crate) fn from_slice(host: &[T]) -> Option<Self> {
        let data = std::mem::size_of_val(host);
        let region = Region::new(PAD_BYTES + data + PAD_BYTES)?;
        let b = Self { region, len: host.len(), _elems: std::marker::PhantomData };
        // SAFETY: the ranges lie inside the region, which nothing else references yet; the
        // elements start PAD_BYTES (a multiple of any element's alignment) into a page; every type
        // a kernel takes (f32, i32, u8, u16) is valid for any bit pattern.
        unsafe {
            let base = b.region.base.as_ptr();
            std::ptr::write_bytes(base, PAD_BYTE, PAD_BYTES);
            std::ptr::write_bytes(base.add(PAD_BYTES + data), PAD_BYTE, b.region.bytes - PAD_BYTES - data);
            std::ptr::copy_nonoverlapping(host.as_ptr(), b.ptr(), host.len());
        }
        Some(b)
    }

    /// The first element, as a kernel sees it.
    pub(crate) fn ptr(&self) -> *mut T {
        // SAFETY: PAD_BYTES is within the region.
        unsafe { self.region.base.as_ptr().add(PAD_BYTES) as *mut T }
    }

    /// The elements. No kernel writes them while the borrow lives: launches are synchronous and
    /// only write buffers passed to them (as `&mut` through the safe wrappers).
    pub(crate) fn as_slice(&self) -> &[T] {
        // SAFETY: `len` initialised elements start at `ptr()`; see above for why nothing writes them.
        unsafe { std::slice::from_raw_parts(self.ptr() as *const T, self.len) }
    }

    pub(crate) fn to_vec(&self) -> Vec<T> {
        self.as_slice().to_vec()
    }

    pub(crate) fn write(&mut self, offset: usize, host: &[T]) {
        debug_assert!(offset + host.len() <= self.len);
        // SAFETY: the caller checked the range; `&mut self` is exclusive.
        unsafe { std::ptr::copy_nonoverlapping(host.as_ptr(), self.ptr().add(offset), host.len()) }
    }

    /// Whether the padding is intact: false means a kernel wrote outside the buffer.
    pub(crate) fn guards_intact(&self) -> bool {
        let data = self.len * size_of::<T>();
        // SAFETY: both padding ranges lie inside the region and are read as plain bytes.
        unsafe {
            let base = self.region.base.as_ptr() as *const u8;
            let front = std::slice::from_raw_parts(base, PAD_BYTES);
            let back = std::slice::from_raw_parts(base.add(PAD_BYTES + data), self.region.bytes - PAD_BYTES - data);
            front.iter().chain(back).all(|&b| b == PAD_BYTE)
        }
    }
}

/// Whole pages between inaccessible ones, owned by one buffer.
struct Region {
    base: NonNull<u8>,
    bytes: usize,
}

impl Region {
    /// At least `bytes`, rounded up to whole pages.
    #[cfg(wasmserve_sim)]
    fn new(bytes: usize) -> Option<Self> {
        let page = super::ffi::page_size();
        let bytes = bytes.div_ceil(page) * page;
        super::ffi::map(bytes).map(|base| Self { base, bytes })
    }

    /// Unreachable: a buffer comes only from a `SimRuntime`, and there is none without the
    /// simulator library (`SimRuntime::new` fails).
    #[cfg(not(wasmserve_sim))]
    fn new(_bytes: usize) -> Option<Self> {
        None
    }
}

impl Drop for Region {
    fn drop(&mut self) {
        #[cfg(wasmserve_sim)]
        // SAFETY: `base` came from map(bytes) and the buffer owning the region is being dropped.
        unsafe {
            super::ffi::unmap(self.base, self.bytes);
        }
    }
}
