//! The product of input rows with a CPU `q8_0`, `q4_0` or `q4_K` weight: decoding's matmul, where every
//! weight is read once per token and the speed is the speed at which the weights stream from
//! memory, and a prompt's (up to [`Q8_0_MAX_ROWS`](crate::Q8_0_MAX_ROWS) rows), where it is
//! arithmetic and `vpdpbusd`'s 64 byte products an instruction beat the float GEMM's 16.
//!
//! Each input row is rounded to 8 bits per block of 32 (ggml's `quantize_row_q8_0`, as candle
//! does for both kinds: a scale `max|x| / 127` stored as float16, the values `round(x / scale)`),
//! then each output is `Σ_blocks scale_w · scale_x · Σ w_q x_q`, the integer sums exact: candle's
//! numbers up to the order of the float additions.
//!
//! The weight is read in a layout of its own, [`Tiles`] (`tiles.rs`), made once per weight and
//! kept with it ([`Param::quantized_layout`]), in place of the weight's own bytes: per tile of 16
//! output rows and one block of 32 inputs, the 16 rows' float16 scales together, and their bytes
//! four at a time across the 16 rows, so one 64-byte load holds 4 bytes of 16 rows and one
//! instruction (`vpdpbusd`) adds their products into 16 lanes, one per output, with no horizontal
//! sums. `q8_0` bytes are stored plus 128 (unsigned, as `vpdpbusd` takes them), and the block's
//! input sum times 128 is taken off after; `q4_0`'s bytes are ggml's, two weights each, whose
//! nibbles (the weight plus 8) are split in registers, and the input sum times 8 is taken off;
//! `q4_K`'s nibbles likewise, per block `d·sc·Σ q·x − dmin·m·Σ x` with the 16 rows' 6-bit
//! scales and minimums decoded in lanes (the input is rounded per block of 32 here, per 256 in
//! candle and llama.cpp: results differ by that rounding, the tests bound it).
//! x86-64 CPUs with AVX-512 VNNI run that; AVX2 ones the same layout eight rows at a time
//! (`q8_0` bytes made signed again, llama.cpp's sign trick; `q4_0` nibbles are unsigned already).
//! Other CPUs keep candle's kernel (NEON on ARM): the scalar loop here is the reference the tests
//! check the SIMD loops against. Row tiles are split over candle's barrier pool, one contiguous
//! run per thread.
//!
//! Candle 0.11's kernels for the same products read a `q8_0` weight whose rows are not a multiple
//! of 256 at about 10 GB/s on two cores here, one 32-block at a time with a horizontal sum each
//! (BENCHMARKS.md, "Quantized weights"), decode a `q4_0` model at 80 tokens/s where these
//! decode it at 215–280, and read `q4_K` at 14–18 GB/s where this reads it at 27–34.

use candle_core::quantized::GgmlDType;
use candle_core::{DType, Device, Tensor};
use half::f16;

use crate::error::Result;
use crate::matmul::SharedOut;
use crate::Param;
use tiles::{q4k_header, q4k_scale_min, Format, Quad, Tiles, Q4K_BLOCKS};

/// Inputs per block of every kind here (`q4_K`'s super-blocks are 8 of them).
const BLOCK: usize = 32;
/// Output rows per tile: one 512-bit register of 32-bit lanes.
const ROWS: usize = 16;
/// Input rows one pass over a tile multiplies (its accumulators stay in registers); more rows
/// take further passes over the same tile, whose bytes are in the L1 cache by then.
const MAX_M: usize = 4;

/// Whether a weight of `kind` on `device` takes this crate's `q8_0` kernel on this CPU (a CPU
/// `q8_0`, `q4_0` or `q4_K` weight, AVX2 or better): [`quantized_linear`](crate::quantized_linear)
/// multiplies it with this kernel, which makes tiles of the weight that then replace its bytes.
pub fn q8_0_kernel_applies(kind: GgmlDType, device: &Device) -> bool {
    matches!(kind, GgmlDType::Q8_0 | GgmlDType::Q4_0 | GgmlDType::Q4K)
        && device.is_cpu()
        && Kernel::detect() != Kernel::Scalar
}

/// `x · wᵀ` for every weight of `params` (all with `k` inputs), as one pass over the thread pool:
/// the rows are rounded to 8 bits once, and the tiles of every weight are one list that the
/// pool's threads share out. `None` when the kernel does not apply to `x` or to any of the
/// weights (a kind, device or CPU the kernel does not take, a non-float32 input: the caller then takes candle's quantized matmul).
pub(crate) fn q8_0_matmul_each(x: &Tensor, params: &[&Param]) -> Result<Option<Vec<Tensor>>> {
    let kernel = Kernel::detect();
    if !x.device().is_cpu() || x.dtype() != DType::F32 || kernel == Kernel::Scalar {
        return Ok(None);
    }
    let (m, k) = x.dims2()?;
    if m == 0 || params.is_empty() {
        return Ok(None);
    }
    let mut weights = Vec::with_capacity(params.len());
    for param in params {
        match param.quantized_layout(Tiles::new) {
            Some(w) if w.k == k => weights.push(w),
            _ => return Ok(None),
        }
    }
    let x = x.contiguous()?;
    let (storage, layout) = x.storage_and_layout();
    let candle_core::Storage::Cpu(storage) = &*storage else {
        return Ok(None);
    };
    // Read in place: the rows are only rounded to 8 bits, never kept.
    let values = crate::cpu::f32_slice(storage, layout, "q8_0 matmul")?;
    let weights: Vec<&Tiles> = weights.iter().map(|w| &**w).collect();
    Ok(Some(matmul(values, m, k, &weights, kernel)?))
}

/// The products `[m, n]` of the rows `x` (`m` rows of `k`) with each weight.
fn matmul(
    x: &[f32],
    m: usize,
    k: usize,
    weights: &[&Tiles],
    kernel: Kernel,
) -> Result<Vec<Tensor>> {
    // The rows in groups of up to `MAX_M`, each group one pass over a tile; a prompt's groups are
    // rounded on the pool's threads (on the calling thread alone this was a tenth of a 128-token
    // prefill, the other thread idle).
    let groups: Vec<Quantized> = crate::pool::par_map(x.chunks(MAX_M * k).collect(), |rows| {
        Quantized::new(rows, rows.len() / k, k, kernel)
    });
    // Weight `i`'s tiles are numbers `first[i]..first[i + 1]` of one list.
    let mut first = vec![0];
    for w in weights {
        first.push(first[first.len() - 1] + w.n.div_ceil(ROWS));
    }
    // One pass over each tile (up to four rows: decoding): its bytes are read once, and
    // streamed past the caches (see `Kernel::tile`).
    let stream = groups.len() == 1;
    // The products, `[m, n]` per weight, each tile writing its columns of every row where it
    // computes them (on the pool's threads, not after on the calling thread).
    let mut outs: Vec<Vec<f32>> = weights
        .iter()
        .map(|w| Vec::with_capacity(m * w.n))
        .collect();
    let out_at: Vec<SharedOut> = outs.iter_mut().map(|o| SharedOut(o.as_mut_ptr())).collect();
    // Candle's own pool for its CPU kernels (the calling thread works too, and waits spinning):
    // a product takes tens of microseconds, less than a sleeping rayon worker takes to wake.
    let body = |range: std::ops::Range<usize>| {
        let mut tile_out = [0f32; MAX_M * ROWS];
        for t in range {
            let i = first.partition_point(|&f| f <= t) - 1;
            let (w, local) = (weights[i], t - first[i]);
            let (quads, scales) = w.tile(local);
            let (col, count) = (local * ROWS, ROWS.min(w.n - local * ROWS));
            for (g, xq) in groups.iter().enumerate() {
                kernel.tile(w.format, quads, scales, xq, &mut tile_out, stream);
                for (r, values) in tile_out.chunks_exact(ROWS).take(xq.m).enumerate() {
                    let row = g * MAX_M + r;
                    // SAFETY: tile `t` alone writes columns `col..col + count` of its weight's
                    // rows (`col + count <= n`, `row < m`), into a buffer of `m * n` that
                    // outlives the pool's call.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            values.as_ptr(),
                            out_at[i].at(row * w.n + col),
                            count,
                        )
                    };
                }
            }
        }
    };
    // The tiles in one contiguous run per thread (`par_runs`). Handed out in sixteenths from a
    // shared cursor, each thread's runs were interleaved with the other's, and every jump
    // restarted the prefetcher on cold memory: one-row decoding ran 15-18% slower (paired ratios
    // of this way over that one 1.176, 1.219, 1.204, 1.181 in one process; a prompt's rows,
    // compute-bound, 0.992).
    crate::pool::par_runs(first[weights.len()], body);
    weights
        .iter()
        .zip(outs)
        .map(|(w, mut out)| {
            // SAFETY: the tiles cover every column of every row (above), and each was written.
            unsafe { out.set_len(m * w.n) };
            Ok(Tensor::from_vec(out, (m, w.n), &Device::Cpu)?)
        })
        .collect()
}

/// Input rows rounded to `q8_0`: row `r`'s values at `q[r * k..]`; per block, its scale
/// (float16-rounded, as candle and ggml store it) and 128 times the sum of its values.
struct Quantized {
    q: Vec<i8>,
    d: Vec<f32>,
    offset: Vec<f32>,
    m: usize,
    k: usize,
}

impl Quantized {
    fn new(x: &[f32], m: usize, k: usize, kernel: Kernel) -> Self {
        let mut q = vec![0i8; m * k];
        let mut d = vec![0f32; m * k / BLOCK];
        let mut offset = vec![0f32; m * k / BLOCK];
        for (((xb, qb), db), ob) in x
            .as_chunks::<BLOCK>()
            .0
            .iter()
            .zip(q.as_chunks_mut::<BLOCK>().0)
            .zip(d.iter_mut())
            .zip(offset.iter_mut())
        {
            let (scale, sum) = kernel.round_block(xb, qb);
            *db = f16::from_f32(scale).to_f32();
            *ob = 128.0 * sum as f32;
        }
        Self { q, d, offset, m, k }
    }
}

/// One block of inputs rounded to 8 bits into `q`: its scale `max|x| / 127` (before the float16
/// rounding) and the sum of the rounded values. The reference for the SIMD versions.
fn round_block(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
    let amax = x.iter().fold(0f32, |a, v| a.max(v.abs()));
    let scale = amax / 127.0;
    let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
    let mut sum = 0i32;
    for (v, o) in x.iter().zip(q.iter_mut()) {
        *o = round_half_away(v * inv) as i8;
        sum += *o as i32;
    }
    (scale, sum)
}

/// `v` rounded to the nearest integer, halves away from zero: `f32::round` (ggml's `roundf`) for
/// the values here (|v| ≤ 127), without the call to libm's `roundf` that `f32::round` is on
/// x86-64's baseline (a truncating conversion and a compare, which the compiler vectorizes).
#[inline(always)]
fn round_half_away(v: f32) -> i32 {
    let t = v as i32; // toward zero
    let frac = v - t as f32; // exact: |v| < 2^23
    t + (frac >= 0.5) as i32 - (frac <= -0.5) as i32
}

/// The inner loop this CPU runs.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Kernel {
    Scalar,
    #[cfg(target_arch = "x86_64")]
    Avx2,
    #[cfg(target_arch = "x86_64")]
    Vnni,
}

impl Kernel {
    /// The loops [`kernel_choice`](crate::kernel_choice)'s quantized level gives on this thread
    /// (AVX-512 there means the CPU has AVX-512 F, BW and VNNI; AVX2 that it has AVX2, FMA and
    /// F16C).
    fn detect() -> Self {
        match crate::kernel_choice().quantized {
            #[cfg(target_arch = "x86_64")]
            crate::CpuCapability::Avx512 => Kernel::Vnni,
            #[cfg(target_arch = "x86_64")]
            crate::CpuCapability::Avx2 => Kernel::Avx2,
            _ => Kernel::Scalar,
        }
    }

    /// Whether this CPU runs the AVX2 loops (also where it has the VNNI ones).
    #[cfg(all(test, target_arch = "x86_64"))]
    fn has_avx2() -> bool {
        use std::arch::is_x86_feature_detected as has;
        has!("avx2") && has!("fma") && has!("f16c")
    }

    /// [`round_block`] of one block, with AVX-512 where the CPU has it (the decoder rounds every
    /// product's input row, 121 a token: 3% of a `q8_0` step in scalar code).
    fn round_block(self, x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
        match self {
            // SAFETY: `detect` picks `Vnni` only where the CPU has AVX-512 F and BW.
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => unsafe { x86::round_block_avx512(x, q) },
            _ => round_block(x, q),
        }
    }

    /// One tile's outputs for every input row: `out[r * 16 + i]` is row `r`'s output `i`.
    ///
    /// With `stream` (the tile is read once), the SIMD loops prefetch the bytes a few blocks
    /// ahead with the non-temporal hint: the weights of a decoding step (145 MB for a
    /// SmolLM-135M-shaped model in `q8_0`) then pass through without pushing the key/value cache
    /// and the activations, which the step reads again, out of the L2 and L3 caches.
    fn tile(
        self,
        format: Format,
        quads: &[Quad],
        scales: &[[u16; ROWS]],
        x: &Quantized,
        out: &mut [f32],
        stream: bool,
    ) {
        // What the SIMD loops' unchecked loads and stores rely on.
        assert!(quads.len() == scales.len() * format.quads() && x.k == scales.len() * BLOCK);
        assert!(format != Format::Q4K || scales.len().is_multiple_of(Q4K_BLOCKS));
        assert!(x.m <= MAX_M && out.len() >= x.m * ROWS);
        match (self, format) {
            (Kernel::Scalar, _) => scalar(format, quads, scales, x, out),
            // SAFETY: `detect` picked these only where the CPU has the features they are
            // compiled for; the lengths are the ones asserted above.
            #[cfg(target_arch = "x86_64")]
            (Kernel::Avx2, Format::Q8) => unsafe {
                x86::tile_avx2::<false>(quads, scales, x, out, stream)
            },
            #[cfg(target_arch = "x86_64")]
            (Kernel::Vnni, Format::Q8) => unsafe {
                x86::tile_vnni::<false>(quads, scales, x, out, stream)
            },
            #[cfg(target_arch = "x86_64")]
            (Kernel::Avx2, Format::Q4) => unsafe {
                x86::tile_avx2::<true>(quads, scales, x, out, stream)
            },
            #[cfg(target_arch = "x86_64")]
            (Kernel::Vnni, Format::Q4) => unsafe {
                x86::tile_vnni::<true>(quads, scales, x, out, stream)
            },
            #[cfg(target_arch = "x86_64")]
            (Kernel::Avx2, Format::Q4K) => unsafe {
                x86::tile_avx2_q4k(quads, scales, x, out, stream)
            },
            #[cfg(target_arch = "x86_64")]
            (Kernel::Vnni, Format::Q4K) => unsafe {
                x86::tile_vnni_q4k(quads, scales, x, out, stream)
            },
        }
    }
}

/// The portable inner loop: exact integer sums per block, scaled and added in `f32`.
fn scalar(format: Format, quads: &[Quad], scales: &[[u16; ROWS]], x: &Quantized, out: &mut [f32]) {
    if format == Format::Q4K {
        return scalar_q4k(quads, scales, x, out);
    }
    let qpb = format.quads();
    for r in 0..x.m {
        let xq = &x.q[r * x.k..(r + 1) * x.k];
        let nb = x.k / BLOCK;
        for i in 0..ROWS {
            let mut acc = 0f32;
            for (b, scale) in scales.iter().enumerate() {
                let xb = &xq[b * BLOCK..(b + 1) * BLOCK];
                let mut sum = 0i32;
                for g in 0..qpb {
                    let w = &quads[b * qpb + g].0[i * 4..i * 4 + 4];
                    for j in 0..4 {
                        // `q4_K` returned above: `q8_0` or `q4_0`.
                        sum += if format == Format::Q8 {
                            (w[j] as i32 - 128) * xb[g * 4 + j] as i32
                        } else {
                            (((w[j] & 15) as i32) - 8) * xb[g * 4 + j] as i32
                                + (((w[j] >> 4) as i32) - 8) * xb[16 + g * 4 + j] as i32
                        };
                    }
                }
                acc += f16::from_bits(scale[i]).to_f32() * x.d[r * nb + b] * sum as f32;
            }
            out[r * ROWS + i] = acc;
        }
    }
}

/// [`scalar`] for `q4_K` tiles: per block `dx · (d·sc·Σ q·x − dmin·m·Σ x)`.
fn scalar_q4k(quads: &[Quad], scales: &[[u16; ROWS]], x: &Quantized, out: &mut [f32]) {
    let nb = x.k / BLOCK;
    for r in 0..x.m {
        let xq = &x.q[r * x.k..(r + 1) * x.k];
        for i in 0..ROWS {
            let mut acc = 0f32;
            for (s, entries) in scales.chunks_exact(Q4K_BLOCKS).enumerate() {
                let d = f16::from_bits(entries[0][i]).to_f32();
                let dmin = f16::from_bits(entries[1][i]).to_f32();
                let header = q4k_header(entries);
                let bytes: [u8; 12] = std::array::from_fn(|k| header[16 * k + i]);
                for j in 0..Q4K_BLOCKS {
                    let (sc, m) = q4k_scale_min(j, &bytes);
                    let b = s * Q4K_BLOCKS + j;
                    let mut sum = 0i32;
                    for g in 0..8 {
                        let quad = &quads[(s * Q4K_BLOCKS) * 4 + (j / 2) * 8 + g].0;
                        for t in 0..4 {
                            let byte = quad[i * 4 + t];
                            let q = if j % 2 == 0 { byte & 15 } else { byte >> 4 };
                            sum += q as i32 * xq[b * BLOCK + g * 4 + t] as i32;
                        }
                    }
                    let xsum = x.offset[r * nb + b] / 128.0;
                    let w = d * sc as f32 * sum as f32 - dmin * m as f32 * xsum;
                    acc += x.d[r * nb + b] * w;
                }
            }
            out[r * ROWS + i] = acc;
        }
    }
}

mod tiles;
#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests;
