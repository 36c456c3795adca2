//! A file's values read straight into a fresh vector, neither zeroed first nor faulted in 4 KiB
//! pages: what a checkpoint load makes each tensor's storage of.

use std::fs::File;
use std::os::fd::AsRawFd;

/// The `n` values of `T` at byte `offset` of `file` (in the file's byte order), read straight
/// into a fresh vector: what a checkpoint load makes a tensor's storage of.
///
/// On Linux the vector is not zeroed first: `pread` fills its spare capacity, since a zeroing
/// pass over memory the read overwrites next cost a fifth of the MiniLM load (`perf`: memset,
/// the allocator recycling the memory of an earlier load). The storage of a large tensor also
/// gets transparent huge pages (`madvise(MADV_HUGEPAGE)`, above 4 MiB).
pub fn read_values_at<T: bytemuck::Pod>(
    file: &File,
    offset: u64,
    n: usize,
) -> std::io::Result<Vec<T>> {
    let mut values: Vec<T> = Vec::with_capacity(n);
    let len = n * std::mem::size_of::<T>();
    let base = values.as_mut_ptr().cast::<u8>();
    advise_huge_pages(base, len);
    let mut done = 0;
    while done < len {
        let at = libc::off_t::try_from(offset + done as u64)
            .map_err(|_| std::io::Error::other("offset beyond what the OS can address"))?;
        // SAFETY: `base + done .. base + len` lies inside the vector's allocation (capacity
        // for `n` values of `T`), which nothing else references; `pread` writes at most
        // `len - done` bytes there and reads nothing.
        let got = unsafe { libc::pread(file.as_raw_fd(), base.add(done).cast(), len - done, at) };
        match got {
            0 => return Err(std::io::ErrorKind::UnexpectedEof.into()),
            got if got > 0 => done += got as usize,
            _ => {
                let error = std::io::Error::last_os_error();
                if error.kind() != std::io::ErrorKind::Interrupted {
                    return Err(error);
                }
            }
        }
    }
    // SAFETY: `pread` wrote all `len` bytes of the first `n` values, and any bytes are a
    // valid `T` (`Pod`).
    unsafe { values.set_len(n) };
    Ok(values)
}

/// Below this size a tensor's storage gets no huge pages: it would hold at most one.
const HUGE_PAGE_MIN_BYTES: usize = 4 << 20;

/// Asks Linux to back the untouched, freshly allocated `len` bytes at `base` with transparent
/// huge pages (2 MiB) before the load writes them, where the kernel leaves that to the program
/// (`/sys/kernel/mm/transparent_hugepage/enabled` = `madvise`, the common default).
///
/// A load copies the checkpoint into fresh memory, and faulting that memory in 4 KiB pages costs
/// about as much as the copy itself: one fault per page, each zeroing its page first. With huge
/// pages the kernel takes 512 times fewer faults (BENCHMARKS.md, "The load alone"). It is advice:
/// where the kernel has no huge page at hand, or transparent huge pages are off, it falls back
/// to small pages, and an error is ignored.
fn advise_huge_pages(base: *mut u8, len: usize) {
    if len < HUGE_PAGE_MIN_BYTES {
        return;
    }
    // madvise wants a page-aligned start; the pages before it keep the default.
    const PAGE: usize = 4096;
    let start = base as usize;
    let aligned = start.next_multiple_of(PAGE);
    let len = (start + len).saturating_sub(aligned) / PAGE * PAGE;
    // SAFETY: `[aligned, aligned + len)` lies inside the caller's allocation, whose contents
    // nobody reads yet (the load writes all of it next). MADV_HUGEPAGE changes how the range is
    // backed, never its contents or its validity.
    unsafe {
        libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
    }
}
