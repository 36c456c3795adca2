//! Bfloat16 matrix products: `a b + bias` from bfloat16 operands, summed in float32, on the
//! AVX512-BF16 instruction `vdpbf16ps` where the CPU has it
//! ([`KernelChoice::bf16_products`](crate::KernelChoice)), on the float32 kernels elsewhere.
//!
//! `vdpbf16ps` multiplies 16 pairs of bfloat16 values by 16 others and adds each pair's two
//! products to one float32 lane: twice the multiply-adds of a float32 FMA per instruction, from
//! half the bytes. Its operands want the shared dimension `k` in pairs: each 32-bit lane holds
//! `(x[k], x[k + 1])`. So each thread packs its rows of `a` and its columns of `b` into such pairs
//! (a zero completes an odd `k`), in slivers of [`MR`] rows and [`NR`] columns, and the tile
//! kernel keeps an `MR × NR` block of float32 sums in 24 of the 32 vector registers, loading three
//! vectors of `b`'s pairs and broadcasting one pair of `a` per row for each pair of `k`.
//!
//! Blocking, as in Goto's scheme (and oneDNN's, BLIS's): `k` in blocks of [`KC`] values, so a
//! sliver of `b` (`KC / 2 × NR` pairs, 24 KiB) stays in the first-level cache (48 KiB on Zen 5)
//! while every sliver of `a`'s block of [`MC`] rows (64 KiB, in the second-level cache) passes
//! over it; the columns in blocks of [`NC`]. The threads split the output as the float32 products
//! do (`matmul::Blocks`, one block per thread of candle's barrier pool).
//!
//! Rounding: each output is the float32 sum of exact products of the bfloat16 values (a product
//! of two bfloat16 values is exact in float32), added in pairs and in another order than a
//! float32 GEMM's; within float32 rounding of the float32 kernels' result from the same values.

use crate::matmul::{product, split_product, Blocks, Matrix};

/// The rows of a tile.
const MR: usize = 8;
/// The columns of a tile: three vectors of 16 float32 sums.
const NR: usize = 48;
/// The values of `k` packed at a time (even, so only the last block has an odd pair).
const KC: usize = 256;
/// The rows of `a` packed at a time (a multiple of [`MR`]).
const MC: usize = 128;
/// The columns of `b` packed at a time (a multiple of [`NR`]).
const NC: usize = 768;

/// `a b + bias`, `[m, n]` row-major float32, for bfloat16 matrices `a` `[m, k]` and `b` `[k, n]`
/// (their bits, any strides) and an optional float32 `bias` `[n]` added to every row: the
/// AVX512-BF16 kernel where [`kernel_choice`](crate::kernel_choice) allows it, else the float32
/// kernels over the widened values.
///
/// An error if `a` or `b` is too short for its matrix, or `bias` is not `n` long.
pub(crate) fn bf16_product(
    a: Matrix<'_, u16>,
    b: Matrix<'_, u16>,
    (m, n, k): (usize, usize, usize),
    bias: Option<&[f32]>,
) -> candle_core::Result<Vec<f32>> {
    if !crate::kernel_choice().bf16_products || k == 0 || m == 0 || n == 0 {
        let (a, b) = (widen(a, m, k)?, widen(b, k, n)?);
        return product(Matrix::rows(&a, k), Matrix::rows(&b, n), (m, n, k), bias);
    }
    if let Some(bias) = bias.filter(|bias| bias.len() != n) {
        return Err(candle_core::Error::Msg(format!(
            "bf16 matmul: a bias of {} values for {n} output columns",
            bias.len()
        )));
    }
    a.check(m, k)?;
    b.check(k, n)?;
    let blocks = Blocks::new(m, n, k);
    Ok(split_product(
        (m, n),
        bias,
        &blocks,
        |rows, cols, dst, accumulate| {
            let a = Matrix {
                values: &a.values[rows.start * a.row_stride..],
                ..a
            };
            let b = Matrix {
                values: &b.values[cols.start * b.col_stride..],
                ..b
            };
            // SAFETY: `split_product`'s promise: `dst` is this block's own `rows × cols` outputs,
            // rows `n` apart; `a` and `b` hold the block's `[rows, k]` and `[k, cols]` matrices
            // (checked above); the CPU has AVX512-BF16 (`kernel_choice` said so).
            unsafe { block((rows.len(), cols.len(), k), a, b, dst, n, accumulate) }
        },
    ))
}

/// The `[rows, cols]` matrix `m` as row-major float32 values (empty when either is zero).
fn widen(m: Matrix<'_, u16>, rows: usize, cols: usize) -> candle_core::Result<Vec<f32>> {
    if rows == 0 || cols == 0 {
        return Ok(Vec::new());
    }
    m.check(rows, cols)?;
    let mut out = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        let row = &m.values[r * m.row_stride..];
        out.extend((0..cols).map(|c| f32::from_bits((row[c * m.col_stride] as u32) << 16)));
    }
    Ok(out)
}

/// The bfloat16 bits of each value, rounded to nearest even (NaNs kept NaN): the values of
/// candle's and PyTorch's casts to bfloat16, compiled for AVX-512 where the CPU has it.
pub(crate) fn to_bf16_bits(values: &[f32]) -> Vec<u16> {
    let mut out = vec![0u16; values.len()];
    #[cfg(target_arch = "x86_64")]
    if crate::kernel_choice().elementwise >= crate::CpuCapability::Avx512 {
        // SAFETY: the CPU has AVX-512 F and BW (`kernel_choice` said so).
        unsafe { round_avx512(values, &mut out) };
        return out;
    }
    round_all(values, &mut out);
    out
}

/// [`to_bf16_bits`] as candle's bfloat16 values (the same bits, no copy).
pub(crate) fn to_bf16(values: &[f32]) -> Vec<half::bf16> {
    half::vec::HalfBitsVecExt::reinterpret_into::<half::bf16>(to_bf16_bits(values))
}

/// [`round_all`] compiled for AVX-512 (the loop vectorizes 16 values at a time).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma")]
unsafe fn round_avx512(values: &[f32], out: &mut [u16]) {
    round_all(values, out);
}

/// `out[i]` = the bfloat16 bits of `values[i]`, rounded to nearest even.
#[inline(always)]
fn round_all(values: &[f32], out: &mut [u16]) {
    for (o, &v) in out.iter_mut().zip(values) {
        *o = bf16_bits(v);
    }
}

/// The float32 value of bfloat16 bits, exactly, a NaN made quiet: `half::bf16::to_f32`'s value
/// (candle's and PyTorch's widening), without a branch, so that a loop over values vectorizes.
#[inline(always)]
pub(crate) fn bf16_value(b: u16) -> f32 {
    let quiet = if b & 0x7fff > 0x7f80 { b | 0x40 } else { b };
    f32::from_bits((quiet as u32) << 16)
}

/// The bfloat16 bits of `v`, rounded to nearest even (carrying into the exponent, so the largest
/// finite values round to infinity), a NaN kept a quiet NaN: `half::bf16::from_f32(v)`'s bits,
/// without a branch, so that a loop over values vectorizes.
#[inline(always)]
pub(crate) fn bf16_bits(v: f32) -> u16 {
    let bits = v.to_bits();
    let rounded = (bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16) as u16;
    if v.is_nan() {
        (bits >> 16) as u16 | 0x40
    } else {
        rounded
    }
}

/// `dst (+)= a b` for one thread's block of `[m, n]` outputs, rows `dst_stride` apart: `a`'s
/// rows and `b`'s columns packed into pairs block by block, and [`tile`] over each `MR × NR`
/// tile (a partial tile at the edges writes only its own outputs).
///
/// # Safety
///
/// `dst` points at `m` rows of `n` writable outputs `dst_stride` apart, written by no one else
/// meanwhile (and initialized where `accumulate`); `a` and `b` hold `[m, k]` and `[k, n]`
/// matrices at their strides; the CPU has AVX512-BF16.
#[cfg(target_arch = "x86_64")]
unsafe fn block(
    (m, n, k): (usize, usize, usize),
    a: Matrix<'_, u16>,
    b: Matrix<'_, u16>,
    dst: *mut f32,
    dst_stride: usize,
    accumulate: bool,
) {
    thread_local! {
        /// Each thread's packed slivers of `a` and `b`, kept between products: a fresh buffer's
        /// pages cost a fault each on first touch.
        static PACKS: std::cell::RefCell<(Vec<u32>, Vec<u32>)> = const {
            std::cell::RefCell::new((Vec::new(), Vec::new()))
        };
    }
    let mut packs = PACKS.with(|p| std::mem::take(&mut *p.borrow_mut()));
    let (a_pack, b_pack) = (&mut packs.0, &mut packs.1);
    for jc in (0..n).step_by(NC) {
        let nc = (n - jc).min(NC);
        for pc in (0..k).step_by(KC) {
            let kc = (k - pc).min(KC);
            let pairs = kc.div_ceil(2);
            // SAFETY: `b`'s columns `jc..jc + nc` and values `pc..pc + kc` are inside it (the
            // caller's); the CPU has AVX-512 (and AVX512-BF16).
            unsafe { pack(b.t(), jc..jc + nc, pc..pc + kc, NR, b_pack) };
            for ic in (0..m).step_by(MC) {
                let mc = (m - ic).min(MC);
                // SAFETY: as for `b`'s, `a`'s rows `ic..ic + mc`.
                unsafe { pack(a, ic..ic + mc, pc..pc + kc, MR, a_pack) };
                for (js, jr) in (0..nc).step_by(NR).enumerate() {
                    let b_sliver = &b_pack[js * pairs * NR..][..pairs * NR];
                    for (is, ir) in (0..mc).step_by(MR).enumerate() {
                        let a_sliver = &a_pack[is * pairs * MR..][..pairs * MR];
                        let out = Out {
                            // `wrapping_add`: in bounds, by the caller's promise.
                            at: dst.wrapping_add((ic + ir) * dst_stride + jc + jr),
                            stride: dst_stride,
                            rows: (mc - ir).min(MR),
                            cols: (nc - jr).min(NR),
                            accumulate: accumulate || pc > 0,
                        };
                        // SAFETY: the slivers hold `pairs` pairs of `MR` and `NR` lanes; the
                        // tile's outputs are inside the caller's block; the caller's CPU.
                        unsafe { tile(pairs, a_sliver, b_sliver, &out) };
                    }
                }
            }
        }
    }
    PACKS.with(|p| *p.borrow_mut() = packs);
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn block(
    _: (usize, usize, usize),
    _: Matrix<'_, u16>,
    _: Matrix<'_, u16>,
    _: *mut f32,
    _: usize,
    _: bool,
) {
    unreachable!("kernel_choice() offers the bfloat16 kernel on x86-64 only")
}

/// Rows `rows` (a range of the first dimension) of the matrix `mat`, whose second dimension is
/// the shared one, values `ks` of it, as the tile kernel reads them: slivers of `width` rows, in
/// each the pairs `(mat[r][k], mat[r][k + 1])` as 32-bit lanes, pair after pair, `width` lanes
/// each (zeros past the last row and the last value).
///
/// Each value packed is multiplied only as many times as the other operand has rows (200 for a
/// MiniLM batch, a few cycles of the tile kernel), so packing must cost well under a cycle a
/// value: where each row's pairs lie side by side (a row-major `a`, a weight read transposed),
/// 16 rows' pairs are gathered into one vector at a time; where the rows lie side by side (a
/// transposed `a`, a row-major `b`), two runs of values are interleaved, 16 pairs at a time.
///
/// # Safety
///
/// `mat` holds the rows `rows` and values `ks` at its strides (its `check`), and the CPU has
/// AVX-512 F and BW.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2")]
unsafe fn pack(
    mat: Matrix<'_, u16>,
    rows: std::ops::Range<usize>,
    ks: std::ops::Range<usize>,
    width: usize,
    out: &mut Vec<u32>,
) {
    use std::arch::x86_64::*;
    let pairs = ks.len().div_ceil(2);
    let slivers = rows.len().div_ceil(width);
    // Every lane of a row inside `rows` is written below; only the padding rows of the last
    // sliver are zeroed (filling the whole buffer first cost as much as the packing).
    if out.len() < slivers * pairs * width {
        out.resize(slivers * pairs * width, 0);
    }
    let out = &mut out[..slivers * pairs * width];
    let (v, rs, cs) = (mat.values.as_ptr(), mat.row_stride, mat.col_stride);
    let pair = |lo: u16, hi: u16| lo as u32 | (hi as u32) << 16;
    // Blocks of 16 rows' (8 for a sliver of 8) 16 pairs, transposed in registers.
    let group = if width.is_multiple_of(16) { 16 } else { 8 };
    let transpose = cs == 1 && width.is_multiple_of(group);
    let whole_pairs = ks.len() / 2;
    for (s, sliver) in out.chunks_exact_mut(pairs * width).enumerate() {
        let r0 = rows.start + s * width;
        let nr = width.min(rows.end - r0);
        if nr < width {
            for lanes in sliver.chunks_exact_mut(width) {
                lanes[nr..].fill(0);
            }
        }
        let sliver = sliver.as_mut_ptr();
        if transpose {
            for g in (0..nr).step_by(group) {
                let live = (nr - g).min(group);
                for p0 in (0..whole_pairs).step_by(16) {
                    let count = (whole_pairs - p0).min(16);
                    let mask = (u32::MAX >> (32 - count)) as u16;
                    let mut block = [_mm512_setzero_si512(); 16];
                    for (r, lanes) in block.iter_mut().enumerate().take(live) {
                        // SAFETY: pairs `p0 .. p0 + count` (values `ks.start + 2 p0 ..`, below
                        // `ks.end`) of row `r0 + g + r < rows.end`, inside `mat`; the masked
                        // lanes are not read.
                        *lanes = unsafe {
                            let at = v.add((r0 + g + r) * rs + ks.start + 2 * p0);
                            _mm512_maskz_loadu_epi32(mask, at.cast())
                        };
                    }
                    let block = transpose_16x16(block);
                    for (q, lanes) in block.iter().enumerate().take(count) {
                        // SAFETY: lanes `g .. g + group <= width` of pair `p0 + q < pairs` of
                        // the sliver.
                        unsafe {
                            let to = sliver.add((p0 + q) * width + g);
                            match group {
                                16 => _mm512_storeu_si512(to.cast(), *lanes),
                                _ => _mm256_storeu_si256(to.cast(), _mm512_castsi512_si256(*lanes)),
                            }
                        }
                    }
                }
            }
            if ks.len() % 2 == 1 {
                for r in 0..nr {
                    // SAFETY: the last value of row `r0 + r`, and the sliver's last pair.
                    unsafe {
                        *sliver.add((pairs - 1) * width + r) =
                            pair(*v.add((r0 + r) * rs + ks.end - 1), 0);
                    }
                }
            }
            continue;
        }
        for p in 0..pairs {
            let k = ks.start + 2 * p;
            let has_hi = k + 1 < ks.end;
            // SAFETY: lanes `p * width .. + nr` of the sliver.
            let lanes = unsafe { std::slice::from_raw_parts_mut(sliver.add(p * width), nr) };
            if rs == 1 {
                // Each pair is one value of two runs of rows: interleaved.
                // SAFETY: rows `r0 .. r0 + nr` of values `k` (and `k + 1`), inside `mat`.
                let lo = unsafe { std::slice::from_raw_parts(v.add(r0 + k * cs), nr) };
                match has_hi {
                    true => {
                        // SAFETY: as above.
                        let hi =
                            unsafe { std::slice::from_raw_parts(v.add(r0 + (k + 1) * cs), nr) };
                        for ((d, &l), &h) in lanes.iter_mut().zip(lo).zip(hi) {
                            *d = pair(l, h);
                        }
                    }
                    false => lanes.iter_mut().zip(lo).for_each(|(d, &l)| *d = pair(l, 0)),
                }
                continue;
            }
            for (r, d) in lanes.iter_mut().enumerate() {
                let i = (r0 + r) * rs + k * cs;
                // SAFETY: value `k` (and `k + 1`) of row `r0 + r`, inside `mat`.
                *d = unsafe { pair(*v.add(i), if has_hi { *v.add(i + cs) } else { 0 }) };
            }
        }
    }
}

/// The transpose of 16 rows of 16 32-bit lanes: lane `c` of row `r` becomes lane `r` of row
/// `c` (pairs within 128-bit lanes, then pairs of pairs, then the 128-bit lanes across).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
fn transpose_16x16(r: [std::arch::x86_64::__m512i; 16]) -> [std::arch::x86_64::__m512i; 16] {
    use std::arch::x86_64::*;
    let mut t = r;
    for i in 0..8 {
        t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    // `u[4 i + j]`: column `4 L + j` of rows `4 i .. 4 i + 4` in each 128-bit lane `L`.
    let mut u = t;
    for i in 0..4 {
        u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
        u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
        u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
    }
    let mut out = u;
    for j in 0..4 {
        let x_lo = _mm512_shuffle_i32x4::<0x88>(u[j], u[4 + j]);
        let x_hi = _mm512_shuffle_i32x4::<0xdd>(u[j], u[4 + j]);
        let y_lo = _mm512_shuffle_i32x4::<0x88>(u[8 + j], u[12 + j]);
        let y_hi = _mm512_shuffle_i32x4::<0xdd>(u[8 + j], u[12 + j]);
        out[j] = _mm512_shuffle_i32x4::<0x88>(x_lo, y_lo);
        out[j + 8] = _mm512_shuffle_i32x4::<0xdd>(x_lo, y_lo);
        out[j + 4] = _mm512_shuffle_i32x4::<0x88>(x_hi, y_hi);
        out[j + 12] = _mm512_shuffle_i32x4::<0xdd>(x_hi, y_hi);
    }
    out
}

/// Where a tile's sums go: `rows × cols` (at most `MR × NR`) outputs from `at`, rows `stride`
/// apart, written or (`accumulate`) added to.
struct Out {
    at: *mut f32,
    stride: usize,
    rows: usize,
    cols: usize,
    accumulate: bool,
}

/// One `MR × NR` tile: the sums over `pairs` pairs of `k` of `a`'s packed pairs (`MR` a pair)
/// times `b`'s (`NR` a pair), into `out`.
///
/// # Safety
///
/// `a` holds `pairs × MR` lanes and `b` `pairs × NR`; `out` describes writable outputs no one
/// else touches meanwhile; the CPU has AVX512-BF16 and AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl")]
unsafe fn tile(pairs: usize, a: &[u32], b: &[u32], out: &Out) {
    use std::arch::x86_64::*;
    /// 16 lanes of bfloat16 pairs as the type `vdpbf16ps` takes.
    #[inline(always)]
    fn pairs_of(v: __m512i) -> __m512bh {
        // SAFETY: two 512-bit vector types: the same bits, reinterpreted.
        unsafe { std::mem::transmute::<__m512i, __m512bh>(v) }
    }
    debug_assert!(a.len() >= pairs * MR && b.len() >= pairs * NR);
    let mut acc = [_mm512_setzero_ps(); MR * 3];
    let (a, b) = (a.as_ptr(), b.as_ptr());
    for p in 0..pairs {
        // SAFETY: lanes `p * NR ..` of `b` (`NR` = 3 × 16) and `p * MR ..` of `a`, inside the
        // slivers (the caller's lengths); unaligned loads.
        let (b0, b1, b2, a_row) = unsafe {
            let b_at = b.add(p * NR);
            (
                _mm512_loadu_si512(b_at.cast()),
                _mm512_loadu_si512(b_at.add(16).cast()),
                _mm512_loadu_si512(b_at.add(32).cast()),
                a.add(p * MR),
            )
        };
        let (b0, b1, b2) = (pairs_of(b0), pairs_of(b1), pairs_of(b2));
        for i in 0..MR {
            // SAFETY: lane `i < MR` of this pair's `MR` lanes.
            let pair = unsafe { *a_row.add(i) } as i32;
            let ai = pairs_of(_mm512_set1_epi32(pair));
            acc[3 * i] = _mm512_dpbf16_ps(acc[3 * i], ai, b0);
            acc[3 * i + 1] = _mm512_dpbf16_ps(acc[3 * i + 1], ai, b1);
            acc[3 * i + 2] = _mm512_dpbf16_ps(acc[3 * i + 2], ai, b2);
        }
    }
    for i in 0..out.rows.min(MR) {
        for v in 0..3 {
            let lanes = out.cols.saturating_sub(16 * v).min(16);
            if lanes == 0 {
                break;
            }
            let mask = (u32::MAX >> (32 - lanes)) as u16;
            // SAFETY: outputs `i < rows`, columns `16 v + lane` for the `lanes < cols - 16 v`
            // lanes the mask keeps, inside `out` (the caller's); masked lanes are not touched.
            unsafe {
                let at = out.at.add(i * out.stride + 16 * v);
                let mut sum = acc[3 * i + v];
                if out.accumulate {
                    sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(mask, at));
                }
                _mm512_mask_storeu_ps(at, mask, sum);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{kernel_choice, with_cpu_capability, CpuCapability};

    /// Pseudo-random bfloat16 bits of values in about [-2, 2] (a few exact zeros too).
    fn values(len: usize, seed: u64) -> Vec<u16> {
        let mut state = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut next = || {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as f32 / (1u64 << 31) as f32) * 4.0 - 2.0
        };
        let mut v = vec![0f32; len];
        v.iter_mut().for_each(|x| *x = next());
        to_bf16_bits(&v)
    }

    fn value(bits: u16) -> f64 {
        f32::from_bits((bits as u32) << 16) as f64
    }

    /// The float64 sums of the products, and the sums of their absolute values (the scale of
    /// the float32 rounding allowed).
    fn reference(
        a: Matrix<'_, u16>,
        b: Matrix<'_, u16>,
        (m, n, k): (usize, usize, usize),
        bias: Option<&[f32]>,
    ) -> (Vec<f64>, Vec<f64>) {
        let mut sums = vec![0f64; m * n];
        let mut scale = vec![0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = bias.map_or(0.0, |b| b[j] as f64);
                let mut t = s.abs();
                for p in 0..k {
                    let x = value(a.values[i * a.row_stride + p * a.col_stride])
                        * value(b.values[p * b.row_stride + j * b.col_stride]);
                    s += x;
                    t += x.abs();
                }
                sums[i * n + j] = s;
                scale[i * n + j] = t;
            }
        }
        (sums, scale)
    }

    /// Each implementation (the AVX512-BF16 kernel where the CPU has it, the float32 kernels
    /// under a forced AVX2 and baseline) against float64 sums of the same bfloat16 values, on
    /// odd shapes (one row, `k` odd and not a multiple of 32, partial tiles, several `k`
    /// blocks) and every stride pattern the callers pass (row-major, transposed).
    #[test]
    fn every_implementation_equals_float64_sums_on_odd_shapes_and_strides() {
        if !kernel_choice().bf16_products {
            println!(
                "the AVX512-BF16 kernel is not tested here: {} has no AVX512-BF16 \
                 (the float32 fallback is)",
                kernel_choice().cpu
            );
        }
        for (m, n, k) in [
            (1, 1, 1),
            (1, 50, 77),
            (3, 5, 7),
            (9, 49, 33),
            (17, 97, 300),
            (40, 100, 600),
            (8, 1700, 40),
            (200, 384, 384),
        ] {
            let a = values(m * k, 1);
            let b = values(k * n, 2);
            let bias: Vec<f32> = (0..n).map(|j| j as f32 * 0.25 - 3.0).collect();
            for (a, b) in [
                (Matrix::rows(&a, k), Matrix::rows(&b, n)),
                (Matrix::transposed(&a, m), Matrix::transposed(&b, k)),
                (Matrix::rows(&a, k), Matrix::transposed(&b, k)),
                (Matrix::transposed(&a, m), Matrix::rows(&b, n)),
            ] {
                for bias in [None, Some(&bias[..])] {
                    let (want, scale) = reference(a, b, (m, n, k), bias);
                    for level in [
                        CpuCapability::Avx512,
                        CpuCapability::Avx2,
                        CpuCapability::Default,
                    ] {
                        let got = with_cpu_capability(level, || {
                            bf16_product(a, b, (m, n, k), bias).unwrap()
                        });
                        for (i, ((&g, &w), &s)) in got.iter().zip(&want).zip(&scale).enumerate() {
                            let tol = s * 4.0 * f32::EPSILON as f64 * (k as f64).sqrt() + 1e-30;
                            assert!(
                                (g as f64 - w).abs() <= tol,
                                "{level} {m}x{n}x{k} output {i}: {g} against {w}"
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn rounds_to_nearest_even_as_the_casts() {
        let v = [
            1.0f32,
            1.0 + 1.0 / 256.0,
            1.0 + 3.0 / 256.0,
            -3.3e38,
            f32::NAN,
            1e-40,
            f32::INFINITY,
        ];
        let ours = to_bf16_bits(&v);
        let plain = with_cpu_capability(CpuCapability::Default, || to_bf16_bits(&v));
        for ((&o, &p), &x) in ours.iter().zip(&plain).zip(&v) {
            let want = half::bf16::from_f32(x);
            assert_eq!(o, p);
            match x.is_nan() {
                true => assert!(half::bf16::from_bits(o).is_nan()),
                false => assert_eq!(o, want.to_bits(), "{x}"),
            }
        }
    }

    #[test]
    fn short_operands_and_a_wrong_bias_are_errors() {
        let a = values(10, 1);
        let b = values(10, 2);
        let (a, b) = (Matrix::rows(&a, 5), Matrix::rows(&b, 2));
        assert!(bf16_product(a, b, (3, 2, 5), None).is_err());
        assert!(bf16_product(a, b, (2, 2, 5), Some(&[1.0])).is_err());
        assert_eq!(bf16_product(a, b, (2, 2, 5), None).unwrap().len(), 4);
    }
}
