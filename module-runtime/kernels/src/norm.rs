//! Normalization over the last dimension: `LayerNorm`'s and `RmsNorm`'s computation, one entry
//! each, taking candle-nn's fused kernel, the fused training op or the composed ops.
//!
//! Half-precision inputs (`f16`, `bf16`) are normalized in `f32` and converted back, as PyTorch
//! does.

use candle_core::{DType, Tensor, D};

use module_core::autocast_policy::{autocast_cast, autocast_cast_opt, AutocastOp};

use crate::cpu::{cpu_half_dtype, widen};
use crate::error::Result;
use crate::fused_grad;

/// `(x - mean) / sqrt(var + eps) · weight + bias` over the last dimension of `x` (the biased
/// variance), `weight` and `bias` (if any) one value per element of that dimension:
///
/// - nothing records a gradient, one dtype of `f32`/`f16`/`bf16`, weight and bias: candle-nn's
///   fused kernel (which records no gradient, candle issues #2168, #3011);
/// - a gradient recorded, float32 CPU tensors, fusion on, weight and bias: one op whose backward is
///   one pass over rows;
/// - a half-precision CPU input otherwise (a gradient recorded, or float32 parameters, as a
///   bfloat16 activation under CPU [`autocast`](module_core::autocast) meets a float32 model's
///   norm): computed in float32 as above and rounded once to the input's dtype, which the result
///   has (PyTorch's CPU `layer_norm` of a bfloat16 input with float32 parameters returns
///   bfloat16);
/// - anything else: candle's differentiable ops, in `f32` for half-precision inputs.
///
/// Under CUDA autocast the inputs are cast to float32 first (PyTorch's `layer_norm` is a float32
/// op there); under CPU autocast they are left as they are (it is in neither CPU list).
///
/// ```
/// use module_runtime::candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[1f32, 2., 3.]], &Device::Cpu)?;
/// let y = module_kernels::layer_norm(&x, None, None, 1e-5)?;
/// let sum: f32 = y.sum_all()?.to_scalar()?;
/// assert!(sum.abs() < 1e-6);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn layer_norm(
    x: &Tensor,
    weight: Option<&Tensor>,
    bias: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let [x] = autocast_cast(AutocastOp::LayerNorm, [x])?;
    let weight = autocast_cast_opt(AutocastOp::LayerNorm, weight)?;
    let bias = autocast_cast_opt(AutocastOp::LayerNorm, bias)?;
    let (x, weight, bias) = (&x, weight.as_ref(), bias.as_ref());
    let mut all = vec![x];
    all.extend(weight);
    all.extend(bias);
    let same = all.iter().all(|t| t.dtype() == x.dtype());
    if let Some(half) = cpu_half_dtype(&all).filter(|_| !same || x.track_op()) {
        let (w, b) = (weight.map(widen).transpose()?, bias.map(widen).transpose()?);
        let y = layer_norm(&widen(x)?, w.as_ref(), b.as_ref(), eps)?;
        return Ok(y.to_dtype(half)?);
    }
    match (weight, bias) {
        (Some(w), Some(b)) if candle_kernel_applies(&[x, w, b]) => {
            return Ok(candle_nn::ops::layer_norm(
                &x.contiguous()?,
                w,
                b,
                eps as f32,
            )?);
        }
        (Some(w), Some(b)) if fused_grad::can_fuse_layer_norm(x, w, b) => {
            return fused_grad::layer_norm(x, w, b, eps);
        }
        _ => {}
    }
    let dtype = x.dtype();
    let normed = standardize_last_dim(&x.to_dtype(compute_dtype(dtype))?, eps)?.to_dtype(dtype)?;
    let scaled = match weight {
        Some(w) => normed.broadcast_mul(w)?,
        None => normed,
    };
    Ok(match bias {
        Some(b) => scaled.broadcast_add(b)?,
        None => scaled,
    })
}

/// `x / sqrt(mean(x²) + eps) · weight` over the last dimension of `x`: candle-nn's fused kernel
/// where nothing records a gradient (and there is a weight), the runtime's fused training op
/// (one pass each way) where a float32 CPU input or weight records one (fusion on), candle's
/// differentiable ops elsewhere (in `f32` for half-precision inputs). A half-precision CPU input with a float32
/// weight (CPU [`autocast`](module_core::autocast)) is normalized in float32 and returned in its
/// own dtype, as PyTorch's `rms_norm` returns it.
pub fn rms_norm(x: &Tensor, weight: Option<&Tensor>, eps: f64) -> Result<Tensor> {
    if let Some(w) = weight.filter(|w| w.dtype() != x.dtype())
        && let Some(half) = cpu_half_dtype(&[x, w])
    {
        return Ok(rms_norm(&widen(x)?, Some(&widen(w)?), eps)?.to_dtype(half)?);
    }
    if let Some(w) = weight.filter(|w| candle_kernel_applies(&[x, w])) {
        return Ok(candle_nn::ops::rms_norm(&x.contiguous()?, w, eps as f32)?);
    }
    if let Some(w) = weight.filter(|w| fused_grad::can_fuse_rms_norm(x, w)) {
        return fused_grad::rms_norm(x, w, eps);
    }
    let dtype = x.dtype();
    let xc = x.to_dtype(compute_dtype(dtype))?;
    let ms = xc.sqr()?.mean_keepdim(D::Minus1)?;
    let normed = xc.broadcast_div(&(ms + eps)?.sqrt()?)?.to_dtype(dtype)?;
    Ok(match weight {
        Some(w) => normed.broadcast_mul(w)?,
        None => normed,
    })
}

/// Whether candle's fused norm kernel can run on `tensors` (the input and the parameters): nothing
/// needs a gradient (the kernel records none), and all share one dtype the kernel takes (`f32`,
/// `f16`, `bf16`: it rejects `f64`, which then goes through the composed path).
fn candle_kernel_applies(tensors: &[&Tensor]) -> bool {
    let dtype = tensors.first().map(|t| t.dtype());
    matches!(dtype, Some(DType::F32 | DType::F16 | DType::BF16))
        && tensors
            .iter()
            .all(|t| !t.track_op() && Some(t.dtype()) == dtype)
}

/// The dtype a normalization computes in: half-precision inputs are normalized in `f32`, as
/// PyTorch does.
pub fn compute_dtype(dtype: DType) -> DType {
    match dtype {
        DType::F16 | DType::BF16 => DType::F32,
        d => d,
    }
}

/// `(x - mean) / sqrt(var + eps)` along the last dimension, with the biased variance; composed of
/// differentiable ops.
pub fn standardize_last_dim(x: &Tensor, eps: f64) -> Result<Tensor> {
    let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    Ok(centered.broadcast_div(&(var + eps)?.sqrt()?)?)
}
