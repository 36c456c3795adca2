//! Likelihood losses as modules: `PoissonNLLLoss` and `GaussianNLLLoss`, PyTorch's `torch.nn`
//! classes of those names with their options.

use std::f64::consts::PI;

use crate::common::{default_new, input_shape_error, layer_forward};
use crate::loss_reduction::{check_same_shape, LossReduction};
use crate::Module;

/// The negative log-likelihood of counts `target` under a Poisson distribution of rate `input`
/// (or `exp(input)` with `log_input`): `exp(x) - t x`, or `x - t log(x + eps)`, plus Stirling's
/// approximation of `log(t!)` for `t > 1` when `full`, reduced. PyTorch's
/// `nn.PoissonNLLLoss(log_input=True, full=False, eps=1e-8, reduction='mean')`.
///
/// Typed paths into it: [`PoissonNLLLossPath`], from [`PoissonNLLLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct PoissonNLLLoss {
    /// Whether the input is the log of the rate (PyTorch's default `true`).
    pub log_input: bool,
    /// Whether to add the Stirling term (PyTorch's default `false`).
    pub full: bool,
    /// Added to a rate before its log when `log_input` is `false` (PyTorch's default 1e-8).
    pub eps: f64,
    /// How the per-element losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl Default for PoissonNLLLoss {
    fn default() -> Self {
        Self {
            log_input: true,
            full: false,
            eps: 1e-8,
            reduction: LossReduction::Mean,
        }
    }
}

default_new! {
    /// PyTorch's defaults.
    PoissonNLLLoss
}

layer_forward!(PoissonNLLLoss, |layer, (input, target)| {
    check_same_shape(
        "PoissonNLLLoss",
        target,
        input,
        "the target (the input's shape)",
    )?;
    let mut loss = if layer.log_input {
        (input.exp()? - (target * input)?)?
    } else {
        (input - (target * (input + layer.eps)?.log()?)?)?
    };
    if layer.full {
        // ATen's masked Stirling term; the log reads 1 where it is masked, so no NaN enters.
        let counted = target.gt(1f64)?;
        let safe = counted.where_cond(target, &target.ones_like()?)?;
        let stirling = (((&safe * safe.log()?)? - &safe)?
            + safe.affine(2.0 * PI, 0.0)?.log()?.affine(0.5, 0.0)?)?;
        loss = (loss + counted.where_cond(&stirling, &target.zeros_like()?)?)?;
    }
    layer.reduction.apply(loss)
});

/// The negative log-likelihood of `target` under Gaussians of mean `input` and variance `var`:
/// `(log(var) + (input - target)² / var) / 2`, plus `log(2π) / 2` when `full`, reduced. PyTorch's
/// `nn.GaussianNLLLoss(full=False, eps=1e-6, reduction='mean')`, called with
/// `(input, target, var)`.
///
/// `var` has the input's shape, or that shape with the last dimension 1 or dropped (one variance
/// per sample); another shape is an [`Error::InputShape`](crate::Error::InputShape). As in
/// PyTorch, `var` is clamped below at `eps` for the value only: its gradient passes the clamp
/// unchanged. PyTorch also rejects negative variances, which would need reading `var` back to the
/// host; here they give NaN.
///
/// Typed paths into it: [`GaussianNLLLossPath`], from [`GaussianNLLLoss::path`]
/// (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct GaussianNLLLoss {
    /// Whether to add the constant `log(2π) / 2` (PyTorch's default `false`).
    pub full: bool,
    /// The smallest variance used (PyTorch's default 1e-6).
    pub eps: f64,
    /// How the per-element losses are reduced.
    #[module(skip)]
    pub reduction: LossReduction,
}

impl Default for GaussianNLLLoss {
    fn default() -> Self {
        Self {
            full: false,
            eps: 1e-6,
            reduction: LossReduction::Mean,
        }
    }
}

default_new! {
    /// PyTorch's defaults.
    GaussianNLLLoss
}

layer_forward!(GaussianNLLLoss, |layer, (input, target, var)| {
    const LAYER: &str = "GaussianNLLLoss";
    check_same_shape(LAYER, target, input, "the target (the input's shape)")?;
    let dims = input.dims();
    let lead = &dims[..dims.len().saturating_sub(1)];
    let var = if var.dims() == dims {
        var.clone()
    } else if !dims.is_empty() && var.dims() == lead {
        var.unsqueeze(var.rank())?
    } else if !dims.is_empty() && var.dims() == [lead, &[1]].concat().as_slice() {
        var.clone()
    } else {
        let expected = format!(
            "{dims:?}, {lead:?} or {:?} variances for the input",
            [lead, &[1]].concat()
        );
        return Err(input_shape_error(LAYER, expected, var));
    };
    // Clamped value, unclamped gradient (PyTorch clamps in place under no_grad).
    let var = (&var + (var.clamp(layer.eps, f64::INFINITY)? - &var)?.detach())?;
    let sq = (input - target)?.sqr()?.broadcast_div(&var)?;
    let mut loss = sq.broadcast_add(&var.log()?)?.affine(0.5, 0.0)?;
    if layer.full {
        loss = (loss + 0.5 * (2.0 * PI).ln())?;
    }
    layer.reduction.apply(loss)
});
