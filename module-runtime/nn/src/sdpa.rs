//! `torch.nn.functional.scaled_dot_product_attention`: attention over given queries, keys and
//! values, with PyTorch's masks, causal masking, scale and grouped-query heads. During CPU float32
//! inference it is one pass per head, reading the heads where they lie (no contiguous copies, no
//! materialized broadcast mask, no separate softmax pass); everywhere else it is composed of
//! candle's differentiable ops, which the pass matches within float32 rounding.

use candle_core::{DType, Storage, Tensor};

use crate::error::{Error, Result};
use crate::{Forward, Softmax};

/// The options of [`scaled_dot_product_attention`] besides the mask, with PyTorch's defaults
/// (`SdpaOptions { is_causal: true, ..Default::default() }`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct SdpaOptions {
    /// Dropout on the attention weights (`dropout_p`, default 0). Applied whenever it is above
    /// zero, in training and in evaluation alike, as PyTorch's function does: pass 0 in
    /// evaluation.
    pub dropout_p: f64,
    /// Queries attend only to keys at or before their own position (`is_causal`): the lower
    /// triangle of an `[L, S]` matrix of ones, aligned at the top left as PyTorch aligns it.
    pub is_causal: bool,
    /// The factor on `q·kᵀ` (`scale`, default `1 / sqrt(E)`).
    pub scale: Option<f64>,
    /// Grouped-query attention (`enable_gqa`): the query heads `Hq` are a multiple of the key and
    /// value heads `H`, and query head `h` attends with key and value head `h / (Hq / H)`.
    pub enable_gqa: bool,
}

/// PyTorch's `F.scaled_dot_product_attention(query, key, value, attn_mask, dropout_p, is_causal,
/// scale, enable_gqa)`: `softmax(q·kᵀ · scale + mask) · v`.
///
/// Shapes: `query` `[B, Hq, L, E]`, `key` `[B, H, S, E]`, `value` `[B, H, S, Ev]`, the result
/// `[B, Hq, L, Ev]` (`H == Hq` unless `enable_gqa`). `attn_mask` broadcasts to `[B, Hq, L, S]`: a
/// `u8` mask says which keys each query may attend to (nonzero: yes, PyTorch's boolean mask), a
/// float mask of the queries' dtype is added to the scores (`-inf` or the dtype's lowest value to
/// exclude a key). A query that may attend to no key gets NaN, as PyTorch's composed path gives.
///
/// During CPU float32 inference (no input records a gradient, no dropout, fusion on: see
/// [`without_fusion`](crate::without_fusion)) the result is computed in one pass per head, split
/// over threads, and returned as a view of a `[B, L, Hq, Ev]` buffer: transposing it back to put
/// the heads side by side (`.transpose(1, 2)?.reshape((b, l, hq * ev))?`) copies nothing.
///
/// ```
/// use module_runtime::nn::functional::{scaled_dot_product_attention, SdpaOptions};
/// use module_runtime::prelude::*;
///
/// let dev = Device::Cpu;
/// let q = Tensor::randn(0f32, 1.0, (2, 4, 5, 8), &dev)?; // [B, Hq, L, E]
/// let k = Tensor::randn(0f32, 1.0, (2, 2, 5, 8), &dev)?; // two key/value heads
/// let v = Tensor::randn(0f32, 1.0, (2, 2, 5, 8), &dev)?;
/// let options = SdpaOptions { is_causal: true, enable_gqa: true, ..Default::default() };
/// let out = scaled_dot_product_attention(&q, &k, &v, None, options)?;
/// assert_eq!(out.dims(), [2, 4, 5, 8]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn scaled_dot_product_attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    attn_mask: Option<&Tensor>,
    options: SdpaOptions,
) -> Result<Tensor> {
    let (shape, mask) = check(query, key, value, attn_mask, &options)?;
    let scale = options.scale.unwrap_or(1.0 / (shape.e as f64).sqrt());
    if options.dropout_p == 0.0 && fast_path_applies(query, key, value, mask.as_ref()) {
        return fused(
            query,
            key,
            value,
            mask.as_ref(),
            options.is_causal,
            scale,
            &shape,
        );
    }
    composed(query, key, value, mask.as_ref(), &options, scale, &shape)
}

/// The dimensions involved: batch, query heads, key/value heads, query and key lengths, the
/// query/key size and the value size.
struct Dims {
    b: usize,
    hq: usize,
    h: usize,
    l: usize,
    s: usize,
    e: usize,
    ev: usize,
}

fn bad(message: String) -> Error {
    Error::InvalidConfig {
        layer: "scaled_dot_product_attention",
        message,
    }
}

/// The dimensions, once the inputs are checked to fit together, and the mask broadcast to
/// `[B, Hq, L, S]`.
fn check(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    options: &SdpaOptions,
) -> Result<(Dims, Option<Tensor>)> {
    let (Ok((b, hq, l, e)), Ok((kb, h, s, ke)), Ok((vb, vh, vs, ev))) =
        (q.dims4(), k.dims4(), v.dims4())
    else {
        return Err(bad(format!(
            "query, key and value must be [B, H, L, E], [B, H, S, E], [B, H, S, Ev]; got {:?}, \
             {:?}, {:?}",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    };
    if kb != b || vb != b || ke != e || vh != h || vs != s {
        return Err(bad(format!(
            "query [B, Hq, L, E] = {:?}, key [B, H, S, E] = {:?} and value [B, H, S, Ev] = {:?} \
             do not agree",
            q.dims(),
            k.dims(),
            v.dims()
        )));
    }
    let heads_fit = if options.enable_gqa {
        h > 0 && hq % h == 0
    } else {
        hq == h
    };
    if !heads_fit {
        return Err(bad(format!(
            "{hq} query heads and {h} key/value heads{}",
            if options.enable_gqa {
                ": the query heads must be a multiple of the key/value heads"
            } else {
                " differ: set enable_gqa for grouped-query attention"
            }
        )));
    }
    if q.dtype() != k.dtype() || q.dtype() != v.dtype() {
        return Err(bad(format!(
            "query, key and value have dtypes {:?}, {:?}, {:?}: they must be one",
            q.dtype(),
            k.dtype(),
            v.dtype()
        )));
    }
    if let Some(m) = mask {
        if m.dtype() != DType::U8 && m.dtype() != q.dtype() {
            return Err(bad(format!(
                "attn_mask must be u8 (which keys to attend to) or {:?} (added to the scores), \
                 got {:?}",
                q.dtype(),
                m.dtype()
            )));
        }
    }
    let mask = mask
        .map(|m| {
            m.broadcast_as((b, hq, l, s)).map_err(|_| {
                bad(format!(
                    "attn_mask of shape {:?} does not broadcast to [B, Hq, L, S] = [{b}, {hq}, {l}, {s}]",
                    m.dims()
                ))
            })
        })
        .transpose()?;
    if !(0.0..1.0).contains(&options.dropout_p) {
        return Err(bad(format!(
            "dropout_p must be in [0, 1), got {}",
            options.dropout_p
        )));
    }
    let dims = Dims {
        b,
        hq,
        h,
        l,
        s,
        e,
        ev,
    };
    Ok((dims, mask))
}

/// Whether the one-pass kernel may run: CPU float32 tensors that record no gradient, each with
/// its last dimension contiguous, fusion on.
fn fast_path_applies(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> bool {
    let plain = |t: &Tensor| {
        t.device().is_cpu() && t.dtype() == DType::F32 && !t.track_op() && t.stride()[3] == 1
    };
    crate::is_fusion_enabled()
        && plain(q)
        && plain(k)
        && plain(v)
        && mask.is_none_or(|m| !m.track_op() && matches!(m.dtype(), DType::F32 | DType::U8))
}

/// The composed path: candle's differentiable ops.
fn composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    mask: Option<&Tensor>,
    options: &SdpaOptions,
    scale: f64,
    d: &Dims,
) -> Result<Tensor> {
    let repeat = |t: &Tensor| -> Result<Tensor> {
        let n = d.hq / d.h;
        if n == 1 {
            return Ok(t.contiguous()?);
        }
        let (b, h, s, x) = t.dims4()?;
        Ok(t.unsqueeze(2)?
            .broadcast_as((b, h, n, s, x))?
            .reshape((b, h * n, s, x))?)
    };
    let (k, v) = (repeat(k)?, repeat(v)?);
    let mut scores = (q.contiguous()?.matmul(&k.t()?)? * scale)?;
    // A masked score is -inf: the softmax gives it exactly zero weight.
    let excluded = Tensor::new(f64::NEG_INFINITY, q.device())?
        .to_dtype(q.dtype())?
        .broadcast_as(scores.shape())?;
    if options.is_causal {
        let allowed: Vec<u8> = (0..d.l)
            .flat_map(|i| (0..d.s).map(move |j| u8::from(j <= i)))
            .collect();
        let allowed =
            Tensor::from_vec(allowed, (d.l, d.s), q.device())?.broadcast_as(scores.shape())?;
        scores = allowed.where_cond(&scores, &excluded)?;
    }
    if let Some(m) = mask {
        scores = if m.dtype() == DType::U8 {
            m.where_cond(&scores, &excluded)?
        } else {
            scores.broadcast_add(m)?
        };
    }
    let mut probs = Forward::forward(&Softmax::new(-1), &scores)?;
    if options.dropout_p > 0.0 {
        probs = candle_nn::ops::dropout(&probs, options.dropout_p as f32)?;
    }
    Ok(probs.matmul(&v)?)
}

/// A tensor's float32 values and the offset and strides to read them with.
struct View<'a> {
    data: &'a [f32],
    offset: usize,
    stride: [usize; 4],
}

impl View<'_> {
    fn at(&self, i: [usize; 4]) -> usize {
        self.offset + (0..4).map(|d| i[d] * self.stride[d]).sum::<usize>()
    }
}

fn view<'a>(c: &'a candle_core::CpuStorage, offset: usize, t: &Tensor) -> Result<View<'a>> {
    Ok(View {
        data: c.as_slice::<f32>()?,
        offset,
        stride: stride4(t),
    })
}

fn stride4(t: &Tensor) -> [usize; 4] {
    let s = t.stride();
    [s[0], s[1], s[2], s[3]]
}

/// The output buffer, written by several threads at disjoint places.
struct Out(*mut f32);
// SAFETY: every (batch, head) pair writes only its own rows of the buffer (see `fused`).
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

/// The one-pass kernel, split over candle's thread pool: per (batch, query head), per query: the scores against every key, the
/// mask, the softmax and the weighted sum of the values, written into `[B, L, Hq, Ev]`.
fn fused(
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
    let qv = view(qc, ql.start_offset(), q)?;
    let kv = view(kc, kl.start_offset(), k)?;
    let vv = view(vc, vl.start_offset(), v)?;
    let mask_guard = mask.map(|m| m.storage_and_layout());
    let mask_view = match (&mask_guard, mask) {
        (Some((storage, layout)), Some(m)) => {
            let Storage::Cpu(c) = &**storage else {
                return Err(bad("the fused pass needs a CPU mask".to_owned()));
            };
            Some((c, layout.start_offset(), stride4(m)))
        }
        _ => None,
    };
    let mut out = vec![0f32; d.b * d.l * d.hq * d.ev];
    let ptr = Out(out.as_mut_ptr());
    let group = d.hq / d.h;
    let scale = scale as f32;
    // Over candle's barrier pool, whose threads are awake right after the projections' kernels
    // (see `fused_grad::par_map`).
    let head = |pair: usize| {
        let (b, h) = (pair / d.hq, pair % d.hq);
        let kh = h / group;
        let mut scores = vec![0f32; d.s];
        for i in 0..d.l {
            let q0 = qv.at([b, h, i, 0]);
            let qrow = &qv.data[q0..q0 + d.e];
            let mut max = f32::NEG_INFINITY;
            for (j, score) in scores.iter_mut().enumerate() {
                let mut x = if causal && j > i {
                    f32::NEG_INFINITY
                } else {
                    let k0 = kv.at([b, kh, j, 0]);
                    dot(qrow, &kv.data[k0..k0 + d.e]) * scale
                };
                if let Some((c, offset, stride)) = &mask_view {
                    let at = offset + b * stride[0] + h * stride[1] + i * stride[2] + j * stride[3];
                    match c {
                        candle_core::CpuStorage::U8(m) if m[at] == 0 => x = f32::NEG_INFINITY,
                        candle_core::CpuStorage::F32(m) => x += m[at],
                        _ => {}
                    }
                }
                *score = x;
                max = max.max(x);
            }
            let mut sum = 0f32;
            for score in scores.iter_mut() {
                *score = (*score - max).exp();
                sum += *score;
            }
            let inv = 1.0 / sum;
            // SAFETY: row (b, i, h) of `out` is written by this (b, h) pair only, and `out`
            // outlives the loop.
            let row = unsafe { ptr.slice(((b * d.l + i) * d.hq + h) * d.ev, d.ev) };
            for (j, &p) in scores.iter().enumerate() {
                let weight = p * inv;
                if weight == 0.0 && sum.is_finite() {
                    continue;
                }
                let v0 = vv.at([b, kh, j, 0]);
                for (o, &x) in row.iter_mut().zip(&vv.data[v0..v0 + d.ev]) {
                    *o += weight * x;
                }
            }
        }
    };
    candle_core::utils::barrier_pool().execute_chunked(d.b * d.hq, |range| range.for_each(head));
    drop((qs, ks, vs, mask_guard));
    Ok(Tensor::from_vec(out, (d.b, d.l, d.hq, d.ev), q.device())?.transpose(1, 2)?)
}

/// `a · b` with eight running sums (so it vectorizes).
fn dot(a: &[f32], b: &[f32]) -> f32 {
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
