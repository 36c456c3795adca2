//! The averaging functions of `torch.optim.swa_utils`: SWA's running average and the exponential
//! moving average, each as a per-tensor function ([`AvgFn`]) and as a function over a list of
//! tensors ([`MultiAvgFn`]).

use std::fmt;
use std::sync::Arc;

use candle_core::{DType, Tensor};

use crate::error::{Error, Result};

type AvgFnBox = dyn Fn(&Tensor, &Tensor, i64) -> Result<Tensor> + Send + Sync;
type MultiAvgFnBox = dyn Fn(&[Tensor], &[Tensor], i64) -> Result<Vec<Tensor>> + Send + Sync;

/// An averaging function applied to one tensor at a time: PyTorch's `avg_fn` argument of
/// [`AveragedModel`](super::AveragedModel), `avg_fn(averaged_param, current_param, num_averaged)`.
///
/// It takes the averaged value, the model's current value (on the averaged value's device and in
/// its dtype) and the number of models averaged so far, and returns the new averaged value
/// (PyTorch's function returns it too; the caller copies it in).
///
/// ```
/// use module_runtime::optim::swa_utils::AvgFn;
/// // The mean of the last value and the new one.
/// let half = AvgFn::new(|avg, cur, _n| Ok(((avg + cur)? * 0.5)?));
/// # let _ = half;
/// ```
#[derive(Clone)]
pub struct AvgFn(Arc<AvgFnBox>);

impl AvgFn {
    /// An averaging function from a closure `(averaged, current, num_averaged) -> new averaged`.
    pub fn new(
        f: impl Fn(&Tensor, &Tensor, i64) -> Result<Tensor> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(f))
    }

    /// Calls the function.
    pub fn call(&self, averaged: &Tensor, current: &Tensor, num_averaged: i64) -> Result<Tensor> {
        (self.0)(averaged, current, num_averaged)
    }
}

impl fmt::Debug for AvgFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("AvgFn(..)")
    }
}

/// An averaging function applied to a list of tensors at once: PyTorch's `multi_avg_fn` argument
/// of [`AveragedModel`](super::AveragedModel), called once per device and dtype with the averaged
/// tensors, the model's current ones (in the same order) and the number of models averaged so far.
///
/// PyTorch's function updates the averaged tensors in place; candle's tensors are values, so this
/// one returns the new averaged tensors, one per input, in order (the caller copies them in).
#[derive(Clone)]
pub struct MultiAvgFn(Arc<MultiAvgFnBox>);

impl MultiAvgFn {
    /// A function from a closure `(averaged, current, num_averaged) -> new averaged values`.
    pub fn new(
        f: impl Fn(&[Tensor], &[Tensor], i64) -> Result<Vec<Tensor>> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(f))
    }

    /// Calls the function.
    pub fn call(
        &self,
        averaged: &[Tensor],
        current: &[Tensor],
        num_averaged: i64,
    ) -> Result<Vec<Tensor>> {
        (self.0)(averaged, current, num_averaged)
    }
}

impl fmt::Debug for MultiAvgFn {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("MultiAvgFn(..)")
    }
}

/// PyTorch's check of an EMA decay: in `[0, 1]`.
fn check_decay(decay: f64) -> Result<()> {
    if (0.0..=1.0).contains(&decay) {
        Ok(())
    } else {
        Err(Error::InvalidHyperparameter {
            name: "decay",
            value: decay,
            reason: "the EMA decay must be in [0, 1]",
            group: None,
        })
    }
}

/// The exponential moving average over a list of tensors, PyTorch's
/// `torch.optim.swa_utils.get_ema_multi_avg_fn(decay)` (PyTorch's default decay is 0.999):
///
/// ```text
/// W_0^EMA = W_0^model        (the first update copies)
/// W_{t+1}^EMA = decay * W_t^EMA + (1 - decay) * W_{t+1}^model
/// ```
///
/// computed as PyTorch computes it: `lerp(ema, model, 1 - decay)` for floating-point tensors,
/// `ema * decay + model * (1 - decay)` rounded toward zero for integer ones (a `BatchNorm`'s
/// `num_batches_tracked` when buffers are averaged). A decay outside `[0, 1]` is
/// [`Error::InvalidHyperparameter`].
///
/// ```
/// use module_runtime::optim::swa_utils::{get_ema_multi_avg_fn, AveragedModel};
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(3, 2, &Device::Cpu)?;
/// // ema_model = AveragedModel(model, multi_avg_fn=get_ema_multi_avg_fn(0.999))
/// let ema = AveragedModel::new(&model)?.multi_avg_fn(get_ema_multi_avg_fn(0.999)?);
/// ema.update_parameters(&model)?; // the first update copies the weights
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn get_ema_multi_avg_fn(decay: f64) -> Result<MultiAvgFn> {
    check_decay(decay)?;
    Ok(MultiAvgFn::new(move |ema, current, _| {
        ema.iter()
            .zip(current)
            .map(|(e, c)| {
                if e.dtype().is_float() {
                    lerp(e, c, 1.0 - decay)
                } else {
                    blend(e, c, decay)
                }
            })
            .collect()
    }))
}

/// The exponential moving average of one tensor, PyTorch's
/// `torch.optim.swa_utils.get_ema_avg_fn(decay)`: `decay * ema + (1 - decay) * model` (the same
/// average as [`get_ema_multi_avg_fn`], written as PyTorch's per-tensor function writes it). A
/// decay outside `[0, 1]` is [`Error::InvalidHyperparameter`].
pub fn get_ema_avg_fn(decay: f64) -> Result<AvgFn> {
    check_decay(decay)?;
    Ok(AvgFn::new(move |ema, current, _| {
        blend(ema, current, decay)
    }))
}

/// SWA's running average over a list of tensors, PyTorch's
/// `torch.optim.swa_utils.get_swa_multi_avg_fn()`: `lerp(avg, model, 1 / (n + 1))` for
/// floating-point tensors, `avg + (model - avg) / (n + 1)` for integer ones, `n` being the number
/// of models averaged so far. It is what an [`AveragedModel`](super::AveragedModel) without an
/// averaging function uses on a CUDA device (PyTorch's foreach path).
pub fn get_swa_multi_avg_fn() -> MultiAvgFn {
    MultiAvgFn::new(|avg, current, n| {
        avg.iter()
            .zip(current)
            .map(|(a, c)| {
                if a.dtype().is_float() {
                    lerp(a, c, 1.0 / (n as f64 + 1.0))
                } else {
                    swa_step(a, c, n)
                }
            })
            .collect()
    })
}

/// SWA's running average of one tensor, PyTorch's `torch.optim.swa_utils.get_swa_avg_fn()`:
/// `avg + (model - avg) / (n + 1)`, `n` being the number of models averaged so far. It is what an
/// [`AveragedModel`](super::AveragedModel) without an averaging function uses on the CPU.
pub fn get_swa_avg_fn() -> AvgFn {
    AvgFn::new(swa_step)
}

/// Whether a dtype is computed in float32 by PyTorch's CPU kernels ("opmath").
fn is_half(dtype: DType) -> bool {
    matches!(dtype, DType::F16 | DType::BF16)
}

/// A 0-dimensional tensor of `x` in `like`'s dtype and device.
fn scalar(x: f64, like: &Tensor) -> Result<Tensor> {
    Ok(Tensor::new(x, like.device())?.to_dtype(like.dtype())?)
}

/// PyTorch's `torch.lerp(start, end, weight)` with a scalar weight, as its kernel computes it:
/// `start + weight * (end - start)` for a weight below 0.5, `end - (end - start) * (1 - weight)`
/// otherwise; half-precision values are computed in float32 and rounded back.
fn lerp(start: &Tensor, end: &Tensor, weight: f64) -> Result<Tensor> {
    let dtype = start.dtype();
    let (s, e) = if is_half(dtype) {
        (start.to_dtype(DType::F32)?, end.to_dtype(DType::F32)?)
    } else {
        (start.clone(), end.clone())
    };
    let diff = (&e - &s)?;
    let out = if weight.abs() < 0.5 {
        s.broadcast_add(&diff.broadcast_mul(&scalar(weight, &s)?)?)?
    } else {
        e.broadcast_sub(&diff.broadcast_mul(&scalar(1.0 - weight, &s)?)?)?
    };
    Ok(out.to_dtype(dtype)?)
}

/// `a * decay + b * (1 - decay)`: PyTorch's per-tensor EMA, and its multi-tensor EMA on integer
/// tensors (computed in floating point there, then copied back, which rounds toward zero).
fn blend(a: &Tensor, b: &Tensor, decay: f64) -> Result<Tensor> {
    let dtype = a.dtype();
    let (a, b) = in_float(a, b)?;
    let out = a
        .broadcast_mul(&scalar(decay, &a)?)?
        .broadcast_add(&b.broadcast_mul(&scalar(1.0 - decay, &b)?)?)?;
    Ok(out.to_dtype(dtype)?)
}

/// `avg + (model - avg) / (n + 1)`, PyTorch's `get_swa_avg_fn`: integer tensors are divided in
/// floating point and rounded toward zero when copied back, as PyTorch's true division and
/// `copy_` do.
fn swa_step(avg: &Tensor, current: &Tensor, n: i64) -> Result<Tensor> {
    let dtype = avg.dtype();
    let (a, c) = in_float(avg, current)?;
    let step = (&c - &a)?.broadcast_div(&scalar(n as f64 + 1.0, &a)?)?;
    Ok(a.broadcast_add(&step)?.to_dtype(dtype)?)
}

/// Both tensors in a floating-point dtype to compute in: float32 for half precision (PyTorch's
/// opmath), float64 for integers, their own dtype otherwise.
fn in_float(a: &Tensor, b: &Tensor) -> Result<(Tensor, Tensor)> {
    let compute = match a.dtype() {
        d if is_half(d) => DType::F32,
        d if d.is_float() => d,
        _ => DType::F64,
    };
    Ok((a.to_dtype(compute)?, b.to_dtype(compute)?))
}
