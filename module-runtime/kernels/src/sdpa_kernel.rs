//! The float32 CPU kernels of `scaled_dot_product_attention`: reading the heads where they lie (any
//! strides, the last dimension contiguous), the attention weights of one query row (scores, mask,
//! softmax in one pass), and the output rows built on them ([`attend`]), which the inference pass
//! and the training op's forward (`fused_grad::attention`) both run: the two paths give the same
//! weights to the bit, and the op's backward recomputes them with the same [`Scores`].

use candle_core::{CpuStorage, Layout, Storage, Tensor};

use crate::cpu::lane_sum;
use crate::error::{Error, Result};

/// A tensor's float32 values and the offset and strides to read them with.
#[derive(Clone, Copy)]
pub(crate) struct View<'a> {
    data: &'a [f32],
    offset: usize,
    stride: [usize; 4],
}

impl<'a> View<'a> {
    /// The values of a rank-4 float32 storage under `layout`.
    pub(crate) fn new(storage: &'a CpuStorage, layout: &Layout) -> candle_core::Result<Self> {
        Ok(Self {
            data: storage.as_slice::<f32>()?,
            offset: layout.start_offset(),
            stride: stride4(layout.stride()),
        })
    }

    /// The `len` values from index `[i0, i1, i2, 0]` on (the last dimension is contiguous).
    #[inline(always)]
    pub(crate) fn row(&self, i: [usize; 3], len: usize) -> &'a [f32] {
        let at =
            self.offset + i[0] * self.stride[0] + i[1] * self.stride[1] + i[2] * self.stride[2];
        &self.data[at..at + len]
    }
}

fn stride4(s: &[usize]) -> [usize; 4] {
    [s[0], s[1], s[2], s[3]]
}

/// A mask broadcast to `[B, Hq, L, S]`: which keys each query may attend to (`u8`), or what is
/// added to its scores (`f32`).
pub(crate) struct Mask<'a> {
    values: &'a CpuStorage,
    offset: usize,
    stride: [usize; 4],
}

impl<'a> Mask<'a> {
    pub(crate) fn new(storage: &'a CpuStorage, layout: &Layout) -> Self {
        Self {
            values: storage,
            offset: layout.start_offset(),
            stride: stride4(layout.stride()),
        }
    }

    /// The scores of query `i` of (batch `b`, query head `h`) over the keys, masked in place.
    #[inline(always)]
    fn apply_row(&self, [b, h, i]: [usize; 3], scores: &mut [f32]) {
        let s = &self.stride;
        let at = self.offset + b * s[0] + h * s[1] + i * s[2];
        match self.values {
            CpuStorage::U8(m) => {
                for (j, score) in scores.iter_mut().enumerate() {
                    if m[at + j * s[3]] == 0 {
                        *score = f32::NEG_INFINITY;
                    }
                }
            }
            CpuStorage::F32(m) if s[3] == 1 => {
                let m = &m[at..at + scores.len()];
                scores.iter_mut().zip(m).for_each(|(score, m)| *score += m);
            }
            CpuStorage::F32(m) => {
                for (j, score) in scores.iter_mut().enumerate() {
                    *score += m[at + j * s[3]];
                }
            }
            _ => {}
        }
    }
}

/// What the attention weights of a query row are computed from: the queries and keys, the mask,
/// causality, the scale, and how many query heads share a key head.
pub(crate) struct Scores<'a> {
    pub(crate) q: View<'a>,
    pub(crate) k: View<'a>,
    pub(crate) mask: Option<Mask<'a>>,
    pub(crate) causal: bool,
    pub(crate) scale: f32,
    /// Query heads per key/value head (`Hq / H`).
    pub(crate) group: usize,
    /// The query/key size `E`.
    pub(crate) e: usize,
    /// Whether the AVX2 + FMA builds run (see [`simd`]): chosen once per call, on the calling
    /// thread, so the pool's threads and a training op's backward take the same build.
    pub(crate) simd: bool,
}

impl Scores<'_> {
    /// The softmax weights of query `i` of (batch `b`, query head `h`) over the keys, written into
    /// `probs` (one per key). A query that may attend to no key gets NaN weights, as PyTorch's
    /// composed path gives. Compiled for AVX2 and FMA when the CPU has them (see [`simd`]): every
    /// caller gets the same weights to the bit, which the training op's backward relies on.
    pub(crate) fn probs(&self, b: usize, h: usize, i: usize, probs: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if self.simd {
            // SAFETY: the CPU has AVX2 and FMA (`simd`, which set the field).
            return unsafe { self.probs_avx2(b, h, i, probs) };
        }
        self.probs_body(b, h, i, probs, dot);
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn probs_avx2(&self, b: usize, h: usize, i: usize, probs: &mut [f32]) {
        // SAFETY: the CPU has AVX2 and FMA (this function's features).
        self.probs_body(b, h, i, probs, |q, k| unsafe { avx2::dot(q, k) });
    }

    #[inline(always)]
    fn probs_body(
        &self,
        b: usize,
        h: usize,
        i: usize,
        probs: &mut [f32],
        dot: impl Fn(&[f32], &[f32]) -> f32,
    ) {
        let kh = h / self.group;
        let qrow = self.q.row([b, h, i], self.e);
        for (j, score) in probs.iter_mut().enumerate() {
            *score = dot(qrow, self.k.row([b, kh, j], self.e)) * self.scale;
        }
        if self.causal && i + 1 < probs.len() {
            probs[i + 1..].fill(f32::NEG_INFINITY);
        }
        if let Some(mask) = &self.mask {
            mask.apply_row([b, h, i], probs);
        }
        softmax_in_place(probs);
    }
}

/// `x ↦ exp(x − max) / Σ exp(x − max)` in place. The exponentials are [`exp`]'s (vectorized when
/// the caller is); a row whose largest value is not finite (every key masked, or an infinite or
/// NaN score) takes the standard library's `exp`, so its NaNs are PyTorch's.
#[inline(always)]
fn softmax_in_place(x: &mut [f32]) {
    let max = x.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
    if max.is_finite() {
        x.iter_mut().for_each(|v| *v = exp(*v - max));
    } else {
        x.iter_mut().for_each(|v| *v = (*v - max).exp());
    }
    let sum = lane_sum(x, |v| v);
    let inv = 1.0 / sum;
    x.iter_mut().for_each(|p| *p *= inv);
}

/// `eˣ` for `x ≤ 0` (a score minus its row's maximum) within 2 ulp, written so that a loop over
/// it vectorizes: `2ⁿ · p(r)` with `x = n ln 2 + r`, `|r| ≤ ln 2 / 2` (Cody–Waite split of ln 2)
/// and a degree-6 polynomial for `eʳ`; 0 below −87.3 (where `eˣ` leaves the normal range, and
/// for −∞: a masked key), NaN for NaN.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOW: f32 = -87.336_55;
    let c = x.clamp(LOW, 88.0);
    let n = (c * std::f32::consts::LOG2_E + 0.5).floor();
    let r = c - n * 0.693_359_4 + n * 2.121_944_4e-4;
    let p = 1.987_569_1e-4;
    let p = p * r + 1.398_199_9e-3;
    let p = p * r + 8.333_452e-3;
    let p = p * r + 4.166_579_6e-2;
    let p = p * r + 0.166_666_65;
    let p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let scale = f32::from_bits(((n as i32 + 127) as u32) << 23);
    if x < LOW {
        0.0
    } else {
        y * scale
    }
}

/// Whether the kernels' AVX2 + FMA builds run for a call started on this thread: where the CPU has
/// them and [`kernel_choice`](crate::kernel_choice)'s attention level allows them.
pub(crate) fn simd() -> bool {
    crate::kernel_choice().attention >= crate::CpuCapability::Avx2
}

/// The dimensions involved: batch, query heads, key/value heads, query and key lengths, the
/// query/key size and the value size.
#[derive(Clone, Copy)]
pub(crate) struct Dims {
    pub(crate) b: usize,
    pub(crate) hq: usize,
    pub(crate) h: usize,
    pub(crate) l: usize,
    pub(crate) s: usize,
    pub(crate) e: usize,
    pub(crate) ev: usize,
}

pub(crate) fn bad(message: String) -> Error {
    Error::InvalidConfig {
        layer: "scaled_dot_product_attention",
        message,
    }
}

/// The inference pass, split over candle's thread pool: per (batch, query head), per query, the
/// weights over the keys and their sum of the values, written into `[B, L, Hq, Ev]` and returned
/// as its `[B, Hq, L, Ev]` view.
pub(crate) fn inference(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    causal: bool,
    scale: f64,
    d: &Dims,
) -> Result<Tensor> {
    let (qs, ql) = q.storage_and_layout();
    let (ks, kl) = k.storage_and_layout();
    let (vs, vl) = v.storage_and_layout();
    let (Storage::Cpu(qc), Storage::Cpu(kc), Storage::Cpu(vc)) = (&*qs, &*ks, &*vs) else {
        return Err(bad("the fused pass needs CPU tensors".to_owned()));
    };
    let mask_guard = mask.map(|m| m.storage_and_layout());
    let mask = match &mask_guard {
        Some((storage, layout)) => {
            let Storage::Cpu(c) = &**storage else {
                return Err(bad("the fused pass needs a CPU mask".to_owned()));
            };
            Some(Mask::new(c, layout))
        }
        None => None,
    };
    let scores = Scores {
        q: View::new(qc, ql)?,
        k: View::new(kc, kl)?,
        mask,
        causal,
        scale: scale as f32,
        group: d.hq / d.h,
        e: d.e,
        simd: simd(),
    };
    let out = attend(&scores, View::new(vc, vl)?, d, |_, _| {});
    drop((qs, ks, vs, mask_guard));
    Ok(Tensor::from_vec(out, (d.b, d.l, d.hq, d.ev), q.device())?.transpose(1, 2)?)
}

/// The attention output as `[B, L, Hq, Ev]` values, split over candle's thread pool: per (batch,
/// query head), per query, the weights over the keys (from `scores`, then changed in place by
/// `reweight`, which the training op uses for dropout) and their sum of the values. Serves the
/// inference pass and the training op's forward alike.
pub(crate) fn attend(
    scores: &Scores,
    values: View,
    d: &Dims,
    reweight: impl Fn([usize; 3], &mut [f32]) + Sync,
) -> Vec<f32> {
    let mut out = vec![0f32; d.b * d.l * d.hq * d.ev];
    let ptr = Out(out.as_mut_ptr());
    // Over candle's barrier pool, whose threads are awake right after the projections' kernels
    // (see `fused_grad::par_map`).
    let head = |pair: usize| {
        let (b, h) = (pair / d.hq, pair % d.hq);
        let kh = h / scores.group;
        let mut weights = vec![0f32; d.s];
        for i in 0..d.l {
            scores.probs(b, h, i, &mut weights);
            reweight([b, h, i], &mut weights);
            // SAFETY: row (b, i, h) of `out` is written by this (b, h) pair only, and `out`
            // outlives the loop.
            let row = unsafe { ptr.slice(((b * d.l + i) * d.hq + h) * d.ev, d.ev) };
            weighted_sum(scores.simd, &weights, |j| values.row([b, kh, j], d.ev), row);
        }
    };
    let pairs = d.b * d.hq;
    if d.l == 1 {
        // Decoding (one query a head): each pair's work is reading its key/value head, cold.
        // One contiguous run of heads per thread reads most key/value heads on one thread only,
        // where heads handed out one at a time read every one on both: paired ratios of a q8_0
        // decode step 1.039, 1.031, 1.023 in one process. Several queries a head (a prompt) are
        // compute, and keep the finer split's balance.
        crate::pool::par_runs(pairs, |range| range.for_each(&head));
    } else {
        candle_core::utils::barrier_pool().execute_chunked(pairs, |range| range.for_each(&head));
    }
    out
}

/// The output buffer, written by several threads at disjoint places.
struct Out(*mut f32);
// SAFETY: every (batch, head) pair writes only its own rows of the buffer (see `attend`).
unsafe impl Send for Out {}
unsafe impl Sync for Out {}

impl Out {
    /// The `len` values from `at`.
    ///
    /// # Safety
    ///
    /// No other thread reads or writes them while the slice lives, and they lie in the buffer.
    #[allow(clippy::mut_from_ref)]
    unsafe fn slice(&self, at: usize, len: usize) -> &mut [f32] {
        // SAFETY: as the caller promises.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

/// `out += Σⱼ weights[j] · row(j)` (rows of at least `out.len()` values), skipping zero weights;
/// with AVX2 and FMA where `simd` (what [`simd`] said) ([`avx2::weighted_sum`]).
pub(crate) fn weighted_sum<'r>(
    simd: bool,
    weights: &[f32],
    row: impl Fn(usize) -> &'r [f32],
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        // SAFETY: the CPU has AVX2 and FMA (`simd` came from the function of that name).
        return unsafe { avx2::weighted_sum(weights, row, out) };
    }
    weighted_sum_body(weights, row, out);
}

/// The AVX2 + FMA builds of the two inner loops: a query's scores and its sum of values.
#[cfg(target_arch = "x86_64")]
mod avx2 {
    use std::arch::x86_64::*;

    /// `a · b` over the shorter length, in two registers of fused multiply-adds.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut s0, mut s1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
        let mut i = 0;
        // SAFETY (every load): `i + 8 ≤ n` values from `i` lie in both slices.
        while i + 16 <= n {
            s0 = _mm256_fmadd_ps(
                unsafe { _mm256_loadu_ps(pa.add(i)) },
                unsafe { _mm256_loadu_ps(pb.add(i)) },
                s0,
            );
            s1 = _mm256_fmadd_ps(
                unsafe { _mm256_loadu_ps(pa.add(i + 8)) },
                unsafe { _mm256_loadu_ps(pb.add(i + 8)) },
                s1,
            );
            i += 16;
        }
        if i + 8 <= n {
            s0 = _mm256_fmadd_ps(
                unsafe { _mm256_loadu_ps(pa.add(i)) },
                unsafe { _mm256_loadu_ps(pb.add(i)) },
                s0,
            );
            i += 8;
        }
        let s = _mm256_add_ps(s0, s1);
        let x = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps::<1>(s));
        let x = _mm_add_ps(x, _mm_movehl_ps(x, x));
        let x = _mm_add_ss(x, _mm_shuffle_ps::<1>(x, x));
        let mut total = _mm_cvtss_f32(x);
        for (x, y) in a[i..n].iter().zip(&b[i..n]) {
            total += x * y;
        }
        total
    }

    /// `out += Σⱼ weights[j] · row(j)`, skipping zero weights: the columns in blocks of 64 (then
    /// 8) summed over every row in registers, and `out` read and written once per block — not
    /// once per row, whose loads then wait on the previous row's stores.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn weighted_sum<'r>(
        weights: &[f32],
        row: impl Fn(usize) -> &'r [f32],
        out: &mut [f32],
    ) {
        let n = out.len();
        let mut c = 0;
        while c + 64 <= n {
            // SAFETY: the CPU has AVX2 and FMA; columns `c..c + 64` lie in `out`.
            unsafe { block::<8>(weights, &row, out, c) };
            c += 64;
        }
        while c + 8 <= n {
            // SAFETY: as above, for `c..c + 8`.
            unsafe { block::<1>(weights, &row, out, c) };
            c += 8;
        }
        if c < n {
            for (j, &weight) in weights.iter().enumerate() {
                if weight != 0.0 {
                    super::axpy(weight, &row(j)[c..n], &mut out[c..]);
                }
            }
        }
    }

    /// Columns `c..c + 8 R` of [`weighted_sum`], in `R` registers.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `c + 8 R ≤ out.len()`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block<'r, const R: usize>(
        weights: &[f32],
        row: &impl Fn(usize) -> &'r [f32],
        out: &mut [f32],
        c: usize,
    ) {
        let end = c + 8 * R;
        let out = &mut out[c..end];
        // SAFETY (every load and store): `out` and each row's `c..end` hold `8 R` values.
        let mut sums = [_mm256_setzero_ps(); R];
        for (r, sum) in sums.iter_mut().enumerate() {
            *sum = unsafe { _mm256_loadu_ps(out.as_ptr().add(8 * r)) };
        }
        for (j, &weight) in weights.iter().enumerate() {
            if weight != 0.0 {
                let v = &row(j)[c..end];
                let w = _mm256_set1_ps(weight);
                for (r, sum) in sums.iter_mut().enumerate() {
                    *sum =
                        _mm256_fmadd_ps(w, unsafe { _mm256_loadu_ps(v.as_ptr().add(8 * r)) }, *sum);
                }
            }
        }
        for (r, sum) in sums.iter().enumerate() {
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(8 * r), *sum) };
        }
    }
}

#[inline(always)]
fn weighted_sum_body<'r>(weights: &[f32], row: impl Fn(usize) -> &'r [f32], out: &mut [f32]) {
    for (j, &weight) in weights.iter().enumerate() {
        if weight != 0.0 {
            axpy(weight, row(j), out);
        }
    }
}

/// `y += a * x`.
#[inline(always)]
pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `a · b` with eight running sums (so it vectorizes).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let rest: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for l in 0..8 {
            lanes[l] += x[l] * y[l];
        }
    }
    lanes.iter().sum::<f32>() + rest
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_the_standard_librarys() {
        let mut x = -87.3f32;
        while x <= 0.0 {
            let (ours, std) = (exp(x), x.exp());
            assert!(
                (ours - std).abs() <= 2.5e-7 * std,
                "exp({x}): {ours} vs {std}"
            );
            x += 0.0007;
        }
        assert_eq!(exp(0.0), 1.0);
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-1e30), 0.0);
        assert!(exp(f32::NAN).is_nan());
    }

    /// The AVX2 build of the weights (on a CPU that has it) and the portable one agree.
    #[test]
    fn the_simd_and_portable_weighted_sums_agree() {
        // 64-column blocks, 8-column blocks and a tail; a zero weight skips a row of NaNs.
        for width in [5, 24, 64, 70, 136] {
            let rows: Vec<Vec<f32>> = (0..9)
                .map(|j| {
                    let nan = j == 4;
                    (0..width)
                        .map(|c| {
                            if nan {
                                f32::NAN
                            } else {
                                ((j * 31 + c * 7) % 23) as f32 - 11.0
                            }
                        })
                        .collect()
                })
                .collect();
            let weights: Vec<f32> = (0..9)
                .map(|j| if j == 4 { 0.0 } else { 0.1 * j as f32 - 0.3 })
                .collect();
            let start: Vec<f32> = (0..width).map(|c| c as f32 * 0.5).collect();
            let (mut fast, mut portable) = (start.clone(), start);
            weighted_sum(simd(), &weights, |j| &rows[j], &mut fast);
            weighted_sum_body(&weights, |j| &rows[j], &mut portable);
            for (f, p) in fast.iter().zip(&portable) {
                assert!(
                    (f - p).abs() <= 1e-5 * p.abs().max(1.0),
                    "{width}: {f} vs {p}"
                );
            }
        }
    }

    #[test]
    fn the_simd_and_portable_weights_agree() {
        let (b, h, l, e) = (2, 3, 5, 24);
        let values: Vec<f32> = (0..b * h * l * e)
            .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
            .collect();
        let view = View {
            data: &values,
            offset: 0,
            stride: [h * l * e, l * e, e, 1],
        };
        for causal in [false, true] {
            let scores = Scores {
                q: view,
                k: view,
                mask: None,
                causal,
                scale: 0.3,
                group: 1,
                e,
                simd: simd(),
            };
            let (mut fast, mut portable) = (vec![0f32; l], vec![0f32; l]);
            for i in 0..l {
                scores.probs(1, 2, i, &mut fast);
                scores.probs_body(1, 2, i, &mut portable, dot);
                for (f, p) in fast.iter().zip(&portable) {
                    assert!((f - p).abs() <= 1e-6, "{fast:?} vs {portable:?}");
                }
                assert!((fast.iter().sum::<f32>() - 1.0).abs() < 1e-5);
            }
        }
    }
}
