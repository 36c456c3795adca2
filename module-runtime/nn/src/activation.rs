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

use crate::common::{
    config_layer, forward_by_value, layer_forward, layer_repr, resolve_dim, unit_layer,
};
use crate::error::Result;
use crate::{Forward, Module, ModuleExt};
use module_kernels::softmax;

unit_layer! {
    /// `max(x, 0)`: PyTorch's `nn.ReLU`. Any shape in, the same shape out.
    ///
    /// The gradient at exactly `0` is `1` here (candle's rule) where PyTorch uses `0`; it only matters
    /// for inputs that are exactly zero.
    ///
    /// Typed paths into it: [`ReLUPath`], from [`ReLU::path`] (`#[module(paths)]`).
    pub struct ReLU;
}

layer_forward!(ReLU, |_, x| Ok(x.relu()?));

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
///
/// Typed paths into it: [`GELUPath`], from [`GELU::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug, Default)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
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

    /// The exact GELU of a float32 CPU tensor that needs no gradient runs a vectorized kernel (a
    /// rational approximation of `erf`, within 2e-6 of the exact GELU); everything else goes
    /// through candle's differentiable ops.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(match self.approximate {
            GeluApproximation::None => module_kernels::gelu_erf(x)?,
            GeluApproximation::Tanh => x.gelu()?,
        })
    }
}

unit_layer! {
    /// `x σ(x)`, also called swish: PyTorch's `nn.SiLU`. Any shape in, the same shape out.
    ///
    /// Typed paths into it: [`SiLUPath`], from [`SiLU::path`] (`#[module(paths)]`).
    pub struct SiLU;
}

impl Forward<&Tensor> for SiLU {
    type Output = Tensor;

    /// The SiLU of a float32 CPU tensor that needs no gradient runs a vectorized kernel (its
    /// `exp` within 2 ulps, the SiLU within 3; candle's calls libm's `expf` per element);
    /// everything else goes through candle's differentiable `silu`.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        module_kernels::silu(x)
    }
}

impl SiLU {
    /// `self(gate) * up`: the SwiGLU product of a gated feed-forward block (transformers'
    /// `act_fn(gate_proj(x)) * up_proj(x)` in Llama's MLP), as `silu.call(&gate)? * up`
    /// computes it, with the same bits.
    ///
    /// With no hooks attached (hooks see each module's own output, so then the layer is called
    /// as usual) and fusion not turned off ([`without_fusion`](crate::without_fusion)), it is
    /// [`silu_mul`](module_kernels::silu_mul): where a gradient is recorded, one op that keeps
    /// no `silu(gate)` in the graph (its backward recomputes it), a tensor as large as `gate`
    /// saved per block until the backward.
    ///
    /// ```
    /// use module_runtime::prelude::*;
    /// use module_runtime::nn::SiLU;
    /// let act = SiLU::new();
    /// let gate = Tensor::randn(0f32, 1., (2, 3, 8), &Device::Cpu)?;
    /// let up = Tensor::randn(0f32, 1., (2, 3, 8), &Device::Cpu)?;
    /// let y = act.call_mul(&gate, &up)?;
    /// let unfused = (act.call(&gate)? * &up)?;
    /// assert_eq!(y.flatten_all()?.to_vec1::<f32>()?, unfused.flatten_all()?.to_vec1::<f32>()?);
    /// # Ok::<(), module_runtime::Error>(())
    /// ```
    pub fn call_mul(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        if crate::fused::fusion_applies() {
            return module_kernels::silu_mul(gate, up);
        }
        Ok((self.call(gate)? * up)?)
    }
}

unit_layer! {
    /// `1 / (1 + e⁻ˣ)`: PyTorch's `nn.Sigmoid`. Any shape in, the same shape out.
    ///
    /// Typed paths into it: [`SigmoidPath`], from [`Sigmoid::path`] (`#[module(paths)]`).
    pub struct Sigmoid;
}

layer_forward!(Sigmoid, |_, x| {
    // candle-nn's sigmoid is a custom op with a backward pass.
    Ok(candle_nn::ops::sigmoid(x)?)
});

unit_layer! {
    /// The hyperbolic tangent: PyTorch's `nn.Tanh`. Any shape in, the same shape out.
    ///
    /// Typed paths into it: [`TanhPath`], from [`Tanh::path`] (`#[module(paths)]`).
    pub struct Tanh;
}

layer_forward!(Tanh, |_, x| Ok(x.tanh()?));

/// `log(softmax(x))` along `dim`, computed stably (`x - max - log Σ exp(x - max)`).
/// Under CUDA autocast a float32 op; a half-precision input is computed in float32 and rounded
/// once to its dtype (PyTorch's CPU kernel accumulates in float32).
pub(crate) fn log_softmax(x: &Tensor, dim: usize) -> Result<Tensor> {
    use module_core::autocast_policy::{autocast_cast, AutocastOp};
    let [x] = autocast_cast(AutocastOp::Softmax, [x])?;
    if matches!(
        x.dtype(),
        candle_core::DType::BF16 | candle_core::DType::F16
    ) {
        let widened = x.to_dtype(candle_core::DType::F32)?;
        return Ok(log_softmax(&widened, dim)?.to_dtype(x.dtype())?);
    }
    let x = &x;
    // The max only shifts the values for stability; it cancels out of the result, so it needs
    // no gradient.
    let shifted = x.broadcast_sub(&x.max_keepdim(dim)?.detach())?;
    let log_sum = shifted.exp()?.sum_keepdim(dim)?.log()?;
    Ok(shifted.broadcast_sub(&log_sum)?)
}

config_layer! {
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
    ///
    /// Typed paths into it: [`SoftmaxPath`], from [`Softmax::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct Softmax {
        /// The dimension the probabilities sum to one along (negative counts from the end).
        pub dim: isize,
    }
    /// Softmax along `dim`.
    new
}

layer_forward!(Softmax, |layer, x| softmax(
    x,
    resolve_dim(x, layer.dim, "softmax")?
));

layer_repr!(Softmax: dim);

config_layer! {
    /// `log(softmax(x))` along `dim`, computed stably: PyTorch's `nn.LogSoftmax(dim)`. Any shape in,
    /// the same shape out; negative `dim` counts from the end.
    ///
    /// Typed paths into it: [`LogSoftmaxPath`], from [`LogSoftmax::path`] (`#[module(paths)]`).
    #[module(extra_repr)]
    pub struct LogSoftmax {
        /// The dimension to normalize along (negative counts from the end).
        pub dim: isize,
    }
    /// Log-softmax along `dim`.
    new
}

layer_forward!(LogSoftmax, |layer, x| log_softmax(
    x,
    resolve_dim(x, layer.dim, "log_softmax")?
));

layer_repr!(LogSoftmax: dim);

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
///
/// Typed paths into it: [`ActivationPath`], from [`Activation::path`] (`#[module(paths)]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
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

layer_forward!(Activation, |layer, x| {
    match layer {
        Self::Relu(m) => m.forward(x),
        Self::Gelu(m) => m.forward(x),
        Self::Silu(m) => m.forward(x),
        Self::Sigmoid(m) => m.forward(x),
        Self::Tanh(m) => m.forward(x),
        Self::Softmax(m) => m.forward(x),
        Self::LogSoftmax(m) => m.forward(x),
    }
});

layer_repr!(GELU, |layer| match layer.approximate {
    GeluApproximation::None => "approximate='none'".into(),
    GeluApproximation::Tanh => "approximate='tanh'".into(),
});

forward_by_value!(ReLU, GELU, SiLU, Sigmoid, Tanh, Softmax, LogSoftmax, Activation);

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn gelu_fast_path_and_differentiable_path_agree() -> Result<()> {
        let x = Tensor::arange(-60f32, 60., &Device::Cpu)?.affine(0.1, 0.)?;
        let fast = GELU::new().forward(&x)?;
        let tracked = Var::from_tensor(&x)?;
        let slow = GELU::new().forward(tracked.as_tensor())?;
        let diff = (fast - slow)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff < 2e-6, "{diff}");
        Ok(())
    }

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
}
