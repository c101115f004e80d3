//! The CPU simulator's own semantics, on the test-only kernels of kernels/sim/selftest.cu:
//! warp collectives and block barriers give CUDA's results, launch geometry and scalar arguments
//! arrive intact, and a barrier that can never complete is an error from the launch, not a hang.
//!
//! Without the simulator (no C++ compiler at build time) each test prints `SKIPPED ...` and
//! passes, unless `WASMSERVE_REQUIRE_SIM=1` (CI), where it fails.

use kernels::gpu::{Dims, KArg, Runtime};
use kernels::sim::{SimRuntime, ThreadOrder};

fn sim(test: &str) -> Option<SimRuntime> {
    match SimRuntime::new() {
        Ok(rt) => Some(rt),
        Err(e) if std::env::var_os("WASMSERVE_REQUIRE_SIM").is_some_and(|v| v == "1") => panic!("{test}: {e}"),
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            None
        }
    }
}

fn launch(rt: &SimRuntime, kernel: &'static str, dims: Dims, args: &[KArg<'_, SimRuntime>]) -> Result<(), String> {
    // SAFETY: every test kernel's buffers are sized for the dimensions it is launched with.
    unsafe { rt.launch(kernel, dims, args) }.map_err(|e| e.to_string())
}

#[test]
fn warp_collectives_and_block_barriers_give_cuda_results() {
    let Some(rt) = sim("warp_collectives_and_block_barriers_give_cuda_results") else { return };
    let (blocks, threads) = (2usize, 96usize);
    let out = rt.zeros::<f32>(blocks * threads * 8).unwrap();
    launch(&rt, "simtest_collectives", Dims::new((blocks as u32, 1, 1), threads as u32), &[KArg::F32s(&out)]).unwrap();
    let got = rt.download(&out).unwrap();
    let block_total: f32 = (1..=threads).map(|v| v as f32).sum();
    for b in 0..blocks {
        for i in 0..threads {
            let o = &got[(b * threads + i) * 8..][..8];
            let (lane, warp0) = (i % 32, i / 32 * 32);
            let v = |l: usize| (warp0 + l + 1) as f32;
            let warp_total: f32 = (0..32).map(v).sum();
            assert_eq!(o[0], warp_total, "warp_sum, thread {i}");
            assert_eq!(o[1], v(3), "shfl from lane 3, thread {i}");
            assert_eq!(o[2], if lane < 31 { v(lane + 1) } else { v(lane) }, "shfl_down 1, thread {i}");
            assert_eq!(o[3], if lane >= 2 { v(lane - 2) } else { v(lane) }, "shfl_up 2, thread {i}");
            assert_eq!(o[4], 0xaaaa_aaaau32 as f32, "ballot of odd lanes, thread {i}");
            assert_eq!(o[5], v(lane ^ 4), "xor 4 within width 8, thread {i}");
            assert_eq!(o[6], block_total, "block_sum, thread {i}");
            assert_eq!(o[7], (threads - 1 - i) as f32, "shared memory after __syncthreads, thread {i}");
        }
    }
}

#[test]
fn threads_that_returned_count_as_arrived_at_syncthreads() {
    let Some(rt) = sim("threads_that_returned_count_as_arrived_at_syncthreads") else { return };
    let out = rt.zeros::<i32>(128).unwrap();
    launch(&rt, "simtest_early_exit", Dims::new((1, 1, 1), 128), &[KArg::I32s(&out), KArg::I32(50)]).unwrap();
    let got = rt.download(&out).unwrap();
    for (i, &v) in got.iter().enumerate().take(50) {
        assert_eq!(v, (49 - i as i32) * 10);
    }
    assert!(got[50..].iter().all(|&v| v == 0));
}

#[test]
fn barriers_that_can_never_complete_are_errors_not_hangs() {
    let Some(rt) = sim("barriers_that_can_never_complete_are_errors_not_hangs") else { return };
    let out = rt.zeros::<f32>(64).unwrap();
    let e = launch(&rt, "simtest_exit_before_shuffle", Dims::new((1, 1, 1), 64), &[KArg::F32s(&out)]).unwrap_err();
    eprintln!("{e}");
    assert!(e.contains("exited") && e.contains("__shfl_xor_sync") && e.contains("prelude.cuh"), "{e}");

    let ints = rt.zeros::<i32>(64).unwrap();
    let e = launch(&rt, "simtest_divergent_barriers", Dims::new((1, 1, 1), 64), &[KArg::I32s(&ints)]).unwrap_err();
    eprintln!("{e}");
    assert!(e.contains("different barriers") && e.contains("selftest.cu"), "{e}");

    let e = launch(&rt, "simtest_mixed_wait", Dims::new((1, 1, 1), 64), &[KArg::I32s(&ints)]).unwrap_err();
    eprintln!("{e}");
    assert!(e.contains("deadlock") && e.contains("__syncwarp"), "{e}");

    // The runtime still works after aborted launches (fiber stacks are reused).
    launch(&rt, "simtest_early_exit", Dims::new((1, 1, 1), 64), &[KArg::I32s(&ints), KArg::I32(64)]).unwrap();
    assert_eq!(rt.download(&ints).unwrap()[0], 630);
}

#[test]
fn launch_geometry_and_scalars_arrive_intact() {
    let Some(parallel) = sim("launch_geometry_and_scalars_arrive_intact") else { return };
    // Serially and with ranges of blocks on rayon's threads: the same result.
    for rt in [parallel, SimRuntime::serial().unwrap()] {
        let (grid, block) = ((3u32, 2u32, 2u32), (4u32, 3u32, 2u32));
        let threads = (grid.0 * grid.1 * grid.2 * block.0 * block.1 * block.2) as usize;
        let out = rt.zeros::<i32>(threads * 6).unwrap();
        let dims = Dims { grid, block, shared_mem_bytes: 0 };
        launch(&rt, "simtest_geometry", dims, &[KArg::I32s(&out), KArg::I64(1 << 40), KArg::F32(7.0)]).unwrap();
        let got = rt.download(&out).unwrap();
        let mut k = 0;
        for bz in 0..grid.2 as i32 {
            for by in 0..grid.1 as i32 {
                for bx in 0..grid.0 as i32 {
                    for tz in 0..block.2 as i32 {
                        for ty in 0..block.1 as i32 {
                            for tx in 0..block.0 as i32 {
                                // (int)(1 << 40) is 0: the long arrived whole and was narrowed by the kernel.
                                assert_eq!(&got[k * 6..k * 6 + 6], &[tx, ty, tz, bx, by, bz + 7]);
                                k += 1;
                            }
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn atomics_and_argument_checks() {
    let Some(rt) = sim("atomics_and_argument_checks") else { return };
    let out = rt.zeros::<i32>(1).unwrap();
    launch(&rt, "simtest_atomic", Dims::new((5, 1, 1), 256), &[KArg::I32s(&out)]).unwrap();
    assert_eq!(rt.download(&out).unwrap()[0], (0..1280).sum::<i32>());

    let f = rt.zeros::<f32>(4).unwrap();
    let e = launch(&rt, "no_such_kernel", Dims::new((1, 1, 1), 32), &[]).unwrap_err();
    assert!(e.contains("no kernel no_such_kernel"), "{e}");
    let e = launch(&rt, "simtest_atomic", Dims::new((1, 1, 1), 32), &[KArg::F32(1.0)]).unwrap_err();
    assert!(e.contains("\"p\"") && e.contains("\"f\""), "{e}");
    let e = launch(&rt, "simtest_atomic", Dims::new((1, 1, 1), 2048), &[KArg::I32s(&out)]).unwrap_err();
    assert!(e.contains("block (2048, 1, 1)"), "{e}");
    let e = launch(&rt, "simtest_atomic", Dims::new((0, 1, 1), 32), &[KArg::I32s(&out)]).unwrap_err();
    assert!(e.contains("grid (0, 1, 1)"), "{e}");
    let e =
        launch(&rt, "simtest_write_past_end", Dims::new((1, 1, 1), 32), &[KArg::F32s(&f), KArg::I32(4)]).unwrap_err();
    assert!(e.contains("out of bounds"), "{e}");

    // A read just past the end does not fault, but the padding it reads is a NaN, which fails
    // any comparison with the reference (kernels::compare).
    let (input, copy) = (rt.upload(&[1.0f32, 2.0, 3.0, 4.0]).unwrap(), rt.zeros::<f32>(4).unwrap());
    launch(&rt, "simtest_read_past_end", Dims::new((1, 1, 1), 4), &[KArg::F32s(&copy), KArg::F32s(&input)]).unwrap();
    let got = rt.download(&copy).unwrap();
    assert_eq!(&got[..3], &[2.0, 3.0, 4.0]);
    assert!(got[3].is_nan(), "{got:?}");
    assert_eq!(kernels::compare::max_abs_error(&got, &[2.0, 3.0, 4.0, 0.0]), f32::INFINITY);
}

/// An access past a buffer's padding, and a simulated thread overflowing its stack, reach an
/// inaccessible page: the fault ends that launch with an error (block, thread, what happened), as
/// CUDA's "illegal address" would, and the next launch on the same OS thread runs normally.
#[test]
fn memory_faults_fail_the_launch_not_the_process() {
    let Some(rt) = sim("memory_faults_fail_the_launch_not_the_process") else { return };
    let rt = rt.with_order(ThreadOrder::Forward);
    let (input, out) = (rt.upload(&[1.0f32, 2.0, 3.0, 4.0]).unwrap(), rt.zeros::<f32>(32).unwrap());
    let read_at = |at: i32| {
        launch(&rt, "simtest_read_at", Dims::new((1, 1, 1), 32), &[KArg::F32s(&out), KArg::F32s(&input), KArg::I32(at)])
    };
    // Within the padding: a NaN, no fault.
    read_at(100).unwrap();
    assert!(rt.download(&out).unwrap()[0].is_nan());
    // Past the padding, into the inaccessible page after the buffer or before it (an access that
    // jumps over that page lands in whatever is mapped beyond, unchecked).
    for at in [1020, 2000, -17, -1000] {
        let e = read_at(at).unwrap_err();
        assert!(e.contains("simtest_read_at: block (0, 0, 0), thread (0, 0, 0): memory fault at"), "{at}: {e}");
    }
    let e = launch(&rt, "simtest_write_past_end", Dims::new((1, 1, 1), 32), &[KArg::F32s(&out), KArg::I32(1100)])
        .unwrap_err();
    assert!(e.contains("memory fault at"), "{e}");
    let e = launch(&rt, "simtest_stack_overflow", Dims::new((1, 1, 1), 32), &[KArg::F32s(&out), KArg::I32(100_000)])
        .unwrap_err();
    assert!(e.contains("thread (0, 0, 0): stack overflow"), "{e}");

    // The same OS thread goes on launching.
    launch(&rt, "simtest_stack_overflow", Dims::new((1, 1, 1), 32), &[KArg::F32s(&out), KArg::I32(3)]).unwrap();
    assert_eq!(rt.download(&out).unwrap(), vec![6.0; 32]);
    read_at(2).unwrap();
    assert_eq!(rt.download(&out).unwrap()[0], 3.0);
}

/// A read of another thread's write with no barrier between them sees the write in forward order
/// and misses it in reverse order (reading the poison every block's shared memory starts with);
/// a race-free kernel (the collectives one) gives the same results
/// in both.
#[test]
fn reverse_thread_order_exposes_a_missing_barrier() {
    let Some(rt) = sim("reverse_thread_order_exposes_a_missing_barrier") else { return };
    let (blocks, threads) = (3usize, 64usize);
    let racy = |rt: &SimRuntime, tag: i32| {
        let out = rt.zeros::<i32>(blocks * threads).unwrap();
        launch(
            rt,
            "simtest_missing_barrier",
            Dims::new((blocks as u32, 1, 1), threads as u32),
            &[KArg::I32s(&out), KArg::I32(tag)],
        )
        .unwrap();
        rt.download(&out).unwrap()
    };
    let forward = rt.with_order(ThreadOrder::Forward);
    let got = racy(&forward, 100);
    assert!(
        (0..blocks * threads).all(|i| got[i] == 100 + (i / threads) as i32),
        "forward order: every thread runs after thread 0's write: {got:?}"
    );
    let reverse = SimRuntime::serial().unwrap().with_order(ThreadOrder::Reverse);
    let got = racy(&reverse, 200);
    for b in 0..blocks {
        let tag = 200 + b as i32;
        assert_eq!(got[b * threads], tag, "thread 0 reads its own write");
        // They read the poison each block's shared memory starts with (all ones), not the write
        // the previous block left there, which would be a plausible tag.
        assert!(
            got[b * threads + 1..(b + 1) * threads].iter().all(|&v| v == -1),
            "block {b}: the other threads ran first and missed the write: {got:?}"
        );
    }

    let collectives = |rt: &SimRuntime| {
        let out = rt.zeros::<f32>(2 * 96 * 8).unwrap();
        launch(rt, "simtest_collectives", Dims::new((2, 1, 1), 96), &[KArg::F32s(&out)]).unwrap();
        rt.download(&out).unwrap()
    };
    assert_eq!(collectives(&forward), collectives(&reverse));
}

/// `__shared__` is per OS thread: launches running at once on different threads do not mix.
#[test]
fn concurrent_launches_on_different_threads_share_nothing() {
    let Some(_) = sim("concurrent_launches_on_different_threads_share_nothing") else { return };
    std::thread::scope(|s| {
        for t in 0..4 {
            s.spawn(move || {
                let rt = SimRuntime::new().unwrap();
                for _ in 0..20 {
                    let out = rt.zeros::<i32>(256).unwrap();
                    let live = 100 + t * 40;
                    launch(&rt, "simtest_early_exit", Dims::new((1, 1, 1), 256), &[KArg::I32s(&out), KArg::I32(live)])
                        .unwrap();
                    let got = rt.download(&out).unwrap();
                    for (i, &v) in got.iter().enumerate().take(live as usize) {
                        assert_eq!(v, (live - 1 - i as i32) * 10);
                    }
                }
            });
        }
    });
}

/// build.rs registered every kernel that src/cuda/sources.rs lists, with a parameter list the
/// simulator could classify (no `?` kinds).
#[test]
fn every_listed_kernel_is_in_the_simulator_registry() {
    let Some(_) = sim("every_listed_kernel_is_in_the_simulator_registry") else { return };
    for src in kernels::cuda::sources::SOURCES {
        for k in src.kernels {
            let sig =
                kernels::sim::ffi::signature(k).unwrap_or_else(|| panic!("{k} ({}) is not in the simulator", src.name));
            assert!(!sig.is_empty() && !sig.contains('?'), "{k}: parameter kinds {sig:?}");
        }
    }
    assert_eq!(kernels::sim::ffi::signature("int4_gemv").as_deref(), Some("plppppiiii"));
    assert!(kernels::sim::ffi::signature("no_such_kernel").is_none());
}
