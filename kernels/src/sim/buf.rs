//! Simulated device memory: a host allocation that kernels write through raw pointers while Rust
//! holds only `&` references to it (the launch wrappers pass outputs as `&R::Buf`), hence the
//! `UnsafeCell`. Guard bytes before and after the elements catch a kernel writing out of bounds.

use std::cell::UnsafeCell;

use crate::gpu::{DevBuf, Elem};

/// Guard size on each side, in bytes.
const GUARD_BYTES: usize = 64;
/// All ones: an f32 or bf16 read past the end is a NaN and an i32 one is -1, so a kernel that
/// *reads* out of bounds (which the guards cannot see) poisons its output instead of passing.
const GUARD_BYTE: u8 = 0xFF;

pub struct SimBuf<T> {
    /// `guard` elements, then `len` elements, then `guard` elements.
    cells: Box<[UnsafeCell<T>]>,
    len: usize,
    guard: usize,
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
    pub(crate) fn from_slice(host: &[T]) -> Self {
        let guard = GUARD_BYTES.div_ceil(size_of::<T>().max(1));
        let cells: Box<[UnsafeCell<T>]> = (0..host.len() + 2 * guard).map(|_| UnsafeCell::new(T::default())).collect();
        let b = Self { cells, len: host.len(), guard };
        // SAFETY: both ranges lie inside `cells`, which nothing else references yet; every type a
        // kernel takes (f32, i32, u8, u16) is valid for any bit pattern.
        unsafe {
            let base = b.cells.as_ptr() as *mut T;
            std::ptr::write_bytes(base, GUARD_BYTE, guard);
            std::ptr::write_bytes(base.add(guard + b.len), GUARD_BYTE, guard);
            std::ptr::copy_nonoverlapping(host.as_ptr(), b.ptr(), host.len());
        }
        b
    }

    /// The first element, as a kernel sees it (`UnsafeCell<T>` has `T`'s layout).
    pub(crate) fn ptr(&self) -> *mut T {
        // SAFETY: `guard` is within the allocation.
        unsafe { (self.cells.as_ptr() as *mut T).add(self.guard) }
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

    /// Whether the guard bytes are intact: false means a kernel wrote outside the buffer.
    pub(crate) fn guards_intact(&self) -> bool {
        let bytes = self.guard * size_of::<T>();
        // SAFETY: both guard ranges lie inside the allocation and are read as plain bytes.
        unsafe {
            let base = self.cells.as_ptr() as *const u8;
            let front = std::slice::from_raw_parts(base, bytes);
            let back = std::slice::from_raw_parts(base.add((self.guard + self.len) * size_of::<T>()), bytes);
            front.iter().chain(back).all(|&b| b == GUARD_BYTE)
        }
    }
}
