//! What the C allocator does with freed CPU tensor memory: kept for the next tensors
//! ([`reuse_freed_memory`]) or handed back to the system ([`return_freed_memory`]).

/// Makes the C allocator keep the memory of freed tensors for the next ones instead of handing it
/// back to the operating system: call it once, at the start of a program that trains or runs
/// models on the CPU.
///
/// Every candle operation allocates its output, and a training step or a forward pass frees and
/// allocates hundreds of tensors, from a few hundred kilobytes to tens of megabytes (the dense
/// gradient of a 30k-word embedding table is 47 MB). glibc serves allocations above its mmap
/// threshold (128 KiB, adjusted at run time up to 32 MiB) with fresh pages from the kernel, which
/// faults in and zeroes every page again, and returns them when they are freed. This turns mmap
/// allocation off (`M_MMAP_MAX = 0`: every allocation comes from the heap) and raises the trim
/// threshold to 2 GiB, so the same memory is reused from step to step. On a MiniLM fine-tuning
/// step (single-threaded, `BENCHMARKS.md`) page faults drop from 2.8 M to 0.45 M per run and CPU
/// time by about a quarter. The cost: memory a program has freed stays reserved to it (its
/// resident size stays at its peak).
///
/// Returns whether the setting took: on Linux with glibc; elsewhere (musl, macOS, Windows) it
/// does nothing and returns `false`. The same effect without code:
/// `GLIBC_TUNABLES=glibc.malloc.mmap_max=0:glibc.malloc.trim_threshold=2147483647`.
///
/// ```
/// let reused = module_runtime::reuse_freed_memory();
/// assert_eq!(reused, cfg!(all(target_os = "linux", target_env = "gnu")));
/// ```
pub fn reuse_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes the allocator's parameters; it is safe to call at any
        // time, from any thread (glibc takes its arena locks).
        let mmap = unsafe { libc::mallopt(libc::M_MMAP_MAX, 0) };
        let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX) };
        mmap == 1 && trim == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

/// Makes the C allocator hand the memory of freed tensors back to the operating system at once:
/// the opposite trade of [`reuse_freed_memory`], for a program whose peak resident memory is
/// what limits it (sharded training, a model that only just fits).
///
/// glibc serves an allocation above its mmap threshold with pages of its own, returned when the
/// block is freed, but raises the threshold (up to 32 MiB) each time such a block is freed; after
/// that the tensors below 32 MiB come from the heap, and the holes they leave stay resident. On
/// the SmolLM-135M-sized ZeRO stage 3 step (`examples/zero_memory.rs`, BENCHMARKS.md "ZeRO")
/// that is 250 MiB of the peak. This fixes the threshold at 64 KiB (which stops the raising) and
/// the trim threshold at 1 MiB. The cost: every larger tensor is faulted in, zeroed, anew.
///
/// Returns whether the setting took: on Linux with glibc; elsewhere it does nothing and returns
/// `false`. The last of the two calls wins. The same effect without code:
/// `MALLOC_MMAP_THRESHOLD_=65536 MALLOC_TRIM_THRESHOLD_=1048576`.
///
/// ```
/// let returned = module_runtime::return_freed_memory();
/// assert_eq!(returned, cfg!(all(target_os = "linux", target_env = "gnu")));
/// ```
pub fn return_freed_memory() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: `mallopt` only changes the allocator's parameters; it is safe to call at any
        // time, from any thread (glibc takes its arena locks).
        let mmap = unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, 64 * 1024) };
        let trim = unsafe { libc::mallopt(libc::M_TRIM_THRESHOLD, 1024 * 1024) };
        mmap == 1 && trim == 1
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}
