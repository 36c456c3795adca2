//! Activation functions as layers: `ReLU`, `GELU`, `SiLU`, `Sigmoid`, `Tanh`, `Softmax`,
//! `LogSoftmax`, and the [`Activation`] enum that holds any of them.
//!
//! Every layer here is elementwise or works along one dimension, so the output has the input's
//! shape. All are differentiable; the softmaxes take candle's fused kernel only when nothing needs a
//! gradient (see [`Softmax`]).
//!
//! None of these layers is zero-sized, on purpose: hooks may tell modules apart by address, and two
//! zero-sized fields of one struct can share an address. The layers without configuration hold a
//! [`Mode`] (PyTorch's `training` flag, which every `nn.Module` has), which gives them a real byte.

use candle_core::Tensor;

use crate::error::Result;
use crate::{Forward, Mode, Module};

/// Implements `Forward<Tensor>` and `candle_core::Module` on top of `Forward<&Tensor>`.
macro_rules! forward_by_value {
    ($($ty:ty),* $(,)?) => {$(
        impl Forward<Tensor> for $ty {
            type Output = Tensor;

            fn forward(&self, x: Tensor) -> Result<Tensor> {
                self.forward(&x)
            }
        }

        impl candle_core::Module for $ty {
            fn forward(&self, x: &Tensor) -> candle_core::Result<Tensor> {
                Ok(Forward::forward(self, x)?)
            }
        }
    )*};
}
pub(crate) use forward_by_value;

/// Resolves a PyTorch-style dimension (negative counts from the end) against a tensor's rank.
pub(crate) fn resolve_dim(x: &Tensor, dim: isize, op: &'static str) -> Result<usize> {
    let rank = x.rank() as isize;
    let resolved = if dim < 0 { rank + dim } else { dim };
    if (0..rank).contains(&resolved) {
        Ok(resolved as usize)
    } else {
        Err(candle_core::Error::DimOutOfRange {
            shape: x.shape().clone(),
            dim: dim as i32,
            op,
        }
        .into())
    }
}

/// `max(x, 0)`: PyTorch's `nn.ReLU`. Any shape in, the same shape out.
///
/// The gradient at exactly `0` is `1` here (candle's rule) where PyTorch uses `0`; it only matters
/// for inputs that are exactly zero.
#[derive(Module, Clone, Debug, Default)]
pub struct ReLU {
    /// Keeps the layer from being zero-sized (see the module docs); no effect on the output.
    pub mode: Mode,
}

impl ReLU {
    /// The layer.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Forward<&Tensor> for ReLU {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.relu()?)
    }
}

/// How [`GELU`] computes its Gaussian CDF (PyTorch's `approximate` argument).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GeluApproximation {
    /// The exact `x Φ(x) = x (1 + erf(x / √2)) / 2` (PyTorch's `approximate='none'`, the default).
    #[default]
    None,
    /// `x (1 + tanh(√(2/π) (x + 0.044715 x³))) / 2` (PyTorch's `approximate='tanh'`).
    Tanh,
}

/// The Gaussian error linear unit: PyTorch's `nn.GELU`. Any shape in, the same shape out.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::GELU;
/// let x = Tensor::new(&[-1f32, 0., 1.], &Device::Cpu)?;
/// let exact = GELU::new().call(&x)?.to_vec1::<f32>()?;
/// let tanh = GELU::tanh().call(&x)?.to_vec1::<f32>()?;
/// assert!((exact[2] - 0.8413).abs() < 1e-4);
/// assert!((tanh[2] - 0.8412).abs() < 1e-4);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug, Default)]
pub struct GELU {
    /// Which formula to use.
    #[module(skip)]
    pub approximate: GeluApproximation,
}

impl GELU {
    /// The exact (erf) GELU.
    pub fn new() -> Self {
        Self::default()
    }

    /// The tanh approximation.
    pub fn tanh() -> Self {
        Self {
            approximate: GeluApproximation::Tanh,
        }
    }
}

impl Forward<&Tensor> for GELU {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self.approximate {
            GeluApproximation::None => x.gelu_erf()?,
            GeluApproximation::Tanh => x.gelu()?,
        })
    }
}

/// `x σ(x)`, also called swish: PyTorch's `nn.SiLU`. Any shape in, the same shape out.
#[derive(Module, Clone, Debug, Default)]
pub struct SiLU {
    /// Keeps the layer from being zero-sized (see the module docs); no effect on the output.
    pub mode: Mode,
}

impl SiLU {
    /// The layer.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Forward<&Tensor> for SiLU {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.silu()?)
    }
}

/// `1 / (1 + e⁻ˣ)`: PyTorch's `nn.Sigmoid`. Any shape in, the same shape out.
#[derive(Module, Clone, Debug, Default)]
pub struct Sigmoid {
    /// Keeps the layer from being zero-sized (see the module docs); no effect on the output.
    pub mode: Mode,
}

impl Sigmoid {
    /// The layer.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Forward<&Tensor> for Sigmoid {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // candle-nn's sigmoid is a custom op with a backward pass.
        Ok(candle_nn::ops::sigmoid(x)?)
    }
}

/// The hyperbolic tangent: PyTorch's `nn.Tanh`. Any shape in, the same shape out.
#[derive(Module, Clone, Debug, Default)]
pub struct Tanh {
    /// Keeps the layer from being zero-sized (see the module docs); no effect on the output.
    pub mode: Mode,
}

impl Tanh {
    /// The layer.
    pub fn new() -> Self {
        Self::default()
    }
}

impl Forward<&Tensor> for Tanh {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.tanh()?)
    }
}

/// `softmax(x)` along `dim`, differentiable unless nothing needs a gradient.
///
/// The fused kernel (`candle_nn::ops::softmax_last_dim`) records no gradient (candle #3011), so it
/// is used only when the input tracks no gradient (`!x.track_op()`) and `dim` is the last one.
pub(crate) fn softmax(x: &Tensor, dim: usize) -> Result<Tensor> {
    if dim + 1 == x.rank() && !x.track_op() {
        return Ok(candle_nn::ops::softmax_last_dim(&x.contiguous()?)?);
    }
    let shifted = x.broadcast_sub(&x.max_keepdim(dim)?.detach())?;
    let exp = shifted.exp()?;
    Ok(exp.broadcast_div(&exp.sum_keepdim(dim)?)?)
}

/// `log(softmax(x))` along `dim`, computed stably (`x - max - log Σ exp(x - max)`).
pub(crate) fn log_softmax(x: &Tensor, dim: usize) -> Result<Tensor> {
    // The max only shifts the values for stability; it cancels out of the result, so it needs
    // no gradient.
    let shifted = x.broadcast_sub(&x.max_keepdim(dim)?.detach())?;
    let log_sum = shifted.exp()?.sum_keepdim(dim)?.log()?;
    Ok(shifted.broadcast_sub(&log_sum)?)
}

/// `exp(xᵢ) / Σⱼ exp(xⱼ)` along `dim`: PyTorch's `nn.Softmax(dim)`. Any shape in, the same shape
/// out; negative `dim` counts from the end.
///
/// Differentiable. The fused candle kernel, which records no gradient (candle #3011), is used only
/// when the input tracks no gradient and `dim` is the last dimension.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Softmax;
/// let p = Softmax::new(-1).call(&Tensor::new(&[[1f32, 1.], [0., 0.]], &Device::Cpu)?)?;
/// assert_eq!(p.to_vec2::<f32>()?, [[0.5, 0.5], [0.5, 0.5]]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub struct Softmax {
    /// The dimension the probabilities sum to one along (negative counts from the end).
    pub dim: isize,
}

impl Softmax {
    /// Softmax along `dim`.
    pub fn new(dim: isize) -> Self {
        Self { dim }
    }
}

impl Forward<&Tensor> for Softmax {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        softmax(x, resolve_dim(x, self.dim, "softmax")?)
    }
}

/// `log(softmax(x))` along `dim`, computed stably: PyTorch's `nn.LogSoftmax(dim)`. Any shape in,
/// the same shape out; negative `dim` counts from the end.
#[derive(Module, Clone, Debug)]
pub struct LogSoftmax {
    /// The dimension to normalize along (negative counts from the end).
    pub dim: isize,
}

impl LogSoftmax {
    /// Log-softmax along `dim`.
    pub fn new(dim: isize) -> Self {
        Self { dim }
    }
}

impl Forward<&Tensor> for LogSoftmax {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        log_softmax(x, resolve_dim(x, self.dim, "log_softmax")?)
    }
}

/// Any of this module's activations, chosen at run time (from a config file, say).
///
/// Each variant holds its layer, and the enum is transparent: in a model's tree it *is* that layer,
/// at the field's path.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::Activation;
/// let act = Activation::relu();
/// let y = act.call(&Tensor::new(&[-1f32, 2.], &Device::Cpu)?)?;
/// assert_eq!(y.to_vec1::<f32>()?, [0., 2.]);
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Module, Clone, Debug)]
pub enum Activation {
    /// [`ReLU`].
    Relu(ReLU),
    /// [`GELU`], exact or tanh-approximated.
    Gelu(GELU),
    /// [`SiLU`].
    Silu(SiLU),
    /// [`Sigmoid`].
    Sigmoid(Sigmoid),
    /// [`Tanh`].
    Tanh(Tanh),
    /// [`Softmax`].
    Softmax(Softmax),
    /// [`LogSoftmax`].
    LogSoftmax(LogSoftmax),
}

impl Activation {
    /// `ReLU`.
    pub fn relu() -> Self {
        Self::Relu(ReLU::new())
    }

    /// Exact (erf) `GELU`.
    pub fn gelu() -> Self {
        Self::Gelu(GELU::new())
    }

    /// Tanh-approximated `GELU`.
    pub fn gelu_tanh() -> Self {
        Self::Gelu(GELU::tanh())
    }

    /// `SiLU`.
    pub fn silu() -> Self {
        Self::Silu(SiLU::new())
    }

    /// `Sigmoid`.
    pub fn sigmoid() -> Self {
        Self::Sigmoid(Sigmoid::new())
    }

    /// `Tanh`.
    pub fn tanh() -> Self {
        Self::Tanh(Tanh::new())
    }

    /// `Softmax` along `dim`.
    pub fn softmax(dim: isize) -> Self {
        Self::Softmax(Softmax::new(dim))
    }

    /// `LogSoftmax` along `dim`.
    pub fn log_softmax(dim: isize) -> Self {
        Self::LogSoftmax(LogSoftmax::new(dim))
    }
}

impl Forward<&Tensor> for Activation {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Relu(m) => m.forward(x),
            Self::Gelu(m) => m.forward(x),
            Self::Silu(m) => m.forward(x),
            Self::Sigmoid(m) => m.forward(x),
            Self::Tanh(m) => m.forward(x),
            Self::Softmax(m) => m.forward(x),
            Self::LogSoftmax(m) => m.forward(x),
        }
    }
}

forward_by_value!(ReLU, GELU, SiLU, Sigmoid, Tanh, Softmax, LogSoftmax, Activation);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn layers_are_not_zero_sized() {
        assert_ne!(std::mem::size_of::<ReLU>(), 0);
        assert_ne!(std::mem::size_of::<GELU>(), 0);
        assert_ne!(std::mem::size_of::<SiLU>(), 0);
        assert_ne!(std::mem::size_of::<Sigmoid>(), 0);
        assert_ne!(std::mem::size_of::<Tanh>(), 0);
        assert_ne!(std::mem::size_of::<Softmax>(), 0);
        assert_ne!(std::mem::size_of::<LogSoftmax>(), 0);
    }

    #[test]
    fn softmax_fused_and_composed_agree_and_composed_has_a_gradient() -> Result<()> {
        let x = Var::new(&[[1f32, -2., 0.5], [3., 0., -1.]], &Device::Cpu)?;
        let fused = Softmax::new(-1).forward(&x.as_tensor().detach())?;
        let composed = Softmax::new(-1).forward(x.as_tensor())?;
        let diff = (fused - &composed)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 1e-6);
        let grads = composed.sqr()?.sum_all()?.backward()?;
        assert!(grads.get(x.as_tensor()).is_some());
        Ok(())
    }

    #[test]
    fn dims_resolve_like_pytorch() -> Result<()> {
        let x = Tensor::zeros((2, 3), candle_core::DType::F32, &Device::Cpu)?;
        assert_eq!(resolve_dim(&x, -1, "t")?, 1);
        assert_eq!(resolve_dim(&x, 0, "t")?, 0);
        assert!(resolve_dim(&x, 2, "t").is_err());
        assert!(resolve_dim(&x, -3, "t").is_err());
        Ok(())
    }
}
