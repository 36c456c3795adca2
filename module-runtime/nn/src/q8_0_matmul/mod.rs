//! The product of input rows with a CPU `q8_0` weight: decoding's matmul, where every weight is read
//! once per token and the speed is the speed at which the weights stream from memory, and a
//! prompt's (up to [`Q8_0_MAX_ROWS`](crate::Q8_0_MAX_ROWS) rows), where it is arithmetic and
//! `vpdpbusd`'s 64 byte products an instruction beat the float GEMM's 16.
//!
//! Each input row is rounded to 8 bits per block of 32 (ggml's `quantize_row_q8_0`, as candle
//! does: a scale `max|x| / 127` stored as float16, the values `round(x / scale)`), then each
//! output is `Σ_blocks scale_w · scale_x · Σ w_q x_q`, the integer sums exact: candle's numbers up
//! to the order of the float additions.
//!
//! The weight is read in a layout of its own, [`Q8Tiles`], made once per weight and kept with it
//! ([`Param::quantized_layout`]): per tile of 16 output rows and one block of 32 inputs, the 16
//! rows' float16 scales together, and their bytes four inputs at a time across the 16 rows, so one
//! 64-byte load holds 4 inputs of 16 rows and one instruction (`vpdpbusd`) adds their products
//! into 16 lanes, one per output, with no horizontal sums. The bytes are stored plus 128
//! (unsigned, as `vpdpbusd` takes them); the block's input sum times 128 is taken off after. x86-64
//! CPUs with AVX-512 VNNI run that; AVX2 ones the same layout eight rows at a time (bytes made
//! signed again, llama.cpp's sign trick). Other CPUs keep candle's kernel (NEON on ARM): the
//! scalar loop here is the reference the tests check the SIMD loops against. Row tiles are split
//! over candle's barrier pool, one contiguous run per thread.
//!
//! Candle 0.11's kernel for the same product reads a `q8_0` weight whose rows are not a multiple
//! of 256 at about 10 GB/s on two cores here, one 32-block at a time with a horizontal sum each
//! (BENCHMARKS.md, "Quantized weights"); this one streams it at float32's rate.

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::f16;

use crate::error::Result;
use crate::Param;
use module_core::QuantizedLayout;

/// Inputs per `q8_0` block.
const BLOCK: usize = 32;
/// Bytes per `q8_0` block in ggml's layout: a float16 scale, then 32 signed bytes.
const BLOCK_BYTES: usize = 2 + BLOCK;
/// Output rows per tile: one 512-bit register of 32-bit lanes.
const ROWS: usize = 16;
/// Input rows one pass over a tile multiplies (its accumulators stay in registers); more rows
/// take further passes over the same tile, whose bytes are in the L1 cache by then.
const MAX_M: usize = 4;

/// 64 bytes, aligned for whole-register loads: four inputs of the 16 rows of a tile.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Quad([u8; 64]);

/// A `q8_0` weight `[n, k]` in tiles of 16 rows by one block (see the module's docs).
pub(crate) struct Q8Tiles {
    n: usize,
    k: usize,
    /// Per tile (row tile major, then block): 8 quads; quad `g` holds inputs `4g..4g+4` of the
    /// block for rows 0..16, row after row, each byte plus 128.
    quads: Vec<Quad>,
    /// Per tile: the 16 rows' scales (float16 bits; 0 for the rows that pad the last tile).
    scales: Vec<[u16; ROWS]>,
}

impl Q8Tiles {
    /// The tiles of `w`, or `None` when it is not a CPU `q8_0` matrix.
    fn new(w: &QTensor) -> Option<Self> {
        if w.dtype() != GgmlDType::Q8_0 || !w.device().is_cpu() {
            return None;
        }
        let (n, k) = w.shape().dims2().ok()?;
        let data = w.data().ok()?;
        let nb = k / BLOCK;
        if k % BLOCK != 0 || data.len() != n * nb * BLOCK_BYTES {
            return None;
        }
        let tiles = n.div_ceil(ROWS);
        let mut quads = vec![Quad([128; 64]); tiles * nb * 8];
        let mut scales = vec![[0u16; ROWS]; tiles * nb];
        for row in 0..n {
            let (t, r) = (row / ROWS, row % ROWS);
            for b in 0..nb {
                let block = &data[(row * nb + b) * BLOCK_BYTES..][..BLOCK_BYTES];
                scales[t * nb + b][r] = u16::from_le_bytes([block[0], block[1]]);
                for (g, four) in block[2..].chunks_exact(4).enumerate() {
                    let quad = &mut quads[(t * nb + b) * 8 + g].0[r * 4..r * 4 + 4];
                    for (q, v) in quad.iter_mut().zip(four) {
                        *q = (*v as i8 as i16 + 128) as u8;
                    }
                }
            }
        }
        Some(Self {
            n,
            k,
            quads,
            scales,
        })
    }
}

/// The tiles hold every byte of the weight (regrouped, each byte plus 128): once they are made,
/// the weight's own bytes are dropped and its rows come back from here.
impl QuantizedLayout for Q8Tiles {
    fn holds_weight(&self) -> bool {
        true
    }

    fn row_bytes(&self, rows: &[usize]) -> Vec<u8> {
        let nb = self.k / BLOCK;
        let mut bytes = Vec::with_capacity(rows.len() * nb * BLOCK_BYTES);
        for &row in rows {
            let (t, r) = (row / ROWS, row % ROWS);
            for b in 0..nb {
                bytes.extend_from_slice(&self.scales[t * nb + b][r].to_le_bytes());
                for quad in &self.quads[(t * nb + b) * 8..(t * nb + b + 1) * 8] {
                    bytes.extend(quad.0[r * 4..r * 4 + 4].iter().map(|q| q.wrapping_sub(128)));
                }
            }
        }
        bytes
    }
}

/// Whether [`q8_0_matmul`] runs for a weight of `kind` on `device` on this CPU (a CPU `q8_0`
/// weight, AVX2 or better).
pub(crate) fn applies(kind: GgmlDType, device: &Device) -> bool {
    kind == GgmlDType::Q8_0 && device.is_cpu() && Kernel::detect() != Kernel::Scalar
}

/// `x · wᵀ` for `x` `[rows, k]` and the quantized weight of `param`, through [`Q8Tiles`], or `None`
/// when the kernel does not apply (another kind or device, a non-float32 input, a CPU without
/// AVX2): the caller then takes candle's quantized matmul.
pub(crate) fn q8_0_matmul(x: &Tensor, param: &Param) -> Result<Option<Tensor>> {
    Ok(q8_0_matmul_each(x, &[param])?.and_then(|products| products.into_iter().next()))
}

/// `x · wᵀ` for every weight of `params` (all with `k` inputs), as one pass over the thread pool:
/// the rows are rounded to 8 bits once, and the tiles of every weight are one list that the
/// pool's threads share out. `None` when the kernel does not apply to `x` or to any of the
/// weights (see [`q8_0_matmul`]).
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
        match param.quantized_layout(Q8Tiles::new) {
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
    let values = crate::common::f32_slice(storage, layout, "q8_0 matmul")?;
    let weights: Vec<&Q8Tiles> = weights.iter().map(|w| &**w).collect();
    Ok(Some(matmul(values, m, k, &weights, kernel)?))
}

/// The products `[m, n]` of the rows `x` (`m` rows of `k`) with each weight.
fn matmul(
    x: &[f32],
    m: usize,
    k: usize,
    weights: &[&Q8Tiles],
    kernel: Kernel,
) -> Result<Vec<Tensor>> {
    // The rows in groups of up to `MAX_M`, each group one pass over a tile; a prompt's groups are
    // rounded on the pool's threads (on the calling thread alone this was a tenth of a 128-token
    // prefill, the other thread idle).
    let groups: Vec<Quantized> =
        crate::fused_grad::par_map(x.chunks(MAX_M * k).collect(), |rows| {
            Quantized::new(rows, rows.len() / k, k)
        });
    let nb = k / BLOCK;
    // Weight `i`'s tiles are numbers `first[i]..first[i + 1]` of one list.
    let mut first = vec![0];
    for w in weights {
        first.push(first[first.len() - 1] + w.n.div_ceil(ROWS));
    }
    let tiles = first[weights.len()];
    // One pass over each tile (up to four rows: decoding): its bytes are read once, and
    // streamed past the caches (see `Kernel::tile`).
    let stream = groups.len() == 1;
    // Per tile, the m rows' 16 outputs; then laid out as [m, n] per weight.
    let per_tile = m * ROWS;
    let mut tiled = vec![0f32; tiles * per_tile];
    let tiled_at = SharedOut(tiled.as_mut_ptr());
    // Candle's own pool for its CPU kernels (the calling thread works too, and waits spinning):
    // a product takes tens of microseconds, less than a sleeping rayon worker takes to wake.
    let body = |range: std::ops::Range<usize>| {
        for t in range {
            let i = first.partition_point(|&f| f <= t) - 1;
            let (w, local) = (weights[i], t - first[i]);
            // SAFETY: every tile index is handed to exactly one call, and tile `t` writes only
            // its own `per_tile` values of `tiled`, which outlives the pool's call.
            let out =
                unsafe { std::slice::from_raw_parts_mut(tiled_at.at(t * per_tile), per_tile) };
            let quads = &w.quads[local * nb * 8..(local + 1) * nb * 8];
            let scales = &w.scales[local * nb..(local + 1) * nb];
            for (xq, out) in groups.iter().zip(out.chunks_mut(MAX_M * ROWS)) {
                kernel.tile(quads, scales, xq, out, stream);
            }
        }
    };
    // The tiles in one contiguous run per thread (`par_runs`). Handed out in sixteenths from a
    // shared cursor, each thread's runs were interleaved with the other's, and every jump
    // restarted the prefetcher on cold memory: one-row decoding ran 15-18% slower (paired ratios
    // of this way over that one 1.176, 1.219, 1.204, 1.181 in one process; a prompt's rows,
    // compute-bound, 0.992).
    crate::fused_grad::par_runs(tiles, body);
    if m == 1 && weights.len() == 1 {
        // One row, one weight: the tiles' outputs are already in order.
        tiled.truncate(weights[0].n);
        return Ok(vec![Tensor::from_vec(
            tiled,
            (1, weights[0].n),
            &Device::Cpu,
        )?]);
    }
    weights
        .iter()
        .zip(&first)
        .map(|(w, &first)| {
            let mut out = vec![0f32; m * w.n];
            let tiled = &tiled[first * per_tile..];
            for (t, tile) in tiled
                .chunks_exact(per_tile)
                .take(w.n.div_ceil(ROWS))
                .enumerate()
            {
                for (r, row) in tile.chunks_exact(ROWS).enumerate() {
                    let col = t * ROWS;
                    let count = ROWS.min(w.n - col);
                    out[r * w.n + col..][..count].copy_from_slice(&row[..count]);
                }
            }
            Ok(Tensor::from_vec(out, (m, w.n), &Device::Cpu)?)
        })
        .collect()
}

/// The output buffer, written by the pool's threads at disjoint tiles.
struct SharedOut(*mut f32);

// SAFETY: the threads write disjoint ranges (see `matmul`).
unsafe impl Sync for SharedOut {}

impl SharedOut {
    fn at(&self, offset: usize) -> *mut f32 {
        // SAFETY: the offsets stay within the buffer (`matmul`).
        unsafe { self.0.add(offset) }
    }
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
    fn new(x: &[f32], m: usize, k: usize) -> Self {
        let mut q = vec![0i8; m * k];
        let mut d = vec![0f32; m * k / BLOCK];
        let mut offset = vec![0f32; m * k / BLOCK];
        for (((xb, qb), db), ob) in x
            .chunks_exact(BLOCK)
            .zip(q.chunks_exact_mut(BLOCK))
            .zip(d.iter_mut())
            .zip(offset.iter_mut())
        {
            let amax = xb.iter().fold(0f32, |a, v| a.max(v.abs()));
            let scale = amax / 127.0;
            let inv = if scale != 0.0 { 1.0 / scale } else { 0.0 };
            let mut sum = 0i32;
            for (v, o) in xb.iter().zip(qb.iter_mut()) {
                *o = round_half_away(v * inv) as i8;
                sum += *o as i32;
            }
            *db = f16::from_f32(scale).to_f32();
            *ob = 128.0 * sum as f32;
        }
        Self { q, d, offset, m, k }
    }
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
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            use std::arch::is_x86_feature_detected as has;
            if has!("avx512f") && has!("avx512bw") && has!("avx512vnni") {
                return Kernel::Vnni;
            }
            if has!("avx2") && has!("fma") && has!("f16c") {
                return Kernel::Avx2;
            }
        }
        Kernel::Scalar
    }

    /// One tile's outputs for every input row: `out[r * 16 + i]` is row `r`'s output `i`.
    ///
    /// With `stream` (the tile is read once), the SIMD loops prefetch the bytes a few blocks
    /// ahead with the non-temporal hint: the weights of a decoding step (145 MB for a
    /// SmolLM-135M-shaped model in `q8_0`) then pass through without pushing the key/value cache
    /// and the activations, which the step reads again, out of the L2 and L3 caches.
    fn tile(
        self,
        quads: &[Quad],
        scales: &[[u16; ROWS]],
        x: &Quantized,
        out: &mut [f32],
        stream: bool,
    ) {
        // What the SIMD loops' unchecked loads and stores rely on.
        assert!(quads.len() == scales.len() * 8 && x.k == scales.len() * BLOCK);
        assert!(x.m <= MAX_M && out.len() >= x.m * ROWS);
        match self {
            Kernel::Scalar => scalar(quads, scales, x, out),
            // SAFETY: `detect` picked these only where the CPU has the features they are
            // compiled for; the lengths are the ones asserted above.
            #[cfg(target_arch = "x86_64")]
            Kernel::Avx2 => unsafe { x86::tile_avx2(quads, scales, x, out, stream) },
            #[cfg(target_arch = "x86_64")]
            Kernel::Vnni => unsafe { x86::tile_vnni(quads, scales, x, out, stream) },
        }
    }
}

/// The portable inner loop: exact integer sums per block, scaled and added in `f32`.
fn scalar(quads: &[Quad], scales: &[[u16; ROWS]], x: &Quantized, out: &mut [f32]) {
    for r in 0..x.m {
        let xq = &x.q[r * x.k..(r + 1) * x.k];
        let nb = x.k / BLOCK;
        for i in 0..ROWS {
            let mut acc = 0f32;
            for (b, scale) in scales.iter().enumerate() {
                let mut sum = 0i32;
                for g in 0..8 {
                    let w = &quads[b * 8 + g].0[i * 4..i * 4 + 4];
                    for j in 0..4 {
                        sum += (w[j] as i32 - 128) * xq[b * BLOCK + g * 4 + j] as i32;
                    }
                }
                acc += f16::from_bits(scale[i]).to_f32() * x.d[r * nb + b] * sum as f32;
            }
            out[r * ROWS + i] = acc;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;
    use std::sync::Arc;

    /// A weight `[n, k]` and input `[rows, k]` with values of both signs, exact zeros and a zero
    /// row (a zero scale).
    fn case(n: usize, k: usize, rows: usize) -> (Param, Tensor) {
        let dev = Device::Cpu;
        let w: Vec<f32> = (0..n * k)
            .map(|i| {
                let zero = i % 97 == 0 || i / k == 1;
                if zero {
                    0.0
                } else {
                    (i * 7919 % 1000) as f32 / 500.0 - 1.0
                }
            })
            .collect();
        let x: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 104729 % 997) as f32 / 498.5 - 1.0) * 3.0)
            .collect();
        let w = Param::new(Tensor::from_vec(w, (n, k), &dev).unwrap()).unwrap();
        w.quantize(GgmlDType::Q8_0).unwrap();
        (w, Tensor::from_vec(x, (rows, k), &dev).unwrap())
    }

    /// The largest difference relative to `b`'s largest magnitude (at least 1).
    fn max_rel_diff(a: &Tensor, b: &Tensor) -> f32 {
        let scale = b
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        crate::common::max_diff(a, b) / scale.max(1.0)
    }

    #[test]
    fn equals_candles_quantized_matmul() {
        // Partial last tiles, one to four rows, blocks counts that are not multiples of 8; and
        // several groups of rows (rounded on the pool), the last one partial.
        for (n, k, rows) in [
            (64, 96, 1),
            (37, 576, 1),
            (130, 64, 3),
            (5, 32, 4),
            (16, 64, 2),
            (37, 576, 13),
            (130, 64, 9),
        ] {
            let (w, x) = case(n, k, rows);
            let Some(ours) = q8_0_matmul(&x, &w).unwrap() else {
                // No SIMD loop on this CPU: candle's kernel runs instead.
                assert_eq!(Kernel::detect(), Kernel::Scalar);
                continue;
            };
            let candle = x
                .apply_op1_no_bwd(&*w.quantized().unwrap().unwrap())
                .unwrap();
            assert_eq!(ours.dims(), [rows, n]);
            let diff = max_rel_diff(&ours, &candle);
            assert!(diff < 1e-5, "{n}x{k}, {rows} rows: {diff}");
        }
    }

    #[test]
    fn rounding_is_f32_round() {
        for v in [
            0.0f32,
            0.5,
            -0.5,
            1.5,
            -1.5,
            2.5,
            0.49999997,
            -0.49999997,
            126.5,
            -127.0,
            3.7,
        ] {
            assert_eq!(round_half_away(v), v.round() as i32, "{v}");
        }
        for i in -127_000..=127_000 {
            let v = i as f32 / 1000.0;
            assert_eq!(round_half_away(v), v.round() as i32, "{v}");
        }
    }

    #[test]
    fn every_inner_loop_on_this_cpu_gives_the_same_sums() {
        // Every row count a pass takes (each is its own build of the SIMD loops).
        for rows in 1..=MAX_M {
            let (w, x) = case(21, 256, rows);
            let tiles = Q8Tiles::new(&w.quantized().unwrap().unwrap()).unwrap();
            let x = x.flatten_all().unwrap().to_vec1::<f32>().unwrap();
            let xq = Quantized::new(&x, rows, 256);
            let nb = 256 / BLOCK;
            let mut kernels = vec![Kernel::Scalar, Kernel::detect()];
            #[cfg(target_arch = "x86_64")]
            if std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c")
            {
                kernels.push(Kernel::Avx2);
            }
            for t in 0..2 {
                let quads = &tiles.quads[t * nb * 8..(t + 1) * nb * 8];
                let scales = &tiles.scales[t * nb..(t + 1) * nb];
                let mut expected = vec![0f32; rows * ROWS];
                Kernel::Scalar.tile(quads, scales, &xq, &mut expected, false);
                // Streaming (prefetching past the tile's end, into the next tile) or not.
                for (kernel, stream) in kernels.iter().flat_map(|k| [(k, false), (k, true)]) {
                    let mut out = vec![0f32; rows * ROWS];
                    kernel.tile(quads, scales, &xq, &mut out, stream);
                    for (a, b) in out.iter().zip(&expected) {
                        assert!(
                            (a - b).abs() <= 1e-4 * b.abs().max(1.0),
                            "{kernel:?} ({rows} rows, stream: {stream}): {a} vs {b}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_tiles_are_made_once_per_weight() {
        if Kernel::detect() == Kernel::Scalar {
            return; // candle's kernel runs on this CPU
        }
        let (w, x) = case(32, 64, 1);
        let first = w.quantized_layout(Q8Tiles::new).unwrap();
        q8_0_matmul(&x, &w).unwrap().unwrap();
        assert!(Arc::ptr_eq(
            &first,
            &w.quantized_layout(Q8Tiles::new).unwrap()
        ));
        // A new weight gets new tiles: the product follows it.
        w.set(&Tensor::ones((32, 64), DType::F32, &Device::Cpu).unwrap())
            .unwrap();
        assert!(!Arc::ptr_eq(
            &first,
            &w.quantized_layout(Q8Tiles::new).unwrap()
        ));
        let y = q8_0_matmul(&x, &w).unwrap().unwrap();
        let expected = x.sum_keepdim(1).unwrap().broadcast_as((1, 32)).unwrap();
        assert!(max_rel_diff(&y, &expected) < 1e-2);
    }

    #[test]
    fn other_kinds_and_dtypes_are_left_to_candle() {
        let (_, x) = case(4, 64, 1);
        let w = Param::new(Tensor::ones((4, 64), DType::F32, &Device::Cpu).unwrap()).unwrap();
        w.quantize(GgmlDType::Q4_0).unwrap();
        assert!(q8_0_matmul(&x, &w).unwrap().is_none());
        w.quantize(GgmlDType::Q8_0).unwrap();
        assert!(q8_0_matmul(&x.to_dtype(DType::F16).unwrap(), &w)
            .unwrap()
            .is_none());
        let simd = Kernel::detect() != Kernel::Scalar;
        assert_eq!(q8_0_matmul(&x, &w).unwrap().is_some(), simd);
    }
}
