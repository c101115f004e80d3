//! NCCL (cudarc, dlopen-ed libnccl) across the GPUs of one node, two ways:
//! - [`NcclDeviceGroup`]: the device forward's tensor-parallel all-reduce, on device buffers,
//!   queued on each rank's own stream.
//! - [`NcclCollective`]: `parallel::Collective` on host slices, for the CPU-resident sharded models
//!   (one communicator per device from `ncclCommInitAll`, each rank driven from its own thread
//!   like `LocalCollective`'s ranks). The trait moves host slices, so each call stages through
//!   device memory (upload, collective on the rank's stream, synchronise, download). `abort`
//!   marks this rank failed so later calls return `Aborted`; a peer already blocked inside NCCL
//!   is released only by NCCL's own timeout (cudarc's `Comm` owns the handle `ncclCommAbort`
//!   needs and calls it on drop).
//!
//! Sums follow NCCL's order (reproducible with `NCCL_ALGO=Ring` on a fixed topology; see
//! docs/sharding.md).

use std::any::TypeId;
use std::sync::{Arc, Mutex};

use kernels::cuda::cudarc::driver::{CudaSlice, CudaStream, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use kernels::cuda::cudarc::nccl::{
    group_end, group_start, result as nccl_result, sys as nccl_sys, Comm, NcclType, ReduceOp,
};
use kernels::cuda::launch::CudaRuntime;
use kernels::cuda::nvrtc::guarded;
use kernels::cuda::{device, CudaError};

use crate::parallel::collective::{Collective, CollectiveError, Element, ReduceElement};
use crate::parallel::device_collective::{DeviceCollective, DeviceCollectiveError, DeviceGroup};

pub struct NcclCollective {
    comm: Comm,
    stream: Arc<CudaStream>,
    failed: Mutex<Option<String>>,
}

// SAFETY: an NCCL communicator may be used from any one thread at a time; each rank's handle is
// driven by one thread (the Collective contract), and the stream is owned by this rank.
unsafe impl Send for NcclCollective {}
unsafe impl Sync for NcclCollective {}

fn nccl_available() -> Result<(), CudaError> {
    for name in kernels::cuda::cudarc::get_lib_name_candidates("nccl") {
        // SAFETY: loading libnccl runs its initialisers only.
        if unsafe { libloading_open(&name) } {
            return Ok(());
        }
    }
    Err(CudaError::LibraryMissing {
        lib: "nccl",
        hint: "install NCCL (e.g. the nvidia-nccl-cu12 wheel) and put it on LD_LIBRARY_PATH",
    })
}

unsafe fn libloading_open(name: &str) -> bool {
    extern "C" {
        fn dlopen(filename: *const std::ffi::c_char, flag: i32) -> *mut std::ffi::c_void;
    }
    let Ok(c) = std::ffi::CString::new(name) else { return false };
    // SAFETY: dlopen with a valid C string; RTLD_LAZY.
    !unsafe { dlopen(c.as_ptr(), 1) }.is_null()
}

impl NcclCollective {
    /// One handle per device in `ordinals` (rank i = ordinals[i]).
    pub fn group(ordinals: &[usize]) -> Result<Vec<Self>, CudaError> {
        if ordinals.is_empty() {
            return Err(CudaError::BadArgs("an NCCL group needs at least one device".into()));
        }
        device::driver_available()?;
        nccl_available()?;
        let mut streams = Vec::new();
        for &o in ordinals {
            let ctx = device::open(o)?;
            streams.push(
                guarded("cuStreamCreate", || ctx.new_stream())?
                    .map_err(|e| CudaError::Driver { what: "cuStreamCreate", msg: format!("{e:?}") })?,
            );
        }
        let comms = guarded("ncclCommInitAll", || Comm::from_devices(streams.clone()))?
            .map_err(|e| CudaError::Driver { what: "ncclCommInitAll", msg: format!("{e:?}") })?;
        Ok(comms
            .into_iter()
            .zip(streams)
            .map(|(comm, stream)| Self { comm, stream, failed: Mutex::new(None) })
            .collect())
    }

    fn live(&self) -> Result<(), CollectiveError> {
        match &*self.failed.lock().unwrap_or_else(|p| p.into_inner()) {
            Some(reason) => Err(CollectiveError::Aborted { reason: reason.clone() }),
            None => Ok(()),
        }
    }

    fn fail(&self, op: &'static str, e: impl std::fmt::Debug) -> CollectiveError {
        let detail = format!("{e:?}");
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(format!("{op}: {detail}"));
        CollectiveError::BadArgument { op, detail }
    }

    fn up<U: DeviceRepr + ValidAsZeroBits>(&self, op: &'static str, h: &[U]) -> Result<CudaSlice<U>, CollectiveError> {
        if h.is_empty() {
            // cuMemAlloc refuses 0 bytes; an unused 1-element buffer stands in.
            return self.zeros(op, 1);
        }
        self.stream.clone_htod(h).map_err(|e| self.fail(op, e))
    }
    fn zeros<U: DeviceRepr + ValidAsZeroBits>(
        &self,
        op: &'static str,
        n: usize,
    ) -> Result<CudaSlice<U>, CollectiveError> {
        self.stream.alloc_zeros(n.max(1)).map_err(|e| self.fail(op, e))
    }
    fn down<U: DeviceRepr + Default + Clone>(
        &self,
        op: &'static str,
        d: &CudaSlice<U>,
        h: &mut [U],
    ) -> Result<(), CollectiveError> {
        let v = self.stream.clone_dtoh(d).map_err(|e| self.fail(op, e))?;
        h.clone_from_slice(&v[..h.len()]);
        Ok(())
    }
    fn sync(&self, op: &'static str) -> Result<(), CollectiveError> {
        self.stream.synchronize().map_err(|e| self.fail(op, e))
    }

    fn all_reduce_t<U: NcclType + DeviceRepr + ValidAsZeroBits + Default + Clone>(
        &self,
        buf: &mut [U],
    ) -> Result<(), CollectiveError> {
        if buf.is_empty() {
            return Ok(());
        }
        let mut d = self.up("all_reduce_sum", buf)?;
        self.comm.all_reduce_in_place(&mut d, &ReduceOp::Sum).map_err(|e| self.fail("all_reduce_sum", e))?;
        self.sync("all_reduce_sum")?;
        self.down("all_reduce_sum", &d, buf)
    }

    fn all_gather_t<U: NcclType + DeviceRepr + ValidAsZeroBits + Default + Clone>(
        &self,
        send: &[U],
        recv: &mut [U],
    ) -> Result<(), CollectiveError> {
        if recv.len() != send.len() * self.world_size() {
            return Err(CollectiveError::BadArgument {
                op: "all_gather",
                detail: format!("recv has {} elements, need {} ranks x {}", recv.len(), self.world_size(), send.len()),
            });
        }
        if send.is_empty() {
            return Ok(());
        }
        let d = self.up("all_gather", send)?;
        let mut r = self.zeros::<U>("all_gather", recv.len())?;
        self.comm.all_gather(&d, &mut r).map_err(|e| self.fail("all_gather", e))?;
        self.sync("all_gather")?;
        self.down("all_gather", &r, recv)
    }

    fn broadcast_t<U: NcclType + DeviceRepr + ValidAsZeroBits + Default + Clone>(
        &self,
        buf: &mut [U],
        root: usize,
    ) -> Result<(), CollectiveError> {
        if root >= self.world_size() {
            return Err(CollectiveError::BadArgument {
                op: "broadcast",
                detail: format!("root {root} of {} ranks", self.world_size()),
            });
        }
        if buf.is_empty() {
            return Ok(());
        }
        let mut d = self.up("broadcast", buf)?;
        self.comm.broadcast_in_place(&mut d, root as i32).map_err(|e| self.fail("broadcast", e))?;
        self.sync("broadcast")?;
        self.down("broadcast", &d, buf)
    }

    fn all_to_all_v_t<U: NcclType + DeviceRepr + ValidAsZeroBits + Default + Clone>(
        &self,
        send: &[U],
        send_counts: &[usize],
        recv: &mut [U],
        recv_counts: &[usize],
    ) -> Result<(), CollectiveError> {
        let w = self.world_size();
        let (ss, rs): (usize, usize) = (send_counts.iter().sum(), recv_counts.iter().sum());
        if send_counts.len() != w || recv_counts.len() != w || ss != send.len() || rs != recv.len() {
            return Err(CollectiveError::BadArgument {
                op: "all_to_all_v",
                detail: format!(
                    "counts for {} / {} peers summing to {ss} / {rs}, buffers {} / {}",
                    send_counts.len(),
                    recv_counts.len(),
                    send.len(),
                    recv.len()
                ),
            });
        }
        let d = self.up("all_to_all_v", send)?;
        let mut r = self.zeros::<U>("all_to_all_v", recv.len())?;
        group_start().map_err(|e| self.fail("all_to_all_v", e))?;
        let (mut so, mut ro) = (0, 0);
        let mut res = Ok(());
        for p in 0..w {
            if send_counts[p] > 0 && res.is_ok() {
                res = self
                    .comm
                    .send(&d.slice(so..so + send_counts[p]), p as i32)
                    .map_err(|e| self.fail("all_to_all_v", e));
            }
            if recv_counts[p] > 0 && res.is_ok() {
                res = self
                    .comm
                    .recv(&mut r.slice_mut(ro..ro + recv_counts[p]), p as i32)
                    .map(|_| ())
                    .map_err(|e| self.fail("all_to_all_v", e));
            }
            so += send_counts[p];
            ro += recv_counts[p];
        }
        // Always close the group, even after a failed enqueue.
        let end = group_end().map_err(|e| self.fail("all_to_all_v", e));
        res?;
        end?;
        self.sync("all_to_all_v")?;
        if !recv.is_empty() {
            self.down("all_to_all_v", &r, recv)?;
        }
        Ok(())
    }
}

/// Runs `$body` with `$u` bound to the concrete NCCL type equal to `T`.
macro_rules! by_type {
    ($t:ty, $op:literal, |$u:ident| $body:expr) => {{
        if TypeId::of::<$t>() == TypeId::of::<f32>() {
            type $u = f32;
            $body
        } else if TypeId::of::<$t>() == TypeId::of::<u32>() {
            type $u = u32;
            $body
        } else if TypeId::of::<$t>() == TypeId::of::<u64>() {
            type $u = u64;
            $body
        } else {
            Err(CollectiveError::BadArgument {
                op: $op,
                detail: format!("no NCCL type for {}", <$t as Element>::NCCL_NAME),
            })
        }
    }};
}

/// `&mut [T]` as `&mut [U]` when they are the same type (checked by the caller via TypeId).
fn cast_mut<T: 'static, U: 'static>(s: &mut [T]) -> &mut [U] {
    assert_eq!(TypeId::of::<T>(), TypeId::of::<U>());
    // SAFETY: T and U are the same type.
    unsafe { std::slice::from_raw_parts_mut(s.as_mut_ptr() as *mut U, s.len()) }
}
fn cast<T: 'static, U: 'static>(s: &[T]) -> &[U] {
    assert_eq!(TypeId::of::<T>(), TypeId::of::<U>());
    // SAFETY: T and U are the same type.
    unsafe { std::slice::from_raw_parts(s.as_ptr() as *const U, s.len()) }
}

impl Collective for NcclCollective {
    fn rank(&self) -> usize {
        self.comm.rank()
    }
    fn world_size(&self) -> usize {
        self.comm.world_size()
    }

    fn all_reduce_sum<T: ReduceElement>(&self, buf: &mut [T]) -> Result<(), CollectiveError> {
        self.live()?;
        by_type!(T, "all_reduce_sum", |U| self.all_reduce_t::<U>(cast_mut(buf)))
    }

    fn all_gather<T: Element>(&self, send: &[T], recv: &mut [T]) -> Result<(), CollectiveError> {
        self.live()?;
        by_type!(T, "all_gather", |U| self.all_gather_t::<U>(cast(send), cast_mut(recv)))
    }

    fn broadcast<T: Element>(&self, buf: &mut [T], root: usize) -> Result<(), CollectiveError> {
        self.live()?;
        by_type!(T, "broadcast", |U| self.broadcast_t::<U>(cast_mut(buf), root))
    }

    fn exchange_counts(&self, send_counts: &[usize]) -> Result<Vec<usize>, CollectiveError> {
        self.live()?;
        let w = self.world_size();
        if send_counts.len() != w {
            return Err(CollectiveError::BadArgument {
                op: "exchange_counts",
                detail: format!("{} counts for {w} ranks", send_counts.len()),
            });
        }
        // Every rank's whole count vector, then column `rank` is what each peer sends here.
        let mine: Vec<u64> = send_counts.iter().map(|&c| c as u64).collect();
        let mut all = vec![0u64; w * w];
        self.all_gather_t(&mine, &mut all)?;
        Ok((0..w).map(|p| all[p * w + self.rank()] as usize).collect())
    }

    fn all_to_all_v<T: Element>(
        &self,
        send: &[T],
        send_counts: &[usize],
        recv: &mut [T],
        recv_counts: &[usize],
    ) -> Result<(), CollectiveError> {
        self.live()?;
        by_type!(T, "all_to_all_v", |U| self.all_to_all_v_t::<U>(cast(send), send_counts, cast_mut(recv), recv_counts))
    }

    fn barrier(&self) -> Result<(), CollectiveError> {
        self.live()?;
        let mut one = [1u32];
        self.all_reduce_t(&mut one)
    }

    fn abort(&self, reason: &str) {
        tracing::warn!(rank = self.rank(), reason, "NCCL collective aborted");
        *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_string());
    }
}

/// NCCL between the device forward's tensor-parallel ranks, on their device buffers: one
/// communicator per rank (`ncclCommInitAll`), each all-reduce queued on that rank's own runtime
/// stream right after the kernels that produced its input: no host copy, no synchronisation.
///
/// The raw communicators are kept (not cudarc's `Comm`) because failing safely needs
/// `ncclCommAbort` on every rank's communicator: when one rank fails mid-step, its peers' queued
/// all-reduces would otherwise spin on the GPU forever and their threads would block in the next
/// copy back. Aborting releases them (their step then fails too), after which the group refuses
/// further steps: a communicator cannot be reused once aborted, so the server needs a restart.
pub struct NcclDeviceGroup {
    shared: Arc<NcclShared>,
}

struct NcclShared {
    /// `None` once aborted. Enqueues hold the read lock (briefly: NCCL calls return once the
    /// work is queued), `abort` the write lock, so no call uses a communicator being destroyed.
    comms: std::sync::RwLock<Option<Vec<nccl_sys::ncclComm_t>>>,
    /// Why the group was aborted.
    failed: Mutex<Option<String>>,
}

// SAFETY: the communicator handles are only used under `comms`' lock (see there); NCCL allows a
// communicator to be driven from any thread, one call at a time, which the per-rank use keeps.
unsafe impl Send for NcclShared {}
unsafe impl Sync for NcclShared {}

impl NcclShared {
    fn abort_all(&self, reason: &str) {
        let mut comms = self.comms.write().unwrap_or_else(|p| p.into_inner());
        if let Some(handles) = comms.take() {
            tracing::error!(reason, ranks = handles.len(), "aborting the tensor-parallel NCCL group");
            *self.failed.lock().unwrap_or_else(|p| p.into_inner()) = Some(reason.to_string());
            for h in handles {
                // SAFETY: each handle came from ncclCommInitAll and is aborted exactly once
                // (taken out of the lock above); ncclCommAbort also frees it.
                let _ = unsafe { nccl_result::comm_abort(h) };
            }
        }
    }

    fn failure(&self) -> Option<String> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

impl Drop for NcclShared {
    fn drop(&mut self) {
        if let Some(handles) = self.comms.get_mut().unwrap_or_else(|p| p.into_inner()).take() {
            for h in handles {
                // SAFETY: as in `abort_all`; nothing else holds the handles any more.
                let _ = unsafe { nccl_result::comm_destroy(h) };
            }
        }
    }
}

/// One rank's handle on an [`NcclDeviceGroup`].
struct NcclDeviceRank {
    rank: usize,
    shared: Arc<NcclShared>,
}

impl NcclDeviceGroup {
    /// One communicator per device of `gpus` (rank r = `gpus[r]`), bound to each runtime's stream.
    pub fn over(gpus: &[kernels::cuda::launch::Gpu]) -> Result<Self, CudaError> {
        nccl_available()?;
        let ordinals: Vec<i32> = gpus.iter().map(|g| g.rt.ctx.ordinal() as i32).collect();
        let mut handles = vec![std::ptr::null_mut(); gpus.len()];
        // SAFETY: `handles` has one slot per device listed in `ordinals`.
        guarded("ncclCommInitAll", || unsafe {
            nccl_result::comm_init_all(handles.as_mut_ptr(), ordinals.len() as i32, ordinals.as_ptr())
        })?
        .map_err(|e| CudaError::Driver { what: "ncclCommInitAll", msg: format!("{e:?}") })?;
        tracing::info!(?ordinals, "NCCL group for the tensor-parallel device forward");
        Ok(Self {
            shared: Arc::new(NcclShared { comms: std::sync::RwLock::new(Some(handles)), failed: Mutex::new(None) }),
        })
    }
}

impl DeviceGroup<CudaRuntime> for NcclDeviceGroup {
    fn world_size(&self) -> usize {
        self.shared.comms.read().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(0, Vec::len)
    }

    fn step_comms(&self) -> Result<Vec<Arc<dyn DeviceCollective<CudaRuntime>>>, DeviceCollectiveError> {
        if let Some(reason) = self.shared.failure() {
            return Err(DeviceCollectiveError::Invalid(format!(
                "the tensor-parallel NCCL group was aborted after an earlier failure ({reason}); restart the server"
            )));
        }
        let world = self.world_size();
        Ok((0..world)
            .map(|rank| {
                Arc::new(NcclDeviceRank { rank, shared: self.shared.clone() }) as Arc<dyn DeviceCollective<CudaRuntime>>
            })
            .collect())
    }
}

impl DeviceCollective<CudaRuntime> for NcclDeviceRank {
    fn rank(&self) -> usize {
        self.rank
    }

    fn world_size(&self) -> usize {
        self.shared.comms.read().unwrap_or_else(|p| p.into_inner()).as_ref().map_or(0, Vec::len)
    }

    fn all_reduce_sum(
        &self,
        gpu: &kernels::cuda::launch::Gpu,
        buf: &mut CudaSlice<f32>,
        n: usize,
    ) -> Result<(), DeviceCollectiveError> {
        if n > buf.len() {
            return Err(DeviceCollectiveError::Invalid(format!(
                "all_reduce_sum of {n} elements on a buffer of {}",
                buf.len()
            )));
        }
        if n == 0 {
            return Ok(());
        }
        let comms = self.shared.comms.read().unwrap_or_else(|p| p.into_inner());
        let Some(handles) = comms.as_ref() else {
            return Err(CollectiveError::Aborted { reason: self.shared.failure().unwrap_or_default() }.into());
        };
        let stream = &gpu.rt.stream;
        // NCCL does not bind the context itself, and this rank's thread may be a fresh one.
        stream
            .context()
            .bind_to_thread()
            .map_err(|e| CudaError::Driver { what: "cuCtxSetCurrent", msg: format!("{e:?}") })?;
        let (ptr, _sync) = buf.device_ptr_mut(stream);
        // SAFETY: `ptr` is a live device buffer of at least `n` f32 on this rank's device, the
        // handle is this rank's (kept alive by the read lock), and the stream is the one every
        // kernel of this rank runs on, so the reduce is ordered after them.
        let r = unsafe {
            nccl_result::all_reduce(
                ptr as *const _,
                ptr as *mut _,
                n,
                nccl_sys::ncclDataType_t::ncclFloat32,
                nccl_sys::ncclRedOp_t::ncclSum,
                handles[self.rank],
                stream.cu_stream() as _,
            )
        };
        r.map(|_| ()).map_err(|e| {
            DeviceCollectiveError::Device(CudaError::Driver { what: "ncclAllReduce", msg: format!("{e:?}") })
        })
    }

    /// Aborts every rank's communicator: peers spinning in an all-reduce this rank will never
    /// join are released (see [`NcclDeviceGroup`]).
    fn abort(&self, reason: &str) {
        self.shared.abort_all(&format!("rank {}: {reason}", self.rank));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without a driver (or NCCL, or two GPUs) the group is an error naming what is missing.
    /// With them, two ranks all-reduce, gather and exchange like LocalCollective.
    #[test]
    fn nccl_group_is_a_clear_error_without_gpus_and_sums_with_them() {
        match NcclCollective::group(&[0, 1]) {
            Err(e) => {
                let msg = e.to_string();
                eprintln!("SKIPPED nccl collective on 2 GPUs: {msg}");
                assert!(msg.contains("libcuda") || msg.contains("libnccl") || msg.contains("no CUDA device"), "{msg}");
                if std::env::var_os("WASMSERVE_REQUIRE_NCCL").is_some_and(|v| v == "1") {
                    panic!("{msg}");
                }
            }
            Ok(ranks) => {
                let ranks: Vec<Arc<NcclCollective>> = ranks.into_iter().map(Arc::new).collect();
                let handles: Vec<_> = ranks
                    .iter()
                    .cloned()
                    .map(|c| {
                        std::thread::spawn(move || {
                            let r = c.rank();
                            let mut v = vec![r as f32 + 1.0; 5];
                            c.all_reduce_sum(&mut v).unwrap();
                            let mut g = vec![0u32; 4];
                            c.all_gather(&[r as u32, 10 + r as u32], &mut g).unwrap();
                            let counts = c.exchange_counts(&[1 + r, 2]).unwrap();
                            c.barrier().unwrap();
                            (v, g, counts)
                        })
                    })
                    .collect();
                let out: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
                for (r, (v, g, counts)) in out.iter().enumerate() {
                    assert_eq!(v, &vec![3.0; 5]);
                    assert_eq!(g, &vec![0, 10, 1, 11]);
                    assert_eq!(counts, &vec![[1usize, 2][r], 2], "rank {r}");
                }
            }
        }
    }
}
