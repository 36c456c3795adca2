//! Loss functions (PyTorch's `torch.nn.functional` losses), differentiable with respect to every
//! floating-point argument. Under [`autocast`](module_core::autocast) they compute in float32 and
//! return float32, as PyTorch's lists say.

use candle_core::Tensor;

use module_core::autocast_policy::{autocast_cast, AutocastOp};

use crate::activation::log_softmax;
use crate::common::input_shape_error;
use crate::error::Result;

pub use crate::linear_cross_entropy_fn::linear_cross_entropy;

/// The mean cross-entropy between `logits` `[N, C]` and integer class ids `target` `[N]` (`u8`,
/// `u32` or `i64`): PyTorch's `F.cross_entropy(logits, target)` with its defaults (mean reduction,
/// no class weights, no label smoothing). Returns a 0-dim tensor.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::loss::cross_entropy;
/// let logits = Tensor::new(&[[0f32, 0.], [0., 0.]], &Device::Cpu)?;
/// let target = Tensor::new(&[0i64, 1], &Device::Cpu)?;
/// let loss = cross_entropy(&logits, &target)?.to_scalar::<f32>()?;
/// assert!((loss - 2f32.ln()).abs() < 1e-6);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn cross_entropy(logits: &Tensor, target: &Tensor) -> Result<Tensor> {
    let (n, _) = logits.dims2()?;
    if target.dims() != [n] {
        let expected = format!("[{n}] (the batch of the logits {:?})", logits.dims());
        return Err(input_shape_error("cross_entropy", expected, target));
    }
    let [logits] = autocast_cast(AutocastOp::Loss, [logits])?;
    let log_p = log_softmax(&logits, 1)?;
    let picked = log_p.gather(&target.unsqueeze(1)?, 1)?;
    Ok(picked.mean_all()?.neg()?)
}

/// The mean squared error between `input` and `target` of the same shape: PyTorch's
/// `F.mse_loss(input, target)` (mean reduction). Returns a 0-dim tensor.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::loss::mse_loss;
/// let a = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let b = Tensor::new(&[0f32, 4.], &Device::Cpu)?;
/// assert_eq!(mse_loss(&a, &b)?.to_scalar::<f32>()?, 2.5);
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn mse_loss(input: &Tensor, target: &Tensor) -> Result<Tensor> {
    let [input, target] = autocast_cast(AutocastOp::Loss, [input, target])?;
    Ok(input.sub(&target)?.sqr()?.mean_all()?)
}
