//! Regression losses as modules: `MSELoss`, `L1Loss`, `SmoothL1Loss`, `HuberLoss` and
//! `KLDivLoss`, PyTorch's `torch.nn` classes of those names with their options.
//!
//! Each is called with `(input, target)` of one shape (another shape is an
//! [`Error::InputShape`](crate::Error::InputShape); PyTorch would broadcast with a warning) and is
//! differentiable with respect to both.

use candle_core::Tensor;

use module_core::autocast_policy::{autocast_cast, AutocastOp};

use crate::common::{config_layer, layer_forward};
use crate::error::Result;
use crate::loss_reduction::{check_same_shape, LossReduction};
use crate::Module;

/// The operands of an elementwise loss, checked to have one shape, in float32 under
/// [`autocast`](module_core::autocast) (every loss here is a float32 op in PyTorch's lists).
fn operands(layer: &'static str, (input, target): (&Tensor, &Tensor)) -> Result<(Tensor, Tensor)> {
    check_same_shape(layer, target, input, "the target (the input's shape)")?;
    let [input, target] = autocast_cast(AutocastOp::Loss, [input, target])?;
    Ok((input, target))
}

/// `(input - target)²`, reduced: PyTorch's `nn.MSELoss(reduction='mean')`.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::{LossReduction, MSELoss};
/// let input = Tensor::new(&[1f32, 2.], &Device::Cpu)?;
/// let target = Tensor::new(&[0f32, 4.], &Device::Cpu)?;
/// assert_eq!(MSELoss::new().call((&input, &target))?.to_scalar::<f32>()?, 2.5);
/// let each = MSELoss::with_reduction(LossReduction::None).call((&input, &target))?;
/// assert_eq!(each.to_vec1::<f32>()?, [1., 4.]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
///
/// Typed paths into it: [`MSELossPath`], from [`MSELoss::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct MSELoss {
    /// How the per-element losses are reduced (PyTorch's default: mean).
    #[module(skip)]
    pub reduction: LossReduction,
}

impl MSELoss {
    /// The mean squared error.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `reduction`.
    pub fn with_reduction(reduction: LossReduction) -> Self {
        Self { reduction }
    }
}

layer_forward!(MSELoss, |layer, pair: (&Tensor, &Tensor)| {
    let (input, target) = operands("MSELoss", pair)?;
    layer.reduction.apply((input - target)?.sqr()?)
});

/// `|input - target|`, reduced: PyTorch's `nn.L1Loss(reduction='mean')`. (At exactly equal values
/// the gradient is candle's `sign(0) = 1`, where PyTorch's is 0.)
///
/// Typed paths into it: [`L1LossPath`], from [`L1Loss::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct L1Loss {
    /// How the per-element losses are reduced (PyTorch's default: mean).
    #[module(skip)]
    pub reduction: LossReduction,
}

impl L1Loss {
    /// The mean absolute error.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `reduction`.
    pub fn with_reduction(reduction: LossReduction) -> Self {
        Self { reduction }
    }
}

layer_forward!(L1Loss, |layer, pair: (&Tensor, &Tensor)| {
    let (input, target) = operands("L1Loss", pair)?;
    layer.reduction.apply((input - target)?.abs()?)
});

/// `scale · d² / 2` where `d = |input - target| < width`, `scale · width · (d - width / 2)`
/// elsewhere, with PyTorch's branch test (`d < width`).
fn quadratic_then_linear(
    input: &Tensor,
    target: &Tensor,
    width: f64,
    smooth: bool,
) -> Result<Tensor> {
    let diff = (input - target)?;
    let abs = diff.abs()?;
    if width == 0.0 {
        return Ok(abs);
    }
    // Smooth L1 divides the quadratic part by beta; Huber multiplies the linear part by delta.
    let (quad_scale, lin_scale) = if smooth {
        (0.5 / width, 1.0)
    } else {
        (0.5, width)
    };
    let quadratic = diff.sqr()?.affine(quad_scale, 0.0)?;
    let linear = abs.affine(lin_scale, -0.5 * width * lin_scale)?;
    Ok(abs.lt(width)?.where_cond(&quadratic, &linear)?)
}

config_layer! {
    /// `0.5 d² / beta` where `d = |input - target| < beta`, `d - beta / 2` elsewhere, reduced:
    /// PyTorch's `nn.SmoothL1Loss(reduction='mean', beta=1.0)`. `beta = 0` is [`L1Loss`].
    ///
    /// Typed paths into it: [`SmoothL1LossPath`], from [`SmoothL1Loss::path`] (`#[module(paths)]`).
    pub struct SmoothL1Loss {
        /// Where the loss turns from quadratic to linear (PyTorch's default 1.0; not negative).
        pub beta: f64 = 1.0,
        /// How the per-element losses are reduced (PyTorch's default: mean).
        #[module(skip)]
        pub reduction: LossReduction = LossReduction::Mean,
    }
    /// With `beta` and `reduction`.
    with_beta
}

layer_forward!(SmoothL1Loss, |layer, pair: (&Tensor, &Tensor)| {
    let (input, target) = operands("SmoothL1Loss", pair)?;
    layer
        .reduction
        .apply(quadratic_then_linear(&input, &target, layer.beta, true)?)
});

config_layer! {
    /// `0.5 d²` where `d = |input - target| < delta`, `delta (d - delta / 2)` elsewhere, reduced:
    /// PyTorch's `nn.HuberLoss(reduction='mean', delta=1.0)` (`delta ·` [`SmoothL1Loss`] with
    /// `beta = delta`).
    ///
    /// Typed paths into it: [`HuberLossPath`], from [`HuberLoss::path`] (`#[module(paths)]`).
    pub struct HuberLoss {
        /// Where the loss turns from quadratic to linear (PyTorch's default 1.0; positive).
        pub delta: f64 = 1.0,
        /// How the per-element losses are reduced (PyTorch's default: mean).
        #[module(skip)]
        pub reduction: LossReduction = LossReduction::Mean,
    }
    /// With `delta` and `reduction`.
    with_delta
}

layer_forward!(HuberLoss, |layer, pair: (&Tensor, &Tensor)| {
    let (input, target) = operands("HuberLoss", pair)?;
    layer
        .reduction
        .apply(quadratic_then_linear(&input, &target, layer.delta, false)?)
});

/// How [`KLDivLoss`] reduces: PyTorch's `reduction`, which for this loss also takes
/// `'batchmean'`, the mathematically correct KL divergence of a batch.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KLDivReduction {
    /// The per-element terms (PyTorch's `'none'`).
    None,
    /// The mean over all elements (PyTorch's `'mean'`, its default).
    #[default]
    Mean,
    /// The sum divided by the batch size, dimension 0 (PyTorch's `'batchmean'`).
    BatchMean,
    /// The sum (PyTorch's `'sum'`).
    Sum,
}

/// The Kullback-Leibler divergence of `target` from the log-probabilities `input`:
/// `target · (log target - input)` per element (0 where `target = 0`), or
/// `exp(target) · (target - input)` when the target is given as log-probabilities too
/// (`log_target`). PyTorch's `nn.KLDivLoss(reduction='mean', log_target=False)`; write
/// `nn.KLDivLoss(reduction='batchmean', log_target=True)` as
///
/// ```
/// use module_runtime::nn::{KLDivLoss, KLDivReduction};
/// let kl = KLDivLoss { reduction: KLDivReduction::BatchMean, log_target: true };
/// # let _ = kl;
/// ```
///
/// Typed paths into it: [`KLDivLossPath`], from [`KLDivLoss::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
pub struct KLDivLoss {
    /// How the terms are reduced (PyTorch's default: mean; `BatchMean` is the true divergence).
    #[module(skip)]
    pub reduction: KLDivReduction,
    /// Whether the target holds log-probabilities (PyTorch's default `false`).
    pub log_target: bool,
}

impl KLDivLoss {
    /// PyTorch's defaults: mean, probabilities as the target.
    pub fn new() -> Self {
        Self::default()
    }

    /// With `reduction`, probabilities as the target.
    pub fn with_reduction(reduction: KLDivReduction) -> Self {
        Self {
            reduction,
            log_target: false,
        }
    }
}

layer_forward!(KLDivLoss, |layer, pair: (&Tensor, &Tensor)| {
    let (input, target) = operands("KLDivLoss", pair)?;
    let (input, target) = (&input, &target);
    let terms = if layer.log_target {
        (target.exp()? * (target - input)?)?
    } else {
        // xlogy: 0 · log 0 is 0, and so is its gradient's share through the log.
        let positive = target.gt(0f64)?;
        let safe = positive.where_cond(target, &target.ones_like()?)?;
        let t_log_t = positive.where_cond(&(target * safe.log()?)?, &target.zeros_like()?)?;
        (t_log_t - (target * input)?)?
    };
    Ok(match layer.reduction {
        KLDivReduction::None => terms,
        KLDivReduction::Mean => terms.mean_all()?,
        KLDivReduction::Sum => terms.sum_all()?,
        KLDivReduction::BatchMean => {
            let batch = input.dims().first().copied().unwrap_or(1);
            (terms.sum_all()? / batch as f64)?
        }
    })
});
