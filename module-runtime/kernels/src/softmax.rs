//! `softmax` along one dimension, the entry the softmax layers and attention call.

use candle_core::Tensor;

use module_core::autocast_policy::{autocast_cast, AutocastOp};

use crate::cpu::{cpu_half_dtype, widen};
use crate::error::Result;
use crate::fused_grad;

/// `softmax(x)` along `dim`, differentiable unless nothing needs a gradient: candle-nn's fused
/// kernel along the last dimension when `x` records no gradient (it records none, candle #3011);
/// the fused training op (one node, a one-pass backward) along the last dimension of a float32 CPU
/// tensor that records one (fusion on); candle's differentiable ops, shifted by the maximum,
/// everywhere else. A half-precision CPU input that records a gradient is computed in float32
/// and rounded once to its dtype (PyTorch's CPU kernel accumulates in float32 too).
///
/// Under CUDA [`autocast`](module_core::autocast) the input is cast to float32 first (PyTorch's
/// `softmax` is a float32 op there); CPU autocast leaves it in its dtype (in neither CPU list).
///
/// ```
/// use module_runtime::candle_core::{Device, Tensor};
/// let x = Tensor::new(&[[0f32, 0.], [1., 1.]], &Device::Cpu)?;
/// let p = module_kernels::softmax(&x, 1)?;
/// assert_eq!(p.to_vec2::<f32>()?, [[0.5, 0.5], [0.5, 0.5]]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn softmax(x: &Tensor, dim: usize) -> Result<Tensor> {
    let [x] = autocast_cast(AutocastOp::Softmax, [x])?;
    let x = &x;
    if let Some(half) = cpu_half_dtype(&[x]).filter(|_| x.track_op()) {
        return Ok(softmax(&widen(x)?, dim)?.to_dtype(half)?);
    }
    if dim + 1 == x.rank() && !x.track_op() {
        return Ok(candle_nn::ops::softmax_last_dim(&x.contiguous()?)?);
    }
    if dim + 1 == x.rank() && fused_grad::can_fuse_softmax_last_dim(x) {
        return fused_grad::softmax_last_dim(x);
    }
    let shifted = x.broadcast_sub(&x.max_keepdim(dim)?.detach())?;
    let exp = shifted.exp()?;
    Ok(exp.broadcast_div(&exp.sum_keepdim(dim)?)?)
}
