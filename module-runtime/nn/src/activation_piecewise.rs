//! Piecewise activations: `LeakyReLU`, `RReLU`, `ELU`, `SELU`, `CELU`, `Hardtanh`, `ReLU6`,
//! `Threshold`, `Hardshrink`, `Softshrink`, `Hardswish` and `Hardsigmoid`, PyTorch's `torch.nn`
//! layers of those names.
//!
//! Each is a selection between branches by a mask of the input (`Tensor::where_cond`), so both
//! values and gradients follow PyTorch's definitions exactly, boundaries included: the gradient of a
//! branch flows only where it is selected, and a branch that is not selected never sees a value
//! that could overflow (the exponential of `ELU` is taken of the negative part only). The masks use
//! PyTorch's comparisons (`x > 0` for the linear part of `LeakyReLU` and `ELU`, `min < x < max` for
//! the slope of `Hardtanh`), so even an input exactly on a boundary gets PyTorch's gradient.
//!
//! PyTorch's `inplace` argument does not apply: candle tensors are immutable. Every layer keeps the
//! input's shape.

use candle_core::Tensor;

use module_core::py_float;

use crate::common::{config_layer, forward_by_value, layer_forward, layer_repr, unit_layer};
use crate::error::Result;
use crate::{Mode, Module};

/// A tensor of `x`'s shape, dtype and device filled with `value`.
pub(crate) fn constant_like(x: &Tensor, value: f64) -> Result<Tensor> {
    Ok(x.zeros_like()?.affine(1.0, value)?)
}

/// `x` where `x > 0`, zero elsewhere, with the gradient of the kept part only (`min(x, 0)`'s
/// complement, without candle's tie-splitting `minimum`).
fn negative_part(x: &Tensor, positive: &Tensor) -> Result<Tensor> {
    Ok(positive.where_cond(&x.zeros_like()?, x)?)
}

/// `x` where `x > 0`, `alpha (exp(x / scale) - 1)` elsewhere: ELU (`scale = 1`) and CELU
/// (`scale = alpha`).
fn exponential_unit(x: &Tensor, alpha: f64, scale: f64) -> Result<Tensor> {
    let positive = x.gt(0f64)?;
    let neg = negative_part(x, &positive)?;
    let curve = (neg.affine(1.0 / scale, 0.0)?.exp()? - 1.0)?.affine(alpha, 0.0)?;
    Ok(positive.where_cond(x, &curve)?)
}

/// `x` clamped to `[min, max]`, with gradient 1 strictly inside and 0 elsewhere (PyTorch's
/// `hardtanh_backward`).
fn hardtanh(x: &Tensor, min: f64, max: f64) -> Result<Tensor> {
    let inner = x.ge(max)?.where_cond(&constant_like(x, max)?, x)?;
    Ok(x.le(min)?.where_cond(&constant_like(x, min)?, &inner)?)
}

config_layer! {
    /// `x` where `x > 0`, `negative_slope · x` elsewhere: PyTorch's `nn.LeakyReLU(negative_slope=0.01)`.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::LeakyReLU;
    /// let y = LeakyReLU::with_slope(0.1).call(&Tensor::new(&[-2f32, 3.], &Device::Cpu)?)?;
    /// assert_eq!(y.to_vec1::<f32>()?, [-0.2, 3.]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    ///
    /// Typed paths into it: [`LeakyReLUPath`], from [`LeakyReLU::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct LeakyReLU {
        /// The slope for negative inputs (PyTorch's default 0.01).
        pub negative_slope: f64 = 0.01,
    }
    /// With `negative_slope`.
    with_slope
}

layer_forward!(LeakyReLU, |layer, x| {
    let scaled = x.affine(layer.negative_slope, 0.0)?;
    Ok(x.gt(0f64)?.where_cond(x, &scaled)?)
});

layer_repr!(LeakyReLU: negative_slope);

config_layer! {
    /// The exponential linear unit: `x` where `x > 0`, `alpha (eˣ - 1)` elsewhere. PyTorch's
    /// `nn.ELU(alpha=1.0)`.
    ///
    /// Typed paths into it: [`ELUPath`], from [`ELU::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct ELU {
        /// The value the negative branch tends to, negated (PyTorch's default 1.0).
        pub alpha: f64 = 1.0,
    }
    /// With `alpha`.
    with_alpha
}

layer_forward!(ELU, |layer, x| exponential_unit(x, layer.alpha, 1.0));

layer_repr!(ELU: alpha);

/// PyTorch's `SELU` constants (Klambauer et al., 2017), as `torch.nn.functional.selu` spells them.
const SELU_ALPHA: f64 = 1.673_263_242_354_377_3;
const SELU_SCALE: f64 = 1.050_700_987_355_480_5;

unit_layer! {
    /// The scaled exponential linear unit, `scale · ELU(x, alpha)` with the fixed constants
    /// `alpha ≈ 1.6733` and `scale ≈ 1.0507`: PyTorch's `nn.SELU`.
    ///
    /// Typed paths into it: [`SELUPath`], from [`SELU::path`] (`#[module(paths)]`).
    pub struct SELU;
}

layer_forward!(SELU, |_, x| {
    Ok(exponential_unit(x, SELU_ALPHA, 1.0)?.affine(SELU_SCALE, 0.0)?)
});

config_layer! {
    /// The continuously differentiable ELU: `x` where `x > 0`, `alpha (e^(x/alpha) - 1)` elsewhere.
    /// PyTorch's `nn.CELU(alpha=1.0)`.
    ///
    /// Typed paths into it: [`CELUPath`], from [`CELU::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct CELU {
        /// The scale of the negative branch (PyTorch's default 1.0).
        pub alpha: f64 = 1.0,
    }
    /// With `alpha`.
    with_alpha
}

layer_forward!(CELU, |layer, x| exponential_unit(
    x,
    layer.alpha,
    layer.alpha
));

layer_repr!(CELU: alpha);

config_layer! {
    /// `x` clamped to `[min_val, max_val]`: PyTorch's `nn.Hardtanh(min_val=-1.0, max_val=1.0)`. The
    /// gradient is 1 strictly inside the range and 0 outside, as in PyTorch.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::Hardtanh;
    /// let y = Hardtanh::with_range(-0.5, 2.0).call(&Tensor::new(&[-3f32, 0.25, 3.], &Device::Cpu)?)?;
    /// assert_eq!(y.to_vec1::<f32>()?, [-0.5, 0.25, 2.]);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    ///
    /// Typed paths into it: [`HardtanhPath`], from [`Hardtanh::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct Hardtanh {
        /// The lower end of the range (PyTorch's default -1.0).
        pub min_val: f64 = -1.0,
        /// The upper end of the range (PyTorch's default 1.0).
        pub max_val: f64 = 1.0,
    }
    /// The range `[min_val, max_val]`.
    with_range
}

layer_forward!(Hardtanh, |layer, x| hardtanh(
    x,
    layer.min_val,
    layer.max_val
));

layer_repr!(Hardtanh: min_val, max_val);

unit_layer! {
    /// `min(max(x, 0), 6)`: PyTorch's `nn.ReLU6` (a `Hardtanh` on `[0, 6]`, with its gradient: 0 at
    /// exactly 0 and 6).
    ///
    /// Typed paths into it: [`ReLU6Path`], from [`ReLU6::path`] (`#[module(paths)]`).
    pub struct ReLU6;
}

layer_forward!(ReLU6, |_, x| hardtanh(x, 0.0, 6.0));

config_layer! {
    /// `x` where `x > threshold`, `value` elsewhere: PyTorch's `nn.Threshold(threshold, value)` (both
    /// required, as in PyTorch).
    ///
    /// Printed as `Threshold(threshold=0.1, value=20.0)`: PyTorch prints `value` as it was
    /// passed (`20` for an int), this layer as the float it stores.
    ///
    /// Typed paths into it: [`ThresholdPath`], from [`Threshold::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct Threshold {
        /// Inputs at or below it are replaced.
        pub threshold: f64,
        /// What replaces them.
        pub value: f64,
    }
    /// Replaces inputs `<= threshold` by `value`.
    new
}

layer_repr!(Threshold: threshold, value);

layer_forward!(Threshold, |layer, x| {
    Ok(x.gt(layer.threshold)?
        .where_cond(x, &constant_like(x, layer.value)?)?)
});

unit_layer! {
    /// `x · relu6(x + 3) / 6`: PyTorch's `nn.Hardswish` (0 below -3, `x` above 3), with PyTorch's
    /// gradient (`x / 3 + 1/2` on `[-3, 3]`).
    ///
    /// Typed paths into it: [`HardswishPath`], from [`Hardswish::path`] (`#[module(paths)]`).
    pub struct Hardswish;
}

layer_forward!(Hardswish, |_, x| {
    let middle = (x * (x + 3.0)?)?.affine(1.0 / 6.0, 0.0)?;
    let upper = x.gt(3f64)?.where_cond(x, &middle)?;
    Ok(x.lt(-3f64)?.where_cond(&x.zeros_like()?, &upper)?)
});

unit_layer! {
    /// `relu6(x + 3) / 6`: PyTorch's `nn.Hardsigmoid` (0 at or below -3, 1 at or above 3, gradient
    /// `1/6` strictly between).
    ///
    /// Typed paths into it: [`HardsigmoidPath`], from [`Hardsigmoid::path`] (`#[module(paths)]`).
    pub struct Hardsigmoid;
}

layer_forward!(Hardsigmoid, |_, x| hardtanh(
    &x.affine(1.0 / 6.0, 0.5)?,
    0.0,
    1.0
));

config_layer! {
    /// `x` where `|x| > lambd`, 0 elsewhere: PyTorch's `nn.Hardshrink(lambd=0.5)`.
    ///
    /// Typed paths into it: [`HardshrinkPath`], from [`Hardshrink::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct Hardshrink {
        /// The half-width of the zeroed band (PyTorch's default 0.5).
        pub lambd: f64 = 0.5,
    }
    /// With `lambd`.
    with_lambda
}

layer_repr!(Hardshrink, |layer| py_float(layer.lambd));

layer_forward!(Hardshrink, |layer, x| {
    Ok(x.abs()?.gt(layer.lambd)?.where_cond(x, &x.zeros_like()?)?)
});

config_layer! {
    /// `x - lambd` above `lambd`, `x + lambd` below `-lambd`, 0 between: PyTorch's
    /// `nn.Softshrink(lambd=0.5)`.
    ///
    /// Typed paths into it: [`SoftshrinkPath`], from [`Softshrink::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct Softshrink {
        /// The half-width of the zeroed band, and the shift outside it (PyTorch's default 0.5).
        pub lambd: f64 = 0.5,
    }
    /// With `lambd`.
    with_lambda
}

layer_repr!(Softshrink, |layer| py_float(layer.lambd));

layer_forward!(Softshrink, |layer, x| {
    let below = x
        .lt(-layer.lambd)?
        .where_cond(&(x + layer.lambd)?, &x.zeros_like()?)?;
    Ok(x.gt(layer.lambd)?.where_cond(&(x - layer.lambd)?, &below)?)
});

/// The randomized leaky ReLU: `x` where `x > 0`, `a · x` elsewhere, with `a` drawn uniformly from
/// `[lower, upper]` for each element in training mode and `(lower + upper) / 2` in evaluation mode.
/// PyTorch's `nn.RReLU(lower=1/8, upper=1/3)`. The slopes drawn are constants of the graph: the
/// gradient of a negative input is its slope, as in PyTorch.
///
/// Typed paths into it: [`RReLUPath`], from [`RReLU::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
pub struct RReLU {
    /// The smallest slope (PyTorch's default 1/8).
    pub lower: f64,
    /// The largest slope (PyTorch's default 1/3).
    pub upper: f64,
    /// Training (random slopes) or evaluation (their mean).
    pub mode: Mode,
}

impl Default for RReLU {
    fn default() -> Self {
        Self::with_range(1.0 / 8.0, 1.0 / 3.0)
    }
}

impl RReLU {
    /// PyTorch's defaults, slopes in `[1/8, 1/3]`, in training mode.
    pub fn new() -> Self {
        Self::default()
    }

    /// Slopes in `[lower, upper]`, in training mode.
    pub fn with_range(lower: f64, upper: f64) -> Self {
        Self {
            lower,
            upper,
            mode: Mode::new(),
        }
    }
}

layer_repr!(RReLU: lower, upper);

layer_forward!(RReLU, |layer, x| {
    let positive = x.gt(0f64)?;
    if !layer.mode.is_training() {
        let slope = (layer.lower + layer.upper) / 2.0;
        return Ok(positive.where_cond(x, &x.affine(slope, 0.0)?)?);
    }
    let slopes = module_core::rand(layer.lower, layer.upper, x.shape(), x.dtype(), x.device())?;
    let noise = positive.where_cond(&x.ones_like()?, &slopes)?;
    Ok((x * noise)?)
});

forward_by_value!(
    Hardshrink,
    Softshrink,
    RReLU,
    LeakyReLU,
    ELU,
    SELU,
    CELU,
    Hardtanh,
    ReLU6,
    Threshold,
    Hardswish,
    Hardsigmoid
);
