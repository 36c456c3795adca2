//! Freed CPU tensor memory kept for the next tensors: [`reuse_freed_memory`].

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
