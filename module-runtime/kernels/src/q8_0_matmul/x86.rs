//! The x86-64 inner loops of the `q8_0` and `q4_0` products: one tile of 16 output rows for up
//! to four input rows, with AVX-512 VNNI (16 lanes) or AVX2 (two halves of eight).

use super::{q4k_header, Quad, Quantized, BLOCK, MAX_M, Q4K_BLOCKS, ROWS};
use std::arch::x86_64::*;

/// How far ahead a streaming tile prefetches: 2 KiB of quads (measured against 1, 4 and 8 KiB
/// on the decoder benchmark's `q8_0` model, within one process, the nearer the better).
const AHEAD_BYTES: usize = 2048;

/// Prefetches the quads and scales of the block 2 KiB of quads after block `b` (`QPB` quads a
/// block) with the non-temporal hint (a prefetch never faults: past the tile's end it reads the
/// next tile, or nothing).
#[inline(always)]
fn prefetch_ahead<const QPB: usize>(quads: &[Quad], scales: &[[u16; ROWS]], b: usize) {
    let ahead = b + AHEAD_BYTES / (QPB * 64);
    let quad = quads.as_ptr().wrapping_add(ahead * QPB);
    for g in 0..QPB {
        // SAFETY: a prefetch reads nothing into the program and cannot fault.
        unsafe { _mm_prefetch::<_MM_HINT_NTA>(quad.wrapping_add(g).cast()) };
    }
    // SAFETY: as above.
    unsafe { _mm_prefetch::<_MM_HINT_NTA>(scales.as_ptr().wrapping_add(ahead).cast()) };
}

/// [`super::round_block`] with AVX-512: the same scale, values and sum for every finite input
/// (the same steps: the largest magnitude, the values times its reciprocal, each truncated and
/// moved one away from zero where the remainder is half or more). A NaN input gives a NaN
/// scale here, where the scalar loop skips it in the maximum.
///
/// # Safety
/// The CPU has AVX-512 F and BW.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn round_block_avx512(x: &[f32; BLOCK], q: &mut [i8; BLOCK]) -> (f32, i32) {
    // SAFETY: `x` holds 32 values, `q` 32 bytes: two loads and two stores of 16.
    let (lo, hi) = unsafe {
        (
            _mm512_loadu_ps(x.as_ptr()),
            _mm512_loadu_ps(x.as_ptr().add(16)),
        )
    };
    let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
    let scale = amax / 127.0;
    let inv = _mm512_set1_ps(if scale != 0.0 { 1.0 / scale } else { 0.0 });
    let (lo, hi) = (
        round16(_mm512_mul_ps(lo, inv)),
        round16(_mm512_mul_ps(hi, inv)),
    );
    unsafe {
        _mm_storeu_si128(q.as_mut_ptr().cast(), _mm512_cvtepi32_epi8(lo));
        _mm_storeu_si128(q.as_mut_ptr().add(16).cast(), _mm512_cvtepi32_epi8(hi));
    }
    (scale, _mm512_reduce_add_epi32(_mm512_add_epi32(lo, hi)))
}

/// 16 values rounded to the nearest integer, halves away from zero ([`super::round_half_away`]).
#[target_feature(enable = "avx512f")]
fn round16(v: __m512) -> __m512i {
    let t = _mm512_cvttps_epi32(v); // toward zero
    let frac = _mm512_sub_ps(v, _mm512_cvtepi32_ps(t)); // exact: |v| < 2^23
    let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(frac, _mm512_set1_ps(0.5));
    let down = _mm512_cmp_ps_mask::<_CMP_LE_OQ>(frac, _mm512_set1_ps(-0.5));
    let one = _mm512_set1_epi32(1);
    _mm512_mask_sub_epi32(_mm512_mask_add_epi32(t, up, t, one), down, t, one)
}

/// Four input bytes of row `r` at `at`, as one 32-bit integer.
///
/// # Safety
/// `r < x.m` and `at + 4 <= x.k`.
#[inline(always)]
unsafe fn four(x: &Quantized, r: usize, at: usize) -> i32 {
    // SAFETY: row `r` holds `x.k` bytes at `r * x.k` (the caller's bounds).
    unsafe {
        x.q.as_ptr()
            .add(r * x.k + at)
            .cast::<i32>()
            .read_unaligned()
    }
}

/// `f::<M, Q4>(args)` for the row count `m` (1 to [`MAX_M`]): one build of the loop per count
/// and format.
macro_rules! per_row_count {
    ($m:expr, $f:ident($($arg:expr),*)) => {
        match $m {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            _ => $f::<MAX_M>($($arg),*),
        }
    };
    ($m:expr, $q4:ident, $f:ident($($arg:expr),*)) => {
        match $m {
            1 => $f::<1, $q4>($($arg),*),
            2 => $f::<2, $q4>($($arg),*),
            3 => $f::<3, $q4>($($arg),*),
            _ => $f::<MAX_M, $q4>($($arg),*),
        }
    };
}

/// What a block's input sum times 128 (`Quantized::offset`) is divided by to give what the
/// stored weights' offset added to the block's products: 1 for `q8_0` (bytes plus 128), 16 for
/// `q4_0` (nibbles plus 8).
#[inline(always)]
fn offset_divisor(q4: bool) -> f32 {
    if q4 {
        16.0
    } else {
        1.0
    }
}

/// A tile with AVX-512 VNNI: 16 lanes, one per output row, for up to four input rows. `q8_0`
/// (`Q4` false): each quad's bytes are four inputs' weights plus 128, one `vpdpbusd` each, in
/// two chains (even and odd quads). `q4_0` (`Q4`): each quad's low and high nibbles are the
/// weights plus 8 of two groups of four inputs, split in registers, a chain each.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `quads` holds 8 (`q8_0`) or 4 (`q4_0`) quads per entry
/// of `scales`, `x` has `scales.len()` blocks per row and `out` `x.m * 16` values.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile_vnni<const Q4: bool>(
    quads: &[Quad],
    scales: &[[u16; ROWS]],
    x: &Quantized,
    out: &mut [f32],
    stream: bool,
) {
    // One build per row count: its sums and accumulators are then registers (with a run-time
    // count they were an array on the stack, each `vpdpbusd` waiting on a store and a load).
    // SAFETY: the caller's contract, and `x.m` rows.
    unsafe { per_row_count!(x.m, Q4, vnni_rows(quads, scales, x, out, stream)) }
}

/// [`tile_vnni`] for `M` input rows (`x.m == M`).
///
/// # Safety
/// As [`tile_vnni`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn vnni_rows<const M: usize, const Q4: bool>(
    quads: &[Quad],
    scales: &[[u16; ROWS]],
    x: &Quantized,
    out: &mut [f32],
    stream: bool,
) {
    let nb = scales.len();
    let low = _mm512_set1_epi8(0x0f);
    let mut acc = [_mm512_setzero_ps(); M];
    for (b, scale) in scales.iter().enumerate() {
        if stream {
            if Q4 {
                prefetch_ahead::<4>(quads, scales, b);
            } else {
                prefetch_ahead::<8>(quads, scales, b);
            }
        }
        // Two independent chains of `vpdpbusd` per input row.
        let mut sums = [[_mm512_setzero_si512(); 2]; M];
        let mut add = |w, chain: usize, at: usize| {
            for (r, sum) in sums.iter_mut().enumerate() {
                // SAFETY: `r < M == x.m`, and the block's bytes are within the row.
                let xs = _mm512_set1_epi32(unsafe { four(x, r, b * BLOCK + at) });
                sum[chain] = _mm512_dpbusd_epi32(sum[chain], w, xs);
            }
        };
        if Q4 {
            for g in 0..4 {
                // SAFETY: an aligned quad of 64 bytes.
                let w = unsafe { _mm512_load_si512(quads[b * 4 + g].0.as_ptr().cast()) };
                add(_mm512_and_si512(w, low), 0, g * 4);
                add(
                    _mm512_and_si512(_mm512_srli_epi16(w, 4), low),
                    1,
                    16 + g * 4,
                );
            }
        } else {
            for g in 0..8 {
                // SAFETY: an aligned quad of 64 bytes.
                let w = unsafe { _mm512_load_si512(quads[b * 8 + g].0.as_ptr().cast()) };
                add(w, g & 1, g * 4);
            }
        }
        // SAFETY: 16 float16 scales, 32 bytes.
        let dw = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(scale.as_ptr().cast()) });
        for (r, (acc, sum)) in acc.iter_mut().zip(&sums).enumerate() {
            let total = _mm512_cvtepi32_ps(_mm512_add_epi32(sum[0], sum[1]));
            let offset = x.offset[r * nb + b] / offset_divisor(Q4);
            let exact = _mm512_sub_ps(total, _mm512_set1_ps(offset));
            let dx = _mm512_set1_ps(x.d[r * nb + b]);
            *acc = _mm512_fmadd_ps(exact, _mm512_mul_ps(dw, dx), *acc);
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: `out` holds 16 values per input row.
        unsafe { _mm512_storeu_ps(out[r * ROWS..].as_mut_ptr(), *acc) };
    }
}

/// A tile with AVX2: two halves of eight rows. `q8_0`: each byte made signed again and
/// multiplied by the sign trick (`|w|` unsigned times `x` with `w`'s sign, at most 2·128·127 per
/// 16-bit pair: no saturation). `q4_0`: the nibbles (unsigned, at most 15) times the signed input
/// bytes directly (2·15·127 per pair, two pairs added), the input sum times 8 taken off after.
///
/// # Safety
/// The CPU has AVX2, FMA and F16C; lengths as for [`tile_vnni`].
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_avx2<const Q4: bool>(
    quads: &[Quad],
    scales: &[[u16; ROWS]],
    x: &Quantized,
    out: &mut [f32],
    stream: bool,
) {
    // One build per row count, as for `tile_vnni`.
    // SAFETY: the caller's contract, and `x.m` rows.
    unsafe { per_row_count!(x.m, Q4, avx2_rows(quads, scales, x, out, stream)) }
}

/// [`tile_avx2`] for `M` input rows (`x.m == M`).
///
/// # Safety
/// As [`tile_avx2`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn avx2_rows<const M: usize, const Q4: bool>(
    quads: &[Quad],
    scales: &[[u16; ROWS]],
    x: &Quantized,
    out: &mut [f32],
    stream: bool,
) {
    let nb = scales.len();
    let ones = _mm256_set1_epi16(1);
    let flip = _mm256_set1_epi8(-128);
    let low = _mm256_set1_epi8(0x0f);
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    for (b, scale) in scales.iter().enumerate() {
        if stream {
            if Q4 {
                prefetch_ahead::<4>(quads, scales, b);
            } else {
                prefetch_ahead::<8>(quads, scales, b);
            }
        }
        let mut sums = [[_mm256_setzero_si256(); 2]; M];
        let qpb = if Q4 { 4 } else { 8 };
        for g in 0..qpb {
            let quad = quads[b * qpb + g].0.as_ptr();
            for half in 0..2 {
                // SAFETY: 32 of the quad's 64 bytes.
                let w = unsafe { _mm256_load_si256(quad.add(half * 32).cast()) };
                for (r, sum) in sums.iter_mut().enumerate() {
                    // SAFETY: `r < M == x.m`, and the block's bytes are within the row.
                    let at = |i: usize| _mm256_set1_epi32(unsafe { four(x, r, b * BLOCK + i) });
                    let pairs = if Q4 {
                        let lo = _mm256_and_si256(w, low);
                        let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                        _mm256_add_epi16(
                            _mm256_maddubs_epi16(lo, at(g * 4)),
                            _mm256_maddubs_epi16(hi, at(16 + g * 4)),
                        )
                    } else {
                        let w = _mm256_xor_si256(w, flip);
                        let magnitude = _mm256_sign_epi8(w, w);
                        _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(at(g * 4), w))
                    };
                    sum[half] = _mm256_add_epi32(sum[half], _mm256_madd_epi16(pairs, ones));
                }
            }
        }
        for half in 0..2 {
            // SAFETY: 8 float16 scales, 16 bytes.
            let dw = _mm256_cvtph_ps(unsafe { _mm_loadu_si128(scale[half * 8..].as_ptr().cast()) });
            for (r, (acc, sum)) in acc.iter_mut().zip(&sums).enumerate() {
                let mut total = _mm256_cvtepi32_ps(sum[half]);
                if Q4 {
                    let offset = x.offset[r * nb + b] / offset_divisor(Q4);
                    total = _mm256_sub_ps(total, _mm256_set1_ps(offset));
                }
                let dx = _mm256_set1_ps(x.d[r * nb + b]);
                acc[half] = _mm256_fmadd_ps(total, _mm256_mul_ps(dw, dx), acc[half]);
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (half, acc) in acc.iter().enumerate() {
            // SAFETY: `out` holds 16 values per input row.
            unsafe { _mm256_storeu_ps(out[r * ROWS + half * 8..].as_mut_ptr(), *acc) };
        }
    }
}

/// A `q4_K` tile with AVX-512 VNNI: per super-block, the 16 rows' 6-bit scales and minimums
/// decoded from their bytes (16 rows, 16 lanes) and multiplied by `d` and `dmin`; per pair of
/// blocks, the quads' low and high nibbles (the two blocks' weights) into two `vpdpbusd` chains;
/// per block `dx · (d·sc·Σ q·x − dmin·m·Σ x)`.
///
/// # Safety
/// As [`tile_vnni`], with 4 quads per entry of `scales` and whole super-blocks (8 entries).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
pub(super) unsafe fn tile_vnni_q4k(
    quads: &[Quad],
    scales: &[[u16; ROWS]],
    x: &Quantized,
    out: &mut [f32],
    stream: bool,
) {
    // SAFETY: the caller's contract, and `x.m` rows.
    unsafe { per_row_count!(x.m, vnni_q4k_rows(quads, scales, x, out, stream)) }
}

/// [`tile_vnni_q4k`] for `M` input rows (`x.m == M`).
///
/// # Safety
/// As [`tile_vnni_q4k`].
#[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
#[inline]
unsafe fn vnni_q4k_rows<const M: usize>(
    quads: &[Quad],
    scales: &[[u16; ROWS]],
    x: &Quantized,
    out: &mut [f32],
    stream: bool,
) {
    let nb = scales.len();
    let low = _mm512_set1_epi8(0x0f);
    let (six_bits, four_bits) = (_mm512_set1_epi32(63), _mm512_set1_epi32(15));
    let mut acc = [_mm512_setzero_ps(); M];
    for (s, entries) in scales.chunks_exact(Q4K_BLOCKS).enumerate() {
        // SAFETY: 16 float16 values, 32 bytes each.
        let d = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(entries[0].as_ptr().cast()) });
        let dmin = _mm512_cvtph_ps(unsafe { _mm256_loadu_si256(entries[1].as_ptr().cast()) });
        let header = q4k_header(entries);
        // Scale byte `k` of the 16 rows, one per lane.
        // SAFETY: the header holds 12 × 16 bytes.
        let byte = |k: usize| {
            _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(header[16 * k..].as_ptr().cast()) })
        };
        // Block `j`'s `d·sc` and `dmin·m` (ggml's `get_scale_min_k4`, in lanes).
        let scale_min = |j: usize| {
            let (sc, m) = if j < 4 {
                (
                    _mm512_and_si512(byte(j), six_bits),
                    _mm512_and_si512(byte(j + 4), six_bits),
                )
            } else {
                let both = byte(j + 4);
                let top = |k: usize| _mm512_slli_epi32(_mm512_srli_epi32(byte(k), 6), 4);
                (
                    _mm512_or_si512(_mm512_and_si512(both, four_bits), top(j - 4)),
                    _mm512_or_si512(_mm512_srli_epi32(both, 4), top(j)),
                )
            };
            (
                _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)),
                _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(m)),
            )
        };
        for pair in 0..Q4K_BLOCKS / 2 {
            let b = s * Q4K_BLOCKS + 2 * pair;
            if stream {
                prefetch_ahead::<4>(quads, scales, b);
                prefetch_ahead::<4>(quads, scales, b + 1);
            }
            let mut sums = [[_mm512_setzero_si512(); 2]; M];
            for g in 0..8 {
                // SAFETY: an aligned quad of 64 bytes.
                let w = unsafe { _mm512_load_si512(quads[b * 4 + g].0.as_ptr().cast()) };
                let lo = _mm512_and_si512(w, low);
                let hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), low);
                for (r, sum) in sums.iter_mut().enumerate() {
                    // SAFETY: `r < M == x.m`, and both blocks' bytes are within the row.
                    let (xl, xh) = unsafe {
                        (
                            four(x, r, b * BLOCK + g * 4),
                            four(x, r, (b + 1) * BLOCK + g * 4),
                        )
                    };
                    sum[0] = _mm512_dpbusd_epi32(sum[0], lo, _mm512_set1_epi32(xl));
                    sum[1] = _mm512_dpbusd_epi32(sum[1], hi, _mm512_set1_epi32(xh));
                }
            }
            for (h, (sc, m)) in [scale_min(2 * pair), scale_min(2 * pair + 1)]
                .into_iter()
                .enumerate()
            {
                for (r, (acc, sum)) in acc.iter_mut().zip(&sums).enumerate() {
                    let at = r * nb + b + h;
                    let xsum = _mm512_set1_ps(x.offset[at] / 128.0);
                    let w = _mm512_fmsub_ps(_mm512_cvtepi32_ps(sum[h]), sc, _mm512_mul_ps(m, xsum));
                    *acc = _mm512_fmadd_ps(w, _mm512_set1_ps(x.d[at]), *acc);
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        // SAFETY: `out` holds 16 values per input row.
        unsafe { _mm512_storeu_ps(out[r * ROWS..].as_mut_ptr(), *acc) };
    }
}

/// A `q4_K` tile with AVX2: [`tile_vnni_q4k`] in two halves of eight rows, the nibbles times
/// the input bytes by `vpmaddubsw` (2·15·127 per 16-bit pair: no saturation).
///
/// # Safety
/// As [`tile_avx2`], with 4 quads per entry of `scales` and whole super-blocks (8 entries).
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn tile_avx2_q4k(
    quads: &[Quad],
    scales: &[[u16; ROWS]],
    x: &Quantized,
    out: &mut [f32],
    stream: bool,
) {
    // SAFETY: the caller's contract, and `x.m` rows.
    unsafe { per_row_count!(x.m, avx2_q4k_rows(quads, scales, x, out, stream)) }
}

/// [`tile_avx2_q4k`] for `M` input rows (`x.m == M`).
///
/// # Safety
/// As [`tile_avx2_q4k`].
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn avx2_q4k_rows<const M: usize>(
    quads: &[Quad],
    scales: &[[u16; ROWS]],
    x: &Quantized,
    out: &mut [f32],
    stream: bool,
) {
    let nb = scales.len();
    let ones = _mm256_set1_epi16(1);
    let low = _mm256_set1_epi8(0x0f);
    let (six_bits, four_bits) = (_mm256_set1_epi32(63), _mm256_set1_epi32(15));
    let mut acc = [[_mm256_setzero_ps(); 2]; M];
    for (s, entries) in scales.chunks_exact(Q4K_BLOCKS).enumerate() {
        let header = q4k_header(entries);
        // The super-block's `d` and `dmin` for rows `8 half..8 half + 8`, read once.
        let d_dmin: [(__m256, __m256); 2] = std::array::from_fn(|half| {
            // SAFETY: 8 float16 values, 16 bytes.
            let f16s = |e: usize| unsafe {
                _mm256_cvtph_ps(_mm_loadu_si128(entries[e][half * 8..].as_ptr().cast()))
            };
            (f16s(0), f16s(1))
        });
        // Block `j`'s `d·sc` and `dmin·m` for rows `8 half..8 half + 8`.
        let scale_min = |j: usize, half: usize| {
            let (d, dmin) = d_dmin[half];
            // SAFETY: the header holds 12 × 16 bytes.
            let byte = |k: usize| unsafe {
                _mm256_cvtepu8_epi32(_mm_loadl_epi64(header[16 * k + 8 * half..].as_ptr().cast()))
            };
            let (sc, m) = if j < 4 {
                (
                    _mm256_and_si256(byte(j), six_bits),
                    _mm256_and_si256(byte(j + 4), six_bits),
                )
            } else {
                let both = byte(j + 4);
                let top = |k: usize| _mm256_slli_epi32(_mm256_srli_epi32(byte(k), 6), 4);
                (
                    _mm256_or_si256(_mm256_and_si256(both, four_bits), top(j - 4)),
                    _mm256_or_si256(_mm256_srli_epi32(both, 4), top(j)),
                )
            };
            (
                _mm256_mul_ps(d, _mm256_cvtepi32_ps(sc)),
                _mm256_mul_ps(dmin, _mm256_cvtepi32_ps(m)),
            )
        };
        for pair in 0..Q4K_BLOCKS / 2 {
            let b = s * Q4K_BLOCKS + 2 * pair;
            if stream {
                prefetch_ahead::<4>(quads, scales, b);
                prefetch_ahead::<4>(quads, scales, b + 1);
            }
            // Per input row, per half, per block of the pair.
            let mut sums = [[[_mm256_setzero_si256(); 2]; 2]; M];
            for g in 0..8 {
                let quad = quads[b * 4 + g].0.as_ptr();
                for half in 0..2 {
                    // SAFETY: 32 of the quad's 64 bytes.
                    let w = unsafe { _mm256_load_si256(quad.add(half * 32).cast()) };
                    let lo = _mm256_and_si256(w, low);
                    let hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                    for (r, sum) in sums.iter_mut().enumerate() {
                        // SAFETY: `r < M == x.m`, and both blocks' bytes are within the row.
                        let (xl, xh) = unsafe {
                            (
                                four(x, r, b * BLOCK + g * 4),
                                four(x, r, (b + 1) * BLOCK + g * 4),
                            )
                        };
                        let pl = _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl));
                        let ph = _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh));
                        let sum = &mut sum[half];
                        sum[0] = _mm256_add_epi32(sum[0], _mm256_madd_epi16(pl, ones));
                        sum[1] = _mm256_add_epi32(sum[1], _mm256_madd_epi16(ph, ones));
                    }
                }
            }
            for half in 0..2 {
                for h in 0..2 {
                    let (sc, m) = scale_min(2 * pair + h, half);
                    for (r, (acc, sum)) in acc.iter_mut().zip(&sums).enumerate() {
                        let at = r * nb + b + h;
                        let xsum = _mm256_set1_ps(x.offset[at] / 128.0);
                        let total = _mm256_cvtepi32_ps(sum[half][h]);
                        let w = _mm256_fmsub_ps(total, sc, _mm256_mul_ps(m, xsum));
                        acc[half] = _mm256_fmadd_ps(w, _mm256_set1_ps(x.d[at]), acc[half]);
                    }
                }
            }
        }
    }
    for (r, acc) in acc.iter().enumerate() {
        for (half, acc) in acc.iter().enumerate() {
            // SAFETY: `out` holds 16 values per input row.
            unsafe { _mm256_storeu_ps(out[r * ROWS + half * 8..].as_mut_ptr(), *acc) };
        }
    }
}
