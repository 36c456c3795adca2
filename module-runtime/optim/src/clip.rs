//! Gradient clipping: PyTorch's `torch.nn.utils.clip_grad_norm_` and `clip_grad_value_`.

use std::borrow::Borrow;

use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor};
use module_core::Param;

use crate::error::{Error, Result};

/// Scales the gradients of `params` (a slice or iterator of parameters or references to them) in
/// `grads` so that their total norm is at most `max_norm`,
/// and returns the total norm they had: PyTorch's `clip_grad_norm_`.
///
/// The total norm of order `norm_type` (2 for the Euclidean norm, `f64::INFINITY` for the largest
/// magnitude) is the norm of the per-gradient norms, taken over every gradient as if they were one
/// vector. Every gradient is multiplied by `max_norm / (total + 1e-6)` clamped to at most 1 (so
/// gradients already within the bound are multiplied by 1), with PyTorch's float32 arithmetic for
/// the coefficient. Each gradient's norm is computed in `f64` and rounded to `f32`, so it may differ
/// from PyTorch's float32 reduction in the last bit. Parameters without a gradient in `grads` are
/// skipped; with none, the total is 0.
///
/// With `error_if_nonfinite`, a `nan` or infinite total is [`Error::NonFiniteNorm`] and nothing is
/// changed; without, the gradients are scaled anyway (by `nan` or 0), as in PyTorch.
///
/// ```
/// use module_runtime::optim::{clip_grad_norm, Optimizer, SgdOptions, SGD};
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(4, 2, &Device::Cpu)?;
/// let mut opt = SGD::new(&model, SgdOptions::new(0.1))?;
/// let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
/// let mut grads = (model.call(&x)?.sqr()?.mean_all()? * 100.0)?.backward()?;
/// let total = clip_grad_norm(&mut grads, &opt.params(), 1.0, 2.0, false)?;
/// assert!(total > 1.0);
/// opt.step(&grads)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn clip_grad_norm<P: Borrow<Param>>(
    grads: &mut GradStore,
    params: impl IntoIterator<Item = P>,
    max_norm: f64,
    norm_type: f64,
    error_if_nonfinite: bool,
) -> Result<f64> {
    check_norm_type(norm_type)?;
    let with_grads: Vec<(Tensor, Tensor)> = params
        .into_iter()
        .filter_map(|p| {
            let t = p.borrow().var().ok()?.as_tensor().clone();
            let g = grads.get(&t)?.clone();
            Some((t, g))
        })
        .collect();
    if with_grads.is_empty() {
        return Ok(0.0);
    }
    let norms = with_grads
        .iter()
        .map(|(_, g)| grad_norm(g, norm_type))
        .collect::<Result<Vec<f64>>>()?;
    let total = total_norm(&norms, norm_type);
    if error_if_nonfinite && !total.is_finite() {
        return Err(Error::NonFiniteNorm { total, norm_type });
    }
    let coef = coefficient(total, max_norm);
    for (t, g) in with_grads {
        grads.insert(&t, g.affine(coef, 0.0)?);
    }
    Ok(total)
}

/// [`Error::InvalidHyperparameter`] unless `norm_type` is a norm order (> 0 or infinite).
pub(crate) fn check_norm_type(norm_type: f64) -> Result<()> {
    if norm_type.is_nan() || norm_type <= 0.0 {
        return Err(Error::InvalidHyperparameter {
            name: "norm_type",
            value: norm_type,
            reason: "the norm order must be > 0 (or infinite)",
            group: None,
        });
    }
    Ok(())
}

/// One gradient's norm, rounded to float32 as PyTorch's per-tensor `vector_norm` gives it.
pub(crate) fn grad_norm(g: &Tensor, norm_type: f64) -> Result<f64> {
    Ok(f64::from(norm(g, norm_type)? as f32))
}

/// The total norm of the per-gradient `norms` (in order), rounded to float32.
pub(crate) fn total_norm(norms: &[f64], norm_type: f64) -> f64 {
    f64::from(combine(norms, norm_type) as f32)
}

/// The factor every gradient is multiplied by: `max_norm / (total + 1e-6)`, clamped to 1, in
/// float32. `scalar / tensor` is `tensor.reciprocal() * scalar` in PyTorch
/// (`Tensor.__rtruediv__`), so it is computed so.
pub(crate) fn coefficient(total: f64, max_norm: f64) -> f64 {
    let coef = (1.0f32 / (total as f32 + 1e-6f32)) * max_norm as f32;
    f64::from(if coef > 1.0 { 1.0 } else { coef })
}

/// Clamps every gradient of `params` in `grads` to `[-clip_value, clip_value]`: PyTorch's
/// `clip_grad_value_`. Parameters without a gradient are skipped.
pub fn clip_grad_value<P: Borrow<Param>>(
    grads: &mut GradStore,
    params: impl IntoIterator<Item = P>,
    clip_value: f64,
) -> Result<()> {
    for p in params {
        let t = p.borrow().var()?.as_tensor().clone();
        if let Some(g) = grads.get(&t) {
            let clamped = g.clamp(-clip_value, clip_value)?;
            grads.insert(&t, clamped);
        }
    }
    Ok(())
}

/// The norm of order `p` of the values of `g`, in `f64`.
fn norm(g: &Tensor, p: f64) -> Result<f64> {
    let g = g.to_dtype(DType::F64)?.flatten_all()?.abs()?;
    if g.elem_count() == 0 {
        return Ok(0.0);
    }
    Ok(if p.is_infinite() {
        // `max` skips nothing for nan, but say so explicitly: a nan gradient has a nan norm.
        let sum = g.sum_all()?.to_scalar::<f64>()?;
        if sum.is_nan() {
            f64::NAN
        } else {
            g.max(0)?.to_scalar::<f64>()?
        }
    } else if p == 2.0 {
        g.sqr()?.sum_all()?.to_scalar::<f64>()?.sqrt()
    } else if p == 1.0 {
        g.sum_all()?.to_scalar::<f64>()?
    } else {
        g.powf(p)?.sum_all()?.to_scalar::<f64>()?.powf(1.0 / p)
    })
}

/// The norm of order `p` of the per-gradient norms `norms`.
fn combine(norms: &[f64], p: f64) -> f64 {
    if norms.iter().any(|n| n.is_nan()) {
        f64::NAN
    } else if p.is_infinite() {
        norms.iter().copied().fold(0.0, f64::max)
    } else if p == 2.0 {
        norms.iter().map(|n| n * n).sum::<f64>().sqrt()
    } else if p == 1.0 {
        norms.iter().sum()
    } else {
        norms.iter().map(|n| n.powf(p)).sum::<f64>().powf(1.0 / p)
    }
}
