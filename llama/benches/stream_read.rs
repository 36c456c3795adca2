//! The speed at which this machine's cores read memory that is not in their caches: the bound
//! on decoding, which reads every weight once per token. A buffer the size of the
//! SmolLM-135M-shaped decoder's `q8_0` weights (143 MB: 34 bytes per 32 weights) is summed by 1
//! and 2 threads, each its half, with plain 32-byte loads and with non-temporal prefetches 2 KiB
//! ahead (as module-nn's `q8_0` kernel streams a weight); and what the decoder's weights would
//! allow at that rate, in `q8_0` (143 MB a token) and float32 (540 MB).
//!
//! ```text
//! cargo bench -p llama --bench stream_read
//! ```

use std::time::Instant;

/// Bytes of the SmolLM-135M-shaped decoder's weights in `q8_0` and in float32.
const Q8_0_BYTES: usize = 134_515_008 / 32 * 34;
const F32_BYTES: usize = 134_515_008 * 4;

/// Sums `chunk` in 32-byte steps with four accumulators; with `prefetch`, each step first asks
/// for the line 2 KiB ahead, non-temporally.
fn sum(chunk: &[u64], prefetch: bool) -> u64 {
    let mut acc = [0u64; 4];
    for (i, four) in chunk.chunks_exact(4).enumerate() {
        #[cfg(target_arch = "x86_64")]
        if prefetch && i % 2 == 0 {
            use std::arch::x86_64::{_mm_prefetch, _MM_HINT_NTA};
            let ahead = four.as_ptr().wrapping_add(256);
            // SAFETY: a prefetch reads nothing into the program and cannot fault.
            unsafe { _mm_prefetch::<_MM_HINT_NTA>(ahead.cast()) };
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (prefetch, i);
        for (a, v) in acc.iter_mut().zip(four) {
            *a = a.wrapping_add(*v);
        }
    }
    acc.iter().fold(0, |a, v| a.wrapping_add(*v))
}

fn main() {
    let words = Q8_0_BYTES / 8;
    let buffer: Vec<u64> = (0..words as u64).collect();
    let bytes = (words * 8) as f64;
    for threads in [1usize, 2] {
        for prefetch in [false, true] {
            let mut rates = Vec::new();
            for _ in 0..9 {
                let start = Instant::now();
                let total = std::thread::scope(|scope| {
                    let handles: Vec<_> = buffer
                        .chunks(words.div_ceil(threads))
                        .map(|chunk| scope.spawn(move || sum(chunk, prefetch)))
                        .collect();
                    handles
                        .into_iter()
                        .fold(0u64, |a, h| a.wrapping_add(h.join().unwrap()))
                });
                std::hint::black_box(total);
                rates.push(bytes / start.elapsed().as_secs_f64() / 1e9);
            }
            rates.sort_by(f64::total_cmp);
            let rate = rates[4];
            println!(
                "{threads} thread(s), {:>22}: {rate:5.1} GB/s (median of 9; {:.1}–{:.1}) → \
                 q8_0 weights {:5.0} tokens/s, float32 {:4.0} tokens/s at most",
                if prefetch {
                    "non-temporal prefetch"
                } else {
                    "plain loads"
                },
                rates[0],
                rates[8],
                rate * 1e9 / Q8_0_BYTES as f64,
                rate * 1e9 / F32_BYTES as f64,
            );
        }
    }
}
