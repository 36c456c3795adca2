//! Smooth activations: `Softplus`, `LogSigmoid`, `Mish`, `Softsign` and `Tanhshrink`, PyTorch's
//! `torch.nn` layers of those names.
//!
//! The softplus family is computed without overflow, forward and backward: where `beta · x` is
//! above the threshold the layer returns `x` (PyTorch's rule), and the exponential is taken only of
//! the inputs below it, so no branch that is not selected can produce an infinity whose gradient
//! would turn into NaN. Every layer keeps the input's shape.

use candle_core::Tensor;

use crate::common::{config_layer, forward_by_value, layer_forward, layer_repr, unit_layer};
use crate::error::Result;

/// `log(1 + exp(beta · x)) / beta`, and `x` where `beta · x > threshold` (PyTorch's
/// `F.softplus`).
pub(crate) fn softplus(x: &Tensor, beta: f64, threshold: f64) -> Result<Tensor> {
    let scaled = x.affine(beta, 0.0)?;
    let linear = scaled.gt(threshold)?;
    let below = linear.where_cond(&x.zeros_like()?, &scaled)?;
    let soft = (below.exp()? + 1.0)?.log()?.affine(1.0 / beta, 0.0)?;
    Ok(linear.where_cond(x, &soft)?)
}

config_layer! {
    /// `log(1 + exp(beta · x)) / beta`, a smooth ReLU, and `x` itself where `beta · x > threshold`:
    /// PyTorch's `nn.Softplus(beta=1.0, threshold=20.0)`.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::Softplus;
    /// let y = Softplus::new().call(&Tensor::new(&[0f32, 30.], &Device::Cpu)?)?.to_vec1::<f32>()?;
    /// assert!((y[0] - 2f32.ln()).abs() < 1e-6);
    /// assert_eq!(y[1], 30.); // above the threshold: linear
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    ///
    /// Typed paths into it: [`SoftplusPath`], from [`Softplus::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct Softplus {
        /// The sharpness (PyTorch's default 1.0).
        pub beta: f64 = 1.0,
        /// Above this value of `beta · x` the layer is linear (PyTorch's default 20.0).
        pub threshold: f64 = 20.0,
    }
    /// With `beta` and `threshold`.
    with_beta
}

layer_forward!(Softplus, |layer, x| softplus(
    x,
    layer.beta,
    layer.threshold
));

layer_repr!(Softplus: beta, threshold);

unit_layer! {
    /// `log σ(x) = -softplus(-x)`, computed without overflow: PyTorch's `nn.LogSigmoid`.
    ///
    /// Typed paths into it: [`LogSigmoidPath`], from [`LogSigmoid::path`] (`#[module(paths)]`).
    pub struct LogSigmoid;
}

layer_forward!(LogSigmoid, |_, x| {
    // Beyond 20, log(1 + e^-20) ≈ 2e-9 is below float32's resolution of the result.
    Ok(softplus(&x.neg()?, 1.0, 20.0)?.neg()?)
});

unit_layer! {
    /// `x · tanh(softplus(x))`: PyTorch's `nn.Mish`.
    ///
    /// Typed paths into it: [`MishPath`], from [`Mish::path`] (`#[module(paths)]`).
    pub struct Mish;
}

layer_forward!(Mish, |_, x| {
    // Above 20, tanh(softplus(x)) is 1 in float32 either way; the threshold only keeps the
    // exponential finite.
    Ok((x * softplus(x, 1.0, 20.0)?.tanh()?)?)
});

unit_layer! {
    /// `x / (1 + |x|)`: PyTorch's `nn.Softsign`.
    ///
    /// Typed paths into it: [`SoftsignPath`], from [`Softsign::path`] (`#[module(paths)]`).
    pub struct Softsign;
}

layer_forward!(Softsign, |_, x| Ok((x / (x.abs()? + 1.0)?)?));

unit_layer! {
    /// `x - tanh(x)`: PyTorch's `nn.Tanhshrink`.
    ///
    /// Typed paths into it: [`TanhshrinkPath`], from [`Tanhshrink::path`] (`#[module(paths)]`).
    pub struct Tanhshrink;
}

layer_forward!(Tanhshrink, |_, x| Ok((x - x.tanh()?)?));

forward_by_value!(Softplus, LogSigmoid, Mish, Softsign, Tanhshrink);
