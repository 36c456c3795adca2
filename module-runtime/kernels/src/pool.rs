//! The barrier pool: candle's own pool of CPU threads (the threads of its elementwise kernels,
//! which wait spinning between calls), on which every pass of this crate splits its work.

use std::sync::{Mutex, PoisonError};

/// Below this many values a pass stays on the calling thread (candle's elementwise kernels use the
/// same threshold): handing it out would cost more than the other threads save.
const PARALLEL_MIN_VALUES: usize = 1 << 16;

/// The length of the blocks of whole rows (of `width` values) that a pass over `len` values is
/// split into: one block per thread of [`par_map`], or one block for a pass that stays on the
/// calling thread. Never zero.
pub(crate) fn block_len(len: usize, width: usize) -> usize {
    let threads = candle_core::utils::barrier_pool().n_workers() + 1;
    if len < PARALLEL_MIN_VALUES || threads < 2 || width == 0 {
        return len.max(1);
    }
    (len / width).div_ceil(threads).max(1) * width
}

/// `f` of each job, in order, the jobs spread over candle's barrier pool: the threads of candle's
/// own elementwise kernels, with the calling thread as one of them. Those threads are awake right
/// after a candle kernel or a product of [`matmul`](crate::matmul), which in a forward or backward
/// pass is always just before; handing the jobs to another pool (rayon's) would leave them
/// spinning beside it on the same cores. One job runs on the calling thread.
pub(crate) fn par_map<J: Send, R: Send>(jobs: Vec<J>, f: impl Fn(J) -> R + Sync) -> Vec<R> {
    if jobs.len() <= 1 {
        return jobs.into_iter().map(f).collect();
    }
    let slots: Vec<Mutex<(Option<J>, Option<R>)>> = jobs
        .into_iter()
        .map(|j| Mutex::new((Some(j), None)))
        .collect();
    candle_core::utils::barrier_pool().execute_chunked(slots.len(), |range| {
        for slot in &slots[range] {
            let mut slot = slot.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(job) = slot.0.take() {
                slot.1 = Some(f(job));
            }
        }
    });
    slots
        .into_iter()
        .filter_map(|s| s.into_inner().unwrap_or_else(PoisonError::into_inner).1)
        .collect()
}

/// `f` over `0..items` in one contiguous run per thread of candle's barrier pool (the last run
/// shorter), each run handed to the first free thread: where each item is a read of cold memory
/// in order, each thread's reads are then one stream the hardware prefetcher follows from start
/// to end, which items handed out a few at a time break at every jump (the `q8_0` products and
/// decode attention, BENCHMARKS.md). A call from within the pool runs inline.
pub(crate) fn par_runs(items: usize, f: impl Fn(std::ops::Range<usize>) + Sync) {
    let pool = candle_core::utils::barrier_pool();
    let runs = pool.n_workers() + 1;
    let per_run = items.div_ceil(runs);
    pool.execute_chunked(runs, |range| {
        for run in range {
            let start = (run * per_run).min(items);
            f(start..(start + per_run).min(items));
        }
    });
}
