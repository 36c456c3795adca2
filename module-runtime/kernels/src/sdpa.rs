//! `torch.nn.functional.scaled_dot_product_attention`: attention over given queries, keys and
//! values, with PyTorch's masks, causal masking, scale, dropout and grouped-query heads. On CPU
//! float32 tensors it is one pass per head, reading the heads where they lie (no contiguous copies,
//! no materialized broadcast mask, no separate softmax pass): during inference (`sdpa_kernel`), and
//! when a gradient is recorded as one op whose backward is one pass per head too
//! (`fused_grad::attention`); everywhere else it is composed of candle's differentiable ops, which
//! both passes match within float32 rounding.

use candle_core::{DType, Tensor};

use module_core::autocast_policy::{autocast_cast, autocast_cast_opt, AutocastOp};

use crate::cpu::{cpu_half_dtype, widen};
use crate::error::Result;
use crate::fused_grad;
use crate::sdpa_kernel::{bad, inference, Dims};
use crate::softmax::softmax;

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
    /// The heads side by side (not an argument of PyTorch's function, which takes them split):
    /// `Some(Hq)` takes the projections' outputs as they are, `query` `[B, L, Hq·E]`, `key`
    /// `[B, S, H·E]`, `value` `[B, S, H·Ev]`, and returns `[B, L, Hq·Ev]`. The values are those of
    /// splitting the heads (`reshape((b, l, hq, e))?.transpose(1, 2)?`), the function, and
    /// joining them back; with a gradient recorded on the CPU, the training op reads and writes
    /// the heads in place, so the graph holds none of those views (each a node whose backward
    /// candle sums into a zero-filled buffer).
    pub packed_heads: Option<usize>,
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
/// On CPU float32 tensors with fusion on (see [`without_fusion`](crate::without_fusion)) the
/// result is computed in one pass per head, split over threads, and returned as a view of a
/// `[B, L, Hq, Ev]` buffer: transposing it back to put the heads side by side
/// (`.transpose(1, 2)?.reshape((b, l, hq * ev))?`) copies nothing. When an input records a
/// gradient, that pass is one node of the graph whose backward is one pass per head as well,
/// dropout included (its draws are the runtime's generator's, as the composed path's).
///
/// Under [`autocast`](module_core::autocast) the queries, keys, values and a float mask are cast
/// to the autocast dtype first (a lower-precision op in PyTorch's lists), and the result is in
/// it. Half-precision CPU inputs are computed in float32 from their values (the passes above)
/// and the result rounded once, as PyTorch's CPU kernel accumulates in float32.
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
    let op = AutocastOp::ScaledDotProductAttention;
    let [query, key, value] = autocast_cast(op, [query, key, value])?;
    let attn_mask = autocast_cast_opt(op, attn_mask)?;
    let (query, key, value, attn_mask) = (&query, &key, &value, attn_mask.as_ref());
    if let Some(heads) = options.packed_heads {
        return packed(query, key, value, attn_mask, options, heads);
    }
    if let Some(half) = cpu_half_dtype(&[query, key, value])
        && query.dtype() == key.dtype()
        && query.dtype() == value.dtype()
    {
        if half == DType::BF16 && bf16_op_applies(query, key, value, attn_mask) {
            let (shape, _) = check(query, key, value, attn_mask, &options)?;
            return fused_training([query, key, value], shape, attn_mask, options, false);
        }
        let float_mask = attn_mask.filter(|m| m.dtype() == half);
        let mask = match float_mask {
            Some(m) => Some(widen(m)?),
            None => attn_mask.cloned(),
        };
        let (q, k, v) = (widen(query)?, widen(key)?, widen(value)?);
        let y = attention(&q, &k, &v, mask.as_ref(), options)?;
        return Ok(y.to_dtype(half)?);
    }
    attention(query, key, value, attn_mask, options)
}

/// Whether bfloat16 queries, keys and values that record a gradient take the bfloat16 training op
/// (`fused_grad/attention_bf16.rs`): fusion is on, they are CPU tensors with their last dimension
/// contiguous, and the mask (if any) is a `u8`, float32 or bfloat16 CPU tensor that records no
/// gradient.
fn bf16_op_applies(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> bool {
    let readable = |t: &&Tensor| {
        t.device().is_cpu() && t.dtype() == DType::BF16 && t.stride().last() == Some(&1)
    };
    crate::fusion::is_fusion_enabled()
        && [q, k, v].iter().all(readable)
        && [q, k, v].iter().any(|t| t.track_op())
        && mask.is_none_or(|m| {
            m.device().is_cpu()
                && !m.track_op()
                && matches!(m.dtype(), DType::BF16 | DType::F32 | DType::U8)
        })
}

/// Attention that records a gradient, as the training op over `inputs` (the queries, keys and
/// values, `[B, H, L, E]` views, or, `packed`, `[B, L, H·E]` tensors; `shape` checked): float32, or bfloat16 as the float32 op's values between casts (a bfloat16 mask
/// widened, exactly), the output in the inputs' dtype: the `[B, Hq, L, Ev]` view of a
/// `[B, L, Hq, Ev]` buffer, or, packed, that buffer as `[B, L, Hq·Ev]`.
fn fused_training(
    inputs: [&Tensor; 3],
    shape: Dims,
    attn_mask: Option<&Tensor>,
    options: SdpaOptions,
    packed: bool,
) -> Result<Tensor> {
    let mask = match attn_mask {
        Some(m) => {
            let m = if m.dtype() == DType::BF16 {
                widen(m)?
            } else {
                m.clone()
            };
            Some(m.broadcast_as((shape.b, shape.hq, shape.l, shape.s))?)
        }
        None => None,
    };
    let op = fused_grad::AttentionOptions {
        packed,
        ..training_options(&options, &shape)
    };
    let [query, key, value] = inputs;
    fused_grad::attention(query, key, value, mask.as_ref(), op, &shape)
}

/// [`scaled_dot_product_attention`] with [`SdpaOptions::packed_heads`]: the heads split as
/// views, then the CPU training op over the packed tensors themselves, or the function over the
/// views with the heads joined back.
fn packed(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    attn_mask: Option<&Tensor>,
    options: SdpaOptions,
    hq: usize,
) -> Result<Tensor> {
    let (Ok((b, l, q_width)), Ok((_, _, k_width)), Ok((_, _, v_width))) =
        (query.dims3(), key.dims3(), value.dims3())
    else {
        return Err(bad(format!(
            "with packed_heads, query, key and value must be [B, L, Hq·E], [B, S, H·E], \
             [B, S, H·Ev]; got {:?}, {:?}, {:?}",
            query.dims(),
            key.dims(),
            value.dims()
        )));
    };
    let e = q_width.checked_div(hq).unwrap_or(0);
    let h = k_width.checked_div(e).unwrap_or(0);
    if e == 0 || q_width % hq != 0 || k_width % e != 0 || h == 0 || v_width % h != 0 {
        return Err(bad(format!(
            "packed_heads {hq}: query {:?}, key {:?} and value {:?} do not split into heads of \
             one width (query width = Hq·E, key width = H·E, value width = H·Ev)",
            query.dims(),
            key.dims(),
            value.dims()
        )));
    }
    let options = SdpaOptions {
        packed_heads: None,
        ..options
    };
    let inputs = [query, key, value];
    // The op reads any strides with the last dimension contiguous: a chunk of a stacked
    // projection (`narrow` of `[B, L, 3·E]`) is read in place too.
    let in_place = inputs.iter().any(|t| t.track_op())
        && match query.dtype() {
            DType::F32 => kernels_apply(query, key, value, attn_mask),
            DType::BF16 => bf16_op_applies(query, key, value, attn_mask),
            _ => false,
        };
    if in_place {
        // The heads' views' dimensions, without making the views.
        let heads = |t: &Tensor, n: usize| {
            let (b, len, width) = t.dims3()?;
            Ok::<_, crate::error::Error>(Shaped {
                dims: vec![b, n, len, width / n],
                dtype: t.dtype(),
            })
        };
        let shaped = [heads(query, hq)?, heads(key, h)?, heads(value, h)?];
        let (shape, _) = check_shapes([&shaped[0], &shaped[1], &shaped[2]], attn_mask, &options)?;
        return fused_training(inputs, shape, attn_mask, options, true);
    }
    let split = |t: &Tensor, heads: usize| -> Result<Tensor> {
        let (b, n, width) = t.dims3()?;
        Ok(t.reshape((b, n, heads, width / heads))?.transpose(1, 2)?)
    };
    let (q, k, v) = (split(query, hq)?, split(key, h)?, split(value, h)?);
    let out = scaled_dot_product_attention(&q, &k, &v, attn_mask, options)?;
    Ok(out.transpose(1, 2)?.reshape((b, l, hq * (v_width / h)))?)
}

/// The scale of the scores: `options.scale`, or `1 / √E` (PyTorch's default).
fn scale_of(options: &SdpaOptions, shape: &Dims) -> f64 {
    options.scale.unwrap_or(1.0 / (shape.e as f64).sqrt())
}

/// The fused training op's options for `options`.
fn training_options(options: &SdpaOptions, shape: &Dims) -> fused_grad::AttentionOptions {
    fused_grad::AttentionOptions {
        causal: options.is_causal,
        scale: scale_of(options, shape),
        dropout_p: options.dropout_p,
        packed: false,
    }
}

/// [`scaled_dot_product_attention`] once autocast's casts are made: the checks, then the passes.
fn attention(
    query: &Tensor,
    key: &Tensor,
    value: &Tensor,
    attn_mask: Option<&Tensor>,
    options: SdpaOptions,
) -> Result<Tensor> {
    let (shape, mask) = check(query, key, value, attn_mask, &options)?;
    let scale = scale_of(&options, &shape);
    let mask = mask.as_ref();
    if kernels_apply(query, key, value, mask) {
        if [query, key, value].iter().any(|t| t.track_op()) {
            let op = training_options(&options, &shape);
            return fused_grad::attention(query, key, value, mask, op, &shape);
        }
        if options.dropout_p == 0.0 {
            return inference(query, key, value, mask, options.is_causal, scale, &shape);
        }
    }
    composed(query, key, value, mask, &options, scale, &shape)
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
    let [q, k, v] = [q, k, v].map(|t| Shaped {
        dims: t.dims().to_vec(),
        dtype: t.dtype(),
    });
    check_shapes([&q, &k, &v], mask, options)
}

/// What [`check_shapes`] reads of a query, key or value: its `[B, H, L, E]` dimensions (the
/// heads' views', for packed heads) and its dtype.
struct Shaped {
    dims: Vec<usize>,
    dtype: DType,
}

/// [`check`] on the inputs' dimensions and dtypes.
fn check_shapes(
    [q, k, v]: [&Shaped; 3],
    mask: Option<&Tensor>,
    options: &SdpaOptions,
) -> Result<(Dims, Option<Tensor>)> {
    let four = |t: &Shaped| <[usize; 4]>::try_from(t.dims.as_slice()).ok();
    let (Some([b, hq, l, e]), Some([kb, h, s, ke]), Some([vb, vh, vs, ev])) =
        (four(q), four(k), four(v))
    else {
        return Err(bad(format!(
            "query, key and value must be [B, H, L, E], [B, H, S, E], [B, H, S, Ev]; got {:?}, \
             {:?}, {:?}",
            q.dims, k.dims, v.dims
        )));
    };
    if kb != b || vb != b || ke != e || vh != h || vs != s {
        return Err(bad(format!(
            "query [B, Hq, L, E] = {:?}, key [B, H, S, E] = {:?} and value [B, H, S, Ev] = {:?} \
             do not agree",
            q.dims, k.dims, v.dims
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
    if q.dtype != k.dtype || q.dtype != v.dtype {
        return Err(bad(format!(
            "query, key and value have dtypes {:?}, {:?}, {:?}: they must be one",
            q.dtype, k.dtype, v.dtype
        )));
    }
    if let Some(m) = mask
        && m.dtype() != DType::U8
        && m.dtype() != q.dtype
    {
        return Err(bad(format!(
            "attn_mask must be u8 (which keys to attend to) or {:?} (added to the scores), \
                 got {:?}",
            q.dtype,
            m.dtype()
        )));
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

/// Whether the one-pass float32 CPU kernels may run (the inference pass, or the training op when
/// a gradient is recorded): fusion is on, the queries, keys and values are float32 CPU tensors
/// with their last dimension contiguous, and the mask (if any) is a `u8` or float32 CPU tensor
/// that records no gradient.
fn kernels_apply(q: &Tensor, k: &Tensor, v: &Tensor, mask: Option<&Tensor>) -> bool {
    let readable = |t: &&Tensor| {
        t.device().is_cpu() && t.dtype() == DType::F32 && t.stride().last() == Some(&1)
    };
    crate::fusion::is_fusion_enabled()
        && [q, k, v].iter().all(readable)
        && mask.is_none_or(|m| {
            m.device().is_cpu() && !m.track_op() && matches!(m.dtype(), DType::F32 | DType::U8)
        })
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
    // In the queries' dtype: under autocast, `softmax` computes in float32 (PyTorch's list), and
    // the product with the values stays in their dtype, as PyTorch's composed attention keeps it.
    let mut probs = softmax(&scores, scores.rank() - 1)?.to_dtype(q.dtype())?;
    if options.dropout_p > 0.0 {
        probs = crate::dropout::dropout(&probs, options.dropout_p)?;
    }
    Ok(probs.matmul(&v)?)
}
