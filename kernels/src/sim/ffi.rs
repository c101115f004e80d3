//! The C entry points of the simulator library that build.rs compiles (kernels/sim/sim.cpp).

use std::ffi::{c_char, c_int, c_void, CStr, CString};

#[cfg(wasmserve_sim)]
unsafe extern "C" {
    fn wsim_launch(
        name: *const c_char,
        grid: *const u32,
        block: *const u32,
        shared_bytes: u32,
        args: *mut *mut c_void,
        kinds: *const c_char,
        first: u64,
        count: u64,
        reverse: c_int,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn wsim_signature(name: *const c_char) -> *const c_char;
    fn wsim_page_size() -> usize;
    fn wsim_map(bytes: usize) -> *mut u8;
    fn wsim_unmap(usable: *mut u8, bytes: usize);
}

/// The page size (what [`map`] rounds to).
#[cfg(wasmserve_sim)]
pub fn page_size() -> usize {
    // SAFETY: no arguments; sysconf cannot fail for the page size.
    unsafe { wsim_page_size() }
}

/// `bytes` (a multiple of [`page_size`]) of zeroed memory between two inaccessible pages, so a
/// kernel reaching past it faults and the simulator reports the fault; None when out of memory.
#[cfg(wasmserve_sim)]
pub fn map(bytes: usize) -> Option<std::ptr::NonNull<u8>> {
    // SAFETY: mmap of fresh anonymous memory; the C side checks every call it makes.
    std::ptr::NonNull::new(unsafe { wsim_map(bytes) })
}

/// Frees what [`map`]`(bytes)` returned.
///
/// # Safety
/// `usable` came from `map(bytes)` and nothing uses it any more.
#[cfg(wasmserve_sim)]
pub unsafe fn unmap(usable: std::ptr::NonNull<u8>, bytes: usize) {
    // SAFETY: see the contract above.
    unsafe { wsim_unmap(usable.as_ptr(), bytes) }
}

/// Whether the simulator library was built (a C++ compiler was found at build time).
pub const BUILT: bool = cfg!(wasmserve_sim);

/// Runs blocks `blocks` (linear index, x fastest) of `kernel`'s grid to completion on this thread.
/// `args[i]` points at parameter i's value (only read); `kinds` names each parameter (p pointer,
/// i int, l long, f float) and is checked against the kernel's signature. `reverse` runs a block's
/// threads from the last to the first between barriers (see [`crate::sim::ThreadOrder`]).
///
/// # Safety
/// Every pointer argument must point at memory large enough for what the kernel accesses, and
/// ranges of one grid running at once on other threads must not race (CUDA's rules for blocks).
pub unsafe fn launch(
    kernel: &str,
    grid: [u32; 3],
    block: [u32; 3],
    shared_bytes: u32,
    args: &[*mut c_void],
    kinds: &str,
    blocks: std::ops::Range<u64>,
    reverse: bool,
) -> Result<(), String> {
    let name = CString::new(kernel).map_err(|_| format!("kernel name {kernel:?} contains a NUL byte"))?;
    let kinds = CString::new(kinds).expect("kinds are ASCII letters");
    #[cfg(wasmserve_sim)]
    {
        let mut err = vec![0 as c_char; 1024];
        // SAFETY: the strings are NUL-terminated, the arrays have the lengths the C side reads,
        // and the caller guarantees the arguments (see above).
        let rc = unsafe {
            wsim_launch(
                name.as_ptr(),
                grid.as_ptr(),
                block.as_ptr(),
                shared_bytes,
                args.as_ptr() as *mut *mut c_void,
                kinds.as_ptr(),
                blocks.start,
                blocks.end - blocks.start,
                reverse as c_int,
                err.as_mut_ptr(),
                err.len(),
            )
        };
        if rc == 0 {
            Ok(())
        } else {
            // SAFETY: the C side always NUL-terminates (vsnprintf).
            Err(unsafe { CStr::from_ptr(err.as_ptr()) }.to_string_lossy().into_owned())
        }
    }
    #[cfg(not(wasmserve_sim))]
    {
        let _ = (name, kinds, grid, block, shared_bytes, args, blocks, reverse);
        Err(NOT_BUILT.to_string())
    }
}

/// The parameter kinds of `kernel` as the simulator compiled it, or None if it has no such kernel.
pub fn signature(kernel: &str) -> Option<String> {
    let name = CString::new(kernel).ok()?;
    #[cfg(wasmserve_sim)]
    {
        // SAFETY: NUL-terminated input; the result is null or a static NUL-terminated string.
        let p = unsafe { wsim_signature(name.as_ptr()) };
        (!p.is_null()).then(|| unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
    }
    #[cfg(not(wasmserve_sim))]
    {
        let _ = name;
        None
    }
}

pub const NOT_BUILT: &str =
    "the CUDA simulator was not built (no C++ compiler was found when the kernels crate was compiled)";
