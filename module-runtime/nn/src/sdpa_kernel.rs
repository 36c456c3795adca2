//! The float32 CPU kernels of `scaled_dot_product_attention`: reading the heads where they lie (any
//! strides, the last dimension contiguous), the attention weights of one query row (scores, mask,
//! softmax in one pass), and the output rows built on them ([`attend`]), which the inference pass
//! and the training op's forward (`fused_grad::attention`) both run: the two paths give the same
//! weights to the bit, and the op's backward recomputes them with the same [`Scores`].

use candle_core::{CpuStorage, Layout, Storage, Tensor};

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

    /// `score` for query `i` and key `j` of (batch `b`, query head `h`), masked.
    fn apply(&self, [b, h, i, j]: [usize; 4], score: f32) -> f32 {
        let s = &self.stride;
        let at = self.offset + b * s[0] + h * s[1] + i * s[2] + j * s[3];
        match self.values {
            CpuStorage::U8(m) if m[at] == 0 => f32::NEG_INFINITY,
            CpuStorage::F32(m) => score + m[at],
            _ => score,
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
}

impl Scores<'_> {
    /// The softmax weights of query `i` of (batch `b`, query head `h`) over the keys, written into
    /// `probs` (one per key). A query that may attend to no key gets NaN weights, as PyTorch's
    /// composed path gives.
    pub(crate) fn probs(&self, b: usize, h: usize, i: usize, probs: &mut [f32]) {
        let kh = h / self.group;
        let qrow = self.q.row([b, h, i], self.e);
        let mut max = f32::NEG_INFINITY;
        for (j, score) in probs.iter_mut().enumerate() {
            let mut x = if self.causal && j > i {
                f32::NEG_INFINITY
            } else {
                dot(qrow, self.k.row([b, kh, j], self.e)) * self.scale
            };
            if let Some(mask) = &self.mask {
                x = mask.apply([b, h, i, j], x);
            }
            *score = x;
            max = max.max(x);
        }
        let mut sum = 0f32;
        for score in probs.iter_mut() {
            *score = (*score - max).exp();
            sum += *score;
        }
        let inv = 1.0 / sum;
        probs.iter_mut().for_each(|p| *p *= inv);
    }
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
            for (j, &weight) in weights.iter().enumerate() {
                if weight != 0.0 {
                    axpy(weight, values.row([b, kh, j], d.ev), row);
                }
            }
        }
    };
    candle_core::utils::barrier_pool().execute_chunked(d.b * d.hq, |range| range.for_each(head));
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

/// `y += a * x`.
pub(crate) fn axpy(a: f32, x: &[f32], y: &mut [f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `a · b` with eight running sums (so it vectorizes).
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
